"""Window neighbourhoods of the interval model (``remat.formulations.moccasin_windows``,
``remat.strategies.exact.windows``): the model holds its incumbent at the incumbent's
recomputation cost, every solution of it is a plan that the simulator accepts within
the budget, and the search over windows improves a plan."""

import itertools
import logging
import random
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from ortools.sat.python import cp_model
from regime import budgeted, recomputing_eviction, resnet18_at_half

from remat.formulations.moccasin import (
    COST_SCALE,
    Placement,
    node_costs,
    retained_of,
    schedule_of_retained,
)
from remat.formulations.moccasin_windows import build_windows, merged_windows, recomputation_ms
from remat.schedule import Schedule
from remat.simulator import simulate
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SolverSettings, StrategyResult, run_strategy
from remat.strategies.baselines import best_baseline
from remat.strategies.common.problem import evaluate
from remat.strategies.config import SearchConfig
from remat.strategies.exact import search as search_module
from remat.strategies.exact.intervals import on_device, placed
from remat.strategies.exact.state import IncumbentStall, Search
from remat.strategies.exact.windows import improve_by_windows
from remat.strategies.heuristics.evict import greedy_evict, home_of
from remat.strategies.heuristics.placed import placed_greedy

QUICK = SolverSettings(options=SolveOptions(time_limit_s=5, gap=1e-4, threads=2))
WINDOWS = [
    [(40, 90)],  # one window in the forward pass
    [(100, 139)],  # one window to the graph's end (its outputs)
    [(0, 30)],  # from the first stage
    [(30, 60), (80, 110)],  # a forward range and the backward stages that read it
    [(10, 30), (50, 70), (100, 120)],  # three windows, two gaps
]


@pytest.fixture(scope="module")
def resnet():
    return resnet18_at_half(QUICK)


@pytest.fixture(scope="module")
def evicted(resnet):
    return recomputing_eviction(resnet)


@pytest.mark.parametrize("windows", WINDOWS)
def test_the_model_holds_its_incumbent_at_its_recomputation_cost(resnet, evicted, windows):
    """The incumbent fixed as the solution (every hinted variable): feasible, its objective
    the incumbent's recomputation time in the windows, and decoded back to the same
    schedule."""
    retained = retained_of(evicted.schedule, resnet.graph)
    placement = on_device(resnet, "cuda0")
    model = build_windows(resnet.graph, resnet.costs, placement, retained, windows)
    assert model.incumbent_cost_ms == pytest.approx(
        recomputation_ms(resnet.costs, placement, retained, windows)
    )
    solver = cp_model.CpSolver()
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.max_time_in_seconds = 30
    status = solver.solve(model.model)
    assert status == cp_model.OPTIMAL, solver.status_name(status)
    rounding = len(resnet.graph) / COST_SCALE  # each weight rounded to an integer
    assert solver.objective_value / COST_SCALE == pytest.approx(
        model.incumbent_cost_ms, abs=rounding
    )
    decoded = model.decode(solver.value)
    assert (decoded.R == evicted.schedule.R).all()


