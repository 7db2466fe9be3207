"""The node agent's agreement targets: profile -> plan -> execute -> compare.

Two emulated CPU devices on one machine (cpu0 with 1 thread, cpu1 with 2; ``--devices``
names others, e.g. ``cuda0:cuda`` or ``cpu0:cpu:threads=8 cuda0:cuda``), VGG-, ResNet-
and U-Net-style models (``remat.samples``) in training mode, the same budget on each device
(100% and 50% of the checkpoint-all peak; a size such as ``6MiB`` is taken as it is, e.g.
below the fixed memory, where ``--strategy port`` pages fixed tensors; devices sharing a
pool, ``pool=NAME``, share one budget). Per model: the agent's profiler measures the
training graph on both devices;
``profiled_costs`` makes the cost model; ``xengine`` plans with a short time limit (a plan
from ``placed_greedy`` or the single-device baselines if it finds none); the executor runs
the plan. Targets:

* measured peak per device = the simulator's prediction within 1% or 1 MiB (a CUDA
  device's measured peak is the allocator's, so it also holds kernels' temporaries);
* measured total time within 15% of the profiled prediction;
* gradients = plain autograd within relative error 1e-4 (fp32; with a CUDA device, against
  float64 autograd within 1e-4 or 10 times the host's fp32 error, see ``agents.executor``).

``--strategy offload_dynprog`` (or any other) plans with that strategy alone: offloading
plans run their transfers on the executor's lanes, timed against the profiled host link;
``--strategy port`` pages to the node's storage directory (``agents.storage``'s default),
timed against the profiled storage link. The plan column counts a plan's host and page
transfers, and the links the profiler measured are printed under the table.

Prints a markdown table; each missed target is listed below it with by how much. Each
row is appended to ``bench/results/agent.csv`` as it is measured (``bench/report.py``
renders them; peaks as ``device=bytes;...``).

    .venv/bin/python bench/agent.py [--models vgg16,resnet18,unet] [--budgets 100,50]
        [--batch 8] [--image 96] [--width 16] [--time-limit 10] [--repeats 5]
        [--devices NAME:KIND[:key=value,...] ...] [--strategy NAME] [--save-tables DIR]
        [--run LABEL]

Timings need a quiet machine: other processes on the cores distort them. Profiling and
each execution wait until other processes leave the CPUs idle (/proc/stat) and are taken
again (up to 3 times) when other processes used more than 10% of the CPUs meanwhile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

import onnx
from results import Writer, add_run_argument

from agents.executor import ExecutionReport, execute
from agents.profiler import profile
from remat import samples
from remat.costs import CostTable
from remat.devices import Device, DeviceKind, format_bytes, parse_device
from remat.errors import RematError
from remat.graph import Graph
from remat.plan import PAGE_OPS, Compute, Copy, FixedIn, GradOut, Offload, Plan, Prefetch
from remat.problem import model_graph, problem_from_graph
from remat.solvers.model import SolveOptions
from remat.strategies import SolverSettings, StrategyResult, run_strategy
from remat.strategies.heuristics.placed import placed_greedy

DEVICES = [
    Device("cpu0", DeviceKind.CPU, {"threads": "1"}),
    Device("cpu1", DeviceKind.CPU, {"threads": "2"}),
]
PEAK_TOLERANCE = (0.01, 2**20)  # relative, absolute bytes
TIME_TOLERANCE = 0.15
QUIET_BUSY = 0.1  # other processes' share of the CPUs under which timings are taken
QUIET_WAIT_S = 300.0
QUIET_TRIES = 3
T = TypeVar("T")


def _models(batch: int, image: int, width: int) -> dict[str, Callable[[], onnx.ModelProto]]:
    return {
        "vgg16": lambda: samples.vgg16(batch=batch, image=image, width=width),
        "resnet18": lambda: samples.resnet18(batch=batch, image=image, width=width),
        "unet": lambda: samples.unet(batch=batch, image=image, width=width, depth=3),
    }


@dataclass
class Row:
    model: str
    nodes: int
    budget: str
    plan: Plan
    report: ExecutionReport
    profile_s: float
    plan_s: float
    links: str  # the profiled links to host memory and storage (``_links``)
    misses: list[str] = field(default_factory=list)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="vgg16,resnet18,unet")
    parser.add_argument("--budgets", default="100,50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image", type=int, default=96)
    parser.add_argument("--width", type=int, default=16, help="channels of the first layer")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=5, help="profiler and executor repeats")
    parser.add_argument(
        "--devices",
        nargs="+",
        type=parse_device,
        default=DEVICES,
        metavar="NAME:KIND[:key=value,...]",
        help="the devices to plan for and run on (default: cpu0:cpu:threads=1 cpu1:cpu:threads=2)",
    )
    parser.add_argument(
        "--strategy",
        default="xengine",
        help="the strategy that plans (default xengine, falling back to the multi-device "
        "heuristic and auto; any other: that strategy alone, e.g. offload_dynprog)",
    )
    parser.add_argument(
        "--save-tables",
        type=Path,
        metavar="DIR",
        help="write each model's profiled cost table to DIR/MODEL.json (to study offline)",
    )
    add_run_argument(parser)
    args = parser.parse_args()
    out = Writer("agent", args.run)
    devices: list[Device] = args.devices
    builders = _models(args.batch, args.image, args.width)
    load_before = os.getloadavg()
    rows: list[Row] = []
    unplanned: list[str] = []  # budgets no strategy found a plan for (the row is left out)
    for name in args.models.split(","):
        model = builders[name]()
        graph = model_graph(model)
        table, profile_s = quietly(
            partial(profile, model, graph, devices, repeats=args.repeats, warmup=2),
            f"profiling {name}",
        )
        print(f"... {name}: measured {_links(table)}", file=sys.stderr, flush=True)
        if args.save_tables is not None:
            args.save_tables.mkdir(parents=True, exist_ok=True)
            (args.save_tables / f"{name}.json").write_text(table.model_dump_json())
        for given in args.budgets.split(","):
            budget = f"{given}%" if given.replace(".", "").isdigit() else given
            start = time.monotonic()
            try:
                plan = _plan(graph, table, devices, budget, args.time_limit, args.strategy)
            except NoPlan as error:
                unplanned.append(f"{name} at {budget}: {error}")
                print(f"... {name} {budget}: {error}", file=sys.stderr, flush=True)
                continue
            plan_s = time.monotonic() - start
            report, _ = quietly(
                partial(execute, model, graph, plan, devices, warmup=1, repeats=args.repeats),
                f"executing {name} at {budget}",
            )
            row = Row(name, len(graph), budget, plan, report, profile_s, plan_s, _links(table))
            row.misses = _misses(row)
            rows.append(row)
            out.add(_result(row, devices, args))
            print(f"... {name} {budget}: {_summary(row)}", file=sys.stderr, flush=True)
    _print_table(rows, args, unplanned)
    before, after = (", ".join(f"{x:.2f}" for x in load) for load in (load_before, os.getloadavg()))
    print(f"Load average (1, 5, 15 min) at the start {before}, at the end {after}.")


def _cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, of this process) so far, from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return (sum(fields) - fields[3] - fields[4]) / ticks, own.user + own.system


def _others_busy(work: Callable[[], T]) -> tuple[T, float]:
    """``work()``'s result and the share of the CPUs other processes used meanwhile."""
    try:
        machine0, own0 = _cpu_seconds()
    except (OSError, ValueError, IndexError):
        return work(), 0.0
    start = time.monotonic()
    result = work()
    elapsed = time.monotonic() - start
    machine1, own1 = _cpu_seconds()
    others = (machine1 - machine0) - (own1 - own0)
    return result, max(others, 0.0) / (elapsed * (os.cpu_count() or 1))


