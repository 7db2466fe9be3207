"""Greedy eviction (``remat.strategies.heuristics.evict``): plans where the checkpoint baselines fit
nowhere, and the exact strategies' warm start from them."""

from __future__ import annotations

import functools
import itertools
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from regime import budgeted

from remat import samples
from remat.compiler import compile_plan
from remat.onnx_ingest import forward_graph
from remat.schedule import Schedule
from remat.simulator import simulate
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SearchConfig, SolverSettings, StrategyResult, run_strategy
from remat.strategies.baselines import best_baseline
from remat.strategies.common.problem import FitDeadline
from remat.strategies.common.profile import Profiler, profile
from remat.strategies.common.rsolve import (
    HoldBuilder,
    holds_from_dense,
    solve_and_prune_placed,
    solve_and_prune_sparse,
)
from remat.strategies.exact.checkmate import checkmate_milp
from remat.strategies.heuristics import evict as evict_module
from remat.strategies.heuristics.evict import (
    _evicted,
    _refills,
    _released,
    evict_placed,
    greedy_evict,
    home_of,
)
from remat.strategies.heuristics.placed import forward_layer, placed_greedy, placed_on
from remat.training import training_graph

from graphs import chain, diamond


def _zoo_problem(
    name: str, percent: float, devices: tuple[str, ...], limit_s: float = 10.0
) -> Problem:
    """``bench/solvers.py``'s setting: batch 4, analytical costs, a share of the
    checkpoint-all peak on each device."""
    graph = training_graph(forward_graph(samples.ZOO[name](), batch=4, fuse_attention=False))
    settings = SolverSettings(options=SolveOptions(time_limit_s=limit_s, gap=1e-4, threads=2))
    return budgeted(graph, percent, devices, settings)


@functools.cache
def _evicted_at_25(name: str) -> tuple[Problem, StrategyResult]:
    """Greedy eviction on cuda0 at 25%, with time enough not to be cut short (it takes
    seconds): three tests read it."""
    problem = _zoo_problem(name, 25, ("cuda0",))
    return problem, greedy_evict(problem, "cuda0", time_budget_s=60.0)


@pytest.mark.parametrize("name", ["unet", "mobilenet_v1"])
def test_eviction_fits_where_no_baseline_does(name: str) -> None:
    """At 25% on cuda0. MobileNet fits only with releases (values recomputed in a stage
    not all kept to its end): without them eviction stopped over the budget."""
    problem, result = _evicted_at_25(name)
    assert best_baseline(problem, ("cuda0",)) is None
    assert result.feasible, result.message
    verdict = simulate(result.plan, problem.graph, problem.costs)
    assert verdict.valid
    assert verdict.peak_bytes["cuda0"] <= problem.budgets["cuda0"]
    assert verdict.total_ms > problem.costs.ideal_ms("cuda0")  # it had to recompute


def test_eviction_beats_the_baselines_where_they_fit() -> None:
    """With time enough not to be cut short: on a loaded 2-core machine (the CI's three
    test groups at once) its default budget ended before its first plan that fits."""
    problem = _zoo_problem("unet", 50, ("cuda0",))
    baseline = best_baseline(problem, ("cuda0",))
    patient = replace(problem.solver, search=replace(SearchConfig(), evict_time_s=60.0))
    result = run_strategy("greedy_evict", replace(problem, solver=patient), "cuda0")
    assert baseline is not None and result.feasible
    assert result.simulation.total_ms < baseline.simulation.total_ms


def test_with_ample_memory_nothing_is_evicted() -> None:
    problem = _zoo_problem("unet", 100, ("cuda0",))
    result = greedy_evict(problem, "cuda0")
    assert result.feasible
    assert result.simulation.computes == len(problem.graph)


def test_the_milp_starts_from_eviction_where_no_baseline_fits() -> None:
    """The transformer block at 50% on cpu0: no baseline fits and HiGHS finds no plan of
    its own in a few seconds; the eviction plan is the answer, with the whole problem's
    bound."""
    problem = _zoo_problem("transformer", 50, ("cpu0",), limit_s=2.0)
    assert best_baseline(problem, ("cpu0",)) is None
    evicted = greedy_evict(problem, "cpu0")
    result = checkmate_milp(problem, "cpu0")
    assert result.feasible, result.message
    assert result.simulation.total_ms <= evicted.simulation.total_ms
    assert result.plan.solver.bound <= result.simulation.total_ms


