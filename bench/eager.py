"""The executor against plain PyTorch (issue 37): a training step of a PyTorch corpus module
(``agents/pytorch/corpus.py``, at its bench scale) as eager autograd runs it (forward, the
entry's loss, the parameters' gradients), against the executor running the checkpoint-all
plan of the module's ONNX export (``--exporter``: TorchScript's by default, training mode)
on one CPU device
with the same thread count, or with ``--device cuda`` on the first CUDA GPU (both sides in
IEEE float32, no TF32, and each eager run ending with a synchronisation). Both take the
median of ``--repeats`` timed runs, made in
``--rounds`` alternating rounds (eager's runs, then the executor's, each round after two
warm-ups and on a quiet machine, ``agent.quietly``) so that a drift of the machine's speed
reaches both sides alike, in one process whose host heap is kept
(``agents.torch_devices.keep_host_heap``). That process is made ``--processes`` times,
fresh each time: on this VM one process's both sides can run 20-40% slower or faster than
the next's (where its heap and threads land), so a row gives the medians over the
processes, and the ratio's median with its range.

Columns: the plan's steps; eager and executor milliseconds and their ratio; the executor's
own time per step outside the kernels' (its total less the sum of its steps' times, over
the steps; the step-timed run is slower than the measured ones, so this can go below 0)
and per compute step inside them (the steps' times less the profiler's median node
times, a rough split: the profiler times each node with the same call); and the
profiler's ``step_overhead_ms`` (the executor's median run less its node times, per
compute step: what the cost model adds to each node); and the plan's peak as the simulator
predicts it with analytical costs (the kernels' workspace included); and the fused
attention nodes' steps, forward and backward, summed in the step-timed run.

Prints a markdown table and appends rows to ``bench/results/eager.csv``.

    .venv/bin/python bench/eager.py [--models small_cnn,resnet18,transformer_encoder]
        [--threads 2] [--device cpu|cuda] [--repeats 20] [--rounds 4] [--processes 3]
        [--exporter torchscript|dynamo] [--no-fuse-attention] [--input-shape 8,3,224,224]
        [--run LABEL]

``--no-fuse-attention`` plans each attention chain node by node
(``forward_graph(fuse_attention=False)``; fused is the default). ``--input-shape`` gives
every model's first input this shape instead of its bench scale's (the corpus' images
are 64 x 64 there; ImageNet's are 224 x 224): the ``input_shape`` column.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from dataclasses import replace
from typing import Any

from agent import quietly
from results import Writer, add_run_argument

from agents.executor import ExecutionReport, execute
from agents.profiler import profile
from agents.program import build_program
from agents.pytorch.check import export_entry
from agents.pytorch.corpus import CORPUS
from agents.pytorch.export import EXPORTERS, Exporter
from agents.pytorch.reference import model_inputs, module_gradients
from agents.torch_devices import keep_host_heap, measuring, runtime_of
from remat.cli import fusion_argument
from remat.devices import Device, DeviceKind
from remat.errors import InvalidInputError
from remat.graph import Mode
from remat.onnx_fusion import ATTENTION
from remat.onnx_ingest import forward_graph, parse_input_shape
from remat.plan import Compute
from remat.problem import problem_from_graph
from remat.strategies import run_strategy
from remat.training import for_mode

WARMUP = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small_cnn,resnet18,transformer_encoder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--exporter", choices=EXPORTERS, default="torchscript")
    parser.add_argument("--input-shape", type=_shape, help="e.g. 8,3,224,224")
    fusion_argument(parser)
    add_run_argument(parser)
    args = parser.parse_args()
    out = Writer("eager", args.run)
    print(
        "| model (nodes) | steps | eager ms | executor ms | executor / eager (range) "
        "| outside the kernels, us per step | inside, us per compute | step overhead, us "
        "| attention steps ms | predicted peak MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter, heap and threads
    for name in args.models.split(","):
        rows = []
        for _ in range(args.processes):
            with spawn.Pool(1) as pool:
                measure = (
                    name,
                    _device(args.device, args.threads),
                    args.repeats,
                    args.rounds,
                    args.fuse_attention,
                    args.exporter,
                    args.input_shape,
                )
                rows.append(pool.apply(_measure, measure))
        row = _over_processes(rows)
        out.add(row)
        print(
            f"| {name} ({row['nodes']}) | {row['steps']} | {row['eager_ms']:.2f} "
            f"| {row['measured_ms']:.2f} | {row['ratio']:.3f} "
            f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f}) "
            f"| {row['outside_us_per_step']:.1f} | {row['inside_us_per_compute']:.1f} "
            f"| {row['step_overhead_us']:.1f} | {row['attention_ms']:.1f} "
            f"| {row['predicted_peak_mib']:.1f} |",
            flush=True,
        )


def _over_processes(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from each process's: medians of the measured columns, the ratio's range."""
    row = dict(rows[0])
    for key in (
        "eager_ms",
        "measured_ms",
        "ratio",
        "outside_us_per_step",
        "inside_us_per_compute",
        "step_overhead_us",
        "attention_ms",
    ):
        row[key] = statistics.median(r[key] for r in rows)
    ratios = [r["ratio"] for r in rows]
    row["ratio_min"], row["ratio_max"] = min(ratios), max(ratios)
    row["gradients_match"] = all(r["gradients_match"] for r in rows)
    row["processes"] = len(rows)
    return row


