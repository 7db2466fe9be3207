"""XEngine's restrictions on several devices, solved one after the other beside the full
model (in the search's ``remat-restricted`` thread): restrictions find plans of the whole
problem, never a bound, so only their plans are offered to the search; the LP relaxation
between them (``rins``) finds the bound.

0. Greedy eviction on each device alone where a baseline fits it alone
   (``evict.greedy_evict``), then on the placement of the warm start
   (``evict.evict_placed``): the warm start on several devices comes from Chen's policies,
   which eviction beats on the same placement.
1. Placement only (``XEngineModel.keep_all``: no recomputation, every value kept on its
   device until its last use), for ``restricted_share`` of the limit. Where keeping
   everything fits on some split of the devices it finds that split's optimum quickly.
2. Where it finds none, greedy eviction on band placements, then node moves from the best
   band, if eviction is quick (``evict.evict_bands``).
3. Where keep_all finds none, or finds a plan before the full solve has any bound, the
   whole model's LP relaxation (``rins.solve_relaxation``): its optimum is a bound of the
   whole problem, reported to the search; the full solve is suspended meanwhile.
4. RINS from the LP's optimum (``rins.improve_by_rins``).
5. Then, where keep_all found no plan and the LP's placement is out of reach, node moves
   from the incumbent until the full solve ends (``_move_nodes``).
6. Or, with ``placement_min_s`` left, the LP's placement: each node on the device with the
   largest R[d,i,i], the model restricted to it (``XEngineModel.placed``) and solved from
   the heuristic's plan for that placement until the full solve ends. The LP's placement
   can lie in a neighbourhood that neither the full nor the coarse solve reaches.

The evidence for each step is in docs/solvers.md, "The search in detail". On one device
only the LP relaxation and RINS apply (``rins.relax_and_improve``: keep_all is
checkpoint-all there).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from remat.errors import ScheduleError
from remat.formulations.xengine import XEngineModel
from remat.solvers.model import MILPModel
from remat.strategies.common.problem import Problem, StrategyResult, cheapest
from remat.strategies.exact.rins import Offer, improve_by_rins, solve_beside, solve_relaxation
from remat.strategies.exact.state import Search
from remat.strategies.heuristics.evict import (
    evict_bands,
    evict_moves,
    evict_placed,
    greedy_evict,
    home_of,
)
from remat.strategies.heuristics.placed import placed_on

logger = logging.getLogger(__name__)


def solve_restrictions(search: Search, formulation: XEngineModel, offer: Offer) -> None:
    """Greedy eviction on each device alone and on the warm start's placement, keep_all,
    then, if it found no plan, greedy eviction on band placements (where eviction is
    quick), then, if keep_all found no plan or no solve has reported a bound yet, the
    whole model's LP relaxation (its optimum a bound of the whole problem, reported to the
    search) and RINS from its optimum, then, if keep_all found no plan, the model
    restricted to the LP's placement where enough time is left, node moves from the
    incumbent where not."""
    config = search.problem.solver.search
    limit = search.problem.solver.options.time_limit_s
    _evict_on_each_device(search, formulation.devices)
    took = _evict_on_warm_start(search, formulation.devices)
    logger.debug("restrictions: placement only (keep_all)")
    kept = solve_beside(search, formulation.keep_all(), offer, limit * config.restricted_share)
    logger.debug("restrictions: keep_all %s", "found a plan" if kept.x is not None else "none")
    if kept.x is not None and search.bound > search.start_bound:
        return
    if kept.x is None:
        _evict_on_bands(search, formulation.devices, took)
    relaxed = solve_relaxation(search, formulation)
    if relaxed is not None:
        improve_by_rins(search, formulation, relaxed, offer)
    if kept.x is not None:
        return
    if relaxed is None or search.time_left() < config.placement_min_s:
        _move_nodes(search, formulation.devices)
        return
    home = formulation.home(relaxed)
    if not search.side_stop().is_set():
        logger.debug("restrictions: the model on the LP relaxation's placement")
        model = _placed(search, formulation, home)
        solve_beside(search, model, offer, search.time_left())


def _evict_on_warm_start(search: Search, names: tuple[str, ...]) -> float | None:
    """Greedy eviction on the placement of the incumbent (the warm start), offered to the
    search, for ``restricted_share`` of the limit rather than the heuristic's own budget
    (beside the other solves it would run out before its plan fits). Here rather than in
    the warm start, so that the first plan does not wait for it. The seconds it took, if
    it ran."""
    warm = _placed_plan(search)
    if warm is None or warm.schedule is None:
        return None
    home = home_of(warm.schedule, names)
    seconds = (
        search.problem.solver.options.time_limit_s * search.problem.solver.search.restricted_share
    )
    logger.debug("restrictions: greedy eviction on the warm start's placement")
    started = time.monotonic()
    search.offer(evict_placed(search.problem, names, home, seconds))
    return time.monotonic() - started


def _evict_on_each_device(search: Search, names: tuple[str, ...]) -> None:
    """Greedy eviction on each device alone (``evict.greedy_evict``, the one-device warm
    start), offered to the search: XEngine's schedules include every one-device schedule,
    so a second device must not leave a more expensive plan than eviction on one, and the
    warm start on several devices has only the baselines and the multi-device heuristic.
    With the warm start's time budget; skipped on a device whose ideal (every node once, on
    it) is not under the incumbent. Also where no baseline fits the device alone: there
    eviction may still find the cheapest plan of all (a slow second device)."""
    problem = search.problem
    config = problem.solver.search
    seconds = min(
        config.placed_time_s, problem.solver.options.time_limit_s * config.restricted_share
    )
    for name in names:
        incumbent_ms = search.best_ms
        if search.side_stop().is_set():
            return
        if incumbent_ms is not None and problem.costs.ideal_ms(name) >= incumbent_ms:
            continue
        logger.debug("restrictions: greedy eviction on %s alone", name)
        search.offer(greedy_evict(problem, name, min(seconds, search.time_left())))


def _placed_plan(search: Search) -> StrategyResult | None:
    """The incumbent, if it runs on several devices (a one-device plan's placement is that
    device: nothing to place)."""
    best = search.best
    if best is None or best.schedule is None or len(set(best.schedule.devices)) < 2:
        return None
    return best


def _evict_on_bands(search: Search, names: tuple[str, ...], took: float | None) -> None:
    """Greedy eviction on band placements (``evict.evict_bands``) for ``restricted_share``
    of the limit, where keep_all found no plan (where one keeps everything, keep_all finds
    the best) and eviction on the warm start's placement took at most 1/``band_evictions``
    of that share: where each eviction takes seconds, the bands would only delay the LP's
    bound."""
    config = search.problem.solver.search
    limit = search.problem.solver.options.time_limit_s
    seconds = min(limit * config.restricted_share, search.time_left())
    if took is None or took * config.band_evictions > seconds or search.side_stop().is_set():
        return
    logger.debug("restrictions: greedy eviction on band placements")
    evict_bands(search.problem, names, seconds, search.offer)


def _move_nodes(search: Search, names: tuple[str, ...]) -> None:
    """Node moves (``evict.evict_moves``) from the placement of the incumbent until the
    full solve ends, where keep_all found no plan and the LP's placement is out of reach:
    the thread would idle otherwise."""
    best = _placed_plan(search)
    if best is None or best.simulation is None or best.schedule is None:
        return
    logger.debug("restrictions: node moves from the incumbent")
    problem = search.problem
    settings = replace(problem.solver, cancel=search.side_stop())
    watched = Problem(problem.graph, problem.costs, problem.budgets, settings)
    home = home_of(best.schedule, names)
    deadline = time.monotonic() + search.time_left()
    evict_moves(watched, names, home, best.simulation.total_ms, deadline, search.offer)


def _placed(search: Search, formulation: XEngineModel, home: np.ndarray) -> MILPModel:
    """The model restricted to ``home``, started from the cheaper of the heuristic's plan
    for it and greedy eviction on it (offered to the search too) when the model accepts
    it."""
    problem, names = search.problem, formulation.devices
    seconds = problem.solver.search.placed_time_s
    heuristic = placed_on(problem, names, home, seconds)
    evicted = evict_placed(problem, names, home, seconds)
    warm = cheapest(heuristic, evicted)
    model = formulation.placed(home)
    if warm is None or warm.schedule is None:
        return model
    search.offer(warm)
    try:
        return replace(model, start=formulation.encode(warm.schedule))
    except ScheduleError:
        return model  # the heuristic's plan breaks one of the model's rules: start cold
