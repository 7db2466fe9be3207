"""Devices that share one memory pool (issue 36 section 1, PORT-M's unified memory): the
device option, budgets per pool, the simulator and the compiler counting a pool once, and
XEngine's model bounding the pool's memory together."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from regime import split_pool

from remat import samples
from remat.compiler import compile_plan
from remat.costs import (
    CostModel,
    CostSource,
    CostTable,
    analytical_costs,
    cost_table_of,
    profiled_costs,
)
from remat.devices import Device, DeviceKind, parse_device
from remat.errors import InvalidInputError
from remat.formulations.xengine import build_xengine
from remat.graph import NodeKind
from remat.plan import (
    PAGE_OPS,
    Compute,
    Copy,
    Free,
    Plan,
    PlanDevice,
    plan_from_json,
    plan_to_json,
)
from remat.problem import build_problem
from remat.schedule import Schedule
from remat.simulator import simulate
from remat.solvers.model import Progress, SolveOptions
from remat.strategies import SearchConfig, SolverSettings, run_strategy
from remat.strategies.heuristics.evict import evict_pooled, greedy_evict
from remat.strategies.heuristics.recompute_ahead import recompute_ahead
from remat.training import training_graph

from graphs import chain, diamond

CPU = Device("cpu0", DeviceKind.CPU, {"pool": "ram"})
GPU = Device("gpu0", DeviceKind.CUDA, {"pool": "ram"})


def _costs(devices=(CPU, GPU)):
    g = training_graph(chain(3))
    n, D = len(g), len(devices)
    out = np.array([node.output_bytes for node in g.nodes], dtype=np.int64)
    costs = CostModel(CostSource.PROFILED, tuple(devices), np.ones((n, D)), np.ones((n, D, D)), out)
    return g, costs.pooled()


def _plan(steps, budget=None, devices=(CPU, GPU)):
    return Plan("hand", tuple(PlanDevice.of(d, budget) for d in devices), tuple(steps))


def test_a_pool_is_a_device_option_and_a_device_has_one():
    device = parse_device("gpu0:cuda:pool=ram")
    assert device.memory_space == "ram" and parse_device("cpu0:cpu").memory_space == "cpu0"
    with pytest.raises(InvalidInputError, match="option pool is given twice"):
        parse_device("gpu0:cuda:pool=ram,pool=vram")
    with pytest.raises(InvalidInputError, match="pool must be a name"):
        parse_device("gpu0:cuda:pool=9 lives")


def test_a_budget_is_the_pools_and_every_device_of_it_carries_it():
    model = samples.chain()
    devices = [parse_device("cpu0:cpu:pool=ram"), parse_device("gpu0:cuda:pool=ram")]
    problem = build_problem(model, batch=2, devices=devices, budgets={"ram": "1MiB"})
    assert problem.budgets == {"cpu0": 1 << 20, "gpu0": 1 << 20}
    assert problem.costs.copy_ms.max() == 0.0  # no copy within a pool costs anything


@pytest.mark.parametrize(
    ("devices", "budgets", "message"),
    [
        (["cpu0:cpu:pool=ram", "gpu0:cuda:pool=ram"], {"cpu0": "1MiB"}, "shares pool 'ram'"),
        (["cpu0:cpu:pool=ram", "gpu0:cuda"], {"vram": "1MiB"}, "pools: ram"),
        (["cpu0:cpu:pool=gpu0", "gpu0:cuda"], {}, "has the name of a device"),
        (
            ["cpu0:cpu:pool=ram", "gpu0:cuda:pool=ram"],
            {"ram": "1MiB", "gpu0": "1MiB"},
            "budget for gpu0",
        ),
    ],
)
def test_pool_budgets_that_mean_nothing_are_refused(devices, budgets, message):
    with pytest.raises(InvalidInputError, match=message):
        build_problem(
            samples.chain(),
            batch=2,
            devices=[parse_device(d) for d in devices],
            budgets=budgets,
        )


def test_the_devices_of_a_pool_read_each_others_tensors_and_count_them_once():
    g, costs = _costs()
    # chain(3): 0 -> 1 -> 2 -> loss 3; backward 4 reads (2, 3), 5 reads (1, 4), 6 (0, 5)
    steps = [
        Compute(0, 0, "cpu0"),
        Compute(1, 1, "gpu0"),  # reads node 0 from the pool: no copy
        Compute(2, 2, "cpu0"),
        Compute(3, 3, "gpu0"),
        Compute(4, 4, "gpu0"),
        Free(4, 2, "cpu0"),
        Free(4, 3, "gpu0"),
        Compute(5, 5, "cpu0"),
        Free(5, 1, "gpu0"),
        Free(5, 4, "cpu0"),
        Compute(6, 6, "gpu0"),
    ]
    separate = simulate(_plan(steps, devices=(Device("cpu0", DeviceKind.CPU), GPU)), g, costs)
    assert not separate.valid and "not resident" in separate.violation.message
    result = simulate(_plan(steps), g, costs)
    assert result.valid, result.violation
    assert result.copy_ms == 0
    fixed = result.fixed_bytes
    # one pool: the parameters read on either device are held once, with their gradients
    # (input 400, three weights of 100 and their gradients)
    assert fixed["cpu0"] == fixed["gpu0"] == 1000
    assert (
        result.peak_bytes["cpu0"] == result.peak_bytes["gpu0"] == 1000 + 5000
    )  # after node 4: values 0 to 4
    over = simulate(_plan(steps, budget=1000 + 4999), g, costs)
    assert not over.valid and over.violation.over_budget


def test_a_copy_within_a_pool_is_refused():
    g, costs = _costs()
    result = simulate(_plan([Compute(0, 0, "cpu0"), Copy(0, 0, "cpu0", "gpu0")]), g, costs)
    assert not result.valid
    assert "share one memory pool, where it is already" in result.violation.message


def test_the_compiler_emits_no_copy_within_a_pool_and_frees_a_tensor_once():
    g, costs = _costs()
    n = len(g)
    R = np.zeros((2, n, n), dtype=bool)
    for t in range(n):
        R[t % 2, t, t] = True  # alternate devices: every read crosses between them
    S = np.zeros((2, n, n), dtype=bool)
    for t in range(1, n):
        for i in range(t):
            if any(j >= t for j in g.users()[i]):
                S[(t + 1) % 2, t, i] = True  # kept "on" the other device of the pool
    schedule = Schedule(("cpu0", "gpu0"), R, S)
    plan = compile_plan(g, schedule, _plan([]).devices, "hand", costs)
    assert not any(isinstance(s, Copy) for s in plan.steps)
    frees = [(s.node) for s in plan.steps if isinstance(s, Free)]
    assert len(frees) == len(set(frees))
    assert simulate(plan, g, costs).valid


def test_xengine_bounds_a_pools_memory_together():
    g = training_graph(chain(3))
    devices = [parse_device("cpu0:cpu:pool=ram"), parse_device("gpu0:cuda:pool=ram")]
    costs = analytical_costs(g, devices).pooled()
    model = build_xengine(g, costs, {"cpu0": 5000, "gpu0": 5000})
    labels = [block.label for block in model.builder.row_blocks]
    assert "6 pool ram" in labels
    apart = analytical_costs(g, [Device("cpu0", DeviceKind.CPU), Device("gpu0", DeviceKind.CUDA)])
    assert "6 pool ram" not in [
        block.label
        for block in build_xengine(g, apart, {"cpu0": 5000, "gpu0": 5000}).builder.row_blocks
    ]


def test_a_pools_model_holds_each_fixed_tensor_once_and_copies_nothing_within_it():
    """XEngine's model on a pool: H and G (fixed tensors, gradient buffers) on its first
    device only, no copy variables; a schedule whose devices keep each other's values is
    encoded, each kept value on one device, and the model's memory of the pool is at
    least the simulator's at every point (conservative), its fixed part counted once."""
    g = training_graph(chain(3))
    devices = [parse_device("cpu0:cpu:pool=ram"), parse_device("cpu1:cpu:pool=ram")]
    costs = analytical_costs(g, devices).pooled()
    model = build_xengine(g, costs, {"cpu0": None, "cpu1": None})
    assert (model.H[0] >= 0).all() and (model.H[1] < 0).all()
    assert (model.G[0] >= 0).all() and (model.G[1] < 0).all()
    assert (model.C < 0).all() and (model.L < 0).all()
    n = len(g)
    R = np.zeros((2, n, n), dtype=bool)
    S = np.zeros((2, n, n), dtype=bool)
    for t in range(n):
        R[t % 2, t, t] = True  # every other node on cpu1
        S[(t + 1) % 2, t, :t] = True  # every value kept, on the device that did not compute t
    x = model.encode(Schedule(("cpu0", "cpu1"), R.astype(np.int8), S.astype(np.int8)))
    assert model.check(x) == []
    kept = np.stack([x[model.S[d, :-1]] * (model.S[d, :-1] >= 0) for d in range(2)])
    assert (kept.sum(axis=0) <= 1).all()  # one device keeps each value
    schedule = model.decode(x)
    plan = compile_plan(g, schedule, [PlanDevice.of(d, None) for d in devices], "hand", costs)
    verdict = simulate(plan, g, costs)
    assert verdict.valid
    pool_memory = x[model.U[0]] + x[model.U[1]]
    fixed = sum(f.nbytes for f in g.fixed.values()) / model.unit
    assert pool_memory[:, 0].min() >= fixed  # every fixed tensor, once
    assert pool_memory.max() * model.unit >= verdict.peak_bytes["cpu0"]


