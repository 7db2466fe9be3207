"""Budgets: resolving user sizes (bytes or % of the checkpoint-all peak) into bytes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from remat.costs import CostModel
from remat.devices import MAX_BYTES, Size, format_bytes
from remat.errors import InvalidInputError
from remat.graph import Graph
from remat.strategies.base import Problem
from remat.strategies.checkpoint_all import checkpoint_all


@dataclass(frozen=True)
class Reference:
    """The checkpoint-all execution on one device with unlimited memory: every node once,
    every value freed after its last use (what frameworks do by default)."""

    fixed_bytes: int
    peak_bytes: int
    total_ms: float


def reference(graph: Graph, costs: CostModel, device: str | None = None) -> Reference:
    name = device or costs.devices[0].name
    result = checkpoint_all(Problem(graph, costs, {}), name)
    assert result.simulation is not None and result.simulation.valid, result.message
    simulation = result.simulation
    return Reference(simulation.fixed_bytes[name], simulation.peak_bytes[name], simulation.total_ms)


def resolve_budgets(
    sizes: Mapping[str, Size], graph: Graph, costs: CostModel
) -> dict[str, int | None]:
    """Bytes per device; devices without a size are unlimited. A percentage refers to the
    checkpoint-all peak (see ``Size.resolve``)."""
    names = {d.name for d in costs.devices}
    unknown = sorted(set(sizes) - names)
    if unknown:
        raise InvalidInputError(
            f"budget for unknown device {unknown[0]!r} (devices: {', '.join(sorted(names))})"
        )
    ref = reference(graph, costs) if any(s.percent is not None for s in sizes.values()) else None
    budgets: dict[str, int | None] = dict.fromkeys(names)
    for name, size in sizes.items():
        if ref is None:
            budgets[name] = size.resolve(0, 0)
        else:
            budgets[name] = size.resolve(ref.fixed_bytes, ref.peak_bytes)
    return budgets


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
