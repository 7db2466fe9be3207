"""Node-by-node profiling against whole-graph passes (issue 37, "profiling what does not
fit"): on one CPU device, each model of ``bench/agent.py`` is profiled twice, in passes
(no limit) and node by node (a limit 5% above what its largest node needs alone, so that
no pass fits: ``remat.profiling_plan``), and the sums of the two tables' node times are set
side by side, with the passes' step overhead (``step_overhead_ms``, which node-by-node
tables do not measure) over all compute steps beside them.

Columns: the limit; the passes' node times summed, their step overhead summed, and the
node-by-node sum; node by node over passes (node times alone), and over passes with their
overhead (what a plan on each table would predict for checkpoint-all).

Prints a markdown table and appends rows to ``bench/results/profiling.csv``.

    .venv/bin/python bench/profiling.py [--models resnet18,vgg16,unet] [--threads 2]
        [--repeats 5] [--run LABEL]
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

from agent import _models, quietly
from results import Writer, add_run_argument

from agents.profiler import profile
from remat.costs import CostTable, analytical_costs
from remat.devices import Device, DeviceKind
from remat.graph import Graph
from remat.problem import model_graph
from remat.profiling_plan import profiling_plan
from remat.strategies import Problem
from remat.strategies.common.floor import shortfall

LIMIT_MARGIN = 1.05  # over the largest node's need alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,vgg16,unet")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    add_run_argument(parser)
    args = parser.parse_args()
    out = Writer("profiling", args.run)
    device = Device("cpu0", DeviceKind.CPU, {"threads": str(args.threads)})
    builders = _models(8, 96, 16)
    print(
        "| model (nodes) | limit MiB | passes ms | passes' overhead ms | node by node ms "
        "| node by node / passes | / passes with overhead |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        model = builders[name]()
        graph = model_graph(model)
        limit = _limit(graph, device)
        measure = partial(profile, model, graph, [device], repeats=args.repeats, warmup=2)
        passes, _ = quietly(measure, f"profiling {name} in passes")
        alone, _ = quietly(
            partial(measure, memory_bytes={"cpu0": limit}), f"profiling {name} node by node"
        )
        row = _row(name, graph, limit, passes, alone, args.threads)
        out.add(row)
        print(
            f"| {name} ({len(graph)}) | {limit / 2**20:.1f} | {row['passes_ms']:.2f} "
            f"| {row['overhead_ms']:.2f} | {row['alone_ms']:.2f} | {row['ratio']:.3f} "
            f"| {row['ratio_with_overhead']:.3f} |",
            flush=True,
        )


def _limit(graph: Graph, device: Device) -> int:
    """A limit no pass fits and every node alone does: 5% over the largest node's need."""
    problem = Problem(graph, analytical_costs(graph, [device]), {device.name: 1})
    found = shortfall(problem, [device.name], alone=True)
    assert found is not None
    limit = int(found.needs[0].total * LIMIT_MARGIN)
    assert profiling_plan(graph, device, limit) is None, "a pass fits: raise nothing"
    return limit


def _row(
    name: str, graph: Graph, limit: int, passes: CostTable, alone: CostTable, threads: int
) -> dict[str, Any]:
    passes_ms = sum(e.compute_ms["cpu0"] for e in passes.nodes.values())
    alone_ms = sum(e.compute_ms["cpu0"] for e in alone.nodes.values())
    overhead_ms = passes.devices[0].step_overhead_ms * len(graph)
    return {
        "model": name,
        "nodes": len(graph),
        "devices": f"cpu0:threads={threads}",
        "limit_bytes": limit,
        "passes_ms": passes_ms,
        "overhead_ms": overhead_ms,
        "alone_ms": alone_ms,
        "ratio": alone_ms / passes_ms,
        "ratio_with_overhead": alone_ms / (passes_ms + overhead_ms),
    }


if __name__ == "__main__":
    main()
