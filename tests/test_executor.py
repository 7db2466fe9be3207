"""The executor: scheduled training gives the gradients of plain autograd and the
simulator's peak memory on every device (exactly, on CPU); bad plans and devices are clear
errors; a device out of memory is a clear error."""

from __future__ import annotations

import ctypes
import io
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch", reason="the agent extra (torch) is not installed")
import torch

from agents import executor
from agents.errors import DeviceError, DeviceOutOfMemory, PlanRejectedError, UnsupportedOpError
from agents.executor import TOLERANCE, ExecutionReport, execute, max_relative_error
from agents.program import Evaluator, Program, Value, build_program
from agents.torch_devices import Runtime, detect_devices, ieee_fp32, keep_host_heap
from remat import samples
from remat.agent_protocol import ExecutionResult
from remat.budgets import reference
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind, Size
from remat.graph import Graph, Mode, Node, NodeKind
from remat.onnx_ingest import forward_graph
from remat.plan import Compute, Copy, Free, Plan, PlanDevice, Step
from remat.strategies import Problem, run_strategy
from remat.strategies.heuristics.placed import placed_greedy
from remat.training import for_mode, training_graph

from graphs import split_and_dropout

CPU0 = Device("cpu0", DeviceKind.CPU, {"threads": "1"})
CPU1 = Device("cpu1", DeviceKind.CPU, {"threads": "2"})
DEVICES = [CPU0, CPU1]
MODELS: dict[str, Callable[[], onnx.ModelProto]] = {
    "vgg16": lambda: samples.vgg16(batch=2, image=32, width=4),
    "resnet18": lambda: samples.resnet18(batch=2, image=32, width=4),
    "unet": lambda: samples.unet(batch=1, image=32, width=4, depth=2),
    "transformer": lambda: samples.transformer_block(batch=2),
    "mobilenet_v1": lambda: samples.mobilenet_v1(batch=1, image=32, width=4),
}


def _graph(model: onnx.ModelProto, mode: Mode = Mode.TRAINING) -> Graph:
    return for_mode(forward_graph(model), mode)


def _problem(
    graph: Graph,
    percent: float | None,
    devices: Sequence[str],
    known: Sequence[Device] = tuple(DEVICES),
) -> Problem:
    costs = analytical_costs(graph, known)
    budget = None
    if percent is not None:
        ref = reference(graph, costs)
        budget = Size(percent=percent).resolve(ref.fixed_bytes, ref.peak_bytes)
    return Problem(graph, costs, dict.fromkeys(devices, budget))


def _strategy_plan(
    graph: Graph,
    strategy: str,
    percent: float | None,
    device: str,
    known: Sequence[Device] = tuple(DEVICES),
) -> Plan:
    result = run_strategy(strategy, _problem(graph, percent, [device], known), device)
    assert result.plan is not None, result.message
    return result.plan


@pytest.mark.parametrize("percent", [100, 80])
def test_gradients_of_some_outputs_of_a_node_run_as_accounted(percent: int) -> None:
    """Backward values hold a gradient only for the float outputs a node reads (a part of a
    Split, not a Dropout's mask): the executor's values and account follow that layout to
    the byte and the gradients match autograd's."""
    model = split_and_dropout()
    graph = training_graph(forward_graph(model))
    plan = _strategy_plan(graph, "checkmate_milp", percent, "cpu0")
    _assert_matches(execute(model, graph, plan, DEVICES), plan, graph)


def _assert_matches(report: ExecutionReport, plan: Plan, graph: Graph) -> None:
    assert report.gradients_match is True
    assert report.max_rel_error is not None and report.max_rel_error <= 1e-4
    # CPU accounting is exact: the same bytes as the simulator, step for step, but for the
    # kernels' workspace (an attention's scores), which the replay charges while a node runs
    # and the account of the tensors does not see
    assert report.peak_bytes == _values_peak(plan, graph)
    assert all(report.peak_bytes[d] <= report.predicted_peak_bytes[d] for d in report.peak_bytes)
    assert report.accounted_peak_bytes == report.peak_bytes
    assert report.allocator_peak_bytes == {} and report.tolerance == TOLERANCE
    assert set(report.peak_bytes) == {d.name for d in plan.devices}
    assert len(report.step_ms) == len(plan.steps)
    assert report.total_ms > 0 and all(ms >= 0 for ms in report.step_ms)


