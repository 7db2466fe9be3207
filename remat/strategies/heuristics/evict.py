"""Greedy eviction: one-device plans for budgets that the checkpoint baselines miss.

A static version of the eviction loop of Dynamic Tensor Rematerialization (Kirisame et
al., 2021) over Checkmate's stages. Start from checkpoint-all (every value kept until
its last use). While some stage's predicted peak is over the budget, evict one value
(any but a model output) held through the stage with the highest peak: it is no longer
kept from its last read before that stage to its next read after it, where it is
recomputed (R solved exactly for the new S, so ancestors no longer held are recomputed
with it), or one value that the stage reads or computes is no longer kept into the next
stage (freed after its last use in the stage, recomputed at its next read). The value
chosen frees the most excess memory (summed over all stages) per millisecond of
recomputation it adds. Once the plan fits, gaps are refilled (a value kept instead of
recomputed) while the plan still fits and gets cheaper; on one device, swaps follow: a
gap refilled, then eviction and refill again, taken where that ends cheaper.

Chen's policies keep whole segments and recompute whole segments; eviction decides per
value and per interval, which is what budgets near the memory floor need (and why it
finds cheaper plans at moderate budgets too). Gradients are values like any other and are
evicted as well, and values are released at a stage's end too (docs/solvers.md,
"Measurements behind the defaults"). Every candidate is scored with
``policy.predict`` (on a placement over several devices, ``Profiler.profile_placed``);
the simulator judges the result.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from remat.graph import Graph
from remat.schedule import Schedule
from remat.strategies.common.policy import (
    Candidate,
    Prediction,
    choose,
    device_fixed_bytes,
    predict,
)
from remat.strategies.common.pooled import as_one_device
from remat.strategies.common.problem import (
    FitDeadline,
    Problem,
    StrategyResult,
    cheapest,
    evaluate,
    memory_needed,
    select_best,
)
from remat.strategies.common.profile import Profiler, excess
from remat.strategies.common.rsolve import (
    HoldBuilder,
    Holds,
    Span,
    Sparse,
    merge_spans,
    solve_and_prune_sparse,
    stage_reads,
)
from remat.strategies.heuristics.placed import bands

STRATEGY = "greedy_evict"
_SAVING = 1e-9  # relative: a swap must save more than rounding noise to be taken
_EPSILON_MS = 1e-6  # an eviction that adds no recomputation scores highest, not infinite


@dataclass(frozen=True)
class _State:
    holds: Holds  # S, pruned: what a node's home device keeps
    cost_ms: float
    peaks: np.ndarray  # int64 [D, T]: fixed memory plus the most resident in each stage
    excess: int  # bytes over the budgets, summed over devices and stages
    reads: list[list[int]]  # stages in which each value is read (``stage_reads``)
    made: Sparse  # R's rows and S, on each node's home

    @property
    def fits(self) -> bool:
        return self.excess == 0


@dataclass(frozen=True)
class _EvictionSetup:
    """What one eviction search runs on: one device or a placement (node i computed and
    kept only on ``names[home[i]]``), the budgets and the deadline; R solved on holds
    either way, scored by ``policy.predict`` or by ``Profiler.profile_placed``. While it
    descends to a first plan that fits, ``fit`` may hold it past the deadline."""

    problem: Problem
    names: tuple[str, ...]
    home: np.ndarray  # device index per node
    budgets: np.ndarray  # bytes per device (unlimited: the largest int64)
    evictable: frozenset[int]  # values that are not model outputs
    deadline: float
    fixed: int  # on one device: its fixed memory (``device_fixed_bytes``)
    profiler: Profiler  # on a placement
    fit: FitDeadline | None = None

    @classmethod
    def of(
        cls, problem: Problem, names: Sequence[str], home: np.ndarray, seconds: float
    ) -> _EvictionSetup:
        graph = problem.graph
        evictable = frozenset(range(len(graph))) - set(graph.outputs)
        unlimited = np.iinfo(np.int64).max
        budgets = [problem.budgets.get(name) for name in names]
        limits = np.array([unlimited if b is None else b for b in budgets], dtype=np.int64)
        fixed = device_fixed_bytes(problem, names[0]) if len(names) == 1 else 0
        deadline = time.monotonic() + seconds
        profiler = Profiler(problem, names)
        return cls(problem, tuple(names), home, limits, evictable, deadline, fixed, profiler)

    def state(self, holds: Holds) -> _State:
        """R solved for ``holds`` and scored. On a placement too the one-device sparse
        solve gives R's rows (``solve_r_placed`` with S only on the homes: the same (1c)
        starts, the same closure, each node on its home), which ``placed`` spreads out."""
        graph = self.problem.graph
        sparse = solve_and_prune_sparse(graph, holds)
        if len(self.names) == 1:
            prediction = predict(self.problem, self.names[0], sparse, self.fixed)
            cost, peaks = prediction.cost_ms, np.array([prediction.stage_peaks], dtype=np.int64)
        else:
            found = self.profiler.profile_placed(sparse, self.home)
            cost, peaks = found.cost_ms, found.peaks
        reads = stage_reads(graph, sparse.computed)
        return _State(sparse.holds, cost, peaks, self._excess(peaks), reads, sparse)

    def placed(self, sparse: Sparse) -> Schedule:
        """The schedule of ``sparse`` with node i computed and kept on ``names[home[i]]``."""
        return _on_placement(self.names, self.home, sparse.R(), sparse.S())

    def _excess(self, peaks: np.ndarray) -> int:
        return excess(peaks, self.budgets)

    def stopped(self) -> bool:
        if self.problem.cancelled:
            return True
        if self.fit is not None:
            return self.fit.passed()
        return time.monotonic() > self.deadline


_Step = Callable[[_EvictionSetup, _State], "_State | None"]  # the next state, if any


def greedy_evict(
    problem: Problem,
    device: str,
    time_budget_s: float | None = None,
    fit_budget_s: float | None = None,
) -> StrategyResult:
    """The cheapest plan the eviction loop reaches on ``device`` within ``time_budget_s``
    (default ``SearchConfig.evict_time_s``; then the loop's last plan is judged: it fits,
    or it says how much it needs). The descent to a first plan that fits may run on to
    ``fit_budget_s`` (if longer): where nothing else gives a plan, a slow moment must not
    leave none (refills and swaps then stop). A descent stopped by its time, not by the
    heuristic, says so instead of "infeasible at this budget"."""
    if time_budget_s is None:
        time_budget_s = problem.solver.search.evict_time_s
    started = time.monotonic()
    home = np.zeros(len(problem.graph), dtype=np.int64)
    context = _EvictionSetup.of(problem, (device,), home, time_budget_s)
    fit = FitDeadline.of(context.deadline, fit_budget_s)
    state = _search(context, fit)
    out_of_time = fit.passed()
    prediction = Prediction(state.cost_ms, tuple(state.peaks[0].tolist()))
    found = choose(problem, device, STRATEGY, [Candidate(state.made, prediction)])
    if found.feasible or state.fits or not out_of_time or found.min_budget_bytes is None:
        return found
    seconds = time.monotonic() - started
    needs = memory_needed(found.min_budget_bytes)
    return replace(
        found,
        message=f"{STRATEGY} ran out of time ({seconds:.3g} s): its plan needs at least {needs}",
    )


def greedy_evict_strategy(problem: Problem, device: str) -> StrategyResult:
    """``greedy_evict`` as the strategy of that name: refills and swaps within
    ``SearchConfig.evict_time_s``, the descent to a first plan that fits for up to
    ``evict_fit_s``."""
    config = problem.solver.search
    return greedy_evict(problem, device, config.evict_time_s, config.evict_fit_s)


def evict_pooled(
    problem: Problem,
    names: Sequence[str],
    time_budget_s: float | None = None,
    fit_budget_s: float | None = None,
) -> StrategyResult:
    """Greedy eviction on devices that share one memory pool, planned as one device
    (``common.pooled``: the pool's memory is one device's, each node timed on its fastest
    device), its schedule then computing each node on that device: compiled concurrent
    where that fits (``evaluate``)."""
    one = as_one_device(problem, names)
    alone = greedy_evict(one.problem, one.anchor, time_budget_s, fit_budget_s)
    if alone.schedule is None:
        return replace(alone, strategy=STRATEGY)
    schedule = _on_placement(one.names, one.home, alone.schedule.R[0], alone.schedule.S[0])
    return select_best(STRATEGY, [evaluate(problem, schedule, STRATEGY)])


def _on_placement(
    names: tuple[str, ...], home: np.ndarray, R: np.ndarray, S: np.ndarray
) -> Schedule:
    """One device's R and S [T, n] as a schedule over ``names`` with node i computed and
    kept on ``names[home[i]]``."""
    on = home[None, None, :] == np.arange(len(names))[:, None, None]
    return Schedule(names, R[None] & on, S[None] & on)


def evict_placed(
    problem: Problem,
    names: Sequence[str],
    home: np.ndarray,
    time_budget_s: float | None = None,
) -> StrategyResult:
    """Greedy eviction with node i computed (and recomputed) only on ``names[home[i]]``,
    its value kept there and copied to users elsewhere (XEngine's eq. 11-12), within
    ``time_budget_s`` (default ``SearchConfig.evict_time_s``). On the placement of the
    multi-device heuristic's plan it finds cheaper plans than Chen's policies there."""
    if time_budget_s is None:
        time_budget_s = problem.solver.search.evict_time_s
    context = _EvictionSetup.of(problem, names, home, time_budget_s)
    schedule = context.placed(_search(context).made)
    return select_best(STRATEGY, [evaluate(problem, schedule, STRATEGY)])


def evict_bands(
    problem: Problem,
    names: Sequence[str],
    time_budget_s: float,
    offer: Callable[[StrategyResult], None],
) -> None:
    """Greedy eviction on band placements (``placed.bands``: each node on its fastest
    device but for one band of forward layers), those whose keep-everything plan is least
    over the budgets first, each better plan offered, until the time budget is spent or
    ``SearchConfig.band_patience`` bands in a row bring nothing better; then node moves
    from the best band (``evict_moves``) for what is left. The multi-device heuristic ranks
    bands by Chen's policies, which can keep too much (an attention block's values); the
    keep-everything excess ranks the bands that eviction does well on near the top."""
    homes = bands(problem, names)
    context = _EvictionSetup.of(problem, names, homes[0], time_budget_s)  # one Profiler for all
    keep = HoldBuilder(problem.graph).keep_everything().build()
    ranked: list[tuple[int, float, int]] = []
    for index, home in enumerate(homes):
        if context.stopped():
            return
        kept = replace(context, home=home).state(keep)
        ranked.append((kept.excess, kept.cost_ms, index))
    best_home, best_ms, since = None, np.inf, 0
    for _, _, index in sorted(ranked):
        left = context.deadline - time.monotonic()
        if left <= 0 or problem.cancelled or since >= problem.solver.search.band_patience:
            break
        found = evict_placed(problem, names, homes[index], left)
        since += 1
        if (cost := _fitting_ms(found)) < best_ms:
            best_home, best_ms, since = homes[index], cost, 0
            offer(found)
    if best_home is not None:
        evict_moves(problem, names, best_home, best_ms, context.deadline, offer)


def evict_moves(
    problem: Problem,
    names: Sequence[str],
    home: np.ndarray,
    cost_ms: float,
    deadline: float,
    offer: Callable[[StrategyResult], None],
) -> None:
    """Local search over placements from ``home`` (whose eviction plan costs ``cost_ms``):
    one node moved to another device, greedy eviction on the result, the move kept (and
    its plan offered) where the plan fits and costs less, until no move helps or
    ``deadline``. Nodes on the boundary between devices are tried first, and once a node
    has moved its neighbours are tried again (the "don't look bits" of local search for
    the TSP)."""
    neighbours = _neighbours(problem.graph)
    look = deque(_boundary_first(home, neighbours))
    while look and time.monotonic() < deadline and not problem.cancelled:
        i = look.popleft()
        for d in (d for d in range(len(names)) if d != home[i]):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            moved = home.copy()
            moved[i] = d
            found = evict_placed(problem, names, moved, left)
            if (cost := _fitting_ms(found)) < cost_ms * (1 - _SAVING):
                home, cost_ms = moved, cost
                offer(found)
                look.extendleft([j for j in neighbours[i] if j not in look])
                break


def _fitting_ms(found: StrategyResult) -> float:
    """The simulated cost of a plan that fits; infinite otherwise."""
    fitting = cheapest(found)
    return np.inf if fitting is None or fitting.simulation is None else fitting.simulation.total_ms


def _neighbours(graph: Graph) -> list[list[int]]:
    """The nodes each node reads or is read by."""
    users = graph.users()
    return [sorted({*node.deps, *users[node.id]}) for node in graph.nodes]


def _boundary_first(home: np.ndarray, neighbours: list[list[int]]) -> list[int]:
    """Every node, those with the most neighbours on another device first."""
    across = [sum(home[j] != home[i] for j in near) for i, near in enumerate(neighbours)]
    return sorted(range(len(home)), key=lambda i: -across[i])


def home_of(schedule: Schedule, names: Sequence[str]) -> np.ndarray:
    """Each node's device in its own stage (an index into ``names``)."""
    nodes = np.arange(schedule.size)
    on = np.argmax(schedule.R[:, nodes, nodes], axis=0)
    return np.array([names.index(schedule.devices[d]) for d in on.tolist()], dtype=np.int64)


