"""The exact strategies' search, composed: warm start, then the full model's solve with
the coarse graph's solve and the strategy's restrictions beside it, or, on a large graph,
its parts solved one by one and stitched (docs/solvers.md, "The search in detail").

A solve never blocks a plan on a proof: a stopped solve returns its incumbent, and a solve
without one returns the warm start. The reported bound is a proven lower bound on the
whole problem: the solver's bound, or the ideal cost (every node once on its fastest
device, no copies), whichever is larger.

Each phase is logged at debug level (``logging.getLogger(__name__)`` and the modules of
the phases beside the full solve), so that what a search did can be followed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from remat.devices import format_bytes
from remat.errors import ScheduleError
from remat.formulations import Formulation
from remat.formulations.device_cover import DeviceCoverModel
from remat.formulations.moccasin import Placement
from remat.plan import SolverInfo
from remat.schedule import Schedule, schedule_of_steps
from remat.simulator import held_fixed_bytes
from remat.solvers import runner
from remat.solvers.model import MILPModel, Progress, SolveOptions, SolveResult, SolveStatus
from remat.strategies.baselines import best_baseline
from remat.strategies.common.beside import Beside, picklable
from remat.strategies.common.floor import shortfall
from remat.strategies.common.known import known_start
from remat.strategies.common.problem import (
    Evaluation,
    Problem,
    StrategyResult,
    cheapest,
    evaluate,
    select_best,
)
from remat.strategies.exact.cover import covers_extra_ms, device_closure_model, device_cover
from remat.strategies.exact.decompose import PartSolvers, is_large, solve_parts
from remat.strategies.exact.intervals import on_device, placed, solve_intervals
from remat.strategies.exact.rins import Offer
from remat.strategies.exact.state import AnyOf, RelaxedPlacement, Search, SideTask
from remat.strategies.exact.windows import improve_by_windows
from remat.strategies.heuristics.evict import (
    evict_moves,
    evict_placed,
    evict_pooled,
    greedy_evict,
    home_of,
)
from remat.strategies.heuristics.placed import placed_greedy

logger = logging.getLogger(__name__)

OneDevice = Callable[[Problem, str], StrategyResult]


@dataclass(frozen=True)
class StrategyVariants:
    """How an exact strategy attacks a graph besides its full model: ``variant(problem,
    coarse=..., decompose=...)`` is the strategy itself, run on the coarse graph (without
    coarsening) or on each part of a large graph (without decomposing); ``restricted``
    runs the strategy's restrictions beside the full solve; ``one_device`` (a multi-device
    strategy) solves a large graph on its best single device (``_decomposed``)."""

    variant: Callable[..., StrategyResult]
    coarse: bool
    decompose: bool
    restricted: Callable[[Search, Formulation, Offer], None] | None = None
    one_device: OneDevice | None = None

    def decomposes(self, problem: Problem) -> bool:
        return self.decompose and is_large(problem.graph, problem.solver.search)

    def on_coarse(self, problem: Problem) -> StrategyResult:
        return self.variant(problem, coarse=False, decompose=False)

    def on_part(self, problem: Problem) -> StrategyResult:
        return self.variant(problem, coarse=self.coarse, decompose=False)


def unfit(problem: Problem, strategy: str, names: Sequence[str]) -> StrategyResult | None:
    """Infeasible without a solve: some node needs more than every budget
    (``floor.shortfall``)."""
    short = shortfall(problem, names)
    if short is None:
        return None
    return StrategyResult(strategy, None, None, short.message(strategy), proven_infeasible=True)


def start_search(
    problem: Problem, names: Sequence[str], variants: StrategyVariants, start: float
) -> Search:
    """The search of a strategy called at ``start`` on ``names``: its warm start
    (``warm_start``), then the larger of the recomputation cover's and the closure cover's
    bounds (``cover.covers_extra_ms``) where ``min_solve_s`` is left, so that the first
    plan does not wait for the bound. On a graph to be decomposed the covers run from the
    start in a process beside the warm start and the parts (``_covers_beside``), so that
    neither waits and the bound has the whole search to arrive, also on a busy machine."""
    ideal = problem.costs.ideal_ms(names[0] if len(names) == 1 else None)
    search = Search(problem, ideal, start)
    config = problem.solver.search
    if variants.decomposes(problem) and search.time_left() >= config.min_solve_s:
        seconds = min(config.cover_s, search.time_left() / 4)
        work = partial(_covers_beside, search, names, seconds)
        search.starting = SideTask(work, "remat-covers")
    warm_start(search, names, variants)
    if search.starting is not None:
        return search
    if search.time_left() >= config.min_solve_s and not _reaches(search.best, ideal, 0.0):
        seconds = min(config.cover_s, search.time_left() / 4)
        extra = covers_extra_ms(problem, names, seconds)
        if extra is not None:
            search.start_from_cover(ideal + extra)
    return search


def _covers_beside(search: Search, names: Sequence[str], seconds: float) -> None:
    """The covers' bound (``covers_extra_ms``, each for at most ``seconds``) computed in a
    process beside a decomposed graph's warm start and parts, whose judging of stored-value
    choices holds this process's core for seconds; taken when it arrives, unless the search
    has ended."""
    problem = search.problem
    work = Beside(covers_extra_ms, picklable(problem), tuple(names), seconds)
    while not work.ready(0.1):
        if search.full_done.is_set() or problem.cancelled:
            work.result(time.monotonic())  # stops it
            logger.debug("covers beside: stopped with the search, before their bound")
            return
    extra, why = work.result(time.monotonic())
    if extra is None:
        logger.debug("covers beside: no bound (%s)", why or "none binds")
        return
    logger.debug("covers beside: bound +%.6g ms", extra)
    search.start_from_cover(search.ideal + extra)


def start_from_devices(search: Search, names: Sequence[str], closure: bool) -> None:
    """With ``closure`` (a decomposed graph), the device cover with closure rows
    (``bound_by_closure``): its bound, and placements for the whole graph's interval model
    (``_decomposed_on_devices``). Otherwise the device cover's bound
    (``cover.device_cover``), and where its solution places nodes on more than one device,
    greedy eviction's plan on that placement: the cover moves a node off the accelerator
    where the memory its fixed tensors free is worth more than its slower compute and
    copies, which no single-device search finds."""
    if closure:
        bound_by_closure(search, names)
        return
    config = search.problem.solver.search
    seconds = max(min(config.device_cover_s, search.time_left() / 4), config.min_solve_s)
    found = device_cover(search.problem, names, seconds, search.side_stop())
    if found is not None:
        search.on_bound(found.bound_ms)
        if found.home is not None and len(set(found.home.tolist())) > 1:
            seconds = min(config.evict_time_s, search.time_left() / 4)
            logger.debug("device cover: greedy eviction on its placement for %.3g s", seconds)
            search.offer(evict_placed(search.problem, names, found.home, seconds))
            _log_incumbent(search, "device cover")


def bound_by_closure(search: Search, names: Sequence[str]) -> None:
    """The dual bound of the device cover with closure rows (``cover.device_closure_model``)
    on ``names``, each rise reported as found, and its placements kept
    (``Search.on_placement``): first its LP relaxation's, rounded (``_rounded_placement``),
    then its MILP's incumbents'. Each solved with ``lp_backend`` on one thread in a
    subprocess for the time left, stopped with the solves beside the full one, the MILP
    also once its bound stalls where no placement of it may make the search switch
    (``_Stalled``)."""
    config = search.problem.solver.search
    cover = device_closure_model(search.problem, names)
    model = cover.model
    logger.debug("device closure cover: %d variables, for %.3g s", model.n_vars, search.remaining())
    options = replace(search.problem.solver.options, threads=1, presolve=config.closure_presolve)
    _rounded_placement(search, cover, options)
    limit = search.problem.solver.options.time_limit_s
    stalled = _Stalled(search, limit * config.stall_share, config.stall_rise, config.stall_room)

    def on_progress(progress: Progress) -> None:
        if progress.bound is not None and math.isfinite(progress.bound):
            search.on_bound(progress.bound)
            stalled.on_bound(progress.bound)

    def on_incumbent(x: np.ndarray, objective: float) -> None:
        search.on_placement(RelaxedPlacement(cover.placement(x), objective))

    solved = runner.solve(
        model,
        backend=config.lp_backend,
        options=replace(options, time_limit_s=search.remaining()),
        on_progress=on_progress,
        cancel=AnyOf((search.side_stop(), stalled)),
        grace_s=config.solve_grace_s,
        on_incumbent=on_incumbent,
    )
    if solved.bound is not None and math.isfinite(solved.bound):
        search.on_bound(solved.bound)
    if solved.x is not None and solved.objective is not None:
        on_incumbent(solved.x, solved.objective)
    why = "its bound stalled" if stalled.fired else solved.message
    logger.debug("device closure cover: bound %s (%s)", solved.bound, why)


def _rounded_placement(search: Search, cover: DeviceCoverModel, options: SolveOptions) -> None:
    """The device cover's LP relaxation (solved with ``options`` for the time left): its
    optimum as a bound, and its solution rounded to a placement (each node first computed
    on the device of its largest share), kept as a rounded one at the cost of the LP
    relaxation of the model placed so (``DeviceCoverModel.placed``), a bound on its cost
    in the relaxation. On graphs of a thousand nodes the MILP's first incumbent that a
    search may switch to comes long after its root relaxation; the rounded placement lets
    the search switch once the one-device search has had its share (``alone_share``),
    where it may be worth it."""
    config = search.problem.solver.search

    def relaxation(model: MILPModel) -> SolveResult:
        return runner.solve(
            model.lp_relaxation(),
            backend=config.lp_backend,
            options=replace(options, time_limit_s=search.remaining()),
            cancel=search.side_stop(),
            grace_s=config.solve_grace_s,
        )

    relaxed = relaxation(cover.model)
    if relaxed.x is None or relaxed.objective is None:
        logger.debug("device closure cover: no LP solution (%s)", relaxed.message)
        return
    search.on_bound(relaxed.objective)
    home = cover.placement(relaxed.x)
    placed = relaxation(cover.placed(home))
    if placed.objective is None:
        logger.debug("device closure cover: its LP solution rounded, no cost (%s)", placed.message)
        return
    search.on_placement(RelaxedPlacement(home, placed.objective, rounded=True))
    logger.debug(
        "device closure cover: LP %.6g ms, its solution rounded %.6g ms",
        relaxed.objective,
        placed.objective,
    )


class _Stalled:
    """The stop flag of the device cover with closure rows beside a one-device search: set
    once its bound has risen by less than ``rise`` (relative) over the last ``window``
    seconds while none of its placements may still make the search switch (``_Switch``):
    its placement is on one device, or it is on several at a relaxed cost no lower than
    the one-device search's bound while its own bound is within ``room`` (relative) of
    that bound, so that no plan on several devices can cost less than one device's
    optimum by more. From then on it raises the bound by little, while on a busy machine
    its core is worth more to the one-device search beside it."""

    def __init__(self, search: Search, window: float, rise: float, room: float) -> None:
        self.search = search
        self.window = window
        self.rise = rise
        self.room = room
        self.bounds: list[tuple[float, float]] = []  # (time.monotonic(), bound)
        self.fired = False  # it stopped the solve

    def on_bound(self, bound: float) -> None:
        self.bounds.append((time.monotonic(), bound))

    def is_set(self) -> bool:
        if self.fired or self._may_switch():
            return self.fired
        before = time.monotonic() - self.window
        earlier = [bound for at, bound in self.bounds if at <= before]
        if earlier and self.bounds[-1][1] <= earlier[-1] * (1 + self.rise):
            self.fired = True
        return self.fired

    def _may_switch(self) -> bool:
        relaxed, alone = self.search.placement, self.search.alone_bound
        if relaxed is None or not relaxed.spans_devices:
            return False
        if self.search.placement_worth_switching() is not None:
            return True
        if not self.bounds or not math.isfinite(alone):
            return True
        return self.bounds[-1][1] < alone * (1 - self.room)


def warm_start(search: Search, names: Sequence[str], variants: StrategyVariants) -> None:
    """The best baseline on any of ``names``, the cheapest known plan (``known_start``) and
    a heuristic's plans, offered to the search as they are found (the first plan does not
    wait for the heuristic's local search).

    On one device greedy eviction, or where it finds no plan the multi-device heuristic's
    local search on Chen's checkpoints on this device: eviction's plans are the cheaper
    where both fit. On several devices the multi-device heuristic: its plans are the
    cheaper there and come sooner; eviction on its placement runs later, beside the full
    solve (``restrict.solve_restrictions``); on devices that share one memory pool greedy
    eviction on the pool's memory first (``evict_pooled``). On a graph to be decomposed
    the best baseline only: the heuristics are slow on large graphs, and the parts'
    quick plans (``quick_part``) come sooner.

    The heuristics get ``warm_start_share`` of the limit (at most ``placed_time_s``), and
    up to ``fit_share`` of it until a first plan fits: at tight budgets no baseline fits,
    and a heuristic cut short would leave the solvers without an incumbent."""
    problem = search.problem
    config = problem.solver.search
    decomposed = variants.decomposes(problem)
    if decomposed and len(names) > 1 and variants.one_device is not None:
        # the one-device search of a decomposed graph starts from the best baseline on its
        # device (``_solve_on_one_device``): here only the other devices'
        alone = alone_device(problem, names)
        baseline_on = [name for name in names if name != alone]
    else:
        baseline_on = list(names)
    logger.debug("warm start: best baseline on %s", ", ".join(baseline_on))
    search.offer(best_baseline(problem, baseline_on))
    search.offer(known_start(problem, names))
    if decomposed:
        return
    limit = problem.solver.options.time_limit_s
    seconds = min(config.placed_time_s, limit * config.warm_start_share)
    spaces = {problem.costs.devices[problem.costs.device_index(n)].memory_space for n in names}
    if len(names) > 1 and len(spaces) == 1:
        logger.debug("warm start: greedy eviction on the pool for %.3g s", seconds)
        search.offer(evict_pooled(problem, names, seconds))
        _log_incumbent(search, "warm start")
    if len(names) == 1:
        logger.debug("warm start: greedy eviction on %s for %.3g s", names[0], seconds)
        evicted = greedy_evict(problem, names[0], seconds, fit_budget_s=limit * config.fit_share)
        if evicted.feasible:
            search.offer(evicted)
            _log_incumbent(search, "warm start")
            return
    logger.debug("warm start: multi-device heuristic for %.3g s", seconds)
    search.offer(placed_greedy(problem, names, seconds, search.offer, limit * config.fit_share))
    _log_incumbent(search, "warm start")


def optimize(
    search: Search,
    strategy: str,
    names: Sequence[str],
    build: Callable[[Problem], Formulation],
    variants: StrategyVariants,
) -> StrategyResult:
    """What the exact strategies share: stop if the warm start (``search.best``, offered
    as it was found) costs the lower bound; on a large graph solve its parts
    (``solve_parts``), else solve the full model from the warm start while the coarse
    graph's solve and the strategy's restrictions (if it has them) run beside it; on
    several devices, the device cover beside all of it (``start_from_devices``; with its
    closure rows on a decomposed graph, where no full model bounds the whole). The best
    plan found, with the whole problem's bound."""
    problem, warm = search.problem, search.best
    if _reaches(warm, search.bound, problem.solver.search.proven_gap):
        logger.debug("%s: the warm start costs the bound, no solve", strategy)
        _end_beside(search, None)
        return finish(problem, strategy, _no_solve(), None, warm, search.bound)
    beside, decomposed = None, variants.decomposes(problem)
    if len(names) > 1:
        devices = partial(start_from_devices, search, names, decomposed)
        beside = SideTask(devices, "remat-devices")
    try:
        if decomposed:
            solved, evaluation = _decomposed(problem, strategy, names, variants, search), None
            for bounding in (beside, search.starting):
                if bounding is not None:
                    _await_bound(search, bounding)
        else:
            solved, evaluation = _solved_whole(search, strategy, names, build, variants)
    finally:
        _end_beside(search, beside)
    return finish(problem, strategy, solved, evaluation, search.best, search.bound)


