"""The restrictions of XEngine's model solved beside the full one (remat.strategies.exact.restrict):
keep_all, then the LP relaxation (a bound), RINS and the LP's placement; on one device the
LP relaxation and RINS; real HiGHS solves in subprocesses."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
from regime import budgeted

from remat import samples
from remat.budgets import reference
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind, Size
from remat.formulations.checkmate import build_checkmate
from remat.formulations.xengine import XEngineModel, build_xengine
from remat.onnx_ingest import forward_graph
from remat.solvers import runner
from remat.solvers.model import MILPModel, Progress, SolveOptions, SolveResult
from remat.strategies import SearchConfig, run_strategy
from remat.strategies.common.policy import device_fixed_bytes
from remat.strategies.common.problem import Problem, SolverSettings, StrategyResult, evaluate
from remat.strategies.exact import restrict, rins
from remat.strategies.exact import search as search_module
from remat.strategies.exact.rins import Offer
from remat.strategies.exact.search import offer_incumbent
from remat.strategies.exact.state import Search
from remat.strategies.exact.xengine import xengine
from remat.strategies.heuristics import evict as evict_module
from remat.strategies.heuristics.evict import greedy_evict
from remat.training import training_graph

from graphs import chain

SETTINGS = SolverSettings(options=SolveOptions(time_limit_s=SearchConfig().placement_min_s + 60))


def _setup(percent: float) -> tuple[Problem, XEngineModel, Search]:
    problem = budgeted(training_graph(chain(10)), percent, settings=SETTINGS)
    formulation = build_xengine(problem.graph, problem.costs, problem.budgets)
    search = Search(problem, problem.costs.ideal_ms(), time.monotonic())
    return problem, formulation, search


def test_where_keeping_everything_fits_nowhere_the_lp_gives_a_bound_and_a_placement() -> None:
    """A training chain at 25% on cpu+cuda: keep_all proves that no split fits without
    recomputation; the LP relaxation of the whole model is then solved, its optimum
    reported as the whole problem's bound, and the model restricted to its placement (here
    all on cpu0: the 12-thread CPU is the faster on a chain's small ops) gives plans, each
    computing every node on one device only, that the simulator accepts and the bound
    bounds."""
    problem, formulation, search = _setup(25)
    assert runner.solve(formulation.keep_all()).status.value == "infeasible"
    relaxed = runner.solve(formulation.lp_relaxation())
    assert relaxed.status.value == "optimal" and relaxed.objective > search.ideal
    offered: list[np.ndarray] = []
    restrict.solve_restrictions(search, formulation, lambda x, _: offered.append(x))
    assert search.bound == pytest.approx(relaxed.objective)
    assert offered
    for x in offered:
        R = formulation.decode(x).R
        assert (R.any(axis=1).sum(axis=0) == 1).all()  # one device per node
    best = formulation.decode(offered[-1])
    evaluation = evaluate(problem, best, "xengine")
    assert evaluation.fits
    assert search.bound <= evaluation.cost_ms


def test_once_the_full_solve_has_ended_the_restrictions_stop_at_once() -> None:
    """Once the full solve ends (``full_done``), keep_all and the LP stop at once: no
    bound, no placement, no plan."""
    _, formulation, search = _setup(25)
    search.full_done.set()
    started = time.monotonic()
    offered: list[np.ndarray] = []
    restrict.solve_restrictions(search, formulation, lambda x, _: offered.append(x))
    assert not offered and search.best is None and search.bound == search.ideal
    assert time.monotonic() - started < 30


def _forbid(monkeypatch: pytest.MonkeyPatch, name: str, why: str) -> None:
    def unexpected(*_: object) -> None:
        raise AssertionError(why)

    monkeypatch.setattr(restrict, name, unexpected)


def _restrictions_offer(search: Search, formulation: XEngineModel) -> list[np.ndarray]:
    offered: list[np.ndarray] = []
    restrict.solve_restrictions(search, formulation, lambda x, _: offered.append(x))
    return offered


def test_when_keep_all_finds_a_plan_and_the_full_solve_has_a_bound_the_lp_is_not_solved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, formulation, search = _setup(100)
    search.on_full(Progress(1.0, None, search.ideal * 1.01, None))
    _forbid(
        monkeypatch, "solve_relaxation", "the LP relaxation ran although the full solve had a bound"
    )
    assert _restrictions_offer(search, formulation)


def test_when_keep_all_finds_a_plan_before_any_bound_the_lp_gives_one_but_no_placement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """keep_all's plan is not a bound: with none from the full solve yet (its root LP comes
    late on large models) the LP relaxation is solved for it, but its placement is not (a
    plan is in hand)."""
    _, formulation, search = _setup(100)
    relaxed = runner.solve(formulation.lp_relaxation())
    _forbid(monkeypatch, "_placed", "the LP's placement was solved although keep_all found a plan")
    from_lp: list[np.ndarray] = []
    rins = restrict.improve_by_rins
    monkeypatch.setattr(
        restrict, "improve_by_rins", lambda *args: from_lp.append(args[2]) or rins(*args)
    )
    assert _restrictions_offer(search, formulation)
    assert relaxed.objective is not None
    assert search.bound == pytest.approx(relaxed.objective)
    assert len(from_lp) == 1  # keep_all's plan need not be the optimum: RINS from the LP


def test_eviction_runs_on_each_device_alone_whose_ideal_is_under_the_incumbent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """XEngine's schedules include every one-device schedule, so greedy eviction on each
    device alone is offered. A training chain at 50% on cpu+cuda, nothing in hand:
    eviction on cpu0 gives the first plan offered; cuda0's ideal (every node once) is
    costlier than that plan, so eviction there is not tried."""
    plans: list[StrategyResult] = []
    settings = replace(SETTINGS, on_plan=plans.append)
    problem = budgeted(training_graph(chain(10)), 50, settings=settings)
    formulation = build_xengine(problem.graph, problem.costs, problem.budgets)
    search = Search(problem, problem.costs.ideal_ms(), time.monotonic())
    tried: list[str] = []
    evict = restrict.greedy_evict
    monkeypatch.setattr(
        restrict, "greedy_evict", lambda p, device, *a: tried.append(device) or evict(p, device, *a)
    )
    restrict.solve_restrictions(search, formulation, lambda *_: None)
    assert tried == ["cpu0"]
    alone = greedy_evict(problem, "cpu0")
    assert plans[0].schedule.devices == ("cpu0",)
    assert plans[0].simulation.total_ms == pytest.approx(alone.simulation.total_ms)
    assert problem.costs.ideal_ms("cuda0") > alone.simulation.total_ms


def test_the_full_solve_is_held_while_the_lp_relaxation_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The LP needs the CPU more than the full solve, whose own root is that LP: the full
    solve's process is suspended (``Search.full_held``) for the LP's solve, and only then."""
    _, formulation, search = _setup(25)
    held: list[tuple[bool, bool]] = []  # (a MILP, held) per restriction solve
    solve = runner.solve

    def watched(model: MILPModel, *args: object, **kwargs: object) -> SolveResult:
        held.append((bool(model.integer.any()), search.full_held.is_set()))
        return solve(model, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "solve", watched)
    restrict.solve_restrictions(search, formulation, lambda *_: None)
    assert held[:2] == [(True, False), (False, True)]  # keep_all, then the LP
    assert all(milp and not is_held for milp, is_held in held[2:])  # the LP's placement
    assert not search.full_held.is_set()


