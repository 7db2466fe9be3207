"""Energy as a measured cost: the counters' readers (RAPL on a tree of files like the
powercap sysfs one, wrap-around included), the measurement of a node's energy (idle power
subtracted, per run), and the profiler's energy pass: measured where this machine has
counters, the power model's with the reason where it has none."""

from __future__ import annotations

import time
import weakref
from pathlib import Path

import onnx
import pytest

pytest.importorskip("torch", reason="the agent extra (torch) is not installed")
import torch

from agents import energy_counters
from agents.energy_counters import (
    counter_for,
    energy_per_run_mj,
    idle_watts,
    rapl_counter,
)
from agents.profiler import profile
from agents.torch_devices import runtime_of
from remat import samples
from remat.costs import CostTable, profiled_costs
from remat.devices import Device, DeviceKind
from remat.graph import Graph, Mode
from remat.onnx_ingest import forward_graph
from remat.training import for_mode

CPU0 = Device("cpu0", DeviceKind.CPU, {"threads": "1"})
CPU1 = Device("cpu1", DeviceKind.CPU, {"threads": "2"})
MAX_UJ = 262_143_328_850  # a typical package's max_energy_range_uj


# --- RAPL on a tree of files --------------------------------------------------------------


def zone(root: Path, name: str, label: str, energy_uj: int, max_uj: int = MAX_UJ) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "name").write_text(f"{label}\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return path


def set_energy(zone_path: Path, energy_uj: int) -> None:
    (zone_path / "energy_uj").write_text(f"{energy_uj}\n")


def test_rapl_sums_the_packages_and_ignores_subzones_and_psys(tmp_path: Path) -> None:
    package0 = zone(tmp_path, "intel-rapl:0", "package-0", 1_000_000)
    package1 = zone(tmp_path, "intel-rapl:1", "package-1", 5_000_000)
    core = zone(tmp_path, "intel-rapl:0:0", "core", 0)  # a subzone: inside package-0
    psys = zone(tmp_path, "intel-rapl:2", "psys", 0)  # the platform: includes the packages
    mmio = zone(tmp_path, "intel-rapl-mmio:0", "package-0", 0)  # the same package again
    counter, what = rapl_counter(tmp_path)
    assert counter is not None and what == ""
    assert counter.description == "RAPL package-0, package-1"
    start = counter.joules()
    set_energy(package0, 3_500_000)  # +2.5 J
    set_energy(package1, 6_000_000)  # +1 J
    for other in (core, psys, mmio):
        set_energy(other, 99_000_000)
    assert counter.joules() - start == pytest.approx(3.5)


def test_rapl_adds_the_range_back_when_a_counter_wraps(tmp_path: Path) -> None:
    package = zone(tmp_path, "intel-rapl:0", "package-0", 9_000_000, max_uj=10_000_000)
    counter, _ = rapl_counter(tmp_path)
    assert counter is not None
    start = counter.joules()
    set_energy(package, 500_000)  # 1 J to the top, wrapped, then 0.5 J
    assert counter.joules() - start == pytest.approx(1.5)
    set_energy(package, 2_500_000)  # no wrap: +2 J
    assert counter.joules() - start == pytest.approx(3.5)
    set_energy(package, 2_000_000)  # wrapped again, all but 0.5 J of the range
    assert counter.joules() - start == pytest.approx(3.5 + 9.5)


def test_rapl_without_counters_says_why(tmp_path: Path) -> None:
    counter, why = rapl_counter(tmp_path / "powercap")
    assert counter is None and why == f"no RAPL counters: {tmp_path / 'powercap'} is missing"
    counter, why = rapl_counter(tmp_path)
    assert counter is None and why.startswith("no RAPL counters: no intel-rapl package zones")


def test_an_unreadable_energy_file_is_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """energy_uj is root's only since Linux 5.10; root reads a chmod 0 file anyway, so the
    refusal is simulated where the reader opens it."""
    package = zone(tmp_path, "intel-rapl:0", "package-0", 1)
    read = energy_counters._read_number

    def refusing(path: Path) -> int:
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return read(path)

    monkeypatch.setattr(energy_counters, "_read_number", refusing)
    counter, why = rapl_counter(tmp_path)
    assert counter is None
    assert why == f"{package / 'energy_uj'} is not readable (needs root or a udev rule)"


def test_a_broken_energy_file_is_the_reason(tmp_path: Path) -> None:
    package = zone(tmp_path, "intel-rapl:0", "package-0", 1)
    (package / "energy_uj").write_text("not a number\n")
    counter, why = rapl_counter(tmp_path)
    assert counter is None and why.startswith(f"{package / 'energy_uj'} cannot be read")


def test_a_gpu_without_nvml_has_no_counter_and_says_why() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: NVML may well work here")
    counter, why = energy_counters.nvml_counter(torch.device("cuda", 0))
    assert counter is None
    assert why.startswith(("NVML is not usable", "nvidia-ml-py is not installed")), why


# --- the measurement, on a fake clock ------------------------------------------------------


class FakeMachine:
    """A clock and an energy counter advancing together: ``idle_w`` always, ``busy_w``
    more while work runs."""

    description = "fake"
    update_s = 0.0

    def __init__(self, idle_w: float) -> None:
        self.idle_w = idle_w
        self.now = 0.0
        self.energy_j = 0.0
        self.runs = 0
        self.synchronized = 0

    def joules(self) -> float:
        return self.energy_j

    def clock(self) -> float:
        return self.now

    def elapse(self, seconds: float, extra_w: float = 0.0) -> None:
        self.now += seconds
        self.energy_j += (self.idle_w + extra_w) * seconds

    def synchronize(self) -> None:
        self.synchronized += 1


class Token:
    pass


def test_a_run_s_energy_is_the_counter_less_idle_over_the_runs() -> None:
    machine = FakeMachine(idle_w=30.0)
    held: list[weakref.ref[Token]] = []

    def work() -> Token:
        # One result at a time: the previous run's is gone before the next runs.
        assert all(ref() is None for ref in held)
        machine.runs += 1
        machine.elapse(0.004, extra_w=50.0)  # 4 ms at 50 W above idle: 200 mJ
        token = Token()
        held.append(weakref.ref(token))
        return token

    result, mj = energy_per_run_mj(
        machine, work, 30.0, run_ms=4.0, synchronize=machine.synchronize, clock=machine.clock
    )
    assert isinstance(result, Token)
    assert mj == pytest.approx(200.0)
    assert machine.runs == 5  # 20 ms of 4 ms runs, in one batch
    assert machine.synchronized == 2  # before the first reading and before the last


def test_short_runs_loop_for_the_window_and_long_ones_run_three_times() -> None:
    machine = FakeMachine(idle_w=10.0)

    def short() -> None:
        machine.runs += 1
        machine.elapse(0.0001, extra_w=20.0)  # 2 mJ

    _, mj = energy_per_run_mj(machine, short, 10.0, clock=machine.clock)  # no time known
    assert mj == pytest.approx(2.0)
    assert 200 <= machine.runs <= 210  # 20 ms of 0.1 ms runs, the batch grown to fit

    machine.runs = 0

    def long() -> None:
        machine.runs += 1
        machine.elapse(0.1, extra_w=5.0)

    _, mj = energy_per_run_mj(machine, long, 10.0, run_ms=100.0, clock=machine.clock)
    assert machine.runs == 3 and mj == pytest.approx(500.0)


def test_energy_below_the_idle_baseline_is_zero() -> None:
    machine = FakeMachine(idle_w=10.0)
    _, mj = energy_per_run_mj(
        machine, lambda: machine.elapse(0.01), 12.0, run_ms=10.0, clock=machine.clock
    )
    assert mj == 0.0


def test_idle_power_is_the_median_rate_over_sleeps() -> None:
    machine = FakeMachine(idle_w=0.0)
    powers = iter([40.0, 100.0, 42.0])
    slept = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        machine.elapse(seconds, extra_w=next(powers))

    assert idle_watts(machine, sleep=sleep, clock=machine.clock) == pytest.approx(42.0)
    assert slept == [0.5, 0.5, 0.5]


# --- the profiler ---------------------------------------------------------------------------


def small_training() -> tuple[onnx.ModelProto, Graph]:
    model = samples.transformer_block(batch=1)
    return model, for_mode(forward_graph(model), Mode.TRAINING)


def test_without_counters_the_table_keeps_the_power_model_and_says_why() -> None:
    """This machine's CPU device (its RAPL counters, where it has them)."""
    counter, why = counter_for(runtime_of(CPU0))
    if counter is not None:
        pytest.skip(f"this machine has energy counters ({why}): the measuring test runs")
    model, graph = small_training()
    progress: list[tuple[int, int]] = []
    table = profile(
        model, graph, [CPU0], repeats=1, warmup=0, on_progress=lambda *p: progress.append(p)
    )
    (device,) = table.devices
    assert device.energy == "model" and device.idle_w is None
    assert device.model_extra == {"energy_note": why}
    assert why  # e.g. "no RAPL counters: /sys/class/powercap is missing"
    assert all(entry.energy_mj == {} for entry in table.nodes.values())
    # one measured pass and the executor's runs of it (1 unmeasured + 1): no energy pass
    assert progress[-1] == (3 * len(graph), 3 * len(graph))
    energy = profiled_costs(graph, table).energy_model()
    assert energy.measured == (False,)
    again = CostTable.model_validate_json(table.model_dump_json())
    assert again.devices[0].model_extra == {"energy_note": why}  # kept through JSON


def _devices_with_counters() -> list[Device]:
    devices = [CPU0]
    if torch.cuda.is_available():
        devices.append(Device("cuda0", DeviceKind.CUDA))
    return devices


@pytest.mark.parametrize("device", _devices_with_counters(), ids=lambda d: d.name)
def test_energy_is_measured_where_this_machine_has_counters(device: Device) -> None:
    counter, why = counter_for(runtime_of(device))
    if counter is None:
        pytest.skip(f"no energy counters on this machine: {why}")
    model, graph = small_training()
    table = profile(model, graph, [device], repeats=3, warmup=1)
    (entry,) = table.devices
    assert entry.energy == "measured"
    assert entry.idle_w is not None and entry.idle_w >= 0
    assert entry.model_extra == {"energy_note": why}
    energies = [table.nodes[n.name].energy_mj[device.name] for n in graph.nodes]
    assert all(mj >= 0 for mj in energies)
    assert sum(energies) > 0  # a training step draws more than idle
    energy = profiled_costs(graph, table).energy_model()
    assert energy.measured == (True,)
    assert energy.idle_w == (entry.idle_w,)
    assert energy.q_mj[:, 0].tolist() == pytest.approx(energies)


class ProcessTimeCounter:
    """A stand-in counter for the profiler's plumbing: 50 W while this process uses a CPU
    (its CPU time), nothing while it sleeps. Not a measurement of anything."""

    description = "process time at 50 W"

    def __init__(self, update_s: float = 0.0) -> None:
        self.update_s = update_s

    def joules(self) -> float:
        return 50.0 * time.process_time()


def test_the_energy_pass_fills_the_table_counts_progress_and_keeps_the_model_elsewhere() -> None:
    model, graph = small_training()
    progress: list[tuple[int, int]] = []
    table = profile(
        model,
        graph,
        [CPU0, CPU1],
        repeats=2,
        warmup=0,
        on_progress=lambda *p: progress.append(p),
        energy_counters={"cpu0": ProcessTimeCounter(), "cpu1": None},
    )
    cpu0, cpu1 = table.devices
    assert cpu0.energy == "measured" and cpu0.idle_w is not None and cpu0.idle_w < 5.0
    assert cpu0.model_extra == {"energy_note": "process time at 50 W"}
    assert cpu1.energy == "model" and cpu1.idle_w is None
    assert cpu1.model_extra == {"energy_note": "no energy counter was given for this device"}
    energies = [table.nodes[n.name].energy_mj for n in graph.nodes]
    assert all(set(e) == {"cpu0"} and e["cpu0"] >= 0 for e in energies)
    assert sum(e["cpu0"] for e in energies) > 0
    # (0 warm-up + 2 measured) passes per device, a copy pass each, the executor's runs
    # of each pass (1 unmeasured + 2), one energy pass.
    total = len(graph) * (2 * 2 + 2 + 2 * 3 + 1)
    assert progress[0] == (0, total) and progress[-1] == (total, total)
    energy = profiled_costs(graph, table).energy_model()
    assert energy.measured == (True, False)
    assert energy.idle_w[0] == cpu0.idle_w


def test_a_counter_too_coarse_for_one_node_measures_the_pass_plan() -> None:
    """A counter that moves every 50 ms (as NVML's every 100 ms) cannot time one node in a
    loop of 20 ms: the device's pass plan runs in a loop of half a second instead, and its
    energy per run is split over the nodes in proportion to their times."""
    model, graph = small_training()
    progress: list[tuple[int, int]] = []
    table = profile(
        model,
        graph,
        [CPU0],
        repeats=2,
        warmup=0,
        on_progress=lambda *p: progress.append(p),
        energy_counters={"cpu0": ProcessTimeCounter(update_s=0.05)},
    )
    assert table.devices[0].energy == "measured"
    entries = [table.nodes[n.name] for n in graph.nodes]
    energies = [e.energy_mj["cpu0"] for e in entries]
    assert sum(energies) > 0
    watts = [e.energy_mj["cpu0"] / e.compute_ms["cpu0"] for e in entries if e.compute_ms["cpu0"]]
    assert max(watts) == pytest.approx(min(watts), rel=1e-9)  # one power for the device
    assert progress[-1][0] == progress[-1][1]


def test_the_energy_pass_stays_within_the_device_s_memory() -> None:
    """Under a limit that makes the passes recompute, the energy pass holds no more than
    the limit either (the profiler's account would raise DeviceOutOfMemory)."""
    from remat.budgets import reference
    from remat.costs import analytical_costs

    model = samples.resnet18(batch=2, image=32, width=8)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    ref = reference(graph, analytical_costs(graph, [CPU0]))
    limit = ref.fixed_bytes + (ref.peak_bytes - ref.fixed_bytes) // 2
    progress: list[tuple[int, int]] = []
    table = profile(
        model,
        graph,
        [CPU0],
        repeats=1,
        warmup=0,
        memory_bytes={"cpu0": limit},
        on_progress=lambda *p: progress.append(p),
        energy_counters={"cpu0": ProcessTimeCounter()},
    )
    assert progress[-1][1] > 2 * len(graph)  # both passes recompute
    assert all("cpu0" in entry.energy_mj for entry in table.nodes.values())
    assert profiled_costs(graph, table).energy_model().measured == (True,)
