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

TABLE_1: dict[str, tuple[Callable[[Problem, str], StrategyResult], str]] = {
    "checkpoint_all": (
        checkpoint_all,
        "Keep every value until its last use, as frameworks do by default.",
    ),
    "chen_sqrt": (chen_sqrt, "Chen et al.'s sqrt(n) checkpoints on a chain."),
    "chen_greedy": (
        chen_greedy,
        "Chen et al.'s greedy checkpoints on a chain, swept over the segment budget.",
    ),
    "ap_sqrt": (ap_sqrt, "Chen's sqrt(n) checkpoints among the graph's articulation points."),
    "ap_greedy": (ap_greedy, "Chen's greedy checkpoints among the graph's articulation points."),
    "linearized_sqrt": (
        linearized_sqrt,
        "Chen's sqrt(n) checkpoints on the topological order as a chain.",
    ),
    "linearized_greedy": (
        linearized_greedy,
        "Chen's greedy checkpoints on the topological order as a chain.",
    ),
    "griewank": (griewank, "Griewank and Walther's binomial checkpointing (REVOLVE) on a chain."),
}
"""Each baseline by name: its function and a one-line description. The registry
(``remat.strategies.registry``) lists every entry as a strategy of kind ``baseline``; adding
a baseline is its module and one entry here."""


def best_baseline(problem: Problem, devices: Sequence[str]) -> StrategyResult | None:
    """The cheapest feasible baseline plan on any of ``devices``. A baseline that does not
    apply to the graph (a chain-only heuristic on a non-chain) is skipped."""
    results: list[StrategyResult] = []
    for device in devices:
        for baseline, _ in TABLE_1.values():
            try:
                problem.costs.device_index(device)
                results.append(baseline(problem, device))
            except RematError:
                continue
    return cheapest(*results)


__all__ = [
    "TABLE_1",
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