def test_an_eviction_drops_a_value_between_its_reads() -> None:
    holds = [[], [(2, 9)]]
    # value 1 is read in stages 3 and 7: evicted at stage 5, it is kept through 3, not in
    # 4..7 (recomputed in 7), and kept again from 8
    assert _evicted(holds, 1, 5, [3, 7], 10)[1] == [(2, 3), (8, 9)]
    # no read before stage 5: nothing kept before the recomputation
    assert _evicted(holds, 1, 5, [7], 10)[1] == [(8, 9)]
    # no read after it: the value is not kept past its last read
    assert _evicted(holds, 1, 5, [3], 10)[1] == [(2, 3)]
    assert holds == [[], [(2, 9)]]  # the input is not changed


def test_a_release_frees_a_value_after_its_last_read_in_the_stage() -> None:
    holds = [[], [(2, 9)]]
    # value 1 is read in stages 3, 5 and 7: released after stage 5, it is not kept in
    # 6..7 (recomputed in 7) and kept again from 8; stage 5 itself is not touched
    assert _released(holds, 1, 5, [3, 5, 7], 10)[1] == [(2, 5), (8, 9)]
    # a value recomputed in stage 5 and kept for stage 6: recomputed in 6 instead
    assert _released([[], [(6, 9)]], 1, 5, [5, 6, 9], 10)[1] == [(7, 9)]
    assert holds == [[], [(2, 9)]]


def test_a_refill_keeps_a_value_through_one_gap() -> None:
    holds = [[(3, 4), (7, 9)]]  # value 0: computed in stage 0, recomputed in 2 and in 6
    refilled = [h[0] for h in _refills(holds, 0, 10)]
    assert refilled == [[(1, 4), (7, 9)], [(3, 9)]]


@pytest.mark.parametrize("name", ["unet", "mobilenet_v1"])
def test_a_swap_beats_where_eviction_and_refill_stop(name: str) -> None:
    """At 25% on cuda0 eviction and refill stop at a plan that refilling one gap and
    evicting again beats; eviction's plan is the swapped one, as the simulator judges it."""
    problem, result = _evicted_at_25(name)  # not cut short
    home = np.zeros(len(problem.graph), dtype=np.int64)
    context = evict_module._EvictionSetup.of(problem, ("cuda0",), home, 60.0)
    start = context.state(HoldBuilder(problem.graph).keep_everything().build())
    refilled = evict_module._refill(context, evict_module._descend(context, start))
    swapped = evict_module._swap(context, refilled)
    assert refilled.fits and swapped.fits
    assert swapped.cost_ms < refilled.cost_ms * 0.995
    assert result.simulation.valid
    assert result.simulation.total_ms == pytest.approx(swapped.cost_ms)


def test_the_descent_to_a_fitting_plan_may_outrun_the_time_budget() -> None:
    """U-Net at 25% on cuda0 with no time at all: the incumbent is checkpoint-all
    (it does not fit); with time to fit, the descent runs on to a plan that fits, and the
    refills and swaps, out of time, are skipped (the plan costs more than with time)."""
    problem, refined = _evicted_at_25("unet")  # with time
    assert not greedy_evict(problem, "cuda0", time_budget_s=0.0).feasible
    fitted = greedy_evict(problem, "cuda0", time_budget_s=0.0, fit_budget_s=60.0)
    assert fitted.feasible, fitted.message
    assert fitted.simulation.peak_bytes["cuda0"] <= problem.budgets["cuda0"]
    assert refined.simulation.total_ms < fitted.simulation.total_ms


def test_a_fit_budget_is_the_threads_cpu_time_not_the_clocks() -> None:
    """A thread that sleeps (as one starved by a busy machine) spends no fit budget: the
    deadline passes only once the wall deadline has and the thread has used its CPU."""
    fit = FitDeadline.of(time.monotonic(), fit_budget_s=0.05)
    time.sleep(0.2)
    assert not fit.passed()
    spin = time.thread_time() + 0.1
    while time.thread_time() < spin:
        pass
    assert fit.passed()


def test_on_a_busy_machine_the_descent_still_gets_its_fit_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """U-Net at 25% on cuda0 with no time of its own and a wall clock that races ahead (a
    busy machine: every look at the clock finds minutes gone): the descent runs on its CPU
    time and reaches a plan that fits; on the clock alone it stopped at once, with none."""
    problem, _ = _evicted_at_25("unet")
    real = time.monotonic
    calls = itertools.count()
    with monkeypatch.context() as patched:
        patched.setattr(time, "monotonic", lambda: real() + 600.0 * next(calls))
        fitted = greedy_evict(problem, "cuda0", time_budget_s=0.0, fit_budget_s=60.0)
    assert fitted.feasible, fitted.message
    assert next(calls) > 2  # the clock was read, and raced
    assert fitted.simulation.peak_bytes["cuda0"] <= problem.budgets["cuda0"]


