"""Solver backends on Checkmate's MILP: status, incumbent, bound and gap after a fixed
time limit, per model and budget (analytical costs, one cpu0 with 4 threads).

    .venv/bin/python bench/solvers.py [--time-limit 10] [--batch 4]
"""

from __future__ import annotations

import argparse

from remat import samples
from remat.budgets import reference
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind, Size
from remat.formulations.checkmate import build_checkmate, single_device_fixed_bytes
from remat.onnx_ingest import forward_graph
from remat.solvers import runner
from remat.solvers.model import SolveOptions
from remat.training import training_graph

CPU = Device("cpu0", DeviceKind.CPU, {"threads": "4"})
CASES = (("chain", {"n": 16}, 50.0), ("vgg16", {}, 80.0), ("resnet18", {}, 60.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    print("| model (stages) | budget | backend | status | incumbent ms | bound ms | gap | s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, kwargs, percent in CASES:
        graph = training_graph(forward_graph(samples.ZOO[name](**kwargs), batch=args.batch))
        costs = analytical_costs(graph, [CPU])
        ref = reference(graph, costs)
        budget = Size(percent=percent).resolve(ref.fixed_bytes, ref.peak_bytes)
        fixed = single_device_fixed_bytes(graph)
        model = build_checkmate(graph, costs, CPU.name, budget, fixed).model
        for backend in runner.BACKENDS:
            options = SolveOptions(time_limit_s=args.time_limit, gap=1e-4, threads=2)
            r = runner.solve(model, backend=backend, options=options)
            used = r.backend if r.backend == backend else f"{backend} -> {r.backend}"
            print(
                f"| {name} ({len(graph)}) | {percent:.0f}% | {used} | {r.status.value} | "
                f"{_num(r.objective)} | {_num(r.bound)} | "
                f"{'-' if r.gap is None else f'{r.gap:.1%}'} | {r.seconds:.1f} |"
            )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