@pytest.mark.parametrize("windows", WINDOWS)
def test_every_solution_is_a_plan_within_the_budget_no_dearer_in_the_windows(
    resnet, evicted, windows
):
    """Each solution CP-SAT finds, decoded into the whole plan, is valid and within the
    budget by the simulator, and no solution's simulated compute time exceeds the
    incumbent's by more than its objective does."""
    retained = retained_of(evicted.schedule, resnet.graph)
    placement = on_device(resnet, "cuda0")
    model = build_windows(resnet.graph, resnet.costs, placement, retained, windows)
    found = []

    class _Plans(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            found.append((self.objective_value, model.decode(self.value)))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 10
    solver.parameters.num_workers = 2
    solver.solve(model.model, _Plans())
    assert found, "a solution within 10 s (the incumbent is one)"
    incumbent = evicted.simulation.compute_ms
    for objective, schedule in found:
        evaluation = evaluate(resnet, schedule, "windows")
        assert evaluation.fits, evaluation.simulation.violation
        saved = model.incumbent_cost_ms - objective / COST_SCALE
        assert evaluation.simulation.compute_ms <= incumbent - saved + 1e-6


def test_a_value_carried_out_of_both_windows_of_a_pair_is_held(resnet, evicted):
    """A value the forward window carries into the gap and, recomputed, the backward window
    carries past the last window: the model holds the incumbent (it had room for one
    carried-out end per value and excluded it)."""
    n = len(resnet.graph)
    retained = [list(own) for own in retained_of(evicted.schedule, resnet.graph)]
    first, recomputed, again = retained[0]
    assert first[1] < n * 2 and recomputed[0] + 1 == again[0], "the premise's recomputations"
    retained[0] = [first, (recomputed[0], again[1])]  # kept to its reader, not recomputed
    problem = budgeted(resnet.graph, 75, ("cuda0",), QUICK)
    placement = on_device(problem, "cuda0")
    schedule = schedule_of_retained(retained, placement)
    assert evaluate(problem, schedule, "kept").fits
    windows = [(0, 1), (recomputed[0], recomputed[0] + 1)]
    model = build_windows(problem.graph, problem.costs, placement, retained, windows)
    solver = cp_model.CpSolver()
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.max_time_in_seconds = 30
    status = solver.solve(model.model)
    assert status == cp_model.OPTIMAL, solver.status_name(status)
    assert (model.decode(solver.value).R == schedule.R).all()


def test_a_checkpoint_kept_into_a_stage_that_does_not_read_it_is_read_as_the_compiler_frees_it(
    resnet, evicted
):
    """S may keep a value into a stage where no node reads it (a solver's solution, free to
    keep it longer): the compiler frees it before that stage's first step, and the
    incumbent's reading (``retained_of``) ends it there, so its memory over time peaks
    where the simulator's does (read to a slot in that stage, it exceeded the budget in a
    window model's gap, which then excluded its own incumbent)."""
    graph, n = resnet.graph, len(resnet.graph)
    before = evicted.schedule
    schedule = Schedule(before.devices, before.R.copy(), before.S.copy())
    users = graph.users()
    extended = 0
    for i, own in enumerate(retained_of(before, graph)):
        for _, end in own:
            after = (end - 1) // n + 1  # the stage after the last that holds it
            if end >= n * n or after >= n:
                continue
            if not any(before.R[0, after, k] for k in [i, *users[i]]):
                schedule.S[0, after, i] = True
                extended += 1
    assert extended > 10
    simulated = evaluate(resnet, schedule, "kept longer").simulation
    placement = on_device(resnet, "cuda0")
    m, w, unit = node_costs(resnet.costs, placement)[1:]
    events = sorted(
        (slot, units)
        for i, own in enumerate(retained_of(schedule, graph))
        for t, end in own
        for slot, units in ((n * t + i, m[i] + w[i]), (n * t + i + 1, -w[i]), (end, -m[i]))
    )
    level = np.cumsum([units for _, units in events])
    assert placement.fixed_bytes[0] + int(level.max()) * unit == simulated.peak_bytes["cuda0"]


def test_on_a_placement_every_solution_keeps_each_node_on_its_device(resnet):
    """On two devices, from the multi-device heuristic's plan: every solution of random
    windows is a plan within both budgets (copies charged on the reader's device), with
    each node computed where the incumbent computes it."""
    names = ("cpu0", "cuda0")
    problem = budgeted(resnet.graph, 30, names, QUICK)
    start = placed_greedy(problem, names, 2.0)
    assert start.feasible and start.schedule is not None
    home = home_of(start.schedule, names)
    assert len(set(home.tolist())) == 2, "a plan over both devices"
    placement = placed(problem, names, home)
    retained = retained_of(start.schedule, problem.graph)
    rng = random.Random(0)
    checked = 0
    for _ in range(6):
        a = rng.randrange(len(problem.graph) - 20)
        windows = [(a, a + rng.randint(10, 60))]
        model = build_windows(problem.graph, problem.costs, placement, retained, windows)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = 5
        solver.parameters.num_workers = 2
        status = solver.solve(model.model)
        assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE), solver.status_name(status)
        evaluation = evaluate(problem, model.decode(solver.value), "windows")
        assert evaluation.fits, evaluation.simulation.violation
        assert np.array_equal(home_of(evaluation.schedule, names), home)
        checked += 1
    assert checked == 6


def test_windows_are_sorted_and_merged():
    assert merged_windows([(50, 60), (0, 10), (8, 20), (20, 25), (70, 200)], 100) == [
        (0, 25),
        (50, 60),
        (70, 100),
    ]
    assert merged_windows([(5, 5), (-3, 2)], 10) == [(0, 2)]


