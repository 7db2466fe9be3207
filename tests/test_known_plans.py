"""Known plans (``SolverSettings.known_plans``): plans made before for the same graph, which
the exact strategies' searches start from where the simulator accepts them, so that a
search never ends above a plan it was given (``remat.strategies.common.known``). The
service gives a job its model's earlier plans (tests/test_api_inprocess.py); the CLI takes
them with ``--start-from`` (tests/test_cli.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from regime import budgeted

from remat import samples
from remat.graph import Graph
from remat.onnx_ingest import forward_graph
from remat.plan import Offload, Plan
from remat.simulator import simulate
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SolverSettings, StrategyResult, run_strategy
from remat.strategies.common.known import known_start, noted_if_known
from remat.training import training_graph

BUDGETS = ("cpu0", "cuda0")


@pytest.fixture(scope="module")
def resnet() -> Graph:
    return training_graph(forward_graph(samples.resnet18(batch=4)))


@pytest.fixture(scope="module")
def evicted(resnet: Graph) -> Plan:
    """Greedy eviction's plan at 55% on the cheaper single device (cpu0 here)."""
    result = run_strategy("greedy_evict", _problem(resnet, 55, 10.0))
    assert result.plan is not None and [d.name for d in result.plan.devices] == ["cpu0"]
    return result.plan


def _problem(graph: Graph, percent: float, seconds: float, known: tuple[Plan, ...] = ()) -> Problem:
    options = SolveOptions(time_limit_s=seconds)
    return budgeted(graph, percent, BUDGETS, SolverSettings(options=options, known_plans=known))


def _cost(problem: Problem, plan: Plan) -> float:
    simulation = simulate(plan, problem.graph, problem.costs, problem.budgets)
    assert simulation.valid, simulation.violation
    return simulation.total_ms


def test_two_devices_without_time_to_search_end_at_the_one_device_plan_they_were_given(
    resnet: Graph, evicted: Plan
) -> None:
    """0.05 s is the warm start alone (shorter than building XEngine's model): without the
    known plan its plan is dearer than eviction's on one device; with it, it is that plan,
    costed at this problem's budgets, with the whole problem's bound."""
    fresh = run_strategy("xengine", _problem(resnet, 55, 0.05))
    problem = _problem(resnet, 55, 0.05, (evicted,))
    started = run_strategy("xengine", problem)
    assert started.plan is not None and started.plan.solver is not None
    assert fresh.time_ms > _cost(problem, evicted)  # the premise: the search alone ends above
    assert started.time_ms == pytest.approx(_cost(problem, evicted))
    assert started.plan.steps == evicted.steps
    assert started.plan.strategy == "xengine" and started.plan.graph == resnet.fingerprint
    assert started.plan.solver.bound is not None and started.plan.solver.bound <= started.time_ms
    noted = noted_if_known(started, {"job 1a2b": evicted})
    assert "no plan cheaper than job 1a2b's was found" in noted.message


def test_a_known_plan_starts_the_one_device_models_too(resnet: Graph, evicted: Plan) -> None:
    """Checkmate's stage order on one device: the known plan comes with its schedule, which
    warm-starts the MILP and RINS."""
    found = known_start(_problem(resnet, 55, 1.0, (evicted,)), ["cpu0"])
    assert found is not None and found.schedule is not None
    assert found.schedule.devices == ("cpu0",)


def test_a_known_plan_is_judged_at_this_problems_budgets(resnet: Graph, evicted: Plan) -> None:
    """Made at 55%, it does not fit 30%: not offered there (and no error)."""
    problem = _problem(resnet, 30, 1.0, (evicted,))
    assert not simulate(evicted, problem.graph, problem.costs, problem.budgets).valid
    assert known_start(problem, BUDGETS) is None


def test_plans_the_search_could_not_have_made_are_not_offered(resnet: Graph, evicted: Plan) -> None:
    """Another graph's plan, a plan on a device the search does not place on, one on a
    device of another kind of the same name, one without a graph record, one that
    offloads: none is offered."""
    other = training_graph(forward_graph(samples.unet(batch=2)))
    problem = _problem(resnet, 55, 1.0)
    cuda = replace(
        evicted, devices=(replace(evicted.devices[0], kind=problem.costs.devices[1].kind),)
    )
    offloads = replace(evicted, steps=(*evicted.steps, Offload(0, 0, "cpu0")))
    cases = {
        "other graph": replace(evicted, graph=other.fingerprint),
        "not among the devices": evicted,
        "another kind": cuda,
        "no graph record": replace(evicted, graph=None),
        "offloads": offloads,
    }
    for why, plan in cases.items():
        names = ["cuda0"] if why == "not among the devices" else list(BUDGETS)
        with_plan = problem.starting_from((plan,))
        assert known_start(with_plan, names) is None, why
    assert known_start(problem.starting_from((evicted,)), BUDGETS)


def test_a_result_of_the_search_itself_is_not_noted(evicted: Plan) -> None:
    result = StrategyResult("xengine", replace(evicted, steps=evicted.steps[:-1]), None, "m")
    assert noted_if_known(result, {"job 1a2b": evicted}).message == "m"
