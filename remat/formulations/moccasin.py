"""Moccasin (Bartan et al., ICML 2023): rematerialization on one device as retention
intervals in a constraint program (CP-SAT), O(n) integer variables instead of Checkmate's
O(n^2) binaries.

Node i has up to C_i computations j = 0..C_i-1. Computation j happens at time s_ij and its
value is retained over the interval [s_ij, e_ij); a_ij says whether it happens (a_i0 = 1:
every node is computed once). The paper's constraints:

* precedence: every present computation of v finds each dependency u retained, i.e. some
  present interval of u with s_ul < s_vj < e_ul;
* memory: the retained values never exceed the budget (a cumulative constraint over the
  intervals, demand M_i), nor do they with the workspace of the node computed in a slot
  (an interval of that one slot, demand its kernel's scratch memory);
* objective: the total compute time, sum_i C_i sum_j a_ij.

The time axis is Checkmate's stage order (``remat.compiler`` emits it): the slot of
computing node k in stage t is ``n t + k``, and stage t first computes node t (eq. 8a), so
s_ij = n t_ij + i with an integer stage t_ij (t_i0 = i), and two computations never share a
slot. A solution is then a Checkmate schedule (``decode``): R[t_ij, i] = 1, and S[t, i] = 1
where an interval of i covers the start of stage t. Like Checkmate's MILP the model is
conservative for the compiled plan: the compiler frees a value after its last reader unless
it is kept for the next stage, never later than its interval ends (an interval ends no
later than the stage of the next computation of its node starts), so the simulated memory
never exceeds the cumulative profile.

With C_i below the number of stages where i can matter, this is a restriction of
Checkmate's model: its solutions are plans, but its bound is not a bound of the whole
problem (the strategy reports the ideal's).

On several devices the model takes a placement (``Placement``: node i computed only on
device home_i, as XEngine's plans with a fixed placement): one cumulative constraint per
device over the intervals of the nodes placed there. A value read on another device is
copied there by the compiler for the stage of its reader and freed by that stage's end,
so each such read charges the value's bytes on the reader's device for the reader's whole
stage. Copies are not in the objective (the simulator charges them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from remat.costs import CostModel
from remat.formulations.common import Structure, memory_unit
from remat.graph import Graph
from remat.schedule import Schedule

COST_SCALE = 1e6  # integer objective units per ms (ns): CP-SAT's objective is integral


@dataclass(frozen=True)
class Computation:
    """The CP-SAT variables of computation j of node i."""

    node: int
    stage: Any  # IntVar or int: t_ij
    end: Any  # IntVar or int: e_ij, exclusive
    present: Any  # BoolVar or True: a_ij


@dataclass(frozen=True)
class Placement:
    """Where each node is computed (``devices[home[i]]``), each device's budget (None:
    unlimited) and the fixed tensors it holds (parameters, inputs, gradient buffers)."""

    devices: tuple[str, ...]
    home: np.ndarray  # int [n]
    budgets: tuple[int | None, ...]
    fixed_bytes: tuple[int, ...]

    @classmethod
    def single(cls, device: str, n: int, budget: int | None, fixed_bytes: int) -> Placement:
        """Every one of ``n`` nodes on ``device``."""
        return cls((device,), np.zeros(n, dtype=np.int64), (budget,), (fixed_bytes,))


@dataclass(frozen=True)
class MoccasinModel:
    """The CP model and its variables, per node the list of its computations."""

    model: Any  # cp_model.CpModel
    graph: Graph
    placement: Placement
    n: int
    computations: tuple[tuple[Computation, ...], ...]
    offset_ms: float  # sum_i C_i: the first computations' time, outside the objective

    def objective_ms(self, value: float) -> float:
        return self.offset_ms + value / COST_SCALE

    def decode(self, value: Any) -> Schedule:
        """R and S of a solution; ``value(var)`` reads a variable (a solver's ``Value``)."""
        retained: list[list[tuple[int, int]]] = [
            [
                (int(_read(value, c.stage)), int(_read(value, c.end)))
                for c in computations
                if _read(value, c.present)
            ]
            for computations in self.computations
        ]
        return schedule_of_retained(retained, self.placement)

    def hint(self, schedule: Schedule) -> None:
        """Hint the solver with ``schedule`` (a warm start): each node's computations in
        stage order with the retention the schedule's S gives them; computations beyond
        C_i are left out of the hint. A node's computations and retention are read on
        any device of ``schedule``."""
        retained = retained_of(schedule, self.graph)
        for computations, own in zip(self.computations, retained, strict=True):
            for j, c in enumerate(computations):
                if j >= len(own):
                    _hint(self.model, c.present, 0)
                    continue
                stage, end = own[j]
                _hint(self.model, c.present, 1)
                _hint(self.model, c.stage, stage)
                _hint(self.model, c.end, end)


def retained_of(schedule: Schedule, graph: Graph) -> list[list[tuple[int, int]]]:
    """Each node's computations in ``schedule`` as (t_ij, e_ij) in stage order: computed in
    stage t_ij, retained while S keeps it, to its last reader in the last stage that does
    (an output to the horizon), or to that stage's start where no node reads it there (the
    compiler frees such a checkpoint before the stage's first step). Read on any device of
    ``schedule``."""
    R, S = np.asarray(schedule.R.any(axis=0)), np.asarray(schedule.S.any(axis=0))
    n = R.shape[1]
    outputs = set(graph.outputs)
    users = [sorted(set(u)) for u in graph.users()]
    retained: list[list[tuple[int, int]]] = []
    for i in range(n):
        own = []
        for t in (int(t) for t in np.flatnonzero(R[:, i])):
            last = t
            while last + 1 < n and S[last + 1, i] and not R[last + 1, i]:
                last += 1
            if i in outputs and last == n - 1:
                own.append((t, n * n))
                continue
            # retained to its last reader in stage ``last`` (after its own slot in t)
            readers = [k for k in users[i] if R[last, k] and (last > t or k > i)]
            if last > t and not readers:
                own.append((t, n * last))
                continue
            own.append((t, n * last + max(readers, default=i) + 1))
        retained.append(own)
    return retained


def schedule_of_retained(retained: list[list[tuple[int, int]]], placement: Placement) -> Schedule:
    """The schedule of each node's computations (t_ij, e_ij) on its device: R[t_ij, i] = 1,
    and S[u, i] = 1 where an interval of i covers the start of stage u > t_ij."""
    n = len(retained)
    shape = (len(placement.devices), n, n)
    R = np.zeros(shape, dtype=bool)
    S = np.zeros(shape, dtype=bool)
    for i, own in enumerate(retained):
        d = int(placement.home[i])
        for t, end in own:
            R[d, t, i] = True
            last = min(n - 1, (end - 1) // n)  # kept into stage u when it covers slot n u
            S[d, t + 1 : last + 1, i] = True
    return Schedule(placement.devices, R, S)


def build_moccasin(
    graph: Graph,
    costs: CostModel,
    placement: Placement,
    computations: int | np.ndarray = 2,
) -> MoccasinModel:
    """The CP model for ``graph`` on ``placement``: at most ``computations`` computations
    of each node (the paper's C_v; one number or one per node), each device's memory
    within its budget, of which its fixed bytes are fixed."""
    from ortools.sat.python import cp_model

    st = Structure.of(graph)
    n = st.n
    home = placement.home
    C_v = np.broadcast_to(np.asarray(computations, dtype=np.int64), (n,))
    C, m, w, unit = node_costs(costs, placement)
    model = cp_model.CpModel()
    horizon = n * n
    nodes: list[tuple[Computation, ...]] = []
    intervals: list[list[Any]] = [[] for _ in placement.devices]
    demands: list[list[int]] = [[] for _ in placement.devices]
    for i in range(n):
        d = int(home[i])
        last = int(st.last_desc[i])  # the last stage in which value i can matter
        end_max = horizon if st.is_output[i] else n * max(last, i) + max(last, i) + 1
        extra = 0 if st.is_output[i] or last <= i else min(int(C_v[i]) - 1, last - i)
        first_start = n * i + i
        first_end: Any = (
            horizon if st.is_output[i] else model.new_int_var(first_start + 1, end_max, f"e[{i},0]")
        )
        own = [Computation(i, i, first_end, True)]
        if w[i] > 0:
            intervals[d].append(model.new_fixed_size_interval_var(first_start, 1, f"W[{i},0]"))
            demands[d].append(int(w[i]))
        if int(m[i]) > 0:
            size = first_end - first_start
            intervals[d].append(model.new_interval_var(first_start, size, first_end, f"I[{i},0]"))
            demands[d].append(int(m[i]))
        for j in range(1, extra + 1):
            a = model.new_bool_var(f"a[{i},{j}]")
            t = model.new_int_var(i + 1, last, f"t[{i},{j}]")
            e = model.new_int_var(n * (i + 1) + i + 1, end_max, f"e[{i},{j}]")
            start = n * t + i
            model.add(e >= start + 1).only_enforce_if(a)
            prev = own[-1]
            model.add(t >= prev.stage + 1).only_enforce_if(a)
            model.add(prev.end <= n * t).only_enforce_if(a)  # ends before the next stage
            if j > 1:
                model.add_implication(a, prev.present)
            if w[i] > 0:
                scratch = model.new_optional_fixed_size_interval_var(start, 1, a, f"W[{i},{j}]")
                intervals[d].append(scratch)
                demands[d].append(int(w[i]))
            if int(m[i]) > 0:
                size = model.new_int_var(0, end_max, f"d[{i},{j}]")
                model.add(size == e - start).only_enforce_if(a)
                optional = model.new_optional_interval_var(start, size, e, a, f"I[{i},{j}]")
                intervals[d].append(optional)
                demands[d].append(int(m[i]))
            own.append(Computation(i, t, e, a))
        nodes.append(tuple(own))
    _precedence(model, st, nodes, n)
    _copies(model, st, nodes, home, m, intervals, demands)
    for d, budget in enumerate(placement.budgets):
        if budget is not None:
            capacity = (budget - placement.fixed_bytes[d]) // unit
            model.add_cumulative(intervals[d], demands[d], max(0, int(capacity)))
    weights = np.rint(C * COST_SCALE).astype(np.int64)
    model.minimize(sum(int(weights[c.node]) * c.present for own in nodes for c in own[1:]))
    return MoccasinModel(model, graph, placement, n, tuple(nodes), float(C.sum()))


def node_costs(
    costs: CostModel, placement: Placement
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Per node on its device: the compute time C (ms), the output m and the workspace w
    in memory units (the workspace rounded up), and the unit in bytes."""
    n = len(placement.home)
    columns = np.array([costs.device_index(name) for name in placement.devices])[placement.home]
    C = np.asarray(costs.compute_ms[np.arange(n), columns], dtype=float)
    M = np.asarray(costs.output_bytes, dtype=np.int64)
    unit = memory_unit(M)
    w = np.zeros(n, dtype=np.int64)
    if costs.workspace_bytes is not None:
        w = -(-costs.workspace_bytes[np.arange(n), columns] // unit)
    return C, M // unit, w, unit


def _copies(
    model: Any,
    st: Structure,
    nodes: list[tuple[Computation, ...]],
    home: np.ndarray,
    m: np.ndarray,
    intervals: list[list[Any]],
    demands: list[list[int]],
) -> None:
    """Each computation of v that reads u from another device holds u's copy on v's
    device for v's whole stage (the compiler frees it by the stage's end)."""
    n = st.n
    for u, v in zip(st.edge_u.tolist(), st.edge_v.tolist(), strict=True):
        d = int(home[v])
        if int(home[u]) == d or int(m[u]) == 0:
            continue
        for j, cv in enumerate(nodes[v]):
            start = n * cv.stage
            if cv.present is True:
                copy = model.new_interval_var(start, n, start + n, f"K[{u},{v},{j}]")
            else:
                copy = model.new_optional_interval_var(
                    start, n, start + n, cv.present, f"K[{u},{v},{j}]"
                )
            intervals[d].append(copy)
            demands[d].append(int(m[u]))


def _precedence(model: Any, st: Structure, nodes: list[tuple[Computation, ...]], n: int) -> None:
    """Every present computation of v finds each dependency u retained at its slot: one
    of u's present computations in the same or an earlier stage whose interval covers it
    (u < v, so u's slot precedes v's within a stage)."""
    for u, v in zip(st.edge_u.tolist(), st.edge_v.tolist(), strict=True):
        for cv in nodes[v]:
            slot = n * cv.stage + v
            enforced = [] if cv.present is True else [cv.present]
            if len(nodes[u]) == 1:  # u's first computation, in stage u <= v's stage
                model.add(nodes[u][0].end >= slot + 1).only_enforce_if(enforced)
                continue
            options = []
            for cu in nodes[u]:
                b = model.new_bool_var(f"b[{u},{v}]")
                if cu.present is not True:
                    model.add_implication(b, cu.present)
                    model.add(cu.stage <= cv.stage).only_enforce_if(b)
                model.add(cu.end >= slot + 1).only_enforce_if(b)
                options.append(b)
            model.add_bool_or(options).only_enforce_if(enforced)


def _is_constant(var: Any) -> bool:
    """A fixed field of a computation (the first one's stage and presence, an output's
    end) rather than a CP-SAT variable."""
    return isinstance(var, (int, bool, np.integer))


def _read(value: Any, var: Any) -> int:
    return int(var) if _is_constant(var) else int(value(var))


def _hint(model: Any, var: Any, value: int) -> None:
    if not _is_constant(var):
        model.add_hint(var, value)
