"""Energy as a cost and an objective (XEngine section 5.1): the power model, a plan's
predicted energy, the energy and weighted objectives (eq. 17), power caps (eq. 18-19) and
the errors of each."""

import json

import numpy as np
import pytest

from remat.costs import CostTable, analytical_costs, cost_table_of, profiled_costs
from remat.devices import Device, DeviceKind
from remat.energy import LINK_W, power_spec
from remat.errors import InvalidInputError, StrategyError
from remat.objective import Objective, ObjectiveKind, forbidden, power_violation
from remat.plan import Compute, plan_from_json, plan_to_json
from remat.problem import problem_from_graph
from remat.samples import ZOO
from remat.simulator import simulate
from remat.strategies import run_strategy
from remat.training import training_graph

from graphs import chain

CPU = Device("cpu0", DeviceKind.CPU, {"threads": "4"})
GPU = Device("gpu0", DeviceKind.CUDA)


def _transformer():
    from remat.problem import model_graph

    return model_graph(ZOO["transformer"](batch=4), fuse_attention=False)


def test_every_analytical_node_has_energy_and_every_device_idle_power():
    g = training_graph(chain(4, size=1 << 20))
    costs = analytical_costs(g, [CPU, GPU])
    energy = costs.energy_model()
    assert energy.q_mj.shape == (len(g), 2)
    assert (energy.q_mj > 0).all()
    assert energy.idle_w == (power_spec(CPU).idle_w, power_spec(GPU).idle_w)
    # a node never draws more than its device's busy power, nor less than a tenth of it
    draw = energy.draw_w(costs.compute_ms)
    assert (draw <= [power_spec(CPU).busy_w, power_spec(GPU).busy_w]).all()
    assert (draw >= [0.1 * power_spec(CPU).busy_w, 0.1 * power_spec(GPU).busy_w]).all()


def test_device_options_set_idle_and_busy_power():
    device = Device("gpu1", DeviceKind.CUDA, {"idle_w": "7", "busy_w": "30"})
    assert (power_spec(device).idle_w, power_spec(device).busy_w) == (7.0, 30.0)
    for bad in ("-1", "lots", "2e6"):
        with pytest.raises(InvalidInputError, match="idle_w"):
            power_spec(Device("gpu1", DeviceKind.CUDA, {"idle_w": bad}))


def test_a_plans_energy_is_its_steps_and_the_static_power_over_its_time():
    problem = problem_from_graph(_transformer(), devices=[CPU, GPU])
    plan = run_strategy("xengine", problem.within(5)).plan
    assert plan is not None and plan.predicted is not None
    sim = simulate(plan, problem.graph, problem.costs, problem.budgets)
    energy = problem.costs.energy_model()
    dynamic = sum(
        energy.q_mj[s.node, problem.costs.device_index(s.device)]
        for s in plan.steps
        if isinstance(s, Compute)
    )
    expected = dynamic + LINK_W * sim.copy_ms + energy.static_w * sim.total_ms
    assert sim.energy_mj == pytest.approx(expected)
    assert plan.predicted.energy_mj == pytest.approx(expected)
    assert plan_from_json(json.loads(json.dumps(plan_to_json(plan)))).predicted == plan.predicted


def test_the_board_power_counts_over_the_whole_run():
    graph = _transformer()
    plain = problem_from_graph(graph, devices=[CPU, GPU])
    board = problem_from_graph(graph, devices=[CPU, GPU], objective=Objective(board_w=20.0))
    plan = run_strategy("checkpoint_all", plain, "gpu0").plan
    a = simulate(plan, graph, plain.costs)
    b = simulate(plan, graph, board.costs)
    assert b.energy_mj - a.energy_mj == pytest.approx(20.0 * a.total_ms)


def _solved(objective: Objective, strategy: str = "xengine"):
    problem = problem_from_graph(
        training_graph(chain(8, size=1 << 22)),
        devices=[CPU, GPU],
        budgets={"cpu0": "60%", "gpu0": "60%"},
        objective=objective,
    )
    result = run_strategy(strategy, problem.within(30))
    assert result.plan is not None, result.message
    return problem, result