def quietly(work: Callable[[], T], what: str) -> tuple[T, float]:
    """``work()`` (and its seconds) run once other processes leave the CPUs idle, and again
    (up to ``QUIET_TRIES`` times in all) when they did not stay idle while it ran: timings
    taken beside other load say more about that load than about the plan."""
    for _ in range(QUIET_TRIES):
        _wait_for_quiet()
        start = time.monotonic()
        result, busy = _others_busy(work)
        seconds = time.monotonic() - start
        if busy <= QUIET_BUSY:
            return result, seconds
        print(f"    {what}: other processes took {busy:.0%} of the CPUs", file=sys.stderr)
    print(f"    {what}: keeping a measurement taken beside other load", file=sys.stderr)
    return result, seconds


def _wait_for_quiet(limit_s: float = QUIET_WAIT_S) -> None:
    """Wait (up to ``limit_s``) until other processes leave the CPUs idle for a second."""
    start = time.monotonic()
    while _others_busy(lambda: time.sleep(1.0))[1] > QUIET_BUSY:
        if time.monotonic() - start > limit_s:
            return


class NoPlan(Exception):
    """No strategy found a plan at a budget."""


def _plan(
    graph: Graph,
    table: CostTable,
    devices: list[Device],
    budget: str,
    time_limit: float,
    strategy: str,
) -> Plan:
    settings = SolverSettings(options=SolveOptions(time_limit_s=time_limit))
    try:
        problem = problem_from_graph(
            graph,
            devices=devices,
            budgets=dict.fromkeys(dict.fromkeys(d.memory_space for d in devices), budget),
            table=table,
            solver=settings,
        )
    except RematError as error:
        raise NoPlan(f"no problem at {budget}: {error}") from None
    attempts: list[Callable[[], StrategyResult]] = [
        lambda: run_strategy("xengine", problem),
        lambda: placed_greedy(problem),
        lambda: run_strategy("auto", problem),
    ]
    if strategy != "xengine":
        attempts = [lambda: run_strategy(strategy, problem)]
    messages = []
    for attempt in attempts:
        try:
            result = attempt()
        except RematError as error:
            messages.append(str(error))
            continue
        if result.plan is not None:
            return result.plan
        messages.append(result.message)
    raise NoPlan(f"no plan at {budget}: {'; '.join(messages)}")