def test_xengine_plans_two_devices_of_a_pool_within_its_budget():
    devices = [parse_device("cpu0:cpu:pool=ram"), parse_device("gpu0:cuda:pool=ram")]
    solver = SolverSettings(options=SolveOptions(time_limit_s=4))
    problem = build_problem(
        samples.vgg16(), batch=2, devices=devices, budgets={"ram": "90%"}, solver=solver
    )
    result = run_strategy("xengine", problem)
    assert result.feasible, result.message
    assert not any(isinstance(s, Copy) for s in result.plan.steps)
    verdict = simulate(result.plan, problem.graph, problem.costs)
    budget = problem.budgets["cpu0"]
    assert verdict.valid and max(verdict.peak_bytes.values()) <= budget


def _diamond_costs():
    g = diamond()
    out = np.array([node.output_bytes for node in g.nodes], dtype=np.int64)
    ones = np.ones((len(g), 2))
    costs = CostModel(CostSource.PROFILED, (CPU, GPU), ones, np.zeros((len(g), 2, 2)), out)
    return g, costs


def test_a_concurrent_plans_computes_overlap_across_the_pools_devices():
    """diamond: 0 -> (1, 2) -> 3, every node 1 ms. Concurrent, 1 on cpu0 and 2 on gpu0 run
    at once after 0, and 3 waits for both: 3 ms of the 4 ms of compute; a free between two
    computes ends a section, and a plan that is not concurrent runs them in turn."""
    g, costs = _diamond_costs()
    steps = [Compute(0, 0, "cpu0"), Compute(1, 1, "cpu0"), Compute(1, 2, "gpu0")]
    steps += [Compute(2, 3, "cpu0")]
    plan = replace(_plan(steps), concurrent=True)
    result = simulate(plan, g, costs)
    assert result.valid and result.total_ms == 3.0 and result.compute_ms == 4.0
    assert plan.version == 4 and _plan(steps).version == 1
    assert simulate(_plan(steps), g, costs).total_ms == 4.0
    split = [*steps[:2], Free(1, 0, "cpu0"), *steps[2:]]
    assert simulate(replace(_plan(split), concurrent=True), g, costs).violation is not None
    late = [*steps[:3], Compute(2, 3, "gpu0")]  # 3 after 2 on gpu0: still 1 + 1 + 1
    assert simulate(replace(_plan(late), concurrent=True), g, costs).total_ms == 3.0
    one = [Compute(0, 0, "cpu0"), Compute(1, 1, "cpu0"), Compute(1, 2, "cpu0")]
    one += [Compute(2, 3, "cpu0")]
    assert simulate(replace(_plan(one), concurrent=True), g, costs).total_ms == 4.0


