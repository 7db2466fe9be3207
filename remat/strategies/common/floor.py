"""The memory floor: what computing one node needs on a device under any plan, so that a
budget below it is proven infeasible before any solve.

The simulator's rules (``remat.simulator``) give it directly: computing node v on device d
allocates v's output while every input of v is resident on d, and d holds the fixed
tensors of every node it computes (plus gradient buffers for backward nodes) for the whole
plan. So on d, at v's step,

    memory >= fixed(d) + M_v + sum of M_u over v's distinct inputs u + workspace(v, d),

with fixed(d) the fixed memory of every node when d is the only device or the devices share
one memory pool (every node runs on one of them, so the pool holds every fixed tensor), and
at least v's own when there are several memories. A node whose floor exceeds the budget of
every device it may run on has no plan; since the exact models are conservative w.r.t.
the simulator, they would prove the same, only later (VGG16 at 50% on one device: HiGHS
proves it in 35 s; a 10 s solve ends with neither a plan nor a proof).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat.devices import format_bytes
from remat.simulator import held_fixed_bytes
from remat.strategies.common.policy import device_fixed_bytes
from remat.strategies.common.problem import Problem


@dataclass(frozen=True)
class Need:
    """What computing ``node`` on ``device`` needs at least, against that device's budget."""

    node: int
    device: str
    fixed_bytes: int  # parameters, inputs and gradient buffers the device holds
    value_bytes: int  # the node's output and inputs, resident at its step, and its workspace
    budget: int

    @property
    def total(self) -> int:
        return self.fixed_bytes + self.value_bytes

    def describe(self) -> str:
        return (
            f"{format_bytes(self.total)} on {self.device} ({format_bytes(self.fixed_bytes)} "
            f"fixed, {format_bytes(self.value_bytes)} for its inputs, output and workspace), "
            f"over the budget of {format_bytes(self.budget)}"
        )


@dataclass(frozen=True)
class Shortfall:
    """A node that fits on none of the devices: what it needs on each."""

    node: str
    needs: tuple[Need, ...]

    def message(self, strategy: str) -> str:
        needs = "; ".join(need.describe() for need in self.needs)
        return (
            f"infeasible at this budget: {strategy} proved that no schedule fits: computing "
            f"{self.node} needs at least {needs}"
        )


def value_bytes(problem: Problem, node: int, d: int) -> int:
    """What computing ``node`` on device ``d`` holds of values at least: its output, its
    distinct inputs and its workspace."""
    sizes = problem.costs.output_bytes
    deps = set(problem.graph.nodes[node].deps)
    return int(sizes[node]) + sum(int(sizes[u]) for u in deps) + problem.costs.workspace(node, d)


def shortfall(problem: Problem, devices: Sequence[str], alone: bool = False) -> Shortfall | None:
    """Among the nodes that fit on none of ``devices`` (each with a budget), the one that
    needs the most on the first of them; None when every node fits somewhere. ``alone``:
    each node with only its own fixed tensors, as where nodes are computed one at a time
    with nothing else held (the agent's profiler, node by node)."""
    budgets: dict[str, int] = {}
    for name in devices:
        budget = problem.budgets.get(name)
        if budget is None:
            return None  # an unlimited device: every node fits there
        budgets[name] = budget
    graph = problem.graph
    index = {name: problem.costs.device_index(name) for name in budgets}
    spaces = {problem.costs.devices[d].memory_space for d in index.values()}
    shared = len(spaces) == 1 and not alone
    everything = device_fixed_bytes(problem, devices[0]) if shared else None
    worst: Shortfall | None = None
    for node in graph.nodes:
        fixed = held_fixed_bytes(graph, [node.id]) if everything is None else everything
        needs = tuple(
            Need(node.id, d, fixed, value_bytes(problem, node.id, index[d]), b)
            for d, b in budgets.items()
        )
        if any(need.total <= need.budget for need in needs):
            continue
        if worst is None or needs[0].total > worst.needs[0].total:
            worst = Shortfall(f"node {node.id} ({node.name})", needs)
    return worst
