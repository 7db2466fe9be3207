"""One corpus model through Remat, checked against PyTorch: export, ingest, plan, then run
the plan on the agent's executor and compare its gradients with the module's autograd
(``agents.pytorch.reference``). The tests and ``bench/models.py`` take the same steps
through these functions; they differ in what they do with a failure (assert, or write the
error in a row)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx
import torch

from agents.pytorch.corpus import OPSETS, Entry, Scale
from agents.pytorch.export import Exporter, export
from agents.pytorch.reference import perturb, without_dropout
from remat.devices import Device, DeviceKind, format_bytes
from remat.graph import Graph, Mode
from remat.loss import Loss
from remat.onnx_ingest import load_model
from remat.problem import model_graph, problem_from_graph
from remat.strategies import Problem, SolverSettings, StrategyResult, run_strategy

CPU = Device("cpu0", DeviceKind.CPU, {"threads": "1"})


@dataclass(frozen=True)
class Exported:
    """A module prepared for the comparison (dropout off, parameters perturbed so that no
    two are equal), its example inputs and its export, loaded as remat loads uploads."""

    module: torch.nn.Module
    args: tuple[torch.Tensor, ...]
    model: onnx.ModelProto


def export_entry(
    entry: Entry,
    scale: Scale,
    exporter: Exporter = "torchscript",
    *,
    train: bool = True,
    opset: int | None = None,
) -> Exported:
    """``entry`` at ``scale`` exported by ``exporter`` (at its ``OPSETS`` opset unless
    given); raises what the exporter or remat's loader raises."""
    module = perturb(without_dropout(entry.module(scale)))
    args = entry.example(scale)
    torch.manual_seed(0)
    proto = export(module, args, exporter=exporter, opset=opset or OPSETS[exporter], train=train)
    return Exported(module, args, load_model(proto.SerializeToString()))


def graph_of(exported: Exported, mode: Mode, loss: Loss, fuse_attention: bool = True) -> Graph:
    return model_graph(exported.model, mode=mode, loss=loss, fuse_attention=fuse_attention)


@dataclass(frozen=True)
class Planned:
    problem: Problem
    result: StrategyResult
    budget: str  # what was planned at: checkpoint-all, the budget asked, or the midpoint


def plan_for_check(
    graph: Graph, budget: str | None, settings: SolverSettings, device: Device = CPU
) -> Planned:
    """``checkpoint_all`` when ``budget`` is None, else ``auto`` at ``budget``. Where
    ``auto`` proves ``budget`` infeasible (small models: the fixed memory and one node's
    working set can be more than half the peak), the plan is made at the midpoint between
    the least memory any schedule needs and the checkpoint-all peak instead, so that it
    still rematerialises; ``budget`` says so."""
    if budget is None:
        problem = problem_from_graph(graph, devices=[device], solver=settings)
        return Planned(
            problem, run_strategy("checkpoint_all", problem, device.name), "checkpoint-all"
        )
    problem = problem_from_graph(
        graph, devices=[device], budgets={device.name: budget}, solver=settings
    )
    result = run_strategy("auto", problem, device.name)
    if result.plan is not None or not result.min_budget_bytes:
        return Planned(problem, result, budget)
    peak = run_strategy("checkpoint_all", problem, device.name).simulation
    if peak is None:
        return Planned(problem, result, budget)
    least = result.min_budget_bytes[device.name]
    middle = (least + peak.peak_bytes[device.name]) // 2
    problem = problem_from_graph(
        graph, devices=[device], budgets={device.name: middle}, solver=settings
    )
    label = f"{format_bytes(middle)} ({budget} is under the {format_bytes(least)} floor)"
    return Planned(problem, run_strategy("auto", problem, device.name), label)