def test_a_concurrent_section_pays_the_hosts_thread_handoff_between_its_devices():
    """diamond with a 0.25 ms hand-off: an input computed on the section's other device
    is read a hand-off after it, a device other than the section's first signals its end
    a hand-off before the section may end; a section on one device, or a plan run in
    turn, pays none."""
    g, costs = _diamond_costs()
    costs = replace(costs, handoff_ms=0.25)
    steps = [Compute(0, 0, "cpu0"), Compute(1, 1, "cpu0"), Compute(1, 2, "gpu0")]
    steps += [Compute(2, 3, "cpu0")]
    # on cpu0: 0 in [0, 1], 1 in [1, 2]; on gpu0: 2 in [1.25, 2.25] (0 came from cpu0);
    # on cpu0: 3 in [2.5, 3.5] (2 came from gpu0)
    assert simulate(replace(_plan(steps), concurrent=True), g, costs).total_ms == 3.5
    late = [*steps[:3], Compute(2, 3, "gpu0")]  # 3 on gpu0: ends 3.25, its end signalled
    assert simulate(replace(_plan(late), concurrent=True), g, costs).total_ms == 3.5
    one = [Compute(0, 0, "cpu0"), Compute(1, 1, "cpu0"), Compute(1, 2, "cpu0")]
    one += [Compute(2, 3, "cpu0")]
    assert simulate(replace(_plan(one), concurrent=True), g, costs).total_ms == 4.0
    assert simulate(_plan(steps), g, costs).total_ms == 4.0


