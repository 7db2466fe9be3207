"""The strategy registry: every strategy by name, with its kind, whether it places
operators over devices, and a one-line description (``REGISTRY``); ``run_strategy`` runs
one by name, or ``auto`` (``remat.strategies.auto``: the baselines, greedy eviction,
offloading and a short exact solve; the default of the CLI, the API and the workers).

Adding a strategy is one module (in ``baselines/``, ``heuristics/`` or ``exact/``) and one
entry: here, or for a baseline in ``baselines.TABLE_1``; or a call to ``register``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from remat.errors import StrategyError
from remat.objective import forbidden, power_violation
from remat.simulator import simulate
from remat.strategies.auto import AUTO, auto
from remat.strategies.baselines import TABLE_1
from remat.strategies.common.problem import Problem, StrategyResult, with_prediction
from remat.strategies.exact.checkmate import checkmate_lp_rounding, checkmate_milp
from remat.strategies.exact.moccasin import moccasin
from remat.strategies.exact.offload_remat import offload_remat
from remat.strategies.exact.port import port
from remat.strategies.exact.port_m import port_m
from remat.strategies.exact.xengine import xengine
from remat.strategies.heuristics.evict import greedy_evict_strategy
from remat.strategies.heuristics.input_aware import input_aware
from remat.strategies.heuristics.offload_dynprog import offload_dynprog
from remat.strategies.heuristics.offload_greedy import offload_greedy

Strategy = Callable[[Problem, str], StrategyResult]
Kind = Literal["baseline", "heuristic", "exact"]


@dataclass(frozen=True)
class StrategyInfo:
    """A registered strategy. ``places_over_devices``: it places operators itself, so it
    runs once over every device (its device argument is ignored); the others run on one
    device, and ``run_strategy`` tries each device when none is named. ``offloads``: its
    plans send activations to host memory, so where no device is named it runs on the
    devices whose memory is apart from the host's, if any. ``pages``: its plans page
    activations to storage, on any device. Plans with transfers are made for time alone
    (transfers overlap compute), except by a strategy that plans ``any_objective`` itself
    on the true costs (``port``: POET's objective)."""

    name: str
    kind: Kind
    places_over_devices: bool
    description: str
    run: Strategy = field(repr=False, compare=False)
    offloads: bool = False
    pages: bool = False
    any_objective: bool = False

    def as_json(self) -> dict[str, str | bool]:
        """The fields a client sees (everything but ``run``)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "places_over_devices": self.places_over_devices,
            "description": self.description,
        }


REGISTRY: dict[str, StrategyInfo] = {
    name: StrategyInfo(name, "baseline", False, description, run)
    for name, (run, description) in TABLE_1.items()
}
REGISTRY |= {
    info.name: info
    for info in (
        StrategyInfo(
            "greedy_evict",
            "heuristic",
            False,
            "Evict the value that frees the most memory per recomputed millisecond until the "
            "plan fits (after Dynamic Tensor Rematerialization).",
            greedy_evict_strategy,
        ),
        StrategyInfo(
            "input_aware",
            "heuristic",
            False,
            "Recompute the activations Mimose's greedy scheduler picks by size buckets until "
            "the estimated excess is covered: plans a new input size in milliseconds.",
            input_aware,
        ),
        StrategyInfo(
            "offload_greedy",
            "heuristic",
            False,
            "Offload the first activations to host memory, transfers overlapping compute, "
            "until the plan fits (Beaumont et al.'s GREEDY).",
            offload_greedy,
            offloads=True,
        ),
        StrategyInfo(
            "offload_dynprog",
            "heuristic",
            False,
            "Offload the activations a dynamic program over the fractional relaxation "
            "chooses (Beaumont et al.'s DYNPROG); never worse than offload_greedy.",
            offload_dynprog,
            offloads=True,
        ),
        StrategyInfo(
            "checkmate_milp",
            "exact",
            False,
            "Checkmate's MILP on one device, solved towards a proven optimum.",
            checkmate_milp,
        ),
        StrategyInfo(
            "checkmate_lp_rounding",
            "exact",
            False,
            "Checkmate's LP relaxation, rounded and checked, swept over budget reductions.",
            checkmate_lp_rounding,
        ),
        StrategyInfo(
            "moccasin",
            "exact",
            False,
            "Moccasin's retention-interval constraint program on one device (CP-SAT): "
            "plans for graphs of thousands of nodes.",
            moccasin,
        ),
        StrategyInfo(
            "offload_remat",
            "exact",
            False,
            "Keep, recompute or offload each activation: greedy eviction to looser budgets "
            "with offloading over its plans, checkmate_milp's search, then its MILP with "
            "transfers to host memory beside each stage's compute; never worse than "
            "offload_dynprog.",
            offload_remat,
            offloads=True,
        ),
        StrategyInfo(
            "port",
            "exact",
            False,
            "PORT's ILP: keep, recompute or page each activation to storage, decided "
            "together; first the least time, then the fewest recomputations and page "
            "transfers within 1% of it.",
            port,
            pages=True,
            any_objective=True,
        ),
        StrategyInfo(
            "port_m",
            "exact",
            True,
            "PORT-M's ILP over devices sharing one memory pool: a stage's devices compute "
            "at once (concurrent plans), so recomputation on one hides behind another's work.",
            port_m,
        ),
        StrategyInfo(
            "xengine",
            "exact",
            True,
            "XEngine's MIQP: operators placed over every device, solved towards a proven optimum.",
            xengine,
        ),
    )
}

STRATEGIES: dict[str, Strategy] = {name: info.run for name, info in REGISTRY.items()}
"""Every strategy by name (``REGISTRY`` without the metadata); open to ``register``."""

BASELINES: tuple[str, ...] = tuple(n for n, info in REGISTRY.items() if info.kind == "baseline")
"""The heuristics of Checkmate's Table 1 (section 6.1)."""
OPTIMAL: tuple[str, ...] = tuple(n for n, info in REGISTRY.items() if info.kind == "exact")
MULTI_DEVICE = frozenset(n for n, info in REGISTRY.items() if info.places_over_devices)
OFFLOADING: tuple[str, ...] = tuple(
    n for n, info in REGISTRY.items() if info.offloads and info.kind != "exact"
)
"""The offloading heuristics: fast, and a job's baselines with Checkmate's Table 1."""


def register(
    name: str,
    strategy: Strategy,
    kind: Kind = "heuristic",
    places_over_devices: bool = False,
    description: str = "",
) -> None:
    """Make ``strategy`` available to ``run_strategy`` as ``name``."""
    REGISTRY[name] = StrategyInfo(name, kind, places_over_devices, description, strategy)
    STRATEGIES[name] = strategy


def run_strategy(name: str, problem: Problem, device: str | None = None) -> StrategyResult:
    """Run strategy ``name`` (or ``auto``) on one device, or on each device of the cost
    model (None; for an offloading strategy, each device with memory apart from the host's
    where there is one, else each cpu device, emulating) and return the cheapest feasible
    result, else the infeasible one needing the least memory.

    Cheapest by the problem's objective (``remat.objective``): where it is not time alone,
    the strategy searches on the objective's costs, and its plan is judged on the true
    ones: predicted time and energy, and the power caps.

    The plan records the graph it was made for (``Plan.graph``)."""
    found = _by_objective(name, problem, device)
    if found.plan is None:
        return found
    return replace(found, plan=replace(found.plan, graph=problem.graph.fingerprint))


def _by_objective(name: str, problem: Problem, device: str | None) -> StrategyResult:
    if problem.objective.time_only:
        return _run(name, problem, device)
    info = REGISTRY.get(name)
    if info is not None and info.any_objective:
        return judged(problem, _run(name, problem, device))
    searched = problem.in_objective_units()
    result = judged(problem, _run(name, searched, device))
    if result.feasible or device is not None or (name != AUTO and name not in MULTI_DEVICE):
        return result
    return _within_caps(problem, searched, result)


def _within_caps(problem: Problem, searched: Problem, broken: StrategyResult) -> StrategyResult:
    """Where a search over every device found no plan within the power caps: ``auto`` on
    each device that every node may run on, the cheapest by the objective, or ``broken``.
    A one-device plan keeps the caps by construction, so a capped multi-device search is
    never worse than one: auto gets a quarter of the limit there, and at least greedy
    eviction's own budget (``evict_time_s``), so that a busy machine leaves it a plan."""
    over = forbidden(problem.costs, problem.objective)
    free = [d.name for j, d in enumerate(problem.costs.devices) if not over[:, j].any()]
    config = searched.solver.search
    seconds = max(config.min_solve_s, config.evict_time_s, searched.solver.options.time_limit_s / 4)
    found = [judged(problem, auto(searched.within(seconds), name)) for name in free]
    plans = [r for r in found if r.feasible and r.simulation is not None]
    if not plans:
        return broken
    objective = problem.objective

    def value(r: StrategyResult) -> float:
        assert r.simulation is not None
        return objective.value(r.simulation.total_ms, r.simulation.energy_mj)

    best = min(plans, key=value)
    where = next(n for n, r in zip(free, found, strict=True) if r is best)
    note = f"{broken.strategy} found no plan within the power caps; auto on {where}"
    return replace(best, strategy=broken.strategy, message=note)


def judged(problem: Problem, found: StrategyResult) -> StrategyResult:
    """``found`` (searched on ``problem``'s objective costs) with its plan simulated on the
    true costs, or without a plan where it breaks a power cap or the runtime cap."""
    if found.plan is None:
        return found
    simulation = simulate(found.plan, problem.graph, problem.costs, problem.budgets)
    broken = power_violation(found.plan, problem.costs, problem.objective)
    if broken is not None or not simulation.valid:
        why = broken or str(simulation.violation)
        return StrategyResult(found.strategy, None, None, f"no plan within the power caps: {why}")
    cap = problem.objective.time_cap_ms
    if cap is not None and simulation.total_ms > cap:
        return StrategyResult(
            found.strategy,
            None,
            None,
            f"no plan within the runtime cap: {found.strategy}'s takes "
            f"{simulation.total_ms:.4g} ms, over {cap:g} ms",
        )
    return replace(found, plan=with_prediction(found.plan, simulation), simulation=simulation)


def _run(name: str, problem: Problem, device: str | None) -> StrategyResult:
    if name == AUTO:
        return auto(problem, device)
    strategy = STRATEGIES.get(name)
    if strategy is None:
        known = ", ".join([AUTO, *STRATEGIES])
        raise StrategyError(f"unknown strategy {name!r}; known strategies: {known}")
    info = REGISTRY.get(name)
    if info is not None and (info.offloads or info.pages) and not problem.offloading:
        what = "offloads" if info.offloads else "pages"
        raise StrategyError(
            f"{name} {what}, and transfers are planned for time alone: choose another "
            "strategy for this objective or these power caps"
        )
    if info is not None and info.places_over_devices:
        return strategy(problem, device)  # type: ignore[arg-type]
    if device is not None:
        problem.costs.device_index(device)  # an unknown device is a clear error
        return strategy(problem, device)
    devices = problem.costs.devices
    if info is not None and info.offloads and any(d.has_own_memory for d in devices):
        devices = tuple(d for d in devices if d.has_own_memory)
    results = [strategy(problem, d.name) for d in devices]
    return min(results, key=_rank)


def _rank(result: StrategyResult) -> tuple[int, float]:
    if result.feasible and result.simulation is not None:
        return (0, result.simulation.total_ms)
    need = result.min_budget_bytes or {}
    return (1, float(max(need.values())) if need else float("inf"))
