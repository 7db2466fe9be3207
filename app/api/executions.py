"""``/v1/jobs/{id}/executions``: ask a node's agent to execute a job's plan, and read what
it measured against what the simulator predicted."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from app.api.deps import PathId, ServicesDep, SessionDep, require_key
from app.schemas import ExecutionOut, ExecutionRequest
from app.services import executions
from app.tables import AgentTaskRow
from remat.agent_protocol import ExecutionResult

router = APIRouter(prefix="/v1/jobs", tags=["executions"], dependencies=[Depends(require_key)])


def execution_out(row: AgentTaskRow) -> ExecutionOut:
    """The task's columns, and what its agent reported (checked when it came)."""
    out = ExecutionOut.model_validate(row, from_attributes=True)
    if row.result is None:
        return out
    result = ExecutionResult.model_validate(row.result)
    return out.model_copy(
        update={
            "measured": result.measured.model_dump(),
            "predicted": result.predicted.model_dump(),
            "gradients_match": result.gradients_match,
            "max_rel_error": result.max_rel_error,
            "gradients_vanish": result.gradients_vanish,
            "sized": None if result.sized is None else [s.model_dump() for s in result.sized],
        }
    )


@router.post("/{job_id}/executions", status_code=202, response_model=ExecutionOut)
def request_execution(
    job_id: PathId,
    body: ExecutionRequest,
    response: Response,
    ctx: ServicesDep,
    session: SessionDep,
) -> ExecutionOut:
    """Queue the job's plan for execution on ``node_id``; its devices must include every
    device the plan uses. A job over ranges of sizes may give ``sizes``: steps of those
    input sizes in turn, each with its size's plan."""
    row = executions.request(ctx, session, job_id, body.node_id, body.sizes)
    response.headers["Location"] = f"/v1/jobs/{job_id}/executions"
    return execution_out(row)


@router.get("/{job_id}/executions", response_model=list[ExecutionOut])
def list_executions(job_id: PathId, session: SessionDep) -> list[ExecutionOut]:
    return [execution_out(r) for r in executions.of_job(session, job_id)]
