"""``/v1/jobs``: submit (idempotent with ``Idempotency-Key``), list, get (ETag), cancel,
plan, schedule, baselines, progress history, server-sent progress events."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from sqlalchemy import select

from app.api.deps import Cursor, PathId, QueryId, ServicesDep, SessionDep, require_key
from app.families import family_of, sized_plan
from app.lifecycle import stopping
from app.pagination import MAX_LIMIT, fetch
from app.schemas import (
    BaselinesOut,
    FamilyOut,
    JobOut,
    JobSpec,
    Page,
    ProgressHistory,
    ProgressPoint,
    ScheduleOut,
)
from app.services import Services, jobs
from app.tables import JobRow, JobStatus, utc

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[Depends(require_key)])
EVENT_POLL_S = 0.5


def job_out(row: JobRow) -> JobOut:
    return JobOut.model_validate(row, from_attributes=True)


@router.post("", status_code=202, response_model=JobOut)
def submit_job(
    spec: JobSpec,
    response: Response,
    ctx: ServicesDep,
    session: SessionDep,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> JobOut:
    """Validate the job against its model (devices, budgets, strategy), commit it, then
    enqueue it. The same ``Idempotency-Key`` and body give the same job."""
    row = jobs.submit(ctx, session, spec, idempotency_key)
    response.headers["Location"] = f"/v1/jobs/{row.id}"
    return job_out(row)


@router.get("", response_model=Page[JobOut], responses={304: {"description": "unchanged"}})
def list_jobs(
    session: SessionDep,
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
    rows, after = fetch(session, query, JobRow, cursor, limit)
    versions = [_version(r) for r in rows] + [after or ""]
    return _conditional(
        versions,
        if_none_match,
        lambda: Page[JobOut](items=[job_out(r) for r in rows], next_cursor=after),
    )


@router.get("/{job_id}", response_model=JobOut)
def get_job(
    job_id: PathId,
    session: SessionDep,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """The job; ``ETag`` on its version, ``If-None-Match`` with it (or ``*``) gives 304
    without building the body."""
    row = jobs.load_job(session, job_id)
    return _conditional([_version(row)], if_none_match, lambda: job_out(row))


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
def cancel_job(job_id: PathId, session: SessionDep) -> JobOut:
    """A queued job is cancelled at once; a running one is flagged and its solve stopped
    by its worker within seconds. Cancelling a finished job changes nothing."""
    return job_out(jobs.cancel(session, job_id))


@router.get("/{job_id}/plan")
def get_plan(
    job_id: PathId, request: Request, ctx: ServicesDep, session: SessionDep
) -> JSONResponse:
    """The job's plan; for a job over ranges of sizes, with the inputs as query parameters
    (``?input_ids=1x300``), the plan for that size: stored (``X-Remat-Plan-Cache: hit``)
    or planned now by the fast planner and stored (``miss``)."""
    if not request.query_params:
        return JSONResponse(jobs.plan_of(session, job_id).document)
    document, cache = sized_plan(ctx, session, job_id, request.query_params)
    return JSONResponse(document, headers={"X-Remat-Plan-Cache": cache})


@router.get("/{job_id}/family", response_model=FamilyOut)
def get_family(job_id: PathId, session: SessionDep) -> FamilyOut:
    """A job over ranges of sizes: its buckets, and each size planned so far with its
    predicted time and peak and how often the cache served it."""
    return family_of(session, job_id)


@router.get("/{job_id}/schedule", response_model=ScheduleOut)
def get_schedule(job_id: PathId, session: SessionDep) -> JSONResponse:
    return JSONResponse(jobs.plan_of(session, job_id).schedule)


@router.get("/{job_id}/baselines", response_model=BaselinesOut)
def get_baselines(job_id: PathId, session: SessionDep) -> JSONResponse:
    return JSONResponse(jobs.baselines_of(session, job_id))


@router.get("/{job_id}/progress", response_model=ProgressHistory)
def get_progress(job_id: PathId, session: SessionDep) -> ProgressHistory:
    """The solver's incumbent and bound over time (at most one point per progress
    interval), for the current attempt."""
    rows = jobs.progress_of(session, job_id)
    return ProgressHistory(
        points=[ProgressPoint.model_validate(r, from_attributes=True) for r in rows]
    )


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={200: {"description": "server-sent events", "content": {"text/event-stream": {}}}},
)
def job_events(
    job_id: PathId, request: Request, ctx: ServicesDep, session: SessionDep
) -> StreamingResponse:
    """Server-sent events: ``progress`` whenever the job changes, ``end`` once finished."""
    # The request's session answers the 404 and is closed before the stream starts (its
    # scope is this call); each poll of the stream reads the job in a transaction of its own.
    jobs.load_job(session, job_id)
    return StreamingResponse(_events(ctx, job_id, request), media_type="text/event-stream")


def _poll(ctx: Services, job_id: str) -> JobOut:
    with ctx.db.session() as session:
        return job_out(jobs.load_job(session, job_id))


async def _events(ctx: Services, job_id: str, request: Request) -> AsyncIterator[str]:
    last = None
    # The stream ends when the server is asked to stop, which otherwise waits for it.
    while not stopping(request.app) and not await request.is_disconnected():
        job = await run_in_threadpool(_poll, ctx, job_id)
        data = job.model_dump_json()
        if data != last:
            last = data
            yield f"event: progress\ndata: {data}\n\n"
        if JobStatus(job.status).finished:
            yield f"event: end\ndata: {json.dumps({'status': job.status})}\n\n"
            return
        await asyncio.sleep(EVENT_POLL_S)
