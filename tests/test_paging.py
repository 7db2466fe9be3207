"""Paging to storage (plan version 3, PORT): the plan format, the simulator's paging lane,
the storage link, and the ``port`` strategy with its lexicographic objectives."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from app.schemas import TransferOut
from remat import samples
from remat.costs import (
    CostModel,
    CostSource,
    Link,
    analytical_costs,
    cost_table_of,
    profiled_costs,
)
from remat.devices import Device, DeviceKind, Tier, parse_device
from remat.errors import InvalidInputError, StrategyError
from remat.objective import Objective, ObjectiveKind
from remat.plan import (
    PAGE_OPS,
    Compute,
    Free,
    Offload,
    PageIn,
    PageOut,
    Plan,
    PlanDevice,
    Wait,
    plan_from_json,
    plan_to_json,
)
from remat.plan_view import stage_matrices, transfer_spans
from remat.problem import build_problem
from remat.simulator import simulate
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SolverSettings, run_strategy
from remat.strategies.common.problem import StrategyResult, evaluate_plan
from remat.strategies.exact.offload_remat import _solve
from remat.strategies.exact.port import _secondary, lexicographic, paged
from remat.strategies.heuristics.evict import greedy_evict
from remat.strategies.heuristics.offload_dynprog import offload_dynprog
from remat.training import training_graph

from graphs import chain

CPU = Device("cpu0", DeviceKind.CPU)
# chain(3) in training: input 400 (data: no gradient), three weights of 100 and their gradients
FIXED = 1000


def _setup(storage_bytes_per_ms: float = 1000.0, host_bytes_per_ms: float = 1000.0):
    """chain(3) in training on one CPU: every node 1 ms and 1000 bytes; a storage link
    that moves ``storage_bytes_per_ms`` each way (1 ms per tensor by default)."""
    g = training_graph(chain(3))
    n = len(g)
    out = np.array([node.output_bytes for node in g.nodes], dtype=np.int64)
    host = host_bytes_per_ms * 1e3
    rate = storage_bytes_per_ms * 1e3
    costs = CostModel(
        CostSource.PROFILED,
        (CPU,),
        np.ones((n, 1)),
        np.zeros((n, 1, 1)),
        out,
        (Link(host, host, 0.0, 0.0),),
        storage=(Link(rate, rate, 0.0, 0.0),),
    )
    return g, costs


def _plan(steps, budget=None):
    return Plan("hand", (PlanDevice.of(CPU, budget),), tuple(steps))


def _c(node):
    return Compute(node, node, "cpu0")


def _f(node):
    return Free(node, node, "cpu0")


# chain(3): 0 -> 1 -> 2 -> loss 3; backward 4 reads (2, 3), 5 reads (1, 4), 6 reads (0, 5).
PAGED = [
    _c(0),
    PageOut(0, 0, "cpu0"),  # 1 -> 2 ms on the paging lane, while node 1 computes
    _c(1),
    Wait(1, 0, "cpu0"),  # done at 2 ms: no stall, x0 released
    _c(2),
    _c(3),
    _c(4),
    _f(2),
    _f(3),
    _c(5),
    _f(1),
    _f(4),
    PageIn(6, 0, "cpu0"),  # 6 -> 7 ms, reserved at 6
    Wait(6, 0, "cpu0"),  # stalls 1 ms
    _c(6),
    _f(0),
    _f(5),
    _f(6),
]


def test_a_page_out_releases_memory_at_its_wait_and_a_page_in_stalls_for_the_read():
    g, costs = _setup()
    result = simulate(_plan(PAGED), g, costs)
    assert result.valid, result.violation
    assert result.compute_ms == 7.0
    assert result.stall_ms == 1.0  # the page-in of x0 is read just before node 6
    assert result.total_ms == 8.0
    assert result.transfer_ms == 2.0
    # x0 is off the device from its wait (step 3) until its page-in (step 12).
    timeline = result.timeline["cpu0"]
    assert timeline[3] == timeline[2] - 1000
    assert timeline[12] == timeline[11] + 1000


def test_plans_are_judged_with_a_queued_page_ins_memory_counted_from_its_step():
    """A page-in issued while its lane still writes another value starts when the write
    ends, after the compute lane has released that value (its wait): the simulator's own
    rule counts the read from then, the agent's executor from its step (it reserves at
    issue, whatever the timing). Plans are judged as the agent runs them, so their memory
    is the account's: one value more there."""
    g, costs = _setup()
    steps = [
        _c(0),
        PageOut(1, 0, "cpu0"),
        _c(1),
        Wait(1, 0, "cpu0"),
        _c(2),
        PageOut(2, 1, "cpu0"),  # the lane writes x1 during [3, 4]
        PageIn(2, 0, "cpu0"),  # queued: its read starts at 4
        Wait(2, 1, "cpu0"),  # x1 released at 4
        _c(3),
        _c(4),
        _f(2),
        _f(3),
        PageIn(4, 1, "cpu0"),
        Wait(4, 0, "cpu0"),
        Wait(4, 1, "cpu0"),
        _c(5),
        _f(1),
        _f(4),
        _c(6),
        _f(0),
        _f(5),
        _f(6),
    ]
    plan = _plan(steps)
    later = simulate(plan, g, costs)
    at_issue = simulate(plan, g, costs, reserve_at_issue=True)
    assert later.valid and at_issue.valid, (later.violation, at_issue.violation)
    # after the queued page-in (step 6): x1 leaving, x2, and x0's reservation
    assert at_issue.timeline["cpu0"][6] == later.timeline["cpu0"][6] + 1000
    judged = evaluate_plan(Problem(g, costs, {"cpu0": None}), plan).simulation
    assert judged.timeline == at_issue.timeline


