"""XEngine's MIQP (Schuler et al., section 3.2): placement + rematerialization on several
devices. The energy objectives of section 5.1 (eq. 17-19) reach it through its costs
(``remat.objective.objective_costs``: c[d,i] becomes the objective's cost of a compute).

Variables (device d, stage t, node i; all 0-based, stage t first computes node t):

* R[d,t,i], S[d,t,i]  compute / keep matrices (eq. 2), lower triangular (eq. 7, 10)
* F[d,t,(u,v)]        u freed on d in stage t after computing v (eq. 3, 15-16)
* Z[d,t,i]            i is computed or kept on d in stage t: Z = R OR S (eq. 4-5)
* U[d,t,c]            memory on d: U[d,t,0] at the start of stage t (eq. 13), U[d,t,k+1]
                      just after computing node k (eq. 14), within the budget (eq. 6)

Objective (1): sum c[d,i] R[d,t,i] + W, W = sum w[u,d,d'] R[d',t,v] Z[d,t,u] over stages,
edges (u,v) and device pairs d != d' (w[u,d,d] = 0): the bilinear terms go to
``MILPModel.quadratic`` (backends without MIQP solve ``linearized()``).

Constraints: (5) Z, (7) R lower triangular, (8)+(9) exactly one device computes node t in
stage t, (10) S strictly lower triangular, (11) keep only what was on the same device,
(12) dependencies computed or kept on some device, (13)-(15) the memory recurrence, (16)
F through per-device hazards (Checkmate's 7b/7c with the device dimension):

    h(d,t,u,v) = (1 - R[d,t,v]) + S[d,t+1,u] + sum_{d'} sum_{j in USERS[u], j > v} R[d',t,j]

Later users on *any* device count: one may copy u from d, so the compiler keeps it there.

Memory is made conservative w.r.t. the simulator (XEngine's U is not):

* Fixed memory depends on placement: H[d,f] = 1 if some node reading fixed tensor f runs on
  d, G[d,f] likewise for backward readers in training (gradient buffers); their bytes enter
  U[d,t,0]. R[d,i,i] <= H[d,f] per reader, and sum_{t>i} R[d,t,i] <= count * H[d,f].
* A copy allocates on the destination: C[d,t,(u,v)] >= R[d,t,v] - Z[d,t,u] - sum of
  R[d,t,v'] over users v' < v of u (v is the first user of u on d, u not there), and M_u
  counts on d from v on. The copy is freed by F like any value of d (its last user on d, if
  no later user anywhere), else it counts to the end of the stage.
* Outputs are never freed (the compiler keeps them on every device holding them): no F for
  outputs, S[d,t,o] >= R[d,t-1,o] and >= S[d,t-1,o]. A copy of an output into d (outputs
  with users only) stays there for good: L[d,t,o] >= C[d,t-1,(o,v)] and >= L[d,t-1,o]
  latches it, counts M_o in U[d,t,0], and lets users on d read it without a new copy.

Valid inequalities (``_free_cuts``): (16) term by term, F <= R[d,t,v], F + S[d,t+1,u] <= 1,
F + R[d',t,j] <= 1; they hold at every integer point and tighten the LP relaxation. On W's
products y = R[d',t,v] Z[d,t,u] (``_copy_cover``, rows only the linearization states):
sum_{d != d'} y >= R[d',t,v] - Z[d',t,u], from (12).

Devices that share a memory pool (option ``pool``): their memory is bounded together, sum_d
U[d,t,c] <= the pool's budget over the pool's devices d at every point (t, c), beside each
U's own bound (6). A pool holds one copy of each fixed tensor: H and G exist for its
first device only, set where any device of the pool reads the tensor. A value kept on two
of its devices is counted twice (conservative: the simulator counts it once); a device
reads a value another device of its pool holds without a copy, so there are no C or L
variables between them (the cost model's copy times within a pool are 0, and the compiler
emits no copy: the tensor is already there). ``encode`` puts a pool schedule's kept values
on one device each (``_rehomed``).

With ``paging`` (PORT-M with PORT's paging, section 4.3 with 4.2's M^out, M^in, S^AUX;
``concurrent`` over one pool only), the pool also pages values to the node's storage at
stage granularity, on one paging lane, as Checkmate's model with transfers
(``remat.formulations.checkmate``) does on one device. Per stage t and value i, over the
pool rather than a device (its devices hold one set of tensors):

* OFF[t,i]   paged out during stage t: resident entering t (OFF <= sum_d S[d,t,i]), held
             through the stage and released at its end (OFF + S[d,t+1,i] <= 1, OFF +
             R[d,t,i] <= 1 for every d)
* HOST[t,i]  in storage entering stage t (PORT's S^AUX): HOST[t+1,i] <= HOST[t,i] + OFF[t,i]
* PRE[t,i]   paged in during stage t (PRE <= HOST[t,i]), its memory reserved from the
             stage's start (PORT-M's stage memory row counts it), readable from stage t+1
             ((11) gains + PRE[t-1,i] on every device); PRE + S[d,t,i] + R[d,t,i] <= 1
* LATE[t,i]  paged in at the end of stage t, after its frees (LATE <= HOST[t,i], (11)
             gains + LATE[t-1,i], LATE + S[d,t,i] + R[d,t,i] <= 1): no memory in stage t,
             and its whole transfer time in the objective
* W[t]       the time stage t waits for its paging: W[t] >= sum_i (out_i OFF[t,i] + in_i
             PRE[t,i]) - A[t], W >= 0: PORT's bandwidth constraint (5) as a cost, not a
             bound; the objective is sum_t (A[t] + W[t]) + sum in_i LATE[t,i]

The plan pages a stage's values out, then in, at its start, runs the stage's section, and
waits for each at its end (``remat.compiler`` with ``transfers`` and ``concurrent``): a
stage costs the longer of its section and its paging, the objective.

``keep_all`` restricts the model to placement (no recomputation, every value kept on its
device until its last use), ``placed`` to a given placement: models whose optima are plans,
never bounds.

Pruning (exact, see ``common.Structure.useful``) as in ``checkmate``. Memory is in units of
the GCD of the value sizes; fixed-tensor bytes divided by it may be fractional (they only
enter eq. 13), and budgets are rounded down when every fixed size is a multiple of the unit
(U is then integral), else divided exactly. With one device the model
is Checkmate's (no copies; H, G are forced to 1): the optima coincide.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import scipy.sparse as sp

from remat.costs import CostModel
from remat.errors import InvalidInputError, ScheduleError
from remat.formulations.checkmate import Transfers, returns_from_copies, transfer_variables
from remat.formulations.common import (
    Builder,
    Structure,
    memory_unit,
    ragged,
    read_binary,
    scaled_budget,
    violations,
)
from remat.graph import Graph, Mode, NodeKind
from remat.schedule import Schedule
from remat.solvers.model import MILPModel, ProductRows


@dataclass(frozen=True)
class _Fixed:
    """Fixed tensors as (tensor, reader) pairs; ``grad`` pairs are backward readers."""

    names: tuple[str, ...]  # fixed tensors some node reads
    sizes: np.ndarray  # their bytes
    pairs: np.ndarray  # [P, 2] (tensor index, reading node)
    grad_names: tuple[str, ...]  # fixed tensors some backward node reads (training)
    grad_sizes: np.ndarray
    grad_pairs: np.ndarray

    @classmethod
    def of(cls, graph: Graph) -> _Fixed:
        names = sorted({f for node in graph.nodes for f in node.fixed})
        pairs = [(names.index(f), node.id) for node in graph.nodes for f in set(node.fixed)]
        training = graph.mode is Mode.TRAINING
        backward = [n for n in graph.nodes if training and n.kind is NodeKind.BACKWARD]
        read = [(node, {f for f in node.fixed if graph.fixed[f].has_gradient}) for node in backward]
        grads = sorted(set().union(*(fixed for _, fixed in read)))
        grad_pairs = [(grads.index(f), node.id) for node, fixed in read for f in fixed]
        return cls(
            tuple(names),
            np.array([graph.fixed[f].nbytes for f in names], dtype=np.int64),
            np.array(pairs, dtype=np.int64).reshape(-1, 2),
            tuple(grads),
            np.array([graph.fixed[f].nbytes for f in grads], dtype=np.int64),
            np.array(grad_pairs, dtype=np.int64).reshape(-1, 2),
        )


@dataclass(frozen=True)
class XEngineModel:
    """The MIQP and the index arrays to read a solution back (-1: no such variable)."""

    model: MILPModel
    graph: Graph
    devices: tuple[str, ...]
    structure: Structure
    unit: int
    sizes: np.ndarray  # M_i in units
    fixed: _Fixed
    R: np.ndarray  # [D, T, n]
    S: np.ndarray  # [D, T + 1, n]; row T is all -1
    Z: np.ndarray  # [D, T, n]
    U: np.ndarray  # [D, T, n + 1]
    F: np.ndarray  # [D, T, E]
    C: np.ndarray  # [D, T, E]
    H: np.ndarray  # [D, fixed tensors]
    G: np.ndarray  # [D, gradient buffers]
    L: np.ndarray  # [D, T, n]: a copy of output o stays on d (latched)
    builder: Builder
    A: np.ndarray  # [T]: PORT-M's stage times (``concurrent``), else empty
    stage_costs: np.ndarray | None  # [D, n]: c[d,i] of A's rows, where concurrent
    lead: np.ndarray  # [D]: the first device of each device's pool (or itself)
    paging: _Paging | None = None  # OFF, HOST, PRE, LATE [T, n] and W [T], with paging

    def transfers(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """OFF, PRE and LATE of a solution, rounded at 0.5 (all False without paging)."""
        if self.paging is None:
            empty = np.zeros(self.R.shape[1:], dtype=bool)
            return empty, empty.copy(), empty.copy()
        pg = self.paging
        return read_binary(pg.OFF, x), read_binary(pg.PRE, x), read_binary(pg.LATE, x)

    def lp_relaxation(self) -> MILPModel:
        return self.model.lp_relaxation()

    def keep_all(self) -> MILPModel:
        """The model restricted to placement: no recomputation (R[d,t,i] = 0 for i < t), and
        each value kept on the device that computed it until its last user's stage
        (S[d,t,i] = R[d,i,i]; outputs for good). A restriction, so its optimum is a plan of
        the whole problem, never a bound. It is small after presolve: where keeping
        everything fits on some split of the devices it finds that split's optimum in
        seconds (ResNet18 and VGG16 at 25% on cpu+cuda: the whole problem's optimum)."""
        st, m = self.structure, self.model
        D, T, n = self.R.shape
        last_use = np.full(n, -1)
        np.maximum.at(last_use, st.edge_u, st.edge_v)
        t, i = np.arange(T)[:, None], np.arange(n)[None, :]
        later = np.broadcast_to(t > i, (D, T, n))
        kept = later & ((t <= last_use) | st.is_output)[None, :, :]
        ub = m.ub.copy()
        ub[self.R[later & (self.R >= 0)]] = 0.0
        S = self.S[:, :-1]
        ub[S[later & ~kept & (S >= 0)]] = 0.0
        dd, tt, ii = np.nonzero(kept & (S >= 0))
        k = dd.shape[0]
        cols = np.stack([S[dd, tt, ii], self.R[dd, ii, ii]], axis=1).ravel()
        same = sp.csr_array(
            (np.tile([1.0, -1.0], k), (np.repeat(np.arange(k), 2), cols)), shape=(k, m.n_vars)
        )  # S[d,t,i] - R[d,i,i] = 0
        return replace(
            m,
            A=sp.csr_array(sp.vstack([m.A, same])),
            row_lb=np.concatenate([m.row_lb, np.zeros(k)]),
            row_ub=np.concatenate([m.row_ub, np.zeros(k)]),
            ub=ub,
            start=None,
        )

    def home(self, x: np.ndarray) -> np.ndarray:
        """The device computing each node in its own stage (eq. 8-9): the one with the
        largest R[d,i,i] in ``x``, e.g. a relaxed solution's placement, rounded."""
        nodes = np.arange(self.R.shape[2])
        return np.argmax(x[self.R[:, nodes, nodes]], axis=0)

    def placed(self, home: np.ndarray) -> MILPModel:
        """The model restricted to a placement: node i is computed, recomputations
        included, only on device ``home[i]`` (R[d,t,i] = 0 elsewhere); keeping, freeing,
        recomputing and copying are still the model's to choose. A restriction: its optimum
        is a plan, never a bound. About half the size after presolve, it finds plans the
        full model does not reach in the same time (docs/solvers.md, "Measurements behind
        the defaults")."""
        D = self.R.shape[0]
        elsewhere = np.arange(D)[:, None, None] != np.asarray(home)[None, None, :]
        ub = self.model.ub.copy()
        ub[self.R[elsewhere & (self.R >= 0)]] = 0.0
        return replace(self.model, ub=ub, start=None)

    def decode(self, x: np.ndarray) -> Schedule:
        """R and S of a solution (rounded at 0.5) as a schedule over the model's devices."""
        return Schedule(self.devices, read_binary(self.R, x), read_binary(self.S[:, :-1], x))

    def check(self, x: np.ndarray) -> list[str]:
        return violations(self.model, self.builder, x)

    def encode(
        self,
        schedule: Schedule,
        repair: bool = True,
        transfers: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """A full assignment (R, S, Z, F, C, H, G, L, U) for ``schedule``, e.g. as a warm
        start; with paging, its page-outs, page-ins and late page-ins (``transfers``: OFF,
        PRE, LATE as [T, n] booleans; none where None). The schedule may name a subset of
        the devices (the others stay idle). If it does not fit as given, runs on one device
        only and ``repair`` is set, it is cleaned with ``solve_and_prune`` first; raises
        ScheduleError if it violates the model."""
        R, S = self._embed(schedule)
        for t in range(1, S.shape[1]):  # outputs stay where they are (the compiler's rule)
            S[:, t] |= (R[:, t - 1] | S[:, t - 1]) & self.structure.is_output[None, :]
        S = self._rehomed(R, S)
        x = self._assign(R, S, transfers)
        problems = self.check(x) if x is not None else ["entries outside the model"]
        used = np.flatnonzero(R.any(axis=(1, 2)))
        if problems and repair and used.size == 1:
            from remat.strategies.common.rsolve import solve_and_prune  # import cycle otherwise

            d = int(used[0])
            kept = S[d] & (self.S[d, :-1] >= 0)
            T, n = kept.shape
            below = np.arange(n)[None, :] < np.arange(T)[:, None]
            kept |= below & self.structure.is_output[None, :]  # outputs stay once computed
            R[d], S[d] = solve_and_prune(self.graph, kept)
            x = self._assign(R, S)
            problems = self.check(x) if x is not None else ["entries outside the model"]
        if problems:
            raise ScheduleError(f"schedule does not fit the XEngine model: {problems[0]}")
        assert x is not None
        return x

    def _rehomed(self, R: np.ndarray, S: np.ndarray) -> np.ndarray:
        """Where every device shares one pool, S as the model counts it: without values
        that no node reads in their stage and nobody keeps into the next (the compiler
        frees them at the stage's start, the model would count them through it), and each
        kept value on one device: the one that kept it into the stage before, else the one
        that computed it there (else the first: paged in). Which device of a pool keeps a
        value means nothing to the plan (they hold one set of tensors), but (11) keeps a
        value only on the device that had it: a schedule whose devices read each other's
        values is so made a solution. Elsewhere S as given."""
        if len(self.lead) < 2 or self.lead.any():  # not one pool of several devices
            return S
        st = self.structure
        S = S.copy()
        T = S.shape[1]
        read = np.zeros(S.shape[1:], dtype=bool)  # [T, n]: some node of stage t reads i
        computed = np.asarray(R.any(axis=0), dtype=bool)  # [T, n]
        tt, ee = np.nonzero(computed[:, st.edge_v])
        read[tt, st.edge_u[ee]] = True
        for t in range(T - 1, 0, -1):
            later = S[:, t + 1].any(axis=0) if t + 1 < T else np.zeros(S.shape[2], dtype=bool)
            S[:, t] &= (read[t] | later | st.is_output)[None, :]
        for t in range(1, T):
            kept = np.flatnonzero(S[:, t].any(axis=0))
            holder = np.argmax(2 * S[:, t - 1, kept] + R[:, t - 1, kept], axis=0)
            S[:, t] = False
            S[holder, t, kept] = True
        return S

    def _embed(self, schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
        D, T, n = self.R.shape
        R = np.zeros((D, T, n), dtype=bool)
        S = np.zeros((D, T, n), dtype=bool)
        for index, name in enumerate(schedule.devices):
            if name not in self.devices:
                raise ScheduleError(f"schedule uses device {name!r}, the model has {self.devices}")
            d = self.devices.index(name)
            R[d] |= schedule.R[index].astype(bool)
            S[d] |= schedule.S[index].astype(bool)
        return R, S

    def _assign(
        self,
        R: np.ndarray,
        S: np.ndarray,
        transfers: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray | None:
        """The assignment that R and S (and ``transfers``, with paging) determine, or None
        if they use absent variables."""
        if (R & (self.R < 0)).any() or (S & (self.S[:, :-1] < 0)).any():
            return None
        x = np.zeros(self.model.n_vars)
        Z = R | S  # (4)
        free = self._frees(R, S)
        L, copy = self._copies(R, Z)
        H, G = self._placement(R)
        for index, values in ((self.R, R), (self.S[:, :-1], S), (self.Z, Z), (self.L, L)):
            _write(x, index, values)
        _write(x, self.H, H)
        _write(x, self.G, G)
        x[self.F[self.F >= 0]] = free
        x[self.C[self.C >= 0]] = copy
        x[self.U[self.U >= 0]] = self._memory(R, S, H, G, L, free, copy)[self.U >= 0]
        if self.stage_costs is not None:  # PORT-M: each stage's longest device
            x[self.A] = np.einsum("dti,di->dt", R, self.stage_costs).max(axis=0)
        if transfers is not None and any(t.any() for t in transfers):
            paged = self.paging is not None and self.paging.assign(x, x[self.A], *transfers)
            if not paged:
                return None
        return x

    def _frees(self, R: np.ndarray, S: np.ndarray) -> np.ndarray:
        """(16): free u on d after v iff v is computed on d, u is not kept on d for the next
        stage and no later user of u is computed on any device (F's row-major order)."""
        st = self.structure
        D, _, n = R.shape
        S_next = np.concatenate([S[:, 1:], np.zeros((D, 1, n), dtype=bool)], axis=1)
        computed = np.asarray(R.any(axis=0), dtype=bool)
        dd, ft, fe = np.nonzero(self.F >= 0)
        free = R[dd, ft, st.edge_v[fe]] & ~S_next[dd, ft, st.edge_u[fe]]
        where, j = ragged(st.later_ptr, st.later_idx, fe)
        hazard = np.zeros(fe.shape[0], dtype=bool)
        np.logical_or.at(hazard, where, computed[ft[where], j])
        return free & ~hazard

    def _copies(self, R: np.ndarray, Z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """L (latched output copies) and C: v is the first user of u on d, and u is neither
        computed nor kept there, nor an output copied there in an earlier stage."""
        st = self.structure
        cd, ct, ce = np.nonzero(self.C >= 0)
        cu, cv = st.edge_u[ce], st.edge_v[ce]
        missing = R[cd, ct, cv] & ~Z[cd, ct, cu]
        reads = np.zeros(R.shape, dtype=bool)  # some user on d reads u, not there itself
        np.logical_or.at(reads, (cd, ct, cu), missing)
        L = np.zeros(R.shape, dtype=bool)
        L[:, 1:] = np.logical_or.accumulate(reads, axis=1)[:, :-1]
        L &= self.L >= 0
        where, j = ragged(st.earlier_ptr, st.earlier_idx, ce)
        earlier = np.zeros(ce.shape[0], dtype=bool)
        np.logical_or.at(earlier, where, R[cd[where], ct[where], j])
        return L, missing & ~L[cd, ct, cu] & ~earlier

    def _placement(self, R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """H and G: a fixed tensor (gradient buffer) is on d if a (backward) reader runs there."""
        on = np.asarray(R.any(axis=1), dtype=bool)  # [D, n]
        fx = self.fixed
        # Over the transposes ([tensors, D] views): ``at`` indexes their first axis, the
        # tensors, and writes through to H and G.
        H = np.zeros(self.H.shape, dtype=bool)
        np.logical_or.at(H.T, fx.pairs[:, 0], on[:, fx.pairs[:, 1]].T)
        G = np.zeros(self.G.shape, dtype=bool)
        np.logical_or.at(G.T, fx.grad_pairs[:, 0], on[:, fx.grad_pairs[:, 1]].T)
        return self._on_leads(H), self._on_leads(G)

    def _on_leads(self, held: np.ndarray) -> np.ndarray:
        """``held`` [D, tensors] gathered onto the first device of each pool (a pool holds
        one copy of each fixed tensor), zero on the others."""
        pooled = np.zeros_like(held)
        np.logical_or.at(pooled, self.lead, held)
        return pooled

    def _memory(
        self,
        R: np.ndarray,
        S: np.ndarray,
        H: np.ndarray,
        G: np.ndarray,
        L: np.ndarray,
        free: np.ndarray,
        copy: np.ndarray,
    ) -> np.ndarray:
        """U by the recurrence (13)-(14), with the fixed, copy and output terms."""
        st, m, fx = self.structure, self.sizes, self.fixed
        D, T, n = R.shape
        fixed = H @ (fx.sizes / self.unit) + G @ (fx.grad_sizes / self.unit)  # [D]
        start = fixed[:, None] + (S * m).sum(axis=2) + L @ m
        dd, ft, fe = np.nonzero(self.F >= 0)
        freed = np.zeros((D, T, n))
        np.add.at(freed, (dd, ft, st.edge_v[fe]), m[st.edge_u[fe]] * free)
        cd, ct, ce = np.nonzero(self.C >= 0)
        alloc = m[None, None, :] * R.astype(float)
        np.add.at(alloc, (cd, ct, st.edge_v[ce]), m[st.edge_u[ce]] * copy)
        U = np.zeros((D, T, n + 1))
        U[:, :, 0] = start
        U[:, :, 1:] = start[:, :, None] + np.cumsum(alloc, axis=2)
        U[:, :, 2:] -= np.cumsum(freed, axis=2)[:, :, :-1]
        return U


def _leads(spaces: Sequence[str]) -> np.ndarray:
    """Per device, the first device of its memory space (its pool's, or itself)."""
    return np.array([list(spaces).index(space) for space in spaces])


def _write(x: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    present = index >= 0
    x[index[present]] = values[present]


def build_xengine(
    graph: Graph,
    costs: CostModel,
    budgets: Mapping[str, int | None],
    concurrent: bool = False,
    paging: Transfers | None = None,
) -> XEngineModel:
    """XEngine's MIQP over the devices named in ``budgets`` (in cost-model order);
    ``concurrent``, PORT-M's over devices that share memory pools (``_stages``); with
    ``paging`` (concurrent, one pool), PORT's paging to storage too (the module
    docstring)."""
    names = tuple(d.name for d in costs.devices if d.name in budgets)
    unknown = set(budgets) - set(names)
    if unknown:
        raise InvalidInputError(f"budgets name devices the cost model lacks: {sorted(unknown)}")
    if not names:
        raise InvalidInputError("xengine needs at least one device")
    dev = np.array([costs.device_index(name) for name in names])
    st = Structure.of(graph)
    fx = _Fixed.of(graph)
    M = np.asarray(costs.output_bytes, dtype=np.int64)
    unit = memory_unit(M)
    # U is integral in units when the fixed tensors are too: then budgets round down.
    integral = not (np.concatenate([fx.sizes, fx.grad_sizes]) % unit).any()
    budget = np.array([_budget(budgets[name], unit, integral) for name in names])
    spaces = [costs.devices[j].memory_space for j in dev]
    b = Builder()
    v = _Variables.create(b, st, fx, names, budget, spaces)
    keep_rows = _assignment(b, st, v)
    _dependencies(b, st, v, concurrent)
    _memory(b, st, fx, M // unit, unit, v)
    workspace = np.zeros((len(names), st.n), dtype=np.int64)
    if costs.workspace_bytes is not None:
        workspace = -(-costs.workspace_bytes[:, dev].T // unit)
        _workspace(b, v, workspace, budget)
    _pools(b, v, spaces, budget)
    _free(b, st, v)
    _copies(b, st, fx, v)
    compute = costs.compute_ms[:, dev].T  # [D, n]
    pg = None
    if paging is not None and not (concurrent and len(set(spaces)) == 1):
        raise InvalidInputError("paging in the XEngine model needs concurrent devices of one pool")
    if concurrent:
        A, stage_rows = _stages(b, v, compute, spaces, M // unit, workspace.max(axis=1), budget)
        if paging is not None:
            pg = _Paging.create(b, st, v, paging)
            pg.rows(b, v, A, keep_rows, stage_rows, M // unit)
        cost = np.zeros(b.n_vars)
        cost[A] = 1.0
        if pg is not None:
            cost[pg.W] = 1.0
            tt, ii = np.nonzero(pg.LATE >= 0)
            cost[pg.LATE[tt, ii]] = pg.link.in_ms[ii]
    else:
        A = np.full(0, -1)
        cost = np.zeros(b.n_vars)
        dd, tt, ii = np.nonzero(v.R >= 0)
        cost[v.R[dd, tt, ii]] = compute[dd, ii]
    quadratic, keys = _copy_cost(st, v, costs.copy_ms[:, dev][:, :, dev])
    cover = _copy_cover(st, v, keys, b.n_vars)
    model = replace(b.model(cost, quadratic), product_rows=cover)
    D, n = len(names), st.n
    S = np.concatenate([v.S, np.full((D, 1, n), -1)], axis=1)
    return XEngineModel(
        model,
        graph,
        names,
        st,
        unit,
        M // unit,
        fx,
        v.R,
        S,
        v.Z,
        v.U,
        v.F,
        v.C,
        v.H,
        v.G,
        v.L,
        b,
        A,
        compute if concurrent else None,
        v.lead,
        pg,
    )


def _budget(budget: int | None, unit: int, integral: bool) -> float:
    return scaled_budget(budget, unit) if integral or budget is None else budget / unit


@dataclass(frozen=True)
class _Variables:
    R: np.ndarray
    S: np.ndarray
    Z: np.ndarray
    U: np.ndarray
    F: np.ndarray
    C: np.ndarray
    H: np.ndarray
    G: np.ndarray
    L: np.ndarray
    lead: np.ndarray  # [D]: the first device of each device's pool, which holds H and G

    @property
    def S_next(self) -> np.ndarray:
        D, _, n = self.S.shape
        return np.concatenate([self.S[:, 1:], np.full((D, 1, n), -1)], axis=1)

    @classmethod
    def create(
        cls,
        b: Builder,
        st: Structure,
        fx: _Fixed,
        names: tuple[str, ...],
        budget: np.ndarray,
        spaces: list[str],
    ) -> _Variables:
        D, T, n = len(names), st.n, st.n
        lead = _leads(spaces)
        # d receives copies only from devices outside its pool (within one, none are made)
        apart = np.array([any(other != space for other in spaces) for space in spaces])
        t, i = np.arange(T)[:, None], np.arange(n)[None, :]
        diag, below, useful = t == i, i < t, st.useful(T)
        out = st.is_output[None, :]
        r_mask = np.broadcast_to(diag | (below & useful), (D, T, n))
        s_mask = np.broadcast_to(below & (useful | out), (D, T, n))
        R = b.variables("R", r_mask, True, names=_labels("R", names, r_mask))  # (2), (7)
        S = b.variables("S", s_mask, True, names=_labels("S", names, s_mask))  # (2), (10)
        z_mask = r_mask | s_mask
        Z = b.variables("Z", z_mask, True, names=_labels("Z", names, z_mask))  # (5)
        u_mask = np.broadcast_to(np.arange(n + 1)[None, :] <= t + 1, (D, T, n + 1))
        U = b.variables(
            "U", u_mask, False, 0.0, budget[:, None, None], names=_labels("U", names, u_mask)
        )  # (6)
        e_u, e_v = st.edge_u[None, :], st.edge_v[None, :]
        tt = np.arange(T)[:, None]
        computable = r_mask[0][:, st.edge_v] & z_mask[0][:, st.edge_u]  # [T, E]
        f_mask = np.broadcast_to((e_v < tt) & computable & ~st.is_output[e_u], (D, T, st.n_edges))
        F = b.variables("F", f_mask, True, names=_edge_labels("F", names, f_mask, st))  # (3)
        c_mask = computable[None, :, :] & apart[:, None, None]
        C = b.variables("C", c_mask, True, names=_edge_labels("C", names, c_mask, st))
        # a pool holds one copy of each fixed tensor: H and G on its first device only
        is_lead = lead == np.arange(D)
        leads = np.flatnonzero(is_lead).tolist()
        fixed = [f"H[{names[d]},{f}]" for d in leads for f in fx.names]
        h_mask = np.broadcast_to(is_lead[:, None], (D, len(fx.names)))
        H = b.variables("H", h_mask, True, names=fixed)
        grads = [f"G[{names[d]},{f}]" for d in leads for f in fx.grad_names]
        g_mask = np.broadcast_to(is_lead[:, None], (D, len(fx.grad_names)))
        G = b.variables("G", g_mask, True, names=grads)
        output = below & st.is_output & st.has_users
        l_mask = output[None, :, :] & apart[:, None, None]
        L = b.variables("L", l_mask, True, names=_labels("L", names, l_mask))
        return cls(R, S, Z, U, F, C, H, G, L, lead)


def _labels(label: str, names: tuple[str, ...], mask: np.ndarray) -> list[str]:
    return [f"{label}[{names[d]},{t},{i}]" for d, t, i in np.argwhere(mask).tolist()]


def _edge_labels(label: str, names: tuple[str, ...], mask: np.ndarray, st: Structure) -> list[str]:
    u, v = st.edge_u.tolist(), st.edge_v.tolist()
    return [f"{label}[{names[d]},{t},{u[e]},{v[e]}]" for d, t, e in np.argwhere(mask).tolist()]


def _assignment(b: Builder, st: Structure, v: _Variables) -> np.ndarray:
    """(5), (8)-(9), (11) and the outputs' keep rows; returns (11)'s row per S[d,t,i]
    (-1 where S has no variable)."""
    D, T, _ = v.R.shape
    # (5) Z = R OR S: Z <= R + S, Z >= R, Z >= S.
    dd, tt, ii = np.nonzero(v.Z >= 0)
    keys = np.stack([dd, tt, ii], axis=1)
    Rz, Sz, Zz = v.R[dd, tt, ii], v.S[dd, tt, ii], v.Z[dd, tt, ii]
    b.rows("5 Z<=R+S", keys, [Zz, Rz, Sz], [1, -1, -1], -np.inf, 0)
    has = Rz >= 0
    b.rows("5 Z>=R", keys[has], [Rz[has], Zz[has]], [1, -1], -np.inf, 0)
    has = Sz >= 0
    b.rows("5 Z>=S", keys[has], [Sz[has], Zz[has]], [1, -1], -np.inf, 0)
    # (8) + (9): at least one device per stage, T in all: exactly one device computes t.
    diag = v.R[:, np.arange(T), np.arange(T)]  # [D, T]
    rows = b.rows("8-9", np.arange(T)[:, None], [diag[0]], [1], 1, 1)
    for d in range(1, D):
        b.entries(rows, diag[d], np.ones(T))
    # (11) S[d,t,i] <= S[d,t-1,i] + R[d,t-1,i]: keep only what is on the same device.
    dd, tt, ii = np.nonzero(v.S >= 0)
    keys = np.stack([dd, tt, ii], axis=1)
    cols = [v.S[dd, tt, ii], v.S[dd, tt - 1, ii], v.R[dd, tt - 1, ii]]
    keep_rows = np.full(v.S.shape, -1)
    keep_rows[dd, tt, ii] = b.rows("11", keys, cols, [1, -1, -1], -np.inf, 0)
    # Outputs are never freed: once on d they stay (S[d,t,o] >= R[d,t-1,o], S[d,t-1,o]).
    out = st.is_output[ii]
    for label, prev in (("keep R", v.R), ("keep S", v.S)):
        has = out & (prev[dd, tt - 1, ii] >= 0)
        cols = [prev[dd[has], tt[has] - 1, ii[has]], v.S[dd[has], tt[has], ii[has]]]
        b.rows(label, keys[has], cols, [1, -1], -np.inf, 0)
    return keep_rows


def _dependencies(b: Builder, st: Structure, v: _Variables, concurrent: bool = False) -> None:
    """(12) R[d,t,v] <= sum_{d'} (R[d',t,u] + S[d',t,u]) for every edge (u,v); concurrent,
    PORT-M's R[d,t,v] <= R[d,t,u] + sum_{d'} S[d',t,u] (section 4.3.2): an input computed
    in the same stage is computed on the same device, so that a stage's devices run apart."""
    D = v.R.shape[0]
    dd, tt, ee = np.nonzero(v.R[:, :, st.edge_v] >= 0)
    u, w = st.edge_u[ee], st.edge_v[ee]
    rows = b.rows("12", np.stack([dd, tt, u, w], axis=1), [v.R[dd, tt, w]], [1], -np.inf, 0)
    minus = -np.ones(rows.shape[0])
    if concurrent:
        b.entries(rows, v.R[dd, tt, u], minus)
    for other in range(D):
        if not concurrent:
            b.entries(rows, v.R[other, tt, u], minus)
        b.entries(rows, v.S[other, tt, u], minus)


def _memory(b: Builder, st: Structure, fx: _Fixed, m: np.ndarray, unit: int, v: _Variables) -> None:
    D, T, _ = v.R.shape
    # (13) U[d,t,0] = sum_i m_i S[d,t,i] + fixed tensors on d + latched output copies.
    dd, tt = np.nonzero(np.ones((D, T), dtype=bool))
    start = b.rows("13", np.stack([dd, tt], axis=1), [v.U[dd, tt, 0]], [1], 0, 0)
    start = start.reshape(D, T)
    sd, st_, si = np.nonzero(v.S >= 0)
    b.entries(start[sd, st_], v.S[sd, st_, si], -m[si])
    for sizes, var in ((fx.sizes, v.H), (fx.grad_sizes, v.G)):
        for d in range(D):
            for t in range(T):
                b.entries(np.full(var.shape[1], start[d, t]), var[d], -(sizes / unit))
    ld, lt, lo = np.nonzero(v.L >= 0)
    b.entries(start[ld, lt], v.L[ld, lt, lo], -m[lo])
    # (14) U[d,t,k+1] = U[d,t,k] - free_{d,t,k-1} + m_k R[d,t,k] + copies into d for k.
    dd, tt, cc = np.nonzero(v.U[:, :, 1:] >= 0)
    cc = cc + 1
    kk = cc - 1
    cols = [v.U[dd, tt, cc], v.U[dd, tt, cc - 1], v.R[dd, tt, kk]]
    rows = b.rows("14", np.stack([dd, tt, kk], axis=1), cols, [1, -1, -m[kk]], 0, 0)
    row_of = np.full(v.U.shape, -1)
    row_of[dd, tt, cc] = rows
    # (15) free_{d,t,k} = sum_{u in DEPS[k]} m_u F[d,t,(u,k)], from column k+2 on.
    fd, ft, fe = np.nonzero(v.F >= 0)
    b.entries(row_of[fd, ft, st.edge_v[fe] + 2], v.F[fd, ft, fe], m[st.edge_u[fe]])
    cd, ct, ce = np.nonzero(v.C >= 0)
    b.entries(row_of[cd, ct, st.edge_v[ce] + 1], v.C[cd, ct, ce], -m[st.edge_u[ce]])


def _free(b: Builder, st: Structure, v: _Variables) -> None:
    """(16) as Checkmate's (7b)-(7c) per device: F = 1 iff h(d,t,u,v) = 0."""
    D = v.R.shape[0]
    fd, ft, fe = np.nonzero(v.F >= 0)
    u, w = st.edge_u[fe], st.edge_v[fe]
    S_next = v.S_next
    where, j = ragged(st.later_ptr, st.later_idx, fe)
    later = [v.R[other, ft[where], j] for other in range(D)]
    count = sum(np.bincount(where[r >= 0], minlength=fe.shape[0]) for r in later)
    kappa = 1 + (S_next[fd, ft, u] >= 0) + count
    keys = np.stack([fd, ft, u, w], axis=1)
    cols = [v.F[fd, ft, fe], v.R[fd, ft, w], S_next[fd, ft, u]]
    low = b.rows("16 min", keys, cols, [-1, 1, -1], -np.inf, 0)  # 1 - F <= h
    high = b.rows("16 max", keys, cols, [kappa, -1, 1], -np.inf, kappa - 1)  # kappa(1-F) >= h
    for r in later:
        b.entries(low[where], r, -np.ones(where.shape[0]))
        b.entries(high[where], r, np.ones(where.shape[0]))
    _free_cuts(b, keys, cols, where, later)


def _free_cuts(
    b: Builder,
    keys: np.ndarray,
    cols: list[np.ndarray],
    where: np.ndarray,
    later: list[np.ndarray],
) -> None:
    """Valid inequalities that tighten the LP relaxation of (16): F = 1 only if every
    hazard is 0, term by term: F <= R[d,t,v], F + S[d,t+1,u] <= 1, F + R[d',t,j] <= 1.

    (16)'s kappa row lets a fractional F sit at 1 - h/kappa, i.e. free most of a value a
    later user still needs; these rows hold at every integer point of (16), so the optimum
    is unchanged, and they raised the root bound of U-Net at 25% on cpu+cuda by 1.2%."""
    F, Rv, S_next = cols
    b.rows("16 cut R", keys, [F, Rv], [1, -1], -np.inf, 0)
    has = S_next >= 0
    b.rows("16 cut S", keys[has], [F[has], S_next[has]], [1, 1], -np.inf, 1)
    for r in later:
        ok = r >= 0
        b.rows("16 cut j", keys[where][ok], [F[where][ok], r[ok]], [1, 1], -np.inf, 1)


def _copies(b: Builder, st: Structure, fx: _Fixed, v: _Variables) -> None:
    D = v.R.shape[0]
    # A copy of u into d for its first user v there: C >= R[d,t,v] - Z[d,t,u] - earlier.
    cd, ct, ce = np.nonzero(v.C >= 0)
    u, w = st.edge_u[ce], st.edge_v[ce]
    keys = np.stack([cd, ct, u, w], axis=1)
    cols = [v.C[cd, ct, ce], v.R[cd, ct, w], v.Z[cd, ct, u]]
    # A latched copy of an output (L) is already on d: no new copy is needed.
    rows = b.rows("copy", keys, [*cols, v.L[cd, ct, u]], [1, -1, 1, 1], 0, np.inf)
    where, j = ragged(st.earlier_ptr, st.earlier_idx, ce)
    b.entries(rows[where], v.R[cd[where], ct[where], j], np.ones(where.shape[0]))
    # A copied output stays on d for good (the compiler never frees outputs).
    T = v.R.shape[1]
    later = ct + 1 < T
    nxt = np.where(later, v.L[cd, np.minimum(ct + 1, T - 1), u], -1)
    has = nxt >= 0
    b.rows("latch copy", keys[has], [v.C[cd, ct, ce][has], nxt[has]], [1, -1], -np.inf, 0)
    ld, lt, lo = np.nonzero(v.L[:, 1:] >= 0)
    lt = lt + 1
    prev = v.L[ld, lt - 1, lo]
    has = prev >= 0
    keys = np.stack([ld, lt, lo], axis=1)[has]
    b.rows("latch keep", keys, [prev[has], v.L[ld, lt, lo][has]], [1, -1], -np.inf, 0)
    # Fixed memory by placement: R[d,i,i] <= H[d,f]; sum_{t>i} R[d,t,i] <= count H[d,f].
    for label, var, pairs in (("H", v.H, fx.pairs), ("G", v.G, fx.grad_pairs)):
        if pairs.shape[0] == 0:
            continue
        f, node = pairs[:, 0], pairs[:, 1]
        for d in range(D):
            keys = np.stack([np.full(len(f), d), f, node], axis=1)
            held = var[v.lead[d]]  # the pool's
            b.rows(f"{label} first", keys, [v.R[d, node, node], held[f]], [1, -1], -np.inf, 0)
            recompute = v.R[d][:, node]  # [T, P]
            recompute = np.where(np.arange(v.R.shape[1])[:, None] > node[None, :], recompute, -1)
            count = (recompute >= 0).sum(axis=0)
            some = count > 0
            rows = b.rows(f"{label} again", keys[some], [held[f[some]]], [-count[some]], -np.inf, 0)
            row_of = np.full(len(f), -1)
            row_of[some] = rows
            tt, pp = np.nonzero(recompute >= 0)
            b.entries(row_of[pp], recompute[tt, pp], np.ones(tt.shape[0]))


def _workspace(b: Builder, v: _Variables, w: np.ndarray, budget: np.ndarray) -> None:
    """(6) while node k runs on d: U[d,t,k+1] + w[d,k] R[d,t,k] <= budget[d], w its
    kernel's workspace in memory units, rounded up (Beaumont et al.'s ex_i)."""
    limited = np.isfinite(budget)[:, None, None]
    dd, tt, kk = np.nonzero((v.R >= 0) & (w[:, None, :] > 0) & limited)
    keys = np.stack([dd, tt, kk], axis=1)
    cols = [v.U[dd, tt, kk + 1], v.R[dd, tt, kk]]
    b.rows("6 workspace", keys, cols, [1, w[dd, kk]], -np.inf, budget[dd])


def _pools(b: Builder, v: _Variables, spaces: list[str], budget: np.ndarray) -> None:
    """sum over a pool's devices d of U[d,t,c] <= its budget, at every (t, c)."""
    for pool in sorted(set(spaces)):
        members = [d for d, space in enumerate(spaces) if space == pool]
        if len(members) < 2 or not np.isfinite(budget[members[0]]):
            continue
        tt, cc = np.nonzero(v.U[members[0]] >= 0)
        keys = np.stack([tt, cc], axis=1)
        cols = [v.U[d, tt, cc] for d in members]
        b.rows(f"6 pool {pool}", keys, cols, [1.0] * len(members), -np.inf, budget[members[0]])


def _stages(
    b: Builder,
    v: _Variables,
    compute: np.ndarray,
    spaces: list[str],
    m: np.ndarray,
    workspace: np.ndarray,
    budget: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """PORT-M (section 4.3): the devices of a stage compute at once, so its time is
    A[t] >= sum_i c[d,i] R[d,t,i] for every device d, and the objective sum_t A[t]. A
    concurrent plan frees nothing inside a stage (``remat.compiler``): a pool's memory
    during stage t is sum over its devices d of U[d,t,0] + sum_i m_i R[d,t,i], within its
    budget less each device's largest workspace, and a pool computes a node at most once
    per stage (its devices hold one copy). Returns A's indices and the first pool's stage
    memory rows ([T]; -1 where its budget is unlimited)."""
    D, T, _ = v.R.shape
    A = b.variables("A", np.ones(T, dtype=bool), False, 0.0, np.inf, [f"A[{t}]" for t in range(T)])
    dd, tt = np.nonzero(np.ones((D, T), dtype=bool))
    longest = b.rows("PORT-M A", np.stack([dd, tt], axis=1), [A[tt]], [1], 0, np.inf)
    longest = longest.reshape(D, T)
    rd, rt, ri = np.nonzero(v.R >= 0)
    b.entries(longest[rd, rt], v.R[rd, rt, ri], -compute[rd, ri])
    memory_rows = np.full(T, -1)
    for pool in sorted(set(spaces)):
        members = [d for d, space in enumerate(spaces) if space == pool]
        if len(members) > 1:
            tt, ii = np.nonzero((v.R[members] >= 0).sum(axis=0) > 1)
            cols = [v.R[d, tt, ii] for d in members]
            b.rows(f"PORT-M once {pool}", np.stack([tt, ii], axis=1), cols, [1] * len(cols), 0, 1)
        if not np.isfinite(budget[members[0]]):
            continue
        cap = budget[members[0]] - workspace[members].sum()
        stages = np.arange(T)
        cols = [v.U[d, stages, 0] for d in members]
        rows = b.rows(f"PORT-M memory {pool}", stages[:, None], cols, [1] * len(cols), -np.inf, cap)
        for d in members:
            rt, ri = np.nonzero(v.R[d] >= 0)
            b.entries(rows[rt], v.R[d, rt, ri], m[ri])
        if pool == spaces[0]:
            memory_rows = rows
    return A, memory_rows


@dataclass(frozen=True)
class _Paging:
    """The pool's paging variables (the module docstring): OFF, HOST, PRE, LATE [T, n]
    and W [T], with the link's times."""

    OFF: np.ndarray
    HOST: np.ndarray
    PRE: np.ndarray
    LATE: np.ndarray
    W: np.ndarray
    link: Transfers

    @classmethod
    def create(cls, b: Builder, st: Structure, v: _Variables, link: Transfers) -> _Paging:
        """OFF where the value can be resident entering the stage, PRE and LATE where it
        can be kept into the next one, HOST in between (as Checkmate's with transfers)."""
        return cls(*transfer_variables(b, st, v.R[0], v.S[0], v.S_next[0]), link)

    def rows(
        self,
        b: Builder,
        v: _Variables,
        A: np.ndarray,
        keep_rows: np.ndarray,
        stage_rows: np.ndarray,
        m: np.ndarray,
    ) -> None:
        D = v.R.shape[0]
        OFF, HOST, PRE, LATE, W = self.OFF, self.HOST, self.PRE, self.LATE, self.W
        tt, ii, keys = returns_from_copies(b, OFF, HOST, PRE, LATE, "page in")
        for d in range(D):  # not resident or computed meanwhile, on any device
            for label, var in (("arriving", PRE), ("late arriving", LATE)):
                cols = [var[tt, ii], v.S[d, tt, ii], v.R[d, tt, ii]]
                b.rows(label, keys, cols, [1, 1, 1], -np.inf, 1)
        # (11) gains PRE[t-1,i] + LATE[t-1,i]: a value paged in may be kept on any device.
        for d in range(D):
            kt, ki = np.nonzero(keep_rows[d, 1:] >= 0)
            rows, prev = keep_rows[d, kt + 1, ki], kt
            for var in (PRE, LATE):
                b.entries(rows, var[prev, ki], -np.ones(rows.shape[0]))
        tt, ii = np.nonzero(OFF >= 0)
        keys = np.stack([tt, ii], axis=1)
        # OFF[t,i] <= sum_d S[d,t,i]; OFF + S[d,t+1,i] <= 1; OFF + R[d,t,i] <= 1
        held = b.rows("page out", keys, [OFF[tt, ii]], [1], -np.inf, 0)
        S_next = v.S_next
        for d in range(D):
            b.entries(held, v.S[d, tt, ii], -np.ones(held.shape[0]))
            b.rows("leaving", keys, [OFF[tt, ii], S_next[d, tt, ii]], [1, 1], -np.inf, 1)
            b.rows("busy", keys, [OFF[tt, ii], v.R[d, tt, ii]], [1, 1], -np.inf, 1)
        # PORT-M's stage memory counts the pages in from the stage's start.
        tt, ii = np.nonzero((PRE >= 0) & (stage_rows >= 0)[:, None])
        b.entries(stage_rows[tt], PRE[tt, ii], m[ii])
        # W[t] + A[t] - sum out OFF - sum in PRE >= 0
        T = A.shape[0]
        rows = b.rows("wait", np.arange(T)[:, None], [W, A], [1, 1], 0, np.inf)
        tt, ii = np.nonzero(OFF >= 0)
        b.entries(rows[tt], OFF[tt, ii], -self.link.out_ms[ii])
        tt, ii = np.nonzero(PRE >= 0)
        b.entries(rows[tt], PRE[tt, ii], -self.link.in_ms[ii])

    def assign(
        self, x: np.ndarray, A: np.ndarray, off: np.ndarray, pre: np.ndarray, late: np.ndarray
    ) -> bool:
        """Write OFF, PRE, LATE, HOST (in storage from the stage after a page-out on) and W
        (given the stages' times ``A``) into ``x``; False where one has no variable."""
        for index, values in ((self.OFF, off), (self.PRE, pre), (self.LATE, late)):
            if (values & (index < 0)).any():
                return False
            _write(x, index, values)
        stored = np.zeros_like(off)
        stored[1:] = np.logical_or.accumulate(off, axis=0)[:-1]
        _write(x, self.HOST, stored & (self.HOST >= 0))
        sent = off @ self.link.out_ms + pre @ self.link.in_ms
        x[self.W] = np.maximum(sent - A, 0.0)
        return True


def _copy_cost(
    st: Structure, v: _Variables, w: np.ndarray
) -> tuple[tuple[tuple[int, int, float], ...], np.ndarray]:
    """W of eq. (1): w[u,d,d'] R[d',t,v] Z[d,t,u] for d != d', every edge (u,v); with each
    term's (d, d', t, edge) as a [terms, 4] array."""
    D = v.R.shape[0]
    terms: list[tuple[int, int, float]] = []
    keys: list[np.ndarray] = [np.zeros((0, 4), dtype=np.int64)]
    for dst in range(D):
        for src in range(D):
            if src == dst:
                continue
            tt, ee = np.nonzero((v.R[dst][:, st.edge_v] >= 0) & (v.Z[src][:, st.edge_u] >= 0))
            coef = w[st.edge_u[ee], src, dst]
            keep = coef > 0
            tt, ee = tt[keep], ee[keep]
            r = v.R[dst, tt, st.edge_v[ee]].tolist()
            z = v.Z[src, tt, st.edge_u[ee]].tolist()
            terms.extend(zip(r, z, coef[keep].tolist(), strict=True))
            keys.append(np.stack([np.full_like(tt, src), np.full_like(tt, dst), tt, ee], axis=1))
    return tuple(terms), np.concatenate(keys)


def _copy_cover(st: Structure, v: _Variables, keys: np.ndarray, n_vars: int) -> ProductRows:
    """Valid inequalities on W's products y[d,d',t,(u,v)] = R[d',t,v] Z[d,t,u]:

        sum_{d != d'} y[d,d',t,(u,v)] >= R[d',t,v] - Z[d',t,u]

    If v runs on d' without u there, (12) puts u on some other device d, so that d's term
    is 1. Only where every such d has a term (a nonzero copy cost). The linearization
    alone (y >= R + Z - 1) lets a fractional placement split u and v over the devices and
    copy for free: these rows tighten the LP bound enough for HiGHS to prove optima it
    could not otherwise (docs/solvers.md, "Measurements behind the defaults")."""
    _, dst, t, e = keys.T
    groups, row, size = np.unique(
        np.stack([dst, t, e], axis=1), axis=0, return_inverse=True, return_counts=True
    )
    g_dst, g_t, g_e = groups.T
    g_u, g_v = st.edge_u[g_e], st.edge_v[g_e]
    holders = (v.Z[:, g_t, g_u] >= 0).sum(axis=0) - (v.Z[g_dst, g_t, g_u] >= 0)
    complete = np.flatnonzero(holders == size)  # every other device holding u has a term
    index = np.full(groups.shape[0], -1)
    index[complete] = np.arange(complete.shape[0])
    k = complete.shape[0]
    q = np.flatnonzero(index[row.ravel()] >= 0)
    P = sp.csr_array((np.ones(q.shape[0]), (index[row.ravel()[q]], q)), shape=(k, keys.shape[0]))
    r = v.R[g_dst, g_t, g_v][complete]
    z = v.Z[g_dst, g_t, g_u][complete]
    has = z >= 0
    rows = np.concatenate([np.arange(k), np.flatnonzero(has)])
    cols = np.concatenate([r, z[has]])
    vals = np.concatenate([-np.ones(k), np.ones(int(has.sum()))])
    A = sp.csr_array((vals, (rows, cols)), shape=(k, n_vars))
    return ProductRows(A, P, np.zeros(k))
