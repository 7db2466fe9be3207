"""The memory floor (``remat.strategies.common.floor``): budgets it proves infeasible, and the
exact strategies answering them without a solve."""

from __future__ import annotations

from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.simulator import held_fixed_bytes
from remat.solvers.model import SolveOptions
from remat.strategies import Problem, SolverSettings
from remat.strategies.common.floor import shortfall
from remat.strategies.exact.checkmate import checkmate_lp_rounding, checkmate_milp
from remat.strategies.exact.xengine import xengine
from remat.training import training_graph

from graphs import chain, diamond

CPU = Device("cpu0", DeviceKind.CPU)
GPU = Device("cuda0", DeviceKind.CUDA)
FAST = SolverSettings(options=SolveOptions(time_limit_s=20, gap=1e-6))


def _floor(problem: Problem, devices: tuple[str, ...]) -> int:
    """The smallest budget (the same on every device) the floor lets through."""
    low, high = 0, 10**9
    while low < high:
        middle = (low + high) // 2
        budgets = dict.fromkeys(devices, middle)
        if shortfall(Problem(problem.graph, problem.costs, budgets), devices) is None:
            high = middle
        else:
            low = middle + 1
    return low


def test_one_device_floor_is_all_fixed_memory_plus_the_largest_step() -> None:
    graph = training_graph(chain(3))
    costs = analytical_costs(graph, [CPU])
    sizes = costs.output_bytes
    step = max(int(sizes[n.id]) + sum(int(sizes[u]) for u in set(n.deps)) for n in graph.nodes)
    expected = held_fixed_bytes(graph, range(len(graph))) + step
    assert _floor(Problem(graph, costs, {}), ("cpu0",)) == expected
    short = shortfall(Problem(graph, costs, {"cpu0": expected - 1}), ("cpu0",))
    assert short is not None and short.needs[0].total == expected


def test_several_devices_need_a_node_to_fit_on_none() -> None:
    graph = training_graph(chain(3))
    costs = analytical_costs(graph, [CPU, GPU])
    one = _floor(Problem(graph, costs, {}), ("cpu0",))
    two = _floor(Problem(graph, costs, {}), ("cpu0", "cuda0"))
    assert two < one  # with two devices, a node holds only its own fixed tensors
    assert (
        shortfall(Problem(graph, costs, {"cpu0": two - 1, "cuda0": None}), ("cpu0", "cuda0"))
        is None
    )
    assert (
        shortfall(Problem(graph, costs, {"cpu0": two - 1, "cuda0": two}), ("cpu0", "cuda0")) is None
    )
    short = shortfall(Problem(graph, costs, {"cpu0": two - 1, "cuda0": two - 1}), ("cpu0", "cuda0"))
    assert short is not None and [n.device for n in short.needs] == ["cpu0", "cuda0"]


def test_exact_strategies_answer_a_budget_below_the_floor_without_a_solve() -> None:
    graph = training_graph(chain(3))
    costs = analytical_costs(graph, [CPU, GPU])
    below = _floor(Problem(graph, costs, {}), ("cpu0",)) - 1
    one = Problem(graph, costs, {"cpu0": below}, FAST)
    for result in (checkmate_milp(one, "cpu0"), checkmate_lp_rounding(one, "cpu0")):
        assert not result.feasible
        assert "proved that no schedule fits: computing node" in result.message
        assert "over the budget of" in result.message
    tight = _floor(Problem(graph, costs, {}), ("cpu0", "cuda0")) - 1
    result = xengine(Problem(graph, costs, {"cpu0": tight, "cuda0": tight}, FAST))
    assert not result.feasible and "on cpu0" in result.message and "on cuda0" in result.message


def test_above_the_floor_the_solver_still_proves_infeasibility() -> None:
    """A training diamond needs both branches and their input at once: more than any
    single step, so at the floor only the MILP knows that no plan fits."""
    graph = training_graph(diamond())
    costs = analytical_costs(graph, [CPU])
    floor = _floor(Problem(graph, costs, {}), ("cpu0",))
    result = checkmate_milp(Problem(graph, costs, {"cpu0": floor}, FAST), "cpu0")
    assert not result.feasible
    assert (
        result.message == "infeasible at this budget: checkmate_milp proved that no schedule fits"
    )
