"""The executor runs plans that page to the node's storage (plan version 3): page_out,
page_in and wait on a paging lane per device, beside the compute lane and the lane to host
memory, through real files in the storage directory. Gradients stay those of plain
autograd, the measured peak is the simulator's and below checkpoint-all's, the files go
with the run (on failure too), a write that fails for real (the file size limit) fails
the run with one clear line, and an agent given a storage directory it cannot use exits
with status 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import onnx
import pytest

pytest.importorskip("torch", reason="the agent extra (torch) is not installed")

from agents.agent import _parser, config_from
from agents.errors import StorageError
from agents.executor import ExecutionReport, execute
from remat import samples
from remat.budgets import reference
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind, Size, Tier
from remat.graph import Graph, Mode, NodeKind
from remat.onnx_ingest import forward_graph
from remat.plan import BRINGS, SENDS, Compute, Plan, Step, Wait
from remat.simulator import simulate
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SolverSettings, run_strategy
from remat.strategies.heuristics.fixed_paging import Hold, with_fixed_paging
from remat.strategies.heuristics.offload_greedy import offload_greedy
from remat.training import for_mode

CPU0 = Device("cpu0", DeviceKind.CPU, {"threads": "1"})
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent


def _graph(model: onnx.ModelProto) -> Graph:
    return for_mode(forward_graph(model), Mode.TRAINING)


def _ops(plan: Plan) -> dict[str, int]:
    counts: dict[str, int] = {}
    for step in plan.steps:
        counts[step.op] = counts.get(step.op, 0) + 1
    return counts


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def _lane_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "-lane" in t.name]


def _assert_correct(report: ExecutionReport, plan: Plan, storage: Path) -> None:
    assert report.gradients_match is True, report.max_rel_error
    assert len(report.step_ms) == len(plan.steps)
    assert report.total_ms > 0 and all(ms >= 0 for ms in report.step_ms)
    assert report.accounted_peak_bytes == report.peak_bytes  # CPU: the account
    assert _files(storage) == [], "the run's files and directory go with it"
    assert not _lane_threads(), "the lanes' threads end with the run"


def _greedy_paging_plan(model: onnx.ModelProto, percent: float) -> tuple[Graph, Plan, int, int]:
    """GREEDY over storage on cpu0 at ``percent`` of checkpoint-all's activations: the
    graph, the plan, the budget and checkpoint-all's peak."""
    graph = _graph(model)
    costs = analytical_costs(graph, [CPU0])
    ref = reference(graph, costs)
    budget = Size(percent=percent).resolve(ref.fixed_bytes, ref.peak_bytes)
    assert budget < ref.peak_bytes
    result = offload_greedy(Problem(graph, costs, {"cpu0": budget}), "cpu0", tier=Tier.STORAGE)
    assert result.plan is not None, result.message
    return graph, result.plan, budget, ref.peak_bytes


# --- a strategy's plan -------------------------------------------------------------------


def test_a_greedy_paging_plan_trains_in_less_memory_than_checkpoint_all(tmp_path: Path) -> None:
    model = samples.resnet18(batch=2, image=32, width=4)
    graph, plan, budget, checkpoint_all_peak = _greedy_paging_plan(model, 60)
    ops = _ops(plan)
    assert plan.version == 3 and plan.pages
    assert ops["page_out"] >= 1 and ops["page_in"] >= 1 and "offload" not in ops
    assert ops["wait"] == ops["page_out"] + ops["page_in"]

    report = execute(model, graph, plan, [CPU0], storage=tmp_path)
    _assert_correct(report, plan, tmp_path)
    assert report.peak_bytes["cpu0"] <= budget < checkpoint_all_peak
    # GREEDY reserves a page-in's memory from the step that issues it, as the executor
    # accounts it: the simulator's peak exactly.
    assert report.peak_bytes == report.predicted_peak_bytes


def test_a_plan_that_pages_fixed_tensors_trains_below_their_size(tmp_path: Path) -> None:
    model = samples.resnet18(batch=2, image=32, width=8)
    graph = _graph(model)
    costs = analytical_costs(graph, [CPU0])
    ref = reference(graph, costs)
    budget = round(0.8 * ref.fixed_bytes)
    solver = SolverSettings(options=SolveOptions(time_limit_s=10))
    result = run_strategy("port", Problem(graph, costs, {"cpu0": budget}, solver), "cpu0")
    assert result.plan is not None, result.message
    plan = result.plan
    ops = _ops(plan)
    assert plan.version == 5 and ops["fixed_in"] >= 1 and ops["grad_out"] >= 1
    assert ops["fixed_wait"] == ops["fixed_in"] and ops["grad_wait"] == ops["grad_out"]

    report = execute(model, graph, plan, [CPU0], storage=tmp_path)
    _assert_correct(report, plan, tmp_path)  # the gradients written out, read back
    assert report.peak_bytes["cpu0"] <= budget < ref.fixed_bytes
    # The account counts a read from its step, as the strategy judged the plan.
    counted = simulate(plan, graph, costs, reserve_at_issue=True)
    assert report.peak_bytes == counted.peak_bytes
    assert report.predicted_peak_bytes["cpu0"] <= report.peak_bytes["cpu0"]


