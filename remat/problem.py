"""One way from a model to the ``Problem`` strategies solve: ONNX -> forward graph ->
training (or inference) graph -> cost model -> budgets in bytes, with every check made on
the way. The command line (plan, max-batch, demo), the service (``app.planning``), the
benchmarks and the tests all build their problems here.

``build_problem`` starts from an ONNX model, ``problem_from_graph`` from a graph already
built (a sample, or a graph a profiler has measured); the first loads the graph and calls
the second. Every error is an ``InvalidInputError`` (or the loader's ``ModelLoadError``,
``ShapeError``) naming what is wrong:

* device names that repeat; a budget for a device that is not used; a device not in the
  cost table;
* a graph whose tensors no device could hold, or a cost model above ``max_cost_bytes``,
  before the cost model is built;
* budgets that together hold less than the fixed memory (parameters, inputs, gradient
  buffers), when every device has one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import onnx

from remat.budgets import check_budget_names, check_fixed_memory, check_sizes, resolve_budgets
from remat.costs import (
    CostModel,
    CostTable,
    Link,
    analytical_costs,
    default_link,
    profiled_costs,
)
from remat.devices import MAX_BYTES, Device, DeviceKind, Size, Tier, parse_size
from remat.errors import InvalidInputError
from remat.graph import Graph, Mode
from remat.loss import MEAN_SQUARE, Loss
from remat.objective import Objective, check_objective, with_board
from remat.onnx_ingest import forward_graph, load_model
from remat.strategies import Problem, SolverSettings
from remat.training import for_mode

DEFAULT_DEVICE = Device("cpu0", DeviceKind.CPU)

# A budget: bytes, a size as text ("208MiB", "65%", "1000"), a parsed size, or None
# (unlimited). A percentage is of the checkpoint-all peak (``remat.devices.Size``).
Budget = int | str | Size | None


def model_graph(
    model: onnx.ModelProto | str | Path,
    *,
    batch: int | None = None,
    inputs: Mapping[str, Sequence[int]] | None = None,
    mode: Mode = Mode.TRAINING,
    loss: Loss = MEAN_SQUARE,
    external_data_dir: Path | None = None,
    fuse_attention: bool = True,
) -> Graph:
    """The graph to plan for a model (a checked ``ModelProto`` or a file, loaded with
    ``load_model``; external data only from ``external_data_dir``): its forward graph at
    ``batch`` / ``inputs`` (each attention chain one node where ``fuse_attention``), made
    a training graph for ``loss`` in training ``mode``."""
    if not isinstance(model, onnx.ModelProto):
        model = load_model(model, external_data_dir=external_data_dir)
    forward = forward_graph(model, batch=batch, inputs=inputs, fuse_attention=fuse_attention)
    return for_mode(forward, mode, loss)


def build_problem(
    model: onnx.ModelProto | str | Path,
    *,
    batch: int | None = None,
    inputs: Mapping[str, Sequence[int]] | None = None,
    mode: Mode = Mode.TRAINING,
    loss: Loss = MEAN_SQUARE,
    devices: Sequence[Device] | None = None,
    budgets: Mapping[str, Budget] | None = None,
    table: CostTable | None = None,
    solver: SolverSettings | None = None,
    max_cost_bytes: int | None = None,
    external_data_dir: Path | None = None,
    check_fixed: bool = True,
    objective: Objective | None = None,
    fuse_attention: bool = True,
) -> Problem:
    """The problem of planning ``model`` (see ``model_graph``) on ``devices`` under
    ``budgets``; the rest as ``problem_from_graph``. Devices and budgets are checked
    before the model is loaded."""
    _checked_sizes(_devices(devices, table), budgets or {})
    graph = model_graph(
        model,
        batch=batch,
        inputs=inputs,
        mode=mode,
        loss=loss,
        external_data_dir=external_data_dir,
        fuse_attention=fuse_attention,
    )
    return problem_from_graph(
        graph,
        devices=devices,
        budgets=budgets,
        table=table,
        solver=solver,
        max_cost_bytes=max_cost_bytes,
        check_fixed=check_fixed,
        objective=objective,
    )


def problem_from_graph(
    graph: Graph,
    *,
    devices: Sequence[Device] | None = None,
    budgets: Mapping[str, Budget] | None = None,
    table: CostTable | None = None,
    solver: SolverSettings | None = None,
    max_cost_bytes: int | None = None,
    check_fixed: bool = True,
    objective: Objective | None = None,
) -> Problem:
    """The problem of planning ``graph`` (a training or inference graph, as ``for_mode``
    makes it) on ``devices``, whose names must be unique.

    Costs: ``table`` (a profile, keyed by ``graph``'s node names) restricted to the named
    devices, in their order, where given (all its devices when ``devices`` is None; a
    device it lacks is an error); else analytical on ``devices`` (one ``cpu0`` when None).
    Only the named devices are used: the problem's cost model has no other.

    ``budgets``: per device name, bytes, a size (``"208MiB"``, ``"65%"`` of the
    checkpoint-all peak on the first device) or None; a device without one is unlimited.
    ``max_cost_bytes`` bounds the cost model's size, checked before it is built.
    ``check_fixed``: budgets that together hold less than the fixed memory are an error
    (max-batch turns it off: there such a batch is one that does not fit, and the
    strategy says what it needs). ``objective``: what plans minimise and the power caps
    they keep (default: time), checked against the costs (``remat.objective``)."""
    names = _device_names(devices, table)
    sizes = _checked_sizes(_devices(devices, table), budgets or {})
    check_sizes(graph, len(names), max_cost_bytes)
    objective = objective or Objective()
    costs = with_board(cost_model(graph, devices, table), objective)
    check_objective(graph, costs, objective)
    resolved = resolve_budgets(sizes, graph, costs)
    if check_fixed:
        check_fixed_memory(graph, resolved, costs.devices)
    return Problem(graph, costs, resolved, solver or SolverSettings(), objective)


def cost_model(
    graph: Graph, devices: Sequence[Device] | None = None, table: CostTable | None = None
) -> CostModel:
    """``graph``'s costs on the named devices: from ``table`` restricted to them (all the
    table's devices when None), else analytical (one ``cpu0`` when None). A device's links
    to its host and to storage are the ones its options name (``host_bandwidth``,
    ``storage_*``), else the table's measurements, else the defaults."""
    names = _device_names(devices, table)
    if table is None:
        return analytical_costs(graph, list(devices or [DEFAULT_DEVICE])).pooled()
    costs = profiled_costs(graph, table.restricted(names))
    if devices is None:
        return costs

    def links(tier: Tier, measured: Mapping[str, object], option: str) -> tuple[Link, ...]:
        return tuple(
            costs.link(j, tier)
            if d.name in measured and not any(k.startswith(option) for k in d.options)
            else default_link(d, tier)
            for j, d in enumerate(devices)
        )

    pooled = tuple(
        replace(c, options={**c.options, "pool": d.options["pool"]}) if "pool" in d.options else c
        for c, d in zip(costs.devices, devices, strict=True)
    )
    return replace(
        costs,
        devices=pooled,
        host=links(Tier.HOST, table.host_links, "host_"),
        storage=links(Tier.STORAGE, table.storage_links, "storage_"),
    ).pooled()


def _device_names(devices: Sequence[Device] | None, table: CostTable | None) -> list[str]:
    """The names of the devices a problem uses, checked: unique, and in ``table``."""
    if devices is None:
        return [d.name for d in table.devices] if table is not None else [DEFAULT_DEVICE.name]
    names = [d.name for d in devices]
    if not names:
        raise InvalidInputError("no devices: name at least one")
    if len(set(names)) != len(names):
        raise InvalidInputError(f"device names must be unique: {names}")
    if table is not None:
        have = [d.name for d in table.devices]
        missing = [n for n in names if n not in have]
        if missing:
            raise InvalidInputError(
                f"device {missing[0]!r} is not in the cost table (it has: {', '.join(have)})"
            )
    return names


def _devices(devices: Sequence[Device] | None, table: CostTable | None) -> list[Device]:
    """The devices a problem uses (``_device_names``), with their options."""
    names = _device_names(devices, table)
    if devices is not None:
        return list(devices)
    if table is not None:
        return [Device(d.name, d.kind) for d in table.devices if d.name in names]
    return [DEFAULT_DEVICE]


def _checked_sizes(
    devices: Sequence[Device], budgets: Mapping[str, Budget]
) -> dict[str, Size | None]:
    """``budgets`` parsed, each for a device of ``devices`` or a pool of them."""
    check_budget_names(devices, budgets)
    return {name: _size(name, budget) for name, budget in budgets.items()}


def _size(name: str, budget: Budget) -> Size | None:
    if budget is None or isinstance(budget, Size):
        return budget
    if isinstance(budget, str):
        return parse_size(budget)
    if isinstance(budget, bool) or not 0 <= budget <= MAX_BYTES:
        raise InvalidInputError(
            f"budget for {name!r}: {budget!r} is not a number of bytes in [0, {MAX_BYTES}]"
        )
    return Size(bytes=budget)
