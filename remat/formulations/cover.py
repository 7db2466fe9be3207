"""The recomputation cover: a relaxation of the rematerialization problem on any number of
nodes, n binaries and at most one row per stage, whose optimum bounds the whole problem
where Checkmate's and XEngine's models are too large to solve.

Stage t of the frontier order first computes node t (Checkmate eq. 8a). Just after node t
is computed, the memory holds the fixed tensors, node t's output and its inputs DEPS[t],
and every value v < t that a node after t reads (the set L_t) unless v is computed again
in a later stage. With z_v = 1 when value v is recomputed at least once:

    fixed + M_t + sum_{v in DEPS[t]} M_v + sum_{v in L_t - DEPS[t]} M_v (1 - z_v) <= budget   (C_t)

and every plan costs at least the ideal plus sum_v C_v z_v. So

    min  sum_v C_v z_v   s.t. (C_t) for every stage t,  z in {0, 1}^n

bounds the recomputation of every plan that first computes the nodes in the graph's order
(Checkmate's and XEngine's stages, every plan the compiler emits), and any bound of this
MILP does too. On several devices the budgets are pooled (each value lives on at least
one device at each instant, each fixed tensor on at least the device that reads it) and
C_v is the fastest device's time: still a relaxation.

It is weaker than the full models where a value is recomputed more than once or kept
between recomputations, and where memory peaks inside a stage; it is exact for the
values whose dropping it charges once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from remat.graph import Graph
from remat.solvers.model import MILPModel

MIB = float(1 << 20)  # rows in MiB: coefficients near 1 for the solver


@dataclass(frozen=True)
class CoverModel:
    """The cover MILP over z (one variable per node), or why it has none."""

    model: MILPModel | None
    infeasible_at: int | None = None  # a stage whose (C_t) no z satisfies

    @property
    def trivial(self) -> bool:
        """No row binds: the bound is the ideal."""
        return self.model is None and self.infeasible_at is None


def build_cover(
    graph: Graph,
    compute_ms: np.ndarray,
    output_bytes: np.ndarray,
    budget_bytes: int | None,
    fixed_bytes: int,
) -> CoverModel:
    """The cover of ``graph`` with recomputation costs ``compute_ms`` (per node) under
    ``budget_bytes`` (pooled over the devices) with ``fixed_bytes`` held throughout."""
    if budget_bytes is None:
        return CoverModel(None)
    n = len(graph)
    M = np.asarray(output_bytes, dtype=float)
    last = np.full(n, -1, dtype=np.int64)  # the last reader of each value (n: the end)
    for v, readers in enumerate(graph.users()):
        if readers:
            last[v] = max(readers)
    last[list(graph.outputs)] = n
    deps = [np.array(sorted(set(node.deps)), dtype=np.int64) for node in graph.nodes]
    now = np.array([fixed_bytes + M[t] + M[d].sum() for t, d in enumerate(deps)])
    if (now > budget_bytes).any():  # memory at stage t that no z lowers
        return CoverModel(None, infeasible_at=int(np.argmax(now > budget_bytes)))
    # sum of M over L_t and DEPS[t]: v is read after stage t for v < t < last[v]
    starts = np.zeros(n + 1)
    np.add.at(starts, np.arange(n) + 1, M)
    np.add.at(starts, np.minimum(last, n), -M * (last > np.arange(n)))
    spanning = np.cumsum(starts)[:n]
    read_later = np.array([M[d[last[d] > t]].sum() for t, d in enumerate(deps)])
    need = now + spanning - read_later - budget_bytes  # bytes the z must free at stage t
    binding = np.nonzero(need > 0)[0]
    if binding.size == 0:
        return CoverModel(None)
    index = np.arange(n)
    cols = [np.setdiff1d(index[:t][last[:t] > t], deps[t]) for t in binding]
    rows = np.repeat(np.arange(binding.size), [c.size for c in cols])
    flat = np.concatenate(cols)
    A = sp.csr_array((M[flat] / MIB, (rows, flat)), shape=(binding.size, n))
    model = MILPModel(
        c=np.asarray(compute_ms, dtype=float),
        A=A,
        row_lb=need[binding] / MIB,
        row_ub=np.full(binding.size, np.inf),
        lb=np.zeros(n),
        ub=np.ones(n),
        integer=np.ones(n, dtype=bool),
    )
    return CoverModel(model)
