"""Budgets: resolving user sizes (bytes or % of the checkpoint-all peak) into bytes, and
the checks a problem's sizes and budgets must pass before anything is planned."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from remat.costs import CostModel
from remat.devices import MAX_BYTES, Device, Size, format_bytes
from remat.errors import InvalidInputError
from remat.graph import Graph
from remat.simulator import held_fixed_bytes
from remat.strategies import Problem, run_strategy


@dataclass(frozen=True)
class Reference:
    """The checkpoint-all execution on one device with unlimited memory: every node once,
    every value freed after its last use (what frameworks do by default)."""

    fixed_bytes: int
    peak_bytes: int
    total_ms: float


def reference(graph: Graph, costs: CostModel, device: str | None = None) -> Reference:
    """Plans and simulates checkpoint-all: use it for the peak; the fixed memory alone is
    ``fixed_bytes(graph)``, without a plan."""
    name = device or costs.devices[0].name
    result = run_strategy("checkpoint_all", Problem(graph, costs, {}), name)
    assert result.simulation is not None and result.simulation.valid, result.message
    simulation = result.simulation
    return Reference(simulation.fixed_bytes[name], simulation.peak_bytes[name], simulation.total_ms)


def fixed_bytes(graph: Graph) -> int:
    """Parameters, inputs and gradient buffers held for the whole step by a device that
    computes every node (``Reference.fixed_bytes``, without planning or simulating). On
    several devices each holds its share, and the shares add up to at least this."""
    return held_fixed_bytes(graph, range(len(graph)))


def pools(devices: Sequence[Device]) -> dict[str, list[str]]:
    """The memory pools of ``devices`` (option ``pool``): pool -> its devices' names.
    ``InvalidInputError`` where a pool has a device's name (a budget by that name would
    mean either)."""
    found: dict[str, list[str]] = {}
    names = {d.name for d in devices}
    for device in devices:
        pool = device.options.get("pool")
        if pool is None:
            continue
        if pool in names:
            raise InvalidInputError(
                f"pool {pool!r} of {device.name} has the name of a device: name it otherwise"
            )
        found.setdefault(pool, []).append(device.name)
    return found


def check_budget_names(devices: Sequence[Device], names: Collection[str]) -> None:
    """``InvalidInputError`` unless each of ``names`` (budgets' keys) is a device without
    a pool or a pool, and no pool has a budget of its own and one for its devices."""
    shared = pools(devices)
    alone = [d.name for d in devices if "pool" not in d.options]
    for name in names:
        device = next((d for d in devices if d.name == name), None)
        if device is not None and "pool" in device.options:
            pool = device.options["pool"]
            raise InvalidInputError(
                f"budget for {name}, which shares pool {pool!r}: give the pool's budget "
                f"(--budget {pool}=SIZE), which holds all its devices"
            )
        if device is None and name not in shared:
            known = ", ".join(sorted(alone))
            extra = f"; pools: {', '.join(sorted(shared))}" if shared else ""
            raise InvalidInputError(f"budget for unknown device {name!r} (devices: {known}{extra})")


def resolve_budgets(
    sizes: Mapping[str, Size | None], graph: Graph, costs: CostModel
) -> dict[str, int | None]:
    """Bytes per device of ``costs``; devices without a size (or with None) are unlimited,
    and each device of a pool has the pool's (the simulator counts the pool once: see
    ``remat.simulator``). A percentage refers to the checkpoint-all peak on the first
    device (see ``Size.resolve``), computed once and only when some size is a
    percentage."""
    check_budget_names(costs.devices, sizes)
    percent = any(s is not None and s.percent is not None for s in sizes.values())
    ref = reference(graph, costs) if percent else None
    budgets: dict[str, int | None] = dict.fromkeys(d.name for d in costs.devices)
    for device in costs.devices:
        size = sizes.get(device.memory_space)
        if size is not None:
            budgets[device.name] = (
                size.resolve(0, 0) if ref is None else size.resolve(ref.fixed_bytes, ref.peak_bytes)
            )
    return budgets


def check_fixed_memory(
    graph: Graph, budgets: Mapping[str, int | None], devices: Sequence[Device]
) -> None:
    """A node's parameters, inputs and gradient buffers are on its device while it runs,
    even where a plan pages the others to storage (plan version 5): budgets that together
    hold less than the most any node needs of them admit no plan at all
    (``InvalidInputError``). Any unlimited device holds them; a pool's budget counts once."""
    if any(b is None for b in budgets.values()):
        return
    need, node = (
        max((held_fixed_bytes(graph, [node.id]), node.name) for node in graph.nodes)
        if len(graph)
        else (0, "")
    )
    spaces = {d.memory_space: budgets[d.name] for d in devices if d.name in budgets}
    total = sum(b for b in spaces.values() if b is not None)
    if total < need:
        raise InvalidInputError(
            f"the budgets ({format_bytes(total)} in all) are below the {format_bytes(need)} "
            f"that node {node!r} needs of parameters, inputs and gradients while it runs: "
            "no plan can fit, even paging the others to storage"
        )


def check_sizes(graph: Graph, devices: int, max_cost_bytes: int | None = None) -> None:
    """``InvalidInputError`` before anything large is built: a graph whose tensors add up
    to more than ``MAX_BYTES`` (no device holds it, and 64-bit byte counts would
    overflow), or a cost model on ``devices`` devices (copy times per node per ordered
    device pair, compute times per node per device, 8 bytes each) above
    ``max_cost_bytes``."""
    total = graph.param_bytes + graph.input_bytes + graph.activation_bytes
    if total > MAX_BYTES:
        raise InvalidInputError(
            f"the graph's tensors need {format_bytes(total)} at this batch size and these "
            f"input shapes: more than {format_bytes(MAX_BYTES)}, beyond any device"
        )
    need = len(graph) * (devices * devices + devices) * 8
    if max_cost_bytes is not None and need > max_cost_bytes:
        raise InvalidInputError(
            f"{len(graph)} nodes on {devices} devices need a {format_bytes(need)} cost model, "
            f"above this server's limit of {format_bytes(max_cost_bytes)}: use fewer devices"
        )
