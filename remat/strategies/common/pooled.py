"""A memory pool planned as one device.

A value held on a pool is held once, wherever it was computed, so the pool's memory is one
device's, and a copy between its devices costs nothing. A one-device strategy therefore
plans the pool on one of its devices, the *anchor* (the one with the least total compute
time, whose per-step overheads most of the plan pays), with each node's time its fastest
device's in the pool (``as_one_device``); the plan then computes each node on that device
(``rehomed``), in the same order and with the same memory, its transfers on the anchor's
lanes. Greedy eviction (``evict.evict_pooled``) and ``port_m``'s paging on the pool plan
this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from remat.plan import Compute
from remat.strategies.common.problem import Problem, StrategyResult, evaluate_plan, with_prediction


@dataclass(frozen=True)
class OneDevice:
    """The pool ``names`` as its ``anchor``: ``problem`` is the pool's with the anchor's
    node times each node's fastest device's; ``home[i]`` indexes node i's device."""

    problem: Problem
    names: tuple[str, ...]
    anchor: str
    home: np.ndarray

    @property
    def used(self) -> tuple[str, ...]:
        """The devices the rehomed plans compute on, and the anchor, in pool order."""
        on = {self.names[int(h)] for h in np.unique(self.home)} | {self.anchor}
        return tuple(name for name in self.names if name in on)

    def label(self) -> str:
        """How a message names the plan's devices: ``cpu0 alone``, or ``cpu0+gpu0 as one
        device``."""
        used = self.used
        return f"{used[0]} alone" if len(used) == 1 else f"{'+'.join(used)} as one device"


def as_one_device(problem: Problem, names: Sequence[str]) -> OneDevice:
    """The pool of ``names`` (devices of one memory pool) as one device (the module
    docstring)."""
    costs = problem.costs
    columns = np.array([costs.device_index(name) for name in names])
    times = costs.compute_ms[:, columns]
    home = np.argmin(times, axis=1)
    anchor = names[int(times.sum(axis=0).argmin())]
    compute = costs.compute_ms.copy()
    compute[:, costs.device_index(anchor)] = times[np.arange(len(home)), home]
    one = replace(problem, costs=replace(costs, compute_ms=compute))
    return OneDevice(one, tuple(names), anchor, home)


def rehomed(one: OneDevice, problem: Problem, found: StrategyResult) -> StrategyResult:
    """``found`` (a plan on the anchor of ``one``) with each computation on its node's
    device of the pool, judged by the simulator on ``problem`` (the pool's own costs),
    its message naming the devices; without a plan, ``found`` with that message."""
    if found.plan is None:
        return replace(found, message=f"{one.label()}: {found.message}")
    steps = tuple(
        replace(step, device=one.names[int(one.home[step.node])])
        if isinstance(step, Compute)
        else step
        for step in found.plan.steps
    )
    plan = replace(found.plan, devices=problem.plan_devices(one.used), steps=steps)
    evaluation = evaluate_plan(problem, plan)
    if not evaluation.fits:  # the same memory: only a plan the pool cannot run fails here
        why = f"{one.label()}: {found.message}; on the pool: {evaluation.simulation.violation}"
        return StrategyResult(found.strategy, None, None, why)
    plan = with_prediction(plan, evaluation.simulation)
    return replace(
        found,
        plan=plan,
        simulation=evaluation.simulation,
        message=f"{one.label()}: {found.message}",
        schedule=None,
    )
