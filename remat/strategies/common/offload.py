"""Offloading activations to host memory, transfers overlapping compute (Beaumont et al.,
docs/strategies.md "Offloading"): what the offloading strategies share.

The same plans page to storage (PORT) where the base's ``tier`` is ``Tier.STORAGE``:
``page_out`` and ``page_in`` on the paging lane instead of ``offload`` and ``prefetch``,
over the device's storage link. Every offloading plan here is a plan on one device
without transfers, by default
checkpoint-all (each node computed once, in the graph's order, each value freed after its
last reader; ``offload_remat`` also offloads over plans that recompute), with some
activations sent to the host and brought back: ``offload_base`` analyses that plan,
``offload_plan`` turns a set of offloaded activations into the no-wait plan of
Proposition 1, and ``offload_bound_ms`` is Proposition 3's lower bound.

An activation (a *candidate*) is a value computed before the first backward node and read
by a backward node: in Beaumont et al.'s chains, the ``x_i``. The plan of an offload set:

- forward: each offloaded activation is sent as soon as it is computed (in production
  order, one transfer at a time); its device copy is released by a ``wait`` once its
  forward readers have run, at no cost when the transfer has completed, and before a
  compute step that would not fit otherwise, which then waits for the transfer;
- between the phases, a wait for every offload still in flight;
- backward: the activations come back in the order of their first backward reader,
  each prefetched as early as the memory of every step up to its release leaves room for
  it (the no-wait, ordered schedule of section 5.2), and waited for just before that
  reader.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np

from remat.devices import Tier, format_bytes
from remat.errors import StrategyError
from remat.graph import NodeKind
from remat.plan import BRINGS, SENDS, Compute, Free, Plan, SolverInfo, Step, Wait
from remat.simulator import simulate
from remat.solvers.backend import relative_gap
from remat.strategies.baselines.checkpoint_all import checkpoint_all
from remat.strategies.common.problem import (
    Evaluation,
    Problem,
    StrategyResult,
    evaluate_plan,
    with_prediction,
)


def named(strategy: str, tier: Tier) -> str:
    """An offloading strategy's label for ``tier``: its name, or for paging the same
    algorithm as ``page_...`` (``page_greedy``, ``page_dynprog``; parts of ``port``)."""
    return strategy if tier is Tier.HOST else strategy.replace("offload_", "page_", 1)


def sending(tier: Tier) -> str:
    """What sending activations to ``tier`` is called: offloading, or paging."""
    return "offloading" if tier is Tier.HOST else "paging"


@dataclass(frozen=True)
class OffloadBase:
    """A plan on one device without transfers (checkpoint-all's by default), analysed for
    offloading. ``compute_ms``: its compute time (every node once, for checkpoint-all).

    ``memory[q]``: bytes on the device after step q, fixed memory included.
    ``boundary``: the index of the first step that computes a backward node.
    ``candidates``: the activations, in production order; for each, the step that
    computes it (``produced``), its last reader before the boundary (``last_forward``, or
    ``produced``), its first reader from the boundary on (``first_backward``) and the step
    that frees it (``freed``; the plan's length where none does). ``tier``: where the
    activations go (the host: offloading; storage: paging)."""

    device: str
    d: int
    steps: tuple[Step, ...]
    memory: np.ndarray
    boundary: int
    candidates: tuple[int, ...]
    produced: dict[int, int]
    last_forward: dict[int, int]
    first_backward: dict[int, int]
    freed: dict[int, int]
    compute_ms: float
    tier: Tier = Tier.HOST

    @property
    def peak_bytes(self) -> int:
        return int(self.memory.max(initial=0))


def offload_base(
    problem: Problem, device: str, plan: Plan | None = None, tier: Tier = Tier.HOST
) -> OffloadBase | None:
    """``plan`` (on ``device`` alone, without transfers; where None, checkpoint-all with
    unlimited memory) analysed; None where it has no valid replay. In a plan that
    recomputes, a candidate is the instance of a value that is computed before the
    boundary and still held there, read from the boundary on before it is freed. Raises
    ``StrategyError`` for offloading to the host from a device of a pool, whose memory is
    the host's."""
    refusal = problem.costs.devices[problem.costs.device_index(device)].host_offload_refusal()
    if tier is Tier.HOST and refusal is not None:
        raise StrategyError(refusal)
    if plan is None:
        unlimited = replace(problem, budgets={**problem.budgets, device: None})
        found = checkpoint_all(unlimited, device)
        if found.plan is None:
            return None
        plan = found.plan
    simulation = simulate(plan, problem.graph, problem.costs, {})
    if not simulation.valid:
        return None
    steps = plan.steps
    graph = problem.graph
    backward = [
        q
        for q, s in enumerate(steps)
        if isinstance(s, Compute) and graph.nodes[s.node].kind is NodeKind.BACKWARD
    ]
    boundary = backward[0] if backward else len(steps)
    produced: dict[int, int] = {}
    last_forward: dict[int, int] = {}
    held: set[int] = set()
    for q, step in enumerate(steps[:boundary]):
        if isinstance(step, Compute):
            produced[step.node] = q
            held.add(step.node)
            for dep in graph.nodes[step.node].deps:
                last_forward[dep] = q
        elif isinstance(step, Free):
            held.discard(step.node)
    first_backward: dict[int, int] = {}
    freed: dict[int, int] = {}
    for q, step in enumerate(steps[boundary:], boundary):
        if isinstance(step, Compute):
            for dep in graph.nodes[step.node].deps:
                if dep in held and dep not in freed:
                    first_backward.setdefault(dep, q)
        elif isinstance(step, Free) and step.node in held:
            freed.setdefault(step.node, q)
    candidates = tuple(sorted((v for v in held if v in first_backward), key=produced.__getitem__))
    for v in candidates:
        # The last forward read of this instance (an earlier instance's reads do not count).
        last_forward[v] = max(last_forward.get(v, produced[v]), produced[v])
        freed.setdefault(v, len(steps))
    return OffloadBase(
        device,
        problem.costs.device_index(device),
        steps,
        np.asarray(simulation.timeline[device], dtype=np.int64),
        boundary,
        candidates,
        produced,
        last_forward,
        first_backward,
        freed,
        simulation.compute_ms,
        tier,
    )


def offload_bound_ms(problem: Problem, base: OffloadBase) -> float:
    """Proposition 3: the base plan's compute, or the time to send the memory above the
    budget to the tier and back, whichever is longer (Proposition 2: any valid plan that
    runs the base plan's computations in its order offloads at least ``M_peak - M_GPU``)."""
    budget = problem.budgets.get(base.device)
    excess = 0 if budget is None else max(base.peak_bytes - budget, 0)
    link = problem.costs.link(base.d, base.tier)
    transfers_ms = excess * (1 / link.out_bytes_per_s + 1 / link.in_bytes_per_s) * 1e3
    return max(base.compute_ms, transfers_ms)


def offload_floor_bytes(problem: Problem, base: OffloadBase) -> int:
    """The least memory any offload set needs: every activation on the host from its last
    forward reader to its first backward reader."""
    memory = base.memory.astype(np.int64).copy()
    for v in base.candidates:
        memory[base.last_forward[v] + 1 : base.first_backward[v]] -= int(
            problem.costs.output_bytes[v]
        )
    return int(memory.max(initial=0))


def offload_result(
    problem: Problem, base: OffloadBase, strategy: str, evaluation: Evaluation
) -> StrategyResult:
    """An offloading plan the simulator accepted, with Proposition 3's bound."""
    simulation = evaluation.simulation
    total, bound = simulation.total_ms, offload_bound_ms(problem, base)
    info = SolverInfo("feasible", total, bound, relative_gap(total, bound))
    plan = replace(with_prediction(evaluation.plan, simulation), strategy=strategy, solver=info)
    sent = [s.node for s in plan.steps if isinstance(s, SENDS[base.tier])]
    nbytes = int(problem.costs.output_bytes[sent].sum()) if sent else 0
    verb = "offloads" if base.tier is Tier.HOST else "pages out"
    message = (
        f"{strategy}: {verb} {len(sent)} activations ({format_bytes(nbytes)}), "
        f"{total:.4g} ms against a bound of {bound:.4g} ms (Proposition 3)"
    )
    return StrategyResult(strategy, plan, simulation, message)


def offload_plan(
    problem: Problem, base: OffloadBase, offloaded: Collection[int], strategy: str
) -> Plan | None:
    """The no-wait plan that offloads ``offloaded`` (candidates of ``base``), as the module
    docstring describes; None where some step cannot fit the budget with this set."""
    chosen = [v for v in base.candidates if v in set(offloaded)]
    budget = problem.budgets.get(base.device)
    limit = np.inf if budget is None else budget
    forward = _forward(problem, base, chosen, limit)
    if forward is None:
        return None
    backward = _backward(problem, base, chosen, limit)
    if backward is None:
        return None
    devices = problem.plan_devices([base.device])
    return Plan(strategy, devices, (*forward, *backward))


def judged_plan(
    problem: Problem, base: OffloadBase, offloaded: Collection[int], strategy: str
) -> Evaluation | None:
    """The plan of ``offloaded`` (``offload_plan``) where the simulator accepts it under
    the problem's budgets, else None."""
    plan = offload_plan(problem, base, offloaded, strategy)
    if plan is None:
        return None
    evaluation = evaluate_plan(problem, plan)
    return evaluation if evaluation.fits else None


def _forward(
    problem: Problem, base: OffloadBase, chosen: Sequence[int], limit: float
) -> list[Step] | None:
    """The steps up to the boundary, every offload waited for at its end."""
    costs, d, device = problem.costs, base.d, base.device
    sizes = costs.output_bytes
    compute_ms = costs.compute_ms[:, d]
    offload_ms = costs.out_ms(d, base.tier)
    send = SENDS[base.tier]
    sending = set(chosen)
    in_flight: list[tuple[float, int]] = []  # (transfer end, node), in lane order
    clock = lane = 0.0
    released = 0
    steps: list[Step] = []

    def release(index: int, stage: int) -> None:
        nonlocal clock, released
        end, v = in_flight.pop(index)
        clock = max(clock, end)
        released += int(sizes[v])
        steps.append(Wait(stage, v, device))

    for q in range(base.boundary):
        step = base.steps[q]
        done = [i for i, (end, v) in enumerate(in_flight) if base.last_forward[v] < q]
        for i in reversed([i for i in done if in_flight[i][0] <= clock]):
            release(i, step.stage)  # completed: released at no cost
        while base.memory[q] - released > limit:
            ready = [i for i, (end, v) in enumerate(in_flight) if base.last_forward[v] < q]
            if not ready:
                return None
            release(ready[0], step.stage)
        steps.append(step)
        if isinstance(step, Compute):
            clock += float(compute_ms[step.node])
            if step.node in sending and base.produced[step.node] == q:
                start = max(clock, lane)
                lane = start + float(offload_ms[step.node])
                in_flight.append((lane, step.node))
                steps.append(send(step.stage, step.node, device))
    stage = base.steps[base.boundary].stage if base.boundary < len(base.steps) else 0
    while in_flight:
        release(0, stage)
    return steps


def _backward(
    problem: Problem, base: OffloadBase, chosen: Sequence[int], limit: float
) -> list[Step] | None:
    """The steps from the boundary on, each offloaded activation prefetched at the
    earliest step from which the memory up to its release leaves room for it."""
    sizes = problem.costs.output_bytes
    b, end = base.boundary, len(base.steps)
    memory = base.memory[b - 1 : end].astype(np.int64).copy() if b > 0 else None
    if memory is None:
        return list(base.steps[b:])
    # memory[k]: bytes after step b - 1 + k with the chosen activations on the host.
    for v in chosen:
        memory[: base.freed[v] - b + 1] -= int(sizes[v])
    if memory.max(initial=0) > limit:
        return None
    bring = BRINGS[base.tier]
    issue: dict[int, list[int]] = {}
    waits: dict[int, list[int]] = {}
    earliest = b
    for v in sorted(chosen, key=lambda v: base.first_backward[v]):
        use, gone = base.first_backward[v], base.freed[v]
        size = int(sizes[v])
        p = _earliest_issue(memory, b, earliest, use, gone, size, limit)
        if p is None:
            return None
        memory[p - 1 - (b - 1) : gone - b + 1] += size
        issue.setdefault(p, []).append(v)
        waits.setdefault(use, []).append(v)
        earliest = p
    steps: list[Step] = []
    for q in range(b, end):
        step = base.steps[q]
        steps.extend(bring(step.stage, v, base.device) for v in issue.get(q, ()))
        steps.extend(Wait(step.stage, v, base.device) for v in waits.get(q, ()))
        steps.append(step)
    return steps


def _earliest_issue(
    memory: np.ndarray, b: int, earliest: int, use: int, gone: int, size: int, limit: float
) -> int | None:
    """The earliest step p in [earliest, use] such that the memory from just before p up to
    the step that frees the value leaves room for it (``memory`` is indexed from step
    b - 1); None where even p = use does not."""
    window = memory[earliest - b : gone - b + 1]  # steps earliest - 1 .. gone - 1
    # The largest memory from each step on: the window shrinks as p grows.
    suffix = np.maximum.accumulate(window[::-1])[::-1]
    fits = np.flatnonzero(suffix[: use - earliest + 1] + size <= limit)
    return None if len(fits) == 0 else earliest + int(fits[0])
