"""The optimal strategies: Checkmate's MILP (section 4) and LP rounding (section 5), and
XEngine's multi-device MIQP (section 3.2).

Each builds its formulation, warm-starts it from the best baseline, solves it in a
subprocess (``remat.solvers.runner``), decodes R and S and lets the simulator judge the
plan. A solve never blocks a plan on a proof: a stopped solve returns its incumbent, and a
solve without one returns the warm start. The reported bound is a proven lower bound on
the whole problem: the solver's bound, or the ideal cost (every node once on its fastest
device, no copies), whichever is larger.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from remat.errors import ScheduleError
from remat.formulations import Formulation
from remat.formulations.checkmate import build_checkmate
from remat.formulations.xengine import XEngineModel, build_xengine
from remat.plan import SolverInfo
from remat.schedule import Schedule
from remat.solvers import runner
from remat.solvers.model import MILPModel, SolveResult, SolveStatus
from remat.strategies.base import (
    Evaluation,
    Problem,
    StrategyResult,
    best_baseline,
    cheapest,
    evaluate,
    select_best,
)
from remat.strategies.decompose import PartSolvers, is_large, solve_parts
from remat.strategies.evict import greedy_evict
from remat.strategies.floor import shortfall
from remat.strategies.placed import TIME_BUDGET_S as PLACED_TIME_BUDGET_S
from remat.strategies.placed import placed_greedy
from remat.strategies.policy import device_fixed_bytes
from remat.strategies.restrict import Offer, relax_and_improve, solve_restrictions
from remat.strategies.rsolve import solve_r
from remat.strategies.search import SOLVE_GRACE_S, Beside, Search, start_coarse

LP_EPSILONS = (0.0, 0.05, 0.1, 0.2, 0.3)  # Checkmate section 5.3 and appendix D: a sweep
MIN_LP_S = 1.0  # the LP at epsilon 0 (the bound) gets at least this long
PROVEN_GAP = 1e-9  # relative: an objective this close to a proven bound is optimal
FIT_SHARE = 0.5  # of the time limit: eviction's descent to a first plan that fits, at most
ALONE_SHARE = 0.25  # of the time left: a large graph's one-device solve before its parts


def _reaches(warm: StrategyResult | None, ideal: float) -> bool:
    """The warm start already costs the ideal (a lower bound): it is optimal, no solve."""
    if warm is None or warm.simulation is None:
        return False
    return warm.simulation.total_ms <= ideal * (1 + PROVEN_GAP)


def _no_solve() -> SolveResult:
    reason = "the warm start costs the ideal"
    return SolveResult(SolveStatus.OPTIMAL, None, None, None, None, 0.0, reason)


def _solve(
    problem: Problem,
    model: MILPModel,
    search: Search | None = None,
    seconds: float | None = None,
    on_incumbent: runner.Incumbent | None = None,
) -> SolveResult:
    """A solve in a subprocess, for ``seconds`` (default: the time limit); within a search,
    for the time it has left, reporting through it."""
    settings = problem.solver
    options, listener, cancel = settings.options, settings.on_progress, settings.cancel
    hold = None
    if seconds is not None:
        options = replace(options, time_limit_s=seconds)
    if search is not None:
        options = replace(options, time_limit_s=search.remaining())
        listener = search.on_full
        cancel = search.full_stop()
        hold = search.full_held
    return runner.solve(
        model,
        backend=settings.backend,
        options=options,
        on_progress=listener,
        cancel=cancel,
        grace_s=SOLVE_GRACE_S if search is not None else runner.DEFAULT_GRACE_S,
        on_incumbent=on_incumbent,
        hold=hold,
    )


def _finish(
    problem: Problem,
    strategy: str,
    solved: SolveResult,
    evaluation: Evaluation | None,
    fallback: StrategyResult | None,
    lower: float,
) -> StrategyResult:
    """The cheaper of the solver's plan (if the simulator accepts it) and the plan in hand
    (warm start or coarse plan); with the bound and gap of the whole problem: the larger of
    the solver's bound and ``lower`` (the ideal, or a bound found beside the solve)."""
    solver_plan = select_best(strategy, [evaluation]) if evaluation is not None else None
    chosen = cheapest(solver_plan, fallback)  # the plan in hand may beat the solver's
    if chosen is None:
        return _no_plan(strategy, solved, solver_plan)
    chosen = replace(chosen, strategy=strategy)
    assert chosen.plan is not None and chosen.simulation is not None
    objective = chosen.simulation.total_ms
    bound = max(lower, solved.bound) if solved.bound is not None else lower
    bound = min(bound, objective)
    gap = (objective - bound) / objective if objective > 0 else 0.0
    status = solved.status
    if status is SolveStatus.OPTIMAL and evaluation is None:
        status = SolveStatus.FEASIBLE
    if status in (SolveStatus.UNKNOWN, SolveStatus.ERROR):
        status = SolveStatus.FEASIBLE  # the warm start is a feasible incumbent
    if gap <= PROVEN_GAP:
        status = SolveStatus.OPTIMAL  # the bound of the whole problem proves it
    info = SolverInfo(status.value, objective, bound, gap, solved.seconds)
    plan = replace(chosen.plan, strategy=strategy, solver=info)
    message = solved.message
    return replace(chosen, plan=plan, message=message)


