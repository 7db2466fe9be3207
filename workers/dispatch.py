"""How the API hands committed jobs to solvers: Celery when a broker is configured, else
the embedded dispatcher (``remat serve`` without PostgreSQL or Redis)."""

from __future__ import annotations

from celery import Celery

from app.context import Dispatcher
from app.database import Database
from app.settings import Settings
from workers.embedded import EmbeddedDispatcher


class CeleryDispatcher:
    def __init__(self, settings: Settings) -> None:
        from workers.celery_app import SOLVE_TASK, make_celery

        self.celery: Celery = make_celery(settings)
        self.task = SOLVE_TASK

    def enqueue(self, job_id: str) -> None:
        self.celery.send_task(self.task, args=[job_id])

    def check(self) -> None:
        with self.celery.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=2)


def dispatcher_for(settings: Settings, db: Database) -> Dispatcher:
    if settings.broker_url:
        return CeleryDispatcher(settings)
    return EmbeddedDispatcher.start(settings, db)
