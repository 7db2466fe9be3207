"""The plan: the executable instruction list (docs/architecture.md, "Plan format").

Version 1 has the steps of one sequential lane: ``compute``, ``copy`` and ``free``.
Version 2 adds transfers between a device and its host memory that run on the device's
transfer lane, concurrently with compute (Beaumont et al., assumptions (B)-(E)):
``offload`` starts sending a tensor to the host, ``prefetch`` starts bringing it back, and
``wait`` holds the compute lane until a transfer has completed. Version 3 adds paging to
the node's storage (PORT), on a second lane per device with the same rules: ``page_out``
and ``page_in``, ended by a ``wait`` too. Version 4 marks a plan ``concurrent`` (PORT-M,
devices sharing one memory): its consecutive ``compute`` steps run at once, each device
its own in plan order, and every other step waits until they have ended (``Plan``).
Version 5 pages fixed tensors too (parameters and model inputs, and the parameters'
gradient buffers), on the paging lane, so that a plan needs less than their whole size: a
fixed tensor named by a step of version 5 starts the plan in the node's storage, is read in
by ``fixed_in`` (readable after ``fixed_wait``) and dropped by ``fixed_free`` (storage keeps
it: fixed tensors do not change during a step); its gradient buffer is allocated by the
first backward node that writes it, and ``grad_out`` writes it to storage, released by a
``grad_wait``. Each
version's plans are plans of the next and mean what they meant; a plan is written as the
lowest version that holds it.

Steps are small slotted dataclasses so that plans of hundreds of thousands of steps stay
cheap to build and simulate; ``plan_to_json``/``plan_from_json`` convert to and from the
JSON document, with a clear error for a malformed one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from remat.devices import Device, DeviceKind, MemoryOptions, Tier
from remat.errors import InvalidInputError
from remat.graph import Fingerprint

PLAN_VERSION = 5  # the latest; a plan is written as the lowest version that holds it
VERSIONS = (1, 2, 3, 4, 5)
FIXED_OPS = frozenset({"fixed_in", "fixed_free", "fixed_wait", "grad_out", "grad_wait"})
"""The step kinds of version 5, which page fixed tensors and gradient buffers: each names a
fixed tensor (``tensor``), not a node."""
TRANSFER_OPS = frozenset({"offload", "prefetch", "page_out", "page_in", "wait"}) | FIXED_OPS
"""The step kinds on transfer lanes: refused in a version-1 document."""
PAGE_OPS = frozenset({"page_out", "page_in"})
"""The step kinds of version 3: refused in a version-1 or -2 document."""
TRANSFER_STARTS = TRANSFER_OPS - {"wait", "fixed_wait", "grad_wait", "fixed_free"}
"""The step kinds that start a transfer on a lane."""


@dataclass(frozen=True, slots=True)
class Compute:
    stage: int
    node: int
    device: str
    op: str = field(default="compute", init=False)


@dataclass(frozen=True, slots=True)
class Copy:
    stage: int
    node: int
    src: str
    dst: str
    op: str = field(default="copy", init=False)


@dataclass(frozen=True, slots=True)
class Free:
    stage: int
    node: int
    device: str
    op: str = field(default="free", init=False)


@dataclass(frozen=True, slots=True)
class Offload:
    """Start sending ``node``'s tensor from ``device`` to its host on the device's transfer
    lane. The device copy stays readable and counted until a ``wait`` for it."""

    stage: int
    node: int
    device: str
    op: str = field(default="offload", init=False)
    tier: ClassVar[Tier] = Tier.HOST


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Start bringing ``node``'s tensor back from the host to ``device`` on the device's
    transfer lane; its memory is reserved when the transfer starts, and it is readable
    after a ``wait`` for it."""

    stage: int
    node: int
    device: str
    op: str = field(default="prefetch", init=False)
    tier: ClassVar[Tier] = Tier.HOST


@dataclass(frozen=True, slots=True)
class PageOut:
    """Start writing ``node``'s tensor from ``device``'s memory to the node's storage on
    the device's paging lane. The device copy stays readable and counted until a ``wait``
    for it: its memory is released once the write has completed."""

    stage: int
    node: int
    device: str
    op: str = field(default="page_out", init=False)
    tier: ClassVar[Tier] = Tier.STORAGE


