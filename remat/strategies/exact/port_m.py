"""port_m: PORT-M (section 4.3) over the devices of one memory pool, which compute at once.

The model is XEngine's with PORT-M's changes (``build_xengine``'s ``concurrent``): a
stage's time is its longest device's, A_t = max_n R[t,:,n] . Psi_n, and the objective
sum_t A_t (PORT-M's alpha); an input computed in the stage is computed on the reader's
device (PORT-M's R[t,j,n] <= R[t,i,n] + S[t,i]); nothing is freed inside a stage, so the
pool's memory during it is its checkpoints plus everything it computes. Its plans are
concurrent (plan version 4): the devices run each stage's computes at once. Concurrency
hides recomputation: a stage recomputes on one device what it needs while another
computes, so PORT-M pays off where the budget forces recomputation, and at a budget where
nothing is recomputed it plans as XEngine does.

The search: XEngine's (``xengine``) for ``port_m_xengine_share`` of the time limit, whose
plans on a pool are compiled concurrent wherever they fit (``evaluate``); its schedule
improved by recomputing a stage ahead on another device of the pool (``recompute_ahead``,
within ``port_m_ahead_share``); ``port`` on the pool as one device (``common.pooled``:
each node timed on its fastest device, then computed there) for ``port_m_alone_share``,
which pages to the node's storage where that beats recomputing (POET's setting on the
pool), so that the pool's plan is not slower than any one device's, paging included; then
PORT-M's MILP for the rest, started from the better of XEngine's plan and the stage-ahead
one. The plan returned is the fastest. On graphs of more than ``port_m_milp_max_nodes``
nodes the MILP is not built: XEngine's search gets the whole limit (less the stage-ahead
share), and beside it, in a process of its own for ``port_m_alone_share``, ``port``'s
paging heuristics on the pool as one device (its MILPs need processes of their own, which
a process beside may not start): XEngine's search, whose plans improve late in its time
on such graphs, keeps nearly all of the limit. Where the pool cannot hold every fixed
tensor with some node's values (``common.floor``), ``port`` runs on the pool as one
device and on each device of the pool alone instead, an equal share of the time each,
paging fixed tensors, and the fastest of those plans is returned. No bound is reported:
the ideal bounds PORT-M's model but not every concurrent plan, whose sections may overlap
independent nodes across stages too.

PORT-M's MILP pages too (``build_xengine`` with ``paging``: PORT's M^out, M^in and S^AUX
over the pool, at stage granularity, on the lane of the pool's first device to the node's
storage): its plans are concurrent plans with ``page_out`` and ``page_in`` steps, each
stage's paging beside its section, and it reaches budgets where no concurrent plan fits
without paging.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import numpy as np

from remat.devices import Tier
from remat.errors import ScheduleError
from remat.formulations.checkmate import Transfers
from remat.formulations.xengine import XEngineModel, build_xengine
from remat.plan import SolverInfo
from remat.strategies.common.beside import Beside, picklable
from remat.strategies.common.floor import shortfall
from remat.strategies.common.pooled import as_one_device, rehomed
from remat.strategies.common.problem import (
    Evaluation,
    Problem,
    StrategyResult,
    evaluate,
    evaluate_concurrent,
    select_best,
    with_prediction,
)
from remat.strategies.exact.offload_remat import offloading_plans
from remat.strategies.exact.port import port
from remat.strategies.exact.search import solve_alone
from remat.strategies.exact.xengine import xengine
from remat.strategies.heuristics.offload_greedy import offload_greedy
from remat.strategies.heuristics.recompute_ahead import recompute_ahead

NAME = "port_m"
BESIDE_GRACE_S = 3.0  # past XEngine's search: the process beside, its result


def port_m(problem: Problem, device: str | None = None) -> StrategyResult:
    """PORT-M's plan over every device of the cost model, which must share one memory
    pool; ``device`` is ignored: the strategy places operators."""
    started = time.monotonic()
    devices = problem.costs.devices
    names = tuple(d.name for d in devices)
    if len(names) < 2 or len({d.memory_space for d in devices}) != 1:
        message = (
            "port_m plans devices that share one memory pool (option pool=NAME on two or "
            f"more devices); these are {', '.join(d.name + ':' + d.memory_space for d in devices)}"
        )
        return StrategyResult(NAME, None, None, message)
    problem = problem.without_bounds()
    config, limit = problem.solver.search, problem.solver.options.time_limit_s
    if shortfall(problem, names) is not None:  # the pool cannot hold every fixed tensor
        return _paging_fixed(problem, names)
    small = len(problem.graph) <= config.port_m_milp_max_nodes
    if not small:
        return _without_milp(problem, started)
    first = xengine(problem.within(limit * config.port_m_xengine_share))
    ahead_s = limit * config.port_m_ahead_share
    first = _ahead(problem, first, time.monotonic() + ahead_s)
    alone = _alone(problem.within(limit * config.port_m_alone_share))
    budgets = {name: problem.budgets.get(name) for name in names}
    costs = problem.costs
    lane = costs.device_index(names[0])
    paging = Transfers(costs.out_ms(lane, Tier.STORAGE), costs.in_ms(lane, Tier.STORAGE))
    formulation = build_xengine(problem.graph, costs, budgets, concurrent=True, paging=paging)
    model = formulation.model
    if first.schedule is not None:
        # not where it reads across devices inside a stage, or frees inside one
        with contextlib.suppress(ScheduleError):
            model = replace(model, start=formulation.encode(first.schedule, repair=False))
    left = limit - (time.monotonic() - started)
    if problem.cancelled or left < config.min_solve_s:
        return _faster(first, alone, "no time left for PORT-M's MILP")
    solved = solve_alone(problem, model, left)
    candidates = []
    if solved.x is not None:
        candidates.append(_compiled(problem, formulation, solved.x))
    found = select_best(NAME, candidates)
    note = f"PORT-M MILP: {solved.status.value}"
    if found.plan is None or found.simulation is None:
        return _faster(first, alone, note)
    fastest = found.simulation.total_ms
    if first.time_ms <= fastest or alone.time_ms <= fastest:
        return _faster(first, alone, note)
    info = SolverInfo(solved.status.value, solved.objective, None, None, solved.seconds)
    plan = replace(with_prediction(found.plan, found.simulation), solver=info)
    return replace(found, plan=plan, message=note)


def _without_milp(problem: Problem, started: float) -> StrategyResult:
    """Over ``port_m_milp_max_nodes`` nodes: XEngine's search for the whole time limit,
    its plan improved by the stage-ahead moves, and beside it, in a process of its own
    (``common.beside``) for ``port_m_alone_share`` of the limit, ``port``'s paging
    heuristics on the pool's fastest device alone (``_paging_alone``); the faster plan."""
    config, limit = problem.solver.search, problem.solver.options.time_limit_s
    names = tuple(d.name for d in problem.costs.devices)
    deadline = time.monotonic() + limit * config.port_m_alone_share
    beside = Beside(_paging_alone, picklable(problem), names, deadline)
    left = limit - (time.monotonic() - started)
    first = xengine(problem.within(left - limit * config.port_m_ahead_share))
    first = _ahead(problem, first, started + limit)
    # no waiting for the paging plans where the user cancelled, or where XEngine's plan
    # costs the ideal, which a plan on one device alone cannot beat: their process stops
    if problem.cancelled or first.time_ms <= problem.costs.ideal_ms() * (1 + config.proven_gap):
        until = time.monotonic()
    else:
        until = max(deadline, time.monotonic()) + BESIDE_GRACE_S
    paging, why = beside.result(until)
    note = f"PORT-M's MILP is not built over {len(problem.graph)} nodes"
    feasible = [p for p in paging or [] if p.feasible and p.simulation is not None]
    if not feasible:
        label = as_one_device(problem, names).label()
        return first.without_bound(NAME, f"{note}; paging on {label}: {why or 'no plan fits'}")
    return _faster(first, min(feasible, key=lambda p: p.time_ms), note)


