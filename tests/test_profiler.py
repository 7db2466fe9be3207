"""The profiler: a measured cost table the cost model accepts for the same graph, with
positive times per node and device, copies in both directions, the graph's bytes, the
links to host memory and to storage, and progress while it runs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the agent extra (torch) is not installed")
import torch

from agents import profiler
from agents.errors import DeviceError, DeviceOutOfMemory, StorageError, TaskError
from agents.executor import execute
from agents.profiler import NODE_BY_NODE_ENERGY, affine_fit, median_and_spread, profile, slowdown
from agents.torch_devices import Runtime, runtime_of
from remat import samples
from remat.budgets import fixed_bytes, reference
from remat.costs import CostSource, CostTable, analytical_costs, profiled_costs
from remat.devices import Device, DeviceKind, Tier, with_option
from remat.graph import Graph, Mode
from remat.onnx_ingest import forward_graph
from remat.strategies import Problem, run_strategy
from remat.training import for_mode

CPU0 = Device("cpu0", DeviceKind.CPU, {"threads": "1"})
CPU1 = Device("cpu1", DeviceKind.CPU, {"threads": "2"})


@pytest.mark.parametrize("mode", [Mode.TRAINING, Mode.INFERENCE])
def test_profile_is_a_cost_table_for_the_graph(mode: Mode) -> None:
    model = samples.resnet18(batch=1, image=32, width=4)
    graph = for_mode(forward_graph(model), mode)
    progress: list[tuple[int, int]] = []
    table = profile(
        model,
        graph,
        [CPU0, CPU1],
        repeats=3,
        warmup=1,
        on_progress=lambda done, total: progress.append((done, total)),
        energy_counters={"cpu0": None, "cpu1": None},  # no energy pass, where RAPL is readable
    )
    assert table.source is CostSource.PROFILED
    assert [(d.name, d.kind, d.threads) for d in table.devices] == [
        ("cpu0", DeviceKind.CPU, 1),
        ("cpu1", DeviceKind.CPU, 2),
    ]
    assert set(table.nodes) == {n.name for n in graph.nodes}
    costs = profiled_costs(graph, table)  # every node, device and ordered pair is there
    assert costs.source is CostSource.PROFILED
    assert (costs.compute_ms > 0).all()
    assert (costs.copy_ms[:, 0, 1] > 0).all() and (costs.copy_ms[:, 1, 0] > 0).all()
    assert costs.output_bytes.tolist() == [n.output_bytes for n in graph.nodes]
    for entry in table.nodes.values():
        assert set(entry.compute_spread_ms) == {"cpu0", "cpu1"}
        assert all(v >= 0 for v in entry.compute_spread_ms.values())
    # The executor's own time per step, added to every node's time on its device.
    for d, device in enumerate(table.devices):
        assert device.step_overhead_ms >= 0
        measured = [table.nodes[n.name].compute_ms[device.name] for n in graph.nodes]
        assert costs.compute_ms[:, d].tolist() == pytest.approx(
            [ms + device.step_overhead_ms for ms in measured]
        )
    # The host's thread hand-off, measured with real threads, and carried into the model.
    assert 0 < table.handoff_ms < 1e3 and costs.handoff_ms == table.handoff_ms
    # Node evaluations: (1 warm-up + 3 measured) passes per device, one copy pass each, and
    # the executor's runs of each pass (1 unmeasured + 3).
    total = len(graph) * (2 * (1 + 3) + 2 + 2 * (1 + 3))
    assert progress[0] == (0, total) and progress[-1] == (total, total)
    done = [d for d, _ in progress]
    assert done == sorted(done) and {t for _, t in progress} == {total}


def test_the_devices_of_a_pool_are_timed_computing_at_once() -> None:
    """Two CPUs of one memory pool: after their passes they run their pass plans at once,
    and each one's slowdown beside the other (at least 1) is in the table; the progress
    counts those runs too. Devices of no common pool keep 1."""
    model = samples.resnet18(batch=1, image=32, width=4)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    pooled = [Device(d.name, d.kind, {**d.options, "pool": "ram"}) for d in (CPU0, CPU1)]
    progress: list[tuple[int, int]] = []

    def profiled(memory_bytes: dict[str, int] | None = None) -> CostTable:
        progress.clear()
        return profile(
            model,
            graph,
            pooled,
            repeats=2,
            warmup=0,
            on_progress=lambda done, total: progress.append((done, total)),
            memory_bytes=memory_bytes,
            energy_counters={"cpu0": None, "cpu1": None},
        )

    table = profiled()
    slowdowns = [d.concurrent_slowdown for d in table.devices]
    assert all(1.0 <= s < 100 for s in slowdowns), slowdowns
    assert profiled_costs(graph, table).concurrent_slowdown == tuple(slowdowns)
    # per device: 2 passes, a copy pass and 1 + 2 executor runs; then 1 + 2 rounds at once
    total = len(graph) * (2 * (2 + 1 + 3) + 3 * 2)
    assert progress[-1] == (total, total)
    apart = profile(model, graph, [CPU0, CPU1], repeats=1, warmup=0, energy_counters={})
    assert [d.concurrent_slowdown for d in apart.devices] == [1.0, 1.0]
    # a pool whose memory holds one pass, not two: not run at once
    peak = reference(graph, analytical_costs(graph, [CPU0])).peak_bytes
    tight = profiled({"cpu0": peak * 3 // 2, "cpu1": peak * 3 // 2})
    assert [d.concurrent_slowdown for d in tight.devices] == [1.0, 1.0]
    alone = len(graph) * 2 * (2 + 1 + 3)
    assert progress[-1] == (alone, alone)


def test_the_executors_time_beyond_its_nodes_is_each_steps_overhead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device's ``step_overhead_ms`` is the executor's median run of its pass less the
    pass's node times, over its compute steps (here the runs take 1 s)."""
    model = samples.resnet18(batch=1, image=32, width=4)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    runs: list[object] = []

    def plain_run_ms(program: object, plan: object, runtimes: object) -> float:
        runs.append(plan)
        return 1000.0

    monkeypatch.setattr(profiler, "plain_run_ms", plain_run_ms)
    table = profile(model, graph, [CPU0], repeats=3, warmup=1, energy_counters={"cpu0": None})
    nodes_ms = sum(e.compute_ms["cpu0"] for e in table.nodes.values())
    assert len(runs) == 4  # one unmeasured, then repeats
    assert table.devices[0].step_overhead_ms == pytest.approx((1000.0 - nodes_ms) / len(graph))


