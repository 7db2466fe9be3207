"""Decomposition of large graphs (``remat.strategies.exact.decompose``): the parts cover the
graph as the plan order needs, held values carry no gradient buffer, and the exact
strategies stitch the parts' plans into one plan the simulator accepts."""

import itertools
import math
import threading
import time
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from regime import budgeted

from remat import samples
from remat.budgets import reference
from remat.graph import Mode, NodeKind
from remat.onnx_ingest import forward_graph
from remat.plan import Compute
from remat.simulator import held_fixed_bytes, simulate
from remat.solvers.model import Progress, SolveOptions
from remat.strategies import Problem, SearchConfig, SolverSettings, StrategyResult
from remat.strategies.baselines import best_baseline
from remat.strategies.common.floor import device_fixed_bytes, shortfall
from remat.strategies.exact import search as search_module
from remat.strategies.exact import xengine as xengine_module
from remat.strategies.exact.checkmate import checkmate_milp
from remat.strategies.exact.cover import covers_extra_ms
from remat.strategies.exact.decompose import (
    PartSolvers,
    _chosen,
    _fits,
    crossing_bytes,
    is_large,
    parts,
    segments,
    solve_parts,
    stored_orders,
)
from remat.strategies.exact.search import _Stalled, _Switch, quick_part
from remat.strategies.exact.state import RelaxedPlacement, Search
from remat.strategies.exact.xengine import xengine
from remat.training import training_graph

FAST = SolverSettings(options=SolveOptions(time_limit_s=12, gap=0.01, threads=2))


def _problem(blocks, percent, devices=("cuda0",), mode=Mode.TRAINING, settings=FAST):
    graph = forward_graph(samples.large(batch=4, blocks=blocks), fuse_attention=False)
    if mode is Mode.TRAINING:
        graph = training_graph(graph)
    return budgeted(graph, percent, devices, settings)


@pytest.fixture(scope="module")
def large():
    return _problem(8, 50)


def test_segments_are_contiguous_bounded_and_cut_where_little_crosses(large):
    graph, costs = large.graph, large.costs
    cuts = segments(graph, costs, size=50)
    forward = [n.id for n in graph.nodes if n.kind is NodeKind.FORWARD]
    assert [i for cut in cuts for i in cut] == forward
    assert all(len(cut) <= 50 for cut in cuts) and len(cuts) > 2
    crossing = crossing_bytes(graph, costs)
    for before, cut in itertools.pairwise(cuts):  # none in its window is cheaper
        window = range(before.start + 25, before.start + 51)
        assert cut.start in window
        assert crossing[cut.start] == min(crossing[c] for c in window)


def test_parts_compute_each_backward_node_once_and_read_only_what_is_resident(large):
    graph = large.graph
    cuts = segments(graph, large.costs)
    for stored in (frozenset(), stored_orders(graph, large.costs, cuts, None)[0][0]):
        plan_parts = parts(graph, cuts, stored)
        seen = [0] * len(graph)
        resident: frozenset[int] = frozenset()
        for part in plan_parts:
            assert list(part.nodes) == sorted(part.nodes)
            assert set(part.held) <= resident  # read only what earlier parts left
            for i in part.nodes:
                seen[i] += 1
            resident = part.needed_after
        assert all(seen)  # every node computed
        backward = [n.id for n in graph.nodes if n.kind is not NodeKind.FORWARD]
        assert all(seen[i] == 1 for i in backward)
        assert resident == frozenset()  # training: nothing stays


def test_storing_every_value_computes_each_forward_node_once(large):
    graph = large.graph
    cuts = segments(graph, large.costs)
    plan_parts = parts(graph, cuts, stored_orders(graph, large.costs, cuts, None)[0][0])
    counts = [0] * len(graph)
    for part in plan_parts:
        for i in part.nodes:
            counts[i] += 1
    recomputed = [i for i, c in enumerate(counts) if c > 1]
    # only forward nodes no backward node reads may be recomputed (to rebuild stored ones)
    assert all(graph.nodes[i].kind is NodeKind.FORWARD for i in recomputed)
    assert sum(counts) < len(graph) + len(recomputed) + 1


