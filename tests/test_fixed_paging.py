"""Paging fixed tensors (plan version 5): the simulator's rules for parameters read in from
storage and gradient buffers written out, the plan document, and ``port`` below the fixed
memory's floor, where no plan keeps every fixed tensor resident."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_paging import FIXED, _c, _f, _plan, _setup

from app.schemas import TransferOut
from remat import samples
from remat.budgets import reference
from remat.costs import analytical_costs
from remat.devices import parse_device
from remat.errors import InvalidInputError
from remat.graph import Mode
from remat.onnx_ingest import forward_graph
from remat.plan import (
    Compute,
    FixedFree,
    FixedIn,
    FixedWait,
    GradOut,
    GradWait,
    plan_from_json,
    plan_to_json,
)
from remat.plan_view import transfer_spans
from remat.simulator import simulate
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SolverSettings, run_strategy
from remat.strategies.common.floor import shortfall
from remat.strategies.heuristics.fixed_paging import Hold, paging_floor, with_fixed_paging
from remat.training import for_mode

# chain(3): 0 -> 1 -> 2 -> loss 3; backward 4 reads (2, 3) and w2, 5 reads (1, 4) and w1,
# 6 reads (0, 5), x and w0. w2 is paged: read in before node 2 and again before node 4,
# its gradient written by node 4 and written out after it.
PAGED = [
    _c(0),
    FixedIn(0, "w2", "cpu0"),  # 1 -> 1.1 ms, while node 1 computes
    _c(1),
    FixedWait(1, "w2", "cpu0"),  # no stall
    _c(2),
    FixedFree(2, "w2", "cpu0"),
    _c(3),
    FixedIn(3, "w2", "cpu0"),  # 4 -> 4.1 ms
    FixedWait(3, "w2", "cpu0"),  # stalls 0.1 ms
    _c(4),  # allocates w2's gradient buffer
    FixedFree(4, "w2", "cpu0"),
    GradOut(4, "w2", "cpu0"),
    _f(2),
    _f(3),
    _c(5),
    GradWait(5, "w2", "cpu0"),  # written long before: no stall, the buffer released
    _f(1),
    _f(4),
    _c(6),
    _f(0),
    _f(5),
    _f(6),
]


def test_a_paged_weight_is_counted_only_while_read_in_and_its_gradient_until_written_out():
    g, costs = _setup()
    result = simulate(_plan(PAGED), g, costs)
    assert result.valid, result.violation
    assert result.fixed_bytes == {"cpu0": FIXED - 200}  # w2 and its gradient left out
    assert result.stall_ms == pytest.approx(0.1)
    assert result.total_ms == pytest.approx(7.1)
    timeline = result.timeline["cpu0"]
    assert timeline[1] == FIXED - 200 + 1000 + 100  # node 0's value and w2, reserved
    assert timeline[5] == timeline[4] - 100  # fixed_free
    assert timeline[9] == timeline[8] + 1000 + 100  # node 4's value and the gradient
    assert timeline[15] == timeline[14] - 100  # grad_wait releases the buffer


def test_a_read_queued_behind_another_counts_from_its_start_or_from_its_step():
    g, costs = _setup()
    steps = [_c(0), FixedIn(0, "w1", "cpu0"), FixedIn(0, "w2", "cpu0")]
    by_start = simulate(_plan(steps), g, costs)
    by_step = simulate(_plan(steps), g, costs, reserve_at_issue=True)
    assert by_start.clock_ms == [0.0, 1.0, 1.0]
    assert by_start.transfer_start_ms == pytest.approx({1: 1.0, 2: 1.1})  # w2 waits for w1
    base = 400 + 100 + 1000  # node 0's fixed tensors x and w0, and its value
    assert by_start.timeline["cpu0"] == [base, base + 100, base + 100]  # w2 not yet started
    assert by_step.timeline["cpu0"] == [base, base + 100, base + 200]
    assert by_start.peak_bytes["cpu0"] == by_step.peak_bytes["cpu0"] == base + 200


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([_c(0), _c(1), FixedFree(1, "w2", "cpu0")], "not resident there"),
        ([_c(0), _c(1), FixedIn(1, "w2", "cpu0"), _c(2)], "no fixed_wait"),
        ([_c(0), FixedIn(0, "w2", "cpu0"), FixedIn(0, "w2", "cpu0")], "already resident"),
        ([FixedWait(0, "w2", "cpu0")], "no fixed_in of it is in flight"),
        ([FixedIn(0, "w9", "cpu0")], "not a fixed tensor of the graph"),
        ([FixedIn(0, "w2", "cpu0"), FixedFree(0, "w2", "cpu0")], "its fixed_in is in flight"),
        ([FixedIn(0, "w2", "cpu0"), GradOut(0, "w2", "cpu0")], "no gradient buffer"),
        ([GradWait(0, "w2", "cpu0")], "no grad_out of it is in flight"),
    ],
)
def test_bad_fixed_paging_is_named(steps, message):
    g, costs = _setup()
    result = simulate(_plan(steps), g, costs)
    assert not result.valid
    assert message in result.violation.message


def test_a_paged_weight_not_read_in_is_refused_at_the_node_that_reads_it():
    g, costs = _setup()
    steps = [s for s in PAGED if not (isinstance(s, FixedIn | FixedWait) and s.stage == 3)]
    result = simulate(_plan(steps), g, costs)
    assert not result.valid
    assert "fixed tensor 'w2' is not readable there" in result.violation.message


def test_version_five_documents_round_trip_and_earlier_versions_refuse_fixed_paging():
    plan = _plan(PAGED)
    assert plan.version == 5 and plan.pages and plan.paged_fixed == {"w2"}
    document = json.loads(json.dumps(plan_to_json(plan)))
    assert document["version"] == 5
    assert {"stage": 4, "op": "grad_out", "tensor": "w2", "device": "cpu0"} in document["steps"]
    assert plan_from_json(document) == plan
    document["version"] = 4
    with pytest.raises(InvalidInputError, match=r"'fixed_in' needs plan version 5"):
        plan_from_json(document)
    document["version"] = 5
    document["steps"][1]["tensor"] = 3
    with pytest.raises(InvalidInputError, match=r"steps\[1\]: 'tensor' must be str"):
        plan_from_json(document)


def test_the_schedule_view_shows_a_paged_weights_reads_and_its_gradients_write():
    spans = transfer_spans(_plan(PAGED))["cpu0"]
    assert [(s.kind, s.tensor, s.node, s.issued, s.done) for s in spans] == [
        ("fixed_in", "w2", None, 1, 3),
        ("fixed_in", "w2", None, 7, 8),
        ("grad_out", "w2", None, 11, 15),
    ]
    out = TransferOut.model_validate(spans[2], from_attributes=True)
    assert out.kind == "grad_out" and out.tensor == "w2" and out.node is None


# --- port below the fixed memory's floor --------------------------------------------------


def _small_resnet():
    """A small ResNet-18 in training on an edge board's CPU with an SSD, and checkpoint-all's
    reference: its fixed memory is most of its peak, as a real ResNet-18's."""
    model = samples.resnet18(batch=2, image=32, width=8)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    device = parse_device(
        "cpu0:cpu:threads=4,storage_read_bandwidth=1.5e9,storage_write_bandwidth=1e9"
    )
    costs = analytical_costs(graph, [device])
    return model, graph, costs, reference(graph, costs, "cpu0")


