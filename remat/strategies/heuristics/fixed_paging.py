"""Paging fixed tensors (plan version 5): a budget below the fixed memory's floor.

Every other strategy keeps the parameters, model inputs and gradient buffers on the device
for the whole plan (the simulator's fixed memory), so no budget below their size plus the
largest node's values has a plan: on a ResNet-18 in training they are 90 of its 103 MiB.
Paging them to the node's storage lifts that floor, as ZeRO-Infinity does with NVMe: a
parameter is read in shortly before the nodes that read it and dropped after them, and a
gradient buffer, allocated by its first writer, is written out after its last.

``page_fixed`` pages the largest fixed tensors: as few as leave every node room for its
values by an estimate of the window they still occupy (``paged_set``), then twice, four
and eight times as many (more paging, more room for the activations). For each set it
gives the rest of the budget to an activation plan from a quick strategy (``quick``:
``port`` uses greedy eviction), made as if every fixed tensor were resident in a budget
larger by what paging frees, inserts the paging steps (``with_fixed_paging``) and lets
the simulator judge (each read's step moved as late as leaves its start unchanged,
``issued_late``, and its memory counted from its step, as the agent's executor counts
it); while over the budget, the set grows by the excess, then the reads
are held to one ahead of the compute and each gradient's write waited for before the
next, then the activations are planned again in less room, and where too little is left
for them, the paging is made serial (``Hold``: each use read on its own, at its step,
each write waited for at once). The fastest set's activations
are then planned again by ``inner`` (``port``'s own search) in the time left, and the
faster plan kept.

Where the steps go, per paged tensor t and run of its uses (compute steps reading it, two
uses in one run where the compute time between them is shorter than reading t back): its
``fixed_in`` as late as leaves the compute before the run's first use time to read it,
after the reads of the runs before it on the lane (as late as possible, the last read
first; never before the previous run's end), its ``fixed_wait`` just before that use, its
``fixed_free`` after the run's last use; its ``grad_out`` after the first computation of
the last backward node that writes its gradient, and its ``grad_wait`` where the compute
after it has had time for the lane to write it, after the transfers before it (else at
the end).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import IntEnum

import numpy as np

from remat.devices import Tier, format_bytes
from remat.graph import Graph, Mode, NodeKind
from remat.plan import (
    TRANSFER_STARTS,
    Compute,
    FixedFree,
    FixedIn,
    FixedWait,
    GradOut,
    GradWait,
    Plan,
    Step,
)
from remat.simulator import Simulation, held_fixed_bytes, simulate
from remat.strategies.common.floor import value_bytes
from remat.strategies.common.problem import (
    Problem,
    StrategyResult,
    with_prediction,
)


class Hold(IntEnum):
    """How far the paging steps may run ahead of the compute: each level holds fewer paged
    tensors at once, and stalls the compute more."""

    FREE = 0  # reads as early as the lane allows, writes waited for when done
    ONE_AHEAD = 1  # one read ahead of the compute, one gradient written at a time
    SERIAL = 2  # each use read on its own, at its step; each write waited for at once


ATTEMPTS = 24
"""Plans judged per call: each grows the paging set, or makes the activation plan again."""
MARGIN = 0.01
"""Beyond an excess the simulator found, the share of the budget the next attempt frees."""
SETS = 4
"""Paging sets tried: the fewest largest tensors the estimate admits, then twice, four and
eight times as many (at most all)."""
QUICK_SHARE = 0.5
"""The share of the time limit for the paging sets tried with the quick activation plans."""


def written(graph: Graph, t: str) -> bool:
    """Whether fixed tensor ``t`` has a gradient buffer in training."""
    return graph.mode is Mode.TRAINING and graph.fixed[t].has_gradient


def window_bytes(graph: Graph, paged: frozenset[str]) -> int:
    """An estimate of the paged tensors resident at once: the most any node reads (and, for
    a backward node, the gradients it writes), plus the largest tensor being read in for
    the next node and the largest gradient being written out; at most all of them."""
    if not paged:
        return 0
    largest = max(graph.fixed[t].nbytes for t in paged)
    largest_grad = max((graph.fixed[t].nbytes for t in paged if written(graph, t)), default=0)
    most = 0
    for node in graph.nodes:
        own = [t for t in node.fixed if t in paged]
        held = sum(graph.fixed[t].nbytes for t in own)
        if node.kind is NodeKind.BACKWARD:
            held += sum(graph.fixed[t].nbytes for t in own if written(graph, t))
        most = max(most, held)
    total = sum(graph.fixed[t].nbytes * (2 if written(graph, t) else 1) for t in paged)
    return min(total, most + largest + largest_grad)


def paging_floor(problem: Problem, device: str) -> int:
    """What computing some node needs on ``device`` under any plan that pages fixed
    tensors: its output, inputs and workspace, its own fixed tensors, and for a backward
    node the gradient buffers it writes (``remat.strategies.common.floor`` with every
    fixed tensor paged)."""
    graph = problem.graph
    d = problem.costs.device_index(device)
    most = 0
    for node in graph.nodes:
        own = sum(graph.fixed[t].nbytes for t in set(node.fixed))
        if node.kind is NodeKind.BACKWARD:
            own += sum(graph.fixed[t].nbytes for t in set(node.fixed) if written(graph, t))
        most = max(most, value_bytes(problem, node.id, d) + own)
    return most


def paged_set(problem: Problem, device: str, budget: int) -> tuple[frozenset[str], int, int]:
    """The fewest largest fixed tensors whose paging leaves every node room for its values
    within ``budget`` (else all of them), the fixed memory left with them paged (the static
    rest plus their window) and the most any node's values need."""
    graph = problem.graph
    d = problem.costs.device_index(device)
    values = max(value_bytes(problem, node.id, d) for node in graph.nodes)
    order = _largest_first(graph)
    for k in range(1, len(order) + 1):
        paged = frozenset(order[:k])
        fixed = _fixed_with(graph, paged)
        if fixed + values <= budget:
            break
    return paged, fixed, values


