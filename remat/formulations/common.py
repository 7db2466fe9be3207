"""What the Checkmate and XEngine formulations share: graph structure as index arrays, the
variable-pruning rule, GCD scaling of memory, and a sparse (COO) model builder.

Everything is built from index arrays (one numpy operation per constraint family), never
one Python object per variable, so a 300-stage graph builds in about a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from remat.graph import Graph
from remat.solvers.model import MILPModel

# --- graph structure ----------------------------------------------------------------------


@dataclass(frozen=True)
class Structure:
    """The graph as arrays.

    Edges (i -> k), i in DEPS[k], are sorted by (k, i). ``later`` holds, for each edge
    (i, k), the users j of i with j > k (the last factors of Checkmate eq. 5);
    ``earlier`` the users j of i with j < k (XEngine copy accounting). Both are CSR:
    ``later_idx[later_ptr[e]:later_ptr[e + 1]]``.

    ``last_desc[i]``: the largest index of a node reachable from i (-1 if none). Value i
    can only matter in stage t if a node first computed in stage >= t needs it, i.e.
    ``t <= last_desc[i]`` (see ``useful``).
    """

    n: int
    edge_u: np.ndarray
    edge_v: np.ndarray
    later_ptr: np.ndarray
    later_idx: np.ndarray
    earlier_ptr: np.ndarray
    earlier_idx: np.ndarray
    last_desc: np.ndarray
    is_output: np.ndarray
    has_users: np.ndarray

    @property
    def n_edges(self) -> int:
        return int(self.edge_u.shape[0])

    @classmethod
    def of(cls, graph: Graph) -> Structure:
        n = len(graph)
        pairs = sorted((k, i) for k, node in enumerate(graph.nodes) for i in set(node.deps))
        edge_v = np.array([k for k, _ in pairs], dtype=np.int64)
        edge_u = np.array([i for _, i in pairs], dtype=np.int64)
        users = [sorted(set(u)) for u in graph.users()]
        later = [[j for j in users[i] if j > k] for k, i in pairs]
        earlier = [[j for j in users[i] if j < k] for k, i in pairs]
        last_desc = np.full(n, -1, dtype=np.int64)
        for i in range(n - 1, -1, -1):
            for j in users[i]:
                last_desc[i] = max(last_desc[i], j, last_desc[j])
        is_output = np.zeros(n, dtype=bool)
        is_output[list(graph.outputs)] = True
        return cls(
            n,
            edge_u,
            edge_v,
            *_csr(later),
            *_csr(earlier),
            last_desc,
            is_output,
            np.array([bool(u) for u in users], dtype=bool),
        )

    def useful(self, T: int) -> np.ndarray:
        """useful[t, i]: value i can matter in stage t (t <= last_desc[i]).

        Pruning rule (exact). Call a schedule *clean* if every recomputation R[t,i] (i < t)
        is read later in its stage or kept for stage t+1, and every checkpoint S[t,i] is read
        in stage t or kept for t+1 (what ``rsolve.solve_and_prune`` returns). Any feasible
        schedule can be cleaned without raising its cost or its memory (both MILP accounting
        and the compiled plan's liveness only lose terms), and in a clean schedule every R/S
        entry off the diagonal satisfies t <= last_desc[i], by induction backwards over
        stages: what is read in stage t feeds the node first computed there or a value
        kept for t+1. So R[t,i] (i < t) and S[t,i] with t > last_desc[i] can be removed."""
        return np.arange(T)[:, None] <= self.last_desc[None, :]


def _csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    counts = np.array([len(x) for x in lists], dtype=np.int64)
    ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    flat = np.fromiter((j for x in lists for j in x), dtype=np.int64, count=int(counts.sum()))
    return ptr, flat


def ragged(ptr: np.ndarray, idx: np.ndarray, owners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each entry ``owners[q]`` (an edge), every element of its CSR list: returns
    (position q repeated, element) pairs, vectorised."""
    counts = ptr[owners + 1] - ptr[owners]
    total = int(counts.sum())
    where = np.repeat(np.arange(owners.shape[0]), counts)
    if total == 0:
        return where, np.zeros(0, dtype=np.int64)
    offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    return where, idx[np.repeat(ptr[owners], counts) + offsets]


# --- memory scaling -----------------------------------------------------------------------


def memory_unit(sizes: np.ndarray | list[int]) -> int:
    """The GCD of the nonzero memory quantities: dividing by it keeps every memory
    coefficient an integer and makes them as small as possible (1 if all are zero)."""
    values = np.asarray(sizes, dtype=np.int64)
    values = values[values > 0]
    return int(np.gcd.reduce(values)) if values.size else 1


def scaled_budget(budget: int | None, unit: int, offset: int = 0) -> float:
    """``offset / unit + floor((budget - offset) / unit)``: exact for memory that is
    ``offset`` plus an integer multiple of ``unit`` (inf without a budget)."""
    if budget is None:
        return math.inf
    return offset / unit + float((budget - offset) // unit)


# --- the sparse model builder ---------------------------------------------------------------


@dataclass
class _Block:
    label: str
    start: int
    keys: np.ndarray  # one row of ints per variable / constraint


@dataclass
class Builder:
    """Collects columns and COO rows; ``model()`` makes the ``MILPModel``."""

    n_vars: int = 0
    n_rows: int = 0
    _lb: list[np.ndarray] = field(default_factory=list)
    _ub: list[np.ndarray] = field(default_factory=list)
    _int: list[np.ndarray] = field(default_factory=list)
    _names: list[list[str]] = field(default_factory=list)
    _rows: list[np.ndarray] = field(default_factory=list)
    _cols: list[np.ndarray] = field(default_factory=list)
    _vals: list[np.ndarray] = field(default_factory=list)
    _row_lb: list[np.ndarray] = field(default_factory=list)
    _row_ub: list[np.ndarray] = field(default_factory=list)
    var_blocks: list[_Block] = field(default_factory=list)
    row_blocks: list[_Block] = field(default_factory=list)

    def variables(
        self,
        label: str,
        mask: np.ndarray,
        integer: bool,
        lb: float | np.ndarray = 0.0,
        ub: float | np.ndarray = 1.0,
        names: list[str] | None = None,
    ) -> np.ndarray:
        """One variable per True entry of ``mask`` (row-major); returns an index array of
        mask's shape with -1 where there is none. ``lb``/``ub`` broadcast over mask."""
        keys = np.argwhere(mask)
        count = keys.shape[0]
        index = np.full(mask.shape, -1, dtype=np.int64)
        index[mask] = np.arange(self.n_vars, self.n_vars + count)
        self._lb.append(np.broadcast_to(np.asarray(lb, dtype=float), mask.shape)[mask])
        self._ub.append(np.broadcast_to(np.asarray(ub, dtype=float), mask.shape)[mask])
        self._int.append(np.full(count, integer))
        self._names.append(names if names is not None else _names(label, keys))
        self.var_blocks.append(_Block(label, self.n_vars, keys))
        self.n_vars += count
        return index

    def rows(
        self,
        label: str,
        keys: np.ndarray,
        cols: list[np.ndarray],
        coefs: list[float | np.ndarray],
        lb: float | np.ndarray,
        ub: float | np.ndarray,
    ) -> np.ndarray:
        """len(keys) rows; term q of row r is ``coefs[q][r] * x[cols[q][r]]``, skipped where
        ``cols[q][r] == -1`` (a pruned variable, i.e. fixed to 0). Returns the row ids."""
        m = keys.shape[0]
        rows = np.arange(self.n_rows, self.n_rows + m)
        for col, coef in zip(cols, coefs, strict=True):
            self.entries(rows, col, np.broadcast_to(np.asarray(coef, dtype=float), (m,)))
        self._row_lb.append(np.broadcast_to(np.asarray(lb, dtype=float), (m,)).copy())
        self._row_ub.append(np.broadcast_to(np.asarray(ub, dtype=float), (m,)).copy())
        self.row_blocks.append(_Block(label, self.n_rows, keys.reshape(m, -1 if m else 1)))
        self.n_rows += m
        return rows

    def entries(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> None:
        """Extra terms on existing rows (ragged sums); entries with col -1 (a pruned
        variable) or a zero coefficient (e.g. a 0-byte value) are skipped."""
        vals = np.asarray(vals, dtype=float)
        keep = (cols >= 0) & (vals != 0)
        self._rows.append(rows[keep])
        self._cols.append(cols[keep])
        self._vals.append(vals[keep])

    def model(self, cost: np.ndarray, quadratic: tuple = ()) -> MILPModel:
        rows = np.concatenate(self._rows) if self._rows else np.zeros(0, dtype=np.int64)
        cols = np.concatenate(self._cols) if self._cols else np.zeros(0, dtype=np.int64)
        vals = np.concatenate(self._vals) if self._vals else np.zeros(0)
        A = sp.csr_array((vals, (rows, cols)), shape=(self.n_rows, self.n_vars))
        A.sum_duplicates()
        A.eliminate_zeros()
        return MILPModel(
            c=cost,
            A=A,
            row_lb=_cat(self._row_lb),
            row_ub=_cat(self._row_ub),
            lb=_cat(self._lb),
            ub=_cat(self._ub),
            integer=np.concatenate(self._int) if self._int else np.zeros(0, dtype=bool),
            quadratic=quadratic,
            names=tuple(name for block in self._names for name in block),
        )

    def counts(self) -> dict[str, int]:
        """Variables and rows per label (for reports)."""
        out: dict[str, int] = {}
        for block in self.var_blocks:
            out[f"var {block.label}"] = out.get(f"var {block.label}", 0) + len(block.keys)
        for block in self.row_blocks:
            out[f"row {block.label}"] = out.get(f"row {block.label}", 0) + len(block.keys)
        return out

    def row_name(self, row: int) -> str:
        for block in reversed(self.row_blocks):
            if row >= block.start:
                key = ",".join(str(int(k)) for k in block.keys[row - block.start])
                return f"{block.label} [{key}]"
        return f"row {row}"


def _names(label: str, keys: np.ndarray) -> list[str]:
    if keys.shape[1] == 0:
        return [label]
    return [f"{label}[{','.join(map(str, k))}]" for k in keys.tolist()]


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0)


def violations(model: MILPModel, builder: Builder, x: np.ndarray, tol: float = 1e-6) -> list[str]:
    """Every violated row, bound and integrality of ``x``, named (empty: x is feasible)."""
    out: list[str] = []
    activity = model.A @ x
    scale = tol * np.maximum(1.0, np.abs(activity))
    for r in np.flatnonzero((activity < model.row_lb - scale) | (activity > model.row_ub + scale)):
        out.append(
            f"{builder.row_name(int(r))}: {activity[r]:g} not in "
            f"[{model.row_lb[r]:g}, {model.row_ub[r]:g}]"
        )
    extra = model.product_rows
    if extra is not None:  # valid inequalities over the products: they hold at integer x
        activity = extra.A @ x + extra.P @ model.products(x)
        for r in np.flatnonzero(activity < extra.lb - tol):
            out.append(f"product row {r}: {activity[r]:g} < {extra.lb[r]:g}")
    for j in np.flatnonzero((x < model.lb - tol) | (x > model.ub + tol)):
        out.append(f"{model.names[j]} = {x[j]:g} outside [{model.lb[j]:g}, {model.ub[j]:g}]")
    fractional = model.integer & (np.abs(x - np.round(x)) > tol)
    out.extend(f"{model.names[j]} = {x[j]:g} is not integral" for j in np.flatnonzero(fractional))
    return out


def read_binary(index: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The 0/1 matrix of variables ``index`` (-1: no variable, read as 0) in a possibly
    fractional solution ``x``, rounded at 0.5 (Checkmate Algorithm 2)."""
    out = np.zeros(index.shape, dtype=bool)
    present = index >= 0
    out[present] = np.asarray(x)[index[present]] > 0.5
    return out
