"""Baseline strategies on the built models: predicted overhead vs ideal (analytical costs)
at 100, 75, 50, 35 and 25% of the checkpoint-all peak, then the time to ingest, build the
training graph and simulate a plan for the largest model.

Prints markdown tables and appends their rows to ``bench/results/baselines.csv`` (one per
model, strategy and budget: the overhead, or the budget the strategy needs) and
``bench/results/ingestion.csv`` (one per step); ``bench/report.py`` renders them.

    .venv/bin/python bench/baselines.py [--batch 8] [--models vgg16,resnet18,...] [--run LABEL]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

from results import Writer, add_run_argument

from remat import samples
from remat.budgets import reference
from remat.comparison import PERCENTS, Row, compare, format_overhead
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind, Size
from remat.onnx_ingest import forward_graph, load_model
from remat.simulator import simulate
from remat.strategies import BASELINES, Problem, run_strategy
from remat.training import training_graph

CPU = Device("cpu0", DeviceKind.CPU, {"threads": "4"})
T = TypeVar("T")


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def overhead_table(models: list[str], batch: int, out: Writer) -> None:
    header = f"| model (training nodes) | strategy | {' | '.join(f'{p:.0f}%' for p in PERCENTS)} |"
    print(header)
    print("|" + "---|" * (2 + len(PERCENTS)))
    for name in models:
        graph = training_graph(forward_graph(samples.ZOO[name](), batch=batch))
        costs = analytical_costs(graph, [CPU])
        rows = compare(graph, costs, strategies=BASELINES)
        for strategy in dict.fromkeys(r.strategy for r in rows):
            cells = [_cell(r) for r in rows if r.strategy == strategy]
            print(f"| {name} ({len(graph)}) | {strategy} | {' | '.join(cells)} |")
        out.add_all(_result(r, name, len(graph), batch) for r in rows)


def _result(row: Row, model: str, nodes: int, batch: int) -> dict[str, object]:
    """``row`` as a result row (``overhead`` a fraction; ``need_percent`` when infeasible;
    ``note`` "n/a" when the strategy does not apply)."""
    result: dict[str, object] = {
        "model": model,
        "budget": f"{row.percent:.0f}%",
        "devices": CPU.name,
        "objective": row.predicted_ms,
        "strategy": row.strategy,
        "nodes": nodes,
        "batch": batch,
        "budget_bytes": row.budget_bytes,
    }
    if row.note.startswith("n/a"):
        result["note"] = "n/a"
    elif row.predicted_ms is not None:
        result["overhead"] = row.overhead
    else:
        result["need_percent"] = row.need_percent
    return result


def _cell(row: Row) -> str:
    if row.note.startswith("n/a"):
        return "n/a"
    if row.predicted_ms is None:
        return f"needs {row.need_percent:.0f}%" if row.need_percent is not None else "infeasible"
    assert row.valid and row.overhead is not None
    return format_overhead(row.overhead)


def timing_table(batch: int, out: Writer) -> None:
    model = samples.large()
    data = model.SerializeToString()
    print(f"\nlargest model: {len(model.graph.node)} ONNX operators, {len(data) / 2**20:.1f} MiB")
    print("| step | seconds |")
    print("|---|---|")
    loaded, t_load = _timed(lambda: load_model(data))
    forward, t_forward = _timed(lambda: forward_graph(loaded, batch=batch))
    graph, t_train = _timed(lambda: training_graph(forward))
    costs = analytical_costs(graph, [CPU])
    ref = reference(graph, costs)
    budget = Size(percent=50).resolve(ref.fixed_bytes, ref.peak_bytes)
    problem = Problem(graph, costs, {CPU.name: budget})
    strategy = "linearized_greedy"
    planned, t_strategy = _timed(lambda: run_strategy(strategy, problem, CPU.name))
    assert planned.plan is not None, planned.message
    plan = planned.plan
    result, t_simulate = _timed(lambda: simulate(plan, graph, costs))
    assert result.valid
    steps = [
        ("load + check (onnx.checker)", t_load),
        (f"shape inference + forward graph ({len(forward)} nodes)", t_forward),
        (f"training graph ({len(graph)} nodes)", t_train),
        ("ingestion + training graph total", t_load + t_forward + t_train),
        (f"{strategy} at 50% (sweep: R solve, compile, simulate)", t_strategy),
        (f"simulate its plan ({len(plan.steps)} steps, {result.computes} computes)", t_simulate),
    ]
    for step, seconds in steps:
        print(f"| {step} | {seconds:.3f} |")
    common = {"model": "large", "devices": CPU.name, "batch": batch}
    out.add_all(common | {"step": step, "seconds": seconds} for step, seconds in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--models", default=",".join(samples.ZOO))
    add_run_argument(parser)
    args = parser.parse_args()
    overhead_table(args.models.split(","), args.batch, Writer("baselines", args.run))
    timing_table(args.batch, Writer("ingestion", args.run))


if __name__ == "__main__":
    main()