def _misses(row: Row) -> list[str]:
    report, misses = row.report, []
    for device, predicted in report.predicted_peak_bytes.items():
        measured = report.peak_bytes[device]
        allowed = max(PEAK_TOLERANCE[0] * predicted, PEAK_TOLERANCE[1])
        if abs(measured - predicted) > allowed:
            misses.append(
                f"peak {device}: measured {format_bytes(measured)} vs predicted "
                f"{format_bytes(predicted)} (off by {format_bytes(abs(measured - predicted))}, "
                f"allowed {format_bytes(allowed)})"
            )
    predicted_ms = report.predicted_total_ms
    if predicted_ms is not None:
        error = (report.total_ms - predicted_ms) / predicted_ms
        if abs(error) > TIME_TOLERANCE:
            misses.append(
                f"time: measured {report.total_ms:.1f} ms vs predicted {predicted_ms:.1f} ms "
                f"({error:+.1%}, {abs(error) - TIME_TOLERANCE:.1%} beyond the 15% target)"
            )
    if not report.gradients_match:
        misses.append(
            f"gradients: max relative error {report.max_rel_error} > {report.tolerance:.1e}"
        )
    return misses


def _time_error(report: ExecutionReport) -> str:
    if report.predicted_total_ms is None:
        return "n/a"
    return f"{(report.total_ms - report.predicted_total_ms) / report.predicted_total_ms:+.1%}"


def _ops_ms(row: Row) -> float:
    """Measured time of the compute and copy steps alone (the rest of the total is frees
    and the executor's own bookkeeping, which the cost model does not count)."""
    steps = zip(row.plan.steps, row.report.step_ms, strict=True)
    return sum(ms for step, ms in steps if isinstance(step, Compute | Copy))


