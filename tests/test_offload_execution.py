"""The executor runs plans that offload to host memory (plan version 2): offload, prefetch
and wait on a transfer lane per device, beside the compute lane. Gradients stay those of
plain autograd, the measured peak stays within the budget and below checkpoint-all's, a
tensor is readable while it is being offloaded, and the lanes' threads end with the run,
on failure too."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import onnx
import pytest

pytest.importorskip("torch", reason="the agent extra (torch) is not installed")
import torch

from agents import executor
from agents.errors import DeviceOutOfMemory
from agents.executor import ExecutionReport, execute
from agents.program import Evaluator, Program, Value
from remat import samples
from remat.budgets import reference
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind, Size
from remat.graph import Graph, Mode, Node, NodeKind
from remat.onnx_ingest import forward_graph
from remat.plan import Compute, Copy, Free, Offload, Plan, PlanDevice, Prefetch, Step, Wait
from remat.strategies import Problem, run_strategy
from remat.training import for_mode

CPU0 = Device("cpu0", DeviceKind.CPU, {"threads": "1"})
CPU1 = Device("cpu1", DeviceKind.CPU, {"threads": "2"})
DEVICES = [CPU0, CPU1]
MODELS: dict[str, Callable[[], onnx.ModelProto]] = {
    "resnet18": lambda: samples.resnet18(batch=2, image=32, width=4),
    "vgg16": lambda: samples.vgg16(batch=2, image=32, width=4),
    "mobilenet_v1": lambda: samples.mobilenet_v1(batch=1, image=32, width=4),
    "chain": lambda: samples.chain(6, batch=2),
}


def _graph(model: onnx.ModelProto) -> Graph:
    return for_mode(forward_graph(model), Mode.TRAINING)


def _ops(plan: Plan) -> dict[str, int]:
    counts: dict[str, int] = {}
    for step in plan.steps:
        counts[step.op] = counts.get(step.op, 0) + 1
    return counts


def _lane_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "-lane" in t.name]


def _assert_correct(report: ExecutionReport, plan: Plan) -> None:
    assert report.gradients_match is True, report.max_rel_error
    assert len(report.step_ms) == len(plan.steps)
    assert report.total_ms > 0 and all(ms >= 0 for ms in report.step_ms)
    assert report.accounted_peak_bytes == report.peak_bytes  # CPU: the account
    assert not _lane_threads(), "the lanes' threads end with the run"


# --- a strategy's plan -------------------------------------------------------------------


@pytest.mark.parametrize(("family", "percent"), [("resnet18", 60), ("vgg16", 75)])
def test_offload_greedy_plans_train_in_less_memory_than_checkpoint_all(
    family: str, percent: float
) -> None:
    model = MODELS[family]()
    graph = _graph(model)
    costs = analytical_costs(graph, [CPU0])
    ref = reference(graph, costs)
    budget = Size(percent=percent).resolve(ref.fixed_bytes, ref.peak_bytes)
    assert budget < ref.peak_bytes
    result = run_strategy("offload_greedy", Problem(graph, costs, {"cpu0": budget}), "cpu0")
    assert result.plan is not None, result.message
    plan = result.plan
    ops = _ops(plan)
    assert ops["offload"] >= 1 and ops["prefetch"] >= 1
    assert ops["wait"] == ops["offload"] + ops["prefetch"]

    report = execute(model, graph, plan, [CPU0])
    _assert_correct(report, plan)
    assert report.peak_bytes["cpu0"] <= budget
    # The offloading strategies reserve a prefetch's memory from the step that issues it,
    # as the executor accounts it: the simulator's peak exactly.
    assert report.peak_bytes == report.predicted_peak_bytes

    unlimited = run_strategy("checkpoint_all", Problem(graph, costs, {"cpu0": None}), "cpu0")
    assert unlimited.plan is not None
    baseline = execute(model, graph, unlimited.plan, [CPU0])
    assert baseline.peak_bytes["cpu0"] == ref.peak_bytes
    assert report.peak_bytes["cpu0"] < baseline.peak_bytes["cpu0"]  # offloading saved memory


# --- hand-made plans -----------------------------------------------------------------------


def _reads(graph: Graph, step: Step, node: int, device: str) -> bool:
    if isinstance(step, Compute):
        return step.device == device and node in graph.nodes[step.node].deps
    return isinstance(step, Copy) and step.src == device and step.node == node


def _is_backward(graph: Graph, step: Step) -> bool:
    return isinstance(step, Compute) and graph.nodes[step.node].kind is NodeKind.BACKWARD


def _candidates(plan: Plan, graph: Graph, device: str) -> list[int]:
    """Values computed on ``device`` before the backward phase, read there by a forward
    node after they are computed and by a backward node later."""
    steps = plan.steps
    boundary = next(i for i, s in enumerate(steps) if _is_backward(graph, s))
    found = []
    for q, step in enumerate(steps[:boundary]):
        if isinstance(step, Compute) and step.device == device:
            readers = [i for i, s in enumerate(steps) if _reads(graph, s, step.node, device)]
            if any(q < i < boundary for i in readers) and any(i >= boundary for i in readers):
                found.append(step.node)
    return found


def _offloading(plan: Plan, graph: Graph, node: int, device: str, late: bool) -> Plan:
    """``plan`` with ``node`` offloaded from ``device`` right after it is computed, its
    device copy released after its last forward reader (``late``: just before the first
    backward step) and prefetched back just before its first backward reader."""
    steps = list(plan.steps)
    computed = next(
        i
        for i, s in enumerate(steps)
        if isinstance(s, Compute) and s.node == node and s.device == device
    )
    boundary = next(i for i, s in enumerate(steps) if _is_backward(graph, s))
    readers = [i for i, s in enumerate(steps) if _reads(graph, s, node, device)]
    back = next(i for i in readers if i >= boundary)
    release = boundary if late else max(i for i in readers if i < boundary) + 1
    stage = steps[computed].stage
    steps[back:back] = [Prefetch(stage, node, device), Wait(stage, node, device)]
    steps[release:release] = [Wait(stage, node, device)]
    steps[computed + 1 : computed + 1] = [Offload(stage, node, device)]
    return Plan("hand", plan.devices, tuple(steps))


def _checkpoint_all(graph: Graph, device: Device = CPU0) -> Plan:
    costs = analytical_costs(graph, [device])
    result = run_strategy("checkpoint_all", Problem(graph, costs, {device.name: None}), device.name)
    assert result.plan is not None, result.message
    return result.plan


def test_a_tensor_is_readable_while_it_is_offloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offload's copy cannot finish before the value's forward reader has run: the
    reader reads the leaving device copy, and the late wait blocks until the copy ends."""
    model = MODELS["chain"]()
    graph = _graph(model)
    base = _checkpoint_all(graph)
    node = _candidates(base, graph, "cpu0")[0]
    plan = _offloading(base, graph, node, "cpu0", late=True)
    offload = next(i for i, s in enumerate(plan.steps) if isinstance(s, Offload))
    wait = next(i for i, s in enumerate(plan.steps) if isinstance(s, Wait))
    reader = next(i for i in range(offload, wait) if _reads(graph, plan.steps[i], node, "cpu0"))
    reader_node = plan.steps[reader].node

    read = threading.Event()
    copies: list[bool] = []  # per copy on the lane: whether the reader had run before it
    original_clone = executor._cloned
    evaluator = Program.evaluator

    def gated_clone(value: Value) -> Value:
        if not copies:  # the offload: held until the reader has computed
            read.wait(timeout=10)
        copies.append(read.is_set())
        return original_clone(value)

    def noting(self: Program, index: int, in_place: bool = False) -> Evaluator:
        evaluate = evaluator(self, index, in_place)
        if index != reader_node:
            return evaluate

        def noted(*args: Any) -> Value:
            found = evaluate(*args)
            read.set()
            return found

        return noted

    monkeypatch.setattr(executor, "_cloned", gated_clone)
    monkeypatch.setattr(Program, "evaluator", noting)
    report = execute(model, graph, plan, [CPU0], warmup=0)
    # the offload, then the prefetch: in the measured run and in the one timing its steps
    assert copies == [True, True] * 2
    _assert_correct(report, plan)
    # Both count the value until the wait: the account is the simulator's.
    assert report.peak_bytes == report.predicted_peak_bytes


