"""``/v1/agent``: what node agents call (the protocol is in ``remat.agent_protocol``):
registration with the enrollment token, heartbeats, leasing tasks, renewing, progress,
reports (checked, recorded once per lease), release, and model downloads.

What an agent can do is bounded: a node name already taken is registered again only with
that node's token, the name ``local`` only with ``remat serve``'s per-run secret; a node
downloads only the models its own unfinished tasks name; an execution's ``predicted`` is
the plan's, never the agent's word."""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.api.deps import ServicesDep, SessionDep, get_or_404
from app.lifecycle import stopping
from app.problem_details import ApiError
from app.profiles import checked_table, graph_of, node_devices, profile_key, profiled_refs
from app.services import Services, key_digest
from app.tables import AgentTaskRow, ModelRow, NodeRow, ProfileRow, TaskStatus, now, utc
from remat.agent_protocol import (
    LOCAL_NODE,
    Enrolled,
    ExecutePayload,
    ExecutionResult,
    Heartbeat,
    Lease,
    LeaseProof,
    LeaseRequest,
    ModelRef,
    PredictedCost,
    ProfilePayload,
    Registration,
    ReportAccepted,
    SizedProfile,
    SizedRun,
    Task,
    TaskKind,
    TaskProgress,
    TaskReport,
)

router = APIRouter(prefix="/v1/agent", tags=["agent protocol"])
LEASE_POLL_S = 0.5
AlsoWrite = Callable[[Session, AgentTaskRow], None]  # written with a task's outcome


def current_node(request: Request, session: SessionDep) -> NodeRow:
    """The node whose token is in ``Authorization: Bearer``, or 401. (In the request's
    session; the read ends here, so that a long poll holds no connection.)"""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "an agent token is required: Authorization: Bearer <token>")
    node = session.scalar(select(NodeRow).where(NodeRow.token_sha256 == key_digest(token)))
    session.commit()
    if node is None:
        raise ApiError(401, "unknown agent token: register again with the enrollment token")
    return node


Node = Annotated[NodeRow, Depends(current_node)]


@router.post("/register", response_model=Enrolled)
def register(body: Registration, ctx: ServicesDep, session: SessionDep) -> Enrolled:
    """A node joins with the enrollment token and gets its own token (stored hashed).
    Registering a taken name again needs that node's current token (``node_token``; 409
    otherwise) and replaces its token and devices. The name ``local`` is ``remat serve``'s
    own agent's: it registers with the server's per-run secret instead."""
    _check_enrollment(ctx, body)
    names = [d.name for d in body.devices]
    if len(set(names)) != len(names):
        raise ApiError(422, f"devices: names must be unique: {names}")
    token = secrets.token_urlsafe(32)
    devices = {"devices": [d.model_dump(mode="json") for d in body.devices]}
    node = session.scalar(select(NodeRow).where(NodeRow.name == body.name).with_for_update())
    if node is None:
        node = NodeRow(name=body.name, token_sha256="", devices=devices)
        session.add(node)
    elif body.name != LOCAL_NODE and not _is_token_of(node, body.node_token):
        raise ApiError(
            409,
            f"node name {body.name!r} is taken: registering it again needs that node's "
            "token (the agent keeps it in its cache directory); or choose another --name",
        )
    node.token_sha256, node.devices = key_digest(token), devices
    node.version, node.last_seen_at = body.version or None, now()
    session.flush()
    return Enrolled(
        node_id=node.id,
        token=token,
        heartbeat_s=ctx.settings.heartbeat_s,
        lease_s=ctx.settings.lease_s,
    )


@router.post("/heartbeat", response_model=Heartbeat)
def heartbeat(node: Node, ctx: ServicesDep) -> Heartbeat:
    node.last_seen_at = now()  # the node is the request session's: committed with it
    return Heartbeat(heartbeat_s=ctx.settings.heartbeat_s)


@router.post("/lease", response_model=Task, responses={204: {"description": "no task in time"}})
async def lease(
    body: LeaseRequest, node: Node, ctx: ServicesDep, request: Request
) -> Task | Response:
    """Long poll: the oldest queued task for this node, or 204 after ``wait_s``; 503 once
    the server is stopping (the poll must not hold its exit up; the agent retries)."""
    # no request session here: each look at the queue is a short transaction of its own
    deadline = time.monotonic() + body.wait_s
    while True:
        if stopping(request.app):
            raise ApiError(503, "the server is shutting down")
        claimed = await run_in_threadpool(ctx.tasks.claim, node.id)
        if claimed is not None:
            row = claimed.row
            assert row.lease_expires_at is not None
            return Task(
                id=row.id,
                kind=TaskKind(row.kind),
                attempt=row.attempts,
                lease_token=claimed.token,
                lease_expires_at=utc(row.lease_expires_at),
                payload=row.payload,
            )
        if time.monotonic() >= deadline:
            return Response(status_code=204)
        await asyncio.sleep(min(LEASE_POLL_S, max(deadline - time.monotonic(), 0)))


