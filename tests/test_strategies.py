"""The baseline strategies (Checkmate Table 1) and the R solve they share."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from remat.costs import CostModel, CostSource, analytical_costs
from remat.devices import Device, DeviceKind
from remat.errors import StrategyError
from remat.graph import Graph
from remat.schedule import Schedule
from remat.simulator import simulate
from remat.strategies import BASELINES, STRATEGIES, run_strategy
from remat.strategies.baselines.chen import (
    articulation_candidates,
    greedy_checkpoints,
    sqrt_checkpoints,
)
from remat.strategies.baselines.griewank import (
    griewank_policy,
    revolve_cost,
    revolve_events,
    revolve_recomputations,
)
from remat.strategies.common.policy import device_fixed_bytes, predict
from remat.strategies.common.problem import Problem, evaluate
from remat.strategies.common.rsolve import (
    holds_from_dense,
    holds_to_dense,
    prune_checkpoints,
    s_from_checkpoints,
    segments_from_checkpoints,
    solve_and_prune,
    solve_and_prune_sparse,
    solve_r,
)
from remat.training import training_graph

from graphs import chain, diamond, forward

CPU = Device("cpu0", DeviceKind.CPU)
CHEN = ("chen_sqrt", "chen_greedy", "ap_sqrt", "ap_greedy", "linearized_sqrt", "linearized_greedy")


def residual() -> Graph:
    """Two residual blocks: 0 -> 1 -> 2 -> add(0, 2) = 3 -> 4 -> 5 -> add(3, 5) = 6 -> 7."""
    return forward([(), (0,), (1,), (0, 2), (3,), (4,), (3, 5), (6,)], op="Conv")


GRAPHS = {
    "chain": lambda: training_graph(chain(10)),
    "diamond": lambda: training_graph(diamond()),
    "residual": lambda: training_graph(residual()),
    "chain-inference": lambda: chain(6),
}


def problem(graph: Graph, budget: int | None = None) -> Problem:
    return Problem(graph, analytical_costs(graph, [CPU]), {"cpu0": budget})


def unit_problem(graph: Graph, budget: int | None = None) -> Problem:
    """Unit compute cost per node (Griewank's setting)."""
    n = len(graph)
    sizes = np.array([node.output_bytes for node in graph.nodes], dtype=np.int64)
    costs = CostModel(CostSource.ANALYTICAL, (CPU,), np.ones((n, 1)), np.zeros((n, 1, 1)), sizes)
    return Problem(graph, costs, {"cpu0": budget})


def applicable(graph: Graph) -> list[str]:
    names = []
    for name in BASELINES:
        try:
            STRATEGIES[name](problem(graph), "cpu0")
        except StrategyError:
            continue
        names.append(name)
    return names


@cache
def full_peak(key: str) -> int:
    result = run_strategy("checkpoint_all", problem(GRAPHS[key]()))
    return result.simulation.peak_bytes["cpu0"]


def fixed_of(graph: Graph) -> int:
    return device_fixed_bytes(problem(graph), "cpu0")


# --- registry ---------------------------------------------------------------------------


def test_registry_lists_the_baselines_in_order():
    assert BASELINES == (
        "checkpoint_all",
        "chen_sqrt",
        "chen_greedy",
        "ap_sqrt",
        "ap_greedy",
        "linearized_sqrt",
        "linearized_greedy",
        "griewank",
    )
    assert all(name in STRATEGIES for name in BASELINES)


def test_unknown_strategy_lists_known_ones():
    with pytest.raises(StrategyError, match=r"unknown strategy 'nope'.*auto, checkpoint_all"):
        run_strategy("nope", problem(GRAPHS["chain"]()))


def test_without_device_the_cheapest_device_wins():
    graph = GRAPHS["chain"]()
    devices = [CPU, Device("cuda0", DeviceKind.CUDA)]
    costs = analytical_costs(graph, devices)
    result = run_strategy("checkpoint_all", Problem(graph, costs, {"cpu0": None, "cuda0": None}))
    assert result.feasible
    assert result.plan.devices[0].name == "cuda0"
    assert result.simulation.total_ms == pytest.approx(costs.ideal_ms("cuda0"))


# --- R solve and pruning ----------------------------------------------------------------


@pytest.mark.parametrize("key", GRAPHS)
def test_solve_r_makes_any_strictly_lower_s_correct(key):
    graph = GRAPHS[key]()
    n = len(graph)
    rng = np.random.default_rng(7)
    for _ in range(20):
        S = np.tril(rng.random((n, n)) < 0.3, -1)
        R = solve_r(graph, S)
        Schedule.single("cpu0", R, S).check(graph)
        assert R[np.arange(n), np.arange(n)].all()  # eq. 8a


@pytest.mark.parametrize("key", GRAPHS)
def test_solve_r_is_minimal(key):
    """Dropping any entry set by solve_r (off the diagonal) breaks a constraint."""
    graph = GRAPHS[key]()
    n = len(graph)
    S = np.tril(np.random.default_rng(3).random((n, n)) < 0.2, -1)
    R = solve_r(graph, S)
    for t, i in np.argwhere(R & ~np.eye(n, dtype=bool)):
        smaller = R.copy()
        smaller[t, i] = False
        with pytest.raises(Exception, match=r"stage|keeps"):
            Schedule.single("cpu0", smaller, S).check(graph)


@pytest.mark.parametrize("key", GRAPHS)
def test_pruning_only_removes_and_stays_correct(key):
    graph = GRAPHS[key]()
    n = len(graph)
    rng = np.random.default_rng(11)
    for _ in range(20):
        S = np.tril(rng.random((n, n)) < 0.4, -1)
        R = solve_r(graph, S)
        pruned = prune_checkpoints(graph, R, S)
        assert not (pruned & ~S).any()
        Schedule.single("cpu0", R, pruned).check(graph)


def test_pruning_keep_everything_gives_liveness():
    """Checkpoint all keeps a value exactly until its last user's stage."""
    graph = GRAPHS["chain"]()
    n = len(graph)
    R, S = solve_and_prune(graph, np.tril(np.ones((n, n), dtype=bool), -1))
    assert np.array_equal(R, np.eye(n, dtype=bool))
    users = graph.users()
    for i in range(n):
        last = max(users[i], default=i)
        assert np.array_equal(np.flatnonzero(S[:, i]), np.arange(i + 1, last + 1))


@pytest.mark.parametrize("key", GRAPHS)
def test_sparse_pipeline_equals_dense(key):
    graph = GRAPHS[key]()
    n = len(graph)
    rng = np.random.default_rng(5)
    for _ in range(20):
        S = np.tril(rng.random((n, n)) < 0.3, -1)
        holds = holds_from_dense(S)
        assert np.array_equal(holds_to_dense(holds, n), S)
        R_dense, S_dense = solve_and_prune(graph, S)
        sparse = solve_and_prune_sparse(graph, holds)
        assert np.array_equal(sparse.R(), R_dense)
        assert np.array_equal(sparse.S(), S_dense)


@pytest.mark.parametrize("key", GRAPHS)
def test_prediction_equals_the_simulator(key):
    graph = GRAPHS[key]()
    p = problem(graph)
    fixed = device_fixed_bytes(p, "cpu0")
    n = len(graph)
    rng = np.random.default_rng(13)
    for _ in range(10):
        sparse = solve_and_prune_sparse(
            graph, holds_from_dense(np.tril(rng.random((n, n)) < 0.3, -1))
        )
        predicted = predict(p, "cpu0", sparse, fixed)
        judged = evaluate(p, sparse.schedule("cpu0"), "test")
        assert judged.fits
        assert judged.simulation.peak_bytes["cpu0"] == predicted.peak_bytes
        assert judged.cost_ms == pytest.approx(predicted.cost_ms)


# --- the Chen policy --------------------------------------------------------------------


def test_segments_split_after_each_checkpoint():
    assert segments_from_checkpoints(7, [2, 4]) == [[0, 1, 2], [3, 4], [5, 6]]
    assert segments_from_checkpoints(3, []) == [[0, 1, 2]]
    assert segments_from_checkpoints(3, [2]) == [[0, 1, 2]]  # the last node ends anyway


def test_sqrt_checkpoints_every_ceil_sqrt_nodes():
    assert sqrt_checkpoints(list(range(10))) == [3, 7]
    assert sqrt_checkpoints(list(range(16))) == [3, 7, 11, 15]
    assert sqrt_checkpoints([]) == []


def test_greedy_checkpoints_when_the_running_total_exceeds_b():
    sizes = np.array([10, 10, 10, 10, 10, 10], dtype=float)
    assert greedy_checkpoints(sizes, range(6), 15) == [1, 3, 5]
    assert greedy_checkpoints(sizes, range(6), 0) == [0, 1, 2, 3, 4, 5]
    assert greedy_checkpoints(sizes, [2, 5], 5) == [2, 5]  # only candidates


def test_articulation_points_of_residual_blocks_are_the_block_boundaries():
    graph = training_graph(residual())
    # 0 (block input), 3 (between blocks), 6 (after) and the last node: not inside blocks
    assert articulation_candidates(graph) == [0, 3, 6, 7]
    assert articulation_candidates(training_graph(chain(5))) == [0, 1, 2, 3, 4]


def test_chen_policy_recomputes_each_segment_once_in_the_backward_pass():
    """Chain of 9, checkpoints 2 and 5: the two first segments' non-checkpoint nodes are
    recomputed exactly once each (0, 1, 3, 4); the last segment is never recomputed."""
    graph = training_graph(chain(9))
    S = s_from_checkpoints(graph, [2, 5], segments_from_checkpoints(9, [2, 5]))
    R, S = solve_and_prune(graph, S)
    Schedule.single("cpu0", R, S).check(graph)
    recomputed = R.sum(axis=0) - 1
    assert recomputed[:9].tolist() == [1, 1, 0, 1, 1, 0, 0, 0, 0]
    assert recomputed[9:].sum() == 0  # loss and gradients are never recomputed


def test_chen_peak_holds_checkpoints_and_one_segment():
    """16-node chain, 1000 B each: sqrt keeps ~4 checkpoints + one 4-node segment instead
    of all 16 activations."""
    graph = training_graph(chain(16))
    full = run_strategy("checkpoint_all", problem(graph))
    sqrt = run_strategy("chen_sqrt", problem(graph))
    fixed = fixed_of(graph)
    assert full.simulation.peak_bytes["cpu0"] - fixed >= 16 * 1000
    assert sqrt.simulation.peak_bytes["cpu0"] - fixed <= 11 * 1000


def test_generalisations_reproduce_chen_on_chains():
    graph = training_graph(chain(12))
    budget = fixed_of(graph) + 9000
    for stem in ("sqrt", "greedy"):
        results = [
            run_strategy(f"{kind}_{stem}", problem(graph, budget))
            for kind in ("chen", "ap", "linearized")
        ]
        plans = {tuple((s.op, s.node) for s in r.plan.steps) for r in results}
        assert len(plans) == 1


# --- strategies on small graphs ---------------------------------------------------------


@pytest.mark.parametrize("key", GRAPHS)
def test_every_strategy_plans_with_ample_memory(key):
    graph = GRAPHS[key]()
    p = problem(graph)
    for name in applicable(graph):
        result = run_strategy(name, p)
        assert result.feasible, (name, result.message)
        assert simulate(result.plan, graph, p.costs).valid


@pytest.mark.parametrize("key", GRAPHS)
def test_checkpoint_all_with_ample_memory_costs_the_ideal(key):
    graph = GRAPHS[key]()
    p = problem(graph)
    result = run_strategy("checkpoint_all", p)
    assert result.simulation.computes == len(graph)  # each node once: no recomputation
    assert result.simulation.total_ms == p.costs.ideal_ms("cpu0")
    unit = unit_problem(graph)
    assert run_strategy("checkpoint_all", unit).simulation.total_ms == unit.costs.ideal_ms("cpu0")


@pytest.mark.parametrize("key", ["chain", "residual", "diamond"])
@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.7, 0.9])
def test_at_tight_budgets_results_fit_or_state_their_need(key, fraction):
    graph = GRAPHS[key]()
    fixed = fixed_of(graph)
    budget = fixed + int((full_peak(key) - fixed) * fraction)
    p = problem(graph, budget)
    for name in applicable(graph):
        result = run_strategy(name, p)
        if result.feasible:
            verdict = simulate(result.plan, graph, p.costs)
            assert verdict.valid and verdict.peak_bytes["cpu0"] <= budget
            assert result.simulation.total_ms >= p.costs.ideal_ms("cpu0")
        else:
            need = result.min_budget_bytes["cpu0"]
            assert need > budget
            assert "needs at least" in result.message and str(need) in result.message
            again = run_strategy(name, problem(graph, need))
            assert again.feasible, (name, again.message)
            assert again.simulation.peak_bytes["cpu0"] <= need


