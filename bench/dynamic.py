"""Planning for inputs whose size changes (Mimose).

1. The size estimator's error at sizes it was not fitted on.
2. At one budget in bytes over the range (``--budget``% of checkpoint-all's peak at the
   largest size), each size's plan by ``input_aware`` (Algorithm 1's selection time, its
   whole planning time with the simulator's check, its predicted time over the ideal)
   against Mimose's static baseline (the cheaper plan for the largest size, replayed at
   every size) and greedy eviction planned for each size.
3. A training run of ``--steps`` steps whose sizes are log-normal (a stand-in for the
   lengths of a text corpus's sentences: skewed to short ones, with a long tail), clipped
   to the range and padded to a multiple of ``--pad``: the total predicted time of (a) a
   static Chen-style plan for the largest size (``ap_sqrt``), (b) a static exact plan for
   it (``checkmate_milp``, ``--time-limit``), (c) ``input_aware`` with the plan cache,
   (d) an exact plan per size (``checkmate_milp``, ``--size-limit`` each); the planning
   time per new size and the cache's hit rate.

Networks: the transformer sample (pre-norm encoder layers, attention scores growing with
the square of the length) or the ResNet-18 sample (``--model resnet18``: the image side
ranges), one GPU, analytical costs. Prints markdown tables and appends rows to
``bench/results/dynamic.csv``.

    .venv/bin/python bench/dynamic.py [--model transformer|resnet18] [--range 32..512]
        [--budget 70] [--steps 500] [--median 128] [--sigma 0.6] [--pad 16] [--run LABEL]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import onnx
from results import Writer, add_run_argument

from remat import samples
from remat.budgets import reference
from remat.devices import parse_device
from remat.plan import Plan
from remat.problem import build_problem
from remat.shape_range import ShapeRange, parse_input_range, shape_range
from remat.simulator import simulate
from remat.size_estimator import fit_size_model, size_model_error
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SolverSettings, run_strategy
from remat.strategies.heuristics.input_aware import activation_layers, recomputed_layers

GPU = parse_device("cuda0:cuda")
SELECTION_REPEATS = 200


def network(args: argparse.Namespace) -> tuple[onnx.ModelProto, str]:
    """The model and its ranged input: the transformer's sequence length, or the CNN's
    image side (height and width together)."""
    if args.model == "resnet18":
        return samples.resnet18(width=16), f"input={args.batch}x3x{args.range}x{args.range}"
    model = samples.transformer_block(layers=args.layers, seq="S", d_model=64, heads=4, d_ff=256)
    return model, f"input={args.batch}x{args.range}x64"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("transformer", "resnet18"), default="transformer")
    parser.add_argument("--layers", type=int, default=12, help="the transformer's layers")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--range", default="32..512")
    parser.add_argument("--fit", help="sizes the estimator is fitted at (default: ends, middle)")
    parser.add_argument("--sizes", help="sizes of the per-size table (default: 6 over the range)")
    parser.add_argument("--budget", type=float, default=70.0, help="%% of the largest size's peak")
    parser.add_argument("--steps", type=int, default=500, help="training steps (0: skip)")
    parser.add_argument("--median", type=float, default=128.0, help="sizes' median")
    parser.add_argument("--sigma", type=float, default=0.6, help="sizes' log-normal sigma")
    parser.add_argument("--pad", type=int, default=16, help="sizes padded to a multiple")
    parser.add_argument("--time-limit", type=float, default=30.0, help="static exact plan (s)")
    parser.add_argument("--size-limit", type=float, default=5.0, help="exact plan per size (s)")
    add_run_argument(parser)
    args = parser.parse_args()
    out = Writer("dynamic", args.run)
    model, ranged_input = network(args)
    ranged = shape_range([parse_input_range(ranged_input)])
    name = args.model if args.model != "transformer" else f"transformer{args.layers}"
    low, high = ranged.low, ranged.high
    args.fit = args.fit or f"{low},{(low + high) // 2 // args.pad * args.pad},{high}"
    step = (high - low) / 6
    args.sizes = args.sizes or ",".join(str(int(low + step * k)) for k in range(1, 7))

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
            "model": name,
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
    static = min(planned, key=lambda r: r.time_ms)
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
        cells: dict[str, tuple[float | None, float | None]] = {}
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
        for strategy, (row_ratio, row_ms) in {**cells, "static": (static_ratio, None)}.items():
            out.add(
                {
                    "table": "plans",
                    "model": name,
                    "size": size,
                    "nodes": len(problem.graph),
                    "strategy": strategy,
                    "budget_bytes": budget,
                    "ratio": row_ratio,
                    "plan_ms": row_ms,
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

    if args.steps:
        training_run(args, out, name, ranged, problem_at, budget)


def training_run(
    args: argparse.Namespace,
    out: Writer,
    name: str,
    ranged: ShapeRange,
    problem_at: Callable[[int, int | None], Problem],
    budget: int,
) -> None:
    """``args.steps`` steps whose lengths are log-normal (median ``args.median``, sigma
    ``args.sigma``; a stand-in for sentence lengths, skewed to short ones with a long
    tail), clipped to the range and padded to a multiple of ``args.pad``: the total
    predicted time of each way to plan them."""
    rng = np.random.default_rng(0)
    drawn = rng.lognormal(np.log(args.median), args.sigma, args.steps)
    padded = np.ceil(np.clip(drawn, ranged.low, ranged.high) / args.pad) * args.pad
    lengths = [int(min(max(s, ranged.low), ranged.high)) for s in padded]
    distinct = sorted(set(lengths))
    at = {s: problem_at(s, budget) for s in distinct}

    def replayed(plan: Plan | None) -> dict[int, float | None]:
        """The plan's time at each size (None where it does not fit there)."""
        times: dict[int, float | None] = {}
        for size, problem in at.items():
            verdict = None if plan is None else simulate(plan, problem.graph, problem.costs)
            fits = verdict is not None and verdict.valid
            times[size] = verdict.total_ms if fits and verdict is not None else None
        return times

    def solver(seconds: float) -> SolverSettings:
        return SolverSettings(options=SolveOptions(time_limit_s=seconds))

    largest = at[distinct[-1]]
    ways: dict[str, dict[int, float | None]] = {}
    for way, strategy in (
        ("static chen (ap_sqrt)", "ap_sqrt"),
        ("static exact", "checkmate_milp"),
    ):
        timed = replace(largest, solver=solver(args.time_limit))
        ways[way] = replayed(run_strategy(strategy, timed, GPU.name).plan)
    miss_ms: list[float] = []
    cache: dict[int, float | None] = {}
    hits = 0
    for size in lengths:  # input_aware with the cache, in the order the steps come
        if size in cache:
            hits += 1
            continue
        began = time.perf_counter()
        planned = run_strategy("input_aware", at[size], GPU.name)
        miss_ms.append((time.perf_counter() - began) * 1e3)
        fits = planned.feasible and planned.simulation is not None
        cache[size] = planned.simulation.total_ms if fits and planned.simulation else None
    ways["input_aware + cache"] = cache
    exact: dict[int, float | None] = {}
    for size, problem in at.items():
        found = run_strategy("checkmate_milp", replace(problem, solver=solver(args.size_limit)))
        fits = found.feasible and found.simulation is not None
        exact[size] = found.simulation.total_ms if fits and found.simulation else None
    ways["exact per size"] = exact
    ideal = sum(at[s].costs.ideal_ms(GPU.name) for s in lengths)
    print(
        f"\n{args.steps} steps, sizes log-normal (median {args.median:g}, sigma "
        f"{args.sigma:g}) padded to {args.pad}: {len(distinct)} distinct, budget {budget} B"
    )
    print("| way | total ms | over the ideal | over exact per size | steps without a plan |")
    print("|---|---|---|---|---|")
    exact_total = _total(exact, lengths)
    for way, times in ways.items():
        total = _total(times, lengths)
        missing = sum(1 for s in lengths if times.get(s) is None)
        over_exact = (
            "-" if exact_total is None or total is None else f"{total / exact_total - 1:+.1%}"
        )
        over_ideal = "-" if total is None else f"{total / ideal - 1:+.1%}"
        shown = "-" if total is None else f"{total:.1f}"
        print(f"| {way} | {shown} | {over_ideal} | {over_exact} | {missing} |")
        out.add(
            {
                "table": "training",
                "model": name,
                "strategy": way,
                "steps": args.steps,
                "distinct": len(distinct),
                "budget_bytes": budget,
                "objective": total,
                "ideal_ms": ideal,
                "missing": missing,
            }
        )
    print(
        f"input_aware: {len(miss_ms)} misses, planning {np.median(miss_ms):.0f} ms median "
        f"(max {max(miss_ms):.0f} ms) per new size, cache hit rate {hits / len(lengths):.1%}"
    )


def _total(times: dict[int, float | None], lengths: list[int]) -> float | None:
    """The run's total time, where every step's size has a plan."""
    per_step = [times.get(s) for s in lengths]
    return None if any(t is None for t in per_step) else float(sum(t for t in per_step if t))


if __name__ == "__main__":
    main()
