"""Graph coarsening: cheap elementwise chains fused into their producer, a schedule of the
coarse graph expanded into a valid schedule of the fine one.

A *group* is a run of consecutive nodes (a contiguous index range, so coarse stage order is
fine stage order): a forward node joins its predecessor's group when it is a cheap op
(``FUSABLE``), reads no other value, and is the predecessor's only forward reader; a
backward node joins its predecessor's group when its forward node joined, mirrored (the
gradient of a chain runs the chain backwards). Backward nodes still read every member's
value, so the coarse problem keeps or recomputes a group as a whole: a restriction of the
fine problem. Its optimum is an upper bound, never a bound below; coarse plans are used as
incumbents, and the reported bound always comes from the fine problem.

Coarse costs: compute = the members' sum per device; copy = the sum over members read
outside the group; output bytes = the bytes of members read outside the group plus the
largest member read only inside it (the transient while the group runs), so the coarse
memory accounting covers the fine plan's. The simulator judges every expanded plan.

Expansion (frontier-advancing, ``Coarse.expand``): coarse stage c spans fine stages
[first(c), last(c)]. A group recomputed in coarse stage c is recomputed in fine stage
first(c); member m of group c is computed in fine stage m; a value kept into coarse stage c
is kept into each of its fine stages, and whatever the coarse stage computed so far is
kept into its later fine stages. Then recomputations and checkpoints that nothing reads are
dropped (``rsolve.clean_placed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.costs import CostModel
from remat.graph import Graph, Node, NodeKind
from remat.schedule import Schedule
from remat.strategies.common.problem import Problem
from remat.strategies.common.rsolve import clean_placed
from remat.strategies.config import DEFAULT_SEARCH

FUSABLE = frozenset(
    [
        "Relu",
        "LeakyRelu",
        "PRelu",
        "Sigmoid",
        "Tanh",
        "Gelu",
        "Elu",
        "Selu",
        "Erf",
        "HardSigmoid",
        "HardSwish",
        "Clip",
        "Dropout",
        "BatchNormalization",
        "InstanceNormalization",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Identity",
        "Cast",
    ]
)


@dataclass(frozen=True)
class Coarse:
    """A coarse graph and its costs, with ``groups[c]`` the fine nodes of coarse node c."""

    fine: Graph
    graph: Graph
    costs: CostModel
    groups: tuple[tuple[int, ...], ...]

    @property
    def ratio(self) -> float:
        return len(self.graph) / max(len(self.fine), 1)

    def expand_home(self, home: np.ndarray) -> np.ndarray:
        """A placement of the coarse nodes as one of the fine nodes: each on its group's."""
        fine = np.zeros(len(self.fine), dtype=np.asarray(home).dtype)
        for c, group in enumerate(self.groups):
            fine[list(group)] = home[c]
        return fine

    def expand(self, coarse: Schedule) -> Schedule:
        """The fine schedule of a coarse one (module docstring); same devices."""
        Rc, Sc = coarse.R, coarse.S
        D, n = Rc.shape[0], len(self.fine)
        R = np.zeros((D, n, n), dtype=bool)
        S = np.zeros((D, n, n), dtype=bool)
        members = [np.array(g) for g in self.groups]
        for c, group in enumerate(members):
            first = int(group[0])
            for d in range(D):
                for h in np.flatnonzero(Rc[d, c, :c]):
                    R[d, first, members[h]] = True
                for h in np.flatnonzero(Sc[d, c]):
                    S[d, first : int(group[-1]) + 1, members[h]] = True
                if Rc[d, c, c]:
                    R[d, group, group] = True
            for m in group[1:]:  # the coarse stage so far stays resident (eq. 11)
                S[:, m] |= R[:, first:m].any(axis=1)
        R, S = clean_placed(self.fine, R, S)
        return Schedule(coarse.devices, R, S)


def coarse_of(problem: Problem) -> Coarse | None:
    """The coarse graph, where it is worth solving: at least ``coarse_min_nodes`` nodes, of
    which coarsening leaves at most ``coarse_max_ratio`` (``SearchConfig``)."""
    config = problem.solver.search
    if len(problem.graph) < config.coarse_min_nodes:
        return None
    coarse = coarsen(problem.graph, problem.costs, config.coarse_max_group)
    return None if coarse.ratio > config.coarse_max_ratio else coarse