@pytest.mark.parametrize("key", ["chain", "residual"])
def test_heuristics_use_less_memory_than_checkpoint_all(key):
    graph = GRAPHS[key]()
    for name in applicable(graph):
        if name == "checkpoint_all":
            continue
        # with no budget, take the candidate that needs least: the infeasible need at 0
        result = run_strategy(name, problem(graph, 0))
        assert not result.feasible
        assert result.min_budget_bytes["cpu0"] < full_peak(key), name


def test_sqrt_and_greedy_beat_checkpoint_all_at_a_tight_budget():
    graph = GRAPHS["chain"]()
    fixed = fixed_of(graph)
    budget = fixed + int((full_peak("chain") - fixed) * 0.6)
    p = problem(graph, budget)
    assert not run_strategy("checkpoint_all", p).feasible
    for name in ("chen_sqrt", "chen_greedy", "griewank"):
        result = run_strategy(name, p)
        assert result.feasible, name
        assert result.simulation.peak_bytes["cpu0"] < full_peak("chain")


def test_greedy_with_ample_memory_recomputes_nothing():
    for key in ("chain", "residual"):
        graph = GRAPHS[key]()
        p = problem(graph)
        for name in ("ap_greedy", "linearized_greedy", "griewank"):
            if name in applicable(graph):
                assert run_strategy(name, p).simulation.total_ms == pytest.approx(
                    p.costs.ideal_ms("cpu0")
                )


