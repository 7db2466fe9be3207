"""The plan: the executable instruction list (docs/architecture.md, "Plan format": version 1).

Steps are small slotted dataclasses so that plans of hundreds of thousands of steps stay
cheap to build and simulate; ``plan_to_json``/``plan_from_json`` convert to and from the
JSON document, with a clear error for a malformed one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remat.devices import Device, DeviceKind
from remat.errors import InvalidInputError

PLAN_VERSION = 1


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


Step = Compute | Copy | Free


@dataclass(frozen=True)
class PlanDevice:
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
    version: int = PLAN_VERSION

    @property
    def budgets(self) -> dict[str, int | None]:
        return {d.name: d.budget_bytes for d in self.devices}


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
    if plan.predicted is not None:
        p = plan.predicted
        document["predicted"] = {
            "total_ms": p.total_ms,
            "compute_ms": p.compute_ms,
            "copy_ms": p.copy_ms,
            "peak_bytes": dict(p.peak_bytes),
        }
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
    if version != PLAN_VERSION:
        raise InvalidInputError(f"plan: unsupported version {version!r} (expected 1)")
    devices = tuple(_device(d, i) for i, d in enumerate(_list(document, "devices")))
    steps = tuple(_step(s, i) for i, s in enumerate(_list(document, "steps")))
    strategy = document.get("strategy")
    if not isinstance(strategy, str):
        raise InvalidInputError("plan: 'strategy' must be a string")
    predicted = _predicted(document.get("predicted"))
    solver = document.get("solver")
    solver_info = SolverInfo(**solver) if isinstance(solver, Mapping) else None
    return Plan(strategy, devices, steps, predicted, solver_info)


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


def _step(raw: Any, index: int) -> Step:
    where = f"plan: steps[{index}]"
    if not isinstance(raw, Mapping):
        raise InvalidInputError(f"{where}: expected an object")
    op = raw.get("op")
    if not isinstance(op, str) or op not in _STEP_FIELDS:
        raise InvalidInputError(f"{where}: unknown op {op!r}")
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
}
_STEP_TYPES: dict[str, type] = {"compute": Compute, "copy": Copy, "free": Free}


def _predicted(raw: Any) -> Predicted | None:
    if not isinstance(raw, Mapping):
        return None
    try:
        return Predicted(
            float(raw["total_ms"]),
            float(raw["compute_ms"]),
            float(raw["copy_ms"]),
            {str(k): int(v) for k, v in raw["peak_bytes"].items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        raise InvalidInputError("plan: 'predicted' is malformed") from None
