"""Offloading to host memory (plan version 2): the plan format, the simulator's transfer
lanes and no-wait timing, Proposition 3's bound and the GREEDY strategy."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from remat.comparison import baselines
from remat.costs import (
    CostModel,
    CostSource,
    CostTable,
    Link,
    analytical_costs,
    cost_table_of,
    profiled_costs,
)
from remat.devices import Device, DeviceKind, Tier, parse_device
from remat.errors import InvalidInputError, StrategyError
from remat.plan import (
    Compute,
    Free,
    Offload,
    Plan,
    PlanDevice,
    Prefetch,
    Wait,
    plan_from_json,
    plan_to_json,
)
from remat.plan_view import stage_matrices, transfer_spans
from remat.problem import build_problem
from remat.samples import unet
from remat.simulator import simulate
from remat.solvers.model import SolveOptions
from remat.strategies import AUTO, Problem, SolverSettings, run_strategy
from remat.strategies.baselines.checkpoint_all import checkpoint_all
from remat.strategies.common.beside import Beside, picklable
from remat.strategies.common.offload import offload_base, offload_bound_ms
from remat.strategies.exact.offload_remat import _solve as offload_remat_solve
from remat.strategies.exact.offload_remat import offloading_plans, recompute_then_offload
from remat.training import training_graph

from graphs import chain

GPU = Device("cuda0", DeviceKind.CUDA)
# chain(3) in training: input 400 (data: no gradient), three weights of 100 and their gradients
FIXED = 1000


def _setup(link_bytes_per_ms: float = 1000.0):
    """chain(3) in training on one GPU: every node 1 ms and 1000 bytes, and a host link
    that moves ``link_bytes_per_ms`` each way (1 ms per tensor by default)."""
    g = training_graph(chain(3))
    n = len(g)
    out = np.array([node.output_bytes for node in g.nodes], dtype=np.int64)
    assert out.tolist() == [1000] * 6 + [0]  # the input gradient accumulates into a buffer
    rate = link_bytes_per_ms * 1e3
    costs = CostModel(
        CostSource.PROFILED,
        (GPU,),
        np.ones((n, 1)),
        np.zeros((n, 1, 1)),
        out,
        (Link(rate, rate, 0.0, 0.0),),
    )
    return g, costs


def _plan(steps, budget=None):
    return Plan("hand", (PlanDevice.of(GPU, budget),), tuple(steps))


def _c(node):
    return Compute(node, node, "cuda0")


def _f(node):
    return Free(node, node, "cuda0")


# chain(3) in training: 0 -> 1 -> 2 -> loss 3; backward 4 reads (2, 3), 5 reads (1, 4),
# 6 reads (0, 5). Checkpoint-all peaks at FIXED + 5000 (after node 4).
OVERLAPPED = [
    _c(0),
    Offload(0, 0, "cuda0"),  # 1 -> 2 ms on the lane, while node 1 computes
    _c(1),
    Offload(1, 1, "cuda0"),  # 2 -> 3 ms, while node 2 computes
    Wait(2, 0, "cuda0"),  # done at 2 ms: no stall, x0 released
    _c(2),
    Wait(3, 1, "cuda0"),  # done at 3 ms: no stall, x1 released
    _c(3),
    _c(4),
    _f(2),
    _f(3),
    Prefetch(5, 1, "cuda0"),  # 5 -> 6 ms, reserved at 5
    Wait(5, 1, "cuda0"),  # stalls 1 ms
    _c(5),
    _f(1),
    _f(4),
    Prefetch(6, 0, "cuda0"),  # 7 -> 8 ms
    Wait(6, 0, "cuda0"),  # stalls 1 ms
    _c(6),
    _f(0),
    _f(5),
    _f(6),
]


def test_a_plan_fits_because_its_transfers_overlap_compute():
    g, costs = _setup()
    budget = FIXED + 3000
    result = simulate(_plan(OVERLAPPED, budget), g, costs)
    assert result.valid, result.violation
    assert result.peak_bytes["cuda0"] == budget
    assert result.compute_ms == 7.0
    assert result.transfer_ms == 4.0
    assert result.stall_ms == 2.0  # the two prefetches; both offloads were hidden
    assert result.total_ms == 9.0
    # Checkpoint-all needs 2000 bytes more.
    unlimited = checkpoint_all(Problem(g, costs, {"cuda0": None}), "cuda0")
    assert unlimited.simulation.peak_bytes["cuda0"] == FIXED + 5000


def test_a_slower_link_makes_the_compute_lane_wait_for_the_offloads():
    g, costs = _setup(link_bytes_per_ms=500.0)  # 2 ms per tensor
    result = simulate(_plan(OVERLAPPED, FIXED + 3000), g, costs)
    assert result.valid
    # x0's offload ends at 3 ms (node 2 would start at 2), x1's at 5 (the lane is busy).
    assert result.stall_ms > 2.0
    assert result.total_ms == result.compute_ms + result.stall_ms


def test_memory_is_released_only_by_a_wait_for_the_offload():
    g, costs = _setup()
    # Without the waits, both offloads complete during node 2, but x0 and x1 still count.
    steps = [s for s in OVERLAPPED if not (s.op == "wait" and s.stage in (2, 3))]
    result = simulate(_plan(steps, FIXED + 3000), g, costs)
    assert not result.valid and result.violation.over_budget
    assert result.violation.step == steps.index(_c(3))


def test_a_prefetch_reserves_its_memory_when_its_transfer_starts():
    g, costs = _setup()
    early = list(OVERLAPPED)
    # Prefetch x1 before node 4 computes: reserved while 4's output is allocated.
    early.remove(Prefetch(5, 1, "cuda0"))
    early.insert(early.index(_c(4)), Prefetch(5, 1, "cuda0"))
    result = simulate(_plan(early, FIXED + 3000), g, costs)
    assert not result.valid and result.violation.over_budget
    roomy = simulate(_plan(early, FIXED + 4000), g, costs)
    assert roomy.valid
    assert roomy.stall_ms < 2.0  # the first prefetch is hidden behind node 4


def test_reads_before_a_prefetch_completes_are_refused():
    g, costs = _setup()
    steps = [s for s in OVERLAPPED if s != Wait(5, 1, "cuda0")]
    result = simulate(_plan(steps), g, costs)
    assert not result.valid
    assert "before its prefetch completes" in result.violation.message
    assert result.violation.step == steps.index(_c(5))


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([_c(0), Prefetch(0, 0, "cuda0")], "not on its host"),
        ([_c(0), Offload(0, 0, "cuda0"), Prefetch(0, 0, "cuda0")], "still resident"),
        ([_c(0), Offload(0, 0, "cuda0"), _f(0)], "in flight"),
        ([_c(0), Wait(0, 0, "cuda0")], "no transfer"),
        ([_c(0), Offload(0, 0, "cuda0"), Offload(0, 0, "cuda0")], "a transfer of it is in flight"),
        ([Offload(0, 0, "cuda0")], "not resident"),
    ],
)
def test_bad_transfers_are_named(steps, message):
    g, costs = _setup()
    result = simulate(_plan(steps), g, costs)
    assert not result.valid
    assert message in result.violation.message


def test_version_two_documents_round_trip_and_version_one_refuses_transfers():
    plan = _plan(OVERLAPPED, FIXED + 3000)
    assert plan.version == 2
    assert _plan([_c(0)]).version == 1  # a plan without transfers stays readable by old agents
    document = json.loads(json.dumps(plan_to_json(plan)))
    assert document["version"] == 2
    assert {"stage": 0, "op": "offload", "node": 0, "device": "cuda0"} in document["steps"]
    assert plan_from_json(document) == plan
    document["version"] = 1
    with pytest.raises(InvalidInputError, match=r"steps\[1\].*'offload' needs plan version 2"):
        plan_from_json(document)


def test_the_host_link_comes_from_options_tables_and_defaults():
    g = training_graph(chain(3))
    slow = parse_device("cuda0:cuda:host_bandwidth=1e9,host_latency_us=0")
    costs = analytical_costs(g, [slow, parse_device("cpu0:cpu")])
    assert costs.out_ms(0)[0] == pytest.approx(1000 / 1e9 * 1e3)
    assert costs.link(1).out_bytes_per_s == 10e9  # a CPU's default: a memcpy
    table = json.loads(cost_table_of(g, costs).model_dump_json())
    assert table["host_links"]["cuda0"]["to_host_bytes_per_s"] == 1e9
    again = profiled_costs(g, CostTable.model_validate(table))
    assert again.link(0) == costs.link(0)
    table["host_links"]["cuda0"]["from_host_bytes_per_s"] = 0
    with pytest.raises(ValueError, match="greater than 0"):
        CostTable.model_validate(table)
    with pytest.raises(InvalidInputError, match="host_bandwidth"):
        parse_device("cuda0:cuda:host_bandwidth=0")


def test_proposition_3_bounds_the_offloading_plans():
    g, costs = _setup()
    problem = Problem(g, costs, {"cuda0": FIXED + 3000})
    base = offload_base(problem, "cuda0")
    assert base.peak_bytes == FIXED + 5000
    assert base.candidates == (0, 1, 2, 3)
    # max(7 ms of compute, 2000 bytes each way at 1000 bytes per ms)
    assert offload_bound_ms(problem, base) == pytest.approx(7.0)
    tight = Problem(
        g,
        CostModel(**{**costs.__dict__, "host": (Link(1e5, 1e5, 0.0, 0.0),)}),
        {"cuda0": FIXED + 3000},
    )
    assert offload_bound_ms(tight, offload_base(tight, "cuda0")) == pytest.approx(40.0)


@pytest.mark.parametrize("budget", [FIXED + 5000, FIXED + 4000, FIXED + 3000])
def test_offload_greedy_plans_fit_and_cost_at_least_the_bound(budget):
    g, costs = _setup()
    problem = Problem(g, costs, {"cuda0": budget})
    result = run_strategy("offload_greedy", problem, "cuda0")
    assert result.feasible, result.message
    again = simulate(result.plan, g, costs)
    assert again.valid and again.peak_bytes["cuda0"] <= budget
    assert result.plan.solver.bound == pytest.approx(7.0)
    assert result.plan.solver.objective == pytest.approx(again.total_ms)
    assert again.total_ms >= result.plan.solver.bound
    offloads = sum(1 for s in result.plan.steps if s.op == "offload")
    assert offloads == (FIXED + 5000 - budget) // 1000  # the fewest that fit, first ones
    assert plan_from_json(json.loads(json.dumps(plan_to_json(result.plan)))) == result.plan


def test_offload_greedy_says_what_it_needs_below_its_floor():
    g, costs = _setup()
    problem = Problem(g, costs, {"cuda0": FIXED + 1000})
    result = run_strategy("offload_greedy", problem, "cuda0")
    assert not result.feasible
    assert "offloading every activation still needs" in result.message
    assert result.min_budget_bytes["cuda0"] > FIXED + 1000


def test_the_stage_view_shows_offloaded_values_off_the_device():
    view = stage_matrices(_plan(OVERLAPPED))
    held = {stage for stage, node in view.S["cuda0"] if node == 0}
    # x0 is computed in stage 0 and on the host from its wait in stage 2 until its
    # prefetch in stage 6, which brings it back during that stage.
    assert held == {1, 2}


@pytest.mark.parametrize("budget", [FIXED + 4000, FIXED + 3000])
def test_offload_dynprog_plans_fit_and_are_never_worse_than_greedy(budget):
    g, costs = _setup()
    problem = Problem(g, costs, {"cuda0": budget})
    dynprog = run_strategy("offload_dynprog", problem, "cuda0")
    greedy = run_strategy("offload_greedy", problem, "cuda0")
    assert dynprog.feasible and dynprog.plan.strategy == "offload_dynprog"
    again = simulate(dynprog.plan, g, costs)
    assert again.valid and again.peak_bytes["cuda0"] <= budget
    assert again.total_ms <= greedy.simulation.total_ms
    assert dynprog.plan.solver.bound == pytest.approx(7.0)


def test_offload_dynprog_chooses_sets_that_are_not_greedy_prefixes():
    """On U-Net, where skip connections hold early activations through the whole forward
    pass, the program offloads a set that is not a prefix and whose plan is cheaper."""
    problem = build_problem(
        unet(), batch=8, devices=[parse_device("cuda0:cuda")], budgets={"cuda0": "50%"}
    )
    greedy = run_strategy("offload_greedy", problem, "cuda0")
    dynprog = run_strategy("offload_dynprog", problem, "cuda0")
    assert dynprog.simulation.valid
    assert dynprog.simulation.total_ms < greedy.simulation.total_ms
    base = offload_base(problem, "cuda0")
    sent = [s.node for s in dynprog.plan.steps if s.op == "offload"]
    assert sent != list(base.candidates[: len(sent)])


def test_offload_dynprog_stops_at_its_time_limit_with_greedys_plan():
    problem = build_problem(
        unet(), batch=8, devices=[parse_device("cuda0:cuda")], budgets={"cuda0": "50%"}
    )
    greedy = run_strategy("offload_greedy", problem, "cuda0")
    stopped = run_strategy("offload_dynprog", problem.within(0.0), "cuda0")
    assert stopped.simulation.total_ms == greedy.simulation.total_ms
    assert "DYNPROG stopped at 0 s" in stopped.message


def test_the_offloading_plans_come_from_beside_the_remat_search():
    """offload_remat's offloading heuristics run in a process of their own: their plans
    arrive over the pipe as they are planned in process."""
    g, costs = _setup()
    problem = Problem(g, costs, {"cuda0": FIXED + 3000})
    deadline = time.monotonic() + 20
    arrived, why = Beside(offloading_plans, picklable(problem), "cuda0", deadline).result(deadline)
    here = offloading_plans(problem, "cuda0", time.monotonic() + 20)
    assert arrived is not None, why
    assert [p.simulation.total_ms for p in arrived] == [p.simulation.total_ms for p in here]


def test_a_cancelled_offload_remat_does_not_wait_for_its_offloading_plans():
    g, costs = _setup()
    cancel = threading.Event()
    cancel.set()
    settings = SolverSettings(options=SolveOptions(time_limit_s=120.0), cancel=cancel)
    problem = Problem(g, costs, {"cuda0": FIXED + 3000}, settings)
    started = time.monotonic()
    result = run_strategy("offload_remat", problem, "cuda0")
    assert time.monotonic() - started < 60, "it waited out the limit"
    assert "cancelled" in result.message


def test_transfer_spans_run_from_issue_to_wait():
    spans = transfer_spans(_plan(OVERLAPPED))["cuda0"]
    assert [(s.kind, s.node) for s in spans] == [
        ("offload", 0),
        ("offload", 1),
        ("prefetch", 1),
        ("prefetch", 0),
    ]
    first = spans[0]
    assert (first.issued, first.done) == (1, OVERLAPPED.index(Wait(2, 0, "cuda0")))


def test_the_joint_milps_plans_cost_what_the_model_says():
    """offload_remat's MILP on chain(3) at FIXED + 3000: its optimum offloads (remat alone
    recomputes), and the compiled plan's simulated time is the model's objective."""
    g, costs = _setup()
    problem = Problem(g, costs, {"cuda0": FIXED + 3000})
    evicted = run_strategy("greedy_evict", problem, "cuda0")
    solved, note, _ = offload_remat_solve(
        problem, "cuda0", [evicted], 30.0, Tier.HOST, "offload_remat"
    )
    assert solved is not None, note
    assert "optimal" in note
    ops = [s.op for s in solved.plan.steps]
    assert "offload" in ops and "prefetch" in ops
    assert solved.simulation.valid
    assert solved.simulation.total_ms < evicted.simulation.total_ms
    assert solved.simulation.peak_bytes["cuda0"] <= FIXED + 3000
    again = simulate(solved.plan, g, costs)
    assert again.total_ms == pytest.approx(solved.simulation.total_ms)


@pytest.mark.parametrize("budget", [FIXED + 4000, FIXED + 3000])
def test_offload_remat_is_never_worse_than_offloading_or_remat_alone(budget):
    g, costs = _setup()
    problem = Problem(g, costs, {"cuda0": budget})
    result = run_strategy("offload_remat", problem, "cuda0")
    assert result.feasible, result.message
    assert result.plan.strategy == "offload_remat"
    verdict = simulate(result.plan, g, costs)
    assert verdict.valid and verdict.peak_bytes["cuda0"] <= budget
    for alone in ("offload_dynprog", "greedy_evict", "checkmate_milp"):
        other = run_strategy(alone, problem, "cuda0")
        if other.feasible:
            assert verdict.total_ms <= other.simulation.total_ms * (1 + 1e-9), alone
    assert result.plan.solver.bound == pytest.approx(costs.ideal_ms("cuda0"))


@pytest.mark.alone  # the ladder of relaxed budgets climbs as far as its 15 s allow
def test_recomputing_to_a_looser_budget_then_offloading_beats_either_alone():
    """U-Net at 50%: offloading alone cannot hide its transfers and recomputing alone pays
    for every activation it drops; greedy eviction to a looser budget, then offloading over
    its plan, recomputes some activations and offloads others, and costs less than both."""
    problem = build_problem(
        unet(), batch=8, devices=[parse_device("cuda0:cuda")], budgets={"cuda0": "50%"}
    )
    mixed = recompute_then_offload(problem, "cuda0", 15.0)
    assert mixed, "no relaxed budget gave a plan"
    best = mixed[0]
    verdict = simulate(best.plan, problem.graph, problem.costs)
    assert verdict.valid and verdict.peak_bytes["cuda0"] <= problem.budgets["cuda0"]
    computes = [s.node for s in best.plan.steps if s.op == "compute"]
    assert len(computes) > len(set(computes)), "it recomputes"
    assert any(s.op == "offload" for s in best.plan.steps), "it offloads"
    for alone in ("offload_dynprog", "greedy_evict"):
        other = run_strategy(alone, problem, "cuda0")
        assert not other.feasible or verdict.total_ms < other.simulation.total_ms, alone


def test_without_a_device_named_offloading_runs_where_memory_is_apart_from_the_host():
    g = training_graph(chain(3))
    cpu = Device("cpu0", DeviceKind.CPU)
    both = analytical_costs(g, [cpu, GPU])
    result = run_strategy("offload_greedy", Problem(g, both, {"cpu0": None, "cuda0": None}))
    assert [d.name for d in result.plan.devices] == ["cuda0"]
    host_only = analytical_costs(g, [cpu])
    emulated = run_strategy("offload_greedy", Problem(g, host_only, {"cpu0": None}))
    assert emulated.feasible  # asked for by name, a cpu device emulates one


def test_a_jobs_baselines_include_offloading_where_a_device_can_offload():
    problem = build_problem(
        unet(), batch=8, devices=[parse_device("cuda0:cuda")], budgets={"cuda0": "75%"}
    )
    rows = {b.strategy: b for b in baselines(problem).items}
    assert {"checkpoint_all", "offload_greedy", "offload_dynprog"} <= set(rows)
    assert rows["offload_greedy"].valid and rows["offload_dynprog"].valid
    on_cpu = build_problem(unet(), batch=8, budgets={"cpu0": "75%"})
    row = next(b for b in baselines(on_cpu).items if b.strategy == "offload_greedy")
    assert row.predicted_ms is None and "apart from its host" in row.note


def test_a_device_of_a_pool_does_not_offload_to_the_host_memory_it_is():
    """On a board whose GPU shares the CPU's memory (a pool), offloading to the host moves
    nothing out of the pool: the strategies refuse it, and so does the simulator."""
    devices = [parse_device("cpu0:cpu:pool=ram"), parse_device("cuda0:cuda:pool=ram")]
    problem = build_problem(unet(), batch=2, devices=devices, budgets={"ram": "75%"})
    for strategy in ("offload_greedy", "offload_dynprog", "offload_remat"):
        with pytest.raises(StrategyError, match="pool 'ram', the host's"):
            run_strategy(strategy, problem, "cuda0")
    apart = build_problem(
        unet(), batch=2, devices=[parse_device("cuda0:cuda")], budgets={"cuda0": "75%"}
    )
    plan = run_strategy("offload_dynprog", apart, "cuda0").plan
    assert plan is not None and any(s.op == "offload" for s in plan.steps)
    assert simulate(plan, apart.graph, apart.costs).valid
    pooled = replace(plan, devices=tuple(replace(d, options={"pool": "ram"}) for d in plan.devices))
    verdict = simulate(pooled, apart.graph, apart.costs)
    assert not verdict.valid and "offloading there frees none of it" in verdict.violation.message


def test_auto_offloads_on_an_accelerator_and_never_on_a_cpu():
    """U-Net at 75%: offloading hides behind compute and costs the ideal, which no
    recomputation can; auto takes it on a GPU. On a CPU (the host) it never offloads: it
    pages to storage there, which hides behind compute too; on a GPU sharing the CPU's
    memory (a pool) offloading to the host would free nothing, and it does not."""
    settings = SolverSettings(options=SolveOptions(time_limit_s=2.0))
    problem = build_problem(
        unet(),
        batch=8,
        devices=[parse_device("cuda0:cuda")],
        budgets={"cuda0": "75%"},
        solver=settings,
    )
    result = run_strategy(AUTO, problem)
    offloading = run_strategy("offload_dynprog", problem, "cuda0")
    assert result.feasible and result.simulation.valid
    assert result.simulation.total_ms <= offloading.simulation.total_ms
    assert result.plan.transfers
    on_cpu = build_problem(unet(), batch=8, budgets={"cpu0": "75%"}, solver=settings)
    paged = run_strategy(AUTO, on_cpu).plan
    assert paged.strategy == "page_dynprog" and paged.pages
    assert not any(s.op in ("offload", "prefetch") for s in paged.steps)
    pooled = build_problem(
        unet(),
        batch=8,
        devices=[parse_device("cpu0:cpu:pool=ram"), parse_device("cuda0:cuda:pool=ram")],
        budgets={"ram": "75%"},
        solver=settings,
    )
    on_pool = run_strategy(AUTO, pooled)
    assert on_pool.feasible and on_pool.simulation.valid
    assert not any(s.op in ("offload", "prefetch") for s in on_pool.plan.steps)
    row = next(b for b in baselines(pooled).items if b.strategy == "offload_greedy")
    assert row.predicted_ms is None and "a pooled device's" in row.note
