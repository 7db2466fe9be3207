"""``auto``, the default strategy (``remat.strategies.auto``): baselines, greedy eviction and
a short exact solve; "infeasible" only with a proof."""

from __future__ import annotations

from dataclasses import replace

import pytest

from remat import samples
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.problem import build_problem
from remat.solvers.model import SolveOptions
from remat.strategies import (
    AUTO,
    BASELINES,
    Problem,
    SearchConfig,
    SolverSettings,
    StrategyResult,
    run_strategy,
)
from remat.strategies import auto as auto_module
from remat.strategies.common.floor import shortfall
from remat.training import training_graph

from graphs import diamond

CPU = Device("cpu0", DeviceKind.CPU)
NO_EXACT = SearchConfig(auto_exact_max_nodes=0)


def settings(limit: float = 20.0, search: SearchConfig | None = None) -> SolverSettings:
    return SolverSettings(options=SolveOptions(time_limit_s=limit), search=search or SearchConfig())


def transformer(percent: int, solver: SolverSettings) -> Problem:
    """A transformer block whose baselines all fail at 40-50% (as a TransformerEncoder's do)."""
    return build_problem(
        samples.transformer_block(),
        batch=2,
        budgets={"cpu0": f"{percent}%"},
        solver=solver,
        fuse_attention=False,
    )


def best_baseline_ms(problem: Problem) -> float | None:
    results = []
    for name in BASELINES:
        try:
            results.append(run_strategy(name, problem))
        except Exception:
            continue
    times = [r.simulation.total_ms for r in results if r.feasible and r.simulation is not None]
    return min(times, default=None)


def test_auto_finds_a_plan_where_every_baseline_fails():
    problem = transformer(50, settings(search=NO_EXACT))
    assert best_baseline_ms(problem) is None  # the bug: auto said "infeasible" here
    result = run_strategy(AUTO, problem)
    assert result.feasible and result.simulation is not None and result.simulation.valid
    assert result.simulation.peak_bytes["cpu0"] <= problem.budgets["cpu0"]
    assert result.plan is not None and result.plan.strategy == "greedy_evict"


def test_auto_is_at_least_as_cheap_as_the_best_baseline():
    problem = build_problem(samples.unet(), batch=2, budgets={"cpu0": "50%"}, solver=settings(3))
    result = run_strategy(AUTO, problem)
    baseline = best_baseline_ms(problem)
    assert baseline is not None and result.feasible
    assert result.simulation.total_ms <= baseline


def test_a_budget_below_the_floor_pages_fixed_tensors():
    problem = transformer(30, settings(search=NO_EXACT))
    assert shortfall(problem, ("cpu0",)) is not None  # no plan keeps them all resident
    result = run_strategy(AUTO, problem)
    assert result.plan is not None and result.simulation is not None, result.message
    assert result.plan.version == 5 and result.plan.paged_fixed
    assert result.simulation.valid
    assert result.simulation.peak_bytes["cpu0"] <= problem.budgets["cpu0"]


def test_a_budget_below_the_paging_floor_is_proven_infeasible_with_what_plans_need():
    problem = replace(transformer(30, settings(search=NO_EXACT)), budgets={"cpu0": 4096})
    result = run_strategy(AUTO, problem)
    assert not result.feasible and result.proven_infeasible
    assert result.message.startswith("infeasible at this budget: auto proved that no schedule")
    assert "computing node" in result.message and "the least any plan found needs" in result.message
    assert "paging fixed tensors too, some node needs at least" in result.message
    assert result.min_budget_bytes and result.min_budget_bytes["cpu0"] > problem.budgets["cpu0"]


def test_without_a_proof_auto_says_what_it_tried_and_the_least_memory_needed():
    problem = transformer(40, settings(search=NO_EXACT))
    assert shortfall(problem, ("cpu0",)) is None  # above the floor: no proof
    result = run_strategy(AUTO, problem)
    assert not result.feasible and not result.proven_infeasible
    assert "infeasible" not in result.message
    assert result.message.startswith(
        "no plan found by auto at this budget (tried: baselines on cpu0, greedy_evict on cpu0, "
        "page_dynprog on cpu0, greedy_evict, then paging, on cpu0)"
    )
    need = result.min_budget_bytes
    assert need is not None and need["cpu0"] > problem.budgets["cpu0"]
    assert f"({need['cpu0']} B) on cpu0" in result.message


def test_the_exact_solve_is_named_among_what_was_tried():
    problem = transformer(40, settings(limit=3.0))
    result = run_strategy(AUTO, problem)
    assert not result.feasible and not result.proven_infeasible
    assert "checkmate_milp" in result.message and "infeasible" not in result.message