def test_compute_beside_a_transfer_is_slowed_by_the_links_compute_slowdown():
    """A link with compute slowdown 2: node 1 computes while x0 is paged out (1 -> 2 ms),
    at half its rate for that millisecond (half of its work), then at its full rate, so it
    ends at 2.5 ms instead of 2; node 6, after the page-in's wait, is not slowed. A link
    without one (1) slows nothing."""
    g, costs = _setup()
    slowed = replace(costs, storage=(replace(costs.storage[0], compute_slowdown=2.0),))
    result = simulate(_plan(PAGED), g, slowed)
    assert result.valid, result.violation
    assert result.compute_ms == 7.0
    assert result.slowdown_ms == pytest.approx(0.5)
    assert result.stall_ms == pytest.approx(1.0)
    assert result.total_ms == pytest.approx(8.5)
    assert simulate(_plan(PAGED), g, costs).slowdown_ms == 0.0


@pytest.mark.parametrize("slowdown", [0.5, -1.0, "nan", 1e9])
def test_a_tables_compute_slowdown_round_trips_and_out_of_range_is_refused(slowdown):
    g, costs = _setup()
    slowed = replace(costs, storage=(replace(costs.storage[0], compute_slowdown=1.5),))
    table = cost_table_of(g, slowed)
    assert table.storage_links["cpu0"].compute_slowdown == 1.5
    assert profiled_costs(g, table).link(0, Tier.STORAGE).compute_slowdown == 1.5
    document = table.model_dump(mode="json")
    document["storage_links"]["cpu0"]["compute_slowdown"] = slowdown
    with pytest.raises(ValueError, match="compute_slowdown"):
        type(table).model_validate(document)


def test_a_slower_storage_makes_compute_wait_and_the_host_link_is_not_used():
    g, costs = _setup(storage_bytes_per_ms=250.0, host_bytes_per_ms=1e9)
    result = simulate(_plan(PAGED), g, costs)
    assert result.valid
    # 4 ms each way on the paging lane: the wait for the page-out stalls 3 ms (1 -> 5),
    # the page-in 4 ms.
    assert result.stall_ms == pytest.approx(3.0 + 4.0)
    assert result.total_ms == pytest.approx(7.0 + 7.0)


