"""``/v1/jobs``: submit (idempotent with ``Idempotency-Key``), list, get (ETag), cancel,
plan, schedule, baselines, progress history, server-sent progress events."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from app.api.models import load_model_row
from app.context import (
    Cursor,
    PathId,
    QueryId,
    Services,
    get_or_404,
    require_key,
    services,
)
from app.lifecycle import stopping
from app.pagination import MAX_LIMIT, fetch
from app.planning import build_problem
from app.problems import ApiError
from app.profiles import job_devices_on
from app.schemas import (
    BaselinesOut,
    JobOut,
    JobSpec,
    NodeCosts,
    Page,
    ProfileCosts,
    Progress,
    ProgressHistory,
    ProgressPoint,
    ScheduleOut,
)
from app.tables import JobRow, JobStatus, NodeRow, PlanRow, ProfileRow, ProgressRow, now, utc
from remat.costs import CostTable

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(require_key)])
EVENT_POLL_S = 0.5


def to_out(row: JobRow) -> JobOut:
    return JobOut(
        id=row.id,
        model_id=row.model_id,
        status=row.status,
        cancel_requested=row.cancel_requested,
        spec=stored_spec(row.spec),
        progress=Progress(
            incumbent_ms=row.incumbent_ms,
            bound_ms=row.bound_ms,
            gap=row.gap,
            elapsed_s=row.elapsed_s,
        ),
        solver_status=row.solver_status,
        message=row.message,
        error=row.error,
        attempts=row.attempts,
        created_at=row.created_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
    )


def stored_spec(spec: dict[str, Any]) -> JobSpec:
    """A stored job's spec. One stored before the current bounds (which it may break) comes
    back as stored, unvalidated, rather than failing the answer that holds it."""
    try:
        return JobSpec.model_validate(spec)
    except ValidationError:
        return JobSpec.model_construct(**spec)


@router.post("", status_code=202, response_model=JobOut)
def submit_job(
    spec: JobSpec,
    response: Response,
    ctx: Annotated[Services, Depends(services)],
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> JobOut:
    """Validate the job against its model (devices, budgets, strategy), commit it, then
    enqueue it. The same ``Idempotency-Key`` and body give the same job."""
    body = spec.model_dump(mode="json")
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    if idempotency_key is not None and (earlier := _by_key(ctx, idempotency_key, digest)):
        return _accepted(response, earlier)
    _validate(ctx, spec)
    row = JobRow(
        model_id=spec.model_id, spec=body, idempotency_key=idempotency_key, request_hash=digest
    )
    try:
        with ctx.db.session() as session:
            session.add(row)
    except IntegrityError:  # the same key at the same time: theirs won
        earlier = _by_key(ctx, idempotency_key or "", digest)
        if earlier is None:
            raise
        return _accepted(response, earlier)
    _enqueue(ctx, row)  # only after the row is committed: a worker must find it
    return _accepted(response, row)


def _by_key(ctx: Services, key: str, digest: str) -> JobRow | None:
    with ctx.db.session() as session:
        row = session.scalar(select(JobRow).where(JobRow.idempotency_key == key))
    if row is not None and row.request_hash != digest:
        raise ApiError(422, f"Idempotency-Key {key!r} was used for another request body")
    return row


def _validate(ctx: Services, spec: JobSpec) -> None:
    if spec.solver.time_limit_s > ctx.settings.max_time_limit_s:
        raise ApiError(
            422, f"solver.time_limit_s: at most {ctx.settings.max_time_limit_s:g} s on this server"
        )
    model = _model_for_job(ctx, spec.model_id)
    table = _costs_table(ctx, spec)
    # RematError -> 422, also for a graph or cost model too large to build
    limit = ctx.settings.max_cost_model_bytes
    build_problem(spec, ctx.store.path(model.sha256), table=table, max_cost_bytes=limit)


def _costs_table(ctx: Services, spec: JobSpec) -> CostTable | None:
    """The profile a job names; a node it names must have the job's devices. (A node's
    profile may not exist yet: the worker has it measured.)"""
    if isinstance(spec.costs, NodeCosts):
        with ctx.db.session() as session:
            node = session.get(NodeRow, spec.costs.node_id)
        if node is None:
            raise ApiError(422, f"costs.node_id: node {spec.costs.node_id!r} does not exist")
        job_devices_on(node, spec)  # RematError -> 422 naming the missing device
    if not isinstance(spec.costs, ProfileCosts):
        return None
    with ctx.db.session() as session:
        profile = session.get(ProfileRow, spec.costs.profile_id)
    if profile is None or profile.model_id != spec.model_id:
        raise ApiError(
            422, f"costs.profile_id: no profile {spec.costs.profile_id!r} for this model"
        )
    return CostTable.model_validate(profile.table)


def _model_for_job(ctx: Services, model_id: str):  # type: ignore[no-untyped-def]
    try:
        return load_model_row(ctx, model_id)
    except ApiError:
        raise ApiError(422, f"model_id: model {model_id!r} does not exist") from None


def _enqueue(ctx: Services, row: JobRow) -> None:
    try:
        ctx.dispatcher.enqueue(row.id)
    except Exception as exc:  # the broker is down: say so, keep no job that never runs
        with ctx.db.session() as session:
            job = session.get_one(JobRow, row.id)
            job.status, job.error, job.finished_at = JobStatus.FAILED, f"not queued: {exc}", now()
        raise ApiError(503, f"the job queue is unreachable: {exc}") from exc


def _accepted(response: Response, row: JobRow) -> JobOut:
    response.headers["Location"] = f"/v1/jobs/{row.id}"
    return to_out(row)


@router.get("", response_model=Page[JobOut], responses={304: {"description": "unchanged"}})
def list_jobs(
    ctx: Annotated[Services, Depends(services)],
    status: JobStatus | None = None,
    model_id: QueryId = None,
    cursor: Cursor = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 50,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """A page of jobs, newest first; ``ETag`` on the page's rows' versions (the dashboard
    polls it with ``If-None-Match``)."""
    query = select(JobRow)
    if status is not None:
        query = query.where(JobRow.status == status)
    if model_id is not None:
        query = query.where(JobRow.model_id == model_id)
    rows, after = fetch(ctx.db, query, JobRow, cursor, limit)
    versions = [_version(r) for r in rows] + [after or ""]
    return _conditional(
        versions,
        if_none_match,
        lambda: Page[JobOut](items=[to_out(r) for r in rows], next_cursor=after),
    )


def load_job(ctx: Services, job_id: str) -> JobRow:
    return get_or_404(ctx.db, JobRow, job_id, "job")


@router.get("/{job_id}", response_model=JobOut)
def get_job(
    job_id: PathId,
    ctx: Annotated[Services, Depends(services)],
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """The job; ``ETag`` on its version, ``If-None-Match`` with it (or ``*``) gives 304
    without building the body."""
    row = load_job(ctx, job_id)
    return _conditional([_version(row)], if_none_match, lambda: to_out(row))


def _conditional(
    versions: list[str], if_none_match: str | None, body: Callable[[], BaseModel]
) -> Response:
    """``body()`` as JSON with an ``ETag`` on ``versions``, or a 304 without building it
    when ``If-None-Match`` names that tag (or ``*``)."""
    joined = "\n".join(versions).encode()
    etag = f'"{hashlib.sha1(joined, usedforsecurity=False).hexdigest()}"'
    if if_none_match is not None and _matches(if_none_match, etag):
        return Response(status_code=304, headers={"ETag": etag})
    return Response(body().model_dump_json(), media_type="application/json", headers={"ETag": etag})


def _version(row: JobRow) -> str:
    """The row's version: every change to a job goes through the ORM, which moves
    ``updated_at`` (``onupdate``); the status is in it too, for changes within one clock
    tick."""
    return f"{row.id}|{utc(row.updated_at).isoformat()}|{row.status}|{row.cancel_requested}"


def _matches(if_none_match: str, etag: str) -> bool:
    tags = {t.strip().removeprefix("W/") for t in if_none_match.split(",")}
    return "*" in tags or etag in tags


@router.post("/{job_id}/cancel", response_model=JobOut)
def cancel_job(job_id: PathId, ctx: Annotated[Services, Depends(services)]) -> JobOut:
    """A queued job is cancelled at once; a running one is flagged and its solve stopped
    by its worker within seconds. Cancelling a finished job changes nothing."""
    with ctx.db.session() as session:
        row = session.get(JobRow, job_id, with_for_update=True)
        if row is None:
            raise ApiError(404, f"job {job_id!r} does not exist")
        seen = JobStatus(row.status)
        if not seen.finished:
            # a compare-and-set on the status read: SQLite takes no row lock, and a worker
            # that stored the plan in between keeps its success (without the flag)
            values: dict[str, object] = {"cancel_requested": True, "updated_at": now()}
            if seen is JobStatus.QUEUED:
                values |= {"status": JobStatus.CANCELLED, "finished_at": now()}
            session.execute(
                update(JobRow)
                .where(JobRow.id == job_id, JobRow.status == seen)
                .values(**values)
                .execution_options(synchronize_session=False)
            )
    return to_out(load_job(ctx, job_id))


def _plan_row(ctx: Services, job_id: str) -> PlanRow:
    job = load_job(ctx, job_id)
    with ctx.db.session() as session:
        plan = session.get(PlanRow, job_id)
    if plan is None:
        raise ApiError(404, f"job {job_id!r} has no plan (status: {job.status})")
    return plan


@router.get("/{job_id}/plan")
def get_plan(job_id: PathId, ctx: Annotated[Services, Depends(services)]) -> JSONResponse:
    return JSONResponse(_plan_row(ctx, job_id).document)


@router.get("/{job_id}/schedule", response_model=ScheduleOut)
def get_schedule(job_id: PathId, ctx: Annotated[Services, Depends(services)]) -> JSONResponse:
    return JSONResponse(_plan_row(ctx, job_id).schedule)


@router.get("/{job_id}/baselines", response_model=BaselinesOut)
def get_baselines(job_id: PathId, ctx: Annotated[Services, Depends(services)]) -> JSONResponse:
    plan = _plan_row(ctx, job_id)
    if plan.baselines is None:
        raise ApiError(404, f"job {job_id!r} was planned before baselines were stored with plans")
    return JSONResponse(plan.baselines)


@router.get("/{job_id}/progress", response_model=ProgressHistory)
def get_progress(job_id: PathId, ctx: Annotated[Services, Depends(services)]) -> ProgressHistory:
    """The solver's incumbent and bound over time (at most one point per progress
    interval), for the current attempt."""
    load_job(ctx, job_id)
    query = select(ProgressRow).where(ProgressRow.job_id == job_id).order_by(ProgressRow.id)
    with ctx.db.session() as session:
        rows = session.scalars(query).all()
    points = [ProgressPoint.model_validate(r, from_attributes=True) for r in rows]
    return ProgressHistory(points=points)


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={200: {"description": "server-sent events", "content": {"text/event-stream": {}}}},
)
async def job_events(
    job_id: PathId, request: Request, ctx: Annotated[Services, Depends(services)]
) -> StreamingResponse:
    """Server-sent events: ``progress`` whenever the job changes, ``end`` once finished."""
    await run_in_threadpool(load_job, ctx, job_id)
    return StreamingResponse(_events(ctx, job_id, request), media_type="text/event-stream")


async def _events(ctx: Services, job_id: str, request: Request) -> AsyncIterator[str]:
    last = None
    # The stream ends when the server is asked to stop, which otherwise waits for it.
    while not stopping(request.app) and not await request.is_disconnected():
        job = to_out(await run_in_threadpool(load_job, ctx, job_id))
        data = job.model_dump_json()
        if data != last:
            last = data
            yield f"event: progress\ndata: {data}\n\n"
        if JobStatus(job.status).finished:
            yield f"event: end\ndata: {json.dumps({'status': job.status})}\n\n"
            return
        await asyncio.sleep(EVENT_POLL_S)
