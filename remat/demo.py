"""``remat demo``: plan a sample network with every strategy at several budgets."""

from __future__ import annotations

import time

from remat import samples
from remat.comparison import compare, format_table
from remat.devices import Device, DeviceKind
from remat.errors import InvalidInputError
from remat.problem import build_problem
from remat.solvers.model import SolveOptions
from remat.strategies import SolverSettings

DEVICE = Device("cpu0", DeviceKind.CPU, {"threads": "4"})


def run_demo(model: str, batch: int, time_limit_s: float) -> None:
    if model not in samples.ZOO:
        known = ", ".join(sorted(samples.ZOO))
        raise InvalidInputError(f"unknown sample model {model!r} (known: {known})")
    started = time.perf_counter()
    solver = SolverSettings(options=SolveOptions(time_limit_s=time_limit_s, gap=1e-3))
    problem = build_problem(samples.ZOO[model](), batch=batch, devices=[DEVICE], solver=solver)
    graph, costs = problem.graph, problem.costs
    print(
        f"{model}, batch {batch}: {len(graph)} training-graph nodes, "
        f"analytical costs on cpu0 (4 threads), ideal {costs.ideal_ms():.3f} ms; "
        f"solver time limit {time_limit_s:g} s per plan"
    )
    print(format_table(compare(graph, costs, solver=problem.solver)))
    print(f"({time.perf_counter() - started:.1f} s)")