def test_eviction_on_each_device_alone_where_no_baseline_fits_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The transformer at 50% on cpu+cuda: eviction fits on cpu0 alone but no baseline
    does; eviction still runs there, since its plan may be the cheapest of all."""
    graph = training_graph(
        forward_graph(samples.ZOO["transformer"](), batch=4, fuse_attention=False)
    )
    problem = budgeted(graph, 50, ("cpu0", "cuda0"), settings=SETTINGS)
    search = Search(problem, problem.costs.ideal_ms(), time.monotonic())
    assert greedy_evict(problem, "cpu0").feasible
    tried: list[str] = []
    monkeypatch.setattr(restrict, "greedy_evict", lambda _p, device, *_: tried.append(device))
    restrict._evict_on_each_device(search, ("cpu0", "cuda0"))
    assert tried == ["cpu0", "cuda0"]


def test_xengine_is_never_worse_than_eviction_on_one_device_with_a_slow_second() -> None:
    """An edge board's GPU (2 TFLOP/s, 100 GB/s, 20 us launches) beside an 8-thread CPU,
    the transformer at 50% on each: no baseline fits the CPU alone, and eviction's plan
    there beats every plan the two-device search finds in its time (a 6 s limit: eviction
    there takes a tenth of a second, about a second into the search)."""
    graph = training_graph(
        forward_graph(samples.ZOO["transformer"](), batch=8, fuse_attention=False)
    )
    cpu = Device("cpu0", DeviceKind.CPU, {"threads": "8"})
    gpu = Device("gpu0", DeviceKind.CUDA, {"flops": "2e12", "bandwidth": "1e11", "launch_us": "20"})
    costs = analytical_costs(graph, [cpu, gpu])
    ref = reference(graph, costs, "cpu0")
    budget = Size(percent=50).resolve(ref.fixed_bytes, ref.peak_bytes)
    budgets = {"cpu0": budget, "gpu0": budget}
    problem = Problem(graph, costs, budgets, SolverSettings()).within(6)
    alone = greedy_evict(problem, "cpu0")
    assert alone.plan is not None and alone.simulation is not None
    result = run_strategy("xengine", problem)
    assert result.simulation is not None, result.message
    assert result.simulation.total_ms <= alone.simulation.total_ms + 1e-9


def test_xengine_finds_the_transformers_band_plan_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transformer at 25% on cpu+cuda: keep_all finds no plan, so eviction on band
    placements runs beside the full solve, and one of its plans becomes the incumbent: it
    beats the warm start and eviction on the warm start's placement (the multi-device
    heuristic ranks placements by Chen's policies, which keep too much of the attention).
    Cancelled as soon as a plan of the band search is the search's best. Without the
    device cover, whose placement's plan comes sooner and would leave the bands none to
    beat (tests/test_device_cover.py), and without the coarse graph's solve, whose own
    warm start would hold the GIL that the restrictions' evictions need."""
    cancel = threading.Event()
    from_bands: list[StrategyResult] = []
    warm: list[float] = []
    evict_bands, warm_start = restrict.evict_bands, search_module.warm_start

    def bands(problem: Problem, names: tuple[str, ...], seconds: float, offer: Offer) -> None:
        def offered(result: StrategyResult) -> None:
            from_bands.append(result)
            offer(result)

        evict_bands(problem, names, seconds, offered)

    def recorded_warm_start(search: Search, *args: Any) -> None:
        warm_start(search, *args)
        warm.append(search.best_ms)

    def on_plan(result: StrategyResult) -> None:  # each plan that beats the search's best
        if any(result is plan for plan in from_bands):
            cancel.set()

    monkeypatch.setattr(restrict, "evict_bands", bands)
    monkeypatch.setattr(search_module, "warm_start", recorded_warm_start)
    monkeypatch.setattr(search_module, "start_from_devices", lambda *_args: None)
    settings = SolverSettings(options=SolveOptions(time_limit_s=30), cancel=cancel, on_plan=on_plan)
    graph = training_graph(
        forward_graph(samples.ZOO["transformer"](), batch=4, fuse_attention=False)
    )
    problem = budgeted(graph, 25, settings=settings)
    result = xengine(problem, coarse=False)
    assert cancel.is_set()
    assert result.simulation.valid and result.simulation.total_ms < warm[0]


