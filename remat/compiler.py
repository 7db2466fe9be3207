"""The plan compiler: Checkmate Algorithm 1, generalised to several devices and copies.

A row-major scan of R (stage t, then node k, then device d) emits ``compute`` steps; a
dependency that is not resident on the computing device is copied from the device where
copying it is cheapest (XEngine eq. 12: a value computed or saved on any device may be
used after a copy). Frees follow Checkmate eq. 5:

    FREE[d,t,i,k] = R[d,t,k] * (1 - S[d,t+1,i]) * prod_{j in USERS[i], j > k} (1 - R[t,j])

i.e. right after k is evaluated, each value i in DEPS[k] ∪ {k} is freed on every device
holding it unless it is checkpointed there for the next stage or a later node of this stage
(on any device, since it may copy from here) still reads it. Model outputs in inference are
never freed. As Checkmate section 4.9 suggests, checkpoints that no node of a stage reads
and that are not kept for the next stage are freed at the start of the stage.

Devices that share a memory pool (option ``pool`` on the plan's devices) hold one set of
tensors: a value on the pool is resident for each of them, read without a copy, kept while
any of them keeps it (S), and freed once. A ``concurrent`` plan (PORT-M) frees nothing
inside a stage, only before its computes and after them, so that each stage's computes
are one section that its devices run at once (``remat.plan.Plan.concurrent``): its memory
is the stage's checkpoints plus every value it computes, PORT-M's stage memory.

With ``transfers`` (one device, or the devices of one pool: the offloads OFF[t,i],
prefetches PRE[t,i] and late prefetches LATE[t,i] of ``remat.formulations.checkmate`` with
transfers, or the page-outs and page-ins of ``remat.formulations.xengine`` with paging), a
stage starts by offloading, then prefetching, its values and ends with a wait for each,
then prefetches and waits for its late ones: an offloaded value is not freed inside the
stage (its wait releases it), a prefetched one is resident from its wait. A pool's
transfers run on its first device's lane; in a concurrent plan they run beside the stage's
section.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from remat.costs import CostModel
from remat.devices import Tier
from remat.errors import ScheduleError
from remat.graph import Graph
from remat.plan import BRINGS, SENDS, Compute, Copy, Free, Plan, PlanDevice, Step, Wait
from remat.schedule import Schedule


def compile_plan(
    graph: Graph,
    schedule: Schedule,
    devices: Sequence[PlanDevice],
    strategy: str,
    costs: CostModel | None = None,
    transfers: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    tier: Tier = Tier.HOST,
    concurrent: bool = False,
) -> Plan:
    """The plan of ``schedule`` (the module docstring); with ``transfers``, its sends to
    and returns from ``tier`` (offloads and prefetches, or page-outs and page-ins);
    ``concurrent``, its stages' computes run at once across devices."""
    names = tuple(d.name for d in devices)
    if set(schedule.devices) - set(names):
        raise ScheduleError(f"schedule uses devices {schedule.devices}, plan has {names}")
    pools = {d.name: d.memory_space for d in devices}
    if transfers is None:
        emitter = _Emitter(graph, schedule, costs, pools, concurrent)
    else:
        if len({pools.get(name, name) for name in schedule.devices}) != 1:
            raise ScheduleError("transfers to another tier are compiled on one device or pool")
        emitter = _TransferEmitter(graph, schedule, costs, pools, *transfers, tier, concurrent)
    for t in range(schedule.stages):
        emitter.stage(t)
    return Plan(strategy, tuple(devices), tuple(emitter.steps), concurrent=concurrent)


