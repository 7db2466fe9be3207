"""The executor's measured energy: none without counters (with the reason), and with a
counter the joules its measured runs drew, per run, a counter shared by devices counted
once."""

from __future__ import annotations

import statistics
import time

import onnx
import pytest

pytest.importorskip("torch", reason="the agent extra (torch) is not installed")

from agents.energy_counters import rapl_counter
from agents.executor import execute
from remat import samples
from remat.agent_protocol import ExecutionResult
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.graph import Graph, Mode
from remat.onnx_ingest import forward_graph
from remat.plan import Compute, Copy, Plan, PlanDevice
from remat.strategies import Problem, run_strategy
from remat.training import for_mode

CPU0 = Device("cpu0", DeviceKind.CPU, {"threads": "1"})
CPU1 = Device("cpu1", DeviceKind.CPU, {"threads": "1"})
WATTS = 40.0


class FakeCounter:
    """A counter drawing a constant ``watts`` since it was made, on ``time.perf_counter``;
    it records the times it was read."""

    def __init__(self, description: str, watts: float = WATTS, update_s: float = 0.0) -> None:
        self._description = description
        self.watts = watts
        self.update_s = update_s
        self.start = time.perf_counter()
        self.reads: list[float] = []

    @property
    def description(self) -> str:
        return self._description

    def joules(self) -> float:
        now = time.perf_counter()
        self.reads.append(now)
        return (now - self.start) * self.watts


def _model_graph_plan(devices: list[Device]) -> tuple[onnx.ModelProto, Graph, Plan]:
    model = samples.chain(4, batch=2)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    problem = Problem(graph, analytical_costs(graph, devices), {devices[0].name: None})
    result = run_strategy("checkpoint_all", problem, devices[0].name)
    assert result.plan is not None, result.message
    return model, graph, result.plan


def _split(plan: Plan) -> Plan:
    """``plan`` (on cpu0) with its first compute step moved to cpu1 and its value copied
    back, so that both devices run."""
    steps = list(plan.steps)
    first = next(i for i, s in enumerate(steps) if isinstance(s, Compute))
    step = steps[first]
    assert isinstance(step, Compute)
    steps[first : first + 1] = [
        Compute(step.stage, step.node, "cpu1"),
        Copy(step.stage, step.node, "cpu1", "cpu0"),
    ]
    devices = (*plan.devices, PlanDevice.of(CPU1, None))
    return Plan(plan.strategy, devices, tuple(steps))


def test_without_counters_there_is_no_energy_and_the_note_says_why() -> None:
    counter, reason = rapl_counter()
    if counter is not None:
        pytest.skip("this machine has readable RAPL counters")
    model, graph, plan = _model_graph_plan([CPU0])
    report = execute(model, graph, plan, [CPU0])
    assert report.gradients_match is True
    assert report.energy_mj is None
    assert reason and reason in report.energy_note and "cpu0" in report.energy_note
    document = report.to_json()
    assert "energy_mj" not in document["measured"]
    assert document["measured"]["energy_note"] == report.energy_note
    assert document["predicted"]["energy_mj"] == plan.predicted.energy_mj
    ExecutionResult.model_validate(document)  # what the server takes


def test_an_injected_counter_gives_the_energy_per_measured_run() -> None:
    model, graph, plan = _model_graph_plan([CPU0])
    counter = FakeCounter("fake package")
    report = execute(
        model,
        graph,
        plan,
        [CPU0],
        warmup=1,
        repeats=3,
        energy_counters={"cpu0": counter},
    )
    assert report.energy_mj is not None
    assert len(counter.reads) == 2  # before and after the measured runs only
    window_ms = (counter.reads[1] - counter.reads[0]) * 1e3
    # The reading is the counter's advance over the measured runs' loop, per run.
    assert report.energy_mj == pytest.approx(WATTS * window_ms / 3, rel=1e-9)
    # The loop covers the timed runs, and not much more than them.
    assert window_ms >= sum(report.runs_ms)
    per_run_ms = statistics.mean(report.runs_ms)
    assert WATTS * per_run_ms <= report.energy_mj <= WATTS * (per_run_ms + 1000)
    assert report.energy_note.startswith("fake package (cpu0): over 3 run(s)")
    measured = report.to_json()["measured"]
    assert measured["energy_mj"] == report.energy_mj
    assert measured["energy_note"] == report.energy_note


def test_a_counter_that_moves_rarely_gets_runs_until_its_window() -> None:
    """A counter that moves every 30 ms (as NVML's every 100 ms) is read over at least ten
    of its updates: the executor makes more measured runs than asked until they span 0.3 s,
    and they all count."""
    model, graph, plan = _model_graph_plan([CPU0])
    counter = FakeCounter("coarse", update_s=0.03)
    report = execute(
        model, graph, plan, [CPU0], warmup=1, repeats=3, energy_counters={"cpu0": counter}
    )
    window_s = counter.reads[1] - counter.reads[0]
    assert window_s >= 10 * counter.update_s
    runs = len(report.runs_ms)
    assert runs > 3 and report.energy_note.startswith(f"coarse (cpu0): over {runs} run(s)")
    assert report.energy_mj == pytest.approx(WATTS * window_s * 1e3 / runs, rel=1e-9)
    assert report.gradients_match is True


def test_a_counter_shared_by_two_devices_counts_once() -> None:
    model, graph, plan = _model_graph_plan([CPU0, CPU1])
    split = _split(plan)
    shared = FakeCounter("fake socket")
    report = execute(
        model,
        graph,
        split,
        [CPU0, CPU1],
        repeats=2,
        energy_counters={"cpu0": shared, "cpu1": shared},
    )
    assert report.gradients_match is True
    assert len(shared.reads) == 2
    window_ms = (shared.reads[1] - shared.reads[0]) * 1e3
    assert report.energy_mj == pytest.approx(WATTS * window_ms / 2, rel=1e-9)
    assert report.energy_note.startswith("fake socket (cpu0, cpu1): over 2 run(s)")


def test_distinct_counters_add_up_and_a_device_without_one_is_named() -> None:
    model, graph, plan = _model_graph_plan([CPU0, CPU1])
    split = _split(plan)
    a, b = FakeCounter("fake a", 30.0), FakeCounter("fake b", 10.0)
    report = execute(
        model,
        graph,
        split,
        [CPU0, CPU1],
        energy_counters={"cpu0": a, "cpu1": b},
    )
    assert report.energy_mj is not None
    joules = (a.reads[1] - a.reads[0]) * 30.0 + (b.reads[1] - b.reads[0]) * 10.0
    assert report.energy_mj == pytest.approx(joules * 1e3, rel=1e-9)

    only = execute(
        model,
        graph,
        split,
        [CPU0, CPU1],
        energy_counters={"cpu0": FakeCounter("fake a"), "cpu1": None},
    )
    assert only.energy_mj is not None
    assert "fake a (cpu0)" in only.energy_note
    assert "not counted: cpu1: no energy counter was given" in only.energy_note


def test_a_counter_that_fails_to_read_drops_the_energy_not_the_run() -> None:
    class Broken(FakeCounter):
        def joules(self) -> float:
            raise OSError("gone")

    model, graph, plan = _model_graph_plan([CPU0])
    report = execute(
        model,
        graph,
        plan,
        [CPU0],
        energy_counters={"cpu0": Broken("broken")},
    )
    assert report.gradients_match is True
    assert report.energy_mj is None and "cannot be read: gone" in report.energy_note
