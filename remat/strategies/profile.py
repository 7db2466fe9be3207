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
from remat.strategies.base import Problem


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
    return _Replay(problem, names, R, S).run()


class _Replay:
    def __init__(self, problem: Problem, names: Sequence[str], R: np.ndarray, S: np.ndarray):
        graph, costs = problem.graph, problem.costs
        order = [costs.device_index(name) for name in names]
        self.deps = [node.deps for node in graph.nodes]
        self.users = graph.users()
        self.size = [int(b) for b in costs.output_bytes]
        self.time = costs.compute_ms[:, order].T.tolist()  # [D][n]
        self.copy = costs.copy_ms[:, order][:, :, order]  # [n, D, D]
        self.keep = set(graph.outputs)
        D, T = R.shape[:2]
        self.R, self.S, self.D, self.T = R, S, D, T
        self.resident: list[set[int]] = [set() for _ in range(D)]
        computes = R.any(axis=1)
        self.memory = [held_fixed_bytes(graph, np.flatnonzero(computes[d])) for d in range(D)]
        self.peaks = np.zeros((D, T), dtype=np.int64)
        self.cost = 0.0

    def run(self) -> Profile:
        stages, nodes = np.nonzero(self.R.any(axis=0))
        bounds = np.searchsorted(stages, np.arange(self.T + 1))
        for t in range(self.T):
            self._stage(t, nodes[bounds[t] : bounds[t + 1]].tolist())
        return Profile(self.cost, self.peaks)

    def _stage(self, t: int, order: list[int]) -> None:
        saved = self.S[:, t + 1] if t + 1 < self.T else np.zeros_like(self.S[:, 0])
        self.saved = [set(np.flatnonzero(saved[d]).tolist()) for d in range(self.D)]
        self.t = t
        self.peaks[:, t] = self.memory
        computed = set(order)
        read = {i for k in order for i in self.deps[k]}
        self._free_where(lambda i: i not in read and i not in computed)
        for k in order:
            for d in np.flatnonzero(self.R[:, t, k]).tolist():
                self._compute(k, d)
            self._free_after(k, computed)
        self._free_where(lambda _: True)

    def _record(self, d: int) -> None:
        self.peaks[d, self.t] = max(self.peaks[d, self.t], self.memory[d])

    def _allocate(self, i: int, d: int) -> None:
        self.resident[d].add(i)
        self.memory[d] += self.size[i]
        self._record(d)

    def _free(self, i: int, d: int) -> None:
        self.resident[d].discard(i)
        self.memory[d] -= self.size[i]

    def _free_where(self, doomed) -> None:  # type: ignore[no-untyped-def]
        for d in range(self.D):
            for i in sorted(self.resident[d]):
                if doomed(i) and i not in self.keep and i not in self.saved[d]:
                    self._free(i, d)

    def _compute(self, k: int, d: int) -> None:
        if k in self.resident[d]:
            return  # the compiler emits nothing for a resident value
        for i in self.deps[k]:
            if i not in self.resident[d]:
                sources = [s for s in range(self.D) if i in self.resident[s]]
                source = min(sources, key=lambda s: self.copy[i, s, d])
                self.cost += float(self.copy[i, source, d])
                self._allocate(i, d)
        self.cost += self.time[d][k]
        self._allocate(k, d)

    def _free_after(self, k: int, computed: set[int]) -> None:
        for i in (*self.deps[k], k):
            if i in self.keep or any(j in computed for j in self.users[i] if j > k):
                continue
            for d in range(self.D):
                if i in self.resident[d] and i not in self.saved[d]:
                    self._free(i, d)
