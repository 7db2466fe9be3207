"""The device cover: a relaxation of the rematerialization problem on several devices
that budgets each device on its own, as the recomputation cover (``cover``) budgets their
pool, and charges running a node off its fastest device and copying between devices.
Its optimum bounds the whole problem; its placement (where each node is first computed)
is a plan's placement.

Pooling the budgets loses what makes several devices hard: a value held on the host
device does not free the accelerator, and the accelerator's fixed tensors (parameters and
their gradients) move only with the nodes that read them. With, per node v and device d,

    x_vd   v is computed on d at least once           (costs C_vd, its time on d)
    c_vd   v is copied to d at least once             (costs K_vd, the cheapest copy to d)
    f_vd   v is first computed on d                   sum_d f_vd = 1,  f_vd <= x_vd
    a2_vd  v arrives on d at least twice (computed or copied)
    e_vd   arrivals on d beyond those x and c pay for (costs min(C_vd, K_vd))
    g_Fd   d holds fixed tensor F (and its gradient buffer, for a backward reader)

every plan that first computes the nodes in the graph's order satisfies

    x_vd <= x_ud + c_ud            for u in DEPS[v]    (an input is on v's device)
    e_vd >= 2 a2_vd - x_vd - c_vd                      (a second arrival is paid)
    g_Fd >= x_vd                   for v reading F

and at stage t (node t's first computation), for each value v < t that a node after t
reads and t does not (L_t - DEPS[t]), with h_vtd = 1 if v is on d then and a_vtd = 1 if
v arrives on d after t:

    f_rd <= h_vtd + a_vtd          for r > t reading v   (r's first computation reads v)
    h_vtd, a_vtd <= x_vd + c_vd                          (what is on d arrived there)
    a_vtd <= a2_vd + 1 - f_vd                            (first computed on d: again)
    fixed_d(g) + f_td (M_t + M_DEPS[t]) + sum_v M_v h_vtd <= budget_d        (D_td)

so its optimum is a lower bound on every such plan's compute and copy time. The graph's
outputs are present at some device at every later stage, or arrive later. x, c, f and
a2 are binaries; h, a and e are continuous (their rows only force them up). Stages are
thinned as the closure cover's are (every k-th binding stage, at most ``cells`` columns
of h per device), which only weakens the bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from remat.formulations.cover import MIB, Rows, Stages
from remat.graph import Graph, Mode, NodeKind
from remat.solvers.model import MILPModel


@dataclass(frozen=True)
class DeviceCoverModel:
    """The device cover MILP and, for reading a placement off a solution, the column of
    f_vd (``first[v, d]``)."""

    model: MILPModel
    first: np.ndarray  # int, [n, D]

    def placement(self, x: np.ndarray) -> np.ndarray:
        """The device of each node's first computation in solution ``x``."""
        return np.argmax(x[self.first], axis=1)


def build_device_cover(
    graph: Graph,
    compute_ms: np.ndarray,
    copy_in_ms: np.ndarray,
    output_bytes: np.ndarray,
    budgets: Sequence[int | None],
    fixed_bytes: int,
    cells: int,
) -> DeviceCoverModel:
    """The device cover of ``graph`` on len(``budgets``) devices: ``compute_ms[v, d]``,
    ``copy_in_ms[v, d]`` (the cheapest copy of v's value to d), ``budgets[d]`` (None:
    unlimited). Stages are those the pooled cover finds binding under the smallest
    budget with ``fixed_bytes`` held (a device holding every fixed tensor)."""
    rows = Rows()
    n, D = compute_ms.shape
    var = rows.var
    for v in range(n):
        for d in range(D):
            var("x", v, d, cost=float(compute_ms[v, d]), integer=True)
            var("c", v, d, cost=float(copy_in_ms[v, d]), integer=True)
            var("e", v, d, cost=float(min(compute_ms[v, d], copy_in_ms[v, d])))
            rows.add([(var("f", v, d, integer=True), 1), (var("x", v, d), -1)], hi=0)
            arrivals = [(var("a2", v, d, integer=True), -2), (var("x", v, d), 1)]
            rows.add([(var("e", v, d), 1), *arrivals, (var("c", v, d), 1)], lo=0)
        rows.add([(var("f", v, d), 1) for d in range(D)], lo=1, hi=1)
        for u in sorted(set(graph.nodes[v].deps)):
            for d in range(D):
                rows.add([(var("x", v, d), 1), (var("x", u, d), -1), (var("c", u, d), -1)], hi=0)
    fixed = _fixed_terms(graph, D, rows)
    finite = [b for b in budgets if b is not None]
    if finite:
        _stage_rows(graph, output_bytes, budgets, fixed, min(finite), fixed_bytes, cells, rows)
    first = np.array([[rows.index[("f", v, d)] for d in range(D)] for v in range(n)])
    return DeviceCoverModel(rows.model(), first)


def _fixed_terms(graph: Graph, D: int, rows: Rows) -> list[list[tuple[int, float]]]:
    """Each device's fixed memory in MiB as terms over g (the simulator's rule: a device
    holds the fixed tensors its nodes read, and a gradient buffer for those a backward
    node of its reads)."""
    readers: dict[tuple[str, str], list[int]] = {}
    training = graph.mode is Mode.TRAINING
    for v, node in enumerate(graph.nodes):
        for name in node.fixed:
            readers.setdefault(("g", name), []).append(v)
            if training and node.kind is NodeKind.BACKWARD and graph.fixed[name].has_gradient:
                readers.setdefault(("gg", name), []).append(v)
    terms: list[list[tuple[int, float]]] = [[] for _ in range(D)]
    for (kind, name), vs in readers.items():
        for d in range(D):
            column = rows.var(kind, name, d)
            for v in vs:
                rows.add([(column, 1), (rows.var("x", v, d), -1)], lo=0)
            terms[d].append((column, graph.fixed[name].nbytes / MIB))
    return terms


def _stage_rows(
    graph: Graph,
    output_bytes: np.ndarray,
    budgets: Sequence[int | None],
    fixed: list[list[tuple[int, float]]],
    smallest: int,
    fixed_bytes: int,
    cells: int,
    rows: Rows,
) -> None:
    """Rows (D_td) and what forces h and a, at every k-th stage binding under
    ``smallest``."""
    stages = Stages.of(graph, output_bytes, smallest, fixed_bytes)
    users, outputs, M, var = graph.users(), set(graph.outputs), stages.M, rows.var
    D = len(budgets)
    for t, dropped in stages.thinned(cells):
        L = dropped.tolist()
        for d, budget in enumerate(budgets):
            if budget is None:
                continue
            held = [(var("h", v, d, t), M[v] / MIB) for v in L]
            inputs = (M[t] + M[stages.deps[t]].sum()) / MIB
            rows.add([*fixed[d], (var("f", t, d), inputs), *held], hi=budget / MIB)
        for v in L:
            for d in range(D):
                arrived = [(var("x", v, d), -1), (var("c", v, d), -1)]
                rows.add([(var("h", v, d, t), 1), *arrived], hi=0)
                rows.add([(var("a", v, d, t), 1), *arrived], hi=0)
                again = [(var("a2", v, d), -1), (var("f", v, d), 1)]
                rows.add([(var("a", v, d, t), 1), *again], hi=1)
                for r in (r for r in users[v] if r > t):
                    there = [(var("h", v, d, t), -1), (var("a", v, d, t), -1)]
                    rows.add([(var("f", r, d), 1), *there], hi=0)
            if v in outputs:
                kept = [(var(kind, v, d, t), 1) for d in range(D) for kind in ("h", "a")]
                rows.add(kept, lo=1)
