"""DYNPROG (Beaumont et al., section 5): the offload set chosen by a dynamic program over
the fractional-communication relaxation, then planned whole (``offload.offload_plan``).

The relaxation releases an offloaded activation's memory as its bytes reach the host and
reserves a prefetched one's as they arrive. Its schedules can be taken ordered and no-wait
(Lemma 3, Proposition 1), so what the rest of a schedule costs depends only on a few
amounts: the bytes offloaded so far, and the bytes still waiting on the lane in each phase
(the paper's ``M_F``, ``Delta_F``, ``Delta_B``). The program walks the candidates in
the order of their last forward reader (production order on a chain) and, for each,
offloads it or not; between two candidates it replays the forward steps up to the
candidate's last forward reader (its memory cannot be released before: the relaxation
counts its transfer from there), and, backwards from the end of the plan, the backward
steps down to its first backward reader. Backwards in time the backward phase is a
forward phase (a prefetch that completes before its reader is an offload that starts
after it, releasing its memory as it goes), so both phases follow the same recurrence
(eq. 1-8): a step that needs more memory than the bytes already moved leave waits for the
lane to move the difference (the stall ``epsilon``), then the lane moves ``u beta`` bytes
while the step computes. Between the phases the lane moves what is left of both
backlogs (``epsilon_G``, eq. 9-10, without the overlap of the phases' idle lane time).
On a chain the backward readers come in the reverse of production order, as in the
paper; on a graph where they do not, a candidate whose reader the backward walk has passed
joins it where the walk stands (its memory counted for longer: conservative).

Discretization (section 5.3.2, differently): the states carry exact bytes and times, and
are merged where their offloaded bytes and both backlogs fall in the same slots of
``offload_slots`` (500) slots of the candidates' total bytes, keeping the least idle time
(then the fewest bytes offloaded: idle lane time is free in the relaxation, not in a plan
of whole activations).
The paper rounds the sizes instead; rounded sizes release rounded memory, which on a graph
of many small activations (U-Net's) overstated what offloading frees by up to a slot per
activation. Merging is one approximation: a merged state may differ from the one kept by
less than a slot in each amount, so the program's optimum is the relaxation's up to what
one slot per candidate changes. The other: at most ``offload_states`` states per
candidate are kept (the least idle), so that graphs of a thousand nodes plan in seconds.

The set's plan is judged by the simulator. Where the relaxation was too optimistic for
whole activations (the plan does not fit), the program runs again for a budget smaller by
``offload_epsilons`` (as Checkmate's LP rounding sweeps), and the plan of the prefix GREEDY
chooses is the fallback, so DYNPROG is never worse than GREEDY. Where GREEDY's plan costs
the bound already, the program does not run; where the program has not ended within the
solver settings' time limit, GREEDY's plan is the result (the message says so).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from remat.devices import Tier
from remat.plan import Compute
from remat.strategies.common.offload import (
    OffloadBase,
    judged_plan,
    named,
    offload_base,
    offload_bound_ms,
    offload_result,
)
from remat.strategies.common.problem import Evaluation, Problem, StrategyResult
from remat.strategies.heuristics.offload_greedy import greedy_plan, offload_greedy

NAME = "offload_dynprog"
Key = tuple[int, int, int]  # (offloaded slots, forward backlog, backward backlog)


@dataclass(frozen=True)
class _Walk:
    """A phase's steps in the order the program walks them: each step's memory over the
    budget and the bytes the lane moves while it computes."""

    excess: list[float]
    moved: list[float]


def offload_dynprog(problem: Problem, device: str, tier: Tier = Tier.HOST) -> StrategyResult:
    """DYNPROG's plan on ``device``: offloading to its host, or paging to storage."""
    base = offload_base(problem, device, tier=tier)
    deadline = time.monotonic() + problem.solver.options.time_limit_s
    best = None if base is None else offload_set_plan(problem, base, deadline)
    if base is None or best is None:
        # GREEDY's result says what sending needs
        return _renamed(offload_greedy(problem, device, tier), tier)
    result = offload_result(problem, base, named(NAME, tier), best)
    if time.monotonic() > deadline:
        limit = problem.solver.options.time_limit_s
        result = replace(result, message=f"{result.message} (DYNPROG stopped at {limit:g} s)")
    return result


def offload_set_plan(
    problem: Problem, base: OffloadBase, deadline: float | None = None
) -> Evaluation | None:
    """The cheaper of GREEDY's and DYNPROG's plans over ``base`` (DYNPROG runs only where
    GREEDY's plan costs more than Proposition 3's bound, until ``deadline``, a
    ``time.monotonic()``); None where neither fits."""
    greedy = greedy_plan(problem, base)
    budget = problem.budgets.get(base.device)
    if budget is None or (greedy is not None and greedy.cost_ms <= offload_bound_ms(problem, base)):
        return greedy
    found: Evaluation | None = None
    for epsilon in problem.solver.search.offload_epsilons:
        chosen = _dynprog(problem, base, int(budget * (1 - epsilon)), deadline)
        found = None if chosen is None else judged_plan(problem, base, chosen, NAME)
        if found is not None:
            break
    plans = [e for e in (greedy, found) if e is not None]
    return min(plans, key=lambda e: e.cost_ms, default=None)