def test_offloading_and_paging_run_on_two_lanes_at_once():
    g, costs = _setup()
    steps = [
        _c(0),
        _c(1),
        PageOut(1, 0, "cpu0"),
        Offload(1, 1, "cpu0"),
        Wait(1, 0, "cpu0"),
        Wait(1, 1, "cpu0"),
    ]
    result = simulate(_plan(steps), g, costs)
    assert result.stall_ms == pytest.approx(1.0)  # both 1 ms transfers overlap: not 2
    assert result.transfer_ms == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([_c(0), PageIn(0, 0, "cpu0")], "not on storage (no page_out before it)"),
        ([_c(0), PageOut(0, 0, "cpu0"), PageIn(0, 0, "cpu0")], "still resident"),
        ([_c(0), PageOut(0, 0, "cpu0"), _f(0)], "in flight"),
        ([_c(0), PageOut(0, 0, "cpu0"), Offload(0, 0, "cpu0")], "a transfer of it is in flight"),
        ([_c(0), Offload(0, 0, "cpu0"), Wait(0, 0, "cpu0"), PageIn(0, 0, "cpu0")], "storage"),
        (
            [_c(0), PageOut(0, 0, "cpu0"), Wait(0, 0, "cpu0"), PageIn(0, 0, "cpu0"), _c(1)],
            "before its page_in completes",
        ),
    ],
)
def test_bad_paging_is_named(steps, message):
    g, costs = _setup()
    result = simulate(_plan(steps), g, costs)
    assert not result.valid
    assert message in result.violation.message


def test_version_three_documents_round_trip_and_earlier_versions_refuse_paging():
    plan = _plan(PAGED)
    assert plan.version == 3 and plan.pages
    assert _plan([_c(0), Offload(0, 0, "cpu0"), Wait(0, 0, "cpu0")]).version == 2
    document = json.loads(json.dumps(plan_to_json(plan)))
    assert document["version"] == 3
    assert {"stage": 0, "op": "page_out", "node": 0, "device": "cpu0"} in document["steps"]
    assert plan_from_json(document) == plan
    for version in (1, 2):
        document["version"] = version
        with pytest.raises(InvalidInputError, match=r"'page_out' needs plan version 3"):
            plan_from_json(document)


def test_the_storage_link_comes_from_options_tables_and_defaults():
    g = training_graph(chain(3))
    ssd = parse_device(
        "cpu0:cpu:storage_write_bandwidth=5e8,storage_read_bandwidth=2e9,storage_latency_us=50"
    )
    costs = analytical_costs(g, [ssd, parse_device("cpu1:cpu")])
    link = costs.link(0, Tier.STORAGE)
    assert (link.out_bytes_per_s, link.in_bytes_per_s) == (5e8, 2e9)
    assert (link.out_latency_ms, link.in_latency_ms) == (0.05, 0.05)
    default = costs.link(1, Tier.STORAGE)
    assert (default.out_bytes_per_s, default.in_bytes_per_s) == (1e9, 1.5e9)
    assert costs.out_ms(0, Tier.STORAGE)[0] == pytest.approx(1000 / 5e8 * 1e3 + 0.05)
    table = cost_table_of(g, costs)
    assert table.storage_links["cpu0"].write_bytes_per_s == 5e8
    assert profiled_costs(g, table).link(0, Tier.STORAGE) == link
    document = table.model_dump(mode="json")
    # Measured apart (the profiler's fit), each direction has its own latency; a table
    # written before then has one for both.
    measured = document["storage_links"]["cpu0"] | {"write_latency_us": 300, "read_latency_us": 80}
    apart = type(table).model_validate(document | {"storage_links": {"cpu0": measured}})
    assert apart.storage_links["cpu0"].link().out_ms(0) == pytest.approx(0.3)
    assert apart.storage_links["cpu0"].link().in_ms(2_000_000) == pytest.approx(0.08 + 1.0)
    older = {"write_bytes_per_s": 5e8, "read_bytes_per_s": 2e9, "latency_us": 120}
    shared = type(table).model_validate(document | {"storage_links": {"cpu0": older}})
    assert shared.storage_links["cpu0"].link().in_latency_ms == pytest.approx(0.12)
    document["storage_links"]["cpu0"]["read_bytes_per_s"] = 0
    with pytest.raises(ValueError, match="read_bytes_per_s"):
        type(table).model_validate(document)
    document["storage_links"]["cpu0"] = older | {"read_latency_us": -1}
    with pytest.raises(ValueError, match="read_latency_us"):
        type(table).model_validate(document)