def test_serial_fixed_paging_runs_at_its_counted_peak(tmp_path: Path) -> None:
    """Every fixed tensor paged serially (each use read on its own, each gradient written
    before the next compute): the executor's peak is the simulator's, reads counted from
    their steps, far below the fixed memory, and the gradients read back are autograd's."""
    model = samples.resnet18(batch=2, image=32, width=8)
    graph = _graph(model)
    costs = analytical_costs(graph, [CPU0])
    ref = reference(graph, costs)
    serial = with_fixed_paging(
        _checkpoint_all(graph),
        graph,
        Problem(graph, costs, {"cpu0": None}),
        "cpu0",
        frozenset(graph.fixed),
        Hold.SERIAL,
    )
    report = execute(model, graph, serial, [CPU0], storage=tmp_path)
    _assert_correct(report, serial, tmp_path)
    counted = simulate(serial, graph, costs, reserve_at_issue=True)
    assert report.peak_bytes == counted.peak_bytes
    assert report.peak_bytes["cpu0"] < ref.fixed_bytes


# --- hand-made plans -----------------------------------------------------------------------


def _reads(graph: Graph, step: Step, node: int) -> bool:
    return isinstance(step, Compute) and node in graph.nodes[step.node].deps


def _checkpoint_all(graph: Graph) -> Plan:
    costs = analytical_costs(graph, [CPU0])
    result = run_strategy("checkpoint_all", Problem(graph, costs, {"cpu0": None}), "cpu0")
    assert result.plan is not None, result.message
    return result.plan


def _sending(plan: Plan, graph: Graph, node: int, tier: Tier) -> Plan:
    """``plan`` with ``node`` sent to ``tier`` right after it is computed, its device copy
    released just before the first backward step (so its forward readers read it while it
    leaves), and brought back just before its first backward reader."""
    steps = list(plan.steps)
    computed = next(i for i, s in enumerate(steps) if isinstance(s, Compute) and s.node == node)
    boundary = next(
        i
        for i, s in enumerate(steps)
        if isinstance(s, Compute) and graph.nodes[s.node].kind is NodeKind.BACKWARD
    )
    back = next(i for i, s in enumerate(steps) if i >= boundary and _reads(graph, s, node))
    stage = steps[computed].stage
    steps[back:back] = [BRINGS[tier](stage, node, "cpu0"), Wait(stage, node, "cpu0")]
    steps[boundary:boundary] = [Wait(stage, node, "cpu0")]
    steps[computed + 1 : computed + 1] = [SENDS[tier](stage, node, "cpu0")]
    return Plan("hand", plan.devices, tuple(steps))


def _two_candidates(plan: Plan, graph: Graph) -> list[int]:
    """Two forward values read by a forward node after they are computed and by a
    backward node later."""
    boundary = next(
        i
        for i, s in enumerate(plan.steps)
        if isinstance(s, Compute) and graph.nodes[s.node].kind is NodeKind.BACKWARD
    )
    found = []
    for q, step in enumerate(plan.steps[:boundary]):
        if isinstance(step, Compute):
            readers = [i for i, s in enumerate(plan.steps) if _reads(graph, s, step.node)]
            if any(q < i < boundary for i in readers) and any(i >= boundary for i in readers):
                found.append(step.node)
    assert len(found) >= 2
    return [found[0], found[-1]]


def test_paging_and_offloading_run_on_their_own_lanes(tmp_path: Path) -> None:
    """One value paged to storage and another offloaded to host memory on one device, both
    read while they leave: each wait finds its transfer on its lane."""
    model = samples.chain(6, batch=2)
    graph = _graph(model)
    plan = _checkpoint_all(graph)
    paged, offloaded = _two_candidates(plan, graph)
    plan = _sending(plan, graph, paged, Tier.STORAGE)
    plan = _sending(plan, graph, offloaded, Tier.HOST)
    assert {"page_out", "page_in", "offload", "prefetch"} <= set(_ops(plan))
    report = execute(model, graph, plan, [CPU0], warmup=0, storage=tmp_path)
    _assert_correct(report, plan, tmp_path)
    assert report.peak_bytes == report.predicted_peak_bytes