def _end_beside(search: Search, beside: SideTask | None) -> None:
    """Stop what runs beside the search (``beside``, the device cover; ``search.starting``,
    a decomposed graph's covers) and wait for it."""
    search.full_done.set()  # on a decomposed graph too: what is beside it stops
    for task in (beside, search.starting):
        if task is not None:
            task.finish()


def _await_bound(search: Search, beside: SideTask) -> None:
    """On a decomposed graph the bounds' solves beside (the covers, and on several devices
    the device cover with closure rows) are the only ones that raise the bound: when the
    plans' search ends early, they keep the time left, unless the gap target is met or the
    search is cancelled."""
    while beside.thread.is_alive() and search.time_left() > 0:
        if search.meets_gap() or search.problem.cancelled:
            return
        beside.thread.join(0.1)


def _solved_whole(
    search: Search,
    strategy: str,
    names: Sequence[str],
    build: Callable[[Problem], Formulation],
    variants: StrategyVariants,
) -> tuple[SolveResult, Evaluation | None]:
    """The full model's solve from the warm start, with the coarse graph's solve and the
    strategy's restrictions beside it: what it ended with, and its plan judged."""
    problem, warm = search.problem, search.best
    if (short := _too_short_to_build(problem, len(names))) is not None:
        logger.debug("%s: %s", strategy, short)
        return SolveResult(SolveStatus.UNKNOWN, None, None, None, None, 0.0, short), None
    # Built and encoded before the coarse and restricted threads start: beside numpy-heavy
    # threads the encoding would wait for the GIL at each of its many short releases.
    formulation = build(problem)
    model = formulation.model
    if warm is not None and warm.schedule is not None:
        start = _encoded(formulation.encode, warm.schedule.on_devices(names))
        model = replace(model, start=start)
    offer = partial(offer_incumbent, search, formulation, strategy)
    side = [
        start_coarse(problem, strategy, variants.on_coarse, search) if variants.coarse else None
    ]
    try:
        if variants.restricted is not None:
            work = partial(variants.restricted, search, formulation, offer)
            side.append(SideTask(work, "remat-restricted"))
        logger.debug("%s: full solve of %d variables", strategy, model.n_vars)
        solved = solve_full(problem, model, search, on_incumbent=offer)
        logger.debug("%s: full solve ended: %s", strategy, solved.status.value)
    finally:
        search.full_done.set()
        for task in side:
            if task is not None:
                task.finish()
    if search.gap_met.is_set() and not problem.cancelled:
        message = "the gap target is met (with a plan found beside the solve)"
        solved = replace(solved, message=message)
    evaluation = None
    if solved.x is not None:
        evaluation = evaluate(problem, formulation.decode(solved.x), strategy)
    return solved, evaluation


