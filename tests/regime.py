"""XEngine's CPU/GPU regime, as ``bench/solvers.py`` measures it: a 12-thread CPU and an
integrated-GPU-like device, each faster on some operators (XEngine section 4.2), and a
problem with the same budget on each device as a percentage of the checkpoint-all peak."""

from __future__ import annotations

from collections.abc import Sequence

from remat.devices import Device, DeviceKind, Size
from remat.graph import Graph
from remat.problem import problem_from_graph
from remat.strategies import Problem, SolverSettings

CPU = Device("cpu0", DeviceKind.CPU, {"threads": "12"})
IGPU = Device("cuda0", DeviceKind.CUDA, {"flops": "2e12", "bandwidth": "60e9", "launch_us": "10"})


def budgeted(
    graph: Graph,
    percent: float,
    devices: Sequence[str] = ("cpu0", "cuda0"),
    settings: SolverSettings | None = None,
) -> Problem:
    """``graph`` with analytical costs on CPU and IGPU, ``percent`` budgets on ``devices``
    (of the checkpoint-all peak on CPU; the other device unlimited)."""
    budget = Size(percent=percent)
    return problem_from_graph(
        graph,
        devices=[CPU, IGPU],
        budgets=dict.fromkeys(devices, budget),
        solver=settings,
    )
