"""``remat demo``: plan a sample network with every strategy at several budgets."""

from __future__ import annotations

import time

from remat import samples
from remat.comparison import compare, format_table
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.errors import InvalidInputError
from remat.onnx_ingest import forward_graph
from remat.training import training_graph


def run_demo(model: str, batch: int) -> None:
    if model not in samples.ZOO:
        known = ", ".join(sorted(samples.ZOO))
        raise InvalidInputError(f"unknown sample model {model!r} (known: {known})")
    started = time.perf_counter()
    graph = training_graph(forward_graph(samples.ZOO[model](), batch=batch))
    costs = analytical_costs(graph, [Device("cpu0", DeviceKind.CPU, {"threads": "4"})])
    print(
        f"{model}, batch {batch}: {len(graph)} training-graph nodes, "
        f"analytical costs on cpu0 (4 threads), ideal {costs.ideal_ms():.3f} ms"
    )
    print(format_table(compare(graph, costs)))
    print(f"({time.perf_counter() - started:.1f} s)")
