"""The plan simulator: the single judge of a plan's validity and predicted cost.

It replays a plan step by step against a graph, a cost model and per-device budgets,
tracking which values are resident on which device.

Memory accounting. A device's memory after a step is its fixed memory plus the values
resident on it. Fixed memory is static for the whole step and follows one rule: a device
holds every fixed tensor (parameter or model input) read by a node it computes anywhere in
the plan, and in training also a gradient buffer of the same size for every fixed tensor
read by a backward node it computes, except the model inputs, which are data (weight
gradients; no input gradient, as in a PyTorch training step). This is Checkmate's
constant M_input + 2 M_param (eq. 2) on one device, split by placement on several.

Time. Compute, copy, free and wait steps run one after another on one compute lane. Each
device also has a transfer lane to its host memory (plan version 2), on which ``offload``
and ``prefetch`` run in plan order, one at a time, concurrently with the compute lane
(Beaumont et al., assumptions (B)-(E)): a transfer starts when the compute lane reaches it
and its lane is free. An offloaded tensor stays on the device, readable and counted, until
a ``wait`` for it, which holds the compute lane until the transfer has completed and then
releases it; a prefetched tensor's memory is reserved when its transfer starts, and it is
readable only after a ``wait`` for it. Every action thus happens as early as the plan's
order and its data allow: the no-wait schedule of Proposition 1 for the plan's transfers.
Paging (plan version 3) runs on a second lane per device, to the node's storage, by the
same rules: ``page_out`` as ``offload``, ``page_in`` as ``prefetch`` (PORT's M^out and
M^in), each tier's link its own (``CostModel.link``). A tensor has at most one transfer
in flight on a device, so that a ``wait`` names one. Predicted time is the compute lane's:
compute and copy times, plus the time it waits for transfers (``stall_ms``), plus any
transfer still running when it ends; a plan without transfers costs the sum of its compute
and copy times, as in version 1.

Transfers and compute may interfere: where a device's link has a ``compute_slowdown`` f
above 1 (``Link``; measured by the agent's profiler, e.g. a CPU whose transfer thread takes
cores or memory bandwidth from its compute), a compute step on it progresses at 1/f of its
rate while a transfer runs on that link, and takes longer by what it lost (``slowdown_ms``,
in the total). Steps of a concurrent plan's sections are not slowed.

Energy (``remat.energy``): each compute step's dynamic energy, ``LINK_W`` over copies and
transfers, and the machine's static power (every device's idle power and the board's) over
the predicted time.

Memory pools (option ``pool`` on the plan's devices: a CPU and an integrated GPU sharing one
memory, PORT-M): the devices of a pool hold one set of resident tensors and one fixed
memory (the rule above over every node they compute), counted once against the pool's
budget (each of its devices carries it as ``budget_bytes``); a tensor on the pool is
readable by all of them, so a copy between two of them is refused (it is already there).
Each of them reports the pool's memory as its own. The pool is the host's memory, so an
offload from one of its devices is refused too (it would free nothing); paging is not.

Concurrent plans (version 4, PORT-M's stages on devices sharing a pool): a run of
consecutive compute steps is one section. Each device runs its steps of the section in plan
order, each starting when its device is free and the inputs computed earlier in the section
have been (on any device); the section takes its longest chain, and any other step starts
after it. The agent runs a section's first device on its own thread and each other device
on a thread of the run, so where a section has several devices it pays the host's thread
hand-off (``CostModel.handoff_ms``): a step waiting for an input another device computed in
the section starts that much after it, and a device other than the first starts that much
after the section and ends that much before the section may. In a section on more than one
device each compute step takes its device's ``CostModel.concurrent_slowdown`` times its
time (devices that compute at once share cores, memory bandwidth and the agent's
interpreter lock), the time it loses in ``slowdown_ms``. A section only allocates, so
memory after each of its steps is memory in plan order, an upper bound of every instant;
while a step runs, the largest workspace of each other device of its pool in the section so
far counts beside its own.

Paged fixed tensors (plan version 5): a fixed tensor named by a ``fixed_in``,
``fixed_wait``, ``fixed_free``, ``grad_out`` or ``grad_wait`` step is left out of the fixed
memory above. It starts the plan in storage; ``fixed_in`` reads it on the device's paging
lane as a ``page_in`` does (reserved when the read starts, readable after its
``fixed_wait``), and ``fixed_free`` releases it at once (storage keeps its value). A node
that reads it needs it readable on its device. Its gradient buffer (where it has a
gradient) is allocated, zeroed, by the first computation of the first backward node that
writes it, and released by a ``grad_wait`` after a ``grad_out`` has written it to storage
(as a ``page_out``); a backward node that would write it after its ``grad_out`` is refused.
On a pool, the pool holds one copy of each and one buffer.

Memory is checked at every instant: after each step and when a transfer starts later
than the step that issued it. While a node computes, its device also holds the kernel's
workspace (``CostModel.workspace_bytes``: scratch memory beyond inputs and output, Beaumont
et al.'s ``ex_i``), released when the step ends: it counts in the peak and against the
budget, not in the memory after the step. Step kinds are dispatched through
``_HANDLERS``, so later kinds (paging) add a handler without touching the others.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from remat.costs import CostModel
from remat.devices import Tier, format_bytes
from remat.energy import LINK_W
from remat.graph import Graph, Mode, NodeKind
from remat.plan import (
    Compute,
    Copy,
    FixedFree,
    FixedIn,
    FixedStep,
    FixedWait,
    Free,
    GradOut,
    GradWait,
    Offload,
    PageIn,
    PageOut,
    Plan,
    Prefetch,
    Step,
    Wait,
)

Key = int | tuple[str, str]
"""What a lane moves: a node's value, or a paged fixed tensor (``("param", name)``) or its
gradient buffer (``("grad", name)``)."""


BEFORE_FIRST = -2
"""A ``Violation``'s step where the plan is refused before its first step is replayed."""


