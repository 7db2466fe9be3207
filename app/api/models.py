"""``/v1/models``: upload (streamed, validated, deduplicated by sha256), list, get, graph,
delete."""

from __future__ import annotations

from typing import Annotated

from anyio import CapacityLimiter, to_thread
from fastapi import APIRouter, Depends, Query, Request, Response
from sqlalchemy import select

from app.api.deps import PathId, ServicesDep, SessionDep, require_key
from app.pagination import MAX_LIMIT, fetch
from app.planning import job_graph
from app.schemas import MAX_BATCH, JobSpec, ModelOut, Page
from app.services import models
from app.tables import ModelRow
from app.upload_stream import receive_file
from remat.cli import graph_to_json
from remat.graph import Mode

router = APIRouter(prefix="/v1/models", tags=["models"], dependencies=[Depends(require_key)])
VALIDATIONS_AT_ONCE = 2  # uploads validated at once per process (CPU and memory bound)


@router.post("", status_code=201, response_model=ModelOut)
async def upload_model(
    request: Request, response: Response, ctx: ServicesDep, session: SessionDep
) -> ModelOut:
    """Multipart upload of an ONNX file in the field ``file``, or of a zip archive holding
    one with its external data files (told apart by their first bytes; the archive is
    stored as the self-contained model it unpacks to). The same model again gives the
    same model (200 instead of 201). The body is counted as it arrives; validation runs
    off the event loop, a few uploads at a time."""
    uploaded = await receive_file(request, ctx.store.staging(ctx.settings.max_upload_bytes))
    try:
        row, created = await to_thread.run_sync(
            models.register, session, ctx, uploaded, limiter=_validation_limiter(request)
        )
    finally:
        ctx.store.discard(uploaded.staged)
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"/v1/models/{row.id}"
    return ModelOut.model_validate(row, from_attributes=True)


def _validation_limiter(request: Request) -> CapacityLimiter:
    """At most ``VALIDATIONS_AT_ONCE`` models validated at a time in this process."""
    state = request.app.state
    if getattr(state, "validation_limiter", None) is None:
        state.validation_limiter = CapacityLimiter(VALIDATIONS_AT_ONCE)
    limiter: CapacityLimiter = state.validation_limiter
    return limiter


@router.get("", response_model=Page[ModelOut])
def list_models(
    session: SessionDep,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 50,
) -> Page[ModelOut]:
    rows, after = fetch(session, select(ModelRow), ModelRow, cursor, limit)
    items = [ModelOut.model_validate(r, from_attributes=True) for r in rows]
    return Page[ModelOut](items=items, next_cursor=after)


@router.get("/{model_id}", response_model=ModelOut)
def get_model(model_id: str, session: SessionDep) -> ModelOut:
    return ModelOut.model_validate(models.load_model(session, model_id), from_attributes=True)


@router.get("/{model_id}/graph")
def get_graph(
    model_id: PathId,
    ctx: ServicesDep,
    session: SessionDep,
    mode: Mode = Mode.TRAINING,
    batch: Annotated[int | None, Query(ge=1, le=MAX_BATCH)] = None,
    fuse_attention: bool = True,
) -> dict[str, object]:
    """The model's graph (nodes, dependencies, output bytes) in ``mode`` at ``batch``, as
    a job with ``fuse_attention`` plans it."""
    row = models.load_model(session, model_id)
    session.commit()  # the read ends here: building the graph can take a while
    spec = JobSpec(model_id=model_id, mode=mode, batch=batch, fuse_attention=fuse_attention)
    return graph_to_json(job_graph(spec, ctx.store.path(row.sha256)))


@router.delete("/{model_id}", status_code=204)
def delete_model(model_id: str, ctx: ServicesDep, session: SessionDep) -> Response:
    """Refused (409) while jobs use the model."""
    models.delete(ctx, session, model_id)
    return Response(status_code=204)
