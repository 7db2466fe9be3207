"""PORT-M (section 4.3) on an edge board whose CPU and GPU share one memory pool: the
CPU ``cpu0:cpu:threads=4`` (analytical costs: 4 x 50 GFLOP/s, as in ``bench/port.py``) and
an integrated GPU ``gpu0:cuda:flops=1e12,bandwidth=68e9,launch_us=20`` (near a Jetson Orin
Nano's: about 1 TFLOP/s FP32, 68 GB/s LPDDR5 shared with the CPU), at budgets given as a
share of the GPU's checkpoint-all peak. Each makespan is a ratio to the ideal (every node
once on its fastest device, one at a time).

Columns, each with ``--time-limit`` seconds:

- ``checkmate_milp``: rematerialization alone, on the GPU with the pool's budget;
- ``poet``: POET's setting, one device with the pool's memory, rematerializing and paging
  to the board's SSD (1 GB/s written, 1.5 GB/s read, 100 us per page, as in
  ``bench/port.py``): ``port`` on the CPU alone and on the GPU alone, the faster of the two
  (POET minimizes energy under a runtime cap; PORT's section 5 sets the cap tight, which
  makes its plan the fastest one, and that is ``port``'s objective);
- ``xengine apart``: XEngine over the CPU and the GPU with memories of their own, the
  pool's budget split evenly between them;
- ``xengine``: XEngine on the pool (its plans compiled concurrent where they fit);
- ``port_m``: PORT-M on the pool (``remat/strategies/exact/port_m.py``), paging to the
  same SSD where its device alone does best so.

Beside them, ``poet`` over ``port_m`` (PORT's speedup over POET, section 5) and the
device ``poet`` chose. After a model's rows, the smallest budget each found a plan for,
among those tried. Budgets are percentages of the GPU's checkpoint-all activations
(``--budgets``: 100% is its peak, 0% its fixed memory), then of its whole peak
(``--of-peak``): below the pool's fixed memory, ``poet`` and ``port_m`` page parameters
and gradients too (plan version 5), and nothing else fits.
Prints a markdown table and appends one row per model, budget and column to
``bench/results/port_m.csv``; ``bench/report.py`` renders them.

    cd bench && ../.venv/bin/python -W ignore port_m.py [--models torch:resnet18,vgg16,...]
        [--budgets 100,75,50] [--of-peak 75,50,40] [--time-limit 20] [--run LABEL]
"""

from __future__ import annotations

import argparse
import time

from results import Writer, add_run_argument
from solvers import bench_budgets, bench_graph

from remat.budgets import reference
from remat.costs import analytical_costs
from remat.devices import Device, parse_device, with_option
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SolverSettings, StrategyResult, run_strategy

MODELS = ("torch:resnet18", "vgg16", "torch:bert")
CPU = "cpu0:cpu:threads=4"
GPU = "gpu0:cuda:flops=1e12,bandwidth=68e9,launch_us=20"
SSD = (("storage_write_bandwidth", 1e9), ("storage_read_bandwidth", 1.5e9))
SSD_LATENCY = ("storage_latency_us", 100.0)
COLUMNS = ("checkmate_milp", "poet", "xengine apart", "xengine", "port_m")


def with_ssd(device: Device) -> Device:
    for key, value in (*SSD, SSD_LATENCY):
        device = with_option(device, key, f"{value:g}")
    return device


