"""Properties of the baselines (and greedy eviction) on random forward DAGs turned into
training graphs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.errors import StrategyError
from remat.graph import Graph
from remat.simulator import simulate
from remat.strategies import BASELINES, run_strategy
from remat.strategies.common.floor import shortfall
from remat.strategies.common.policy import device_fixed_bytes, predict
from remat.strategies.common.problem import Problem, evaluate
from remat.strategies.common.rsolve import (
    holds_from_dense,
    solve_and_prune,
    solve_and_prune_sparse,
)
from remat.training import training_graph

from graphs import forward

CPU = Device("cpu0", DeviceKind.CPU)
OPS = ["Relu", "Conv", "Add", "MaxPool", "Mul", "Sigmoid"]
HEURISTICS = (*BASELINES, "greedy_evict", "offload_greedy", "offload_dynprog")
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def forward_graphs(draw) -> Graph:
    """5-25 nodes; node i reads a random set of earlier nodes (a chain a third of the
    time, so that chen_* and griewank apply), with random output sizes."""
    n = draw(st.integers(5, 25))
    linear = draw(st.integers(0, 2)) == 0
    deps: list[tuple[int, ...]] = [()]
    for i in range(1, n):
        if linear:
            deps.append((i - 1,))
        else:
            chosen = draw(st.sets(st.integers(0, i - 1), max_size=3))
            deps.append(tuple(sorted(chosen)))
    sizes = draw(st.lists(st.integers(1, 64), min_size=n, max_size=n))
    return forward(deps, [s * 256 for s in sizes], op=draw(st.sampled_from(OPS)))


def problem(graph: Graph, budget: int | None) -> Problem:
    return Problem(graph, analytical_costs(graph, [CPU]), {"cpu0": budget})


def run(name: str, p: Problem):
    try:
        return run_strategy(name, p, "cpu0")
    except StrategyError:
        return None  # not applicable (chen_* and griewank need a chain)


@SETTINGS
@given(forward_graphs(), st.floats(0.0, 1.1))
def test_every_heuristic_fits_or_names_a_larger_budget(forward_graph, fraction):
    graph = training_graph(forward_graph)
    full = run_strategy("checkpoint_all", problem(graph, None))
    fixed = full.simulation.fixed_bytes["cpu0"]
    peak = full.simulation.peak_bytes["cpu0"]
    budget = fixed + int((peak - fixed) * fraction)
    p = problem(graph, budget)
    for name in HEURISTICS:
        result = run(name, p)
        if result is None:
            continue
        if result.feasible:
            verdict = simulate(result.plan, graph, p.costs)
            assert verdict.valid, (name, verdict.violation)
            assert verdict.peak_bytes["cpu0"] <= budget
        else:
            assert result.min_budget_bytes["cpu0"] > budget, name
            assert str(result.min_budget_bytes["cpu0"]) in result.message


@SETTINGS
@given(forward_graphs())
def test_checkpoint_all_with_ample_memory_costs_the_ideal(forward_graph):
    graph = training_graph(forward_graph)
    p = problem(graph, None)
    result = run_strategy("checkpoint_all", p)
    assert result.feasible
    assert result.simulation.computes == len(graph)
    assert result.simulation.total_ms == p.costs.ideal_ms("cpu0")


@SETTINGS
@given(forward_graphs(), st.integers(0, 2**32 - 1))
def test_sparse_solve_and_prediction_agree_with_dense_and_simulator(forward_graph, seed):
    graph = training_graph(forward_graph)
    n = len(graph)
    S = np.tril(np.random.default_rng(seed).random((n, n)) < 0.3, -1)
    R_dense, S_dense = solve_and_prune(graph, S)
    sparse = solve_and_prune_sparse(graph, holds_from_dense(S))
    assert np.array_equal(sparse.R(), R_dense)
    assert np.array_equal(sparse.S(), S_dense)
    p = problem(graph, None)
    predicted = predict(p, "cpu0", sparse, device_fixed_bytes(p, "cpu0"))
    judged = evaluate(p, sparse.schedule("cpu0"), "test")
    assert judged.fits
    assert judged.simulation.peak_bytes["cpu0"] == predicted.peak_bytes
    assert judged.cost_ms == pytest.approx(predicted.cost_ms)


@SETTINGS
@given(forward_graphs())
def test_the_stated_need_is_enough(forward_graph):
    graph = training_graph(forward_graph)
    for name in (*BASELINES, "offload_greedy", "offload_dynprog"):
        result = run(name, problem(graph, 0))
        if result is None:
            continue
        assert not result.feasible
        need = result.min_budget_bytes["cpu0"]
        again = run(name, problem(graph, need))
        assert again.feasible, (name, again.message)


@SETTINGS
@given(forward_graphs())
def test_no_plan_needs_less_than_the_memory_floor(forward_graph):
    """The floor is a proof: every plan the simulator accepts (the baselines' plans at the
    budget they need) peaks at or above the smallest budget the floor lets through."""
    graph = training_graph(forward_graph)
    for name in HEURISTICS:
        result = run(name, problem(graph, 0))
        if result is None:
            continue
        need = result.min_budget_bytes["cpu0"]
        assert shortfall(problem(graph, need), ("cpu0",)) is None, name


@SETTINGS
@given(forward_graphs(), st.floats(0.3, 1.0))
def test_dynprog_is_never_worse_than_greedy(forward_graph, fraction):
    graph = training_graph(forward_graph)
    full = run_strategy("checkpoint_all", problem(graph, None))
    fixed = full.simulation.fixed_bytes["cpu0"]
    budget = fixed + int((full.simulation.peak_bytes["cpu0"] - fixed) * fraction)
    greedy = run("offload_greedy", problem(graph, budget))
    dynprog = run("offload_dynprog", problem(graph, budget))
    assert dynprog.feasible == greedy.feasible
    if greedy.feasible:
        assert dynprog.simulation.total_ms <= greedy.simulation.total_ms
        assert dynprog.plan.solver.bound == greedy.plan.solver.bound
