"""port: PORT's ILP on one device (section 4.2): keep, recompute or page each activation to
the node's storage, decided together, with PORT's lexicographic objectives.

The ILP is Checkmate's MILP with transfers (``remat.formulations.checkmate``), over the
device's storage link instead of its host link. In PORT's names: R is R, S^RAM is S, the
paging matrices M^out and M^in are OFF and PRE + LATE, S^AUX (resident in storage) is
HOST, and U^RAM <= mu^RAM is the budget row (9). PORT's bandwidth constraint (5) forbids a
stage's paging from exceeding what its compute time can carry; here a stage may page more
and then costs the difference (its wait W[t]), so every plan PORT admits is admitted, and
the objective stays the simulator's time.

The search is ``offload_remat``'s (``joint_search``) over storage, for ``1 -
port_secondary_share`` of the time limit, of which ``port_remat_share`` goes to the remat
search (paging is slower than offloading, so rematerialization carries more plans):
GREEDY's and DYNPROG's paging plans, ``checkmate_milp``'s rematerialization alone,
greedy eviction to looser budgets with paging over its plans, and the joint MILP from the
best remat plan. Then the objectives, in turn
(PORT's alpha, then beta): first the total time (alpha, eq. 3); then, among plans within
``port_time_tolerance`` of the best time, the fewest computations (beta_1, PORT-M section
4.3.3: needless recomputation) plus page transfers (beta_2, eq. 4: needless paging),
solved as the paper does: a second solve of the same model whose objective is beta_1 +
beta_2, with the first objective bounded by the first solve's incumbent times ``1 +
port_time_tolerance``, from that incumbent. The plan returned is, among all plans within
the tolerance of the cheapest one the simulator accepted, the one with the fewest
computations and page transfers; so it is never slower than the tolerance allows, and
never worse in time than rematerialization alone or paging alone by more than it.

POET's objective (PORT section 4.2, eq. 1-2), where the problem's objective is energy or
the weighted sum (``remat.objective``), optionally with a runtime cap: the same search
for time, then a second solve of the same model whose objective is the plan's energy (or
the weighted sum) and whose time is at most the cap, from the first incumbent where it
keeps the cap. Energy is linear in the model's variables as the simulator counts it: q_i
per computation, ``LINK_W`` over each transfer's time, and the static power over the
time (the first objective's expression). The plan returned is, among every plan within
the cap, the one of least objective; the bound is the ideal's objective (every node once,
at the ideal's time, no transfers), a lower bound of any plan's.

The bound reported under the time objective is the ideal (every node once, no
transfers), as ``offload_remat``'s.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import scipy.sparse as sp

from remat.devices import Tier
from remat.energy import LINK_W
from remat.objective import Objective
from remat.plan import PAGE_OPS, SolverInfo
from remat.solvers.backend import relative_gap
from remat.solvers.model import MILPModel
from remat.strategies.common.problem import Problem, StrategyResult
from remat.strategies.exact.offload_remat import (
    JointSearch,
    JointSolve,
    best_of,
    joint_plan,
    joint_search,
)
from remat.strategies.exact.search import solve_alone
from remat.strategies.heuristics.evict import greedy_evict
from remat.strategies.heuristics.fixed_paging import page_fixed

NAME = "port"


def port(problem: Problem, device: str) -> StrategyResult:
    """The module docstring's search; where it finds no plan (the budget is below the
    fixed memory's floor), a plan that pages fixed tensors too, its activations planned by
    the same search (``remat.strategies.heuristics.fixed_paging``)."""
    started = time.monotonic()
    result = _port(problem, device)
    if result.feasible or problem.cancelled:
        return result
    left = problem.solver.options.time_limit_s - (time.monotonic() - started)
    paging = page_fixed(
        problem.within(left),
        device,
        lambda p: _port(p, device),
        NAME,
        quick=lambda p: greedy_evict(p, device, p.solver.options.time_limit_s / 2),
    )
    if paging.feasible:
        return paging
    lead = "infeasible at this budget" if paging.proven_infeasible else "no plan found"
    return replace(
        result,
        message=f"{lead}: {paging.message}; keeping every fixed tensor "
        f"resident: {result.message.removeprefix('infeasible at this budget: ')}",
        min_budget_bytes=paging.min_budget_bytes or result.min_budget_bytes,
        proven_infeasible=paging.proven_infeasible,
    )


def _port(problem: Problem, device: str) -> StrategyResult:
    started = time.monotonic()
    config, limit = problem.solver.search, problem.solver.options.time_limit_s
    first = problem.within(limit * (1 - config.port_secondary_share))
    search = joint_search(first, device, Tier.STORAGE, NAME, config.port_remat_share)
    plans, note = list(search.plans), search.note
    tolerance = config.port_time_tolerance
    left = limit - (time.monotonic() - started)
    objective = problem.objective
    if search.joint is not None and not problem.cancelled and left >= config.min_solve_s:
        solve = _secondary if objective.time_only else _poet
        second, why = solve(problem, device, search.joint, tolerance, left)
        note = f"{note}; {why}"
        if second is not None:
            plans.append(second)
    if not objective.time_only:
        return _within_cap(problem, device, plans, note, time.monotonic() - started)
    chosen = lexicographic(plans, tolerance)
    elapsed = time.monotonic() - started
    result = best_of(problem, device, JointSearch(plans, note, elapsed, search.joint), NAME, chosen)
    if chosen is None or chosen.simulation is None:
        return result
    recomputed = chosen.simulation.computes - len(problem.graph)
    return replace(
        result,
        message=f"{result.message}; {recomputed} recomputations, {paged(chosen)} page transfers",
    )


def paged(result: StrategyResult) -> int:
    """The page transfers (page-outs and page-ins) of a result's plan."""
    return 0 if result.plan is None else sum(s.op in PAGE_OPS for s in result.plan.steps)