def coarsen(
    graph: Graph, costs: CostModel, max_group: int = DEFAULT_SEARCH.coarse_max_group
) -> Coarse:
    """Fuse cheap chains (module docstring) of at most ``max_group`` nodes."""
    joins = _joins(graph, max_group)
    groups: list[list[int]] = []
    for index in range(len(graph)):
        if joins[index]:
            groups[-1].append(index)
        else:
            groups.append([index])
    owner = np.zeros(len(graph), dtype=np.int64)
    for c, group in enumerate(groups):
        owner[group] = c
    readers = graph.users()
    external = [
        [m for m in g if any(owner[u] != c for u in readers[m]) or m in graph.outputs]
        for c, g in enumerate(groups)
    ]
    coarse_costs = _coarse_costs(costs, groups, external)
    nodes = tuple(
        _coarse_node(graph, c, group, owner, int(coarse_costs.output_bytes[c]))
        for c, group in enumerate(groups)
    )
    outputs = tuple(sorted({int(owner[o]) for o in graph.outputs}))
    coarse_graph = Graph(graph.mode, nodes, graph.fixed, outputs)
    return Coarse(graph, coarse_graph, coarse_costs, tuple(tuple(g) for g in groups))


def _joins(graph: Graph, max_group: int) -> list[bool]:
    """joins[i]: node i joins node i-1's group."""
    n = len(graph)
    users = graph.users()
    joins = [False] * n
    size = [1] * n
    backward_of = {node.forward: node.id for node in graph.nodes if node.forward is not None}
    for node in graph.nodes[1:]:
        i = node.id
        if node.kind is NodeKind.FORWARD:
            joins[i] = _fuses_forward(graph, node, users)
        elif node.kind is NodeKind.BACKWARD and node.forward is not None:
            joins[i] = _fuses_backward(graph, node, backward_of, joins)
        if joins[i] and size[i - 1] < max_group:
            size[i] = size[i - 1] + 1
        else:
            joins[i] = False
    return joins


def _fuses_forward(graph: Graph, node: Node, users: list[list[int]]) -> bool:
    producer = node.id - 1
    if node.op not in FUSABLE or node.deps != (producer,):
        return False
    forward_readers = [u for u in users[producer] if graph.nodes[u].kind is NodeKind.FORWARD]
    return forward_readers == [node.id]


def _fuses_backward(
    graph: Graph, node: Node, backward_of: dict[int, int], joins: list[bool]
) -> bool:
    """b(u) joins b(v) when v joined u's forward group and b(v) is b(u)'s only gradient."""
    u = node.forward
    assert u is not None
    v = u + 1
    if v >= len(graph) or not joins[v] or backward_of.get(v) != node.id - 1:
        return False
    gradients = [d for d in node.deps if graph.nodes[d].kind is not NodeKind.FORWARD]
    return gradients == [node.id - 1]


def _coarse_node(
    graph: Graph, c: int, group: list[int], owner: np.ndarray, output_bytes: int
) -> Node:
    first, last = graph.nodes[group[0]], graph.nodes[group[-1]]
    deps = sorted({int(owner[d]) for m in group for d in graph.nodes[m].deps} - {c})
    fixed = tuple(dict.fromkeys(f for m in group for f in graph.nodes[m].fixed))
    forward = None if last.forward is None else int(owner[last.forward])
    return Node(
        id=c,
        name=first.name if len(group) == 1 else f"{first.name}..{last.name}",
        op=first.op if len(group) == 1 else "+".join(graph.nodes[m].op for m in group),
        kind=first.kind,
        deps=tuple(deps),
        output_bytes=output_bytes,
        fixed=fixed,
        forward=forward,
        scratch_bytes=max(graph.nodes[m].scratch_bytes for m in group),
    )


def _coarse_costs(
    costs: CostModel, groups: list[list[int]], external: list[list[int]]
) -> CostModel:
    out = costs.output_bytes
    copy = np.stack(
        [
            costs.copy_ms[e].sum(axis=0) if e else costs.copy_ms[g[-1]]
            for g, e in zip(groups, external, strict=True)
        ]
    )
    sizes = []
    for g, e in zip(groups, external, strict=True):
        internal = [int(out[m]) for m in g if m not in e]
        sizes.append(int(out[e].sum()) + max(internal, default=0))
    sizes_array = np.array(sizes, dtype=np.int64)
    return costs.grouped(groups, sizes_array, copy)
