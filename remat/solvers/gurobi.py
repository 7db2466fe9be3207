"""Gurobi backend (``gurobipy`` matrix API): takes the MIQP as written.

Without a license the wheel is size-limited (2000 variables / 2000 linear constraints, 200
variables with a quadratic objective) and ``optimize()`` raises ``GurobiError`` 10010; that
and a missing license become ``SolverUnavailable`` so the runner can fall back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import scipy.sparse as sp

from remat.solvers.backend import Incumbent, Reporter, SolverUnavailable, relative_gap
from remat.solvers.model import MILPModel, Progress, SolveOptions, SolveResult, SolveStatus

_SIZE_LIMIT = 10010  # "Model too large for size-limited license"
_NO_LICENSE = 10009
_INFINITY = 1e100  # Gurobi's "no incumbent / no bound" value is 1e100 (GRB.INFINITY)


def solve(
    model: MILPModel,
    options: SolveOptions,
    progress: Callable[[Progress], None],
    should_stop: Callable[[], bool],
    incumbent: Incumbent | None = None,
) -> SolveResult:
    try:
        import gurobipy as gp
    except ImportError as exc:
        raise SolverUnavailable(f"gurobipy cannot be imported: {exc}") from exc

    reporter = Reporter(progress, incumbent)
    try:
        with _env(gp) as env, gp.Model(env=env) as grb:
            x = _build(gp, grb, model)
            _set_options(grb, options)
            grb.optimize(_callback(gp, x, reporter, should_stop))
            if grb.Status == gp.GRB.INF_OR_UNBD:
                # Presolve's dual reductions leave infeasible-or-unbounded open; settle it.
                grb.Params.DualReductions = 0
                grb.optimize(_callback(gp, x, reporter, should_stop))
            return _result(gp, grb, x, model, reporter)
    except gp.GurobiError as exc:
        if exc.errno == _SIZE_LIMIT:
            raise SolverUnavailable(f"model too large for size-limited license ({exc})") from exc
        if exc.errno == _NO_LICENSE:
            raise SolverUnavailable(f"no Gurobi license ({exc})") from exc
        raise


def _env(gp: Any) -> Any:
    env = gp.Env(empty=True)
    env.setParam("OutputFlag", 0)  # also keeps the license banner off stdout
    env.start()
    return env


def _build(gp: Any, grb: Any, model: MILPModel) -> Any:
    vtype = np.where(model.integer, gp.GRB.INTEGER, gp.GRB.CONTINUOUS)
    binary = model.integer & (model.lb >= 0) & (model.ub <= 1)
    vtype = np.where(binary, gp.GRB.BINARY, vtype)
    x = grb.addMVar(model.n_vars, lb=model.lb, ub=model.ub, vtype=vtype)
    _add_rows(grb, x, model)
    Q = None
    if model.quadratic:
        i, j, coef = zip(*model.quadratic, strict=True)
        Q = sp.csr_array((coef, (i, j)), shape=(model.n_vars, model.n_vars))
    grb.setMObjective(
        Q, np.asarray(model.c, dtype=float), float(model.offset), sense=gp.GRB.MINIMIZE
    )
    if model.start is not None:
        x.Start = np.asarray(model.start, dtype=float)
    return x


def _add_rows(grb: Any, x: Any, model: MILPModel) -> None:
    # The matrix API takes one sense per row: a ranged row becomes two.
    A = model.A.tocsr()
    equal = model.row_lb == model.row_ub
    upper = ~equal & np.isfinite(model.row_ub)
    lower = ~equal & np.isfinite(model.row_lb)
    for mask, sense, rhs in (
        (equal, "=", model.row_ub),
        (upper, "<", model.row_ub),
        (lower, ">", model.row_lb),
    ):
        if np.any(mask):
            grb.addMConstr(A[mask], x, sense, np.asarray(rhs[mask], dtype=float))


def _set_options(grb: Any, options: SolveOptions) -> None:
    grb.Params.TimeLimit = float(options.time_limit_s)
    grb.Params.MIPGap = float(options.gap)
    grb.Params.Threads = int(options.threads)
    if not options.presolve:
        grb.Params.Presolve = 0


def _callback(
    gp: Any, x: Any, reporter: Reporter, should_stop: Callable[[], bool]
) -> Callable[[Any, int], None]:
    where_ = gp.GRB.Callback

    def callback(grb: Any, where: int) -> None:
        if should_stop():
            grb.terminate()  # Gurobi polls callbacks often, in every phase
        if where == where_.MIPSOL:
            reporter.update(
                grb.cbGet(where_.MIPSOL_OBJ),
                _finite(grb.cbGet(where_.MIPSOL_OBJBND)),
                np.asarray(grb.cbGetSolution(x), dtype=float),
            )
        elif where == where_.MIP:
            reporter.update(
                _finite(grb.cbGet(where_.MIP_OBJBST)), _finite(grb.cbGet(where_.MIP_OBJBND))
            )
        else:
            reporter.tick()

    return callback


def _finite(value: float) -> float | None:
    return None if abs(value) >= _INFINITY else float(value)


def _result(gp: Any, grb: Any, x: Any, model: MILPModel, reporter: Reporter) -> SolveResult:
    reporter.flush()
    seconds = reporter.elapsed()
    status = grb.Status
    codes = gp.GRB
    has_solution = grb.SolCount > 0
    values = objective = bound = None
    if has_solution:
        values = np.asarray(x.X, dtype=float)
        objective = float(grb.ObjVal)
        # A continuous model has no ObjBound attribute: its optimum is its own bound.
        bound = float(grb.ObjBound) if grb.IsMIP else objective
        bound = min(bound, objective)
    gap = relative_gap(objective, bound)

    def make(solve_status: SolveStatus, message: str = "") -> SolveResult:
        return SolveResult(solve_status, values, objective, bound, gap, seconds, message, "gurobi")

    if status == codes.OPTIMAL:
        return make(SolveStatus.OPTIMAL)
    if status == codes.INFEASIBLE:
        return make(SolveStatus.INFEASIBLE)
    if status == codes.UNBOUNDED:
        return make(SolveStatus.ERROR, "Gurobi: the model is unbounded")
    if status == codes.INF_OR_UNBD:
        return make(SolveStatus.UNKNOWN, "Gurobi: infeasible or unbounded (not resolved)")
    name = _status_name(gp, status)
    if status == codes.NUMERIC and not has_solution:
        return make(SolveStatus.ERROR, "Gurobi: numerical trouble")
    if has_solution:
        return make(SolveStatus.FEASIBLE, f"Gurobi stopped: {name}")
    return make(SolveStatus.UNKNOWN, f"Gurobi stopped without a solution: {name}")


def _status_name(gp: Any, status: int) -> str:
    names = {
        getattr(gp.GRB.Status, attr): attr
        for attr in dir(gp.GRB.Status)
        if attr.isupper() and isinstance(getattr(gp.GRB.Status, attr), int)
    }
    return names.get(status, str(status))
