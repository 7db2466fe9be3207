"""The LP relaxation and relaxation induced neighbourhood search (RINS), beside the full
solve: the relaxation's optimum is a bound of the whole problem, reported to the search;
RINS (Danna, Rothberg and Le Pape, 2005) solves the model restricted to where the
incumbent and the relaxation agree, a restriction whose plans are plans of the whole
problem. Also the solve that every phase beside the full solve uses (``solve_beside``).

On one device these are the only phases beside the full solve (``relax_and_improve``);
on several they follow XEngine's restrictions (``restrict.solve_restrictions``).
docs/solvers.md, "The search in detail", gives the evidence for each choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from remat.errors import ScheduleError
from remat.formulations import Formulation
from remat.solvers import runner
from remat.solvers.model import MILPModel, SolveResult, SolveStatus
from remat.strategies.exact.state import Search

logger = logging.getLogger(__name__)

Offer = Callable[[np.ndarray, float], None]  # a solver incumbent of the full model's variables


def relax_and_improve(search: Search, formulation: Formulation, offer: Offer) -> None:
    """One device: the LP relaxation (its optimum a bound of the whole problem), then RINS
    from its optimum (``improve_by_rins``) with ``rins_one_device_backend``'s sub-MIPs,
    the quicker backend on one device."""
    relaxed = solve_relaxation(search, formulation)
    if relaxed is not None:
        backend = search.problem.solver.search.rins_one_device_backend
        improve_by_rins(search, formulation, relaxed, offer, backend)


def solve_relaxation(search: Search, formulation: Formulation) -> np.ndarray | None:
    """The whole model's LP relaxation, solved to optimality with ``lp_backend``: its
    objective is reported to the search as a bound of the whole problem
    (``Search.on_bound``). The full solve is suspended meanwhile (``Search.full_held``):
    its root node is that same LP, which it reaches much later than the LP alone, and on
    two cores the LP gets one to itself."""
    logger.debug("LP relaxation of %d variables", formulation.model.n_vars)
    search.full_held.set()
    try:
        backend = search.problem.solver.search.lp_backend
        relaxed = solve_beside(
            search, formulation.lp_relaxation(), None, search.time_left(), backend
        )
    finally:
        search.full_held.clear()
    if relaxed.status is not SolveStatus.OPTIMAL or relaxed.objective is None:
        logger.debug("LP relaxation: no optimum (%s)", relaxed.status.value)
        return None
    logger.debug("LP relaxation: bound %.6g ms", relaxed.objective)
    search.on_bound(relaxed.objective)
    return relaxed.x


def improve_by_rins(
    search: Search, formulation: Formulation, relaxed: np.ndarray, offer: Offer, backend: str = ""
) -> None:
    """RINS: the model restricted to the neighbourhood where the incumbent and the LP
    relaxation's optimum ``relaxed`` agree (``rins_neighbourhood``), solved from the
    incumbent, its incumbents offered; again from each better incumbent (from here or
    elsewhere) until a neighbourhood brings nothing or the full solve ends. Sub-MIPs solved
    with ``backend`` (default: the problem's)."""
    model = formulation.model
    relaxed = relaxed[: model.n_vars]  # without the linearization's products
    searched: set[float] = set()  # the incumbents whose neighbourhood was solved
    agree = search.problem.solver.search.rins_agree
    while not search.side_stop().is_set() and search.time_left() > 0:
        best = search.best
        if best is None or best.schedule is None or best.simulation is None:
            return
        if best.simulation.total_ms in searched:
            return
        searched.add(best.simulation.total_ms)
        try:
            incumbent = formulation.encode(best.schedule)
        except ScheduleError:
            return  # a plan the model cannot state has no neighbourhood in it
        neighbourhood = rins_neighbourhood(model, relaxed, incumbent, agree)
        if logger.isEnabledFor(logging.DEBUG):
            free = int((neighbourhood.lb != neighbourhood.ub)[model.integer].sum())
            total = int(model.integer.sum())
            logger.debug(
                "RINS from %.6g ms: %d of %d integer variables free",
                *(best.simulation.total_ms, free, total),
            )
        solve_beside(search, neighbourhood, offer, search.time_left(), backend)


def rins_neighbourhood(
    model: MILPModel, relaxed: np.ndarray, incumbent: np.ndarray, agree: float = 1e-6
) -> MILPModel:
    """RINS's sub-MIP: ``model`` with each integer variable on which ``incumbent`` and the
    LP optimum ``relaxed`` agree (within ``agree``) fixed to that value, started from
    ``incumbent``. A restriction: its optimum is a plan of the whole problem, never a
    bound."""
    fixed = model.integer & (np.abs(relaxed - incumbent) <= agree)
    lb, ub = model.lb.copy(), model.ub.copy()
    lb[fixed] = ub[fixed] = np.round(incumbent[fixed])
    return replace(model, lb=lb, ub=ub, start=incumbent)


def solve_beside(
    search: Search, model: MILPModel, offer: Offer | None, seconds: float, backend: str = ""
) -> SolveResult:
    """A solve beside the full one (``backend``: default the problem's) for at most
    ``seconds``, stopped when the full solve ends; each incumbent, and the final solution,
    offered."""
    settings = search.problem.solver
    options = replace(settings.options, time_limit_s=min(seconds, search.remaining()))
    solved = runner.solve(
        model,
        backend=backend or settings.backend,
        options=options,
        on_progress=lambda _: search.heartbeat(),
        cancel=search.side_stop(),
        grace_s=settings.search.solve_grace_s,
        on_incumbent=offer,
    )
    if offer is not None and solved.x is not None and solved.objective is not None:
        offer(solved.x, solved.objective)
    return solved
