"""Moccasin's retention-interval model (``remat.formulations.moccasin``), the strategy on
it (``moccasin``) and its use after a decomposed graph's stitched plan: the model holds
the plans the compiler makes at their simulated cost, and its plans are valid."""

import logging
import time
from dataclasses import replace

import numpy as np
import pytest
from ortools.sat.python import cp_model
from regime import budgeted, recomputing_eviction, resnet18_at_half

from remat.compiler import compile_plan
from remat.formulations.moccasin import COST_SCALE, Placement, build_moccasin
from remat.plan import Compute, Copy, Free
from remat.schedule import schedule_of_steps
from remat.simulator import simulate
from remat.solvers.model import SolveOptions
from remat.strategies import SolverSettings, run_strategy
from remat.strategies.common.policy import device_fixed_bytes
from remat.strategies.common.problem import evaluate
from remat.strategies.config import SearchConfig
from remat.strategies.exact.cover import covers_extra_ms
from remat.strategies.exact.intervals import on_device, placed, solve_intervals
from remat.strategies.exact.state import Search
from remat.strategies.heuristics.evict import greedy_evict

# CP-SAT's searches within limits of seconds: what they find depends on the CPU they get
pytestmark = pytest.mark.alone

QUICK = SolverSettings(options=SolveOptions(time_limit_s=5, gap=1e-4, threads=2))


@pytest.fixture(scope="module")
def resnet():
    return resnet18_at_half(QUICK)


@pytest.fixture(scope="module")
def evicted(resnet):
    return recomputing_eviction(resnet)


def test_a_compiled_plan_gives_back_its_schedule(resnet, evicted):
    plan = evicted.plan
    schedule = schedule_of_steps(plan.steps, len(resnet.graph), "cuda0")
    assert schedule is not None
    assert (schedule.R == evicted.schedule.R).all()
    devices = resnet.plan_devices(("cuda0",))
    again = compile_plan(resnet.graph, schedule, devices, "x", resnet.costs)
    assert again.steps == plan.steps


def test_steps_out_of_stage_order_or_with_copies_have_no_schedule():
    first = [Compute(0, 0, "d"), Compute(1, 1, "d")]
    assert schedule_of_steps(first, 2, "d") is not None
    assert schedule_of_steps(list(reversed(first)), 2, "d") is None
    assert schedule_of_steps([first[0], Copy(0, 0, "d", "e"), first[1]], 2, "d") is None
    assert schedule_of_steps([first[0], Free(0, 0, "d")], 2, "d") is None  # node 1 missing


def test_the_model_holds_a_plan_at_its_simulated_cost(resnet, evicted):
    """The warm start fixed as the solution: feasible under the budget, with the
    simulator's compute time as the objective."""
    computations = np.maximum(2, evicted.schedule.R[0].sum(axis=0))
    fixed = device_fixed_bytes(resnet, "cuda0")
    placement = Placement.single("cuda0", len(resnet.graph), resnet.budgets["cuda0"], fixed)
    model = build_moccasin(resnet.graph, resnet.costs, placement, computations)
    model.hint(evicted.schedule)
    solver = cp_model.CpSolver()
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.max_time_in_seconds = 30
    status = solver.solve(model.model)
    assert status == cp_model.OPTIMAL, solver.status_name(status)
    objective = model.objective_ms(solver.objective_value)
    rounding = len(resnet.graph) / COST_SCALE  # each weight rounded to an integer
    assert objective == pytest.approx(evicted.simulation.compute_ms, abs=rounding)
    decoded = model.decode(solver.value)
    assert (decoded.R == evicted.schedule.R).all()


def test_the_model_refuses_a_plan_over_its_budget(resnet, evicted):
    computations = np.maximum(2, evicted.schedule.R[0].sum(axis=0))
    peak = evicted.simulation.peak_bytes["cuda0"]
    fixed = device_fixed_bytes(resnet, "cuda0")
    tight = fixed + (peak - fixed) // 2
    placement = Placement.single("cuda0", len(resnet.graph), tight, fixed)
    model = build_moccasin(resnet.graph, resnet.costs, placement, computations)
    model.hint(evicted.schedule)
    solver = cp_model.CpSolver()
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.max_time_in_seconds = 30
    assert solver.solve(model.model) == cp_model.INFEASIBLE


def test_moccasin_plans_within_the_budget_no_worse_than_its_warm_start(resnet, evicted):
    result = run_strategy("moccasin", resnet, "cuda0")
    assert result.feasible and result.plan is not None and result.plan.strategy == "moccasin"
    simulation = simulate(result.plan, resnet.graph, resnet.costs, resnet.budgets)
    assert simulation.valid
    assert simulation.peak_bytes["cuda0"] <= resnet.budgets["cuda0"]
    assert simulation.total_ms <= evicted.simulation.total_ms * (1 + 1e-9)
    solver = result.plan.solver
    assert solver is not None  # the restriction's bound is not the problem's: the covers'
    extra = covers_extra_ms(resnet, ("cuda0",), 10.0)
    assert extra is not None and extra > 0
    assert solver.bound == pytest.approx(resnet.costs.ideal_ms("cuda0") + extra)


