"""From a stored model and a job spec to the library's ``Problem``: the one translation
the API (to validate a job before accepting it) and the workers (to solve it) share."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from app.schemas import JobSpec, ModelSummary
from remat.budgets import check_sizes, reference, resolve_budgets
from remat.costs import CostModel, CostTable, analytical_costs, profiled_costs
from remat.devices import Device, DeviceKind, format_bytes, parse_size
from remat.errors import InvalidInputError
from remat.graph import Graph
from remat.onnx_ingest import forward_graph, load_model
from remat.solvers.model import SolveOptions
from remat.strategies import STRATEGIES
from remat.strategies.base import Problem, SolverSettings
from remat.training import for_mode

AUTO = "auto"  # every applicable baseline, the cheapest wins (``remat plan`` default)


def summarize(path: Path) -> ModelSummary:
    """Validate an ONNX file with ``remat`` (a forward graph at batch 1) and summarise it;
    ``RematError`` names what is wrong with it."""
    model = load_model(path)
    graph = forward_graph(model, batch=1)
    inputs: dict[str, list[int | str]] = {}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        inputs[value.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]
    initializers = {t.name for t in model.graph.initializer}
    inputs = {name: dims for name, dims in inputs.items() if name not in initializers}
    return ModelSummary(
        nodes=len(graph),
        operators=dict(sorted(Counter(n.op for n in graph.nodes).items())),
        inputs=inputs,
        param_bytes=graph.param_bytes,
        input_bytes=graph.input_bytes,
        activation_bytes=graph.activation_bytes,
    )


def job_graph(spec: JobSpec, path: Path) -> Graph:
    forward = forward_graph(load_model(path), batch=spec.batch, inputs=spec.inputs)
    return for_mode(forward, spec.mode)


def build_problem(
    spec: JobSpec,
    path: Path,
    solver: SolverSettings | None = None,
    table: CostTable | None = None,
    max_cost_bytes: int | None = None,
) -> Problem:
    """The job's problem, with costs from ``table`` (a profile) where given, else
    analytical; ``InvalidInputError`` for what no plan can satisfy: an unknown strategy
    or device, a budget for an unknown device, budgets that cannot hold the parameters,
    inputs and gradients; and for a graph or cost model too large to build (tensors
    beyond any device, a cost model above ``max_cost_bytes``), before building it."""
    if spec.strategy != AUTO and spec.strategy not in STRATEGIES:
        known = ", ".join([AUTO, *STRATEGIES])
        raise InvalidInputError(f"unknown strategy {spec.strategy!r} (known: {known})")
    names = [d.name for d in spec.devices]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"device names must be unique: {names}")
    graph = job_graph(spec, path)
    check_sizes(graph, len(names), max_cost_bytes)
    if table is not None:
        costs = profiled_costs(graph, table.restricted(names))
    else:
        devices = [Device(d.name, DeviceKind(d.kind), dict(d.options)) for d in spec.devices]
        costs = analytical_costs(graph, devices)
    sizes = {name: parse_size(text) for name, text in spec.budgets.items()}
    budgets = resolve_budgets(sizes, graph, costs)
    _check_fixed_memory_fits(graph, budgets, costs)
    return Problem(graph, costs, budgets, solver or solver_settings(spec))


def solver_settings(spec: JobSpec) -> SolverSettings:
    s = spec.solver
    options = SolveOptions(time_limit_s=s.time_limit_s, gap=s.gap, threads=s.threads)
    return SolverSettings(backend=s.backend, options=options)


def _check_fixed_memory_fits(
    graph: Graph, budgets: dict[str, int | None], costs: CostModel
) -> None:
    """Parameters, inputs and gradient buffers live somewhere for the whole step: budgets
    that together hold less admit no plan at all."""
    if any(b is None for b in budgets.values()):
        return
    fixed = reference(graph, costs).fixed_bytes
    total = sum(b for b in budgets.values() if b is not None)
    if total < fixed:
        raise InvalidInputError(
            f"the budgets ({format_bytes(total)} in all) are below the fixed memory of "
            f"{format_bytes(fixed)} (parameters, inputs and gradients): no plan can fit"
        )
