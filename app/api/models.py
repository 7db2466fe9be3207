"""``/v1/models``: upload (streamed, validated, deduplicated by sha256), list, get, graph,
delete."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from sqlalchemy import exists, select
from sqlalchemy.exc import IntegrityError
from starlette.datastructures import UploadFile

from app.context import Services, get_or_404, require_key, services
from app.pagination import MAX_LIMIT, fetch
from app.planning import job_graph, summarize
from app.problems import ApiError
from app.schemas import JobSpec, ModelOut, ModelSummary, Page
from app.storage import TooLarge
from app.tables import JobRow, ModelRow
from remat.cli import graph_to_json
from remat.errors import RematError
from remat.graph import Mode

router = APIRouter(prefix="/v1/models", tags=["models"], dependencies=[Depends(require_key)])
CHUNK = 1 << 20
FORM_OVERHEAD = 64 * 1024  # multipart boundaries and headers around the file


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
    the same model (200 instead of 201)."""
    limit = ctx.settings.max_upload_bytes
    upload = await _file_field(request, limit)
    staged = await ctx.store.stage(_chunks(upload), limit)
    try:
        with ctx.db.session() as session:
            found = session.scalar(select(ModelRow).where(ModelRow.sha256 == staged.sha256))
        if found is not None:
            response.status_code = 200
            return to_out(found)
        summary = _validated(staged.path)
        path = ctx.store.keep(staged)
        row = ModelRow(
            sha256=staged.sha256,
            filename=Path(upload.filename or "model.onnx").name[:255],
            size_bytes=staged.size,
            summary=summary.model_dump(),
        )
        try:
            with ctx.db.session() as session:
                session.add(row)
        except IntegrityError:  # the same bytes uploaded at the same time: theirs won
            with ctx.db.session() as session:
                row = session.scalars(
                    select(ModelRow).where(ModelRow.sha256 == staged.sha256)
                ).one()
            response.status_code = 200
        response.headers["Location"] = f"/v1/models/{row.id}"
        assert path.exists()
        return to_out(row)
    finally:
        ctx.store.discard(staged)


async def _file_field(request: Request, limit: int) -> UploadFile:
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise ApiError(
            415, f"expected multipart/form-data with the ONNX file in 'file', got {content_type!r}"
        )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit + FORM_OVERHEAD:
        raise TooLarge(limit)
    form = await request.form(max_files=1, max_fields=4)
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise ApiError(422, "the form has no file field named 'file'")
    return upload


async def _chunks(upload: UploadFile):  # type: ignore[no-untyped-def]
    while chunk := await upload.read(CHUNK):
        yield chunk


def _validated(path: Path) -> ModelSummary:
    try:
        return summarize(path)
    except RematError as exc:
        raise ApiError(422, f"not a usable ONNX model: {exc}") from None


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
    model_id: str,
    ctx: Annotated[Services, Depends(services)],
    mode: Mode = Mode.TRAINING,
    batch: Annotated[int | None, Query(ge=1)] = None,
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