@dataclass(frozen=True)
class Violation:
    step: int  # index into plan.steps; -1 for a check after the last step; BEFORE_FIRST
    message: str
    over_budget: bool = False  # the plan is correct but needs more memory

    def __str__(self) -> str:
        if self.step == BEFORE_FIRST:
            return self.message
        where = "after the last step" if self.step < 0 else f"step {self.step}"
        return f"{where}: {self.message}"


@dataclass(frozen=True)
class Simulation:
    violation: Violation | None
    total_ms: float
    compute_ms: float
    copy_ms: float
    fixed_bytes: dict[str, int]
    peak_bytes: dict[str, int]
    # bytes resident on each device after each step, or while it ran where more: a compute
    # step's workspace on its device (so that the timeline's largest value is the peak)
    timeline: dict[str, list[int]]
    computes: int = 0
    transfer_ms: float = 0.0  # the transfer lanes' busy time (overlapped with compute)
    stall_ms: float = 0.0  # the compute lane's waits for transfers, in ``total_ms``
    energy_mj: float = 0.0
    slowdown_ms: float = 0.0  # compute time lost to transfers beside it, in ``total_ms``
    # the compute lane's time when each step is issued, and when each transfer step's
    # transfer starts on its lane (step index -> ms)
    clock_ms: list[float] = field(default_factory=list)
    transfer_start_ms: dict[int, float] = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return self.violation is None


class _PlanInvalid(Exception):
    pass


@dataclass
class _Lane:
    """A device's transfer lane to a tier: when it is next free, the tensors in flight
    (node -> the time their transfer completes) and the tensors held on the tier."""

    free_at: float = 0.0
    leaving: dict[Key, float] = field(default_factory=dict)  # sent, not yet released
    arriving: dict[Key, float] = field(default_factory=dict)  # brought back, not yet waited
    held: set[int] = field(default_factory=set)


@dataclass
class _Section:
    """A concurrent plan's run of compute steps under way: times from its start. Its first
    device runs on the thread that reached it; another device's thread starts ``handoff``
    later, signals its end ``handoff`` before the section may end, and a step that waits
    for an input another device computed in the section starts ``handoff`` after it
    (``CostModel.handoff_ms``)."""

    start: float
    handoff: float = 0.0
    first: int | None = None  # the device of its first step
    free_at: dict[int, float] = field(default_factory=dict)  # device -> when next free
    ends: dict[int, tuple[float, int]] = field(default_factory=dict)  # node -> (when, device)
    workspace: dict[int, int] = field(default_factory=dict)  # device -> largest so far
    span: float = 0.0

    def run(self, node: int, d: int, deps: Iterable[int], duration: float) -> float:
        """Schedule ``node`` on ``d``; return how much the section lengthens."""
        if self.first is None:
            self.first = d
        other = 0.0 if d == self.first else self.handoff
        begin = self.free_at.get(d, other)
        for u in deps:
            if (found := self.ends.get(u)) is not None:
                ready, on = found
                begin = max(begin, ready + (self.handoff if on != d else 0.0))
        end = self.free_at[d] = begin + duration
        self.ends[node] = (end, d)
        span, self.span = self.span, max(self.span, end + other)
        return self.span - span