def test_a_solver_proof_says_infeasible_where_plans_send_nothing_away():
    """A training diamond at its floor: only the MILP proves that no plan fits, and only
    where plans may not offload or page (its model does neither)."""
    graph = training_graph(diamond())
    costs = analytical_costs(graph, [CPU])
    low, high = 0, 10**9
    while low < high:  # the smallest budget the floor lets through
        middle = (low + high) // 2
        if shortfall(Problem(graph, costs, {"cpu0": middle}), ("cpu0",)) is None:
            high = middle
        else:
            low = middle + 1
    problem = Problem(graph, costs, {"cpu0": low}, settings(), offloading=False)
    result = run_strategy(AUTO, problem)
    assert not result.feasible and result.proven_infeasible
    assert result.message.startswith(
        "infeasible at this budget: auto (checkmate_milp) proved that no schedule fits"
    )
    unproven = run_strategy(AUTO, replace(problem, solver=settings(search=NO_EXACT)))
    assert not unproven.proven_infeasible and unproven.message.startswith("no plan found by auto")
    paging = run_strategy(AUTO, replace(problem, offloading=True))  # nor paging
    assert not paging.feasible and not paging.proven_infeasible
    assert "proved that no plan without paging fits" in paging.message
    gpu = Device("cuda0", DeviceKind.CUDA)
    on_gpu = Problem(graph, analytical_costs(graph, [gpu]), {"cuda0": low}, settings())
    offloading = run_strategy(AUTO, on_gpu)  # the MILP's proof does not cover offloading
    assert not offloading.feasible and not offloading.proven_infeasible
    assert "proved that no plan without offloading fits" in offloading.message


def _recording(monkeypatch: pytest.MonkeyPatch, name: str) -> list[float]:
    """Replace auto's ``name`` exact strategy by one recording its time limit."""
    limits: list[float] = []

    def fake(problem: Problem, *args: object) -> StrategyResult:
        limits.append(problem.solver.options.time_limit_s)
        return StrategyResult(name, None, None, f"{name}: no schedule found (unknown)")

    monkeypatch.setattr(auto_module, name, fake)
    return limits


@pytest.mark.alone  # at a 3 s limit the exact phase runs only if the earlier ones leave time
def test_the_exact_solve_is_short_and_within_the_problems_limit(monkeypatch):
    limits = _recording(monkeypatch, "checkmate_milp")
    run_strategy(AUTO, transformer(40, settings(limit=60.0, search=SearchConfig(auto_exact_s=2))))
    assert limits == [2.0]
    run_strategy(AUTO, transformer(40, settings(limit=3.0, search=SearchConfig(auto_exact_s=30))))
    assert len(limits) == 2 and limits[1] <= 3.0
    run_strategy(AUTO, transformer(40, settings(search=NO_EXACT)))  # graph above the threshold
    assert len(limits) == 2


def test_no_exact_solve_once_a_plan_is_near_the_ideal(monkeypatch):
    limits = _recording(monkeypatch, "checkmate_milp")
    unlimited = build_problem(samples.transformer_block(), batch=2, solver=settings())
    result = run_strategy(AUTO, unlimited)  # checkpoint-all costs the ideal
    assert result.feasible and limits == []


def test_several_devices_solve_xengine(monkeypatch):
    limits = _recording(monkeypatch, "xengine")
    devices = [CPU, Device("cuda0", DeviceKind.CUDA)]
    problem = build_problem(
        samples.transformer_block(),
        batch=2,
        devices=devices,
        budgets={"cpu0": "40%", "cuda0": "40%"},
        solver=settings(limit=5.0),
    )
    result = run_strategy(AUTO, problem)
    assert len(limits) == 1
    if not result.feasible:
        assert "xengine" in result.message and "greedy_evict on cpu0, cuda0" in result.message


def test_a_named_device_restricts_auto_to_it():
    devices = [CPU, Device("cuda0", DeviceKind.CUDA)]
    problem = build_problem(
        samples.transformer_block(), batch=2, devices=devices, solver=settings(search=NO_EXACT)
    )
    result = run_strategy(AUTO, problem, "cpu0")
    assert result.feasible and [d.name for d in result.plan.devices] == ["cpu0"]


def test_good_enough_plans_skip_the_exact_solve(monkeypatch):
    """The max-batch search asks only whether a plan is within its bound."""
    limits = _recording(monkeypatch, "checkmate_milp")
    problem = transformer(50, settings())
    found = auto_module.auto(problem, good_enough_ms=float("inf"))
    assert found.feasible and limits == []
    auto_module.auto(problem, good_enough_ms=0.0)
    assert len(limits) == 1
