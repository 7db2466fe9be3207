"""The contract between the runner and a solver backend, and the helpers backends share.

A backend is one module of ``remat.solvers`` whose module-level ``solve`` is a ``Backend``
and one entry in ``remat.solvers.runner.SOLVERS`` (its name there is the name users pick).
The runner calls ``solve`` in the solve's own subprocess, never in the caller's, so a
backend module must import its solver library inside ``solve`` (raising
``SolverUnavailable`` when it cannot), not at module level: importing every backend module
must stay cheap and import no solver library (ortools and highspy cannot share a process).

This module imports no solver library either.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from remat.solvers.model import MILPModel, Progress, SolveOptions, SolveResult

Incumbent = Callable[[np.ndarray, float], None]


class SolverUnavailable(Exception):
    """The backend cannot solve this model here (not installed, unlicensed, or over a
    size-limited license). The runner falls back to another backend."""


class Backend(Protocol):
    """A backend's ``solve``: solve ``model`` within ``options`` (time limit, gap target,
    threads) and return what it found.

    - ``model`` may carry ``quadratic`` terms (solve it as written or ``linearized()``) and
      a warm ``start``; ``SolveResult.x`` has one value per variable of ``model`` as given
      (``model.n_vars``, without a linearization's products).
    - ``progress`` gets the incumbent's objective, the best bound and the gap as they
      change, ``incumbent`` (if given) each better solution: both through a ``Reporter``,
      which keeps them to one report per interval.
    - ``should_stop()`` is polled from the solver's callbacks; once it is true the solve
      ends soon, returning its incumbent (status ``feasible``) if it has one.
    - A backend that cannot solve here (library missing, no license, over a size-limited
      license) raises ``SolverUnavailable``; the runner then falls back to another backend.
      Any other exception is reported as an ``error`` result, with the last incumbent.

    Backend-specific keywords (``runner.solve(..., backend_options=...)``, e.g. CP-SAT's
    ``resolution``) are extra keyword parameters with defaults.
    """

    def __call__(
        self,
        model: MILPModel,
        options: SolveOptions,
        progress: Callable[[Progress], None],
        should_stop: Callable[[], bool],
        incumbent: Incumbent | None = None,
    ) -> SolveResult: ...


def relative_gap(objective: float | None, bound: float | None) -> float | None:
    """|objective - bound| / |objective| (Gurobi's definition; inf when the objective is 0
    and the bound is not). None while either is unknown."""
    if objective is None or bound is None or not math.isfinite(objective):
        return None
    if not math.isfinite(bound):
        return None
    diff = max(0.0, objective - bound)
    if diff <= 1e-9 * max(1.0, abs(objective)):
        return 0.0
    return diff / abs(objective) if objective != 0 else math.inf


class Reporter:
    """Turns a solver's many callbacks into at most one report every ``interval_s``.

    Backends call ``update`` with whatever they learned (incumbent objective, bound, the
    incumbent itself: an array, or a function producing it when the data stays valid) and
    ``tick`` from frequent callbacks; a report goes out when something changed and the
    interval has passed. Thread-safe: CP-SAT and Gurobi call back from solver threads.
    """

    def __init__(
        self,
        progress: Callable[[Progress], None],
        incumbent: Incumbent | None = None,
        interval_s: float = 0.5,
    ) -> None:
        self._progress = progress
        self._incumbent = incumbent
        self._interval = interval_s
        self._start = time.monotonic()
        self._lock = threading.Lock()
        self._last_sent = -math.inf
        self._changed = False
        self.objective: float | None = None
        self.bound: float | None = None
        # The incumbent not yet sent, with its own objective: the objective reported by
        # some callbacks may already be newer than the last solution seen.
        self._pending: tuple[np.ndarray | Callable[[], np.ndarray], float] | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def update(
        self,
        objective: float | None = None,
        bound: float | None = None,
        x: np.ndarray | Callable[[], np.ndarray] | None = None,
    ) -> None:
        with self._lock:
            if objective is not None and math.isfinite(objective):
                if self.objective is None or objective < self.objective:
                    self.objective = objective
                    self._changed = True
                if x is not None and objective <= self.objective:
                    self._pending = (x, objective)
                    self._changed = True
            # The best proven bound only rises; solvers sometimes report a stale one.
            if (
                bound is not None
                and math.isfinite(bound)
                and (self.bound is None or bound > self.bound)
            ):
                self.bound = bound
                self._changed = True
            self._emit_if_due(force=False)

    def tick(self) -> None:
        with self._lock:
            self._emit_if_due(force=False)

    def flush(self) -> None:
        with self._lock:
            self._emit_if_due(force=True)

    def _emit_if_due(self, force: bool) -> None:
        now = time.monotonic()
        if not self._changed or (not force and now - self._last_sent < self._interval):
            return
        self._last_sent = now
        self._changed = False
        if self._pending is not None and self._incumbent is not None:
            x, objective = self._pending
            self._pending = None  # sent once; the next incumbent replaces it
            self._incumbent(np.asarray(x() if callable(x) else x, dtype=float), objective)
        bound = self.bound
        if bound is not None and self.objective is not None:
            bound = min(bound, self.objective)  # tolerances can put it a hair above
        gap = relative_gap(self.objective, bound)
        self._progress(Progress(now - self._start, self.objective, bound, gap))