def with_fixed_paging(
    plan: Plan,
    graph: Graph,
    problem: Problem,
    device: str,
    paged: frozenset[str],
    hold: Hold = Hold.FREE,
) -> Plan:
    """``plan`` (on ``device``, fixed tensors resident throughout) with ``paged`` paged, the
    steps placed as the module docstring says; ``hold`` (``Hold``): ``ONE_AHEAD``, no read
    starts before the first use of the read before it, and each gradient's write is waited
    for before the next one starts, so that at most one read is ahead of the compute and one
    gradient leaving (the window ``window_bytes`` estimates, where reading them earlier and
    writing them later would hold more); ``SERIAL``, each use of a tensor read on its own,
    issued at that use, and each gradient's write waited for right after it starts: the
    paging floor's window, at the cost of every transfer's time on the compute lane."""
    costs = problem.costs
    d = costs.device_index(device)
    link = costs.link(d, Tier.STORAGE)
    steps = plan.steps
    elapsed = np.zeros(len(steps) + 1)  # compute time before each step
    uses: dict[str, list[int]] = {t: [] for t in paged}
    last_writer: dict[str, int] = {}
    seen: set[int] = set()
    for i, step in enumerate(steps):
        ms = 0.0
        if isinstance(step, Compute) and step.device == device:
            ms = float(costs.compute_ms[step.node, d])
            node = graph.nodes[step.node]
            first = step.node not in seen
            seen.add(step.node)
            for t in node.fixed:
                if t in paged:
                    uses[t].append(i)
                    if first and node.kind is NodeKind.BACKWARD and written(graph, t):
                        last_writer[t] = i
        elapsed[i + 1] = elapsed[i] + ms
    before: dict[int, list[tuple[int, Step]]] = {}  # step index -> (order, step) to insert

    def insert(at: int, order: int, step: Step) -> None:
        before.setdefault(at, []).append((order, step))

    stage = _stages(steps)
    reads: list[tuple[int, str, float, int]] = []  # (first use, tensor, read ms, earliest)
    for t in sorted(paged):
        read_ms = float(link.in_ms(graph.fixed[t].nbytes))
        previous_end = -1
        # Serial: each use read on its own, never kept resident from one use to the next.
        for a, b in _runs(uses[t], elapsed, 0.0 if hold is Hold.SERIAL else read_ms):
            reads.append((a, t, read_ms, previous_end + 1))
            insert(a, 4 * len(steps) + a, FixedWait(stage[a], t, device))
            insert(b + 1, 0, FixedFree(stage[b], t, device))
            previous_end = b
    if hold >= Hold.ONE_AHEAD:
        reads.sort()
        reads = [
            (a, t, ms, max(earliest, reads[j - 1][0] if j else 0))
            for j, (a, t, ms, earliest) in enumerate(reads)
        ]
    lane_free = float("inf")  # as late as possible on the lane, the last read first
    queued: list[tuple[int, int, float, str]] = []  # the lane in plan order: (at, order, ms, t)
    for a, t, read_ms, earliest in sorted(reads, reverse=True):
        start = min(float(elapsed[a]), lane_free) - read_ms
        lane_free = start
        issue = max(earliest, min(a, int(np.searchsorted(elapsed, start, side="right")) - 1))
        if hold is Hold.SERIAL:
            issue = a
        insert(issue, 3 * len(steps) + a, FixedIn(stage[issue], t, device))
        queued.append((issue, 3 * len(steps) + a, read_ms, ""))
    for t, w in last_writer.items():
        insert(w + 1, 1, GradOut(stage[w], t, device))
        queued.append((w + 1, 1, float(link.out_ms(graph.fixed[t].nbytes)), t))
    busy_until = 0.0  # each grad_wait where the lane, in plan order, has written it
    writes = sorted(w + 1 for w in last_writer.values())
    for at, _, ms, t in sorted(queued):
        busy_until = max(busy_until, float(elapsed[at])) + ms
        if t:
            wait = min(int(np.searchsorted(elapsed, busy_until, side="left")), len(steps))
            if hold >= Hold.ONE_AHEAD:  # before the next gradient's grad_out
                wait = min([wait, *(w for w in writes if w > at)])
            if hold is Hold.SERIAL:
                wait = at
            insert(wait, 2, GradWait(stage[wait], t, device))
    out: list[Step] = []
    for i in range(len(steps) + 1):
        out += [step for _, step in sorted(before.get(i, []), key=lambda pair: pair[0])]
        if i < len(steps):
            out.append(steps[i])
    return replace(plan, steps=tuple(out), predicted=None, version=0)


