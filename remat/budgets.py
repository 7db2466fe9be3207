"""Budgets: resolving user sizes (bytes or % of the checkpoint-all peak) into bytes, and
the checks a problem's sizes and budgets must pass before anything is planned."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from remat.costs import CostModel
from remat.devices import MAX_BYTES, Size, format_bytes
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


def resolve_budgets(
    sizes: Mapping[str, Size | None], graph: Graph, costs: CostModel
) -> dict[str, int | None]:
    """Bytes per device of ``costs``; devices without a size (or with None) are unlimited.
    A percentage refers to the checkpoint-all peak on the first device (see
    ``Size.resolve``), computed once and only when some size is a percentage."""
    names = [d.name for d in costs.devices]
    unknown = sorted(set(sizes) - set(names))
    if unknown:
        raise InvalidInputError(
            f"budget for unknown device {unknown[0]!r} (devices: {', '.join(sorted(names))})"
        )
    percent = any(s is not None and s.percent is not None for s in sizes.values())
    ref = reference(graph, costs) if percent else None
    budgets: dict[str, int | None] = dict.fromkeys(names)
    for name, size in sizes.items():
        if size is not None:
            budgets[name] = (
                size.resolve(0, 0) if ref is None else size.resolve(ref.fixed_bytes, ref.peak_bytes)
            )
    return budgets


def check_fixed_memory(graph: Graph, budgets: Mapping[str, int | None]) -> None:
    """Parameters, inputs and gradient buffers live somewhere for the whole step: budgets
    that together hold less admit no plan at all (``InvalidInputError``). Any unlimited
    device holds them."""
    if any(b is None for b in budgets.values()):
        return
    fixed = fixed_bytes(graph)
    total = sum(b for b in budgets.values() if b is not None)
    if total < fixed:
        raise InvalidInputError(
            f"the budgets ({format_bytes(total)} in all) are below the fixed memory of "
            f"{format_bytes(fixed)} (parameters, inputs and gradients): no plan can fit"
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
