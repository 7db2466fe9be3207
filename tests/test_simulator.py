from dataclasses import replace

import numpy as np
import pytest

from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.plan import Compute, Copy, Free, Plan, PlanDevice
from remat.simulator import simulate
from remat.strategies import Problem
from remat.strategies.baselines.checkpoint_all import checkpoint_all
from remat.training import training_graph

from graphs import chain

CPU = Device("cpu0", DeviceKind.CPU)
GPU = Device("cuda0", DeviceKind.CUDA)


def _setup(n=3, devices=(CPU,)):
    g = training_graph(chain(n))
    return g, analytical_costs(g, list(devices))


def _plan(steps, budgets=None, devices=(CPU,)):
    budgets = budgets or {}
    return Plan("hand", tuple(PlanDevice.of(d, budgets.get(d.name)) for d in devices), steps)


def _all_computes(g, device="cpu0"):
    return [Compute(i, i, device) for i in range(len(g))]


def test_keep_everything_plan_is_valid_and_costs_the_ideal():
    g, costs = _setup()
    result = simulate(_plan(tuple(_all_computes(g))), g, costs)
    assert result.valid
    assert result.total_ms == pytest.approx(costs.ideal_ms())
    # fixed: input x (400) + 3 weights (100 each); training adds the weights' gradient
    # buffers (the input is data: no gradient)
    assert result.fixed_bytes == {"cpu0": 400 + 2 * 300}
    assert result.peak_bytes["cpu0"] == 1000 + sum(n.output_bytes for n in g.nodes)
    assert len(result.timeline["cpu0"]) == len(g)


def test_missing_dependency_is_rejected_at_its_step():
    g, costs = _setup()
    steps = _all_computes(g)
    steps.insert(2, Free(1, 1, "cpu0"))  # free n1 before n2 reads it
    result = simulate(_plan(tuple(steps)), g, costs)
    assert result.violation.step == 3
    assert "dependency 1 (n1)" in result.violation.message
    assert "not resident" in result.violation.message


def test_over_budget_is_rejected_at_the_step_that_exceeds_it():
    g, costs = _setup()
    budget = 1400 + 3500  # fixed + 3.5 values
    result = simulate(_plan(tuple(_all_computes(g)), {"cpu0": budget}), g, costs)
    assert result.violation.step == 3
    assert result.violation.over_budget
    assert "over the budget" in result.violation.message


def test_use_after_free_and_double_free():
    g, costs = _setup()
    steps = _all_computes(g)
    use_after_free = [steps[0], Free(0, 0, "cpu0"), *steps[1:]]  # n1 reads the freed n0
    result = simulate(_plan(tuple(use_after_free)), g, costs)
    assert result.violation.step == 2 and "dependency 0 (n0)" in result.violation.message
    double = [steps[0], Free(0, 0, "cpu0"), Free(0, 0, "cpu0")]
    result = simulate(_plan(tuple(double)), g, costs)
    assert result.violation.step == 2 and "double free" in result.violation.message


def test_never_computing_a_gradient_is_rejected_after_the_last_step():
    g, costs = _setup()
    result = simulate(_plan(tuple(_all_computes(g)[:-1])), g, costs)
    assert result.violation.step == -1
    assert "n0:grad" in result.violation.message and "never computed" in result.violation.message


def test_unknown_device_and_node_are_violations_not_crashes():
    g, costs = _setup()
    result = simulate(_plan((Compute(0, 0, "gpu9"),)), g, costs)
    assert "unknown device" in result.violation.message
    result = simulate(_plan((Compute(0, 99, "cpu0"),)), g, costs)
    assert "unknown node 99" in result.violation.message


def test_a_plan_is_refused_on_a_graph_of_another_structure_not_of_another_size():
    g, costs = _setup(3)
    plan = replace(_plan(tuple(_all_computes(g))), graph=g.fingerprint)
    assert simulate(plan, g, costs).valid
    wider = training_graph(chain(3, size=4000))  # the same nodes, larger values
    wider_costs = analytical_costs(wider, [CPU])
    assert wider.fingerprint == g.fingerprint and simulate(plan, wider, wider_costs).valid
    longer, longer_costs = _setup(4)
    refused = simulate(plan, longer, longer_costs)
    assert not refused.valid and "made for another graph" in str(refused.violation)
    assert str(g.fingerprint) in str(refused.violation)
    assert str(longer.fingerprint) in str(refused.violation)


def test_copy_allocates_on_the_destination_and_costs_link_time():
    g, costs = _setup(devices=(CPU, GPU))
    steps = [Compute(0, 0, "cpu0"), Copy(1, 0, "cpu0", "cuda0"), Compute(1, 1, "cuda0")]
    result = simulate(_plan(tuple(steps), devices=(CPU, GPU)), g, costs, {})
    assert result.timeline["cuda0"][1] - result.timeline["cuda0"][0] == 1000
    assert result.copy_ms == pytest.approx(costs.copy_ms[0, 0, 1])
    # parameters live where they are used: w1 only on the GPU, w0 and x only on the CPU
    assert result.fixed_bytes == {"cpu0": 500, "cuda0": 100}
    bad = [Compute(0, 0, "cpu0"), Compute(1, 1, "cuda0")]
    result = simulate(_plan(tuple(bad), devices=(CPU, GPU)), g, costs)
    assert result.violation.step == 1


def test_inference_outputs_must_stay_resident():
    g = chain(2)
    costs = analytical_costs(g, [CPU])
    steps = (Compute(0, 0, "cpu0"), Compute(1, 1, "cpu0"), Free(1, 1, "cpu0"))
    result = simulate(_plan(steps), g, costs)
    assert result.violation.step == -1 and "output 1" in result.violation.message


def test_compiled_keep_all_plan_frees_after_last_use():
    g, costs = _setup(n=4)
    plan = checkpoint_all(Problem(g, costs, {}), "cpu0").plan
    result = simulate(plan, g, costs)
    assert result.valid
    frees = [s for s in plan.steps if isinstance(s, Free)]
    assert len(frees) == len(g)  # every value freed exactly once
    # n3 and the loss are freed right after n3:grad, their last reader (eq. 5)
    grad = next(i for i, s in enumerate(plan.steps) if isinstance(s, Compute) and s.node == 5)
    assert {(type(s), s.node) for s in plan.steps[grad + 1 : grad + 3]} == {(Free, 3), (Free, 4)}
    assert np.argmax(result.timeline["cpu0"]) < len(plan.steps) - 1