class _Emitter:
    def __init__(
        self,
        graph: Graph,
        schedule: Schedule,
        costs: CostModel | None,
        pools: Mapping[str, str],
        concurrent: bool = False,
    ) -> None:
        self.graph = graph
        self.concurrent = concurrent
        self.schedule = schedule
        self.devices = schedule.devices
        spaces = [pools.get(name, name) for name in self.devices]
        # shared[d, e]: devices d and e hold one set of tensors (one pool, or d = e)
        self.shared = np.array([[a == b for b in spaces] for a in spaces], dtype=bool)
        # lead[d]: d is the first device of its pool, which emits its frees
        self.lead = np.array([spaces.index(a) == d for d, a in enumerate(spaces)], dtype=bool)
        self.users = graph.users()
        n = len(graph)
        self.keep = np.zeros(n, dtype=bool)
        self.keep[list(graph.outputs)] = True
        self.resident = np.zeros((len(self.devices), n), dtype=bool)
        self.none_saved = np.zeros(n, dtype=bool)
        self.steps: list[Step] = []
        self.copy_ms = self._copy_matrix(costs)
        self._saved: tuple[int, np.ndarray] = (-1, np.zeros(0, dtype=bool))

    def _copy_matrix(self, costs: CostModel | None) -> np.ndarray | None:
        if costs is None:
            return None
        order = [costs.device_index(name) for name in self.devices]
        return costs.copy_ms[:, order][:, :, order]

    def stage(self, t: int) -> None:
        R = self.schedule.R
        computed = np.any(R[:, t], axis=0)  # per node
        order = [int(k) for k in np.flatnonzero(computed)]
        read = np.zeros_like(computed)
        for k in order:
            read[list(self.graph.nodes[k].deps)] = True
        self._check_checkpoints(t)
        # Checkpoints nobody reads in this stage and nobody keeps go first (section 4.9).
        self._free_where(t, ~read & ~computed)
        for k in order:
            for d in np.flatnonzero(R[:, t, k]):
                self._compute(t, k, int(d))
            if not self.concurrent:
                self._free_after(t, k, computed)
        # The schedule is the authority on what survives a stage: anything left that is not
        # saved for the next one (e.g. a copy-source replica) is freed at the stage's end.
        self._free_where(t, np.ones_like(computed))

    def _saved_next(self, t: int) -> np.ndarray:
        """Per device, the values kept into stage t + 1 on it or on a device of its pool
        (computed once per stage: the compile asks for it at every free)."""
        if self._saved[0] != t:
            S = self.schedule.S
            saved = S[:, t + 1] if t + 1 < self.schedule.stages else np.zeros_like(S[:, 0])
            self._saved = (t, (self.shared.astype(np.int64) @ saved.astype(np.int64)) > 0)
        return self._saved[1]

    def _check_checkpoints(self, t: int) -> None:
        unavailable = self.schedule.S[:, t] & ~self.resident
        if unavailable.any():
            d, i = (int(x) for x in np.argwhere(unavailable)[0])
            raise ScheduleError(
                f"stage {t}: S keeps node {i} on {self.devices[d]} but it is not resident there"
            )

    def _free_where(self, t: int, candidates: np.ndarray) -> None:
        doomed = self.resident & candidates[None, :] & ~self.keep & ~self._saved_next(t)
        doomed &= self.lead[:, None]
        if doomed.any():
            for d, i in np.argwhere(doomed):
                self._emit_free(t, int(i), int(d))

    def _compute(self, t: int, k: int, d: int) -> None:
        if self.resident[d, k]:
            return  # recomputing a resident value is a no-op (R and S both set)
        for dep in self.graph.nodes[k].deps:
            if not self.resident[d, dep]:
                self._copy_in(t, dep, d)
        self.steps.append(Compute(t, k, self.devices[d]))
        self.resident[self.shared[d], k] = True

    def _copy_in(self, t: int, node: int, d: int) -> None:
        sources = [int(s) for s in np.flatnonzero(self.resident[:, node])]
        if not sources:
            raise ScheduleError(
                f"stage {t}: node {node} is needed on {self.devices[d]} but is resident nowhere"
            )
        if (copy_ms := self.copy_ms) is not None:
            sources.sort(key=lambda s: copy_ms[node, s, d])
        self.steps.append(Copy(t, node, self.devices[sources[0]], self.devices[d]))
        self.resident[self.shared[d], node] = True

    def _free_after(self, t: int, k: int, computed: np.ndarray) -> None:
        saved_next = self._saved_next(t)
        for i in (*self.graph.nodes[k].deps, k):
            if self.keep[i] or any(computed[j] for j in self.users[i] if j > k):
                continue
            for d in np.flatnonzero(self.resident[:, i] & ~saved_next[:, i] & self.lead):
                self._emit_free(t, i, int(d))

    def _emit_free(self, t: int, i: int, d: int) -> None:
        self.steps.append(Free(t, i, self.devices[d]))
        self.resident[self.shared[d], i] = False


class _TransferEmitter(_Emitter):
    """One device's (or one pool's) stages with transfers to and from ``tier`` around
    them: ``off[t, i]`` sends value i during stage t, ``pre[t, i]`` brings it back,
    ``late[t, i]`` at its end (the module docstring)."""

    def __init__(
        self,
        graph: Graph,
        schedule: Schedule,
        costs: CostModel | None,
        pools: Mapping[str, str],
        off: np.ndarray,
        pre: np.ndarray,
        late: np.ndarray,
        tier: Tier,
        concurrent: bool = False,
    ) -> None:
        super().__init__(graph, schedule, costs, pools, concurrent)
        self.off, self.pre, self.late = off, pre, late
        self.send, self.bring = SENDS[tier], BRINGS[tier]
        self.leaving: set[int] = set()
        self.device = self.devices[0]

    def stage(self, t: int) -> None:
        # A value brought back that no device keeps into the next stage would be read by
        # nobody, and one brought during the stage need not come again at its end: such
        # transfers are not emitted (a model may choose them where they cost nothing).
        kept = self._saved_next(t)[0]
        sent = [int(i) for i in np.flatnonzero(self.off[t])]
        fetched = [int(i) for i in np.flatnonzero(self.pre[t] & kept)]
        for i in sent:
            if not self.resident[0, i]:
                raise ScheduleError(f"stage {t}: sends node {i}, which is not resident")
            self.steps.append(self.send(t, i, self.device))
            self.leaving.add(i)
        self.steps.extend(self.bring(t, i, self.device) for i in fetched)
        super().stage(t)
        for i in sent:
            self.steps.append(Wait(t, i, self.device))
            self.leaving.discard(i)
            self.resident[:, i] = False
        for i in fetched:
            self.steps.append(Wait(t, i, self.device))
            self.resident[:, i] = True
        last = [int(i) for i in np.flatnonzero(self.late[t] & kept & ~self.pre[t])]
        self.steps.extend(self.bring(t, i, self.device) for i in last)
        for i in last:
            self.steps.append(Wait(t, i, self.device))
            self.resident[:, i] = True

    def _emit_free(self, t: int, i: int, d: int) -> None:
        if i in self.leaving:
            return  # its wait at the stage's end releases it
        super()._emit_free(t, i, d)
