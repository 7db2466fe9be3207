"""The multi-device R solve (``rsolve.solve_r_placed``) and the placed heuristic that
warm-starts XEngine where no single device fits."""

import itertools
import threading
import time

import numpy as np
import pytest
from regime import CPU, budgeted

from remat import samples
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.onnx_ingest import forward_graph
from remat.simulator import simulate
from remat.solvers.model import SolveOptions
from remat.strategies import BASELINES, Problem, SolverSettings, run_strategy
from remat.strategies.baselines import best_baseline
from remat.strategies.common.rsolve import (
    prune_placed,
    solve_and_prune,
    solve_and_prune_placed,
    solve_r,
    solve_r_placed,
)
from remat.strategies.exact.xengine import xengine
from remat.strategies.heuristics import placed
from remat.strategies.heuristics.placed import forward_layer, placed_greedy, placed_on, placements
from remat.training import training_graph

from graphs import chain, diamond


@pytest.mark.parametrize("seed", range(20))
def test_placed_r_solve_satisfies_xengine_constraints(seed):
    rng = np.random.default_rng(seed)
    graph = training_graph(diamond() if seed % 2 else chain(4))
    T, D = len(graph), 2
    place = rng.integers(0, D, T)
    S = (rng.random((D, T, T)) < 0.3) & np.tril(np.ones((T, T), dtype=bool), -1)[None]
    S &= place[None, None, :] == np.arange(D)[:, None, None]
    R = solve_r_placed(graph, S, place)
    assert R[place, np.arange(T), np.arange(T)].all()  # eq. 8-9: node t on its home
    assert not np.triu(R.any(axis=0), 1).any()  # eq. 7
    on = R | S
    for d in range(D):  # eq. 11: keep only what was on the same device
        assert not (S[d, 1:] & ~on[d, :-1]).any()
    anywhere = on.any(axis=0)
    for t in range(T):  # eq. 12: dependencies computed or kept on some device
        for k in np.flatnonzero(R[:, t].any(axis=0)):
            assert all(anywhere[t, i] for i in graph.nodes[k].deps)


@pytest.mark.parametrize("seed", range(10))
def test_prune_placed_keeps_exactly_what_the_backward_recurrence_needs(seed):
    """The vectorised prune against its definition, stage by stage from the end: a value
    is needed on d at the start of t if it is kept there, not recomputed there, and read
    in t (from any device) or needed on d at the start of t+1; outputs after the end."""
    rng = np.random.default_rng(seed)
    graph = training_graph(diamond() if seed % 2 else chain(5))
    T, D = len(graph), 2
    R = rng.random((D, T, T)) < 0.2
    S = rng.random((D, T, T)) < 0.5
    users = np.zeros((T, T), dtype=bool)  # users[t, i]: a node computed in t reads i
    for t in range(T):
        for k in np.flatnonzero(R[:, t].any(axis=0)):
            users[t, list(graph.nodes[k].deps)] = True
    expected = np.zeros_like(S)
    needed = np.zeros((D, T), dtype=bool)
    needed[:, list(graph.outputs)] = True
    for t in range(T - 1, -1, -1):
        needed = S[:, t] & ~R[:, t] & (users[t][None] | needed)
        expected[:, t] = needed
    assert np.array_equal(prune_placed(graph, R, S), expected)


def test_one_device_placed_solve_is_checkmates():
    graph = training_graph(diamond())
    T = len(graph)
    S = np.tril(np.ones((T, T), dtype=bool), -1)
    S[:, 1] = False
    zeros = np.zeros(T, dtype=np.int64)
    assert np.array_equal(solve_r_placed(graph, S[None], zeros)[0], solve_r(graph, S))
    R, pruned = solve_and_prune_placed(graph, S[None], zeros)
    R1, pruned1 = solve_and_prune(graph, S)
    assert np.array_equal(R[0], R1) and np.array_equal(pruned[0], pruned1)


def _split_problem(name, percent, settings=None):
    graph = training_graph(forward_graph(samples.ZOO[name](), batch=4, fuse_attention=False))
    return budgeted(graph, percent, settings=settings)


def _no_single_device_fits(problem):
    for device in ("cpu0", "cuda0"):
        for name in BASELINES:
            try:
                result = run_strategy(name, problem, device)
            except Exception:
                continue
            assert not result.feasible, (name, device)


def test_placed_greedy_fits_where_no_single_device_does():
    problem = _split_problem("vgg16", 25)
    _no_single_device_fits(problem)
    result = placed_greedy(problem, fit_budget_s=60.0)
    assert result.feasible, result.message
    verdict = simulate(result.plan, problem.graph, problem.costs, problem.budgets)
    assert verdict.valid
    for device, peak in verdict.peak_bytes.items():
        assert peak <= problem.budgets[device]
    used = {s.device for s in result.plan.steps if s.op == "compute"}
    assert used == {"cpu0", "cuda0"}


