"""A plan as stage matrices, for drawing (XEngine figure 3): per device, which nodes are
computed in each stage (R) and which values are resident when the stage starts (S); and
its transfers to and from host memory and storage as spans of steps, on each device's
transfer lanes.

Derived from the plan's steps alone, so it works for every strategy, stitched plans
included: a compute puts its value on its device, a copy on the destination, a prefetch
or a page-in brings it back, a free removes it, and so does the wait that completes an
offload or a page-out. A paged fixed tensor's reads (``fixed_in``) and its gradient's
writes (``grad_out``, plan version 5) are spans of the paging lane too, named by the
tensor. Pairs are sparse (stage, node) lists: a 1,000-node graph's dense matrices
would hold millions of cells per device.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.plan import (
    Compute,
    Copy,
    FixedIn,
    FixedWait,
    Free,
    GradOut,
    GradWait,
    Offload,
    PageIn,
    PageOut,
    Plan,
    Prefetch,
    Wait,
)
from remat.simulator import Key

Cell = tuple[int, int]  # (stage, node)


@dataclass(frozen=True)
class StageMatrices:
    stages: int
    R: dict[str, list[Cell]]  # computed on the device in the stage
    S: dict[str, list[Cell]]  # resident on the device when the stage starts


@dataclass(frozen=True)
class TransferSpan:
    """A transfer on a device's lane: from the step that issues it to the step of the
    wait that ends it (the plan's last step where none does). ``node`` is None where it
    moves a fixed tensor (``tensor``) or its gradient."""

    node: int | None
    kind: str  # "offload", "prefetch", "page_out", "page_in", "fixed_in" or "grad_out"
    issued: int
    done: int
    tensor: str | None = None


def transfer_spans(plan: Plan) -> dict[str, list[TransferSpan]]:
    """Every transfer of ``plan`` by device, in the order the lanes run them."""
    spans: dict[str, list[TransferSpan]] = {d.name: [] for d in plan.devices}
    open_: dict[tuple[str, Key], tuple[str, int]] = {}
    for index, step in enumerate(plan.steps):
        key: Key
        if isinstance(step, Offload | Prefetch | PageOut | PageIn | Wait):
            key = step.node
        elif isinstance(step, FixedIn | FixedWait):
            key = ("param", step.tensor)
        elif isinstance(step, GradOut | GradWait):
            key = ("grad", step.tensor)
        else:
            continue
        if not isinstance(step, Wait | FixedWait | GradWait):
            open_[(step.device, key)] = (step.op, index)
        elif (step.device, key) in open_:
            kind, issued = open_.pop((step.device, key))
            spans[step.device].append(_span(key, kind, issued, index))
    last = len(plan.steps) - 1
    for (device, key), (kind, issued) in open_.items():
        spans[device].append(_span(key, kind, issued, last))
    for device in spans:
        spans[device].sort(key=lambda span: span.issued)
    return spans


def _span(key: Key, kind: str, issued: int, done: int) -> TransferSpan:
    if isinstance(key, tuple):
        return TransferSpan(None, kind, issued, done, key[1])
    return TransferSpan(key, kind, issued, done)


def stage_matrices(plan: Plan) -> StageMatrices:
    names = [d.name for d in plan.devices]
    R: dict[str, list[Cell]] = {name: [] for name in names}
    S: dict[str, list[Cell]] = {name: [] for name in names}
    resident: dict[str, set[int]] = {name: set() for name in names}
    leaving: dict[str, set[int]] = {name: set() for name in names}
    stage = -1
    for step in plan.steps:
        while stage < step.stage:  # entering a new stage: what it starts with
            stage += 1
            for name in names:
                S[name].extend((stage, node) for node in sorted(resident[name]))
        if isinstance(step, Compute):
            R[step.device].append((stage, step.node))
            resident[step.device].add(step.node)
        elif isinstance(step, Copy):
            resident[step.dst].add(step.node)
        elif isinstance(step, Free):
            resident[step.device].discard(step.node)
        elif isinstance(step, Offload | PageOut):
            leaving[step.device].add(step.node)
        elif isinstance(step, Prefetch | PageIn):
            resident[step.device].add(step.node)
        elif isinstance(step, Wait) and step.node in leaving[step.device]:
            leaving[step.device].discard(step.node)
            resident[step.device].discard(step.node)
    return StageMatrices(stage + 1, R, S)