def test_a_slow_transfer_is_waited_for_by_its_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    model = MODELS["chain"]()
    graph = _graph(model)
    base = _checkpoint_all(graph)
    node = _candidates(base, graph, "cpu0")[0]
    plan = _offloading(base, graph, node, "cpu0", late=False)
    original_clone = executor._cloned
    finished = threading.Event()

    def slow_clone(value: Value) -> Value:
        finished.wait(timeout=0.2)  # 200 ms, unless set
        return original_clone(value)

    monkeypatch.setattr(executor, "_cloned", slow_clone)
    report = execute(model, graph, plan, [CPU0], warmup=0)
    _assert_correct(report, plan)
    kinds = [s.op for s in plan.steps]
    issued = [report.step_ms[i] for i, op in enumerate(kinds) if op in ("offload", "prefetch")]
    waited = [report.step_ms[i] for i, op in enumerate(kinds) if op == "wait"]
    assert max(issued) < 100 < min(waited)  # the compute lane blocked in the waits
    # The lane runs one transfer at a time, each 200 ms, and the run ends after the last
    # (the waits above come from the run that times steps, not the one ``total_ms`` times).
    assert report.total_ms >= 200 * len(issued)


def test_an_offload_never_waited_for_ends_with_the_run() -> None:
    """An offload of a value kept to the end (no free, no wait): the run waits for the
    transfer before it ends, and the value still counts."""
    model = MODELS["chain"]()
    graph = _graph(model)
    base = _checkpoint_all(graph)
    node = _candidates(base, graph, "cpu0")[0]
    steps = [s for s in base.steps if not (isinstance(s, Free) and s.node == node)]
    computed = steps.index(next(s for s in steps if isinstance(s, Compute) and s.node == node))
    steps.insert(computed + 1, Offload(steps[computed].stage, node, "cpu0"))
    plan = Plan("hand", base.devices, tuple(steps))
    report = execute(model, graph, plan, [CPU0], warmup=0)
    _assert_correct(report, plan)
    assert report.peak_bytes == report.predicted_peak_bytes


