"""Greedy eviction: one-device plans for budgets that the checkpoint baselines miss.

A static version of the eviction loop of Dynamic Tensor Rematerialization (Kirisame et
al., 2021) over Checkmate's stages. Start from checkpoint-all (every value kept until its
last use). While some stage's predicted peak is over the budget, evict one forward value
held through the stage with the highest peak: it is no longer kept from its last read
before that stage to its next read after it, where it is recomputed (R solved exactly for
the new S, so ancestors no longer held are recomputed with it). The value chosen frees
the most excess memory (summed over all stages) per millisecond of recomputation it adds.
Once the plan fits, gaps are refilled (a value kept instead of recomputed) while the plan
still fits and gets cheaper.

Chen's policies keep whole segments and recompute whole segments; eviction decides per
value and per interval, which is what budgets near the memory floor need (and why it finds
cheaper plans at moderate budgets too). Every candidate is scored with ``policy.predict``;
the simulator judges the result.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass

from remat.graph import NodeKind
from remat.strategies.base import Problem, StrategyResult
from remat.strategies.policy import Candidate, Prediction, choose, device_fixed_bytes, predict
from remat.strategies.rsolve import (
    HoldBuilder,
    Holds,
    Span,
    Sparse,
    merge_spans,
    solve_and_prune_sparse,
    stage_reads,
)

STRATEGY = "greedy_evict"
TIME_BUDGET_S = 5.0  # U-Net (135 nodes) at 25% on cuda0 takes 0.8 s
_EPSILON_MS = 1e-6  # an eviction that adds no recomputation scores highest, not infinite


@dataclass(frozen=True)
class _State:
    sparse: Sparse
    prediction: Prediction
    excess: int  # bytes over the budget, summed over stages

    @property
    def cost_ms(self) -> float:
        return self.prediction.cost_ms

    @property
    def fits(self) -> bool:
        return self.excess == 0


@dataclass(frozen=True)
class _Context:
    problem: Problem
    device: str
    budget: int
    fixed: int
    evictable: frozenset[int]  # forward values that are not model outputs
    deadline: float

    def state(self, holds: Holds) -> _State:
        sparse = solve_and_prune_sparse(self.problem.graph, holds)
        prediction = predict(self.problem, self.device, sparse, self.fixed)
        excess = sum(max(0, peak - self.budget) for peak in prediction.stage_peaks)
        return _State(sparse, prediction, excess)

    def stopped(self) -> bool:
        return time.monotonic() > self.deadline or self.problem.cancelled


def greedy_evict(
    problem: Problem, device: str, time_budget_s: float = TIME_BUDGET_S
) -> StrategyResult:
    """The cheapest plan the eviction loop reaches on ``device`` within ``time_budget_s``
    (then the plan in hand is judged: it fits, or it says how much it needs)."""
    graph = problem.graph
    evictable = frozenset(
        node.id
        for node in graph.nodes
        if node.kind is NodeKind.FORWARD and node.id not in set(graph.outputs)
    )
    budget = problem.budgets.get(device)
    fixed = device_fixed_bytes(problem, device)
    deadline = time.monotonic() + time_budget_s
    context = _Context(problem, device, budget or 0, fixed, evictable, deadline)
    state = context.state(_keep_all(problem))
    if budget is not None:
        state = _refill(context, _descend(context, state))
    return choose(problem, device, STRATEGY, [Candidate(state.sparse, state.prediction)])


def _keep_all(problem: Problem) -> Holds:
    builder = HoldBuilder(problem.graph)
    for i in range(len(problem.graph)):
        builder.hold(i, i + 1)
    return builder.build()


def _descend(context: _Context, state: _State) -> _State:
    """Evict until the plan fits, no eviction frees excess memory, or time is up."""
    while not state.fits and not context.stopped():
        evicted = _best_eviction(context, state)
        if evicted is None:
            break
        state = evicted
    return state


def _best_eviction(context: _Context, state: _State) -> _State | None:
    peaks = state.prediction.stage_peaks
    t = max(range(len(peaks)), key=peaks.__getitem__)
    reads = stage_reads(context.problem.graph, state.sparse.computed)
    best: tuple[float, _State] | None = None
    for i, spans in enumerate(state.sparse.holds):
        if i not in context.evictable or not _holds_at(spans, t) or _reads_at(reads[i], t):
            continue
        candidate = context.state(_evicted(state.sparse.holds, i, t, reads[i]))
        freed = state.excess - candidate.excess
        if freed <= 0:
            continue
        score = freed / max(candidate.cost_ms - state.cost_ms, _EPSILON_MS)
        if best is None or score > best[0]:
            best = (score, candidate)
    return None if best is None else best[1]


def _holds_at(spans: list[Span], t: int) -> bool:
    return any(a <= t <= b for a, b in spans)


def _reads_at(reads: list[int], t: int) -> bool:
    k = bisect_left(reads, t)
    return k < len(reads) and reads[k] == t


def _evicted(holds: Holds, i: int, t: int, reads: list[int]) -> Holds:
    """``holds`` with value i not kept from its last read before stage t to its next read
    after t (exclusive), where it is then recomputed and kept on as before."""
    k = bisect_left(reads, t)
    previous = reads[k - 1] if k > 0 else None
    following = reads[k] if k < len(reads) else None
    spans: list[Span] = []
    for a, b in holds[i]:
        if not a <= t <= b:
            spans.append((a, b))
            continue
        if previous is not None and previous >= a:
            spans.append((a, previous))
        if following is not None and following < b:
            spans.append((following + 1, b))
    evicted = list(holds)
    evicted[i] = spans
    return evicted


def _refill(context: _Context, state: _State) -> _State:
    """Keep again, one gap at a time, the value whose refill saves the most while the plan
    still fits."""
    while state.fits and not context.stopped():
        best = state
        for i in context.evictable:
            for holds in _refills(state.sparse.holds, i, len(context.problem.graph)):
                candidate = context.state(holds)
                if candidate.fits and candidate.cost_ms < best.cost_ms:
                    best = candidate
        if best is state:
            break
        state = best
    return state


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
