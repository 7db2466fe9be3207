"""The bound of the whole problem that every exact search starts from: the ideal plus the
recomputation cover's bound on what every plan pays beyond it
(``remat.formulations.cover``), a relaxation small enough for any graph, so that a search
on a graph too large for its full model still reports a gap against a bound above the
ideal. On several devices, the device cover (``remat.formulations.device_cover``) budgets
each device on its own, where the covers pool them.

The pooled covers are solved in this process by SciPy's HiGHS (``scipy.optimize.milp``),
not in a solver subprocess (``remat.solvers.runner``): they take a fraction of a second,
less than a subprocess takes to start, and every exact search on every graph runs them
(a decomposed graph's search runs them in a process beside its parts, whose Python holds
this process meanwhile: ``search._covers_beside``).
The device cover's MILP takes up to half a minute: it is solved in a subprocess, which a
cancelled search stops. The device cover with closure rows (``device_closure_model``) is
only built here."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, OptimizeResult, milp

from remat.formulations.cover import build_closure, build_cover
from remat.formulations.device_cover import DeviceCoverModel, build_device_cover
from remat.simulator import held_fixed_bytes
from remat.solvers import runner
from remat.solvers.model import MILPModel, SolveOptions, StopFlag
from remat.strategies.common.problem import Problem

logger = logging.getLogger(__name__)


def cover_extra_ms(problem: Problem, names: Sequence[str], seconds: float) -> float | None:
    """A lower bound on what every plan of ``problem`` on ``names`` costs beyond the ideal
    on them (``CostModel.ideal_ms``): the cover's bound, solved for at most ``seconds`` (a
    stopped solve's bound still bounds). None when no memory constraint binds (the ideal
    is the bound) or the solve gives none."""
    pooled, fastest, fixed = _relaxed(problem, names)
    cover = build_cover(problem.graph, fastest, problem.costs.output_bytes, pooled, fixed)
    if cover.model is None:
        return None
    model = cover.model
    solved = _solved(model, time_limit=seconds, mip_rel_gap=problem.solver.search.proven_gap)
    bound = getattr(solved, "mip_dual_bound", None)
    if bound is None or not math.isfinite(bound):
        logger.debug("recomputation cover: no bound (%s)", solved.message)
        return None
    logger.debug("recomputation cover: %d rows, bound +%.6g ms", model.n_rows, bound)
    return float(bound)


def closure_extra_ms(problem: Problem, names: Sequence[str], seconds: float) -> float | None:
    """A lower bound on what every plan costs beyond the ideal on ``names``: the closure
    cover's LP relaxation (``formulations.cover.build_closure``), which charges a dropped
    value's inputs too. None when no memory constraint binds or the LP is not solved within
    ``seconds`` (a stopped LP solve bounds nothing)."""
    pooled, fastest, fixed = _relaxed(problem, names)
    if pooled is None:
        return None
    config = problem.solver.search
    cells, depth = config.closure_cells, config.closure_depth
    output_bytes = problem.costs.output_bytes
    model = build_closure(problem.graph, fastest, output_bytes, pooled, fixed, cells, depth)
    if model is None:
        return None
    solved = _solved(model, time_limit=seconds)
    if solved.status != 0 or solved.fun is None:
        logger.debug("closure cover: no bound (%s)", solved.message)
        return None
    logger.debug("closure cover: %d variables, bound +%.6g ms", model.n_vars, solved.fun)
    return float(solved.fun)


def covers_extra_ms(problem: Problem, names: Sequence[str], seconds: float) -> float | None:
    """The larger of the two covers' bounds beyond the ideal, each solved for at most
    ``seconds``; None when neither gives one."""
    extras = [extra(problem, names, seconds) for extra in (cover_extra_ms, closure_extra_ms)]
    return max((e for e in extras if e is not None), default=None)


@dataclass(frozen=True)
class DeviceBound:
    """The device cover's bound on every plan's cost (ms) and the placement of its best
    solution (``home[v]``: the index in ``names`` of node v's device)."""

    bound_ms: float
    home: np.ndarray | None


def device_cover(
    problem: Problem, names: Sequence[str], seconds: float, cancel: StopFlag | None = None
) -> DeviceBound | None:
    """The device cover (``formulations.device_cover``) of ``problem`` on two or more
    devices ``names``, solved with ``lp_backend`` on one thread in a solver subprocess for
    at most ``seconds``, or until ``cancel``: its dual bound (a stopped solve's still
    bounds) and its incumbent's placement, if it has one."""
    config = problem.solver.search
    cover = _device_cover_model(problem, names, depth=0, cells=config.closure_cells)
    options = SolveOptions(time_limit_s=seconds, gap=config.proven_gap, threads=1)
    solved = runner.solve(cover.model, backend=config.lp_backend, options=options, cancel=cancel)
    if solved.bound is None or not math.isfinite(solved.bound):
        logger.debug("device cover: no bound (%s)", solved.message)
        return None
    home = None if solved.x is None else cover.placement(solved.x)
    logger.debug("device cover: %d variables, bound %.6g ms", cover.model.n_vars, solved.bound)
    return DeviceBound(solved.bound, home)


def device_closure_model(problem: Problem, names: Sequence[str]) -> DeviceCoverModel:
    """The device cover of ``problem`` on two or more devices ``names`` with the closure
    cover's rows on each device (a recomputation on d needs its inputs on d, ``closure_depth``
    steps back). Its optimum bounds every plan's cost. Its LP relaxation is weak (a node
    split over devices halves its memory on each), so the bound is the MILP's dual bound,
    which a solve stopped early still gives; that solve takes longer than a solver
    subprocess takes to start, and is solved in one (``search.bound_by_closure``). Its
    incumbents' placements are where the interval model on several devices runs
    (``search._decomposed_on_devices``)."""
    config = problem.solver.search
    return _device_cover_model(problem, names, config.closure_depth, config.device_closure_cells)


def _device_cover_model(
    problem: Problem, names: Sequence[str], depth: int, cells: int
) -> DeviceCoverModel:
    """The device cover of ``problem`` on ``names``, its closure rows ``depth`` steps deep,
    its binding stages thinned to ``cells`` dropped-value columns."""
    costs, graph = problem.costs, problem.graph
    columns = [costs.device_index(name) for name in names]
    copies = costs.copy_ms[:, columns][:, :, columns]
    others = ~np.eye(len(columns), dtype=bool)
    copy_in = np.where(others[None], copies, np.inf).min(axis=1)
    return build_device_cover(
        graph,
        costs.compute_ms[:, columns],
        copy_in,
        costs.output_bytes,
        [problem.budgets.get(name) for name in names],
        held_fixed_bytes(graph, range(len(graph))),
        cells,
        depth,
    )


def _relaxed(problem: Problem, names: Sequence[str]) -> tuple[int | None, np.ndarray, int]:
    """What the covers relax ``problem`` on ``names`` to: the budgets pooled (None if one
    is unlimited), each node's time on its fastest device, every fixed tensor held."""
    costs, graph = problem.costs, problem.graph
    budgets = [problem.budgets.get(name) for name in names]
    pooled = None if any(b is None for b in budgets) else sum(b for b in budgets if b)
    fastest = costs.compute_ms[:, [costs.device_index(name) for name in names]].min(axis=1)
    return pooled, fastest, held_fixed_bytes(graph, range(len(graph)))


def _solved(model: MILPModel, **options: float) -> OptimizeResult:
    """``model`` solved by SciPy's HiGHS with ``options`` (``scipy.optimize.milp``'s)."""
    return milp(
        model.c,
        integrality=model.integer.astype(int),
        bounds=Bounds(model.lb, model.ub),
        constraints=LinearConstraint(model.A, model.row_lb, model.row_ub),
        options=options,
    )