def test_a_section_on_several_devices_runs_its_steps_slowed_by_their_interference():
    """diamond with cpu0 1.5x and gpu0 2x slower while the other computes at once: the
    section on both devices takes 1.5 + max(1.5, 2) + 1.5; one on cpu0 alone is not
    slowed, nor is a plan run in turn; the time lost is the simulation's slowdown_ms."""
    g, costs = _diamond_costs()
    costs = replace(costs, concurrent_slowdown=(1.5, 2.0))
    steps = [Compute(0, 0, "cpu0"), Compute(1, 1, "cpu0"), Compute(1, 2, "gpu0")]
    steps += [Compute(2, 3, "cpu0")]
    both = simulate(replace(_plan(steps), concurrent=True), g, costs)
    assert both.total_ms == 5.0 and both.compute_ms == 4.0 and both.slowdown_ms == 2.5
    one = [Compute(0, 0, "cpu0"), Compute(1, 1, "cpu0"), Compute(1, 2, "cpu0")]
    one += [Compute(2, 3, "cpu0")]
    assert simulate(replace(_plan(one), concurrent=True), g, costs).total_ms == 4.0
    assert simulate(_plan(steps), g, costs).total_ms == 4.0
    table = cost_table_of(g, costs)
    assert [d.concurrent_slowdown for d in table.devices] == [1.5, 2.0]
    assert profiled_costs(g, table).concurrent_slowdown == (1.5, 2.0)
    document = table.model_dump(mode="json")
    document["devices"][0]["concurrent_slowdown"] = 0.5  # faster beside another: refused
    with pytest.raises(ValueError, match="concurrent_slowdown"):
        CostTable.model_validate(document)


@pytest.mark.parametrize("handoff", [-0.01, float("nan"), 5e3])
def test_a_tables_handoff_round_trips_and_out_of_range_is_refused(handoff):
    g, costs = _diamond_costs()
    table = cost_table_of(g, replace(costs, handoff_ms=0.04))
    assert table.handoff_ms == 0.04 and profiled_costs(g, table).handoff_ms == 0.04
    assert cost_table_of(g, costs).handoff_ms == 0.0  # the analytical model's
    document = table.model_dump(mode="json") | {"handoff_ms": handoff}
    with pytest.raises(ValueError, match="handoff_ms"):
        CostTable.model_validate(document)


