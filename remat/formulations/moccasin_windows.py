"""Moccasin's model (``remat.formulations.moccasin``) restricted to windows of stages
around an incumbent: a neighbourhood of a large neighbourhood search, small enough for
CP-SAT to solve to optimality in about a second on graphs whose whole model it explores
slowly.

The incumbent is given as each node's computations (t_ij, e_ij) on the slot axis of the
whole model (``moccasin.retained_of``). A window is a range of stages [a, b), the slots
[n a, n b). In the windows, and only there, the model decides again:

* every computation whose stage lies in a window (a first computation keeps its stage,
  a recomputation may move within its window or be dropped), and one more optional
  recomputation per node and window (``extra``), for the nodes computed in the windows
  and their dependencies;
* the end of every retention interval that ends in a window (a *crossing-in*: computed
  before the window, outside every window, and freed in it; it may be freed earlier, at
  the window's start at the earliest).

Everything else is the incumbent's. A value the incumbent computes in a window and
retains past the windows into a gap, or past the last window, is *carried out*: exactly
one of its computations in the windows before that end (and after the value's previous
carried-out end, where a mirrored pair's forward window carries it into the gap and the
backward window past the last) is retained to the incumbent's end. So outside
the windows the memory over time is the incumbent's, except for the retention intervals
that the model itself runs across a gap between two windows. The memory constraint
charges, in each window and each gap, the incumbent's largest memory there of what the
model does not decide (a conservative restriction of the whole model's cumulative), plus
the intervals the model decides. Readers outside the windows keep finding their
dependencies: each one's value stays retained up to its slot.

A solution is a plan of the whole problem; its objective is the recomputation time in
the windows, against the incumbent's there (``incumbent_cost_ms``). With two windows,
a forward range and the backward stages that read it, the model revisits what the
forward pass keeps for the backward pass, which no single window of a training graph
covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from remat.costs import CostModel
from remat.formulations.common import Structure
from remat.formulations.moccasin import COST_SCALE, Placement, node_costs, schedule_of_retained
from remat.graph import Graph
from remat.schedule import Schedule

Retained = list[list[tuple[int, int]]]  # per node, its computations (t_ij, e_ij)


@dataclass
class _Item:
    """A computation of a node that the model decides: its stage (an int where fixed),
    its slot, its end, whether it is present (True or a BoolVar), the window it lies in
    (a crossing-in: the window it ends in), the end the memory constraint charges it to
    (a value carried out: the last window's end before its end) and whether it carries
    the value out (False, or a BoolVar) to ``carried_to``."""

    node: int
    stage: Any
    start: Any
    end: Any
    present: Any
    window: int
    crossing: bool = False
    charged: Any = None
    carried: Any = False
    carried_to: int = 0  # where it frees the value it carries out
    carried_hint: bool = False


@dataclass(frozen=True)
class WindowModel:
    """The CP model of the neighbourhood; ``decode`` gives the whole plan's schedule."""

    model: Any  # cp_model.CpModel
    placement: Placement
    retained: Retained  # the incumbent's computations of every node
    items: dict[int, list[_Item]]  # the decided computations of each node in the model
    kept: dict[int, list[tuple[int, int]]]  # of those nodes, the incumbent's other ones
    incumbent_cost_ms: float  # the incumbent's recomputation time in the windows
    intervals: int  # in the cumulative constraints

    def decode(self, value: Any) -> Schedule:
        """The whole plan's schedule of a solution (``value(var)`` reads a variable)."""
        retained = [list(own) for own in self.retained]
        for i, items in self.items.items():
            own = list(self.kept[i])
            for item in items:
                if not _value(value, item.present):
                    continue
                stage = _value(value, item.stage)
                carried = _value(value, item.carried)
                own.append((stage, item.carried_to if carried else _value(value, item.end)))
            retained[i] = sorted(own)
        return schedule_of_retained(retained, self.placement)


def merged_windows(windows: Sequence[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """Stage ranges [a, b) within [0, n), sorted, overlapping or adjacent ones merged."""
    result: list[tuple[int, int]] = []
    for a, b in sorted((max(0, a), min(n, b)) for a, b in windows):
        if b <= a:
            continue
        if result and a <= result[-1][1]:
            result[-1] = (result[-1][0], max(result[-1][1], b))
        else:
            result.append((a, b))
    return result


@dataclass(frozen=True)
class _Axis:
    """The windows on the slot axis: slots[k] = [n a_k, n b_k)."""

    n: int
    slots: list[tuple[int, int]]

    def of_stage(self, t: int) -> int:
        """The window stage t lies in, or -1."""
        return next((k for k, (lo, hi) in enumerate(self.slots) if lo <= self.n * t < hi), -1)

    def of_end(self, e: int) -> int:
        """The window a retention interval ending at ``e`` ends in (lo < e <= hi), or -1."""
        return next((k for k, (lo, hi) in enumerate(self.slots) if lo < e <= hi), -1)

    def charged_end(self, e: int) -> int:
        """Where the model stops charging a value carried out to ``e``: the end of the last
        window before it."""
        return max(hi for _, hi in self.slots if hi < e)


def build_windows(
    graph: Graph,
    costs: CostModel,
    placement: Placement,
    retained: Retained,
    windows: Sequence[tuple[int, int]],
    extra: int = 1,
    structure: Structure | None = None,
) -> WindowModel:
    """The neighbourhood of the incumbent ``retained`` (on ``placement``) in ``windows``
    (stage ranges), hinted with the incumbent: at most ``extra`` recomputations per node
    and window beyond the incumbent's. ``structure``: the graph's, where already built."""
    from ortools.sat.python import cp_model

    st = structure or Structure.of(graph)
    n = st.n
    stages = merged_windows(windows, n)
    axis = _Axis(n, [(n * a, n * b) for a, b in stages])
    C, m, w, unit = node_costs(costs, placement)
    deps = [sorted(set(node.deps)) for node in graph.nodes]

    kept: dict[int, list[tuple[int, int]]] = {}
    inside: dict[int, list[tuple[int, int, int]]] = {}  # node -> (window, t, e)
    carried_ends: dict[int, set[int]] = {}  # node -> where its values carried out are freed
    crossing: dict[int, list[tuple[int, int, int]]] = {}  # node -> (window, t, e)
    for i, computations in enumerate(retained):
        for t, e in computations:
            k = axis.of_stage(t)
            if k >= 0:
                inside.setdefault(i, []).append((k, t, e))
                if e > axis.slots[k][1] and axis.of_end(e) < 0:
                    carried_ends.setdefault(i, set()).add(e)
                continue
            into = axis.of_end(e)
            if into >= 0 and n * t + i < axis.slots[into][0]:
                crossing.setdefault(i, []).append((into, t, e))
            else:
                kept.setdefault(i, []).append((t, e))
    active = set(inside) | set(crossing)
    for i in list(inside):
        active.update(deps[i])

    model = cp_model.CpModel()
    items: dict[int, list[_Item]] = {}
    incumbent_cost = 0.0
    objective: list[tuple[int, Any]] = []
    for i in sorted(active):
        own: list[_Item] = []
        end: Any
        for k, t, e in crossing.get(i, []):
            lo, hi = axis.slots[k]
            end = model.new_int_var(lo, hi, f"e[{i},in{k}]")
            model.add_hint(end, e)
            own.append(_Item(i, t, n * t + i, end, True, k, crossing=True, charged=end))
        carried = carried_ends.get(i, set())
        last = int(st.last_desc[i])
        for k, (a, b) in enumerate(stages):
            here = [(t, e) for kk, t, e in sorted(inside.get(i, [])) if kk == k]
            recomputed = [(t, e) for t, e in here if t != i]
            if any(t == i for t, _ in here):
                e = next(e for t, e in here if t == i)
                end = n * n  # an output is retained to the end
                if not st.is_output[i]:
                    end = _end_var(model, cp_model, axis, k, n * i + i + 1, f"e[{i},0]")
                    if e not in carried:
                        model.add_hint(end, e)
                own.append(_Item(i, i, n * i + i, end, True, k, carried_hint=e in carried))
            low, high = max(a, i + 1), min(b - 1, last)
            count = min(len(recomputed) + extra, high - low + 1) if high >= low else 0
            previous: _Item | None = None
            for j in range(count):
                present = model.new_bool_var(f"a[{i},{k},{j}]")
                stage = model.new_int_var(low, high, f"t[{i},{k},{j}]")
                start = n * stage + i
                end = _end_var(model, cp_model, axis, k, n * low + i + 1, f"e[{i},{k},{j}]")
                model.add(end >= start + 1).only_enforce_if(present)
                if previous is not None:  # symmetry: the present ones first, in stage order
                    model.add_implication(present, previous.present)
                    model.add(stage >= previous.stage + 1).only_enforce_if(present)
                hinted = j < len(recomputed)
                model.add_hint(present, hinted)
                if hinted:
                    t, e = recomputed[j]
                    model.add_hint(stage, t)
                    if e not in carried:
                        model.add_hint(end, e)
                    incumbent_cost += C[i]
                item = _Item(i, stage, start, end, present, k)
                item.carried_hint = hinted and recomputed[j][1] in carried
                own.append(item)
                objective.append((i, present))
                previous = item
        _carry_out(model, own, i, sorted(carried), axis)
        items[i] = own
        kept.setdefault(i, [])

    _precedence(model, deps, items, kept, retained, axis)
    count = _memory(model, placement, items, retained, axis, m, w, deps, unit)
    weights = np.rint(C * COST_SCALE).astype(np.int64)
    model.minimize(sum(int(weights[i]) * present for i, present in objective))
    return WindowModel(
        model,
        placement,
        [list(own) for own in retained],
        items,
        kept,
        incumbent_cost,
        count,
    )


def recomputation_ms(
    costs: CostModel,
    placement: Placement,
    retained: Retained,
    windows: Sequence[tuple[int, int]],
) -> float:
    """The incumbent's recomputation time in ``windows``: what a neighbourhood can save
    (a window without any is its own optimum)."""
    C = node_costs(costs, placement)[0]
    ranges = merged_windows(windows, len(retained))
    return float(
        sum(
            C[i]
            for i, own in enumerate(retained)
            for t, _ in own
            if t != i and any(a <= t < b for a, b in ranges)
        )
    )


def _end_var(model: Any, cp_model: Any, axis: _Axis, k: int, low: int, name: str) -> Any:
    """The end of a computation in window k: in that window from ``low``, or in a later
    one (retained across the gaps between)."""
    pieces = [[low, axis.slots[k][1]]] + [[lo, hi] for lo, hi in axis.slots[k + 1 :]]
    return model.new_int_var_from_domain(cp_model.Domain.from_intervals(pieces), name)


def _carry_out(model: Any, own: list[_Item], i: int, carried: list[int], axis: _Axis) -> None:
    """For each end in ``carried`` (sorted) where node i's value is carried out of the
    windows, exactly one of its computations in the windows between the previous such end
    and it carries the value there, charged to the last window's end before it; every other
    computation is charged to its end."""
    flags: dict[int, list[Any]] = {}
    for item in own:
        item.charged = item.end
        hi = axis.slots[item.window][1]
        to = next((e for e in carried if e > hi), None)
        if to is None or item.crossing:
            continue
        flag = model.new_bool_var(f"out[{i},{item.window}]")
        if item.present is not True:
            model.add_implication(flag, item.present)
        stop = axis.charged_end(to)
        charged = model.new_int_var(0, stop, f"c[{i},{item.window}]")
        model.add(charged == stop).only_enforce_if(flag)
        model.add(charged == item.end).only_enforce_if(~flag)
        model.add_hint(flag, item.carried_hint)
        item.charged, item.carried, item.carried_to = charged, flag, to
        flags.setdefault(to, []).append(flag)
    for group in flags.values():
        model.add_exactly_one(group)


def _precedence(
    model: Any,
    deps: list[list[int]],
    items: dict[int, list[_Item]],
    kept: dict[int, list[tuple[int, int]]],
    retained: Retained,
    axis: _Axis,
) -> None:
    """Every present computation in the windows finds each dependency retained at its
    slot, and so does every computation outside them where the model decides that
    dependency's retention."""
    n = axis.n

    def covered(u: int, lo: int, hi: int) -> bool:
        """A computation of u that the model does not free retains u over [lo, hi): one it
        keeps, or a crossing-in to a window after hi."""
        if any(n * t + u < lo and e >= hi for t, e in kept.get(u, [])):
            return True
        return any(
            c.crossing and c.start < lo and axis.slots[c.window][0] >= hi for c in items.get(u, [])
        )

    for v, own in items.items():
        for cv in own:
            if cv.crossing:
                continue
            lo, hi = axis.slots[cv.window]
            for u in deps[v]:
                if covered(u, lo, hi):
                    continue
                options = []
                for cu in items.get(u, []):
                    if cu.window != cv.window and (cu.crossing or cu.window > cv.window):
                        continue
                    b = model.new_bool_var(f"b[{u},{v}]")
                    if cu.present is not True:
                        model.add_implication(b, cu.present)
                    if not cu.crossing and cu.window == cv.window:
                        model.add(cu.stage <= cv.stage).only_enforce_if(b)
                    _covers(model, cu, cv.start, hi, b)
                    options.append(b)
                model.add_bool_or(options).only_enforce_if(
                    [] if cv.present is True else [cv.present]
                )
    for v in range(n):  # computed outside the windows (a crossing-in too)
        if v in items:
            outside = [t for t, _ in kept[v]] + [c.stage for c in items[v] if c.crossing]
        else:
            outside = [t for t, _ in retained[v]]
        for t in outside:
            slot = n * t + v
            for u in deps[v]:
                if u not in items or covered(u, slot, slot + 1):
                    continue
                options = []
                for cu in items[u]:
                    if cu.crossing or axis.slots[cu.window][1] > slot:
                        continue
                    b = model.new_bool_var(f"b[{u},{v}]")
                    if cu.present is not True:
                        model.add_implication(b, cu.present)
                    _covers(model, cu, slot, slot + 1, b)
                    options.append(b)
                model.add_bool_or(options)


def _covers(model: Any, cu: _Item, slot: Any, before: int, b: Any) -> None:
    """``b`` implies that ``cu``'s value is retained at ``slot``, a slot before
    ``before``: to its end, or carried out to an end at or past ``before``."""
    if cu.carried is False:
        model.add(cu.end >= slot + 1).only_enforce_if(b)
        return
    model.add(cu.end >= slot + 1).only_enforce_if([b, ~cu.carried])
    if cu.carried_to < before:
        model.add_implication(b, ~cu.carried)


def _memory(
    model: Any,
    placement: Placement,
    items: dict[int, list[_Item]],
    retained: Retained,
    axis: _Axis,
    m: np.ndarray,
    w: np.ndarray,
    deps: list[list[int]],
    unit: int,
) -> int:
    """One cumulative per device over the windows and the gaps between them: the decided
    intervals (retention, workspace, copies from other devices), and per window and gap
    one fixed interval of the incumbent's largest memory there of the rest. Returns the
    number of intervals."""
    n, home = axis.n, placement.home
    devices = len(placement.devices)
    events: list[list[tuple[int, int]]] = [[] for _ in range(devices)]  # (slot, +-units)

    def charge(i: int, t: int, begin: int, end: int, sign: int, computed: bool) -> None:
        """Node i's value over [begin, end), and where ``computed`` its computation in
        stage t: its workspace and the copies it reads."""
        d = int(home[i])
        events[d] += [(begin, sign * int(m[i])), (end, -sign * int(m[i]))]
        if not computed:
            return
        s = n * t + i
        events[d] += [(s, sign * int(w[i])), (s + 1, -sign * int(w[i]))]
        for u in deps[i]:
            if int(home[u]) != d:
                events[d] += [(n * t, sign * int(m[u])), (n * t + n, -sign * int(m[u]))]

    for i, computations in enumerate(retained):  # the incumbent's profile
        for t, e in computations:
            charge(i, t, n * t + i, e, 1, True)
    for i, decided in items.items():  # less what the model decides, as the incumbent has it
        for t, e in retained[i]:
            k = axis.of_stage(t)
            if k >= 0:
                into = axis.of_end(e)
                charge(i, t, n * t + i, e if into >= 0 else axis.charged_end(e), -1, True)
            elif any(c.crossing and c.stage == t for c in decided):
                into = axis.of_end(e)
                charge(i, t, axis.slots[into][0], e, -1, False)

    segments = []
    for k, (lo, hi) in enumerate(axis.slots):
        segments.append((lo, hi))
        if k + 1 < len(axis.slots):
            segments.append((hi, axis.slots[k + 1][0]))
    intervals: list[list[Any]] = [[] for _ in range(devices)]
    demands: list[list[int]] = [[] for _ in range(devices)]
    for d in range(devices):
        ordered = sorted(events[d])
        for lo, hi in segments:
            peak = _peak(ordered, lo, hi)
            if peak > 0:
                intervals[d].append(model.new_fixed_size_interval_var(lo, hi - lo, "rest"))
                demands[d].append(peak)
    for i, own in items.items():
        d = int(home[i])
        for item in own:
            begin = axis.slots[item.window][0] if item.crossing else item.start
            if int(m[i]) > 0:
                intervals[d].append(_interval(model, begin, item.charged, item.present, n * n))
                demands[d].append(int(m[i]))
            if item.crossing:
                continue
            if int(w[i]) > 0:
                intervals[d].append(_slot_interval(model, item.start, 1, item.present))
                demands[d].append(int(w[i]))
            for u in deps[i]:
                if int(home[u]) != d and int(m[u]) > 0:
                    intervals[d].append(_slot_interval(model, n * item.stage, n, item.present))
                    demands[d].append(int(m[u]))
    for d, budget in enumerate(placement.budgets):
        if budget is not None:
            capacity = (budget - placement.fixed_bytes[d]) // unit
            model.add_cumulative(intervals[d], demands[d], max(0, int(capacity)))
    return sum(len(x) for x in intervals)


def _peak(ordered: list[tuple[int, int]], lo: int, hi: int) -> int:
    """The largest sum of the sorted events' units at any slot of [lo, hi)."""
    level = sum(units for slot, units in ordered if slot <= lo)
    peak = level
    for slot, units in ordered:
        if lo < slot < hi:
            level += units
            peak = max(peak, level)
    return peak


def _interval(model: Any, start: Any, end: Any, present: Any, horizon: int) -> Any:
    size = model.new_int_var(0, horizon, "d")
    if present is True:
        model.add(size == end - start)
        return model.new_interval_var(start, size, end, "I")
    model.add(size == end - start).only_enforce_if(present)
    return model.new_optional_interval_var(start, size, end, present, "I")


def _slot_interval(model: Any, start: Any, size: int, present: Any) -> Any:
    if present is True:
        return model.new_fixed_size_interval_var(start, size, "s")
    return model.new_optional_fixed_size_interval_var(start, size, present, "s")


def _value(value: Any, var: Any) -> int:
    if isinstance(var, (bool, int, np.integer)):
        return int(var)
    return int(value(var))
