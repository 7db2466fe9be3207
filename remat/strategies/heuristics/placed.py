"""A multi-device heuristic: a home device per node, a Chen-style checkpoint policy, and R
solved over devices (``rsolve.solve_r_placed``).

XEngine warm-starts from the best single-device schedule, but where no single device fits
(the case XEngine is for) there is none. This heuristic finds a feasible multi-device
schedule in a second or two, so the MIQP starts from an incumbent and a stopped solve still
returns a plan. Candidates are (placement, policy) pairs:

* placements: every node on its fastest device; every node on one device; and cuts: for an
  ordered device pair (a, b), forward layers before the cut (and their backward nodes) on
  a, the rest on b (XEngine 4.2: "the minimal cut is found where data copies are cheapest
  and one half is computed on the first device and the other on the second"); and bands:
  the layers between two cuts on b, the rest on a (a U-Net's deep middle holds most of the
  weights but small activations: on the other device it frees memory for the shallow
  layers' large activations);
* policies: the S policies of ``linearized_greedy`` and ``ap_greedy`` (Chen's greedy swept
  over its segment budget) and "keep everything"; each kept value stays on its home.

A placement is skipped when its compute floor (every node once on its home) is not below a
candidate already estimated to fit: solving R for every candidate is most of the cost.
Each candidate's R is solved and pruned, its compute cost and a per-device memory estimate
(every value resident in a stage, plus the copies its users on another device need) are
computed in numpy; the simulator then judges them in order, those estimated to fit first,
cheapest first, until ``SearchConfig.placed_keep`` fit or the time budget is spent. The
best (and the best on one device, ``_starts``) is then improved, for up to another time
budget, by a local search that alternates two sweeps: move one layer to another device
(``_move_layers``), and add or drop one checkpoint of a Chen policy
(``_toggle_checkpoints``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from remat.graph import Graph
from remat.schedule import Schedule
from remat.simulator import held_fixed_bytes
from remat.strategies.baselines.chen import (
    articulation_candidates,
    greedy_budgets,
    greedy_checkpoints,
    linearized_candidates,
)
from remat.strategies.common.problem import (
    Evaluation,
    FitDeadline,
    Problem,
    StrategyResult,
    evaluate,
    select_best,
)
from remat.strategies.common.rsolve import (
    Layout,
    checkpoint_holds,
    holds_to_dense,
    segments_from_checkpoints,
    solve_and_prune_placed,
)


@dataclass(frozen=True)
class _Candidate:
    cost_ms: float
    fits: bool  # by the memory estimate
    R: np.ndarray
    S: np.ndarray
    place: np.ndarray
    policy: _Policy

    def order(self) -> tuple[bool, float]:
        """Those estimated to fit first, cheapest first."""
        return (not self.fits, self.cost_ms)


@dataclass(frozen=True)
class _Policy:
    """A dense S policy [T, n] and the checkpoints of the Chen policy it comes from (None:
    keep everything)."""

    S: np.ndarray
    checkpoints: frozenset[int] | None


_Judged = tuple[_Candidate, Evaluation]
Offer = Callable[[StrategyResult], None]
_Sweep = Callable[["_CandidateScorer", _Judged, float], tuple[_Judged, bool]]


def placed_greedy(
    problem: Problem,
    names: Sequence[str] | None = None,
    time_budget_s: float | None = None,
    offer: Offer | None = None,
    fit_budget_s: float | None = None,
) -> StrategyResult:
    """The cheapest multi-device schedule among the candidates that the simulator accepts
    under every device's budget (``names``: the devices to use, default all), within
    ``time_budget_s`` (default ``SearchConfig.placed_time_s``) and as long again for the
    local search. Stops early when the problem is cancelled. ``offer`` gets each plan the
    simulator accepts as soon as it is judged (the search keeps the better ones): the first
    comes from the first placement with a candidate that fits, before the other placements
    are solved. Until one fits, placements are solved and candidates judged for up to
    ``fit_budget_s`` (if longer than ``time_budget_s``): where no candidate is estimated to
    fit, the first that the simulator accepts can come late."""
    config = problem.solver.search
    if time_budget_s is None:
        time_budget_s = config.placed_time_s
    names = tuple(names or (d.name for d in problem.costs.devices))
    deadline = time.monotonic() + time_budget_s
    until_fit = FitDeadline.of(deadline, fit_budget_s)
    policies = _policies(problem)
    context = _CandidateScorer.of(problem, names, offer)
    candidates: list[_Candidate] = []
    early: list[_Judged] = []  # judged while the placements are solved, until one fits
    cheapest_fit = np.inf  # by the estimates
    for place in placements(problem, names):
        # solving R for every candidate is most of the cost: one fit is enough, and until
        # one, placements are solved for as long as candidates are judged
        if _over(problem, deadline) if cheapest_fit < np.inf else _unfit_over(problem, until_fit):
            break
        fixed = context.fixed(place)
        if context.compute_floor(place) >= cheapest_fit or not context.fixed_fits(fixed):
            continue  # no policy makes this placement cheaper than a fit already found
        found = [context.candidate(place, fixed, policy) for policy in policies]
        cheapest_fit = min([cheapest_fit, *(c.cost_ms for c in found if c.fits)])
        candidates.extend(found)
        if offer is not None and not any(e.fits for _, e in early):
            early.extend(_judge_cheapest_fit(context, found))
    candidates.sort(key=_Candidate.order)
    judged = list(early)
    for candidate in candidates:
        if any(candidate is c for c, _ in early):
            continue
        judged.append((candidate, context.evaluate(candidate)))
        fits = sum(e.fits for _, e in judged)
        over = _over(problem, deadline) if fits else _unfit_over(problem, until_fit)
        if fits >= config.placed_keep or over:
            break
    fitting = [(c, e) for c, e in judged if e.fits]
    if fitting:
        end = deadline + time_budget_s
        starts = _starts(context, fitting, candidates)
        judged.extend(_local_search(context, start, end) for start in starts)
    return select_best("placed_greedy", [e for _, e in judged])


def placed_on(
    problem: Problem,
    names: Sequence[str],
    home: np.ndarray,
    time_budget_s: float | None = None,
) -> StrategyResult:
    """The cheapest plan the heuristic finds with node i computed on ``names[home[i]]``
    only, within ``time_budget_s`` (default ``SearchConfig.placed_time_s``): the cheapest
    of Chen's policies the simulator accepts, improved by the checkpoint sweep (a warm
    start for a model restricted to that placement)."""
    if time_budget_s is None:
        time_budget_s = problem.solver.search.placed_time_s
    names = tuple(names)
    deadline = time.monotonic() + time_budget_s
    context = _CandidateScorer.of(problem, names)
    fixed = context.fixed(home)
    if not context.fixed_fits(fixed):
        return StrategyResult("placed_greedy", None, None, "its fixed memory exceeds a budget")
    found = [context.candidate(home, fixed, policy) for policy in _policies(problem)]
    found.sort(key=_Candidate.order)
    first = _first_fit(context, found)
    if first is None:
        return StrategyResult("placed_greedy", None, None, "no policy fits on this placement")
    best = _local_search(context, first, deadline, (_toggle_checkpoints,))
    return select_best("placed_greedy", [best[1]])


def _starts(
    context: _CandidateScorer, fitting: list[_Judged], candidates: list[_Candidate]
) -> list[_Judged]:
    """Where the local search starts: the cheapest plan judged and, on each device whose
    compute floor is below it, the cheapest one-device candidate the simulator accepts.
    Layer moves from a mixed plan rarely reach a one-device plan that recomputes more."""
    best = min(fitting, key=lambda pair: pair[1].cost_ms)
    starts = [best]
    for d in range(len(context.names)):
        alone = [c for c in candidates if c.fits and (c.place == d).all()][
            : context.problem.solver.search.placed_keep
        ]
        if not alone or np.array_equal(alone[0].place, best[0].place):
            continue
        if context.compute_floor(alone[0].place) >= best[1].cost_ms:
            continue  # no plan on d alone beats the best start
        first = _first_fit(context, alone)
        if first is not None:
            starts.append(first)
    return starts


def _judge_cheapest_fit(context: _CandidateScorer, found: list[_Candidate]) -> list[_Judged]:
    """The cheapest of ``found`` estimated to fit, judged (none if none is)."""
    fits = [c for c in found if c.fits]
    cheapest = min(fits, key=lambda c: c.cost_ms, default=None)
    return [] if cheapest is None else [(cheapest, context.evaluate(cheapest))]


def _first_fit(context: _CandidateScorer, candidates: list[_Candidate]) -> _Judged | None:
    """The first of ``candidates`` the simulator accepts; none simulated after it."""
    judged = ((c, context.evaluate(c)) for c in candidates)
    return next((pair for pair in judged if pair[1].fits), None)


def _local_search(
    context: _CandidateScorer, best: _Judged, deadline: float, sweeps: tuple[_Sweep, ...] = ()
) -> _Judged:
    """The sweeps (default: both) in turn, while one finds a cheaper plan that fits and
    time is left.
    Each keeps a neighbour if the simulator says it is cheaper and fits; a neighbour whose
    compute cost alone is not below the incumbent's total is not simulated (copies only
    add to it)."""
    improved = True
    while improved and not _over(context.problem, deadline):
        improved = False
        for sweep in sweeps or (_move_layers, _toggle_checkpoints):
            best, moved = sweep(context, best, deadline)
            improved |= moved
    return best


def _move_layers(context: _CandidateScorer, best: _Judged, deadline: float) -> tuple[_Judged, bool]:
    """One sweep on the placement: move one layer (a forward node and its backward node)
    to another device."""
    layer = forward_layer(context.problem)
    improved = False
    for group in np.unique(layer).tolist():
        for d in range(len(context.names)):
            candidate = best[0]
            place = candidate.place.copy()
            place[layer == group] = d
            if np.array_equal(place, candidate.place):
                continue
            fixed = context.fixed(place)
            if context.fixed_fits(fixed):
                best, moved = _keep_if_better(context, best, place, fixed, candidate.policy)
                improved |= moved
        if _over(context.problem, deadline):
            break
    return best, improved


def _toggle_checkpoints(
    context: _CandidateScorer, best: _Judged, deadline: float
) -> tuple[_Judged, bool]:
    """One sweep on the policy: add or drop one forward node as a checkpoint (Chen's
    segments follow), on the same placement."""
    graph = context.problem.graph
    if best[0].policy.checkpoints is None:
        return best, False  # keep everything: nothing to toggle
    place = best[0].place  # the sweep keeps it, and so its fixed memory
    fixed = context.fixed(place)
    improved = False
    for node in range(Layout.of(graph).F - 1):
        checkpoints = best[0].policy.checkpoints
        assert checkpoints is not None  # toggles keep a Chen policy
        policy = _chen_policy(graph, checkpoints ^ {node})
        best, moved = _keep_if_better(context, best, place, fixed, policy)
        improved |= moved
        if _over(context.problem, deadline):
            break
    return best, improved


def _keep_if_better(
    context: _CandidateScorer, best: _Judged, place: np.ndarray, fixed: list[int], policy: _Policy
) -> tuple[_Judged, bool]:
    trial = context.candidate(place, fixed, policy)
    if trial.cost_ms >= best[1].cost_ms:
        return best, False
    judged = context.evaluate(trial)
    if judged.fits and judged.cost_ms < best[1].cost_ms:
        return (trial, judged), True
    return best, False


def _over(problem: Problem, deadline: float) -> bool:
    """Time is up, or the user cancelled."""
    return problem.cancelled or time.monotonic() > deadline


def _unfit_over(problem: Problem, until_fit: FitDeadline) -> bool:
    """With no plan that fits yet: the fit budget is spent too, or the user cancelled."""
    return problem.cancelled or until_fit.passed()


def placements(problem: Problem, names: Sequence[str]) -> list[np.ndarray]:
    """Home device per node (indices into ``names``): fastest, each single device, cuts
    (the most even split of the forward layers first: at tight budgets the plans that fit
    split the activations), bands."""
    n, D = len(problem.graph), len(names)
    found = [_fastest(problem, names)] + [np.full(n, d) for d in range(D)]
    layer = forward_layer(problem)
    F = max(int(layer.max()), 1)
    positions = np.linspace(1, F, problem.solver.search.placed_cuts + 2)[1:-1]
    cuts = sorted({int(k) for k in positions})
    pairs = [(a, b) for a in range(D) for b in range(D) if a != b]
    balanced = sorted(cuts, key=lambda k: abs(2 * k - F - 1))  # layers 0..F halved first
    for a, b in pairs:
        found.extend(np.where(layer < k, a, b) for k in balanced)
    for a, b in pairs:
        for first, k in enumerate(cuts):
            found.extend(np.where((layer >= k) & (layer < end), b, a) for end in cuts[first + 1 :])
    unique: dict[bytes, np.ndarray] = {}
    for place in found:
        unique.setdefault(place.astype(np.int64).tobytes(), place.astype(np.int64))
    return list(unique.values())


def bands(problem: Problem, names: Sequence[str]) -> list[np.ndarray]:
    """Home device per node: each on its fastest device but for one band of forward
    layers (every start and end, with their backward nodes), moved to another device."""
    fastest = _fastest(problem, names)
    layer = forward_layer(problem)
    F = int(layer.max())
    found = []
    for first in range(F + 1):
        for end in range(first + 1, F + 2):
            band = (layer >= first) & (layer < end)
            for shift in range(1, len(names)):
                place = fastest.copy()
                place[band] = (fastest[band] + shift) % len(names)
                found.append(place)
    return found


def _fastest(problem: Problem, names: Sequence[str]) -> np.ndarray:
    """Each node on its fastest device (an index into ``names``)."""
    costs = problem.costs
    compute = costs.compute_ms[:, [costs.device_index(name) for name in names]]
    return np.argmin(compute, axis=1).astype(np.int64)


def forward_layer(problem: Problem) -> np.ndarray:
    """The forward position a node belongs to: itself (forward), its forward node
    (backward), the end of the forward pass (loss)."""
    layout = Layout.of(problem.graph)
    n = len(problem.graph)
    layer = np.minimum(np.arange(n), layout.F)
    backward = layout.forward_of >= 0
    layer[backward] = layout.forward_of[backward]
    return layer


def _policies(problem: Problem) -> list[_Policy]:
    """Chen's greedy on linearized and articulation candidates, swept over the segment
    budget, plus "keep everything" (pruned to free-after-last-use)."""
    graph = problem.graph
    F, T = Layout.of(graph).F, len(graph)
    sizes = np.asarray(problem.costs.output_bytes[:F], dtype=float)
    choices: set[frozenset[int]] = set()
    for candidates in (linearized_candidates(graph), articulation_candidates(graph)):
        for b in greedy_budgets(sizes):
            chosen = greedy_checkpoints(sizes, candidates, b)
            choices.add(frozenset(c for c in chosen if c < F - 1))
    keep_all = _Policy(np.tril(np.ones((T, T), dtype=bool), -1), None)
    return [keep_all, *(_chen_policy(graph, key) for key in sorted(choices, key=sorted))]


def _chen_policy(graph: Graph, checkpoints: frozenset[int]) -> _Policy:
    F, T = Layout.of(graph).F, len(graph)
    key = sorted(c for c in checkpoints if c < F - 1)
    S = holds_to_dense(checkpoint_holds(graph, key, segments_from_checkpoints(F, key)), T)
    return _Policy(S, frozenset(key))


@dataclass(frozen=True)
class _CandidateScorer:
    """What scoring every candidate of one problem shares: compute costs, value sizes and
    reads, and where accepted plans go."""

    problem: Problem
    names: tuple[str, ...]
    compute: np.ndarray  # [D, n] ms
    size: np.ndarray  # [n] bytes
    reads: np.ndarray  # [n, n]: reads[k, i] = 1 if node k reads value i
    offer: Offer | None  # each plan the simulator accepts

    @classmethod
    def of(
        cls, problem: Problem, names: tuple[str, ...], offer: Offer | None = None
    ) -> _CandidateScorer:
        costs, graph = problem.costs, problem.graph
        compute = costs.compute_ms[:, [costs.device_index(name) for name in names]].T
        n = len(graph)
        reads = np.zeros((n, n), dtype=np.float32)
        for node in graph.nodes:
            reads[node.id, list(node.deps)] = 1
        sizes = np.asarray(costs.output_bytes, float)
        return cls(problem, names, compute, sizes, reads, offer)

    def fixed(self, place: np.ndarray) -> list[int]:
        """Bytes of the parameters and buffers a placement puts on each device."""
        graph = self.problem.graph
        return [
            held_fixed_bytes(graph, np.flatnonzero(place == d).tolist())
            for d in range(len(self.names))
        ]

    def compute_floor(self, place: np.ndarray) -> float:
        """Every node once on its home: no candidate of ``place`` costs less."""
        return float(self.compute[place, np.arange(place.shape[0])].sum())

    def fixed_fits(self, fixed: list[int]) -> bool:
        budgets = [self.problem.budgets.get(name) for name in self.names]
        return all(b is None or f <= b for f, b in zip(fixed, budgets, strict=True))

    def candidate(self, place: np.ndarray, fixed: list[int], policy: _Policy) -> _Candidate:
        D = len(self.names)
        S = policy.S[None] & (place[None, None, :] == np.arange(D)[:, None, None])
        R, S = solve_and_prune_placed(self.problem.graph, S, place)
        cost = float((R * self.compute[:, None, :]).sum())
        return _Candidate(cost, self._estimate_fits(fixed, R, S), R, S, place, policy)

    def evaluate(self, candidate: _Candidate) -> Evaluation:
        schedule = Schedule(self.names, candidate.R, candidate.S)
        judged = evaluate(self.problem, schedule, "placed_greedy")
        if self.offer is not None and judged.fits:
            self.offer(select_best("placed_greedy", [judged]))
        return judged

    def _estimate_fits(self, fixed: list[int], R: np.ndarray, S: np.ndarray) -> bool:
        """An over-estimate of each device's peak: fixed memory, every value computed or
        kept on it in a stage, and every value its nodes read from another device then."""
        for d, name in enumerate(self.names):
            budget = self.problem.budgets.get(name)
            if budget is None:
                continue
            there = R[d] | S[d]
            copied = ((R[d].astype(np.float32) @ self.reads) > 0) & ~there
            stage = ((there | copied) * self.size).sum(axis=1).max(initial=0.0)
            if fixed[d] + stage > budget:
                return False
        return True