def test_stored_choices_are_distinct_and_each_fits_the_memory_estimate(large):
    graph, costs = large.graph, large.costs
    cuts = segments(graph, costs)
    reserved = held_fixed_bytes(graph, range(len(graph)))
    room = large.budgets["cuda0"] - reserved
    orders = stored_orders(graph, costs, cuts, room)
    choices = [stored for order in orders for stored in order]
    assert all(len(order[0]) > len(order[-1]) for order in orders)  # the longest first
    assert len(choices) >= 2 and len(set(choices)) == len(choices)
    assert all(choices) and frozenset() not in choices  # room for some values
    assert all(_fits(graph, costs, parts(graph, cuts, stored), room) for stored in choices)
    everything = stored_orders(graph, costs, cuts, None)[0][0]
    assert not _fits(graph, costs, parts(graph, cuts, everything), room)  # a real choice


def _judged_by_cost(graph, cuts, costs_of):
    """A judge that plans each choice at ``costs_of[choice]`` ms (None: no plan that
    fits), recording the choices it is asked for."""
    by_parts = {tuple(parts(graph, cuts, stored)): stored for stored in costs_of}
    asked: list[frozenset[int]] = []

    def judged(plan_parts):
        stored = by_parts[tuple(plan_parts)]
        asked.append(stored)
        cost = costs_of[stored]
        if cost is None:
            return StrategyResult("judge", None, None, "does not fit")
        return StrategyResult("judge", object(), SimpleNamespace(total_ms=cost))

    return judged, asked


def test_choices_are_judged_by_turns_each_order_until_a_shorter_prefix_costs_more(large):
    graph, costs = large.graph, large.costs
    cuts = segments(graph, costs)
    kept = sorted(stored_orders(graph, costs, cuts, None)[0][0])
    a1, a2, a3, a4, b1, b2, b3 = (frozenset(kept[: k + 1]) for k in range(7))
    orders = [[a1, a2, a3, a4], [b1, b2, b3]]
    costs_of = {a1: 10.0, a2: 8.0, a3: 9.0, a4: 7.0, b1: None, b2: 12.0, b3: 7.5}
    judged, asked = _judged_by_cost(graph, cuts, costs_of)
    offered: list[StrategyResult] = []
    chosen = _chosen(graph, orders, cuts, judged, _never_called, offered.append, math.inf)
    # a3 costs more than a2, so a4 is never judged; b1 has no plan, so b2 follows it
    assert asked == [a1, b1, a2, b2, a3, b3]
    assert chosen == b3
    assert [r.simulation.total_ms for r in offered] == [10.0, 8.0, 7.5]


def test_past_its_deadline_judging_stops_once_a_choice_has_a_plan(large):
    graph, costs = large.graph, large.costs
    cuts = segments(graph, costs)
    kept = sorted(stored_orders(graph, costs, cuts, None)[0][0])
    a1, a2, b1, b2 = (frozenset(kept[: k + 1]) for k in range(4))
    judged, asked = _judged_by_cost(graph, cuts, {a1: None, b1: 9.0, a2: 8.0, b2: 7.0})
    quick, _ = _judged_by_cost(graph, cuts, {a1: None})
    chosen = _chosen(graph, [[a1, a2], [b1, b2]], cuts, judged, quick, None, 0.0)
    assert asked == [a1, b1] and chosen == b1