@dataclass(frozen=True, slots=True)
class PageIn:
    """Start reading ``node``'s tensor back from storage to ``device`` on the device's
    paging lane; its memory is reserved when the read starts, and it is readable after a
    ``wait`` for it."""

    stage: int
    node: int
    device: str
    op: str = field(default="page_in", init=False)
    tier: ClassVar[Tier] = Tier.STORAGE


@dataclass(frozen=True, slots=True)
class Wait:
    """Hold the compute lane until the transfer of ``node`` on ``device`` (on either of
    its lanes) has completed: after an offload or a page-out the device copy is released,
    after a prefetch or a page-in the tensor is readable."""

    stage: int
    node: int
    device: str
    op: str = field(default="wait", init=False)


@dataclass(frozen=True, slots=True)
class FixedIn:
    """Start reading fixed tensor ``tensor`` from the node's storage to ``device`` on its
    paging lane; its memory is reserved when the read starts, and it is readable after a
    ``fixed_wait``."""

    stage: int
    tensor: str
    device: str
    op: str = field(default="fixed_in", init=False)


@dataclass(frozen=True, slots=True)
class FixedWait:
    """Hold the compute lane until ``tensor``'s ``fixed_in`` on ``device`` has completed."""

    stage: int
    tensor: str
    device: str
    op: str = field(default="fixed_wait", init=False)


@dataclass(frozen=True, slots=True)
class FixedFree:
    """Release ``tensor``'s copy on ``device`` (its value stays in storage)."""

    stage: int
    tensor: str
    device: str
    op: str = field(default="fixed_free", init=False)


@dataclass(frozen=True, slots=True)
class GradOut:
    """Start writing ``tensor``'s gradient buffer on ``device`` to the node's storage on the
    paging lane, once every backward node that writes it has run; the buffer stays counted
    until a ``grad_wait``, and the gradient ends the plan in storage."""

    stage: int
    tensor: str
    device: str
    op: str = field(default="grad_out", init=False)


@dataclass(frozen=True, slots=True)
class GradWait:
    """Hold the compute lane until ``tensor``'s ``grad_out`` on ``device`` has completed,
    then release the buffer."""

    stage: int
    tensor: str
    device: str
    op: str = field(default="grad_wait", init=False)


FixedStep = FixedIn | FixedWait | FixedFree | GradOut | GradWait
NodeStep = Compute | Copy | Free | Offload | Prefetch | PageOut | PageIn | Wait
Step = NodeStep | FixedStep
SENDS: dict[Tier, type[Offload] | type[PageOut]] = {Tier.HOST: Offload, Tier.STORAGE: PageOut}
"""The step that sends a tensor from a device to each tier."""
BRINGS: dict[Tier, type[Prefetch] | type[PageIn]] = {Tier.HOST: Prefetch, Tier.STORAGE: PageIn}
"""The step that brings a tensor back from each tier."""


@dataclass(frozen=True)
class PlanDevice(MemoryOptions):
    name: str
    kind: DeviceKind
    budget_bytes: int | None
    options: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, device: Device, budget_bytes: int | None) -> PlanDevice:
        return cls(device.name, device.kind, budget_bytes, dict(device.options))


@dataclass(frozen=True)
class Predicted:
    total_ms: float
    compute_ms: float
    copy_ms: float
    peak_bytes: dict[str, int]
    transfer_ms: float = 0.0  # time the transfer lanes are busy, overlapped with compute
    energy_mj: float | None = None  # remat.energy; None in plans written before energy