@pytest.mark.alone
def test_the_milps_warm_start_fits_even_when_evictions_budget_is_spent() -> None:
    """The heuristics' budget at a share of the limit, here none: eviction's descent still
    gets half the limit to fit, so U-Net at 25% on cuda0 (no baseline fits, the placed
    heuristic finds no plan) has a plan; the search is cancelled once it is offered."""
    cancel = threading.Event()
    settings = SolverSettings(
        options=SolveOptions(time_limit_s=10.0, gap=1e-4, threads=2),
        cancel=cancel,
        on_plan=lambda _result: cancel.set(),
        search=SearchConfig(placed_time_s=0.0),
    )
    problem = _zoo_problem("unet", 25, ("cuda0",))
    problem = Problem(problem.graph, problem.costs, problem.budgets, settings)
    result = checkmate_milp(problem, "cuda0", coarse=False)
    assert result.feasible, result.message
    assert result.simulation.valid


def test_eviction_on_bands_beats_eviction_on_the_heuristics_placement() -> None:
    """The transformer at 25% on cpu+cuda: eviction on band placements, those least over
    the budgets with everything kept first, beats eviction on the multi-device heuristic's
    placement (chosen with Chen's policies), and node moves from the best band improve on
    it. Each plan offered fits and is cheaper than the one before, the last one node's
    move from the one before it; the search stops on its own (patience, then no move that
    helps)."""
    problem = _zoo_problem("transformer", 25, ("cpu0", "cuda0"))
    names = ("cpu0", "cuda0")
    warm = placed_greedy(problem, names, 5.0, fit_budget_s=60.0)
    on_warm = evict_placed(problem, names, home_of(warm.schedule, names), 60.0)
    offered: list[float] = []
    homes: list[np.ndarray] = []

    def offer(result) -> None:
        verdict = simulate(result.plan, problem.graph, problem.costs, problem.budgets)
        assert verdict.valid and all(
            verdict.peak_bytes[name] <= problem.budgets[name] for name in names
        )
        offered.append(result.simulation.total_ms)
        homes.append(home_of(result.schedule, names))

    evict_module.evict_bands(problem, names, 120.0, offer)
    assert offered == sorted(offered, reverse=True)
    assert offered[-1] < on_warm.simulation.total_ms
    assert np.count_nonzero(homes[-1] != homes[-2]) == 1


@pytest.mark.parametrize("seed", range(12))
def test_profile_is_the_simulators_verdict(seed):
    """Cost and each device's peak as the compiled plan replays in the simulator, on random
    placements and keep policies; no stage's peak is below what the simulator sees in it
    (a stage also counts what it starts with)."""
    rng = np.random.default_rng(seed)
    graph = training_graph(diamond() if seed % 2 else chain(5))
    problem = budgeted(graph, 100)
    names = ("cpu0", "cuda0")
    T, D = len(graph), len(names)
    home = rng.integers(0, D, T)
    S = (rng.random((D, T, T)) < 0.4) & np.tril(np.ones((T, T), dtype=bool), -1)[None]
    R, S = solve_and_prune_placed(graph, S & (home == np.arange(D)[:, None, None]), home)
    found = profile(problem, names, R, S)
    plan = compile_plan(
        graph, Schedule(names, R, S), problem.plan_devices(names), "t", problem.costs
    )
    verdict = simulate(plan, graph, problem.costs, dict.fromkeys(names))
    assert verdict.valid
    assert found.cost_ms == pytest.approx(verdict.total_ms)
    for d, name in enumerate(names):
        assert found.peaks[d].max() == verdict.peak_bytes[name]
        for t in range(T):
            steps = zip(plan.steps, verdict.timeline[name], strict=True)
            during = [memory for step, memory in steps if step.stage == t]
            assert not during or found.peaks[d, t] >= max(during)