def _no_plan(strategy: str, solved: SolveResult, chosen: StrategyResult | None) -> StrategyResult:
    if solved.status is SolveStatus.INFEASIBLE:
        message = f"infeasible at this budget: {strategy} proved that no schedule fits"
    elif chosen is not None and chosen.message:
        message = chosen.message
    else:
        message = f"{strategy}: no schedule found ({solved.status.value}) {solved.message}"
    return StrategyResult(strategy, None, None, message.strip())


def checkmate_milp(
    problem: Problem,
    device: str,
    *,
    coarse: bool = True,
    decompose: bool = True,
    restrict: bool = True,
) -> StrategyResult:
    """Checkmate's MILP (eq. 9) on one device, warm-started from the best baseline and
    greedy eviction (``_warm_start``) and, on graphs of 40+ nodes, the coarse graph's
    plan, with the LP relaxation and RINS beside it (``restrict.relax_and_improve``);
    large graphs are decomposed (their parts, like the coarse graph, without RINS)."""
    start = time.monotonic()
    if (unfit := _unfit(problem, "checkmate_milp", (device,))) is not None:
        return unfit
    fixed = device_fixed_bytes(problem, device)

    def build(p: Problem) -> Formulation:
        return build_checkmate(p.graph, p.costs, device, p.budgets.get(device), fixed)

    def restricted(search: Search, formulation: Formulation, offer: Offer) -> None:
        if restrict:
            relax_and_improve(search, formulation, offer)

    variant = partial(checkmate_milp, device=device, restrict=False)
    ways = _Ways(variant, coarse, decompose, restricted)
    search = Search(problem, problem.costs.ideal_ms(device), start)
    _warm_start(search, (device,), ways)
    return _optimize(search, "checkmate_milp", (device,), build, ways)


def checkmate_lp_rounding(problem: Problem, device: str) -> StrategyResult:
    """Checkmate Algorithm 2: solve the LP relaxation at (1 - epsilon) x budget, round S
    deterministically (S* > 0.5), solve R exactly, check with the simulator; swept over
    epsilon, the cheapest plan within the budget wins. The bound is the LP at epsilon 0.
    The sweep shares the time limit and stops when it is spent (epsilon 0 always runs)."""
    deadline = time.monotonic() + problem.solver.options.time_limit_s
    if (unfit := _unfit(problem, "checkmate_lp_rounding", (device,))) is not None:
        return unfit
    budget = problem.budgets.get(device)
    fixed = device_fixed_bytes(problem, device)
    evaluations: list[Evaluation] = []
    bound: SolveResult | None = None
    seconds = 0.0
    for epsilon in LP_EPSILONS if budget is not None else (0.0,):
        scaled = None if budget is None else fixed + int((budget - fixed) * (1 - epsilon))
        left = deadline - time.monotonic()
        if bound is not None and left <= 0:
            break
        formulation = build_checkmate(problem.graph, problem.costs, device, scaled, fixed)
        relaxed = _solve(problem, formulation.lp_relaxation(), seconds=max(left, MIN_LP_S))
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


def xengine(
    problem: Problem,
    device: str | None = None,
    *,
    coarse: bool = True,
    decompose: bool = True,
    restrict: bool = True,
) -> StrategyResult:
    """XEngine's MIQP (eq. 1-16) over every device of the cost model, warm-started from the
    best baseline on any device, the multi-device heuristic, restrictions of the model
    (``remat.strategies.restrict``: on two or more devices placement only, then RINS from
    the LP relaxation and the LP relaxation's placement; on one the LP relaxation and RINS)
    and, on graphs of 40+ nodes, the coarse graph's plan; large graphs are decomposed
    (their parts, like the coarse graph, without the restrictions).
    ``device`` is ignored: the strategy places operators."""
    start = time.monotonic()
    names = tuple(d.name for d in problem.costs.devices)
    if (unfit := _unfit(problem, "xengine", names)) is not None:
        return unfit

    def build(p: Problem) -> Formulation:
        return build_xengine(p.graph, p.costs, {name: p.budgets.get(name) for name in names})

    def restricted(search: Search, formulation: Formulation, offer: Offer) -> None:
        if not restrict:
            return
        if len(names) == 1:  # keep_all is checkpoint-all there
            relax_and_improve(search, formulation, offer)
            return
        assert isinstance(formulation, XEngineModel)
        solve_restrictions(search, formulation, offer)

    ways = _Ways(partial(xengine, restrict=False), coarse, decompose, restricted)
    search = Search(problem, problem.costs.ideal_ms(), start)
    _warm_start(search, names, ways)
    return _optimize(search, "xengine", names, build, ways)


