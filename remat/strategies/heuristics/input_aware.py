"""input_aware: Mimose's responsive scheduler (Algorithm 1), the fast planner for an input
size met on the spot.

A *layer* is a forward node whose output a later phase reads (an activation held across
the end of the forward pass, checkpoint-all's peak); its estimated memory is its output
bytes. Algorithm 1:

- lines 2-14: the layers, largest first, go into buckets of sizes within
  ``BUCKET_TOLERANCE`` (10%) of the bucket's largest; each bucket in forward order;
- lines 15-25: while the excess memory is positive, recompute a layer: where some bucket's
  largest layer exceeds the excess, the earliest layer of the smallest such bucket (the
  one nearest the excess), else the earliest layer of the largest bucket; subtract its
  bytes from the excess.

Earlier layers are preferred within a bucket because a layer recomputed early in the
forward pass is restored late in the backward pass, when most activations are gone
(section 4.4). The excess is the paper's: the layers' bytes plus fixed memory minus the
budget. A recomputed layer is restored in the backward pass with the others of its
segment (the layers between two kept ones: ``rsolve.checkpoint_holds``, torch's
checkpointing of that run). The recomputation's own memory in the backward pass is not
in the estimate, so where the plan's predicted peak is over the budget the excess grows by
twice the overshoot, then by steps that double, until it fits; then a bisection finds the
least excess that fits
(``SELECTION_ROUNDS`` selections each at most); the cheapest plan predicted to fit is
judged by the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from remat.graph import NodeKind
from remat.strategies.common.policy import Candidate, candidates, choose, device_fixed_bytes
from remat.strategies.common.problem import Problem, StrategyResult
from remat.strategies.common.rsolve import Layout, checkpoint_holds, segments_from_checkpoints

NAME = "input_aware"
BUCKET_TOLERANCE = 0.1
SELECTION_ROUNDS = 8


def input_aware(problem: Problem, device: str) -> StrategyResult:
    graph = problem.graph
    F = Layout.of(graph).F
    sizes = problem.costs.output_bytes
    layers = activation_layers(problem)
    budget = problem.budgets.get(device)
    tried: list[Candidate] = []

    def over(excess: float) -> int:
        """The plan of the selection for ``excess``: its predicted peak over the budget."""
        dropped = set(recomputed_layers(sizes, layers, excess))
        kept = [v for v in range(F) if v not in dropped]
        holds = checkpoint_holds(graph, kept, segments_from_checkpoints(F, kept))
        tried.append(candidates(problem, device, [holds])[0])
        return 0 if budget is None else tried[-1].prediction.peak_bytes - budget

    low = (
        0.0
        if budget is None
        else float(device_fixed_bytes(problem, device) + sizes[layers].sum() - budget)
    )
    most = float(sizes[layers].sum())
    overshoot = over(low)
    high, step = low, 2.0 * overshoot
    for _ in range(SELECTION_ROUNDS):  # grow the excess, the step doubling, until it fits
        if overshoot <= 0 or high >= most:
            break
        low, high, step = high, min(high + step, most), 2 * step
        overshoot = over(high)
    if overshoot <= 0:
        for _ in range(SELECTION_ROUNDS):  # the least excess that fits, by bisection
            if high - low <= most / 100:
                break
            middle = (low + high) / 2
            if over(middle) <= 0:
                high = middle
            else:
                low = middle
    return choose(problem, device, NAME, tried)


def activation_layers(problem: Problem) -> list[int]:
    """The forward nodes a loss or backward node reads: Mimose's layers, in forward
    order."""
    graph = problem.graph
    read_later = {
        dep for node in graph.nodes if node.kind is not NodeKind.FORWARD for dep in node.deps
    }
    return [v for v in sorted(read_later) if graph.nodes[v].kind is NodeKind.FORWARD]


def recomputed_layers(sizes: np.ndarray, layers: Sequence[int], excess: float) -> list[int]:
    """Algorithm 1 (lines 2-25): the layers to recompute so that their bytes cover
    ``excess``, by the buckets of the module docstring; every layer where none suffices."""
    size = {v: int(sizes[v]) for v in layers}
    buckets: list[list[int]] = []  # the largest sizes first
    for v in sorted(layers, key=lambda v: (-size[v], v)):
        if buckets and size[v] > size[buckets[-1][0]] * (1 - BUCKET_TOLERANCE):
            buckets[-1].append(v)
        else:
            buckets.append([v])
    for bucket in buckets:
        bucket.sort()  # forward order: the earliest layer first
    chosen: list[int] = []
    while excess > 0 and buckets:
        above = [b for b in buckets if max(size[v] for v in b) > excess]
        bucket = above[-1] if above else buckets[0]
        layer = bucket.pop(0)
        if not bucket:
            buckets.remove(bucket)
        chosen.append(layer)
        excess -= size[layer]
    return chosen