@pytest.mark.alone  # a search within seconds: what it finds depends on the CPU it gets
def test_the_search_over_windows_improves_the_best_baseline(resnet):
    """From the best baseline's plan at 70% (a segment policy's), window neighbourhoods
    find a cheaper plan that the simulator accepts within the budget, and stop at their
    deadline."""
    problem = budgeted(resnet.graph, 70, ("cuda0",), QUICK)
    baseline = best_baseline(problem, ["cuda0"])
    assert baseline is not None and baseline.simulation is not None
    search = Search(problem, problem.costs.ideal_ms("cuda0"), time.monotonic())
    search.offer(baseline)
    placement = on_device(problem, "cuda0")

    def incumbent():
        return search.best.schedule if search.best is not None else None

    began = time.monotonic()
    improved = improve_by_windows(search, placement, "windows", incumbent, began + 10)
    assert time.monotonic() - began < 10 + 6  # one neighbourhood's solve may end late
    assert improved >= 1
    best = search.best
    assert best is not baseline and best.simulation is not None
    assert best.simulation.total_ms < baseline.simulation.total_ms
    assert best.simulation.peak_bytes["cuda0"] <= problem.budgets["cuda0"]


@pytest.mark.alone
@pytest.mark.parametrize("min_nodes", [100, 600])
def test_a_decomposed_graph_gets_window_neighbourhoods_first_from_their_size_on(
    resnet, caplog, min_nodes
):
    """After the parts' stitched plan, windows run before the whole interval model on a
    graph of at least ``windows_min_nodes`` nodes (ResNet-18's 139 here), and after it
    below; the plan stays valid and within the budget."""
    caplog.set_level(logging.DEBUG, logger="remat.strategies.exact")
    settings = SolverSettings(
        options=SolveOptions(time_limit_s=8, gap=1e-4, threads=2),
        search=SearchConfig(decompose_min_nodes=100, windows_min_nodes=min_nodes),
    )
    problem = budgeted(resnet.graph, 50, ("cuda0",), settings)
    result = run_strategy("checkmate_milp", problem, "cuda0")
    assert result.feasible and result.plan is not None
    assert "decomposed: stitched plan" in result.message
    phases = [_phase(r.getMessage()) for r in caplog.records]
    phases = [phase for phase in phases if phase is not None]
    assert phases, "no interval phase"
    assert phases[0] == ("windows" if min_nodes <= len(problem.graph) else "intervals"), phases
    simulation = simulate(result.plan, problem.graph, problem.costs, problem.budgets)
    assert simulation.valid
    assert simulation.peak_bytes["cuda0"] <= problem.budgets["cuda0"]


@pytest.mark.alone
def test_windows_improve_a_placements_first_plan_in_a_search_of_its_own(resnet, monkeypatch):
    """On the device cover's placement of a graph that windows improve, the interval model
    runs to its first plan there, and window neighbourhoods then improve that plan in a
    search of its own (``Search.beside``) whether or not it costs more than the search's
    one-device incumbent; the search keeps the cheaper of the two."""
    config = SearchConfig(windows_min_nodes=100)
    settings = SolverSettings(options=SolveOptions(time_limit_s=10, threads=2), search=config)
    problem = budgeted(resnet.graph, 50, NAMES, settings)
    search, incumbent, placement = _split_after_one_device(problem)
    seen: list[tuple[Search, np.ndarray, float | None]] = []
    windows = search_module.improve_by_windows

    def recorded(own, placement, strategy, incumbent_of, until, stall_s=None):
        seen.append((own, home_of(incumbent_of(), NAMES), own.best_ms))
        return windows(own, placement, strategy, incumbent_of, until, stall_s)

    monkeypatch.setattr(search_module, "improve_by_windows", recorded)
    trial = time.monotonic() + 10
    message = search_module._placement_by_windows(search, placement, "x", trial)
    assert message is not None and "found a plan on the device cover's placement" in message
    own, on, first_ms = seen[0]
    assert own is not search and np.array_equal(on, placement.home)  # the placement's plan
    assert first_ms is not None and own.best_ms is not None and own.best_ms <= first_ms
    assert search.best_ms == min(incumbent.simulation.total_ms, own.best_ms)
    best = search.best
    assert best is not None and best.plan is not None
    assert simulate(best.plan, problem.graph, problem.costs, problem.budgets).valid


@pytest.mark.alone
def test_a_placement_without_a_plan_by_its_trial_gives_the_search_back(resnet):
    """Where the interval model finds no plan on the device cover's placement by the trial
    (here none exists: cpu0's budget is below what its nodes need), nothing is offered
    and the one-device search resumes (``None``)."""
    settings = SolverSettings(options=SolveOptions(time_limit_s=10, threads=2))
    problem = budgeted(resnet.graph, 50, NAMES, settings)
    problem = replace(problem, budgets={**problem.budgets, "cpu0": 1})
    search, incumbent, placement = _split_after_one_device(problem)
    trial = time.monotonic() + 5
    assert search_module._placement_by_windows(search, placement, "x", trial) is None
    assert search.best is incumbent