def _unfit(problem: Problem, strategy: str, names: Sequence[str]) -> StrategyResult | None:
    """Infeasible without a solve: some node needs more than every budget
    (``floor.shortfall``)."""
    short = shortfall(problem, names)
    return None if short is None else StrategyResult(strategy, None, None, short.message(strategy))


def _warm_start(search: Search, names: Sequence[str], ways: _Ways) -> None:
    """The best baseline on any of ``names`` and a heuristic's plans, offered to the search
    as they are found (the first plan does not wait for the heuristic's local search): on
    one device greedy eviction, or where it finds no plan the placed heuristic's local search
    on Chen's checkpoints (``placed_greedy`` on this device); on several devices the
    placed heuristic. Not on a graph to be decomposed: the heuristics are slow on large
    graphs, and each part runs them. On one device eviction's plan was the cheaper on
    every bench row where both fit (ResNet18 at 50% on cpu0 1.315 ms against 1.333, U-Net
    at 50% on cuda0 3.534 against 3.824), and the local search, after it, took 1.4-3.0 s
    of a 10 s limit from the full solve's root LP. Eviction is left out on several
    devices: the placed heuristic's plans are cheaper there (U-Net at 25%: 4.08 ms) and the
    first plan would come later; there the restricted thread runs it on the warm start's
    placement (``restrict.solve_restrictions``). The heuristics get a quarter of the limit,
    and up to ``FIT_SHARE`` of it until a first plan fits: at tight budgets no baseline
    fits, and a heuristic cut short left the solvers without a start; none found a plan in
    10 s (eviction's descent on U-Net at 25% on cuda0 takes 1.4 s of the 2.5 s, and the
    placed heuristic's first plan for the transformer at 25% on cpu+cuda came at 3.8 s)."""
    problem = search.problem
    search.offer(best_baseline(problem, names))
    if ways.decomposes(problem):
        return
    limit = problem.solver.options.time_limit_s
    seconds = min(PLACED_TIME_BUDGET_S, limit / 4)
    if len(names) == 1:
        evicted = greedy_evict(problem, names[0], seconds, fit_budget_s=limit * FIT_SHARE)
        if evicted.feasible:
            search.offer(evicted)
            return
    search.offer(placed_greedy(problem, names, seconds, search.offer, limit * FIT_SHARE))


@dataclass(frozen=True)
class _Ways:
    """How an exact strategy attacks a graph besides its full model: ``variant(problem,
    coarse=..., decompose=...)`` is the strategy itself, run on the coarse graph (without
    coarsening) or on each part of a large graph (without decomposing)."""

    variant: Callable[..., StrategyResult]
    coarse: bool
    decompose: bool
    restricted: Callable[[Search, Formulation, Offer], None] | None = None

    def decomposes(self, problem: Problem) -> bool:
        return self.decompose and is_large(problem.graph)

    def on_coarse(self, problem: Problem) -> StrategyResult:
        return self.variant(problem, coarse=False, decompose=False)

    def on_part(self, problem: Problem) -> StrategyResult:
        return self.variant(problem, coarse=self.coarse, decompose=False)


