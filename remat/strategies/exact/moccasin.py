"""Moccasin's strategy on one device (Bartan et al., ICML 2023): the retention-interval
constraint program for the whole graph at any size (``intervals.solve_intervals``),
warm-started from the best baseline and greedy eviction. The bound is the recomputation
cover's (``exact.cover``): the computation cap makes CP-SAT's own a restriction's."""

from __future__ import annotations

import time

from remat.strategies.common.problem import Problem, StrategyResult
from remat.strategies.exact.intervals import on_device, solve_intervals
from remat.strategies.exact.search import StrategyVariants, finish, start_search, unfit


def moccasin(problem: Problem, device: str) -> StrategyResult:
    """Moccasin's model on ``device`` for the time limit left after the warm start,
    hinted with the warm start's plan."""
    start = time.monotonic()
    if (unfit_result := unfit(problem, "moccasin", (device,))) is not None:
        return unfit_result
    variants = StrategyVariants(moccasin, coarse=False, decompose=False)
    search = start_search(problem, (device,), variants, start)
    warm = search.best.schedule if search.best is not None else None
    solved = solve_intervals(search, on_device(problem, device), warm, "moccasin")
    return finish(problem, "moccasin", solved, None, search.best, search.bound)
