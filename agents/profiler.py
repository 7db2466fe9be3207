"""The profiler: a measured cost table for a graph on this node's devices (XEngine
section 3: profiling of operators and copies per device).

For every node of the graph, in node order (so every dependency's value exists: the graph
runs once, checkpoint-all, values freed after their last use) and every device:

* compute time: the node evaluated exactly as the executor evaluates it
  (``Program.compute``, backward nodes accumulating into scratch gradient buffers), ``warmup``
  unmeasured runs, then the median of ``repeats`` runs, with their interquartile range as
  dispersion (``compute_spread_ms``). CPU devices run with their thread count; CUDA is
  timed with events after synchronisation.
* copy time of its value for every ordered pair of distinct devices: the destination is
  allocated beforehand and only ``dst.copy_(src)`` is timed (allocation excluded); the
  median of the repeats.
* output bytes: what the value keeps allocated.

The result is a ``remat.costs.CostTable`` (source ``profiled``) keyed by the graph's node
names, which ``remat.costs.profiled_costs`` turns into a cost model for the same graph.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnx
import torch

from agents.errors import DeviceError
from agents.program import Program, Value, build_program, value_bytes
from agents.torch_devices import DEFAULT_THREADS, Runtime, copy_runtime, runtime_of
from remat.costs import CostSource, CostTable
from remat.devices import Device
from remat.graph import Graph, Node, NodeKind

Progress = Callable[[int, int], None]


def profile(
    model: onnx.ModelProto,
    graph: Graph,
    devices: Sequence[Device],
    *,
    repeats: int = 5,
    warmup: int = 2,
    on_progress: Progress | None = None,
) -> CostTable:
    """The cost table of ``graph`` (built by remat from ``model``) on ``devices``;
    ``on_progress(done, total)`` after each node (total: the graph's node count)."""
    if not devices:
        raise DeviceError("no devices to profile")
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise DeviceError(f"device names must be unique: {names}")
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    runtimes = [runtime_of(d) for d in devices]
    session = _Session(build_program(model, graph), runtimes, repeats, warmup)
    nodes: dict[str, dict[str, Any]] = {}
    copies: dict[str, dict[str, float]] = {}
    total = len(graph)
    if on_progress is not None:
        on_progress(0, total)
    with _gc_paused():
        for node in graph.nodes:
            nodes[node.name], copies[node.name] = session.measure(node)
            if on_progress is not None:
                on_progress(node.id + 1, total)
    return CostTable.model_validate(
        {
            "source": CostSource.PROFILED,
            "devices": [_table_device(r) for r in runtimes],
            "nodes": nodes,
            "copy_ms": copies,
        }
    )


def _table_device(runtime: Runtime) -> dict[str, Any]:
    threads = None if runtime.is_cuda else (runtime.threads or DEFAULT_THREADS)
    return {"name": runtime.name, "kind": runtime.kind, "threads": threads}


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while timing (its pauses land on random ops)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def median_and_spread(samples: Sequence[float]) -> tuple[float, float]:
    """The median and the interquartile range."""
    q25, q75 = np.percentile(samples, [25, 75])
    return float(statistics.median(samples)), float(q75 - q25)


class _Session:
    """The graph run once in node order; each node measured on every device as it comes."""

    def __init__(
        self, program: Program, runtimes: Sequence[Runtime], repeats: int, warmup: int
    ) -> None:
        self.program = program
        self.runtimes = runtimes
        self.repeats = repeats
        self.warmup = warmup
        graph = program.graph
        self.last_use = {i: max(users, default=i) for i, users in enumerate(graph.users())}
        self.host: dict[int, Value] = {}  # every value still needed, on the host
        self.on_device: dict[str, dict[int, Value]] = {r.name: {} for r in runtimes}
        everything = list(range(len(graph)))
        self.fixed = {r.name: self._place(program.fixed, r) for r in runtimes}
        buffers = program.gradient_buffers(everything)
        self.grads = {
            r.name: {t: torch.zeros_like(program.fixed[t], device=r.torch_device) for t in buffers}
            for r in runtimes
        }

    @staticmethod
    def _place(tensors: Mapping[str, torch.Tensor], runtime: Runtime) -> dict[str, torch.Tensor]:
        return {name: t.to(runtime.torch_device) for name, t in tensors.items()}

    def measure(self, node: Node) -> tuple[dict[str, Any], dict[str, float]]:
        compute, spread = {}, {}
        value: Value | None = None
        for runtime in self.runtimes:
            result, times = self._time_compute(node, runtime)
            compute[runtime.name], spread[runtime.name] = median_and_spread(times)
            if value is None:
                value = tuple(t.to("cpu") for t in result)
        assert value is not None
        self.host[node.id] = value
        copies = self._time_copies(value)
        entry = {
            "compute_ms": compute,
            "compute_spread_ms": spread,
            "output_bytes": value_bytes(value),
        }
        self._release(node)
        return entry, copies

    def _inputs(self, node: Node, runtime: Runtime) -> dict[int, Value]:
        """The values of ``node``'s dependencies on ``runtime``'s device (moved once)."""
        cache = self.on_device[runtime.name]
        for dep in node.deps:
            if dep not in cache:
                cache[dep] = tuple(t.to(runtime.torch_device) for t in self.host[dep])
        return cache

    def _time_compute(self, node: Node, runtime: Runtime) -> tuple[Value, list[float]]:
        values = self._inputs(node, runtime)
        fixed, grads = self.fixed[runtime.name], self.grads[runtime.name]
        device = runtime.torch_device
        grads_or_none = grads if node.kind is NodeKind.BACKWARD else None

        def work() -> Value:
            return self.program.compute(node.id, values, fixed, grads_or_none, device)

        times = []
        result: Value = ()
        for run in range(self.warmup + self.repeats):
            result, ms = runtime.timed(work)
            if run >= self.warmup:
                times.append(ms)
        return result, times

    def _time_copies(self, value: Value) -> dict[str, float]:
        copies: dict[str, float] = {}
        for src in self.runtimes:
            source = tuple(t.to(src.torch_device) for t in value)
            for dst in self.runtimes:
                if dst.name == src.name:
                    continue
                targets = tuple(torch.empty_like(t, device=dst.torch_device) for t in source)
                copies[f"{src.name}->{dst.name}"] = self._time_copy(src, dst, source, targets)
        return copies

    def _time_copy(self, src: Runtime, dst: Runtime, source: Value, targets: Value) -> float:
        timer = copy_runtime(src, dst)

        def work() -> None:
            for target, tensor in zip(targets, source, strict=True):
                target.copy_(tensor)
            if src.is_cuda and dst.is_cuda:
                dst.synchronize()

        times = []
        for run in range(self.warmup + self.repeats):
            _, ms = timer.timed(work)
            if run >= self.warmup:
                times.append(ms)
        return float(statistics.median(times))

    def _release(self, node: Node) -> None:
        """Forget the values no later node reads."""
        for index in {*node.deps, node.id}:
            if self.last_use[index] <= node.id:
                self.host.pop(index, None)
                for cache in self.on_device.values():
                    cache.pop(index, None)
