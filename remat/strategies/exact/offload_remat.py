"""offload_remat: keep, recompute or offload each activation, decided together on one
device by Checkmate's MILP extended with transfers to host memory at stage granularity
(``remat.formulations.checkmate`` with ``transfers``: a stage's transfers run beside its
compute and it costs the longer of the two).

Plans, in turn: GREEDY's (offloading alone, ``offload_greedy``: milliseconds; where it
costs the ideal nothing else runs); ``checkmate_milp``'s search for
``offload_remat_share`` of the time left (rematerialization alone, with its own warm
starts, RINS and decomposition; its plan is the joint MILP's start, since every remat plan
is a solution with no transfers), and beside it DYNPROG's plan
(``offload_dynprog``, whose transfers are finer than stages, so it competes as a plan
rather than as a start) and greedy eviction to relaxed budgets with offloading over its
plans down to the budget (``recompute_then_offload``, a ladder of budgets), in a process of
its own (``common.beside``); then the joint MILP for the rest, where at least
``min_solve_s`` is left (a solve is not started after the time limit). The remat search gets the
whole of its share of the time, as ``checkmate_milp`` alone would, sharing the cores while
the offloading heuristics run, rather than what they leave (its plans improve through the
whole limit on large graphs). The best plan the simulator accepts wins, so the result
is never worse than those plans.

The bound reported is the ideal (every node once, no transfers): the MILP's own bound
holds only for plans whose transfers follow its stages, which the heuristics' plans need
not, so it is given in the message, not as the plan's bound. Where a plan costs the ideal,
no further solve runs. On graphs of more than ``decompose_min_nodes`` nodes the joint
model is not built (its O(n^2) variables do not solve there): ``checkmate_milp`` gets the
rest of the time, and its plan competes with the others.

``joint_search`` is this search over either tier: the host (here) or storage (``port``:
paging, PORT section 4.2).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from itertools import pairwise

import numpy as np

from remat.compiler import compile_plan
from remat.devices import Tier, format_bytes
from remat.errors import ScheduleError
from remat.formulations.checkmate import CheckmateModel, Transfers, build_checkmate
from remat.plan import SolverInfo
from remat.schedule import schedule_of_steps
from remat.solvers.backend import relative_gap
from remat.strategies.common.beside import Beside, picklable
from remat.strategies.common.offload import offload_base, offload_result, sending
from remat.strategies.common.policy import device_fixed_bytes
from remat.strategies.common.problem import (
    Problem,
    StrategyResult,
    evaluate_plan,
    with_prediction,
)
from remat.strategies.exact.checkmate import checkmate_milp
from remat.strategies.exact.search import solve_alone, unfit
from remat.strategies.heuristics.evict import greedy_evict
from remat.strategies.heuristics.offload_dynprog import offload_dynprog, offload_set_plan
from remat.strategies.heuristics.offload_greedy import offload_greedy

NAME = "offload_remat"
BESIDE_GRACE_S = 3.0  # past the remat search: the offloading process's start and its result
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JointSolve:
    """The joint MILP of a search and its incumbent (``x``), where it found one."""

    model: CheckmateModel
    x: np.ndarray
    objective: float


@dataclass(frozen=True)
class JointSearch:
    """What ``joint_search`` found: every plan (the heuristics', the remat search's and the
    joint MILP's), a note on how it ended, its time, and the joint solve if any."""

    plans: list[StrategyResult]
    note: str
    seconds: float
    joint: JointSolve | None = None


def offload_remat(problem: Problem, device: str) -> StrategyResult:
    search = joint_search(problem, device, Tier.HOST, NAME)
    return best_of(problem, device, search, NAME)


def joint_search(
    problem: Problem, device: str, tier: Tier, name: str, remat_share: float | None = None
) -> JointSearch:
    """The search of the module docstring, sending activations to ``tier``; strategy
    ``name`` in messages; ``remat_share``: the remat search's share of the time left
    (default ``offload_remat_share``). Its plans include an infeasible one with the least
    memory needed where none fits."""
    started = time.monotonic()
    if (unfit_result := unfit(problem, name, (device,))) is not None:
        return JointSearch([unfit_result], "", 0.0)
    config, limit = problem.solver.search, problem.solver.options.time_limit_s
    ideal = problem.costs.ideal_ms(device)
    plans = [offload_greedy(problem, device, tier)]
    if _reaches(plans, ideal, config.proven_gap):
        return JointSearch(plans, f"{sending(tier)} alone costs the ideal: no solve", 0.0)
    large = len(problem.graph) > config.decompose_min_nodes
    share = 1.0 if large else remat_share or config.offload_remat_share
    seconds = (limit - (time.monotonic() - started)) * share
    deadline = time.monotonic() + seconds
    beside = Beside(offloading_plans, picklable(problem), device, deadline, tier)
    remat = checkmate_milp(problem.within(seconds), device)
    if problem.cancelled:  # no waiting for the offloading plans: their process stops
        until = time.monotonic()
    else:
        until = max(deadline, time.monotonic()) + BESIDE_GRACE_S
    offloading, why = beside.result(until)
    if offloading is None:
        offloading = []
        logger.debug("%s: no %s plans from beside the remat search: %s", name, tier, why)
    plans += [*offloading, remat]
    joint = None
    if problem.cancelled:
        note = "cancelled"
    elif large:
        note = f"the joint model is not built over {config.decompose_min_nodes} nodes"
    elif _reaches(plans, ideal, config.proven_gap):
        note = "a plan costs the ideal: no joint solve"
    elif (left := limit - (time.monotonic() - started)) < config.min_solve_s:
        note = "no time left for the joint MILP"
    else:
        solved, note, joint = _solve(problem, device, [remat], left, tier, name)
        if solved is not None:
            plans.append(solved)
    return JointSearch(plans, note, time.monotonic() - started, joint)


def offloading_plans(
    problem: Problem, device: str, deadline: float, tier: Tier = Tier.HOST
) -> list[StrategyResult]:
    """DYNPROG's plan and ``recompute_then_offload``'s, by ``deadline`` (a
    ``time.monotonic()``): the work beside the remat search."""
    plans = [offload_dynprog(problem.within(deadline - time.monotonic()), device, tier)]
    return plans + recompute_then_offload(problem, device, deadline - time.monotonic(), tier)


def recompute_then_offload(
    problem: Problem, device: str, seconds: float, tier: Tier = Tier.HOST
) -> list[StrategyResult]:
    """Greedy eviction to a relaxed budget, then offloading over its plan (GREEDY's or
    DYNPROG's set, ``offload_set_plan``) down to the problem's budget: the transfers hide
    what they can behind compute, and recomputation frees the memory they cannot (at the
    backward phase's peak, where offloaded activations are coming back). The relaxed
    budgets are ``offload_remat_ladder``'s fractions of the way from the budget up to
    checkpoint-all's peak, the loosest first until a plan costs more than the best so far,
    then the best one's neighbours at half the spacing, within ``seconds``; every plan that
    fits, best first."""
    budget = problem.budgets.get(device)
    base = offload_base(problem, device, tier=tier)
    if budget is None or base is None or base.peak_bytes <= budget:
        return []
    config = problem.solver.search
    deadline = time.monotonic() + seconds
    found: dict[float, StrategyResult | None] = {}

    def attempt(fraction: float) -> float | None:
        """The cost of the plan at ``fraction`` (None without one)."""
        left = deadline - time.monotonic()
        if fraction in found or not 0 < fraction < 1 or left <= 0:
            return None
        found[fraction] = None
        relaxed = budget + int(fraction * (base.peak_bytes - budget))
        looser = replace(problem, budgets={**problem.budgets, device: relaxed})
        remat = greedy_evict(looser, device, min(config.evict_time_s, left))
        over = None if remat.plan is None else offload_base(problem, device, remat.plan, tier)
        chosen = None if over is None else offload_set_plan(problem, over, deadline)
        if over is None or chosen is None:
            return None
        label = f"greedy_evict to {format_bytes(relaxed)}, then {sending(tier)}"
        found[fraction] = offload_result(problem, over, label, chosen)
        return chosen.cost_ms

    ladder = sorted(config.offload_remat_ladder)
    best = float("inf")
    for fraction in reversed(ladder):  # the loosest first: its eviction is the quickest
        cost = attempt(fraction)
        if cost is None:
            continue
        if cost > best:
            break  # past the best mix: tighter budgets recompute more
        best = cost
    ranked = sorted((r.simulation.total_ms, f) for f, r in found.items() if r and r.simulation)
    if ranked and len(ladder) > 1:
        step = min(b - a for a, b in pairwise(ladder)) / 2
        attempt(ranked[0][1] - step)
        attempt(ranked[0][1] + step)
    plans = [r for r in found.values() if r is not None and r.simulation is not None]
    return sorted(plans, key=lambda r: r.simulation.total_ms if r.simulation else 0.0)


def _reaches(plans: list[StrategyResult], ideal: float, proven_gap: float) -> bool:
    costs = [p.simulation.total_ms for p in plans if p.feasible and p.simulation]
    return bool(costs) and min(costs) <= ideal * (1 + proven_gap)


def _solve(
    problem: Problem,
    device: str,
    remat: list[StrategyResult],
    seconds: float,
    tier: Tier,
    name: str,
) -> tuple[StrategyResult | None, str, JointSolve | None]:
    """The joint MILP from the cheapest remat plan, for ``seconds``: its plan (None
    without one), a note on the solve, and the model with its incumbent."""
    costs = problem.costs
    d = costs.device_index(device)
    transfers = Transfers(costs.out_ms(d, tier), costs.in_ms(d, tier))
    fixed = device_fixed_bytes(problem, device)
    model = build_checkmate(
        problem.graph, costs, device, problem.budgets.get(device), fixed, transfers
    )
    start = None
    for found in sorted(remat, key=lambda r: r.simulation.total_ms if r.simulation else 0.0):
        schedule = found.schedule
        if schedule is None and found.plan is not None:
            schedule = schedule_of_steps(found.plan.steps, len(problem.graph), device)
        if schedule is None:
            continue
        try:
            start = model.encode(schedule)
            break
        except ScheduleError:
            continue
    solved = solve_alone(problem, replace(model.model, start=start), seconds)
    note = f"joint MILP: {solved.status.value}"
    if solved.bound is not None:
        note += f", bound {solved.bound:.4g} ms over stage-aligned transfers"
    if solved.x is None or solved.objective is None:
        return None, note, None
    joint = JointSolve(model, solved.x, solved.objective)
    plan, refused = joint_plan(problem, device, joint, tier, name)
    if plan is None:
        return None, f"{note}; its plan was refused: {refused}", joint
    return plan, note, joint


def joint_plan(
    problem: Problem, device: str, joint: JointSolve, tier: Tier, name: str
) -> tuple[StrategyResult | None, str]:
    """The compiled plan of a joint solution, judged by the simulator: the result, or None
    and the violation."""
    model, x = joint.model, joint.x
    schedule = model.decode(x)
    plan = compile_plan(
        problem.graph,
        schedule,
        problem.plan_devices([device]),
        name,
        problem.costs,
        transfers=model.transfers(x),
        tier=tier,
    )
    evaluation = evaluate_plan(problem, plan, schedule)
    if not evaluation.fits:
        return None, str(evaluation.simulation.violation)
    return StrategyResult(name, plan, evaluation.simulation, schedule=schedule), ""


def best_of(
    problem: Problem,
    device: str,
    search: JointSearch,
    name: str,
    chosen: StrategyResult | None = None,
) -> StrategyResult:
    """The search's result as strategy ``name``: ``chosen``, else its cheapest feasible
    plan, with the ideal as the bound; or, where none fits, the least memory one needed."""
    plans, note = search.plans, search.note
    feasible = [p for p in plans if p.feasible and p.plan is not None and p.simulation]
    if not feasible:
        if len(plans) == 1 and plans[0].proven_infeasible:
            return plans[0]
        needs = [p.min_budget_bytes[device] for p in plans if p.min_budget_bytes]
        message = f"{name}: no plan fits the budget on {device}"
        need = {device: min(needs)} if needs else None
        return StrategyResult(name, None, None, f"{message}; {note}", min_budget_bytes=need)
    best = chosen or min(feasible, key=lambda p: p.simulation.total_ms if p.simulation else 0.0)
    assert best.plan is not None and best.simulation is not None
    total, bound = best.simulation.total_ms, problem.costs.ideal_ms(device)
    info = SolverInfo("feasible", total, bound, relative_gap(total, bound), search.seconds)
    plan = replace(with_prediction(best.plan, best.simulation), strategy=name, solver=info)
    origin = "the joint MILP" if best.strategy == name else best.strategy
    message = f"{name}: the plan of {origin}, {total:.4g} ms; {note}"
    return StrategyResult(name, plan, best.simulation, message, schedule=best.schedule)
