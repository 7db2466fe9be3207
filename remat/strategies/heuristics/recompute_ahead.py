"""Recomputing a stage ahead on another device of the pool: a local search that turns a
schedule on devices sharing one memory pool into one whose concurrent plan (PORT-M's
stages, ``remat.plan.Plan.concurrent``) hides recomputation.

In Checkmate's stages, stage t computes node t and recomputes what it needs that was not
kept. On a pool, that recomputation can instead run one stage earlier on another device,
beside stage t - 1's own work, and be kept into stage t: stage t is shorter by it, and
stage t - 1 no longer than its longest device. The cost is memory: the value lives a
stage longer, and a concurrent stage frees nothing until it ends.

From the last stage to the first, for each device's recomputations in the stage, the
move is tried for all of them at once, then for each alone, to each other device, where
every input of a moved value is on the pool during stage t - 1 (kept into it, computed in
it, or moved with it); a move is kept where the schedule's concurrent plan
(``evaluate_concurrent``) fits and is faster than the best plan so far. Each try is one
compile and simulation (a move only pays where the stages run concurrently, so the plan
in turn is not tried).
"""

from __future__ import annotations

import time

import numpy as np

from remat.schedule import Schedule
from remat.strategies.common.problem import (
    Evaluation,
    Problem,
    evaluate,
    evaluate_concurrent,
)


def recompute_ahead(
    problem: Problem, schedule: Schedule, strategy: str, deadline: float | None = None
) -> Evaluation:
    """The best plan found from ``schedule`` (itself where no move helps), over every
    device of the problem's cost model; no move is tried after ``deadline`` (a
    ``time.monotonic()``) where one is given."""
    names = tuple(d.name for d in problem.costs.devices)
    schedule = schedule.on_devices(names)
    R, S, (_, T, n) = schedule.R, schedule.S, schedule.R.shape
    best = evaluate(problem, schedule, strategy)
    if not best.fits or len(names) < 2:
        return best
    deps = [problem.graph.nodes[i].deps for i in range(n)]
    for t in range(T - 1, 0, -1):
        if deadline is not None and time.monotonic() > deadline:
            break
        for a in range(len(names)):
            recomputed = [int(i) for i in np.flatnonzero(R[a, t, :t])]
            if not recomputed:
                continue
            groups = [recomputed] + ([[i] for i in recomputed] if len(recomputed) > 1 else [])
            for group in groups:
                if not R[a, t, group].all():
                    continue  # moved already, with a larger group
                for b in range(len(names)):
                    moved = _moved(R, S, deps, t, a, b, group) if b != a else None
                    if moved is None:
                        continue
                    candidate = evaluate_concurrent(problem, Schedule(names, *moved), strategy)
                    if candidate.fits and candidate.cost_ms < best.cost_ms:
                        best, (R, S) = candidate, moved
                        break
    return best


def _moved(
    R: np.ndarray,
    S: np.ndarray,
    deps: list[tuple[int, ...]],
    t: int,
    a: int,
    b: int,
    group: list[int],
) -> tuple[np.ndarray, np.ndarray] | None:
    """R and S with ``group``'s recomputations in stage ``t`` on device ``a`` moved to
    stage ``t - 1`` on ``b`` and kept into ``t``; None where an input is not there then."""
    on_pool = np.asarray(S[:, t - 1].any(axis=0) | R[:, t - 1].any(axis=0), dtype=bool)
    R, S = R.copy(), S.copy()
    R[a, t, group] = False
    for i in group:
        S[b, t, i] = True
        if i == t - 1:
            continue  # computed in stage t - 1 anyway: kept instead of recomputed
        if not all(j in group or on_pool[j] for j in deps[i]):
            return None
        R[b, t - 1, i] = True
    return R, S