@pytest.mark.alone
def test_the_window_neighbourhoods_take_over_once_the_whole_models_search_stalls(
    resnet, monkeypatch
):
    """Below ``windows_min_nodes``, CP-SAT's search on the whole interval model runs first,
    until the incumbent has not improved for ``neighbourhood_stall_share`` of the limit,
    then the window neighbourhoods from its plan, by turns; after a round of both without
    a cheaper plan, the whole model takes the time left. The plan stays within the
    budget and no dearer than greedy eviction's, where it started."""
    config = SearchConfig(neighbourhood_stall_share=0.05)
    settings = SolverSettings(options=SolveOptions(time_limit_s=6, threads=2), search=config)
    problem = budgeted(resnet.graph, 50, ("cuda0",), settings)
    start = greedy_evict(problem, "cuda0", 2)
    assert start.simulation is not None
    search = Search(problem, problem.costs.ideal_ms("cuda0"), time.monotonic())
    search.offer(start)
    calls: list[tuple[str, float | None]] = []
    intervals, windows = search_module.solve_intervals, search_module.improve_by_windows

    def solve_intervals(search, placement, warm, strategy, stall_s=None):
        calls.append(("intervals", stall_s))
        return intervals(search, placement, warm, strategy, stall_s=stall_s)

    def improve_by_windows(search, placement, strategy, incumbent, until, stall_s=None):
        calls.append(("windows", stall_s))
        return windows(search, placement, strategy, incumbent, until, stall_s)

    monkeypatch.setattr(search_module, "solve_intervals", solve_intervals)
    monkeypatch.setattr(search_module, "improve_by_windows", improve_by_windows)
    search_module._alternated(search, on_device(problem, "cuda0"), "x")
    kinds = [kind for kind, _ in calls]
    assert kinds[:2] == ["intervals", "windows"], calls
    assert all(a != b for a, b in itertools.pairwise(kinds)), calls  # by turns
    assert all(stall == pytest.approx(0.3) for _, stall in calls[:-1]), calls
    assert calls[-1][1] is not None or calls[-1][0] == "intervals", calls  # the time left
    best = search.best
    assert best is not None and best.simulation is not None and best.plan is not None
    assert best.simulation.total_ms <= start.simulation.total_ms
    assert simulate(best.plan, problem.graph, problem.costs, problem.budgets).valid


def test_an_incumbent_stall_is_set_once_no_better_plan_has_come_for_its_time():
    """``IncumbentStall`` counts from its making (or its start), restarts at each cheaper
    incumbent, is never set without a time, and a dearer incumbent does not restart it."""
    search = SimpleNamespace(best_ms=None)
    stall = IncumbentStall(search, 0.2)
    assert not stall.is_set()
    time.sleep(0.25)
    assert stall.is_set()  # no plan at all for its time
    search.best_ms = 10.0
    assert not stall.is_set()  # the first plan restarts it
    time.sleep(0.1)
    search.best_ms = 9.0
    assert not stall.is_set()
    time.sleep(0.1)
    search.best_ms = 9.5  # dearer: not an improvement
    assert not stall.is_set()  # 0.1 s since 9.0
    time.sleep(0.15)
    assert stall.is_set()
    assert not IncumbentStall(search, None).is_set()
    waiting = IncumbentStall(search, 0.2, started=False)
    time.sleep(0.25)
    assert not waiting.is_set()  # not started: CP-SAT has no first solution yet
    waiting.start()
    assert not waiting.is_set()
    time.sleep(0.25)
    assert waiting.is_set()


def _phase(message: str) -> str | None:
    """Which neighbourhood search a debug record of the exact search ends, if any."""
    if "window neighbourhoods" in message:
        return "windows"
    if "intervals model" in message and " in " in message:
        return "intervals"
    return None


NAMES = ("cpu0", "cuda0")


def _split_after_one_device(problem: Problem) -> tuple[Search, StrategyResult, Placement]:
    """A search whose incumbent is greedy eviction's plan on cuda0, and a placement over
    both devices (the first forward nodes on cpu0), as the device cover's would be."""
    incumbent = greedy_evict(problem, "cuda0", 2)
    assert incumbent.simulation is not None
    search = Search(problem, problem.costs.ideal_ms(None), time.monotonic())
    search.offer(incumbent)
    home = np.ones(len(problem.graph), dtype=np.int64)
    home[:12] = 0
    return search, incumbent, placed(problem, NAMES, home)
