"""Energy: each node's energy on each device, the devices' idle power, and the energy of a
plan (XEngine section 5.1: the cost q_{d,i} of eq. 17).

A plan's energy is what the machine draws while it runs:

    E = sum over compute steps of q_{d,i} + link_w * (copy and transfer time)
        + (sum over devices of idle_w + board_w) * T

where q_{d,i} is node i's dynamic energy on device d (above the device's idle draw: what a
profiler measures with the idle baseline subtracted), T the plan's time, and the static
term the idle power of every device of the machine plus the rest of the board, drawn for
the whole run whether a device computes or not. Units: W and ms, so energies are mJ.

Where no counter measured q_{d,i}, a power model gives it (``modelled_energy_mj``). Per
device kind, with options ``idle_w=`` and ``busy_w=`` overriding:

| kind | idle_w | busy_w                 |
|------|--------|------------------------|
| cpu  | 10 W   | 6 W per thread         |
| cuda | 50 W   | 250 W                  |

A node draws ``busy_w * (0.5 + 0.5 u)`` while it works, where ``u`` is its compute-bound
share (FLOP time over the larger of FLOP and memory time): arithmetic units at full rate
draw the most, a memory-bound kernel about half. During its launch overhead it draws a
tenth of ``busy_w``. Without FLOP counts (a profiled time), a node draws ``0.75 busy_w``
for its whole time. Copies and host transfers draw ``LINK_W`` while they run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from remat.devices import Device, DeviceKind, check_option

LINK_W = 10.0
"""Power drawn by a copy between devices or a transfer to host memory while it runs."""


@dataclass(frozen=True)
class PowerSpec:
    idle_w: float
    busy_w: float


KIND_POWER: dict[DeviceKind, PowerSpec] = {
    DeviceKind.CPU: PowerSpec(idle_w=10.0, busy_w=6.0),  # busy_w per thread
    DeviceKind.CUDA: PowerSpec(idle_w=50.0, busy_w=250.0),
}

MAX_POWER_W = 1e6  # no device or board draws a megawatt


def power_spec(device: Device) -> PowerSpec:
    """The device's idle and busy power: its options, else its kind's default."""
    base = KIND_POWER[device.kind]
    busy = base.busy_w * (device.threads or 1) if device.kind is DeviceKind.CPU else base.busy_w
    return PowerSpec(
        idle_w=_watts(device, "idle_w", base.idle_w),
        busy_w=_watts(device, "busy_w", busy),
    )


def _watts(device: Device, key: str, default: float) -> float:
    """Option ``key`` in watts, checked by the rule every device option follows
    (``remat.devices.NUMBER_OPTIONS``), else ``default``."""
    text = device.options.get(key)
    if text is None:
        return default
    check_option(key, text)
    return float(text)


@dataclass(frozen=True)
class Energy:
    """Per node per device dynamic energy ``q_mj[i, d]`` (mJ), each device's idle power,
    the board's (the rest of the machine), and per device whether counters measured its
    ``q_mj`` (empty: none did)."""

    q_mj: np.ndarray
    idle_w: tuple[float, ...]
    board_w: float = 0.0
    measured: tuple[bool, ...] = ()

    def measured_on(self, d: int) -> bool:
        return bool(self.measured) and self.measured[d]

    @property
    def static_w(self) -> float:
        """Drawn for the whole run: every device's idle power and the board's."""
        return float(sum(self.idle_w)) + self.board_w

    def draw_w(self, compute_ms: np.ndarray) -> np.ndarray:
        """Per node per device: the dynamic power while the node runs (W = mJ / ms)."""
        return np.divide(self.q_mj, compute_ms, out=np.zeros_like(self.q_mj), where=compute_ms > 0)


def modelled_energy_mj(
    devices: Sequence[Device],
    work_ms: np.ndarray,
    compute_bound: np.ndarray,
    launch_ms: np.ndarray,
) -> np.ndarray:
    """The power model's q[i, d] (module docstring): ``work_ms[i, d]`` the node's time
    beyond launch, ``compute_bound[i, d]`` its share ``u`` in [0, 1], ``launch_ms[d]``."""
    busy = np.array([power_spec(d).busy_w for d in devices])
    working = busy * (0.5 + 0.5 * compute_bound) * work_ms
    return working + 0.1 * busy * launch_ms


def timed_energy_mj(devices: Sequence[Device], compute_ms: np.ndarray) -> np.ndarray:
    """The power model's q[i, d] for measured times without FLOP counts: ``0.75 busy_w``."""
    busy = np.array([power_spec(d).busy_w for d in devices])
    return 0.75 * busy * compute_ms


def idle_power(devices: Sequence[Device]) -> tuple[float, ...]:
    return tuple(power_spec(d).idle_w for d in devices)
