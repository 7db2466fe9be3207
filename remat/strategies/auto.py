"""``auto``, the default strategy: the baselines on each device, then greedy eviction, then
offloading or paging, then, on a graph small enough, a short exact solve; the cheapest plan
the simulator accepts wins.

The phases share the problem's time limit (``SolveOptions.time_limit_s``), counted from the
call:

1. every applicable baseline (Checkmate's Table 1) on each device: fast, and often enough;
2. greedy eviction (``heuristics.evict.greedy_evict``) on each device, for at most
   ``SearchConfig.evict_time_s`` (less where the limit is short); where no baseline fits it
   may run on to find a first plan (``fit_share`` of the limit);
3. DYNPROG (``heuristics.offload_dynprog``, never worse than GREEDY) on each device:
   offloading to host memory where the device's memory is apart from its host's, paging
   to the node's storage (``page_dynprog``, PORT's setting) where it is the host's (a cpu
   device, or a device of a pool: offloading there would free nothing), the time left
   shared between them; then, unless the best plan so far is within ``auto_skip_gap`` of
   the ideal, greedy eviction to looser budgets with those transfers over its plans
   (``offload_remat.recompute_then_offload``, the mix of ``offload_remat`` and ``port``)
   for at most ``evict_time_s`` per device;
4. where the graph has at most ``auto_exact_max_nodes`` nodes and the best plan so far is
   more than ``auto_skip_gap`` above the ideal, ``checkmate_milp`` (one device), ``port_m``
   (the devices of one pool, which compute at once) or ``xengine`` (other several) for at
   most ``auto_exact_s`` of the time left. Its own warm start (the best baseline and greedy
   eviction, ``exact.search.warm_start``) gives the solver the incumbent found so far.

Where the memory floor (``common.floor``: a node that fits on no device with every fixed
tensor resident) is above the budget, auto pages fixed tensors instead
(``heuristics.fixed_paging``, greedy eviction planning the activations; plan version 5) on
each device and returns the cheapest such plan. Only a proof says "infeasible": the
paging floor on every device (some node's inputs, output, workspace, fixed tensors and
gradients) or an exact solve over the whole problem that its solver proved infeasible, where
plans send no tensor away (``Problem.offloading`` False: the exact solve neither offloads
nor pages, and a plan that does may fit where its proof holds); the result then has
``proven_infeasible``. Otherwise the message is "no plan found by auto at
this budget (tried: ...)" with the least memory any phase needed (``min_budget_bytes``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from remat.devices import Device, Tier
from remat.errors import RematError
from remat.strategies.baselines import TABLE_1
from remat.strategies.common.floor import shortfall
from remat.strategies.common.offload import named
from remat.strategies.common.offload import sending as sending_name
from remat.strategies.common.problem import Problem, StrategyResult, memory_needed
from remat.strategies.exact.checkmate import checkmate_milp
from remat.strategies.exact.offload_remat import recompute_then_offload
from remat.strategies.exact.port_m import NAME as PORT_M
from remat.strategies.exact.port_m import port_m
from remat.strategies.exact.xengine import xengine
from remat.strategies.heuristics.evict import greedy_evict
from remat.strategies.heuristics.fixed_paging import page_fixed
from remat.strategies.heuristics.offload_dynprog import NAME as OFFLOAD_DYNPROG
from remat.strategies.heuristics.offload_dynprog import offload_dynprog

logger = logging.getLogger(__name__)

AUTO = "auto"
DESCRIPTION = (
    "Every applicable baseline on each device, then greedy eviction, then offloading "
    "(offload_dynprog) on each device with memory apart from its host and paging to storage "
    "(page_dynprog) on each other, then on graphs small enough a short exact solve "
    "(checkmate_milp, port_m on the devices of one pool, or xengine on other several); the "
    "cheapest plan that fits wins."
)


@dataclass
class _Tried:
    """What auto ran, for the message, and every result."""

    phases: list[str] = field(default_factory=list)
    results: list[StrategyResult] = field(default_factory=list)

    def add(self, result: StrategyResult | None) -> None:
        if result is not None:
            self.results.append(result)


def auto(
    problem: Problem, device: str | None = None, *, good_enough_ms: float | None = None
) -> StrategyResult:
    """The cheapest plan of the baselines, greedy eviction, offloading and (graphs of at
    most ``auto_exact_max_nodes`` nodes) a short exact solve, on ``device`` or on each device
    (None); see the module docstring for the phases, the time they get and the wording of
    a result without a plan. ``good_enough_ms``: no exact solve once a plan costs at most
    this (the max-batch search only asks whether a plan is within its bound)."""
    start = time.monotonic()
    config, options = problem.solver.search, problem.solver.options
    if device is not None:
        problem.costs.device_index(device)  # an unknown device is a clear error
    names = (device,) if device is not None else tuple(d.name for d in problem.costs.devices)
    tried = _Tried()

    def left() -> float:
        return options.time_limit_s - (time.monotonic() - start)

    floor = shortfall(problem, names)
    _baselines(problem, names, tried)
    if floor is not None:  # no plan keeps every fixed tensor resident: page them
        return _paging_fixed(problem, names, tried, floor.message(AUTO))

    if not problem.cancelled:
        fit_s = options.time_limit_s * config.fit_share / len(names)
        for name in names:
            seconds = max(0.0, min(config.evict_time_s, left() / len(names)))
            logger.debug("auto: greedy eviction on %s for %.3g s", name, seconds)
            tried.add(_attempt(greedy_evict, problem, name, seconds, fit_s))
        tried.phases.append(f"greedy_evict on {', '.join(names)}")
    devices = [problem.costs.devices[problem.costs.device_index(n)] for n in names]
    movable = devices if problem.offloading else []  # no transfers for other objectives
    offloading = [d.name for d in movable if d.has_own_memory]
    paging = [d.name for d in movable if not d.has_own_memory]

    def settled() -> bool:
        """The best plan so far leaves nothing worth a longer search."""
        best = _cheapest(tried.results)
        good = best is not None and good_enough_ms is not None and _ms(best) <= good_enough_ms
        return problem.cancelled or good or _near_ideal(problem, best, names)

    for tier, sending in ((Tier.HOST, offloading), (Tier.STORAGE, paging)):
        if sending and not problem.cancelled:
            for name in sending:
                within = problem.within(max(0.0, left()) / len(sending))
                tried.add(_attempt(offload_dynprog, within, name, tier))
            tried.phases.append(f"{named(OFFLOAD_DYNPROG, tier)} on {', '.join(sending)}")
        if sending and not settled():
            for name in sending:
                seconds = max(0.0, min(config.evict_time_s, left() / len(sending)))
                for mixed in recompute_then_offload(problem, name, seconds, tier):
                    tried.add(_as_auto(mixed))
            tried.phases.append(f"greedy_evict, then {sending_name(tier)}, on {', '.join(sending)}")

    seconds = min(config.auto_exact_s, left())
    exact = _exact_name(devices)
    if (
        not problem.cancelled
        and len(problem.graph) <= config.auto_exact_max_nodes
        and seconds >= config.min_solve_s
        and not settled()
    ):
        within = problem.within(seconds)
        logger.debug("auto: %s for %.3g s", exact, seconds)
        if exact == PORT_M:
            solved = _attempt(port_m, within, None)
        elif exact == "xengine":
            solved = _attempt(xengine, within, None)
        else:
            solved = _attempt(checkmate_milp, within, names[0])
        tried.add(solved)
        tried.phases.append(f"{exact} {seconds:.3g} s")
        if solved is not None and _proved(solved) and problem.offloading:
            # its model has no transfers: a plan that sends tensors away may still fit
            sends = [w for w, on in (("offloading", offloading), ("paging", paging)) if on]
            tried.phases[-1] += f" (proved that no plan without {' or '.join(sends)} fits)"
        elif solved is not None and _proved(solved):  # over every device auto plans on
            message = solved.message.replace(f": {exact} proved", f": auto ({exact}) proved", 1)
            return _no_plan(tried, message, proven=True)

    best = _cheapest(tried.results)
    if best is not None:
        return best
    text = f"no plan found by auto at this budget (tried: {', '.join(tried.phases)})"
    if problem.cancelled:
        text += "; cancelled"
    return _no_plan(tried, text, proven=False)


def _as_auto(result: StrategyResult) -> StrategyResult:
    """A plan of greedy eviction, then transfers (``offload_remat.recompute_then_offload``),
    under auto's name: its strategy is the mix, which no strategy of its own runs alone."""
    plan = None if result.plan is None else replace(result.plan, strategy=AUTO)
    return replace(result, strategy=AUTO, plan=plan, message=f"{AUTO}: {result.message}")


