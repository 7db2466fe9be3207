"""Plans made before for the same graph (an earlier job's, a file's), offered to the exact
strategies' searches as incumbents: a search that is given a plan never ends above it,
however little time it has or however busy the machine is. The simulator judges each one
under the problem's own costs and budgets, so a plan made at another budget, batch size or
cost table is taken only where it holds here."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from remat.plan import Plan
from remat.schedule import schedule_of_steps
from remat.strategies.common.problem import (
    Evaluation,
    Problem,
    StrategyResult,
    evaluate_plan,
    select_best,
)

logger = logging.getLogger(__name__)

ORIGIN = "earlier plan"
"""The strategy name of a known plan's result (the search renames what it returns)."""


def known_start(problem: Problem, names: Sequence[str]) -> StrategyResult | None:
    """The cheapest of the solver settings' ``known_plans`` that the simulator accepts
    under ``problem``, among those an exact strategy on ``names`` could have found itself:
    made for this graph (``Plan.graph``), on devices of ``names`` of the same kinds, with
    computations, copies and frees only (no transfers, no concurrent sections). Its
    schedule comes with it where its steps follow Checkmate's stage order on one device,
    so that it warm-starts the models too. None where no plan qualifies."""
    admissible = (p for p in problem.solver.known_plans if _admissible(problem, names, p))
    candidates = list({plan.steps: plan for plan in admissible}.values())  # each plan once
    evaluations = [_evaluated(problem, plan) for plan in candidates]
    fitting = [e for e in evaluations if e.fits and math.isfinite(e.cost_ms)]
    logger.debug(
        "known plans: %d given, %d for this graph and these devices, %d fit",
        len(problem.solver.known_plans),
        len(candidates),
        len(fitting),
    )
    return select_best(ORIGIN, fitting) if fitting else None


def _admissible(problem: Problem, names: Sequence[str], plan: Plan) -> bool:
    graph = plan.graph
    if graph is None or graph.nodes != len(problem.graph) or graph != problem.graph.fingerprint:
        return False
    if plan.transfers or plan.pages or plan.concurrent:
        return False
    kinds = {d.name: d.kind for d in problem.costs.devices if d.name in names}
    return all(kinds.get(d.name) == d.kind for d in plan.devices)


def _evaluated(problem: Problem, plan: Plan) -> Evaluation:
    """``plan`` with this problem's devices and budgets, simulated."""
    used = [d.name for d in plan.devices]
    plan = replace(plan, devices=problem.plan_devices(used), predicted=None, solver=None)
    schedule = None
    if len(used) == 1:
        schedule = schedule_of_steps(plan.steps, len(problem.graph), used[0])
    return evaluate_plan(problem, plan, schedule)


def noted_if_known(result: StrategyResult, known: Mapping[str, Plan]) -> StrategyResult:
    """``result``, its message saying so where its plan's steps are those of a known plan
    (``known``: by where it came from, e.g. "job 1a2b3c4d" or a file's path): the search
    found nothing cheaper than a plan it was given."""
    plan = result.plan
    origin = next((o for o, k in known.items() if plan is not None and k.steps == plan.steps), None)
    if origin is None:
        return result
    note = f"no plan cheaper than {origin}'s was found: this is that plan, costed here"
    return replace(result, message="; ".join(part for part in (result.message, note) if part))