def test_a_decomposed_graph_is_solved_whole_after_its_parts(resnet):
    """Past ``decompose_min_nodes`` the parts' stitched plan is the interval model's
    warm start for the time left."""
    settings = SolverSettings(
        options=SolveOptions(time_limit_s=8, gap=1e-4, threads=2),
        search=SearchConfig(decompose_min_nodes=100),
    )
    problem = budgeted(resnet.graph, 50, ("cuda0",), settings)
    result = run_strategy("checkmate_milp", problem, "cuda0")
    assert result.feasible and result.plan is not None
    assert "decomposed: stitched plan" in result.message
    assert "interval model" in result.message
    stitched = float(result.message.split("stitched plan ")[1].split(" ms")[0])
    simulation = simulate(result.plan, problem.graph, problem.costs, problem.budgets)
    assert simulation.valid
    assert simulation.total_ms <= stitched * (1 + 1e-3)


def test_on_a_placement_every_plan_computes_each_node_on_its_device_within_each_budget(resnet):
    """Nodes alternate between two devices, so nearly every value is read on the other
    device: each incumbent's plan copies them there, and the simulator finds every one
    within both budgets (the model charges each copy on its reader's device for the
    reader's stage) and each node computed only on its device."""
    names = ("cpu0", "cuda0")
    problem = budgeted(resnet.graph, 50, names, QUICK)
    home = np.arange(len(problem.graph)) % 2
    placement = placed(problem, names, home)
    model = build_moccasin(problem.graph, problem.costs, placement, 2)
    plans = []

    class _Plans(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            plans.append(evaluate(problem, model.decode(self.value), "moccasin"))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 10
    solver.parameters.num_workers = 2
    solver.solve(model.model, _Plans())
    assert plans, "a plan within 10 s"
    for evaluation in plans:
        assert evaluation.fits, evaluation.simulation.violation
        computes = [s for s in evaluation.plan.steps if isinstance(s, Compute)]
        assert all(step.device == names[home[step.node]] for step in computes)
        assert any(isinstance(s, Copy) for s in evaluation.plan.steps)


def _interval_solves(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "remat.strategies.exact.intervals"]


def test_from_a_hint_the_interval_model_improves_by_lns_alone(resnet, evicted, caplog):
    """CP-SAT's LNS workers alone, from the warm start's hint, find plans (no solve with a
    full-problem worker after them) no worse than the warm start. The LNS phase gets all
    the time, so that a slow presolve on a busy machine does not end it."""
    caplog.set_level(logging.DEBUG, logger="remat.strategies.exact.intervals")
    settings = replace(QUICK, search=SearchConfig(moccasin_hint_share=1.0))
    result = run_strategy("moccasin", replace(resnet, solver=settings), "cuda0")
    assert result.feasible and result.simulation is not None
    assert result.simulation.total_ms <= evicted.simulation.total_ms * (1 + 1e-9)
    solves = _interval_solves(caplog)
    lns = [m for m in solves if "by LNS from the hint" in m]
    assert len(lns) == 1 and not lns[0].endswith(": 0 plans"), solves


def test_without_patience_for_the_hint_the_default_portfolio_plans(resnet, evicted, caplog):
    caplog.set_level(logging.DEBUG, logger="remat.strategies.exact.intervals")
    settings = replace(QUICK, search=SearchConfig(moccasin_hint_share=0.0))
    problem = replace(resnet, solver=settings)
    result = run_strategy("moccasin", problem, "cuda0")
    assert result.feasible and result.simulation is not None
    assert result.simulation.total_ms <= evicted.simulation.total_ms * (1 + 1e-9)
    solves = _interval_solves(caplog)
    assert not any("by LNS" in m for m in solves), solves
    assert any("intervals model" in m for m in solves), solves


def test_given_a_trial_time_the_interval_model_stops_then_without_a_cheaper_plan(resnet):
    """The incumbent is a plan on cpu0 below cuda0's ideal, so the model on cuda0 alone has
    no cheaper plan: given a trial of 1 s, its LNS from the incumbent's hint (which proves
    nothing optimal) stops soon after, long before the 60 s limit, and the incumbent stays."""
    long = replace(QUICK, options=replace(QUICK.options, time_limit_s=60))
    problem = budgeted(resnet.graph, 50, ("cpu0", "cuda0"), long)
    incumbent = greedy_evict(problem, "cpu0", 2)
    assert incumbent.simulation is not None
    assert incumbent.simulation.total_ms < problem.costs.ideal_ms("cuda0")
    search = Search(problem, problem.costs.ideal_ms(None), time.monotonic())
    search.offer(incumbent)
    began = time.monotonic()
    model = on_device(problem, "cuda0")
    solve_intervals(search, model, incumbent.schedule, "moccasin", improve_by=began + 1)
    assert time.monotonic() - began < 30
    assert search.best is incumbent


def test_until_better_the_interval_model_stops_at_its_first_cheaper_plan(resnet, evicted):
    """A search without an incumbent: every plan is cheaper, so with ``until_better`` the
    model's LNS from the hint (which never proves a plan optimal, and would search to the
    limit) stops at its first plan, long before the 60 s limit."""
    long = replace(QUICK, options=replace(QUICK.options, time_limit_s=60))
    problem = replace(resnet, solver=long)
    search = Search(problem, problem.costs.ideal_ms("cuda0"), time.monotonic())
    began = time.monotonic()
    model = on_device(problem, "cuda0")
    solve_intervals(search, model, evicted.schedule, "moccasin", until_better=True)
    assert time.monotonic() - began < 30
    assert search.best is not None and search.best.simulation is not None
    assert search.best.simulation.peak_bytes["cuda0"] <= problem.budgets["cuda0"]
