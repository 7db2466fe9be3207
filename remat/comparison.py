"""Strategy comparison tables (used by ``remat demo`` and ``bench/baselines.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from remat.budgets import Reference, reference
from remat.costs import CostModel
from remat.devices import Size, format_bytes
from remat.errors import RematError
from remat.graph import Graph
from remat.simulator import simulate
from remat.strategies import (
    BASELINES,
    OFFLOADING,
    STRATEGIES,
    Problem,
    SolverSettings,
    run_strategy,
)

PERCENTS = (100.0, 75.0, 50.0, 35.0, 25.0)


NO_OFFLOADING = (
    "no device has memory apart from its host (a cpu device's memory is the host's, and so "
    "is a pooled device's)"
)


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
    need_bytes: int | None = None  # when infeasible: the budget the strategy needs
    need_percent: float | None = None  # when infeasible: the budget it needs, in %


def compare(
    graph: Graph,
    costs: CostModel,
    percents: Sequence[float] = PERCENTS,
    strategies: Iterable[str] = STRATEGIES,
    solver: SolverSettings | None = None,
) -> list[Row]:
    """Every strategy at every budget (a % of the checkpoint-all peak on the first device)."""
    device = costs.devices[0].name
    ref = reference(graph, costs, device)
    ideal = costs.ideal_ms(device)
    rows = []
    for strategy in strategies:
        for percent in percents:
            budget = Size(percent=percent).resolve(ref.fixed_bytes, ref.peak_bytes)
            problem = Problem(graph, costs, {device: budget}, solver or SolverSettings())
            row = _row(problem, strategy, percent, device, ideal)
            rows.append(_with_need(row, ref))
    return rows


def _with_need(row: Row, ref: Reference) -> Row:
    if row.need_bytes is None:
        return row
    activations = max(ref.peak_bytes - ref.fixed_bytes, 1)
    percent = 100.0 * (row.need_bytes - ref.fixed_bytes) / activations
    return replace(row, need_percent=percent)


def _row(problem: Problem, strategy: str, percent: float, device: str, ideal: float) -> Row:
    outcome = _judge(problem, strategy, ideal, device)
    return Row(
        strategy,
        percent,
        problem.budgets[device] or 0,
        outcome.predicted_ms,
        outcome.overhead,
        outcome.peak_bytes,
        outcome.valid,
        outcome.note,
        outcome.need_bytes,
    )


@dataclass(frozen=True)
class Baseline:
    """A strategy's plan for a problem as given (its budgets, all its devices), re-judged
    by the simulator; ``overhead`` is against the ideal on the fastest devices."""

    strategy: str
    predicted_ms: float | None
    overhead: float | None
    peak_bytes: dict[str, int]
    valid: bool | None  # the simulator's verdict, None without a plan
    note: str = ""
    need_bytes: int | None = None  # when infeasible: the budget the strategy needs
    energy_mj: float | None = None  # predicted (remat.energy), None without a plan


@dataclass(frozen=True)
class Baselines:
    ideal_ms: float  # every node once on its fastest device, no copies
    items: list[Baseline]


def baselines(problem: Problem, strategies: Iterable[str] = (*BASELINES, *OFFLOADING)) -> Baselines:
    """Each baseline (Checkmate's Table 1 and the offloading heuristics) on the problem's
    own inputs: what a job's plan is compared with. A single-device baseline runs on each
    device (an offloading one on each with memory apart from its host) and its best plan
    counts."""
    ideal = problem.costs.ideal_ms()
    return Baselines(ideal, [_judge(problem, strategy, ideal) for strategy in strategies])


def _judge(problem: Problem, strategy: str, ideal: float, device: str | None = None) -> Baseline:
    own_memory = any(d.has_own_memory for d in problem.costs.devices)
    if strategy in OFFLOADING and device is None and not own_memory:
        return Baseline(strategy, None, None, {}, None, f"n/a: {NO_OFFLOADING}")
    try:
        result = run_strategy(strategy, problem, device)
    except RematError as exc:
        return Baseline(strategy, None, None, {}, None, f"n/a: {exc}")
    if result.plan is None:
        need = max((result.min_budget_bytes or {}).values(), default=None)
        return Baseline(strategy, None, None, {}, None, result.message, need)
    verdict = simulate(result.plan, problem.graph, problem.costs)  # judged independently
    return Baseline(
        strategy,
        verdict.total_ms,
        verdict.total_ms / ideal - 1,
        verdict.peak_bytes,
        verdict.valid,
        energy_mj=verdict.energy_mj,
    )


def format_table(rows: Sequence[Row]) -> str:
    """One line per strategy and budget; a strategy that does not apply gets one line."""
    header = ("strategy", "budget", "predicted", "overhead", "peak", "valid")
    lines = [header]
    not_applicable: set[str] = set()
    for row in rows:
        if row.note.startswith("n/a"):
            if row.strategy not in not_applicable:
                not_applicable.add(row.strategy)
                lines.append((row.strategy, "any", "-", "-", _shorten(row.note), "-"))
            continue
        lines.append(
            (row.strategy, f"{row.percent:.0f}% {format_bytes(row.budget_bytes)}", *_cells(row))
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def _cells(row: Row) -> tuple[str, str, str, str]:
    if row.predicted_ms is None or row.overhead is None:
        return (
            "infeasible",
            "-",
            _shorten(row.note.replace("infeasible at this budget: ", "")),
            "-",
        )
    peaks = " ".join(f"{d}={format_bytes(v)}" for d, v in row.peak_bytes.items())
    verdict = "yes" if row.valid else "NO"
    return f"{row.predicted_ms:.3f} ms", format_overhead(row.overhead), peaks, verdict


def format_overhead(overhead: float) -> str:
    """A signed percentage; rounding noise around zero prints as +0.0%."""
    return f"{0.0 if abs(overhead) < 5e-4 else overhead:+.1%}"


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