def _paging_alone(
    problem: Problem, names: tuple[str, ...], deadline: float
) -> list[StrategyResult]:
    """``port``'s paging heuristics on the pool of ``names`` as one device
    (``common.pooled``) by ``deadline``: GREEDY's and DYNPROG's paging, and greedy eviction
    to looser budgets with paging over its plans (``offload_remat.offloading_plans``),
    each node then computed on its fastest device. Module-level: it runs in a process
    beside."""
    one = as_one_device(problem, names)
    plans = [offload_greedy(one.problem, one.anchor, Tier.STORAGE)]
    plans += offloading_plans(one.problem, one.anchor, deadline, Tier.STORAGE)
    return [rehomed(one, problem, plan) for plan in plans]


def _compiled(problem: Problem, formulation: XEngineModel, x: np.ndarray) -> Evaluation:
    """A solution of PORT-M's MILP as a plan, judged by the simulator: concurrent, its
    page transfers beside each stage's section where it pages."""
    schedule = formulation.decode(x)
    transfers = formulation.transfers(x)
    if not any(t.any() for t in transfers):
        return evaluate(problem, schedule, NAME)
    return evaluate_concurrent(problem, schedule, NAME, transfers, Tier.STORAGE)


def _paging_fixed(problem: Problem, names: tuple[str, ...]) -> StrategyResult:
    """Below the pool's fixed memory: ``port`` (paging fixed tensors, its fallback) on the
    pool as one device (``common.pooled``) and on each device of the pool alone, an equal
    share of the time limit each; the fastest plan."""
    share = problem.solver.options.time_limit_s / (len(names) + 1)
    one = as_one_device(problem, names)
    found = {one.label(): rehomed(one, problem, port(one.problem.within(share), one.anchor))}
    for name in names:
        alone = port(problem.within(share), name)
        found[f"{name} alone"] = replace(alone, message=f"{name} alone: {alone.message}")
    where, best = min(found.items(), key=lambda item: item[1].time_ms)
    if best.feasible:
        return best.without_bound(NAME, f"{where}, below the pool's fixed memory")
    proven = all(r.proven_infeasible for r in found.values())
    notes = "; ".join(r.message for r in found.values())
    return replace(best.without_bound(NAME, ""), message=notes, proven_infeasible=proven)


