"""Griewank & Walther's REVOLVE (binomial checkpointing) on linear graphs.

Reversing a chain of l steps from a held state with c free snapshots costs, at best,

    cost(l, c) = min_{1 <= m < l} m + cost(l - m, c - 1) + cost(m, c),
    cost(1, c) = 0,  cost(l, 0) = l (l - 1) / 2

forward steps (advance m steps and snapshot there, reverse the last l - m steps with one
snapshot fewer, then the first m with the snapshot freed). Its closed form: with
beta(s, r) = C(s + r, s) and r the smallest repetition number with beta(c + 1, r) >= l,
cost(l, c) = r l - beta(c + 2, r - 1) (Griewank & Walther 2000; the model input is the
extra, free snapshot). Optimal for unit costs on chains.

In the stage model, forward node i is step i (x_i from x_{i-1}, x_{-1} the model input)
and backward node B_i reverses it. The reversal schedule is expressed as S: the snapshots
held at each stage (a snapshot taken during an advance is kept from the stage of that
advance, i.e. the next reversal), the value the sweep has just computed, and the
gradients; ``solve_r`` adds the advances. The first sweep counts l - 1 of cost(l, c)
steps, so the forward recomputations are cost(F, c) - (F - 1) when each B_i reads x_{i-1}.
"""

from __future__ import annotations

import numpy as np

from remat.errors import StrategyError
from remat.graph import Graph
from remat.strategies.common.policy import Candidate, choose, device_fixed_bytes, predict
from remat.strategies.common.problem import Problem, StrategyResult
from remat.strategies.common.rsolve import (
    HoldBuilder,
    Holds,
    Layout,
    holds_to_dense,
    linear_chain_violation,
    solve_and_prune_sparse,
)

# Candidates with more forward recomputations than this per forward node are not
# considered (they are slow to even compile on long chains and use barely less memory than
# the smallest c below the limit); short chains always try c = 0.
MAX_RECOMPUTE_PER_NODE = 16


# --- revolve ----------------------------------------------------------------------------