def _record_the_local_search_start(monkeypatch) -> list[float]:
    """When the heuristic's local search first starts (``time.monotonic()``)."""
    started: list[float] = []
    search = placed._local_search

    def recorded(*args, **kwargs):
        started.append(time.monotonic())
        return search(*args, **kwargs)

    monkeypatch.setattr(placed, "_local_search", recorded)
    return started


def test_placed_greedy_offers_its_first_plan_before_the_local_search(monkeypatch):
    """The first plan that fits is offered as soon as a placement gives one, before the
    other placements are solved and the local search starts; every plan offered fits,
    and the cheapest offered is the one returned."""
    started = _record_the_local_search_start(monkeypatch)
    problem = _split_problem("vgg16", 25)
    offered: list[tuple[float, float]] = []

    def offer(result):
        assert result.feasible and result.simulation.valid
        offered.append((time.monotonic(), result.simulation.total_ms))

    result = placed_greedy(problem, time_budget_s=2.0, offer=offer, fit_budget_s=60.0)
    assert started and offered
    assert offered[0][0] < started[0]
    assert min(ms for _, ms in offered) == result.simulation.total_ms


def test_xengine_reports_a_plan_before_the_heuristics_local_search(monkeypatch):
    """U-Net at 25% on cpu+cuda: the first plan is reported from the first placement that
    fits, before the heuristic's local search starts, not at the end of its warm start.
    Cancelled once the local search starts: the rest of the search tells nothing here.
    The limit leaves the heuristic time to a first fit on a loaded machine (half of it)."""
    started = _record_the_local_search_start(monkeypatch)
    cancel = threading.Event()
    local_search = placed._local_search

    def cancelling(*args, **kwargs):
        cancel.set()
        return local_search(*args, **kwargs)

    monkeypatch.setattr(placed, "_local_search", cancelling)
    reported: list[float] = []

    def on_progress(progress):
        if progress.objective is not None:
            reported.append(time.monotonic())

    options = SolveOptions(time_limit_s=30.0)
    settings = SolverSettings(options=options, on_progress=on_progress, cancel=cancel)
    result = xengine(_split_problem("unet", 25, settings))
    assert result.feasible
    assert started and reported and reported[0] < started[0]


def test_placed_greedy_judges_on_until_a_plan_fits_within_its_fit_budget():
    """The transformer at 22% on cpu+cuda: no candidate is estimated to fit, and the first
    the simulator accepts comes after several are judged. Out of time, the heuristic
    stops after the first (no plan); with time to fit it judges on, then stops."""
    problem = _split_problem("transformer", 22)
    _no_single_device_fits(problem)
    assert not placed_greedy(problem, time_budget_s=0.0).feasible
    result = placed_greedy(problem, time_budget_s=0.0, fit_budget_s=60.0)
    assert result.feasible, result.message
    verdict = simulate(result.plan, problem.graph, problem.costs, problem.budgets)
    assert verdict.valid


def test_on_a_busy_machine_placed_greedy_still_gets_its_fit_budget(monkeypatch):
    """As above with a wall clock that races ahead (a busy machine: every look at the clock
    finds minutes gone): the fit budget is the heuristic's CPU time, so it still judges
    on to a plan that fits."""
    problem = _split_problem("transformer", 22)
    real = time.monotonic
    calls = itertools.count()
    with monkeypatch.context() as patched:
        patched.setattr(time, "monotonic", lambda: real() + 600.0 * next(calls))
        result = placed_greedy(problem, time_budget_s=0.0, fit_budget_s=60.0)
    assert result.feasible, result.message
    assert next(calls) > 2  # the clock was read, and raced


def test_xengine_finds_the_transformers_plan_at_a_short_limit():
    """At a short limit the heuristic's quarter of it can run out before the transformer's
    first plan that fits, and no solver finds one in the rest; its search for a first plan
    may take half the limit (``SearchConfig.fit_share``). The solve is cancelled once a
    plan is offered. (The limit leaves room for a slow machine: that search alone took
    8-9 s on a 2-core CI VM, where the test above needs it too.)"""
    cancel = threading.Event()
    settings = SolverSettings(
        options=SolveOptions(time_limit_s=30.0), cancel=cancel, on_plan=lambda _: cancel.set()
    )
    problem = _split_problem("transformer", 22, settings)
    result = xengine(problem)
    assert result.feasible, result.message
    assert simulate(result.plan, problem.graph, problem.costs, problem.budgets).valid


def test_placements_include_fastest_single_devices_and_cuts():
    problem = _split_problem("vgg16", 100)
    found = placements(problem, ("cpu0", "cuda0"))
    fastest = np.argmin(problem.costs.compute_ms, axis=1)
    assert any(np.array_equal(p, fastest) for p in found)
    assert any((p == 0).all() for p in found) and any((p == 1).all() for p in found)
    mixed = [p for p in found if 0 < p.sum() < len(p)]
    assert len(mixed) >= 8  # cuts in both directions
    assert any(_is_band(p, problem) for p in found)