def test_one_device_has_no_copies_and_round_trips_through_json(tmp_path: Path) -> None:
    model = samples.transformer_block(batch=1)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    table = profile(model, graph, [CPU0], repeats=1, warmup=0, storage=tmp_path)
    assert all(pairs == {} for pairs in table.copy_ms.values())
    link = table.host_links["cpu0"]  # measured: a memcpy into host memory and back
    assert link.to_host_bytes_per_s > 0 and link.from_host_bytes_per_s > 0
    assert link.latency_us >= 0
    # measured: files written through to the storage directory and read back
    stored = table.storage_links["cpu0"]
    assert stored.write_bytes_per_s > 0 and stored.read_bytes_per_s > 0
    assert stored.write_latency_us is not None and stored.read_latency_us is not None
    assert stored.write_latency_us + stored.read_latency_us > 0
    assert list(tmp_path.iterdir()) == []  # the probe files and their directory are gone
    # measured beside each link's transfer, on a CPU device
    assert "compute_slowdown" in link.model_fields_set and link.compute_slowdown >= 1
    assert "compute_slowdown" in stored.model_fields_set and stored.compute_slowdown >= 1
    costs = profiled_costs(graph, table)
    assert costs.link(0, Tier.STORAGE) == stored.link()
    assert costs.link(0, Tier.STORAGE).out_bytes_per_s == stored.write_bytes_per_s
    assert costs.link(0, Tier.STORAGE).in_bytes_per_s == stored.read_bytes_per_s
    again = type(table).model_validate_json(table.model_dump_json())
    assert profiled_costs(graph, again).link(0) == costs.link(0)
    assert profiled_costs(graph, again).link(0, Tier.STORAGE) == costs.link(0, Tier.STORAGE)
    assert (
        profiled_costs(graph, again).compute_ms == profiled_costs(graph, table).compute_ms
    ).all()


