"""Strategies: (problem, device) -> StrategyResult, by name.

``STRATEGIES`` is open: solvers register themselves with ``register`` (or by adding an
entry) and become available to ``run_strategy`` under their name. ``BASELINES`` are the
heuristics of Checkmate Table 1 (section 6.1).
"""

from __future__ import annotations

from collections.abc import Callable

from remat.errors import StrategyError
from remat.strategies.base import Problem, StrategyResult
from remat.strategies.checkpoint_all import checkpoint_all
from remat.strategies.chen import (
    ap_greedy,
    ap_sqrt,
    chen_greedy,
    chen_sqrt,
    linearized_greedy,
    linearized_sqrt,
)
from remat.strategies.evict import greedy_evict
from remat.strategies.griewank import griewank
from remat.strategies.optimal import checkmate_lp_rounding, checkmate_milp, xengine

Strategy = Callable[[Problem, str], StrategyResult]

STRATEGIES: dict[str, Strategy] = {
    "checkpoint_all": checkpoint_all,
    "chen_sqrt": chen_sqrt,
    "chen_greedy": chen_greedy,
    "ap_sqrt": ap_sqrt,
    "ap_greedy": ap_greedy,
    "linearized_sqrt": linearized_sqrt,
    "linearized_greedy": linearized_greedy,
    "griewank": griewank,
}

BASELINES: tuple[str, ...] = tuple(STRATEGIES)

STRATEGIES |= {
    "greedy_evict": greedy_evict,  # not Checkmate's: for budgets the baselines miss
    "checkmate_milp": checkmate_milp,
    "checkmate_lp_rounding": checkmate_lp_rounding,
    "xengine": xengine,  # type: ignore[dict-item]
}
OPTIMAL: tuple[str, ...] = ("checkmate_milp", "checkmate_lp_rounding", "xengine")
MULTI_DEVICE = frozenset({"xengine"})  # place operators themselves: run once, all devices


def register(name: str, strategy: Strategy) -> None:
    """Make ``strategy`` available to ``run_strategy`` as ``name``."""
    STRATEGIES[name] = strategy


def run_strategy(name: str, problem: Problem, device: str | None = None) -> StrategyResult:
    """Run strategy ``name`` on one device, or on each device of the cost model (None) and
    return the cheapest feasible result, else the infeasible one needing the least memory."""
    strategy = STRATEGIES.get(name)
    if strategy is None:
        known = ", ".join(STRATEGIES)
        raise StrategyError(f"unknown strategy {name!r}; known strategies: {known}")
    if name in MULTI_DEVICE:
        return strategy(problem, device)  # type: ignore[arg-type]
    if device is not None:
        problem.costs.device_index(device)  # an unknown device is a clear error
        return strategy(problem, device)
    results = [strategy(problem, d.name) for d in problem.costs.devices]
    return min(results, key=_rank)


def _rank(result: StrategyResult) -> tuple[int, float]:
    if result.feasible and result.simulation is not None:
        return (0, result.simulation.total_ms)
    need = result.min_budget_bytes or {}
    return (1, float(max(need.values())) if need else float("inf"))


__all__ = [
    "BASELINES",
    "MULTI_DEVICE",
    "OPTIMAL",
    "STRATEGIES",
    "Problem",
    "Strategy",
    "StrategyResult",
    "register",
    "run_strategy",
]