def test_the_energy_objective_finds_no_more_energy_and_the_time_one_no_more_time():
    _, by_time = _solved(Objective())
    _, by_energy = _solved(Objective(ObjectiveKind.ENERGY))
    assert by_time.plan.solver.status == by_energy.plan.solver.status == "optimal"
    assert by_energy.plan.predicted.energy_mj <= by_time.plan.predicted.energy_mj + 1e-9
    assert by_time.plan.predicted.total_ms <= by_energy.plan.predicted.total_ms + 1e-9
    # the solver minimised the plan's true energy: its objective is the predicted energy
    assert by_energy.plan.solver.objective == pytest.approx(by_energy.plan.predicted.energy_mj)


def test_the_weighted_objective_is_time_plus_alpha_energy():
    alpha = 0.01
    _, result = _solved(Objective(ObjectiveKind.WEIGHTED, alpha=alpha))
    predicted = result.plan.predicted
    value = predicted.total_ms + alpha * predicted.energy_mj
    assert result.plan.solver.objective == pytest.approx(value)


def test_a_power_cap_keeps_the_plan_off_the_placements_it_forbids():
    problem, uncapped = _solved(Objective())
    draws = problem.costs.energy_model().draw_w(problem.costs.compute_ms)[:, 1]
    on_gpu = {s.node for s in uncapped.plan.steps if isinstance(s, Compute) and s.device == "gpu0"}
    assert on_gpu, "the uncapped plan uses the GPU"
    # a cap just under the hungriest node the uncapped plan puts on the GPU
    cap = power_spec(GPU).idle_w + max(draws[i] for i in on_gpu) - 1e-3
    objective = Objective(caps_w={"gpu0": cap})
    capped_problem, capped = _solved(objective)
    over = forbidden(capped_problem.costs, objective)
    assert over[:, 1].any() and not over[:, 0].any()
    for step in capped.plan.steps:
        if isinstance(step, Compute):
            assert not over[step.node, capped_problem.costs.device_index(step.device)]
    assert power_violation(capped.plan, capped_problem.costs, objective) is None
    assert power_violation(uncapped.plan, capped_problem.costs, objective) is not None
    assert capped.plan.predicted.total_ms >= uncapped.plan.predicted.total_ms - 1e-9


def test_a_one_device_strategy_on_a_capped_device_finds_no_plan():
    problem, _ = _solved(Objective())
    draws = problem.costs.energy_model().draw_w(problem.costs.compute_ms)[:, 1]
    objective = Objective(caps_w={"gpu0": power_spec(GPU).idle_w + float(draws.max()) - 1e-3})
    capped = problem_from_graph(problem.graph, devices=[CPU, GPU], objective=objective)
    result = run_strategy("checkpoint_all", capped, "gpu0")
    assert result.plan is None
    assert "power cap" in result.message and "gpu0" in result.message