def _transformer_band_plan(problem: Problem, monkeypatch: pytest.MonkeyPatch) -> StrategyResult:
    """The best band's plan for the transformer at 25% on cpu+cuda, without the node moves
    that follow the band search."""
    found: list[StrategyResult] = []
    with monkeypatch.context() as patched:
        patched.setattr(evict_module, "evict_moves", lambda *_args, **_kw: None)
        evict_module.evict_bands(problem, ("cpu0", "cuda0"), 60.0, found.append)
    return found[-1]


def test_node_moves_improve_the_incumbent_until_the_full_solve_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where keep_all finds no plan and the LP's placement is out of reach, the thread
    moves nodes from the incumbent: from the transformer's best band plan, a cheaper plan
    that fits; once the full solve has ended, nothing is tried."""
    settings = SolverSettings(options=SolveOptions(time_limit_s=60))
    graph = training_graph(
        forward_graph(samples.ZOO["transformer"](), batch=4, fuse_attention=False)
    )
    problem = budgeted(graph, 25, settings=settings)
    band = _transformer_band_plan(problem, monkeypatch)
    names = ("cpu0", "cuda0")

    ended = Search(problem, problem.costs.ideal_ms(), time.monotonic())
    ended.offer(band)
    ended.full_done.set()
    restrict._move_nodes(ended, names)
    assert ended.best is band

    search = Search(problem, problem.costs.ideal_ms(), time.monotonic())
    search.offer(band)
    restrict._move_nodes(search, names)
    assert search.best is not band and search.best.simulation.valid
    assert search.best.simulation.total_ms < 0.97 * band.simulation.total_ms


def test_rins_fixes_the_integer_variables_on_which_the_plan_and_the_lp_agree() -> None:
    """Integer variables where the incumbent and the LP optimum agree are fixed to the
    incumbent's value; those where they differ, and continuous ones, keep their bounds;
    the incumbent is the start."""
    model = MILPModel(
        c=np.ones(4),
        A=sp.csr_array(np.ones((1, 4))),
        row_lb=np.array([1.0]),
        row_ub=np.array([np.inf]),
        lb=np.zeros(4),
        ub=np.array([1.0, 1.0, 1.0, 5.0]),
        integer=np.array([True, True, True, False]),
    )
    incumbent = np.array([1.0, 0.0, 1.0, 2.0])
    relaxed = np.array([1.0 - 1e-9, 0.5, 0.0, 2.0])
    sub = rins.rins_neighbourhood(model, relaxed, incumbent)
    assert sub.lb.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert sub.ub.tolist() == [1.0, 1.0, 1.0, 5.0]
    assert sub.start is incumbent
    assert (sub.A != model.A).nnz == 0 and (sub.c == model.c).all()


def _one_device(percent: float, seconds: float) -> tuple[Problem, Search]:
    """The transformer on cpu0 with eviction's plan as the incumbent."""
    settings = SolverSettings(options=SolveOptions(time_limit_s=seconds))
    graph = training_graph(
        forward_graph(samples.ZOO["transformer"](), batch=4, fuse_attention=False)
    )
    problem = budgeted(graph, percent, ("cpu0",), settings=settings)
    search = Search(problem, problem.costs.ideal_ms("cpu0"), time.monotonic())
    search.offer(greedy_evict(problem, "cpu0"))
    return problem, search


