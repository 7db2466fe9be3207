"""The plan simulator: the single judge of a plan's validity and predicted cost.

It replays a plan step by step against a graph, a cost model and per-device budgets,
tracking which values are resident on which device.

Memory accounting. A device's memory after a step is its fixed memory plus the values
resident on it. Fixed memory is static for the whole step and follows one rule: a device
holds every fixed tensor (parameter or model input) read by a node it computes anywhere in
the plan, and in training also a gradient buffer of the same size for every fixed tensor
read by a backward node it computes (weight gradients, and the input gradient). This is
Checkmate's constant M_input + 2 M_param (eq. 2) on one device, split by placement on
several.

Time. Steps run one after another: predicted time is the sum of compute and copy times.
Step kinds are dispatched through ``_HANDLERS``, so later kinds (offload, prefetch, paging,
steps on a transfer stream) add a handler without touching the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from remat.costs import CostModel
from remat.devices import format_bytes
from remat.graph import Graph, Mode, NodeKind
from remat.plan import Compute, Copy, Free, Plan, Step


@dataclass(frozen=True)
class Violation:
    step: int  # index into plan.steps; -1 for a check made after the last step
    message: str
    over_budget: bool = False  # the plan is correct but needs more memory

    def __str__(self) -> str:
        where = "after the last step" if self.step < 0 else f"step {self.step}"
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class Simulation:
    violation: Violation | None
    total_ms: float
    compute_ms: float
    copy_ms: float
    fixed_bytes: dict[str, int]
    peak_bytes: dict[str, int]
    timeline: dict[str, list[int]]  # bytes resident on each device after each step
    computes: int = 0

    @property
    def valid(self) -> bool:
        return self.violation is None


class _PlanInvalid(Exception):
    pass


@dataclass
class _State:
    graph: Graph
    costs: CostModel
    device_index: dict[str, int]
    resident: list[set[int]]
    memory: list[int]
    computed: set[int] = field(default_factory=set)
    compute_ms: float = 0.0
    copy_ms: float = 0.0
    computes: int = 0

    def device(self, name: str) -> int:
        index = self.device_index.get(name)
        if index is None:
            raise _PlanInvalid(f"unknown device {name!r}")
        return index

    def node_name(self, node: int) -> str:
        if not 0 <= node < len(self.graph):
            raise _PlanInvalid(f"unknown node {node}")
        return f"{node} ({self.graph.nodes[node].name})"

    def allocate(self, node: int, d: int) -> None:
        self.resident[d].add(node)
        self.memory[d] += int(self.costs.output_bytes[node])


def _compute(state: _State, step: Compute) -> None:
    name = state.node_name(step.node)
    d = state.device(step.device)
    if step.node in state.resident[d]:
        raise _PlanInvalid(f"node {name} is already resident on {step.device}")
    for dep in state.graph.nodes[step.node].deps:
        if dep not in state.resident[d]:
            raise _PlanInvalid(
                f"compute {name} on {step.device}: dependency {state.node_name(dep)} "
                f"is not resident there"
            )
    state.allocate(step.node, d)
    state.computed.add(step.node)
    state.compute_ms += float(state.costs.compute_ms[step.node, d])
    state.computes += 1


def _copy(state: _State, step: Copy) -> None:
    name = state.node_name(step.node)
    src, dst = state.device(step.src), state.device(step.dst)
    if src == dst:
        raise _PlanInvalid(f"copy of {name} from {step.src} to itself")
    if step.node not in state.resident[src]:
        raise _PlanInvalid(f"copy of {name}: not resident on {step.src}")
    if step.node in state.resident[dst]:
        raise _PlanInvalid(f"copy of {name}: already resident on {step.dst}")
    state.allocate(step.node, dst)
    state.copy_ms += float(state.costs.copy_ms[step.node, src, dst])


def _free(state: _State, step: Free) -> None:
    name = state.node_name(step.node)
    d = state.device(step.device)
    if step.node not in state.resident[d]:
        raise _PlanInvalid(f"free of {name} on {step.device}: not resident (double free)")
    state.resident[d].discard(step.node)
    state.memory[d] -= int(state.costs.output_bytes[step.node])


_HANDLERS: dict[str, Callable[[_State, Step], None]] = {
    "compute": _compute,  # type: ignore[dict-item]
    "copy": _copy,  # type: ignore[dict-item]
    "free": _free,  # type: ignore[dict-item]
}


def held_fixed_bytes(graph: Graph, nodes: Iterable[int]) -> int:
    """Fixed memory of a device that computes ``nodes``: the rule in the module docstring."""
    held: set[str] = set()
    gradients: set[str] = set()
    training = graph.mode is Mode.TRAINING
    for index in nodes:
        node = graph.nodes[index]
        held.update(node.fixed)
        if training and node.kind is NodeKind.BACKWARD:
            gradients.update(t for t in node.fixed if graph.fixed[t].has_gradient)
    return sum(graph.fixed[t].nbytes for t in held) + sum(graph.fixed[t].nbytes for t in gradients)


def fixed_bytes(graph: Graph, plan: Plan) -> dict[str, int]:
    """Fixed memory per device of a plan (steps naming unknown nodes are skipped here and
    reported by the replay)."""
    computed: dict[str, set[int]] = {d.name: set() for d in plan.devices}
    for step in plan.steps:
        if isinstance(step, Compute) and step.device in computed and 0 <= step.node < len(graph):
            computed[step.device].add(step.node)
    return {name: held_fixed_bytes(graph, nodes) for name, nodes in computed.items()}


def simulate(
    plan: Plan,
    graph: Graph,
    costs: CostModel,
    budgets: Mapping[str, int | None] | None = None,
) -> Simulation:
    """Replay ``plan``; return its predicted cost and memory, or its first violation.

    ``budgets`` default to the plan's own ``budget_bytes``; None means unlimited."""
    budgets = dict(plan.budgets if budgets is None else budgets)
    names = [d.name for d in plan.devices]
    fixed = fixed_bytes(graph, plan)
    state = _State(
        graph,
        costs,
        {name: costs.device_index(name) for name in names},
        [set() for _ in costs.devices],
        [0] * len(costs.devices),
    )
    for name in names:
        state.memory[state.device_index[name]] = fixed[name]
    timeline: dict[str, list[int]] = {name: [] for name in names}
    peaks = dict(fixed)
    violation = _over_budget(fixed, budgets, -1, "fixed memory (parameters, inputs)")
    for index, step in enumerate(plan.steps if violation is None else ()):
        try:
            handler = _HANDLERS.get(step.op)
            if handler is None:
                raise _PlanInvalid(f"unknown step kind {step.op!r}")
            handler(state, step)
        except _PlanInvalid as exc:
            violation = Violation(index, str(exc))
            break
        for name in names:
            used = state.memory[state.device_index[name]]
            timeline[name].append(used)
            peaks[name] = max(peaks[name], used)
        violation = _over_budget(
            {n: state.memory[state.device_index[n]] for n in names}, budgets, index, None
        )
        if violation is not None:
            break
    if violation is None:
        violation = _final_check(state, graph)
    return Simulation(
        violation,
        state.compute_ms + state.copy_ms,
        state.compute_ms,
        state.copy_ms,
        fixed,
        peaks,
        timeline,
        state.computes,
    )


def _over_budget(
    used: Mapping[str, int], budgets: Mapping[str, int | None], step: int, what: str | None
) -> Violation | None:
    for name, value in used.items():
        budget = budgets.get(name)
        if budget is not None and value > budget:
            label = f"{what} on {name}" if what else f"memory on {name}"
            return Violation(
                step,
                f"{label} is {format_bytes(value)} ({value} B), over the budget of "
                f"{format_bytes(budget)} ({budget} B)",
                over_budget=True,
            )
    return None


def _final_check(state: _State, graph: Graph) -> Violation | None:
    for node in graph.nodes:
        if node.id not in state.computed:
            return Violation(-1, f"node {state.node_name(node.id)} is never computed")
    for output in graph.outputs:
        if not any(output in resident for resident in state.resident):
            return Violation(
                -1, f"output {state.node_name(output)} is not resident when the plan ends"
            )
    return None
