"""Checkpoint all (Checkmate section 6.1): every value is computed once and kept until its
last use, as frameworks do by default. Ideal with ample memory."""

from __future__ import annotations

from remat.strategies.common.policy import run_policies
from remat.strategies.common.problem import Problem, StrategyResult
from remat.strategies.common.rsolve import HoldBuilder


def checkpoint_all(problem: Problem, device: str) -> StrategyResult:
    # Keep everything once computed (S strictly lower triangular): R = I.
    holds = HoldBuilder(problem.graph).keep_everything().build()
    return run_policies(problem, device, "checkpoint_all", [holds])
