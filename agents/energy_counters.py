"""Cumulative energy counters of this node's devices, read in joules, and the measurement
of a node's energy with them (the profiler's energy pass, ``agents.profiler``).

A counter (``Counter``) gives the energy its device has drawn since some fixed point, in
joules, going up only: the raw hardware counters it reads wrap around at a known range,
and the reader adds the range back each time a reading comes out lower than the previous
one (``_Unwrapped``). A wrap is only seen if the counter is read at least once per wrap
period (minutes at a package's full power); the profiler's differences span a sleep or a
loop of runs, far shorter, and a wrap missed between them only offsets the total.

- CPU devices: Intel's and AMD's RAPL through the powercap sysfs tree
  (``/sys/class/powercap``): the package zones ``intel-rapl:N`` (not their subzones, and not
  the ``psys`` platform zone, which would count the packages twice), ``energy_uj`` in
  microjoules wrapping at ``max_energy_range_uj``, summed over the packages. A package
  counts the whole socket: every core, whichever device or process uses it, so what the
  profiler attributes to a node is the socket's draw above its idle draw while the node
  runs. Since Linux 5.10 (the Platypus attack) ``energy_uj`` is readable by root only unless
  a udev rule or ``chmod`` opens it.
- CUDA devices: NVML's ``nvmlDeviceGetTotalEnergyConsumption`` (millijoules since the
  driver was loaded; Volta and newer) through ``nvidia-ml-py`` (module ``pynvml``), an
  optional package. A PyTorch CUDA index is mapped to NVML's device by PCI bus id (NVML
  numbers devices in PCI order and ignores ``CUDA_VISIBLE_DEVICES``; CUDA may do neither),
  else through ``CUDA_VISIBLE_DEVICES`` where it lists indices or GPU UUIDs, else by the
  index itself.

``counter_for(runtime)`` is a device's counter, or None with the reason there is none.

Measuring (``idle_watts``, ``energy_per_run_mj``): a device's idle power is the counter's
rate over a short sleep (the median of a few), and a node's energy per run is what the
counter advanced over a loop of runs lasting at least ``window_s``, less the idle power
over the loop's wall time, divided by the runs, clamped at zero. Short operators run many
times per loop, since a counter moves only every so often (``update_s``: RAPL about every
millisecond, NVML's every 100 ms) and a single run of microseconds would read as nothing;
the loop spans at least ``WINDOW_UPDATES`` updates, so NVML's loops last a second.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from agents.torch_devices import Runtime

POWERCAP = Path("/sys/class/powercap")
_PACKAGE_ZONE = re.compile(r"intel-rapl:\d+$")
_NVML_RANGE_MJ = 1 << 64  # nvmlDeviceGetTotalEnergyConsumption: unsigned long long
# How often each counter's reading moves: RAPL's about every millisecond; NVML's total
# energy every 100 ms (an H200, idle and under load alike: bench/cuda.sh's probe).
RAPL_UPDATE_S = 0.001
NVML_UPDATE_S = 0.1


class Counter(Protocol):
    """A device's cumulative energy counter."""

    @property
    def description(self) -> str:
        """What it reads, in a few words (e.g. ``RAPL package-0, package-1``)."""
        ...

    def joules(self) -> float:
        """The energy drawn since a fixed point, in joules; never decreases."""
        ...

    @property
    def update_s(self) -> float:
        """How often the reading moves, in seconds: a loop shorter than a few of these
        reads as nothing or as a whole update (``window_s``)."""
        ...


class _Unwrapped:
    """One raw counter that wraps to 0 after ``range_`` units: the total advanced since the
    first reading, wraps added back (in integers: exact however large the raw values)."""

    def __init__(self, read: Callable[[], int], range_: int) -> None:
        self._read = read
        self._range = range_
        self._last = read()
        self._total = 0

    def advanced(self) -> int:
        raw = self._read()
        step = raw - self._last
        if step < 0:  # wrapped around (a reading is taken at least once per wrap period)
            step += self._range
        self._last = raw
        self._total += step
        return self._total


