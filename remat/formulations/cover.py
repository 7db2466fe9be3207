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
values whose dropping it charges once. It also charges nothing for a recomputation's
inputs: the closure cover (``build_closure``) does, in a larger model solved as an LP.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    stages = Stages.of(graph, output_bytes, budget_bytes, fixed_bytes)
    if stages.infeasible_at is not None:
        return CoverModel(None, infeasible_at=stages.infeasible_at)
    binding, n, M = stages.binding, len(graph), stages.M
    if binding.size == 0:
        return CoverModel(None)
    cols = [stages.dropped(t) for t in binding]
    rows = np.repeat(np.arange(binding.size), [c.size for c in cols])
    flat = np.concatenate(cols)
    A = sp.csr_array((M[flat] / MIB, (rows, flat)), shape=(binding.size, n))
    model = MILPModel(
        c=np.asarray(compute_ms, dtype=float),
        A=A,
        row_lb=stages.need[binding] / MIB,
        row_ub=np.full(binding.size, np.inf),
        lb=np.zeros(n),
        ub=np.ones(n),
        integer=np.ones(n, dtype=bool),
    )
    return CoverModel(model)


def build_closure(
    graph: Graph,
    compute_ms: np.ndarray,
    output_bytes: np.ndarray,
    budget_bytes: int,
    fixed_bytes: int,
    cells: int,
    depth: int,
) -> MILPModel | None:
    """The closure cover: the cover made aware that a value recomputed needs its inputs
    then. Its LP relaxation (all variables continuous) is the bound; None when no row
    binds or some stage cannot fit.

    At stage t (node t's first computation), for v in L_t - DEPS[t]: y_vt = 1 if v is
    absent, w_vt = 1 if v is computed again after it; for a value u no node after t reads,
    p_ut = 1 if u is present all the same; z_v = 1 if v is recomputed at all:

        sum_v M_v y_vt - sum_u M_u p_ut >= need_t          (K_t: the cover's row C_t)
        y_vt <= w_vt                                        (absent, then read: recomputed)
        w_vt <= present_ut + w_ut     for u in DEPS[v]      (N: its inputs at that time)
        w_vt <= z_v
        min  sum_v C_v z_v

    where present_ut = 1 - y_ut for u in L_t - DEPS[t] and p_ut otherwise (no row for u in
    DEPS[t], present at stage t). (N) holds for every plan in the frontier order: v computed
    at tau after stage t reads u at tau, so u was present throughout [t, tau] or computed
    again within it. Rows (N) follow inputs ``depth`` steps back from L_t; the stages are
    the binding ones that need most, as many as keep the y columns under ``cells``
    (``Stages.thinned``: fewer rows only weaken a relaxation)."""
    stages = Stages.of(graph, output_bytes, budget_bytes, fixed_bytes)
    if stages.infeasible_at is not None or stages.binding.size == 0:
        return None
    deps, M = stages.deps, stages.M
    rows = Rows()
    var = rows.var
    for t, dropped in stages.thinned(cells):
        L = {int(v) for v in dropped}
        inputs_of_t = set(deps[t].tolist())
        memory = [(var("y", v, t), M[v] / MIB) for v in sorted(L)]
        for v in sorted(L):
            rows.add([(var("y", v, t), 1.0), (var("w", v, t), -1.0)], hi=0.0)
        present: set[int] = set()
        frontier, seen = [(v, 0) for v in sorted(L)], set(L)
        while frontier:
            v, level = frontier.pop()
            recomputed = var("z", v, cost=float(compute_ms[v]))
            rows.add([(var("w", v, t), 1.0), (recomputed, -1.0)], hi=0.0)
            if level >= depth:
                continue
            for u in deps[v].tolist():
                if u in inputs_of_t:
                    continue
                if u in L:
                    terms = [(var("w", v, t), 1.0), (var("w", u, t), -1.0), (var("y", u, t), 1.0)]
                    rows.add(terms, hi=1.0)
                else:
                    terms = [(var("w", v, t), 1.0), (var("w", u, t), -1.0), (var("p", u, t), -1.0)]
                    rows.add(terms, hi=0.0)
                    present.add(u)
                if u not in seen:
                    seen.add(u)
                    frontier.append((u, level + 1))
        memory += [(var("p", u, t), -M[u] / MIB) for u in sorted(present)]
        rows.add(memory, lo=float(stages.need[t]) / MIB)
    return rows.model()