def _solver(seconds: float) -> SolverSettings:
    return SolverSettings(options=SolveOptions(time_limit_s=seconds))


def test_port_pages_fixed_tensors_where_keeping_them_resident_cannot_fit():
    _, graph, costs, ref = _small_resnet()
    budget = round(0.8 * ref.fixed_bytes)  # below the parameters, inputs and gradients
    remat_alone = run_strategy(
        "checkmate_milp", Problem(graph, costs, {"cpu0": budget}, _solver(5))
    )
    assert not remat_alone.feasible
    result = run_strategy("port", Problem(graph, costs, {"cpu0": budget}, _solver(10)), "cpu0")
    assert result.plan is not None, result.message
    assert result.plan.version == 5 and result.plan.paged_fixed
    assert "fixed tensors paged" in result.message
    simulation = simulate(result.plan, graph, costs)
    assert simulation.valid, simulation.violation
    assert simulation.peak_bytes["cpu0"] <= budget < ref.fixed_bytes


def test_port_proves_a_budget_below_what_one_node_needs_with_everything_paged():
    _, graph, costs, _ = _small_resnet()
    result = run_strategy("port", Problem(graph, costs, {"cpu0": 1000}, _solver(5)), "cpu0")
    assert not result.feasible and result.proven_infeasible
    assert "paging fixed tensors too, some node needs at least" in result.message
    assert result.min_budget_bytes is not None and result.min_budget_bytes["cpu0"] > 1000


