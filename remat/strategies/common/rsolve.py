"""Solving R for a fixed checkpoint policy S, and the S policies the baselines share.

Checkmate implements every baseline "as a static policy for the decision variable S and
then solve[s] for the lowest-cost recomputation schedule" (section 6.2, appendix B.1).
``solve_r`` is that R solve (Algorithm 2, phase 2). ``prune_checkpoints`` drops the
checkpoints no later computation reads, which turns "keep everything" policies into the
free-after-last-use liveness of frameworks. ``s_from_checkpoints`` is the S policy of the
Chen-style heuristics (checkpoints + one segment, appendix B).

Matrices are 2-D [T, n] bool (one device); stages are frontier-advancing, so T = n and
node t is computed for the first time in stage t (eq. 8a).

Two representations. The dense functions take and return [T, n] matrices (the MILP and
LP rounding work with those). The baselines build many candidate policies on graphs of
thousands of nodes, so they use a sparse form: S as *holds* (per node, the maximal stage
intervals during which it is kept) and R as the list of nodes computed in each stage. The
sparse solve and prune give exactly the dense results (tested), touching only nonzeros.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from remat.errors import StrategyError
from remat.graph import Graph, NodeKind
from remat.schedule import Schedule

Span = tuple[int, int]  # stages [start, end], both inclusive
Holds = list[list[Span]]  # holds[i]: sorted, disjoint, non-adjacent spans where S[t, i] = 1

# --- dense ------------------------------------------------------------------------------


def solve_r(graph: Graph, S: np.ndarray) -> np.ndarray:
    """The cheapest R that makes ``S`` correct (Checkmate Algorithm 2, phase 2; B.1).

    Every entry set here is forced by a constraint, so the result is the unique minimal
    R ⊇ I satisfying (1b), (1c) and (8a) for this S."""
    S = np.asarray(S, dtype=bool)
    return solve_r_placed(graph, S[None], np.zeros(S.shape[1], dtype=np.int64))[0]


def solve_r_placed(graph: Graph, S: np.ndarray, place: np.ndarray) -> np.ndarray:
    """``solve_r`` over devices: S[d,t,i] and a home device ``place[i]`` per node.

    Node t is computed in stage t on its home (XEngine eq. 8-9); a checkpoint kept on d
    from stage t must be on d in t-1 (eq. 11); a missing dependency of a computed node is
    recomputed on its home (eq. 12: anything resident on some device may be copied), and so
    on, transitively. With one device this is exactly Checkmate's R solve."""
    S = np.asarray(S, dtype=bool)
    D, T, n = S.shape
    R = np.zeros((D, T, n), dtype=bool)
    R[place[:T], np.arange(T), np.arange(T)] = True  # eq. 8a / XEngine 8-9
    # (1c) / eq. 11: a checkpoint must have been on its device in the previous stage; if it
    # was not saved there, it has to be computed there. S is fixed: one vectorised pass.
    R[:, :-1] |= S[:, 1:] & ~S[:, :-1]
    deps = [node.deps for node in graph.nodes]
    home = [int(d) for d in place]
    # Stage t's closure changes only stage t: what is available and computed before each
    # closure is read for all stages at once (numpy per stage dominated the R solve).
    available = (R | S).any(axis=0)
    stages, nodes = np.nonzero(R.any(axis=0))
    starts = np.searchsorted(stages, np.arange(T + 1))
    for t in range(T):
        computed = nodes[starts[t] : starts[t + 1]].tolist()
        _close_stage(R, t, bytearray(available[t].tobytes()), computed, deps, home)
    return R


def _close_stage(
    R: np.ndarray,
    t: int,
    available: bytearray,
    stack: list[int],
    deps: Sequence[tuple[int, ...]],
    home: list[int],
) -> None:
    """(1b) within stage t: compute every missing dependency of a computed node (``stack``),
    and theirs; ``available`` (one byte per node, updated) is what stage t already holds.

    Checkmate scans the stage right to left (reverse topological order); a depth-first walk
    from the computed nodes visits the same closure, touching only nonzeros."""
    while stack:
        j = stack.pop()
        for i in deps[j]:
            if not available[i]:
                available[i] = 1
                R[home[i], t, i] = True
                stack.append(i)


