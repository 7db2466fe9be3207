"""The shared state of one exact strategy's search (``Search``): the incumbent (the best
plan the simulator accepted so far, from any phase), the best proven bound of the whole
problem, the flags that stop each solve, and progress reporting; and ``SideTask``, a phase
that runs in a thread beside the full model's solve.

The phases (docs/solvers.md, "The search in detail"): the full model's solve gives the
bound of the whole problem and, on small graphs, the optimum; beside it, the same strategy
on the coarse graph finds good plans where the full solve finds none in time, and the
restrictions and the LP relaxation (``restrict``, ``rins``) find plans and an early bound.
They share the time limit and stop each other's waste: the coarse solve stops once its
bound reaches the incumbent (no coarse plan can be better), the full solve once the
incumbent meets the gap target against the bound, and the solves beside it when the full
one ends.

Progress events carry the incumbent and the best bound of the whole problem (the full
model's, its LP relaxation's, or the ideal): the coarse solve's own objective and bound
belong to another problem and are never reported. Plans reach the search as they are
found (each solver incumbent judged by the simulator and offered at once), not when a
solve ends.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from remat.schedule import Schedule
from remat.solvers.model import Progress, StopFlag
from remat.strategies.common.problem import Problem, StrategyResult, evaluate, select_best
from remat.strategies.exact.coarsen import Coarse, coarse_of


@dataclass(frozen=True)
class AnyOf:
    """Set when any of its flags is."""

    flags: tuple[StopFlag | None, ...]

    def is_set(self) -> bool:
        return any(flag is not None and flag.is_set() for flag in self.flags)


class IncumbentStall:
    """Set once ``search``'s incumbent has not improved for ``seconds``, counted from the
    flag's start (its making, or with ``started`` False its ``start()``) until the first
    improvement; never where ``seconds`` is None or before its start. Polled: an
    improvement counts from the first poll that sees it."""

    def __init__(self, search: Search, seconds: float | None, started: bool = True) -> None:
        self.search = search
        self.seconds = seconds
        self.best_ms = search.best_ms
        self.since: float | None = time.monotonic() if started else None

    def start(self) -> None:
        """Start counting, if not yet started."""
        if self.since is None:
            self.since = time.monotonic()

    def is_set(self) -> bool:
        if self.seconds is None or self.since is None:
            return False
        now, best = time.monotonic(), self.search.best_ms
        if best is not None and (self.best_ms is None or best < self.best_ms):
            self.best_ms, self.since = best, now
        return now - self.since > self.seconds


@dataclass(frozen=True)
class RelaxedPlacement:
    """A solution of the device cover with closure rows: the device of each node's first
    computation (``home[v]``, an index into the search's devices) and the solution's cost
    in that relaxation. ``rounded``: from its LP relaxation's solution, each node on the
    device of its largest first-computation share; ``cost_ms`` is then the optimum of the
    LP relaxation with that placement fixed, a lower bound on its cost, not its cost."""

    home: np.ndarray
    cost_ms: float
    rounded: bool = False

    @property
    def spans_devices(self) -> bool:
        """Its nodes are placed on more than one device."""
        return len(set(self.home.tolist())) > 1


class Search:
    """The shared state of one strategy call (thread-safe)."""

    def __init__(self, problem: Problem, ideal: float, start: float) -> None:
        """``start``: when the strategy was called (``time.monotonic()``); the time limit
        counts from there, warm starts included. The incumbent comes through ``offer``, the
        warm starts' first."""
        self.problem = problem
        self.ideal = ideal
        self.best: StrategyResult | None = None
        self.bound = ideal  # the whole problem's best proven bound so far
        self.start_bound = ideal  # the bound before any solve (``start_from_cover``)
        self.coarse_bound = -math.inf  # the coarse problem's (no coarse plan costs less)
        self.start = start
        self.gap_met = threading.Event()  # stops the full solve
        self.coarse_done = threading.Event()  # stops the coarse solve
        self.full_done = threading.Event()  # the full solve ended: stops the solves beside it
        self.full_held = threading.Event()  # suspends the full solve's process while set
        self.placement: RelaxedPlacement | None = None  # the device cover's best
        # on a decomposed graph on several devices, the bound of the one-device search
        # beside (no plan on that device costs less); -inf until it reports one
        self.alone_bound = -math.inf
        self.starting: SideTask | None = None  # a decomposed graph's covers (``start_search``)
        self._lock = threading.Lock()

    def beside(self) -> Search:
        """A search of the same problem and time limit with an incumbent of its own, for a
        phase that improves its own plans before they beat this search's (on a placement
        of their own): its plans pass to this search, which keeps the cheaper, and its
        progress is this search's heartbeat."""
        settings = replace(
            self.problem.solver, on_plan=self.offer, on_progress=lambda _: self.heartbeat()
        )
        return Search(replace(self.problem, solver=settings), self.ideal, self.start)

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
        """The time limit left for a solve: at least ``SearchConfig.min_solve_s`` (a quarter
        of a shorter limit), so that the full model gets its bound even after slow warm
        starts."""
        limit = self.problem.solver.options.time_limit_s
        return max(self.time_left(), min(self.problem.solver.search.min_solve_s, limit / 4))

    def full_stop(self) -> AnyOf:
        return AnyOf((self.problem.solver.cancel, self.gap_met))

    def coarse_stop(self) -> AnyOf:
        return AnyOf((self.problem.solver.cancel, self.coarse_done, self.full_done))

    def side_stop(self) -> AnyOf:
        """Stops the solves beside the full one: cancelled, or the full solve ended."""
        return AnyOf((self.problem.solver.cancel, self.full_done))

    def judge(self, schedule: Schedule, strategy: str) -> None:
        """A schedule of the search's problem (a solver incumbent, an expanded coarse plan):
        simulated, and offered if the simulator accepts it."""
        self.offer(select_best(strategy, [evaluate(self.problem, schedule, strategy)]))

    def offer(self, result: StrategyResult | None) -> None:
        """A plan the simulator accepted: kept, reported and passed to the settings'
        ``on_plan`` if it beats the incumbent."""
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
                self._stop_full_if_met()  # an incumbent the solver does not know meets it

    def start_from_cover(self, bound: float) -> None:
        """The recomputation cover's bound (``exact.cover``), known before any solve."""
        with self._lock:
            self.start_bound = max(self.start_bound, bound)
            self.bound = max(self.bound, bound)
            self._report()

    def on_bound(self, bound: float) -> None:
        """A bound of the whole problem found beside the full solve (its LP relaxation, the
        device cover)."""
        with self._lock:
            self.bound = max(self.bound, bound)
            self._report()
            self._stop_full_if_met()

    def on_placement(self, placement: RelaxedPlacement) -> None:
        """A placement of the device cover with closure rows, kept if its relaxed cost is
        the lowest so far. An integral solution replaces a rounded one (whose cost is only
        bounded) once it is worth switching to (``placement_worth_switching``); a rounded
        one never replaces an integral one."""
        with self._lock:
            kept = self.placement
            if kept is None or kept.rounded == placement.rounded:
                better = kept is None or placement.cost_ms < kept.cost_ms
            else:
                better = kept.rounded and placement.cost_ms < self.alone_bound
            if better:
                self.placement = placement

    def placement_worth_switching(self) -> RelaxedPlacement | None:
        """The device cover's best placement where it uses several devices at a relaxed
        cost below the one-device search's bound (``alone_bound``), so that no plan on one
        device can reach it; None otherwise."""
        relaxed = self.placement
        if relaxed is None or not relaxed.spans_devices:
            return None
        return relaxed if relaxed.cost_ms < self.alone_bound else None

    def _stop_full_if_met(self) -> None:
        if self.meets_gap():
            self.gap_met.set()

    def meets_gap(self) -> bool:
        """The incumbent is within the gap target of the best bound."""
        best = self.best_ms
        if best is None or best <= 0:
            return False
        return (best - self.bound) / best <= self.problem.solver.options.gap

    def on_coarse(self, progress: Progress) -> None:
        """The coarse solve's progress: a heartbeat with the incumbent (its objective and
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
        """The incumbent again (while parts of a large graph are solved)."""
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


class SideTask:
    """A phase of the search in a thread beside the full model's solve (the coarse graph's
    solve, the restrictions); it offers its plans to the search itself."""

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