@router.post("/tasks/{task_id}/renew", response_model=Lease)
def renew(
    task_id: str, body: LeaseProof, node: Node, ctx: ServicesDep, session: SessionDep
) -> Lease:
    expires = ctx.tasks.renew(session, task_id, node.id, body.lease_token)
    return Lease(lease_expires_at=expires)


@router.post("/tasks/{task_id}/progress", response_model=Lease)
def progress(
    task_id: str, body: TaskProgress, node: Node, ctx: ServicesDep, session: SessionDep
) -> Lease:
    shown = body.model_dump(include={"done", "total", "message"})
    expires = ctx.tasks.progress(session, task_id, node.id, body.lease_token, shown)
    return Lease(lease_expires_at=expires)


@router.post("/tasks/{task_id}/release", status_code=204)
def release(
    task_id: str, body: LeaseProof, node: Node, ctx: ServicesDep, session: SessionDep
) -> Response:
    ctx.tasks.release(session, task_id, node.id, body.lease_token)
    return Response(status_code=204)


@router.post("/tasks/{task_id}/report", response_model=ReportAccepted)
def report(
    task_id: str, body: TaskReport, node: Node, ctx: ServicesDep, session: SessionDep
) -> ReportAccepted:
    """Record the outcome of this lease's attempt, once. A success's result is checked
    first (422 says what is wrong; the lease stays the agent's)."""
    row = ctx.tasks.lookup_report(session, task_id, node.id, body.lease_token)
    if TaskStatus(row.status).finished:
        return ReportAccepted(task_id=task_id, status=row.status, duplicate=True)
    status = TaskStatus(body.status)
    token = body.lease_token
    if status is TaskStatus.FAILED:
        error = body.error or "the agent reported a failure without a message"
        fresh = ctx.tasks.finish(session, task_id, token, status, None, error)
    else:
        result, also = _checked_result(ctx, session, row, body.result)
        fresh = ctx.tasks.finish(session, task_id, token, status, result, None, also)
    return ReportAccepted(task_id=task_id, status=status, duplicate=not fresh)


@router.get("/models/{model_id}", response_class=FileResponse)
def download_model(
    model_id: str, node: Node, ctx: ServicesDep, session: SessionDep
) -> FileResponse:
    """A model one of this node's unfinished tasks names (404 for any other)."""
    payloads = session.scalars(
        select(AgentTaskRow.payload)
        .where(AgentTaskRow.node_id == node.id)
        .where(AgentTaskRow.status.in_((TaskStatus.QUEUED, TaskStatus.LEASED)))
    ).all()
    named = any(_model_id_of(payload) == model_id for payload in payloads)
    model = session.get(ModelRow, model_id) if named else None
    if model is None:
        raise ApiError(404, f"model {model_id!r} is not in any of this node's tasks")
    return FileResponse(ctx.store.path(model.sha256), media_type="application/octet-stream")


def _check_enrollment(ctx: Services, body: Registration) -> None:
    """401/403 unless ``body`` carries the secret its name registers with."""
    if body.name == LOCAL_NODE:
        expected = ctx.settings.local_agent_token
        if not expected:
            raise ApiError(
                403, f"node name {LOCAL_NODE!r} is reserved for the agent remat serve starts"
            )
        if not hmac.compare_digest(body.enroll_token.encode(), expected.encode()):
            raise ApiError(
                401,
                f"wrong token for node {LOCAL_NODE!r}: the name is reserved for the agent "
                "remat serve starts",
            )
        return
    expected = ctx.settings.enroll_token
    if not expected:
        raise ApiError(403, "agent enrollment is disabled on this server (set REMAT_ENROLL_TOKEN)")
    if not hmac.compare_digest(body.enroll_token.encode(), expected.encode()):
        raise ApiError(401, "wrong enrollment token")


def _is_token_of(node: NodeRow, token: str | None) -> bool:
    return token is not None and hmac.compare_digest(node.token_sha256, key_digest(token))