def users_computed(graph: Graph, R: np.ndarray) -> np.ndarray:
    """used[t, i]: some user of value i is computed in stage t (a gather over R's nonzeros)."""
    T, n = R.shape
    counts = np.array([len(node.deps) for node in graph.nodes], dtype=np.int64)
    indptr = np.concatenate(([0], np.cumsum(counts)))
    indices = np.fromiter((d for node in graph.nodes for d in node.deps), dtype=np.int64)
    ts, js = np.nonzero(R)
    per = counts[js]
    total = int(per.sum())
    used = np.zeros((T, n), dtype=bool)
    if total == 0:
        return used
    rows = np.repeat(ts, per)
    offsets = np.arange(total) - np.repeat(np.cumsum(per) - per, per)
    used[rows, indices[np.repeat(indptr[js], per) + offsets]] = True
    return used


def prune_checkpoints(graph: Graph, R: np.ndarray, S: np.ndarray) -> np.ndarray:
    """S without the checkpoints no later stage reads.

    A value is needed at the start of stage t if it is not recomputed in t (R[t,i] = 0:
    a recomputation in t precedes all its users there) and a user reads it in t or it is
    needed at the start of t+1. Model outputs are needed after the last stage. Only 1s are
    removed, and (1b), (1c) stay satisfied: a kept S[t+1,i] with R[t,i] = 0 was carried by
    S[t,i] (1c), which is then needed too; a dependency read in t with R[t,i] = 0 was in
    S[t] (1b) and is needed."""
    R = np.asarray(R, dtype=bool)
    return prune_placed(graph, R[None], np.asarray(S, dtype=bool)[None])[0]


def prune_placed(graph: Graph, R: np.ndarray, S: np.ndarray) -> np.ndarray:
    """``prune_checkpoints`` over devices [D, T, n]: a checkpoint on d is needed if it is
    not recomputed on d in that stage and a user on any device reads it then (it may be
    copied from d) or it is needed on d at the start of the next stage."""
    T = S.shape[1]
    if T == 0:
        return S.copy()
    kept = S & ~R  # A: held into t, not recomputed there
    computed = np.asarray(R.any(axis=0), dtype=bool)  # [T, n]: on some device
    read = kept & users_computed(graph, computed)[None]  # needed in t itself
    read[:, T - 1, list(graph.outputs)] |= kept[:, T - 1, list(graph.outputs)]
    # The recurrence needed[t] = A[t] & (read[t] | needed[t+1]), solved for all t at once:
    # needed[t] iff A holds from t up to some stage that reads the value.
    later = np.arange(T)[None, :, None]
    next_read = _next_true(read, later, T)
    next_gap = _next_true(~kept, later, T)
    return kept & (next_read < next_gap)


def _next_true(flags: np.ndarray, stage: np.ndarray, T: int) -> np.ndarray:
    """For each [d, t, i]: the first stage t' >= t where ``flags`` holds (T if none)."""
    at = np.where(flags, stage, T).astype(np.int32)
    return np.minimum.accumulate(at[:, ::-1], axis=1)[:, ::-1]


