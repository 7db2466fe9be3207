"""Graph coarsening (``remat.strategies.exact.coarsen``): which chains fuse, the coarse costs, and
coarse schedules expanded into valid fine ones; the optimal strategies' coarse phase."""

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from regime import CPU, budgeted

from remat import samples
from remat.costs import analytical_costs
from remat.graph import NodeKind
from remat.onnx_ingest import forward_graph
from remat.plan import Compute
from remat.schedule import Schedule
from remat.solvers.model import Progress, SolveOptions
from remat.strategies import BASELINES, run_strategy
from remat.strategies.common.problem import Problem, SolverSettings, StrategyResult, evaluate
from remat.strategies.common.rsolve import clean_placed
from remat.strategies.exact import search as search_module
from remat.strategies.exact.checkmate import checkmate_milp
from remat.strategies.exact.coarsen import coarsen
from remat.strategies.exact.decompose import Part
from remat.strategies.exact.state import Search
from remat.strategies.exact.xengine import xengine
from remat.strategies.heuristics.placed import placed_greedy
from remat.training import training_graph

from graphs import chain


def _problem(name, percent, settings=None):
    graph = training_graph(forward_graph(samples.ZOO[name](), batch=4))
    return budgeted(graph, percent, settings=settings)


def test_resnet_fuses_conv_norm_relu_and_mirrors_it_backwards():
    problem = _problem("resnet18", 100)
    coarse = coarsen(problem.graph, problem.costs)
    graph = problem.graph
    ops = ["+".join(graph.nodes[m].op for m in g) for g in coarse.groups]
    assert ops.count("Conv+BatchNormalization+Relu") >= 8
    forward_groups = [g for g in coarse.groups if graph.nodes[g[0]].kind is NodeKind.FORWARD]
    backward_groups = [g for g in coarse.groups if graph.nodes[g[0]].kind is NodeKind.BACKWARD]
    assert sum(len(g) > 1 for g in forward_groups) == sum(len(g) > 1 for g in backward_groups)
    for group in coarse.groups:  # contiguous, one kind, one op per chain link
        assert list(group) == list(range(group[0], group[-1] + 1))
        assert len({graph.nodes[m].kind for m in group}) == 1
    assert coarse.ratio < 0.5
    for c, group in enumerate(coarse.groups):
        assert coarse.costs.compute_ms[c] == pytest.approx(
            problem.costs.compute_ms[list(group)].sum(0)
        )
        assert coarse.costs.output_bytes[c] >= problem.costs.output_bytes[group[-1]]


def test_a_coarse_placement_puts_each_fine_node_on_its_groups_device():
    problem = _problem("unet", 100)
    coarse = coarsen(problem.graph, problem.costs)
    home = np.arange(len(coarse.graph)) % 2
    fine = coarse.expand_home(home)
    assert fine.shape == (len(problem.graph),)
    for c, group in enumerate(coarse.groups):
        assert (fine[list(group)] == home[c]).all()


def test_groups_stop_at_max_group():
    graph = training_graph(chain(6))  # Relu after Relu: each fuses into its producer
    costs = analytical_costs(graph, [CPU])
    coarse = coarsen(graph, costs)
    assert max(len(g) for g in coarse.groups) <= 4
    assert sum(len(g) for g in coarse.groups) == len(graph)


@pytest.mark.parametrize("name", ["vgg16", "resnet18", "unet"])
def test_expanded_baselines_are_valid_no_costlier_and_within_the_coarse_peak(name):
    problem = _problem(name, 100)
    coarse = coarsen(problem.graph, problem.costs)
    coarse_problem = Problem(coarse.graph, coarse.costs, {})
    checked = 0
    for strategy in BASELINES:
        for device in ("cpu0", "cuda0"):
            try:
                result = run_strategy(strategy, coarse_problem, device)
            except Exception:
                continue  # not applicable to this graph (e.g. chain-only)
            fine = coarse.expand(result.schedule)
            fine.check(problem.graph)
            # the coarse accounting covers the fine plan: it fits the coarse plan's peak
            peak = dict(result.simulation.peak_bytes)
            evaluation = evaluate(Problem(problem.graph, problem.costs, peak), fine, strategy)
            assert evaluation.fits, (strategy, device, evaluation.simulation.violation)
            assert evaluation.cost_ms <= result.simulation.total_ms * (1 + 1e-9)
            checked += 1
    assert checked >= 8


