"""Inputs whose size changes (Mimose): shape ranges, the size estimator and the
``input_aware`` planner (Algorithm 1)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from remat import samples
from remat.costs import cost_table_of, profiled_costs
from remat.devices import parse_device
from remat.errors import InvalidInputError
from remat.family import plan_family, time_shares
from remat.problem import build_problem
from remat.shape_range import parse_input_range, parse_observed, shape_range
from remat.simulator import simulate
from remat.size_estimator import fit_size_model, size_model_error, table_at_size
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SolverSettings, run_strategy
from remat.strategies.heuristics.input_aware import activation_layers, recomputed_layers

GPU = [parse_device("cuda0:cuda")]
SEQ = shape_range([parse_input_range("input=2x16..256x32")], parse_observed("16:10,128:3"))


def transformer_at(size: int, budget: str | None = None) -> Problem:
    """Four encoder layers (attention scores grow with the square of the size)."""
    budgets = {"cuda0": budget} if budget else None
    model = samples.transformer_block(layers=4, seq="S")
    return build_problem(
        model, inputs=SEQ.shapes(size), devices=GPU, budgets=budgets, fuse_attention=False
    )


# --- shape ranges ----------------------------------------------------------------------


def test_a_range_gives_every_input_its_shape_at_a_size():
    ranged = shape_range(
        [parse_input_range("input_ids=8x16..512"), parse_input_range("mask=8x16..512")]
    )
    assert (ranged.low, ranged.high) == (16, 512)
    assert ranged.shapes(300) == {"input_ids": (8, 300), "mask": (8, 300)}
    assert ranged.size_of({"input_ids": (8, 300)}) == 300
    assert SEQ.observed == ((16, 10), (128, 3))


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        (["input_ids=8x16..a"], "expected NAME=DIMS"),
        (["input_ids=8x512..16"], r"range 512\.\.16 is empty"),
        (["input_ids=0x16..32"], "must be positive"),
        (["input_ids=8x16"], "no input has a ranged dimension"),
        (["a=8x16..512", "b=8x16..256"], "their ranges must agree"),
    ],
)
def test_bad_ranges_are_named(texts, message):
    with pytest.raises(InvalidInputError, match=message):
        shape_range([parse_input_range(t) for t in texts])


def test_sizes_outside_the_range_and_mismatched_shapes_are_refused():
    with pytest.raises(InvalidInputError, match=r"outside the job.s range 16\.\.256"):
        SEQ.shapes(300)
    with pytest.raises(InvalidInputError, match="dimension 3 where the job has 2"):
        SEQ.size_of({"input": (3, 100, 32)})
    with pytest.raises(InvalidInputError, match="outside the range"):
        shape_range([parse_input_range("x=1x4..8")], [(9, 1)])
    with pytest.raises(InvalidInputError, match="SIZE:COUNT"):
        parse_observed("16-3")


def test_observed_sizes_are_counts_or_a_distribution():
    assert parse_observed("16:0.75,128:0.25") == ((16, 750_000), (128, 250_000))
    assert parse_observed("16:120,128:40") == ((16, 120), (128, 40))
    refused = {
        "16:0.5,128:0.3": "the observed shares sum to 0.8, not 1",
        "16:0.5,128:1": "counts or shares, not both",
        "16:1,16:2": "observed size 16 is given more than once",
        "16:0,32:1": "counts must be at least 1",
        "16:1.5,32:0.5": r"share must be in \(0, 1\]",
    }
    for text, message in refused.items():
        with pytest.raises(InvalidInputError, match=message):
            parse_observed(text)


# --- the size estimator -----------------------------------------------------------------


def test_three_sizes_predict_the_bytes_of_a_fourth_exactly_and_its_time_closely():
    """Attention's scores grow with size^2, the rest linearly: degree 2 is exact."""
    model = fit_size_model({s: transformer_at(s) for s in (16, 128, 256)})
    held_out = transformer_at(192)
    error = size_model_error(model, 192, held_out)
    assert error.bytes_max == 0.0
    assert np.array_equal(model.output_bytes(192), held_out.costs.output_bytes)
    assert error.ms_weighted < 0.01
    at_128, at_256 = model.output_bytes(128), model.output_bytes(256)
    assert ((at_256 == 4 * at_128) & (at_128 > 0)).any()  # attention scores: size^2


def test_a_fit_needs_two_sizes_with_the_same_nodes():
    with pytest.raises(InvalidInputError, match="two sizes"):
        fit_size_model({16: transformer_at(16)})
    two_layers = build_problem(
        samples.transformer_block(layers=2), batch=2, devices=GPU, fuse_attention=False
    )
    with pytest.raises(InvalidInputError, match="structure depends on the size"):
        fit_size_model({16: transformer_at(16), 32: two_layers})


# --- input_aware (Algorithm 1) ----------------------------------------------------------