def test_on_one_device_rins_improves_evictions_plan_and_the_lp_bounds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The transformer at 50% on cpu0, from greedy eviction's plan: the LP relaxation
    (HiGHS) bounds it, and RINS from it (CP-SAT's sub-MIPs, the quicker on one device)
    finds a cheaper plan that the simulator accepts; once the full solve has ended,
    nothing is tried."""
    backends: list[tuple[bool, str]] = []  # (a MILP, backend) per solve
    solve = rins.solve_beside

    def watched(search: Search, model: MILPModel, *args: object) -> SolveResult:
        backends.append((bool(model.integer.any()), str(args[2]) if len(args) > 2 else ""))
        return solve(search, model, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(rins, "solve_beside", watched)
    problem, search = _one_device(50, 60)
    evicted = search.best
    assert evicted is not None and evicted.simulation is not None
    fixed = device_fixed_bytes(problem, "cpu0")
    formulation = build_checkmate(
        problem.graph, problem.costs, "cpu0", problem.budgets["cpu0"], fixed
    )
    offer = partial(offer_incumbent, search, formulation, "checkmate_milp")
    rins.relax_and_improve(search, formulation, offer)
    relaxed = runner.solve(formulation.lp_relaxation())
    assert search.bound == pytest.approx(relaxed.objective)
    assert search.best.simulation.valid
    assert search.best.simulation.total_ms < evicted.simulation.total_ms
    assert search.bound <= search.best.simulation.total_ms
    assert backends[0] == (False, "highs") and len(backends) > 1
    assert all(backend == (True, "cpsat") for backend in backends[1:])

    _, ended = _one_device(50, 60)
    ended.full_done.set()
    before = ended.best
    on_ended = partial(offer_incumbent, ended, formulation, "checkmate_milp")
    rins.relax_and_improve(ended, formulation, on_ended)
    assert ended.best is before and ended.bound == ended.ideal