@dataclass
class _State:
    graph: Graph
    costs: CostModel
    device_index: dict[str, int]
    resident: list[set[int]]  # counted on the device (readable, leaving or arriving); one
    # set shared by the devices of a pool
    memory: list[int]  # per device, the memory of its pool: index with ``space``
    lanes: dict[Tier, list[_Lane]]  # per tier, per device
    computed: set[int] = field(default_factory=set)
    compute_ms: float = 0.0
    copy_ms: float = 0.0
    transfer_ms: float = 0.0
    stall_ms: float = 0.0
    clock: float = 0.0  # the compute lane's time
    computes: int = 0
    dynamic_mj: float = 0.0  # the compute steps' energy above idle
    scratch: tuple[int, int] | None = None  # (device, workspace bytes) during this step
    step: int = 0  # the index of the step being replayed
    # Allocations of transfers that start after the step that issued them:
    # (time, order, device, bytes, step index).
    pending: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    link_ms: dict[tuple[Tier, str, int], np.ndarray] = field(default_factory=dict)
    q_mj: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    space: list[int] = field(default_factory=list)  # device -> the first device of its pool
    # device -> the lanes' tensors in flight (arriving; leaving or arriving) of its pool
    incoming: list[list[dict[Key, float]]] = field(default_factory=list)
    moving: list[list[dict[Key, float]]] = field(default_factory=list)
    in_transit: int = 0  # transfers in flight on every lane
    concurrent: bool = False  # the plan's sections of compute steps run at once
    section: _Section | None = None  # the section under way, in a concurrent plan
    overlap_ms: float = 0.0  # compute time the sections' overlap saves, less their hand-offs
    # per step: a compute step of a concurrent plan's section where more than one device
    # computes (``CostModel.concurrent_slowdown`` applies)
    shared: list[bool] = field(default_factory=list)
    # per device: its transfers (start, end, compute slowdown) on links that slow its compute
    busy: list[list[tuple[float, float, float]]] = field(default_factory=list)
    slowdown_ms: float = 0.0  # compute time lost to them
    slowdowns: dict[tuple[Tier, int], float] = field(default_factory=dict)  # per lane
    # Paged fixed tensors (version 5): their names; per device, those resident and the
    # gradient buffers allocated on its pool (one set shared by a pool's devices); the
    # (pool, tensor) gradients written out; the backward nodes whose gradients are in.
    paged: frozenset[str] = frozenset()
    # device -> why offloading to its host frees none of its memory (a device of a pool)
    offload_refusals: dict[int, str] = field(default_factory=dict)
    at_issue: bool = False  # reserve a transfer's memory at its step (``simulate``)
    starts: dict[int, float] = field(default_factory=dict)  # step -> its transfer's start
    params: list[set[str]] = field(default_factory=list)
    grads: list[set[str]] = field(default_factory=list)
    stored: set[tuple[int, str]] = field(default_factory=set)
    accumulated: set[int] = field(default_factory=set)

    def device(self, name: str) -> int:
        index = self.device_index.get(name)
        if index is None:
            raise _PlanInvalid(f"unknown device {name!r}")
        return index

    def node_name(self, node: int) -> str:
        if not 0 <= node < len(self.graph):
            raise _PlanInvalid(f"unknown node {node}")
        return f"{node} ({self.graph.nodes[node].name})"

    def allocate(self, node: int, d: int) -> None:
        self.resident[d].add(node)
        self.memory[self.space[d]] += int(self.costs.output_bytes[node])

    def release(self, node: int, d: int) -> None:
        self.resident[d].discard(node)
        self.memory[self.space[d]] -= int(self.costs.output_bytes[node])

    def readable(self, node: int, d: int, what: str) -> None:
        """Raise unless ``node`` can be read on ``d``: resident, and not arriving. ``what``
        starts the message."""
        if node not in self.resident[d]:
            raise _PlanInvalid(f"{what} {self.node_name(node)} is not resident there")
        for tier, lanes in self.lanes.items():
            pool = (lane for e, lane in enumerate(lanes) if self.space[e] == self.space[d])
            if any(node in lane.arriving for lane in pool):
                op = "prefetch" if tier is Tier.HOST else "page_in"
                raise _PlanInvalid(
                    f"{what} {self.node_name(node)} is read before its {op} completes "
                    "(no wait for it)"
                )

    def arriving(self, key: Key, d: int) -> bool:
        """``key`` is coming back on a lane of ``d``'s pool."""
        return self.in_transit > 0 and any(key in arriving for arriving in self.incoming[d])

    def in_flight(self, key: Key, d: int) -> bool:
        """A transfer of ``key`` is in flight on a lane of ``d``'s pool."""
        return self.in_transit > 0 and any(key in moving for moving in self.moving[d])

    def tensor(self, step: FixedStep) -> int:
        """The bytes of the paged fixed tensor ``step`` names."""
        fixed = self.graph.fixed.get(step.tensor)
        if fixed is None:
            raise _PlanInvalid(f"{step.op} of {step.tensor!r}: not a fixed tensor of the graph")
        return fixed.nbytes

    def reserve(self, d: int, nbytes: int, start: float) -> None:
        """Count ``nbytes`` on ``d``'s pool from ``start`` (now, or when a transfer starts
        later than the step that issued it: assumption (E))."""
        if start <= self.clock or self.at_issue:
            self.memory[self.space[d]] += nbytes
        else:
            heapq.heappush(self.pending, (start, len(self.pending), d, nbytes, self.step))

    def transfer_ms_of(self, tier: Tier, direction: str, d: int, node: int) -> float:
        key = (tier, direction, d)
        if key not in self.link_ms:
            self.link_ms[key] = (
                self.costs.out_ms(d, tier) if direction == "out" else self.costs.in_ms(d, tier)
            )
        return float(self.link_ms[key][node])

    def start_transfer(self, tier: Tier, d: int, duration: float) -> tuple[float, float]:
        """Queue a transfer of ``duration`` ms on ``d``'s lane to ``tier``: its start and its
        end."""
        lane = self.lanes[tier][d]
        start = self.starts[self.step] = max(self.clock, lane.free_at)
        lane.free_at = start + duration
        self.transfer_ms += duration
        slowdown = self.slowdowns.get((tier, d))
        if slowdown is None:
            slowdown = self.slowdowns[tier, d] = self.costs.link(d, tier).compute_slowdown
        if slowdown > 1.0:
            self.busy[d].append((start, lane.free_at, slowdown))
        return start, lane.free_at

    def compute_time(self, d: int, duration: float) -> float:
        """How long ``duration`` ms of compute on ``d`` takes from the clock, progressing
        at 1/f of its rate while a transfer with compute slowdown f runs on its links (the
        largest f where several do)."""
        spans = self.busy[d] = [span for span in self.busy[d] if span[1] > self.clock]
        t, work = self.clock, duration
        for point in sorted({p for span in spans for p in span[:2] if p > t}):
            factor = max((f for start, end, f in spans if start <= t < end), default=1.0)
            if (point - t) / factor >= work:
                return t + work * factor - self.clock
            work -= (point - t) / factor
            t = point
        return t + work - self.clock

    def wait_until(self, t: float) -> None:
        if t > self.clock:
            self.stall_ms += t - self.clock
            self.clock = t


