"""Cost models: per node per device compute time, per node per device pair copy time, per
node output bytes, each device's links to its host memory (offloading) and to storage
(paging), each node's energy
per device with the devices' idle power (``remat.energy``), and each node's workspace per
device (scratch memory its kernel holds while it runs; measured, 0 where not). Either
analytical (FLOPs and bandwidth) or profiled (a cost table measured by agents); a model
always names its source.

Analytical defaults (all overridable per device with options ``flops=``, ``bandwidth=``,
``launch_us=``; link defaults through ``AnalyticalParams``):

| kind | FLOP rate                 | memory bandwidth | launch overhead |
|------|---------------------------|------------------|-----------------|
| cpu  | 50 GFLOP/s per thread (1) | 20 GB/s          | 5 us            |
| cuda | 10 TFLOP/s                | 900 GB/s         | 10 us           |

Links: cpu<->cuda 12 GB/s + 10 us (PCIe 3 x16 in practice); cuda<->cuda 50 GB/s + 5 us;
cpu<->cpu 10 GB/s + 1 us (a memcpy between two thread pools). A device's host link (options
``host_bandwidth=`` in B/s, ``host_latency_us=``) defaults to its kind's link with a CPU:
cuda 12 GB/s + 10 us each way, cpu 10 GB/s + 1 us. Its storage link (paging; options
``storage_write_bandwidth=``, ``storage_read_bandwidth=``, ``storage_latency_us=``)
defaults to an SSD: 1 GB/s written, 1.5 GB/s read, 100 us per page.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from remat.devices import Device, DeviceKind, Tier
from remat.energy import (
    MAX_POWER_W,
    Energy,
    idle_power,
    modelled_energy_mj,
    power_spec,
    timed_energy_mj,
)
from remat.errors import InvalidInputError
from remat.graph import Graph


class CostSource(StrEnum):
    ANALYTICAL = "analytical"
    PROFILED = "profiled"


@dataclass(frozen=True)
class Link:
    """A device's link to a slower tier (``Tier``: its host's memory, or storage):
    bandwidth each way and a latency per transfer (Beaumont et al.'s beta, section 3.1
    (C); PORT's lambda^bandwidth)."""

    out_bytes_per_s: float  # device -> tier (offload, page out)
    in_bytes_per_s: float  # tier -> device (prefetch, page in)
    out_latency_ms: float
    in_latency_ms: float
    # How much longer the device computes while a transfer runs on this link: 1 where they
    # do not interfere (Beaumont et al.'s assumption (D): a GPU's copy engines), more where
    # the transfer takes the compute's cores or memory bandwidth (measured by the profiler).
    compute_slowdown: float = 1.0

    def out_ms(self, nbytes: int | np.ndarray) -> np.ndarray:
        return np.asarray(nbytes, dtype=float) / self.out_bytes_per_s * 1e3 + self.out_latency_ms

    def in_ms(self, nbytes: int | np.ndarray) -> np.ndarray:
        return np.asarray(nbytes, dtype=float) / self.in_bytes_per_s * 1e3 + self.in_latency_ms


@dataclass(frozen=True)
class CostModel:
    """compute_ms[i, d], copy_ms[i, d_from, d_to] and output_bytes[i] for one graph,
    each device's links to its host's memory and to storage (``host``, ``storage``: empty,
    or one per device; where empty, the device's default, ``link``), and energy (None:
    the power model over ``compute_ms``, ``energy_model``)."""

    source: CostSource
    devices: tuple[Device, ...]
    compute_ms: np.ndarray
    copy_ms: np.ndarray
    output_bytes: np.ndarray
    host: tuple[Link, ...] = ()
    energy: Energy | None = None
    # workspace_bytes[i, d]: scratch memory node i's kernel holds on device d while it
    # runs, beyond its inputs and output (None: none anywhere)
    workspace_bytes: np.ndarray | None = None
    storage: tuple[Link, ...] = ()
    # How long one device's thread takes to run after another's signal (a thread's
    # wake-up): a concurrent plan's section pays it where a step waits for an input another
    # device computed in it, and where a device other than its first starts and ends
    # (``remat.simulator``); measured by the agent's profiler, 0 in the analytical model.
    handoff_ms: float = 0.0
    # Per device: how much longer its compute steps take in a concurrent plan's section
    # where another device of its pool computes too (the devices share cores, memory
    # bandwidth and, on the agent, the interpreter's lock); empty: 1 everywhere.
    concurrent_slowdown: tuple[float, ...] = ()

    def workspace(self, node: int, d: int) -> int:
        return 0 if self.workspace_bytes is None else int(self.workspace_bytes[node, d])

    def energy_model(self) -> Energy:
        """The energy costs: measured or modelled where given, else the power model over
        the compute times (``remat.energy.timed_energy_mj``)."""
        if self.energy is not None:
            return self.energy
        return Energy(timed_energy_mj(self.devices, self.compute_ms), idle_power(self.devices))

    def link(self, d: int, tier: Tier = Tier.HOST) -> Link:
        """Device ``d``'s link to ``tier``."""
        links = self.host if tier is Tier.HOST else self.storage
        return links[d] if links else default_link(self.devices[d], tier)

    def out_ms(self, d: int, tier: Tier = Tier.HOST) -> np.ndarray:
        """Per node: the time to send its output from device ``d`` to ``tier``."""
        return self.link(d, tier).out_ms(self.output_bytes)

    def in_ms(self, d: int, tier: Tier = Tier.HOST) -> np.ndarray:
        """Per node: the time to bring its output back from ``tier`` to device ``d``."""
        return self.link(d, tier).in_ms(self.output_bytes)

    def grouped(
        self, groups: Sequence[Sequence[int]], output_bytes: np.ndarray, copy_ms: np.ndarray
    ) -> CostModel:
        """The model of a graph whose node ``c`` runs the nodes ``groups[c]`` of this one in
        turn, with the given output sizes and copy times: their compute times and energies
        summed, the largest of their workspaces (one kernel runs at a time). Groups of one
        node each slice the model (a part of the graph)."""
        rows = [list(g) for g in groups]
        workspace = None
        if self.workspace_bytes is not None:
            workspace = np.stack([self.workspace_bytes[g].max(axis=0) for g in rows])
        energy = self.energy
        if energy is not None:
            energy = replace(energy, q_mj=np.stack([energy.q_mj[g].sum(axis=0) for g in rows]))
        return replace(
            self,
            compute_ms=np.stack([self.compute_ms[g].sum(axis=0) for g in rows]),
            copy_ms=copy_ms,
            output_bytes=output_bytes,
            workspace_bytes=workspace,
            energy=energy,
        )

    def pooled(self) -> CostModel:
        """This model with no copy time between devices that share a memory pool (option
        ``pool``): a tensor on the pool is already where each of them reads it."""
        spaces = [d.memory_space for d in self.devices]
        same = np.array([[a == b for b in spaces] for a in spaces], dtype=bool)
        if not (same & ~np.eye(len(spaces), dtype=bool)).any():
            return self
        return replace(self, copy_ms=np.where(same[None, :, :], 0.0, self.copy_ms))

    def device_index(self, name: str) -> int:
        for index, device in enumerate(self.devices):
            if device.name == name:
                return index
        raise InvalidInputError(f"device {name!r} is not in the cost model")

    def ideal_ms(self, device: str | None = None) -> float:
        """Every node once on one device (or on its fastest device), no copies: the cost
        of checkpoint-all with ample memory, and a lower bound on any schedule. Summed in
        node order, as the simulator sums a plan, so the two agree to the last bit."""
        if device is None:
            times = self.compute_ms.min(axis=1)
        else:
            times = self.compute_ms[:, self.device_index(device)]
        return float(sum(times.tolist()))


# --- analytical -------------------------------------------------------------------------


@dataclass(frozen=True)
class KindSpec:
    flops_per_s: float
    bytes_per_s: float
    launch_s: float


@dataclass(frozen=True)
class LinkSpec:
    bytes_per_s: float
    latency_s: float


CPU_FLOPS_PER_THREAD = 50e9


@dataclass(frozen=True)
class AnalyticalParams:
    kinds: Mapping[DeviceKind, KindSpec] = field(
        default_factory=lambda: {
            DeviceKind.CPU: KindSpec(CPU_FLOPS_PER_THREAD, 20e9, 5e-6),
            DeviceKind.CUDA: KindSpec(10e12, 900e9, 10e-6),
        }
    )
    links: Mapping[frozenset[DeviceKind], LinkSpec] = field(
        default_factory=lambda: {
            frozenset({DeviceKind.CPU, DeviceKind.CUDA}): LinkSpec(12e9, 10e-6),
            frozenset({DeviceKind.CUDA}): LinkSpec(50e9, 5e-6),
            frozenset({DeviceKind.CPU}): LinkSpec(10e9, 1e-6),
        }
    )

    def spec(self, device: Device) -> KindSpec:
        base = self.kinds[device.kind]
        flops = base.flops_per_s
        if device.kind is DeviceKind.CPU:
            flops = CPU_FLOPS_PER_THREAD * (device.threads or 1)
        options = device.options
        return KindSpec(
            flops_per_s=_option(options, "flops", flops),
            bytes_per_s=_option(options, "bandwidth", base.bytes_per_s),
            launch_s=_option(options, "launch_us", base.launch_s * 1e6) * 1e-6,
        )


def _option(options: Mapping[str, str], key: str, default: float) -> float:
    if key not in options:
        return default
    try:
        value = float(options[key])
    except ValueError:
        raise InvalidInputError(f"device option {key}={options[key]!r} is not a number") from None
    if value <= 0:
        raise InvalidInputError(f"device option {key} must be positive")
    return value


HOST_LINKS: Mapping[DeviceKind, LinkSpec] = {
    DeviceKind.CUDA: LinkSpec(12e9, 10e-6),
    DeviceKind.CPU: LinkSpec(10e9, 1e-6),
}
"""Each kind's link to its host memory where neither the device's options nor a profile
say otherwise: PCIe 3 x16 for a GPU, a memcpy for a CPU (an emulated device's host)."""

STORAGE_WRITE = LinkSpec(1e9, 100e-6)
STORAGE_READ = LinkSpec(1.5e9, 100e-6)
"""The storage link where neither the device's options nor a profile say otherwise: an
edge board's SSD (PORT's regime), 1 GB/s written, 1.5 GB/s read, 100 us per page."""


def default_link(device: Device, tier: Tier) -> Link:
    """The device's link to ``tier`` from its options (``host_bandwidth``,
    ``host_latency_us``; ``storage_write_bandwidth``, ``storage_read_bandwidth``,
    ``storage_latency_us``) or the defaults (``HOST_LINKS``, ``STORAGE_WRITE``,
    ``STORAGE_READ``)."""
    options = device.options
    if tier is Tier.HOST:
        base = HOST_LINKS[device.kind]
        rate = _option(options, "host_bandwidth", base.bytes_per_s)
        latency = _latency_ms(options, "host_latency_us", base.latency_s)
        return Link(rate, rate, latency, latency)
    latency = _latency_ms(options, "storage_latency_us", STORAGE_WRITE.latency_s)
    return Link(
        _option(options, "storage_write_bandwidth", STORAGE_WRITE.bytes_per_s),
        _option(options, "storage_read_bandwidth", STORAGE_READ.bytes_per_s),
        latency,
        latency,
    )


def _latency_ms(options: Mapping[str, str], key: str, default_s: float) -> float:
    value = options.get(key)
    latency_us = default_s * 1e6 if value is None else float(value)
    if not 0 <= latency_us < math.inf:
        raise InvalidInputError(f"device option {key} must be a non-negative number")
    return latency_us * 1e-3


def analytical_costs(
    graph: Graph, devices: Sequence[Device], params: AnalyticalParams | None = None
) -> CostModel:
    """compute = max(FLOPs / rate, bytes moved / bandwidth) + launch overhead;
    copy = bytes / link bandwidth + latency; workspace: each node's ``scratch_bytes`` on
    every device. Backward nodes carry their own FLOP, byte and scratch estimates (set by the
    training graph from the op type)."""
    params = params or AnalyticalParams()
    specs = [params.spec(d) for d in devices]
    flops = np.array([n.flops for n in graph.nodes], dtype=float)
    moved = np.array([n.bytes_moved for n in graph.nodes], dtype=float)
    out = np.array([n.output_bytes for n in graph.nodes], dtype=np.int64)
    flop_s = np.stack([flops / s.flops_per_s for s in specs], axis=1)
    work_s = np.maximum(flop_s, np.stack([moved / s.bytes_per_s for s in specs], axis=1))
    launch_s = np.array([s.launch_s for s in specs])
    compute_s = work_s + launch_s
    bound = np.divide(flop_s, work_s, out=np.zeros_like(work_s), where=work_s > 0)
    energy = Energy(
        modelled_energy_mj(devices, work_s * 1e3, bound, launch_s * 1e3), idle_power(devices)
    )
    D = len(devices)
    scratch = np.array([n.scratch_bytes for n in graph.nodes], dtype=np.int64)
    copy_s = np.zeros((len(graph), D, D))
    for a in range(D):
        for b in range(D):
            if a != b:
                link = params.links[frozenset({devices[a].kind, devices[b].kind})]
                copy_s[:, a, b] = out / link.bytes_per_s + link.latency_s
    host = tuple(default_link(d, Tier.HOST) for d in devices)
    storage = tuple(default_link(d, Tier.STORAGE) for d in devices)
    return CostModel(
        CostSource.ANALYTICAL,
        tuple(devices),
        compute_s * 1e3,
        copy_s * 1e3,
        out,
        host,
        energy,
        workspace_bytes=np.repeat(scratch[:, None], D, axis=1) if scratch.any() else None,
        storage=storage,
    )


# --- profiled (cost table JSON) ---------------------------------------------------------


Watts = Annotated[float, Field(ge=0, le=MAX_POWER_W, allow_inf_nan=False)]
MAX_CONCURRENT_SLOWDOWN = 100.0


class _TableDevice(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    kind: DeviceKind
    threads: int | None = None
    idle_w: Watts | None = None  # measured idle power (the baseline energy is measured over)
    # What the nodes' energy_mj on this device is: read from counters, or a power model's.
    energy: Literal["measured", "model"] = "model"
    # The executor's own time per compute step here, beyond the node's (its dispatch and
    # accounting, the free after it), measured by the agent's profiler; ``profiled_costs``
    # adds it to every node's time on this device, since every evaluation pays it.
    step_overhead_ms: float = Field(default=0.0, ge=0, le=1e3, allow_inf_nan=False)
    # How much longer its steps take while another device of its memory pool computes at
    # once (``CostModel.concurrent_slowdown``), measured by the agent's profiler.
    concurrent_slowdown: float = Field(
        default=1.0, ge=1.0, le=MAX_CONCURRENT_SLOWDOWN, allow_inf_nan=False
    )


MAX_TABLE_MS = 1e9  # about 11.6 days: no operator or copy takes longer
MAX_TABLE_BYTES = 1 << 50  # 1 PiB: no output is larger
# A table's times and sizes: finite, non-negative and bounded (tables come from agents and
# files; a NaN or 1e300 would poison every plan solved with them).
TableMs = Annotated[float, Field(ge=0, le=MAX_TABLE_MS, allow_inf_nan=False)]
TableBytes = Annotated[int, Field(ge=0, le=MAX_TABLE_BYTES)]
TableMj = Annotated[float, Field(ge=0, le=MAX_TABLE_MS * MAX_POWER_W, allow_inf_nan=False)]


class _TableNode(BaseModel):
    compute_ms: dict[str, TableMs]
    output_bytes: int = Field(ge=0, le=MAX_TABLE_BYTES)
    # Dispersion of a profiled time per device (the interquartile range of the repeats).
    compute_spread_ms: dict[str, TableMs] = Field(default_factory=dict)
    # Measured dynamic energy per device (idle baseline subtracted), where counters exist.
    energy_mj: dict[str, TableMj] = Field(default_factory=dict)
    # Scratch memory per device the node's kernel holds while it runs (absent: 0).
    workspace_bytes: dict[str, TableBytes] = Field(default_factory=dict)


MAX_LINK_BYTES_PER_S = 1e15
LinkRate = Annotated[float, Field(gt=0, le=MAX_LINK_BYTES_PER_S, allow_inf_nan=False)]
MAX_COMPUTE_SLOWDOWN = 100.0
ComputeSlowdown = Annotated[float, Field(ge=1.0, le=MAX_COMPUTE_SLOWDOWN, allow_inf_nan=False)]


class _TableHostLink(BaseModel):
    """A device's measured link to its host memory (both directions, pinned buffers)."""

    to_host_bytes_per_s: LinkRate
    from_host_bytes_per_s: LinkRate
    latency_us: float = Field(default=0.0, ge=0, le=1e6, allow_inf_nan=False)
    compute_slowdown: ComputeSlowdown = 1.0  # ``Link.compute_slowdown``

    def link(self) -> Link:
        return Link(
            self.to_host_bytes_per_s,
            self.from_host_bytes_per_s,
            self.latency_us * 1e-3,
            self.latency_us * 1e-3,
            self.compute_slowdown,
        )


LatencyUs = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]


class _TableStorageLink(BaseModel):
    """A node's measured storage as a device pages to it: files written and fsync'd, and
    read back. A transfer's time is its latency plus its bytes over the bandwidth, each
    direction its own; ``latency_us`` is both directions' where the directional one is
    not given (tables written before the profiler measured them apart)."""

    write_bytes_per_s: LinkRate
    read_bytes_per_s: LinkRate
    latency_us: LatencyUs = 0.0
    write_latency_us: LatencyUs | None = None
    read_latency_us: LatencyUs | None = None
    compute_slowdown: ComputeSlowdown = 1.0  # ``Link.compute_slowdown``

    def link(self) -> Link:
        write_us, read_us = (
            self.latency_us if given is None else given
            for given in (self.write_latency_us, self.read_latency_us)
        )
        return Link(
            self.write_bytes_per_s,
            self.read_bytes_per_s,
            write_us * 1e-3,
            read_us * 1e-3,
            self.compute_slowdown,
        )


class CostTable(BaseModel):
    """The cost table format of the agents (keys are training-graph node names;
    ``host_links`` and ``storage_links`` by device name, where measured)."""

    source: CostSource
    devices: list[_TableDevice] = Field(min_length=1)
    nodes: dict[str, _TableNode]
    copy_ms: dict[str, dict[str, TableMs]] = Field(default_factory=dict)
    host_links: dict[str, _TableHostLink] = Field(default_factory=dict)
    storage_links: dict[str, _TableStorageLink] = Field(default_factory=dict)
    # The host's thread hand-off (``CostModel.handoff_ms``): half an event's round trip
    # between two threads, measured by the agent's profiler.
    handoff_ms: float = Field(default=0.0, ge=0, le=1e3, allow_inf_nan=False)
    # The digest of the graph the profiler measured (``Graph.fingerprint``); None in tables
    # from before it was recorded, and in tables written by hand.
    graph: str | None = Field(default=None, max_length=100)

    def measured_on(self, graph: Graph) -> bool:
        """Whether the table was measured on ``graph``'s structure: its recorded digest,
        or where it has none, exactly ``graph``'s node names (a graph that ingestion now
        builds otherwise, e.g. with more operators fused, has other nodes)."""
        if self.graph is not None:
            return self.graph == graph.fingerprint.digest
        return set(self.nodes) == {node.name for node in graph.nodes}

    def restricted(self, names: list[str]) -> CostTable:
        """The table's costs for the devices ``names`` only, in that order (a job may use
        some of a profiled node's devices)."""
        have = {d.name: d for d in self.devices}
        missing = [n for n in names if n not in have]
        if missing:
            raise InvalidInputError(
                f"the profile has no device {missing[0]!r} (it has: {', '.join(have)})"
            )
        chosen = set(names)

        def node(costs: _TableNode) -> _TableNode:
            spread = {n: ms for n, ms in costs.compute_spread_ms.items() if n in chosen}
            times = {n: costs.compute_ms[n] for n in names}
            energy = {n: mj for n, mj in costs.energy_mj.items() if n in chosen}
            scratch = {n: b for n, b in costs.workspace_bytes.items() if n in chosen}
            return costs.model_copy(
                update={
                    "compute_ms": times,
                    "compute_spread_ms": spread,
                    "energy_mj": energy,
                    "workspace_bytes": scratch,
                }
            )

        def copies(pairs: dict[str, float]) -> dict[str, float]:
            return {pair: ms for pair, ms in pairs.items() if set(pair.split("->", 1)) <= chosen}

        return self.model_copy(
            update={
                "devices": [have[n] for n in names],
                "nodes": {key: node(costs) for key, costs in self.nodes.items()},
                "copy_ms": {key: copies(pairs) for key, pairs in self.copy_ms.items()},
                "host_links": {n: link for n, link in self.host_links.items() if n in chosen},
                "storage_links": {n: link for n, link in self.storage_links.items() if n in chosen},
            }
        )


def load_cost_table(path: str | Path) -> CostTable:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidInputError(f"cost table {path}: {exc.strerror}") from None
    try:
        return CostTable.model_validate(json.loads(text))
    except (json.JSONDecodeError, ValidationError) as exc:
        first = (
            str(exc).splitlines()[0]
            if isinstance(exc, json.JSONDecodeError)
            else (_first_pydantic_error(exc))
        )
        raise InvalidInputError(f"cost table {path}: {first}") from None


def _first_pydantic_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"])
    return f"{where}: {error['msg']}"


def profiled_costs(graph: Graph, table: CostTable) -> CostModel:
    """A profiled cost model for ``graph``. Every node must have a time on every device and
    every value a copy time between every ordered pair of distinct devices."""
    devices = tuple(
        Device(d.name, d.kind, {"threads": str(d.threads)} if d.threads else {})
        for d in table.devices
    )
    if table.graph is not None and table.graph != graph.fingerprint.digest:
        raise InvalidInputError(
            f"the cost table was measured on another graph ({table.graph}; this one: "
            f"{graph.fingerprint}): profile the model again"
        )
    names = [d.name for d in devices]
    n, D = len(graph), len(devices)
    compute = np.zeros((n, D))
    copy = np.zeros((n, D, D))
    out = np.zeros(n, dtype=np.int64)
    workspace = np.zeros((n, D), dtype=np.int64)
    for node in graph.nodes:
        entry = table.nodes.get(node.name)
        if entry is None:
            raise InvalidInputError(f"cost table has no entry for node {node.name!r}")
        missing = [d for d in names if d not in entry.compute_ms]
        if missing:
            raise InvalidInputError(f"cost table: node {node.name!r} has no time on {missing[0]}")
        for what, per_device in (("workspace", entry.workspace_bytes), ("energy", entry.energy_mj)):
            stray = sorted(set(per_device) - set(names))
            if stray:
                raise InvalidInputError(
                    f"cost table: node {node.name!r} has {what} on {stray[0]}, which the "
                    "table lacks"
                )
        compute[node.id] = [
            entry.compute_ms[d] + t.step_overhead_ms
            for d, t in zip(names, table.devices, strict=True)
        ]
        workspace[node.id] = [entry.workspace_bytes.get(d, 0) for d in names]
        out[node.id] = entry.output_bytes
        pairs = table.copy_ms.get(node.name, {})
        for a, src in enumerate(names):
            for b, dst in enumerate(names):
                if a == b:
                    continue
                key = f"{src}->{dst}"
                if key not in pairs:
                    raise InvalidInputError(f"cost table: node {node.name!r} has no copy {key}")
                copy[node.id, a, b] = pairs[key]
    if (compute < 0).any() or (copy < 0).any():
        raise InvalidInputError("cost table: times must not be negative")
    host = tuple(
        table.host_links[d.name].link()
        if d.name in table.host_links
        else default_link(d, Tier.HOST)
        for d in devices
    )
    storage = tuple(
        table.storage_links[d.name].link()
        if d.name in table.storage_links
        else default_link(d, Tier.STORAGE)
        for d in devices
    )
    energy = _table_energy(graph, table, devices, compute)
    scratch = workspace if workspace.any() else None
    return CostModel(
        CostSource.PROFILED,
        devices,
        compute,
        copy,
        out,
        host,
        energy,
        scratch,
        storage,
        handoff_ms=table.handoff_ms,
        concurrent_slowdown=tuple(d.concurrent_slowdown for d in table.devices),
    )


def _table_energy(
    graph: Graph, table: CostTable, devices: tuple[Device, ...], compute: np.ndarray
) -> Energy:
    """The table's energy: measured on a device where every node has it there, modelled
    (``remat.energy.timed_energy_mj``) where none has; a device measured for some nodes
    only is an error. Idle power: measured where the table has it, else modelled."""
    q = timed_energy_mj(devices, compute)
    measured = []
    for d, device in enumerate(devices):
        have = [n for n in graph.nodes if device.name in table.nodes[n.name].energy_mj]
        if have and len(have) < len(graph):
            lacking = next(
                n for n in graph.nodes if device.name not in table.nodes[n.name].energy_mj
            )
            raise InvalidInputError(
                f"cost table: node {lacking.name!r} has no energy on {device.name}, which "
                f"{len(have)} other nodes have (give every node's energy there, or none)"
            )
        if have:
            q[:, d] = [table.nodes[n.name].energy_mj[device.name] for n in graph.nodes]
        measured.append(bool(have) and table.devices[d].energy == "measured")
    idle = tuple(
        t.idle_w if t.idle_w is not None else power_spec(device).idle_w
        for t, device in zip(table.devices, devices, strict=True)
    )
    return Energy(q, idle, measured=tuple(measured))


def cost_table_of(graph: Graph, model: CostModel) -> CostTable:
    """The cost table of a model (e.g. to write analytical costs out as a starting point)."""
    names = [d.name for d in model.devices]
    energy = model.energy_model()
    return CostTable(
        source=model.source,
        devices=[
            _TableDevice(
                name=d.name,
                kind=d.kind,
                threads=d.threads,
                idle_w=energy.idle_w[j],
                energy="measured" if energy.measured_on(j) else "model",
                concurrent_slowdown=model.concurrent_slowdown[j]
                if model.concurrent_slowdown
                else 1.0,
            )
            for j, d in enumerate(model.devices)
        ],
        nodes={
            n.name: _TableNode(
                compute_ms={d: float(model.compute_ms[n.id, j]) for j, d in enumerate(names)},
                output_bytes=int(model.output_bytes[n.id]),
                energy_mj={d: float(energy.q_mj[n.id, j]) for j, d in enumerate(names)},
                workspace_bytes={
                    d: model.workspace(n.id, j)
                    for j, d in enumerate(names)
                    if model.workspace(n.id, j)
                },
            )
            for n in graph.nodes
        },
        copy_ms={
            n.name: {
                f"{a}->{b}": float(model.copy_ms[n.id, i, j])
                for i, a in enumerate(names)
                for j, b in enumerate(names)
                if i != j
            }
            for n in graph.nodes
        },
        host_links={
            d.name: _TableHostLink(
                to_host_bytes_per_s=link.out_bytes_per_s,
                from_host_bytes_per_s=link.in_bytes_per_s,
                latency_us=link.out_latency_ms * 1e3,
                compute_slowdown=link.compute_slowdown,
            )
            for j, d in enumerate(model.devices)
            for link in (model.link(j, Tier.HOST),)
        },
        storage_links={
            d.name: _TableStorageLink(
                write_bytes_per_s=link.out_bytes_per_s,
                read_bytes_per_s=link.in_bytes_per_s,
                write_latency_us=link.out_latency_ms * 1e3,
                read_latency_us=link.in_latency_ms * 1e3,
                compute_slowdown=link.compute_slowdown,
            )
            for j, d in enumerate(model.devices)
            for link in (model.link(j, Tier.STORAGE),)
        },
        handoff_ms=model.handoff_ms,
    )