@pytest.mark.parametrize(
    ("objective", "match"),
    [
        (Objective(caps_w={"gpu9": 100.0}), "power cap for unknown device 'gpu9'"),
        (Objective(caps_w={"gpu0": 10.0}), r"power cap of gpu0 \(10 W\) is below its idle"),
        (Objective(board_cap_w=30.0), r"board power cap \(30 W\) is below the machine's idle"),
        (Objective(caps_w={"gpu0": 51.0, "cpu0": 10.5}), "power caps leave node .* no device"),
    ],
)
def test_caps_that_no_plan_can_keep_are_refused(objective, match):
    with pytest.raises(InvalidInputError, match=match):
        problem_from_graph(training_graph(chain(3)), devices=[CPU, GPU], objective=objective)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": ObjectiveKind.WEIGHTED}, "needs alpha in"),
        ({"kind": ObjectiveKind.WEIGHTED, "alpha": -1.0}, "needs alpha in"),
        ({"kind": ObjectiveKind.ENERGY, "alpha": 1.0}, "alpha weighs energy in the weighted"),
        ({"caps_w": {"gpu0": 0.0}}, "power cap of gpu0: 0 W is not in"),
        ({"board_cap_w": float("nan")}, "power cap of the board"),
        ({"board_w": -3.0}, "board power -3 W is not in"),
    ],
)
def test_malformed_objectives_are_refused(kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        Objective(**kwargs)


def test_offloading_strategies_are_refused_for_energy():
    problem = problem_from_graph(
        training_graph(chain(3)), devices=[GPU], objective=Objective(ObjectiveKind.ENERGY)
    )
    with pytest.raises(StrategyError, match="offload_greedy offloads"):
        run_strategy("offload_greedy", problem)


def _profiled_table(graph, energy: dict[str, float] | None) -> dict:
    table = cost_table_of(graph, analytical_costs(graph, [CPU])).model_dump(mode="json")
    table["source"] = "profiled"
    for node in table["nodes"].values():
        node["energy_mj"] = {}
    table["devices"][0]["energy"] = "model"
    if energy is not None:
        table["devices"][0]["energy"] = "measured"
        for name, mj in energy.items():
            table["nodes"][name]["energy_mj"] = {"cpu0": mj}
    return table


def test_a_profile_without_energy_counters_serves_time_but_not_energy():
    graph = training_graph(chain(3))
    table = CostTable.model_validate(_profiled_table(graph, None))
    costs = profiled_costs(graph, table)
    assert costs.energy_model().measured == (False,)
    assert (costs.energy_model().q_mj > 0).all()  # the power model over measured times
    problem_from_graph(graph, table=table)
    with pytest.raises(InvalidInputError, match="needs energy costs, and the profile has none"):
        problem_from_graph(graph, table=table, objective=Objective(ObjectiveKind.ENERGY))


def test_a_profile_with_measured_energy_is_used_as_measured():
    graph = training_graph(chain(3))
    energy = {n.name: 0.5 + n.id for n in graph.nodes}
    table = CostTable.model_validate(_profiled_table(graph, energy))
    costs = profiled_costs(graph, table)
    assert costs.energy_model().measured == (True,)
    assert np.allclose(costs.energy_model().q_mj[:, 0], [0.5 + n.id for n in graph.nodes])
    problem_from_graph(graph, table=table, objective=Objective(ObjectiveKind.ENERGY))


def test_a_profile_with_energy_for_some_nodes_only_is_refused():
    graph = training_graph(chain(3))
    first = graph.nodes[0].name
    table = CostTable.model_validate(_profiled_table(graph, {first: 1.0}))
    with pytest.raises(InvalidInputError, match="has no energy on cpu0, which 1 other"):
        profiled_costs(graph, table)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_negative_or_non_finite_energy_is_refused(bad):
    graph = training_graph(chain(3))
    table = _profiled_table(graph, {n.name: 1.0 for n in graph.nodes})
    table["nodes"][graph.nodes[1].name]["energy_mj"]["cpu0"] = bad
    with pytest.raises(ValueError, match="energy_mj"):
        CostTable.model_validate(table)
    table["nodes"][graph.nodes[1].name]["energy_mj"]["cpu0"] = 1.0
    table["devices"][0]["idle_w"] = -5
    with pytest.raises(ValueError, match="idle_w"):
        CostTable.model_validate(table)


def test_a_capped_search_over_devices_is_never_without_a_plan_one_device_has():
    from remat.problem import model_graph

    graph = model_graph(ZOO["transformer"](batch=8), fuse_attention=False)
    devices = [Device("cpu0", DeviceKind.CPU, {"threads": "8"}), GPU]
    plain = problem_from_graph(graph, devices=devices)
    energy = plain.costs.energy_model()
    draws = energy.draw_w(plain.costs.compute_ms)[:, 1]
    objective = Objective(caps_w={"gpu0": energy.idle_w[1] + float(np.median(draws))})
    budgets = {"cpu0": "50%", "gpu0": "50%"}
    capped = problem_from_graph(graph, devices=devices, budgets=budgets, objective=objective)
    alone = run_strategy("greedy_evict", capped, "cpu0")
    assert alone.plan is not None  # a plan within the caps exists, on the CPU
    result = run_strategy("xengine", capped.within(4))
    assert result.plan is not None, result.message
    assert power_violation(result.plan, capped.costs, objective) is None
    assert result.plan.predicted.total_ms <= alone.plan.predicted.total_ms + 1e-9