def _compute(state: _State, step: Compute) -> None:
    name = state.node_name(step.node)
    d = state.device(step.device)
    if step.node in state.resident[d]:
        raise _PlanInvalid(f"node {name} is already resident on {step.device}")
    resident = state.resident[d]
    incoming = [a for a in state.incoming[d] if a] if state.in_transit else []
    node = state.graph.nodes[step.node]
    for dep in node.deps:
        if dep not in resident or (incoming and any(dep in a for a in incoming)):
            state.readable(dep, d, f"compute {name} on {step.device}: dependency")
    if state.paged and not state.paged.isdisjoint(node.fixed):
        _paged_fixed(state, step, name, d)
    state.allocate(step.node, d)
    state.computed.add(step.node)
    workspace = state.costs.workspace(step.node, d)
    duration = float(state.costs.compute_ms[step.node, d])
    state.dynamic_mj += float(state.q_mj[step.node, d])
    state.compute_ms += duration
    state.computes += 1
    if not state.concurrent:
        taken = state.compute_time(d, duration) if state.busy[d] else duration
        state.slowdown_ms += taken - duration
        state.clock += taken
        if workspace:
            state.scratch = (d, workspace)
        return
    section = state.section = state.section or _Section(state.clock, state.costs.handoff_ms)
    slowed = duration
    if state.shared[state.step] and state.costs.concurrent_slowdown:
        slowed = duration * state.costs.concurrent_slowdown[d]
        state.slowdown_ms += slowed - duration
    longer = section.run(step.node, d, state.graph.nodes[step.node].deps, slowed)
    state.clock += longer
    state.overlap_ms += slowed - longer
    section.workspace[d] = max(section.workspace.get(d, 0), workspace)
    beside = sum(
        w for e, w in section.workspace.items() if e != d and state.space[e] == state.space[d]
    )
    if workspace or beside:
        state.scratch = (d, workspace + beside)


