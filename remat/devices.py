"""Devices and memory sizes as users write them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from remat.errors import InvalidInputError


class DeviceKind(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Device:
    """A named compute unit. ``options`` are kind-specific (e.g. ``threads`` for a CPU)."""

    name: str
    kind: DeviceKind
    options: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def threads(self) -> int | None:
        value = self.options.get("threads")
        return int(value) if value is not None else None


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
            options[key] = value
    if "threads" in options and not options["threads"].isdigit():
        raise InvalidInputError(f"device {spec!r}: threads must be a positive integer")
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
    """Parse ``123``, ``208MiB``, ``1.5GiB`` or ``65%``."""
    stripped = text.strip()
    if stripped.endswith("%"):
        try:
            percent = float(stripped[:-1])
        except ValueError:
            raise InvalidInputError(f"size {text!r}: expected a number before '%'") from None
        if not 0 < percent <= 1000:
            raise InvalidInputError(f"size {text!r}: percentage must be in (0, 1000]")
        return Size(percent=percent)
    match = _SIZE.match(stripped)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise InvalidInputError(f"size {text!r}: expected bytes, KiB, MiB, GiB, KB, MB, GB or %")
    return Size(bytes=int(float(match.group(1)) * _UNITS[unit]))


def format_bytes(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