def test_a_failing_transfer_is_named_and_ends_the_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    model = MODELS["chain"]()
    graph = _graph(model)
    base = _checkpoint_all(graph)
    node = _candidates(base, graph, "cpu0")[0]
    plan = _offloading(base, graph, node, "cpu0", late=False)

    def failing(value: Value) -> Value:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")

    monkeypatch.setattr(executor, "_cloned", failing)
    wait = next(i for i, s in enumerate(plan.steps) if isinstance(s, Wait))
    with pytest.raises(DeviceOutOfMemory, match=rf"device 'cpu0' at step {wait} \(wait of"):
        execute(model, graph, plan, [CPU0], warmup=0)
    assert not _lane_threads()
    monkeypatch.undo()
    assert execute(model, graph, plan, [CPU0], warmup=0).gradients_match is True


# --- two emulated CPU devices ------------------------------------------------------------


def _split_plan(graph: Graph, home: Callable[[Node], str], devices: Sequence[Device]) -> Plan:
    """Every node once on its home device; a dependency resident elsewhere is copied in;
    every copy is freed after the value's last use (as in tests/test_executor.py)."""
    users = graph.users()
    resident: dict[str, set[int]] = {d.name: set() for d in devices}
    steps: list[Step] = []
    for node in graph.nodes:
        device = home(node)
        for dep in node.deps:
            if dep not in resident[device]:
                source = next(d for d, held in resident.items() if dep in held)
                steps.append(Copy(node.id, dep, source, device))
                resident[device].add(dep)
        steps.append(Compute(node.id, node.id, device))
        resident[device].add(node.id)
        for value in {*node.deps, node.id}:
            if max(users[value], default=-1) <= node.id:
                for name, held in resident.items():
                    if value in held:
                        steps.append(Free(node.id, value, name))
                        held.discard(value)
    return Plan("split", tuple(PlanDevice.of(d, None) for d in devices), tuple(steps))


def test_two_devices_offload_on_their_own_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Half the network on each emulated CPU device, each offloading two activations (one
    released late): the two lanes run at once, each in its own order, without CUDA."""

    def no_cuda(*args: object, **kwargs: object) -> None:
        raise AssertionError("a CPU run touched torch.cuda")

    for name in ("Stream", "Event", "current_stream", "stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    model = MODELS["mobilenet_v1"]()
    graph = _graph(model)
    cut = len(graph.forward_nodes()) // 2

    def home(node: Node) -> str:
        forward = node.forward if node.kind is NodeKind.BACKWARD else node.id
        return "cpu0" if node.kind is not NodeKind.LOSS and forward < cut else "cpu1"  # type: ignore[operator]

    plan = _split_plan(graph, home, DEVICES)
    for device in ("cpu0", "cpu1"):
        chosen = _candidates(plan, graph, device)
        assert len(chosen) >= 2, device
        plan = _offloading(plan, graph, chosen[0], device, late=True)
        plan = _offloading(plan, graph, chosen[-1], device, late=False)
    transfers = {(s.op, s.device) for s in plan.steps if isinstance(s, Offload | Prefetch)}
    assert transfers == {(op, d) for op in ("offload", "prefetch") for d in ("cpu0", "cpu1")}
    report = execute(model, graph, plan, DEVICES)
    _assert_correct(report, plan)
    assert report.peak_bytes == report.predicted_peak_bytes


# --- CUDA -----------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_device_offloads_through_pinned_buffers() -> None:  # pragma: no cover
    """offload_greedy's plan on a GPU: the transfers run on the lane's CUDA stream into
    pinned host buffers, the gradients are autograd's (against float64 within the CUDA
    tolerance), the executor's account is the simulator's peak, and what the allocator was
    asked for adds only the kernels' temporaries (within 1% or 1 MiB)."""
    cuda0 = Device("cuda0", DeviceKind.CUDA)
    model = MODELS["resnet18"]()
    graph = _graph(model)
    costs = analytical_costs(graph, [cuda0])
    ref = reference(graph, costs)
    budget = Size(percent=60).resolve(ref.fixed_bytes, ref.peak_bytes)
    result = run_strategy("offload_greedy", Problem(graph, costs, {"cuda0": budget}), "cuda0")
    assert result.plan is not None, result.message
    ops = _ops(result.plan)
    assert ops["offload"] >= 1 and ops["prefetch"] >= 1
    report = execute(model, graph, result.plan, [cuda0], repeats=2)
    assert report.gradients_match is True, (report.max_rel_error, report.tolerance)
    assert not _lane_threads(), "the lanes' threads end with the run"
    predicted = report.predicted_peak_bytes["cuda0"]
    assert report.accounted_peak_bytes["cuda0"] == predicted <= budget
    assert predicted <= report.peak_bytes["cuda0"] <= predicted + max(0.01 * predicted, 2**20)
