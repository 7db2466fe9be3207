"""The search of an exact strategy: the full model's solve and, beside it, the same
strategy on the coarse graph (``remat.strategies.coarsen``) and restrictions of the full
model where the strategy has them (XEngine's, ``remat.strategies.restrict``), sharing the
best plan in hand.

They run at once (the solves beside the full one in threads, each solver in its own
subprocess): the full model's solve gives the bound of the whole problem (as does the LP
relaxation the restricted thread solves, the full solve suspended meanwhile, where keeping
everything fits nowhere or no bound is known yet: on U-Net and ResNet18 the full solve's
own root LP comes too late) and, on small graphs, the optimum; the
coarse solve, a smaller model, finds good plans where the full one finds none in time
(U-Net when its first coarse plan comes in time); the restriction finds the optimum where
it recomputes nothing (ResNet18 and VGG16 at 25% on cpu+cuda). Each stops the others'
waste: the coarse solve stops once its bound reaches the plan in hand (no coarse plan can
be better), the full solve once the plan in hand meets the gap target against its bound,
and the solves beside it when the full one ends. Run one after the other instead (the coarse solve
alone for half the limit), U-Net found no coarse plan either and the full model's LP bound
no longer arrived in 120 s, so they share the time.

Progress events carry the best plan in hand (the simulator accepted it) and the best
bound of the whole problem (the full model's, its LP relaxation's, or the ideal): the
coarse solve's own objective and bound belong to another problem, so they are never
reported. Plans reach the search as they are found, the warm start's included (the
multi-device heuristic offers its first plan before its local search), not when a solve
ends: each solver incumbent is judged by the simulator and offered at once, and each
better coarse plan (the coarse strategy's ``on_plan``) is expanded and offered. On ResNet18
at 25% on cpu+cuda the coarse warm start alone (8.7% gap) is in hand at 5 s; it used to come
at the time limit, with the coarse solve's result.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

from remat.schedule import Schedule
from remat.solvers.model import Progress, StopFlag
from remat.strategies.base import Problem, StrategyResult, evaluate, select_best
from remat.strategies.coarsen import Coarse, coarsen

COARSE_MIN_NODES = 40  # smaller graphs solve well as they are
COARSE_MAX_RATIO = 0.8  # coarsen only when it removes a fifth of the nodes or more
MIN_SOLVE_S = 1.0  # the full model's solve gets at least this long (see Search.remaining)
# A solve of the search is stopped this long after its time limit (the runner's default
# allows 5 s for process start and model building): HiGHS does not look at its time limit
# in presolve (U-Net at 25% on cpu+cuda: 10-15 s), so a 15 s search returned after 19-21 s.
SOLVE_GRACE_S = 0.5


@dataclass(frozen=True)
class AnyOf:
    """Set when any of its flags is."""

    flags: tuple[StopFlag | None, ...]

    def is_set(self) -> bool:
        return any(flag is not None and flag.is_set() for flag in self.flags)


class Search:
    """The shared state of one strategy call (thread-safe)."""

    def __init__(self, problem: Problem, ideal: float, start: float) -> None:
        """``start``: when the strategy was called (``time.monotonic()``); the time limit
        counts from there, warm starts included. The plan in hand comes through ``offer``,
        the warm starts' first."""
        self.problem = problem
        self.ideal = ideal
        self.best: StrategyResult | None = None
        self.bound = ideal  # the whole problem's best proven bound so far
        self.coarse_bound = -math.inf  # the coarse problem's (no coarse plan costs less)
        self.start = start
        self.gap_met = threading.Event()  # stops the full solve
        self.coarse_done = threading.Event()  # stops the coarse solve
        self.full_done = threading.Event()  # the full solve ended: stops the solves beside it
        self.full_held = threading.Event()  # suspends the full solve's process while set
        self._lock = threading.Lock()

    @property
    def best_ms(self) -> float | None:
        return (
            None
            if self.best is None or self.best.simulation is None
            else self.best.simulation.total_ms
        )

    @cached_property
    def coarse(self) -> Coarse | None:
        """The problem's coarse graph where it is worth solving (``coarse_of``)."""
        return coarse_of(self.problem)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def time_left(self) -> float:
        """The time limit left (negative once spent)."""
        return self.problem.solver.options.time_limit_s - self.elapsed()

    def remaining(self) -> float:
        """The time limit left for a solve: at least a second (a quarter of a shorter
        limit), so that the full model gets its bound even after slow warm starts."""
        limit = self.problem.solver.options.time_limit_s
        return max(self.time_left(), min(MIN_SOLVE_S, limit / 4))

    def full_stop(self) -> AnyOf:
        return AnyOf((self.problem.solver.cancel, self.gap_met))

    def coarse_stop(self) -> AnyOf:
        return AnyOf((self.problem.solver.cancel, self.coarse_done, self.full_done))

    def beside_stop(self) -> AnyOf:
        return AnyOf((self.problem.solver.cancel, self.full_done))

    def judge(self, schedule: Schedule, strategy: str) -> None:
        """A schedule of the search's problem (a solver incumbent, an expanded coarse plan):
        simulated, and offered if the simulator accepts it."""
        self.offer(select_best(strategy, [evaluate(self.problem, schedule, strategy)]))

    def offer(self, result: StrategyResult | None) -> None:
        """A plan the simulator accepted: kept, reported and passed to the settings'
        ``on_plan`` if it beats the one in hand."""
        if result is None or result.simulation is None or not result.feasible:
            return
        with self._lock:
            if self.best_ms is not None and result.simulation.total_ms >= self.best_ms:
                return
            self.best = result
            self._stop_coarse_if_useless()
            self._report()
        self._pass_on(result)

    def _pass_on(self, result: StrategyResult | None) -> None:
        """Outside the lock: the listener may take its own search's lock (the coarse
        solve's plans go to the full search)."""
        listener = self.problem.solver.on_plan
        if listener is not None and result is not None:
            listener(result)

    def on_full(self, progress: Progress) -> None:
        """The full model's progress: its bound is the whole problem's. Reported at the
        search's time: the solver's own clock starts late (model transfer) and would put
        its events before the coarse solve's."""
        with self._lock:
            if progress.bound is not None:
                self.bound = max(self.bound, progress.bound)
            objective = progress.objective
            if self.best_ms is not None and (objective is None or self.best_ms < objective):
                objective = self.best_ms
            self._report(objective)
            if objective != progress.objective:
                self._stop_full_if_met()  # a plan the solver does not know meets the target

    def on_bound(self, bound: float) -> None:
        """A bound of the whole problem found beside the full solve (its LP relaxation)."""
        with self._lock:
            self.bound = max(self.bound, bound)
            self._report()
            self._stop_full_if_met()

    def _stop_full_if_met(self) -> None:
        if self._meets_gap():
            self.gap_met.set()

    def _meets_gap(self) -> bool:
        best = self.best_ms
        if best is None or best <= 0:
            return False
        return (best - self.bound) / best <= self.problem.solver.options.gap

    def on_coarse(self, progress: Progress) -> None:
        """The coarse solve's progress: a heartbeat with the plan in hand (its objective and
        bound are the coarse problem's), and the sign to stop it once it cannot help."""
        with self._lock:
            if progress.bound is not None:
                self.coarse_bound = max(self.coarse_bound, progress.bound)
            self._stop_coarse_if_useless()
            self._report()

    def _stop_coarse_if_useless(self) -> None:
        """Checked on each coarse bound and each better plan (a plan from elsewhere may
        pass the coarse bound while that bound stays put for a long time)."""
        best = self.best_ms
        if best is not None and self.coarse_bound >= best:
            self.coarse_done.set()

    def heartbeat(self) -> None:
        """The plan in hand again (while parts of a large graph are solved)."""
        with self._lock:
            self._report()

    def _report(self, objective: float | None = None) -> None:
        listener = self.problem.solver.on_progress
        objective = self.best_ms if objective is None else objective
        if listener is None or objective is None:
            return
        bound = min(self.bound, objective)
        gap = (objective - bound) / objective if objective > 0 else 0.0
        listener(Progress(self.elapsed(), objective, bound, gap))


class Beside:
    """Work of the search in a thread beside the full model's solve (the coarse graph's
    solve, a restricted model's); it offers its plans to the search itself."""

    def __init__(self, work: Callable[[], None], name: str) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # re-raised in the caller's thread by finish()
                self.error = exc

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def finish(self) -> None:
        """Wait for the work (the caller has set the flag that stops it)."""
        self.thread.join()
        if self.error is not None:
            raise self.error


def coarse_of(problem: Problem) -> Coarse | None:
    """The coarse graph, where it is worth solving: 40+ nodes, a fifth of them fused."""
    if len(problem.graph) < COARSE_MIN_NODES:
        return None
    coarse = coarsen(problem.graph, problem.costs)
    return None if coarse.ratio > COARSE_MAX_RATIO else coarse


def start_coarse(
    problem: Problem,
    strategy: str,
    again: Callable[[Problem], StrategyResult],
    search: Search,
) -> Beside | None:
    """The strategy on the coarse graph, beside the full solve; each better coarse plan is
    expanded and offered to the search. None when the graph is too small or does not
    coarsen."""
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
    return Beside(lambda: offer_expanded(again(coarse_problem)), "remat-coarse")
