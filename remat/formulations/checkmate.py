"""Checkmate's MILP (Jain et al., section 4): optimal rematerialization on one device.

Variables (stages t, nodes i, both 0-based; stage t first computes node t, eq. 8a):

* R[t,i]  node i is (re)computed in stage t                        (binary, i <= t, eq. 8c)
* S[t,i]  node i's value is kept from stage t-1 into stage t        (binary, i < t, eq. 8b)
* U[t,c]  memory in use; U[t,0] at the start of stage t (eq. 2) and U[t,k+1] just after
          computing node k in stage t (eq. 3): the paper's 1-based U[t,k] for our node k
* FREE[t,i,k] value i is freed in stage t after computing its user k (binary, (i,k) in E)

Objective (1a): sum_t sum_i C_i R[t,i]. Constraints (1b), (1c), (2), (3) with mem_freed of
eq. (4) summed over DEPS[k] only (section 4.8: no FREE[t,k,k]), (7a-7c) for FREE through
num_hazards and kappa, (8a-8c), and U[t,c] <= budget (9).

Our adaptations, all keeping the optimum exact (``common.Structure.useful``):

* Fixed memory (parameters, inputs, gradient buffers; ``remat.simulator``) replaces
  M_input + 2 M_param in eq. (2); the caller passes it (``single_device_fixed_bytes``).
* Model outputs (inference) are never freed by the compiler, so S[t,o] = 1 for t > o: U then
  counts them as the plan holds them, and R[t,o] (t > o) would be a no-op and is dropped.
* Variables that cannot matter are not created: R[t,i], S[t,i] for t > last_desc[i];
  FREE[t,i,k] for k = t (it frees after the stage's last node: no U depends on it) and for
  outputs i; S[t+1,i] for the last stage is 0 (nothing is kept after the plan).
* Memory is in units of the GCD of the value sizes. The fixed memory is a constant, so
  U <= budget becomes U <= fixed/g + floor((budget - fixed)/g), exact for integral sizes.
  Times stay in ms: the objective is the simulator's predicted time.

With ``transfers`` (strategy ``offload_remat``), the model also decides offloading to host
memory (Beaumont et al.), at stage granularity, on the device's transfer lane:

* OFF[t,i]   value i is offloaded during stage t: resident entering t (OFF <= S[t,i]),
             sent from the stage's start and released at its end: not kept (OFF +
             S[t+1,i] <= 1), not computed in t (OFF + R[t,i] <= 1), never freed inside the
             stage (OFF joins num_hazards in (7b)-(7c), so U counts it through the stage)
* HOST[t,i]  value i is on the host entering stage t: HOST[t+1,i] <= HOST[t,i] + OFF[t,i]
* PRE[t,i]   value i is prefetched during stage t (PRE <= HOST[t,i]): its memory reserved
             from the stage's start (U[t,0] counts it, eq. 2), readable from stage t+1
             (eq. 1c gains + PRE[t-1,i]); not resident or computed meanwhile (PRE +
             S[t,i] + R[t,i] <= 1)
* LATE[t,i]  value i is prefetched at the end of stage t, after its frees (LATE <=
             HOST[t,i], eq. 1c gains + LATE[t-1,i], LATE + S[t,i] + R[t,i] <= 1): no
             memory in stage t (U[t+1,0] counts it through S[t+1,i]), and no overlap: the
             objective adds its whole transfer time. Where memory is short until a
             stage's frees, as before the backward nodes, only it brings a value back.
* W[t]       the time stage t waits for its transfers: W[t] >= sum_i (off_i OFF[t,i] +
             pre_i PRE[t,i]) - sum_k C_k R[t,k], W >= 0; the objective adds sum_t W[t]

The plan issues a stage's offloads, then its prefetches, at its start and waits for all of
them at its end, then prefetches and waits for its late prefetches
(``remat.compiler.compile_plan`` with ``transfers``), so that stage costs max(compute,
transfers) plus the late prefetches, which is the objective: the simulator's time.

Conservative w.r.t. the compiled plan (``remat.compiler``): every value FREE frees is also
freed there at the same point (same eq. 5 condition), the compiler frees more (FREE[t,k,k],
unread checkpoints at stage start), and a value both kept and recomputed is counted twice
here, once there. So the simulated memory never exceeds U at any step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from remat.costs import CostModel
from remat.errors import ScheduleError
from remat.formulations.common import (
    Builder,
    Structure,
    memory_unit,
    ragged,
    read_binary,
    scaled_budget,
    violations,
)
from remat.graph import Graph
from remat.schedule import Schedule
from remat.simulator import held_fixed_bytes
from remat.solvers.model import MILPModel


@dataclass(frozen=True)
class Transfers:
    """Per value, the time to send it to a tier (the host, or storage) and to bring it
    back (ms)."""

    out_ms: np.ndarray
    in_ms: np.ndarray


@dataclass(frozen=True)
class CheckmateModel:
    """The MILP and the index arrays to read a solution back (-1: no such variable); with
    transfers, OFF, HOST, PRE, LATE [T, n] and W [T] too (else empty)."""

    model: MILPModel
    graph: Graph
    device: str
    structure: Structure
    unit: int  # bytes per memory unit (the GCD)
    sizes: np.ndarray  # M_i in units
    fixed: float  # fixed memory in units
    R: np.ndarray  # [T, n]
    S: np.ndarray  # [T + 1, n]; row T (S after the last stage) is all -1
    U: np.ndarray  # [T, n + 1]
    FREE: np.ndarray  # [T, E], edge e = (edge_u[e] -> edge_v[e])
    builder: Builder
    OFF: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    HOST: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    PRE: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    LATE: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    W: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def transfers(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """OFF, PRE and LATE of a solution, rounded at 0.5 (all False without transfers)."""
        if self.OFF.size == 0:
            empty = np.zeros(self.R.shape, dtype=bool)
            return empty, empty.copy(), empty.copy()
        return read_binary(self.OFF, x), read_binary(self.PRE, x), read_binary(self.LATE, x)

    @property
    def stages(self) -> int:
        return self.R.shape[0]

    def lp_relaxation(self) -> MILPModel:
        """The same model with integrality dropped (Checkmate section 5.1)."""
        return self.model.lp_relaxation()

    def decode(self, x: np.ndarray) -> Schedule:
        """R and S of a (possibly fractional) solution, rounded at 0.5 (Algorithm 2)."""
        return Schedule.single(self.device, read_binary(self.R, x), read_binary(self.S[:-1], x))

    def encode(self, schedule: Schedule, repair: bool = True) -> np.ndarray:
        """A full assignment (R, S, FREE, U) for ``schedule``, e.g. as a warm start.

        FREE follows eq. (5)/(6) and U the recurrence (2)-(3). If the schedule does not fit
        as given (entries the model prunes, or a row violated, e.g. by a spurious
        recomputation that delays a free) and ``repair`` is set, it is cleaned with
        ``solve_and_prune`` first (never costlier, never more memory). Raises ScheduleError
        if the result violates the model (e.g. over budget)."""
        if schedule.R.shape[0] != 1:
            raise ScheduleError("Checkmate encodes a one-device schedule")
        R, S = schedule.R[0].astype(bool), schedule.S[0].astype(bool)
        S[self._forced_s()] = True  # outputs stay once computed (the compiler's rule)
        x = self._assign(R, S)
        problems = self.check(x) if x is not None else ["entries outside the model"]
        if problems and repair:
            # Imported here: remat.strategies imports this module (optimal strategies).
            from remat.strategies.common.rsolve import solve_and_prune

            S = S & (self.S[:-1] >= 0)
            x = self._assign(*solve_and_prune(self.graph, S))
            problems = self.check(x) if x is not None else ["entries outside the model"]
        if problems:
            raise ScheduleError(f"schedule does not fit the Checkmate model: {problems[0]}")
        assert x is not None
        return x

    def check(self, x: np.ndarray) -> list[str]:
        """Named violations of ``x`` (rows, bounds, integrality); empty if feasible."""
        return violations(self.model, self.builder, x)

    def _forced_s(self) -> np.ndarray:
        T, n = self.R.shape
        below = np.arange(n)[None, :] < np.arange(T)[:, None]
        return below & self.structure.is_output[None, :]

    def _assign(self, R: np.ndarray, S: np.ndarray) -> np.ndarray | None:
        """The assignment that R and S determine, or None if they use absent variables."""
        if (R & (self.R < 0)).any() or (S & (self.S[:-1] < 0)).any():
            return None
        x = np.zeros(self.model.n_vars)
        x[self.R[self.R >= 0]] = R[self.R >= 0]
        x[self.S[self.S >= 0]] = S[self.S[:-1] >= 0]
        free = self._frees(R, S)
        x[self.FREE[self.FREE >= 0]] = free
        x[self.U[self.U >= 0]] = self._memory(R, S, free)[self.U >= 0]
        return x

    def _frees(self, R: np.ndarray, S: np.ndarray) -> np.ndarray:
        """Eq. (5): free i after k iff k is computed, i is not kept for the next stage and no
        later user of i is computed (FREE's row-major order)."""
        st = self.structure
        S_next = np.vstack([S[1:], np.zeros((1, S.shape[1]), dtype=bool)])
        ft, fe = np.nonzero(self.FREE >= 0)
        free = R[ft, st.edge_v[fe]] & ~S_next[ft, st.edge_u[fe]]
        where, j = ragged(st.later_ptr, st.later_idx, fe)
        hazard = np.zeros(fe.shape[0], dtype=bool)
        np.logical_or.at(hazard, where, R[ft[where], j])
        return free & ~hazard

    def _memory(self, R: np.ndarray, S: np.ndarray, free: np.ndarray) -> np.ndarray:
        """Eq. (2)-(3): U[t,0] = fixed + checkpoints; then + M_k R[t,k] - mem_freed(k-1)."""
        st, m = self.structure, self.sizes
        ft, fe = np.nonzero(self.FREE >= 0)
        freed = np.zeros(R.shape)
        np.add.at(freed, (ft, st.edge_v[fe]), m[st.edge_u[fe]] * free)
        U = np.zeros((R.shape[0], st.n + 1))
        U[:, 0] = self.fixed + (m[None, :] * S).sum(axis=1)
        U[:, 1:] = U[:, :1] + np.cumsum(m[None, :] * R, axis=1)
        U[:, 2:] -= np.cumsum(freed, axis=1)[:, :-1]
        return U


def single_device_fixed_bytes(graph: Graph) -> int:
    """Fixed memory when every node runs on one device (the simulator's rule)."""
    return held_fixed_bytes(graph, range(len(graph)))


def build_checkmate(
    graph: Graph,
    costs: CostModel,
    device: str,
    budget_bytes: int | None,
    fixed_bytes: int,
    transfers: Transfers | None = None,
) -> CheckmateModel:
    """Checkmate's MILP (eq. 9) for ``graph`` on ``device`` with frontier-advancing stages;
    with ``transfers``, offloading too (the module docstring)."""
    st = Structure.of(graph)
    T = n = st.n
    C = np.asarray(costs.compute_ms[:, costs.device_index(device)], dtype=float)
    M = np.asarray(costs.output_bytes, dtype=np.int64)
    unit = memory_unit(M)
    m = M // unit
    fixed = fixed_bytes / unit
    b = Builder()
    budget = scaled_budget(budget_bytes, unit, fixed_bytes)
    R, S, U, FREE = _variables(b, st, T, budget)
    S_next = np.vstack([S[1:], np.full((1, n), -1)])
    host = None if transfers is None else transfer_variables(b, st, R, S, S_next)
    _dependencies(b, st, R, S, None if host is None else (host[2], host[3]))
    _memory(b, st, m, fixed, R, S, U, FREE, None if host is None else host[2])
    if costs.workspace_bytes is not None and math.isfinite(budget):
        scratch = costs.workspace_bytes[:, costs.device_index(device)]
        _workspace(b, R, U, -(-scratch // unit), budget)
    _free(b, st, R, S_next, FREE, None if host is None else host[0])
    cost = np.zeros(b.n_vars)
    ti, ii = np.nonzero(R >= 0)
    cost[R[ti, ii]] = C[ii]  # (1a)
    extra = {}
    if host is not None and transfers is not None:
        OFF, HOST, PRE, LATE, W = host
        _transfers(b, st, R, S, S_next, C, transfers, OFF, HOST, PRE, LATE, W)
        cost = np.concatenate([cost, np.zeros(b.n_vars - cost.shape[0])])
        cost[W] = 1.0
        tt, ii = np.nonzero(LATE >= 0)
        cost[LATE[tt, ii]] = transfers.in_ms[ii]
        extra = {"OFF": OFF, "HOST": HOST, "PRE": PRE, "LATE": LATE, "W": W}
    model = b.model(cost)
    Sfull = np.vstack([S, np.full((1, n), -1)])
    return CheckmateModel(model, graph, device, st, unit, m, fixed, R, Sfull, U, FREE, b, **extra)


def transfer_variables(
    b: Builder, st: Structure, R: np.ndarray, S: np.ndarray, S_next: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """OFF, HOST, PRE, LATE and W (the module docstring): OFF where the value can be
    resident entering the stage, PRE and LATE where it can be kept into the next one, HOST
    in between. ``S`` and ``S_next`` are the keep variables' indices [T, n] (a pool's, for
    ``remat.formulations.xengine``'s paging)."""
    T, n = R.shape
    t = np.arange(T)[:, None]
    value = ~st.is_output[None, :] & st.has_users[None, :]
    OFF = b.variables("OFF", (S >= 0) & value, True)
    can_return = (S_next >= 0) & value & (np.arange(n)[None, :] < t)
    HOST = b.variables("HOST", can_return, True)
    PRE = b.variables("PRE", can_return, True)
    LATE = b.variables("LATE", can_return, True)
    W = b.variables("W", np.ones(T, dtype=bool), False, 0.0, np.inf)
    return OFF, HOST, PRE, LATE, W


def _transfers(
    b: Builder,
    st: Structure,
    R: np.ndarray,
    S: np.ndarray,
    S_next: np.ndarray,
    C: np.ndarray,
    transfers: Transfers,
    OFF: np.ndarray,
    HOST: np.ndarray,
    PRE: np.ndarray,
    LATE: np.ndarray,
    W: np.ndarray,
) -> None:
    T = R.shape[0]
    tt, ii, keys = returns_from_copies(b, OFF, HOST, PRE, LATE, "prefetch")
    # PRE + S[t,i] + R[t,i] <= 1; LATE + S[t,i] + R[t,i] <= 1
    b.rows("arriving", keys, [PRE[tt, ii], S[tt, ii], R[tt, ii]], [1, 1, 1], -np.inf, 1)
    b.rows("late arriving", keys, [LATE[tt, ii], S[tt, ii], R[tt, ii]], [1, 1, 1], -np.inf, 1)
    tt, ii = np.nonzero(OFF >= 0)
    keys = np.stack([tt, ii], axis=1)
    # OFF[t,i] <= S[t,i]; OFF + S[t+1,i] <= 1; OFF + R[t,i] <= 1
    b.rows("offload", keys, [OFF[tt, ii], S[tt, ii]], [1, -1], -np.inf, 0)
    b.rows("leaving", keys, [OFF[tt, ii], S_next[tt, ii]], [1, 1], -np.inf, 1)
    b.rows("busy", keys, [OFF[tt, ii], R[tt, ii]], [1, 1], -np.inf, 1)
    # W[t] - sum off OFF - sum pre PRE + sum C R >= 0
    stages = np.arange(T)
    rows = b.rows("wait", stages[:, None], [W], [1], 0, np.inf)
    tt, ii = np.nonzero(OFF >= 0)
    b.entries(rows[tt], OFF[tt, ii], -transfers.out_ms[ii])
    tt, ii = np.nonzero(PRE >= 0)
    b.entries(rows[tt], PRE[tt, ii], -transfers.in_ms[ii])
    tt, ii = np.nonzero(R >= 0)
    b.entries(rows[tt], R[tt, ii], C[ii])


def returns_from_copies(
    b: Builder,
    OFF: np.ndarray,
    HOST: np.ndarray,
    PRE: np.ndarray,
    LATE: np.ndarray,
    label: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """HOST[t+1,i] <= HOST[t,i] + OFF[t,i] (a copy on the tier comes from a send), and
    PRE <= HOST, LATE <= HOST (only a copy there comes back; PRE's rows named ``label``).
    Returns PRE's (t, i) and their keys, for the rows a model adds on them."""
    tt, ii = np.nonzero(HOST[1:] >= 0)
    keys = np.stack([tt + 1, ii], axis=1)
    b.rows("host", keys, [HOST[tt + 1, ii], HOST[tt, ii], OFF[tt, ii]], [1, -1, -1], -np.inf, 0)
    tt, ii = np.nonzero(PRE >= 0)
    keys = np.stack([tt, ii], axis=1)
    b.rows(label, keys, [PRE[tt, ii], HOST[tt, ii]], [1, -1], -np.inf, 0)
    b.rows("late", keys, [LATE[tt, ii], HOST[tt, ii]], [1, -1], -np.inf, 0)
    return tt, ii, keys


def _variables(
    b: Builder, st: Structure, T: int, budget: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n = st.n
    t, i = np.arange(T)[:, None], np.arange(n)[None, :]
    diag, below, useful = t == i, i < t, st.useful(T)
    out = st.is_output[None, :]
    # (8a) R[t,t] = 1 as a fixed variable; (8c) nothing above the diagonal.
    R = b.variables("R", diag | (below & useful & ~out), True, lb=diag.astype(float))
    # (8b) strictly lower triangular; outputs are held from the stage after their own.
    S = b.variables("S", below & (useful | out), True, lb=(below & out).astype(float))
    # (9) U <= budget, on the start-of-stage value U[t,0] too.
    cols = np.arange(n + 1)[None, :]
    U = b.variables("U", cols <= t + 1, False, 0.0, budget)
    ft = np.arange(T)[:, None]
    u, v = st.edge_u[None, :], st.edge_v[None, :]
    present = (R >= 0) | (S >= 0)  # value i can be resident in stage t
    mask = (v < ft) & (R[:, st.edge_v] >= 0) & ~st.is_output[u] & present[:, st.edge_u]
    keys = np.argwhere(mask)
    names = [f"FREE[{a},{st.edge_u[e]},{st.edge_v[e]}]" for a, e in keys.tolist()]
    FREE = b.variables("FREE", mask, True, names=names)  # (7a)
    return R, S, U, FREE


def _dependencies(
    b: Builder,
    st: Structure,
    R: np.ndarray,
    S: np.ndarray,
    prefetched: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    T, n = R.shape
    u, v = st.edge_u, st.edge_v
    # (1b) R[t,k] <= R[t,i] + S[t,i] for every edge (i,k) and stage computing k. Rows whose
    # S[t,i] is fixed to 1 (outputs) hold trivially and are left out.
    forced = st.is_output[u][None, :] & (u[None, :] < np.arange(T)[:, None])
    tt, ee = np.nonzero((R[:, v] >= 0) & ~forced)
    keys = np.stack([tt, u[ee], v[ee]], axis=1)
    b.rows("1b", keys, [R[tt, v[ee]], R[tt, u[ee]], S[tt, u[ee]]], [1, -1, -1], -np.inf, 0)
    # (1c) S[t,i] <= R[t-1,i] + S[t-1,i]; trivial for i = t-1 (R[t-1,t-1] = 1) and outputs.
    i = np.arange(n)[None, :]
    mask = (S >= 0) & (i < np.arange(T)[:, None] - 1) & ~st.is_output[None, :]
    tt, ii = np.nonzero(mask)
    keys = np.stack([tt, ii], axis=1)
    cols = [S[tt, ii], R[tt - 1, ii], S[tt - 1, ii]]
    if prefetched is not None:  # ... + PRE[t-1,i] + LATE[t-1,i]: prefetched in stage t-1
        cols.extend(kind[tt - 1, ii] for kind in prefetched)
    coefs: list[float | np.ndarray] = [1.0, -1.0, -1.0, -1.0, -1.0]
    b.rows("1c", keys, cols, coefs[: len(cols)], -np.inf, 0)


def _memory(
    b: Builder,
    st: Structure,
    m: np.ndarray,
    fixed: float,
    R: np.ndarray,
    S: np.ndarray,
    U: np.ndarray,
    FREE: np.ndarray,
    PRE: np.ndarray | None = None,
) -> None:
    T, n = R.shape
    # (2) U[t,0] - sum_i M_i S[t,i] = fixed memory (our M_input + 2 M_param), and
    # - sum_i M_i PRE[t,i] for the prefetches reserved from the stage's start.
    init = b.rows("2", np.arange(T)[:, None], [U[:, 0]], [1], fixed, fixed)
    tt, ii = np.nonzero(S >= 0)
    b.entries(init[tt], S[tt, ii], -m[ii])
    if PRE is not None:
        tt, ii = np.nonzero(PRE >= 0)
        b.entries(init[tt], PRE[tt, ii], -m[ii])
    # (3) U[t,k+1] = U[t,k] - mem_freed_t(k-1) + M_k R[t,k], columns shifted by one (U[t,0]
    # is the start), with mem_freed (4) = sum_{i in DEPS[k-1]} M_i FREE[t,i,k-1] (4.8).
    tt, cc = np.nonzero(U[:, 1:] >= 0)
    cc = cc + 1
    kk = cc - 1
    cols = [U[tt, cc], U[tt, cc - 1], R[tt, kk]]
    rec = b.rows("3", np.stack([tt, kk], axis=1), cols, [1, -1, -m[kk]], 0, 0)
    row_of = np.full((T, n + 1), -1)
    row_of[tt, cc] = rec
    ft, fe = np.nonzero(FREE >= 0)
    # FREE[t,i,k] lowers U from column k+2 (after node k+1) on; k < t, so that row exists.
    b.entries(row_of[ft, st.edge_v[fe] + 2], FREE[ft, fe], m[st.edge_u[fe]])


def _workspace(b: Builder, R: np.ndarray, U: np.ndarray, w: np.ndarray, budget: float) -> None:
    """(9) while node k runs: U[t,k+1] + w_k R[t,k] <= budget, w_k its kernel's workspace
    in memory units, rounded up (Checkmate's temporary memory; Beaumont et al.'s ex_i)."""
    tt, kk = np.nonzero((R >= 0) & (w[None, :] > 0))
    keys = np.stack([tt, kk], axis=1)
    b.rows("9 workspace", keys, [U[tt, kk + 1], R[tt, kk]], [1, w[kk]], -np.inf, budget)


def _free(
    b: Builder,
    st: Structure,
    R: np.ndarray,
    S_next: np.ndarray,
    FREE: np.ndarray,
    OFF: np.ndarray | None = None,
) -> None:
    """(7b), (7c): FREE[t,i,k] = 1 iff num_hazards(t,i,k) = 0, where
    num_hazards = (1 - R[t,k]) + S[t+1,i] + sum_{j in USERS[i], j > k} R[t,j], and
    + OFF[t,i] with transfers (an offloaded value is released at the stage's end)."""
    ft, fe = np.nonzero(FREE >= 0)
    u, v = st.edge_u[fe], st.edge_v[fe]
    where, j = ragged(st.later_ptr, st.later_idx, fe)
    later = R[ft[where], j]
    present = later >= 0
    # kappa: the largest value num_hazards can take given which variables exist.
    kappa = 1 + (S_next[ft, u] >= 0) + np.bincount(where[present], minlength=fe.shape[0])
    offloaded = np.full(fe.shape[0], -1) if OFF is None else OFF[ft, u]
    kappa = kappa + (offloaded >= 0)
    keys = np.stack([ft, u, v], axis=1)
    cols = [FREE[ft, fe], R[ft, v], S_next[ft, u], offloaded]
    # (7b) 1 - FREE <= num_hazards  <=>  -FREE + R[t,k] - S[t+1,i] - OFF - sum R[t,j] <= 0
    rows = b.rows("7b", keys, cols, [-1, 1, -1, -1], -np.inf, 0)
    b.entries(rows[where], later, np.full(where.shape[0], -1.0))
    # (7c) kappa (1 - FREE) >= num_hazards
    #      <=>  kappa FREE - R[t,k] + S[t+1,i] + OFF + sum R[t,j] <= kappa - 1
    rows = b.rows("7c", keys, cols, [kappa, -1, 1, 1], -np.inf, kappa - 1)
    b.entries(rows[where], later, np.ones(where.shape[0]))