def _ahead(problem: Problem, first: StrategyResult, deadline: float) -> StrategyResult:
    """``first`` (XEngine's result), or its schedule with recomputation moved a stage
    ahead onto another device where that is faster (``recompute_ahead``, by
    ``deadline``)."""
    if first.schedule is None:
        return first
    ahead = recompute_ahead(problem, first.schedule, NAME, deadline)
    if ahead.fits and first.simulation and ahead.cost_ms < first.simulation.total_ms:
        plan = with_prediction(ahead.plan, ahead.simulation)
        note = "recomputed a stage ahead on another device"
        return StrategyResult(NAME, plan, ahead.simulation, note, schedule=ahead.schedule)
    return first


def _alone(problem: Problem) -> StrategyResult:
    """``port`` on the pool as one device (``common.pooled``), each node then computed on
    its fastest device; none where its share of the limit is 0."""
    if problem.solver.search.port_m_alone_share <= 0:
        return StrategyResult(NAME, None, None, "no plan of the pool as one device")
    one = as_one_device(problem, tuple(d.name for d in problem.costs.devices))
    return rehomed(one, problem, port(one.problem, one.anchor))


def _faster(first: StrategyResult, alone: StrategyResult, note: str) -> StrategyResult:
    """The faster of XEngine's (or the stage-ahead) plan and ``port``'s on one device, as
    port_m's, ``note`` added to its message."""
    return (alone if alone.time_ms < first.time_ms else first).without_bound(NAME, note)