def test_a_part_that_several_choices_share_is_judged_once(large):
    """The stored-value choices share parts (the same nodes, held values and budget): each
    such part's judge plan is made once and reused, and the stitched plans still fit."""
    graph, costs = large.graph, large.costs
    cuts = segments(graph, costs)
    room = large.budgets["cuda0"] - held_fixed_bytes(graph, range(len(graph)))
    choices = [stored for order in stored_orders(graph, costs, cuts, room) for stored in order]
    shapes = [(p.nodes, p.held) for stored in choices for p in parts(graph, cuts, stored)]
    assert len(set(shapes)) < len(shapes)  # some part recurs across the choices
    judged: list[tuple[object, ...]] = []

    def judge(part):
        judged.append((part.graph.fingerprint, *sorted(part.budgets.items())))
        return _baseline(part)

    solvers = PartSolvers(_baseline, _baseline, judge=judge)
    result = solve_parts(large, "checkmate_milp", "cuda0", solvers, lambda: None, 60)
    assert judged and len(set(judged)) == len(judged)
    assert result.plan is not None, result.message
    simulation = simulate(result.plan, graph, costs, large.budgets)
    assert simulation.valid and simulation.peak_bytes["cuda0"] <= large.budgets["cuda0"]


def test_a_held_value_is_fixed_memory_without_a_gradient_buffer(large):
    graph, costs = large.graph, large.costs
    part = parts(graph, segments(graph, costs))[-1]  # B_1: reads checkpoints and gradients
    local = part.graph(graph, costs)
    assert local.fixed and all(t.kind == "held" for t in local.fixed.values())
    held = sum(t.nbytes for t in local.fixed.values())
    assert held_fixed_bytes(local, range(len(local))) == held  # training, yet no gradients
    assert held == sum(int(costs.output_bytes[v]) for v in part.held)


def test_checkmate_milp_on_a_large_graph_stitches_a_valid_plan_that_beats_the_baseline(
    large, monkeypatch
):
    """6 s: the parts' share of them gets each part its quick plan (as 12 s did, each
    share under ``min_part_s``), the whole graph's interval model the rest. The parts
    start right after the best baseline: the covers' bound is computed in a process
    beside them, and still reaches the result."""
    assert is_large(large.graph)
    started: list[str] = []
    beside, solve = search_module.Beside, search_module.solve_parts

    def recorded_beside(work, *args):
        started.append(work.__name__)
        return beside(work, *args)

    def recorded_parts(*args, **kwargs):
        started.append("parts")
        return solve(*args, **kwargs)

    monkeypatch.setattr(search_module, "Beside", recorded_beside)
    monkeypatch.setattr(search_module, "solve_parts", recorded_parts)
    found: list[StrategyResult] = []  # the parts' plans are not the whole problem's
    options = replace(large.solver.options, time_limit_s=6)
    listening = replace(large, solver=replace(large.solver, options=options, on_plan=found.append))
    result = checkmate_milp(listening, "cuda0")
    assert started == ["covers_extra_ms", "parts"]
    assert found and found[-1].simulation.total_ms == result.simulation.total_ms
    for plan in found:
        assert simulate(plan.plan, large.graph, large.costs, large.budgets).valid
    assert result.feasible and result.plan is not None
    simulation = simulate(result.plan, large.graph, large.costs, large.budgets)
    assert simulation.valid
    assert simulation.peak_bytes["cuda0"] <= large.budgets["cuda0"]
    assert result.plan.solver is not None
    # no part's bound bounds the whole: the larger cover's does, solved within the search's
    # share of the limit: above the ideal (its root relaxation is, in a fraction of a
    # second), at most its optimum (which 10 s reach; on a loaded machine the share may end
    # before the optimum, never above it)
    extra = covers_extra_ms(large, ("cuda0",), 10.0) or 0.0
    ideal = large.costs.ideal_ms("cuda0")
    bound = result.plan.solver.bound
    assert bound is not None and ideal + 1e-9 < bound <= ideal + extra + 1e-9
    assert "decomposed" in result.message
    baseline = best_baseline(large, ["cuda0"])
    assert baseline is not None and baseline.simulation is not None
    assert simulation.total_ms < baseline.simulation.total_ms