def _values_peak(plan: Plan, graph: Graph) -> dict[str, int]:
    """The replay's peak of each device without the kernels' workspace."""
    without = replace(graph, nodes=tuple(replace(n, scratch_bytes=0) for n in graph.nodes))
    return executor.check_plan(plan, without).peak_bytes


def _recomputes(plan: Plan) -> bool:
    computes = [s.node for s in plan.steps if isinstance(s, Compute)]
    return len(computes) > len(set(computes))


# --- scheduled training ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "strategy", "percent", "device"),
    [
        ("vgg16", "checkpoint_all", 100, "cpu0"),
        ("vgg16", "chen_sqrt", None, "cpu0"),
        ("resnet18", "ap_sqrt", None, "cpu1"),
        ("unet", "linearized_greedy", 70, "cpu0"),
        ("transformer", "checkpoint_all", 100, "cpu1"),
    ],
)
def test_single_device_plans_give_autograds_gradients_and_the_simulators_peak(
    family: str, strategy: str, percent: float | None, device: str
) -> None:
    model = MODELS[family]()
    graph = _graph(model)
    plan = _strategy_plan(graph, strategy, percent, device)
    if strategy != "checkpoint_all":
        assert _recomputes(plan), "the case should exercise recomputation"
    report = execute(model, graph, plan, DEVICES)
    _assert_matches(report, plan, graph)


def _split_plan(
    graph: Graph, home: Callable[[Node], str], devices: Sequence[Device] = tuple(DEVICES)
) -> Plan:
    """Every node once on its home device; a dependency resident elsewhere is copied in;
    every copy is freed after the value's last use."""
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


@pytest.mark.parametrize("family", ["unet", "mobilenet_v1", "transformer"])
def test_a_plan_split_over_two_devices_matches(family: str) -> None:
    """First half of the forward pass (and its backward) on cpu0, the rest on cpu1:
    activations copy forward, gradients copy back."""
    model = MODELS[family]()
    graph = _graph(model)
    cut = len(graph.forward_nodes()) // 2

    def home(node: Node) -> str:
        forward = node.forward if node.kind is NodeKind.BACKWARD else node.id
        return "cpu0" if node.kind is not NodeKind.LOSS and forward < cut else "cpu1"  # type: ignore[operator]

    plan = _split_plan(graph, home)
    copies = {(s.src, s.dst) for s in plan.steps if isinstance(s, Copy)}
    assert copies == {("cpu0", "cpu1"), ("cpu1", "cpu0")}
    _assert_matches(execute(model, graph, plan, DEVICES), plan, graph)


def test_a_step_kind_this_agent_lacks_is_refused_before_any_step_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plan's steps are resolved before the run starts (``_Run._prepared``): a step
    the simulator accepted but this executor has no method for (here: copies, taken away)
    fails the run with its index before any node is computed."""
    model = MODELS["mobilenet_v1"]()
    graph = _graph(model)
    plan = _split_plan(graph, lambda n: "cpu0" if n.id % 2 else "cpu1")
    first = next(i for i, s in enumerate(plan.steps) if isinstance(s, Copy))
    original = executor._Run.__init__

    def without_copies(run: executor._Run, *args: object, **kwargs: object) -> None:
        original(run, *args, **kwargs)  # type: ignore[arg-type]
        del run.perform[Copy]

    computed: list[int] = []
    evaluator = Program.evaluator

    def counted(self: Program, node: int, in_place: bool = False) -> Evaluator:
        evaluate = evaluator(self, node, in_place)

        def noted(*args: Any) -> Value:
            computed.append(node)
            return evaluate(*args)

        return noted

    monkeypatch.setattr(executor._Run, "__init__", without_copies)
    monkeypatch.setattr(Program, "evaluator", counted)
    with pytest.raises(PlanRejectedError, match=rf"step {first}: unsupported step kind 'copy'"):
        execute(model, graph, plan, DEVICES)
    assert computed == []


def test_only_one_run_times_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured runs time the whole plan; one more run times each compute and copy
    step on its device (on CUDA that synchronises), for the report's step times."""
    model = MODELS["resnet18"]()
    graph = _graph(model)
    plan = _split_plan(graph, lambda n: "cpu0" if n.id % 2 else "cpu1")
    timed: list[str] = []
    original = Runtime.timed

    def counted(self: Runtime, work: Callable[[], object]) -> object:
        timed.append(self.name)
        return original(self, work)  # type: ignore[arg-type]

    monkeypatch.setattr(Runtime, "timed", counted)
    report = execute(model, graph, plan, DEVICES, warmup=1, repeats=3)
    assert len(timed) == sum(1 for s in plan.steps if isinstance(s, Compute | Copy))
    assert len(report.step_ms) == len(plan.steps) and len(report.runs_ms) == 3
    _assert_matches(report, plan, graph)