def test_a_pool_below_its_fixed_memory_pages_them_with_auto_and_port_m():
    """Devices sharing one pool hold every node's fixed tensors there: below that, the
    floor says so at once (not one node's own tensors, as for separate memories), and auto
    and port_m page fixed tensors on one device of the pool instead of finding nothing."""
    model = samples.resnet18(batch=2, image=32, width=8)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    ssd = "storage_read_bandwidth=1.5e9,storage_write_bandwidth=1e9,pool=ram"
    pool = [parse_device(f"cpu0:cpu:threads=4,{ssd}"), parse_device(f"gpu0:cuda:{ssd}")]
    costs = analytical_costs(graph, pool).pooled()
    ref = reference(graph, costs, "gpu0")
    budget = round(0.8 * ref.fixed_bytes)
    problem = Problem(graph, costs, {"cpu0": budget, "gpu0": budget}, _solver(6))
    short = shortfall(problem, ("cpu0", "gpu0"))
    assert short is not None and short.needs[0].fixed_bytes == ref.fixed_bytes
    apart = analytical_costs(graph, [parse_device("cpu0:cpu"), parse_device("gpu0:cuda")])
    assert shortfall(replace(problem, costs=apart), ("cpu0", "gpu0")) is None
    for strategy in ("auto", "port_m"):
        result = run_strategy(strategy, problem)
        assert result.plan is not None, (strategy, result.message)
        assert result.plan.version == 5 and result.plan.paged_fixed
        simulation = simulate(result.plan, graph, costs)
        assert simulation.valid, simulation.violation
        assert max(simulation.peak_bytes.values()) <= budget


def test_paging_that_finds_no_plan_above_the_paging_floor_says_so_without_a_proof():
    _, graph, costs, _ = _small_resnet()
    problem = Problem(graph, costs, {"cpu0": 0}, _solver(5))
    floor = paging_floor(problem, "cpu0")
    result = run_strategy("port", replace(problem, budgets={"cpu0": floor}), "cpu0")
    assert not result.feasible and not result.proven_infeasible
    assert result.message.startswith("no plan found: paging fixed tensors too, no plan: ")
    assert "keeping every fixed tensor resident: port proved" in result.message


def test_each_hold_level_holds_fewer_paged_tensors_at_once_and_serial_waits_at_each_use():
    _, graph, costs, ref = _small_resnet()
    plan = run_strategy("checkpoint_all", Problem(graph, costs, {"cpu0": None}), "cpu0").plan
    assert plan is not None
    problem = Problem(graph, costs, {"cpu0": None})
    everything = frozenset(graph.fixed)
    peaks = []
    for hold in Hold:
        paged = with_fixed_paging(plan, graph, problem, "cpu0", everything, hold)
        counted = simulate(paged, graph, costs, {}, reserve_at_issue=True)
        assert counted.valid, (hold, counted.violation)
        peaks.append(counted.peak_bytes["cpu0"])
    assert peaks[0] >= peaks[1] >= peaks[2] and peaks[2] < ref.fixed_bytes
    serial = with_fixed_paging(plan, graph, problem, "cpu0", everything, Hold.SERIAL)
    steps = serial.steps
    for i, step in enumerate(steps):  # no compute between a transfer and its wait
        if step.op in ("fixed_in", "grad_out"):
            wait = "fixed_wait" if step.op == "fixed_in" else "grad_wait"
            j = next(
                j
                for j in range(i + 1, len(steps))
                if steps[j].op == wait and steps[j].tensor == step.tensor
            )
            assert not any(isinstance(s, Compute) for s in steps[i + 1 : j])