@dataclass(frozen=True)
class SolverInfo:
    status: str
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class Plan:
    strategy: str
    devices: tuple[PlanDevice, ...]
    steps: tuple[Step, ...]
    predicted: Predicted | None = None
    solver: SolverInfo | None = None
    version: int = 0
    """1 to 5, at least the lowest that holds the plan (5 where a step pages a fixed
    tensor, 4 where it is concurrent, 3 where any step pages, 2 where any other is a
    transfer, else 1), which 0 (the default) and
    any lower value become, so that agents that read an earlier version execute every
    plan it holds."""
    concurrent: bool = False
    """Version 4 (PORT-M): a run of consecutive ``compute`` steps is one section, whose
    steps run at once across devices. Each device runs its steps of a section in plan
    order, each as soon as its device is free and the inputs computed earlier in the
    section have been; a step of any other kind starts once every compute before it has
    ended. Memory after each step is as in plan order (a section only allocates), so the
    plan-order peak holds; the kernels' workspaces of a section may overlap."""
    graph: Fingerprint | None = None
    """The graph the plan was made for (``run_strategy`` records it): the simulator, and
    so ``remat check`` and the agents, refuse the plan on a graph of another structure.
    None in plans from before it was recorded, which are checked step by step alone."""

    def __post_init__(self) -> None:
        ops = {step.op for step in self.steps}
        need = 3 if ops & PAGE_OPS else 2 if ops & TRANSFER_OPS else 1
        need = 4 if self.concurrent else need
        need = 5 if ops & FIXED_OPS else need
        if self.version < need:  # also a plan replaced into a later version's
            object.__setattr__(self, "version", need)

    @property
    def budgets(self) -> dict[str, int | None]:
        return {d.name: d.budget_bytes for d in self.devices}

    @property
    def transfers(self) -> bool:
        """Whether any step runs on a transfer lane (offload, prefetch, paging, wait)."""
        return any(step.op in TRANSFER_OPS for step in self.steps)

    @property
    def pages(self) -> bool:
        """Whether any step pages to storage (activations or fixed tensors)."""
        return any(step.op in PAGE_OPS or step.op in FIXED_OPS for step in self.steps)

    @property
    def paged_fixed(self) -> frozenset[str]:
        """The fixed tensors the plan pages (version 5): they start it in storage."""
        return frozenset(step.tensor for step in self.steps if isinstance(step, FixedStep))


# --- JSON -------------------------------------------------------------------------------


def _step_to_json(step: Step) -> dict[str, Any]:
    if isinstance(step, Copy):
        return {
            "stage": step.stage,
            "op": "copy",
            "node": step.node,
            "from": step.src,
            "to": step.dst,
        }
    if isinstance(step, FixedStep):
        return {"stage": step.stage, "op": step.op, "tensor": step.tensor, "device": step.device}
    return {"stage": step.stage, "op": step.op, "node": step.node, "device": step.device}


def plan_to_json(plan: Plan) -> dict[str, Any]:
    document: dict[str, Any] = {
        "version": plan.version,
        "strategy": plan.strategy,
        "devices": [
            {"name": d.name, "kind": d.kind.value, "budget_bytes": d.budget_bytes}
            | ({"options": d.options} if d.options else {})
            for d in plan.devices
        ],
        "steps": [_step_to_json(s) for s in plan.steps],
    }
    if plan.concurrent:
        document["concurrent"] = True
    if plan.graph is not None:
        document["graph"] = {"nodes": plan.graph.nodes, "digest": plan.graph.digest}
    if plan.predicted is not None:
        p = plan.predicted
        document["predicted"] = {
            "total_ms": p.total_ms,
            "compute_ms": p.compute_ms,
            "copy_ms": p.copy_ms,
            "peak_bytes": dict(p.peak_bytes),
        } | ({"transfer_ms": p.transfer_ms} if p.transfer_ms else {})
        if p.energy_mj is not None:
            document["predicted"]["energy_mj"] = p.energy_mj
    if plan.solver is not None:
        s = plan.solver
        document["solver"] = {
            "status": s.status,
            "objective": s.objective,
            "bound": s.bound,
            "gap": s.gap,
            "seconds": s.seconds,
        }
    return document


def plan_from_json(document: Any) -> Plan:
    """Parse a plan document; InvalidInputError names the first malformed field."""
    if not isinstance(document, Mapping):
        raise InvalidInputError("plan: expected a JSON object")
    version = document.get("version")
    if isinstance(version, bool) or version not in VERSIONS:
        raise InvalidInputError(f"plan: unsupported version {version!r} (expected 1 to 5)")
    concurrent = document.get("concurrent", False)
    if not isinstance(concurrent, bool):
        raise InvalidInputError("plan: 'concurrent' must be true or false")
    if concurrent and version < 4:
        raise InvalidInputError(f"plan: 'concurrent' needs plan version 4 (this plan is {version})")
    devices = tuple(_device(d, i) for i, d in enumerate(_list(document, "devices")))
    steps = tuple(_step(s, i, version) for i, s in enumerate(_list(document, "steps")))
    strategy = document.get("strategy")
    if not isinstance(strategy, str):
        raise InvalidInputError("plan: 'strategy' must be a string")
    predicted = _predicted(document.get("predicted"))
    solver = document.get("solver")
    solver_info = SolverInfo(**solver) if isinstance(solver, Mapping) else None
    graph = _fingerprint(document.get("graph"))
    return Plan(strategy, devices, steps, predicted, solver_info, version, concurrent, graph)