def lexicographic(plans: list[StrategyResult], tolerance: float) -> StrategyResult | None:
    """Among the feasible plans within ``tolerance`` of the cheapest one's time, the one
    with the fewest computations plus page transfers (then the fastest); None without a
    feasible plan."""
    feasible = [p for p in plans if p.feasible and p.plan is not None and p.simulation]
    if not feasible:
        return None

    def time_ms(p: StrategyResult) -> float:
        assert p.simulation is not None
        return p.simulation.total_ms

    best = min(time_ms(p) for p in feasible)
    close = [p for p in feasible if time_ms(p) <= best * (1 + tolerance)]

    def secondary(p: StrategyResult) -> tuple[int, float]:
        assert p.simulation is not None
        return (p.simulation.computes + paged(p), time_ms(p))

    return min(close, key=secondary)


def _within_cap(
    problem: Problem, device: str, plans: list[StrategyResult], note: str, seconds: float
) -> StrategyResult:
    """POET's choice: among the plans within the runtime cap, the least objective, with
    the ideal's objective as the bound."""
    objective = problem.objective
    cap = objective.time_cap_ms
    found = JointSearch(plans, note, seconds)
    timed = {
        id(p): (
            p.simulation.total_ms,
            objective.value(p.simulation.total_ms, p.simulation.energy_mj),
        )
        for p in plans
        if p.feasible and p.plan is not None and p.simulation is not None
    }
    if not timed:
        return best_of(problem, device, found, NAME)
    kept = [p for p in plans if id(p) in timed and (cap is None or timed[id(p)][0] <= cap)]
    if not kept:
        fastest = min(ms for ms, _ in timed.values())
        return StrategyResult(
            NAME,
            None,
            None,
            f"{NAME}: no plan keeps the runtime cap of {cap:g} ms (the fastest found takes "
            f"{fastest:.4g} ms); {note}",
        )
    best = min(kept, key=lambda p: timed[id(p)][1])
    result = best_of(problem, device, found, NAME, best)
    assert result.plan is not None
    total, bound = timed[id(best)][1], ideal_objective(problem, device, objective)
    info = SolverInfo("feasible", total, bound, relative_gap(total, bound), seconds)
    return replace(result, plan=replace(result.plan, solver=info))


