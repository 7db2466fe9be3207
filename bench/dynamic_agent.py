"""Plans for changing input sizes, measured on this node (Mimose): the agent's profiler
measures the transformer sample at the range's ends and middle on one CPU device; every
size's cost table takes each node's time on the polynomial through those and its bytes from
shape inference (``size_estimator.table_at_size``); ``input_aware`` plans each size under one
budget in bytes (``--budget``% of checkpoint-all's peak at the largest size), greedy
eviction where it finds none; the executor runs each plan. Per size, profiled or not:
measured against predicted (time, peak), and the interpolated table's total compute time
against a profile taken at that size.

``--profile-within-budget`` profiles the fitted sizes as the service does for a job on one
device: holding at most the budget, so under a plan that recomputes where checkpoint-all
needs more (``remat.profiling_plan``); it first prints, per fitted size, that table against
a checkpoint-all profile (total compute time, and the median of the nodes' relative
differences), then plans and runs with it.

Prints a markdown table and appends rows to ``bench/results/dynamic.csv`` (table
``measured``). Timings wait for a quiet machine (``agent.quietly``).

    .venv/bin/python bench/dynamic_agent.py [--range 32..256] [--sizes 48,96,160,224]
        [--layers 4] [--batch 8] [--budget 70] [--device cpu0:cpu:threads=2]
        [--repeats 3] [--profile-within-budget] [--run LABEL]
"""

from __future__ import annotations

import argparse
from functools import partial

import numpy as np
from agent import quietly
from results import Writer, add_run_argument

from agents.executor import execute
from agents.profiler import profile
from remat import samples
from remat.budgets import reference
from remat.costs import CostTable, profiled_costs
from remat.devices import parse_device
from remat.family import fitted_sizes
from remat.graph import Graph
from remat.onnx_ingest import forward_graph
from remat.problem import problem_from_graph
from remat.shape_range import parse_input_range, shape_range
from remat.size_estimator import table_at_size
from remat.strategies import run_strategy
from remat.training import training_graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--range", default="32..256")
    parser.add_argument("--sizes", default="48,96,160,224")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=float, default=70.0)
    parser.add_argument("--device", default="cpu0:cpu:threads=2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile-within-budget", action="store_true")
    add_run_argument(parser)
    args = parser.parse_args()
    out = Writer("dynamic", args.run)
    model = samples.transformer_block(layers=args.layers, seq="S", d_model=64, heads=4, d_ff=256)
    ranged = shape_range([parse_input_range(f"input={args.batch}x{args.range}x64")])
    device = parse_device(args.device)
    fitted = fitted_sizes(ranged)
    sizes = sorted({*fitted, *(int(s) for s in args.sizes.split(","))})
    graphs = {s: training_graph(forward_graph(model, inputs=ranged.shapes(s))) for s in sizes}

    def profiled(size: int, memory: int | None = None) -> CostTable:
        limit = None if memory is None else {device.name: memory}
        table, _ = quietly(
            lambda: profile(model, graphs[size], [device], repeats=5, warmup=2, memory_bytes=limit),
            f"profile at {size}",
        )
        return table

    high = ranged.high
    top = problem_from_graph(
        graphs[high], devices=[device], budgets={device.name: f"{args.budget:g}%"}
    )
    budget = top.budgets[device.name]
    print(f"budget {budget} B ({args.budget:g}% at size {high}) on {args.device}")
    tables = {s: profiled(s) for s in fitted}
    if args.profile_within_budget:
        within = {s: profiled(s, budget) for s in fitted}
        again = {s: profiled(s) for s in fitted}  # the noise floor of the comparison
        _compare_profiles(out, args, graphs, tables, within, again, budget)
        tables = within
    print(
        "| size | profiled | table time vs a profile | plan | predicted ms | measured ms "
        "| measured / predicted | predicted peak | measured peak |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        graph = graphs[size]
        table = table_at_size(tables, size, graph)
        problem = problem_from_graph(
            graph, devices=[device], budgets={device.name: budget}, table=table
        )
        direct = tables.get(size) or profiled(size)
        estimated = problem.costs.compute_ms.sum()
        profiled_ms = profiled_costs(graph, direct).compute_ms.sum()
        result = run_strategy("input_aware", problem, device.name)
        if not result.feasible:
            result = run_strategy("greedy_evict", problem, device.name)
        if result.plan is None or result.simulation is None:
            print(f"| {size} | no plan fits: {result.message} |")
            continue
        plan = result.plan
        run = partial(execute, model, graph, plan, [device], warmup=1, repeats=args.repeats)
        report, _ = quietly(run, f"execute at {size}")
        predicted_ms = result.simulation.total_ms
        predicted_peak = result.simulation.peak_bytes[device.name]
        measured_peak = report.peak_bytes[device.name]
        out.add(
            {
                "table": "measured",
                "model": f"transformer{args.layers}",
                "devices": args.device,
                "size": size,
                "profiled": size in tables,
                "strategy": result.strategy,
                "budget_bytes": budget,
                "table_error": estimated / profiled_ms - 1,
                "objective": predicted_ms,
                "measured_ms": report.total_ms,
                "predicted_peak": predicted_peak,
                "measured_peak": measured_peak,
            }
        )
        print(
            f"| {size} | {'yes' if size in tables else 'no'} | "
            f"{estimated / profiled_ms - 1:+.1%} | {result.strategy} | {predicted_ms:.2f} | "
            f"{report.total_ms:.2f} | {report.total_ms / predicted_ms - 1:+.1%} | "
            f"{predicted_peak} | {measured_peak} |",
            flush=True,
        )


def _compare_profiles(
    out: Writer,
    args: argparse.Namespace,
    graphs: dict[int, Graph],
    everything: dict[int, CostTable],
    within: dict[int, CostTable],
    again: dict[int, CostTable],
    budget: int,
) -> None:
    """Per fitted size: the table profiled within ``budget`` against checkpoint-all's
    (profiled before and after it: their mean), and checkpoint-all's two profiles against
    each other (what the machine's noise alone makes of the comparison)."""
    print("| size | checkpoint-all peak | total compute, within budget vs checkpoint-all "
          "| median node difference | checkpoint-all twice: total, median node |")  # fmt: skip
    print("|---|---|---|---|---|")
    for size, table in within.items():
        graph = graphs[size]
        first = profiled_costs(graph, everything[size]).compute_ms[:, 0]
        second = profiled_costs(graph, again[size]).compute_ms[:, 0]
        plain = (first + second) / 2
        planned = profiled_costs(graph, table).compute_ms[:, 0]
        peak = reference(graph, profiled_costs(graph, table)).peak_bytes
        total = planned.sum() / plain.sum() - 1
        median = float(np.median(np.abs(planned / plain - 1)))
        noise_total = second.sum() / first.sum() - 1
        noise_median = float(np.median(np.abs(second / first - 1)))
        out.add(
            {
                "table": "profiled_within_budget",
                "model": f"transformer{args.layers}",
                "devices": args.device,
                "size": size,
                "budget_bytes": budget,
                "reference_peak": peak,
                "table_error": total,
                "node_median_error": median,
                "noise_table_error": noise_total,
                "noise_node_median_error": noise_median,
            }
        )
        print(f"| {size} | {peak} ({peak / budget:.0%} of the budget) | {total:+.1%} "
              f"| {median:.1%} | {noise_total:+.1%}, {noise_median:.1%} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
