"""The optimal strategies per backend: seconds to the first plan, to the final plan, to a
5% and a 1% gap (or the gap at the time limit), objective vs the best baseline and vs the
ideal, and the peak memory of the bench and its solver subprocesses together.

Models in training mode at 100, 50 and 25% of the checkpoint-all peak, on one device
(``checkmate_milp``, or the ``--strategies`` named, on the device with the lower ideal)
and on cpu+cuda (``xengine``, each device with that budget). Analytical costs in XEngine's
regime (section 4.2: CPU and GPU comparably fast, each winning on some operators): a
12-thread CPU and an integrated-GPU-like device (2 TFLOP/s, 60 GB/s, 10 us launches). The
gap is against the bound of the whole problem (the solver's, the recomputation cover's or
the ideal, whichever is largest).

Prints a markdown table and appends its rows to ``bench/results/solvers.csv`` as they are
measured (``bench/report.py`` renders them).

    .venv/bin/python bench/solvers.py [--time-limit 30] [--batch 4] [--models vgg16,unet,large8]
        [--budgets 100,50,25] [--setups one,two] [--backends highs,cpsat,scip,gurobi]
        [--strategies checkmate_milp,moccasin] [--reuse] [--run LABEL]

``--reuse``: each row's search starts from the plans of the rows before it of the same
model and budget (``SolverSettings.known_plans``), as a job of the service starts from its
model's earlier jobs' plans: with ``--setups one,two`` the two-device search starts from
the one-device plan.

``--models`` takes the sample zoo's names, ``large<blocks>``, ``torch:NAME`` (a model of
the PyTorch corpus, exported at its bench scale: ``torch:resnet50``, ``torch:densenet121``)
and ``onnx:NAME`` (a model of the ONNX model zoo as the onnx package ships it, converted
from Caffe2 at opset 9: ``onnx:resnet50``, ``onnx:inception_v2``, ``onnx:densenet121``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from report import solver_label
from results import Writer, add_run_argument

from remat import samples
from remat.budgets import reference
from remat.costs import CostModel, analytical_costs
from remat.devices import Device, DeviceKind, Size
from remat.graph import Graph
from remat.onnx_ingest import forward_graph, load_model
from remat.plan import Plan
from remat.solvers import runner
from remat.solvers.model import Progress, SolveOptions
from remat.strategies import Problem, SolverSettings, StrategyResult, run_strategy
from remat.strategies.baselines import best_baseline
from remat.training import training_graph

CPU = Device("cpu0", DeviceKind.CPU, {"threads": "12"})
IGPU = Device("cuda0", DeviceKind.CUDA, {"flops": "2e12", "bandwidth": "60e9", "launch_us": "10"})
MODELS = ("vgg16", "resnet18", "unet", "mobilenet_v1", "transformer")
TARGET_GAP = 0.01
NEAR_GAP = 0.05
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass
class _Clock:
    """Wall-clock times of the first plan, of the final plan (when the incumbent last
    improved) and of the first 5% and 1% gaps, from progress events."""

    start: float
    ideal: float
    first_plan: float | None = None
    final_plan: float | None = None
    best: float | None = None
    first_gap: float | None = None
    near_gap: float | None = None
    elapsed: float | None = None  # the whole strategy call

    def __call__(self, progress: Progress) -> None:
        if progress.objective is None:
            return
        now = time.monotonic() - self.start
        if self.first_plan is None:
            self.first_plan = now
        if self.best is None or progress.objective < self.best * (1 - 1e-9):
            self.best, self.final_plan = progress.objective, now
        bound = max(progress.bound or 0.0, self.ideal)
        gap = (progress.objective - bound) / progress.objective if progress.objective else 0
        if self.first_gap is None and gap <= TARGET_GAP:
            self.first_gap = now
        if self.near_gap is None and gap <= NEAR_GAP:
            self.near_gap = now


class _MemoryPeak:
    """The largest resident memory of this process and its descendants (the solver
    subprocesses) together, sampled from /proc every 0.1 s while the ``with`` block runs;
    None where /proc is not there."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> _MemoryPeak:
        if Path("/proc/self/stat").exists():
            self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def _sample(self) -> None:
        while True:
            rss = _tree_rss(os.getpid())
            self.peak = rss if self.peak is None else max(self.peak, rss)
            if self._done.wait(0.1):
                return


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and every descendant (Linux /proc)."""
    parent: dict[int, int] = {}
    rss: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while listed
        pid = int(stat.parent.name)
        parent[pid], rss[pid] = int(fields[1]), int(fields[21]) * PAGE
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, up in parent.items() if up == pid and child not in tree]
        tree.update(children)
        frontier += children
    return sum(rss.get(pid, 0) for pid in tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budgets", default="100,50,25")
    parser.add_argument("--setups", default="one,two")
    parser.add_argument("--backends", default=",".join(runner.BACKENDS))
    parser.add_argument(
        "--strategies",
        default="checkmate_milp",
        help="one-device strategies (moccasin solves with CP-SAT whatever the backend)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="start each row from the plans of the model's earlier rows at its budget",
    )
    add_run_argument(parser)
    args = parser.parse_args()
    out = Writer("solvers", args.run)
    print(
        "| model (stages) | budget | devices | backend | status | first plan s | final plan s "
        "| 5% gap s | 1% gap s | objective ms | vs best baseline | vs ideal | total s "
        "| peak MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        graph = bench_graph(name, args.batch)
        costs = analytical_costs(graph, [CPU, IGPU])
        ref = reference(graph, costs)
        for percent in (float(p) for p in args.budgets.split(",")):
            budget = Size(percent=percent).resolve(ref.fixed_bytes, ref.peak_bytes)
            known: list[Plan] = []  # the plans of this model and budget's rows (--reuse)
            for setup in args.setups.split(","):
                devices = _devices(costs, setup)
                problem = Problem(graph, costs, dict.fromkeys(devices, budget))
                baseline = _best_baseline(problem, devices)
                strategies = args.strategies.split(",") if len(devices) == 1 else ["xengine"]
                for strategy, backend in _solvers(strategies, args.backends.split(",")):
                    started = tuple(known) if args.reuse else ()
                    row, result, plan = _run(
                        problem, devices, strategy, backend, args.time_limit, baseline, started
                    )
                    known += [] if plan is None else [plan]
                    print(f"| {name} ({len(graph)}) | {percent:.0f}% | {row}", flush=True)
                    what = {"model": name, "nodes": len(graph), "budget": f"{percent:.0f}%"}
                    setting = {"batch": args.batch, "time_limit_s": args.time_limit}
                    reused = {"reuse": len(started)} if args.reuse else {}
                    out.add(what | result | setting | reused)


def _solvers(strategies: list[str], backends: list[str]) -> list[tuple[str, str]]:
    return [
        (strategy, backend)
        for strategy in strategies
        for backend in (["cpsat"] if strategy == "moccasin" else backends)
    ]


def bench_budgets(
    percents: str, of_peak: str, fixed_bytes: int, peak_bytes: int
) -> list[tuple[str, int]]:
    """Budgets by label and bytes: comma-separated percentages of checkpoint-all's
    activations (``percents``: 100% is its peak, 0% its fixed memory), then of its whole
    peak, fixed memory included (``of_peak``, labelled ``N% of peak``)."""
    budgets = [
        (f"{p:.0f}%", Size(percent=p).resolve(fixed_bytes, peak_bytes))
        for p in (float(p) for p in percents.split(",") if p)
    ]
    return budgets + [
        (f"{p:.0f}% of peak", round(peak_bytes * p / 100))
        for p in (float(p) for p in of_peak.split(",") if p)
    ]


def bench_graph(name: str, batch: int) -> Graph:
    """The training graph of a zoo model, of ``large<blocks>`` (the deep transformer stack
    that is decomposed), of ``torch:NAME``: the PyTorch corpus's model (its ``bench``
    scale, TorchScript export in training mode; ``agents/pytorch/corpus.py``), or of
    ``onnx:NAME``: the ONNX model zoo's, as the onnx package ships it
    (``samples.onnx_zoo``)."""
    if name.startswith("torch:"):
        from agents.pytorch.check import export_entry
        from agents.pytorch.corpus import CORPUS

        entry = CORPUS[name.removeprefix("torch:")]
        return training_graph(forward_graph(export_entry(entry, "bench").model))
    if name.startswith("onnx:"):
        path = samples.onnx_zoo()[name.removeprefix("onnx:")]
        return training_graph(forward_graph(load_model(path), batch=batch))
    if name.startswith("large"):
        blocks = int(name.removeprefix("large") or 8)
        return training_graph(forward_graph(samples.large(blocks=blocks), batch=batch))
    return training_graph(forward_graph(samples.ZOO[name](), batch=batch))


def _devices(costs: CostModel, setup: str) -> tuple[str, ...]:
    if setup == "two":
        return ("cpu0", "cuda0")
    return (min(("cpu0", "cuda0"), key=costs.ideal_ms),)


def _best_baseline(problem: Problem, devices: tuple[str, ...]) -> float | None:
    best = best_baseline(problem, devices)
    return None if best is None or best.simulation is None else best.simulation.total_ms


def _run(
    problem: Problem,
    devices: tuple[str, ...],
    strategy: str,
    backend: str,
    limit: float,
    baseline: float | None,
    known: tuple[Plan, ...] = (),
) -> tuple[str, dict[str, Any], Plan | None]:
    """The row of ``strategy`` on ``problem`` started from ``known`` plans: its table text,
    its result fields and its plan."""
    ideal = problem.costs.ideal_ms(devices[0] if len(devices) == 1 else None)
    clock = _Clock(time.monotonic(), ideal)
    options = SolveOptions(time_limit_s=limit, gap=1e-4, threads=2)
    settings = SolverSettings(
        backend=backend, options=options, on_progress=clock, known_plans=known
    )
    problem = Problem(problem.graph, problem.costs, problem.budgets, settings)
    with _MemoryPeak() as memory:
        if len(devices) == 1:
            result = run_strategy(strategy, problem, devices[0])
        else:
            result = run_strategy(strategy, problem)
    clock.elapsed = time.monotonic() - clock.start
    peak_mib = None if memory.peak is None else memory.peak / 2**20
    text = _row(result, devices, solver_label(strategy, backend), clock, baseline, ideal)
    text += f" {_f(peak_mib, '.0f')} |"
    row: dict[str, Any] = {"devices": "+".join(devices), "backend": backend, "strategy": strategy}
    row |= {"seconds": clock.elapsed, "peak_mib": peak_mib, "message": result.message}
    solver = result.plan.solver if result.feasible and result.plan is not None else None
    if solver is None:
        row["status"] = "infeasible" if "infeasible" in result.message else "no plan"
        return text, row, None
    row |= {"status": solver.status, "objective": solver.objective, "gap": solver.gap}
    row |= {"first_plan_s": clock.first_plan, "final_plan_s": clock.final_plan}
    row |= {"gap_5pct_s": clock.near_gap, "gap_1pct_s": clock.first_gap}
    if baseline is not None:
        row["vs_baseline"] = solver.objective / baseline - 1
    row["vs_ideal"] = solver.objective / ideal - 1
    return text, row, result.plan


def _row(
    result: StrategyResult,
    devices: tuple[str, ...],
    backend: str,
    clock: _Clock,
    baseline: float | None,
    ideal: float,
) -> str:
    where = "+".join(devices)
    if not result.feasible or result.plan is None or result.plan.solver is None:
        status = "infeasible" if "infeasible" in result.message else "no plan"
        print(f"{where} {backend}: {result.message}", file=sys.stderr)  # why, off the table
        return f"{where} | {backend} | {status} | - | - | - | - | - | - | - | {_s(clock.elapsed)} |"
    solver = result.plan.solver
    objective = solver.objective
    if clock.first_gap is None and solver.gap <= TARGET_GAP:
        clock.first_gap = clock.elapsed  # the final result is the first report within the gap
    if clock.near_gap is None and solver.gap <= NEAR_GAP:
        clock.near_gap = clock.elapsed
    gap = f"{_s(clock.first_gap)}" if clock.first_gap is not None else f"gap {solver.gap:.1%}"
    versus = "-" if baseline is None else f"{objective / baseline - 1:+.1%}"
    return (
        f"{where} | {backend} | {solver.status} | {_s(clock.first_plan)} | "
        f"{_s(clock.final_plan)} | {_s(clock.near_gap)} | {gap} | "
        f"{objective:.3f} | {versus} | {objective / ideal - 1:+.1%} | {_s(clock.elapsed)} |"
    )


def _s(seconds: float | None) -> str:
    return _f(seconds, ".1f")


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    main()
