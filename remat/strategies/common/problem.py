"""What every strategy shares: the problem it solves, how a candidate schedule is judged,
and the result it returns."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from remat.compiler import compile_plan
from remat.costs import CostModel
from remat.devices import Tier, format_bytes
from remat.graph import Graph
from remat.objective import Objective, objective_costs
from remat.plan import Plan, PlanDevice, Predicted
from remat.schedule import Schedule
from remat.simulator import Simulation, simulate
from remat.solvers.model import Progress, SolveOptions, StopFlag
from remat.strategies.config import SearchConfig


@dataclass(frozen=True)
class SolverSettings:
    """How the strategies search: the solver backend, limits, progress and cancellation
    (the exact strategies), and the time shares and thresholds of ``search`` (the
    heuristics' time budgets too).

    ``on_plan`` gets each better plan an optimal strategy finds while it runs (its warm
    start, then the solver's incumbents the simulator accepts): a caller that runs the
    strategy on a derived problem (the coarse graph) uses them before the strategy returns.

    ``known_plans``: plans made before for the same graph (earlier jobs', a file's), which
    the exact strategies offer as incumbents where the simulator accepts them here
    (``known.known_start``): their result is never dearer than any of them.
    """

    backend: str = "highs"
    options: SolveOptions = field(default_factory=SolveOptions)
    on_progress: Callable[[Progress], None] | None = None
    cancel: StopFlag | None = None
    on_plan: Callable[[StrategyResult], None] | None = None
    search: SearchConfig = field(default_factory=SearchConfig)
    known_plans: tuple[Plan, ...] = ()


@dataclass(frozen=True)
class Problem:
    """A graph, its cost model, a budget in bytes per device (None: unlimited) and what a
    plan minimises (``remat.objective``). ``offloading``: plans may send activations to
    host memory (not where the search's costs are an objective's other than time)."""

    graph: Graph
    costs: CostModel
    budgets: Mapping[str, int | None]
    solver: SolverSettings = field(default_factory=SolverSettings)
    objective: Objective = field(default_factory=Objective)
    offloading: bool = True

    def in_objective_units(self) -> Problem:
        """The problem strategies search where the objective is not time alone: its costs
        are the objective's (``remat.objective.objective_costs``), its objective time."""
        return replace(
            self,
            costs=objective_costs(self.costs, self.objective),
            objective=Objective(),
            offloading=False,
        )

    @property
    def cancelled(self) -> bool:
        """The user asked to stop (the solver settings' cancel flag is set)."""
        return self.solver.cancel is not None and self.solver.cancel.is_set()

    def within(self, seconds: float) -> Problem:
        """This problem with the solver settings' time limit set to ``seconds``."""
        options = replace(self.solver.options, time_limit_s=seconds)
        return replace(self, solver=replace(self.solver, options=options))

    def starting_from(self, plans: Iterable[Plan]) -> Problem:
        """This problem with ``plans`` as the solver settings' ``known_plans``."""
        return replace(self, solver=replace(self.solver, known_plans=tuple(plans)))

    @property
    def shares_memory(self) -> bool:
        """Two or more of the cost model's devices share one memory pool: their plans may
        run concurrent sections (PORT-M), which no single-device-per-stage model bounds."""
        spaces = [d.memory_space for d in self.costs.devices]
        return len(spaces) != len(set(spaces))

    def without_bounds(self) -> Problem:
        """This problem, its progress reports carrying the incumbent but no bound: on a
        pool the searches bound their own models (XEngine's, one device's), not every
        concurrent plan of the pool, which may run below them."""
        listener = self.solver.on_progress
        if listener is None:
            return self

        def report(progress: Progress) -> None:
            listener(Progress(progress.elapsed_s, progress.objective, None, None))

        return replace(self, solver=replace(self.solver, on_progress=report))

    def plan_devices(self, names: Iterable[str] | None = None) -> tuple[PlanDevice, ...]:
        wanted = set(names) if names is not None else None
        return tuple(
            PlanDevice.of(d, self.budgets.get(d.name))
            for d in self.costs.devices
            if wanted is None or d.name in wanted
        )


@dataclass(frozen=True)
class Evaluation:
    """A candidate schedule compiled into a plan and judged by the simulator."""

    schedule: Schedule | None  # None: a plan stitched from parts (remat.strategies.exact.decompose)
    plan: Plan
    simulation: Simulation

    @property
    def fits(self) -> bool:
        return self.simulation.valid

    @property
    def cost_ms(self) -> float:
        return self.simulation.total_ms


def evaluate(problem: Problem, schedule: Schedule, strategy: str) -> Evaluation:
    """Compile ``schedule`` and simulate it under the problem's budgets. A candidate that
    is correct but over budget comes back with the budget violation; the peak it reached
    is still recorded (simulated without budgets). On two or more devices of one memory
    pool it is also compiled concurrent (PORT-M's stages, ``compile_plan``): that plan,
    no slower and needing no less memory, is taken where it fits."""
    devices = problem.plan_devices(schedule.devices)
    plan = compile_plan(problem.graph, schedule, devices, strategy, problem.costs)
    evaluation = evaluate_plan(problem, plan, schedule)
    spaces = [d.memory_space for d in devices]
    if len(spaces) == len(set(spaces)):
        return evaluation
    overlapped = evaluate_concurrent(problem, schedule, strategy)
    return overlapped if overlapped.fits else evaluation


def evaluate_concurrent(
    problem: Problem,
    schedule: Schedule,
    strategy: str,
    transfers: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    tier: Tier = Tier.HOST,
) -> Evaluation:
    """``schedule`` compiled concurrent (PORT-M's stages) and simulated, as ``evaluate``
    does on a pool; with ``transfers`` to ``tier`` beside each stage's section
    (``compile_plan``)."""
    devices = problem.plan_devices(schedule.devices)
    plan = compile_plan(
        problem.graph,
        schedule,
        devices,
        strategy,
        problem.costs,
        transfers=transfers,
        tier=tier,
        concurrent=True,
    )
    return evaluate_plan(problem, plan, schedule)


def evaluate_plan(problem: Problem, plan: Plan, schedule: Schedule | None = None) -> Evaluation:
    """Simulate ``plan`` (compiled from ``schedule``, or stitched without one) as
    ``evaluate`` does: with each prefetch's, page-in's and fixed read's memory counted from
    its step (``reserve_at_issue``), as the agent's executor reserves it, so that the plan's
    peak is the one a run reaches however its transfers are timed."""
    simulation = simulate(
        plan, problem.graph, problem.costs, problem.budgets, reserve_at_issue=True
    )
    if not simulation.valid:
        unlimited = simulate(plan, problem.graph, problem.costs, {}, reserve_at_issue=True)
        if unlimited.valid:  # over budget only: keep the true peak for "needs X bytes"
            simulation = replace(unlimited, violation=simulation.violation)
    return Evaluation(schedule, plan, simulation)


@dataclass(frozen=True)
class StrategyResult:
    """The best plan a strategy found within the budgets, or why it found none.

    ``min_budget_bytes``: when infeasible, the smallest peak (per device) among the
    strategy's own candidates: the budget this strategy would need.
    ``proven_infeasible``: without a plan, whether no plan exists at these budgets (the
    memory floor or a solver proved it), rather than that the strategy found none
    (``remat.strategies.auto`` says "infeasible" only then)."""

    strategy: str
    plan: Plan | None
    simulation: Simulation | None
    message: str = ""
    min_budget_bytes: dict[str, int] | None = None
    schedule: Schedule | None = None
    proven_infeasible: bool = False

    @property
    def feasible(self) -> bool:
        return self.plan is not None

    @property
    def time_ms(self) -> float:
        """Its plan's predicted time; infinity without a plan (results compare by it)."""
        if self.plan is None or self.simulation is None:
            return math.inf
        return self.simulation.total_ms

    def without_bound(self, strategy: str, note: str) -> StrategyResult:
        """This result as ``strategy``'s, ``note`` added to its message, without the bound
        and gap of the search it came from (``Problem.without_bounds``): "feasible" where
        that bound alone made it "optimal"."""
        plan = None if self.plan is None else replace(self.plan, strategy=strategy)
        if plan is not None and plan.solver is not None:
            status = "feasible" if plan.solver.status == "optimal" else plan.solver.status
            plan = replace(plan, solver=replace(plan.solver, status=status, bound=None, gap=None))
        message = "; ".join(part for part in (self.message, note) if part)
        return replace(self, strategy=strategy, plan=plan, message=message)


def with_prediction(plan: Plan, simulation: Simulation) -> Plan:
    predicted = Predicted(
        simulation.total_ms,
        simulation.compute_ms,
        simulation.copy_ms,
        simulation.peak_bytes,
        simulation.transfer_ms,
        simulation.energy_mj,
    )
    return replace(plan, predicted=predicted)


def select_best(strategy: str, evaluations: Iterable[Evaluation]) -> StrategyResult:
    """The cheapest candidate that fits; otherwise an infeasible result naming the smallest
    budget any candidate needed."""
    best: Evaluation | None = None
    smallest: Evaluation | None = None
    for candidate in evaluations:
        if candidate.fits and (best is None or candidate.cost_ms < best.cost_ms):
            best = candidate
        if _correct(candidate) and (smallest is None or _peak(candidate) < _peak(smallest)):
            smallest = candidate
    if best is not None:
        return StrategyResult(
            strategy,
            with_prediction(best.plan, best.simulation),
            best.simulation,
            schedule=best.schedule,
        )
    if smallest is None:
        return StrategyResult(strategy, None, None, "the strategy produced no correct schedule")
    need = smallest.simulation.peak_bytes
    return StrategyResult(
        strategy,
        None,
        smallest.simulation,
        f"infeasible at this budget: {strategy} needs at least {memory_needed(need)}",
        dict(need),
    )


def memory_needed(need: Mapping[str, int]) -> str:
    """Bytes per device, as the messages of plans that do not fit say them."""
    return ", ".join(f"{format_bytes(v)} ({v} B) on {d}" for d, v in need.items())


def cheapest(*results: StrategyResult | None) -> StrategyResult | None:
    """The cheapest feasible result, or None."""
    feasible = [r for r in results if r is not None and r.feasible and r.simulation is not None]
    return min(feasible, key=lambda r: r.simulation.total_ms, default=None)  # type: ignore[union-attr]


@dataclass(frozen=True)
class FitDeadline:
    """When a heuristic stops looking for a first plan that fits: once its own deadline
    ``wall`` (``time.monotonic()``) has passed and its thread has spent its fit budget of
    CPU time (``cpu``, a ``time.thread_time()``). Where no baseline fits, a heuristic cut
    short would leave the solvers without a start (greedy eviction and the multi-device
    heuristic). The budget is the heuristic's own CPU time, not wall time, so that a busy
    machine (other jobs, other processes) does not cut it short: there the search runs
    past its time limit with a plan rather than end within it without one."""

    wall: float
    cpu: float

    @classmethod
    def of(cls, deadline: float, fit_budget_s: float | None) -> FitDeadline:
        """From now: ``deadline``, or ``fit_budget_s`` of this thread's CPU time."""
        return cls(deadline, time.thread_time() + (fit_budget_s or 0.0))

    def passed(self) -> bool:
        return time.monotonic() > self.wall and time.thread_time() > self.cpu


def _correct(candidate: Evaluation) -> bool:
    """Valid, or invalid only because of the budget."""
    violation = candidate.simulation.violation
    return violation is None or violation.over_budget


def _peak(candidate: Evaluation) -> int:
    return max(candidate.simulation.peak_bytes.values())
