"""PORT-M with paging (issue 36): the devices of one memory pool compute at once and page
values to the node's storage in the same plan. PORT-M's MILP decides, per stage, what each
device computes and what the pool pages out and in (``build_xengine`` with ``paging``); its
plan is concurrent, its page transfers beside each stage's section, the simulator's time
is the model's objective, and the agent's executor runs it for real: two threads, files in
the storage directory, autograd's gradients."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from regime import split_pool

from remat import samples
from remat.compiler import compile_plan
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind, Tier, parse_device
from remat.errors import InvalidInputError
from remat.formulations.checkmate import Transfers
from remat.formulations.xengine import build_xengine
from remat.plan import PAGE_OPS, PageIn, PlanDevice, plan_from_json, plan_to_json
from remat.problem import build_problem
from remat.schedule import Schedule
from remat.simulator import simulate
from remat.strategies import Problem, StrategyResult, run_strategy
from remat.training import training_graph

from graphs import chain

SSD = "storage_write_bandwidth=1e9,storage_read_bandwidth=1e9,storage_latency_us=0"
POOL = [
    parse_device(f"cpu0:cpu:pool=ram,threads=1,{SSD}"),
    parse_device(f"cpu1:cpu:pool=ram,threads=1,{SSD}"),
]


def _split_problem(seconds: float) -> Problem:
    """``regime.split_pool`` on the pool of two CPUs with fast storage."""
    return split_pool(POOL, seconds)


@pytest.fixture(scope="module")
def port_m_plan() -> tuple[Problem, StrategyResult]:
    """``port_m``'s plan with no plan of the pool as one device beside (which pages to
    the ideal here, below): PORT-M's MILP's."""
    problem = _split_problem(12)
    search = replace(problem.solver.search, port_m_alone_share=0.0)
    result = run_strategy("port_m", replace(problem, solver=replace(problem.solver, search=search)))
    assert result.feasible, result.message
    return problem, result


def test_port_m_pages_inside_its_concurrent_plan(
    port_m_plan: tuple[Problem, StrategyResult],
) -> None:
    """At 40%, no device alone keeps up (``port`` pages on one device, at its own speed)
    and XEngine recomputes; PORT-M's MILP places each node on its faster device, runs the
    stages' devices at once and pages the rest: faster than every one of them, within the
    pool's budget, and the simulator's time is the model's objective."""
    problem, result = port_m_plan
    plan = result.plan
    assert plan is not None and result.simulation is not None
    assert plan.concurrent and plan.version == 4
    assert plan_from_json(json.loads(json.dumps(plan_to_json(plan)))) == plan  # as sent
    assert {d.name for d in plan.devices} == {"cpu0", "cpu1"}
    assert {s.device for s in plan.steps if s.op == "compute"} == {"cpu0", "cpu1"}
    pages = [s for s in plan.steps if s.op in PAGE_OPS]
    assert any(s.op == "page_out" for s in pages) and any(s.op == "page_in" for s in pages)
    assert "PORT-M MILP" in result.message
    verdict = simulate(plan, problem.graph, problem.costs, problem.budgets)
    assert verdict.valid and verdict.total_ms == pytest.approx(result.simulation.total_ms)
    assert max(verdict.peak_bytes.values()) <= problem.budgets["cpu0"]
    assert plan.solver is not None and plan.solver.objective is not None
    assert verdict.total_ms == pytest.approx(plan.solver.objective)
    quick = _split_problem(3)
    others = [run_strategy("port", quick, name) for name in ("cpu0", "cpu1")]
    others.append(run_strategy("xengine", quick))
    for other in others:
        assert other.simulation is not None
        assert verdict.total_ms < 0.8 * other.simulation.total_ms, other.message


