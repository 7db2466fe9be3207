"""Offloading against rematerialization in Beaumont et al.'s regime (section 6): one GPU
with a PCIe-class link to its host (analytical costs: 10 TFLOP/s, 900 GB/s, 12 GB/s each
way to the host), training graphs of VGG-, ResNet- and transformer-style networks, at
budgets below the checkpoint-all peak. Every makespan is a ratio to Proposition 3's lower
bound (``max(compute, 2 (M_peak - M_GPU) / beta)``), which bounds plans that compute every
node once; rematerialization can beat it, by recomputing instead of transferring.

Columns: ``offload_greedy`` (GREEDY), ``offload_dynprog`` (DYNPROG), ``vdnn_conv`` (the
paper's competitor: every activation a convolution reads offloaded, vDNN's policy, through
the same no-wait plan), ``checkmate_milp`` (rematerialization alone, ``--time-limit``
seconds), ``offload_remat`` (both, ``--time-limit`` seconds), ``auto`` (the default
strategy, whose phases include DYNPROG and greedy eviction with offloading over its plans)
and the best of them; ``--strategies`` picks some.
Prints a markdown table and appends one row per model, budget and strategy to
``bench/results/offload.csv``; ``bench/report.py`` renders them.

    .venv/bin/python bench/offload.py [--models vgg16,resnet18,unet,transformer,...]
        [--strategies checkmate_milp,offload_remat,auto] [--budgets 90,75,50] [--batch 8]
        [--time-limit 30] [--run LABEL]
"""

from __future__ import annotations

import argparse

from results import Writer, add_run_argument, add_strategies_argument
from solvers import bench_graph

from remat.budgets import reference
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind, Size
from remat.graph import NodeKind
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SolverSettings, StrategyResult, run_strategy
from remat.strategies.common.offload import (
    OffloadBase,
    judged_plan,
    offload_base,
    offload_bound_ms,
    offload_result,
)

GPU = Device("cuda0", DeviceKind.CUDA)
MODELS = ("vgg16", "resnet18", "unet", "transformer", "torch:resnet50", "torch:bert_base")
STRATEGIES = (
    "offload_greedy",
    "offload_dynprog",
    "vdnn_conv",
    "checkmate_milp",
    "offload_remat",
    "auto",
)
CONVOLUTIONS = frozenset({"Conv", "ConvTranspose"})


def vdnn_conv(problem: Problem, base: OffloadBase) -> StrategyResult:
    """vDNN's policy: offload every activation that a convolution reads."""
    graph = problem.graph
    read_by_conv = {
        dep
        for node in graph.nodes
        if node.op in CONVOLUTIONS and node.kind is NodeKind.FORWARD
        for dep in node.deps
    }
    chosen = [v for v in base.candidates if v in read_by_conv]
    if not chosen:
        return StrategyResult("vdnn_conv", None, None, "n/a: no convolution")
    evaluation = judged_plan(problem, base, chosen, "vdnn_conv")
    if evaluation is None:
        return StrategyResult("vdnn_conv", None, None, "does not fit")
    return offload_result(problem, base, "vdnn_conv", evaluation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    add_strategies_argument(parser, STRATEGIES)
    parser.add_argument("--budgets", default="90,75,50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=30.0)
    add_run_argument(parser)
    args = parser.parse_args()
    strategies: list[str] = args.strategies
    out = Writer("offload", args.run)
    print(f"| model (nodes) | budget | bound ms | {' | '.join(strategies)} | best |")
    print("|---|---|---|" + "---|" * (len(strategies) + 1))
    solver = SolverSettings(options=SolveOptions(time_limit_s=args.time_limit))
    for name in args.models.split(","):
        graph = bench_graph(name, args.batch)
        costs = analytical_costs(graph, [GPU])
        ref = reference(graph, costs)
        for percent in (float(p) for p in args.budgets.split(",")):
            budget = Size(percent=percent).resolve(ref.fixed_bytes, ref.peak_bytes)
            problem = Problem(graph, costs, {GPU.name: budget}, solver)
            base = offload_base(problem, GPU.name)
            assert base is not None
            bound = offload_bound_ms(problem, base)
            cells = []
            for strategy in strategies:
                if strategy == "vdnn_conv":
                    result = vdnn_conv(problem, base)
                else:
                    result = run_strategy(strategy, problem, GPU.name)
                ms = result.simulation.total_ms if result.feasible and result.simulation else None
                cells.append(ms)
                out.add(
                    {
                        "model": name,
                        "budget": f"{percent:.0f}%",
                        "devices": GPU.name,
                        "objective": ms,
                        "strategy": strategy,
                        "bound_ms": bound,
                        "ratio": None if ms is None else ms / bound,
                        "nodes": len(graph),
                        "batch": args.batch,
                        "budget_bytes": budget,
                        "time_limit_s": args.time_limit,
                        "note": "" if ms is not None else result.message[:80],
                    }
                )
            found = [ms for ms in cells if ms is not None]
            ratios = [f"{ms / bound:.3f}" if ms is not None else "-" for ms in cells]
            best = f"{min(found) / bound:.3f}" if found else "-"
            print(
                f"| {name} ({len(graph)}) | {percent:.0f}% | {bound:.4g} | "
                f"{' | '.join(ratios)} | {best} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