def _is_band(place, problem):
    """Forward layers in a middle band on one device, those before and after it (and all
    their backward nodes) on the other."""
    layer = forward_layer(problem)
    forward = place[: layer.max() + 1]
    changes = np.flatnonzero(np.diff(forward))
    return changes.size == 2 and np.array_equal(place, forward[layer])


def test_placed_greedy_splits_a_u_net_that_fits_no_single_device():
    """U-Net at 25% on cpu+cuda: no single device fits, so the heuristic's plan uses both
    devices, and the simulator accepts it under both budgets. (Its cost is measured by
    ``bench/solvers.py``, not asserted here: 2 s for the candidates, and as long for the
    local search, are enough.)"""
    problem = _split_problem("unet", 25)
    _no_single_device_fits(problem)
    result = placed_greedy(problem, time_budget_s=2.0, fit_budget_s=60.0)
    assert result.feasible, result.message
    assert simulate(result.plan, problem.graph, problem.costs, problem.budgets).valid
    n = len(problem.graph)
    place = np.argmax(result.schedule.R[:, np.arange(n), np.arange(n)], axis=0)
    assert set(place.tolist()) == {0, 1}


def test_xengine_returns_a_plan_where_no_single_device_fits_even_when_stopped_early():
    settings = SolverSettings(options=SolveOptions(time_limit_s=1.0))
    problem = _split_problem("vgg16", 25, settings)
    result = xengine(problem)
    assert result.feasible, result.message
    assert simulate(result.plan, problem.graph, problem.costs, problem.budgets).valid
    solver = result.plan.solver
    assert solver.bound <= solver.objective and solver.gap > 0


def test_xengine_with_ample_memory_is_optimal_without_a_solve():
    """One device is faster on every node: its checkpoint-all plan costs the ideal, which
    is a proven bound, so no solver runs."""
    graph = training_graph(chain(4))
    slow = Device("cpu1", DeviceKind.CPU, {"threads": "1"})
    costs = analytical_costs(graph, [CPU, slow])
    result = xengine(Problem(graph, costs, {"cpu0": None, "cpu1": None}))
    assert result.plan.solver.status == "optimal"
    assert result.plan.solver.gap == pytest.approx(0)
    assert result.plan.solver.seconds == 0
    assert result.simulation.total_ms == pytest.approx(costs.ideal_ms())


def test_placed_greedy_also_searches_from_the_best_plan_on_one_device():
    """U-Net at 50% on cpu+cuda: layer moves from the cheapest mixed plan rarely reach a
    plan on one device, so the local search also starts from the best one-device
    candidate: the result is no worse than any baseline on either device alone."""
    problem = _split_problem("unet", 50)
    result = placed_greedy(problem, fit_budget_s=60.0)
    assert result.feasible, result.message
    alone = best_baseline(problem, ("cpu0", "cuda0"))
    assert alone is not None
    assert result.simulation.total_ms <= alone.simulation.total_ms + 1e-9


def test_placed_on_keeps_every_node_on_its_home_and_tunes_checkpoints():
    """U-Net at 25% on cpu+cuda with the bottleneck and its gradients on cpu0 (the LP
    relaxation's placement): a plan that fits and computes each node only on its home;
    all on cuda0 (where nothing fits) gives none, with the reason."""
    problem = _split_problem("unet", 25)
    layer = forward_layer(problem)
    names = ("cpu0", "cuda0")
    bottleneck = [i for i, node in enumerate(problem.graph.nodes) if "bottleneck" in node.name]
    home = np.where(np.isin(layer, layer[bottleneck]), 0, 1)
    result = placed_on(problem, names, home, time_budget_s=60)
    assert result.feasible, result.message
    n = len(problem.graph)
    elsewhere = np.arange(2)[:, None, None] != home[None, None, :]
    assert not (result.schedule.R & elsewhere).any()
    assert result.schedule.R[0].any() and result.schedule.R[1].any()
    assert simulate(result.plan, problem.graph, problem.costs, problem.budgets).valid
    nowhere = placed_on(problem, names, np.ones(n, dtype=np.int64))
    assert not nowhere.feasible and "fits" in nowhere.message


def test_one_cut_placements_start_from_the_most_even_split():
    """After the fastest and the single-device placements come the one-cut placements of
    each pair of devices, the most even split of the forward layers first: at tight
    budgets the candidates that fit split the activations (U-Net at 25%)."""
    problem = _split_problem("unet", 25)
    names = ("cpu0", "cuda0")
    layer = forward_layer(problem)
    forward = layer[: int(layer.max()) + 1]
    cuts = placements(problem, names)[
        1 + len(names) : 1 + len(names) + problem.solver.search.placed_cuts
    ]
    unevenness = [abs(float((place[: len(forward)] == 1).mean()) - 0.5) for place in cuts]
    assert all(len(set(place.tolist())) == 2 for place in cuts)  # each a split in two
    assert unevenness[0] == min(unevenness) < 0.1
    result = placed_greedy(problem, time_budget_s=0.0, fit_budget_s=60.0)
    assert result.feasible, result.message