@pytest.mark.parametrize(
    "option", ["storage_write_bandwidth=0", "storage_read_bandwidth=-1", "storage_latency_us=x"]
)
def test_bad_storage_options_are_refused(option):
    with pytest.raises(InvalidInputError, match=option.split("=")[0]):
        parse_device(f"cpu0:cpu:{option}")


def _result(computes: int, pages: int, total_ms: float) -> StrategyResult:
    """A stand-in result of ``computes`` compute steps and ``pages`` page transfers."""
    g, costs = _setup()
    steps = [PageOut(0, 0, "cpu0")] * pages
    simulation = simulate(_plan([_c(0)]), g, costs)
    simulation = replace(simulation, violation=None, total_ms=total_ms, computes=computes)
    return StrategyResult("hand", _plan(steps), simulation)


def test_lexicographic_picks_the_fewest_computations_and_pages_within_the_tolerance():
    fast = _result(computes=10, pages=4, total_ms=100.0)
    lean = _result(computes=8, pages=1, total_ms=100.9)
    slow = _result(computes=7, pages=0, total_ms=101.5)
    assert lexicographic([fast, lean, slow], 0.01) is lean
    assert lexicographic([fast, lean, slow], 0.0) is fast
    assert lexicographic([slow, fast], 0.02) is slow
    assert lexicographic([], 0.01) is None
    assert paged(lean) == 1


def test_port_pages_where_storage_hides_behind_compute_and_beats_remat_alone():
    """chain(3) at FIXED + 3000: remat alone recomputes; paging x0 out during the forward
    pass and back during the backward one costs at most a stall."""
    g, costs = _setup(storage_bytes_per_ms=2000.0)
    budget = FIXED + 3000
    problem = Problem(g, costs, {"cpu0": budget})
    result = run_strategy("port", problem, "cpu0")
    assert result.feasible, result.message
    assert result.plan.strategy == "port" and result.plan.version == 3
    verdict = simulate(result.plan, g, costs)
    assert verdict.valid and verdict.peak_bytes["cpu0"] <= budget
    assert any(s.op in PAGE_OPS for s in result.plan.steps)
    remat = run_strategy("checkmate_milp", problem, "cpu0")
    assert verdict.total_ms < remat.simulation.total_ms
    assert "page transfers" in result.message
    assert result.plan.solver.bound == pytest.approx(costs.ideal_ms("cpu0"))


def test_the_beta_solve_keeps_the_time_and_needs_no_more_computations_or_pages():
    g, costs = _setup(storage_bytes_per_ms=2000.0)
    problem = Problem(g, costs, {"cpu0": FIXED + 3000})
    evicted = greedy_evict(problem, "cpu0", 5.0)
    first, note, joint = _solve(problem, "cpu0", [evicted], 20.0, Tier.STORAGE, "port")
    assert first is not None and joint is not None, note
    second, why = _secondary(problem, "cpu0", joint, 0.01, 20.0)
    assert second is not None, why
    assert second.simulation.total_ms <= joint.objective * 1.01 + 1e-9
    assert second.simulation.computes + paged(second) <= first.simulation.computes + paged(first)


def test_offloading_is_refused_for_an_energy_objective():
    g, costs = _setup()
    problem = Problem(g, costs, {"cpu0": FIXED + 3000}, objective=Objective(ObjectiveKind.ENERGY))
    with pytest.raises(StrategyError, match="offload_greedy offloads"):
        run_strategy("offload_greedy", problem, "cpu0")