def solve_and_prune(graph: Graph, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """R = solve_r(S), S = prune_checkpoints(R, S), repeated to a fixed point.

    Repeating matters: a checkpoint the policy asked for but nobody reads forces a
    recomputation through (1c); once pruned, re-solving drops that recomputation (the new R
    is a subset: the old one was feasible for the smaller S, and solve_r is minimal)."""
    S = np.asarray(S, dtype=bool)
    R, S = solve_and_prune_placed(graph, S[None], np.zeros(S.shape[1], dtype=np.int64))
    return R[0], S[0]


def solve_and_prune_placed(
    graph: Graph, S: np.ndarray, place: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``solve_and_prune`` over devices with home devices ``place`` (``solve_r_placed``)."""
    S = np.asarray(S, dtype=bool)
    while True:
        R = solve_r_placed(graph, S, place)
        pruned = prune_placed(graph, R, S)
        if np.array_equal(pruned, S):
            return R, S
        S = pruned


def clean_placed(graph: Graph, R: np.ndarray, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """R and S [D, T, n] without what nothing reads: checkpoints (``prune_placed``) and
    recomputations (off the diagonal) that no node of their stage reads and that are not
    kept for the next stage, or that repeat a value already kept on that device. Only 1s
    are removed, to a fixed point; every constraint stays satisfied (``prune_checkpoints``)."""
    R = np.asarray(R, dtype=bool).copy()
    S = np.asarray(S, dtype=bool)
    _, T, n = R.shape
    first = np.zeros((T, n), dtype=bool)
    first[np.arange(min(T, n)), np.arange(min(T, n))] = True
    R &= first[None] | ~S  # a value kept on a device is not recomputed there
    while True:
        S = prune_placed(graph, R, S)
        used = users_computed(graph, np.asarray(R.any(axis=0), dtype=bool))
        kept_next = np.concatenate([S[:, 1:], np.zeros_like(S[:, :1])], axis=1)
        needed = first[None] | used[None] | kept_next
        if not (R & ~needed).any():
            return R, S
        R &= needed


# --- sparse -----------------------------------------------------------------------------


def merge_spans(spans: Sequence[Span], low: int, high: int) -> list[Span]:
    """Sorted, disjoint, non-adjacent spans covering the same stages, clipped to
    [low, high]."""
    if len(spans) == 1:  # the common case, without sorting
        (a, b), *_ = spans
        return [(max(a, low), min(b, high))] if max(a, low) <= min(b, high) else []
    merged: list[Span] = []
    for start, end in sorted((max(a, low), min(b, high)) for a, b in spans):
        if start > end:
            continue
        if merged and start <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def holds_from_dense(S: np.ndarray) -> Holds:
    """The maximal runs of each column of S."""
    S = np.asarray(S, dtype=bool)
    T, n = S.shape
    padded = np.zeros((n, T + 2), dtype=np.int8)
    padded[:, 1:-1] = S.T
    step = np.diff(padded, axis=1)
    starts = np.argwhere(step == 1)  # (node, stage), sorted by node then stage
    ends = np.argwhere(step == -1)
    holds: Holds = [[] for _ in range(n)]
    for (i, a), (_, b) in zip(starts.tolist(), ends.tolist(), strict=True):
        holds[i].append((a, b - 1))
    return holds


def holds_to_dense(holds: Holds, T: int) -> np.ndarray:
    S = np.zeros((T, len(holds)), dtype=bool)
    for i, spans in enumerate(holds):
        for a, b in spans:
            S[a : b + 1, i] = True
    return S


@dataclass(frozen=True)
class Sparse:
    """A one-device schedule by its nonzeros: ``computed[t]`` lists the nodes computed in
    stage t (ascending; R's row t) and ``holds`` is S."""

    computed: list[list[int]]
    holds: Holds

    @property
    def stages(self) -> int:
        return len(self.computed)

    def R(self) -> np.ndarray:
        R = np.zeros((self.stages, len(self.holds)), dtype=bool)
        for t, nodes in enumerate(self.computed):
            R[t, nodes] = True
        return R

    def S(self) -> np.ndarray:
        return holds_to_dense(self.holds, self.stages)

    def schedule(self, device: str) -> Schedule:
        return Schedule.single(device, self.R(), self.S())


def span_events(holds: Holds) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """By stage: the nodes whose holds start there, and those whose holds ended at the
    previous stage (stages without events are absent)."""
    starts: dict[int, list[int]] = defaultdict(list)
    stops: dict[int, list[int]] = defaultdict(list)
    for i, spans in enumerate(holds):
        for a, b in spans:
            starts[a].append(i)
            stops[b + 1].append(i)
    return dict(starts), dict(stops)


def solve_r_sparse(graph: Graph, holds: Holds, T: int) -> list[list[int]]:
    """``solve_r`` on holds: R I, then (1c) at each hold's start, then (1b) per stage."""
    n = len(graph)
    deps = [node.deps for node in graph.nodes]
    forced: list[list[int]] = [[t] if t < n else [] for t in range(T)]
    for i, spans in enumerate(holds):
        for a, _ in spans:
            if a >= 1 and a - 1 != i:  # spans are maximal: S[a-1, i] = 0
                forced[a - 1].append(i)
    starts, stops = span_events(holds)
    held = bytearray(n)  # S[t] during the sweep
    computed: list[list[int]] = []
    for t in range(T):
        for i in stops.get(t, ()):
            held[i] = 0
        for i in starts.get(t, ()):
            held[i] = 1
        stage = set(forced[t])
        stack = list(stage)
        while stack:
            for i in deps[stack.pop()]:
                if not held[i] and i not in stage:
                    stage.add(i)
                    stack.append(i)
        computed.append(sorted(stage))
    return computed


def prune_sparse(graph: Graph, computed: list[list[int]], holds: Holds) -> Holds:
    """``prune_checkpoints`` for an R solved from these holds: R is then zero inside every
    hold, so a hold is cut back to its last read (or dropped if nothing reads it), except
    that a model output held to the end stays."""
    T = len(computed)
    reads = stage_reads(graph, computed)
    outputs = set(graph.outputs)
    pruned: Holds = []
    for i, spans in enumerate(holds):
        kept: list[Span] = []
        for a, b in spans:
            if b == T - 1 and i in outputs:
                kept.append((a, b))
                continue
            k = bisect_right(reads[i], b) - 1
            if k >= 0 and reads[i][k] >= a:
                kept.append((a, reads[i][k]))
        pruned.append(kept)
    return pruned


def stage_reads(graph: Graph, computed: list[list[int]]) -> list[list[int]]:
    """reads[i]: the stages in which some computed node reads value i (ascending, once)."""
    deps = [node.deps for node in graph.nodes]
    reads: list[list[int]] = [[] for _ in graph.nodes]
    for t, nodes in enumerate(computed):
        for j in nodes:
            for i in deps[j]:
                if not reads[i] or reads[i][-1] != t:
                    reads[i].append(t)
    return reads


def solve_and_prune_sparse(graph: Graph, holds: Holds) -> Sparse:
    """``solve_and_prune`` on holds (same fixed point, without dense matrices).

    Pruning only cuts holds back or drops them. If none was dropped, R stays: (1c) forces
    the same entries (same starts), and no node computed in the cut stages read the value.
    So the fixed point is reached one solve earlier than in the dense loop."""
    T = len(graph)
    while True:
        computed = solve_r_sparse(graph, holds, T)
        pruned = prune_sparse(graph, computed, holds)
        if sum(map(len, pruned)) == sum(map(len, holds)):
            return Sparse(computed, pruned)
        holds = pruned


# --- graph structure shared by the baselines -------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where the forward, loss and backward stages of a graph are.

    ``forward_of[t]``: for a backward stage, the forward node it differentiates (else -1).
    ``backward_of[i]``: for a forward node, its backward stage (else -1)."""

    F: int  # forward nodes are 0..F-1
    loss: int | None
    forward_of: np.ndarray
    backward_of: np.ndarray

    @classmethod
    def of(cls, graph: Graph) -> Layout:
        kinds = [node.kind for node in graph.nodes]
        F = sum(k is NodeKind.FORWARD for k in kinds)
        if any(k is not NodeKind.FORWARD for k in kinds[:F]):
            raise StrategyError("the forward nodes must come first (nodes 0..F-1)")
        forward_of = np.full(len(graph), -1, dtype=np.int64)
        backward_of = np.full(F, -1, dtype=np.int64)
        loss = None
        for node in graph.nodes[F:]:
            if node.kind is NodeKind.LOSS:
                loss = node.id
            elif node.forward is not None and 0 <= node.forward < F:
                forward_of[node.id] = node.forward
                backward_of[node.forward] = node.id
        return cls(F, loss, forward_of, backward_of)

    @property
    def sweep_end(self) -> int:
        """The last stage of the forward pass (the loss in training)."""
        return self.loss if self.loss is not None else self.F - 1


def linear_chain_violation(graph: Graph) -> str | None:
    """None if the forward graph is a chain (node i > 0 reads exactly node i-1), else why."""
    for node in graph.forward_nodes():
        expected = (node.id - 1,) if node.id > 0 else ()
        if tuple(node.deps) != expected:
            return f"node {node.id} ({node.name}) has deps {tuple(node.deps)}"
    return None


class HoldBuilder:
    """Collects the spans of an S policy; ``build`` merges them into holds (S strictly
    lower triangular: node i can be held from stage i+1 on)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.T = len(graph)
        self.spans: list[list[Span]] = [[] for _ in graph.nodes]

    def hold(self, i: int, start: int, end: int | None = None) -> None:
        """Keep node i during stages start..end (default: to the last stage)."""
        self.spans[i].append((start, self.T - 1 if end is None else end))

    def keep_gradients_and_outputs(self) -> HoldBuilder:
        """What every baseline keeps: LOSS/BACKWARD values once computed (gradients are
        never recomputed) and model outputs (inference); pruning frees them after their
        last use."""
        for node in self.graph.nodes:
            if node.kind is not NodeKind.FORWARD:
                self.hold(node.id, node.id + 1)
        for i in self.graph.outputs:
            self.hold(i, i + 1)
        return self

    def keep_everything(self) -> HoldBuilder:
        """Every value kept once computed (checkpoint-all; pruning frees each value right
        after its last use)."""
        for i in range(self.T):
            self.hold(i, i + 1)
        return self

    def build(self) -> Holds:
        return [merge_spans(s, i + 1, self.T - 1) for i, s in enumerate(self.spans)]


# --- the Chen-style policy --------------------------------------------------------------


def checkpoint_holds(
    graph: Graph, checkpoints: Iterable[int], segments: Sequence[Sequence[int]]
) -> Holds:
    """``s_from_checkpoints`` as holds."""
    layout = Layout.of(graph)
    F = layout.F
    segment_of = np.full(len(graph), -2, dtype=np.int64)  # -2: never an active segment
    for index, segment in enumerate(segments):
        segment_of[list(segment)] = index
    if F and (segment_of[:F] < 0).any():
        raise StrategyError("segments must cover every forward node")
    builder = HoldBuilder(graph).keep_gradients_and_outputs()
    for i in checkpoints:  # (b)
        if 0 <= i < F:
            builder.hold(i, i + 1)
    for first, last, run in _segment_runs(layout, segment_of):  # (c), (d)
        for i in segments[run]:
            builder.hold(i, max(first, i + 1), last)
    return builder.build()


def _segment_runs(layout: Layout, segment_of: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal stage runs [first, last] during which one segment is kept: (c) forward and
    loss stages keep the segment of the node just computed (built up stage by stage, so its
    earlier nodes are present); (d) a backward stage keeps its segment if the previous
    stage already did, so a segment's nodes are recomputed once, at its first backward
    stage (solve_r, via (1c)), then kept until its backward completes."""
    F = layout.F
    T = len(layout.forward_of)
    active = np.full(T, -1, dtype=np.int64)  # A(t): the segment stage t works on
    if F == 0:
        return []
    active[1:F] = segment_of[: F - 1]  # forward stage t: the segment of node t-1
    if layout.loss is not None:
        active[layout.loss] = segment_of[F - 1]  # the loss reads the last segment
    backward = layout.forward_of >= 0
    active[backward] = segment_of[layout.forward_of[backward]]
    sweep = np.arange(T) <= layout.sweep_end
    previous = np.concatenate(([-1], active[:-1]))
    kept = (sweep | (active == previous)) & (active >= 0)
    runs: list[tuple[int, int, int]] = []
    for t in np.flatnonzero(kept).tolist():
        segment = int(active[t])
        if runs and runs[-1][1] == t - 1 and runs[-1][2] == segment:
            runs[-1] = (runs[-1][0], t, segment)
        else:
            runs.append((t, t, segment))
    return runs


def s_from_checkpoints(
    graph: Graph, checkpoints: Iterable[int], segments: Sequence[Sequence[int]]
) -> np.ndarray:
    """The S policy of the Chen-style baselines (before solving R and pruning).

    (a) LOSS/BACKWARD values are kept once computed; (b) checkpoint forward nodes are kept
    once computed; (c) during the forward pass the nodes of the current segment are kept;
    (d) "ladders": during the backward of a segment its forward nodes are kept. A segment
    whose backward starts was not kept through the previous stage, so its nodes are
    recomputed once, at its first backward stage, then kept until its backward completes:
    the peak holds the checkpoints and one segment (Chen et al.)."""
    return holds_to_dense(checkpoint_holds(graph, checkpoints, segments), len(graph))


def segments_from_checkpoints(F: int, checkpoints: Iterable[int]) -> list[list[int]]:
    """Split the forward order 0..F-1 after each checkpoint (a checkpoint ends a segment)."""
    cuts = sorted({c for c in checkpoints if 0 <= c < F - 1})
    segments: list[list[int]] = []
    start = 0
    for cut in [*cuts, F - 1]:
        segments.append(list(range(start, cut + 1)))
        start = cut + 1
    return [s for s in segments if s]
