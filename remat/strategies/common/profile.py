"""The cost and per-stage memory of a multi-device schedule, without compiling it.

``policy.predict`` does this for one device; searches over placed schedules (greedy
eviction on a placement) score hundreds of candidates, and compiling and simulating each
takes tens of milliseconds on a U-Net. ``profile`` replays the compiler's rules
(``remat.compiler``) over R's nonzeros: per stage, values nobody reads or keeps are freed
first; each computed node copies its missing inputs in from the cheapest source, is
allocated, then it and its inputs are freed on every device that does not keep them once
no later node of the stage reads them; whatever is not kept is freed at the stage's end.
The result equals the simulator's (tested): total time (compute and copies) and, per device
and stage, the most memory resident after any of the stage's steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from remat.simulator import held_fixed_bytes
from remat.strategies.common.problem import Problem
from remat.strategies.common.rsolve import Sparse


@dataclass(frozen=True)
class Profile:
    cost_ms: float  # compute and copies
    peaks: np.ndarray  # int64 [D, T]: fixed memory plus the most resident in each stage


def excess(peaks: np.ndarray, budgets: np.ndarray) -> int:
    """Bytes over each device's budget (``peaks`` [D, T], ``budgets`` [D]), summed over
    devices and stages."""
    return int(np.maximum(peaks - budgets[:, None], 0).sum())


def profile(problem: Problem, names: Sequence[str], R: np.ndarray, S: np.ndarray) -> Profile:
    """The simulator's verdict on ``compile_plan(Schedule(names, R, S))``, budgets aside."""
    return Profiler(problem, names).profile(R, S)


class Profiler:
    """``profile`` for many schedules of one problem and device list: what they share is
    read from the problem once (a search scores hundreds of candidates)."""

    def __init__(self, problem: Problem, names: Sequence[str]) -> None:
        graph, costs = problem.graph, problem.costs
        order = [costs.device_index(name) for name in names]
        self.graph = graph
        self.deps = [node.deps for node in graph.nodes]
        self.users = graph.users()
        self.size = [int(b) for b in costs.output_bytes]
        self.time = costs.compute_ms[:, order].T.tolist()  # [D][n]
        self.copy = costs.copy_ms[:, order][:, :, order].tolist()  # [n][D][D]
        self.keep = frozenset(graph.outputs)

    def profile(self, R: np.ndarray, S: np.ndarray) -> Profile:
        D, T = R.shape[:2]
        steps: list[list[tuple[int, int]]] = [[] for _ in range(T)]
        for t, k, d in zip(*(a.tolist() for a in np.nonzero(R.transpose(1, 2, 0))), strict=True):
            steps[t].append((k, d))
        computes = np.asarray(R.any(axis=1), dtype=bool)
        nodes = [np.flatnonzero(computes[d]) for d in range(D)]
        return _Replay(self, steps, S, nodes).run()

    def profile_placed(self, sparse: Sparse, home: np.ndarray) -> Profile:
        """``profile`` of a schedule whose node i is computed and kept only on device
        ``home[i]``: ``sparse`` says when (its R rows and S), ``home`` where."""
        D = len(self.time)
        steps = [[(k, int(home[k])) for k in nodes] for nodes in sparse.computed]
        on = home[None, None, :] == np.arange(D)[:, None, None]
        S = sparse.S()[None] & on
        computed = np.zeros(len(home), dtype=bool)
        computed[[k for nodes in sparse.computed for k in nodes]] = True
        nodes = [np.flatnonzero(computed & (home == d)) for d in range(D)]
        return _Replay(self, steps, S, nodes).run()


class _Replay:
    def __init__(
        self,
        shared: Profiler,
        steps: list[list[tuple[int, int]]],
        S: np.ndarray,
        nodes: list[np.ndarray],
    ) -> None:
        """``steps[t]``: the (node, device) pairs computed in stage t, in node order; ``S``
        [D, T, n]; ``nodes[d]``: what device d computes (its fixed memory)."""
        self.shared = shared
        D, T = S.shape[:2]
        self.D, self.T = D, T
        self.steps = steps
        self.resident: list[set[int]] = [set() for _ in range(D)]
        self.memory = [held_fixed_bytes(shared.graph, nodes[d]) for d in range(D)]
        self.peaks = np.zeros((D, T), dtype=np.int64)
        self.cost = 0.0
        # What each device keeps into the next stage (S[:, t + 1]) as bytes: indexing one
        # is the cheapest membership test per value.
        self.kept = [[S[d, t + 1].tobytes() for d in range(D)] for t in range(T - 1)]
        self.kept.append([bytes(S.shape[2])] * D)

    def run(self) -> Profile:
        for t in range(self.T):
            self._stage(t)
        return Profile(self.cost, self.peaks)

    def _stage(self, t: int) -> None:
        deps = self.shared.deps
        steps = self.steps[t]
        self.saved = self.kept[t]
        self.t = t
        self.peaks[:, t] = self.memory
        computed = {k for k, _ in steps}
        read = {i for k in computed for i in deps[k]}
        self._free_all_but(read | computed)
        for position, (k, d) in enumerate(steps):
            self._compute(k, d)
            if position + 1 == len(steps) or steps[position + 1][0] != k:
                self._free_after(k, computed)
        self._free_all_but(set())

    def _record(self, d: int) -> None:
        self.peaks[d, self.t] = max(self.peaks[d, self.t], self.memory[d])

    def _allocate(self, i: int, d: int) -> None:
        self.resident[d].add(i)
        self.memory[d] += self.shared.size[i]
        self._record(d)

    def _free(self, i: int, d: int) -> None:
        self.resident[d].discard(i)
        self.memory[d] -= self.shared.size[i]

    def _free_all_but(self, spared: set[int]) -> None:
        """Free what is resident but neither kept (model outputs, S[t + 1]) nor spared."""
        keep = self.shared.keep
        for d in range(self.D):
            saved = self.saved[d]
            for i in self.resident[d] - spared - keep:
                if not saved[i]:
                    self._free(i, d)

    def _compute(self, k: int, d: int) -> None:
        if k in self.resident[d]:
            return  # the compiler emits nothing for a resident value
        shared = self.shared
        for i in shared.deps[k]:
            if i not in self.resident[d]:
                sources = [s for s in range(self.D) if i in self.resident[s]]
                source = min(sources, key=lambda s: shared.copy[i][s][d])
                self.cost += shared.copy[i][source][d]
                self._allocate(i, d)
        self.cost += shared.time[d][k]
        self._allocate(k, d)

    def _free_after(self, k: int, computed: set[int]) -> None:
        shared = self.shared
        for i in (*shared.deps[k], k):
            if i in shared.keep or any(j in computed for j in shared.users[i] if j > k):
                continue
            for d in range(self.D):
                if i in self.resident[d] and not self.saved[d][i]:
                    self._free(i, d)
