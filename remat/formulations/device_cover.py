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
    e_vd   arrivals on d beyond those x and c pay for: computed again (costs C_vd)
    k_vd   ... or copied again (costs K_vd)
    g_Fd   d holds fixed tensor F (and its gradient buffer, for a backward reader)

every plan that first computes the nodes in the graph's order satisfies

    x_vd <= x_ud + c_ud            for u in DEPS[v]    (an input is on v's device)
    e_vd + k_vd >= 2 a2_vd - x_vd - c_vd               (a second arrival is paid)
    g_Fd >= x_vd                   for v reading F

and at stage t (node t's first computation), for each value v < t that a node after t
reads and t does not (L_t - DEPS[t]), with h_vtd = 1 if v is on d then and a_vtd = 1 if
v arrives on d after t:

    f_rd <= h_vtd + a_vtd          for r > t reading v   (r's first computation reads v)
    h_vtd, a_vtd <= x_vd + c_vd                          (what is on d arrived there)
    a_vtd <= a2_vd + 1 - f_vd                            (first computed on d: again)
    fixed_d(g) + f_td (M_t + M_DEPS[t]) + sum_v M_v h_vtd <= budget_d        (D_td)

so its optimum is a lower bound on every such plan's compute and copy time. The graph's
outputs are present at some device at every later stage, or arrive later. x, c, f and a2
are binaries; h, a, e and k are continuous (their rows only force them up). Stages are
thinned as the closure cover's are (the binding stages that need most, at most ``cells``
columns of h per device), which only weakens the bound.

It charges a recomputation nothing for its inputs. The closure rows (``depth`` > 0) add
the closure cover's (``cover.build_closure``) on each device: with w_vtd = 1 if v is
computed on d after stage t and p_utd = 1 if u, which no node after t reads, is on d
during stage t,

    a_vtd <= w_vtd + c_vd                               (an arrival: computed, or copied)
    w_vtd <= present_utd + a_utd   for u in DEPS[v]     (its inputs on d at that time)
    e_vd + k_vd >= a2_vd + f_vd - 1 - c_vd              (first computed on d, never copied
                                                         there: a second arrival is paid)

where present_utd is h_utd for u in L_t - DEPS[t], f_td + p_utd for t's inputs and p_utd
otherwise, with M_u p_utd charged in (D_td). Rows follow inputs ``depth`` steps back.
Once a recomputation pays for its inputs, a copy must pay for its source, or a value
that only the accelerator ever held comes back there at a copy's price. So the closure
rows come with copy rows, which hold for every plan that copies a value to a device only
for a node there that reads it (as the compiler does):

    c_vd, k_vd <= sum_{o != d} (x_vo + c_vo)           (a copy has a source elsewhere)
    c_vd, k_vd <= sum_{r reads v} x_rd                 (and a reader on d)

Without the closure rows they raised no bound on the bench graphs, and slowed the MILP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

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

    def placed(self, home: np.ndarray) -> MILPModel:
        """The model with each node first computed on ``home[v]`` (f fixed): its optimum is
        the placement's cost in the relaxation, and its LP relaxation's a bound on it, far
        closer than the whole model's LP (which splits nodes over devices)."""
        lb, ub = self.model.lb.copy(), self.model.ub.copy()
        chosen = self.first[np.arange(len(home)), home]
        lb[self.first], ub[self.first] = 0.0, 0.0
        lb[chosen], ub[chosen] = 1.0, 1.0
        return replace(self.model, lb=lb, ub=ub, start=None)


def build_device_cover(
    graph: Graph,
    compute_ms: np.ndarray,
    copy_in_ms: np.ndarray,
    output_bytes: np.ndarray,
    budgets: Sequence[int | None],
    fixed_bytes: int,
    cells: int,
    depth: int = 0,
) -> DeviceCoverModel:
    """The device cover of ``graph`` on len(``budgets``) devices: ``compute_ms[v, d]``,
    ``copy_in_ms[v, d]`` (the cheapest copy of v's value to d), ``budgets[d]`` (None:
    unlimited). Stages are those the pooled cover finds binding under the smallest
    budget with ``fixed_bytes`` held (a device holding every fixed tensor). With
    ``depth`` > 0, the closure rows (``_closure_rows``) follow a recomputation's inputs
    that many steps back, and the copy rows (``_copy_rows``) come with them."""
    rows = Rows()
    n, D = compute_ms.shape
    var = rows.var
    for v in range(n):
        for d in range(D):
            var("x", v, d, cost=float(compute_ms[v, d]), integer=True)
            var("c", v, d, cost=float(copy_in_ms[v, d]), integer=True)
            var("e", v, d, cost=float(compute_ms[v, d]))
            var("k", v, d, cost=float(copy_in_ms[v, d]))
            beyond = [(var("e", v, d), 1), (var("k", v, d), 1)]
            rows.add([(var("f", v, d, integer=True), 1), (var("x", v, d), -1)], hi=0)
            arrivals = [(var("a2", v, d, integer=True), -2), (var("x", v, d), 1)]
            rows.add([*beyond, *arrivals, (var("c", v, d), 1)], lo=0)
            if depth:
                again = [(var("a2", v, d), -1), (var("f", v, d), -1), (var("c", v, d), 1)]
                rows.add([*beyond, *again], lo=-1)
        rows.add([(var("f", v, d), 1) for d in range(D)], lo=1, hi=1)
        for u in sorted(set(graph.nodes[v].deps)):
            for d in range(D):
                rows.add([(var("x", v, d), 1), (var("x", u, d), -1), (var("c", u, d), -1)], hi=0)
    if depth:
        _copy_rows(graph, D, rows)
    fixed = _fixed_terms(graph, D, rows)
    finite = [b for b in budgets if b is not None]
    if finite:
        stages = Stages.of(graph, output_bytes, min(finite), fixed_bytes)
        _stage_rows(graph, stages, budgets, fixed, cells, depth, rows)
    first = np.array([[rows.index[("f", v, d)] for d in range(D)] for v in range(n)])
    return DeviceCoverModel(rows.model(), first)


def _copy_rows(graph: Graph, D: int, rows: Rows) -> None:
    """A copy of v to d (the first, c_vd, or one beyond those x and c pay for, k_vd) has
    a source, v computed on or copied to another device, and a reader of v on d, for
    which the compiler copies it."""
    var = rows.var
    for v, readers in enumerate(graph.users()):
        for d in range(D):
            elsewhere = [(var(kind, v, o), -1) for o in range(D) if o != d for kind in "xc"]
            there = [(var("x", r, d), -1) for r in readers]
            for copy in (var("c", v, d), var("k", v, d)):
                rows.add([(copy, 1), *elsewhere], hi=0)
                rows.add([(copy, 1), *there], hi=0)


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
    stages: Stages,
    budgets: Sequence[int | None],
    fixed: list[list[tuple[int, float]]],
    cells: int,
    depth: int,
    rows: Rows,
) -> None:
    """Rows (D_td) and what forces h and a, at the binding stages ``stages.thinned`` keeps."""
    users, outputs, M, var = graph.users(), set(graph.outputs), stages.M, rows.var
    D = len(budgets)
    for t, dropped in stages.thinned(cells):
        L = dropped.tolist()
        for d, budget in enumerate(budgets):
            if budget is None:
                continue
            held = [(var("h", v, d, t), M[v] / MIB) for v in L]
            present = _closure_rows(graph, stages, t, L, d, depth, rows) if depth else []
            held += [(var("p", u, d, t), M[u] / MIB) for u in present]
            inputs = (M[t] + M[stages.deps[t]].sum()) / MIB
            rows.add([*fixed[d], (var("f", t, d), inputs), *held], hi=budget / MIB)
        for v in L:
            for d in range(D):
                arrived = [(var("x", v, d), -1), (var("c", v, d), -1)]
                rows.add([(var("h", v, d, t), 1), *arrived], hi=0)
                _arrival_rows(v, d, t, rows)
                for r in (r for r in users[v] if r > t):
                    there = [(var("h", v, d, t), -1), (var("a", v, d, t), -1)]
                    rows.add([(var("f", r, d), 1), *there], hi=0)
            if v in outputs:
                kept = [(var(kind, v, d, t), 1) for d in range(D) for kind in ("h", "a")]
                rows.add(kept, lo=1)


def _arrival_rows(v: int, d: int, t: int, rows: Rows) -> None:
    """What v's arriving on d after stage t (a_vtd) costs: v was computed on or copied to
    d, and if v was first computed on d, it arrives there twice."""
    var = rows.var
    arrived = [(var("x", v, d), -1), (var("c", v, d), -1)]
    rows.add([(var("a", v, d, t), 1), *arrived], hi=0)
    again = [(var("a2", v, d), -1), (var("f", v, d), 1)]
    rows.add([(var("a", v, d, t), 1), *again], hi=1)


def _closure_rows(
    graph: Graph, stages: Stages, t: int, L: list[int], d: int, depth: int, rows: Rows
) -> list[int]:
    """The closure cover's rows on device d at stage t: a value arriving on d after t by a
    computation there (w_vtd) needs each input u on d then, so u was on d at t (h_utd for
    u in ``L``; f_td, t's device, or p_utd for t's inputs; p_utd for the rest) or arrived
    there after t too. Rows follow inputs ``depth`` steps back from ``L``; returns the u
    whose p_utd the memory row (D_td) must charge."""
    var, inputs_of_t, dropped = rows.var, set(stages.deps[t].tolist()), set(L)
    present: list[int] = []
    frontier, seen = [(v, 0) for v in L], set(L)
    while frontier:
        v, level = frontier.pop()
        if v not in dropped:
            _arrival_rows(v, d, t, rows)
        computed = [(var("w", v, d, t), -1), (var("c", v, d), -1)]
        rows.add([(var("a", v, d, t), 1), *computed], hi=0)
        if level >= depth:
            continue
        for u in sorted(set(graph.nodes[v].deps)):
            if u in dropped:
                there = [(var("h", u, d, t), -1)]
            else:
                there = [(var("p", u, d, t), -1)]
                if u in inputs_of_t:
                    there.append((var("f", t, d), -1))
                if u not in present:
                    present.append(u)
            rows.add([(var("w", v, d, t), 1), *there, (var("a", u, d, t), -1)], hi=0)
            if u not in seen:
                seen.add(u)
                frontier.append((u, level + 1))
    return present
