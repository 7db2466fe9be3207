"""The node's devices as PyTorch sees them: detection, binding a ``remat`` device to a
``torch.device``, and timing work on it.

Two CPU devices of different speed on one machine are emulated by thread counts: a CPU
device runs every operation after ``torch.set_num_threads(threads)`` (e.g. cpu0 with one
thread, cpu1 with two). CPU devices are timed with ``time.perf_counter``. CUDA devices
with events after synchronisation, behind a short spin kernel (``LAUNCH_COVER_CYCLES``) that
keeps the stream busy while the host issues the work, so that the events time the kernels
back to back, as a run that issues steps ahead of the GPU executes them, not the host's
launch latency before the first; the time is the larger of that and the host's issuing time
(a step whose kernels are shorter than its dispatch costs its dispatch).

The host's C allocator keeps what it has taken (``keep_host_heap``): glibc's default hands
large freed blocks back to the kernel and takes them again, page by page, at the next
allocation, so that a run of a plan that frees and allocates its values took thousands of
page faults a step, where eager PyTorch, whose step reuses its heap, took none.

CUDA computes float32 in full IEEE precision while the agent profiles or executes
(``ieee_fp32``): PyTorch lets cuDNN convolutions use TF32 by default, whose 10-bit mantissa
put the gradients of a plan on an H100 1e-2 to 1e-1 (relative) away from plain fp32 autograd.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch

from agents.errors import DeviceError
from remat.devices import Device, DeviceKind

T = TypeVar("T")
# GPU clock cycles a CUDA timing's spin kernel runs (about 1 ms at 2 GHz): longer than the
# host takes to issue one node's kernels.
LAUNCH_COVER_CYCLES = 2_000_000

# torch's own default (physical cores), used by CPU devices that name no thread count.
DEFAULT_THREADS = torch.get_num_threads()
_TRAILING_INDEX = re.compile(r"(\d+)$")
# glibc's mallopt parameters, and the values ``keep_host_heap`` sets: blocks up to 1 GiB
# come from the heap, which is never trimmed (both are C ints).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES, _TRIM_THRESHOLD_BYTES = 1 << 30, (1 << 31) - 1


def detect_devices() -> list[Device]:
    """``cpu0`` (kind cpu, threads = ``os.cpu_count()``) plus ``cuda0``..``cudaN``, one
    per CUDA GPU PyTorch can see."""
    devices = [Device("cpu0", DeviceKind.CPU, {"threads": str(os.cpu_count() or 1)})]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            name = torch.cuda.get_device_name(index)
            devices.append(Device(f"cuda{index}", DeviceKind.CUDA, {"model": name}))
    return devices


@dataclass(frozen=True)
class Runtime:
    """One device bound to PyTorch: where its tensors live and how its work is timed."""

    name: str
    kind: DeviceKind
    torch_device: torch.device
    threads: int | None
    # The most bytes the executor and the profiler may hold here (the device's ``memory``
    # option; the profiler's limit), checked on their own account of tensors (``check_memory``);
    # None: no limit but the device's own.
    memory_bytes: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.kind is DeviceKind.CUDA

    def activate(self) -> None:
        """Make this device current: its thread count (CPU) or its CUDA device."""
        if self.is_cuda:
            torch.cuda.set_device(self.torch_device)
        else:
            threads = self.threads or DEFAULT_THREADS
            # Changing the pool size is cheap, but skipping the call when unchanged keeps
            # per-op overhead identical between the profiler and the executor.
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.torch_device)

    def timed(self, work: Callable[[], T]) -> tuple[T, float]:
        """Run ``work`` on this device; its result and its time in milliseconds (CUDA:
        events around it after synchronising the current stream, so that earlier work is
        not counted; not the whole device, whose other streams, such as the executor's
        transfers to host memory, run on beside it)."""
        self.activate()
        if not self.is_cuda:
            start = time.perf_counter()
            result = work()
            return result, (time.perf_counter() - start) * 1e3
        torch.cuda.current_stream(self.torch_device).synchronize()
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(LAUNCH_COVER_CYCLES)  # the stream busy while the host issues work
        begin.record()
        start = time.perf_counter()
        result = work()
        host_ms = (time.perf_counter() - start) * 1e3
        end.record()
        end.synchronize()
        return result, max(float(begin.elapsed_time(end)), host_ms)


def runtime_of(device: Device) -> Runtime:
    """Bind ``device`` to PyTorch; DeviceError when it cannot run here."""
    if device.kind is DeviceKind.CPU:
        return Runtime(
            device.name, device.kind, torch.device("cpu"), device.threads, device.memory_bytes
        )
    if not torch.cuda.is_available():
        raise DeviceError(f"device {device.name!r} is CUDA, but CUDA is not available here")
    index = _cuda_index(device)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"device {device.name!r} is CUDA index {index}; this node has {count}")
    return Runtime(device.name, device.kind, torch.device("cuda", index), None, device.memory_bytes)


def _cuda_index(device: Device) -> int:
    """The CUDA index: option ``index``, else the trailing digits of the name (cuda1 -> 1),
    else 0."""
    text = device.options.get("index")
    if text is None:
        match = _TRAILING_INDEX.search(device.name)
        text = match.group(1) if match else "0"
    if not text.isdigit():
        raise DeviceError(f"device {device.name!r}: index {text!r} is not a number")
    return int(text)


def runtimes(devices: Sequence[Device]) -> dict[str, Runtime]:
    return {d.name: runtime_of(d) for d in devices}


def copy_runtime(src: Runtime, dst: Runtime) -> Runtime:
    """Which device a copy is timed on: the CUDA side where there is one (its stream does
    the transfer), else the destination's thread pool (it writes the copy)."""
    if src.is_cuda and not dst.is_cuda:
        return src
    return dst


