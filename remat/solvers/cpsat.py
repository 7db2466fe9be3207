"""OR-tools CP-SAT backend: integer variables and integer coefficients only.

The model is scaled to integers first (``scale``, pure numpy, no ortools):

- every variable becomes an integer ``k`` with ``x = offset + step * k``. Integer variables
  have step 1 and offset 0; continuous ones that an equality row fixes as ``x = r - (a
  combination of lattice variables)`` get that combination's lattice (``implied_lattice``:
  Checkmate's memory U = fixed bytes / unit + whole units of values, with a fractional
  fixed part, gets offset 0.42 and step 1; XEngine's, with fractional fixed-tensor sizes
  in units, a step of 1/1024); other continuous variables are discretised at
  ``resolution`` (e.g. 1e-6: micro-units) and the solver then works on a restriction of
  the model.
- each row is multiplied by the smallest power of two (up to 2**30), or else of ten (up
  to 1e9), that makes its coefficients integral. When none does, the row is scaled to
  ``_PRECISION`` and rounded
  conservatively: the coefficients are rounded in the direction that over-estimates the
  constrained side for the variable's sign, and whatever a mixed-sign variable can still
  add is taken off the bound, so any point CP-SAT accepts satisfies the original row.
- the objective is scaled the same way; when it has to be rounded, the rounding error
  (bounded with the variable domains) is taken off the reported bound, so it stays valid.

``exact`` records whether the integer model has the same feasible points as the original.
When it does not, CP-SAT's bound and infeasibility proof are about the restriction only:
the result is then ``feasible`` without a bound, or ``unknown`` instead of ``infeasible``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from remat.solvers.backend import Incumbent, Reporter, SolverUnavailable, relative_gap
from remat.solvers.model import MILPModel, Progress, SolveOptions, SolveResult, SolveStatus

DEFAULT_RESOLUTION = 1e-6
_MAX_EXACT_POWER = 9  # try row scale factors 10**0 .. 10**9
_PRECISION = 1e7  # largest coefficient of a row that has to be rounded
_MAX_BINARY_POWER = 30  # binary fractions finer than 2**-30 are treated as arbitrary reals
_INFINITE_DOMAIN = 2**40  # stands in for an infinite variable bound
_INT64 = 2**63 - 1
# "Integral" means integral to float precision: the data is only defined that far, and a
# looser, relative tolerance would call every large number integral.
_REL_TOL = 1e-12
_ABS_TOL = 1e-9
_STOP_POLL_S = 0.05


@dataclass(frozen=True)
class ScaledRow:
    cols: np.ndarray  # int
    coefs: np.ndarray  # int64
    lo: int | None  # None: unbounded side
    hi: int | None


@dataclass(frozen=True)
class ScaledModel:
    step: np.ndarray  # x = offset + step * k
    offset: np.ndarray
    k_lo: np.ndarray  # int64 domains of k
    k_hi: np.ndarray
    rows: tuple[ScaledRow, ...]
    obj: np.ndarray  # int64 objective coefficients of k
    obj_scale: float  # scaled objective = obj_scale * (c @ x)
    obj_error: float  # |unscaled integer objective - c @ x| is at most this
    obj_offset: float  # c @ offset: c @ x = obj_offset + (c * step) @ k
    exact: bool  # same feasible points as the original model

    def x(self, k: np.ndarray) -> np.ndarray:
        k = np.asarray(k, dtype=float)
        n = len(k)  # a prefix of k: the linearization's products dropped
        return self.offset[:n] + self.step[:n] * k

    def k(self, x: np.ndarray) -> np.ndarray:
        """The nearest integer point of ``x`` in the domains (a warm start's hint)."""
        k = np.rint((np.asarray(x, dtype=float) - self.offset) / self.step)
        return np.clip(k, self.k_lo, self.k_hi).astype(np.int64)


# ------------------------------------------------------------------------------- scaling


def scale(model: MILPModel, resolution: float = DEFAULT_RESOLUTION) -> ScaledModel:
    """The integer model CP-SAT solves; see the module docstring. ``model`` must be linear."""
    if model.quadratic:
        raise ValueError("scale() takes a linear model: pass model.linearized()")
    lattice = implied_lattice(model)
    step = np.where(lattice.on, lattice.step, resolution)
    offset = np.where(lattice.on, lattice.offset, 0.0)
    k_lo, k_hi = _domains(model.lb - offset, model.ub - offset, step)
    A = model.A.tocsr()
    shift = A @ offset  # each row's activity at k = 0
    rows: list[ScaledRow] = []
    exact = bool(np.all(lattice.on))
    for r in range(model.n_rows):
        cols = A.indices[A.indptr[r] : A.indptr[r + 1]]
        vals = A.data[A.indptr[r] : A.indptr[r + 1]] * step[cols]
        lo, hi = model.row_lb[r] - shift[r], model.row_ub[r] - shift[r]
        scaled, row_exact = scale_row(cols, vals, k_lo[cols], k_hi[cols], lo, hi)
        rows.extend(scaled)
        exact = exact and row_exact
    obj, obj_scale, obj_error = _scale_objective(model.c * step, k_lo, k_hi)
    obj_offset = float(model.c @ offset)
    return ScaledModel(
        step, offset, k_lo, k_hi, tuple(rows), obj, obj_scale, obj_error, obj_offset, exact
    )


@dataclass(frozen=True)
class Lattice:
    """Where every feasible point puts each variable: ``x = offset + step * k`` for an
    integer k, for the variables ``on`` it (the others: anywhere in their bounds)."""

    on: np.ndarray  # bool
    step: np.ndarray
    offset: np.ndarray


def implied_lattice(model: MILPModel) -> Lattice:
    """Integer variables (step 1), plus continuous ones that an equality row with a +-1
    coefficient on them fixes as ``x = +-(r - sum a_j x_j)`` over variables on lattices
    whose steps times a_j are all rational (decimal or binary fractions): x's step is the
    gcd of those, its offset what the row leaves at k = 0. Iterated to a fixpoint, so a
    memory recurrence (U[k+1] = U[k] + m R - m FREE) carries its start's lattice along."""
    on = np.asarray(model.integer, dtype=bool).copy()
    step = np.ones(model.n_vars)
    offset = np.zeros(model.n_vars)
    A = model.A.tocsr()
    eq = np.flatnonzero((model.row_lb == model.row_ub) & np.isfinite(model.row_ub))
    changed = True
    while changed:
        changed = False
        for r in eq:
            cols = A.indices[A.indptr[r] : A.indptr[r + 1]]
            vals = A.data[A.indptr[r] : A.indptr[r + 1]]
            free = ~on[cols]
            if np.count_nonzero(free) != 1 or abs(abs(vals[free][0]) - 1.0) > _ABS_TOL:
                continue
            fixed = ~free
            gcd = _rational_gcd(vals[fixed] * step[cols[fixed]])
            if gcd is None:
                continue
            j, sign = cols[free][0], float(np.sign(vals[free][0]))
            start = sign * (model.row_ub[r] - float(vals[fixed] @ offset[cols[fixed]]))
            on[j], step[j], offset[j] = True, gcd, start - gcd * math.floor(start / gcd)
            changed = True
    return Lattice(on, step, offset)


def scale_row(
    cols: np.ndarray,
    vals: np.ndarray,
    k_lo: np.ndarray,
    k_hi: np.ndarray,
    lo: float,
    hi: float,
) -> tuple[list[ScaledRow], bool]:
    """Integer rows over k whose solutions all satisfy lo <= vals @ k <= hi; and whether they
    have exactly the same integer solutions."""
    factor = _exact_factor(vals)
    if factor is not None:
        coefs = np.rint(vals * factor).astype(np.int64)
        row = ScaledRow(cols, coefs, _ceil(lo * factor), _floor(hi * factor))
        return [row], True
    peak = float(np.max(np.abs(vals)))
    factor = 10.0 ** math.ceil(math.log10(_PRECISION / peak))
    scaled = vals * factor
    rows = []
    if math.isfinite(hi):
        rows.append(_rounded_side(cols, scaled, k_lo, k_hi, hi * factor, upper=True))
    if math.isfinite(lo):
        rows.append(_rounded_side(cols, scaled, k_lo, k_hi, lo * factor, upper=False))
    return rows, False


def _rounded_side(
    cols: np.ndarray,
    scaled: np.ndarray,
    k_lo: np.ndarray,
    k_hi: np.ndarray,
    rhs: float,
    upper: bool,
) -> ScaledRow:
    # For "<= rhs": round coefficients up on k >= 0 (down on k <= 0), so the integer
    # activity over-estimates the true one; a mixed-sign k's worst error comes off rhs.
    # ">= lhs" is the mirror image.
    negative_k = k_hi <= 0
    up = np.ceil(scaled) if upper else np.floor(scaled)
    down = np.floor(scaled) if upper else np.ceil(scaled)
    coefs = np.where(negative_k, down, up)
    error = scaled - coefs  # true = integer + error * k
    worst = np.maximum(error * k_lo, error * k_hi)
    if upper:
        slack = float(np.sum(np.maximum(worst, 0.0)))
        return ScaledRow(cols, coefs.astype(np.int64), None, _floor(rhs - slack))
    best = np.minimum(error * k_lo, error * k_hi)
    slack = float(np.sum(np.minimum(best, 0.0)))
    return ScaledRow(cols, coefs.astype(np.int64), _ceil(rhs - slack), None)


def _scale_objective(
    c: np.ndarray, k_lo: np.ndarray, k_hi: np.ndarray
) -> tuple[np.ndarray, float, float]:
    if not np.any(c):
        return np.zeros(len(c), dtype=np.int64), 1.0, 0.0
    factor = _exact_factor(c)
    if factor is not None:
        return np.rint(c * factor).astype(np.int64), factor, 0.0
    factor = 10.0 ** math.ceil(math.log10(_PRECISION / float(np.max(np.abs(c)))))
    coefs = np.rint(c * factor)
    reach = np.maximum(np.abs(k_lo), np.abs(k_hi)).astype(float)
    error = float(np.sum(np.abs(c * factor - coefs) * reach)) / factor
    return coefs.astype(np.int64), factor, error


def _exact_factor(vals: np.ndarray) -> float | None:
    """The smallest factor making every value integral: 1, else the smallest 2**p (binary
    fractions: memory in units of a power-of-two GCD), else the smallest 10**p (decimal
    data), if p is at most 30 and 9; None if none does or a scaled value is too large to
    stay exact in a float."""
    if np.all(_is_integral(vals)):
        return 1.0 if np.max(np.abs(vals), initial=0.0) < 2**53 else None
    binary = _binary_factor(vals)
    if binary is not None:
        return binary
    for power in range(1, _MAX_EXACT_POWER + 1):
        scaled = vals * 10.0**power
        if np.max(np.abs(scaled), initial=0.0) >= 2**53:
            return None
        if np.all(_is_integral(scaled)):
            return 10.0**power
    return None


def _binary_factor(vals: np.ndarray) -> float | None:
    """The smallest 2**p (p <= ``_MAX_BINARY_POWER``) making every value exactly integral."""
    scaled = vals * 2.0**_MAX_BINARY_POWER  # exact: a power of two only moves the exponent
    if np.max(np.abs(scaled), initial=0.0) >= 2**53 or np.any(scaled != np.rint(scaled)):
        return None
    whole = np.abs(np.rint(scaled)).astype(np.int64)
    whole = whole[whole > 0]
    trailing_zeros = int(np.log2(whole & -whole).min()) if whole.size else _MAX_BINARY_POWER
    return 2.0 ** max(0, _MAX_BINARY_POWER - trailing_zeros)


def _rational_gcd(vals: np.ndarray) -> float | None:
    """The largest g with every value an integer multiple of g (1 for none), if the values
    are decimal or binary fractions (``_exact_factor``)."""
    factor = _exact_factor(vals)
    if factor is None:
        return None
    whole = np.abs(np.rint(vals * factor)).astype(np.int64)
    g = math.gcd(*whole.tolist()) if whole.any() else 0
    return 1.0 if g == 0 else g / factor


def _domains(lb: np.ndarray, ub: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo = np.full(len(lb), -_INFINITE_DOMAIN, dtype=np.int64)
    hi = np.full(len(ub), _INFINITE_DOMAIN, dtype=np.int64)
    finite = np.isfinite(lb)
    lo[finite] = [_ceil_finite(v) for v in _clipped(lb[finite] / step[finite])]
    finite = np.isfinite(ub)
    hi[finite] = [_floor_finite(v) for v in _clipped(ub[finite] / step[finite])]
    return np.clip(lo, -_INFINITE_DOMAIN, None), np.clip(hi, None, _INFINITE_DOMAIN)


def _clipped(values: np.ndarray) -> list[float]:
    """``values`` within twice the stand-in for infinity: finite (a quotient that overflows
    is not) and an int64, while a bound past the stand-in stays past it."""
    return np.clip(values, -2 * _INFINITE_DOMAIN, 2 * _INFINITE_DOMAIN).tolist()


def _is_integral(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, dtype=float)
    with np.errstate(invalid="ignore"):  # inf is not integral, and says so as nan
        error = np.abs(values - np.rint(values))
        return error <= np.maximum(_ABS_TOL, _REL_TOL * np.abs(values))


def _floor(value: float) -> int | None:
    return _floor_finite(value) if math.isfinite(value) else None


def _ceil(value: float) -> int | None:
    return _ceil_finite(value) if math.isfinite(value) else None


def _floor_finite(value: float) -> int:
    slack = max(_ABS_TOL, _REL_TOL * abs(value))  # float noise only: stays conservative
    return int(min(math.floor(value + slack), _INT64))


def _ceil_finite(value: float) -> int:
    slack = max(_ABS_TOL, _REL_TOL * abs(value))
    return int(max(math.ceil(value - slack), -_INT64))


# --------------------------------------------------------------------------------- solve


def solve(
    model: MILPModel,
    options: SolveOptions,
    progress: Callable[[Progress], None],
    should_stop: Callable[[], bool],
    incumbent: Incumbent | None = None,
    resolution: float = DEFAULT_RESOLUTION,
) -> SolveResult:
    try:
        from ortools.sat.python import cp_model
    except ImportError as exc:
        raise SolverUnavailable(f"ortools cannot be imported: {exc}") from exc

    milp = _with_integral_products(model)
    scaled = scale(milp, resolution)
    cp = _build(cp_model, milp, scaled)
    reporter = Reporter(progress, incumbent)
    solver = _solver(cp_model, options)
    unscale = _Unscale(model, scaled)
    solver.best_bound_callback = lambda b: reporter.update(bound=unscale.bound(b))
    callback = _callback(cp_model, model, scaled, reporter)
    status = solve_watched(solver, cp, callback, should_stop, reporter.tick)
    return _result(cp_model, solver, status, cp, model, scaled, unscale, reporter, options)


def _with_integral_products(model: MILPModel) -> MILPModel:
    """The linearization's y = x_i * x_j of binaries is 0/1 at every optimum, so it can be an
    integer variable: the integer model stays exact."""
    milp = model.linearized()
    if not model.quadratic:
        return milp
    integer = milp.integer.copy()
    binary = model.integer & (model.lb >= 0) & (model.ub <= 1)
    for q, (i, j, _) in enumerate(model.quadratic):
        integer[model.n_vars + q] = bool(binary[i] and binary[j])
    return replace(milp, integer=integer)


def _build(cp_model: Any, milp: MILPModel, scaled: ScaledModel) -> Any:
    cp = cp_model.CpModel()
    k = [
        cp.new_int_var(int(lo), int(hi), f"k{j}")
        for j, (lo, hi) in enumerate(zip(scaled.k_lo, scaled.k_hi, strict=True))
    ]
    for row in scaled.rows:
        terms = [k[j] for j in row.cols]
        expr = cp_model.LinearExpr.weighted_sum(terms, [int(a) for a in row.coefs])
        lo = cp_model.INT_MIN if row.lo is None else row.lo
        hi = cp_model.INT_MAX if row.hi is None else row.hi
        cp.add_linear_constraint(expr, lo, hi)
    nonzero = np.flatnonzero(scaled.obj)
    cp.minimize(
        cp_model.LinearExpr.weighted_sum(
            [k[j] for j in nonzero], [int(scaled.obj[j]) for j in nonzero]
        )
    )
    if milp.start is not None:
        for var, value in zip(k, scaled.k(milp.start), strict=True):
            cp.add_hint(var, int(value))
    return cp


def _solver(cp_model: Any, options: SolveOptions) -> Any:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(options.time_limit_s)
    solver.parameters.num_workers = max(1, int(options.threads))
    solver.parameters.relative_gap_limit = float(options.gap)
    solver.parameters.log_search_progress = False
    solver.parameters.cp_model_presolve = options.presolve
    return solver


class _Unscale:
    """Integer objective values back to the model's units (offset included)."""

    def __init__(self, model: MILPModel, scaled: ScaledModel) -> None:
        self._offset = model.offset + scaled.obj_offset
        self._scale = scaled.obj_scale
        self._error = scaled.obj_error
        self._valid_bound = scaled.exact

    def bound(self, value: float) -> float | None:
        if not self._valid_bound or not math.isfinite(value):
            return None
        return value / self._scale + self._offset - self._error


def _callback(cp_model: Any, model: MILPModel, scaled: ScaledModel, reporter: Reporter) -> Any:
    n = model.n_vars

    class _Callback(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            x = scaled.x(np.asarray(self.response_proto.solution, dtype=np.int64)[:n])
            # The exact objective of the original model, not the rounded integer one.
            reporter.update(float(model.objective(x)), x=x)

    return _Callback()


def solve_watched(
    solver: Any,
    cp: Any,
    callback: Any,
    should_stop: Callable[[], bool],
    tick: Callable[[], None],
) -> Any:
    """``solver.solve(cp, callback)`` with a thread beside it that polls ``should_stop``
    and asks the search to stop (CP-SAT has no interrupt callback), calling ``tick``
    between polls; the solve's status."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(_STOP_POLL_S):
            if should_stop():
                solver.stop_search()
                return
            tick()

    watcher = threading.Thread(target=watch, name="remat-cpsat-watch", daemon=True)
    watcher.start()
    try:
        return solver.solve(cp, callback)
    finally:
        done.set()
        watcher.join()


def _result(
    cp_model: Any,
    solver: Any,
    status: Any,
    cp: Any,
    model: MILPModel,
    scaled: ScaledModel,
    unscale: _Unscale,
    reporter: Reporter,
    options: SolveOptions,
) -> SolveResult:
    reporter.flush()
    seconds = reporter.elapsed()
    restricted = "" if scaled.exact else "integer scaling restricted the model; "
    if status == cp_model.MODEL_INVALID:
        message = f"CP-SAT rejected the model: {cp.validate()}"
        return SolveResult(SolveStatus.ERROR, None, None, None, None, seconds, message, "cpsat")
    if status == cp_model.INFEASIBLE:
        if scaled.exact:
            return SolveResult(SolveStatus.INFEASIBLE, None, None, None, None, seconds, "", "cpsat")
        message = restricted + "CP-SAT's infeasibility is not a proof for the original"
        return SolveResult(SolveStatus.UNKNOWN, None, None, None, None, seconds, message, "cpsat")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        message = f"CP-SAT stopped without a solution ({solver.status_name(status)})"
        return SolveResult(SolveStatus.UNKNOWN, None, None, None, None, seconds, message, "cpsat")
    k = np.asarray(solver.response_proto.solution, dtype=np.int64)[: model.n_vars]
    x = scaled.x(k)
    objective = float(model.objective(x))
    bound = unscale.bound(solver.best_objective_bound)
    if bound is not None:
        bound = min(bound, objective)
    gap = relative_gap(objective, bound)
    proven = gap is not None and gap <= options.gap + 1e-12
    if status == cp_model.OPTIMAL and proven:
        return SolveResult(SolveStatus.OPTIMAL, x, objective, bound, gap, seconds, "", "cpsat")
    if scaled.exact:
        message = f"CP-SAT stopped: {solver.status_name(status)}"
    else:
        message = restricted + "no bound for the original model"
    return SolveResult(SolveStatus.FEASIBLE, x, objective, bound, gap, seconds, message, "cpsat")
