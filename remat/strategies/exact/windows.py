"""Large neighbourhood search over windows of stages: the incumbent's computations in one
window of stages, or in a forward range and the backward stages that read it, decided
again by Moccasin's model restricted to them (``formulations.moccasin_windows``), each
neighbourhood solved by CP-SAT, most to optimality in about a second. Every improvement
is judged by the simulator and offered to the search, and the next neighbourhood starts
from the search's incumbent.

CP-SAT's own LNS on the whole interval model (``intervals.solve_intervals``) keeps the
whole cumulative constraint in every neighbourhood, whose propagation takes most of its
time on graphs of several hundred nodes; these models hold only the windows' intervals
and one fixed interval per window and gap for the rest. A single window cannot change
what the forward pass keeps for the backward pass (those intervals span it); a pair of
mirrored windows can. The two kinds alternate.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from remat.costs import CostModel
from remat.formulations.common import Structure
from remat.formulations.moccasin import COST_SCALE, Placement, retained_of
from remat.formulations.moccasin_windows import build_windows, recomputation_ms
from remat.graph import Graph, NodeKind
from remat.schedule import Schedule
from remat.solvers.backend import SolverUnavailable
from remat.solvers.cpsat import solve_watched
from remat.strategies.exact.state import IncumbentStall, Search
from remat.strategies.heuristics.evict import home_of

logger = logging.getLogger(__name__)

Windows = list[tuple[int, int]]


def improve_by_windows(
    search: Search,
    placement: Placement,
    strategy: str,
    incumbent: Callable[[], Schedule | None],
    until: float,
    stall_s: float | None = None,
) -> int:
    """Window neighbourhoods of ``incumbent()`` (the search's incumbent schedule) on
    ``placement`` until ``until`` (``time.monotonic()``), cancellation, an incumbent not
    on ``placement``, or, with ``stall_s``, once the search's incumbent has not improved
    for that long; improvements are offered under ``strategy``'s name. Returns the number
    of neighbourhoods that improved the incumbent."""
    try:
        from ortools.sat.python import cp_model
    except ImportError as exc:
        raise SolverUnavailable(f"ortools cannot be imported: {exc}") from exc
    problem = search.problem
    config = problem.solver.search
    graph, costs = problem.graph, problem.costs
    structure = Structure.of(graph)
    pick = _Picker(graph, config.window_stages, random.Random(config.window_seed))
    improved = tried = 0
    stalled = IncumbentStall(search, stall_s)
    while time.monotonic() < until and not problem.cancelled and not stalled.is_set():
        began = time.monotonic()
        schedule = incumbent()
        if schedule is None or not _on(schedule, placement):
            break
        retained = retained_of(schedule, graph)
        windows = pick.next(costs, placement, retained)
        if windows is None:
            break
        picked = time.monotonic()
        model = build_windows(graph, costs, placement, retained, windows, structure=structure)
        built = time.monotonic()
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(
            0.0, min(config.window_solve_s, until - time.monotonic())
        )
        solver.parameters.num_workers = max(1, problem.solver.options.threads)
        found = _stall_watch(cp_model, config.window_stall_s, lambda: problem.cancelled)
        status = solve_watched(solver, model.model, found, found.should_stop, search.heartbeat)
        if status == cp_model.INFEASIBLE:  # the incumbent is a solution: a model error
            logger.warning("windows %s: the neighbourhood excludes the incumbent", windows)
        tried += 1
        solved = time.monotonic()
        pick.solved(status == cp_model.OPTIMAL, solved - built, config.window_solve_s)
        found_ms = None
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            found_ms = solver.objective_value / COST_SCALE
        if found_ms is not None and found_ms < model.incumbent_cost_ms * (1 - 1e-9) - 1e-9:
            before = search.best_ms
            search.judge(model.decode(solver.value), strategy)
            if search.best_ms != before:
                improved += 1
        logger.debug(
            "windows %s: %d intervals, recomputation %.4g -> %s ms, %s; "
            "incumbent %.3f s, model %.3f s, solve %.3f s, judged %.3f s",
            windows,
            model.intervals,
            model.incumbent_cost_ms,
            "-" if found_ms is None else f"{found_ms:.4g}",
            solver.status_name(status),
            picked - began,
            built - picked,
            solved - built,
            time.monotonic() - solved,
        )
    logger.debug("%s: %d window neighbourhoods, %d improved the plan", strategy, tried, improved)
    return improved


def _stall_watch(cp_model: Any, stall_s: float, cancelled: Callable[[], bool]) -> Any:
    """A solution callback whose ``should_stop`` says the solve is cancelled or has found
    no better solution for ``stall_s`` (since its start, before the first)."""

    class Improvements(cp_model.CpSolverSolutionCallback):
        def __init__(self) -> None:
            super().__init__()
            self.last = time.monotonic()

        def on_solution_callback(self) -> None:
            self.last = time.monotonic()

        def should_stop(self) -> bool:
            return cancelled() or time.monotonic() - self.last > stall_s

    return Improvements()


def _on(schedule: Schedule, placement: Placement) -> bool:
    """``schedule`` computes each node first where ``placement`` puts it."""
    if not set(schedule.devices) <= set(placement.devices):
        return False
    return bool(np.array_equal(home_of(schedule, placement.devices), placement.home))


class _Picker:
    """The windows of the next neighbourhood: by turns one window of about ``stages``
    stages (from half to one and a half times), and a forward range of about half that
    with the stages of its backward nodes (where the graph has them). Windows in which the
    incumbent recomputes nothing are passed over: their optimum is the incumbent's. The
    size adapts: a quarter smaller after a solve stopped by its time limit, a tenth larger
    after one proven optimal in under a fifth of it."""

    def __init__(self, graph: Graph, stages: int, rng: random.Random) -> None:
        self.n = len(graph)
        self.size = float(min(max(8, stages), self.n))
        self.rng = rng
        self.turn = 0
        self.backward: dict[int, list[int]] = {}
        for node in graph.nodes:
            if node.kind is not NodeKind.FORWARD and node.forward is not None:
                self.backward.setdefault(node.forward, []).append(node.id)
        self.forward = sorted(self.backward)

    def next(
        self, costs: CostModel, placement: Placement, retained: list[list[tuple[int, int]]]
    ) -> Windows | None:
        """The next windows, or None where 100 draws found none with a recomputation."""
        for _ in range(100):
            self.turn += 1
            mirrored = self.turn % 2 == 0 and bool(self.forward)
            windows = self._mirrored() if mirrored else self._single()
            if recomputation_ms(costs, placement, retained, windows) > 0:
                return windows
        return None

    def solved(self, optimal: bool, seconds: float, limit: float) -> None:
        """Adapt the size to the last solve: ``optimal`` or not, in ``seconds`` of
        ``limit``."""
        if not optimal:
            self.size = max(8.0, self.size * 0.75)
        elif seconds < limit / 5:
            self.size = min(float(self.n), self.size * 1.1)

    @property
    def stages(self) -> int:
        return int(self.size)

    def _single(self) -> Windows:
        size = self.rng.randint(self.stages // 2, self.stages * 3 // 2)
        a = self.rng.randrange(self.n)
        return [(a, min(self.n, a + size))]

    def _mirrored(self) -> Windows:
        size = self.rng.randint(max(1, self.stages // 4), self.stages * 3 // 4)
        first = self.rng.randrange(len(self.forward))
        chosen = self.forward[first : first + size]
        stages = [k for f in chosen for k in self.backward[f]]
        return [(chosen[0], chosen[-1] + 1), (min(stages), max(stages) + 1)]
