"""XEngine's strategy: the multi-device MIQP (section 3.2, eq. 1-16) solved by the exact
search, which places operators over every device of the cost model."""

from __future__ import annotations

import time
from functools import partial

from remat.formulations import Formulation
from remat.formulations.xengine import XEngineModel, build_xengine
from remat.strategies.common.problem import Problem, StrategyResult
from remat.strategies.exact.checkmate import checkmate_milp
from remat.strategies.exact.restrict import solve_restrictions
from remat.strategies.exact.rins import Offer, relax_and_improve
from remat.strategies.exact.search import StrategyVariants, optimize, start_search, unfit
from remat.strategies.exact.state import Search

NAME = "xengine"
UNBOUNDED_ON_POOL = (
    "no bound on a pool: XEngine's model runs one device per stage, and the plan's "
    "concurrent sections may run below its bound"
)


def xengine(
    problem: Problem,
    device: str | None = None,
    *,
    coarse: bool = True,
    decompose: bool = True,
    restrict: bool = True,
) -> StrategyResult:
    """XEngine's MIQP (eq. 1-16) over every device of the cost model, warm-started from the
    best baseline on any device and the multi-device heuristic (``search.warm_start``),
    with restrictions of the model beside the full solve (``restrict.solve_restrictions``
    on two or more devices; on one, where keeping everything is checkpoint-all, the LP
    relaxation and RINS) and, on graphs of ``coarse_min_nodes`` or more, the coarse graph's
    plan; large graphs are decomposed (their parts, like the coarse graph, without the
    restrictions), after ``checkmate_milp`` on their best single device. On devices that
    share a memory pool its plans are compiled concurrent where they fit (``evaluate``)
    and it reports no bound (``UNBOUNDED_ON_POOL``).
    ``device`` is ignored: the strategy places operators."""
    start = time.monotonic()
    names = tuple(d.name for d in problem.costs.devices)
    if (unfit_result := unfit(problem, NAME, names)) is not None:
        return unfit_result

    def build(p: Problem) -> Formulation:
        return build_xengine(p.graph, p.costs, {name: p.budgets.get(name) for name in names})

    def restricted(search: Search, formulation: Formulation, offer: Offer) -> None:
        if not restrict:
            return
        if len(names) == 1:
            relax_and_improve(search, formulation, offer)
            return
        assert isinstance(formulation, XEngineModel)
        solve_restrictions(search, formulation, offer)

    variant = partial(xengine, restrict=False)
    variants = StrategyVariants(variant, coarse, decompose, restricted, checkmate_milp)
    if not problem.shares_memory:
        return optimize(start_search(problem, names, variants, start), NAME, names, build, variants)
    search = start_search(problem.without_bounds(), names, variants, start)
    return optimize(search, NAME, names, build, variants).without_bound(NAME, UNBOUNDED_ON_POOL)