def revolve_cost(steps: np.ndarray | int, c: int) -> np.ndarray:
    """cost(l, c) in closed form, vectorised over l = ``steps`` (l >= 1)."""
    lengths = np.atleast_1d(np.asarray(steps, dtype=np.int64))
    s = c + 1  # snapshots counting the held starting state
    top = int(lengths.max()) if lengths.size else 1
    betas = [1]  # beta(s, r) for r = 0, 1, ... until it covers the longest chain
    while betas[-1] < top:
        k = len(betas)
        betas.append(betas[-1] * (s + k) // k)
    beta = np.array(betas, dtype=np.int64)
    r = np.searchsorted(beta, lengths, side="left")
    # beta(s + 1, r - 1) = C(s + r, s + 1) = beta(s, r) * r / (s + 1)
    below = beta[r] * r // (s + 1)
    return r * lengths - below


def revolve_split(steps: int, c: int) -> int:
    """An optimal first snapshot position m (1 <= m < l) for cost(l, c), c >= 1."""
    if c >= steps - 1:
        return 1  # enough snapshots: snapshot every state, no recomputation
    m = np.arange(1, steps, dtype=np.int64)
    total = m + revolve_cost(steps - m, c - 1) + revolve_cost(m, c)
    return int(m[np.argmin(total)])


def revolve_recomputations(F: int, c: int) -> int:
    """Forward recomputations of revolve with c snapshots on an F-node chain."""
    if F <= 1:
        return 0
    return int(revolve_cost(F, c)[0]) - (F - 1)


def revolve_events(F: int, c: int) -> list[tuple[str, int]]:
    """The reversal order as events ("take", s), ("release", s), ("reverse", i).

    Iterative (an explicit stack), so long chains do not hit Python's recursion limit."""
    events: list[tuple[str, int]] = []
    stack: list[tuple[int, int, int] | int] = [(-1, F, c)]  # (base h, steps l, snapshots c)
    while stack:
        task = stack.pop()
        if isinstance(task, int):  # the snapshot at ``task`` has done its job
            events.append(("release", task))
            continue
        h, steps, snaps = task
        if steps <= 0:
            continue
        if steps == 1:
            events.append(("reverse", h + 1))
        elif snaps == 0:  # advance from x_h for every step, last step first
            events.extend(("reverse", h + k) for k in range(steps, 0, -1))
        else:
            m = revolve_split(steps, snaps)
            events.append(("take", h + m))
            stack.extend([(h, m, snaps), h + m, (h + m, steps - m, snaps - 1)])
    return events


# --- S policy ---------------------------------------------------------------------------


def griewank_holds(graph: Graph, c: int) -> Holds:
    """S for revolve with c snapshots (before solving R and pruning), as holds."""
    layout = Layout.of(graph)
    F = layout.F
    builder = HoldBuilder(graph).keep_gradients_and_outputs()
    # The sweep's current state: each forward stage and the loss read the value just
    # computed.
    for t in range(1, F):
        builder.hold(t - 1, t, t)
    if layout.loss is not None:
        for i in graph.nodes[layout.loss].deps:
            builder.hold(i, layout.loss, layout.loss)
    events = revolve_events(F, c)
    stages = [int(layout.backward_of[i]) if e == "reverse" else -1 for e, i in events]
    _hold_first_reversal(graph, builder, stages)
    next_real = _next_real(stages)
    last = -1  # stage of the latest reversal
    taken: dict[int, int] = {}
    for k, (event, i) in enumerate(events):
        if event == "reverse":
            last = max(last, stages[k])
        elif event == "take":
            # During the sweep the snapshot is the value computed in its own stage; later
            # it is taken during the advance of the next reversal, in that stage.
            taken[i] = i + 1 if last < 0 else next_real[k] + 1
        else:
            end = last if last >= 0 else layout.sweep_end
            # Revolve frees x_i once step i+1 is reversed, and reverses step i next. If
            # B_i also reads its output x_i (e.g. Relu), keep the snapshot one more stage.
            b = int(layout.backward_of[i])
            if b >= 0 and i in graph.nodes[b].deps:
                end = max(end, b)
            builder.hold(i, taken.pop(i), end)
    return builder.build()


def griewank_policy(graph: Graph, c: int) -> np.ndarray:
    """S for revolve with c snapshots (before solving R and pruning)."""
    return holds_to_dense(griewank_holds(graph, c), len(graph))


def _next_real(stages: list[int]) -> list[int]:
    """For each event, the stage of the next reversal that has a backward node."""
    result = [0] * len(stages)
    upcoming = 1 << 62  # none: the hold is clipped away
    for k in range(len(stages) - 1, -1, -1):
        if stages[k] >= 0:
            upcoming = stages[k]
        result[k] = upcoming
    return result


def _hold_first_reversal(graph: Graph, builder: HoldBuilder, stages: list[int]) -> None:
    """The first reversal reads what the sweep computed last (classic revolve's current
    state): keep its forward dependencies from their computation instead of recomputing."""
    first = next((s for s in stages if s >= 0), -1)
    if first < 0:
        return
    F = Layout.of(graph).F
    for i in graph.nodes[first].deps:
        if i < F:
            builder.hold(i, i + 1, first)


# --- strategy ---------------------------------------------------------------------------


def snapshot_range(F: int) -> tuple[int, int]:
    """The c values griewank considers: up to F - 1 (a snapshot of every state: no
    recomputation even when backward nodes read their outputs), down to the smallest c
    within MAX_RECOMPUTE_PER_NODE recomputations per node (0 for short chains)."""
    high = max(F - 1, 0)
    low = 0
    limit = MAX_RECOMPUTE_PER_NODE * max(F, 1)
    while low < high and revolve_recomputations(F, low) > limit:
        low += 1
    return low, high


def griewank(problem: Problem, device: str) -> StrategyResult:
    graph = problem.graph
    problem_text = linear_chain_violation(graph)
    if problem_text is not None:
        raise StrategyError(f"griewank needs a linear graph (a chain); {problem_text}")
    F = Layout.of(graph).F
    low, high = snapshot_range(F)
    budget = problem.budgets.get(device)
    fixed = device_fixed_bytes(problem, device)
    pool: dict[int, Candidate] = {}

    def fits(c: int) -> bool:
        if c not in pool:
            sparse = solve_and_prune_sparse(graph, griewank_holds(graph, c))
            pool[c] = Candidate(sparse, predict(problem, device, sparse, fixed))
        return budget is None or pool[c].prediction.peak_bytes <= budget

    # Fewer snapshots never cost less, and memory grows with c: binary search for the
    # largest c that fits (the top first: with ample memory it is the only candidate).
    if not fits(high):
        high -= 1
        while low < high:
            mid = (low + high + 1) // 2
            if fits(mid):
                low = mid
            else:
                high = mid - 1
        fits(low)
    return choose(problem, device, "griewank", list(pool.values()))