def test_the_schedule_view_shows_pages_on_their_lane_and_paged_values_off_the_device():
    plan = _plan(PAGED)
    spans = transfer_spans(plan)["cpu0"]
    assert [(s.kind, s.node, s.issued, s.done) for s in spans] == [
        ("page_out", 0, 1, 3),
        ("page_in", 0, 12, 13),
    ]
    resident = stage_matrices(plan).S["cpu0"]
    assert (2, 0) not in resident  # paged out: off the device when stage 2 starts
    assert (6, 0) not in resident and (1, 0) in resident
    assert TransferOut(node=0, kind="page_in", issued=12, done=13).kind == "page_in"


def test_port_plans_for_energy_under_a_runtime_cap_as_poet_does():
    g, costs = _setup(storage_bytes_per_ms=2000.0)
    budget = {"cpu0": FIXED + 3000}
    by_time = run_strategy("port", Problem(g, costs, budget), "cpu0")
    assert by_time.feasible, by_time.message
    capped = Objective(ObjectiveKind.ENERGY, time_cap_ms=by_time.simulation.total_ms)
    by_energy = run_strategy("port", Problem(g, costs, budget, objective=capped), "cpu0")
    assert by_energy.feasible, by_energy.message
    assert "POET solve" in by_energy.message
    assert by_energy.simulation.energy_mj <= by_time.simulation.energy_mj + 1e-9
    assert by_energy.simulation.total_ms <= by_time.simulation.total_ms
    info = by_energy.plan.solver
    assert info.objective == pytest.approx(by_energy.simulation.energy_mj)
    assert info.bound <= info.objective  # the ideal's energy
    tight = Objective(ObjectiveKind.ENERGY, time_cap_ms=costs.ideal_ms("cpu0") / 2)
    refused = run_strategy("port", Problem(g, costs, budget, objective=tight), "cpu0")
    assert not refused.feasible and "runtime cap" in refused.message


@pytest.mark.parametrize("cap", [0.0, -1.0, 1e12])
def test_a_runtime_cap_out_of_range_is_refused(cap):
    with pytest.raises(InvalidInputError, match="runtime cap"):
        Objective(ObjectiveKind.ENERGY, time_cap_ms=cap)


def test_other_strategies_keep_the_runtime_cap_by_judging():
    g, costs = _setup()
    tight = Objective(time_cap_ms=costs.ideal_ms("cpu0") / 2)
    result = run_strategy("checkpoint_all", Problem(g, costs, {}, objective=tight), "cpu0")
    assert not result.feasible and "no plan within the runtime cap" in result.message


@pytest.mark.alone
def test_auto_mixes_recomputation_and_paging_where_that_beats_either():
    """U-Net at 75% on an edge board's CPU with an SSD: remat alone recomputes, paging
    alone stalls on the SSD; auto's greedy eviction to a looser budget with paging over
    its plan (``recompute_then_offload``) is faster than both, within the budget."""
    ssd = "storage_write_bandwidth=1e9,storage_read_bandwidth=1.5e9,storage_latency_us=100"
    problem = build_problem(
        samples.unet(),
        batch=2,
        devices=[parse_device(f"cpu0:cpu:threads=4,{ssd}")],
        budgets={"cpu0": "75%"},
        solver=SolverSettings(options=SolveOptions(time_limit_s=6)),
    )
    result = run_strategy("auto", problem)
    assert result.feasible, result.message
    assert result.plan.strategy == "auto" and "then paging" in result.message
    assert any(s.op in PAGE_OPS for s in result.plan.steps)
    verdict = simulate(result.plan, problem.graph, problem.costs, problem.budgets)
    assert verdict.valid and verdict.total_ms == pytest.approx(result.simulation.total_ms)
    remat = run_strategy("checkmate_milp", problem, "cpu0")
    paging = offload_dynprog(problem, "cpu0", Tier.STORAGE)
    assert verdict.total_ms < remat.simulation.total_ms
    assert verdict.total_ms < paging.simulation.total_ms
