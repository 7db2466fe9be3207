"""Executions: a job's plan queued for a node's agent to run, and what it measured."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.families import plan_for_size
from app.planning import job_range
from app.problem_details import ApiError
from app.profiles import model_ref, node_devices
from app.schemas import stored_spec
from app.services import Services
from app.services.jobs import load_job
from app.tables import AgentTaskRow, ModelRow, NodeRow, PlanRow
from remat.agent_protocol import ExecutePayload, SizedRun, TaskKind


def request(
    ctx: Services, session: Session, job_id: str, node_id: str, sizes: list[int] | None = None
) -> AgentTaskRow:
    """Queue the job's plan for execution on ``node_id``: 409 without a plan, 422 for a
    node that does not exist or lacks a device the plan uses. ``sizes`` (a job over ranges
    of sizes only): steps of those sizes in turn, each with its size's plan (from the
    family's cache, or planned now)."""
    job = load_job(session, job_id)
    plan = session.get(PlanRow, job_id)
    node = session.get(NodeRow, node_id)
    model = session.get_one(ModelRow, job.model_id)
    if plan is None:
        raise ApiError(409, f"job {job_id!r} has no plan to execute (status: {job.status})")
    if node is None:
        raise ApiError(422, f"node_id: node {node_id!r} does not exist")
    _check_devices(node, plan.document)
    spec = stored_spec(job.spec)
    ref, document = model_ref(spec, model), plan.document
    sized = None if sizes is None else _sized_run(ctx, session, job_id, sizes)
    payload = ExecutePayload(model=ref, job_id=job_id, plan=document, sized=sized)
    row = AgentTaskRow(
        kind=TaskKind.EXECUTE,
        job_id=job_id,
        node_id=node.id,
        payload=payload.model_dump(mode="json"),
    )
    session.add(row)
    session.flush()  # its id and defaults, for the answer
    return row


def _sized_run(ctx: Services, session: Session, job_id: str, sizes: list[int]) -> SizedRun:
    """Each distinct size's whole input shapes and plan (``plan_for_size``: a hit when
    stored, else planned now), for the steps ``sizes``."""
    ranged = job_range(stored_spec(load_job(session, job_id).spec))
    if ranged is None:
        raise ApiError(422, f"sizes: job {job_id!r} has one input shape")
    inputs: dict[str, dict[str, list[int]]] = {}
    plans: dict[str, dict[str, Any]] = {}
    cached: list[int] = []
    for size in dict.fromkeys(sizes):
        document, cache = plan_for_size(ctx, session, job_id, size)
        inputs[str(size)] = {name: list(dims) for name, dims in ranged.shapes(size).items()}
        plans[str(size)] = document
        if cache == "hit":
            cached.append(size)
    return SizedRun(sizes=sizes, inputs=inputs, plans=plans, cached=cached)


def of_job(session: Session, job_id: str) -> list[AgentTaskRow]:
    load_job(session, job_id)
    query = (
        select(AgentTaskRow)
        .where(AgentTaskRow.job_id == job_id, AgentTaskRow.kind == TaskKind.EXECUTE)
        .order_by(AgentTaskRow.created_at)
    )
    return list(session.scalars(query))


def _check_devices(node: NodeRow, plan: dict[str, object]) -> None:
    have = {d.name: d.kind for d in node_devices(node)}
    devices = plan.get("devices", [])
    for device in devices if isinstance(devices, list) else []:
        name, kind = device["name"], device["kind"]
        if have.get(name) != kind:
            listing = ", ".join(f"{n} ({k})" for n, k in have.items())
            raise ApiError(
                422,
                f"node {node.name!r} has no {kind} device {name!r} for this plan "
                f"(it has: {listing})",
            )