def start_coarse(
    problem: Problem,
    strategy: str,
    again: Callable[[Problem], StrategyResult],
    search: Search,
) -> SideTask | None:
    """The strategy on the coarse graph, beside the full solve; each better coarse plan is
    expanded and offered to the search. None when the graph is too small or does not
    coarsen (``coarsen.coarse_of``)."""
    coarse = search.coarse
    if coarse is None:
        return None

    def offer_expanded(result: StrategyResult) -> None:
        if result.schedule is not None:
            search.judge(coarse.expand(result.schedule), strategy)

    settings = problem.solver
    solver = replace(
        settings,
        options=replace(settings.options, time_limit_s=search.remaining()),
        on_progress=search.on_coarse,
        cancel=search.coarse_stop(),
        on_plan=offer_expanded,  # each better coarse plan, as soon as it is found
    )
    coarse_problem = Problem(coarse.graph, coarse.costs, problem.budgets, solver)
    logger.debug("%s: coarse solve of %d nodes beside the full solve", strategy, len(coarse.graph))
    return SideTask(lambda: offer_expanded(again(coarse_problem)), "remat-coarse")


def offer_incumbent(
    search: Search, formulation: Formulation, strategy: str, x: np.ndarray, _objective: float
) -> None:
    """A solver incumbent, while the solve runs: judged by the simulator and offered to
    the search, so that the search's incumbent (progress, ``on_plan``, a cancelled solve)
    is the best found so far."""
    try:
        schedule = formulation.decode(x)
    except ScheduleError:
        return  # within tolerances but not a schedule; the solve's result is judged again
    search.judge(schedule, strategy)