def _model_id_of(payload: dict[str, Any]) -> object:
    model = payload.get("model") if isinstance(payload, dict) else None
    return model.get("model_id") if isinstance(model, dict) else None


def _checked_result(
    ctx: Services, session: Session, row: AgentTaskRow, result: object
) -> tuple[dict[str, Any] | None, AlsoWrite | None]:
    """The result to store and what else to write with it."""
    if row.kind == TaskKind.EXECUTE:
        try:
            checked = ExecutionResult.model_validate(result)
        except ValidationError as exc:
            raise ApiError(422, f"result: not an execution result: {_first(exc)}") from None
        execution = ExecutePayload.model_validate(row.payload)
        checked.predicted = _plan_prediction(execution.plan)
        if execution.sized is not None:
            checked = _sized_prediction(checked, execution.sized)
        return checked.model_dump(mode="json"), None
    payload = ProfilePayload.model_validate(row.payload)
    model = get_or_404(session, ModelRow, payload.model.model_id, "model")
    session.commit()  # the reads end here: checking the tables takes a while
    refs = profiled_refs(payload)
    reported: dict[str | None, object] = {None: result}
    if payload.sizes is not None:
        reported = _sized_tables(result, refs)
    path = ctx.store.path(model.sha256)
    documents = {  # RematError -> 422
        size: checked_table(graph_of(path, ref), reported[size], payload.devices).model_dump(
            mode="json"
        )
        for size, ref in refs.items()
    }

    def store_profiles(session: Session, task: AgentTaskRow) -> None:
        node = session.get_one(NodeRow, task.node_id)
        defined = {d.name: d for d in node_devices(node)}
        devices = [defined[name] for name in payload.devices if name in defined]
        ids: dict[str, str] = {}
        for size, ref in refs.items():
            profile = ProfileRow(
                model_id=model.id,
                node_id=task.node_id,
                key=(task.key or "") if size is None else profile_key(ref, devices),
                table=documents[size],
                spec=payload.model_copy(update={"model": ref, "sizes": None}).model_dump(
                    mode="json"
                ),
            )
            session.add(profile)
            session.flush()
            ids[size or ""] = profile.id
        task.result = {"profile_id": ids[""]} if payload.sizes is None else {"profile_ids": ids}

    return None, store_profiles


def _sized_tables(result: object, refs: dict[str | None, ModelRef]) -> dict[str | None, object]:
    """A profile over several sizes: a table for each size the task asked for; 422 else."""
    try:
        sized = SizedProfile.model_validate(result)
    except ValidationError as exc:
        raise ApiError(422, f"result: not a profile over sizes: {_first(exc)}") from None
    if set(sized.tables) != set(refs):
        raise ApiError(
            422,
            f"result: the tables are for sizes {sorted(sized.tables)}, the task asked for "
            f"{sorted(s for s in refs if s is not None)}",
        )
    return {size: table for size, table in sized.tables.items()}


def _sized_prediction(result: ExecutionResult, run: SizedRun) -> ExecutionResult:
    """A family's execution: each step's prediction from the plan sent for its size, the
    run's as their sum and largest peaks, and a step's cache flag as the server knows it
    (stored before, or a size an earlier step had). 422 for steps other than those sent."""
    steps = result.sized or []
    if [s.size for s in steps] != run.sizes:
        raise ApiError(422, "result: sized: the steps are not the sizes the task gave")
    total = 0.0
    peaks: dict[str, int] = {}
    seen: set[int] = set()
    for step in steps:
        predicted = _plan_prediction(run.plans[str(step.size)])
        step.predicted_ms, step.predicted_peak_bytes = predicted.total_ms, predicted.peak_bytes
        step.plan_cached = step.size in seen or step.size in run.cached
        seen.add(step.size)
        total += predicted.total_ms or 0.0
        for device, peak in predicted.peak_bytes.items():
            peaks[device] = max(peaks.get(device, 0), peak)
    result.predicted = PredictedCost(total_ms=total, peak_bytes=peaks)
    return result


def _plan_prediction(plan: dict[str, Any]) -> PredictedCost:
    """What the simulator predicted for a plan an execution task carries (the server's
    own copy, not the agent's report)."""
    predicted = plan.get("predicted")
    if not isinstance(predicted, dict):
        return PredictedCost()
    return PredictedCost(
        total_ms=predicted.get("total_ms"),
        peak_bytes=predicted.get("peak_bytes") or {},
        energy_mj=predicted.get("energy_mj"),
    )


def _first(exc: ValidationError) -> str:
    error = exc.errors()[0]
    return f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"