def issued_late(plan: Plan, simulation: Simulation) -> Plan:
    """``plan`` with each ``fixed_in`` moved later to the last step the compute lane reaches
    before its read starts (``simulation``: the plan's replay), never past the next
    transfer on a lane nor its ``fixed_wait``: its read starts when it did, and its memory,
    which the agent's executor counts from the step, is held no earlier than needed."""
    steps = plan.steps
    clocks, starts = simulation.clock_ms, simulation.transfer_start_ms
    if len(clocks) != len(steps):
        return plan
    keys = [float(i) for i in range(len(steps))]
    next_transfer = float(len(steps))  # where the next transfer is issued, once moved
    for i in range(len(steps) - 1, -1, -1):
        step = steps[i]
        if isinstance(step, FixedIn) and i in starts:
            j = i  # the last step issued no later than the read starts, short of the limits
            while (
                j + 1 < min(len(steps), next_transfer + 1)
                and clocks[j + 1] <= starts[i]
                and not _waits(steps[j + 1], step)
            ):
                j += 1
            keys[i] = j - 0.5 if j > i else float(i)
        if step.op in TRANSFER_STARTS:
            next_transfer = keys[i]
    order = sorted(range(len(steps)), key=lambda i: keys[i])
    return replace(plan, steps=tuple(steps[i] for i in order), predicted=None)


