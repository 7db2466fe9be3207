"""A backend-neutral mixed-integer model in matrix form, and what a solve returns.

Formulations (``remat.formulations``) build a ``MILPModel``; each backend translates it
to its own API. Rows are ``row_lb <= A x <= row_ub``; columns have bounds and an
integrality flag. ``quadratic`` holds bilinear objective terms ``coef * x_i * x_j`` of
binaries (XEngine's copy term W, eq. 1): backends that take them natively (SCIP, Gurobi)
use them as written, the others solve ``linearized()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol

import numpy as np
import scipy.sparse as sp


@dataclass(frozen=True)
class ProductRows:
    """Rows ``lb <= A x + P y`` over a model's variables x and the products y of its
    bilinear terms (y[q] = x_i x_j of ``quadratic[q]``): valid inequalities that only the
    linearization can state, so ``linearized()`` adds them and MIQP backends, which
    take the products as written, do not see them."""

    A: sp.csr_array  # [rows, n_vars]
    P: sp.csr_array  # [rows, len(quadratic)]
    lb: np.ndarray


@dataclass(frozen=True)
class MILPModel:
    c: np.ndarray  # objective coefficients, [n_vars]
    A: sp.csr_array  # constraint matrix, [n_rows, n_vars]
    row_lb: np.ndarray
    row_ub: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integer: np.ndarray  # bool, [n_vars]
    quadratic: tuple[tuple[int, int, float], ...] = ()
    offset: float = 0.0
    start: np.ndarray | None = None  # a feasible warm start, if known
    names: tuple[str, ...] = field(default=(), compare=False)
    product_rows: ProductRows | None = None

    @property
    def n_vars(self) -> int:
        return int(self.c.shape[0])

    @property
    def n_rows(self) -> int:
        return int(self.A.shape[0])

    def lp_relaxation(self) -> MILPModel:
        """The same model with integrality dropped, without the warm start."""
        return replace(self, integer=np.zeros(self.n_vars, dtype=bool), start=None)

    def objective(self, x: np.ndarray) -> float:
        return float(self.c @ x) + self.offset + self.quadratic_value(x)

    def products(self, x: np.ndarray) -> np.ndarray:
        """x_i x_j of each bilinear term, in ``quadratic`` order (the linearization's y)."""
        pairs = np.array([(i, j) for i, j, _ in self.quadratic], dtype=np.int64).reshape(-1, 2)
        x = np.asarray(x, dtype=float)
        return x[pairs[:, 0]] * x[pairs[:, 1]]

    def quadratic_value(self, x: np.ndarray) -> float:
        """The bilinear part of the objective at x."""
        coefs = np.array([coef for _, _, coef in self.quadratic], dtype=float)
        return float(coefs @ self.products(x))

    def linearized(self) -> MILPModel:
        """Each bilinear term coef * x_i * x_j (coef > 0, binaries) becomes coef * y with
        y >= x_i + x_j - 1, y >= 0: with a positive cost, y takes the product's value at
        any optimum (docs/architecture.md, section "Solving"). ``product_rows`` are added
        over x and y."""
        if not self.quadratic:
            return self
        if any(coef < 0 for _, _, coef in self.quadratic):
            raise ValueError("linearization needs non-negative bilinear coefficients")
        k = len(self.quadratic)
        n = self.n_vars
        rows = np.repeat(np.arange(k), 3)
        cols = np.array([[n + q, i, j] for q, (i, j, _) in enumerate(self.quadratic)]).ravel()
        vals = np.tile([1.0, -1.0, -1.0], k)
        blocks = [
            sp.hstack([self.A, sp.csr_array((self.n_rows, k))]),
            sp.csr_array((vals, (rows, cols)), shape=(k, n + k)),
        ]
        row_lb = [self.row_lb, np.full(k, -1.0)]
        extra = self.product_rows
        if extra is not None:
            blocks.append(sp.hstack([extra.A, extra.P]))
            row_lb.append(extra.lb)
        A = sp.vstack(blocks).tocsr()
        start = None
        if self.start is not None:
            start = np.concatenate([self.start, self.products(self.start)])
        return MILPModel(
            c=np.concatenate([self.c, [coef for _, _, coef in self.quadratic]]),
            A=sp.csr_array(A),
            row_lb=np.concatenate(row_lb),
            row_ub=np.concatenate([self.row_ub, np.full(A.shape[0] - self.n_rows, np.inf)]),
            lb=np.concatenate([self.lb, np.zeros(k)]),
            ub=np.concatenate([self.ub, np.ones(k)]),
            integer=np.concatenate([self.integer, np.zeros(k, dtype=bool)]),
            offset=self.offset,
            start=start,
            names=self.names + tuple(f"y{q}" for q in range(k)) if self.names else (),
        )


class SolveStatus(StrEnum):
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"  # stopped (time limit, gap, cancel) with an incumbent
    INFEASIBLE = "infeasible"  # proven
    UNKNOWN = "unknown"  # stopped without an incumbent or a proof
    ERROR = "error"


class StopFlag(Protocol):
    """What stops a solve: a ``threading.Event``, or anything else that can say it is set."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class SolveOptions:
    time_limit_s: float = 60.0
    gap: float = 1e-4  # relative gap target
    threads: int = 1
    presolve: bool = True  # the solver's own model reductions before its search


@dataclass(frozen=True)
class Progress:
    elapsed_s: float
    objective: float | None  # incumbent
    bound: float | None  # best proven lower bound
    gap: float | None


@dataclass(frozen=True)
class SolveResult:
    status: SolveStatus
    x: np.ndarray | None
    objective: float | None
    bound: float | None
    gap: float | None
    seconds: float
    message: str = ""
    backend: str = ""
