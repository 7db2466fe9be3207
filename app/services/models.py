"""Models: an upload registered once per content (validated, moved into the store,
recorded), and deleted only while no job uses it. A zip archive (a model with its
external data files) is stored as the one self-contained model it unpacks to."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import exists, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.planning import summarize
from app.problem_details import ApiError
from app.services import Services, get_or_404
from app.storage import TooLarge
from app.tables import JobRow, ModelRow
from app.upload_stream import Uploaded
from remat.errors import ModelLoadError, RematError
from remat.onnx_external import load_archive, starts_like_zip


def load_model(session: Session, model_id: str) -> ModelRow:
    return get_or_404(session, ModelRow, model_id, "model")


def register(session: Session, ctx: Services, uploaded: Uploaded) -> tuple[ModelRow, bool]:
    """The model row of these bytes, and whether it is new: validated, moved into the
    store and recorded if it was not there yet. A zip archive is unpacked first
    (``unpack``): the model stored, hashed and deduplicated is the self-contained one.
    Each read and write is its own short transaction: validating a model takes a while
    and holds no connection."""
    if not starts_like_zip(uploaded.staged.path):
        return _register(session, ctx, uploaded)
    unpacked = unpack(ctx, uploaded)
    try:
        return _register(session, ctx, unpacked)
    finally:
        ctx.store.discard(unpacked.staged)


def unpack(ctx: Services, uploaded: Uploaded) -> Uploaded:
    """The model of an uploaded zip archive with its external data embedded, staged as an
    upload of its own (named as the archive's ``.onnx`` member). 422 for an archive
    ``remat.onnx_external.load_archive`` refuses, or whose model, embedded, passes the
    upload limit; nothing is staged then."""
    limit = ctx.settings.max_upload_bytes
    try:
        archived = load_archive(uploaded.staged.path, limit)
        name, data = archived.name, archived.model.SerializeToString()
    except (ModelLoadError, ValueError) as exc:  # ValueError: protobuf's 2 GiB limit
        raise ApiError(422, f"not a usable model archive: {exc}") from None
    del archived  # the parsed model: only its bytes are needed from here
    staging = ctx.store.staging(limit)
    try:
        staging.write(data)
    except TooLarge:
        staging.abort()
        raise ApiError(
            422,
            "not a usable model archive: the model with its external data embedded is "
            f"larger than the limit of {limit} bytes",
        ) from None
    except BaseException:
        staging.abort()
        raise
    return Uploaded(staging.finish(), name)


def _register(session: Session, ctx: Services, uploaded: Uploaded) -> tuple[ModelRow, bool]:
    staged = uploaded.staged
    by_content = select(ModelRow).where(ModelRow.sha256 == staged.sha256)
    found = session.scalar(by_content)
    session.commit()
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
    session.add(row)
    try:
        session.commit()
    except IntegrityError:  # the same bytes uploaded at the same time: theirs won
        session.rollback()
        return session.scalars(by_content).one(), False
    return row, True


def delete(ctx: Services, session: Session, model_id: str) -> None:
    """Refused (409) while jobs use the model; its file goes once the row is gone."""
    row = load_model(session, model_id)
    if session.scalar(select(exists().where(JobRow.model_id == model_id))):
        raise ApiError(409, f"model {model_id!r} is used by jobs; delete them first")
    sha256 = row.sha256
    session.delete(row)
    session.commit()  # the file goes only once no row names it
    ctx.store.delete(sha256)
