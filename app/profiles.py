"""Profiles: measured cost tables from a node's agent, keyed by what was measured (the
model's bytes, mode, input shapes and the node's device definitions)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.schemas import JobSpec
from app.tables import AgentTaskRow, ModelRow, NodeRow, ProfileRow
from app.task_queue import active_task
from remat.agent_protocol import AgentDevice, LossSpec, ModelRef, ProfilePayload, TaskKind
from remat.costs import CostTable, profiled_costs
from remat.errors import InvalidInputError
from remat.graph import Graph
from remat.onnx_fusion import ATTENTION
from remat.onnx_ingest import load_model


def graph_of(path: Path, ref: ModelRef) -> Graph:
    """The graph an agent rebuilds from the same reference (what the job schedules)."""
    return ref.graph(load_model(path))


def model_ref(spec: JobSpec, model: ModelRow) -> ModelRef:
    return ModelRef(
        model_id=model.id,
        sha256=model.sha256,
        mode=spec.mode,
        batch=spec.batch,
        inputs=spec.inputs,
        loss=spec.loss if spec.loss != LossSpec() else None,
        fuse_attention=spec.fuse_attention and _may_fuse(model),
    )


def _may_fuse(model: ModelRow) -> bool:
    """Whether fusing attention can change the model's graph: only where its summary has a
    Softmax (or, summarised fused, an attention node). Elsewhere the unfused reference is
    the same graph, and it keeps the keys of the profiles made before fusing was the
    default."""
    operators = model.summary.get("operators") if isinstance(model.summary, dict) else None
    return not isinstance(operators, dict) or bool({"Softmax", ATTENTION} & operators.keys())


def node_devices(node: NodeRow) -> list[AgentDevice]:
    return [AgentDevice.model_validate(d) for d in node.devices.get("devices", [])]


def job_devices_on(node: NodeRow, spec: JobSpec) -> list[AgentDevice]:
    """The job's devices as the node defines them (options such as threads come from the
    node); InvalidInputError names a device the node lacks or has as another kind."""
    have = {d.name: d for d in node_devices(node)}
    chosen = []
    for device in spec.devices:
        found = have.get(device.name)
        if found is None or found.kind != device.kind:
            listing = ", ".join(f"{d.name} ({d.kind})" for d in have.values())
            raise InvalidInputError(
                f"node {node.name!r} has no {device.kind} device {device.name!r} "
                f"(it has: {listing})"
            )
        chosen.append(found)
    return chosen


def profile_key(ref: ModelRef, devices: list[AgentDevice]) -> str:
    what = {
        "sha256": ref.sha256,
        "mode": ref.mode,
        "batch": ref.batch,
        "inputs": ref.inputs,
        "devices": [d.model_dump(mode="json") for d in devices],
    }
    if ref.loss is not None:  # the default loss keeps the keys of profiles made before losses
        what["loss"] = ref.loss.model_dump(mode="json")
    if ref.fuse_attention:  # another graph; unfused keeps the keys of profiles made before
        what["fuse_attention"] = True
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def find_profile(session: Session, node_id: str, key: str) -> ProfileRow | None:
    return session.scalar(
        select(ProfileRow)
        .where(ProfileRow.node_id == node_id, ProfileRow.key == key)
        .order_by(ProfileRow.created_at.desc())
        .limit(1)
    )


def request_profile(
    session: Session,
    node: NodeRow,
    ref: ModelRef,
    devices: list[AgentDevice],
    memory_bytes: dict[str, int] | None = None,
) -> AgentTaskRow:
    """The node's unfinished profiling task for this key, or a new one that holds at
    most ``memory_bytes`` per device (the job's budgets; the table measured does not
    depend on them, so they are not part of the key)."""
    names = [d.name for d in devices]
    payload = ProfilePayload(model=ref, devices=names, memory_bytes=memory_bytes or None)
    return _profile_task(session, node, profile_key(ref, devices), payload)


def request_sized_profile(
    session: Session,
    node: NodeRow,
    refs: Mapping[int, ModelRef],
    devices: list[AgentDevice],
    memory_bytes: dict[str, int] | None = None,
) -> AgentTaskRow:
    """One task that profiles the model at several sizes (``refs``: the model at each, as
    ``request_profile`` takes it); its key is that of the sizes' profiles together."""
    keys = {size: profile_key(ref, devices) for size, ref in sorted(refs.items())}
    key = hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()
    payload = ProfilePayload(
        model=refs[max(refs)],
        devices=[d.name for d in devices],
        memory_bytes=memory_bytes or None,
        sizes={str(size): ref.inputs or {} for size, ref in sorted(refs.items())},
    )
    return _profile_task(session, node, key, payload)


def _profile_task(
    session: Session, node: NodeRow, key: str, payload: ProfilePayload
) -> AgentTaskRow:
    task = active_task(session, TaskKind.PROFILE, key)
    if task is None:
        task = AgentTaskRow(
            kind=TaskKind.PROFILE, node_id=node.id, key=key, payload=payload.model_dump(mode="json")
        )
        session.add(task)
        session.flush()
    return task


def profiled_refs(payload: ProfilePayload) -> dict[str | None, ModelRef]:
    """What a profiling task measures: its model (key None), or the model at each of its
    sizes (keys: the sizes as text)."""
    if payload.sizes is None:
        return {None: payload.model}
    return {
        size: payload.model.model_copy(update={"inputs": inputs})
        for size, inputs in payload.sizes.items()
    }


def checked_table(graph: Graph, document: object, devices: list[str]) -> CostTable:
    """A reported cost table, checked against the graph it claims to measure; a
    ``RematError`` (422 to the agent) says what is wrong."""
    if not isinstance(document, dict):
        raise InvalidInputError("a profile report's result must be a cost table object")
    try:
        table = CostTable.model_validate(document)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        raise InvalidInputError(f"the cost table is malformed: {where}: {error['msg']}") from None
    missing = sorted(set(devices) - {d.name for d in table.devices})
    if missing:
        raise InvalidInputError(f"the cost table has no times for device {missing[0]!r}")
    profiled_costs(graph, table)  # every node on every device, every copy: or it raises
    stray = sorted(set(table.nodes) - {node.name for node in graph.nodes})
    if stray:
        raise InvalidInputError(
            f"the cost table has nodes the model's graph lacks ({stray[0]!r}, {len(stray)} in "
            "all): the agent builds another graph of the model than the server (another "
            "version of remat: update the agent)"
        )
    return table
