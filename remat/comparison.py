"""Strategy comparison tables (used by ``remat demo`` and ``bench/baselines.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from remat.budgets import reference
from remat.costs import CostModel
from remat.devices import Size, format_bytes
from remat.errors import RematError
from remat.graph import Graph
from remat.simulator import simulate
from remat.strategies import STRATEGIES, run_strategy
from remat.strategies.base import Problem

PERCENTS = (100.0, 75.0, 50.0, 35.0, 25.0)


@dataclass(frozen=True)
class Row:
    strategy: str
    percent: float
    budget_bytes: int
    predicted_ms: float | None
    overhead: float | None  # predicted / ideal - 1
    peak_bytes: dict[str, int]
    valid: bool | None  # the simulator's verdict on the plan, None without a plan
    note: str = ""


def compare(
    graph: Graph,
    costs: CostModel,
    percents: Sequence[float] = PERCENTS,
    strategies: Iterable[str] = STRATEGIES,
) -> list[Row]:
    """Every strategy at every budget (a % of the checkpoint-all peak on the first device)."""
    device = costs.devices[0].name
    ref = reference(graph, costs, device)
    ideal = costs.ideal_ms(device)
    rows = []
    for strategy in strategies:
        for percent in percents:
            budget = Size(percent=percent).resolve(ref.fixed_bytes, ref.peak_bytes)
            rows.append(_row(graph, costs, strategy, percent, budget, device, ideal))
    return rows


def _row(
    graph: Graph,
    costs: CostModel,
    strategy: str,
    percent: float,
    budget: int,
    device: str,
    ideal: float,
) -> Row:
    problem = Problem(graph, costs, {device: budget})
    try:
        result = run_strategy(strategy, problem, device)
    except RematError as exc:
        return Row(strategy, percent, budget, None, None, {}, None, f"n/a: {exc}")
    if result.plan is None:
        return Row(strategy, percent, budget, None, None, {}, None, result.message)
    verdict = simulate(result.plan, graph, costs)  # re-judged independently of the strategy
    return Row(
        strategy,
        percent,
        budget,
        verdict.total_ms,
        verdict.total_ms / ideal - 1,
        verdict.peak_bytes,
        verdict.valid,
    )


def format_table(rows: Sequence[Row]) -> str:
    header = ("strategy", "budget", "predicted", "overhead", "peak", "valid")
    lines = [header]
    for row in rows:
        budget = f"{row.percent:.0f}% {format_bytes(row.budget_bytes)}"
        if row.predicted_ms is None:
            note = row.note if len(row.note) <= 70 else row.note[:67] + "..."
            lines.append((row.strategy, budget, "-", "-", note, "-"))
            continue
        peaks = " ".join(f"{d}={format_bytes(v)}" for d, v in row.peak_bytes.items())
        lines.append(
            (
                row.strategy,
                budget,
                f"{row.predicted_ms:.3f} ms",
                f"{row.overhead:+.1%}",
                peaks,
                "yes" if row.valid else "NO",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )
