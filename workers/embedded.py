"""The embedded dispatcher: ``remat serve``'s worker, threads in the API process that run
queued jobs, ``REMAT_EMBEDDED_JOBS`` at a time (solves run in their own subprocesses;
a job waiting for a node's profile must not hold up the others), with the same
``solve_job`` as the Celery task. The database is its queue: ``enqueue`` only wakes it,
and it picks up what is queued and what is running without a heartbeat for
``REMAT_JOB_STALE_S`` (left by a server that died; the attempt cap stops a job that kills
it), never a job that a live thread (here or in another server on the same database)
holds."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

from sqlalchemy import and_, func, or_, select

from app.database import Database
from app.settings import Settings
from app.storage import ModelStore
from app.tables import JobRow, JobStatus, now
from workers.context import WorkerContext
from workers.solve import solve_job

log = logging.getLogger("remat.worker")
IDLE_POLL_S = 2.0


class EmbeddedDispatcher:
    def __init__(self, context: WorkerContext, jobs: int = 1) -> None:
        self.context = context
        self.wake = threading.Condition()
        self.stopping = threading.Event()
        self._active: set[str] = set()  # jobs a thread of this dispatcher is running
        self.threads = [
            threading.Thread(target=self._run, name=f"remat-dispatcher-{i}", daemon=True)
            for i in range(jobs)
        ]

    @classmethod
    def start(cls, settings: Settings, db: Database) -> EmbeddedDispatcher:
        context = WorkerContext(settings, db, ModelStore(settings.model_dir))
        dispatcher = cls(context, settings.embedded_jobs)
        for thread in dispatcher.threads:
            thread.start()
        return dispatcher

    def enqueue(self, job_id: str) -> None:
        with self.wake:
            self.wake.notify()

    def check(self) -> None:
        if not all(thread.is_alive() for thread in self.threads):
            raise RuntimeError("an embedded dispatcher thread has stopped")

    def stop(self) -> None:
        self.stopping.set()
        with self.wake:
            self.wake.notify_all()
        for thread in self.threads:
            thread.join(timeout=10)

    def _run(self) -> None:
        while not self.stopping.is_set():
            job_id = self._take()
            if job_id is None:
                with self.wake:
                    self.wake.wait(IDLE_POLL_S)
                continue
            try:
                solve_job(self.context, job_id)
            except Exception:
                log.exception("job %s: the dispatcher caught an error", job_id)
            finally:
                with self.wake:
                    self._active.discard(job_id)

    def _take(self) -> str | None:
        """The oldest job that is queued, or running without a recent heartbeat, that no
        thread here runs, now this thread's (``solve_job``'s claim decides for good)."""
        stale_before = now() - timedelta(seconds=self.context.settings.job_stale_s)
        with self.wake:
            with self.context.db.session() as session:
                abandoned = and_(
                    JobRow.status == JobStatus.RUNNING,
                    func.coalesce(JobRow.heartbeat_at, JobRow.updated_at) < stale_before,
                )
                query = select(JobRow.id).where(or_(JobRow.status == JobStatus.QUEUED, abandoned))
                if self._active:
                    query = query.where(JobRow.id.not_in(self._active))
                job_id = session.scalar(query.order_by(JobRow.created_at).limit(1))
            if job_id is not None:
                self._active.add(job_id)
            return job_id