def solve_full(
    problem: Problem,
    model: MILPModel,
    search: Search,
    on_incumbent: runner.Incumbent | None = None,
) -> SolveResult:
    """The full model's solve in a subprocess, for the time the search has left, reporting
    through it; stopped once the gap target is met, suspended while ``full_held``."""
    settings = problem.solver
    return runner.solve(
        model,
        backend=settings.backend,
        options=replace(settings.options, time_limit_s=search.remaining()),
        on_progress=search.on_full,
        cancel=search.full_stop(),
        grace_s=settings.search.solve_grace_s,
        on_incumbent=on_incumbent,
        hold=search.full_held,
    )


def solve_alone(problem: Problem, model: MILPModel, seconds: float) -> SolveResult:
    """A solve in a subprocess outside a search, for ``seconds``, reporting to the
    problem's listener."""
    settings = problem.solver
    return runner.solve(
        model,
        backend=settings.backend,
        options=replace(settings.options, time_limit_s=seconds),
        on_progress=settings.on_progress,
        cancel=settings.cancel,
        grace_s=runner.DEFAULT_GRACE_S,
    )


def _reaches(warm: StrategyResult | None, bound: float, proven_gap: float) -> bool:
    """The warm start already costs a lower bound (the ideal, the cover's): it is optimal,
    no solve."""
    if warm is None or warm.simulation is None:
        return False
    return warm.simulation.total_ms <= bound * (1 + proven_gap)


