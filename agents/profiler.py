"""The profiler: a measured cost table for a graph on this node's devices (XEngine
section 3: profiling of operators and copies per device).

Each device runs the whole graph end to end, in node order (every value freed after its
last use, as checkpoint-all does), ``warmup`` times unmeasured and then ``repeats`` times
measured, and every node is timed as the executor evaluates it (``Program.evaluator``;
backward nodes accumulate into scratch gradient buffers). A node's time on a device is the
median of its measurements, with their interquartile range as dispersion
(``compute_spread_ms``). Timing nodes inside whole passes rather than repeating one node in
isolation matters: an operator repeated alone finds its inputs, weights and code hot in the
caches and ran 30-60% faster than the same operator inside a training step (measured on
VGG/ResNet/U-Net at batch 4 on a 2-core Xeon). CPU devices run with their thread count;
CUDA is timed with events after synchronisation, in IEEE fp32 as the executor runs it
(``ieee_fp32``).

Where a device may hold less than checkpoint-all needs (``memory_bytes``, the job's budget
there, and the device's ``memory`` option, whichever is smaller), the passes follow a plan
that fits instead (``remat.profiling_plan``: recomputing as Mimose's collector does), and a
node recomputed in a pass is timed at each evaluation. Where no pass fits (a device given
less than the model's fixed tensors, in a job that splits the model over devices), the
nodes are timed one at a time there (``_Session._node_by_node``: passes in node order in
which each node's inputs and own fixed tensors are copied to the device for its timed
evaluation and its value goes to the host), which needs the most any one node needs; such
a device gets no energy pass and no step overhead. The profiler's account of the tensors
it holds on the device (fixed tensors, gradient buffers and the values resident) never
exceeds the limit: ``DeviceOutOfMemory`` if it would.

With several devices, one more pass per source device times copies: right after a node is
computed, its value is copied to every other device into a destination allocated
beforehand, timing only ``dst.copy_(src)`` (allocation excluded); the median of
``warmup + repeats`` copies after ``warmup``. Output bytes are what the values keep
allocated.

Each device's link to its host memory (offloading) is measured too: a 16 MiB buffer and a
4-byte one copied to host memory and back (CUDA: pinned host buffers, copies on the
compute stream timed with events; CPU: a copy into a fresh host buffer, the memcpy an
emulated device's transfer thread makes), the median of ``warmup + repeats`` copies after
``warmup``. The small copy's time is the latency; the bandwidth is the big buffer's bytes
over its time less the latency (``host_links``).

So is each device's link to the node's storage (paging, plan version 3), in a directory of
its own in the storage directory (``storage``), removed afterwards: buffers of
``STORAGE_SIZES`` (4 KiB to 16 MiB) each written to a file, fsync'd and dropped from the
page cache, then read back (CUDA: copied from the device into pinned host memory before the
write and back after the read, as the executor's paging lane does); each
``STORAGE_REPEATS`` times, the mean (not the median: a plan's paging time is a sum of
transfers, and fsync's slow tail is part of it). On a CPU device they run beside the
slowdown's compute probe repeating on a thread (below), since a plan overlaps its paging
with compute, which takes the cores the transfers' system calls and copies need. Each
direction's latency and bandwidth are the line through those times with the least relative
errors (``affine_fit``): a file's fixed costs (open, fsync, the page cache) grow with its
size up to a few hundred KiB, so a latency from the smallest file alone and a bandwidth from
the largest alone under-predict the mid-sized transfers that most plans page
(``storage_links``). A storage directory that cannot be written fails the profile
(``StorageError``).

On a CPU device a transfer runs on a thread beside the compute's (the executor's lanes), and
takes cores, memory bandwidth and the kernel's time from it; how much is measured for each
link (``compute_slowdown``, ``remat.costs.Link``): a compute probe (a matrix product and an
elementwise pass, about ``SLOWDOWN_PROBE_MS`` per run, with the device's threads) timed
alone and while a thread repeats the link's transfer (host: a 4 MiB memcpy, as the lane's;
storage: a 4 MiB file written, fsync'd and read back), in ``SLOWDOWN_REPEATS`` pairs of
runs (alone, then beside), the median of the pairs' ratios, at least 1. A CUDA device's
transfers run on its copy engines and DMA, beside its kernels (Beaumont et al.'s assumption
(D)): 1, not measured.

Each device with an energy counter (``agents.energy_counters``: RAPL for CPU packages,
NVML for CUDA GPUs) gets one more pass, after the others, that measures energy, since a
plan's energy is a cost a job may minimise (``remat.energy``). First its idle power: the
counter's rate over half a second of sleep, the median of three (``idle_w``, the
baseline). Then the pass follows the same steps, and each node, at its first evaluation,
runs in a loop of at least ``energy_counters.WINDOW_S`` and three runs, ``repeats`` times:
per loop, the counter's advance less the idle power over the loop's time, per run, at
least 0; the node's energy is the median (``energy_mj``, mJ, dynamic: above idle). A
single run is too short for a counter that updates every millisecond or so, hence the
loop; it runs inside the pass so that the node's inputs are the pass's own. A counter that
moves too rarely to resolve one node so (``energy_counters.resolves_nodes``: NVML's, every
100 ms, would need a second's loop per node) measures the device's pass plan instead,
after its step overhead: the executor's runs of it looped for ``energy_counters.window_s``
(a second), their dynamic energy per run split over the pass's evaluations in proportion
to their times (one power for the device's kernels: the plan's total holds, not each
operator's own draw). A loop holds one result at a time, so the pass stays within the
device's memory limit as the timed ones do. Such a device is ``energy: "measured"`` in the
table. A device without a counter gets no energy and ``energy: "model"`` (remat's power
model stands in), with the reason in ``energy_note``.

On a CUDA device the timed passes also measure each node's workspace: the allocator's
peak while the node runs, less what is allocated after it (what was before it, and its
output's new storage: cuDNN's and cuBLAS's scratch buffers, a convolution's backward above
all), the most over the passes, into the table's ``workspace_bytes``; the planners charge
it while the node runs. A CPU device's kernels are taken to hold none.

A plan's time is more than its nodes' times: the executor dispatches each step, keeps its
account, frees values, and a node's time is the median of its evaluations where a run
pays each one's. So each device ends with the executor's own runs of its pass's plan
(``agents.executor.plain_run_ms``: one unmeasured, then ``repeats``), and the median
run's time less the sum of its evaluations' times, over its compute steps, is the device's
``step_overhead_ms`` (at least 0: on a GPU, a node's time is the larger of its kernels'
and its dispatch, ``agents.torch_devices.Runtime.timed``, and the rest of the host's work
hides behind the kernels), which
``remat.costs.profiled_costs`` adds to every node's time there.

The devices of a concurrent plan's section run on threads of their own, which wait for
each other's signals; the table's ``handoff_ms`` is the host's thread hand-off (half an
event's round trip between two threads, ``thread_handoff_ms``), which the simulator
charges at each such signal. And devices of one memory pool slow each other when they
compute at once (shared cores, memory bandwidth, the interpreter's lock between kernels):
after every device's passes, each pool's devices run their pass plans at once
(``agents.executor.plain_runs_at_once``: one unmeasured round, then ``repeats``), and a
device's median run there over its median run alone is its ``concurrent_slowdown`` (at
least 1), which the simulator applies to its steps in a section on several devices. A
pool whose devices' pass plans would not fit its memory together (or one profiled node by
node) is not run at once: its devices keep 1.

The result is a ``remat.costs.CostTable`` (source ``profiled``) keyed by the graph's node
names, which ``remat.costs.profiled_costs`` turns into a cost model for the same graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from agents.energy_counters import (
    Counter,
    counter_of,
    energy_per_run_mj,
    idle_watts,
    resolves_nodes,
    window_s,
)
from agents.errors import DeviceError, DeviceOutOfMemory, StorageError, TaskError
from agents.executor import check_plan, plain_run_ms, plain_runs_at_once
from agents.program import GradientBuffers, Program, Value, build_program, value_bytes
from agents.storage import describe, read_back, resolve_storage, scratch_directory, write_through
from agents.torch_devices import (
    DEFAULT_THREADS,
    Runtime,
    check_memory,
    copy_runtime,
    is_out_of_memory,
    measuring,
    runtime_of,
)
from remat.costs import (
    MAX_COMPUTE_SLOWDOWN,
    MAX_CONCURRENT_SLOWDOWN,
    MAX_LINK_BYTES_PER_S,
    CostSource,
    CostTable,
)
from remat.devices import Device
from remat.errors import RematError
from remat.graph import Graph, Node, NodeKind
from remat.plan import Compute, Free, Plan
from remat.profiling_plan import profiling_plan

Progress = Callable[[int, int], None]
PROGRESS_INTERVAL_S = 0.25


def profile(
    model: onnx.ModelProto,
    graph: Graph,
    devices: Sequence[Device],
    *,
    repeats: int = 5,
    warmup: int = 2,
    on_progress: Progress | None = None,
    memory_bytes: Mapping[str, int] | None = None,
    energy_counters: Mapping[str, Counter | None] | None = None,
    storage: str | Path | None = None,
) -> CostTable:
    """The cost table of ``graph`` (built by remat from ``model``) on ``devices``.

    ``memory_bytes``: per device name, the most the profiler may hold there (e.g. the
    job's budget); a device's ``memory`` option limits it too. ``on_progress(done,
    total)`` counts node evaluations over all passes (the energy pass too); it is called
    at the start, at most every ``PROGRESS_INTERVAL_S`` while profiling, and at the end.
    ``energy_counters``: per device name, the counter to measure energy with (None: no
    energy there); a device it does not name gets ``counter_for``'s (``counter_of``).
    ``storage``: the node's storage directory, whose link each device pages over is
    measured (None: ``agents.storage.resolve_storage``'s default)."""
    if not devices:
        raise DeviceError("no devices to profile")
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise DeviceError(f"device names must be unique: {names}")
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    runtimes = [_limited(runtime_of(d), (memory_bytes or {}).get(d.name)) for d in devices]
    passes = [_pass_plan(graph, d, r.memory_bytes) for d, r in zip(devices, runtimes, strict=True)]
    counters = [counter_of(r, energy_counters) for r in runtimes]
    directory = resolve_storage(storage)
    program = build_program(model, graph)
    pools: dict[str, list[str]] = {}
    for device in devices:
        pools.setdefault(device.memory_space, []).append(device.name)
    shared = [
        names
        for names in pools.values()
        if len(names) > 1 and _fit_at_once(graph, names, runtimes, passes)
    ]
    session = _Session(program, runtimes, passes, repeats, warmup, on_progress, counters, shared)
    with measuring():
        session.run()
    return CostTable.model_validate(
        {
            "source": CostSource.PROFILED,
            "devices": [session.table_device(r) for r in runtimes],
            "nodes": {node.name: session.entry(node) for node in graph.nodes},
            "copy_ms": {node.name: session.copies[node.id] for node in graph.nodes},
            "host_links": {
                r.name: host_link(r, warmup, repeats) | slowdown(r, _host_copy) for r in runtimes
            },
            "storage_links": {
                r.name: storage_link(r, directory) | slowdown(r, partial(_paged, directory))
                for r in runtimes
            },
            "handoff_ms": thread_handoff_ms(repeats=max(100, 20 * repeats)),
            "graph": graph.fingerprint.digest,
        }
    )


def _fit_at_once(
    graph: Graph, names: Sequence[str], runtimes: Sequence[Runtime], passes: Sequence[Plan | None]
) -> bool:
    """Whether the pass plans of a pool's devices (``names``) may run at once: each device
    has one, and their peaks together are within the least memory limit among them (the
    pool's memory holds them all)."""
    plans = {r.name: (r, p) for r, p in zip(runtimes, passes, strict=True) if r.name in names}
    if any(plan is None for _, plan in plans.values()):
        return False
    limits = [r.memory_bytes for r, _ in plans.values() if r.memory_bytes is not None]
    if not limits:
        return True
    peaks = sum(
        max(check_plan(plan, graph).peak_bytes.values())
        for _, plan in plans.values()
        if plan is not None
    )
    return peaks <= min(limits)


def thread_handoff_ms(repeats: int) -> float:
    """The host's thread hand-off (``remat.costs.CostModel.handoff_ms``): the median of
    ``repeats`` round trips of an event between two threads (after ten unmeasured), halved.
    A concurrent plan's section waits so at each signal between its devices' threads."""
    ping, pong = threading.Event(), threading.Event()
    rounds = 10 + repeats

    def answer() -> None:
        for _ in range(rounds):
            ping.wait()
            ping.clear()
            pong.set()

    other = threading.Thread(target=answer, name="remat-handoff", daemon=True)
    other.start()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        ping.set()
        pong.wait()
        pong.clear()
        times.append(time.perf_counter() - start)
    other.join()
    return statistics.median(times[10:]) / 2 * 1e3


def _limited(runtime: Runtime, limit: int | None) -> Runtime:
    """``runtime`` holding at most ``limit`` bytes too (None: as it is)."""
    if limit is None or (runtime.memory_bytes is not None and runtime.memory_bytes <= limit):
        return runtime
    return dataclasses.replace(runtime, memory_bytes=limit)


# A pass: nodes to compute in order, each with the values to free right after it.
PassSteps = list[tuple[int, tuple[int, ...]]]


def _pass_plan(graph: Graph, device: Device, limit: int | None) -> Plan | None:
    """A pass on ``device`` within ``limit`` bytes: checkpoint-all's, or a plan's that
    recomputes (``remat.profiling_plan``); None where no pass fits but every node alone
    does (``_Session._node_by_node``); TaskError where some node does not."""
    try:
        return profiling_plan(graph, device, limit)
    except RematError as error:
        raise TaskError(str(error)) from None


def _pass_steps(plan: Plan | None, graph: Graph) -> PassSteps:
    """``plan``'s computes in order, each with the values freed after it (None: every
    node in order, each evaluated alone)."""
    if plan is None:
        return [(node.id, ()) for node in graph.nodes]
    steps: PassSteps = []
    for step in plan.steps:
        if isinstance(step, Compute):
            steps.append((step.node, ()))
        elif isinstance(step, Free) and steps:
            node, frees = steps[-1]
            steps[-1] = (node, (*frees, step.node))
    return steps


NODE_BY_NODE_ENERGY = "not measured: no pass fits this device's memory, its nodes were timed alone"
HOST_LINK_BYTES = 16 << 20


def host_link(runtime: Runtime, warmup: int, repeats: int) -> dict[str, float]:
    """The measured link between ``runtime``'s device and host memory, both directions
    (the module docstring), as a cost table's ``host_links`` entry."""
    device = runtime.torch_device
    pinned = runtime.is_cuda

    def median_ms(nbytes: int, to_host: bool) -> float:
        count = max(nbytes // 4, 1)
        on_device = torch.ones(count, dtype=torch.float32, device=device)
        on_host = torch.empty(count, dtype=torch.float32, pin_memory=pinned)
        source, target = (on_device, on_host) if to_host else (on_host, on_device)
        times = []
        for run in range(warmup + repeats):
            _, ms = runtime.timed(lambda: target.copy_(source, non_blocking=pinned))
            if run >= warmup:
                times.append(ms)
        return float(statistics.median(times))

    link: dict[str, float] = {}
    latencies = []
    for key, to_host in (("to_host_bytes_per_s", True), ("from_host_bytes_per_s", False)):
        small, big = median_ms(4, to_host), median_ms(HOST_LINK_BYTES, to_host)
        latencies.append(small)
        seconds = max(big - small, big / 2, 1e-6) / 1e3
        link[key] = min(HOST_LINK_BYTES / seconds, MAX_LINK_BYTES_PER_S)
    link["latency_us"] = float(statistics.mean(latencies)) * 1e3
    return link


STORAGE_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 16 << 20)
STORAGE_REPEATS = 5


def storage_link(runtime: Runtime, storage: Path) -> dict[str, float]:
    """The measured link between ``runtime``'s device and the node's storage in
    ``storage``, both directions (the module docstring), as a cost table's
    ``storage_links`` entry; ``StorageError`` where the files cannot be written or read."""
    device = runtime.torch_device

    def mean_ms(nbytes: int, path: Path) -> tuple[float, float]:
        """The mean times of writing ``nbytes`` from the device and reading them back."""
        on_device = torch.ones(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=runtime.is_cuda)
        view = [host.numpy().data]

        def write() -> None:
            if runtime.is_cuda:
                host.copy_(on_device)
            write_through(path, view)

        def read() -> None:
            read_back(path, view)
            if runtime.is_cuda:
                on_device.copy_(host)

        writes, reads = [], []
        for _ in range(STORAGE_REPEATS):
            writes.append(_wall_ms(runtime, write))
            reads.append(_wall_ms(runtime, read))
        return float(statistics.mean(writes)), float(statistics.mean(reads))

    # A CPU device's transfers run beside its compute, which takes the cores their system
    # calls and copies need: measured so, as the plans overlap them.
    beside = (
        contextlib.nullcontext()
        if runtime.is_cuda
        else _running(partial(_computing, _compute_probe(runtime)))
    )
    try:
        with scratch_directory(storage, "profile-") as directory, beside:
            times = [mean_ms(n, directory / f"probe-{n}") for n in STORAGE_SIZES]
    except OSError as error:
        raise StorageError(
            f"measuring the storage {storage} for {runtime.name} failed: {describe(error)}"
        ) from None
    write_ms, write_rate = affine_fit(STORAGE_SIZES, [w for w, _ in times])
    read_ms, read_rate = affine_fit(STORAGE_SIZES, [r for _, r in times])
    return {
        "write_bytes_per_s": write_rate,
        "read_bytes_per_s": read_rate,
        "write_latency_us": write_ms * 1e3,
        "read_latency_us": read_ms * 1e3,
    }


def affine_fit(sizes: Sequence[int], ms: Sequence[float]) -> tuple[float, float]:
    """The latency (ms, at least 0) and bandwidth (B/s, at most ``MAX_LINK_BYTES_PER_S``)
    of the line ``latency + bytes / bandwidth`` nearest to transfers of ``sizes`` bytes
    taking ``ms``, by least squares of the relative errors, so that small and large
    transfers are predicted equally well rather than the largest alone."""
    n = np.asarray(sizes, dtype=float)
    t = np.maximum(np.asarray(ms, dtype=float), 1e-6)
    rows = np.stack([1 / t, n / t], axis=1)
    (latency, per_byte), *_ = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)
    if latency < 0:  # a line through the origin instead
        latency, per_byte = 0.0, float(np.sum(n / t) / np.sum((n / t) ** 2))
    rate = 1e3 / per_byte if per_byte > 0 else MAX_LINK_BYTES_PER_S
    return float(latency), float(min(rate, MAX_LINK_BYTES_PER_S))


SLOWDOWN_PROBE_MS = 10.0
SLOWDOWN_REPEATS = 5
SLOWDOWN_LOAD_BYTES = 4 << 20


Load = Callable[[threading.Event, threading.Event], None]
"""A link's transfer repeated on a thread: ``load(ready, stop)`` sets ``ready`` once set up,
just before its first transfer, and repeats until ``stop`` is set."""


def slowdown(runtime: Runtime, load: Load) -> dict[str, float]:
    """``runtime``'s compute slowdown while ``load`` runs on a thread beside it (the module
    docstring), as a link entry's ``compute_slowdown``. Nothing on CUDA (1 by default)."""
    if runtime.is_cuda:
        return {}
    probe = _compute_probe(runtime)

    def beside() -> float:
        with _running(load):
            return _wall_ms(runtime, probe)

    # In pairs, alone then beside, so that the machine's other work drifting between the
    # runs weighs on both sides of each ratio alike.
    ratios = [beside() / max(_wall_ms(runtime, probe), 1e-6) for _ in range(SLOWDOWN_REPEATS)]
    return {"compute_slowdown": min(max(statistics.median(ratios), 1.0), MAX_COMPUTE_SLOWDOWN)}


def _compute_probe(runtime: Runtime) -> Callable[[], None]:
    """A compute probe on ``runtime``'s device: a matrix product and an elementwise pass,
    repeated to about ``SLOWDOWN_PROBE_MS``."""
    device = runtime.torch_device
    matrix = torch.rand(256, 256, device=device)
    vector = torch.rand(1 << 20, device=device)

    def once() -> None:
        matrix @ matrix
        vector.mul_(1.0)

    runs = max(1, round(SLOWDOWN_PROBE_MS / max(_wall_ms(runtime, once), 1e-3)))

    def probe() -> None:
        for _ in range(runs):
            once()

    return probe


@contextlib.contextmanager
def _running(load: Load) -> Iterator[None]:
    """``load`` repeating on a thread of its own for the block, which starts once it is set
    up."""
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=load, args=(ready, stop), name="remat-profile-lane")
    thread.start()
    try:
        ready.wait()
        yield
    finally:
        stop.set()
        thread.join()