def _placement(plan: Plan) -> str:
    computes: dict[str, int] = {}
    for step in plan.steps:
        if isinstance(step, Compute):
            computes[step.device] = computes.get(step.device, 0) + 1
    copies = sum(isinstance(s, Copy) for s in plan.steps)
    placed = " + ".join(f"{n} on {d}" for d, n in sorted(computes.items()))
    text = f"{placed}, {copies} copies"
    offloads = sum(isinstance(s, Offload | Prefetch) for s in plan.steps)
    pages = sum(s.op in PAGE_OPS for s in plan.steps)
    if offloads:
        text += f", {offloads} host transfers"
    if pages:
        text += f", {pages} page transfers"
    if plan.paged_fixed:
        reads = sum(isinstance(s, FixedIn | GradOut) for s in plan.steps)
        text += f", {len(plan.paged_fixed)} fixed tensors paged ({reads} transfers)"
    if plan.concurrent:
        text += ", concurrent"
    return text


def _links(table: CostTable) -> str:
    """The profiled links to host memory and storage, as the header states them."""
    parts = []
    for name, host in table.host_links.items():
        parts.append(
            f"{name} host link {host.to_host_bytes_per_s / 1e9:.2f} GB/s out, "
            f"{host.from_host_bytes_per_s / 1e9:.2f} GB/s in, compute slowdown "
            f"{host.compute_slowdown:.2f}"
        )
    for name, disk in table.storage_links.items():
        link = disk.link()
        parts.append(
            f"{name} storage {disk.write_bytes_per_s / 1e9:.2f} GB/s written (fsync'd), "
            f"{disk.read_bytes_per_s / 1e9:.2f} GB/s read, {link.out_latency_ms * 1e3:.0f} / "
            f"{link.in_latency_ms * 1e3:.0f} us latency, "
            f"compute slowdown {disk.compute_slowdown:.2f}"
        )
    return "; ".join(parts)


def _summary(row: Row) -> str:
    report = row.report
    return (
        f"{row.plan.strategy} ({_placement(row.plan)}), "
        f"{report.total_ms:.1f} ms vs {report.predicted_total_ms:.1f} ms predicted, "
        f"peaks {report.peak_bytes} vs {report.predicted_peak_bytes}, "
        f"gradient error {report.max_rel_error:.1e} (tolerance {report.tolerance:.1e}), "
        f"allocator peaks {report.allocator_peak_bytes}, {_energy(report)}"
    )


def _energy(report: ExecutionReport) -> str:
    """Measured energy per run against the plan's prediction, where counters exist."""
    predicted = report.predicted_energy_mj
    if report.energy_mj is None:
        return f"no measured energy ({report.energy_note})"
    against = "" if predicted is None else f" vs {predicted:.1f} mJ predicted"
    return f"energy {report.energy_mj:.1f} mJ per run{against} ({report.energy_note})"


def _peaks(report: ExecutionReport, device: str) -> str:
    """Predicted / measured peak; on CUDA also the allocator's peak."""
    text = (
        f"{format_bytes(report.predicted_peak_bytes.get(device, 0))} / "
        f"{format_bytes(report.peak_bytes.get(device, 0))}"
    )
    if device in report.allocator_peak_bytes:
        text += f" (alloc {format_bytes(report.allocator_peak_bytes[device])})"
    return text


def _describe(device: Device) -> str:
    if device.kind is DeviceKind.CUDA:
        return device.name
    threads = device.threads
    if threads is None:
        return f"{device.name} (default threads)"
    return f"{device.name} ({threads} thread{'s' if threads != 1 else ''})"


