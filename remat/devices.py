"""Devices and memory sizes as users write them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum

from remat.errors import InvalidInputError


class DeviceKind(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


class Tier(StrEnum):
    """Where a device's tensors can go and come back from, on a transfer lane beside its
    compute: its host's memory (offloading, Beaumont et al.) or the node's secondary
    storage (paging, PORT)."""

    HOST = "host"
    STORAGE = "storage"


_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class NumberOption:
    """A numeric device option and its range: bounds that no real device reaches, so that
    a typo or an absurd value is refused instead of poisoning the cost model."""

    low: float
    high: float
    integer: bool = False
    low_open: bool = False  # the value must be above ``low``, not equal to it

    def rule(self) -> str:
        if self.integer:
            return f"an integer from {self.low:g} to {self.high:g}"
        above = "above" if self.low_open else "at least"
        return f"a finite number {above} {self.low:g} and at most {self.high:g}"


# Every option a device understands (``Device``, the analytical cost model, the agents).
NUMBER_OPTIONS: dict[str, NumberOption] = {
    "threads": NumberOption(1, 1024, integer=True),  # CPU threads
    "index": NumberOption(0, 1023, integer=True),  # CUDA device index
    "flops": NumberOption(0, 1e18, low_open=True),  # FLOP/s
    "bandwidth": NumberOption(0, 1e15, low_open=True),  # memory bandwidth, B/s
    "launch_us": NumberOption(0, 1e6, low_open=True),  # launch overhead, microseconds
    "host_bandwidth": NumberOption(0, 1e15, low_open=True),  # link to host memory, B/s
    "host_latency_us": NumberOption(0, 1e6),  # per transfer to or from the host, microseconds
    "storage_write_bandwidth": NumberOption(0, 1e15, low_open=True),  # paging out, B/s
    "storage_read_bandwidth": NumberOption(0, 1e15, low_open=True),  # paging in, B/s
    "storage_latency_us": NumberOption(0, 1e6),  # per page out or in, microseconds
    "idle_w": NumberOption(0, 1e6),  # power drawn idle, watts (remat.energy)
    "busy_w": NumberOption(0, 1e6),  # power drawn computing beyond idle, watts
}
TEXT_OPTIONS: dict[str, int] = {"model": 128}  # free text (a GPU's model name): max length
# Sizes in bytes (``parse_size``: ``268435456``, ``256MiB``, ``2GiB``; no percentages).
# ``memory``: what the node's agent may hold on the device; its executor and profiler never
# hold more (a smaller device emulated on a CPU; a share of a GPU).
SIZE_OPTIONS = ("memory",)
# Names: ``pool``, the memory pool a device shares with others (PORT-M's unified memory: a
# CPU and an integrated GPU); a budget is then the pool's, for all its devices at once.
NAME_OPTIONS = ("pool",)
OPTION_KEYS = (*NUMBER_OPTIONS, *SIZE_OPTIONS, *TEXT_OPTIONS, *NAME_OPTIONS)
_INTEGER = re.compile(r"[0-9]+")
_PRINTABLE = re.compile(r"[^\x00-\x1f\x7f]*")


def check_option(key: str, value: str) -> None:
    """``InvalidInputError`` naming the option and its rule (never the value) when
    ``key=value`` is not an option a device understands, in its range."""
    if key in SIZE_OPTIONS:
        if len(value) > 64 or option_bytes(value) is None:
            raise InvalidInputError(
                f"device option {key} must be a size in bytes above 0 (e.g. 268435456, "
                "256MiB, 2GiB), at most 1 EiB"
            )
        return
    if key in NAME_OPTIONS:
        if len(value) > 64 or not _NAME.fullmatch(value):
            raise InvalidInputError(
                f"device option {key} must be a name: a letter, then letters, digits, "
                "'_', '.' or '-', at most 64 characters"
            )
        return
    if key in TEXT_OPTIONS:
        if len(value) > TEXT_OPTIONS[key] or not _PRINTABLE.fullmatch(value):
            raise InvalidInputError(
                f"device option {key} must be printable text of at most "
                f"{TEXT_OPTIONS[key]} characters"
            )
        return
    option = NUMBER_OPTIONS.get(key)
    if option is None:
        raise InvalidInputError(
            f"unknown device option {key[:32]!r} (known: {', '.join(OPTION_KEYS)})"
        )
    text = value.strip()
    if option.integer:
        ok = len(text) <= 20 and bool(_INTEGER.fullmatch(text))
        number = float(int(text)) if ok else math.nan
    else:
        try:
            number = float(text) if len(text) <= 64 else math.nan
        except ValueError:
            number = math.nan
    above = number > option.low if option.low_open else number >= option.low
    if not (math.isfinite(number) and above and number <= option.high):
        raise InvalidInputError(f"device option {key} must be {option.rule()}")


class MemoryOptions:
    """What a device's options say of its memory, for a device of the cost model
    (``Device``) and of a plan (``remat.plan.PlanDevice``) alike."""

    name: str
    options: dict[str, str]

    @property
    def pool(self) -> str | None:
        """The memory pool it shares with other devices (option ``pool``), if any."""
        return self.options.get("pool")

    @property
    def memory_space(self) -> str:
        """Where its memory is counted: its pool, else itself."""
        return self.pool or self.name

    def host_offload_refusal(self) -> str | None:
        """Why offloading to its host frees none of its memory, where that is so: a device
        of a pool (an integrated GPU sharing the board's memory with its CPU) keeps a copy
        sent to the host in the pool."""
        if self.pool is None:
            return None
        return (
            f"{self.name}'s memory is pool {self.pool!r}, the host's: offloading there frees "
            "none of it; page to storage instead (port, or port_m over the pool)"
        )


@dataclass(frozen=True)
class Device(MemoryOptions):
    """A named compute unit. ``options`` are kind-specific (e.g. ``threads`` for a CPU)."""

    name: str
    kind: DeviceKind
    options: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def threads(self) -> int | None:
        value = self.options.get("threads")
        return int(value) if value is not None else None

    @property
    def memory_bytes(self) -> int | None:
        """The memory the agent may use on the device (option ``memory``); None: all."""
        value = self.options.get("memory")
        return option_bytes(value) if value is not None else None

    @property
    def has_own_memory(self) -> bool:
        """Its memory is apart from its host's: offloading to the host frees some. A CPU
        device's memory is the host's (offloading there only emulates a device), and so is
        a device's in a pool (``host_offload_refusal``)."""
        return self.kind is not DeviceKind.CPU and self.host_offload_refusal() is None


def with_option(device: Device, key: str, value: str) -> Device:
    """``device`` with option ``key`` set to ``value`` (checked)."""
    check_option(key, value)
    return Device(device.name, device.kind, {**device.options, key: value})


def parse_device(spec: str) -> Device:
    """Parse ``NAME:KIND[:key=value,...]``, e.g. ``cpu0:cpu:threads=2`` or ``cuda0:cuda``."""
    parts = spec.split(":", 2)
    if len(parts) < 2 or not _NAME.match(parts[0]):
        raise InvalidInputError(f"device {spec!r}: expected NAME:KIND[:key=value,...]")
    name, kind_text = parts[0], parts[1]
    try:
        kind = DeviceKind(kind_text)
    except ValueError:
        kinds = ", ".join(k.value for k in DeviceKind)
        raise InvalidInputError(f"device {spec!r}: unknown kind {kind_text!r} ({kinds})") from None
    options: dict[str, str] = {}
    if len(parts) == 3 and parts[2]:
        for item in parts[2].split(","):
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise InvalidInputError(f"device {spec!r}: option {item!r} is not key=value")
            if key in options:
                raise InvalidInputError(f"device {spec!r}: option {key} is given twice")
            try:
                check_option(key, value)
            except InvalidInputError as exc:
                raise InvalidInputError(f"device {spec!r}: {exc}") from None
            options[key] = value
    return Device(name, kind, options)


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
MAX_BYTES = 1 << 60  # 1 EiB: above any device's memory, and far inside a 64-bit count
MAX_PERCENT = 1000.0


@dataclass(frozen=True)
class Size:
    """A memory budget: absolute bytes, or a percentage of a reference peak."""

    bytes: int | None = None
    percent: float | None = None

    def resolve(self, fixed_bytes: int, peak_bytes: int) -> int:
        """Bytes for this size. A percentage scales the *activation* part of the reference
        peak (peak minus fixed memory) and adds the fixed memory back, so that 100% is the
        checkpoint-all peak and every percentage leaves room for parameters and inputs
        (XEngine section 4.1: "the budget needed to save all tensors is 100%")."""
        if self.bytes is not None:
            return self.bytes
        assert self.percent is not None
        return fixed_bytes + round((peak_bytes - fixed_bytes) * self.percent / 100.0)


def parse_size(text: str) -> Size:
    """Parse ``123``, ``208MiB``, ``1.5GiB`` or ``65%``: at most ``MAX_BYTES``, or a
    percentage in (0, ``MAX_PERCENT``]. Errors quote at most 32 characters of ``text``."""
    shown = repr(text[:32]) + ("..." if len(text) > 32 else "")
    stripped = text.strip()
    if stripped.endswith("%"):
        try:
            percent = float(stripped[:-1]) if len(stripped) <= 32 else math.nan
        except ValueError:
            raise InvalidInputError(f"size {shown}: expected a number before '%'") from None
        if not 0 < percent <= MAX_PERCENT:  # also false for nan
            raise InvalidInputError(f"size {shown}: percentage must be in (0, {MAX_PERCENT:g}]")
        return Size(percent=percent)
    match = _SIZE.match(stripped)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise InvalidInputError(f"size {shown}: expected bytes, KiB, MiB, GiB, KB, MB, GB or %")
    digits = match.group(1)
    number = float(digits) * _UNITS[unit] if "." in digits else int(digits) * _UNITS[unit]
    if number > MAX_BYTES:  # also for a float that overflowed to inf
        raise InvalidInputError(f"size {shown}: at most {MAX_BYTES} bytes (1 EiB)")
    return Size(bytes=int(number))


def option_bytes(text: str) -> int | None:
    """A size option's bytes (``parse_size`` without percentages), or None where it is
    not one above 0."""
    try:
        size = parse_size(text)
    except InvalidInputError:
        return None
    return size.bytes if size.bytes else None


def parse_rate(text: str) -> float:
    """Parse a transfer rate: a size per second (``12GB/s``, ``900MiB/s``) or bytes per
    second (``12e9``); positive, at most ``host_bandwidth``'s bound."""
    shown = repr(text[:32]) + ("..." if len(text) > 32 else "")
    stripped = text.strip()
    body = stripped[:-2] if stripped.endswith("/s") else stripped
    try:
        rate = float(body) if len(body) <= 32 else math.nan
    except ValueError:
        try:
            size = parse_size(body)
        except InvalidInputError:
            raise InvalidInputError(
                f"rate {shown}: expected bytes per second, e.g. 12GB/s or 12e9"
            ) from None
        if size.bytes is None:
            raise InvalidInputError(f"rate {shown}: a percentage is not a rate") from None
        rate = float(size.bytes)
    bound = NUMBER_OPTIONS["host_bandwidth"].high
    if not (math.isfinite(rate) and 0 < rate <= bound):
        raise InvalidInputError(f"rate {shown}: must be positive and at most {bound:g} B/s")
    return rate


def format_bytes(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(value) < 1024 or unit == "EiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
