"""HiGHS backend (``highspy``): MILPs only, so a quadratic model is solved ``linearized()``.

Progress comes from the MIP interrupt callback: with ``output_flag`` off HiGHS fires no
``kCallbackMipLogging`` events, but the interrupt callback fires many times a second and its
``data_out`` carries the primal bound, dual bound and running time. The same callback is
where ``should_stop()`` is polled (``e.interrupt()`` ends the solve as ``kInterrupt``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from remat.solvers.backend import Incumbent, Reporter, SolverUnavailable, relative_gap
from remat.solvers.model import MILPModel, Progress, SolveOptions, SolveResult, SolveStatus

# HiGHS statuses after which an incumbent, if any, is a valid feasible answer.
_STOPPED = (
    "kTimeLimit",
    "kInterrupt",
    "kHighsInterrupt",
    "kIterationLimit",
    "kSolutionLimit",
    "kObjectiveBound",
    "kObjectiveTarget",
    "kMemoryLimit",
)


# Dual simplex pricing for LPs: devex instead of HiGHS's choice (dual steepest edge), which
# is markedly faster on XEngine's relaxations (docs/solvers.md, "Measurements behind the
# defaults").
LP_DUAL_PRICING = 1  # simplex_dual_edge_weight_strategy: 1 is devex


def solve(
    model: MILPModel,
    options: SolveOptions,
    progress: Callable[[Progress], None],
    should_stop: Callable[[], bool],
    incumbent: Incumbent | None = None,
) -> SolveResult:
    try:
        import highspy
    except ImportError as exc:
        raise SolverUnavailable(f"highspy cannot be imported: {exc}") from exc

    milp = model.linearized()
    h = highspy.Highs()
    _set_options(h, options)
    if not np.any(milp.integer):
        h.setOptionValue("simplex_dual_edge_weight_strategy", LP_DUAL_PRICING)
    reporter = Reporter(progress, incumbent)
    status = h.passModel(_lp(milp, highspy))
    if status == highspy.HighsStatus.kError:
        return _error("HiGHS rejected the model (passModel)", reporter)
    if milp.start is not None:
        _warm_start(h, milp, highspy)
    _subscribe(h, milp, model.n_vars, reporter, should_stop)
    h.run()
    return _result(h, milp, model.n_vars, reporter, highspy)


def _set_options(h: Any, options: SolveOptions) -> None:
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(options.time_limit_s))
    h.setOptionValue("mip_rel_gap", float(options.gap))
    # HiGHS's thread pool is process-global and fixed at the first solve; each solve runs
    # in a fresh process, so setting it here takes effect.
    h.setOptionValue("threads", int(options.threads))
    if not options.presolve:
        h.setOptionValue("presolve", "off")


def _lp(milp: MILPModel, highspy: Any) -> Any:
    lp = highspy.HighsLp()
    lp.num_col_ = milp.n_vars
    lp.num_row_ = milp.n_rows
    lp.col_cost_ = np.asarray(milp.c, dtype=float)
    lp.col_lower_ = np.asarray(milp.lb, dtype=float)
    lp.col_upper_ = np.asarray(milp.ub, dtype=float)
    lp.row_lower_ = np.asarray(milp.row_lb, dtype=float)
    lp.row_upper_ = np.asarray(milp.row_ub, dtype=float)
    lp.offset_ = float(milp.offset)
    A = milp.A.tocsr()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = milp.n_vars
    lp.a_matrix_.num_row_ = milp.n_rows
    lp.a_matrix_.start_ = A.indptr.astype(np.int32)
    lp.a_matrix_.index_ = A.indices.astype(np.int32)
    lp.a_matrix_.value_ = A.data.astype(float)
    if np.any(milp.integer):
        kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
        lp.integrality_ = [kinds[int(flag)] for flag in milp.integer]
    return lp


def _warm_start(h: Any, milp: MILPModel, highspy: Any) -> None:
    # HiGHS checks the start itself and keeps it as the first incumbent if it is feasible.
    solution = highspy.HighsSolution()
    solution.col_value = np.asarray(milp.start, dtype=float)
    solution.value_valid = True
    h.setSolution(solution)


def _subscribe(
    h: Any,
    milp: MILPModel,
    n_original: int,
    reporter: Reporter,
    should_stop: Callable[[], bool],
) -> None:
    def on_improving(e: Any) -> None:
        # data_out is only valid during the callback: copy the solution now.
        x = np.array(e.data_out.mip_solution, dtype=float)[:n_original]
        reporter.update(e.data_out.objective_function_value, e.data_out.mip_dual_bound, x)

    def on_interrupt(e: Any) -> None:
        if should_stop():
            e.interrupt()
        reporter.update(e.data_out.mip_primal_bound, e.data_out.mip_dual_bound)

    h.cbMipImprovingSolution.subscribe(on_improving)
    h.cbMipInterrupt.subscribe(on_interrupt)


def _result(
    h: Any, milp: MILPModel, n_original: int, reporter: Reporter, highspy: Any
) -> SolveResult:
    reporter.flush()
    seconds = reporter.elapsed()
    name = h.getModelStatus().name
    info = h.getInfo()
    has_solution = info.primal_solution_status == highspy.kSolutionStatusFeasible
    x = None
    objective = bound = None
    if has_solution:
        x = np.array(h.getSolution().col_value, dtype=float)[:n_original]
        objective = float(info.objective_function_value)
    # A MIP's dual bound bounds also when no solution was found. An LP (no integers) has
    # none: its optimum is its own bound, but a solution stopped short of optimality
    # bounds nothing.
    if np.any(milp.integer):
        bound = float(info.mip_dual_bound)
    elif name == "kOptimal":
        bound = objective
    if bound is None or not np.isfinite(bound):
        bound = None
    elif objective is not None and bound > objective:
        bound = objective
    gap = relative_gap(objective, bound)

    def make(status: SolveStatus, message: str = "") -> SolveResult:
        return SolveResult(status, x, objective, bound, gap, seconds, message, "highs")

    if name == "kOptimal":
        return make(SolveStatus.OPTIMAL)
    if name == "kInfeasible":
        return make(SolveStatus.INFEASIBLE)
    if name in _STOPPED or name == "kUnknown":
        if has_solution:
            return make(SolveStatus.FEASIBLE, f"HiGHS stopped: {name[1:]}")
        return make(SolveStatus.UNKNOWN, f"HiGHS stopped without a solution: {name[1:]}")
    if name == "kUnboundedOrInfeasible":
        return make(SolveStatus.UNKNOWN, "HiGHS: infeasible or unbounded (not resolved)")
    if name == "kUnbounded":
        return make(SolveStatus.ERROR, "HiGHS: the model is unbounded")
    return make(SolveStatus.ERROR, f"HiGHS failed: {h.modelStatusToString(h.getModelStatus())}")


def _error(message: str, reporter: Reporter) -> SolveResult:
    return SolveResult(SolveStatus.ERROR, None, None, None, None, reporter.elapsed(), message)