def _print_table(rows: list[Row], args: argparse.Namespace, unplanned: list[str]) -> None:
    devices: list[Device] = args.devices
    print(
        f"\nbatch {args.batch}, image {args.image}, width {args.width}, "
        f"devices {' + '.join(_describe(d) for d in devices)}, "
        f"xengine time limit {args.time_limit:g} s, {args.repeats} repeats\n"
    )
    peak_columns = "".join(f"| peak {d.name} pred / meas " for d in devices)
    print(
        "| model (nodes) | budget | plan | predicted ms | measured ms (runs) | time error "
        f"| of which compute + copy {peak_columns}| grad rel error | targets |"
    )
    print("|---" * (9 + len(devices)) + "|")
    for row in rows:
        r = row.report
        runs = ", ".join(f"{ms:.1f}" for ms in r.runs_ms)
        if len(r.runs_ms) > 5:  # more runs where an energy counter needed them
            runs = f"{len(r.runs_ms)} runs, {min(r.runs_ms):.1f}-{max(r.runs_ms):.1f}"
        peaks = "".join(f"| {_peaks(r, d.name)} " for d in devices)
        print(
            f"| {row.model} ({row.nodes}) | {row.budget} | {row.plan.strategy}: "
            f"{_placement(row.plan)} | {r.predicted_total_ms:.1f} | {r.total_ms:.1f} ({runs}) "
            f"| {_time_error(r)} | {_ops_ms(row):.1f} {peaks}"
            f"| {r.max_rel_error:.1e} "
            f"| {'met' if not row.misses else 'MISSED'} |"
        )
    missed = [(row, miss) for row in rows for miss in row.misses]
    print()
    if not missed and not unplanned:
        print("All targets met.")
    for row, miss in missed:
        print(f"- {row.model} at {row.budget}: {miss}")
    for text in unplanned:
        print(f"- {text} (left out of the table)")
    profiled = {r.model: r.profile_s for r in rows}  # one profile per model, for every budget
    timing = ", ".join(f"{model} {seconds:.1f} s" for model, seconds in profiled.items())
    planning = ", ".join(f"{r.model} {r.budget} {r.plan_s:.1f} s" for r in rows)
    print(f"\nProfiling took {timing}; planning {planning}.")
    for model, links in dict((r.model, r.links) for r in rows).items():
        print(f"Measured links ({model}'s profile): {links}.")
    for row in rows:
        if row.report.energy_mj is not None:
            print(f"- {row.model} at {row.budget}: {_energy(row.report)}")


def _result(row: Row, devices: list[Device], args: argparse.Namespace) -> dict[str, object]:
    """``row`` as a result row for ``bench/results/agent.csv``."""
    report = row.report

    def per_device(peaks: dict[str, int]) -> str:
        return ";".join(f"{name}={peaks[name]}" for name in peaks)

    return {
        "model": row.model,
        "budget": row.budget,
        "devices": "+".join(d.name for d in devices),
        "objective": report.predicted_total_ms,
        "seconds": row.plan_s,
        "strategy": row.plan.strategy,
        "nodes": row.nodes,
        "batch": args.batch,
        "image": args.image,
        "width": args.width,
        "time_limit_s": args.time_limit,
        "repeats": args.repeats,
        "placement": _placement(row.plan),
        "measured_ms": report.total_ms,
        "time_error": (
            None
            if report.predicted_total_ms is None
            else (report.total_ms - report.predicted_total_ms) / report.predicted_total_ms
        ),
        "compute_copy_ms": _ops_ms(row),
        "predicted_peak": per_device(report.predicted_peak_bytes),
        "measured_peak": per_device(report.peak_bytes),
        "allocator_peak": per_device(report.allocator_peak_bytes),
        "grad_rel_error": report.max_rel_error,
        "energy_mj": report.energy_mj,
        "predicted_energy_mj": report.predicted_energy_mj,
        "profile_s": row.profile_s,
        "links": row.links,
        "targets": "met" if not row.misses else "missed: " + "; ".join(row.misses),
    }


if __name__ == "__main__":
    main()