def _waits(step: Step, read: FixedIn) -> bool:
    return isinstance(step, FixedWait) and step.tensor == read.tensor


def _stages(steps: tuple[Step, ...]) -> list[int]:
    """The stage of each step, and of the end (the last step's)."""
    stages = [step.stage for step in steps]
    return [*stages, stages[-1] if stages else 0]


def _runs(uses: list[int], elapsed: np.ndarray, read_ms: float) -> list[tuple[int, int]]:
    """``uses`` (step indices) grouped into runs: a use joins the run before it where the
    compute time between them is shorter than reading the tensor back."""
    runs: list[tuple[int, int]] = []
    for i in uses:
        if runs and elapsed[i] - elapsed[runs[-1][1] + 1] < read_ms:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


@dataclass(frozen=True)
class _Fit:
    """A plan that pages ``paged`` within the budget, its activations planned in ``room``."""

    result: StrategyResult
    paged: frozenset[str]
    room: int
    hold_first: bool


def page_fixed(
    problem: Problem,
    device: str,
    inner: Callable[[Problem], StrategyResult],
    strategy: str,
    quick: Callable[[Problem], StrategyResult] | None = None,
) -> StrategyResult:
    """A plan for ``device`` that pages fixed tensors, its activations planned by ``inner``
    (the module docstring); without a plan, the reason, proven where the budget is under
    ``paging_floor``. ``quick`` (default ``inner``) plans the activations of each paging set
    tried, in ``QUICK_SHARE`` of the time; ``inner`` then plans the fastest one's again."""
    budget = problem.budgets.get(device)
    if budget is None or not problem.graph.fixed:
        return StrategyResult(strategy, None, None, "no fixed tensors to page")
    floor = paging_floor(problem, device)
    if floor > budget:
        return StrategyResult(
            strategy,
            None,
            None,
            f"paging fixed tensors too, some node needs at least {format_bytes(floor)} "
            f"({floor} B): its inputs, output, workspace, fixed tensors and gradients",
            {device: floor},
            proven_infeasible=True,
        )
    started, limit = time.monotonic(), problem.solver.options.time_limit_s
    fewest, _, values = paged_set(problem, device, budget)
    largest = _largest_first(problem.graph)
    sizes = sorted({min(len(largest), len(fewest) * 2**i) for i in range(SETS)})
    fits: list[_Fit] = []
    reasons: dict[str, None] = {}  # why the sets tried found no plan, in order, once each
    for k in sizes:
        left = started + limit * QUICK_SHARE - time.monotonic()
        if left <= 0 or problem.cancelled:
            break
        paged = frozenset(largest[:k])
        room = max(budget - _fixed_with(problem.graph, paged), values + round(MARGIN * budget))
        for hold_first in (False, True):
            left = started + limit * QUICK_SHARE - time.monotonic()
            fit = _fit(
                problem.within(left), device, paged, room, quick or inner, strategy, hold_first
            )
            if isinstance(fit, _Fit):
                fits.append(fit)
            else:
                reasons[fit] = None
    if not fits:
        why = "; ".join(reasons) or "no time to try a paging set"
        return StrategyResult(strategy, None, None, f"paging fixed tensors too, no plan: {why}")
    best = min(fits, key=lambda fit: fit.result.time_ms)
    left = limit - (time.monotonic() - started)
    if quick is not None and left > 0 and not problem.cancelled:
        again = _fit(
            problem.within(left), device, best.paged, best.room, inner, strategy, best.hold_first
        )
        if isinstance(again, _Fit) and again.result.time_ms < best.result.time_ms:
            best = again
    return best.result


def _largest_first(graph: Graph) -> list[str]:
    return sorted(graph.fixed, key=lambda t: (-graph.fixed[t].nbytes, t))