def _too_short_to_build(problem: Problem, devices: int) -> str | None:
    """Why the full model is not built: the time limit is shorter than building it takes
    (``SearchConfig.build_us``); None when it is not."""
    graph, limit = problem.graph, problem.solver.options.time_limit_s
    edges = sum(len(set(node.deps)) for node in graph.nodes)
    build_s = len(graph) * (len(graph) + edges) * devices * problem.solver.search.build_us * 1e-6
    if limit >= build_s:
        return None
    return (
        f"no solve: the time limit ({limit:.3g} s) is shorter than building the model of "
        f"{len(graph)} nodes takes (about {build_s:.2g} s); give a time limit of at least "
        f"{build_s + problem.solver.search.min_solve_s:.2g} s"
    )


def _no_solve() -> SolveResult:
    reason = "the warm start costs the lower bound"
    return SolveResult(SolveStatus.OPTIMAL, None, None, None, None, 0.0, reason)


def finish(
    problem: Problem,
    strategy: str,
    solved: SolveResult,
    evaluation: Evaluation | None,
    fallback: StrategyResult | None,
    lower: float,
) -> StrategyResult:
    """The cheaper of the solver's plan (if the simulator accepts it) and the incumbent
    (warm start or a plan found beside the solve); with the bound and gap of the whole
    problem: the larger of the solver's bound and ``lower`` (the ideal, or a bound found
    beside the solve)."""
    solver_plan = select_best(strategy, [evaluation]) if evaluation is not None else None
    chosen = cheapest(solver_plan, fallback)  # the incumbent may beat the solver's plan
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
    if gap <= problem.solver.search.proven_gap:
        status = SolveStatus.OPTIMAL  # the bound of the whole problem proves it
    info = SolverInfo(status.value, objective, bound, gap, solved.seconds)
    plan = replace(chosen.plan, strategy=strategy, solver=info)
    logger.debug("%s: %s, %.6g ms, gap %.3g", strategy, status.value, objective, gap)
    return replace(chosen, plan=plan, message=solved.message)


def _no_plan(strategy: str, solved: SolveResult, chosen: StrategyResult | None) -> StrategyResult:
    proven = solved.status is SolveStatus.INFEASIBLE
    if proven:
        message = f"infeasible at this budget: {strategy} proved that no schedule fits"
    elif chosen is not None and chosen.message:
        message = chosen.message
    else:
        message = f"{strategy}: no schedule found ({solved.status.value}) {solved.message}"
    return StrategyResult(strategy, None, None, message.strip(), proven_infeasible=proven)


