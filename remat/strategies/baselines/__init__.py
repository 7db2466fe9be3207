"""The baselines: the checkpointing heuristics of Checkmate's Table 1 (section 6.1), each a
one-device strategy, and ``best_baseline``, the warm start and fallback of the exact
strategies."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from remat.errors import RematError
from remat.strategies.baselines.checkpoint_all import checkpoint_all
from remat.strategies.baselines.chen import (
    ap_greedy,
    ap_sqrt,
    chen_greedy,
    chen_sqrt,
    linearized_greedy,
    linearized_sqrt,
)
from remat.strategies.baselines.griewank import griewank
from remat.strategies.common.problem import Problem, StrategyResult, cheapest

BASELINES: dict[str, Callable[[Problem, str], StrategyResult]] = {
    "checkpoint_all": checkpoint_all,
    "chen_sqrt": chen_sqrt,
    "chen_greedy": chen_greedy,
    "ap_sqrt": ap_sqrt,
    "ap_greedy": ap_greedy,
    "linearized_sqrt": linearized_sqrt,
    "linearized_greedy": linearized_greedy,
    "griewank": griewank,
}


def best_baseline(problem: Problem, devices: Sequence[str]) -> StrategyResult | None:
    """The cheapest feasible baseline plan on any of ``devices``. A baseline that does not
    apply to the graph (a chain-only heuristic on a non-chain) is skipped."""
    results: list[StrategyResult] = []
    for device in devices:
        for baseline in BASELINES.values():
            try:
                problem.costs.device_index(device)
                results.append(baseline(problem, device))
            except RematError:
                continue
    return cheapest(*results)


__all__ = [
    "BASELINES",
    "ap_greedy",
    "ap_sqrt",
    "best_baseline",
    "checkpoint_all",
    "chen_greedy",
    "chen_sqrt",
    "griewank",
    "linearized_greedy",
    "linearized_sqrt",
]
