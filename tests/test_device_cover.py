"""The device cover (``remat.formulations.device_cover``): a bound of the whole problem
on several devices that budgets each device on its own, and a placement to plan on."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from functools import partial

import pytest
from regime import budgeted

from remat import samples
from remat.formulations import device_cover as device_cover_module
from remat.onnx_ingest import forward_graph
from remat.solvers import runner
from remat.solvers.model import Progress, SolveOptions, SolveResult, SolveStatus
from remat.strategies import Problem, SolverSettings, StrategyResult, run_strategy
from remat.strategies.config import SearchConfig
from remat.strategies.exact.cover import covers_extra_ms, device_closure_model, device_cover
from remat.strategies.heuristics.evict import evict_placed
from remat.training import training_graph

NAMES = ("cpu0", "cuda0")
QUICK = SolverSettings(options=SolveOptions(time_limit_s=3, gap=1e-4, threads=2))


def _problem(name: str, percent: float, seconds: float = 3):
    graph = training_graph(forward_graph(samples.ZOO[name](batch=4), fuse_attention=False))
    settings = SolverSettings(options=SolveOptions(time_limit_s=seconds, gap=1e-4, threads=2))
    return budgeted(graph, percent, NAMES, settings)


OPTIMAL = SolveOptions(time_limit_s=120, gap=1e-6, threads=1)  # closes in 10 to 30 s


@pytest.fixture(scope="module")
def transformer_closures() -> Iterator[tuple[Future[SolveResult], Future[SolveResult]]]:
    """The cover with closure rows on the transformer at 24%, with and without its copy
    rows, each solved to optimality on one thread: started when the module's first test
    asks, so that they solve beside its own work (the U-Net's, whose device cover is
    given time enough for that); two tests read them. Those unread are stopped."""
    problem = _problem("transformer", 24)
    with_rows = device_closure_model(problem, NAMES).model
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(device_cover_module, "_copy_rows", lambda *_: None)
        without_rows = device_closure_model(problem, NAMES).model
    stop = threading.Event()
    solve = partial(runner.solve, options=OPTIMAL, cancel=stop)
    with ThreadPoolExecutor(2) as pool:
        yield pool.submit(solve, with_rows), pool.submit(solve, without_rows)
        stop.set()


def _cost(result: StrategyResult) -> float | None:
    return result.simulation.total_ms if result.feasible and result.simulation else None


def _first_plan(problem: Problem) -> StrategyResult:
    """xengine's first plan for ``problem`` on two devices, within 60 s, the search
    cancelled once it is found: on a busy machine the multi-device heuristic may need more
    than a short limit gives it."""
    cancel = threading.Event()
    options = replace(problem.solver.options, time_limit_s=60)
    settings = SolverSettings(options=options, cancel=cancel, on_plan=lambda _: cancel.set())
    return run_strategy("xengine", replace(problem, solver=settings))


@pytest.mark.parametrize(("name", "percent"), [("unet", 25), ("transformer", 24)])
def test_the_device_cover_bounds_every_plan_on_two_devices(
    name: str,
    percent: float,
    transformer_closures: tuple[Future[SolveResult], Future[SolveResult]],
) -> None:
    """Also with closure rows: on the transformer both are solved to optimality, and the
    closure rows raise the bound (a recomputed softmax needs its scores). The device cover
    closes in 5 to 8 s alone, well within 30 s beside the closure rows' solves."""
    problem = _problem(name, percent)
    found = device_cover(problem, NAMES, 30.0)
    assert found is not None
    pooled = problem.costs.ideal_ms() + (covers_extra_ms(problem, NAMES, 10.0) or 0.0)
    assert found.bound_ms > pooled  # per device, the budgets bind where pooled they do not
    bounds = [found.bound_ms]
    if name == "transformer":
        closure = transformer_closures[0].result()
        assert closure.status is SolveStatus.OPTIMAL and closure.bound is not None
        assert closure.bound > found.bound_ms * 1.01
        bounds.append(closure.bound)
    plans = [_first_plan(problem)]
    # greedy eviction's first plans: any plan is bounded, its refills need no 5 s here
    quick = SolverSettings(options=problem.solver.options, search=SearchConfig(evict_time_s=0.5))
    evicted = replace(problem, solver=quick)
    plans += [run_strategy("greedy_evict", evicted, d) for d in NAMES]
    plans += [run_strategy("ap_sqrt", problem, d) for d in NAMES]
    plans.append(run_strategy("checkmate_milp", problem, "cuda0"))
    costs = [cost for cost in map(_cost, plans) if cost is not None]
    assert costs and min(costs) >= max(bounds) * (1 - 1e-9)


