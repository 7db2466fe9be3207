"""The whole graph as Moccasin's retention-interval constraint program
(``remat.formulations.moccasin``) on CP-SAT, from a warm start, on one device or on a
placement over several: a search phase that scales to graphs of thousands of nodes (the
model has O(n) intervals, built in well under a second at 1,000 nodes). Every solver
incumbent is judged by the simulator and offered to the search as it is found. The model
limits each node's computations (and fixes its device), so CP-SAT's bound is a
restriction's and is not reported."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from remat.formulations.moccasin import MoccasinModel, Placement, build_moccasin
from remat.schedule import Schedule
from remat.simulator import held_fixed_bytes
from remat.solvers.backend import SolverUnavailable
from remat.solvers.cpsat import solve_watched
from remat.solvers.model import SolveResult, SolveStatus
from remat.strategies.common.policy import device_fixed_bytes
from remat.strategies.common.problem import Problem
from remat.strategies.exact.state import IncumbentStall, Search

logger = logging.getLogger(__name__)


def on_device(problem: Problem, device: str) -> Placement:
    """Every node of ``problem`` on ``device``."""
    fixed = device_fixed_bytes(problem, device)
    return Placement.single(device, len(problem.graph), problem.budgets.get(device), fixed)


def placed(problem: Problem, names: Sequence[str], home: np.ndarray) -> Placement:
    """Node i of ``problem`` on ``names[home[i]]``, each device holding the fixed tensors
    of the nodes placed there (the simulator's rule)."""
    fixed = [held_fixed_bytes(problem.graph, np.flatnonzero(home == d)) for d in range(len(names))]
    budgets = tuple(problem.budgets.get(name) for name in names)
    return Placement(tuple(names), home, budgets, tuple(fixed))


def solve_intervals(
    search: Search,
    placement: Placement,
    warm: Schedule | None,
    strategy: str,
    improve_by: float | None = None,
    until_better: bool = False,
    stall_s: float | None = None,
) -> SolveResult:
    """Moccasin's model of the search's problem on ``placement`` for the time the search
    has left, with ``SearchConfig.moccasin_computations`` computations per node at most
    (more where ``warm`` recomputes a node more often, so that ``warm`` is a solution),
    hinted with ``warm``; plans are offered to the search under ``strategy``'s name.

    From a hint, on two threads or more, CP-SAT runs its large neighbourhood search alone
    (``use_lns_only``): its neighbourhoods of the incumbent improve a large graph's plan
    faster than a portfolio that gives a worker to the full problem (on one thread CP-SAT
    searches sequentially, LNS or not). LNS needs a first solution, which its
    first-solution workers complete from the hint; where they have none after
    ``SearchConfig.moccasin_hint_share`` of the time (none where it is 0), the default
    portfolio takes the time left. Where ``improve_by`` (``time.monotonic()``) is given, it
    stops then unless it has found a plan below the search's incumbent at its start; with
    ``until_better``, it stops at its first such plan; with ``stall_s``, once the search's
    incumbent has not improved for that long since CP-SAT's first solution
    (``IncumbentStall``): completing the hint on a large graph takes seconds."""
    try:
        from ortools.sat.python import cp_model
    except ImportError as exc:
        raise SolverUnavailable(f"ortools cannot be imported: {exc}") from exc
    problem = search.problem
    config = problem.solver.search
    computations = np.full(len(problem.graph), config.moccasin_computations)
    if warm is not None:
        computations = np.maximum(computations, warm.R.any(axis=0).sum(axis=0))
    formulation = build_moccasin(problem.graph, problem.costs, placement, computations)
    began = time.monotonic()
    status, found = None, 0
    before = search.best_ms
    stalled = IncumbentStall(search, stall_s, started=False)

    def given_up() -> bool:
        after = search.best_ms
        better = after is not None and (before is None or after < before)
        if until_better and better:
            return True
        return improve_by is not None and time.monotonic() > improve_by and not better

    if warm is not None:
        formulation.hint(warm)
    threads = problem.solver.options.threads
    if warm is not None and config.moccasin_hint_share > 0 and threads > 1:
        patience = began + max(0.0, search.time_left()) * config.moccasin_hint_share
        status, found = _solve(cp_model, formulation, search, strategy, patience, given_up, stalled)
        logger.debug("%s: intervals model by LNS from the hint: %d plans", strategy, found)
    if (
        not found
        and status != cp_model.INFEASIBLE
        and not problem.cancelled
        and not given_up()
        and search.time_left() > 0
    ):
        status, found = _solve(cp_model, formulation, search, strategy, None, given_up, stalled)
    seconds = time.monotonic() - began
    name = "not run" if status is None else cp_model.CpSolver().status_name(status)
    logger.debug("%s: intervals model %s in %.3g s", strategy, name, seconds)
    return SolveResult(_status(cp_model, status), None, None, None, None, seconds, "", "cpsat")


def _solve(
    cp_model: Any,
    formulation: MoccasinModel,
    search: Search,
    strategy: str,
    patience: float | None,
    given_up: Callable[[], bool],
    stalled: IncumbentStall,
) -> tuple[Any, int]:
    """One CP-SAT solve of ``formulation`` for the time the search has left: by LNS alone
    where ``patience`` is given, stopped at that ``time.monotonic()`` if it has found no
    solution by then; the default portfolio where it is None; stopped once ``given_up``,
    or ``stalled`` (started at its first solution). Its status and the number of solutions
    it found."""
    problem = search.problem

    class _Incumbents(cp_model.CpSolverSolutionCallback):
        found = 0

        def on_solution_callback(self) -> None:
            self.found += 1
            stalled.start()
            search.judge(formulation.decode(self.value), strategy)

    def stop() -> bool:
        if problem.cancelled or given_up() or stalled.is_set():
            return True
        return patience is not None and not incumbents.found and time.monotonic() > patience

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.0, search.time_left())
    solver.parameters.num_workers = max(1, problem.solver.options.threads)
    solver.parameters.use_lns_only = patience is not None
    incumbents = _Incumbents()
    status = solve_watched(solver, formulation.model, incumbents, stop, search.heartbeat)
    return status, incumbents.found


def _status(cp_model: Any, status: Any) -> SolveStatus:
    """Infeasible and optimal hold for the restriction only: neither is the problem's."""
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SolveStatus.FEASIBLE
    return SolveStatus.UNKNOWN