def _shared_sections(plan: Plan) -> list[bool]:
    """Per step of a concurrent plan: whether it is a compute step of a section on more
    than one device."""
    shared = [False] * len(plan.steps)
    start = 0
    for end in range(len(plan.steps) + 1):
        if end < len(plan.steps) and isinstance(plan.steps[end], Compute):
            continue
        section = [s for s in plan.steps[start:end] if isinstance(s, Compute)]
        if len({s.device for s in section}) > 1:
            shared[start:end] = [True] * len(section)
        start = end + 1
    return shared


def _copy(state: _State, step: Copy) -> None:
    name = state.node_name(step.node)
    src, dst = state.device(step.src), state.device(step.dst)
    if src == dst:
        raise _PlanInvalid(f"copy of {name} from {step.src} to itself")
    if step.node not in state.resident[src]:
        raise _PlanInvalid(f"copy of {name}: not resident on {step.src}")
    state.readable(step.node, src, f"copy from {step.src}:")
    if state.space[src] == state.space[dst]:
        raise _PlanInvalid(
            f"copy of {name} from {step.src} to {step.dst}: they share one memory pool, "
            "where it is already"
        )
    if step.node in state.resident[dst]:
        raise _PlanInvalid(f"copy of {name}: already resident on {step.dst}")
    state.allocate(step.node, dst)
    duration = float(state.costs.copy_ms[step.node, src, dst])
    state.copy_ms += duration
    state.clock += duration


def _free(state: _State, step: Free) -> None:
    name = state.node_name(step.node)
    d = state.device(step.device)
    if step.node not in state.resident[d]:
        raise _PlanInvalid(f"free of {name} on {step.device}: not resident (double free)")
    if state.in_flight(step.node, d):
        raise _PlanInvalid(
            f"free of {name} on {step.device}: its transfer is in flight (a wait ends it)"
        )
    state.release(step.node, d)


_TO = {Tier.HOST: "its host", Tier.STORAGE: "storage"}


def _send(state: _State, step: Offload | PageOut) -> None:
    """An offload or a page-out: the tensor leaves on its tier's lane."""
    name = state.node_name(step.node)
    d = state.device(step.device)
    if step.tier is Tier.HOST and (refusal := state.offload_refusals.get(d)) is not None:
        raise _PlanInvalid(f"offload of {name}: {refusal}")
    state.readable(step.node, d, f"{step.op} from {step.device}:")
    if state.in_flight(step.node, d):
        raise _PlanInvalid(f"{step.op} of {name} from {step.device}: a transfer of it is in flight")
    lane = state.lanes[step.tier][d]
    duration = state.transfer_ms_of(step.tier, "out", d, step.node)
    _, end = state.start_transfer(step.tier, d, duration)
    lane.leaving[step.node] = end
    state.in_transit += 1
    lane.held.add(step.node)


def _bring(state: _State, step: Prefetch | PageIn) -> None:
    """A prefetch or a page-in: the tensor comes back on its tier's lane, its memory
    reserved when the transfer starts."""
    name = state.node_name(step.node)
    d = state.device(step.device)
    lane = state.lanes[step.tier][d]
    sent = "offload" if step.tier is Tier.HOST else "page_out"
    if step.node not in lane.held:
        raise _PlanInvalid(
            f"{step.op} of {name} to {step.device}: not on {_TO[step.tier]} (no {sent} before it)"
        )
    if step.node in state.resident[d]:
        raise _PlanInvalid(
            f"{step.op} of {name} to {step.device}: still resident there (a wait for its "
            f"{sent} releases it)"
        )
    duration = state.transfer_ms_of(step.tier, "in", d, step.node)
    start, end = state.start_transfer(step.tier, d, duration)
    lane.arriving[step.node] = end
    state.in_transit += 1
    state.resident[d].add(step.node)
    state.reserve(d, int(state.costs.output_bytes[step.node]), start)


def _wait(state: _State, step: Wait) -> None:
    name = state.node_name(step.node)
    d = state.device(step.device)
    for lanes in state.lanes.values():
        lane = lanes[d]
        if step.node in lane.leaving:
            state.wait_until(lane.leaving.pop(step.node))
            state.release(step.node, d)
            state.in_transit -= 1
            return
        if step.node in lane.arriving:
            state.wait_until(lane.arriving.pop(step.node))
            state.in_transit -= 1
            return
    raise _PlanInvalid(f"wait for {name} on {step.device}: no transfer of it is in flight")