def test_xengine_on_a_large_graph_says_when_no_device_holds_its_fixed_tensors_alone():
    """A part's plan holds every fixed tensor on each device: where no device holds them
    alone, no part fits; where the multi-device heuristic finds no plan either (this
    stack's activations need several times its weights), the message says why instead of
    a part's shortfall."""
    quick = SolverSettings(options=SolveOptions(time_limit_s=2, gap=0.01, threads=2))
    problem = _problem(7, 50, devices=("cpu0", "cuda0"), settings=quick)
    budget = device_fixed_bytes(problem, "cuda0") - 1
    problem = replace(problem, budgets={"cpu0": budget, "cuda0": budget})
    assert is_large(problem.graph) and shortfall(problem, ("cpu0", "cuda0")) is None
    assert all(shortfall(problem, (name,)) is not None for name in ("cpu0", "cuda0"))
    result = xengine(problem)
    assert not result.feasible
    assert "no single device holds every fixed tensor" in result.message
    assert "the multi-device heuristic found no plan" in result.message


def test_xengine_on_a_large_graph_splits_the_fixed_tensors_no_device_holds_alone():
    """VGG-16, decomposed here from 50 nodes, on two devices that each hold 80% of its
    weights and gradients and a third of its activations: no part fits on either, and
    the multi-device heuristic's placements, which split the weights, give the plan (then
    the interval model on placements and node moves improve it). Cancelled at the first
    improvement: the heuristic's plan comes within a second on an idle machine, and the
    60 s limit leaves it time on a loaded one."""
    graph = training_graph(forward_graph(samples.vgg16(), batch=4))
    cancel = threading.Event()
    costs: list[float] = []

    def on_plan(found: StrategyResult) -> None:
        assert found.simulation is not None
        costs.append(found.simulation.total_ms)
        if min(costs) < costs[0]:
            cancel.set()

    quick = SolverSettings(
        options=SolveOptions(time_limit_s=60, gap=0.01, threads=2),
        search=SearchConfig(decompose_min_nodes=50),
        cancel=cancel,
        on_plan=on_plan,
    )
    problem = budgeted(graph, 50, settings=quick)
    ref = reference(graph, problem.costs)
    budget = int(device_fixed_bytes(problem, "cuda0") * 0.8)
    budget += (ref.peak_bytes - ref.fixed_bytes) // 3
    problem = replace(problem, budgets={"cpu0": budget, "cuda0": budget})
    assert is_large(problem.graph, quick.search)
    assert all(shortfall(problem, (name,)) is not None for name in ("cpu0", "cuda0"))
    result = xengine(problem)
    assert result.feasible and result.plan is not None, result.message
    assert simulate(result.plan, problem.graph, problem.costs, problem.budgets).valid
    assert {s.device for s in result.plan.steps if isinstance(s, Compute)} == {"cpu0", "cuda0"}
    assert "no single device holds every fixed tensor" in result.message
    assert "multi-device heuristic's plan costs" in result.message