def _decomposed(
    problem: Problem,
    strategy: str,
    names: Sequence[str],
    variants: StrategyVariants,
    search: Search,
) -> SolveResult:
    """The stitched plan of the parts offered to the search (the warm start stays if it is
    cheaper, or if the parts found none), then the whole graph's interval model for the
    time left where the incumbent computes on one device (``_polished``); the bound is the
    covers': no part's bound bounds the whole. On several devices,
    ``_decomposed_on_devices``."""
    started = time.monotonic()
    if len(names) > 1:
        message = _decomposed_on_devices(problem, strategy, names, variants, search)
        elapsed = time.monotonic() - started
        return SolveResult(SolveStatus.UNKNOWN, None, None, None, None, elapsed, message)

    device = names[0]
    judge = partial(baseline_part, device=device)
    solvers = PartSolvers(variants.on_part, partial(quick_part, device=device), judge)
    seconds = search.time_left() * problem.solver.search.parts_share  # the rest: _polished
    logger.debug("%s: decomposed, parts solved in %.3g s", strategy, seconds)
    stitched = solve_parts(
        problem, strategy, device, solvers, search.heartbeat, seconds, offer=search.offer
    )
    search.offer(stitched)
    if stitched.plan is not None and stitched.simulation is not None:
        message = f"decomposed: stitched plan {stitched.simulation.total_ms:.4g} ms"
    else:
        message = stitched.message
    if search.time_left() >= problem.solver.search.min_solve_s:
        message += _polished(search, on_device(problem, device), strategy)
    return SolveResult(
        SolveStatus.UNKNOWN, None, None, None, None, time.monotonic() - started, message
    )


def _decomposed_on_devices(
    problem: Problem,
    strategy: str,
    names: Sequence[str],
    variants: StrategyVariants,
    search: Search,
) -> str:
    """A decomposed graph on several devices: solved on the device with the lowest ideal
    that the memory floor admits alone (``_solve_on_one_device``), as the single-device
    strategy would, so a second device never leaves a worse plan; beside it the device
    cover with closure rows (``bound_by_closure``) finds placements. Once ``alone_share``
    of the time left has passed and it has found one worth it (``_Switch``), the
    one-device search stops and the whole graph's interval model runs on that placement
    for the time left, from the incumbent moved onto it: with window neighbourhoods from
    its first plan there (``_placement_by_windows``) on a graph they improve, else on
    trial (``placement_trial_share``). The parts are not solved over
    several devices: a part's plan holds every fixed tensor on each device, so where no
    device holds them alone, no part fits either (there ``_split_fixed``), and where one
    does, the parts' plans cost more than that device's. Returns what happened."""
    if variants.one_device is None:
        return "decomposed: no strategy for one device"
    config = problem.solver.search
    switch = _Switch(search, time.monotonic() + search.time_left() * config.alone_share)
    solved = _solve_on_one_device(problem, names, search, variants.one_device, switch)
    if solved is None:
        return _split_fixed(problem, names, search, strategy)
    device, alone = solved
    search.offer(alone)
    relaxed = switch.placement()
    if relaxed is None or _out_of_time(search):
        return alone.message
    message = f"{alone.message}; stopped for the device cover's placement"
    placement = placed(problem, names, relaxed.home)
    trial = time.monotonic() + search.time_left() * config.placement_trial_share
    if len(problem.graph) >= config.windows_min_nodes:
        windowed = _placement_by_windows(search, placement, strategy, trial)
        if windowed is not None:
            return message + windowed
        message += "; the whole graph's interval model found no plan on it in its trial"
    else:
        before = search.best_ms
        message += _polished(search, placement, strategy, trial=trial)
        if search.best_ms != before and not _out_of_time(search):
            # its first cheaper plan came as the trial ended
            return message + "; on for the time left" + _polished(search, placement, strategy)
    if _out_of_time(search):
        return message
    return message + f"; back on {device}" + _polished(search, on_device(problem, device), strategy)


def _out_of_time(search: Search) -> bool:
    """Too little time is left for another solve, or the search is cancelled."""
    return search.time_left() < search.problem.solver.search.min_solve_s or search.problem.cancelled