def _paged_fixed(state: _State, step: Compute, name: str, d: int) -> None:
    """A compute step's paged fixed tensors: each readable on ``d``'s pool; the first
    computation of a backward node allocates the gradient buffers it writes first."""
    node = state.graph.nodes[step.node]
    space = state.space[d]
    for t in node.fixed:
        if t not in state.paged:
            continue
        if t not in state.params[d] or state.arriving(("param", t), d):
            raise _PlanInvalid(
                f"compute {name} on {step.device}: fixed tensor {t!r} is not readable there "
                "(no fixed_in, or no fixed_wait for it)"
            )
    if node.kind is not NodeKind.BACKWARD or step.node in state.accumulated:
        return
    state.accumulated.add(step.node)
    for t in node.fixed:
        fixed = state.graph.fixed[t]
        if t not in state.paged or not fixed.has_gradient or t in state.grads[d]:
            continue
        if (space, t) in state.stored:
            raise _PlanInvalid(
                f"compute {name} on {step.device}: writes the gradient of {t!r} after its grad_out"
            )
        state.grads[d].add(t)
        state.memory[space] += fixed.nbytes


def _fixed_in(state: _State, step: FixedIn) -> None:
    nbytes = state.tensor(step)
    d = state.device(step.device)
    key = ("param", step.tensor)
    if step.tensor in state.params[d]:
        raise _PlanInvalid(f"fixed_in of {step.tensor!r} to {step.device}: already resident there")
    link = state.costs.link(d, Tier.STORAGE)
    start, end = state.start_transfer(Tier.STORAGE, d, float(link.in_ms(nbytes)))
    state.lanes[Tier.STORAGE][d].arriving[key] = end
    state.in_transit += 1
    state.params[d].add(step.tensor)
    state.reserve(d, nbytes, start)


def _fixed_wait(state: _State, step: FixedWait) -> None:
    state.tensor(step)
    d = state.device(step.device)
    arriving = state.lanes[Tier.STORAGE][d].arriving
    end = arriving.pop(("param", step.tensor), None)
    if end is None:
        raise _PlanInvalid(
            f"fixed_wait for {step.tensor!r} on {step.device}: no fixed_in of it is in flight"
        )
    state.wait_until(end)
    state.in_transit -= 1


def _fixed_free(state: _State, step: FixedFree) -> None:
    nbytes = state.tensor(step)
    d = state.device(step.device)
    if step.tensor not in state.params[d]:
        raise _PlanInvalid(f"fixed_free of {step.tensor!r} on {step.device}: not resident there")
    if state.arriving(("param", step.tensor), d):
        raise _PlanInvalid(
            f"fixed_free of {step.tensor!r} on {step.device}: its fixed_in is in flight "
            "(a fixed_wait ends it)"
        )
    state.params[d].discard(step.tensor)
    state.memory[state.space[d]] -= nbytes


def _grad_out(state: _State, step: GradOut) -> None:
    nbytes = state.tensor(step)
    d = state.device(step.device)
    if step.tensor not in state.grads[d]:
        raise _PlanInvalid(
            f"grad_out of {step.tensor!r} from {step.device}: no gradient buffer of it there "
            "(not paged, not yet written, or already written out)"
        )
    if state.in_flight(("grad", step.tensor), d):
        raise _PlanInvalid(f"grad_out of {step.tensor!r} from {step.device}: already in flight")
    link = state.costs.link(d, Tier.STORAGE)
    _, end = state.start_transfer(Tier.STORAGE, d, float(link.out_ms(nbytes)))
    state.lanes[Tier.STORAGE][d].leaving[("grad", step.tensor)] = end
    state.in_transit += 1
    state.stored.add((state.space[d], step.tensor))


def _grad_wait(state: _State, step: GradWait) -> None:
    nbytes = state.tensor(step)
    d = state.device(step.device)
    end = state.lanes[Tier.STORAGE][d].leaving.pop(("grad", step.tensor), None)
    if end is None:
        raise _PlanInvalid(
            f"grad_wait for {step.tensor!r} on {step.device}: no grad_out of it is in flight"
        )
    state.wait_until(end)
    state.in_transit -= 1
    state.grads[d].discard(step.tensor)
    state.memory[state.space[d]] -= nbytes