def _renamed(result: StrategyResult, tier: Tier) -> StrategyResult:
    """GREEDY's result under this strategy's name."""
    name = named(NAME, tier)
    plan = None if result.plan is None else replace(result.plan, strategy=name)
    message = result.message.replace(named("offload_greedy", tier), name)
    return replace(result, strategy=name, plan=plan, message=message)


def _dynprog(
    problem: Problem, base: OffloadBase, budget: int, deadline: float | None
) -> list[int] | None:
    """The candidates DYNPROG offloads at ``budget``, or None where no set fits the
    relaxation or the program has not ended by ``deadline``."""
    # In the order their memory can be released: after their last forward reader.
    candidates = sorted(base.candidates, key=lambda v: (base.last_forward[v], base.produced[v]))
    if not candidates:
        return None
    costs, d = problem.costs, base.d
    sizes = [float(costs.output_bytes[v]) for v in candidates]
    slot = max(sum(sizes) / problem.solver.search.offload_slots, 1.0)
    link = costs.link(d, base.tier)
    to_host = link.out_bytes_per_s / 1e3  # bytes per ms
    from_host = link.in_bytes_per_s / 1e3
    b, end = base.boundary, len(base.steps)
    forward = _walk(problem, base, range(b), budget, to_host)
    backward = _walk(problem, base, range(end - 1, b - 1, -1), budget, from_host)
    # Where each candidate joins a lane: in the forward walk after its last forward reader,
    # in the backward walk (backwards from the end) once it has passed its first backward
    # reader, or where the walk stands if it has passed it already.
    joins_f = [base.last_forward[v] + 1 for v in candidates]
    cursor, joins_b = end - 1, []
    for v in candidates:
        cursor = min(cursor, base.first_backward[v])
        joins_b.append(end - cursor)  # steps of the backward walk before it joins
    limit = problem.solver.search.offload_states
    layers: list[dict[Key, _State]] = [{(0, 0, 0): _State(0.0, 0.0, 0.0, 0.0, None, False)}]
    at_f = at_b = 0
    for j, size in enumerate(sizes):
        if deadline is not None and time.monotonic() > deadline:
            return None
        states: dict[Key, _State] = {}
        for key, state in layers[-1].items():
            moved = _advance(state, forward, at_f, joins_f[j], to_host, True)
            moved = moved and _advance(moved, backward, at_b, joins_b[j], from_host, False)
            if moved is None:
                continue
            for chose in (False, True):
                grown = size if chose else 0.0
                o, df, db = moved.o + grown, moved.df + grown, moved.db + grown
                bucket = (round(o / slot), round(df / slot), round(db / slot))
                kept = states.get(bucket)
                if kept is None or (moved.idle, o) < (kept.idle, kept.o):
                    states[bucket] = _State(moved.idle, o, df, db, key, chose)
        if len(states) > limit:  # the least idle, then the fewest bytes offloaded
            ranked = sorted(states.items(), key=lambda item: (item[1].idle, item[1].o))
            states = dict(ranked[:limit])
        layers.append(states)
        at_f, at_b = joins_f[j], joins_b[j]
    finals: list[tuple[float, float, Key]] = []
    for key, state in layers[-1].items():
        moved = _advance(state, forward, at_f, b, to_host, True)
        moved = moved and _advance(moved, backward, at_b, end - b, from_host, False)
        if moved is not None:  # epsilon_G: both backlogs, between the phases
            idle = moved.idle + moved.df / to_host + moved.db / from_host
            finals.append((idle, moved.o, key))
    if not finals:
        return None
    _, _, key = min(finals)  # the least idle time, then the fewest bytes offloaded
    chosen: list[int] = []
    for j in range(len(candidates), 0, -1):
        state = layers[j][key]
        if state.chose:
            chosen.append(candidates[j - 1])
        assert state.parent is not None
        key = state.parent
    return chosen[::-1]


@dataclass(frozen=True)
class _State:
    """A state of the program: idle time so far (ms), bytes offloaded (``o``), the
    forward and backward lanes' backlogs (bytes), and how it was reached."""

    idle: float
    o: float
    df: float
    db: float
    parent: Key | None
    chose: bool


def _walk(problem: Problem, base: OffloadBase, order: range, budget: int, rate: float) -> _Walk:
    compute_ms = problem.costs.compute_ms[:, base.d]
    excess, moved = [], []
    for q in order:
        excess.append(float(base.memory[q]) - budget)
        step = base.steps[q]
        duration = float(compute_ms[step.node]) if isinstance(step, Compute) else 0.0
        moved.append(duration * rate)
    return _Walk(excess, moved)


def _advance(
    state: _State, walk: _Walk, start: int, stop: int, rate: float, forward: bool
) -> _State | None:
    """Replay ``walk``'s steps [start, stop) from ``state`` (eq. 1-8): a step whose excess
    the bytes already moved do not cover waits for the lane to move the rest; then the lane
    moves what the step's compute time allows. None where the backlog cannot cover it."""
    idle, o = state.idle, state.o
    backlog = state.df if forward else state.db
    for q in range(start, stop):
        short = walk.excess[q] - (o - backlog)
        if short > 0:
            if short > backlog:
                return None
            idle += short / rate
            backlog -= short
        backlog = max(backlog - walk.moved[q], 0.0)
    if forward:
        return replace(state, idle=idle, df=backlog)
    return replace(state, idle=idle, db=backlog)