def ideal_objective(problem: Problem, device: str, objective: Objective) -> float:
    """The objective of every node once on ``device`` at the ideal's time, no transfers:
    below any plan's."""
    costs = problem.costs
    d = costs.device_index(device)
    energy = costs.energy_model()
    ideal = costs.ideal_ms(device)
    return objective.value(ideal, float(energy.q_mj[:, d].sum()) + energy.static_w * ideal)


def with_row(model: MILPModel, row: np.ndarray, upper: float) -> MILPModel:
    """``model`` with the constraint ``row . x <= upper``."""
    return replace(
        model,
        A=sp.vstack([model.A, sp.csr_array(row.reshape(1, -1))], format="csr"),
        row_lb=np.append(model.row_lb, -np.inf),
        row_ub=np.append(model.row_ub, upper),
    )


def _poet(
    problem: Problem, device: str, joint: JointSolve, tolerance: float, seconds: float
) -> tuple[StrategyResult | None, str]:
    """POET's solve (the module docstring): the objective's expression over the joint
    model, the time at most the runtime cap; its plan where the simulator accepts it."""
    model, objective = joint.model, problem.objective
    first = model.model
    costs = problem.costs
    d = costs.device_index(device)
    energy = costs.energy_model()
    c_time = first.c
    c_energy = energy.static_w * c_time
    tt, ii = np.nonzero(model.R >= 0)
    c_energy[model.R[tt, ii]] += energy.q_mj[ii, d]
    transfers = (
        (model.OFF, costs.out_ms(d, Tier.STORAGE)),
        (model.PRE, costs.in_ms(d, Tier.STORAGE)),
    )
    for matrix, ms in (*transfers, (model.LATE, costs.in_ms(d, Tier.STORAGE))):
        tt, ii = np.nonzero(matrix >= 0)
        c_energy[matrix[tt, ii]] += LINK_W * ms[ii]
    w_t, w_e = objective.weights
    cap = objective.time_cap_ms
    start = joint.x if cap is None or float(c_time @ joint.x) + first.offset <= cap else None
    poet = replace(
        first,
        c=w_t * c_time + w_e * c_energy,
        offset=(w_t + w_e * energy.static_w) * first.offset,
        start=start,
    )
    if cap is not None:
        poet = with_row(poet, c_time, cap - first.offset)
    return _solve_again(
        problem, device, joint, poet, seconds, f"POET solve ({objective.describe()})"
    )


def _secondary(
    problem: Problem, device: str, joint: JointSolve, tolerance: float, seconds: float
) -> tuple[StrategyResult | None, str]:
    """The second solve: beta_1 + beta_2 with the time bounded (the module docstring);
    its plan where the simulator accepts it, and a note."""
    model = joint.model
    first = model.model
    c = np.zeros(first.n_vars)
    for matrix in (model.R, model.OFF, model.PRE, model.LATE):
        index = matrix[matrix >= 0]
        c[index] = 1.0
    bound = joint.objective * (1 + tolerance) - first.offset
    second = with_row(replace(first, c=c, offset=0.0, start=joint.x), first.c, bound)
    return _solve_again(problem, device, joint, second, seconds, "beta solve")


def _solve_again(
    problem: Problem,
    device: str,
    joint: JointSolve,
    model: MILPModel,
    seconds: float,
    label: str,
) -> tuple[StrategyResult | None, str]:
    """The joint model solved again as ``model`` (another objective, a bounding row) for
    ``seconds``: its plan where the simulator accepts it, and a note led by ``label``."""
    solved = solve_alone(problem, model, max(seconds, 1.0))
    note = f"{label}: {solved.status.value}"
    if solved.x is None:
        return None, note
    found, refused = joint_plan(problem, device, replace(joint, x=solved.x), Tier.STORAGE, NAME)
    if found is None:
        return None, f"{note}; its plan was refused: {refused}"
    return found, note
