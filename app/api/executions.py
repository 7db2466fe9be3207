"""``/v1/jobs/{id}/executions``: ask a node's agent to execute a job's plan, and read what
it measured against what the simulator predicted."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Response
from sqlalchemy import select

from agents.protocol import ExecutePayload, ExecutionResult, TaskKind
from app.api.jobs import load_job, stored_spec
from app.context import PathId, Services, require_key, services
from app.problems import ApiError
from app.profiles import model_ref, node_devices
from app.schemas import ExecutionOut, ExecutionRequest
from app.tables import AgentTaskRow, ModelRow, NodeRow, PlanRow

router = APIRouter(prefix="/v1/jobs", tags=["executions"], dependencies=[Depends(require_key)])
Ctx = Annotated[Services, Depends(services)]


def execution_out(row: AgentTaskRow) -> ExecutionOut:
    out = ExecutionOut(
        id=row.id,
        job_id=row.job_id or "",
        node_id=row.node_id,
        status=row.status,
        attempts=row.attempts,
        error=row.error,
        created_at=row.created_at,
        finished_at=row.finished_at,
    )
    if row.result is not None:
        result = ExecutionResult.model_validate(row.result)
        out.measured = result.measured.model_dump()
        out.predicted = result.predicted.model_dump()
        out.gradients_match, out.max_rel_error = result.gradients_match, result.max_rel_error
    return out


@router.post("/{job_id}/executions", status_code=202, response_model=ExecutionOut)
def request_execution(
    job_id: PathId, body: ExecutionRequest, response: Response, ctx: Ctx
) -> ExecutionOut:
    """Queue the job's plan for execution on ``node_id``; its devices must include every
    device the plan uses."""
    job = load_job(ctx, job_id)
    with ctx.db.session() as session:
        plan = session.get(PlanRow, job_id)
        node = session.get(NodeRow, body.node_id)
        model = session.get_one(ModelRow, job.model_id)
        if plan is None:
            raise ApiError(409, f"job {job_id!r} has no plan to execute (status: {job.status})")
        if node is None:
            raise ApiError(422, f"node_id: node {body.node_id!r} does not exist")
        _check_devices(node, plan.document)
        payload = ExecutePayload(
            model=model_ref(stored_spec(job.spec), model),
            job_id=job_id,
            plan=plan.document,
        )
        row = AgentTaskRow(
            kind=TaskKind.EXECUTE,
            job_id=job_id,
            node_id=node.id,
            payload=payload.model_dump(mode="json"),
        )
        session.add(row)
    response.headers["Location"] = f"/v1/jobs/{job_id}/executions"
    return execution_out(row)


@router.get("/{job_id}/executions", response_model=list[ExecutionOut])
def list_executions(job_id: PathId, ctx: Ctx) -> list[ExecutionOut]:
    load_job(ctx, job_id)
    with ctx.db.session() as session:
        rows = session.scalars(
            select(AgentTaskRow)
            .where(AgentTaskRow.job_id == job_id, AgentTaskRow.kind == TaskKind.EXECUTE)
            .order_by(AgentTaskRow.created_at)
        ).all()
    return [execution_out(r) for r in rows]


def _check_devices(node: NodeRow, plan: dict[str, object]) -> None:
    have = {d.name: d.kind for d in node_devices(node)}
    for device in plan.get("devices", []):  # type: ignore[union-attr]
        name, kind = device["name"], device["kind"]
        if have.get(name) != kind:
            listing = ", ".join(f"{n} ({k})" for n, k in have.items())
            raise ApiError(
                422,
                f"node {node.name!r} has no {kind} device {name!r} for this plan "
                f"(it has: {listing})",
            )