def test_a_run_starts_without_the_earlier_runs_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measured runs do not hold each other's values (a parameter's size each, so
    that 20 runs of ResNet-18 held 900 MB): only the last run's gradients are kept, for
    the check, while the run that times each step runs."""
    model = MODELS["resnet18"]()
    graph = _graph(model)
    plan = _strategy_plan(graph, "checkpoint_all", 100, "cpu0")
    earlier: list[weakref.ref[torch.Tensor]] = []
    held_at_start: list[int] = []
    original = executor._Run.run

    def run(self: executor._Run) -> executor._Result:
        held_at_start.append(sum(ref() is not None for ref in earlier))
        result = original(self)
        earlier.extend(weakref.ref(g) for g in result.gradients.values())
        return result

    monkeypatch.setattr(executor._Run, "run", run)
    report = execute(model, graph, plan, DEVICES, warmup=1, repeats=4)
    assert report.gradients_match is True
    gradients = len(report.gradients or {})
    assert gradients > 0
    assert held_at_start == [0, 0, 0, 0, 0, gradients]


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``: ``arena``, the heap's bytes; ``hblkhd``, mmapped blocks'."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def test_after_a_run_the_host_heap_keeps_large_tensors_and_their_pages() -> None:
    """The executor keeps the host heap (``keep_host_heap``): a 40 MiB tensor comes from
    the heap, not from a mapping of its own (glibc's default over 32 MiB, mapped anew and
    faulted in page by page at each allocation), and freeing it leaves the heap as large."""
    model = MODELS["vgg16"]()
    graph = _graph(model)
    execute(model, graph, _strategy_plan(graph, "checkpoint_all", 100, "cpu0"), DEVICES)
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if not keep_host_heap() or mallinfo2 is None:
        pytest.skip("the C library is not glibc 2.33 or later: its heap is its own")
    mallinfo2.restype = _MallInfo2
    before = mallinfo2()
    tensor = torch.ones((40 << 20) // 4)
    during = mallinfo2()
    assert during.hblkhd - before.hblkhd < tensor.nbytes // 2
    del tensor
    assert mallinfo2().arena >= during.arena


def test_a_multi_device_heuristic_plan_matches() -> None:
    model = MODELS["resnet18"]()
    graph = _graph(model)
    problem = _problem(graph, 40, ["cpu0", "cpu1"])
    result = placed_greedy(problem, time_budget_s=2.0, fit_budget_s=60.0)
    assert result.plan is not None, result.message
    plan = result.plan
    assert {s.device for s in plan.steps if isinstance(s, Compute)} == {"cpu0", "cpu1"}
    report = execute(model, graph, plan, DEVICES)
    _assert_matches(report, plan, graph)
    assert report.predicted_total_ms == plan.predicted.total_ms  # type: ignore[union-attr]


def test_inference_plan_reproduces_the_outputs() -> None:
    model = MODELS["resnet18"]()
    graph = _graph(model, Mode.INFERENCE)
    plan = _strategy_plan(graph, "checkpoint_all", 100, "cpu0")
    report = execute(model, graph, plan, DEVICES)
    assert report.gradients_match is None and report.max_rel_error is None
    assert report.gradients_vanish is None
    assert report.outputs_match is True
    assert report.peak_bytes == report.predicted_peak_bytes


def test_report_json_has_the_protocol_fields() -> None:
    model = samples.chain(4, batch=2)
    graph = _graph(model)
    plan = _strategy_plan(graph, "checkpoint_all", None, "cpu0")
    document = execute(model, graph, plan).to_json()
    assert set(document) == {
        "measured",
        "predicted",
        "gradients_match",
        "max_rel_error",
        "gradients_vanish",
    }
    assert {"total_ms", "peak_bytes", "step_ms", "energy_note"} <= set(document["measured"])
    assert set(document["measured"]) <= {
        "total_ms",
        "peak_bytes",
        "step_ms",
        "energy_note",
        "energy_mj",
    }
    assert set(document["predicted"]) == {"total_ms", "peak_bytes", "energy_mj"}
    assert document["gradients_match"] is True and document["gradients_vanish"] is False
    ExecutionResult.model_validate(document)  # what the server takes
    assert document["measured"]["peak_bytes"] == document["predicted"]["peak_bytes"]


def test_relative_error_sees_a_wrong_gradient() -> None:
    expected = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0, 0.0])}
    assert max_relative_error(expected, expected) == 0.0
    assert max_relative_error({**expected, "w": torch.tensor([1.0, 2.1])}, expected) > 1e-2
    assert max_relative_error({"w": expected["w"]}, expected) == float("inf")
    # an absolute floor: noise against noise is no error, a real difference still is
    noise = {"w": torch.tensor([1e-10, -2e-10])}
    assert max_relative_error({"w": torch.zeros(2)}, noise) == 1.0
    assert max_relative_error({"w": torch.zeros(2)}, noise, floor=1e-5) < 1e-4
    assert max_relative_error({"w": torch.tensor([1e-3, 0.0])}, noise, floor=1e-5) > 1


def _vanishing_model(columns: int = 10) -> onnx.ModelProto:
    """``softmax(x @ w + b)`` with every column of ``w`` and ``b`` the same: the softmax is
    uniform for any input, and the loss's gradient at it is uniform too, so every exact
    gradient is zero. fp32 autograd returns rounding noise (the softmax's entries do not
    sum to exactly 1 for 10 columns); the plan's kernels may return other noise, or 0."""
    w = numpy_helper.from_array(np.full((32, columns), 0.37, dtype=np.float32), "w")
    b = numpy_helper.from_array(np.full((columns,), 0.11, dtype=np.float32), "b")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["z0"], name="matmul"),
        helper.make_node("Add", ["z0", "b"], ["z"], name="add"),
        helper.make_node("Softmax", ["z"], ["y"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "vanishing",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, columns])],
        [w, b],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _perturbed(monkeypatch: pytest.MonkeyPatch, name: str, change: float) -> None:
    """The executor's measured gradient of ``name`` off by ``change`` in one entry."""
    original = executor._Run._gradients

    def gradients(run: executor._Run) -> dict[str, torch.Tensor]:
        found = original(run)
        wrong = found[name].clone()
        wrong.view(-1)[0] += change
        return {**found, name: wrong}

    monkeypatch.setattr(executor._Run, "_gradients", gradients)


