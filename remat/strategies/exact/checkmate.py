"""Checkmate's strategies on one device: the MILP (section 4, eq. 9) solved by the exact
search, and LP rounding (section 5, Algorithm 2)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial

from remat.formulations import Formulation
from remat.formulations.checkmate import build_checkmate
from remat.plan import SolverInfo
from remat.schedule import Schedule
from remat.solvers.model import SolveResult
from remat.strategies.common.policy import device_fixed_bytes
from remat.strategies.common.problem import (
    Evaluation,
    Problem,
    StrategyResult,
    evaluate,
    select_best,
)
from remat.strategies.common.rsolve import solve_r
from remat.strategies.exact.rins import Offer, relax_and_improve
from remat.strategies.exact.search import (
    StrategyVariants,
    optimize,
    solve_alone,
    start_search,
    unfit,
)
from remat.strategies.exact.state import Search

logger = logging.getLogger(__name__)


def checkmate_milp(
    problem: Problem,
    device: str,
    *,
    coarse: bool = True,
    decompose: bool = True,
    restrict: bool = True,
) -> StrategyResult:
    """Checkmate's MILP (eq. 9) on one device, warm-started from the best baseline and
    greedy eviction (``search.warm_start``) and, on graphs of ``coarse_min_nodes`` or more,
    the coarse graph's plan, with the LP relaxation and RINS beside it
    (``rins.relax_and_improve``); large graphs are decomposed (their parts, like the coarse
    graph, without RINS)."""
    start = time.monotonic()
    if (unfit_result := unfit(problem, "checkmate_milp", (device,))) is not None:
        return unfit_result
    fixed = device_fixed_bytes(problem, device)

    def build(p: Problem) -> Formulation:
        return build_checkmate(p.graph, p.costs, device, p.budgets.get(device), fixed)

    def restricted(search: Search, formulation: Formulation, offer: Offer) -> None:
        if restrict:
            relax_and_improve(search, formulation, offer)

    variant = partial(checkmate_milp, device=device, restrict=False)
    variants = StrategyVariants(variant, coarse, decompose, restricted)
    search = start_search(problem, (device,), variants, start)
    return optimize(search, "checkmate_milp", (device,), build, variants)


def checkmate_lp_rounding(problem: Problem, device: str) -> StrategyResult:
    """Checkmate Algorithm 2: solve the LP relaxation at (1 - epsilon) x budget, round S
    deterministically (S* > 0.5), solve R exactly, check with the simulator; swept over
    epsilon (``SearchConfig.lp_epsilons``), the cheapest plan within the budget wins. The
    bound is the LP at epsilon 0. The sweep shares the time limit and stops when it is
    spent (epsilon 0 always runs)."""
    config = problem.solver.search
    deadline = time.monotonic() + problem.solver.options.time_limit_s
    if (unfit_result := unfit(problem, "checkmate_lp_rounding", (device,))) is not None:
        return unfit_result
    budget = problem.budgets.get(device)
    fixed = device_fixed_bytes(problem, device)
    evaluations: list[Evaluation] = []
    bound: SolveResult | None = None
    seconds = 0.0
    for epsilon in config.lp_epsilons if budget is not None else (0.0,):
        scaled = None if budget is None else fixed + int((budget - fixed) * (1 - epsilon))
        left = deadline - time.monotonic()
        if bound is not None and left <= 0:
            break
        formulation = build_checkmate(problem.graph, problem.costs, device, scaled, fixed)
        logger.debug("LP rounding: LP relaxation at epsilon %g", epsilon)
        relaxation = formulation.lp_relaxation()
        relaxed = solve_alone(problem, relaxation, max(left, config.min_lp_s))
        seconds += relaxed.seconds
        if epsilon == 0.0:
            bound = relaxed
        if relaxed.x is None:
            continue
        S = formulation.decode(relaxed.x).S[0]  # decode rounds at 0.5 (Algorithm 2)
        schedule = Schedule.single(device, solve_r(problem.graph, S), S)
        evaluations.append(evaluate(problem, schedule, "checkmate_lp_rounding"))
    result = select_best("checkmate_lp_rounding", evaluations)
    if not result.feasible or result.plan is None or result.simulation is None:
        return result
    objective = result.simulation.total_ms
    lower = problem.costs.ideal_ms(device)
    if bound is not None and bound.bound is not None:  # the LP solved to optimality
        lower = max(lower, bound.bound)
    lower = min(lower, objective)
    gap = (objective - lower) / objective if objective > 0 else 0.0
    info = SolverInfo("feasible", objective, lower, gap, seconds)
    return replace(result, plan=replace(result.plan, solver=info))
