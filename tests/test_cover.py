"""The recomputation cover and the closure cover (``remat.formulations.cover``) and the
bounds they give every exact search (``remat.strategies.exact.cover``): each bounds every
plan the strategies find, one device or several, lies between the ideal and a proven
optimum, and is what a search on a decomposed graph reports as its bound."""

import threading
from dataclasses import replace

import pytest
from regime import budgeted

from remat import samples
from remat.formulations.cover import Stages, build_cover
from remat.onnx_ingest import forward_graph
from remat.simulator import held_fixed_bytes
from remat.solvers.model import SolveOptions
from remat.strategies import SolverSettings, run_strategy
from remat.strategies.exact.cover import closure_extra_ms, cover_extra_ms
from remat.training import training_graph

QUICK = SolverSettings(options=SolveOptions(time_limit_s=3, gap=1e-4, threads=2))
ONE_DEVICE = ("greedy_evict", "ap_sqrt", "checkpoint_all", "checkmate_milp", "moccasin")


BOUNDS = [cover_extra_ms, closure_extra_ms]


def _bound(problem, names: tuple[str, ...], extra_ms=cover_extra_ms) -> float:
    """The ideal on ``names`` plus a cover's bound beyond it (which must exist)."""
    extra = extra_ms(problem, names, 10.0)
    assert extra is not None
    return problem.costs.ideal_ms(names[0] if len(names) == 1 else None) + extra


def _one_device_costs(problem, device: str) -> list[float]:
    """The simulated cost of each ``ONE_DEVICE`` strategy's plan on ``device`` that fits:
    greedy eviction (alone and as the warm start) has a minute to reach its first plan that
    fits, which a busy machine may need (it stops sooner where it converges)."""
    search = replace(problem.solver.search, evict_time_s=60.0)
    problem = replace(problem, solver=replace(problem.solver, search=search))
    results = [run_strategy(strategy, problem, device) for strategy in ONE_DEVICE]
    return [r.simulation.total_ms for r in results if r.feasible and r.simulation is not None]


def _graph(name: str, batch: int = 4):
    return training_graph(forward_graph(samples.ZOO[name](batch=batch), fuse_attention=False))


def test_every_plan_on_one_device_costs_at_least_either_bound() -> None:
    problem = budgeted(_graph("unet"), 35, ("cuda0",), QUICK)
    cover, closure = (_bound(problem, ("cuda0",), extra) for extra in BOUNDS)
    ideal = problem.costs.ideal_ms("cuda0")
    assert cover > ideal * 1.05  # tight budgets: well above the ideal
    assert closure > cover  # a dropped value's inputs are charged too
    costs = _one_device_costs(problem, "cuda0")
    assert len(costs) >= 3
    assert min(costs) >= closure * (1 - 1e-9)


def test_closure_rows_deep_enough_for_attention_raise_the_bound_below_every_plan() -> None:
    """A recomputed softmax needs its scores, the scores need Q and K, and those their
    projections: on the transformer block rows that follow inputs ``closure_depth`` (8)
    steps back charge that chain, where one step stops short of it (0.8% lower at 45% to
    55% of the peak)."""
    graph = training_graph(forward_graph(samples.transformer_block(batch=2), fuse_attention=False))
    problem = budgeted(graph, 50, ("cpu0",), QUICK)
    search = problem.solver.search
    shallow_settings = replace(problem.solver, search=replace(search, closure_depth=1))
    shallow = _bound(replace(problem, solver=shallow_settings), ("cpu0",), closure_extra_ms)
    deep = _bound(problem, ("cpu0",), closure_extra_ms)
    assert search.closure_depth == 8 and deep > shallow * 1.005
    costs = _one_device_costs(problem, "cpu0")
    assert len(costs) >= 3
    assert min(costs) >= deep * (1 - 1e-9)


@pytest.mark.parametrize("extra_ms", BOUNDS)
def test_the_bound_is_below_a_proven_optimum_and_above_the_ideal(extra_ms) -> None:
    graph = training_graph(forward_graph(samples.chain(n=8, batch=2)))
    settings = SolverSettings(options=SolveOptions(time_limit_s=60, gap=1e-9, threads=2))
    problem = budgeted(graph, 50, ("cpu0",), settings)
    result = run_strategy("checkmate_milp", problem, "cpu0")
    assert result.plan is not None and result.plan.solver is not None
    assert result.plan.solver.status == "optimal"
    bound = _bound(problem, ("cpu0",), extra_ms)
    assert problem.costs.ideal_ms("cpu0") < bound <= result.plan.solver.objective * (1 + 1e-9)


def test_pooled_budgets_bound_every_two_device_plan() -> None:
    """xengine starts from the covers' bound: the search is cancelled at its first plan,
    and its limit leaves the covers their time after the warm start also on a busy
    machine."""
    cancel = threading.Event()
    options = SolveOptions(time_limit_s=30, gap=1e-4, threads=2)
    settings = SolverSettings(options=options, cancel=cancel, on_plan=lambda _: cancel.set())
    problem = budgeted(_graph("unet"), 25, ("cpu0", "cuda0"), settings)
    bound = max(_bound(problem, ("cpu0", "cuda0"), extra) for extra in BOUNDS)
    assert bound > problem.costs.ideal_ms()
    result = run_strategy("xengine", problem)
    assert result.feasible and result.simulation is not None and result.plan is not None
    assert result.simulation.total_ms >= bound * (1 - 1e-9)
    assert result.plan.solver is not None and result.plan.solver.bound >= bound * (1 - 1e-9)


def test_no_budget_or_ample_memory_leaves_the_ideal_and_a_node_over_it_is_named() -> None:
    graph = _graph("resnet18")
    problem = budgeted(graph, 100, ("cuda0",), QUICK)
    costs = problem.costs
    fixed = held_fixed_bytes(graph, range(len(graph)))
    times = costs.compute_ms[:, 0]
    assert build_cover(graph, times, costs.output_bytes, None, fixed).trivial
    assert build_cover(graph, times, costs.output_bytes, 10 * fixed + 10**12, fixed).trivial
    tiny = build_cover(graph, times, costs.output_bytes, fixed, fixed)
    assert tiny.model is None and tiny.infeasible_at == 0  # the first node's output alone


def test_the_closure_keeps_the_stages_that_need_most_within_its_columns() -> None:
    """``Stages.thinned``: the kept stages' dropped values fit ``cells``, the stage that
    needs most is kept, and no stage left out would still fit beside the kept ones (so each
    was left out for its size, after every stage that needs more); with room for all, all
    are kept."""
    problem = budgeted(_graph("unet"), 25, ("cuda0",), QUICK)
    graph, costs = problem.graph, problem.costs
    fixed = held_fixed_bytes(graph, range(len(graph)))
    stages = Stages.of(graph, costs.output_bytes, problem.budgets["cuda0"], fixed)
    sizes = {int(t): stages.dropped(int(t)).size for t in stages.binding}
    cells = sum(sizes.values()) // 3
    kept = [t for t, _ in stages.thinned(cells)]
    assert kept == sorted(kept) and 0 < sum(sizes[t] for t in kept) <= cells
    assert max(sizes, key=lambda t: stages.need[t]) in kept
    room = cells - sum(sizes[t] for t in kept)
    assert all(sizes[t] > room for t in sizes if t not in kept)
    everything = [t for t, _ in stages.thinned(sum(sizes.values()))]
    assert everything == sorted(sizes)