_HANDLERS: dict[str, Callable[[_State, Step], None]] = {
    "compute": _compute,  # type: ignore[dict-item]
    "copy": _copy,  # type: ignore[dict-item]
    "free": _free,  # type: ignore[dict-item]
    "offload": _send,  # type: ignore[dict-item]
    "prefetch": _bring,  # type: ignore[dict-item]
    "page_out": _send,  # type: ignore[dict-item]
    "page_in": _bring,  # type: ignore[dict-item]
    "wait": _wait,  # type: ignore[dict-item]
    "fixed_in": _fixed_in,  # type: ignore[dict-item]
    "fixed_wait": _fixed_wait,  # type: ignore[dict-item]
    "fixed_free": _fixed_free,  # type: ignore[dict-item]
    "grad_out": _grad_out,  # type: ignore[dict-item]
    "grad_wait": _grad_wait,  # type: ignore[dict-item]
}


def held_fixed_bytes(
    graph: Graph, nodes: Iterable[int], paged: frozenset[str] = frozenset()
) -> int:
    """Fixed memory of a device that computes ``nodes``: the rule in the module docstring,
    without the ``paged`` tensors."""
    held: set[str] = set()
    gradients: set[str] = set()
    training = graph.mode is Mode.TRAINING
    for index in nodes:
        node = graph.nodes[index]
        held.update(node.fixed)
        if training and node.kind is NodeKind.BACKWARD:
            gradients.update(t for t in node.fixed if graph.fixed[t].has_gradient)
    held -= paged
    gradients -= paged
    return sum(graph.fixed[t].nbytes for t in held) + sum(graph.fixed[t].nbytes for t in gradients)


def memory_spaces(plan: Plan) -> dict[str, str]:
    """Each device of ``plan`` -> where its memory is counted: its pool, else itself."""
    return {d.name: d.memory_space for d in plan.devices}


def fixed_bytes(graph: Graph, plan: Plan) -> dict[str, int]:
    """Fixed memory per device of a plan, its pool's where it shares one (steps naming
    unknown nodes are skipped here and reported by the replay)."""
    spaces = memory_spaces(plan)
    computed: dict[str, set[int]] = {space: set() for space in spaces.values()}
    for step in plan.steps:
        if isinstance(step, Compute) and step.device in spaces and 0 <= step.node < len(graph):
            computed[spaces[step.device]].add(step.node)
    paged = plan.paged_fixed
    held = {space: held_fixed_bytes(graph, nodes, paged) for space, nodes in computed.items()}
    return {name: held[space] for name, space in spaces.items()}


