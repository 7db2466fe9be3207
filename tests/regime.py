"""XEngine's CPU/GPU regime, as ``bench/solvers.py`` measures it: a 12-thread CPU and an
integrated-GPU-like device, each faster on some operators (XEngine section 4.2), and a
problem with the same budget on each device as a percentage of the checkpoint-all peak;
and the same regime on two devices of one memory pool (``split_pool``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from remat import samples
from remat.devices import Device, DeviceKind, Size
from remat.graph import Graph, NodeKind
from remat.onnx_ingest import forward_graph
from remat.problem import build_problem, problem_from_graph
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SolverSettings, StrategyResult
from remat.strategies.heuristics.evict import greedy_evict
from remat.training import training_graph

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


def split_pool(devices: Sequence[Device], seconds: float) -> Problem:
    """The chain sample at 40% of its activations on ``devices`` (two of one pool), the
    first three times slower on backward nodes and the second on forward ones (as a CPU
    and a GPU that each win on some operators): the pool's ideal needs both devices."""
    solver = SolverSettings(options=SolveOptions(time_limit_s=seconds))
    problem = build_problem(
        samples.chain(batch=2), devices=list(devices), budgets={"ram": "40%"}, solver=solver
    )
    backward = np.array([node.kind is NodeKind.BACKWARD for node in problem.graph.nodes])
    compute = problem.costs.compute_ms.copy()
    compute[backward, 0] *= 3
    compute[~backward, 1] *= 3
    return replace(problem, costs=replace(problem.costs, compute_ms=compute))


def resnet18_at_half(settings: SolverSettings) -> Problem:
    """ResNet-18's training graph (batch 4) at 50% on cuda0: the interval models' tests'."""
    graph = training_graph(forward_graph(samples.resnet18(batch=4)))
    return budgeted(graph, 50, ("cuda0",), settings)


def recomputing_eviction(problem: Problem) -> StrategyResult:
    """Greedy eviction's plan on cuda0 (5 s), checked to fit and to recompute."""
    result = greedy_evict(problem, "cuda0", 5)
    assert result.feasible and result.schedule is not None
    assert result.schedule.R[0].sum() > len(problem.graph)  # it recomputes
    return result