def _exact_name(devices: Sequence[Device]) -> str:
    """Auto's exact strategy: ``checkmate_milp`` on one device, ``port_m`` on the devices
    of one memory pool (which compute at once), ``xengine`` on any other several."""
    if len(devices) == 1:
        return "checkmate_milp"
    return PORT_M if len({d.memory_space for d in devices}) == 1 else "xengine"


def _paging_fixed(
    problem: Problem, names: Sequence[str], tried: _Tried, floor: str
) -> StrategyResult:
    """Below the fixed memory's floor: the cheapest plan that pages fixed tensors on one of
    ``names`` (``heuristics.fixed_paging``, greedy eviction planning the activations), each
    device an equal share of the time limit; without one, ``floor`` (what keeping them
    resident needs), a proof where every device is below the paging floor too."""
    seconds = problem.solver.options.time_limit_s / len(names)
    found: list[StrategyResult] = []
    for name in names:

        def evict(p: Problem, name: str = name) -> StrategyResult:
            return greedy_evict(p, name, p.solver.options.time_limit_s)

        found.append(page_fixed(problem.within(seconds), name, evict, AUTO))
    best = _cheapest(found)
    if best is not None:
        return best
    tried.phases.append(f"paging fixed tensors on {', '.join(names)}")
    proven = all(r.proven_infeasible for r in found)
    notes = "; ".join(f"on {n}: {r.message}" for n, r in zip(names, found, strict=True))
    resident = floor.removeprefix("infeasible at this budget: ")
    lead = (
        "infeasible at this budget: auto proved that no schedule fits, even paging fixed tensors"
        if proven
        else "no plan found by auto at this budget"
    )
    return _no_plan(
        tried, f"{lead}: {notes}; keeping every fixed tensor resident: {resident}", proven
    )


