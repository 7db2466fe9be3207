"""offload_remat: keep, recompute or offload each activation, decided together on one
device by Checkmate's MILP extended with transfers to host memory at stage granularity
(``remat.formulations.checkmate`` with ``transfers``: a stage's transfers run beside its
compute and it costs the longer of the two).

Warm starts and incumbents: DYNPROG's plan (offloading alone, ``offload_dynprog``, whose
transfers are finer than stages, so it competes as a plan rather than as a start), then
``checkmate_milp``'s search for ``offload_remat_share`` of the time (rematerialization
alone, with its own warm starts, RINS and decomposition; its plan is the joint MILP's
start, since every remat plan is a solution with no transfers), then the joint MILP for
the rest. The best plan the simulator accepts wins, so the result is never worse than
those plans.

The bound reported is the ideal (every node once, no transfers): the MILP's own bound
holds only for plans whose transfers follow its stages, which the heuristics' plans need
not, so it is given in the message, not as the plan's bound. Where a plan costs the ideal,
no further solve runs. On graphs of more than ``decompose_min_nodes`` nodes the joint
model is not built (its O(n^2) variables do not solve there): ``checkmate_milp`` gets the
whole time limit, and DYNPROG's plan competes with its plan.
"""

from __future__ import annotations

import time
from dataclasses import replace

from remat.compiler import compile_plan
from remat.errors import ScheduleError
from remat.formulations.checkmate import HostTransfers, build_checkmate
from remat.plan import SolverInfo
from remat.schedule import schedule_of_steps
from remat.solvers.backend import relative_gap
from remat.strategies.common.policy import device_fixed_bytes
from remat.strategies.common.problem import (
    Problem,
    StrategyResult,
    evaluate_plan,
    with_prediction,
)
from remat.strategies.exact.checkmate import checkmate_milp
from remat.strategies.exact.search import solve_alone, unfit
from remat.strategies.heuristics.offload_dynprog import offload_dynprog

NAME = "offload_remat"


def offload_remat(problem: Problem, device: str) -> StrategyResult:
    started = time.monotonic()
    if (unfit_result := unfit(problem, NAME, (device,))) is not None:
        return unfit_result
    config, limit = problem.solver.search, problem.solver.options.time_limit_s
    ideal = problem.costs.ideal_ms(device)
    plans = [offload_dynprog(problem, device)]
    if _reaches(plans, ideal, config.proven_gap):
        return _best(problem, device, plans, "offloading alone costs the ideal: no solve", 0.0)
    large = len(problem.graph) > config.decompose_min_nodes
    share = 1.0 if large else config.offload_remat_share
    settings = problem.solver
    alone = replace(settings, options=replace(settings.options, time_limit_s=limit * share))
    remat = checkmate_milp(replace(problem, solver=alone), device)
    plans.append(remat)
    if large:
        note = f"the joint model is not built over {config.decompose_min_nodes} nodes"
    elif _reaches(plans, ideal, config.proven_gap):
        note = "a plan costs the ideal: no joint solve"
    else:
        left = limit - (time.monotonic() - started)
        solved, note = _solve(problem, device, [remat], left)
        if solved is not None:
            plans.append(solved)
    return _best(problem, device, plans, note, time.monotonic() - started)


def _reaches(plans: list[StrategyResult], ideal: float, proven_gap: float) -> bool:
    costs = [p.simulation.total_ms for p in plans if p.feasible and p.simulation]
    return bool(costs) and min(costs) <= ideal * (1 + proven_gap)


def _solve(
    problem: Problem, device: str, remat: list[StrategyResult], seconds: float
) -> tuple[StrategyResult | None, str]:
    """The joint MILP from the cheapest remat plan, for ``seconds``: its plan (None
    without one) and a note on the solve."""
    costs = problem.costs
    d = costs.device_index(device)
    transfers = HostTransfers(costs.offload_ms(d), costs.prefetch_ms(d))
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
    solved = solve_alone(problem, replace(model.model, start=start), max(seconds, 1.0))
    note = f"joint MILP: {solved.status.value}"
    if solved.bound is not None:
        note += f", bound {solved.bound:.4g} ms over stage-aligned transfers"
    if solved.x is None:
        return None, note
    schedule = model.decode(solved.x)
    off, pre, late = model.transfers(solved.x)
    plan = compile_plan(
        problem.graph,
        schedule,
        problem.plan_devices([device]),
        NAME,
        costs,
        transfers=(off, pre, late),
    )
    evaluation = evaluate_plan(problem, plan, schedule)
    if not evaluation.fits:
        return None, f"{note}; its plan was refused: {evaluation.simulation.violation}"
    return StrategyResult(NAME, plan, evaluation.simulation, schedule=schedule), note


def _best(
    problem: Problem, device: str, plans: list[StrategyResult], note: str, seconds: float
) -> StrategyResult:
    feasible = [p for p in plans if p.feasible and p.plan is not None and p.simulation]
    if not feasible:
        needs = [p.min_budget_bytes[device] for p in plans if p.min_budget_bytes]
        message = f"{NAME}: no plan fits the budget on {device}"
        need = {device: min(needs)} if needs else None
        return StrategyResult(NAME, None, None, f"{message}; {note}", min_budget_bytes=need)
    best = min(feasible, key=lambda p: p.simulation.total_ms if p.simulation else 0.0)
    assert best.plan is not None and best.simulation is not None
    total, bound = best.simulation.total_ms, problem.costs.ideal_ms(device)
    info = SolverInfo("feasible", total, bound, relative_gap(total, bound), seconds)
    plan = replace(with_prediction(best.plan, best.simulation), strategy=NAME, solver=info)
    origin = "the joint MILP" if best.strategy == NAME else best.strategy
    message = f"{NAME}: the plan of {origin}, {total:.4g} ms; {note}"
    return StrategyResult(NAME, plan, best.simulation, message, schedule=best.schedule)