def test_xengine_on_a_large_graph_costs_no_more_than_on_its_fastest_device_alone(monkeypatch):
    """The parts' plans on several devices reserve every fixed tensor on each device and
    copy between parts, so the stitched plan can cost more than one device's. ``xengine``
    solves the graph on the device with the lowest ideal alone (``checkmate_milp``,
    decomposed too) until the device cover's placement takes over, and keeps its plan
    unless the interval model on that placement plans cheaper. Beside it the device
    cover with closure rows bounds the whole graph, its bound the result's where it is
    the best (solved without presolve). Each device's best baseline is planned once: the
    one device's by its search, the other's by the warm start. It is stopped with the
    solves beside it, so on a loaded machine it may end before its root relaxation lifts
    it above the ideal: that it does lift it is ``test_cover``'s to show."""
    quick = SolverSettings(options=SolveOptions(time_limit_s=6, gap=0.01, threads=2))
    problem = _problem(7, 50, devices=("cpu0", "cuda0"), settings=quick)
    alone: list[tuple[str, StrategyResult]] = []
    solve_alone = xengine_module.checkmate_milp

    def watched(p: Problem, device: str, **kwargs: bool) -> StrategyResult:
        result = solve_alone(p, device, **kwargs)
        alone.append((device, result))
        return result

    closure_bounds: list[float] = []
    bound_by_closure = search_module.bound_by_closure

    def bounded(search: Search, names: tuple[str, ...]) -> None:
        bound_by_closure(search, names)
        closure_bounds.append(search.bound)

    baselines_on: list[tuple[str, ...]] = []  # the whole graph's best baselines' devices
    best_baseline = search_module.best_baseline

    def recorded(p: Problem, names: list[str]) -> StrategyResult | None:
        if p.graph is problem.graph:
            baselines_on.append(tuple(names))
        return best_baseline(p, names)

    presolved: list[bool] = []  # the closure cover's solves: without presolve
    solve = search_module.runner.solve

    def solve_recorded(model, *args, **kwargs):
        if kwargs.get("on_incumbent") is not None:  # the cover, whose placements are kept
            presolved.append(kwargs["options"].presolve)
        return solve(model, *args, **kwargs)

    monkeypatch.setattr(xengine_module, "checkmate_milp", watched)
    monkeypatch.setattr(search_module, "bound_by_closure", bounded)
    monkeypatch.setattr(search_module, "best_baseline", recorded)
    monkeypatch.setattr(search_module.runner, "solve", solve_recorded)
    result = xengine(problem)
    assert presolved == [False]
    assert sorted(baselines_on) == [("cpu0",), ("cuda0",)]  # each device's once
    assert len(closure_bounds) == 1 and result.plan is not None and result.plan.solver
    assert result.plan.solver.bound >= closure_bounds[0] >= problem.costs.ideal_ms()
    [(device, first)] = alone  # the whole graph, once
    assert device == min(problem.budgets, key=problem.costs.ideal_ms) == "cpu0"
    assert first.feasible and result.feasible
    assert result.simulation.total_ms <= first.simulation.total_ms
    simulation = simulate(result.plan, problem.graph, problem.costs, problem.budgets)
    assert simulation.valid and simulation.total_ms == pytest.approx(result.simulation.total_ms)


def test_inference_graphs_decompose_into_forward_parts_and_keep_the_outputs():
    """Without a budget the stitched plan computes each node once. (At the checkpoint-all
    peak it may not: a part holds the values it reads from earlier parts until it ends,
    where the whole graph's schedule frees them after their last reader.)"""
    problem = replace(_problem(14, 100, mode=Mode.INFERENCE), budgets={"cuda0": None})
    assert is_large(problem.graph)
    graph = problem.graph
    plan_parts = parts(graph, segments(graph, problem.costs))
    assert sum(len(p.nodes) for p in plan_parts) == len(graph)  # each node once
    assert set(graph.outputs) <= plan_parts[-1].needed_after
    exact = lambda part: checkmate_milp(part, "cuda0", decompose=False)  # noqa: E731
    solvers = PartSolvers(exact, _never_called)
    result = solve_parts(problem, "checkmate_milp", "cuda0", solvers, lambda: None, 60)
    assert result.plan is not None, result.message
    simulation = simulate(result.plan, graph, problem.costs, problem.budgets)
    assert simulation.valid  # the outputs are resident at the end
    assert simulation.total_ms == pytest.approx(problem.costs.ideal_ms("cuda0"))


def test_an_impossible_budget_is_reported_not_stitched(large):
    tight = Problem(large.graph, large.costs, {"cuda0": 1}, large.solver)
    cuts = segments(tight.graph, tight.costs)
    assert stored_orders(tight.graph, tight.costs, cuts, 0) == [[frozenset()]]
    solvers = PartSolvers(_never_called, _never_called)
    result = solve_parts(tight, "checkmate_milp", "cuda0", solvers, lambda: None, 60)
    assert result.plan is None
    assert "exceed the budget" in result.message


def test_a_spent_time_limit_stitches_the_parts_baselines_without_solving(large):
    solvers = PartSolvers(_never_called, _baseline)
    result = solve_parts(large, "checkmate_milp", "cuda0", solvers, lambda: None, 0)
    assert result.plan is not None, result.message
    simulation = simulate(result.plan, large.graph, large.costs, large.budgets)
    assert simulation.valid
    assert simulation.peak_bytes["cuda0"] <= large.budgets["cuda0"]