def test_expanded_multi_device_plan_fits_where_no_single_device_does():
    problem = _problem("resnet18", 25)
    coarse = coarsen(problem.graph, problem.costs)
    names = ["cpu0", "cuda0"]
    coarse_problem = Problem(coarse.graph, coarse.costs, problem.budgets)
    result = placed_greedy(coarse_problem, names, fit_budget_s=60.0)
    assert result.feasible
    fine = coarse.expand(result.schedule)
    fine.check(problem.graph)
    evaluation = evaluate(problem, fine, "xengine")
    assert evaluation.fits
    assert {s.device for s in evaluation.plan.steps if isinstance(s, Compute)} == set(names)


def test_clean_drops_unread_recomputations_and_checkpoints():
    graph = training_graph(chain(3))  # 0 1 2 forward, 3 loss, 4 5 6 = grads of 2 1 0
    T = len(graph)
    R = np.zeros((1, T, T), dtype=bool)
    R[0, np.arange(T), np.arange(T)] = True
    S = np.tril(np.ones((1, T, T), dtype=bool), -1)
    R[0, 5, 0] = R[0, 4, 1] = True  # recomputed while kept on the same device
    Rc, Sc = clean_placed(graph, R, S)
    Schedule(("cpu0",), Rc, Sc).check(graph)
    assert np.array_equal(Rc[0], np.eye(T, dtype=bool))
    assert Sc[0, 5, 1] and Sc[0, 6, 0]  # read by the gradients of 1 and 0
    assert not Sc[0, 6, 2] and not Sc[0, 6, 1]  # nobody reads them in stage 6 or later


def _record_the_fine_heuristic(monkeypatch) -> list[float]:
    """The cost of the plan of the multi-device heuristic on the fine graph, xengine's warm
    start (the first it runs: the coarse graph's solve starts after it), once it returns."""
    heuristic_ms: list[float] = []

    def recorded(*args, **kwargs) -> StrategyResult:
        result = placed_greedy(*args, **kwargs)
        if not heuristic_ms:
            assert result.simulation is not None
            heuristic_ms.append(result.simulation.total_ms)
        return result

    monkeypatch.setattr(search_module, "placed_greedy", recorded)
    return heuristic_ms


def test_xengine_improves_on_the_fine_heuristic_through_the_coarse_graph(monkeypatch):
    """Cancelled at its first plan cheaper than the heuristic's, which it keeps."""
    seen: list[Progress] = []
    cancel = threading.Event()
    heuristic_ms = _record_the_fine_heuristic(monkeypatch)

    def on_plan(result: StrategyResult) -> None:
        assert result.simulation is not None
        if heuristic_ms and result.simulation.total_ms < heuristic_ms[0]:
            cancel.set()

    options = SolveOptions(time_limit_s=60, gap=0.01, threads=2)
    settings = SolverSettings(
        options=options, on_progress=seen.append, cancel=cancel, on_plan=on_plan
    )
    problem = _problem("resnet18", 25, settings)
    result = xengine(problem)
    assert cancel.is_set()
    assert result.feasible, result.message
    assert result.simulation.valid
    assert result.simulation.total_ms < heuristic_ms[0]
    solver = result.plan.solver
    assert solver.bound <= solver.objective and solver.bound >= problem.costs.ideal_ms() - 1e-9
    # the full and the coarse solve report on one clock, and the incumbent only improves
    times = [p.elapsed_s for p in seen]
    assert len(seen) >= 2 and times == sorted(times)
    objectives = [p.objective for p in seen]
    assert objectives == sorted(objectives, reverse=True)


def test_coarse_plans_reach_the_search_while_the_solves_run(monkeypatch):
    """ResNet18's coarse graph has a warm start better than the fine heuristic: it is
    expanded and in hand seconds into the solve (before, only when the coarse solve ended,
    at the time limit). A cancel as soon as it is reported keeps it."""
    cancel = threading.Event()
    plans = []
    heuristic_ms = _record_the_fine_heuristic(monkeypatch)

    def on_progress(progress):
        if heuristic_ms and progress.objective < heuristic_ms[0] - 1e-9:
            cancel.set()

    limit = 120.0
    settings = SolverSettings(
        options=SolveOptions(time_limit_s=limit, threads=2),
        on_progress=on_progress,
        cancel=cancel,
        on_plan=plans.append,
    )
    problem = _problem("resnet18", 25, settings)
    started = time.monotonic()
    result = xengine(problem, restrict=False)  # the restriction finds better plans first
    assert time.monotonic() - started < limit / 2  # the cancel came, mid-solve
    assert result.feasible and result.simulation.valid
    assert result.simulation.total_ms < heuristic_ms[0]
    # on_plan saw each better plan of the search in hand, all accepted by the simulator
    costs = [plan.simulation.total_ms for plan in plans]
    assert costs and costs == sorted(costs, reverse=True) and len(set(costs)) == len(costs)
    assert all(plan.simulation.valid for plan in plans)
    assert costs[-1] == pytest.approx(result.simulation.total_ms)