def test_a_copy_needs_a_source_elsewhere_and_a_reader_there(
    transformer_closures: tuple[Future[SolveResult], Future[SolveResult]],
) -> None:
    """Without its copy rows the cover lets a value that only the accelerator ever held
    come back there at a copy's price, cheaper than recomputing it and its inputs: on the
    transformer at 24% the rows raise the bound of the cover with closure rows by 1% or
    more (both solved to optimality; the previous test checks it against the plans)."""
    with_rows, without_rows = (solve.result() for solve in transformer_closures)
    bounds = []
    for solved in (with_rows, without_rows):
        assert solved.status is SolveStatus.OPTIMAL and solved.bound is not None
        bounds.append(solved.bound)
    bound_with, bound_without = bounds
    assert bound_with > bound_without * 1.01


def test_a_placement_fixed_bounds_its_cost_closer_than_the_whole_lp(
    transformer_closures: tuple[Future[SolveResult], Future[SolveResult]],
) -> None:
    """The cover with a placement fixed (``DeviceCoverModel.placed``, how the search costs
    the LP's rounded placement): each node first on its device of the placement only,
    and its LP relaxation's optimum between the whole LP's and the placement's cost in the
    MILP (the optimum's placement, solved to optimality by the fixture)."""
    cover = device_closure_model(_problem("transformer", 24), NAMES)
    optimum = transformer_closures[0].result()
    assert optimum.x is not None and optimum.objective is not None
    home = cover.placement(optimum.x)
    placed = cover.placed(home)
    n = len(home)
    assert placed.lb[cover.first].sum() == n and placed.ub[cover.first].sum() == n
    assert (placed.lb[cover.first[range(n), home]] == 1).all()
    options = replace(OPTIMAL, time_limit_s=60)
    whole = runner.solve(cover.model.lp_relaxation(), options=options)
    fixed = runner.solve(placed.lp_relaxation(), options=options)
    assert whole.objective is not None and fixed.objective is not None
    assert whole.objective - 1e-6 <= fixed.objective <= optimum.objective + 1e-6
    assert fixed.objective > whole.objective * 1.01  # the whole LP splits nodes over devices


def test_its_placement_plans_below_every_single_device_plan() -> None:
    """On ResNet-18 at 50% the cover runs the nodes that read the largest weights on the
    host, which frees the accelerator of them: greedy eviction on that placement beats
    every plan on one device, even an optimal one (it costs less than a device's ideal
    plus the covers' bound there, the least any plan on that device alone can cost), and
    so does xengine, which solves the cover for a quarter of its limit (its cover stopped
    sooner may place, and so cost, slightly otherwise). The cover closes in seconds: with
    an 80 s limit xengine's is solved to optimality also on a busy machine, and the search
    is cancelled once it has both that bound and a plan below one device's."""
    quick = _problem("resnet18", 50)
    found = device_cover(quick, NAMES, 60.0)  # optimal in 4 s on an idle machine
    assert found is not None and found.home is not None and len(set(found.home.tolist())) == 2
    placed = _cost(evict_placed(quick, NAMES, found.home, 5.0))
    assert placed is not None and placed >= found.bound_ms * (1 - 1e-9)
    one = [run_strategy("greedy_evict", quick, d) for d in NAMES]
    best_one = min(cost for cost in map(_cost, one) if cost is not None)
    alone = min(
        quick.costs.ideal_ms(d) + (covers_extra_ms(quick, (d,), 10.0) or 0.0) for d in NAMES
    )
    assert alone <= best_one * (1 + 1e-9)  # a bound of every plan on one device
    assert placed < alone
    cancel = threading.Event()

    def on_progress(progress: Progress) -> None:
        below = progress.objective is not None and progress.objective < alone
        if below and progress.bound is not None and progress.bound >= found.bound_ms * 0.999:
            cancel.set()

    options = replace(quick.solver.options, time_limit_s=80)
    settings = SolverSettings(options=options, cancel=cancel, on_progress=on_progress)
    problem = replace(quick, solver=settings)
    result = run_strategy("xengine", problem)
    assert cancel.is_set() and result.plan is not None and result.plan.solver is not None
    assert _cost(result) is not None and _cost(result) < alone
    pooled = problem.costs.ideal_ms() + (covers_extra_ms(problem, NAMES, 10.0) or 0.0)
    assert pooled < result.plan.solver.bound <= found.bound_ms * (1 + 1e-9)  # its own cover's