def test_the_baselines_stitched_plan_is_offered_before_any_part_is_solved(large):
    offered: list[StrategyResult] = []
    offers_before_solve: list[int] = []

    def exact(part):
        offers_before_solve.append(len(offered))
        return _baseline(part)

    solvers = PartSolvers(exact, _baseline)
    result = solve_parts(
        large, "checkmate_milp", "cuda0", solvers, lambda: None, 60, offered.append
    )
    assert result.plan is not None and offers_before_solve and offers_before_solve[0] >= 1
    first = offered[0]
    assert first.plan is not None
    simulation = simulate(first.plan, large.graph, large.costs, large.budgets)
    assert simulation.valid and simulation.peak_bytes["cuda0"] <= large.budgets["cuda0"]


def test_parts_no_baseline_fits_get_greedy_eviction_plans_offered_before_any_solve():
    """Where no choice's judged plans fit, the first choice's quick plans (greedy
    eviction) are offered before the other choices are judged and before any solve. Eviction
    gets all the time it needs for its first plan of a part: what is asserted is the order,
    not how fast a busy machine finds one."""
    patient = replace(FAST, search=replace(SearchConfig(), part_fit_s=60.0))
    tight = _problem(8, 15, settings=patient)
    assert best_baseline(tight, ["cuda0"]) is None
    baselines = PartSolvers(_never_called, _baseline)
    assert solve_parts(tight, "checkmate_milp", "cuda0", baselines, lambda: None, 0).plan is None
    quick = partial(quick_part, device="cuda0")
    offered: list[StrategyResult] = []

    def exact(part):
        assert offered, "the quick plans' stitched plan comes before any part's solve"
        return quick(part)

    offered_when_judged: list[int] = []

    def judge(part):  # no choice's baselines fit
        offered_when_judged.append(len(offered))
        return _baseline(part)

    solvers = PartSolvers(exact, quick, judge=judge)
    result = solve_parts(
        tight, "checkmate_milp", "cuda0", solvers, lambda: None, 60, offered.append
    )
    assert result.plan is not None and len(offered) == 1, result.message
    # the first choice's quick plans are stitched and offered before the next is judged
    assert offered_when_judged[0] == 0 and offered_when_judged[-1] == 1
    assert offered[0].feasible
    for plan in (offered[0].plan, result.plan):
        simulation = simulate(plan, tight.graph, tight.costs, tight.budgets)
        assert simulation.valid and simulation.peak_bytes["cuda0"] <= tight.budgets["cuda0"]


def _baseline(part):
    return best_baseline(part, ["cuda0"]) or StrategyResult("baseline", None, None, "none fits")


def _never_called(problem):
    raise AssertionError("this part solver must not be called here")


def test_the_one_device_search_stops_for_a_placement_only_where_it_is_worth_it(large):
    """On several devices the one-device search of a decomposed graph stops for the
    interval model on the device cover's placement once its share of the time has passed,
    where that placement uses both devices and its relaxed cost is below the one-device
    search's bound; otherwise it goes on."""
    problem = replace(large, budgets={"cpu0": None, "cuda0": large.budgets["cuda0"]})
    n, now = len(problem.graph), time.monotonic()
    search = Search(problem, problem.costs.ideal_ms(), now)
    switch = _Switch(search, after=now - 1)
    assert not switch.is_set()  # no placement yet
    search.on_placement(RelaxedPlacement(np.ones(n, dtype=np.int64), 2.0))
    switch.on_progress(Progress(1.0, 4.0, 3.0, 0.25))
    assert not switch.is_set()  # every node on one device
    search.on_placement(RelaxedPlacement(np.arange(n) % 2, 1.5))
    assert switch.placement() is not None and switch.is_set()
    assert search.alone_bound == 3.0  # the one-device search's bound, for the cover's stop
    later = _Switch(search, after=now + 3600)
    assert not later.is_set()  # its share of the time has not passed
    dearer = _Switch(Search(problem, problem.costs.ideal_ms(), now), after=now - 1)
    dearer.search.on_placement(RelaxedPlacement(np.arange(n) % 2, 1.5))
    dearer.on_progress(Progress(1.0, 4.0, 1.2, 0.7))
    assert dearer.placement() is None and not dearer.is_set()  # one device may reach it