def solve(column: str, pooled: Problem, apart: Problem, alone: list[Problem]) -> StrategyResult:
    if column == "checkmate_milp":
        return run_strategy(column, pooled, "gpu0")
    if column == "poet":
        return min((run_strategy("port", problem) for problem in alone), key=lambda r: r.time_ms)
    if column == "xengine apart":
        return run_strategy("xengine", apart)
    return run_strategy(column, pooled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budgets", default="100,75,50")
    parser.add_argument(
        "--of-peak",
        default="",
        help="more budgets, as percentages of the GPU's whole checkpoint-all peak (fixed "
        "memory included), e.g. 75,50,40",
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=20.0)
    add_run_argument(parser)
    args = parser.parse_args()
    pool = [with_ssd(parse_device(f"{CPU},pool=ram")), with_ssd(parse_device(f"{GPU},pool=ram"))]
    separate = [parse_device(CPU), parse_device(GPU)]
    single = [with_ssd(d) for d in separate]
    out = Writer("port_m", args.run)
    extra = ("port_m concurrent", "poet / port_m", "poet's device")
    print(f"| model (nodes) | budget | ideal ms | {' | '.join((*COLUMNS, *extra))} |")
    print("|---|---|---|" + "---|" * (len(COLUMNS) + len(extra)))
    solver = SolverSettings(options=SolveOptions(time_limit_s=args.time_limit))
    for name in args.models.split(","):
        graph = bench_graph(name, args.batch)
        costs = analytical_costs(graph, pool).pooled()
        apart_costs = analytical_costs(graph, separate)
        alone_costs = [analytical_costs(graph, [d]) for d in single]
        ref = reference(graph, costs, "gpu0")
        ideal = costs.ideal_ms()
        label = f"{name} ({len(graph)})"
        smallest: dict[str, tuple[int, str]] = {}
        budgets = bench_budgets(args.budgets, args.of_peak, ref.fixed_bytes, ref.peak_bytes)
        for where, budget in budgets:
            pooled = Problem(graph, costs, {"cpu0": budget, "gpu0": budget}, solver)
            half = budget // 2
            apart = Problem(graph, apart_costs, {"cpu0": half, "gpu0": half}, solver)
            alone = [
                Problem(graph, c, {d.name: budget}, solver)
                for c, d in zip(alone_costs, single, strict=True)
            ]
            cells: list[float | None] = []
            concurrent = poet_device = "-"
            for column in COLUMNS:
                started = time.monotonic()
                result = solve(column, pooled, apart, alone)
                seconds = time.monotonic() - started
                ms = result.simulation.total_ms if result.feasible and result.simulation else None
                if ms is not None:
                    smallest[column] = min(smallest.get(column, (budget, where)), (budget, where))
                if column == "port_m" and result.plan is not None:
                    concurrent = "yes" if result.plan.concurrent else "no"
                if column == "poet" and result.plan is not None:
                    poet_device = result.plan.devices[0].name
                cells.append(ms)
                out.add(
                    {
                        "model": name,
                        "budget": where,
                        "devices": "cpu0+gpu0",
                        "objective": ms,
                        "seconds": seconds,
                        "strategy": column,
                        "ideal_ms": ideal,
                        "ratio": None if ms is None else ms / ideal,
                        "concurrent": None if result.plan is None else result.plan.concurrent,
                        "plan_devices": (
                            None
                            if result.plan is None
                            else "+".join(sorted({d.name for d in result.plan.devices}))
                        ),
                        "nodes": len(graph),
                        "batch": args.batch,
                        "budget_bytes": budget,
                        "peak_bytes": ref.peak_bytes,
                        "time_limit_s": args.time_limit,
                        "note": result.message[:300],
                    }
                )
            ratios = [f"{ms / ideal:.3f}" if ms is not None else "-" for ms in cells]
            poet, port_m = cells[COLUMNS.index("poet")], cells[COLUMNS.index("port_m")]
            speedup = f"{poet / port_m:.3f}x" if poet is not None and port_m is not None else "-"
            print(
                f"| {label} | {where} | {ideal:.4g} | {' | '.join(ratios)} | {concurrent} "
                f"| {speedup} | {poet_device} |",
                flush=True,
            )
        least = [smallest[c][1] if c in smallest else "none" for c in COLUMNS]
        print(
            f"| {label} | smallest feasible, among those tried | | {' | '.join(least)} | | | |",
            flush=True,
        )


if __name__ == "__main__":
    main()
