"""The database schema (SQLAlchemy 2 ORM). Migrations in ``migrations/`` create it;
change both together (``alembic revision --autogenerate`` compares them)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


def new_id() -> str:
    return uuid.uuid4().hex


def now() -> datetime:
    return datetime.now(UTC)


def utc(moment: datetime) -> datetime:
    """A stored time as an aware UTC time (SQLite gives naive ones back)."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """A timestamp stored in UTC and read back as an aware UTC time on every database
    (SQLite keeps no offset and gives naive times back; PostgreSQL gives the session's
    zone), so that the API always writes it with its offset."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return value.astimezone(UTC) if value is not None and value.tzinfo else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else utc(value).astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSON,
        datetime: UtcDateTime(),
    }


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class TaskStatus(StrEnum):
    QUEUED = "queued"
    LEASED = "leased"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (TaskStatus.SUCCEEDED, TaskStatus.FAILED)


class ModelRow(Base):
    """An uploaded ONNX model; its bytes live in the file store under ``sha256``."""

    __tablename__ = "models"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    filename: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column(Integer)
    summary: Mapped[dict[str, Any]]  # operator counts, parameter and activation bytes
    created_at: Mapped[datetime] = mapped_column(default=now, index=True)


class JobRow(Base):
    """A planning job: its request (``spec``), lifecycle and the solver's progress."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="RESTRICT"), index=True)
    spec: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED, index=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    request_hash: Mapped[str | None] = mapped_column(String(64))
    # progress of the running solve (the incumbent and the proven bound)
    incumbent_ms: Mapped[float | None] = mapped_column(Float)
    bound_ms: Mapped[float | None] = mapped_column(Float)
    gap: Mapped[float | None] = mapped_column(Float)
    elapsed_s: Mapped[float | None] = mapped_column(Float)
    solver_status: Mapped[str | None] = mapped_column(String(16))
    message: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=now, index=True)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    updated_at: Mapped[datetime] = mapped_column(default=now, onupdate=now)
    # the job's lease (workers/sweeper.py): running, its worker's last heartbeat; queued,
    # when it was last handed to the broker. ``worker`` names the holder of a running job.
    heartbeat_at: Mapped[datetime | None] = mapped_column(default=now)
    worker: Mapped[str | None] = mapped_column(String(255))

    @property
    def progress(self) -> dict[str, float | None]:
        """The running solve's progress columns together (the API's ``progress``)."""
        return {
            "incumbent_ms": self.incumbent_ms,
            "bound_ms": self.bound_ms,
            "gap": self.gap,
            "elapsed_s": self.elapsed_s,
        }


class PlanRow(Base):
    """A job's plan (the plan JSON) and its schedule for drawing; written once, after the
    simulator accepted the plan."""

    __tablename__ = "plans"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    document: Mapped[dict[str, Any]]
    schedule: Mapped[dict[str, Any]]
    baselines: Mapped[dict[str, Any] | None]  # the baselines on the same inputs
    # a job over ranges of sizes: its range, device and buckets (its plans: FamilyPlanRow)
    family: Mapped[dict[str, Any] | None]
    # the digest of the graph the plan was made for (``Plan.graph``): later jobs of the
    # same model and graph start from it (``services.jobs.earlier_plans``)
    graph_digest: Mapped[str | None] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime] = mapped_column(default=now)


class FamilyPlanRow(Base):
    """A plan of a job over ranges of sizes for one size: a bucket's representative
    (planned by the worker) or a size asked for later (planned then, and cached here)."""

    __tablename__ = "family_plans"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    size: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    document: Mapped[dict[str, Any]]
    origin: Mapped[str] = mapped_column(String(255))
    predicted_ms: Mapped[float] = mapped_column(Float)
    peak_bytes: Mapped[int] = mapped_column(BigInteger)
    hits: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(default=now)


class ProgressRow(Base):
    """One progress event of a job's solve (incumbent and bound at a moment): the history
    that the job row's progress columns only hold the latest of. A new attempt starts a
    new history."""

    __tablename__ = "job_progress"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    elapsed_s: Mapped[float] = mapped_column(Float)
    incumbent_ms: Mapped[float | None] = mapped_column(Float)
    bound_ms: Mapped[float | None] = mapped_column(Float)
    gap: Mapped[float | None] = mapped_column(Float)


class ProfileRow(Base):
    """A measured cost table (issue: node agents), keyed by model, inputs, node, devices."""

    __tablename__ = "profiles"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[str | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    key: Mapped[str] = mapped_column(String(64), index=True)  # hash of inputs and devices
    table: Mapped[dict[str, Any]]
    spec: Mapped[dict[str, Any] | None]  # what was profiled: mode, shapes, devices
    created_at: Mapped[datetime] = mapped_column(default=now)


class NodeRow(Base):
    """A compute node's agent (issue: node agents); its token is stored hashed."""

    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    devices: Mapped[dict[str, Any]]  # {"devices": [{name, kind, options}]}
    version: Mapped[str | None] = mapped_column(String(64))
    last_seen_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=now)


class AgentTaskRow(Base):
    """Work for one node's agents (profile, execute), with a lease and an attempt cap.

    ``lease_token`` is the lease of the current (or, once finished, the last) attempt: it
    proves which attempt a renewal or report belongs to.
    """

    __tablename__ = "agent_tasks"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    kind: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    node_id: Mapped[str | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    key: Mapped[str | None] = mapped_column(String(64), index=True)  # a profile task's key
    payload: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), default=TaskStatus.QUEUED, index=True)
    lease_token: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    progress: Mapped[dict[str, Any] | None]
    result: Mapped[dict[str, Any] | None]
    error: Mapped[str | None] = mapped_column(Text)
    finished_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=now)
    updated_at: Mapped[datetime] = mapped_column(default=now, onupdate=now)


class ApiKeyRow(Base):
    """An API key, stored as its sha256; once any exists, model and job endpoints need one."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(255))
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=now)
