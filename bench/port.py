"""Paging to storage with rematerialization (PORT, section 4.2) on an edge board's CPU: one
device, ``cpu0:cpu:threads=4`` by default (analytical costs: 4 x 50 GFLOP/s, 20 GB/s, near
a 4-core Cortex-A76 board such as a Raspberry Pi 5: 154 GFLOP/s FP32 peak, 17 GB/s
LPDDR4X), paging to an SSD (1 GB/s written, 1.5 GB/s read, 100 us per page), at budgets
below the checkpoint-all peak. Each makespan is a ratio to the ideal (every node once, no
transfers).

Columns (``--strategies``, all by default): ``page_greedy`` and ``page_dynprog`` (GREEDY
and DYNPROG paging to storage), ``checkmate_milp`` (rematerialization alone), ``port``
(both, decided together) and ``auto`` (the default strategy, whose phases include
DYNPROG's paging), each with ``--time-limit`` seconds, and ``port``'s recomputations and
page transfers. After a
model's rows, the smallest budget each strategy found a plan for, among those tried.
Budgets are percentages of checkpoint-all's activations (``--budgets``: 100% is its peak,
0% its fixed memory), then of its whole peak (``--of-peak``): below the fixed memory,
``port`` pages parameters and gradients too (plan version 5), and nothing else fits.
Prints a markdown table and appends one row per model, budget and strategy to
``bench/results/port.csv``; ``bench/report.py`` renders them.

    cd bench && ../.venv/bin/python -W ignore port.py [--models torch:resnet18,vgg16,...]
        [--strategies checkmate_milp,port,auto] [--budgets 100,75,50,40,30] [--of-peak 75,50,40]
        [--storage-read 2e9 --storage-write 1e9] [--run LABEL]
"""

from __future__ import annotations

import argparse
import time

from results import Writer, add_run_argument, add_strategies_argument
from solvers import bench_budgets, bench_graph

from remat.budgets import reference
from remat.costs import analytical_costs
from remat.devices import Tier, parse_device, with_option
from remat.plan import PAGE_OPS
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SolverSettings, StrategyResult, run_strategy
from remat.strategies.heuristics.offload_dynprog import offload_dynprog
from remat.strategies.heuristics.offload_greedy import offload_greedy

MODELS = ("torch:resnet18", "vgg16", "unet", "torch:bert")
STRATEGIES = ("page_greedy", "page_dynprog", "checkmate_milp", "port", "auto")


def solve(strategy: str, problem: Problem, device: str) -> StrategyResult:
    if strategy == "page_greedy":
        return offload_greedy(problem, device, tier=Tier.STORAGE)
    if strategy == "page_dynprog":
        return offload_dynprog(problem, device, tier=Tier.STORAGE)
    return run_strategy(strategy, problem, device)


def counts(result: StrategyResult, nodes: int) -> tuple[int | None, int | None]:
    """Recomputations and page transfers of a result's plan (None without one)."""
    if result.plan is None or result.simulation is None:
        return None, None
    paged = sum(step.op in PAGE_OPS for step in result.plan.steps)
    return result.simulation.computes - nodes, paged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    add_strategies_argument(parser, STRATEGIES)
    parser.add_argument("--budgets", default="100,75,50,40,30")
    parser.add_argument(
        "--of-peak",
        default="75,50,40",
        help="more budgets, as percentages of the whole checkpoint-all peak (fixed memory "
        "included): below the fixed memory, only paging fixed tensors fits",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--device", default="cpu0:cpu:threads=4")
    parser.add_argument("--storage-bandwidth", type=float, help="B/s, both ways")
    parser.add_argument("--storage-write", type=float, help="B/s (default 1e9)")
    parser.add_argument("--storage-read", type=float, help="B/s (default 1.5e9)")
    parser.add_argument("--storage-latency-us", type=float, default=100.0)
    add_run_argument(parser)
    args = parser.parse_args()
    strategies: list[str] = args.strategies
    write = args.storage_write or args.storage_bandwidth or 1e9
    read = args.storage_read or args.storage_bandwidth or 1.5e9
    device = parse_device(args.device)
    for key, value in (
        ("storage_write_bandwidth", write),
        ("storage_read_bandwidth", read),
        ("storage_latency_us", args.storage_latency_us),
    ):
        device = with_option(device, key, f"{value:g}")
    storage = f"w {write:g} r {read:g} B/s, {args.storage_latency_us:g} us"
    out = Writer("port", args.run)
    print(
        f"| model (nodes) | budget | ideal ms | {' | '.join(strategies)} "
        "| port recomputations | port page transfers |"
    )
    print("|---|---|---|" + "---|" * (len(strategies) + 2))
    solver = SolverSettings(options=SolveOptions(time_limit_s=args.time_limit))
    for name in args.models.split(","):
        graph = bench_graph(name, args.batch)
        costs = analytical_costs(graph, [device])
        ref = reference(graph, costs, device.name)
        ideal = costs.ideal_ms(device.name)
        label = f"{name} ({len(graph)})"
        smallest: dict[str, tuple[int, str]] = {}
        budgets = bench_budgets(args.budgets, args.of_peak, ref.fixed_bytes, ref.peak_bytes)
        for where, budget in budgets:
            problem = Problem(graph, costs, {device.name: budget}, solver)
            cells: list[float | None] = []
            port_counts: tuple[int | None, int | None] = (None, None)
            for strategy in strategies:
                started = time.monotonic()
                result = solve(strategy, problem, device.name)
                seconds = time.monotonic() - started
                ok = result.feasible and result.simulation is not None
                ms = result.simulation.total_ms if ok and result.simulation else None
                recomputed, paged = counts(result, len(graph))
                if strategy == "port":
                    port_counts = (recomputed, paged)
                if ms is not None:
                    here = (budget, where)
                    smallest[strategy] = min(smallest.get(strategy, here), here)
                cells.append(ms)
                out.add(
                    {
                        "model": name,
                        "budget": where,
                        "devices": device.name,
                        "objective": ms,
                        "seconds": seconds,
                        "strategy": strategy,
                        "ideal_ms": ideal,
                        "ratio": None if ms is None else ms / ideal,
                        "recomputations": recomputed,
                        "page_transfers": paged,
                        "nodes": len(graph),
                        "batch": args.batch,
                        "budget_bytes": budget,
                        "peak_bytes": ref.peak_bytes,
                        "time_limit_s": args.time_limit,
                        "storage": storage,
                        "note": result.message[:300],
                    }
                )
            ratios = [f"{ms / ideal:.3f}" if ms is not None else "-" for ms in cells]
            extra = " | ".join("-" if c is None else str(c) for c in port_counts)
            print(
                f"| {label} | {where} | {ideal:.4g} | {' | '.join(ratios)} | {extra} |",
                flush=True,
            )
        least = [smallest[s][1] if s in smallest else "none" for s in strategies]
        print(
            f"| {label} | smallest feasible, among those tried | | {' | '.join(least)} | | |",
            flush=True,
        )


if __name__ == "__main__":
    main()