class RaplCounter:
    """The sum of RAPL package zones' ``energy_uj`` (module docstring)."""

    def __init__(self, zones: list[Path]) -> None:
        self.zones = zones
        self._counters = [
            _Unwrapped(_reader(z / "energy_uj"), _read_number(z / "max_energy_range_uj"))
            for z in zones
        ]

    @property
    def description(self) -> str:
        return "RAPL " + ", ".join(_zone_name(z) for z in self.zones)

    def joules(self) -> float:
        return sum(c.advanced() for c in self._counters) * 1e-6

    @property
    def update_s(self) -> float:
        return RAPL_UPDATE_S


def _reader(path: Path) -> Callable[[], int]:
    return lambda: _read_number(path)


def _read_number(path: Path) -> int:
    return int(path.read_text().strip())


def _zone_name(zone: Path) -> str:
    try:
        return (zone / "name").read_text().strip() or zone.name
    except OSError:
        return zone.name


def rapl_counter(root: Path | str = POWERCAP) -> tuple[RaplCounter | None, str]:
    """The RAPL counter of this machine's CPU packages under ``root``, or None and why."""
    root = Path(root)
    if not root.is_dir():
        return None, f"no RAPL counters: {root} is missing"
    zones = sorted(
        (z for z in root.iterdir() if _PACKAGE_ZONE.match(z.name) and z.is_dir()),
        key=lambda z: int(z.name.rsplit(":", 1)[1]),
    )
    # The platform zone (psys) already includes the packages.
    zones = [z for z in zones if not _zone_name(z).startswith("psys")]
    if not zones:
        return None, f"no RAPL counters: no intel-rapl package zones under {root}"
    for zone in zones:
        for name in ("energy_uj", "max_energy_range_uj"):
            path = zone / name
            try:
                value = _read_number(path)
            except PermissionError:
                return None, f"{path} is not readable (needs root or a udev rule)"
            except (OSError, ValueError) as error:
                return None, f"{path} cannot be read: {error}"
            if name == "max_energy_range_uj" and value <= 0:
                return None, f"{path} is {value}: no wrap-around range"
    try:
        return RaplCounter(zones), ""
    except (OSError, ValueError) as error:  # changed between the checks and now
        return None, f"RAPL counters cannot be read: {error}"


class NvmlCounter:
    """NVML's total energy of one GPU (module docstring)."""

    def __init__(self, nvml: Any, handle: Any, description: str) -> None:
        self._description = description
        read = lambda: int(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))  # noqa: E731
        self._counter = _Unwrapped(read, _NVML_RANGE_MJ)

    @property
    def description(self) -> str:
        return self._description

    def joules(self) -> float:
        return self._counter.advanced() * 1e-3

    @property
    def update_s(self) -> float:
        return NVML_UPDATE_S


def nvml_counter(device: torch.device) -> tuple[NvmlCounter | None, str]:
    """The NVML energy counter of CUDA ``device``, or None and why."""
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed (no NVML energy counters)"
    try:
        pynvml.nvmlInit()  # reference-counted: every counter may call it
        handle, how = _nvml_handle(pynvml, device)
        name = pynvml.nvmlDeviceGetName(handle)
    except pynvml.NVMLError as error:
        return None, f"NVML is not usable: {error}"
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    try:
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except pynvml.NVMLError_NotSupported:
        return None, f"NVML has no energy counter on this GPU ({name}; Volta or newer has)"
    except pynvml.NVMLError as error:
        return None, f"NVML's energy counter of {name} cannot be read: {error}"
    return NvmlCounter(pynvml, handle, f"NVML total energy of {name} ({how})"), ""