@dataclass(frozen=True)
class Stages:
    """What the covers share: each node's inputs, the last reader of each value (n: the
    end), the bytes the z must free at each stage (``need``) and the stages where that is
    positive (``binding``); ``infeasible_at``, a stage whose memory no z lowers fits not."""

    M: np.ndarray
    deps: list[np.ndarray]
    last: np.ndarray
    need: np.ndarray
    binding: np.ndarray
    infeasible_at: int | None

    @classmethod
    def of(cls, graph: Graph, output_bytes: np.ndarray, budget: int, fixed: int) -> Stages:
        n = len(graph)
        M = np.asarray(output_bytes, dtype=float)
        last = np.full(n, -1, dtype=np.int64)
        for v, readers in enumerate(graph.users()):
            if readers:
                last[v] = max(readers)
        last[list(graph.outputs)] = n
        deps = [np.array(sorted(set(node.deps)), dtype=np.int64) for node in graph.nodes]
        now = np.array([fixed + M[t] + M[d].sum() for t, d in enumerate(deps)])
        infeasible_at = int(np.argmax(now > budget)) if (now > budget).any() else None
        # sum of M over L_t and DEPS[t]: v is read after stage t for v < t < last[v]
        starts = np.zeros(n + 1)
        np.add.at(starts, np.arange(n) + 1, M)
        np.add.at(starts, np.minimum(last, n), -M * (last > np.arange(n)))
        spanning = np.cumsum(starts)[:n]
        read_later = np.array([M[d[last[d] > t]].sum() for t, d in enumerate(deps)])
        need = now + spanning - read_later - budget
        return cls(M, deps, last, need, np.nonzero(need > 0)[0], infeasible_at)

    def dropped(self, t: int) -> np.ndarray:
        """L_t - DEPS[t]: the values before t that a node after t reads, not t's inputs."""
        earlier = np.arange(t)
        return np.setdiff1d(earlier[self.last[:t] > t], self.deps[t])

    def thinned(self, cells: int) -> list[tuple[int, np.ndarray]]:
        """The binding stages with their dropped values, in stage order: by decreasing
        ``need`` (the bytes a stage's row must free), each taken while the dropped values
        stay at most ``cells`` in all (one that would pass it is skipped). Fewer rows only
        weaken a relaxation, and the stages that need most bind its optimum most."""
        dropped = [(int(t), self.dropped(t)) for t in self.binding]
        kept: list[int] = []
        total = 0
        for i in sorted(range(len(dropped)), key=lambda i: -self.need[dropped[i][0]]):
            size = dropped[i][1].size
            if kept and total + size > cells:
                continue
            kept.append(i)
            total += size
        return [dropped[i] for i in sorted(kept)]


class Rows:
    """A sparse model built one row at a time, for the covers' irregular rows: columns
    named by a key (kind, then indices), each with its cost and integrality, in [0, 1];
    rows ``lo <= sum a x <= hi`` over them. (The full models' ``common.Builder`` builds
    whole constraint families from index arrays instead.)"""

    def __init__(self) -> None:
        self.index: dict[tuple[object, ...], int] = {}
        self.cost: dict[int, float] = {}
        self.integer: set[int] = set()
        self.entries: list[tuple[int, int, float]] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def var(self, *key: object, cost: float = 0.0, integer: bool = False) -> int:
        column = self.index.setdefault(key, len(self.index))
        if cost:
            self.cost[column] = cost
        if integer:
            self.integer.add(column)
        return column

    def add(
        self, terms: Sequence[tuple[int, float]], lo: float = -np.inf, hi: float = np.inf
    ) -> None:
        self.entries.extend((len(self.lo), j, a) for j, a in terms)
        self.lo.append(lo)
        self.hi.append(hi)

    def model(self) -> MILPModel:
        N = len(self.index)
        r, c, a = zip(*self.entries, strict=True)
        costs = np.zeros(N)
        costs[list(self.cost)] = list(self.cost.values())
        integer = np.zeros(N, dtype=bool)
        integer[list(self.integer)] = True
        return MILPModel(
            c=costs,
            A=sp.csr_array((a, (r, c)), shape=(len(self.lo), N)),
            row_lb=np.array(self.lo),
            row_ub=np.array(self.hi),
            lb=np.zeros(N),
            ub=np.ones(N),
            integer=integer,
        )