@pytest.mark.alone
def test_a_load_that_takes_the_computes_time_is_measured_as_a_slowdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread that holds the interpreter (pure Python, never blocking) takes turns with
    the probe's every operation: the probe runs far slower beside it than alone. The probe
    is made to last ten of the interpreter's switch intervals (5 ms), so that it cannot
    run through in one or two turns of the lock; on two cores a measurement can still see
    none (the threads then barely meet), so one of three, measured until one does, must."""
    monkeypatch.setattr(profiler, "SLOWDOWN_PROBE_MS", 50.0)

    def hog(ready: threading.Event, stop: threading.Event) -> None:
        ready.set()
        while not stop.is_set():
            sum(range(10_000))

    measured: list[float] = []
    while len(measured) < 3 and max(measured, default=0.0) <= 1.5:
        measured.append(slowdown(runtime_of(CPU0), hog)["compute_slowdown"])
    assert max(measured) > 1.5, measured
    gpu = Runtime("cuda0", DeviceKind.CUDA, torch.device("cuda", 0), None, None)
    assert slowdown(gpu, hog) == {}  # copy engines beside the kernels: not measured


def test_median_and_interquartile_range() -> None:
    assert median_and_spread([1.0, 2.0, 3.0, 4.0, 100.0]) == (3.0, 2.0)
    assert median_and_spread([5.0]) == (5.0, 0.0)


def test_a_storage_directory_that_cannot_be_used_is_named(tmp_path: Path) -> None:
    model = samples.chain(2, batch=1)
    graph = forward_graph(model)
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(StorageError, match=f"the storage {afile} is not a directory"):
        profile(model, graph, [CPU0], repeats=1, warmup=0, storage=afile)


def test_bad_device_lists_are_refused() -> None:
    model = samples.chain(2, batch=1)
    graph = forward_graph(model)
    with pytest.raises(DeviceError, match="unique"):
        profile(model, graph, [CPU0, CPU0])
    with pytest.raises(DeviceError, match="no devices"):
        profile(model, graph, [])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused() -> None:
    model = samples.chain(2, batch=1)
    with pytest.raises(DeviceError, match="CUDA is not available"):
        profile(model, forward_graph(model), [CPU0, Device("cuda0", DeviceKind.CUDA)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_on_cpu_and_cuda() -> None:  # pragma: no cover - GPU only
    model = samples.resnet18(batch=2, image=32, width=4)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    table = profile(model, graph, [CPU0, Device("cuda0", DeviceKind.CUDA)], repeats=3)
    costs = profiled_costs(graph, table)
    assert (costs.compute_ms > 0).all()
    assert (costs.copy_ms[:, 0, 1] > 0).all() and (costs.copy_ms[:, 1, 0] > 0).all()
    assert [d.threads for d in table.devices] == [1, None]
    assert set(table.host_links) == {"cpu0", "cuda0"}  # cuda0: pinned, both directions


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_profile_has_workspace_and_the_plan_its_peak() -> None:  # pragma: no cover
    """The table's workspace makes the prediction cover what the allocator holds: a
    checkpoint-all plan's allocator peak within 2% or 2 MiB of the simulated one."""
    model = samples.vgg16(batch=2, image=32, width=8)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    gpu = Device("cuda0", DeviceKind.CUDA)
    table = profile(model, graph, [gpu], repeats=2)
    costs = profiled_costs(graph, table)
    assert costs.workspace_bytes is None or (costs.workspace_bytes >= 0).all()
    plan = run_strategy("checkpoint_all", Problem(graph, costs, {}), "cuda0").plan
    assert plan is not None and plan.predicted is not None
    report = execute(model, graph, plan, [gpu])
    predicted = plan.predicted.peak_bytes["cuda0"]
    measured = report.allocator_peak_bytes["cuda0"]
    assert measured <= predicted + max(0.02 * predicted, 2 << 20), (measured, predicted)


def _half_of_checkpoint_all(graph: Graph) -> int:
    """Bytes halfway between the fixed memory and checkpoint-all's peak on one CPU."""
    ref = reference(graph, analytical_costs(graph, [CPU0]))
    return ref.fixed_bytes + (ref.peak_bytes - ref.fixed_bytes) // 2