def test_a_concurrent_plan_is_version_4_and_says_so_in_json():
    plan = replace(_plan([Compute(0, 0, "cpu0")]), concurrent=True)
    document = plan_to_json(plan)
    assert document["version"] == 4 and document["concurrent"] is True
    assert plan_from_json(document).concurrent
    assert "concurrent" not in plan_to_json(_plan([Compute(0, 0, "cpu0")]))
    with pytest.raises(InvalidInputError, match="'concurrent' needs plan version 4"):
        plan_from_json(document | {"version": 3})
    with pytest.raises(InvalidInputError, match="'concurrent' must be true or false"):
        plan_from_json(document | {"concurrent": "yes"})


def test_the_compiler_frees_nothing_inside_a_concurrent_stage():
    """Stage 1 computes 1 on cpu0 and 2 on gpu0 beside it: concurrent, the stage's frees
    come after both, and its two computes overlap."""
    g, costs = _diamond_costs()
    R = np.zeros((2, 4, 4), dtype=bool)
    S = np.zeros((2, 4, 4), dtype=bool)
    R[0, 0, 0] = R[0, 1, 1] = R[1, 1, 2] = R[0, 2, 3] = True  # stage 1 also computes 2
    R[0, 3, 3] = False
    S[0, 1, 0] = S[0, 2, 1] = S[0, 2, 2] = True
    schedule = Schedule(("cpu0", "gpu0"), R[:, :3], S[:, :3])
    devices = _plan([]).devices
    plan = compile_plan(g, schedule, devices, "hand", costs, concurrent=True)
    assert plan.concurrent
    ops = [s.op for s in plan.steps if s.stage == 1]
    assert ops == ["compute", "compute", "free"]
    sequential = compile_plan(g, schedule, devices, "hand", costs)
    fast, slow = (simulate(p, g, costs) for p in (plan, sequential))
    assert fast.valid and slow.valid
    assert fast.total_ms == slow.total_ms - 1.0


POOLED_CPUS = [
    parse_device("cpu0:cpu:pool=ram,threads=2"),
    parse_device("cpu1:cpu:pool=ram,threads=2"),
]


def test_port_ms_model_bounds_a_stage_by_its_longest_device_and_its_memory_by_the_pool():
    g = training_graph(chain(3))
    costs = analytical_costs(g, POOLED_CPUS).pooled()
    labels = {
        block.label
        for block in build_xengine(g, costs, {"cpu0": 9000, "cpu1": 9000}, True).builder.row_blocks
    }
    assert {"PORT-M A", "PORT-M once ram", "PORT-M memory ram"} <= labels
    sequential = build_xengine(g, costs, {"cpu0": 9000, "cpu1": 9000})
    assert not any(block.label.startswith("PORT-M") for block in sequential.builder.row_blocks)


def _xengine_and_port_m(devices, seconds):
    """The chain sample at 70% on ``devices`` (one pool), and XEngine's and port_m's
    plans for it with ``seconds`` each, both feasible."""
    solver = SolverSettings(options=SolveOptions(time_limit_s=seconds))
    problem = build_problem(
        samples.chain(), batch=2, devices=devices, budgets={"ram": "70%"}, solver=solver
    )
    apart = run_strategy("xengine", problem)
    result = run_strategy("port_m", problem)
    assert apart.feasible and result.feasible, result.message
    return problem, apart, result


@pytest.mark.alone  # what PORT-M's MILP finds within 6 s
def test_port_m_hides_recomputation_on_the_pools_other_device():
    """The chain sample at 70% on two equal CPUs sharing their memory: XEngine's plan
    recomputes on the way back and pays for part of it; PORT-M recomputes on one CPU while
    the other computes (a stage ahead, then as its MILP finds), so its concurrent plan
    recomputes and still runs within 1% of the ideal (every node once), faster than
    XEngine's, within the pool's budget."""
    problem, apart, result = _xengine_and_port_m(POOLED_CPUS, 6)
    assert result.plan.concurrent and result.plan.version == 4
    assert result.plan.strategy == "port_m"
    verdict = simulate(result.plan, problem.graph, problem.costs)
    assert verdict.valid and verdict.total_ms == pytest.approx(result.simulation.total_ms)
    assert max(verdict.peak_bytes.values()) <= problem.budgets["cpu0"]
    ideal = problem.costs.ideal_ms()
    assert verdict.computes > len(problem.graph)
    assert verdict.total_ms <= ideal * 1.01
    assert apart.simulation.total_ms > ideal * 1.01


