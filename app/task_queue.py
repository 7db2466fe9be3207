"""The agents' task queue: tasks for a node, leased one attempt at a time.

A lease is a random token with an expiry (stored as its sha256, like node tokens: the
database never holds a token that works). The agent renews it while it works and proves
it on every call about the task; a call with another token (the lease expired and the
task went back to the queue, or to another attempt) is refused. An expired lease puts
the task back in the queue; after ``max_attempts`` leases it fails. Claiming uses
``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so concurrent agents never wait on each other;
SQLite ignores it and serialises writers, and the claim's compare-and-set update (it only
lands while the row is still as read) keeps two claims from taking one task there.

The queue knows nothing of what tasks do: ``finish`` stores what the caller checked.
Calls about a held task take the request's session (the caller commits); ``claim``, which
an agent's long poll repeats, runs short transactions of its own.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from app.database import Database
from app.problem_details import ApiError
from app.tables import AgentTaskRow, TaskStatus, now


@dataclass(frozen=True)
class Claimed:
    row: AgentTaskRow
    token: str


class TaskQueue:
    def __init__(self, db: Database, lease_s: float, max_attempts: int) -> None:
        self.db, self.lease = db, timedelta(seconds=lease_s)
        self.max_attempts = max_attempts

    def claim(self, node_id: str) -> Claimed | None:
        """Lease the oldest queued task for ``node_id`` (one more attempt), or None."""
        with self.db.session() as session:
            sweep_expired(session, self.max_attempts)
        for _ in range(5):  # a lost compare-and-set race: another agent took it; look again
            with self.db.session() as session:
                row = session.scalar(
                    select(AgentTaskRow)
                    .where(AgentTaskRow.node_id == node_id)
                    .where(AgentTaskRow.status == TaskStatus.QUEUED)
                    .order_by(AgentTaskRow.created_at)
                    .limit(1)
                    .with_for_update(skip_locked=True)
                )
                if row is None:
                    return None
                token = secrets.token_hex(16)
                taken = session.execute(
                    update(AgentTaskRow)
                    .where(AgentTaskRow.id == row.id)
                    .where(AgentTaskRow.status == TaskStatus.QUEUED)
                    .where(AgentTaskRow.attempts == row.attempts)
                    .values(
                        status=TaskStatus.LEASED,
                        lease_token=lease_digest(token),
                        lease_expires_at=now() + self.lease,
                        attempts=row.attempts + 1,
                        updated_at=now(),
                    )
                    .execution_options(synchronize_session=False)
                )
                if taken.rowcount == 1:  # type: ignore[attr-defined]
                    session.refresh(row)
                    return Claimed(row, token)
        return None

    def renew(self, session: Session, task_id: str, node_id: str, token: str) -> datetime:
        row = self._held(session, task_id, node_id, token)
        expires = row.lease_expires_at = now() + self.lease
        return expires

    def progress(
        self, session: Session, task_id: str, node_id: str, token: str, progress: dict[str, Any]
    ) -> datetime:
        row = self._held(session, task_id, node_id, token)
        row.progress = progress
        expires = row.lease_expires_at = now() + self.lease
        return expires

    def release(self, session: Session, task_id: str, node_id: str, token: str) -> None:
        """The agent gives the task back unfinished (it is stopping): not its fault, so the
        attempt does not count."""
        row = self._held(session, task_id, node_id, token)
        row.status, row.lease_token, row.lease_expires_at = TaskStatus.QUEUED, None, None
        row.attempts = max(row.attempts - 1, 0)

    def lookup_report(
        self, session: Session, task_id: str, node_id: str, token: str
    ) -> AgentTaskRow:
        """The task a report is about: 404 if it is not this node's, 409 if the lease is not
        (or no longer) this one. A finished task with this lease is a repeated report."""
        row = session.get(AgentTaskRow, task_id)
        if row is None or row.node_id != node_id:
            raise ApiError(404, f"task {task_id!r} does not exist for this node")
        if not _holds(row, token):
            raise _stale(task_id)
        return row

    def finish(
        self,
        session: Session,
        task_id: str,
        token: str,
        status: TaskStatus,
        result: dict[str, Any] | None,
        error: str | None,
        also: Callable[[Session, AgentTaskRow], None] | None = None,
    ) -> bool:
        """Record the outcome once (and what ``also`` writes, in the same transaction);
        False if this lease's outcome was already recorded."""
        row = _locked(session, task_id)
        if row is None or not _holds(row, token):
            raise _stale(task_id)
        if TaskStatus(row.status).finished:
            return False
        row.status, row.result, row.error, row.finished_at = status, result, error, now()
        row.lease_expires_at = None
        if also is not None:
            also(session, row)
        return True

    def _held(self, session: Session, task_id: str, node_id: str, token: str) -> AgentTaskRow:
        row = _locked(session, task_id)
        if row is None or row.node_id != node_id:
            raise ApiError(404, f"task {task_id!r} does not exist for this node")
        if not _holds(row, token) or row.status != TaskStatus.LEASED:
            raise _stale(task_id)
        return row


def sweep_expired(session: Session, max_attempts: int) -> None:
    """Expired leases: back to the queue, or failed once their attempts are spent."""
    expired = session.scalars(
        select(AgentTaskRow)
        .where(AgentTaskRow.status == TaskStatus.LEASED)
        .where(AgentTaskRow.lease_expires_at < now())
        .with_for_update(skip_locked=True)
    ).all()
    for row in expired:
        if row.attempts >= max_attempts:
            row.status, row.finished_at = TaskStatus.FAILED, now()
            row.error = f"gave up after {row.attempts} attempts: the agent's lease expired"
        else:
            row.status, row.lease_token, row.lease_expires_at = TaskStatus.QUEUED, None, None


def active_task(session: Session, kind: str, key: str) -> AgentTaskRow | None:
    """An unfinished task of ``kind`` with ``key`` (to join instead of queueing twice)."""
    return session.scalar(
        select(AgentTaskRow)
        .where(AgentTaskRow.kind == kind, AgentTaskRow.key == key)
        .where(
            or_(AgentTaskRow.status == TaskStatus.QUEUED, AgentTaskRow.status == TaskStatus.LEASED)
        )
        .order_by(AgentTaskRow.created_at.desc())
        .limit(1)
    )


def _locked(session: Session, task_id: str) -> AgentTaskRow | None:
    """The task as it is now, locked until the session commits (PostgreSQL): read again
    even if the session read it before (``populate_existing``), so that a report that
    waited for the lock sees the one recorded before it."""
    return session.get(AgentTaskRow, task_id, with_for_update=True, populate_existing=True)


def lease_digest(token: str) -> str:
    """What is stored of a lease token."""
    return hashlib.sha256(token.encode()).hexdigest()


def _holds(row: AgentTaskRow, token: str) -> bool:
    """Whether ``token`` is the lease of the task's current (or last) attempt."""
    stored = row.lease_token
    return stored is not None and hmac.compare_digest(stored, lease_digest(token))


def _stale(task_id: str) -> ApiError:
    return ApiError(
        409,
        f"task {task_id!r}: this lease is not current (it expired or the task was handed to "
        "another attempt); stop working on it",
    )