def test_a_device_smaller_than_checkpoint_all_is_profiled_under_a_plan() -> None:
    """Mimose's collector: where checkpoint-all does not fit what a device may use, the
    passes recompute, so profiling holds no more than that, and the table is whole."""
    model = samples.resnet18(batch=2, image=32, width=8)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    limit = _half_of_checkpoint_all(graph)
    small = with_option(CPU0, "memory", str(limit))
    everything = run_strategy("checkpoint_all", Problem(graph, analytical_costs(graph, [CPU0]), {}))
    assert everything.plan is not None
    with pytest.raises(DeviceOutOfMemory, match=f"above the {limit} bytes the device may use"):
        execute(model, graph, everything.plan, [small], warmup=0)  # the option is enforced

    progress: list[tuple[int, int]] = []
    table = profile(
        model, graph, [small], repeats=1, warmup=0, on_progress=lambda *p: progress.append(p)
    )
    costs = profiled_costs(graph, table)
    assert (costs.compute_ms > 0).all()
    assert costs.output_bytes.tolist() == [n.output_bytes for n in graph.nodes]
    assert progress[-1][1] > len(graph)  # some nodes were evaluated twice: recomputed

    # The same limit given as the job's budget, on a device without the option.
    table = profile(model, graph, [CPU0], repeats=1, warmup=0, memory_bytes={"cpu0": limit})
    assert set(table.nodes) == {n.name for n in graph.nodes}


def test_a_device_smaller_than_any_pass_is_profiled_node_by_node() -> None:
    """A device that holds less than the whole graph's fixed tensors (a part of a model
    split over devices) has no pass: each node is timed alone there, with only its own
    fixed tensors, inputs and output, never above what the device may hold; the other
    device profiles in passes, and copies are timed both ways."""
    model = samples.resnet18(batch=2, image=32, width=8)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    limit = fixed_bytes(graph) // 2
    small = with_option(CPU0, "memory", str(limit))
    progress: list[tuple[int, int]] = []
    table = profile(
        model,
        graph,
        [small, CPU1],
        repeats=2,
        warmup=1,
        on_progress=lambda *p: progress.append(p),
        energy_counters={"cpu0": None, "cpu1": None},
    )
    costs = profiled_costs(graph, table)
    assert (costs.compute_ms > 0).all()
    assert (costs.copy_ms[:, 0, 1] > 0).all() and (costs.copy_ms[:, 1, 0] > 0).all()
    assert costs.output_bytes.tolist() == [n.output_bytes for n in graph.nodes]
    cpu0, cpu1 = table.devices
    assert cpu0.model_extra == {"energy_note": NODE_BY_NODE_ENERGY}
    assert cpu0.step_overhead_ms == 0.0 and cpu1.model_extra != cpu0.model_extra
    # cpu0: 1 + 2 evaluations and a copy per node; cpu1: (1 + 2) passes, a copy pass and
    # the executor's runs (1 + 2)
    total = len(graph) * ((1 + 2 + 1) + (1 + 2 + 1 + 1 + 2))
    assert progress[-1] == (total, total)


def test_a_device_too_small_for_any_node_says_what_profiling_needs() -> None:
    model = samples.resnet18(batch=2, image=32, width=8)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    with pytest.raises(TaskError, match=r"cannot profile on cpu0: computing .* alone needs at"):
        profile(model, graph, [CPU0], memory_bytes={"cpu0": 4096})


def test_the_storage_fit_weighs_every_size_alike() -> None:
    sizes = [4 << 10, 512 << 10, 16 << 20]
    exact = [0.2 + n / 1e9 * 1e3 for n in sizes]
    latency, rate = affine_fit(sizes, exact)
    assert latency == pytest.approx(0.2) and rate == pytest.approx(1e9)
    # Mid-sized files slower than the line through the smallest and the largest: the fit
    # gives up a little on the largest rather than 40% on the middle one.
    measured = [0.2, 0.2 + 512 / 1024 * 1.4, 0.2 + 16.78]
    latency, rate = affine_fit(sizes, measured)
    predicted = [latency + n / rate * 1e3 for n in sizes]
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured, strict=True)]
    assert max(errors) < 0.25
    # Times that do not grow from a latency: a line through the origin, never negative.
    latency, rate = affine_fit([1 << 20, 2 << 20], [0.5, 2.0])
    assert latency == 0.0 and rate > 0
