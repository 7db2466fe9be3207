"""``/v1/models``: upload (streamed, validated, deduplicated by sha256), list, get, graph,
delete."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from anyio import CapacityLimiter, to_thread
from fastapi import APIRouter, Depends, Query, Request, Response
from sqlalchemy import exists, select
from sqlalchemy.exc import IntegrityError

from app.context import PathId, Services, get_or_404, require_key, services
from app.pagination import MAX_LIMIT, fetch
from app.planning import job_graph, summarize
from app.problems import ApiError
from app.schemas import MAX_BATCH, JobSpec, ModelOut, ModelSummary, Page
from app.tables import JobRow, ModelRow
from app.upload_stream import Uploaded, receive_file
from remat.cli import graph_to_json
from remat.errors import RematError
from remat.graph import Mode

router = APIRouter(prefix="/v1/models", tags=["models"], dependencies=[Depends(require_key)])
VALIDATIONS_AT_ONCE = 2  # uploads validated at once per process (CPU and memory bound)


def to_out(row: ModelRow) -> ModelOut:
    return ModelOut(
        id=row.id,
        sha256=row.sha256,
        filename=row.filename,
        size_bytes=row.size_bytes,
        created_at=row.created_at,
        summary=ModelSummary.model_validate(row.summary),
    )


@router.post("", status_code=201, response_model=ModelOut)
async def upload_model(
    request: Request, response: Response, ctx: Annotated[Services, Depends(services)]
) -> ModelOut:
    """Multipart upload of an ONNX file in the field ``file``. The same bytes again give
    the same model (200 instead of 201). The body is counted as it arrives; validation
    runs off the event loop, a few uploads at a time."""
    uploaded = await receive_file(request, ctx.store.staging(ctx.settings.max_upload_bytes))
    try:
        row, created = await to_thread.run_sync(
            _register, ctx, uploaded, limiter=_validation_limiter(request)
        )
    finally:
        ctx.store.discard(uploaded.staged)
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"/v1/models/{row.id}"
    return to_out(row)


def _validation_limiter(request: Request) -> CapacityLimiter:
    """At most ``VALIDATIONS_AT_ONCE`` models validated at a time in this process."""
    state = request.app.state
    if getattr(state, "validation_limiter", None) is None:
        state.validation_limiter = CapacityLimiter(VALIDATIONS_AT_ONCE)
    return state.validation_limiter  # type: ignore[no-any-return]


def _register(ctx: Services, uploaded: Uploaded) -> tuple[ModelRow, bool]:
    """The model row of these bytes, and whether it is new: validated, moved into the
    store and recorded if it was not there yet."""
    staged = uploaded.staged
    with ctx.db.session() as session:
        found = session.scalar(select(ModelRow).where(ModelRow.sha256 == staged.sha256))
    if found is not None:
        return found, False
    try:
        summary = summarize(staged.path)
    except RematError as exc:
        raise ApiError(422, f"not a usable ONNX model: {exc}") from None
    ctx.store.keep(staged)
    row = ModelRow(
        sha256=staged.sha256,
        filename=Path(uploaded.filename or "model.onnx").name[:255],
        size_bytes=staged.size,
        summary=summary.model_dump(),
    )
    try:
        with ctx.db.session() as session:
            session.add(row)
    except IntegrityError:  # the same bytes uploaded at the same time: theirs won
        with ctx.db.session() as session:
            return session.scalars(
                select(ModelRow).where(ModelRow.sha256 == staged.sha256)
            ).one(), False
    return row, True


@router.get("", response_model=Page[ModelOut])
def list_models(
    ctx: Annotated[Services, Depends(services)],
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 50,
) -> Page[ModelOut]:
    rows, after = fetch(ctx.db, select(ModelRow), ModelRow, cursor, limit)
    return Page[ModelOut](items=[to_out(r) for r in rows], next_cursor=after)


def load_model_row(ctx: Services, model_id: str) -> ModelRow:
    return get_or_404(ctx.db, ModelRow, model_id, "model")


@router.get("/{model_id}", response_model=ModelOut)
def get_model(model_id: str, ctx: Annotated[Services, Depends(services)]) -> ModelOut:
    return to_out(load_model_row(ctx, model_id))


@router.get("/{model_id}/graph")
def get_graph(
    model_id: PathId,
    ctx: Annotated[Services, Depends(services)],
    mode: Mode = Mode.TRAINING,
    batch: Annotated[int | None, Query(ge=1, le=MAX_BATCH)] = None,
) -> dict[str, object]:
    """The model's graph (nodes, dependencies, output bytes) in ``mode`` at ``batch``."""
    row = load_model_row(ctx, model_id)
    spec = JobSpec(model_id=model_id, mode=mode, batch=batch)
    return graph_to_json(job_graph(spec, ctx.store.path(row.sha256)))


@router.delete("/{model_id}", status_code=204)
def delete_model(model_id: str, ctx: Annotated[Services, Depends(services)]) -> Response:
    """Refused (409) while jobs use the model."""
    with ctx.db.session() as session:
        row = session.get(ModelRow, model_id)
        if row is None:
            raise ApiError(404, f"model {model_id!r} does not exist")
        if session.scalar(select(exists().where(JobRow.model_id == model_id))):
            raise ApiError(409, f"model {model_id!r} is used by jobs; delete them first")
        sha256 = row.sha256
        session.delete(row)
    ctx.store.delete(sha256)
    return Response(status_code=204)
