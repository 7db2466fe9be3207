"""A kernel's workspace in the cost model (issue 37 section 1): the scratch memory a node
holds while it runs counts in the simulator's peak and against the budget, in the memory
floor, and in the exact formulations, so that a plan that fits keeps fitting on a device
whose kernels need scratch memory."""

from dataclasses import replace

import numpy as np
import pytest

from remat.costs import CostTable, analytical_costs, cost_table_of, profiled_costs
from remat.devices import Device, DeviceKind
from remat.errors import InvalidInputError
from remat.simulator import simulate
from remat.strategies import Problem, SolverSettings, run_strategy
from remat.training import training_graph

from graphs import chain

GPU = Device("gpu0", DeviceKind.CUDA)
CPU = Device("cpu0", DeviceKind.CPU)
SIZE = 1 << 20


def _costs(graph, devices, scratch: dict[int, int]):
    """Analytical costs with ``scratch[i]`` bytes of workspace for node i on every device."""
    costs = analytical_costs(graph, devices)
    workspace = np.zeros((len(graph), len(devices)), dtype=np.int64)
    for node, nbytes in scratch.items():
        workspace[node] = nbytes
    return replace(costs, workspace_bytes=workspace)


def test_a_nodes_workspace_counts_while_it_runs_and_not_after():
    graph = training_graph(chain(6, size=SIZE))
    plain = analytical_costs(graph, [GPU])
    heavy = 8 * SIZE
    costs = _costs(graph, [GPU], {2: heavy})
    plan = run_strategy("checkpoint_all", Problem(graph, plain, {}), "gpu0").plan
    without = simulate(plan, graph, plain, {})
    with_scratch = simulate(plan, graph, costs, {})
    # node 2's scratch counts at its step alone, in the timeline and the peak
    step = next(i for i, s in enumerate(plan.steps) if s.op == "compute" and s.node == 2)
    during = without.timeline["gpu0"][step] + heavy
    expected = list(without.timeline["gpu0"])
    expected[step] = during
    assert with_scratch.timeline["gpu0"] == expected
    assert with_scratch.peak_bytes["gpu0"] == max(without.peak_bytes["gpu0"], during)
    assert with_scratch.peak_bytes["gpu0"] > without.peak_bytes["gpu0"]
    assert max(with_scratch.timeline["gpu0"]) == with_scratch.peak_bytes["gpu0"]
    budget = without.peak_bytes["gpu0"]  # fits without the workspace, not with it
    over = simulate(plan, graph, costs, {"gpu0": budget})
    assert over.violation is not None and over.violation.over_budget
    assert over.violation.step == step


@pytest.mark.parametrize("strategy", ["checkmate_milp", "auto"])
def test_one_device_plans_keep_the_budget_with_workspace(strategy):
    graph = training_graph(chain(8, size=SIZE))
    costs = _costs(graph, [GPU], {1: 4 * SIZE, 10: 2 * SIZE})
    plain = analytical_costs(graph, [GPU])
    ideal = run_strategy("checkpoint_all", Problem(graph, costs, {}), "gpu0").simulation
    budget = int(ideal.peak_bytes["gpu0"] * 0.8)
    solver = SolverSettings()
    problem = Problem(graph, costs, {"gpu0": budget}, solver).within(20)
    result = run_strategy(strategy, problem, "gpu0")
    assert result.plan is not None, result.message
    assert simulate(result.plan, graph, costs, {"gpu0": budget}).valid
    # planned without the workspace, the same budget gives a plan that breaks it
    blind = run_strategy(strategy, Problem(graph, plain, {"gpu0": budget}).within(20), "gpu0")
    assert blind.plan is not None
    assert not simulate(blind.plan, graph, costs, {"gpu0": budget}).valid


def test_xengine_keeps_every_devices_budget_with_workspace():
    graph = training_graph(chain(6, size=SIZE))
    costs = _costs(graph, [CPU, GPU], {0: 5 * SIZE, 4: 5 * SIZE})
    peak = run_strategy("checkpoint_all", Problem(graph, costs, {}), "gpu0").simulation
    budget = int(peak.peak_bytes["gpu0"] * 0.8)
    budgets = {"cpu0": budget, "gpu0": budget}
    result = run_strategy("xengine", Problem(graph, costs, budgets).within(20))
    assert result.plan is not None, result.message
    assert simulate(result.plan, graph, costs, budgets).valid


def test_a_budget_below_a_nodes_workspace_is_proven_infeasible_naming_it():
    graph = training_graph(chain(4, size=SIZE))
    costs = _costs(graph, [GPU], {3: 64 * SIZE})
    budget = 64 * SIZE  # below node 3's workspace with its input and output
    result = run_strategy("auto", Problem(graph, costs, {"gpu0": budget}), "gpu0")
    assert result.plan is None and result.proven_infeasible
    assert "for its inputs, output and workspace" in result.message
    assert f"node 3 ({graph.nodes[3].name})" in result.message


def test_a_tables_workspace_is_read_and_written():
    graph = training_graph(chain(3))
    costs = _costs(graph, [GPU], {1: 4096})
    table = cost_table_of(graph, costs)
    assert table.nodes[graph.nodes[1].name].workspace_bytes == {"gpu0": 4096}
    assert table.nodes[graph.nodes[0].name].workspace_bytes == {}
    back = profiled_costs(graph, CostTable.model_validate(table.model_dump(mode="json")))
    assert back.workspace(1, 0) == 4096 and back.workspace(0, 0) == 0
    none = profiled_costs(graph, cost_table_of(graph, analytical_costs(graph, [GPU])))
    assert none.workspace_bytes is None


@pytest.mark.parametrize("bad", [-1, 1.5, "lots", 1 << 60])
def test_a_negative_or_malformed_workspace_is_refused(bad):
    graph = training_graph(chain(3))
    table = cost_table_of(graph, analytical_costs(graph, [GPU])).model_dump(mode="json")
    table["nodes"][graph.nodes[1].name]["workspace_bytes"] = {"gpu0": bad}
    with pytest.raises(ValueError, match="workspace_bytes"):
        CostTable.model_validate(table)


def test_a_workspace_for_a_device_the_table_lacks_is_refused():
    graph = training_graph(chain(3))
    table = cost_table_of(graph, analytical_costs(graph, [GPU])).model_dump(mode="json")
    table["nodes"][graph.nodes[1].name]["workspace_bytes"] = {"gpu7": 4096}
    with pytest.raises(InvalidInputError, match="workspace on gpu7, which the table lacks"):
        profiled_costs(graph, CostTable.model_validate(table))


def test_moccasins_plans_keep_the_budget_with_workspace():
    graph = training_graph(chain(8, size=SIZE))
    costs = _costs(graph, [GPU], {1: 4 * SIZE, 10: 2 * SIZE})
    ideal = run_strategy("checkpoint_all", Problem(graph, costs, {}), "gpu0").simulation
    budget = int(ideal.peak_bytes["gpu0"] * 0.8)
    result = run_strategy("moccasin", Problem(graph, costs, {"gpu0": budget}).within(20), "gpu0")
    assert result.plan is not None, result.message
    assert simulate(result.plan, graph, costs, {"gpu0": budget}).valid