def _fingerprint(raw: Any) -> Fingerprint | None:
    if raw is None:
        return None
    nodes = raw.get("nodes") if isinstance(raw, Mapping) else None
    digest = raw.get("digest") if isinstance(raw, Mapping) else None
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 0:
        raise InvalidInputError("plan: 'graph' must hold 'nodes', a count of nodes, and 'digest'")
    if not isinstance(digest, str) or not digest:
        raise InvalidInputError("plan: 'graph.digest' must be a non-empty string")
    return Fingerprint(nodes, digest)


def load_plan(path: str | Path) -> Plan:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidInputError(f"plan {path}: {exc.strerror}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"plan {path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    return plan_from_json(document)


def _list(document: Mapping[str, Any], key: str) -> list[Any]:
    value = document.get(key)
    if not isinstance(value, list):
        raise InvalidInputError(f"plan: {key!r} must be a list")
    return value


def _device(raw: Any, index: int) -> PlanDevice:
    where = f"plan: devices[{index}]"
    if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
        raise InvalidInputError(f"{where}: expected an object with a 'name'")
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in {k.value for k in DeviceKind}:
        raise InvalidInputError(f"{where}: unknown kind {kind!r}")
    budget = raw.get("budget_bytes")
    if budget is not None and (not isinstance(budget, int) or budget < 0):
        raise InvalidInputError(f"{where}: budget_bytes must be a non-negative integer")
    options = raw.get("options") or {}
    return PlanDevice(
        raw["name"], DeviceKind(kind), budget, {str(k): str(v) for k, v in options.items()}
    )


def _step(raw: Any, index: int, version: int) -> Step:
    where = f"plan: steps[{index}]"
    if not isinstance(raw, Mapping):
        raise InvalidInputError(f"{where}: expected an object")
    op = raw.get("op")
    if not isinstance(op, str) or op not in _STEP_FIELDS:
        raise InvalidInputError(f"{where}: unknown op {op!r}")
    need = 5 if op in FIXED_OPS else 3 if op in PAGE_OPS else 2 if op in TRANSFER_OPS else 1
    if version < need:
        raise InvalidInputError(
            f"{where}: op {op!r} needs plan version {need} (this plan is {version})"
        )
    fields = _STEP_FIELDS[op]
    values = []
    for name, kind in fields:
        value = raw.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise InvalidInputError(f"{where}: {name!r} must be {kind.__name__}")
        values.append(value)
    return _STEP_TYPES[op](*values)


_STEP_FIELDS: dict[str, list[tuple[str, type]]] = {
    "compute": [("stage", int), ("node", int), ("device", str)],
    "copy": [("stage", int), ("node", int), ("from", str), ("to", str)],
    "free": [("stage", int), ("node", int), ("device", str)],
    "offload": [("stage", int), ("node", int), ("device", str)],
    "prefetch": [("stage", int), ("node", int), ("device", str)],
    "page_out": [("stage", int), ("node", int), ("device", str)],
    "page_in": [("stage", int), ("node", int), ("device", str)],
    "wait": [("stage", int), ("node", int), ("device", str)],
} | {op: [("stage", int), ("tensor", str), ("device", str)] for op in FIXED_OPS}
_STEP_TYPES: dict[str, type] = {
    "compute": Compute,
    "copy": Copy,
    "free": Free,
    "offload": Offload,
    "prefetch": Prefetch,
    "page_out": PageOut,
    "page_in": PageIn,
    "wait": Wait,
    "fixed_in": FixedIn,
    "fixed_wait": FixedWait,
    "fixed_free": FixedFree,
    "grad_out": GradOut,
    "grad_wait": GradWait,
}


def _predicted(raw: Any) -> Predicted | None:
    if not isinstance(raw, Mapping):
        return None
    try:
        return Predicted(
            float(raw["total_ms"]),
            float(raw["compute_ms"]),
            float(raw["copy_ms"]),
            {str(k): int(v) for k, v in raw["peak_bytes"].items()},
            float(raw.get("transfer_ms", 0.0)),
            None if raw.get("energy_mj") is None else float(raw["energy_mj"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        raise InvalidInputError("plan: 'predicted' is malformed") from None
