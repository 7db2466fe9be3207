import json

import numpy as np
import pytest

from remat.compiler import compile_plan
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.errors import InvalidInputError, ScheduleError
from remat.plan import (
    Compute,
    Copy,
    Free,
    Plan,
    PlanDevice,
    load_plan,
    plan_from_json,
    plan_to_json,
)
from remat.schedule import Schedule
from remat.simulator import simulate
from remat.training import training_graph

from graphs import chain, diamond

CPU = Device("cpu0", DeviceKind.CPU)
GPU = Device("cuda0", DeviceKind.CUDA)


def _devices(*devices):
    return [PlanDevice.of(d, None) for d in devices]


def test_plan_json_round_trip_uses_design_field_names(tmp_path):
    g = training_graph(chain(2))
    costs = analytical_costs(g, [CPU, GPU])
    n = len(g)
    R = np.zeros((2, n, n), bool)
    S = np.zeros((2, n, n), bool)
    R[0, 0, 0] = True
    for t in range(1, n):
        R[1, t, t] = True
    S[0, 1:5, 0] = True  # n0 kept on the CPU, read from there by the GPU
    S[1, 2:4, 1] = True  # n1 until its gradient (stage 3)
    S[1, 3, 2] = True  # the loss until n1:grad reads it
    S[1, 4, 3] = True  # n1:grad until n0:grad reads it
    Schedule(("cpu0", "cuda0"), R, S).check(g)
    plan = compile_plan(g, Schedule(("cpu0", "cuda0"), R, S), _devices(CPU, GPU), "x", costs)
    document = plan_to_json(plan)
    copy = next(s for s in document["steps"] if s["op"] == "copy")
    assert copy == {"stage": 1, "op": "copy", "node": 0, "from": "cpu0", "to": "cuda0"}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(document))
    assert load_plan(path) == plan
    assert simulate(plan, g, costs).valid


@pytest.mark.parametrize(
    ("document", "match"),
    [
        ([], "object"),
        ({"version": 6}, "version"),
        ({"version": True}, "version"),
        (
            {"version": 1, "strategy": "x", "devices": [], "steps": [{"op": "wait", "stage": 0}]},
            "needs plan version 2",
        ),
        ({"version": 1, "strategy": "x", "devices": [], "steps": [{"op": "jump"}]}, "steps\\[0\\]"),
        (
            {"version": 1, "strategy": "x", "devices": [{"name": "a", "kind": "tpu"}], "steps": []},
            "devices\\[0\\]",
        ),
        (
            {
                "version": 1,
                "strategy": "x",
                "devices": [],
                "steps": [{"op": "compute", "stage": 0, "node": "zero", "device": "a"}],
            },
            "'node'",
        ),
        ({"version": 1, "strategy": "x", "devices": [], "steps": [], "graph": 7}, "'graph'"),
        (
            {"version": 1, "strategy": "x", "devices": [], "steps": [], "graph": {"nodes": 3}},
            "graph.digest",
        ),
    ],
)
def test_malformed_plans_are_named(document, match):
    with pytest.raises(InvalidInputError, match=match):
        plan_from_json(document)


def test_a_plan_records_its_graph_through_json_and_plans_before_it_still_load():
    g = training_graph(chain(2))
    steps = tuple(Compute(i, i, "cpu0") for i in range(len(g)))
    stamped = Plan("x", tuple(_devices(CPU)), steps, graph=g.fingerprint)
    document = plan_to_json(stamped)
    assert document["graph"] == {"nodes": len(g), "digest": g.fingerprint.digest}
    assert plan_from_json(document).graph == g.fingerprint
    del document["graph"]
    assert plan_from_json(document).graph is None


def test_compiler_copies_a_dependency_from_the_cheapest_device():
    g = training_graph(diamond())
    n = len(g)
    costs = analytical_costs(g, [CPU, GPU])
    R = np.zeros((2, n, n), bool)
    S = np.zeros((2, n, n), bool)
    R[0, np.arange(n), np.arange(n)] = True
    R[0, 3, 3] = False
    R[1, 3, 3] = True  # n3 runs on the GPU: n1 and n2 must be copied over
    for t in range(1, n):
        S[0, t, :t] = True
    S[0, 4:, 3] = False
    S[1, 4:, 3] = True
    S[0, :, 3] = False
    schedule = Schedule(("cpu0", "cuda0"), R, S)
    schedule.check(g)
    plan = compile_plan(g, schedule, _devices(CPU, GPU), "x", costs)
    copies = [s for s in plan.steps if isinstance(s, Copy)]
    assert {(c.node, c.src, c.dst) for c in copies} >= {(1, "cpu0", "cuda0"), (2, "cpu0", "cuda0")}
    result = simulate(plan, g, costs)
    assert result.valid, result.violation
    # the copies on the GPU are freed once n3 has read them
    after = plan.steps.index(Compute(3, 3, "cuda0"))
    freed = {(s.node, s.device) for s in plan.steps[after:] if isinstance(s, Free) and s.stage == 3}
    assert {(1, "cuda0"), (2, "cuda0")} <= freed


def test_schedule_check_rejects_broken_schedules():
    g = training_graph(chain(3))
    n = len(g)
    R = np.eye(n, dtype=bool)
    S = np.zeros((n, n), bool)
    with pytest.raises(ScheduleError, match="without dependency"):
        Schedule.single("cpu0", R, S).check(g)
    S2 = np.tril(np.ones((n, n), bool), -1)
    S2[2, 1] = False
    S2[3, 1] = True  # kept in stage 3 without being present in stage 2
    with pytest.raises(ScheduleError, match="not present"):
        Schedule.single("cpu0", R, S2).check(g)
    R3 = R.copy()
    R3[4, 4] = False
    with pytest.raises(ScheduleError, match="not computed in its stage"):
        Schedule.single("cpu0", R3, np.tril(np.ones((n, n), bool), -1)).check(g)