# A pool of a fast CPU and one ten times slower on the chain sample's nodes (launch-bound
# at batch 2), with storage fast enough to hide every page transfer.
_SSD = "storage_write_bandwidth=1e11,storage_read_bandwidth=1e11,storage_latency_us=0"
FAST_AND_SLOW = [
    parse_device(f"cpu0:cpu:pool=ram,{_SSD}"),
    parse_device(f"cpu1:cpu:pool=ram,launch_us=50,{_SSD}"),
]


def test_port_m_pages_on_the_pools_fastest_device_where_that_beats_recomputing():
    """The chain sample at 70% on a pool of a fast CPU and a slow one, with storage fast
    enough to hide every page transfer: XEngine recomputes; port_m takes ``port``'s plan
    on the fast CPU alone, which pages instead and runs at the ideal (POET's setting)."""
    devices = FAST_AND_SLOW
    problem, apart, result = _xengine_and_port_m(devices, 4)
    assert result.plan.strategy == "port_m" and "cpu0 alone: port" in result.message
    assert [d.name for d in result.plan.devices] == ["cpu0"]
    assert any(s.op in PAGE_OPS for s in result.plan.steps)
    verdict = simulate(result.plan, problem.graph, problem.costs)
    assert verdict.valid and verdict.peak_bytes["cpu0"] <= problem.budgets["cpu0"]
    assert verdict.total_ms < apart.simulation.total_ms


def test_port_m_leaves_its_milp_to_small_graphs_and_pages_beside_xengine():
    """Over ``port_m_milp_max_nodes`` nodes PORT-M's MILP is not built (it found nothing
    in its time on the bench's 79-179-node graphs): XEngine's search keeps the limit, and
    ``port``'s paging heuristics run on the fastest device in a process beside it. The
    pool of the test above: their paging plan on the fast CPU is returned, and the
    message says why no MILP ran."""
    devices = FAST_AND_SLOW
    solver = SolverSettings(
        options=SolveOptions(time_limit_s=4), search=SearchConfig(port_m_milp_max_nodes=10)
    )
    problem = build_problem(
        samples.chain(), batch=2, devices=devices, budgets={"ram": "70%"}, solver=solver
    )
    apart = run_strategy("xengine", problem)
    result = run_strategy("port_m", problem)
    assert result.feasible, result.message
    assert "PORT-M's MILP is not built over 19 nodes" in result.message
    assert "cpu0 alone: page_greedy" in result.message
    assert result.plan.solver is None or result.plan.solver.bound is None
    assert [d.name for d in result.plan.devices] == ["cpu0"]
    assert any(s.op in PAGE_OPS for s in result.plan.steps)
    verdict = simulate(result.plan, problem.graph, problem.costs, problem.budgets)
    assert verdict.valid and verdict.total_ms < apart.simulation.total_ms


def test_eviction_on_a_pool_holds_each_value_once_and_runs_each_node_where_it_is_fastest():
    """The chain sample at 40% on a pool of two CPUs, the first three times slower on
    backward nodes and the second on forward ones: greedy eviction on the pool's memory
    (``evict_pooled``) recomputes to fit the pool's budget, computes every node on its
    faster device, and is faster than eviction on either device alone with the pool's
    memory; XEngine's search, which starts from it, ends no slower."""
    problem = split_pool(POOLED_CPUS, 2)
    backward = np.array([node.kind is NodeKind.BACKWARD for node in problem.graph.nodes])
    pooled = evict_pooled(problem, ("cpu0", "cpu1"))
    assert pooled.feasible, pooled.message
    verdict = simulate(pooled.plan, problem.graph, problem.costs, problem.budgets)
    assert verdict.valid and max(verdict.peak_bytes.values()) <= problem.budgets["cpu0"]
    computes = [s for s in pooled.plan.steps if isinstance(s, Compute)]
    assert len(computes) > len(problem.graph)  # it recomputes
    faster = {0: "cpu0", 1: "cpu1"}  # forward nodes, backward nodes
    assert all(s.device == faster[int(backward[s.node])] for s in computes)
    for name in ("cpu0", "cpu1"):
        alone = greedy_evict(problem, name)
        assert not alone.feasible or alone.time_ms > pooled.time_ms
    assert run_strategy("xengine", problem).time_ms <= pooled.time_ms


