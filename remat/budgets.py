"""Budgets: resolving user sizes (bytes or % of the checkpoint-all peak) into bytes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from remat.compiler import compile_plan
from remat.costs import CostModel
from remat.devices import Size
from remat.errors import InvalidInputError
from remat.graph import Graph
from remat.plan import PlanDevice
from remat.schedule import Schedule
from remat.simulator import simulate


@dataclass(frozen=True)
class Reference:
    """The checkpoint-all execution on one device with unlimited memory: every node once,
    every value freed after its last use (what frameworks do by default)."""

    fixed_bytes: int
    peak_bytes: int
    total_ms: float


def keep_all_schedule(graph: Graph, device: str) -> Schedule:
    """R = I, S = every computed value kept until no later stage reads it."""
    n = len(graph)
    last_use = np.arange(n)
    for node in graph.nodes:
        for dep in node.deps:
            last_use[dep] = max(last_use[dep], node.id)
    stages = np.arange(n)[:, None]
    S = (np.arange(n)[None, :] < stages) & (last_use[None, :] >= stages)
    return Schedule.single(device, np.eye(n, dtype=bool), S)


def reference(graph: Graph, costs: CostModel, device: str | None = None) -> Reference:
    name = device or costs.devices[0].name
    plan_device = PlanDevice.of(costs.devices[costs.device_index(name)], None)
    plan = compile_plan(graph, keep_all_schedule(graph, name), [plan_device], "reference", costs)
    result = simulate(plan, graph, costs, {})
    assert result.valid, result.violation
    return Reference(result.fixed_bytes[name], result.peak_bytes[name], result.total_ms)


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
