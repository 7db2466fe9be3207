"""Strategies: (problem, device) -> StrategyResult, by name.

The package is laid out by kind: ``baselines/`` (Checkmate's Table 1 heuristics),
``heuristics/`` (greedy eviction, the multi-device placement heuristic), ``exact/`` (the
MILP/MIQP strategies and their search) and ``common/`` (what they share). ``REGISTRY``
records each strategy's kind, whether it places operators over devices, and a one-line
description; ``STRATEGIES`` maps names to the functions and is open to ``register``.
``run_strategy`` also runs ``AUTO`` (``auto.py``), the default: the baselines, greedy
eviction, offloading where a device has memory apart from its host, and a short exact
solve, which says "infeasible" only with a proof.
``SearchConfig`` (``SolverSettings.search``) holds every time share and threshold of the
search.
"""

from __future__ import annotations

from remat.strategies.auto import AUTO
from remat.strategies.common.problem import Problem, SolverSettings, StrategyResult
from remat.strategies.config import SearchConfig
from remat.strategies.registry import (
    BASELINES,
    MULTI_DEVICE,
    OFFLOADING,
    OPTIMAL,
    REGISTRY,
    STRATEGIES,
    Kind,
    Strategy,
    StrategyInfo,
    register,
    run_strategy,
)

__all__ = [
    "AUTO",
    "BASELINES",
    "MULTI_DEVICE",
    "OFFLOADING",
    "OPTIMAL",
    "REGISTRY",
    "STRATEGIES",
    "Kind",
    "Problem",
    "SearchConfig",
    "SolverSettings",
    "Strategy",
    "StrategyInfo",
    "StrategyResult",
    "register",
    "run_strategy",
]