@pytest.mark.parametrize("seed", range(12))
def test_the_sparse_solve_on_a_placement_is_the_dense_one(seed):
    """Holds kept on each node's home: the one-device sparse R solve, spread over the
    homes, is ``solve_and_prune_placed``'s schedule, and ``profile_placed`` scores it as
    ``profile`` scores the dense one."""
    rng = np.random.default_rng(seed)
    graph = training_graph(diamond() if seed % 2 else chain(5))
    problem = budgeted(graph, 100)
    names = ("cpu0", "cuda0")
    T, D = len(graph), len(names)
    home = rng.integers(0, D, T)
    kept = (rng.random((T, T)) < 0.4) & np.tril(np.ones((T, T), dtype=bool), -1)
    on = home[None, None, :] == np.arange(D)[:, None, None]
    R, S = solve_and_prune_placed(graph, kept[None] & on, home)
    sparse = solve_and_prune_sparse(graph, holds_from_dense(kept))
    assert np.array_equal(sparse.R()[None] & on, R)
    assert np.array_equal(sparse.S()[None] & on, S)
    dense, placed = (
        profile(problem, names, R, S),
        Profiler(problem, names).profile_placed(sparse, home),
    )
    assert placed.cost_ms == pytest.approx(dense.cost_ms)
    assert np.array_equal(placed.peaks, dense.peaks)


def test_eviction_on_a_placement_beats_chens_policies_there():
    """U-Net at 25% on cpu+cuda with its deep middle (forward layers 21-42 and their
    gradients) on cpu0: eviction fits, computes each node only on its home, and costs no
    more than the heuristic's best plan of Chen's policies on that placement."""
    problem = _zoo_problem("unet", 25, ("cpu0", "cuda0"))
    layer = forward_layer(problem)
    home = np.where((layer >= 21) & (layer <= 42), 0, 1).astype(np.int64)
    result = evict_placed(problem, ("cpu0", "cuda0"), home, time_budget_s=60)
    assert result.feasible, result.message
    elsewhere = np.arange(2)[:, None, None] != home[None, None, :]
    assert not (result.schedule.R & elsewhere).any()
    assert simulate(result.plan, problem.graph, problem.costs, problem.budgets).valid
    chen = placed_on(problem, ("cpu0", "cuda0"), home)
    if chen.feasible:
        assert result.simulation.total_ms <= chen.simulation.total_ms + 1e-9


@pytest.mark.parametrize("calls", [1, 5, 40, 200])
def test_a_cancel_stops_eviction_between_two_candidates(monkeypatch, calls):
    """The user cancels while eviction scores its ``calls``-th candidate: it scores at
    most one more (each step scores every value held through the peak stage, each refill
    round every gap: on large graphs, seconds) and still returns its incumbent, judged."""
    problem = _zoo_problem("unet", 25, ("cuda0",))
    cancel = threading.Event()
    problem = Problem(problem.graph, problem.costs, problem.budgets, SolverSettings(cancel=cancel))
    scored = {"before": 0, "after": 0}
    score = evict_module._EvictionSetup.state

    def counting(self, holds):
        scored["after" if cancel.is_set() else "before"] += 1
        if scored["before"] == calls:
            cancel.set()
        return score(self, holds)

    monkeypatch.setattr(evict_module._EvictionSetup, "state", counting)
    result = greedy_evict(problem, "cuda0", time_budget_s=60)
    assert scored["before"] == calls
    assert scored["after"] <= 1
    assert result.simulation is not None  # judged: a plan, or what it needs


def test_the_strategy_descends_to_a_plan_that_fits_past_its_time_budget() -> None:
    """``greedy_evict`` run as a strategy: its descent to a first plan that fits goes on
    past ``evict_time_s`` (here none at all) for up to ``evict_fit_s``, so that a slow
    moment does not report a budget it meets as infeasible; with no time for the descent
    either, it stops over the budget and says that its time ran out, not that the budget
    is infeasible, and what its last plan needs."""
    problem = _zoo_problem("resnet18", 50, ("cuda0",))
    assert best_baseline(problem, ("cuda0",)) is None

    def planned(config: SearchConfig) -> StrategyResult:
        settings = replace(problem.solver, search=config)
        return run_strategy("greedy_evict", replace(problem, solver=settings), "cuda0")

    fitted = planned(SearchConfig(evict_time_s=0.0))
    assert fitted.feasible, fitted.message
    assert fitted.simulation is not None
    assert fitted.simulation.peak_bytes["cuda0"] <= problem.budgets["cuda0"]
    cut = planned(SearchConfig(evict_time_s=0.0, evict_fit_s=0.0))
    assert not cut.feasible and "infeasible" not in cut.message
    assert (
        cut.message.startswith("greedy_evict ran out of time (") and "needs at least" in cut.message
    )
