"""Decomposition of large graphs: segments of the forward pass, each solved by the exact
strategy on its own, stitched into one plan (docs/architecture.md, section "Block
decomposition"; as Rockmate and Chen's segments do). The whole model of a graph with
thousands of nodes has millions of variables; its parts have a few thousand.

The forward nodes are cut into K segments (``segments``) where few bytes cross the cut.
The parts, in plan order, are (``parts``):

- F_1 .. F_{K-1}: segment j's forward nodes, computed once; they leave resident what later
  parts read (checkpoints);
- B_K: the last segment's forward nodes, the loss and their backward nodes;
- B_{K-1} .. B_1: segment k's forward nodes recomputed from the checkpoints, then its
  backward nodes (a part whose segment has no backward node is left out).

In inference the parts are F_1 .. F_K. The exact search decomposes on one device
(``search._decomposed``): a part's plan reserves every fixed tensor, so over several
devices the parts would cost more than one device's. Each part is a graph of its own
(``Part``):

- a value it reads from another part is a *held* fixed tensor (``FixedKind.HELD``),
  resident for the whole part;
- a value a later part reads is one of its outputs: resident from its computation on;
- parameters, inputs and their gradient buffers are reserved for the whole plan, and
  values carried past the part (read later, not by it) are reserved too: both come off
  its budget.

So every part's plan fits its budget in the whole plan too; the simulator still judges the
stitched plan. The price: segments 1..K-1 run forward twice (as in Chen's segments). The
bound stays the whole problem's (the covers'): a part's bound is not a bound of the whole.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from remat.costs import CostModel
from remat.graph import FixedKind, FixedTensor, Graph, Mode, Node, NodeKind
from remat.plan import Compute, Free, NodeStep, Plan, Step
from remat.simulator import held_fixed_bytes
from remat.strategies.common.problem import Problem, StrategyResult, evaluate_plan, select_best
from remat.strategies.config import DEFAULT_SEARCH, SearchConfig


def is_large(graph: Graph, config: SearchConfig = DEFAULT_SEARCH) -> bool:
    """Large enough to decompose (``SearchConfig.decompose_min_nodes``): the whole model is
    not built."""
    return len(graph) > config.decompose_min_nodes


@dataclass(frozen=True)
class Part:
    """A part of the graph in plan order: ``nodes`` (indices of the whole graph, ascending,
    so local index order is topological), ``held`` (values of earlier parts it reads),
    ``needed_after`` (values computed so far that later parts, or the plan's end, read:
    resident when the part ends) and ``outputs`` (its own values among them)."""

    nodes: tuple[int, ...]
    held: tuple[int, ...]
    needed_after: frozenset[int]

    @property
    def outputs(self) -> tuple[int, ...]:
        return tuple(i for i in self.nodes if i in self.needed_after)

    def graph(self, whole: Graph, costs: CostModel) -> Graph:
        local = {g: i for i, g in enumerate(self.nodes)}
        held = [
            FixedTensor(held_name(v), FixedKind.HELD, int(costs.output_bytes[v])) for v in self.held
        ]
        nodes = tuple(_local_node(whole.nodes[g], i, local) for i, g in enumerate(self.nodes))
        outputs = tuple(local[o] for o in self.outputs)
        return Graph(whole.mode, nodes, {t.name: t for t in held}, outputs)

    def costs(self, costs: CostModel) -> CostModel:
        index = list(self.nodes)
        return costs.grouped([[i] for i in index], costs.output_bytes[index], costs.copy_ms[index])


def held_name(value: int) -> str:
    return f"@{value}"


def _local_node(node: Node, index: int, local: dict[int, int]) -> Node:
    """The node in its part: dependencies inside the part renumbered, those outside read as
    held tensors; parameters and inputs dropped (reserved outside the part's budget)."""
    inside = tuple(local[d] for d in node.deps if d in local)
    held = tuple(held_name(d) for d in node.deps if d not in local)
    forward = local.get(node.forward) if node.forward is not None else None
    return replace(node, id=index, deps=inside, fixed=held, forward=forward)


# --- segments and parts ------------------------------------------------------------------


def _position(graph: Graph) -> list[int]:
    """Where each node belongs on the forward axis: a forward node at itself, a backward
    node at its forward node, the loss after the last forward node."""
    forward = _forward_count(graph)
    return [
        n.id if n.kind is NodeKind.FORWARD else (n.forward if n.forward is not None else forward)
        for n in graph.nodes
    ]


def crossing_bytes(graph: Graph, costs: CostModel) -> np.ndarray:
    """crossing[c]: bytes of the values that a cut before forward node c separates from a
    reader (activations read after the cut, gradients read before it)."""
    position = _position(graph)
    forward = _forward_count(graph)
    delta = np.zeros(forward + 2, dtype=np.int64)
    for node, readers in zip(graph.nodes, graph.users(), strict=True):
        span = [position[node.id], *(position[u] for u in readers)]
        low, high = min(span), max(span)
        if high > low:  # the cuts before low+1 .. high separate it from a reader
            delta[low + 1] += int(costs.output_bytes[node.id])
            delta[high + 1] -= int(costs.output_bytes[node.id])
    return np.cumsum(delta)[: forward + 1]


def _forward_count(graph: Graph) -> int:
    return sum(1 for n in graph.nodes if n.kind is NodeKind.FORWARD)


def segments(
    graph: Graph, costs: CostModel, size: int = DEFAULT_SEARCH.segment_forward_nodes
) -> list[range]:
    """Forward index ranges of at most ``size`` nodes, each cut (after at least half of
    ``size``) where the fewest bytes cross."""
    forward = _forward_count(graph)
    crossing = crossing_bytes(graph, costs)
    result: list[range] = []
    start = 0
    while forward - start > size:
        window = range(start + max(size // 2, 1), start + size + 1)
        cut = min(window, key=lambda c: (int(crossing[c]), -c))
        result.append(range(start, cut))
        start = cut
    result.append(range(start, forward))
    return result


def parts(graph: Graph, cuts: Sequence[range], stored: frozenset[int] = frozenset()) -> list[Part]:
    """The parts in plan order (see the module docstring), with what each reads from
    earlier parts and leaves for later ones. ``stored`` forward values are kept from their
    F part for their B part, which recomputes only the forward nodes its backward needs."""
    segment_of = np.full(_forward_count(graph) + 1, len(cuts) - 1)  # the loss: the last
    for k, cut in enumerate(cuts):
        segment_of[cut.start : cut.stop] = k
    segment = [int(segment_of[p]) for p in _position(graph)]
    return _with_boundaries(graph, _node_sets(graph, segment, len(cuts), stored))


def _node_sets(graph: Graph, segment: list[int], K: int, stored: frozenset[int]) -> list[list[int]]:
    members: list[list[int]] = [[] for _ in range(K)]
    for node in graph.nodes:
        members[segment[node.id]].append(node.id)
    forward = [[i for i in m if graph.nodes[i].kind is NodeKind.FORWARD] for m in members]
    if graph.mode is Mode.INFERENCE:
        return forward
    backward = [
        m if k == K - 1 else _recomputed(graph, m, stored)
        for k, m in enumerate(members)
        if k == K - 1 or _has_backward(graph, m)
    ]
    return forward[: K - 1] + backward[::-1]


def _recomputed(graph: Graph, members: list[int], stored: frozenset[int]) -> list[int]:
    """A segment's backward nodes and the forward nodes they need recomputed: those not
    stored that they read, directly or through other such nodes."""
    inside = set(members)
    chosen = {i for i in members if graph.nodes[i].kind is not NodeKind.FORWARD}
    for i in sorted(members, reverse=True):  # readers before what they read
        if i in chosen:
            chosen.update(d for d in graph.nodes[i].deps if d in inside and d not in stored)
    return sorted(chosen)


def _has_backward(graph: Graph, nodes: list[int]) -> bool:
    return any(graph.nodes[i].kind is NodeKind.BACKWARD for i in nodes)


def _with_boundaries(graph: Graph, node_sets: list[list[int]]) -> list[Part]:
    reads = [
        sorted({d for i in nodes for d in graph.nodes[i].deps} - set(nodes)) for nodes in node_sets
    ]
    read_later: list[set[int]] = []
    later: set[int] = set(graph.outputs)
    for held in reversed(reads):
        read_later.append(set(later))
        later |= set(held)
    read_later.reverse()
    result: list[Part] = []
    produced: set[int] = set()
    for nodes, held, after in zip(node_sets, reads, read_later, strict=True):
        produced |= set(nodes)
        result.append(Part(tuple(nodes), tuple(held), frozenset(after & produced)))
    return result


# --- solving the parts and stitching their plans -----------------------------------------


@dataclass(frozen=True)
class PartSolvers:
    """How a part is solved: ``exact``, the strategy itself for the part's share of the time
    limit; ``quick``, a plan without a solve (a baseline, a heuristic) once that share is
    under ``SearchConfig.min_part_s`` (the limit is spent), so that a stitched plan still
    arrives near the limit; ``judge`` (by default ``quick``), how the parts of each
    stored-value choice are planned to compare the choices (``_chosen``): its plan depends
    on the part's problem alone, not on the time left, so a part that several choices
    share (the same nodes, held values and budget) is planned once."""

    exact: Callable[[Problem], StrategyResult]
    quick: Callable[[Problem], StrategyResult]
    judge: Callable[[Problem], StrategyResult] | None = None


def solve_parts(
    problem: Problem,
    strategy: str,
    device: str,
    solvers: PartSolvers,
    heartbeat: Callable[[], None],
    seconds: float,
    offer: Callable[[StrategyResult], None] | None = None,
) -> StrategyResult:
    """Each part solved on ``device`` in plan order (a part's budget depends on what the
    earlier parts left resident), for a share of ``seconds`` proportional to its size; the
    stitched plan judged by the simulator. Which forward values the segments keep is chosen among
    ``stored_orders`` by the stitched plans of their parts' ``judge`` plans (``_chosen``, in
    ``judge_share`` of ``seconds``: the parts' solves have the rest), each cheaper one going
    to ``offer`` as found (a plan within a second or two, where the parts' solves take most
    of the limit); if a part then finds no plan, every segment is recomputed instead, in
    the time left."""
    graph, costs = problem.graph, problem.costs
    cuts = segments(graph, costs, problem.solver.search.segment_forward_nodes)
    reserved = held_fixed_bytes(graph, range(len(graph)))  # every fixed tensor, everywhere
    budget = problem.budgets.get(device)
    room = None if budget is None else budget - reserved
    now = time.monotonic()
    deadline = now + seconds
    stitch = partial(_stitch, problem, strategy, device, reserved, heartbeat, deadline)
    orders = stored_orders(graph, costs, cuts, room)
    judge = _remembered(solvers.judge or solvers.quick)
    judged = partial(stitch, replace(solvers, exact=judge, quick=judge))
    quick = partial(stitch, replace(solvers, exact=solvers.quick))
    judged_by = now + seconds * problem.solver.search.judge_share
    stored = _chosen(graph, orders, cuts, judged, quick, offer, judged_by)
    result = stitch(solvers, parts(graph, cuts, stored))
    if result.plan is None and stored and not problem.cancelled:
        result = stitch(solvers, parts(graph, cuts))
    return result


def _remembered(solve: Callable[[Problem], StrategyResult]) -> Callable[[Problem], StrategyResult]:
    """``solve`` with its result kept per part problem (its graph's fingerprint and its
    budget): the stored-value choices share many of their parts."""
    known: dict[tuple[object, ...], StrategyResult] = {}

    def remembered(part: Problem) -> StrategyResult:
        key = (part.graph.fingerprint, *sorted(part.budgets.items()))
        if key not in known:
            known[key] = solve(part)
        return known[key]

    return remembered


def _chosen(
    graph: Graph,
    orders: list[list[frozenset[int]]],
    cuts: Sequence[range],
    judged: Callable[[list[Part]], StrategyResult],
    quick: Callable[[list[Part]], StrategyResult],
    offer: Callable[[StrategyResult], None] | None,
    deadline: float,
) -> frozenset[int]:
    """The stored values whose stitched plan of judged part plans (``judged``) the simulator
    finds cheapest, each cheaper plan going to ``offer``. The orders' choices are judged by
    turns, each order's from the longest down, until one whose plan costs more than the
    order's choice before it (a shorter prefix recomputes more; it pays only where the
    longer one left a part too little room); past ``deadline`` no more are judged once one
    has a plan. Until a choice's judged plan fits, each choice whose judged plan does not is
    stitched from quick part plans (``quick``) too, and the first that fits is offered at
    once (at tight budgets no part's judged plan may fit, and the first plan must not wait
    for every choice to be judged); where no judged plan fits, that choice is returned. A
    single choice is not stitched."""
    if sum(len(order) for order in orders) == 1:
        return orders[0][0]
    best, best_ms = orders[0][0], float("inf")
    fallback: frozenset[int] | None = None  # the first choice whose quick plans fit
    queues = [deque(order) for order in orders]
    last_ms = [float("inf")] * len(orders)  # each order's last choice with a plan
    while any(queues):
        for k, queue in enumerate(queues):
            if not queue:
                continue
            planned = best_ms < float("inf") or fallback is not None
            if planned and time.monotonic() > deadline:
                queues = []
                break
            stored = queue.popleft()
            result = judged(parts(graph, cuts, stored))
            cost = result.simulation.total_ms if result.feasible and result.simulation else None
            if cost is not None and cost < best_ms:
                best, best_ms = stored, cost
                if offer is not None:
                    offer(result)
            elif (
                cost is None
                and not planned
                and (result := quick(parts(graph, cuts, stored))).feasible
            ):
                fallback = stored
                if offer is not None:
                    offer(result)
            if cost is not None:
                if cost > last_ms[k]:
                    queue.clear()  # its shorter prefixes recompute more still
                last_ms[k] = cost
    if best_ms < float("inf") or fallback is None:
        return best
    return fallback


def stored_orders(
    graph: Graph, costs: CostModel, cuts: Sequence[range], room: int | None
) -> list[list[frozenset[int]]]:
    """Sets of forward values to keep from their F part for their B part, by order of the
    candidates: the longest prefix of the order that the memory estimate admits (``_fits``:
    every part's resident values, outputs and largest operation within ``room``, the bytes
    the device has for values), then its 3/4, 1/2 and 1/4; a set that an earlier order has
    is left out. The estimate ignores the parts' working memory: a part left little room
    recomputes inside it, which can cost more than recomputing the segment. The orders:
    segment by segment from the loss back (the later a segment, the shorter its values are
    held), and across segments by recomputation cost per byte (a transformer's matrix
    products before its activations). Without a budget, one set: every candidate."""
    users = graph.users()
    fastest = costs.compute_ms.min(axis=1)
    segment = {i: k for k, cut in enumerate(cuts[:-1]) for i in cut}

    def per_byte(i: int) -> float:
        return -float(fastest[i]) / max(int(costs.output_bytes[i]), 1)

    kept = [i for i in segment if any(graph.nodes[u].kind is NodeKind.BACKWARD for u in users[i])]
    candidates = [
        sorted(kept, key=lambda i: (-segment[i], per_byte(i))),
        sorted(kept, key=lambda i: (per_byte(i), -segment[i])),
    ]
    if room is None:
        return [[frozenset(kept)]]
    seen: set[frozenset[int]] = set()
    orders: list[list[frozenset[int]]] = []
    for candidate in candidates:
        longest = _longest_fitting(graph, costs, cuts, candidate, room)
        order = []
        for length in (longest, longest * 3 // 4, longest // 2, longest // 4):
            if (choice := frozenset(candidate[:length])) not in seen:
                seen.add(choice)
                order.append(choice)
        if order:
            orders.append(order)
    return orders


def _longest_fitting(
    graph: Graph, costs: CostModel, cuts: Sequence[range], order: list[int], room: int
) -> int:
    """The longest prefix of ``order`` that ``_fits`` admits (binary search)."""
    low, high = 0, len(order)
    while low < high:
        middle = (low + high + 1) // 2
        if _fits(graph, costs, parts(graph, cuts, frozenset(order[:middle])), room):
            low = middle
        else:
            high = middle - 1
    return low


def _fits(graph: Graph, costs: CostModel, plan_parts: list[Part], room: int) -> bool:
    size = costs.output_bytes
    resident: frozenset[int] = frozenset()
    for part in plan_parts:
        inside = set(part.nodes)
        largest = max(
            int(size[i]) + sum(int(size[d]) for d in graph.nodes[i].deps if d in inside)
            for i in part.nodes
        )
        needed = sum(int(size[v]) for v in resident) + sum(int(size[o]) for o in part.outputs)
        if needed + largest > room:
            return False
        resident = part.needed_after
    return True


def _stitch(
    problem: Problem,
    strategy: str,
    device: str,
    reserved: int,
    heartbeat: Callable[[], None],
    deadline: float,
    solvers: PartSolvers,
    plan_parts: list[Part],
) -> StrategyResult:
    graph, costs = problem.graph, problem.costs
    stitcher = _Stitcher(problem, device)
    left = sum(len(part.nodes) for part in plan_parts)
    for number, part in enumerate(plan_parts, start=1):
        where = f"part {number} of {len(plan_parts)} ({len(part.nodes)} nodes)"
        budget = stitcher.budget(part, reserved)
        if budget is not None and budget < 0:
            return _failed(strategy, f"{where}: fixed memory and checkpoints exceed the budget")
        share = (deadline - time.monotonic()) * len(part.nodes) / left
        left -= len(part.nodes)
        settings = replace(
            problem.solver,
            options=replace(problem.solver.options, time_limit_s=share),
            on_progress=lambda _progress: heartbeat(),
            on_plan=None,  # a part's plans are not plans of the whole problem
        )
        sub = Problem(part.graph(graph, costs), part.costs(costs), {device: budget}, settings)
        quick = share < problem.solver.search.min_part_s
        result = solvers.quick(sub) if quick else solvers.exact(sub)
        if result.plan is None:
            return _failed(strategy, f"{where}: {result.message}")
        stitcher.add(part, result.plan)
        if problem.cancelled:
            return _failed(strategy, "cancelled")
    plan = Plan(strategy, problem.plan_devices([device]), tuple(stitcher.steps))
    return select_best(strategy, [evaluate_plan(problem, plan)])


def _failed(strategy: str, why: str) -> StrategyResult:
    return StrategyResult(strategy, None, None, f"decomposition: {why}")


class _Stitcher:
    """The stitched plan on one device as it grows, and which values it leaves resident."""

    def __init__(self, problem: Problem, device: str) -> None:
        self.problem = problem
        self.device = device
        self.resident: set[int] = set()
        self.steps: list[Step] = []
        self.stage = 0

    def budget(self, part: Part, reserved: int) -> int | None:
        """The part's budget: the device's, less the reserved fixed memory and the values
        carried past the part (None: unlimited; below zero: the part cannot fit)."""
        budget = self.problem.budgets.get(self.device)
        if budget is None:
            return None
        size = self.problem.costs.output_bytes
        return budget - reserved - sum(int(size[v]) for v in self.resident - set(part.held))

    def add(self, part: Part, plan: Plan) -> None:
        """The part's plan in the whole graph's numbering, then what no later part reads
        freed. Its held values are resident: earlier parts left every value a later
        part reads."""
        for step in plan.steps:
            assert isinstance(step, NodeStep), "a part's plan pages no fixed tensor"
            self.stage = max(self.stage, part.nodes[step.stage])
            self._emit(replace(step, stage=self.stage, node=part.nodes[step.node]))
        for value in sorted(self.resident - part.needed_after):
            self._emit(Free(self.stage, value, self.device))

    def _emit(self, step: Step) -> None:
        if isinstance(step, Compute):
            self.resident.add(step.node)
        elif isinstance(step, Free):
            self.resident.discard(step.node)
        self.steps.append(step)