def test_algorithm_1_takes_the_earliest_layer_of_the_bucket_nearest_the_excess():
    sizes = np.array([100, 95, 50, 48, 10, 100], dtype=np.int64)
    layers = [0, 1, 2, 3, 4, 5]
    # buckets: [0, 1, 5] (within 10% of 100), [2, 3], [4]
    assert recomputed_layers(sizes, layers, 40) == [2]  # nearest above 40: the 50s, earliest
    assert recomputed_layers(sizes, layers, 60) == [0]  # nearest above 60: the 100s
    assert recomputed_layers(sizes, layers, 250) == [0, 1, 5]  # none above: the largest
    assert recomputed_layers(sizes, layers, 0) == []


def test_input_aware_plans_fit_and_recompute_the_attention_scores():
    problem = transformer_at(128, "75%")
    result = run_strategy("input_aware", problem, "cuda0")
    assert result.feasible, result.message
    verdict = simulate(result.plan, problem.graph, problem.costs)
    assert verdict.valid and verdict.peak_bytes["cuda0"] <= problem.budgets["cuda0"]
    computes = [s.node for s in result.plan.steps if s.op == "compute"]
    recomputed = {v for v in computes if computes.count(v) > 1}
    largest = max(int(problem.costs.output_bytes[v]) for v in activation_layers(problem))
    assert any(int(problem.costs.output_bytes[v]) == largest for v in recomputed)


def test_input_aware_never_returns_an_over_budget_plan():
    problem = transformer_at(128, "35%")
    result = run_strategy("input_aware", problem, "cuda0")
    assert not result.feasible
    assert "input_aware needs at least" in result.message
    assert result.min_budget_bytes["cuda0"] > problem.budgets["cuda0"]


# --- the plan family --------------------------------------------------------------------


def _family(budget: int, observed: tuple[tuple[int, int], ...] = ()):
    ranged = shape_range([parse_input_range("input=2x16..256x32")], observed)
    model = samples.transformer_block(layers=4, seq="S")
    settings = SolverSettings(options=SolveOptions(time_limit_s=4.0))

    def problem_at(size: int) -> Problem:
        return build_problem(
            model,
            inputs=ranged.shapes(size),
            devices=GPU,
            budgets={"cuda0": budget},
            solver=settings,
            fuse_attention=False,
        )

    return plan_family(problem_at, ranged, "cuda0", "greedy_evict"), problem_at


def test_a_family_buckets_sizes_and_plans_each_representative():
    budget = transformer_at(256, "75%").budgets["cuda0"]
    family, problem_at = _family(budget)
    assert family.buckets[0].low == 16 and family.buckets[-1].high == 256
    assert all(a.high + 1 == b.low for a, b in itertools.pairwise(family.buckets))
    peaks = [b.predicted_peak_bytes for b in family.buckets]
    assert peaks == sorted(peaks) and len(family.buckets) > 1
    for bucket in family.buckets:
        sized = family.cache[bucket.high]
        problem = problem_at(bucket.high)
        verdict = simulate(sized.plan, problem.graph, problem.costs, problem.budgets)
        assert verdict.valid, f"the plan for {bucket.high} is over the budget"


def test_a_size_between_representatives_is_planned_once_then_cached():
    budget = transformer_at(256, "75%").budgets["cuda0"]
    family, problem_at = _family(budget)
    size = next(b.high - 1 for b in family.buckets if b.high - 1 >= b.low)
    sized = family.plan_for(size)
    problem = problem_at(size)
    verdict = simulate(sized.plan, problem.graph, problem.costs, problem.budgets)
    assert verdict.valid and verdict.total_ms == pytest.approx(sized.simulation.total_ms)
    assert sized.plan.predicted.total_ms == pytest.approx(verdict.total_ms)  # at this size
    assert family.plan_for(size) is sized and family.hits == 1
    with pytest.raises(InvalidInputError, match="outside the job's range"):
        family.plan_for(257)


def test_observed_sizes_get_more_of_the_time():
    budget = transformer_at(256, "75%").budgets["cuda0"]
    family, _ = _family(budget, observed=((20, 100),))
    shares = time_shares(family.buckets, family.ranged)
    assert shares[0] == max(shares) and sum(shares) == pytest.approx(1.0)


def test_a_cost_table_for_a_size_from_tables_profiled_at_three():
    """Tables at 16, 128 and 256 (analytical here, as a profiler writes them) give the
    table at 192: its times on their polynomials, its bytes from shape inference."""
    problems = {s: transformer_at(s) for s in (16, 128, 256)}
    tables = {s: cost_table_of(p.graph, p.costs) for s, p in problems.items()}
    held_out = transformer_at(192)
    table = table_at_size(tables, 192, held_out.graph)
    costs = profiled_costs(held_out.graph, table)
    assert np.array_equal(costs.output_bytes, held_out.costs.output_bytes)
    error = np.abs(costs.compute_ms - held_out.costs.compute_ms).sum()
    assert error / held_out.costs.compute_ms.sum() < 0.01
