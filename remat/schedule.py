"""Schedules: the R and S matrices of Checkmate (section 4.2) with XEngine's device axis.

R[d, t, i] = 1: node i is (re)computed on device d in stage t.
S[d, t, i] = 1: node i's value is kept on device d from stage t-1 into stage t.

Stages are frontier-advancing (Checkmate eq. 8): node t is computed for the first time
in stage t, so R and S are lower triangular (S strictly).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from remat.errors import ScheduleError
from remat.graph import Graph
from remat.plan import Compute, Free, Step


@dataclass(frozen=True)
class Schedule:
    devices: tuple[str, ...]
    R: np.ndarray  # bool [D, T, n]
    S: np.ndarray  # bool [D, T, n]

    def __post_init__(self) -> None:
        if self.R.shape != self.S.shape or self.R.ndim != 3:
            raise ScheduleError(f"R {self.R.shape} and S {self.S.shape} must be equal [D, T, n]")
        if self.R.shape[0] != len(self.devices):
            raise ScheduleError("R's first axis must match the device list")

    @property
    def stages(self) -> int:
        return self.R.shape[1]

    @property
    def size(self) -> int:
        return self.R.shape[2]

    def on_devices(self, names: Sequence[str]) -> Schedule:
        """This schedule over ``names``, a superset of its devices (zeros elsewhere)."""
        D, T, n = len(names), self.stages, self.size
        R = np.zeros((D, T, n), dtype=bool)
        S = np.zeros((D, T, n), dtype=bool)
        for index, name in enumerate(self.devices):
            R[names.index(name)] = self.R[index]
            S[names.index(name)] = self.S[index]
        return Schedule(tuple(names), R, S)

    @classmethod
    def single(cls, device: str, R: np.ndarray, S: np.ndarray) -> Schedule:
        """A one-device schedule from Checkmate's 2-D [T, n] matrices."""
        return cls((device,), R.astype(bool)[None], S.astype(bool)[None])

    def check(self, graph: Graph) -> None:
        """Raise ScheduleError on the first violated correctness constraint."""
        R, S = self.R, self.S
        n = len(graph)
        if R.shape[1:] != (n, n):
            raise ScheduleError(f"schedule is {R.shape[1:]} but the graph has {n} nodes")
        # Eq. 8a / XEngine eq. 8-9: each node is computed for the first time in its stage.
        diagonal = R[:, np.arange(n), np.arange(n)].any(axis=0)
        if not diagonal.all():
            raise ScheduleError(f"node {int(np.argmin(diagonal))} is not computed in its stage")
        # Eq. 8b, 8c: lower triangular.
        if np.triu(R.any(axis=0), 1).any() or np.triu(S.any(axis=0)).any():
            raise ScheduleError("R must be lower triangular and S strictly lower triangular")
        # Eq. 1c / XEngine eq. 11: keep only what was available on the same device.
        carried = S[:, 1:] & ~(R[:, :-1] | S[:, :-1])
        if carried.any():
            d, t, i = (int(x) for x in np.argwhere(carried)[0])
            raise ScheduleError(f"S[{d},{t + 1},{i}] keeps a value not present in stage {t}")
        # Eq. 1b / XEngine eq. 12: dependencies available on some device in the same stage.
        available = (R | S).any(axis=0)
        for node in graph.nodes:
            if not node.deps:
                continue
            computing = np.any(R[:, :, node.id], axis=0)  # per stage
            missing = computing[:, None] & ~available[:, list(node.deps)]
            if missing.any():
                t, k = (int(x) for x in np.argwhere(missing)[0])
                raise ScheduleError(
                    f"stage {t}: node {node.id} is computed without dependency {node.deps[k]}"
                )


def schedule_of_steps(steps: Iterable[Step], n: int, device: str) -> Schedule | None:
    """The one-device schedule whose stages a plan's steps follow (the inverse of
    ``remat.compiler`` on one device), or None if they do not follow Checkmate's stage
    order: the first computations in node order, without copies. A computation belongs to the
    stage of the next first computation; S[t, i] = 1 where value i is resident just before
    stage t's first computation."""
    R = np.zeros((n, n), dtype=bool)
    S = np.zeros((n, n), dtype=bool)
    resident: set[int] = set()
    at_start: list[int] | None = None  # resident when the current stage's first step ran
    pending: list[int] = []  # recomputations of the current stage
    stage = 0
    for step in steps:
        if isinstance(step, Free):
            resident.discard(step.node)
            continue
        if not isinstance(step, Compute) or step.device != device:
            return None
        if at_start is None:
            at_start = [i for i in resident if i < stage]
        if step.node < stage:
            pending.append(step.node)
        elif step.node == stage:
            S[stage, at_start] = True
            R[stage, [*pending, stage]] = True
            at_start, pending = None, []
            stage += 1
        else:
            return None
        resident.add(step.node)
    return Schedule.single(device, R, S) if stage == n else None
