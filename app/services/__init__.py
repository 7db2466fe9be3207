"""The service layer: what the API does, apart from HTTP. Routers (``app/api``) translate
requests into calls here and results into responses; a service takes the request's
database session (``app.api.deps.SessionDep``) and the ``Services`` it needs.

``Services`` holds what every request shares: settings, the database, the model file
store, the job dispatcher and the agents' task queue (one per application, made by
``app.main.create_app``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol, TypeVar

from sqlalchemy.orm import Session

from app.database import Database
from app.problem_details import ApiError
from app.settings import Settings
from app.storage import ModelStore
from app.task_queue import TaskQueue

T = TypeVar("T")


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


def key_digest(key: str) -> str:
    """What is stored of an API key or a node token (never the secret itself)."""
    return hashlib.sha256(key.encode()).hexdigest()


def get_or_404(session: Session, table: type[T], id_: str, what: str) -> T:
    """The row of ``table`` with primary key ``id_``, or a 404 naming ``what``."""
    row = session.get(table, id_)
    if row is None:
        raise ApiError(404, f"{what} {id_!r} does not exist")
    return row