def test_a_plan_that_pages_needs_its_storage_directory(tmp_path: Path) -> None:
    model = samples.chain(6, batch=2)
    graph = _graph(model)
    base = _checkpoint_all(graph)
    plan = _sending(base, graph, _two_candidates(base, graph)[0], Tier.STORAGE)
    missing = tmp_path / "missing"
    with pytest.raises(StorageError, match=f"the storage directory {missing} does not exist"):
        execute(model, graph, plan, [CPU0], warmup=0, storage=missing)
    # A plan that does not page never touches it.
    assert execute(model, graph, base, [CPU0], warmup=0, storage=missing).gradients_match
    assert not missing.exists()


# --- writes that fail ------------------------------------------------------------------------

FAILING = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    from agents.errors import StorageError
    from agents.executor import execute
    from remat import samples
    from remat.budgets import reference
    from remat.costs import analytical_costs
    from remat.devices import Device, DeviceKind, Size, Tier
    from remat.graph import Mode
    from remat.onnx_ingest import forward_graph
    from remat.strategies import Problem
    from remat.strategies.heuristics.offload_greedy import offload_greedy
    from remat.training import for_mode

    storage = Path(sys.argv[1])
    model = samples.chain(6, batch=2)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    cpu0 = Device("cpu0", DeviceKind.CPU, {"threads": "1"})
    costs = analytical_costs(graph, [cpu0])
    ref = reference(graph, costs)
    budget = Size(percent=60).resolve(ref.fixed_bytes, ref.peak_bytes)
    plan = offload_greedy(Problem(graph, costs, {"cpu0": budget}), "cpu0", tier=Tier.STORAGE).plan
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))  # smaller than any paged value
    try:
        execute(model, graph, plan, [cpu0], warmup=0, storage=storage)
        error = None
    except StorageError as exc:
        error = str(exc)
    left = sorted(str(p) for p in storage.rglob("*"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    again = execute(model, graph, plan, [cpu0], warmup=0, storage=storage).gradients_match
    print(json.dumps({"error": error, "left": left, "again": again}))
    """
)


def test_a_write_that_fails_fails_the_run_clearly_and_leaves_no_files(tmp_path: Path) -> None:
    """The file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes the lane's write() fail
    with EFBIG, as a full disk fails it with ENOSPC; in a process of its own, which goes on
    to page again once the limit is lifted, as an agent runs its next task."""
    done = subprocess.run(
        [sys.executable, "-c", FAILING, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    graph = _graph(samples.chain(6, batch=2))
    names = "|".join(n.name for n in graph.nodes)
    assert found["error"] is not None
    pattern = rf"paging node \d+ \(({names})\) out to {re.escape(str(tmp_path))} failed: "
    assert re.fullmatch(pattern + "File too large", found["error"]), found["error"]
    assert found["left"] == []
    assert found["again"] is True
    assert _files(tmp_path) == []


# --- the agent's storage directory -------------------------------------------------------------


def _agent(*args: str) -> subprocess.CompletedProcess[str]:
    command = [str(BIN / "remat-agent"), "--server", "http://127.0.0.1:9"]
    command += ["--enroll-token", "paging-test-token", "--device", "cpu0:cpu", *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMAT_")}
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def test_an_agent_given_a_storage_directory_it_cannot_use_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    done = _agent("--storage", str(missing))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"remat-agent: error: the storage directory {missing} does not exist"
    ]
    afile = tmp_path / "afile"
    afile.write_text("")
    done = _agent("--storage", str(afile))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"remat-agent: error: the storage {afile} is not a directory"
    ]


def test_the_agent_storage_defaults_to_the_variable_then_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def storage(*args: str) -> Path | None:
        argv = ["--server", "http://127.0.0.1:9", "--enroll-token", "t", "--device", "cpu0:cpu"]
        return config_from(_parser().parse_args([*argv, *args])).storage

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("REMAT_STORAGE", raising=False)
    assert storage() == tmp_path / "home" / ".cache" / "remat" / "storage"
    assert storage().is_dir()  # type: ignore[union-attr]  # created: the built-in default
    monkeypatch.setenv("REMAT_STORAGE", str(tmp_path))
    assert storage() == tmp_path
    assert storage("--storage", str(tmp_path / "home")) == tmp_path / "home"