def test_vanishing_gradients_match_and_are_reported() -> None:
    model = _vanishing_model()
    graph = _graph(model)
    plan = _strategy_plan(graph, "checkpoint_all", None, "cpu0")
    report = execute(model, graph, plan, DEVICES)
    assert report.gradients_match is True, report.max_rel_error
    assert report.max_rel_error is not None and report.max_rel_error <= TOLERANCE
    assert report.gradients_vanish is True
    document = report.to_json()
    assert document["gradients_vanish"] is True
    assert ExecutionResult.model_validate(document).gradients_vanish is True
    # the float64 reference is zero up to its own rounding: the gradients vanish indeed
    program = build_program(model, graph)
    exact = program.in_float64().reference_gradients()
    assert {"w", "b"} <= set(exact) and max(float(g.abs().max()) for g in exact.values()) < 1e-15


@pytest.mark.parametrize("change", [1e-3, 1e-6])
def test_a_wrong_gradient_of_a_vanishing_model_still_fails(
    monkeypatch: pytest.MonkeyPatch, change: float
) -> None:
    """Where every gradient is zero, a gradient that is not (even one entry of 1e-6) is
    wrong: the floor is fp32's own noise (about 1e-10 here), not a relative scale."""
    model = _vanishing_model()
    graph = _graph(model)
    plan = _strategy_plan(graph, "checkpoint_all", None, "cpu0")
    _perturbed(monkeypatch, "w", change)
    report = execute(model, graph, plan, DEVICES)
    assert report.gradients_match is False
    assert report.max_rel_error is not None and report.max_rel_error > 100 * TOLERANCE
    assert report.gradients_vanish is True  # a property of the model, not of the run


