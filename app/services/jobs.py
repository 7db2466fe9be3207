"""Jobs: submit (validated against its model, idempotent with a key), cancel, and what a
job has (its plan, schedule, baselines and progress history).

Submitting commits the job before it is handed to the dispatcher (a worker must find
it); two submissions with the same ``Idempotency-Key`` and body at once give one job (the
key is unique: the loser reads the winner's). Cancelling is a compare-and-set on the
status read, as the worker's store of the plan is: whichever lands first wins.
"""

from __future__ import annotations

import hashlib
import json
import logging

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.planning import build_problem
from app.problem_details import ApiError
from app.profiles import job_devices_on
from app.schemas import JobSpec, NodeCosts, ProfileCosts
from app.services import Services, get_or_404
from app.services.models import load_model
from app.tables import JobRow, JobStatus, ModelRow, NodeRow, PlanRow, ProfileRow, ProgressRow, now
from remat.costs import CostTable
from remat.errors import RematError
from remat.graph import Fingerprint
from remat.plan import Plan, plan_from_json

log = logging.getLogger(__name__)
EARLIER_PLANS = 16
"""At most this many of a model's stored plans (the newest) start a later job's search."""


def request_hash(spec: JobSpec) -> str:
    """The body's digest: an ``Idempotency-Key`` stands for this body only."""
    body = spec.model_dump(mode="json")
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def submit(ctx: Services, session: Session, spec: JobSpec, idempotency_key: str | None) -> JobRow:
    """The job of ``spec``: validated, committed, then enqueued; with an
    ``idempotency_key`` used before for the same body, the job made then (422 for another
    body). 503 (the job failed, not left queued) when the dispatcher cannot take it."""
    digest = request_hash(spec)
    if idempotency_key is not None and (earlier := _by_key(session, idempotency_key, digest)):
        return earlier
    _validate(ctx, session, spec)
    row = JobRow(
        model_id=spec.model_id,
        spec=spec.model_dump(mode="json"),
        idempotency_key=idempotency_key,
        request_hash=digest,
    )
    session.add(row)
    try:
        session.commit()
    except IntegrityError:  # the same key at the same time: theirs won
        session.rollback()
        earlier = _by_key(session, idempotency_key or "", digest)
        if earlier is None:
            raise
        return earlier
    _enqueue(ctx, session, row)  # only after the row is committed: a worker must find it
    return row


def _by_key(session: Session, key: str, digest: str) -> JobRow | None:
    row = session.scalar(select(JobRow).where(JobRow.idempotency_key == key))
    if row is not None and row.request_hash != digest:
        raise ApiError(422, f"Idempotency-Key {key!r} was used for another request body")
    return row


def _validate(ctx: Services, session: Session, spec: JobSpec) -> None:
    """422 unless the job can be planned: its model exists, the node or profile it names
    fits, and the problem builds (also refused: a graph or cost model too large)."""
    if spec.solver.time_limit_s > ctx.settings.max_time_limit_s:
        raise ApiError(
            422, f"solver.time_limit_s: at most {ctx.settings.max_time_limit_s:g} s on this server"
        )
    model = _model_for_job(session, spec.model_id)
    table = _costs_table(session, spec)
    session.commit()  # the reads end here: building the problem can take a while
    # RematError -> 422, also for a graph or cost model too large to build
    limit = ctx.settings.max_cost_model_bytes
    build_problem(spec, ctx.store.path(model.sha256), table=table, max_cost_bytes=limit)


def _costs_table(session: Session, spec: JobSpec) -> CostTable | None:
    """The profile a job names; a node it names must have the job's devices. (A node's
    profile may not exist yet: the worker has it measured.)"""
    if isinstance(spec.costs, NodeCosts):
        node = session.get(NodeRow, spec.costs.node_id)
        if node is None:
            raise ApiError(422, f"costs.node_id: node {spec.costs.node_id!r} does not exist")
        job_devices_on(node, spec)  # RematError -> 422 naming the missing device
    if not isinstance(spec.costs, ProfileCosts):
        return None
    profile = session.get(ProfileRow, spec.costs.profile_id)
    if profile is None or profile.model_id != spec.model_id:
        raise ApiError(
            422, f"costs.profile_id: no profile {spec.costs.profile_id!r} for this model"
        )
    return CostTable.model_validate(profile.table)


def _model_for_job(session: Session, model_id: str) -> ModelRow:
    try:
        return load_model(session, model_id)
    except ApiError:
        raise ApiError(422, f"model_id: model {model_id!r} does not exist") from None


def _enqueue(ctx: Services, session: Session, row: JobRow) -> None:
    try:
        ctx.dispatcher.enqueue(row.id)
    except Exception as exc:  # the broker is down: say so, keep no job that never runs
        job = session.get_one(JobRow, row.id)
        job.status, job.error, job.finished_at = JobStatus.FAILED, f"not queued: {exc}", now()
        session.commit()  # kept although the request fails
        raise ApiError(503, f"the job queue is unreachable: {exc}") from exc


def load_job(session: Session, job_id: str) -> JobRow:
    return get_or_404(session, JobRow, job_id, "job")


def cancel(session: Session, job_id: str) -> JobRow:
    """A queued job is cancelled at once; a running one is flagged (its worker stops the
    solve within seconds). A finished job is left as it is."""
    row = session.get(JobRow, job_id, with_for_update=True, populate_existing=True)
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
        session.refresh(row)  # what the compare-and-set (or the worker) left
    return row


def plan_of(session: Session, job_id: str) -> PlanRow:
    """The job's plan; 404 for a job without one (yet)."""
    job = load_job(session, job_id)
    plan = session.get(PlanRow, job_id)
    if plan is None:
        raise ApiError(404, f"job {job_id!r} has no plan (status: {job.status})")
    return plan


def baselines_of(session: Session, job_id: str) -> dict[str, object]:
    plan = plan_of(session, job_id)
    if plan.baselines is None:
        raise ApiError(404, f"job {job_id!r} was planned before baselines were stored with plans")
    return plan.baselines


def progress_of(session: Session, job_id: str) -> list[ProgressRow]:
    """The current attempt's progress history, oldest first."""
    load_job(session, job_id)
    query = select(ProgressRow).where(ProgressRow.job_id == job_id).order_by(ProgressRow.id)
    return list(session.scalars(query))


def earlier_plans(
    session: Session, model_id: str, graph: Fingerprint, limit: int = EARLIER_PLANS
) -> dict[str, Plan]:
    """The plans of the model's earlier jobs made for ``graph``, newest first, by job
    ("job ID"): a later job's search starts from those the simulator accepts under its own
    costs and budgets (``SolverSettings.known_plans``). A stored document that no longer
    reads is skipped."""
    query = (
        select(PlanRow.job_id, PlanRow.document)
        .join(JobRow, JobRow.id == PlanRow.job_id)
        .where(JobRow.model_id == model_id, PlanRow.graph_digest == graph.digest)
        .order_by(PlanRow.created_at.desc())
        .limit(limit)
    )
    plans = {}
    for job_id, document in session.execute(query).all():
        try:
            plans[f"job {job_id}"] = plan_from_json(document)
        except RematError as exc:
            log.warning("the stored plan of job %s does not read: %s", job_id, exc)
    return plans