def _split_fixed(problem: Problem, names: Sequence[str], search: Search, strategy: str) -> str:
    """A decomposed graph whose fixed tensors no single device holds alone (so no part's
    plan fits either): the multi-device heuristic, whose placements split them, for
    ``warm_start_share`` of the time left; then, while time is left and a placement not
    yet tried (``_placement_of``), the whole graph's interval model on it, and node moves
    from the incumbent's placement (``evict.evict_moves``) for half the time left. Returns
    what happened."""
    fixed = format_bytes(held_fixed_bytes(problem.graph, range(len(problem.graph))))
    message = f"decomposed: no single device holds every fixed tensor ({fixed})"
    config = problem.solver.search
    seconds = min(config.placed_time_s, search.time_left() * config.warm_start_share)
    logger.debug("decomposed: multi-device heuristic for %.3g s", seconds)
    fit_s = search.time_left() * config.fit_share
    heuristic = placed_greedy(problem, names, seconds, search.offer, fit_s)
    search.offer(heuristic)
    start_ms = search.best_ms  # the heuristic's plan, or a known plan's if cheaper
    if start_ms is None:
        return f"{message}, and the multi-device heuristic found no plan"
    if heuristic.feasible:
        message += f"; the multi-device heuristic's plan costs {heuristic.time_ms:.4g} ms"
    tried: list[np.ndarray] = []
    while (found := _placement_of(search, names, tried)) is not None:
        if _out_of_time(search):
            break
        home, whose = found
        tried.append(home)
        logger.debug(
            "decomposed: %s", _polished(search, placed(problem, names, home), strategy, whose)
        )
        best = search.best
        if best is None or best.schedule is None or best.simulation is None:
            break
        logger.debug("decomposed: node moves from the incumbent's placement")
        deadline = time.monotonic() + search.time_left() / 2
        start = home_of(best.schedule, names)
        evict_moves(problem, names, start, best.simulation.total_ms, deadline, search.offer)
    if tried and search.best_ms is not None and search.best_ms < start_ms:
        improved = f"improved it to {search.best_ms:.4g} ms"
        return (
            f"{message}; the interval model on {len(tried)} placement(s) and node moves {improved}"
        )
    return message


def _placement_of(
    search: Search, names: Sequence[str], tried: list[np.ndarray]
) -> tuple[np.ndarray, str] | None:
    """The device cover's placement where it has one over several devices not yet
    ``tried``, else the incumbent's: each node on a device, and whose it is; None where
    both were tried."""
    relaxed = search.placement
    candidates = []
    if relaxed is not None and relaxed.spans_devices:
        candidates.append((relaxed.home, "the device cover's"))
    if search.best is not None and search.best.schedule is not None:
        candidates.append((home_of(search.best.schedule, names), "its"))
    for home, whose in candidates:
        if not any(np.array_equal(home, h) for h in tried):
            return home, whose
    return None


class _Switch:
    """The stop flag of a decomposed graph's one-device search on several devices: set
    once ``after`` (``time.monotonic()``) has passed and the device cover has found a
    placement on several devices whose cost in its relaxation is below the one-device
    search's bound (so that no plan on one device can reach it), or when the search is
    cancelled."""

    def __init__(self, search: Search, after: float) -> None:
        self.search = search
        self.after = after

    def on_progress(self, progress: Progress) -> None:
        """The one-device search's progress: its bound is ``Search.alone_bound``."""
        if progress.bound is not None:
            self.search.alone_bound = max(self.search.alone_bound, progress.bound)
        self.search.heartbeat()

    def placement(self) -> RelaxedPlacement | None:
        return self.search.placement_worth_switching()

    def is_set(self) -> bool:
        if self.search.problem.cancelled:
            return True
        return time.monotonic() >= self.after and self.placement() is not None


def baseline_part(part: Problem, device: str) -> StrategyResult:
    """A part's best baseline on ``device``: how the stored-value choices are judged
    (``decompose.PartSolvers.judge``), the stitched baselines having ranked them better
    than stitched heuristic plans."""
    found = best_baseline(part, [device])
    return found or StrategyResult("baseline", None, None, "no baseline fits its budget")


def quick_part(part: Problem, device: str) -> StrategyResult:
    """A part's plan on ``device`` without a solve: its best baseline, or where none fits
    greedy eviction (``SearchConfig.part_evict_s``, ``part_fit_s``): at tight budgets no
    baseline fits a part, and eviction finds a plan for a part of a hundred nodes in a
    fraction of a second."""
    found = baseline_part(part, device)
    if found.feasible:
        return found
    config = part.solver.search
    return greedy_evict(part, device, config.part_evict_s, config.part_fit_s)


def _polished(
    search: Search,
    placement: Placement,
    strategy: str,
    whose: str = "the device cover's",
    trial: float | None = None,
) -> str:
    """The whole graph's interval model on ``placement`` (on several devices, ``whose``)
    for the time left, from the incumbent (the stitched plan, or the warm start): the parts
    fix where the graph is cut and what crosses each cut, the whole graph's model does
    not. With window neighbourhoods by turns (``_alternated``), or, where ``trial``
    (``time.monotonic()``) is given, CP-SAT's search alone, stopped then unless it has
    found a cheaper plan."""
    where = "" if len(placement.devices) == 1 else f" on {whose} placement"
    before = search.best_ms
    improved = 0
    if trial is None:
        improved = _alternated(search, placement, strategy)
    else:
        solve_intervals(search, placement, _incumbent_schedule(search), strategy, improve_by=trial)
    after = search.best_ms
    if after is None or (before is not None and after >= before):
        return f"; the whole graph's interval model{where} found no better plan"
    windows = f" and {improved} window neighbourhoods" if improved else ""
    return f"; the whole graph's interval model{windows}{where} improved it to {after:.4g} ms"