def test_checkmate_milp_with_coarsening_still_proves_the_ideal_with_ample_memory():
    settings = SolverSettings(options=SolveOptions(time_limit_s=20, gap=1e-6))
    problem = _problem("vgg16", 100, settings)
    problem = Problem(problem.graph, problem.costs, {"cpu0": None}, settings)
    result = checkmate_milp(problem, "cpu0")
    assert result.plan.solver.status == "optimal"
    assert result.simulation.total_ms == pytest.approx(problem.costs.ideal_ms("cpu0"))


def test_cancelling_stops_the_full_and_the_coarse_solve_and_keeps_the_incumbent():
    cancel = threading.Event()
    seen: list[float] = []

    def on_progress(progress):
        seen.append(progress.elapsed_s)
        if len(seen) == 1:  # the warm start is announced: cancel a little later
            threading.Timer(4.0, cancel.set).start()

    limit = 600.0
    settings = SolverSettings(
        options=SolveOptions(time_limit_s=limit, threads=2), on_progress=on_progress, cancel=cancel
    )
    problem = _problem("unet", 25, settings)
    started = time.monotonic()
    result = xengine(problem)
    assert time.monotonic() - started < limit / 4  # stopped by the cancel, not the limit
    assert result.feasible and result.simulation.valid
    assert not any(t.name == "remat-coarse" and t.is_alive() for t in threading.enumerate())


@pytest.mark.alone
def test_a_cancel_during_the_warm_start_stops_the_strategy_within_seconds():
    """The multi-device heuristic (a warm start of up to 10 s on U-Net) and the coarse
    graph's own heuristic stop at the cancel, not at their time budgets."""
    cancel = threading.Event()
    settings = SolverSettings(options=SolveOptions(time_limit_s=600, threads=2), cancel=cancel)
    problem = _problem("unet", 25, settings)
    threading.Timer(1.0, cancel.set).start()
    started = time.monotonic()
    xengine(problem)
    assert time.monotonic() - started < 1.0 + 5.0


def test_the_coarse_solve_stops_when_a_plan_from_elsewhere_passes_its_bound():
    """The coarse bound can stay put for a long time: a better plan from elsewhere (the
    restricted model, the full solve) that it cannot beat stops it at once."""
    problem = budgeted(training_graph(chain(4)), 100, devices=("cpu0",))
    plan = run_strategy("checkpoint_all", problem, "cpu0")
    search = Search(problem, ideal=0.0, start=time.monotonic())
    cost = plan.simulation.total_ms
    search.on_coarse(Progress(1.0, cost * 2, cost * 1.01, 0.5))
    assert not search.coarse_done.is_set()  # no incumbent yet
    search.offer(plan)
    assert search.coarse_done.is_set()


def test_coarse_and_part_costs_keep_each_node_s_workspace_and_energy():
    """A profiled table's workspace and measured energy (CUDA) reach the coarse graph and
    the decomposition's parts: a group holds its largest workspace and the sum of its
    energies, and xengine's coarse phase builds its model over them."""
    problem = _problem("unet", 60, SolverSettings(options=SolveOptions(time_limit_s=5)))
    n, devices = problem.costs.compute_ms.shape
    rng = np.random.default_rng(0)
    workspace = rng.integers(0, 2**16, size=(n, devices), dtype=np.int64)
    energy = replace(problem.costs.energy_model(), q_mj=rng.random((n, devices)))
    costs = replace(problem.costs, workspace_bytes=workspace, energy=energy)
    coarse = coarsen(problem.graph, costs)
    assert coarse.ratio < 1
    for c, group in enumerate(coarse.groups):
        rows = list(group)
        assert (coarse.costs.workspace_bytes[c] == workspace[rows].max(axis=0)).all()
        assert coarse.costs.energy.q_mj[c] == pytest.approx(energy.q_mj[rows].sum(axis=0))
    part = Part(nodes=(3, 5, 8), held=(), needed_after=frozenset())
    sliced = part.costs(costs)
    assert (sliced.workspace_bytes == workspace[[3, 5, 8]]).all()
    assert (sliced.energy.q_mj == energy.q_mj[[3, 5, 8]]).all()
    result = xengine(replace(problem, costs=costs))
    assert result.feasible and result.simulation.valid, result.message