def _shape(text: str) -> tuple[int, ...]:
    """``--input-shape``'s sizes, as ``remat plan --input`` reads them."""
    try:
        return parse_input_shape(f"input={text}")[1]
    except InvalidInputError:
        raise argparse.ArgumentTypeError(
            f"not a shape: {text!r} (positive sizes, e.g. 8,3,224,224)"
        ) from None


def _device(kind: str, threads: int) -> Device:
    """The one device both sides run on: a CPU with ``threads``, or the first CUDA GPU."""
    if kind == "cuda":
        return Device("cuda0", DeviceKind.CUDA)
    return Device("cpu0", DeviceKind.CPU, {"threads": str(threads)})


def _measure(
    name: str,
    device: Device,
    repeats: int,
    rounds: int,
    fuse_attention: bool,
    exporter: Exporter,
    input_shape: tuple[int, ...] | None,
) -> dict[str, Any]:
    """One corpus model's row from this process: eager, the executor, and the profiler's
    node times."""
    keep_host_heap()  # eager's runs too, as the executor's (``agents.torch_devices``)
    runtime = runtime_of(device)
    entry = CORPUS[name]
    if input_shape is not None:
        entry = replace(entry, shapes={**entry.shapes, "bench": input_shape})
    exported = export_entry(entry, "bench", exporter)
    forward = forward_graph(exported.model, fuse_attention=fuse_attention)
    graph = for_mode(forward, Mode.TRAINING, entry.loss)
    problem = problem_from_graph(graph, devices=[device])
    plan = run_strategy("checkpoint_all", problem, device.name).plan
    assert plan is not None
    inputs = model_inputs(exported.model, exported.args)
    program = build_program(exported.model, graph, inputs)
    labels = None
    if program.loss.labels is not None:
        labels = program.fixed[program.loss.labels]
        inputs[program.loss.labels] = labels.numpy()
    module = exported.module.to(runtime.torch_device)
    args = [a.to(runtime.torch_device) for a in exported.args]
    on_device = None if labels is None else labels.to(runtime.torch_device)

    def eager(count: int) -> list[float]:
        runtime.activate()
        times = []
        with measuring():
            for run in range(WARMUP + count):
                start = time.perf_counter()
                module_gradients(module, args, program.loss, on_device)
                runtime.synchronize()
                if run >= WARMUP:
                    times.append((time.perf_counter() - start) * 1e3)
        return times

    def executed(count: int) -> ExecutionReport:
        return execute(
            exported.model, graph, plan, [device], inputs=inputs, warmup=WARMUP, repeats=count
        )

    # Alternating rounds, so that both sides see the same machine (this VM's speed drifts
    # by 10-30% within minutes).
    eager_runs: list[float] = []
    executor_runs: list[float] = []
    count = max(repeats // rounds, 1)
    for _ in range(rounds):
        eager_runs += quietly(lambda: eager(count), f"eager {name}")[0]
        report, _ = quietly(lambda: executed(count), f"executing {name}")
        executor_runs += report.runs_ms
    eager_ms, executor_ms = statistics.median(eager_runs), statistics.median(executor_runs)
    table, _ = quietly(
        lambda: profile(exported.model, graph, [device], repeats=5, warmup=WARMUP),
        f"profiling {name}",
    )
    kernels_ms = sum(entry.compute_ms[device.name] for entry in table.nodes.values())
    steps, computes = len(plan.steps), sum(1 for s in plan.steps if s.op == "compute")
    return {
        "model": name,
        "exporter": exporter,
        "input_shape": "x".join(map(str, input_shape)) if input_shape is not None else "",
        "nodes": len(graph),
        "devices": ":".join([device.name, *(f"{k}={v}" for k, v in device.options.items())]),
        "steps": steps,
        "eager_ms": eager_ms,
        "measured_ms": executor_ms,
        "ratio": executor_ms / eager_ms,
        "outside_us_per_step": (executor_ms - sum(report.step_ms)) / steps * 1e3,
        "attention_ms": sum(
            ms
            for step, ms in zip(plan.steps, report.step_ms, strict=True)
            if isinstance(step, Compute) and graph.nodes[step.node].op == ATTENTION
        ),
        "inside_us_per_compute": (sum(report.step_ms) - kernels_ms) / computes * 1e3,
        "step_overhead_us": table.devices[0].step_overhead_ms * 1e3,
        "gradients_match": report.gradients_match,
        "predicted_peak_mib": report.predicted_peak_bytes[device.name] / 2**20,
        "rounds": rounds,
    }


if __name__ == "__main__":
    main()
