"""From a stored model and a job spec to the library's ``Problem``: the one translation
the API (to validate a job before accepting it) and the workers (to solve it) share."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

import onnx

from app.schemas import JobSpec, ModelSummary
from remat import problem as remat_problem
from remat.costs import CostTable
from remat.devices import Device, DeviceKind
from remat.errors import InvalidInputError
from remat.graph import Graph
from remat.onnx_ingest import declared_inputs, forward_graph, load_model
from remat.problem import model_graph
from remat.shape_range import (
    ShapeRange,
    check_ranged_dims_symbolic,
    observed_counts,
    parse_input_range,
    shape_range,
)
from remat.size_estimator import table_at_size
from remat.solvers.model import SolveOptions
from remat.strategies import AUTO as AUTO  # the default: ``remat.strategies.auto``
from remat.strategies import STRATEGIES, Problem, SolverSettings


def summarize(path: Path) -> ModelSummary:
    """Validate an ONNX file with ``remat`` (a forward graph with every symbolic or unknown
    dimension 1: the batch, a sequence length) and summarise it; ``RematError`` names what
    is wrong with it."""
    model = load_model(path)
    ones = {
        name: [d if isinstance(d, int) and d > 0 else 1 for d in dims]
        for name, dims in declared_inputs(model).items()
        if dims
    }
    graph = forward_graph(model, batch=1, inputs=ones)
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


def job_range(spec: JobSpec) -> ShapeRange | None:
    """The sizes a job's ranged inputs take (None for a job of one shape)."""
    if not spec.ranges:
        return None
    items = [parse_input_range(f"{name}={text}") for name, text in spec.ranges.items()]
    return shape_range(items, observed_counts([(o.size, o.weight()) for o in spec.observed or ()]))


def at_size(spec: JobSpec, ranged: ShapeRange, size: int) -> JobSpec:
    """The job of one shape: its ranged inputs at ``size``."""
    shapes = {name: list(dims) for name, dims in ranged.shapes(size).items()}
    return spec.model_copy(
        update={"inputs": {**(spec.inputs or {}), **shapes}, "ranges": None, "observed": None}
    )


def family_problems(
    spec: JobSpec,
    path: Path | onnx.ModelProto,
    ranged: ShapeRange,
    solver: SolverSettings | None = None,
    tables: Mapping[int, CostTable] | None = None,
    max_cost_bytes: int | None = None,
) -> Callable[[int], Problem]:
    """The problem at each size of a ranged job, on its one device, every size under the
    budget in bytes that the job's budget is at the largest size (a percentage is of the
    largest size's peak); costs analytical, or from ``tables`` profiled at a few sizes
    (``table_at_size``). The largest size's problem is built here: it checks the job."""
    model = path if isinstance(path, onnx.ModelProto) else load_model(path)  # once
    check_ranged_dims_symbolic(ranged, declared_inputs(model))

    def sized_problem(sized: JobSpec, size: int) -> Problem:
        if tables is None:
            return build_problem(sized, model, solver, None, max_cost_bytes)
        graph = job_graph(sized, model)  # once: for the table's bytes and the problem
        return remat_problem.problem_from_graph(
            graph,
            devices=job_devices(sized),
            budgets=sized.budgets,
            table=table_at_size(tables, size, graph),
            solver=solver or solver_settings(sized),
            max_cost_bytes=max_cost_bytes,
        )

    largest = sized_problem(at_size(spec, ranged, ranged.high), ranged.high)
    if len(largest.costs.devices) != 1:
        names = ", ".join(d.name for d in largest.costs.devices)
        raise InvalidInputError(f"a job over ranges of sizes plans for one device; got {names}")
    budgets = {name: str(b) for name, b in largest.budgets.items() if b is not None}

    def problem_at(size: int) -> Problem:
        if size == ranged.high:
            return largest
        sized = at_size(spec, ranged, size).model_copy(update={"budgets": budgets})
        return sized_problem(sized, size)

    return problem_at


def job_graph(spec: JobSpec, path: Path | onnx.ModelProto) -> Graph:
    return model_graph(
        path,
        batch=spec.batch,
        inputs=spec.inputs,
        mode=spec.mode,
        loss=spec.loss.to_loss(),
        fuse_attention=spec.fuse_attention,
    )


def build_problem(
    spec: JobSpec,
    path: Path | onnx.ModelProto,
    solver: SolverSettings | None = None,
    table: CostTable | None = None,
    max_cost_bytes: int | None = None,
) -> Problem:
    """The job's problem (``remat.problem.build_problem``), with costs from ``table`` (a
    profile) where given, else analytical; ``InvalidInputError`` for what no plan can
    satisfy: an unknown strategy or device, a budget for an unknown device, budgets that
    cannot hold the parameters, inputs and gradients; and for a graph or cost model too
    large to build (tensors beyond any device, a cost model above ``max_cost_bytes``),
    before building it."""
    if spec.strategy != AUTO and spec.strategy not in STRATEGIES:
        known = ", ".join([AUTO, *STRATEGIES])
        raise InvalidInputError(f"unknown strategy {spec.strategy!r} (known: {known})")
    ranged = job_range(spec)
    if ranged is not None:  # a job over sizes: checked at the largest, analytical costs
        return family_problems(spec, path, ranged, solver, None, max_cost_bytes)(ranged.high)
    return remat_problem.build_problem(
        path,
        batch=spec.batch,
        inputs=spec.inputs,
        mode=spec.mode,
        loss=spec.loss.to_loss(),
        devices=job_devices(spec),
        budgets=spec.budgets,
        table=table,
        solver=solver or solver_settings(spec),
        max_cost_bytes=max_cost_bytes,
        objective=spec.objective.to_objective(),
        fuse_attention=spec.fuse_attention,
    )


def job_devices(spec: JobSpec) -> list[Device]:
    return [Device(d.name, DeviceKind(d.kind), dict(d.options)) for d in spec.devices]


def solver_settings(spec: JobSpec) -> SolverSettings:
    s = spec.solver
    options = SolveOptions(time_limit_s=s.time_limit_s, gap=s.gap, threads=s.threads)
    return SolverSettings(backend=s.backend, options=options)