def test_port_m_plans_the_pool_as_one_device_that_pages_at_its_ideal() -> None:
    """The same pool with ``port_m``'s defaults: ``port`` on the pool as one device (each
    node timed on its faster CPU, the pool's memory one device's) pages what does not fit
    behind the compute, and its plan, each node then on its faster CPU, runs at the
    pool's ideal within the pool's budget, faster than PORT-M's concurrent plan."""
    problem = _split_problem(12)
    result = run_strategy("port_m", problem)
    assert result.feasible and result.plan is not None, result.message
    assert "cpu0+cpu1 as one device: port" in result.message
    assert {s.device for s in result.plan.steps if s.op == "compute"} == {"cpu0", "cpu1"}
    assert any(s.op == "page_out" for s in result.plan.steps)
    verdict = simulate(result.plan, problem.graph, problem.costs, problem.budgets)
    assert verdict.valid and max(verdict.peak_bytes.values()) <= problem.budgets["cpu0"]
    assert verdict.total_ms == pytest.approx(problem.costs.ideal_ms())


def test_the_agent_runs_a_concurrent_paging_plan_for_real(
    port_m_plan: tuple[Problem, StrategyResult], tmp_path: Path
) -> None:
    """The plan above on the agent's executor: each section on a thread per device, page
    transfers through real files on the paging lane; the gradients are autograd's, the
    pool's peak the simulator's, and the files go with the run."""
    pytest.importorskip("torch", reason="the agent extra (torch) is not installed")
    from agents.executor import execute

    problem, result = port_m_plan
    assert result.plan is not None
    model = samples.chain(batch=2)
    devices = [Device(d.name, DeviceKind.CPU, {"threads": "1"}) for d in POOL]
    report = execute(model, problem.graph, result.plan, devices, storage=tmp_path)
    assert report.gradients_match is True, report.max_rel_error
    assert report.peak_bytes == report.predicted_peak_bytes
    assert report.peak_bytes["cpu0"] <= problem.budgets["cpu0"]
    assert sorted(tmp_path.rglob("*")) == []


# --- the model and the compiler ----------------------------------------------------------


def test_paging_in_the_xengine_model_needs_one_pool_of_concurrent_devices() -> None:
    problem = build_problem(samples.chain(batch=2), devices=POOL, budgets={"ram": "60%"})
    costs = problem.costs
    link = Transfers(costs.out_ms(0, Tier.STORAGE), costs.in_ms(0, Tier.STORAGE))
    budgets = {"cpu0": None, "cpu1": None}
    with pytest.raises(InvalidInputError, match="concurrent devices of one pool"):
        build_xengine(problem.graph, costs, budgets, concurrent=False, paging=link)
    labels = {
        b.label
        for b in build_xengine(
            problem.graph, costs, budgets, concurrent=True, paging=link
        ).builder.row_blocks
    }
    assert {"host", "page in", "page out", "leaving", "wait"} <= labels


def test_the_compiler_brings_a_value_back_once_and_only_where_it_is_kept() -> None:
    """A late page-in of a value already paged in during the stage is not emitted, nor a
    page-in of one no device keeps into the next stage: a model may choose either where it
    costs nothing, and the simulator would refuse the first (the value is resident)."""
    g = training_graph(chain(3))  # 0-2 forward, 3 the loss, 4-6 backward
    n = len(g)
    R = np.eye(n, dtype=bool)
    S = np.tril(np.ones((n, n), dtype=bool), -1)  # everything kept
    off, pre, late = (np.zeros((n, n), dtype=bool) for _ in range(3))
    off[3, 1] = True  # node 1 (read by 2 and 5) leaves in stage 3 ...
    S[4, 1] = False
    pre[4, 1] = late[4, 1] = True  # ... and comes back in stage 4, twice over
    off[2, 0] = True  # node 0 (read by 1 and 6) leaves in stage 2 ...
    S[3:6, 0] = False
    pre[3, 0] = True  # ... comes back in stage 3, where nobody keeps it into stage 4 ...
    late[5, 0] = True  # ... and at the end of stage 5, for 6
    devices = (PlanDevice.of(Device("cpu0", DeviceKind.CPU), None),)
    plan = compile_plan(
        g,
        Schedule.single("cpu0", R, S),
        devices,
        "hand",
        transfers=(off, pre, late),
        tier=Tier.STORAGE,
    )
    assert [(s.stage, s.node) for s in plan.steps if isinstance(s, PageIn)] == [(4, 1), (5, 0)]
    costs = analytical_costs(g, [Device("cpu0", DeviceKind.CPU)])
    assert simulate(plan, g, costs).valid
