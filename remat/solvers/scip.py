"""SCIP backend (``pyscipopt``): takes the MIQP as written.

SCIP wants a linear objective, so the bilinear terms go into one constraint
``sum coef * x_i * x_j - t <= 0`` and the objective is ``c x + t + offset``; minimising
makes t equal to the quadratic part. Progress and ``should_stop`` run in an event handler
(best solution found, node solved, LP solved, presolve round): ``interruptSolve()`` is only
safe from inside SCIP's own callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from remat.solvers.backend import Incumbent, Reporter, SolverUnavailable, relative_gap
from remat.solvers.model import MILPModel, Progress, SolveOptions, SolveResult, SolveStatus

_OPTIMAL = ("optimal", "gaplimit")  # gaplimit: proven within options.gap, as HiGHS's optimal
_STOPPED = (
    "timelimit",
    "userinterrupt",
    "nodelimit",
    "totalnodelimit",
    "stallnodelimit",
    "memlimit",
    "sollimit",
    "bestsollimit",
    "restartlimit",
    "primallimit",
    "duallimit",
    "terminate",
    "unknown",
)


def solve(
    model: MILPModel,
    options: SolveOptions,
    progress: Callable[[Progress], None],
    should_stop: Callable[[], bool],
    incumbent: Incumbent | None = None,
) -> SolveResult:
    try:
        import pyscipopt
    except ImportError as exc:
        raise SolverUnavailable(f"pyscipopt cannot be imported: {exc}") from exc

    scip = pyscipopt.Model()
    scip.hideOutput()
    _set_options(scip, options)
    x, t = _build(scip, model, pyscipopt)
    if model.start is not None:
        _warm_start(scip, model, x, t)
    reporter = Reporter(progress, incumbent)
    handler = _handler(pyscipopt, x, reporter, should_stop)
    scip.includeEventhdlr(handler, "remat_progress", "progress and cooperative stop")
    scip.optimize()
    return _result(scip, x, reporter)


def _set_options(scip: Any, options: SolveOptions) -> None:
    scip.setParam("limits/time", float(options.time_limit_s))
    scip.setParam("limits/gap", float(options.gap))
    # SCIP's branch and bound is sequential; threads only matter for its concurrent mode,
    # which this backend does not use.
    scip.setParam("misc/catchctrlc", False)  # the runner owns signals
    if not options.presolve:
        scip.setParam("presolving/maxrounds", 0)


def _build(scip: Any, model: MILPModel, pyscipopt: Any) -> tuple[list[Any], Any]:
    x = [
        scip.addVar(
            name=model.names[j] if model.names else f"x{j}",
            vtype=_vtype(model, j),
            lb=_finite(model.lb[j]),
            ub=_finite(model.ub[j]),
        )
        for j in range(model.n_vars)
    ]
    A = model.A.tocsr()
    for r in range(model.n_rows):
        lo, hi = A.indptr[r], A.indptr[r + 1]
        expr = pyscipopt.quicksum(
            float(a) * x[j] for j, a in zip(A.indices[lo:hi], A.data[lo:hi], strict=True)
        )
        scip.addCons(
            pyscipopt.scip.ExprCons(
                expr, lhs=_finite(model.row_lb[r]), rhs=_finite(model.row_ub[r])
            )
        )
    objective = pyscipopt.quicksum(float(c) * x[j] for j, c in enumerate(model.c) if c != 0)
    t = None
    if model.quadratic:
        t = scip.addVar(name="quadratic_part", vtype="C", lb=None, ub=None)
        quad = pyscipopt.quicksum(float(coef) * x[i] * x[j] for i, j, coef in model.quadratic)
        scip.addCons(quad - t <= 0)
        objective = objective + t
    scip.setObjective(objective + float(model.offset), "minimize")
    return x, t


def _vtype(model: MILPModel, j: int) -> str:
    if not model.integer[j]:
        return "C"
    return "B" if model.lb[j] >= 0 and model.ub[j] <= 1 else "I"


def _finite(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None  # None: SCIP's infinity


def _warm_start(scip: Any, model: MILPModel, x: list[Any], t: Any) -> None:
    start = np.asarray(model.start, dtype=float)
    sol = scip.createSol()
    for var, value in zip(x, start, strict=True):
        scip.setSolVal(sol, var, float(value))
    if t is not None:
        scip.setSolVal(sol, t, model.quadratic_value(start))
    # Before solving, SCIP stores the start and checks it when the problem is transformed.
    scip.addSol(sol, free=True)


def _handler(
    pyscipopt: Any, x: list[Any], reporter: Reporter, should_stop: Callable[[], bool]
) -> Any:
    events = pyscipopt.SCIP_EVENTTYPE
    mask = events.BESTSOLFOUND | events.NODESOLVED | events.LPSOLVED | events.PRESOLVEROUND

    class _Progress(pyscipopt.Eventhdlr):
        def eventinit(self) -> None:
            self.model.catchEvent(mask, self)

        def eventexit(self) -> None:
            self.model.dropEvent(mask, self)

        def eventexec(self, event: Any) -> None:
            scip = self.model
            if should_stop():
                scip.interruptSolve()
            if event.getType() == events.BESTSOLFOUND:
                best = scip.getBestSol()

                def values() -> np.ndarray:
                    # Read lazily: the best solution stays valid until the reporter sends it.
                    return np.array([scip.getSolVal(best, var) for var in x], dtype=float)

                reporter.update(scip.getSolObjVal(best), _bound(scip), values)
            else:
                reporter.update(bound=_bound(scip))

    return _Progress()


def _bound(scip: Any) -> float | None:
    value = scip.getDualbound()
    return None if abs(value) >= scip.infinity() else float(value)


def _result(scip: Any, x: list[Any], reporter: Reporter) -> SolveResult:
    reporter.flush()
    seconds = reporter.elapsed()
    status = scip.getStatus()
    has_solution = scip.getNSols() > 0
    values = objective = bound = None
    if has_solution:
        best = scip.getBestSol()
        values = np.array([scip.getSolVal(best, var) for var in x], dtype=float)
        objective = float(scip.getSolObjVal(best))
        bound = _bound(scip)
        bound = None if bound is None else min(bound, objective)
    gap = relative_gap(objective, bound)

    def make(solve_status: SolveStatus, message: str = "") -> SolveResult:
        return SolveResult(solve_status, values, objective, bound, gap, seconds, message, "scip")

    if status in _OPTIMAL and has_solution:
        return make(SolveStatus.OPTIMAL)
    if status == "infeasible":
        return make(SolveStatus.INFEASIBLE)
    if status == "inforunbd":
        return make(SolveStatus.UNKNOWN, "SCIP: infeasible or unbounded (not resolved)")
    if status == "unbounded":
        return make(SolveStatus.ERROR, "SCIP: the model is unbounded")
    if status in _STOPPED or status in _OPTIMAL:
        if has_solution:
            return make(SolveStatus.FEASIBLE, f"SCIP stopped: {status}")
        return make(SolveStatus.UNKNOWN, f"SCIP stopped without a solution: {status}")
    return make(SolveStatus.ERROR, f"SCIP ended with status {status!r}")