def _optimize(
    search: Search,
    strategy: str,
    names: Sequence[str],
    build: Callable[[Problem], Formulation],
    ways: _Ways,
) -> StrategyResult:
    """What the exact strategies share: stop if the warm start (``search.best``, offered
    as it was found) costs the ideal; on a large graph solve its parts
    (``solve_parts``), else solve the full model from the warm start while the coarse
    graph's solve and the strategy's restricted model (if it has one) run beside it; the
    best plan found, with the whole problem's bound."""
    problem, warm, ideal = search.problem, search.best, search.ideal
    if _reaches(warm, ideal):
        return _finish(problem, strategy, _no_solve(), None, warm, ideal)
    if ways.decomposes(problem):
        return _decomposed(problem, strategy, names, ways, search)
    # Built and encoded before the threads beside it start: beside numpy-heavy threads the
    # encoding waits for the GIL at each of its many short releases (U-Net at 25% on
    # cpu+cuda: 2.5 s instead of 0.1, until greedy eviction beside it ended).
    formulation = build(problem)
    model = formulation.model
    if warm is not None and warm.schedule is not None:
        start = _encoded(formulation.encode, _on_devices(warm.schedule, names))
        model = replace(model, start=start)
    offer = partial(_offer_incumbent, search, formulation, strategy)
    beside = [start_coarse(problem, strategy, ways.on_coarse, search) if ways.coarse else None]
    try:
        if ways.restricted is not None:
            work = partial(ways.restricted, search, formulation, offer)
            beside.append(Beside(work, "remat-restricted"))
        solved = _solve(problem, model, search, on_incumbent=offer)
    finally:
        search.full_done.set()
        for phase in beside:
            if phase is not None:
                phase.finish()
    if search.gap_met.is_set() and not problem.cancelled:
        message = "the gap target is met (with a plan found beside the solve)"
        solved = replace(solved, message=message)
    evaluation = None
    if solved.x is not None:
        evaluation = evaluate(problem, formulation.decode(solved.x), strategy)
    return _finish(problem, strategy, solved, evaluation, search.best, search.bound)


def _offer_incumbent(
    search: Search, formulation: Formulation, strategy: str, x: np.ndarray, _objective: float
) -> None:
    """A solver incumbent, while the solve runs: judged by the simulator and offered to
    the search, so that the plan in hand (progress, ``on_plan``, a cancelled solve) is the
    best found so far."""
    try:
        schedule = formulation.decode(x)
    except ScheduleError:
        return  # within tolerances but not a schedule; the solve's result is judged again
    search.judge(schedule, strategy)


def _decomposed(
    problem: Problem, strategy: str, names: Sequence[str], ways: _Ways, search: Search
) -> StrategyResult:
    """The stitched plan of the parts, or the warm start if it is cheaper (or the parts
    found none); the bound is the ideal: no part's bound bounds the whole. On several
    devices the graph is first solved on one device alone (``_alone``)."""
    started = time.monotonic()
    if len(names) > 1:
        search.offer(_alone(problem, names, search))

    def quick(part: Problem) -> StrategyResult:
        found = best_baseline(part, names)
        return found or StrategyResult(strategy, None, None, "no baseline fits its budget")

    solvers = PartSolvers(ways.on_part, quick)
    seconds = search.time_left()
    stitched = solve_parts(problem, strategy, names, solvers, search.heartbeat, seconds)
    search.offer(stitched)
    if stitched.plan is not None and stitched.simulation is not None:
        message = f"decomposed: stitched plan {stitched.simulation.total_ms:.4g} ms"
    else:
        message = stitched.message
    solved = SolveResult(
        SolveStatus.UNKNOWN, None, None, None, None, time.monotonic() - started, message
    )
    return _finish(problem, strategy, solved, None, search.best, search.ideal)


def _alone(problem: Problem, names: Sequence[str], search: Search) -> StrategyResult | None:
    """A large graph on several devices: ``checkmate_milp`` (decomposed too) on the device
    with the lowest ideal that the memory floor admits alone, for ``ALONE_SHARE`` of the
    time left, so that a second device does not leave a dearer plan than one: the parts'
    plans on several devices reserve every fixed tensor on each device and copy between
    parts (the 467-node transformer stack at 50% on cpu+cuda: 3.237 ms, on cpu0 alone
    3.058). Its bound bounds one device only, so its progress is not reported."""
    admitted = [name for name in names if shortfall(problem, (name,)) is None]
    if not admitted:
        return None
    device = min(admitted, key=problem.costs.ideal_ms)
    settings = problem.solver
    options = replace(settings.options, time_limit_s=search.time_left() * ALONE_SHARE)
    quiet = replace(
        settings, options=options, on_progress=lambda _: search.heartbeat(), on_plan=None
    )
    return checkmate_milp(replace(problem, solver=quiet), device)


def _encoded(encode: Callable[[Schedule], np.ndarray], schedule: Schedule) -> np.ndarray | None:
    """The warm start, or none when the baseline's schedule does not fit the model (the
    solver then starts cold; the baseline stays the fallback plan)."""
    try:
        return encode(schedule)
    except ScheduleError:
        return None


def _on_devices(schedule: Schedule, names: Sequence[str]) -> Schedule:
    """A single-device schedule embedded in an all-devices one (zeros elsewhere)."""
    D, T, n = len(names), schedule.stages, schedule.size
    R = np.zeros((D, T, n), dtype=bool)
    S = np.zeros((D, T, n), dtype=bool)
    for index, name in enumerate(schedule.devices):
        R[names.index(name)] = schedule.R[index]
        S[names.index(name)] = schedule.S[index]
    return Schedule(tuple(names), R, S)