def test_port_m_says_it_needs_devices_that_share_a_pool():
    devices = [parse_device("cpu0:cpu"), parse_device("cpu1:cpu")]
    problem = build_problem(samples.chain(), batch=2, devices=devices)
    result = run_strategy("port_m", problem)
    assert not result.feasible
    assert "port_m plans devices that share one memory pool" in result.message
    assert "cpu0:cpu0, cpu1:cpu1" in result.message


@pytest.mark.alone  # from the schedule XEngine's search reaches within 4 s
def test_recomputing_a_stage_ahead_on_the_other_device_shortens_the_plan():
    """XEngine's plan for the chain sample at 70% on two pooled CPUs recomputes and pays
    for part of it; the values moved a stage earlier onto the other CPU and kept run
    beside that stage's own work: the same computations, a concurrent plan within 1% of
    the ideal (every node once), within the pool's budget."""
    solver = SolverSettings(options=SolveOptions(time_limit_s=4))
    problem = build_problem(
        samples.chain(), batch=2, devices=POOLED_CPUS, budgets={"ram": "70%"}, solver=solver
    )
    xengine = run_strategy("xengine", problem)
    assert xengine.feasible and xengine.schedule is not None
    ahead = recompute_ahead(problem, xengine.schedule, "port_m")
    assert ahead.fits and ahead.plan.concurrent
    assert ahead.simulation.computes == xengine.simulation.computes
    ideal = problem.costs.ideal_ms()
    assert xengine.simulation.total_ms > ideal * 1.01 and ahead.cost_ms <= ideal * 1.01
    verdict = simulate(ahead.plan, problem.graph, problem.costs)
    assert verdict.valid and max(verdict.peak_bytes.values()) <= problem.budgets["cpu0"]


@pytest.mark.alone  # a concurrent plan within a 4 s limit
@pytest.mark.parametrize("strategy", ["port_m", "xengine"])
def test_no_bound_is_reported_for_concurrent_plans(strategy):
    """The searches on a pool bound their own models (XEngine's stages one at a time),
    which a concurrent plan may run below: neither the progress reports nor the plan carry
    their bound, and the plan is not called optimal by it."""
    reports: list[Progress] = []
    solver = SolverSettings(
        options=SolveOptions(time_limit_s=4),
        search=SearchConfig(port_m_milp_max_nodes=10),
        on_progress=reports.append,
    )
    problem = build_problem(
        samples.chain(), batch=2, devices=POOLED_CPUS, budgets={"ram": "70%"}, solver=solver
    )
    result = run_strategy(strategy, problem)
    assert result.feasible and result.plan.concurrent, result.message
    solver = result.plan.solver
    assert solver is None or (solver.bound is None and solver.status != "optimal")
    assert reports and all(r.bound is None and r.gap is None for r in reports)
    assert any(r.objective is not None for r in reports)


@pytest.mark.alone
def test_auto_plans_a_pool_with_port_m():
    """``auto``'s exact phase on the devices of one pool is PORT-M, not XEngine: on the
    chain sample at 70% on two pooled CPUs its plan is concurrent, within the pool's
    budget, and hides its recomputation (within 1% of the ideal), which XEngine's does
    not."""
    problem, apart, _ = _xengine_and_port_m(POOLED_CPUS, 6)
    result = run_strategy("auto", problem)
    assert result.feasible, result.message
    assert result.plan.strategy == "port_m" and result.plan.concurrent
    verdict = simulate(result.plan, problem.graph, problem.costs, problem.budgets)
    ideal = problem.costs.ideal_ms()
    assert verdict.valid and verdict.total_ms <= ideal * 1.01
    assert apart.simulation.total_ms > ideal * 1.01