class OverMemoryLimit(RuntimeError):
    """The tensors held on a device went above the memory it may use (``Runtime``'s
    ``memory_bytes``): out of memory, as a device of that size would be
    (``is_out_of_memory`` says so)."""


def check_memory(runtime: Runtime, held_bytes: int) -> None:
    """``OverMemoryLimit`` when ``held_bytes`` on ``runtime``'s device exceed the memory
    it may use."""
    limit = runtime.memory_bytes
    if limit is not None and held_bytes > limit:
        raise OverMemoryLimit(
            f"out of memory: {held_bytes} bytes held, above the {limit} bytes the device may use"
        )


def is_out_of_memory(error: BaseException) -> bool:
    """A CUDA or host allocation failure (PyTorch raises a plain RuntimeError for the
    host), or the memory a device may use exceeded."""
    if isinstance(error, torch.OutOfMemoryError | OverMemoryLimit):
        return True
    return "can't allocate memory" in str(error) or "out of memory" in str(error)


# (backend, operator) pairs of PyTorch's float32 precision settings that CUDA kernels read.
_FP32_SETTINGS = (("cudnn", "conv"), ("cudnn", "rnn"), ("cuda", "matmul"))


@contextmanager
def ieee_fp32() -> Iterator[None]:
    """CUDA float32 convolutions and matrix products in IEEE precision (no TF32) inside, the
    previous settings restored afterwards. Nothing changes on a machine without CUDA.

    Inside, PyTorch 2.11 refuses to read the legacy flag ``torch.backends.cudnn.allow_tf32``
    (it sees legacy and per-operator settings mixed); nothing the agent runs reads it."""
    if not torch.cuda.is_available():
        yield
        return
    found = [getattr(getattr(torch.backends, b), op, None) for b, op in _FP32_SETTINGS]
    settings = [s for s in found if s is not None and hasattr(s, "fp32_precision")]
    if len(settings) == len(_FP32_SETTINGS):
        before = [s.fp32_precision for s in settings]
        try:
            for setting in settings:
                setting.fp32_precision = "ieee"
            yield
        finally:
            for setting, value in zip(settings, before, strict=True):
                setting.fp32_precision = value
        return
    # PyTorch before the per-operator settings (2.9): the legacy flags.
    cudnn, cublas = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn, cublas


@functools.cache
def keep_host_heap() -> bool:
    """Make the host's C allocator (glibc) keep the memory it has taken for this process:
    tensors up to 1 GiB from its heap, and the heap never trimmed, so that a value freed
    and allocated again reuses pages already mapped (the module docstring). The process
    keeps its peak heap, as PyTorch's CUDA allocator keeps its peak on a GPU. Once per
    process; False where the C library has no ``mallopt`` (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    return bool(mmap and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))


@contextmanager
def measuring() -> Iterator[None]:
    """The conditions the profiler and the executor both time under, so that a plan's
    measured time is comparable to its profiled costs: the host heap kept
    (``keep_host_heap``), no cyclic garbage collection (``gc_paused``), float32 in IEEE
    precision on CUDA (``ieee_fp32``), and no autograd recording (``torch.no_grad``: the
    kernels' rules compute every gradient, and a rule that differentiates through
    autograd enables it for itself)."""
    keep_host_heap()
    with gc_paused(), ieee_fp32(), torch.no_grad():
        yield


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while timing: its pauses land on random operations
    (the profiler and the executor both time under it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