def _search(context: _EvictionSetup, fit: FitDeadline | None = None) -> _State:
    """Evict until the plan fits (until ``fit`` where given, else the context's deadline),
    then refill and swap within the context's deadline."""
    state = context.state(HoldBuilder(context.problem.graph).keep_everything().build())
    fitting = replace(context, fit=fit)
    state = _refill(context, _descend(fitting, state))
    return _swap(context, state) if len(context.names) == 1 else state


def _descend(context: _EvictionSetup, state: _State) -> _State:
    """Evict until the plan fits, no eviction frees excess memory, or time is up."""
    return _repeat(context, state, _best_eviction, lambda s: not s.fits)


def _repeat(
    context: _EvictionSetup, state: _State, step: _Step, go: Callable[[_State], bool]
) -> _State:
    """``step`` applied while ``go`` holds for the current state, ``step`` finds a next
    one and time is left."""
    while go(state) and not context.stopped():
        found = step(context, state)
        if found is None:
            break
        state = found
    return state


def _best_eviction(context: _EvictionSetup, state: _State) -> _State | None:
    over = state.peaks - context.budgets[:, None]
    d, t = (int(x) for x in np.unravel_index(np.argmax(over), over.shape))
    best: tuple[float, _State] | None = None
    for holds in _evictions(context, state, d, t):
        if context.stopped():
            break  # a step scores every move at t: on large graphs, seconds
        candidate = context.state(holds)
        freed = state.excess - candidate.excess
        if freed <= 0:
            continue
        score = freed / max(candidate.cost_ms - state.cost_ms, _EPSILON_MS)
        if best is None or score > best[0]:
            best = (score, candidate)
    return None if best is None else best[1]


