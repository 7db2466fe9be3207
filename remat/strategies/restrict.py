"""Restrictions of XEngine's model, and its LP relaxation, solved one after the other
beside the full model (in the search's ``remat-restricted`` thread): the restrictions find
plans of the whole problem, never a bound, so only their plans are offered to the search;
the relaxation finds a bound.

0. Greedy eviction on each device alone where a baseline fits it alone
   (``evict.greedy_evict``; U-Net at 50% on cpu+cuda: 3.824 -> 3.534 ms, on cuda0), then
   on the placement of the warm start, which the multi-device heuristic found with Chen's
   policies (``evict.evict_placed``; U-Net at 25% on cpu+cuda: 4.08 -> 3.904 ms in 2 s).
1. Placement only (``XEngineModel.keep_all``: no recomputation, every value kept on its
   device until its last use), for a share of the time limit. Where keeping everything
   fits on some split of the devices it finds that split's optimum in seconds (ResNet18
   and VGG16 at 25% on cpu+cuda: the whole problem's optimum).
2. Where it finds none, greedy eviction on band placements, then node moves from the best
   band, if eviction is quick (``evict.evict_bands``; the transformer at 25%: 0.666 ->
   0.5695 -> 0.522 ms).
3. Where keep_all finds none (U-Net at 25% on cpu+cuda: proven infeasible in 5 s), or finds a
   plan before the full solve has any bound (ResNet18 at 25%, U-Net at 50%), the whole
   model's LP relaxation, solved to optimality: not a restriction but a relaxation, so its
   optimum is a bound of the whole problem, reported to the search (the full solve's root
   LP comes much later: ``_relaxation``). The full solve is suspended meanwhile: its root
   is that same LP, which it reaches later than the LP alone, so it has little to show
   before then, and on 2 cores the LP gets one to itself.
4. RINS from the LP's optimum (``improve_by_rins``): the model with every integer variable
   fixed where the plan in hand and the LP agree, solved from that plan, again from each
   better plan until one brings nothing (U-Net at 25%: 3.904 -> 3.755 ms in 10 s alone; at
   50%, where keep_all's plan is dearer than the plan in hand, 3.534 -> 3.396 ms).
5. Then, where keep_all found no plan and the LP's placement is out of reach (below), node
   moves from the plan in hand until the full solve ends (``_move_nodes``; U-Net at 25%,
   before RINS: 3.904 -> 3.862 ms).
6. Or, on long solves (``PLACEMENT_MIN_S`` left), the LP's placement: each node on the
   device with the largest R[d,i,i], the model restricted to it (``XEngineModel.placed``)
   and solved from the heuristic's plan for that placement (``placed_on``) until the full
   solve ends. The LP puts the U-Net's bottleneck and its gradients on the CPU; the
   heuristic prefers the whole deep half there, and neither the full nor the coarse solve
   leaves that neighbourhood. U-Net at 25% on cpu+cuda in 300 s:
   3.751 ms (gap 3.1%) instead of 3.939 (gap 7.6%) once, from eviction's 3.92 ms; beside
   three solver processes eviction now runs out of its 5 s before its plan fits and the
   model, from the heuristic's 4.26 ms, finds nothing under 3.904 in 240 s, nor does it
   from eviction's 3.937 (the full solve held while that start is built).

On one device (``relax_and_improve``) only the LP relaxation and RINS apply (keep_all is
checkpoint-all there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from remat.errors import ScheduleError
from remat.formulations import Formulation
from remat.formulations.xengine import XEngineModel
from remat.solvers import runner
from remat.solvers.model import MILPModel, SolveResult, SolveStatus
from remat.strategies.base import Problem, StrategyResult, best_baseline, cheapest
from remat.strategies.evict import (
    evict_bands,
    evict_moves,
    evict_placed,
    greedy_evict,
    home_of,
)
from remat.strategies.placed import TIME_BUDGET_S as PLACED_TIME_BUDGET_S
from remat.strategies.placed import placed_on
from remat.strategies.search import SOLVE_GRACE_S, Search

RESTRICTED_SHARE = 0.25  # of the time limit, at most, for keep_all
BAND_EVICTIONS = 20  # evictions the band search must get within the share to run
# Left of the limit to start on the LP's placement: on U-Net at 25% on cpu+cuda its first
# better plan came 196 s after the start, and with 70 s left (a 120 s solve) it only took
# CPU from the coarse solve (4.08 ms at the end instead of 3.94).
PLACEMENT_MIN_S = 180.0
LP = "highs"  # an LP, whatever the backend of the MILPs
# RINS's sub-MIPs on one device, whatever the problem's backend: on U-Net at 25% on cuda0
# CP-SAT has 4.289 ms at 4.4 s, HiGHS its first better plan (4.287) at 10.6 s; on MobileNet
# at 25% 5.2 s (optimal at 5.6) against 30.7. On several devices HiGHS is the quicker
# (U-Net at 25%: 4.1 s against 10.6; CP-SAT's integer scaling of the larger model).
RINS_ONE_DEVICE = "cpsat"
AGREE = 1e-6  # RINS: an LP value this close to the incumbent's integer value agrees with it

Offer = Callable[[np.ndarray, float], None]  # a solver incumbent of the full model's variables


def solve_restrictions(search: Search, formulation: XEngineModel, offer: Offer) -> None:
    """Greedy eviction on each device alone and on the warm start's placement, keep_all,
    then, if it found no plan, greedy eviction on band placements (where eviction is
    quick), then, if keep_all found no plan or the search has no bound yet, the whole
    model's LP relaxation (its optimum a bound of the whole problem, reported to the
    search) and RINS from its optimum, then, if keep_all found no plan, the model
    restricted to the LP's placement where enough time is left, node moves from the plan
    in hand where not."""
    limit = search.problem.solver.options.time_limit_s
    _evict_on_each_device(search, formulation.devices)
    took = _evict_on_warm_start(search, formulation.devices)
    kept = _solve(search, formulation.keep_all(), offer, limit * RESTRICTED_SHARE)
    if kept.x is not None and search.bound > search.ideal:
        return
    if kept.x is None:
        _evict_on_bands(search, formulation.devices, took)
    relaxed = _relaxation(search, formulation)
    if relaxed is not None:
        improve_by_rins(search, formulation, relaxed, offer)
    if kept.x is not None:
        return
    if relaxed is None or search.time_left() < PLACEMENT_MIN_S:
        _move_nodes(search, formulation.devices)
        return
    home = formulation.home(relaxed)
    if not search.beside_stop().is_set():
        _solve(search, _placed(search, formulation, home), offer, search.time_left())


def relax_and_improve(search: Search, formulation: Formulation, offer: Offer) -> None:
    """One device: the LP relaxation (its optimum a bound of the whole problem), then RINS
    from its optimum (``improve_by_rins``). At 25% on cuda0, U-Net 4.637 -> 4.274 ms,
    MobileNet 2.936 -> 2.881 (eviction's plans, which HiGHS's full solve did not improve
    in 60 s); the transformer at 50% on cpu0 0.528 -> 0.511 ms in 0.2 s."""
    relaxed = _relaxation(search, formulation)
    if relaxed is not None:
        improve_by_rins(search, formulation, relaxed, offer, RINS_ONE_DEVICE)


def improve_by_rins(
    search: Search, formulation: Formulation, relaxed: np.ndarray, offer: Offer, backend: str = ""
) -> None:
    """Relaxation induced neighbourhood search (Danna, Rothberg and Le Pape, 2005): the
    model restricted to the neighbourhood where the plan in hand and the LP relaxation's
    optimum ``relaxed`` agree (``rins_neighbourhood``), solved from that plan, its
    incumbents offered; again from each better plan in hand (from here or elsewhere) until
    a neighbourhood brings nothing or the full solve ends. On U-Net at 25% on cpu+cuda the
    first neighbourhood leaves 5k of 101k integer variables free, and HiGHS solves it to
    optimality in 10 s: 3.904 -> 3.755 ms (the full model: nothing better in 120 s); the
    next one, 4k free, brings nothing in 4 s. Sub-MIPs solved with ``backend`` (default:
    the problem's)."""
    model = formulation.model
    relaxed = relaxed[: model.n_vars]  # without the linearization's products
    searched: set[float] = set()  # the plans in hand whose neighbourhood was solved
    while not search.beside_stop().is_set() and search.time_left() > 0:
        best = search.best
        if best is None or best.schedule is None or best.simulation is None:
            return
        if best.simulation.total_ms in searched:
            return
        searched.add(best.simulation.total_ms)
        try:
            incumbent = formulation.encode(best.schedule)
        except ScheduleError:
            return  # a plan the model cannot state has no neighbourhood in it
        neighbourhood = rins_neighbourhood(model, relaxed, incumbent)
        _solve(search, neighbourhood, offer, search.time_left(), backend)


def rins_neighbourhood(model: MILPModel, relaxed: np.ndarray, incumbent: np.ndarray) -> MILPModel:
    """RINS's sub-MIP: ``model`` with each integer variable on which ``incumbent`` and the
    LP optimum ``relaxed`` agree fixed to that value, started from ``incumbent``. A
    restriction: its optimum is a plan of the whole problem, never a bound."""
    agree = model.integer & (np.abs(relaxed - incumbent) <= AGREE)
    lb, ub = model.lb.copy(), model.ub.copy()
    lb[agree] = ub[agree] = np.round(incumbent[agree])
    return replace(model, lb=lb, ub=ub, start=incumbent)


def _evict_on_warm_start(search: Search, names: tuple[str, ...]) -> float | None:
    """Greedy eviction on the placement of the plan in hand (the warm start), offered to
    the search: U-Net at 25% on cpu+cuda, 4.08 -> 3.904 ms in 2 s alone, in hand 3 s after
    the warm start beside the full and coarse solves (a share of the time limit, not the
    heuristic's 5 s: it ran out before it fit when it took 3.5 s alone). Here rather than
    in the warm start, so that the first plan does not wait for it. The seconds it took,
    if it ran."""
    warm = _placed_plan(search)
    if warm is None:
        return None
    home = home_of(warm.schedule, names)
    seconds = search.problem.solver.options.time_limit_s * RESTRICTED_SHARE
    started = time.monotonic()
    search.offer(evict_placed(search.problem, names, home, seconds))
    return time.monotonic() - started


def _evict_on_each_device(search: Search, names: tuple[str, ...]) -> None:
    """Greedy eviction on each device alone (``evict.greedy_evict``, the one-device warm
    start), offered to the search: XEngine's schedules include every one-device schedule,
    so a second device must not leave a dearer plan than eviction on one. The warm start on
    several devices has only the baselines and the multi-device heuristic (Chen's
    policies): U-Net at 50% on cpu+cuda ended at 3.824 ms in 10 s where eviction on cuda0
    alone gives 3.534 in 0.9 s.
    With the one-device warm start's time budget; skipped on a device whose ideal (every
    node once, on it) is not under the plan in hand, or where no baseline fits it alone: at
    U-Net's 25% on cuda0 eviction gives 4.637 ms in 2.6 s, where the multi-device plans are
    under 4.08, and it delayed eviction on their placement past a 10 s limit."""
    problem = search.problem
    seconds = min(PLACED_TIME_BUDGET_S, problem.solver.options.time_limit_s * RESTRICTED_SHARE)
    for name in names:
        in_hand = search.best_ms
        if search.beside_stop().is_set():
            return
        if in_hand is not None and problem.costs.ideal_ms(name) >= in_hand:
            continue
        if best_baseline(problem, (name,)) is None:
            continue  # no checkpointing fits it alone: there one device recomputes too much
        search.offer(greedy_evict(problem, name, min(seconds, search.time_left())))


def _placed_plan(search: Search) -> StrategyResult | None:
    """The plan in hand, if it runs on several devices (a one-device plan's placement is
    that device: nothing to place)."""
    best = search.best
    if best is None or best.schedule is None or len(set(best.schedule.devices)) < 2:
        return None
    return best


def _evict_on_bands(search: Search, names: tuple[str, ...], took: float | None) -> None:
    """Greedy eviction on band placements (``evict.evict_bands``) for a share of the limit,
    where keep_all found no plan (where one keeps everything, keep_all finds the best) and
    eviction on the warm start's placement took at most 1/``BAND_EVICTIONS`` of that share.
    The transformer at 25% on cpu+cuda: 0.666 -> 0.5695 ms, at 50% 0.497 -> 0.466, in
    under a second alone, then node moves: 0.522 and 0.457 ms. Before keep_all, the LP's
    bound came too late; after the LP, the plan; here, at a 10 s limit, the moves are cut
    short (0.540-0.570 ms) and the bound comes in one run of four. U-Net's evictions
    take seconds each: there it found nothing in 20 s and would delay the LP's bound."""
    seconds = min(search.problem.solver.options.time_limit_s * RESTRICTED_SHARE, search.time_left())
    if took is None or took * BAND_EVICTIONS > seconds or search.beside_stop().is_set():
        return
    evict_bands(search.problem, names, seconds, search.offer)


def _move_nodes(search: Search, names: tuple[str, ...]) -> None:
    """Node moves (``evict.evict_moves``) from the placement of the plan in hand until the
    full solve ends, where keep_all found no plan and the LP's placement is out of reach:
    the thread would idle otherwise. U-Net at 25% on cpu+cuda, from eviction's 3.904 ms:
    3.876 after one eviction, 3.862 after three (7.8 s alone; each takes 2-3 s there),
    nothing more in 58 evictions after that."""
    best = _placed_plan(search)
    if best is None or best.simulation is None:
        return
    problem = search.problem
    settings = replace(problem.solver, cancel=search.beside_stop())
    watched = Problem(problem.graph, problem.costs, problem.budgets, settings)
    home = home_of(best.schedule, names)
    deadline = time.monotonic() + search.time_left()
    evict_moves(watched, names, home, best.simulation.total_ms, deadline, search.offer)


def _relaxation(search: Search, formulation: Formulation) -> np.ndarray | None:
    """The whole model's LP relaxation, solved to optimality: its objective is reported to
    the search as a bound of the whole problem (``Search.on_bound``), the full solve
    suspended meanwhile (``Search.full_held``). The full solve's root LP comes late: U-Net
    at 25% on cpu+cuda, HiGHS alone, the MIP's root bound (3.611 ms) after 54-73 s
    (presolve, symmetry detection, then the same LP), the LP alone in 16 s (devex pricing,
    ``highs.LP_DUAL_PRICING``); in the 120 s search the LP's bound came at 106 s beside the
    running full solve, at 46 s with the full solve held and devex (ResNet18: 0.1% gap at
    50 s instead of 87 s)."""
    search.full_held.set()
    try:
        relaxed = _solve(search, formulation.lp_relaxation(), None, search.time_left(), LP)
    finally:
        search.full_held.clear()
    if relaxed.status is not SolveStatus.OPTIMAL or relaxed.objective is None:
        return None
    search.on_bound(relaxed.objective)
    return relaxed.x


def _placed(search: Search, formulation: XEngineModel, home: np.ndarray) -> MILPModel:
    """The model restricted to ``home``, started from the cheaper of the heuristic's plan
    for it and greedy eviction on it (offered to the search too) when the model accepts
    it. U-Net at 25% on cpu+cuda, on the coarse LP's placement (the full LP's but for two
    nodes): 4.27 and 3.920 ms."""
    problem, names = search.problem, formulation.devices
    heuristic = placed_on(problem, names, home, PLACED_TIME_BUDGET_S)
    evicted = evict_placed(problem, names, home, PLACED_TIME_BUDGET_S)
    warm = cheapest(heuristic, evicted)
    model = formulation.placed(home)
    if warm is None or warm.schedule is None:
        return model
    search.offer(warm)
    try:
        return replace(model, start=formulation.encode(warm.schedule))
    except ScheduleError:
        return model  # the heuristic's plan breaks one of the model's rules: start cold


def _solve(
    search: Search, model: MILPModel, offer: Offer | None, seconds: float, backend: str = ""
) -> SolveResult:
    """A restriction's solve (``backend``: default the problem's) for at most ``seconds``,
    stopped when the full solve ends; each incumbent, and the final solution, offered."""
    settings = search.problem.solver
    options = replace(settings.options, time_limit_s=min(seconds, search.remaining()))
    solved = runner.solve(
        model,
        backend=backend or settings.backend,
        options=options,
        on_progress=lambda _: search.heartbeat(),
        cancel=search.beside_stop(),
        grace_s=SOLVE_GRACE_S,
        on_incumbent=offer,
    )
    if offer is not None and solved.x is not None and solved.objective is not None:
        offer(solved.x, solved.objective)
    return solved
