"""The sweeper: the database, not the broker, says which jobs still have to run. Every
``REMAT_SWEEP_INTERVAL_S`` it

- takes back running jobs whose worker stopped heartbeating for ``REMAT_JOB_STALE_S``
  (killed, or cut off from the database): queued again and sent again, the attempt
  counted; past ``REMAT_MAX_ATTEMPTS`` failed with the reason; cancelled if a cancel was
  asked;
- sends again queued jobs whose message is in neither the broker's queue nor its unacked
  deliveries (lost with a Redis that restarted without persistence), once they were last
  sent ``REMAT_QUEUED_GRACE_S`` ago.

It runs as a thread in each API process with a Celery broker (started with the app): the
API is up whenever jobs are submitted and is what sends them, while workers may be none
(jobs queued before any starts) or all dead (the case to recover from). Several API
processes sweep safely: running jobs are read ``FOR UPDATE SKIP LOCKED`` (PostgreSQL) and
every change is a compare-and-set on what was read, so a job is taken back once; a job
sent twice gets two messages, and the claim of the second leaves it alone (it is running
with a fresh heartbeat, or finished). The embedded dispatcher needs no sweeper: the
database is its queue, and it claims running jobs whose heartbeat is stale itself.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from sqlalchemy import func, select, update

from app.database import Database
from app.settings import Settings
from app.tables import JobRow, JobStatus, now

log = logging.getLogger("remat.sweeper")
BATCH = 500  # jobs looked at per sweep and kind; the rest wait for the next sweep


class Broker(Protocol):
    """What the sweeper needs of a dispatcher (``workers.dispatch.CeleryDispatcher``)."""

    def enqueue(self, job_id: str) -> None: ...

    def pending(self) -> set[str]:
        """The jobs with a message in the broker (queued or delivered, not acknowledged)."""
        ...


@dataclass
class Swept:
    """What one sweep did, by job id."""

    requeued: list[str] = field(default_factory=list)  # running, stale: queued and sent again
    given_up: list[str] = field(default_factory=list)  # running, stale: failed or cancelled
    resent: list[str] = field(default_factory=list)  # queued, message lost: sent again


class Sweeper:
    def __init__(self, settings: Settings, db: Database, broker: Broker) -> None:
        self.settings, self.db, self.broker = settings, db, broker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="remat-sweeper", daemon=True)
        self._listable = True

    @classmethod
    def start(cls, settings: Settings, db: Database, broker: Broker) -> Sweeper:
        sweeper = cls(settings, db, broker)
        sweeper._thread.start()
        return sweeper

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception:  # the database or broker is away: the next sweep tries again
                log.warning("job sweep failed", exc_info=True)
            self._stop.wait(self.settings.sweep_interval_s)

    def sweep(self) -> Swept:
        swept = Swept()
        self._take_back_stale(swept)
        self._resend_lost(swept)
        for job_id in swept.requeued + swept.resent:
            try:
                self.broker.enqueue(job_id)
            except Exception:  # still queued: sent again once the grace period is over
                log.warning("job %s: could not be sent to the broker", job_id, exc_info=True)
        if swept.requeued or swept.given_up or swept.resent:
            log.warning(
                "sweep: %d running jobs without a heartbeat queued again, %d given up; "
                "%d queued jobs without a message sent again",
                len(swept.requeued),
                len(swept.given_up),
                len(swept.resent),
            )
        return swept

    def _take_back_stale(self, swept: Swept) -> None:
        stale_before = now() - timedelta(seconds=self.settings.job_stale_s)
        last_beat = func.coalesce(JobRow.heartbeat_at, JobRow.updated_at)
        stale = (JobRow.status == JobStatus.RUNNING) & (last_beat < stale_before)
        with self.db.session() as session:
            rows = session.execute(
                select(JobRow.id, JobRow.attempts, JobRow.cancel_requested)
                .where(stale)
                .order_by(JobRow.created_at)
                .limit(BATCH)
                .with_for_update(skip_locked=True)
            ).all()
            for job_id, attempts, cancel_requested in rows:
                values = self._taken_back(attempts, cancel_requested)
                changed = session.execute(
                    update(JobRow)
                    .where(JobRow.id == job_id, JobRow.attempts == attempts, stale)
                    .values(**values)
                    .execution_options(synchronize_session=False)
                )
                if changed.rowcount != 1:  # type: ignore[attr-defined]
                    continue  # claimed or finished meanwhile
                queued = values["status"] == JobStatus.QUEUED
                (swept.requeued if queued else swept.given_up).append(job_id)

    def _taken_back(self, attempts: int, cancel_requested: bool) -> dict[str, Any]:
        """A stale running job's new state."""
        if cancel_requested:
            return {
                "status": JobStatus.CANCELLED,
                "finished_at": now(),
                "message": "cancelled (its worker had stopped)",
            }
        if attempts >= self.settings.max_attempts:
            return {
                "status": JobStatus.FAILED,
                "finished_at": now(),
                "error": f"gave up after {attempts} attempts (its worker stopped mid-solve)",
            }
        return {
            "status": JobStatus.QUEUED,
            "heartbeat_at": now(),
            "worker": None,
            "message": f"queued again: the worker of attempt {attempts} stopped responding",
        }

    def _resend_lost(self, swept: Swept) -> None:
        if not self._listable:
            return
        sent_before = now() - timedelta(seconds=self.settings.queued_grace_s)
        last_sent = func.coalesce(JobRow.heartbeat_at, JobRow.created_at)
        overdue = (JobRow.status == JobStatus.QUEUED) & (last_sent < sent_before)
        with self.db.session() as session:
            candidates = session.scalars(
                select(JobRow.id).where(overdue).order_by(JobRow.created_at).limit(BATCH)
            ).all()
        if not candidates:
            return
        try:  # read after the rows: a message sent since is for a job not among them
            present = self.broker.pending()
        except NotImplementedError as exc:
            log.warning("queued jobs are not checked against the broker: %s", exc)
            self._listable = False
            return
        for job_id in candidates:
            if job_id in present:
                continue
            with self.db.session() as session:  # compare-and-set: one sweeper sends it
                marked = session.execute(
                    update(JobRow)
                    .where(JobRow.id == job_id, overdue)
                    .values(heartbeat_at=now(), updated_at=JobRow.updated_at)
                    .execution_options(synchronize_session=False)
                )
            if marked.rowcount == 1:  # type: ignore[attr-defined]
                swept.resent.append(job_id)
