"""The embedded dispatcher: ``remat serve``'s worker, a thread in the API process that
runs queued jobs one at a time with the same ``solve_job`` as the Celery task. The
database is its queue: ``enqueue`` only wakes it, and on start it picks up what an
earlier run left queued or running (the attempt cap stops a job that kills it)."""

from __future__ import annotations

import logging
import threading

from sqlalchemy import select

from app.database import Database
from app.settings import Settings
from app.storage import ModelStore
from app.tables import JobRow, JobStatus
from workers.context import WorkerContext
from workers.solve import solve_job

log = logging.getLogger("remat.worker")
IDLE_POLL_S = 2.0


class EmbeddedDispatcher:
    def __init__(self, context: WorkerContext) -> None:
        self.context = context
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="remat-dispatcher", daemon=True)

    @classmethod
    def start(cls, settings: Settings, db: Database) -> EmbeddedDispatcher:
        dispatcher = cls(WorkerContext(settings, db, ModelStore(settings.model_dir)))
        dispatcher.thread.start()
        return dispatcher

    def enqueue(self, job_id: str) -> None:
        self.wake.set()

    def check(self) -> None:
        if not self.thread.is_alive():
            raise RuntimeError("the embedded dispatcher thread has stopped")

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while not self.stopping.is_set():
            job_id = self._next()
            if job_id is None:
                self.wake.wait(IDLE_POLL_S)
                self.wake.clear()
                continue
            try:
                solve_job(self.context, job_id)
            except Exception:
                log.exception("job %s: the dispatcher caught an error", job_id)

    def _next(self) -> str | None:
        """The oldest job not finished (running ones only left over from an earlier run:
        this thread runs one job at a time)."""
        with self.context.db.session() as session:
            waiting = (JobStatus.QUEUED, JobStatus.RUNNING)
            query = select(JobRow.id).where(JobRow.status.in_(waiting))
            return session.scalar(query.order_by(JobRow.created_at).limit(1))