def _computing(probe: Callable[[], None], ready: threading.Event, stop: threading.Event) -> None:
    """The compute lane's work, repeated: ``probe`` until ``stop`` is set."""
    ready.set()
    while not stop.is_set():
        probe()


def _host_copy(ready: threading.Event, stop: threading.Event) -> None:
    """The host lane's transfer on a CPU device, repeated: one thread's memcpy."""
    source = np.ones(SLOWDOWN_LOAD_BYTES, dtype=np.uint8)
    ready.set()
    while not stop.is_set():
        source.copy()


def _paged(storage: Path, ready: threading.Event, stop: threading.Event) -> None:
    """The paging lane's transfer, repeated: a file written, fsync'd and read back (until
    a write fails: ``storage_link`` has reported the storage usable just before)."""
    buffer = [np.ones(SLOWDOWN_LOAD_BYTES, dtype=np.uint8).data]
    try:
        with scratch_directory(storage, "profile-") as directory, contextlib.suppress(OSError):
            ready.set()
            while not stop.is_set():
                write_through(directory / "load", buffer)
                read_back(directory / "load", buffer)
    finally:
        ready.set()  # also where the directory could not be made: the probe runs alone


def _wall_ms(runtime: Runtime, work: Callable[[], None]) -> float:
    """``work``'s wall-clock time on ``runtime``'s device, synchronised before and after:
    the file's part runs on the host, which a device's events would not see."""
    runtime.activate()
    runtime.synchronize()
    start = time.perf_counter()
    work()
    runtime.synchronize()
    return (time.perf_counter() - start) * 1e3