@pytest.mark.parametrize("name", ["chen_sqrt", "chen_greedy"])
def test_chen_needs_a_chain_and_points_to_the_generalisations(name):
    stem = name.removeprefix("chen_")
    with pytest.raises(StrategyError, match=f"linear graph.*ap_{stem}.*linearized_{stem}"):
        run_strategy(name, problem(GRAPHS["residual"]()))


def test_griewank_needs_a_chain():
    with pytest.raises(StrategyError, match=r"griewank needs a linear graph \(a chain\); node 3"):
        run_strategy("griewank", problem(GRAPHS["residual"]()))


# --- Griewank / revolve -----------------------------------------------------------------


@cache
def revolve_dp(steps: int, c: int) -> int:
    if steps == 1:
        return 0
    if c == 0:
        return steps * (steps - 1) // 2
    return min(m + revolve_dp(steps - m, c - 1) + revolve_dp(m, c) for m in range(1, steps))


def test_revolve_closed_form_equals_the_dp():
    for steps in range(1, 40):
        for c in range(0, 8):
            assert int(revolve_cost(steps, c)[0]) == revolve_dp(steps, c), (steps, c)


def test_revolve_events_reverse_every_step_once_in_order():
    for c in range(0, 5):
        events = revolve_events(8, c)
        assert [i for e, i in events if e == "reverse"] == list(range(7, -1, -1))
        taken = [i for e, i in events if e == "take"]
        assert sorted(taken) == sorted(i for e, i in events if e == "release")


