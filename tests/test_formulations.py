"""Checkmate's MILP and XEngine's MIQP (remat.formulations), solved with scipy's HiGHS and
judged against brute force through the compiler and the simulator."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp

from remat.compiler import compile_plan
from remat.costs import CostModel, CostSource, analytical_costs
from remat.devices import Device, DeviceKind
from remat.errors import ScheduleError
from remat.formulations import build_checkmate, single_device_fixed_bytes
from remat.formulations.xengine import build_xengine
from remat.graph import Graph
from remat.plan import PlanDevice
from remat.schedule import Schedule
from remat.simulator import Simulation, simulate
from remat.solvers import runner
from remat.solvers.model import MILPModel, SolveOptions, SolveStatus
from remat.strategies.common.problem import Problem, evaluate
from remat.strategies.common.rsolve import solve_and_prune, solve_r
from remat.training import training_graph

from graphs import chain, diamond, forward

CPU = Device("cpu0", DeviceKind.CPU)
GPU = Device("cuda0", DeviceKind.CUDA)

# --- helpers ---------------------------------------------------------------------------------


def solve(model: MILPModel) -> tuple[float | None, np.ndarray | None]:
    """(optimum, x) with scipy's HiGHS, (None, None) if infeasible. Bilinear terms are
    linearized. Presolve is off: scipy 1.17.1's bundled HiGHS presolve reported a wrong
    "optimal" (28 instead of 24) on one 3-stage XEngine instance of this file, where
    highspy 1.15, SCIP and HiGHS without presolve all find 24."""
    lin = model.linearized()
    result = milp(
        lin.c,
        constraints=LinearConstraint(lin.A, lin.row_lb, lin.row_ub),
        bounds=Bounds(lin.lb, lin.ub),
        integrality=lin.integer.astype(int),
        options={"presolve": False},
    )
    if result.status == 2:
        return None, None
    assert result.status == 0, result.message
    return float(result.fun) + lin.offset, result.x[: model.n_vars]


def hand_costs(graph: Graph, devices: int, seed: int) -> CostModel:
    """Distinct integer compute times per node and device, copy times per ordered pair."""
    rng = np.random.default_rng(seed)
    n = len(graph)
    compute = rng.integers(1, 20, size=(n, devices)).astype(float)
    copy = rng.integers(1, 10, size=(n, devices, devices)).astype(float)
    copy[:, np.arange(devices), np.arange(devices)] = 0.0
    names = tuple(Device(f"dev{d}", DeviceKind.CPU) for d in range(devices))
    out = np.array([node.output_bytes for node in graph.nodes], dtype=np.int64)
    return CostModel(CostSource.PROFILED, names, compute, copy, out)


def run(graph: Graph, costs: CostModel, schedule: Schedule) -> Simulation:
    """Compile and simulate without budgets (peaks are compared to budgets afterwards)."""
    devices = tuple(PlanDevice.of(d, None) for d in costs.devices if d.name in schedule.devices)
    plan = compile_plan(graph, schedule, devices, "test", costs)
    result = simulate(plan, graph, costs, {})
    assert result.valid, result.violation
    return result


Table = list[tuple[tuple[int, ...], float]]  # (peak per device, time) of every schedule


def brute_force_one(graph: Graph, costs: CostModel, device: str) -> Table:
    """Every S over the strictly lower triangle with its cheapest R (solve_r: any other R
    for this S adds recomputations, i.e. time and memory)."""
    T = len(graph)
    cells = [(t, i) for t in range(T) for i in range(t)]
    assert len(cells) <= 16
    table: Table = []
    for bits in range(1 << len(cells)):
        S = np.zeros((T, T), dtype=bool)
        for q, (t, i) in enumerate(cells):
            S[t, i] = bool(bits >> q & 1)
        result = run(graph, costs, Schedule.single(device, solve_r(graph, S), S))
        table.append(((result.peak_bytes[device],), result.total_ms))
    return table


def valid_schedules(graph: Graph, D: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every schedule over D devices: per stage, the values kept on each device (a subset of
    what it computed or kept the stage before, XEngine eq. 11), the device of the new node
    (eq. 8-9) and any recomputations on each device, as long as every computed node's
    dependencies are computed or kept on some device (eq. 12)."""
    T = len(graph)
    deps = [list(node.deps) for node in graph.nodes]
    R = np.zeros((D, T, T), dtype=bool)
    S = np.zeros((D, T, T), dtype=bool)

    def subsets(items: list[int]) -> list[tuple[int, ...]]:
        return [c for r in range(len(items) + 1) for c in itertools.combinations(items, r)]

    def stage(t: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if t == T:
            yield R.copy(), S.copy()
            return
        before = R[:, t - 1] | S[:, t - 1] if t else np.zeros((D, T), dtype=bool)
        keeps = [subsets(np.flatnonzero(before[d]).tolist()) for d in range(D)]
        recomputes = subsets(list(range(t)))
        for keep in itertools.product(*keeps):
            for new in range(D):
                for extra in itertools.product(recomputes, repeat=D):
                    R[:, t], S[:, t] = False, False
                    for d in range(D):
                        S[d, t, list(keep[d])] = True
                        R[d, t, list(extra[d])] = True
                    R[new, t, t] = True
                    there = (R[:, t] | S[:, t]).any(axis=0)
                    if all(there[deps[v]].all() for v in np.flatnonzero(R[:, t].any(axis=0))):
                        yield from stage(t + 1)
        R[:, t], S[:, t] = False, False

    yield from stage(0)


def brute_force_all(graph: Graph, costs: CostModel) -> Table:
    names = tuple(d.name for d in costs.devices)
    table: Table = []
    for R, S in valid_schedules(graph, len(names)):
        result = run(graph, costs, Schedule(names, R, S))
        table.append((tuple(result.peak_bytes[n] for n in names), result.total_ms))
    return table


def optimum(table: Table, budgets: tuple[int, ...]) -> float | None:
    fits = [c for peaks, c in table if all(p <= b for p, b in zip(peaks, budgets, strict=True))]
    return min(fits, default=None)


def budget_grid(table: Table) -> list[tuple[int, ...]]:
    """Every combination of reachable peaks per device, and one byte below the smallest."""
    axes = []
    for d in range(len(table[0][0])):
        peaks = sorted({p[d] for p, _ in table})
        axes.append([peaks[0] - 1, *peaks])
    return list(itertools.product(*axes))


def assert_fits(graph: Graph, costs: CostModel, schedule: Schedule, budgets: dict) -> float:
    """The schedule is correct, and its plan is valid within the budgets; returns its time."""
    schedule.check(graph)
    evaluation = evaluate(Problem(graph, costs, budgets), schedule, "test")
    assert evaluation.fits, evaluation.simulation.violation
    return evaluation.cost_ms


def residual() -> Graph:
    """Two residual blocks: 0 -> 1 -> 2 -> add(0, 2) = 3 -> 4 -> 5 -> add(3, 5) = 6 -> 7."""
    return forward([(), (0,), (1,), (0, 2), (3,), (4,), (3, 5), (6,)], op="Conv")


def with_outputs(graph: Graph, outputs: tuple[int, ...]) -> Graph:
    return replace(graph, outputs=outputs)


# --- brute force: one device -------------------------------------------------------------------

ONE_DEVICE: dict[str, Callable[[], Graph]] = {
    "relu-chain": lambda: training_graph(forward([(), (0,)], [3000, 1000])),
    "conv-chain": lambda: training_graph(forward([(), (0,)], [1000, 3000], op="Conv")),
    "two-inputs": lambda: training_graph(forward([(), ()], [2000, 1000], op="MaxPool")),
    "skip": lambda: forward([(), (0,), (1,), (2,), (0, 3)], [3000, 1000, 2000, 1000, 500]),
    "diamond": diamond,
    "inner-output": lambda: with_outputs(
        forward([(), (0,), (1,), (2,)], [800, 200, 600, 400]), (1, 3)
    ),
}


@pytest.mark.parametrize("name", ONE_DEVICE)
def test_checkmate_optimum_equals_brute_force(name: str) -> None:
    graph = ONE_DEVICE[name]()
    costs = hand_costs(graph, 1, seed=len(name))
    table = brute_force_one(graph, costs, "dev0")
    fixed = single_device_fixed_bytes(graph)
    for (budget,) in budget_grid(table):
        expected = optimum(table, (budget,))
        formulation = build_checkmate(graph, costs, "dev0", budget, fixed)
        objective, x = solve(formulation.model)
        if expected is None:
            assert objective is None, budget
            continue
        assert objective == pytest.approx(expected), budget
        assert x is not None
        schedule = formulation.decode(x)
        assert assert_fits(graph, costs, schedule, {"dev0": budget}) == pytest.approx(objective)
        assert formulation.check(formulation.encode(schedule)) == []
        single, _ = solve(build_xengine(graph, costs, {"dev0": budget}).model)
        assert single == pytest.approx(objective), budget


def test_fixed_memory_is_the_simulators() -> None:
    graph = training_graph(residual())
    costs = analytical_costs(graph, [CPU])
    schedule = Schedule.single("cpu0", *solve_and_prune(graph, np.tril(np.ones((17, 17)), -1)))
    assert run(graph, costs, schedule).fixed_bytes["cpu0"] == single_device_fixed_bytes(graph)


# --- brute force: two devices --------------------------------------------------------------------

TWO_DEVICES: dict[str, Callable[[], Graph]] = {
    "training": lambda: training_graph(forward([()], [400])),
    "join": lambda: forward([(), (), (0, 1)], [400, 600, 200]),
    "inner-output": lambda: with_outputs(forward([(), (0,), (1,)], [600, 200, 400]), (1, 2)),
}


@pytest.mark.parametrize("name", TWO_DEVICES)
def test_xengine_optimum_equals_brute_force_on_two_devices(name: str) -> None:
    graph = TWO_DEVICES[name]()
    costs = hand_costs(graph, 2, seed=len(name))
    table = brute_force_all(graph, costs)
    for budgets in budget_grid(table):
        expected = optimum(table, budgets)
        named = {"dev0": budgets[0], "dev1": budgets[1]}
        formulation = build_xengine(graph, costs, named)
        objective, x = solve(formulation.model)
        if expected is None:
            assert objective is None, budgets
            continue
        assert objective == pytest.approx(expected), budgets
        assert x is not None
        schedule = formulation.decode(x)
        assert assert_fits(graph, costs, schedule, named) == pytest.approx(objective)
        assert formulation.check(formulation.encode(schedule, repair=False)) == []


def keeps_all(graph: Graph, R: np.ndarray, S: np.ndarray) -> bool:
    """No recomputation, and each value kept on its device until its last user's stage
    (outputs for good): the schedules of ``XEngineModel.keep_all``."""
    _, T, n = R.shape
    users = graph.users()
    home = R[:, np.arange(n), np.arange(n)]  # [D, n]
    for t in range(T):
        for i in range(t):
            kept = (bool(users[i]) and t <= max(users[i])) or i in graph.outputs
            if R[:, t, i].any() or (S[:, t, i] != (home[:, i] & kept)).any():
                return False
    return True


@pytest.mark.parametrize("name", TWO_DEVICES)
def test_keep_all_is_the_best_schedule_without_recomputation(name: str) -> None:
    graph = TWO_DEVICES[name]()
    costs = hand_costs(graph, 2, seed=len(name))
    names = tuple(d.name for d in costs.devices)
    table: Table = []
    for R, S in valid_schedules(graph, 2):
        if keeps_all(graph, R, S):
            result = run(graph, costs, Schedule(names, R, S))
            table.append((tuple(result.peak_bytes[d] for d in names), result.total_ms))
    assert table
    for budgets in budget_grid(table):
        formulation = build_xengine(graph, costs, dict(zip(names, budgets, strict=True)))
        objective, x = solve(formulation.keep_all())
        assert objective == pytest.approx(optimum(table, budgets)), budgets
        if x is not None:
            schedule = formulation.decode(x)
            assert keeps_all(graph, schedule.R, schedule.S)
            full, _ = solve(formulation.model)  # a restriction: never below the optimum
            assert full is not None and full <= objective + 1e-9


@pytest.mark.parametrize("name", TWO_DEVICES)
def test_placed_is_the_best_schedule_with_each_node_on_its_home(name: str) -> None:
    """``XEngineModel.placed(home)``: the optimum over the schedules that compute node i
    (recomputations included) only on device home[i]; ``home`` reads that placement back."""
    graph = TWO_DEVICES[name]()
    costs = hand_costs(graph, 2, seed=len(name))
    names = tuple(d.name for d in costs.devices)
    n = len(graph)
    home = np.arange(n) % 2  # alternate: every edge crosses devices
    elsewhere = np.arange(2)[:, None, None] != home[None, None, :]
    table: Table = []
    for R, S in valid_schedules(graph, 2):
        if not (R & elsewhere).any():
            result = run(graph, costs, Schedule(names, R, S))
            table.append((tuple(result.peak_bytes[d] for d in names), result.total_ms))
    assert table
    for budgets in budget_grid(table):
        formulation = build_xengine(graph, costs, dict(zip(names, budgets, strict=True)))
        objective, x = solve(formulation.placed(home))
        assert objective == pytest.approx(optimum(table, budgets)), budgets
        if x is not None:
            assert not (formulation.decode(x).R & elsewhere).any()
            assert np.array_equal(formulation.home(x), home)
            full, _ = solve(formulation.model)  # a restriction: never below the optimum
            assert full is not None and full <= objective + 1e-9


def test_copy_cover_rows_close_the_lp_gap_of_the_copy_term() -> None:
    """With ample memory on two devices, the linearization's LP splits values over both
    devices and copies them for free; with the cover rows on W's products it reaches the
    integer optimum here. The brute-force tests above show the rows cut off no optimum."""
    graph = training_graph(residual())
    for seed in range(4):
        formulation = build_xengine(graph, hand_costs(graph, 2, seed), {"dev0": None, "dev1": None})
        best, _ = solve(formulation.model)
        lp = formulation.lp_relaxation()
        covered, _ = solve(lp)
        loose, _ = solve(replace(lp, product_rows=None))
        assert best is not None and covered is not None and loose is not None
        assert covered == pytest.approx(best)
        assert loose < 0.95 * best


# --- larger graphs ------------------------------------------------------------------------------


def test_ample_memory_costs_the_ideal() -> None:
    graph = training_graph(residual())
    costs = analytical_costs(graph, [CPU, GPU])
    fixed = single_device_fixed_bytes(graph)
    for device in ("cpu0", "cuda0"):
        for budget in (None, 10**12):
            objective, _ = solve(build_checkmate(graph, costs, device, budget, fixed).model)
            assert objective == pytest.approx(costs.ideal_ms(device))
        objective, _ = solve(build_xengine(graph, costs, {device: None}).model)
        assert objective == pytest.approx(costs.ideal_ms(device))
    objective, _ = solve(build_xengine(graph, costs, {"cpu0": None, "cuda0": None}).model)
    assert objective is not None
    assert costs.ideal_ms() - 1e-9 <= objective <= costs.ideal_ms("cuda0") + 1e-9


def test_impossible_budgets_are_infeasible() -> None:
    graph = training_graph(chain(2))
    costs = analytical_costs(graph, [CPU, GPU])
    fixed = single_device_fixed_bytes(graph)
    largest = int(costs.output_bytes.max())
    for budget in (fixed - 1, fixed + largest - 1):
        assert solve(build_checkmate(graph, costs, "cpu0", budget, fixed).model)[0] is None
        assert solve(build_xengine(graph, costs, {"cpu0": budget}).model)[0] is None
    both = {"cpu0": fixed + largest - 1, "cuda0": fixed + largest - 1}
    assert solve(build_xengine(graph, costs, both).model)[0] is None


@pytest.mark.parametrize("fraction", [0.9, 0.7])
def test_tight_budgets_decode_to_valid_plans(fraction: float) -> None:
    graph = training_graph(residual())
    costs = analytical_costs(graph, [CPU, GPU])
    fixed = single_device_fixed_bytes(graph)
    peak = fixed + int(costs.output_bytes.sum())
    budget = fixed + int((peak - fixed) * fraction)
    formulation = build_checkmate(graph, costs, "cpu0", budget, fixed)
    objective, x = solve(formulation.model)
    assert objective is not None and x is not None
    assert objective > costs.ideal_ms("cpu0")  # the budget forces recomputation
    schedule = formulation.decode(x)
    assert assert_fits(graph, costs, schedule, {"cpu0": budget}) == pytest.approx(objective)
    relaxed, _ = solve(formulation.lp_relaxation())
    assert relaxed is not None and relaxed <= objective + 1e-9
    assert not formulation.lp_relaxation().integer.any()


def test_xengine_two_devices_at_tight_budgets_fit_and_cost_no_more_than_predicted() -> None:
    graph = training_graph(forward([(), (0,), (1,)], [3000, 1000, 2000]))
    costs = hand_costs(graph, 2, seed=7)
    fixed = single_device_fixed_bytes(graph)
    budgets = {"dev0": fixed + 6000, "dev1": fixed + 3000}  # dev1 alone cannot do it
    formulation = build_xengine(graph, costs, budgets)
    objective, x = solve(formulation.model)
    assert objective is not None and x is not None
    simulated = assert_fits(graph, costs, formulation.decode(x), budgets)
    assert simulated <= objective + 1e-9
    # Either device alone, at its own budget, is worse than the pair.
    alone = [solve(build_checkmate(graph, costs, d, b, fixed).model)[0] for d, b in budgets.items()]
    assert alone[1] is None and alone[0] is not None and objective < alone[0]


# --- encode -------------------------------------------------------------------------------------


def random_clean_schedule(graph: Graph, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    T = len(graph)
    S = np.tril(rng.random((T, T)) < 0.4, -1)
    return solve_and_prune(graph, S)


@pytest.mark.parametrize("seed", range(6))
def test_encoding_a_clean_schedule_is_exact(seed: int) -> None:
    """On a clean schedule (solve_and_prune), the MILP's time is the simulated time and its
    peak memory is the simulated peak, to the byte."""
    rng = np.random.default_rng(seed)
    graph = training_graph([chain(4), diamond(), residual()][seed % 3])
    costs = analytical_costs(graph, [CPU])
    R, S = random_clean_schedule(graph, rng)
    schedule = Schedule.single("cpu0", R, S)
    result = run(graph, costs, schedule)
    fixed = single_device_fixed_bytes(graph)
    checkmate = build_checkmate(graph, costs, "cpu0", None, fixed)
    xengine = build_xengine(graph, costs, {"cpu0": None})
    for formulation in (checkmate, xengine):
        x = formulation.encode(schedule, repair=False)
        assert formulation.check(x) == []
        assert formulation.model.objective(x) == pytest.approx(result.total_ms)
        peak = x[formulation.U[formulation.U >= 0]].max() * formulation.unit
        assert peak == pytest.approx(result.peak_bytes["cpu0"])
    peak = result.peak_bytes["cpu0"]
    assert build_checkmate(graph, costs, "cpu0", peak, fixed).encode(schedule) is not None
    with pytest.raises(ScheduleError):
        build_checkmate(graph, costs, "cpu0", peak - 1, fixed).encode(schedule)


def random_schedule(graph: Graph, D: int, rng: np.random.Generator) -> Schedule:
    """A random valid schedule over D devices (random placement, keeps, recomputations)."""
    T = len(graph)
    useful = np.arange(T)[:, None] <= _last_descendant(graph)[None, :]
    R = np.zeros((D, T, T), dtype=bool)
    S = np.zeros((D, T, T), dtype=bool)
    for t in range(T):
        if t:
            S[:, t] = (R[:, t - 1] | S[:, t - 1]) & (rng.random((D, T)) < 0.5) & useful[t]
        R[rng.integers(D), t, t] = True
        R[:, t, :t] |= (rng.random((D, t)) < 0.15) & useful[t, :t]
        for v in range(t, -1, -1):  # recompute what a computed node misses, on any device
            if R[:, t, v].any():
                for u in graph.nodes[v].deps:
                    if not (R[:, t, u] | S[:, t, u]).any():
                        R[rng.integers(D), t, u] = True
    schedule = Schedule(tuple(f"dev{d}" for d in range(D)), R, S)
    schedule.check(graph)
    return schedule


def _last_descendant(graph: Graph) -> np.ndarray:
    last = np.full(len(graph), -1)
    users = graph.users()
    for i in range(len(graph) - 1, -1, -1):
        for j in users[i]:
            last[i] = max(last[i], j, last[j])
    return last


@pytest.mark.parametrize("seed", range(8))
def test_xengine_time_and_memory_are_conservative(seed: int) -> None:
    """Any correct schedule over two devices: the MIQP's objective is at least the simulated
    time and its U at least the simulated memory on every device."""
    rng = np.random.default_rng(seed)
    graph = training_graph([chain(3), diamond(), residual()][seed % 3])
    if seed % 4 == 3:
        graph = with_outputs(forward([(), (0,), (1,), (0, 2), (3,)]), (2, 4))
    costs = hand_costs(graph, 2, seed)
    formulation = build_xengine(graph, costs, {"dev0": None, "dev1": None})
    for _ in range(5):
        schedule = random_schedule(graph, 2, rng)
        result = run(graph, costs, schedule)
        x = formulation.encode(schedule, repair=False)
        assert formulation.check(x) == []
        assert formulation.model.objective(x) >= result.total_ms - 1e-9
        for d, name in enumerate(formulation.devices):
            U = x[formulation.U[d][formulation.U[d] >= 0]]
            assert U.max() * formulation.unit >= result.peak_bytes[name] - 1e-6


def test_encode_repairs_useless_recomputations() -> None:
    graph = training_graph(chain(3))
    costs = analytical_costs(graph, [CPU])
    fixed = single_device_fixed_bytes(graph)
    T = len(graph)
    R, S = solve_and_prune(graph, np.tril(np.ones((T, T), dtype=bool), -1))
    peak = run(graph, costs, Schedule.single("cpu0", R, S)).peak_bytes["cpu0"]
    formulation = build_checkmate(graph, costs, "cpu0", peak, fixed)
    repaired = 0
    for t in range(1, T):  # recompute node 0 where nothing needs it: over the budget?
        spurious = R.copy()
        spurious[t, 0] = True
        schedule = Schedule.single("cpu0", spurious, S)
        try:
            formulation.encode(schedule, repair=False)
        except ScheduleError:
            x = formulation.encode(schedule)
            assert formulation.check(x) == []
            assert formulation.model.objective(x) == pytest.approx(costs.ideal_ms("cpu0"))
            repaired += 1
    assert repaired
    # Recomputing a model output is a no-op for the compiler (it keeps outputs), and the
    # model has no variable for it: repaired, or refused without repair.
    graph = with_outputs(forward([(), (0,), (1,), (2,)]), (1, 3))
    costs = analytical_costs(graph, [CPU])
    R, S = solve_and_prune(graph, np.tril(np.ones((4, 4), dtype=bool), -1))
    R[2, 1] = True
    formulation = build_checkmate(graph, costs, "cpu0", None, single_device_fixed_bytes(graph))
    schedule = Schedule.single("cpu0", R, S)
    assert formulation.model.objective(formulation.encode(schedule)) == pytest.approx(
        costs.ideal_ms("cpu0")
    )
    with pytest.raises(ScheduleError):
        formulation.encode(schedule, repair=False)


# --- scaling and size ---------------------------------------------------------------------------


def test_gcd_scaling_keeps_memory_coefficients_small() -> None:
    page = 4096
    graph = training_graph(forward([(), (0,), (1,), (0, 2)], [3 * page, 5 * page, 2 * page, page]))
    costs = analytical_costs(graph, [CPU, GPU])
    fixed = single_device_fixed_bytes(graph)
    budget = fixed + 9 * page + page // 2  # rounds down to 9 pages of activations
    checkmate = build_checkmate(graph, costs, "cpu0", budget, fixed)
    assert checkmate.unit == page
    assert np.abs(checkmate.model.A.data).max() <= 2 * len(graph)  # sizes and kappa
    U = checkmate.model.ub[checkmate.U[checkmate.U >= 0]]
    assert U.max() == pytest.approx(fixed / page + 9)
    exact = build_checkmate(graph, costs, "cpu0", fixed + 9 * page, fixed)
    assert solve(checkmate.model)[0] == pytest.approx(solve(exact.model)[0])
    xengine = build_xengine(graph, costs, {"cpu0": budget, "cuda0": budget})
    assert xengine.unit == page
    assert np.abs(xengine.model.A.data).max() <= 2 * 2 * len(graph)


def test_a_300_stage_graph_builds_with_pruned_variables() -> None:
    graph = training_graph(chain(150))
    costs = analytical_costs(graph, [CPU, GPU])
    fixed = single_device_fixed_bytes(graph)
    checkmate = build_checkmate(graph, costs, "cpu0", fixed + 10**6, fixed)
    xengine = build_xengine(graph, costs, {"cpu0": 10**7, "cuda0": 10**7})
    assert len(graph) == 301
    T, E = len(graph), sum(len(node.deps) for node in graph.nodes)
    counts = checkmate.builder.counts()
    assert counts["var R"] <= T * (T + 1) // 2 and counts["var S"] <= T * (T - 1) // 2
    assert counts["var FREE"] < T * E // 2  # the paper's T x |E|, halved by pruning
    assert xengine.model.n_vars > 2 * checkmate.model.n_vars


# --- every backend agrees with brute force ----------------------------------------------------


@pytest.mark.parametrize("backend", runner.BACKENDS)
def test_every_backend_reaches_the_brute_force_optimum(backend: str) -> None:
    """Gurobi runs under its free size-limited license here: the one-device model is small
    enough; a model over the limit falls back to HiGHS and says so."""
    one = ONE_DEVICE["diamond"]()
    costs = hand_costs(one, 1, seed=7)
    table = brute_force_one(one, costs, "dev0")
    budget = sorted(budget_grid(table))[len(budget_grid(table)) // 2][0]
    model = build_checkmate(one, costs, "dev0", budget, single_device_fixed_bytes(one)).model
    result = runner.solve(model, backend=backend, options=SolveOptions(time_limit_s=30))
    # CP-SAT too proves it: the continuous U lies on the lattice its rows imply (fixed
    # memory + whole units), so the integer model is exact.
    assert result.status is SolveStatus.OPTIMAL, result.message
    assert result.backend == backend
    assert result.objective == pytest.approx(optimum(table, (budget,)), rel=1e-4)

    two = TWO_DEVICES["join"]()
    costs2 = hand_costs(two, 2, seed=4)
    table2 = brute_force_all(two, costs2)
    budgets = budget_grid(table2)[len(budget_grid(table2)) // 2]
    model2 = build_xengine(two, costs2, {"dev0": budgets[0], "dev1": budgets[1]}).model
    result2 = runner.solve(model2, backend=backend, options=SolveOptions(time_limit_s=30))
    assert result2.objective == pytest.approx(optimum(table2, budgets), rel=1e-4)
    if result2.backend != backend:
        assert backend == "gurobi" and "license" in result2.message