def _baselines(problem: Problem, names: Sequence[str], tried: _Tried) -> None:
    """Every baseline of Checkmate's Table 1 on each device (one that does not apply to
    the graph, a chain-only heuristic on a non-chain, is skipped)."""
    for name in names:
        for baseline, _ in TABLE_1.values():
            tried.add(_attempt(baseline, problem, name))
    tried.phases.append(f"baselines on {', '.join(names)}")


def _attempt(
    strategy: Callable[..., StrategyResult], problem: Problem, *args: object
) -> StrategyResult | None:
    """``strategy(problem, *args)``, or None where it does not apply to the graph."""
    try:
        return strategy(problem, *args)
    except RematError as exc:
        logger.debug("auto: %s does not apply: %s", getattr(strategy, "__name__", strategy), exc)
        return None


def _ms(result: StrategyResult) -> float:
    assert result.simulation is not None
    return result.simulation.total_ms


def _cheapest(results: Sequence[StrategyResult]) -> StrategyResult | None:
    feasible = [r for r in results if r.feasible and r.simulation is not None]
    return min(feasible, key=lambda r: r.simulation.total_ms, default=None)  # type: ignore[union-attr]


def _near_ideal(problem: Problem, best: StrategyResult | None, names: Sequence[str]) -> bool:
    """The best plan is within ``auto_skip_gap`` of the ideal (every node once on its
    fastest device): no exact solve can gain more."""
    if best is None or best.simulation is None:
        return False
    ideal = problem.costs.ideal_ms(names[0] if len(names) == 1 else None)
    return best.simulation.total_ms <= ideal * (1 + problem.solver.search.auto_skip_gap)


def _proved(result: StrategyResult) -> bool:
    return not result.feasible and result.proven_infeasible


def _no_plan(tried: _Tried, message: str, proven: bool) -> StrategyResult:
    """Auto's result without a plan: ``message`` (a proof, or what was tried) and the least
    memory any phase's schedule needed (``min_budget_bytes``), with its simulation."""
    needing = [r for r in tried.results if r.min_budget_bytes]
    least = min(needing, key=lambda r: max(r.min_budget_bytes.values()), default=None)  # type: ignore[union-attr]
    if least is None or least.min_budget_bytes is None:
        if not proven:
            message += "; none of them produced a correct schedule"
        return StrategyResult(AUTO, None, None, message, proven_infeasible=proven)
    need = least.min_budget_bytes
    amounts = memory_needed(need)
    if proven:
        message += f"; the least any plan found needs is {amounts} ({least.strategy})"
    else:
        message += f"; the least any of them needed is {amounts} ({least.strategy})"
    return StrategyResult(
        AUTO,
        None,
        least.simulation,
        message,
        dict(need),
        least.schedule,
        proven_infeasible=proven,
    )