def _evictions(context: _EvictionSetup, state: _State, d: int, t: int) -> Iterator[Holds]:
    """Each way to stop holding one value of device d in stage t. A value held at t and
    not read there is dropped from its last read before t to its next read after t. A value
    held into stage t + 1 that t reads or computes is dropped from t + 1 to its next read,
    so it is freed after its last use in t instead of staying to t's end: without these,
    MobileNet at 25% on cuda0 stops 84 KiB over, recomputing the first layers once in the
    stage of block1_pw_bn's gradient and keeping them for the next one."""
    T = len(context.problem.graph)
    for i, spans in enumerate(state.holds):
        if i not in context.evictable or context.home[i] != d:
            continue
        reads = state.reads[i]
        if _holds_at(spans, t) and not _reads_at(reads, t):
            yield _evicted(state.holds, i, t, reads, T)
        elif _holds_at(spans, t + 1):
            yield _released(state.holds, i, t, reads, T)


def _holds_at(spans: list[Span], t: int) -> bool:
    return any(a <= t <= b for a, b in spans)


def _reads_at(reads: list[int], t: int) -> bool:
    k = bisect_left(reads, t)
    return k < len(reads) and reads[k] == t


def _evicted(holds: Holds, i: int, t: int, reads: list[int], T: int) -> Holds:
    """``holds`` with value i (not read in stage t) not kept from its last read before t
    to its next read after t, where it is then recomputed and kept on as before."""
    k = bisect_left(reads, t)
    previous = reads[k - 1] if k > 0 else -1
    return _without(holds, i, previous + 1, reads[k] if k < len(reads) else T)


