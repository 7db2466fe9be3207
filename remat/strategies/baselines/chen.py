"""Chen et al. (2016) sqrt(n) and greedy checkpointing, and Checkmate's generalisations to
non-linear graphs (Table 1, appendix B).

Each heuristic picks a set of checkpoints among *candidates* and splits the forward order
after each checkpoint into segments; ``s_from_checkpoints`` turns that into S (checkpoints
+ the current segment, with a recomputed "ladder" per segment in the backward pass) and
R is solved optimally for it. The variants differ only in the candidates:

- ``chen_*``: linear graphs (chains) only, every forward node is a candidate;
- ``ap_*`` (B.1): articulation points of the undirected forward graph;
- ``linearized_*`` (B.2): every forward node, the topological order treated as a chain.

On a chain all three pick the same checkpoints (B: "all proposed generalizations exactly
reproduce the original heuristics on linear networks").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import networkx as nx
import numpy as np

from remat.errors import StrategyError
from remat.graph import FixedKind, Graph
from remat.strategies.common.policy import run_policies
from remat.strategies.common.problem import Problem, StrategyResult
from remat.strategies.common.rsolve import (
    Layout,
    checkpoint_holds,
    linear_chain_violation,
    segments_from_checkpoints,
)

GREEDY_SWEEP = 24  # values of Chen's segment budget b tried by the greedy variants


# --- candidates -------------------------------------------------------------------------


def chain_candidates(graph: Graph, strategy: str) -> list[int]:
    problem = linear_chain_violation(graph)
    if problem is not None:
        stem = strategy.removeprefix("chen_")
        raise StrategyError(
            f"{strategy} needs a linear graph (a chain); {problem}. "
            f"Use ap_{stem} or linearized_{stem} for general graphs"
        )
    return list(range(Layout.of(graph).F))


def linearized_candidates(graph: Graph) -> list[int]:
    return list(range(Layout.of(graph).F))


def articulation_candidates(graph: Graph) -> list[int]:
    """Articulation points of the undirected forward graph, plus the last forward node
    (the end of the last segment, so that a chain gives every node as in Chen et al.).

    The model input is a node in Checkmate's graphs; here it is a fixed tensor, so a
    virtual source joins every forward node that reads it or has no dependencies."""
    F = Layout.of(graph).F
    if F == 0:
        return []
    source = -1
    undirected = nx.Graph()
    undirected.add_nodes_from(range(-1, F))
    for node in graph.nodes[:F]:
        undirected.add_edges_from((d, node.id) for d in node.deps)
        reads_input = any(
            graph.fixed[name].kind is FixedKind.INPUT for name in node.fixed if name in graph.fixed
        )
        if not node.deps or reads_input:
            undirected.add_edge(source, node.id)
    points = set(nx.articulation_points(undirected)) - {source}
    return sorted(points | {F - 1})


# --- checkpoint selection ---------------------------------------------------------------


def sqrt_checkpoints(candidates: Sequence[int]) -> list[int]:
    """Every k-th candidate, k = ceil(sqrt(#candidates)): about sqrt(n) segments of about
    sqrt(n) nodes each on a chain."""
    if not candidates:
        return []
    k = math.ceil(math.sqrt(len(candidates)))
    return list(candidates[k - 1 :: k])


def greedy_checkpoints(sizes: np.ndarray, candidates: Sequence[int], b: float) -> list[int]:
    """Chen's greedy: walk the topological order accumulating output bytes; at the first
    candidate where the running total exceeds b, checkpoint it and start a new segment."""
    allowed = np.zeros(len(sizes), dtype=bool)
    allowed[list(candidates)] = True
    chosen: list[int] = []
    total = 0.0
    for v, size in enumerate(sizes.tolist()):
        total += size
        if allowed[v] and total > b:
            chosen.append(v)
            total = 0.0
    return chosen


def greedy_budgets(sizes: np.ndarray) -> list[float]:
    """The sweep over b (Checkmate 6.1): 0 (checkpoint every candidate) and a geometric
    range from the smallest node to all forward activations."""
    positive = sizes[sizes > 0]
    if positive.size == 0:
        return [0.0]
    low, high = float(positive.min()), float(sizes.sum())
    return [0.0, *np.geomspace(low, max(high, low), GREEDY_SWEEP).tolist()]


# --- strategies -------------------------------------------------------------------------


def _judge(
    problem: Problem, device: str, strategy: str, choices: list[list[int]]
) -> StrategyResult:
    graph = problem.graph
    F = Layout.of(graph).F
    distinct = {tuple(sorted(c for c in choice if c < F - 1)) for choice in choices}
    policies = (
        checkpoint_holds(graph, key, segments_from_checkpoints(F, key))
        for key in sorted(distinct)  # F-1 ends the last segment anyway
    )
    return run_policies(problem, device, strategy, policies)


def _sqrt(problem: Problem, device: str, strategy: str, candidates: list[int]) -> StrategyResult:
    return _judge(problem, device, strategy, [sqrt_checkpoints(candidates)])


def _greedy(problem: Problem, device: str, strategy: str, candidates: list[int]) -> StrategyResult:
    F = Layout.of(problem.graph).F
    sizes = np.asarray(problem.costs.output_bytes[:F], dtype=float)
    choices = [greedy_checkpoints(sizes, candidates, b) for b in greedy_budgets(sizes)]
    return _judge(problem, device, strategy, choices)


def chen_sqrt(problem: Problem, device: str) -> StrategyResult:
    return _sqrt(problem, device, "chen_sqrt", chain_candidates(problem.graph, "chen_sqrt"))


def chen_greedy(problem: Problem, device: str) -> StrategyResult:
    candidates = chain_candidates(problem.graph, "chen_greedy")
    return _greedy(problem, device, "chen_greedy", candidates)


def ap_sqrt(problem: Problem, device: str) -> StrategyResult:
    return _sqrt(problem, device, "ap_sqrt", articulation_candidates(problem.graph))


def ap_greedy(problem: Problem, device: str) -> StrategyResult:
    return _greedy(problem, device, "ap_greedy", articulation_candidates(problem.graph))


def linearized_sqrt(problem: Problem, device: str) -> StrategyResult:
    return _sqrt(problem, device, "linearized_sqrt", linearized_candidates(problem.graph))


def linearized_greedy(problem: Problem, device: str) -> StrategyResult:
    candidates = linearized_candidates(problem.graph)
    return _greedy(problem, device, "linearized_greedy", candidates)
