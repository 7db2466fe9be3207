"""The time a decomposed graph's search takes to judge its stored-value choices: every
choice of ``stored_orders`` stitched from its parts' judge plans (each part's best
baseline, ``search.baseline_part``), once with a judge plan made for every part of every
choice and once with a part that several choices share planned once
(``decompose._remembered``), as ``decompose.solve_parts`` does. The plans are the same;
only the time differs.

Models in training mode on the device with the lower ideal, analytical costs in XEngine's
regime (as ``bench/solvers.py``), at the budgets given. Prints a markdown table and
appends its rows to ``bench/results/judging.csv``.

    .venv/bin/python bench/judging.py [--models onnx:densenet121,torch:gpt2_small]
        [--budgets 50,25] [--batch 4] [--run LABEL]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

from results import Writer, add_run_argument
from solvers import CPU, IGPU, _devices, bench_graph

from remat.budgets import reference
from remat.costs import analytical_costs
from remat.devices import Size
from remat.simulator import held_fixed_bytes
from remat.strategies import Problem, StrategyResult
from remat.strategies.exact import decompose
from remat.strategies.exact.search import baseline_part


def judging(problem: Problem, device: str, remember: bool) -> tuple[int, int, float]:
    """Every stored-value choice stitched from its parts' judge plans: the number of
    choices, of judge plans made, and the seconds it took."""
    graph, costs = problem.graph, problem.costs
    reserved = held_fixed_bytes(graph, range(len(graph)))
    cuts = decompose.segments(graph, costs, problem.solver.search.segment_forward_nodes)
    orders = decompose.stored_orders(graph, costs, cuts, problem.budgets[device] - reserved)
    made = 0

    def judge(part: Problem) -> StrategyResult:
        nonlocal made
        made += 1
        return baseline_part(part, device)

    planned: Callable[[Problem], StrategyResult] = judge
    if remember:
        planned = decompose._remembered(judge)
    solvers = decompose.PartSolvers(planned, planned)
    forever = time.monotonic() + 1e9
    stitch = partial(decompose._stitch, problem, "judge", device, reserved, lambda: None, forever)
    started = time.monotonic()
    choices = [stored for order in orders for stored in order]
    for stored in choices:
        stitch(solvers, decompose.parts(graph, cuts, stored))
    return len(choices), made, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="onnx:densenet121,onnx:inception_v2,torch:gpt2_small")
    parser.add_argument("--budgets", default="50,25")
    parser.add_argument("--batch", type=int, default=4)
    add_run_argument(parser)
    args = parser.parse_args()
    out = Writer("judging", args.run)
    print("| model (nodes) | budget | choices | judge plans, each part | seconds "
          "| judge plans, shared parts once | seconds | time saved |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        graph = bench_graph(name, args.batch)
        costs = analytical_costs(graph, [CPU, IGPU])
        ref = reference(graph, costs)
        (device,) = _devices(costs, "one")
        for percent in (float(p) for p in args.budgets.split(",")):
            budget = Size(percent=percent).resolve(ref.fixed_bytes, ref.peak_bytes)
            problem = Problem(graph, costs, {device: budget})
            choices, every, every_s = judging(problem, device, remember=False)
            _, once, once_s = judging(problem, device, remember=True)
            saved = 1 - once_s / every_s
            print(f"| {name} ({len(graph)}) | {percent:.0f}% | {choices} | {every} | "
                  f"{every_s:.2f} | {once} | {once_s:.2f} | {saved:.0%} |", flush=True)  # fmt: skip
            out.add(
                {
                    "model": name,
                    "nodes": len(graph),
                    "budget": f"{percent:.0f}%",
                    "choices": choices,
                    "plans_each_part": every,
                    "seconds_each_part": round(every_s, 3),
                    "plans_shared_once": once,
                    "seconds_shared_once": round(once_s, 3),
                }
            )


if __name__ == "__main__":
    main()