def test_a_wrong_gradient_of_an_ordinary_model_still_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = MODELS["transformer"]()
    graph = _graph(model)
    plan = _strategy_plan(graph, "checkpoint_all", 100, "cpu0")
    program = build_program(model, graph)
    name, largest = max(
        ((n, g) for n, g in program.reference_gradients().items() if g.numel()),
        key=lambda item: float(item[1].abs().max()),
    )
    _perturbed(monkeypatch, name, 1e-2 * float(largest.abs().max()))  # off by 1%
    report = execute(model, graph, plan, DEVICES)
    assert report.gradients_match is False and report.gradients_vanish is False
    assert report.max_rel_error is not None and report.max_rel_error > 1e-3


# --- refusals and faults -------------------------------------------------------------------


def _chain_plan() -> tuple[onnx.ModelProto, Graph, Plan]:
    model = samples.chain(4, batch=2)
    graph = _graph(model)
    return model, graph, _strategy_plan(graph, "checkpoint_all", None, "cpu0")


def test_a_plan_the_simulator_rejects_is_refused() -> None:
    model, graph, plan = _chain_plan()
    first_free = next(i for i, s in enumerate(plan.steps) if isinstance(s, Free))
    twice = (*plan.steps[: first_free + 1], *plan.steps[first_free:])
    broken = Plan(plan.strategy, plan.devices, twice)
    with pytest.raises(PlanRejectedError, match="double free"):
        execute(model, graph, broken, DEVICES)
    small = Plan(plan.strategy, (PlanDevice("cpu0", DeviceKind.CPU, 1000),), plan.steps)
    with pytest.raises(PlanRejectedError, match="over the budget"):
        execute(model, graph, small, DEVICES)


def test_a_plan_for_another_graph_is_refused_before_it_runs() -> None:
    """An agent whose graph of the model is not the server's (another remat version's
    ingestion, other options) refuses the plan by its recorded graph, not at the first step
    that reads what this graph does not hold."""
    _, graph, plan = _chain_plan()
    assert plan.graph == graph.fingerprint
    longer = samples.chain(5, batch=2)
    with pytest.raises(PlanRejectedError, match=r"made for another graph \(\d+ nodes, sha256:"):
        execute(longer, _graph(longer), plan, DEVICES)


def _pooled_resnet() -> tuple[onnx.ModelProto, Graph, Plan, Plan]:
    """ResNet-18's checkpoint-all plan on cpu0, and the same steps with every other node
    on cpu1, both devices in one pool."""
    model = MODELS["resnet18"]()
    graph = _graph(model)
    plan = _strategy_plan(graph, "checkpoint_all", 100, "cpu0")
    pooled = tuple(
        PlanDevice(d.name, DeviceKind.CPU, None, {**d.options, "pool": "ram"}) for d in DEVICES
    )
    steps = tuple(
        Compute(s.stage, s.node, "cpu1") if isinstance(s, Compute) and s.node % 2 else s
        for s in plan.steps
    )
    return model, graph, plan, Plan(plan.strategy, pooled, steps)


def test_a_plan_over_two_devices_of_one_pool_shares_their_tensors() -> None:
    """Every other node on the pool's second device, no copies: it reads the first's
    tensors, the pool holds each tensor and parameter once, as the simulator counts."""
    model, graph, plan, shared = _pooled_resnet()
    report = execute(model, graph, shared, DEVICES)
    _assert_matches(report, shared, graph)
    assert report.peak_bytes["cpu0"] == report.peak_bytes["cpu1"]
    alone = execute(model, graph, plan, DEVICES)
    assert report.peak_bytes["cpu0"] == alone.peak_bytes["cpu0"]  # the same tensors, once
    mixed = (
        PlanDevice("cpu0", DeviceKind.CPU, None, {"pool": "ram"}),
        PlanDevice("cuda0", DeviceKind.CUDA, None, {"pool": "ram"}),
    )
    with pytest.raises(PlanRejectedError, match="memory pool 'ram' has cpu and cuda devices"):
        executor.check_plan(Plan(plan.strategy, mixed, plan.steps), graph)