def _released(holds: Holds, i: int, t: int, reads: list[int], T: int) -> Holds:
    """``holds`` with value i not kept from stage t + 1 to its next read after t."""
    k = bisect_left(reads, t + 1)
    return _without(holds, i, t + 1, reads[k] if k < len(reads) else T)


def _without(holds: Holds, i: int, first: int, last: int) -> Holds:
    """``holds`` with value i not kept in stages first..last."""
    spans: list[Span] = []
    for a, b in holds[i]:
        if a < first:
            spans.append((a, min(b, first - 1)))
        if b > last:
            spans.append((max(a, last + 1), b))
    without = list(holds)
    without[i] = spans
    return without


def _refill(context: _EvictionSetup, state: _State) -> _State:
    """Keep again, one gap at a time, the value whose refill saves the most while the plan
    still fits."""
    while state.fits and not context.stopped():
        fitting = (c for c in _refilled(context, state) if c.fits)
        best = min(fitting, key=_cost, default=state)
        if best.cost_ms >= state.cost_ms:
            break
        state = best
    return state


def _swap(context: _EvictionSetup, state: _State) -> _State:
    """Trade one gap for other evictions while that saves time: refill a gap (the plan no
    longer fits), evict again and refill (``_descend``, ``_refill``). The refilled plans
    are tried cheapest first and the first swap that fits and costs less is taken, until
    none does. One device only: on a placement over several devices eviction's plan is
    usually a local optimum for swaps already, and finding that out would delay the
    plan."""
    return _repeat(context, state, _first_swap, lambda s: s.fits)


def _first_swap(context: _EvictionSetup, state: _State) -> _State | None:
    for refilled in sorted(_refilled(context, state), key=_cost):
        if context.stopped():
            return None
        again = _refill(context, _descend(context, refilled))
        if again.fits and again.cost_ms < state.cost_ms * (1 - _SAVING):
            return again
    return None


def _refilled(context: _EvictionSetup, state: _State) -> Iterator[_State]:
    """``state`` with one gap of one value filled, each way (``_refills``); none once
    stopped (a round scores every gap: on large graphs, seconds)."""
    T = len(context.problem.graph)
    for i in context.evictable:
        for holds in _refills(state.holds, i, T):
            if context.stopped():
                return
            yield context.state(holds)


def _cost(state: _State) -> float:
    return state.cost_ms


def _refills(holds: Holds, i: int, T: int) -> Iterator[Holds]:
    """``holds`` with one gap of value i filled: before its first span (the value is
    present from its own stage on) or between two spans."""
    available = i  # the last stage in which the value is present before the next span
    for a, b in holds[i]:
        if a > available + 1:
            refilled = list(holds)
            refilled[i] = merge_spans([*holds[i], (available + 1, b)], i + 1, T - 1)
            yield refilled
        available = b
