"""The restrictions of XEngine's model solved beside the full one (remat.strategies.restrict):
keep_all, then the LP relaxation's placement; real HiGHS solves in subprocesses."""

from __future__ import annotations

import time

import numpy as np
import pytest
from regime import budgeted

from remat.formulations.xengine import XEngineModel, build_xengine
from remat.solvers import runner
from remat.solvers.model import Progress, SolveOptions
from remat.strategies import restrict
from remat.strategies.base import Problem, SolverSettings, evaluate
from remat.strategies.search import Search
from remat.training import training_graph

from graphs import chain

SETTINGS = SolverSettings(options=SolveOptions(time_limit_s=restrict.PLACEMENT_MIN_S + 60))


def _setup(percent: float) -> tuple[Problem, XEngineModel, Search]:
    problem = budgeted(training_graph(chain(10)), percent, settings=SETTINGS)
    formulation = build_xengine(problem.graph, problem.costs, problem.budgets)
    search = Search(problem, problem.costs.ideal_ms(), time.monotonic())
    return problem, formulation, search


def _report_the_lp_bound(search: Search, formulation: XEngineModel) -> float:
    """What the full solve reports after its root LP (no full solve runs in these tests)."""
    bound = runner.solve(formulation.lp_relaxation()).objective
    assert bound is not None and bound > search.ideal
    search.on_full(Progress(search.elapsed(), None, bound, None))
    return bound


def test_where_keeping_everything_fits_nowhere_the_lp_placement_gives_plans() -> None:
    """A training chain at 25% on cpu+cuda: keep_all proves that no split fits without
    recomputation; the model restricted to the LP's placement (here all on cpu0: the
    12-thread CPU is the faster on a chain's small ops) then gives plans, each computing
    every node on one device only, and the simulator accepts the best."""
    problem, formulation, search = _setup(25)
    assert runner.solve(formulation.keep_all()).status.value == "infeasible"
    bound = _report_the_lp_bound(search, formulation)
    offered: list[np.ndarray] = []
    restrict.solve_restrictions(search, formulation, lambda x, _: offered.append(x))
    assert offered
    for x in offered:
        R = formulation.decode(x).R
        assert (R.any(axis=1).sum(axis=0) == 1).all()  # one device per node
    best = formulation.decode(offered[-1])
    evaluation = evaluate(problem, best, "xengine")
    assert evaluation.fits
    assert bound <= evaluation.cost_ms


def test_the_lp_placement_waits_for_the_full_solves_bound_and_stops_with_it() -> None:
    """Without a bound from the full solve, the second restriction does not start; once
    the full solve ends (``full_done``), the wait ends without it."""
    _, formulation, search = _setup(25)
    search.full_done.set()
    started = time.monotonic()
    offered: list[np.ndarray] = []
    restrict.solve_restrictions(search, formulation, lambda x, _: offered.append(x))
    assert not offered and search.best is None
    assert time.monotonic() - started < 30  # keep_all stopped at once, no wait


def test_when_keep_all_finds_a_plan_the_lp_placement_is_not_solved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, formulation, search = _setup(100)
    # As if the full solve had a bound: a broken rule would go on to the LP placement.
    search.on_full(Progress(0.0, None, search.ideal * 1.001, None))

    def unexpected(*_: object) -> None:
        raise AssertionError("the LP placement ran after keep_all found a plan")

    monkeypatch.setattr(restrict, "_lp_home", unexpected)
    offered: list[np.ndarray] = []
    restrict.solve_restrictions(search, formulation, lambda x, _: offered.append(x))
    assert offered
