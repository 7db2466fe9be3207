"""Planning for inputs whose size changes (Mimose): the size estimator's error at sizes it
was not fitted on, and, at one budget in bytes over a range of sequence lengths, each
size's plan by ``input_aware`` (Algorithm 1: its selection time, its whole planning time
with the simulator's check, its predicted time over the ideal) against Mimose's static
baseline (the cheaper of the two plans for the largest size, used at every size) and
greedy eviction planned for each size.

The network is the transformer sample (pre-norm encoder layers, attention scores growing
with the square of the length) on one GPU, analytical costs. Prints markdown tables and
appends rows to ``bench/results/dynamic.csv``.

    .venv/bin/python bench/dynamic.py [--layers 12] [--range 32..512] [--fit 32,272,512]
        [--sizes 64,128,192,256,384,512] [--budget 50] [--run LABEL]
"""

from __future__ import annotations

import argparse
import time

from results import Writer, add_run_argument

from remat import samples
from remat.budgets import reference
from remat.devices import parse_device
from remat.problem import build_problem
from remat.shape_range import parse_input_range, shape_range
from remat.simulator import simulate
from remat.size_estimator import fit_size_model, size_model_error
from remat.strategies import Problem, run_strategy
from remat.strategies.heuristics.input_aware import activation_layers, recomputed_layers

GPU = parse_device("cuda0:cuda")
SELECTION_REPEATS = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--range", default="32..512")
    parser.add_argument("--fit", default="32,272,512")
    parser.add_argument("--sizes", default="64,128,192,256,384,512")
    parser.add_argument("--budget", type=float, default=50.0, help="%% of the largest size's peak")
    add_run_argument(parser)
    args = parser.parse_args()
    out = Writer("dynamic", args.run)
    model = samples.transformer_block(layers=args.layers, seq="S", d_model=64, heads=4, d_ff=256)
    ranged = shape_range([parse_input_range(f"input={args.batch}x{args.range}x64")])

    def problem_at(size: int, budget: int | None = None) -> Problem:
        budgets = None if budget is None else {GPU.name: budget}
        return build_problem(model, inputs=ranged.shapes(size), devices=[GPU], budgets=budgets)

    fitted = [int(s) for s in args.fit.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    estimator = fit_size_model({s: problem_at(s) for s in fitted})
    print(
        "| size | fitted at | bytes max error | bytes weighted | time max error | time weighted |"
    )
    print("|---|---|---|---|---|---|")
    for size in sizes:
        error = size_model_error(estimator, size, problem_at(size))
        row = {
            "table": "estimator",
            "model": f"transformer{args.layers}",
            "size": size,
            "fitted": args.fit,
            "bytes_max": error.bytes_max,
            "bytes_weighted": error.bytes_weighted,
            "ms_max": error.ms_max,
            "ms_weighted": error.ms_weighted,
        }
        out.add(row)
        print(
            f"| {size} | {args.fit} | {error.bytes_max:.2%} | {error.bytes_weighted:.2%} | "
            f"{error.ms_max:.2%} | {error.ms_weighted:.2%} |"
        )

    largest = problem_at(ranged.high)
    ref = reference(largest.graph, largest.costs, GPU.name)
    budget = ref.fixed_bytes + int((ref.peak_bytes - ref.fixed_bytes) * args.budget / 100)
    at_largest = problem_at(ranged.high, budget)
    planned = [run_strategy(s, at_largest, GPU.name) for s in ("input_aware", "greedy_evict")]
    static = min(
        planned, key=lambda r: r.simulation.total_ms if r.feasible and r.simulation else 1e300
    )
    print(f"\nbudget {budget} B ({args.budget:.0f}% at size {ranged.high}); time over the ideal")
    print(
        "| size (nodes) | input_aware | select ms | plan ms | static (largest) | greedy_evict "
        "| plan ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for size in sizes:
        problem = problem_at(size, budget)
        ideal = problem.costs.ideal_ms(GPU.name)
        layers = activation_layers(problem)
        started = time.perf_counter()
        for _ in range(SELECTION_REPEATS):
            recomputed_layers(problem.costs.output_bytes, layers, float(ref.peak_bytes))
        select_ms = (time.perf_counter() - started) / SELECTION_REPEATS * 1e3
        cells = {}
        for strategy in ("input_aware", "greedy_evict"):
            started = time.perf_counter()
            result = run_strategy(strategy, problem, GPU.name)
            plan_ms = (time.perf_counter() - started) * 1e3
            ratio = (
                result.simulation.total_ms / ideal
                if result.feasible and result.simulation
                else None
            )
            cells[strategy] = (ratio, plan_ms)
        replay = (
            None if static.plan is None else simulate(static.plan, problem.graph, problem.costs)
        )
        static_ratio = replay.total_ms / ideal if replay is not None and replay.valid else None
        for strategy, (ratio, plan_ms) in {**cells, "static": (static_ratio, None)}.items():
            out.add(
                {
                    "table": "plans",
                    "model": f"transformer{args.layers}",
                    "size": size,
                    "nodes": len(problem.graph),
                    "strategy": strategy,
                    "budget_bytes": budget,
                    "ratio": ratio,
                    "plan_ms": plan_ms,
                    "select_ms": select_ms if strategy == "input_aware" else None,
                }
            )

        def text(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        print(
            f"| {size} ({len(problem.graph)}) | {text(cells['input_aware'][0])} | "
            f"{select_ms:.3f} | {cells['input_aware'][1]:.0f} | {text(static_ratio)} | "
            f"{text(cells['greedy_evict'][0])} | {cells['greedy_evict'][1]:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
