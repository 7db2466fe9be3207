"""What request handlers share (settings, database, file store, dispatcher), and the
API-key check."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated, Protocol, TypeVar

from fastapi import Path, Query, Request
from sqlalchemy import case, func, select

from app.database import Database
from app.problems import ApiError
from app.schemas import ID_MAX, ID_PATTERN
from app.settings import Settings
from app.storage import ModelStore
from app.tables import ApiKeyRow
from app.task_queue import TaskQueue

API_KEY_HEADER = "X-API-Key"
T = TypeVar("T")
# An id in a path or a query: malformed ones (a NUL byte, too long) get 422 before any
# database sees them.
PathId = Annotated[str, Path(pattern=ID_PATTERN, max_length=ID_MAX)]
QueryId = Annotated[str | None, Query(pattern=ID_PATTERN, max_length=ID_MAX)]
Cursor = Annotated[str | None, Query(pattern=r"^[A-Za-z0-9_=-]+$", max_length=512)]


class Dispatcher(Protocol):
    """Where committed jobs go to be solved: Celery workers, or the embedded dispatcher."""

    def enqueue(self, job_id: str) -> None: ...

    def check(self) -> None:
        """Raise if jobs cannot be dispatched now (``/readyz``)."""


@dataclass
class Services:
    settings: Settings
    db: Database
    store: ModelStore
    dispatcher: Dispatcher
    tasks: TaskQueue


def services(request: Request) -> Services:
    return request.app.state.services  # type: ignore[no-any-return]


def get_or_404(db: Database, table: type[T], id_: str, what: str) -> T:
    """The row of ``table`` with primary key ``id_``, or a 404 naming ``what``."""
    with db.session() as session:
        row = session.get(table, id_)
    if row is None:
        raise ApiError(404, f"{what} {id_!r} does not exist")
    return row


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def require_key(request: Request) -> None:
    """Once any API key exists, model and job endpoints need one (``X-API-Key``)."""
    db = services(request).db
    key = request.headers.get(API_KEY_HEADER)
    digest = key_digest(key) if key else ""
    # one round trip: whether any key exists, and whether this one does
    query = select(func.count(ApiKeyRow.id), func.max(case((ApiKeyRow.sha256 == digest, 1))))
    with db.session() as session:
        keys, found = session.execute(query).one()
    if keys and not found:
        raise ApiError(401, f"a valid API key is required in the {API_KEY_HEADER} header")
