"""Jobs over ranges of input sizes (``remat.family``): what the worker stores of a plan
family, and the plan for one size that ``GET /v1/jobs/{id}/plan?NAME=DIMS`` serves.

The worker stores the family's range, device and buckets with the job's plan (the
largest size's, so that the schedule view and the baselines are those of the largest
input), and each representative's plan as a ``FamilyPlanRow``. A size asked for later is
served from those rows (a *hit*, counted), or planned on the spot by ``remat.family``'s
fast path against its bucket's representative and stored (a *miss*).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.planning import family_problems, job_range
from app.problem_details import ApiError
from app.schemas import FamilyBucketOut, FamilyOut, FamilySizeOut, stored_spec
from app.services import Services
from app.tables import FamilyPlanRow, JobRow, ModelRow, PlanRow
from remat.costs import CostTable
from remat.errors import RematError
from remat.family import Bucket, PlanFamily, SizedPlan, plan_size
from remat.onnx_ingest import parse_input_shape
from remat.plan import plan_from_json, plan_to_json
from remat.shape_range import ShapeRange
from remat.strategies import StrategyResult


def family_summary(
    family: PlanFamily, tables: Mapping[int, CostTable] | None = None
) -> dict[str, Any]:
    """What the job's plan row keeps of its family (``PlanRow.family``): its device,
    range and buckets, and the cost tables profiled at a few sizes where the costs are a
    node's (to plan other sizes from)."""
    return {
        "tables": {str(s): t.model_dump(mode="json") for s, t in (tables or {}).items()},
        "device": family.device,
        "low": family.ranged.low,
        "high": family.ranged.high,
        "buckets": [
            {"low": b.low, "high": b.high, "predicted_peak_bytes": b.predicted_peak_bytes}
            for b in family.buckets
        ],
    }


def family_row(job_id: str, sized: SizedPlan) -> FamilyPlanRow:
    simulation = sized.simulation
    return FamilyPlanRow(
        job_id=job_id,
        size=sized.size,
        document=plan_to_json(sized.plan),
        origin=sized.origin[:255],
        predicted_ms=simulation.total_ms,
        peak_bytes=max(simulation.peak_bytes.values(), default=0),
        hits=0,
    )


def family_result(family: PlanFamily, strategy: str) -> StrategyResult:
    """The job's result: the largest size's plan, with a line per bucket; no plan where
    the largest size has none."""
    largest = family.cache.get(family.ranged.high)
    planned = sum(1 for b in family.buckets if b.high in family.cache)
    summary = (
        f"a plan family over sizes {family.ranged.low}..{family.ranged.high}: "
        f"{planned} of {len(family.buckets)} buckets planned by {strategy}"
    )
    if largest is None:
        fitting = [f"{b.low}..{b.high}" for b in family.buckets if b.high in family.cache]
        sizes = ", ".join(fitting) or "none"
        return StrategyResult(
            strategy,
            None,
            None,
            f"no plan fits the budget at size {family.ranged.high}, the range's largest "
            f"(sizes with plans: {sizes}); {summary}",
        )
    return StrategyResult(strategy, largest.plan, largest.simulation, summary)


def sized_plan(
    ctx: Services, session: Session, job_id: str, query: Mapping[str, str]
) -> tuple[dict[str, Any], str]:
    """The plan document for the sizes ``query`` gives (``NAME=DIMS`` per input) and
    whether it was a cache ``hit`` or a ``miss`` (planned now and stored)."""
    ranged = _family_range(session, job_id, f"got {', '.join(sorted(query))}")
    try:
        shapes = dict(parse_input_shape(f"{name}={dims}") for name, dims in query.items())
        size = ranged.size_of(shapes)
    except RematError as exc:
        raise ApiError(422, str(exc)) from None
    return plan_for_size(ctx, session, job_id, size)