def test_a_concurrent_plans_sections_run_on_a_thread_per_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pooled plan above made concurrent: its sections run on a thread per device (the
    first device's share on the calling thread, the other's on a thread the run starts
    once), a step on one waiting for the inputs the other computes in the section; the
    gradients and the pool's peak are those of the plan run in turn."""
    model, graph, _, in_turn = _pooled_resnet()
    concurrent = replace(in_turn, concurrent=True)
    threads: set[str] = set()
    step = executor._Run._step

    def watched(run: executor._Run, index: int, prepared: Sequence[Callable[[], float]]) -> float:
        if isinstance(run.plan.steps[index], Compute):
            threads.add(threading.current_thread().name)
        return step(run, index, prepared)

    monkeypatch.setattr(executor._Run, "_step", watched)
    report = execute(model, graph, concurrent, DEVICES)
    _assert_matches(report, concurrent, graph)
    assert len(threads) == 2
    assert len({name for name in threads if name.startswith("remat-section")}) == 1
    assert report.peak_bytes == execute(model, graph, in_turn, DEVICES).peak_bytes


@pytest.mark.parametrize("device", ["cpu0", "cpu1"])
def test_a_step_failing_in_a_section_fails_the_run_and_leaves_no_thread(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """A step that runs out of memory in a concurrent section, on the run's thread (cpu0,
    the section's first device) or on the section's other thread (cpu1), fails the run
    with the device and step named, the other device's thread stopping at its next step;
    the run's section threads end with it, and the next run is unaffected."""
    model, graph, _, in_turn = _pooled_resnet()
    concurrent = replace(in_turn, concurrent=True)
    steps = concurrent.steps

    def section(i: int) -> set[str]:  # the devices of the section around step i
        lo, hi = i, i
        while lo > 0 and isinstance(steps[lo - 1], Compute):
            lo -= 1
        while hi + 1 < len(steps) and isinstance(steps[hi + 1], Compute):
            hi += 1
        return {s.device for s in steps[lo : hi + 1] if isinstance(s, Compute)}

    index, victim = next(
        (i, s)
        for i, s in enumerate(steps)
        if isinstance(s, Compute) and s.device == device and i > 10 and len(section(i)) == 2
    )
    monkeypatch.setattr(Program, "evaluator", _failing_at(victim.node, "out of memory (injected)"))
    with pytest.raises(DeviceOutOfMemory, match=rf"device '{device}' at step {index} \(compute"):
        execute(model, graph, concurrent, DEVICES)
    assert not [t for t in threading.enumerate() if t.name.startswith("remat-section")]
    monkeypatch.undo()
    assert execute(model, graph, concurrent, DEVICES).gradients_match is True


def test_a_device_this_node_lacks_is_refused() -> None:
    model, graph, plan = _chain_plan()
    with pytest.raises(DeviceError, match=r"'cpu0'.*this node does not have.*cpu7"):
        execute(model, graph, plan, [Device("cpu7", DeviceKind.CPU)])
    elsewhere = Plan(plan.strategy, plan.devices, (Compute(0, 0, "gpu9"), *plan.steps))
    with pytest.raises(DeviceError, match="unknown device 'gpu9'"):
        execute(model, graph, elsewhere, DEVICES)
    mismatched = [Device("cpu0", DeviceKind.CUDA)]
    with pytest.raises(DeviceError, match="cuda on this node, cpu in the plan"):
        execute(model, graph, plan, mismatched)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused() -> None:
    model, graph, plan = _chain_plan()
    moved = [
        Compute(s.stage, s.node, "cuda0")
        if isinstance(s, Compute)
        else Free(s.stage, s.node, "cuda0")
        for s in plan.steps
    ]
    cuda = Plan(plan.strategy, (PlanDevice("cuda0", DeviceKind.CUDA, None),), tuple(moved))
    with pytest.raises(DeviceError, match="CUDA is not available"):
        execute(model, graph, cuda)


def test_an_unsupported_operator_is_named() -> None:
    model, graph, plan = _chain_plan()
    model.graph.node[2].op_type = "Softsign2"  # act1 (Tanh): no such kernel
    with pytest.raises(UnsupportedOpError, match=r"'Softsign2' \(node 'act1'\)"):
        execute(model, graph, plan, DEVICES)


def _failing_at(node: int, message: str) -> Callable[[Program, int, bool], Evaluator]:
    """``Program.evaluator`` with node ``node``'s evaluation running out of memory."""
    evaluator = Program.evaluator

    def failing(self: Program, index: int, in_place: bool = False) -> Evaluator:
        if index != node:
            return evaluator(self, index, in_place)

        def out_of_memory(*args: Any) -> Value:
            raise torch.OutOfMemoryError(message)

        return out_of_memory

    return failing


def test_out_of_memory_names_the_device_and_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model, graph, plan = _chain_plan()
    failing = _failing_at(3, "CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(Program, "evaluator", failing)
    step = next(i for i, s in enumerate(plan.steps) if isinstance(s, Compute) and s.node == 3)
    with pytest.raises(DeviceOutOfMemory, match=rf"device 'cpu0' at step {step} \(compute"):
        execute(model, graph, plan, DEVICES)
    monkeypatch.undo()
    assert execute(model, graph, plan, DEVICES).gradients_match is True  # still usable


# --- CUDA -----------------------------------------------------------------------------------


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA0 = Device("cuda0", DeviceKind.CUDA)


def _assert_cuda_peak(report: ExecutionReport, device: str) -> None:
    """The executor's own account equals the simulator's peak; the bytes requested from
    the CUDA allocator add the kernels' temporaries (workspaces, gradient temporaries: tens
    to hundreds of KiB on these small models), never less; the allocator's peak adds its
    rounding and slack on top."""
    predicted = report.predicted_peak_bytes[device]
    assert report.accounted_peak_bytes[device] == predicted
    measured = report.peak_bytes[device]
    assert predicted <= measured <= predicted + max(0.01 * predicted, 2**20)
    assert report.allocator_peak_bytes[device] >= measured


@needs_cuda
def test_a_plan_over_cpu_and_cuda_matches() -> None:  # pragma: no cover - GPU only
    model = MODELS["resnet18"]()
    graph = _graph(model)
    cut = len(graph.forward_nodes()) // 2

    def home(node: Node) -> str:
        forward = node.forward if node.kind is NodeKind.BACKWARD else node.id
        return "cpu0" if node.kind is not NodeKind.LOSS and forward < cut else "cuda0"  # type: ignore[operator]

    plan = _split_plan(graph, home, [CPU0, CUDA0])
    report = execute(model, graph, plan, [CPU0, CUDA0])
    assert report.gradients_match is True
    assert report.max_rel_error is not None and report.max_rel_error <= report.tolerance
    assert report.peak_bytes["cpu0"] == report.predicted_peak_bytes["cpu0"]
    assert report.accounted_peak_bytes["cpu0"] == report.predicted_peak_bytes["cpu0"]
    assert set(report.allocator_peak_bytes) == {"cuda0"}
    _assert_cuda_peak(report, "cuda0")


@needs_cuda
@pytest.mark.parametrize(
    ("family", "strategy", "percent"),
    [
        ("vgg16", "checkpoint_all", 100),
        ("resnet18", "ap_sqrt", None),
        ("unet", "linearized_greedy", 70),
        ("transformer", "checkpoint_all", 100),
        ("mobilenet_v1", "ap_sqrt", None),
    ],
)
def test_single_cuda_device_plans_match(
    family: str, strategy: str, percent: float | None
) -> None:  # pragma: no cover - GPU only
    model = MODELS[family]()
    graph = _graph(model)
    plan = _strategy_plan(graph, strategy, percent, "cuda0", [CUDA0])
    report = execute(model, graph, plan, [CUDA0], repeats=2)
    assert report.gradients_match is True, (report.max_rel_error, report.tolerance)
    assert report.tolerance >= TOLERANCE
    assert len(report.step_ms) == len(plan.steps) and len(report.runs_ms) == 2
    assert report.total_ms > 0 and all(ms >= 0 for ms in report.step_ms)
    _assert_cuda_peak(report, "cuda0")


@needs_cuda
def test_a_cuda_inference_plan_reproduces_the_outputs() -> None:  # pragma: no cover
    model = MODELS["resnet18"]()
    graph = _graph(model, Mode.INFERENCE)
    plan = _strategy_plan(graph, "checkpoint_all", 100, "cuda0", [CUDA0])
    report = execute(model, graph, plan, [CUDA0])
    assert report.outputs_match is True, (report.outputs_rel_error, report.tolerance)
    _assert_cuda_peak(report, "cuda0")


@needs_cuda
def test_cuda_runs_in_ieee_fp32_and_restores_the_settings() -> None:  # pragma: no cover
    """TF32 (PyTorch's default for cuDNN convolutions) is off while the agent computes."""
    settings = (torch.backends.cudnn.conv, torch.backends.cuda.matmul)
    before = [s.fp32_precision for s in settings]
    x = torch.randn(8, 64, 16, 16, device="cuda")
    w = torch.randn(64, 64, 3, 3, device="cuda")
    exact = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)
    with ieee_fp32():
        assert [s.fp32_precision for s in settings] == ["ieee", "ieee"]
        y = torch.nn.functional.conv2d(x, w, padding=1)
    assert [s.fp32_precision for s in settings] == before
    assert float((y.double() - exact).abs().max() / exact.abs().max()) < 1e-5


@needs_cuda
def test_cuda_out_of_memory_is_a_clear_error() -> None:  # pragma: no cover - GPU only
    """A CUDA device too small for the fixed tensors, or for a step, is DeviceOutOfMemory
    naming the device (and the step), and the device is usable again afterwards."""
    model = samples.chain(2, batch=2**22, features=4)  # input and every value: 64 MiB
    graph = _graph(model, Mode.INFERENCE)
    plan = _strategy_plan(graph, "checkpoint_all", None, "cuda0", [CUDA0])
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    try:
        torch.cuda.set_per_process_memory_fraction(2**20 / total)  # 1 MiB
        with pytest.raises(DeviceOutOfMemory, match="device 'cuda0' placing its parameters"):
            execute(model, graph, plan, [CUDA0], warmup=0)
        torch.cuda.set_per_process_memory_fraction(100 * 2**20 / total)  # the input only
        with pytest.raises(DeviceOutOfMemory, match=r"device 'cuda0' at step 0 \(compute"):
            execute(model, graph, plan, [CUDA0], warmup=0)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert execute(model, graph, plan, [CUDA0], warmup=0).outputs_match is True


def test_detect_devices_lists_the_host_and_each_gpu() -> None:
    devices = detect_devices()
    assert devices[0] == Device("cpu0", DeviceKind.CPU)
    assert devices[0].threads == os.cpu_count()
    cuda = [d.name for d in devices if d.kind is DeviceKind.CUDA]
    assert cuda == [f"cuda{i}" for i in range(torch.cuda.device_count())]


# --- a model exported by PyTorch ------------------------------------------------------------


class _Net(torch.nn.Module):
    """Conv, BatchNorm (folded by the exporter), a gated residual (Mul of two activations),
    MaxPool, Flatten, Linear, Gelu (exported as Div/Erf/Add/Mul with Constant nodes, fused),
    LayerNorm, Softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 4 * 4, 10)
        self.ln = torch.nn.LayerNorm(10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.c1(x)))
        y = y + torch.sigmoid(self.c2(y)) * y
        y = torch.flatten(torch.nn.functional.max_pool2d(y, 2), 1)
        return self.ln(torch.nn.functional.gelu(self.fc(y))).softmax(-1)


def _exported() -> tuple[_Net, torch.Tensor, onnx.ModelProto]:
    torch.manual_seed(0)
    net = _Net().eval()
    x = torch.randn(2, 3, 8, 8)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(net, (x,), buffer, dynamo=False, opset_version=17)
        except Exception as error:  # the exporter needs optional packages on some installs
            pytest.skip(f"torch.onnx.export is unavailable here: {error}")
    return net, x, onnx.load_from_string(buffer.getvalue())


def test_an_exported_model_trains_like_pytorch() -> None:
    """Scheduled training of a torch.onnx.export model gives the plain autograd gradients,
    and those are PyTorch's own for the same module, input and loss; the model's input is
    data, as in a PyTorch training step: it gets no gradient."""
    net, x, model = _exported()
    name = model.graph.input[0].name
    graph = _graph(model)
    plan = _strategy_plan(graph, "checkpoint_all", None, "cpu0")
    report = execute(model, graph, plan, DEVICES, inputs={name: x.numpy()})
    _assert_matches(report, plan, graph)
    ours = build_program(model, graph, inputs={name: x.numpy()}).reference_gradients()
    loss = 0.5 * (net(x) ** 2).mean()
    loss.backward()
    theirs = {n: p.grad for n, p in net.named_parameters()}
    shared = sorted(set(ours) & set(theirs))
    assert name not in ours and "fc.weight" in shared and "ln.weight" in shared
    for tensor in shared:
        torch.testing.assert_close(ours[tensor], theirs[tensor], rtol=1e-4, atol=1e-7)