def _fixed_with(graph: Graph, paged: frozenset[str]) -> int:
    """The fixed memory estimated with ``paged`` paged: the static rest and their window."""
    return held_fixed_bytes(graph, range(len(graph)), paged) + window_bytes(graph, paged)


def _with_budget(problem: Problem, device: str, budget: int) -> Problem:
    """``problem`` with ``budget`` for ``device``'s memory: its own, or its pool's (every
    device of the pool carries the pool's budget)."""
    devices = problem.costs.devices
    space = devices[problem.costs.device_index(device)].memory_space
    same = {d.name: budget for d in devices if d.memory_space == space}
    return replace(problem, budgets={**problem.budgets, **same})


def _fit(
    problem: Problem,
    device: str,
    paged: frozenset[str],
    room: int,
    inner: Callable[[Problem], StrategyResult],
    strategy: str,
    hold_first: bool = False,
) -> _Fit | str:
    """Activations planned by ``inner`` in ``room`` with ``paged`` paged, judged, and the
    paging set grown, the reads held back (first, where ``hold_first``) or the room made
    smaller while over the budget (the module docstring): the plan within the budget, or
    why there is none."""
    budget = problem.budgets[device]
    assert budget is not None
    graph = problem.graph
    everything = held_fixed_bytes(graph, range(len(graph)))
    largest = _largest_first(graph)
    values = paged_set(problem, device, budget)[2]
    started, limit = time.monotonic(), problem.solver.options.time_limit_s
    found: StrategyResult | None = None
    excess = 0
    hold = Hold.FREE
    for attempt in range(ATTEMPTS):
        left = limit - (time.monotonic() - started)
        if left <= 0 or problem.cancelled:
            return "no plan within the budget in time"
        if found is None:
            seconds = left / 2 if attempt < ATTEMPTS - 1 else left
            found = inner(_with_budget(problem, device, room + everything).within(seconds))
        if found.plan is None:
            return found.message
        plan = with_fixed_paging(found.plan, graph, problem, device, paged, hold)
        names = [d.name for d in plan.devices]
        plan = replace(plan, strategy=strategy, devices=problem.plan_devices(names))
        plan = issued_late(plan, simulate(plan, graph, problem.costs, {}))
        # Judged with its reads counted from their steps, as the executor counts them: at
        # every instant at least the memory counted from their starts.
        counted = simulate(plan, graph, problem.costs, {}, reserve_at_issue=True)
        if not counted.valid:
            return str(counted.violation)
        peak = counted.peak_bytes[device]
        if peak <= budget:
            simulation = simulate(plan, graph, problem.costs, problem.budgets)
            size = format_bytes(sum(graph.fixed[t].nbytes for t in paged))
            note = (
                f"{len(paged)} fixed tensors paged ({size}); activations planned by "
                f"{found.strategy} for {format_bytes(room + everything)} with them resident"
            )
            result = StrategyResult(strategy, with_prediction(plan, simulation), simulation, note)
            return _Fit(result, paged, room, hold_first)
        # Over by the window's underestimate: page more tensors for the same activations;
        # with every one paged, read one ahead at most; then plan the activations again in
        # less room; where too little is left for them, page serially.
        over = peak - budget + round(MARGIN * budget)
        excess += over
        if hold_first and hold is Hold.FREE:
            hold = Hold.ONE_AHEAD
        elif len(paged) < len(largest):
            more = len(paged_set(problem, device, budget - excess)[0])
            paged = frozenset(largest[: max(more, len(paged) + 1)])
        elif hold is Hold.FREE:
            hold = Hold.ONE_AHEAD
        elif room - over >= values:
            room -= over
            found = None
        elif hold is Hold.ONE_AHEAD:
            hold = Hold.SERIAL
        else:
            return (
                f"with all {len(paged)} fixed tensors paged serially, the plan needs "
                f"{format_bytes(peak)} and too little room is left for the activations"
            )
    return "no plan within the budget in the attempts made"