@pytest.mark.parametrize("c", [0, 1, 2, 3, 6])
def test_griewank_recomputations_equal_revolves_optimum(c):
    """On a unit-cost chain whose backward nodes read their input (MatMul), the plan
    recomputes exactly cost(8, c) - 7 forward nodes (the DP optimum)."""
    graph = training_graph(forward([(i - 1,) if i else () for i in range(8)], op="MatMul"))
    p = unit_problem(graph)
    R, S = solve_and_prune(graph, griewank_policy(graph, c))
    Schedule.single("cpu0", R, S).check(graph)
    judged = evaluate(p, Schedule.single("cpu0", R, S), "griewank")
    assert judged.fits
    assert judged.simulation.computes - len(graph) == revolve_dp(8, c) - 7
    assert revolve_recomputations(8, c) == revolve_dp(8, c) - 7


def test_griewank_memory_grows_and_cost_falls_with_snapshots():
    graph = training_graph(forward([(i - 1,) if i else () for i in range(12)], op="MatMul"))
    p = unit_problem(graph)
    fixed = device_fixed_bytes(p, "cpu0")
    previous = None
    for c in range(0, 11):
        sparse = solve_and_prune_sparse(graph, holds_from_dense(griewank_policy(graph, c)))
        now = predict(p, "cpu0", sparse, fixed)
        if previous is not None:
            assert now.peak_bytes >= previous.peak_bytes
            assert now.cost_ms <= previous.cost_ms
        previous = now


def test_griewank_picks_the_most_snapshots_that_fit():
    graph = training_graph(forward([(i - 1,) if i else () for i in range(12)], op="MatMul"))
    fixed = device_fixed_bytes(unit_problem(graph), "cpu0")
    budget = fixed + 6000  # a few 1000-byte snapshots
    result = run_strategy("griewank", unit_problem(graph, budget))
    assert result.feasible
    recomputed = result.simulation.computes - len(graph)
    fits = [
        c
        for c in range(11)
        if predict(
            unit_problem(graph, budget),
            "cpu0",
            solve_and_prune_sparse(graph, holds_from_dense(griewank_policy(graph, c))),
            fixed,
        ).peak_bytes
        <= budget
    ]
    assert recomputed == revolve_recomputations(12, max(fits))