def simulate(
    plan: Plan,
    graph: Graph,
    costs: CostModel,
    budgets: Mapping[str, int | None] | None = None,
    reserve_at_issue: bool = False,
) -> Simulation:
    """Replay ``plan``; return its predicted cost and memory, or its first violation.

    ``budgets`` default to the plan's own ``budget_bytes``; None means unlimited.
    ``reserve_at_issue``: a prefetch's, page-in's or fixed_in's memory counts from its step
    rather than from when its transfer starts, as the agent's executor accounts it (an
    upper bound of the memory of every instant)."""
    if plan.graph is not None and plan.graph != graph.fingerprint:
        other = Violation(
            BEFORE_FIRST,
            f"the plan was made for another graph ({plan.graph}; this one: "
            f"{graph.fingerprint}): another model, other ingestion options (attention "
            "fused or not), or a version of remat that builds the model's graph otherwise",
        )
        return Simulation(other, 0.0, 0.0, 0.0, {}, {}, {})
    budgets = dict(plan.budgets if budgets is None else budgets)
    names = [d.name for d in plan.devices]
    fixed = fixed_bytes(graph, plan)
    where = {name: costs.device_index(name) for name in names}
    first: dict[str, int] = {}
    space = list(range(len(costs.devices)))
    for name, pool in memory_spaces(plan).items():
        space[where[name]] = first.setdefault(pool, where[name])
    members = [[e for e in range(len(space)) if space[e] == space[d]] for d in range(len(space))]
    shared: dict[int, set[int]] = {}
    state = _State(
        graph,
        costs,
        where,
        [shared.setdefault(space[d], set()) for d in range(len(costs.devices))],
        [0] * len(costs.devices),
        {tier: [_Lane() for _ in costs.devices] for tier in Tier},
        space=space,
        concurrent=plan.concurrent,
        shared=_shared_sections(plan) if plan.concurrent else [],
        busy=[[] for _ in costs.devices],
        paged=plan.paged_fixed,
        offload_refusals={
            where[d.name]: why for d in plan.devices if (why := d.host_offload_refusal())
        },
        at_issue=reserve_at_issue,
    )
    params: dict[int, set[str]] = {}
    grads: dict[int, set[str]] = {}
    state.params = [params.setdefault(space[d], set()) for d in range(len(space))]
    state.grads = [grads.setdefault(space[d], set()) for d in range(len(space))]
    for d in range(len(space)):
        lanes = [state.lanes[tier][e] for tier in Tier for e in members[d]]
        state.incoming.append([lane.arriving for lane in lanes])
        state.moving.append([m for lane in lanes for m in (lane.leaving, lane.arriving)])
    energy = costs.energy_model()
    state.q_mj = energy.q_mj
    for name in names:
        state.memory[space[where[name]]] = fixed[name]
    timeline: dict[str, list[int]] = {name: [] for name in names}
    clocks: list[float] = []
    peaks = dict(fixed)

    placed = [(name, space[where[name]]) for name in names]

    running: dict[str, int] = {}  # this step's bytes with its workspace, where it has one

    def measure(step: int) -> Violation | None:
        used = {name: state.memory[s] for name, s in placed}
        if state.scratch is not None:  # the workspace of the node this step computes
            d, workspace = state.scratch
            state.scratch = None
            for name, s in placed:
                if s == space[d]:
                    used[name] += workspace
            running.update(used)
        for name, value in used.items():
            if value > peaks[name]:
                peaks[name] = value
        return _over_budget(used, budgets, step, None)

    def start_pending(until: float) -> Violation | None:
        """Reserve the memory of the transfers that have started by ``until``."""
        while state.pending and state.pending[0][0] <= until:
            _, _, d, nbytes, step = heapq.heappop(state.pending)
            state.memory[space[d]] += nbytes
            if (found := measure(step)) is not None:
                return found
        return None

    violation = _over_budget(fixed, budgets, -1, "fixed memory (parameters, inputs)")
    for index, step in enumerate(plan.steps if violation is None else ()):
        state.step = index
        clocks.append(state.clock)
        if step.op != "compute":
            state.section = None  # the section's computes have ended
        try:
            handler = _HANDLERS.get(step.op)
            if handler is None:
                raise _PlanInvalid(f"unknown step kind {step.op!r}")
            handler(state, step)
        except _PlanInvalid as exc:
            violation = Violation(index, str(exc))
            break
        violation = measure(index)
        if violation is None and state.pending:
            violation = start_pending(state.clock)
        for name, s in placed:
            timeline[name].append(max(state.memory[s], running.get(name, 0)))
        running.clear()
        if violation is not None:
            break
    if violation is None:
        violation = start_pending(float("inf"))
    if violation is None:
        violation = _final_check(state, graph)
    ends = [lane.free_at for lanes in state.lanes.values() for lane in lanes]
    tail = max(ends, default=0.0) - state.clock
    total = state.compute_ms + state.copy_ms + state.slowdown_ms - state.overlap_ms
    if state.stall_ms or tail > 0:  # a plan without transfers costs its steps' sum, exactly
        total += state.stall_ms + max(tail, 0.0)
    link_mj = LINK_W * (state.copy_ms + state.transfer_ms)
    energy_mj = state.dynamic_mj + link_mj + energy.static_w * total
    return Simulation(
        violation,
        total,
        state.compute_ms,
        state.copy_ms,
        fixed,
        peaks,
        timeline,
        state.computes,
        state.transfer_ms,
        state.stall_ms,
        energy_mj,
        state.slowdown_ms,
        clocks,
        state.starts,
    )


def _over_budget(
    used: Mapping[str, int], budgets: Mapping[str, int | None], step: int, what: str | None
) -> Violation | None:
    for name, value in used.items():
        budget = budgets.get(name)
        if budget is not None and value > budget:
            label = f"{what} on {name}" if what else f"memory on {name}"
            return Violation(
                step,
                f"{label} is {format_bytes(value)} ({value} B), over the budget of "
                f"{format_bytes(budget)} ({budget} B)",
                over_budget=True,
            )
    return None


def _final_check(state: _State, graph: Graph) -> Violation | None:
    for node in graph.nodes:
        if node.id not in state.computed:
            return Violation(-1, f"node {state.node_name(node.id)} is never computed")
    for output in graph.outputs:
        if not any(
            output in resident and not state.arriving(output, d)
            for d, resident in enumerate(state.resident)
        ):
            return Violation(
                -1, f"output {state.node_name(output)} is not resident when the plan ends"
            )
    return None