def _alternated(search: Search, placement: Placement, strategy: str) -> int:
    """CP-SAT's large neighbourhood search on the whole graph's interval model and window
    neighbourhoods (``windows.improve_by_windows``) by turns on ``placement`` for the time
    left, from the search's incumbent, each until the incumbent has not improved for
    ``SearchConfig.neighbourhood_stall_share`` of the time limit: each reaches plans that
    the other's neighbourhoods improve. On graphs of at least ``windows_min_nodes`` nodes
    the windows go first, for ``windows_share`` of the time left; on smaller ones the
    whole model, whose search is quick enough there. After a round of both without a
    cheaper plan, the whole model takes the time left. Returns the number of window
    neighbourhoods that improved the plan."""
    config = search.problem.solver.search
    stall = search.problem.solver.options.time_limit_s * config.neighbourhood_stall_share
    incumbent = partial(_incumbent_schedule, search)
    improved = 0
    if len(search.problem.graph) >= config.windows_min_nodes:
        until = time.monotonic() + search.time_left() * config.windows_share
        improved += improve_by_windows(search, placement, strategy, incumbent, until)
    while not _out_of_time(search):
        before = search.best_ms
        solve_intervals(search, placement, incumbent(), strategy, stall_s=stall)
        if _out_of_time(search):
            break
        end = time.monotonic() + search.time_left()
        improved += improve_by_windows(search, placement, strategy, incumbent, end, stall)
        if search.best_ms == before and not _out_of_time(search):
            solve_intervals(search, placement, incumbent(), strategy)
            break
    return improved


def _placement_by_windows(
    search: Search, placement: Placement, strategy: str, trial: float
) -> str | None:
    """The device cover's ``placement`` on a graph that window neighbourhoods improve: the
    whole graph's interval model on it, from the search's incumbent, to its first plan
    there, then ``_polished`` from that plan for the time left, in a search of its own
    (``Search.beside``) whose plans pass to ``search``. A placement's first plans cost
    more than the one-device incumbent, and windows improve them where only the search's
    incumbent would be improved otherwise. Returns what happened, or None where the model
    found no plan on the placement by ``trial`` (``time.monotonic()``)."""
    own = search.beside()
    warm = _incumbent_schedule(search)
    solve_intervals(own, placement, warm, strategy, improve_by=trial, until_better=True)
    first = own.best_ms
    if first is None:
        return None
    found = "; the whole graph's interval model found a plan on the device cover's placement"
    return f"{found} ({first:.4g} ms)" + _polished(own, placement, strategy)


def _incumbent_schedule(search: Search) -> Schedule | None:
    """The incumbent's schedule (its plan's, turned back into one where it computes on one
    device), or None. The interval model reads each node's computations and retention on
    any device of it, so a one-device schedule warm-starts a model on a placement too."""
    best = search.best
    if best is None or best.plan is None:
        return None
    if best.schedule is None and len(best.plan.devices) == 1:
        n, device = len(search.problem.graph), best.plan.devices[0].name
        return schedule_of_steps(best.plan.steps, n, device)
    return best.schedule


def _solve_on_one_device(
    problem: Problem,
    names: Sequence[str],
    search: Search,
    one_device: OneDevice,
    switch: _Switch,
) -> tuple[str, StrategyResult] | None:
    """A large graph on several devices, solved by ``one_device`` (decomposed too) on the
    device with the lowest ideal that the memory floor admits alone, for the time left or
    until ``switch`` is set, as that strategy would solve it on its own: the device and its
    result, or None where no device is admitted. Its plans are offered as found; its bound
    bounds one device only, so its progress goes to ``switch``, not to the search's
    listener."""
    device = alone_device(problem, names)
    if device is None:
        return None
    settings = problem.solver
    seconds = search.time_left()
    options = replace(settings.options, time_limit_s=seconds)
    quiet = replace(
        settings,
        options=options,
        on_progress=switch.on_progress,
        on_plan=search.offer,
        cancel=switch,
    )
    logger.debug("decomposed: solved on %s alone, for %.3g s", device, seconds)
    return device, one_device(replace(problem, solver=quiet), device)


def alone_device(problem: Problem, names: Sequence[str]) -> str | None:
    """Where a decomposed graph on several devices is solved on one device: the device
    with the lowest ideal that the memory floor admits alone; None where none is."""
    admitted = [name for name in names if shortfall(problem, (name,)) is None]
    return min(admitted, key=problem.costs.ideal_ms, default=None)


def _log_incumbent(search: Search, phase: str) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: incumbent %s ms", phase, search.best_ms)


def _encoded(encode: Callable[[Schedule], np.ndarray], schedule: Schedule) -> np.ndarray | None:
    """The warm start, or none when the baseline's schedule does not fit the model (the
    solver then starts cold; the baseline stays the fallback plan)."""
    try:
        return encode(schedule)
    except ScheduleError:
        return None