def test_a_rounded_placement_gives_way_to_an_integral_one_worth_switching_to(large):
    """The device cover's LP solution, rounded, is a placement the search may switch to
    before its MILP has an incumbent; its cost (the LP's with it fixed) only bounds the
    placement's, so an integral placement replaces it once that is worth switching to
    (cheaper than the one-device search's bound), whatever the LP's cost, and a rounded
    one never replaces an integral one."""
    n, now = len(large.graph), time.monotonic()
    search = Search(large, large.costs.ideal_ms(), now)
    search.alone_bound = 100.0
    rounded = RelaxedPlacement(np.arange(n) % 2, 90.0, rounded=True)
    search.on_placement(rounded)
    assert search.placement_worth_switching() is rounded
    search.on_placement(RelaxedPlacement(np.ones(n, dtype=np.int64), 120.0))
    assert search.placement is rounded  # the MILP's first incumbent: not worth a switch
    integral = RelaxedPlacement((np.arange(n) // 2) % 2, 95.0)
    search.on_placement(integral)
    assert search.placement is integral  # dearer than the LP's optimum, but its cost known
    search.on_placement(RelaxedPlacement(np.arange(n) % 2, 80.0, rounded=True))
    assert search.placement is integral
    search.on_placement(cheaper := RelaxedPlacement(np.arange(n) % 2, 92.0))
    assert search.placement is cheaper


def test_the_closure_cover_stops_once_its_bound_stalls_on_a_one_device_placement(large):
    """Beside a decomposed graph's one-device search, the device cover with closure rows
    stops once its bound has risen by less than the tolerance over the window, unless its
    placement uses several devices and may still make the search switch: it is cheaper
    than the one-device search's bound, or its bound leaves room below that bound."""
    n, now = len(large.graph), time.monotonic()
    search = Search(large, large.costs.ideal_ms(), now)
    stalled = _Stalled(search, window=0.05, rise=1e-3, room=0.01)
    assert not stalled.is_set()  # no bound yet
    stalled.on_bound(100.0)
    assert not stalled.is_set()  # no bound a window old
    time.sleep(0.06)
    stalled.on_bound(102.0)
    assert not stalled.is_set()  # risen by 2% over the window
    time.sleep(0.06)
    stalled.on_bound(102.05)
    search.on_placement(RelaxedPlacement(np.zeros(n, dtype=np.int64), 90.0))
    assert stalled.is_set() and stalled.fired  # 0.05% over the last window, one device
    on_both = _Stalled(search, window=0.05, rise=1e-3, room=0.01)
    on_both.on_bound(100.0)
    time.sleep(0.06)
    on_both.on_bound(100.0)
    search.on_placement(RelaxedPlacement(np.arange(n) % 2, 80.0))
    assert not on_both.is_set()  # a placement on both devices, no one-device bound yet
    search.alone_bound = 100.5
    assert not on_both.is_set()  # cheaper than one device's bound: the search may switch
    dear = Search(large, large.costs.ideal_ms(), now)
    dear.on_placement(RelaxedPlacement(np.arange(n) % 2, 130.0))
    dear.alone_bound = 103.0
    roomy = _Stalled(dear, window=0.05, rise=1e-3, room=0.01)
    roomy.on_bound(100.0)
    time.sleep(0.06)
    roomy.on_bound(100.0)
    assert not roomy.is_set()  # 3% below one device's bound: a cheaper placement may come
    dear.alone_bound = 100.5
    assert roomy.is_set()  # within 1% of it: no placement gains more than that
