"""GREEDY (Beaumont et al., section 4.2), generalised to training graphs: offload the first
k activations in production order, k the smallest for which the no-wait plan fits.

In the fractional relaxation the eager, ordered schedule that offloads the least data is
optimal (Lemmas 1 and 2); rounded to whole activations, the paper takes the smallest k
whose sizes sum to at least ``M_peak - M_GPU`` (Proposition 2). On a training graph the
memory of the backward phase and of steps between the peaks may need more, so k grows
from there until the simulator accepts the plan (by bisection: a larger prefix only
frees more memory). The plan's bound is Proposition 3's (``offload.offload_bound_ms``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from remat.devices import Tier, format_bytes
from remat.strategies.common.offload import (
    OffloadBase,
    judged_plan,
    named,
    offload_base,
    offload_floor_bytes,
    offload_result,
    sending,
)
from remat.strategies.common.problem import Evaluation, Problem, StrategyResult

NAME = "offload_greedy"


def offload_greedy(problem: Problem, device: str, tier: Tier = Tier.HOST) -> StrategyResult:
    """GREEDY's plan on ``device``: offloading to its host, or paging to storage."""
    base = offload_base(problem, device, tier=tier)
    name = named(NAME, tier)
    if base is None:
        return StrategyResult(name, None, None, f"{name}: checkpoint-all has no plan on {device}")
    found = greedy_plan(problem, base)
    if found is None:
        budget = problem.budgets.get(device)
        floor = offload_floor_bytes(problem, base)
        return StrategyResult(
            name,
            None,
            None,
            f"{name}: no plan fits {format_bytes(budget or 0)} on {device}; {sending(tier)} every "
            f"activation still needs {format_bytes(floor)} ({floor} B)",
            min_budget_bytes={device: floor},
        )
    return offload_result(problem, base, name, found)


def greedy_plan(problem: Problem, base: OffloadBase) -> Evaluation | None:
    """GREEDY's plan over ``base``: the smallest prefix of its candidates, at least the
    bytes over the budget, whose plan the simulator accepts; None where none is."""
    sizes = [int(problem.costs.output_bytes[v]) for v in base.candidates]
    budget = problem.budgets.get(base.device)
    excess = 0 if budget is None else base.peak_bytes - budget
    first = int(np.searchsorted(np.cumsum([0, *sizes]), excess)) if excess > 0 else 0
    return _smallest_prefix(problem, base, first)


def _smallest_prefix(problem: Problem, base: OffloadBase, first: int) -> Evaluation | None:
    """The plan of the smallest prefix of at least ``first`` candidates that the simulator
    accepts, or None where not even every candidate fits."""
    candidates: Sequence[int] = base.candidates

    def judged(k: int) -> Evaluation | None:
        return judged_plan(problem, base, candidates[:k], NAME)

    low, high = min(first, len(candidates)), len(candidates)
    best = judged(high)
    if best is None:
        return None
    while low < high:
        middle = (low + high) // 2
        found = judged(middle)
        if found is None:
            low = middle + 1
        else:
            best, high = found, middle
    return best
