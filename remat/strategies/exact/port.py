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
port_secondary_share`` of the time limit: GREEDY's and DYNPROG's paging plans,
``checkmate_milp``'s rematerialization alone, greedy eviction to looser budgets with paging
over its plans, and the joint MILP from the best remat plan. Then the objectives, in turn
(PORT's alpha, then beta): first the total time (alpha, eq. 3); then, among plans within
``port_time_tolerance`` of the best time, the fewest computations (beta_1, PORT-M section
4.3.3: needless recomputation) plus page transfers (beta_2, eq. 4: needless paging),
solved as the paper does: a second solve of the same model whose objective is beta_1 +
beta_2, with the first objective bounded by the first solve's incumbent times ``1 +
port_time_tolerance``, from that incumbent. The plan returned is, among all plans within
the tolerance of the cheapest one the simulator accepted, the one with the fewest
computations and page transfers; so it is never slower than the tolerance allows, and
never worse in time than rematerialization alone or paging alone by more than it.

The bound reported is the ideal (every node once, no transfers), as ``offload_remat``'s.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import scipy.sparse as sp

from remat.devices import Tier
from remat.plan import PAGE_OPS
from remat.strategies.common.problem import Problem, StrategyResult
from remat.strategies.exact.offload_remat import (
    JointSearch,
    JointSolve,
    best_of,
    joint_plan,
    joint_search,
)
from remat.strategies.exact.search import solve_alone

NAME = "port"


def port(problem: Problem, device: str) -> StrategyResult:
    started = time.monotonic()
    config, limit = problem.solver.search, problem.solver.options.time_limit_s
    first = problem.within(limit * (1 - config.port_secondary_share))
    search = joint_search(first, device, Tier.STORAGE, NAME)
    plans, note = list(search.plans), search.note
    tolerance = config.port_time_tolerance
    left = limit - (time.monotonic() - started)
    if search.joint is not None and not problem.cancelled and left > 0:
        second, why = _secondary(problem, device, search.joint, tolerance, left)
        note = f"{note}; {why}"
        if second is not None:
            plans.append(second)
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
    row = sp.csr_array(first.c.reshape(1, -1))
    second = replace(
        first,
        c=c,
        offset=0.0,
        A=sp.vstack([first.A, row], format="csr"),
        row_lb=np.append(first.row_lb, -np.inf),
        row_ub=np.append(first.row_ub, bound),
        start=joint.x,
    )
    solved = solve_alone(problem, second, max(seconds, 1.0))
    note = f"beta solve: {solved.status.value}"
    if solved.x is None:
        return None, note
    found, refused = joint_plan(problem, device, replace(joint, x=solved.x), Tier.STORAGE, NAME)
    if found is None:
        return None, f"{note}; its plan was refused: {refused}"
    return found, note
