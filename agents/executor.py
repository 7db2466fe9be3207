"""The executor: runs a plan step by step (compute, copy, free) on the node's devices and
reports what it measured next to what the simulator predicted.

Before anything runs, the plan's devices are bound to this node's devices (``DeviceError``
for one it lacks) and the plan is replayed by the simulator (``PlanRejectedError`` with its
violation): validity and peaks do not depend on times, so analytical costs suffice.

Memory. Each device holds, for the whole run, the fixed tensors the simulator's rule puts
there (``remat.simulator.held_fixed_bytes``: every parameter and input read by a node it
computes, and a gradient buffer for the fixed tensors of the backward nodes it computes),
plus the values resident on it. The measured peak of a CPU device is the executor's own
account of those bytes, taken from the tensors themselves after every step (two emulated
CPU devices share the host's memory, so the process's memory cannot tell them apart); of a
CUDA device it is ``torch.cuda.max_memory_allocated`` above the baseline before the run,
which also sees the kernels' temporary buffers.

Numerics. In training, the parameter and input gradients summed over the devices' gradient
buffers are compared with plain end-to-end autograd on the host: the error of a tensor is
``max|a - b| / max|b|`` (see ``max_relative_error``), and they match when the worst is at
most 1e-4 (fp32). In inference
the model outputs are compared with a plain forward run in the same way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch

from agents.errors import DeviceError, DeviceOutOfMemory, PlanRejectedError
from agents.program import Program, Value, build_program, value_bytes
from agents.torch_devices import Runtime, copy_runtime, gc_paused, runtime_of
from remat.costs import analytical_costs
from remat.devices import Device
from remat.graph import Graph, Mode, NodeKind
from remat.plan import Compute, Copy, Free, Plan, Step
from remat.simulator import Simulation, simulate

TOLERANCE = 1e-4


@dataclass(frozen=True)
class ExecutionReport:
    total_ms: float
    step_ms: list[float]
    peak_bytes: dict[str, int]
    predicted_total_ms: float | None
    predicted_peak_bytes: dict[str, int]
    gradients_match: bool | None  # None in inference mode
    max_rel_error: float | None  # gradients' worst relative error; None in inference
    # Inference: the model outputs against a plain forward run (not part of to_json).
    outputs_match: bool | None = None
    outputs_rel_error: float | None = None
    runs_ms: list[float] = field(default_factory=list)  # total of every measured run

    def to_json(self) -> dict[str, Any]:
        return {
            "measured": {
                "total_ms": self.total_ms,
                "peak_bytes": dict(self.peak_bytes),
                "step_ms": list(self.step_ms),
            },
            "predicted": {
                "total_ms": self.predicted_total_ms,
                "peak_bytes": dict(self.predicted_peak_bytes),
            },
            "gradients_match": self.gradients_match,
            "max_rel_error": self.max_rel_error,
        }


def execute(
    model: onnx.ModelProto,
    graph: Graph,
    plan: Plan,
    devices: Sequence[Device] | None = None,
    *,
    inputs: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    warmup: int = 1,
    repeats: int = 1,
) -> ExecutionReport:
    """Run ``plan`` (for ``graph``, built by remat from ``model``) on ``devices`` (the
    node's; None: the plan's own). ``warmup`` unmeasured runs come first; of ``repeats``
    measured runs the one with the median total is reported."""
    runtimes = bind_devices(plan, devices)
    simulation = check_plan(plan, graph)
    program = build_program(model, graph, inputs, seed)
    with gc_paused():
        runs = [_Run(program, plan, runtimes).run() for _ in range(warmup + max(repeats, 1))]
    measured = runs[warmup:]
    chosen = sorted(measured, key=lambda r: r.total_ms)[(len(measured) - 1) // 2]
    report = ExecutionReport(
        total_ms=chosen.total_ms,
        step_ms=chosen.step_ms,
        peak_bytes=chosen.peak_bytes,
        predicted_total_ms=plan.predicted.total_ms if plan.predicted is not None else None,
        predicted_peak_bytes=dict(simulation.peak_bytes),
        gradients_match=None,
        max_rel_error=None,
        runs_ms=[r.total_ms for r in measured],
    )
    if graph.mode is Mode.TRAINING:
        error = max_relative_error(chosen.gradients, program.reference_gradients())
        return _with(report, gradients_match=error <= TOLERANCE, max_rel_error=error)
    reference = program.model_output_values(program.forward_values())
    error = max_relative_error(chosen.outputs, reference)
    return _with(report, outputs_match=error <= TOLERANCE, outputs_rel_error=error)


def _with(report: ExecutionReport, **changes: Any) -> ExecutionReport:
    return ExecutionReport(**{**report.__dict__, **changes})


def bind_devices(plan: Plan, devices: Sequence[Device] | None) -> dict[str, Runtime]:
    """The plan's devices bound to this node's (by name; kinds must agree). A CPU device
    runs with the plan's thread count (what was profiled and planned), else the node's."""
    node = {d.name: d for d in devices} if devices is not None else None
    bound: dict[str, Runtime] = {}
    for planned in plan.devices:
        options = dict(planned.options)
        if node is not None:
            local = node.get(planned.name)
            if local is None:
                known = ", ".join(sorted(node)) or "none"
                raise DeviceError(
                    f"the plan names device {planned.name!r}, which this node does not have "
                    f"(its devices: {known})"
                )
            if local.kind is not planned.kind:
                raise DeviceError(
                    f"device {planned.name!r} is {local.kind.value} on this node, "
                    f"{planned.kind.value} in the plan"
                )
            options = {**local.options, **options}
        bound[planned.name] = runtime_of(Device(planned.name, planned.kind, options))
    for index, step in enumerate(plan.steps):
        for name in _step_devices(step):
            if name not in bound:
                raise DeviceError(f"plan step {index} names unknown device {name!r}")
    return bound


def _step_devices(step: Step) -> tuple[str, ...]:
    return (step.src, step.dst) if isinstance(step, Copy) else (step.device,)


def check_plan(plan: Plan, graph: Graph) -> Simulation:
    """The simulator's replay of ``plan`` under its own budgets; PlanRejectedError with the
    violation if it rejects it."""
    devices = [Device(d.name, d.kind, dict(d.options)) for d in plan.devices]
    simulation = simulate(plan, graph, analytical_costs(graph, devices))
    if simulation.violation is not None:
        raise PlanRejectedError(f"the simulator rejects the plan: {simulation.violation}")
    return simulation


def max_relative_error(
    measured: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]
) -> float:
    """The worst ``max|a - b| / max|b|`` over the reference's tensors, ``max|b|`` floored at
    ``1e-3`` of the largest reference entry overall: a gradient that is zero in exact
    arithmetic (a key bias before a softmax, a conv bias before an instance norm) holds
    rounding noise, not a scale, while a wrong tensor is still off by about its own size.
    A missing tensor or a shape mismatch is an infinite error."""
    expected = {name: t.detach().double().cpu() for name, t in reference.items()}
    scales = {name: float(t.abs().max()) if t.numel() else 0.0 for name, t in expected.items()}
    floor = 1e-3 * max(scales.values(), default=0.0)
    worst = 0.0
    for name, b in expected.items():
        got = measured.get(name)
        if got is None or tuple(got.shape) != tuple(b.shape):
            return float("inf")
        if not b.numel():
            continue
        diff = float((got.detach().double().cpu() - b).abs().max())
        scale = max(scales[name], floor)
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


@dataclass
class _Result:
    total_ms: float
    step_ms: list[float]
    peak_bytes: dict[str, int]
    gradients: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


class _Run:
    """One execution of the plan with its own fixed tensors, buffers and accounting."""

    def __init__(self, program: Program, plan: Plan, runtimes: Mapping[str, Runtime]) -> None:
        self.program = program
        self.plan = plan
        self.runtimes = runtimes
        computed: dict[str, list[int]] = {name: [] for name in runtimes}
        for step in plan.steps:
            if isinstance(step, Compute):
                computed[step.device].append(step.node)
        self.computed = computed
        self.resident: dict[str, dict[int, Value]] = {name: {} for name in runtimes}
        self.live = dict.fromkeys(runtimes, 0)
        self.accumulated: set[int] = set()  # backward nodes whose gradients are in
        self.fixed: dict[str, dict[str, torch.Tensor]] = {}
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}
        self.fixed_bytes: dict[str, int] = {}
        self.baseline: dict[str, int] = {}
        self.peaks: dict[str, int] = {}

    def run(self) -> _Result:
        try:
            self._place_fixed()
            start = time.perf_counter()
            step_ms = [self._step(index, step) for index, step in enumerate(self.plan.steps)]
            for runtime in self.runtimes.values():
                runtime.synchronize()
            total_ms = (time.perf_counter() - start) * 1e3
            peaks = {name: self._peak(name) for name in self.runtimes}
            return _Result(total_ms, step_ms, peaks, self._gradients(), self._outputs())
        finally:
            self._release()

    # --- setup and teardown --------------------------------------------------------------

    def _place_fixed(self) -> None:
        for name, runtime in self.runtimes.items():
            if runtime.is_cuda:
                runtime.synchronize()
                torch.cuda.reset_peak_memory_stats(runtime.torch_device)
                self.baseline[name] = torch.cuda.memory_allocated(runtime.torch_device)
            device = runtime.torch_device
            held = self.program.held_fixed(self.computed[name])
            # Emulated CPU devices share the host's tensors; each is accounted per device.
            self.fixed[name] = {t: self.program.fixed[t].to(device) for t in held}
            buffers = self.program.gradient_buffers(self.computed[name])
            self.buffers[name] = {
                t: torch.zeros_like(self.program.fixed[t], device=device) for t in buffers
            }
            self.fixed_bytes[name] = sum(
                value_bytes((t,))
                for t in (*self.fixed[name].values(), *self.buffers[name].values())
            )
            self.peaks[name] = self.fixed_bytes[name]

    def _release(self) -> None:
        self.resident = {name: {} for name in self.runtimes}
        self.fixed, self.buffers = {}, {}
        if any(r.is_cuda for r in self.runtimes.values()):
            torch.cuda.empty_cache()

    def _peak(self, name: str) -> int:
        runtime = self.runtimes[name]
        if runtime.is_cuda:
            return torch.cuda.max_memory_allocated(runtime.torch_device) - self.baseline[name]
        return self.peaks[name]

    # --- steps ---------------------------------------------------------------------------

    def _step(self, index: int, step: Step) -> float:
        try:
            if isinstance(step, Compute):
                ms = self._compute(step)
            elif isinstance(step, Copy):
                ms = self._copy(step)
            elif isinstance(step, Free):
                ms = self._free(step)
            else:  # the simulator accepted it, so a newer step kind this agent lacks
                raise PlanRejectedError(f"step {index}: unsupported step kind {step.op!r}")
        except torch.OutOfMemoryError as error:
            raise self._oom(index, step, error) from error
        except RuntimeError as error:
            if "can't allocate memory" not in str(error) and "out of memory" not in str(error):
                raise
            raise self._oom(index, step, error) from error
        return ms

    def _allocated(self, device: str, value: Value) -> None:
        """Account a new resident value (only allocations can raise a peak)."""
        self.live[device] += value_bytes(value)
        used = self.fixed_bytes[device] + self.live[device]
        if used > self.peaks[device]:
            self.peaks[device] = used

    def _oom(self, index: int, step: Step, error: Exception) -> DeviceOutOfMemory:
        device = step.dst if isinstance(step, Copy) else step.device
        node = self.program.graph.nodes[step.node].name
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        self._release()
        return DeviceOutOfMemory(
            f"out of memory on device {device!r} at step {index} ({step.op} of node "
            f"{node!r}): {first}"
        )

    def _compute(self, step: Compute) -> float:
        runtime = self.runtimes[step.device]
        node = self.program.graph.nodes[step.node]
        grads = None
        if node.kind is NodeKind.BACKWARD and step.node not in self.accumulated:
            # A recomputed backward node must not add its parameter gradients twice.
            self.accumulated.add(step.node)
            grads = self.buffers[step.device]
        resident = self.resident[step.device]
        value, ms = runtime.timed(
            lambda: self.program.compute(
                step.node, resident, self.fixed[step.device], grads, runtime.torch_device
            )
        )
        resident[step.node] = value
        self._allocated(step.device, value)
        return ms

    def _copy(self, step: Copy) -> float:
        src, dst = self.runtimes[step.src], self.runtimes[step.dst]
        value = self.resident[step.src][step.node]
        copied, ms = copy_runtime(src, dst).timed(
            lambda: tuple(t.to(dst.torch_device, copy=True) for t in value)
        )
        if src.is_cuda and dst.is_cuda:
            dst.synchronize()
        self.resident[step.dst][step.node] = copied
        self._allocated(step.dst, copied)
        return ms

    def _free(self, step: Free) -> float:
        start = time.perf_counter()
        value = self.resident[step.device].pop(step.node)
        self.live[step.device] -= value_bytes(value)
        del value
        return (time.perf_counter() - start) * 1e3

    # --- results -------------------------------------------------------------------------

    def _gradients(self) -> dict[str, torch.Tensor]:
        total: dict[str, torch.Tensor] = {}
        for buffers in self.buffers.values():
            for name, buffer in buffers.items():
                if name in self.program.trainable:
                    host = buffer.to("cpu")
                    total[name] = total[name] + host if name in total else host
        return total

    def _outputs(self) -> dict[str, torch.Tensor]:
        values: dict[int, Value] = {}
        for resident in self.resident.values():
            for node, value in resident.items():
                values.setdefault(node, tuple(t.to("cpu") for t in value))
        return self.program.model_output_values(values)
