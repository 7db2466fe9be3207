"""The bound of the whole problem that every exact search starts from: the ideal plus the
recomputation cover's bound (``remat.formulations.cover``), a relaxation small enough for
any graph, so that a search on a graph too large for its full model still reports a gap
against a bound above the ideal."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from remat.formulations.cover import build_cover
from remat.simulator import held_fixed_bytes
from remat.solvers import runner
from remat.solvers.model import SolveOptions
from remat.strategies.common.problem import Problem

logger = logging.getLogger(__name__)


def cover_bound(problem: Problem, names: Sequence[str], seconds: float) -> float | None:
    """A lower bound on the cost of every plan of ``problem`` on ``names``: the ideal on
    them plus the cover's bound, solved for at most ``seconds`` with the LP backend (a
    stopped solve's bound still bounds). None when no memory constraint binds (the ideal
    is the bound) or the solve gives none."""
    costs, graph = problem.costs, problem.graph
    budgets = [problem.budgets.get(name) for name in names]
    pooled = None if any(b is None for b in budgets) else sum(b for b in budgets if b)
    fastest = costs.compute_ms[:, [costs.device_index(name) for name in names]].min(axis=1)
    fixed = held_fixed_bytes(graph, range(len(graph)))
    cover = build_cover(graph, fastest, costs.output_bytes, pooled, fixed)
    if cover.model is None:
        return None
    config = problem.solver.search
    options = SolveOptions(time_limit_s=seconds, gap=config.proven_gap, threads=1)
    solved = runner.solve(
        cover.model,
        backend=config.lp_backend,
        options=options,
        cancel=problem.solver.cancel,
        grace_s=config.solve_grace_s,
    )
    if solved.bound is None:
        logger.debug("recomputation cover: no bound (%s)", solved.status.value)
        return None
    logger.debug("recomputation cover: %d rows, bound +%.6g ms", cover.model.n_rows, solved.bound)
    return float(sum(fastest.tolist())) + solved.bound  # the ideal summed as ideal_ms sums