def plan_for_size(
    ctx: Services, session: Session, job_id: str, size: int
) -> tuple[dict[str, Any], str]:
    """The plan document for ``size`` of a job over ranges of sizes, and ``hit`` (stored;
    counted) or ``miss`` (planned now and stored). 422 outside the range, or where the
    size's bucket has no plan."""
    ranged = _family_range(session, job_id, f"got size {size}")
    job, plan = session.get_one(JobRow, job_id), session.get_one(PlanRow, job_id)
    assert plan.family is not None
    if not ranged.low <= size <= ranged.high:
        raise ApiError(
            422,
            f"size {size} is outside the job's range {ranged.low}..{ranged.high}: no plan is "
            "given for it (submit a job whose range holds it)",
        )
    cached = session.get(FamilyPlanRow, (job_id, size))
    if cached is not None:
        cached.hits += 1
        document = cached.document
        session.commit()
        return document, "hit"
    buckets = [Bucket(**b) for b in plan.family["buckets"]]
    bucket = next(b for b in buckets if b.low <= size <= b.high)
    representative = session.get(FamilyPlanRow, (job_id, bucket.high))
    if representative is None:
        raise ApiError(
            422,
            f"no plan fits the budget at size {bucket.high}, so none is given for "
            f"sizes {bucket.low}..{bucket.high}",
        )
    spec, device = stored_spec(job.spec), plan.family["device"]
    model = session.get_one(ModelRow, job.model_id)
    rep_plan = plan_from_json(representative.document)
    session.commit()  # the reads end here: planning takes a while
    try:
        stored = plan.family.get("tables") or {}
        tables = {int(s): CostTable.model_validate(t) for s, t in stored.items()} or None
        problem = family_problems(spec, ctx.store.path(model.sha256), ranged, None, tables)(size)
        found = plan_size(problem, size, device, rep_plan, bucket.high)
    except RematError as exc:
        raise ApiError(422, str(exc)) from None
    row = family_row(job_id, found)
    session.add(row)
    try:
        session.commit()
    except IntegrityError:  # the same size at the same time: theirs is as good
        session.rollback()
    return plan_to_json(found.plan), "miss"


def _family_range(session: Session, job_id: str, asked: str) -> ShapeRange:
    """The range of a job over sizes with a plan: 404 without a job or plan, 422 for a
    job of one shape (``asked`` says what was asked of it)."""
    job = session.get(JobRow, job_id)
    plan = session.get(PlanRow, job_id)
    if job is None:
        raise ApiError(404, f"job {job_id!r} does not exist")
    if plan is None:
        raise ApiError(404, f"job {job_id!r} has no plan (status: {job.status})")
    ranged = job_range(stored_spec(job.spec))
    if ranged is None or plan.family is None:
        raise ApiError(
            422, f"job {job_id!r} has one input shape: its plan takes no sizes ({asked})"
        )
    return ranged


def family_of(session: Session, job_id: str) -> FamilyOut:
    """The job's family: 404 for a job of one shape or without a plan."""
    job = session.get(JobRow, job_id)
    plan = session.get(PlanRow, job_id)
    if job is None:
        raise ApiError(404, f"job {job_id!r} does not exist")
    if plan is None or plan.family is None:
        what = "has no plan yet" if plan is None else "has one input shape"
        raise ApiError(404, f"job {job_id!r} {what}: it has no plan family")
    query = select(FamilyPlanRow).where(FamilyPlanRow.job_id == job_id).order_by(FamilyPlanRow.size)
    rows = list(session.scalars(query))
    device = plan.family["device"]
    budget = next(
        (d.get("budget_bytes") for d in plan.document["devices"] if d["name"] == device), None
    )
    return FamilyOut(
        device=device,
        low=plan.family["low"],
        high=plan.family["high"],
        budget_bytes=budget,
        buckets=[FamilyBucketOut(**b) for b in plan.family["buckets"]],
        sizes=[FamilySizeOut.model_validate(r, from_attributes=True) for r in rows],
    )