def _nvml_handle(nvml: Any, device: torch.device) -> tuple[Any, str]:
    """NVML's handle of CUDA ``device`` and how it was found (module docstring)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, int):
        domain = int(getattr(props, "pci_domain_id", 0) or 0)
        slot = int(getattr(props, "pci_device_id", 0) or 0)
        for width in (8, 4):  # NVML's bus id, then the legacy one
            text = f"{domain:0{width}X}:{bus:02X}:{slot:02X}.0"
            try:
                return nvml.nvmlDeviceGetHandleByPciBusId(text.encode()), f"PCI {text}"
            except nvml.NVMLError:
                continue
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        listed = [v.strip() for v in visible.split(",") if v.strip()]
        entry = listed[index] if index < len(listed) else ""
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry)), f"NVML index {entry}"
        if entry.startswith("GPU-"):
            return nvml.nvmlDeviceGetHandleByUUID(entry.encode()), entry
    return nvml.nvmlDeviceGetHandleByIndex(index), f"NVML index {index}"


def counter_for(runtime: Runtime, powercap: Path | str = POWERCAP) -> tuple[Counter | None, str]:
    """``runtime``'s device's energy counter and what it reads, or None and the reason
    there is none (one line)."""
    counter: Counter | None
    if runtime.is_cuda:
        counter, reason = nvml_counter(runtime.torch_device)
    else:
        counter, reason = rapl_counter(powercap)
    if counter is None:
        return None, reason
    return counter, counter.description


def counter_of(
    runtime: Runtime, given: Mapping[str, Counter | None] | None
) -> tuple[Counter | None, str]:
    """The device's counter as ``counter_for`` gives it, unless ``given`` names the device
    (a counter, or None: none there): what the profiler and the executor read."""
    if given is None or runtime.name not in given:
        return counter_for(runtime)
    counter = given[runtime.name]
    if counter is None:
        return None, "no energy counter was given for this device"
    return counter, counter.description


# --- measuring ---------------------------------------------------------------------------

IDLE_SECONDS = 0.5
IDLE_SAMPLES = 3
WINDOW_S = 0.02
# A loop spans at least this many of its counter's updates: its reading is then off by at
# most about one update in this many.
WINDOW_UPDATES = 10
MIN_RUNS = 3


def updates_s(counter: Counter) -> float:
    """``WINDOW_UPDATES`` of ``counter``'s updates, in seconds: the least a loop it reads
    must span (NVML: 1 s)."""
    return WINDOW_UPDATES * counter.update_s


def window_s(counter: Counter) -> float:
    """The shortest loop ``counter`` measures a node over: ``WINDOW_S``, or ``updates_s``
    where its updates are slower."""
    return max(WINDOW_S, updates_s(counter))


def resolves_nodes(counter: Counter) -> bool:
    """Whether ``counter`` updates often enough to measure one node in a loop of
    ``WINDOW_S`` (RAPL); else the profiler measures a whole pass (NVML)."""
    return window_s(counter) <= WINDOW_S


def idle_watts(
    counter: Counter,
    *,
    seconds: float = IDLE_SECONDS,
    samples: int = IDLE_SAMPLES,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The device's idle power: the median over ``samples`` sleeps of ``seconds`` of the
    counter's rate, in W (callers synchronise the device first)."""
    rates = []
    for _ in range(samples):
        joules, start = counter.joules(), clock()
        sleep(seconds)
        elapsed = clock() - start
        rates.append((counter.joules() - joules) / elapsed if elapsed > 0 else 0.0)
    return max(float(statistics.median(rates)), 0.0)


def energy_per_run_mj(
    counter: Counter,
    work: Callable[[], Any],
    idle_w: float,
    *,
    run_ms: float | None = None,
    window_s: float = WINDOW_S,
    min_runs: int = MIN_RUNS,
    synchronize: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Any, float]:
    """Run ``work`` in a loop for at least ``window_s`` of wall time and ``min_runs`` runs;
    its last result and its dynamic energy per run in mJ: the counter's advance less
    ``idle_w`` over the loop's time, over the runs, at least 0.

    ``run_ms``: the expected time of one run, to size the first batch of runs (None: one
    run first). ``synchronize`` waits for the device's queued work; it is called before
    each counter reading, so the loop's energy and time cover its work and nothing else.
    Each run's result is dropped before the next runs, so one result is held at a time."""
    batch = 1
    if run_ms is not None and run_ms > 0:
        batch = max(min_runs, math.ceil(window_s * 1e3 / run_ms))
    result: Any = None
    runs = 0
    synchronize()
    joules, start = counter.joules(), clock()
    while True:
        for _ in range(batch):
            result = None
            result = work()
        runs += batch
        synchronize()
        elapsed = clock() - start
        if elapsed >= window_s and runs >= min_runs:
            break
        # the runs still missing, at the rate seen so far
        left = (window_s - elapsed) * runs / elapsed if elapsed > 0 else runs
        batch = max(min_runs - runs, math.ceil(left), 1)
    used = counter.joules() - joules
    dynamic = max(used - idle_w * elapsed, 0.0)
    return result, dynamic / runs * 1e3