def _with_workspace(runtime: Runtime, compute: Callable[[], Value]) -> tuple[Value, float, int]:
    """``compute`` timed on a CUDA device, with the scratch memory its kernels held: the
    allocator's peak during the call less what is allocated after it (what was before it,
    and the output's new storage: an output that shares an input's has none)."""
    device = runtime.torch_device
    torch.cuda.reset_peak_memory_stats(device)
    value, ms = runtime.timed(compute)
    peak = torch.cuda.max_memory_allocated(device)
    return value, ms, max(0, peak - torch.cuda.memory_allocated(device))


@contextlib.contextmanager
def _device_memory(runtime: Runtime, doing: str) -> Iterator[None]:
    """A device's own out-of-memory error inside as ``DeviceOutOfMemory``, saying what the
    profiler was ``doing``."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        raise DeviceOutOfMemory(
            f"out of memory on device {runtime.name!r} {doing}: {_first_line(error)}"
        ) from error


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def median_and_spread(samples: Sequence[float]) -> tuple[float, float]:
    """The median and the interquartile range."""
    q25, q75 = np.percentile(samples, [25, 75])
    return float(statistics.median(samples)), float(q75 - q25)


@dataclasses.dataclass(frozen=True)
class _EnergyProbe:
    """An energy pass's counter, the device's idle power, and per node the mJ per run."""

    counter: Counter
    idle_w: float
    samples: list[list[float]]


class _Session:
    """Whole-graph passes per device, each node timed as it comes."""

    def __init__(
        self,
        program: Program,
        runtimes: Sequence[Runtime],
        passes: Sequence[Plan | None],
        repeats: int,
        warmup: int,
        on_progress: Progress | None,
        counters: Sequence[tuple[Counter | None, str]] | None = None,
        pools: Sequence[Sequence[str]] = (),
    ) -> None:
        self.program = program
        # the devices of each memory pool of several whose pass plans also run at once
        # (``_concurrent_slowdown``; ``_fit_at_once``)
        self.pools = [list(p) for p in pools]
        self.runtimes = runtimes
        self.passes = passes
        self.steps = [_pass_steps(plan, program.graph) for plan in passes]
        self.repeats = repeats
        self.warmup = warmup
        self.on_progress = on_progress
        n = len(program.graph)
        self.times: dict[str, list[list[float]]] = {
            r.name: [[] for _ in range(n)] for r in runtimes
        }
        self.copies: dict[int, dict[str, float]] = {i: {} for i in range(n)}
        self.output_bytes = [0] * n
        # per CUDA device, per node: the most scratch memory its kernel held in a timed pass
        self.workspace: dict[str, dict[int, int]] = {}
        copy_passes = 1 if len(runtimes) > 1 else 0
        # the timed passes, the copies' and the executor's runs (``_step_overhead``); node
        # by node, each node's timed evaluations and its copies
        runs = warmup + repeats + copy_passes
        self.total = sum(
            len(steps) * (runs if plan is None else runs + 1 + repeats)
            for plan, steps in zip(passes, self.steps, strict=True)
        )
        # Per device: its energy counter, or None and why (``_counter``); node by node, none.
        self.counters = dict(
            zip((r.name for r in runtimes), counters or [(None, "")] * len(runtimes), strict=True)
        )
        for runtime, plan in zip(runtimes, passes, strict=True):
            if plan is None:
                self.counters[runtime.name] = (None, NODE_BY_NODE_ENERGY)
        self.total += sum(
            len(steps)
            for r, steps in zip(runtimes, self.steps, strict=True)
            if self.counters[r.name][0] is not None
        )
        self.idle_w: dict[str, float] = {}
        self.energy: dict[str, list[list[float]]] = {}  # per device, per node: mJ per run
        self.step_overhead_ms: dict[str, float] = {}  # per device (``_step_overhead``)
        self.alone_ms: dict[str, float] = {}  # per device: its pass plan's median run
        self.concurrent_slowdown: dict[str, float] = {}  # per pooled device
        steps_of = dict(zip((r.name for r in runtimes), self.steps, strict=True))
        self.total += sum(
            (1 + repeats) * sum(len(steps_of[n]) for n in names) for names in self.pools
        )
        self.done = 0
        self.reported_at = 0.0

    def run(self) -> None:
        self._report(force=True)
        for runtime, plan, steps in zip(self.runtimes, self.passes, self.steps, strict=True):
            if plan is None:
                self._node_by_node(runtime)
                continue
            doing = "placing the parameters, inputs and gradient buffers to profile"
            with _device_memory(runtime, doing):
                fixed = {n: t.to(runtime.torch_device) for n, t in self.program.fixed.items()}
                everything = range(len(self.program.graph))
                grads = GradientBuffers.allocate(
                    self.program.gradient_buffers(everything),
                    self.program.fixed,
                    runtime.torch_device,
                )
                held = value_bytes((*fixed.values(), *grads.values()))
                check_memory(runtime, held)
            for index in range(self.warmup + self.repeats):
                record = self.times[runtime.name] if index >= self.warmup else None
                self._pass(runtime, steps, held, fixed, grads, record, copies=False)
            if len(self.runtimes) > 1:
                self._pass(runtime, steps, held, fixed, grads, None, copies=True)
            counter = self.counters[runtime.name][0]
            if counter is not None and resolves_nodes(counter):
                runtime.activate()
                runtime.synchronize()
                idle = self.idle_w[runtime.name] = idle_watts(counter)
                samples: list[list[float]] = [[] for _ in range(len(self.program.graph))]
                probe = _EnergyProbe(counter, idle, samples)
                self._pass(runtime, steps, held, fixed, grads, None, copies=False, energy=probe)
                self.energy[runtime.name] = samples
            del fixed, grads
            self.step_overhead_ms[runtime.name] = self._step_overhead(runtime, plan, steps)
            if counter is not None and not resolves_nodes(counter):
                self.energy[runtime.name] = self._pass_energy(runtime, plan, steps, counter)
        for names in self.pools:
            self._concurrent_slowdown(names)
        self._report(force=True)

    def _concurrent_slowdown(self, names: Sequence[str]) -> None:
        """How much longer each device of a pool (``names``) runs its pass plan while the
        others run theirs at once (the module docstring): after one unmeasured round, the
        median of ``repeats`` over its median run alone; at least 1."""
        runtimes = {r.name: r for r in self.runtimes if r.name in names}
        plans = {
            r.name: plan
            for r, plan in zip(self.runtimes, self.passes, strict=True)
            if r.name in names and plan is not None
        }
        steps = dict(zip((r.name for r in self.runtimes), self.steps, strict=True))
        runs: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(1 + self.repeats):
            measured = plain_runs_at_once(self.program, plans, runtimes)
            if round_:
                for name, ms in measured.items():
                    runs[name].append(ms)
            self.done += sum(len(steps[name]) for name in names)
            self._report()
        for name in names:
            ratio = statistics.median(runs[name]) / max(self.alone_ms[name], 1e-9)
            self.concurrent_slowdown[name] = min(max(ratio, 1.0), MAX_CONCURRENT_SLOWDOWN)

    def _node_by_node(self, runtime: Runtime) -> None:
        """Every node timed alone on ``runtime``, where no pass fits what it may hold (the
        module docstring): ``warmup + repeats`` passes in node order, in which each node's
        inputs, own fixed tensors (and gradient buffers for its parameters' gradients) are
        copied to the device, the node is evaluated and timed there, and its value goes to
        the host, where each value is held until its last reader; the last pass also times
        each value's copies to the other devices. A node thus runs once a pass, as in a
        pass of the whole graph, rather than repeated alone with everything hot."""
        graph, program = self.program.graph, self.program
        host, device = torch.device("cpu"), runtime.torch_device
        last_read = {dep: node.id for node in graph.nodes for dep in node.deps}
        for run in range(self.warmup + self.repeats):
            values: dict[int, Value] = {}
            for node in graph.nodes:
                index = node.id
                with _device_memory(runtime, f"while profiling node {node.name!r} alone"):
                    fixed = {n: program.fixed[n].to(device) for n in program.held_fixed([index])}
                    grads = None
                    if node.kind is NodeKind.BACKWARD:
                        names = program.gradient_buffers([index])
                        grads = GradientBuffers.allocate(names, program.fixed, device)
                    inputs = {dep: tuple(t.to(device) for t in values[dep]) for dep in node.deps}
                    read = [t for value in inputs.values() for t in value]
                    held = value_bytes((*fixed.values(), *(grads or {}).values(), *read))
                    check_memory(runtime, held)
                    compute = partial(program.evaluator(index), inputs, fixed, grads, device)
                    value, ms = self._timed(runtime, index, compute, run >= self.warmup)
                    check_memory(runtime, held + value_bytes(value))
                if run >= self.warmup:
                    self.times[runtime.name][index].append(ms)
                self.output_bytes[index] = value_bytes(value)
                self.done += 1
                if run == self.warmup + self.repeats - 1 and len(self.runtimes) > 1:
                    self._time_copies(index, runtime, value)
                    self.done += 1
                self._report()
                del inputs, fixed, grads
                values[index] = tuple(t.to(host) for t in value)
                del value
                for dep in node.deps:
                    if last_read[dep] == index:
                        del values[dep]

    def _timed(
        self, runtime: Runtime, index: int, compute: Callable[[], Value], measured: bool
    ) -> tuple[Value, float]:
        """Node ``index``'s evaluation ``compute`` timed on ``runtime``; where ``measured``
        on a CUDA device, its workspace recorded too (the most over the evaluations)."""
        if not (measured and runtime.is_cuda):
            return runtime.timed(compute)
        value, ms, scratch = _with_workspace(runtime, compute)
        workspace = self.workspace.setdefault(runtime.name, {})
        workspace[index] = max(workspace.get(index, 0), scratch)
        return value, ms

    def _pass_energy(
        self, runtime: Runtime, plan: Plan, steps: PassSteps, counter: Counter
    ) -> list[list[float]]:
        """Per node, its energy per evaluation where ``counter`` cannot resolve one node
        (the module docstring): the pass plan's dynamic energy per run, its runs looped for
        ``energy_counters.window_s``, split over the pass's evaluations by their times."""
        runtime.activate()
        runtime.synchronize()
        idle = self.idle_w[runtime.name] = idle_watts(counter)
        _, pass_mj = energy_per_run_mj(
            counter,
            lambda: plain_run_ms(self.program, plan, {runtime.name: runtime}),
            idle,
            run_ms=self.alone_ms[runtime.name],
            window_s=window_s(counter),
            synchronize=runtime.synchronize,
        )
        self.done += len(steps)
        times = self.times[runtime.name]
        node_ms = {index: float(statistics.median(times[index])) for index, _ in steps}
        total_ms = sum(node_ms[index] for index, _ in steps)
        share = pass_mj / total_ms if total_ms > 0 else 0.0
        samples = [[0.0] for _ in range(len(self.program.graph))]
        for index, ms in node_ms.items():
            samples[index] = [share * ms]
        return samples

    def _step_overhead(self, runtime: Runtime, plan: Plan, steps: PassSteps) -> float:
        """The executor's own time per compute step of ``plan`` on ``runtime`` (the module
        docstring): the median time of ``repeats`` runs of it after one unmeasured, less
        its nodes' times (each evaluation's median), over its compute steps; at least 0."""
        runs = []
        for _ in range(1 + self.repeats):
            runs.append(plain_run_ms(self.program, plan, {runtime.name: runtime}))
            self.done += len(steps)
            self._report()
        times = self.times[runtime.name]
        nodes_ms = sum(statistics.median(times[index]) for index, _ in steps)
        self.alone_ms[runtime.name] = statistics.median(runs[1:])
        return max(0.0, (statistics.median(runs[1:]) - nodes_ms) / len(steps))

    def entry(self, node: Node) -> dict[str, Any]:
        compute, spread = {}, {}
        for runtime in self.runtimes:
            compute[runtime.name], spread[runtime.name] = median_and_spread(
                self.times[runtime.name][node.id]
            )
        energy = {
            name: float(statistics.median(samples[node.id]))
            for name, samples in self.energy.items()
        }
        return {
            "compute_ms": compute,
            "compute_spread_ms": spread,
            "output_bytes": self.output_bytes[node.id],
            "energy_mj": energy,
            "workspace_bytes": {
                name: per_node[node.id]
                for name, per_node in self.workspace.items()
                if per_node.get(node.id, 0) > 0
            },
        }

    def table_device(self, runtime: Runtime) -> dict[str, Any]:
        """The device's entry in the cost table: with its idle power where energy was
        measured there; ``energy_note``: the counter, or why there was none."""
        threads = None if runtime.is_cuda else (runtime.threads or DEFAULT_THREADS)
        entry: dict[str, Any] = {
            "name": runtime.name,
            "kind": runtime.kind,
            "threads": threads,
            "step_overhead_ms": self.step_overhead_ms.get(runtime.name, 0.0),
            "concurrent_slowdown": self.concurrent_slowdown.get(runtime.name, 1.0),
        }
        note = self.counters[runtime.name][1]
        if runtime.name in self.energy:
            entry.update(idle_w=self.idle_w[runtime.name], energy="measured")
        else:
            entry["energy"] = "model"
        if note:
            entry["energy_note"] = note
        return entry

    def _pass(
        self,
        runtime: Runtime,
        steps: PassSteps,
        fixed_bytes: int,
        fixed: Mapping[str, torch.Tensor],
        grads: GradientBuffers,
        record: list[list[float]] | None,
        copies: bool,
        energy: _EnergyProbe | None = None,
    ) -> None:
        """One pass of ``steps``: each node timed into ``record`` (None: not kept); with
        ``copies``, its copies to the other devices timed too; with ``energy``, its energy
        measured (once per node, not per recompute). Its gradients are written into
        ``grads`` as a run's are (``GradientBuffers``)."""
        grads.rewind()
        values: dict[int, Value] = {}
        held = fixed_bytes
        timed: set[int] = set()  # nodes whose copies or energy were measured
        device = runtime.torch_device
        nodes = self.program.graph.nodes
        for index, frees in steps:
            node = nodes[index]
            buffers = grads if node.kind is NodeKind.BACKWARD else None
            with _device_memory(runtime, f"while profiling node {node.name!r}"):
                evaluate = self.program.evaluator(index)
                compute = partial(evaluate, values, fixed, buffers, device)
                if energy is not None and index not in timed:
                    timed.add(index)
                    value, ms = self._measure_energy(runtime, energy, index, compute), 0.0
                else:
                    value, ms = self._timed(runtime, index, compute, record is not None)
                nbytes = value_bytes(value)
                check_memory(runtime, held + nbytes)
            if record is not None:
                record[index].append(ms)
            self.output_bytes[index] = nbytes
            if copies and index not in timed:
                timed.add(index)
                self._time_copies(index, runtime, value)
            values[index] = value
            held += nbytes
            for freed in frees:
                held -= value_bytes(values.pop(freed))
            self.done += 1
            self._report()

    def _measure_energy(
        self, runtime: Runtime, probe: _EnergyProbe, index: int, compute: Callable[[], Value]
    ) -> Value:
        """Node ``index``'s energy per run, ``repeats`` loops of it into ``probe``'s samples
        (the module docstring); the value of its last run (one held at a time)."""
        times = self.times[runtime.name][index]
        run_ms = float(statistics.median(times)) if times else None
        runtime.activate()
        value: Value | None = None
        for _ in range(self.repeats):
            value = None
            value, mj = energy_per_run_mj(
                probe.counter, compute, probe.idle_w, run_ms=run_ms, synchronize=runtime.synchronize
            )
            probe.samples[index].append(mj)
        assert value is not None
        return value

    def _report(self, force: bool = False) -> None:
        if self.on_progress is None:
            return
        now = time.monotonic()
        if force or now - self.reported_at >= PROGRESS_INTERVAL_S:
            self.reported_at = now
            self.on_progress(self.done, self.total)

    def _time_copies(self, index: int, src: Runtime, value: Value) -> None:
        for dst in self.runtimes:
            if dst.name != src.name:
                targets = tuple(torch.empty_like(t, device=dst.torch_device) for t in value)
                ms = self._time_copy(src, dst, value, targets)
                self.copies[index][f"{src.name}->{dst.name}"] = ms

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
