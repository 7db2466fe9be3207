"""The service's settings, from ``REMAT_*`` environment variables (pydantic-settings).

The embedded default needs none of them: SQLite and model files under the data directory,
jobs run by an in-process dispatcher. Production sets a PostgreSQL database and a Redis
broker, and jobs go to Celery workers.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1 << 20


def _default_data_dir() -> Path:
    return Path.home() / ".remat"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REMAT_", frozen=True)

    data_dir: Path = Field(default_factory=_default_data_dir)
    database_url: str | None = None  # default: SQLite under the data directory
    broker_url: str | None = None  # None: the embedded dispatcher instead of Celery
    embedded_jobs: int = Field(default=2, ge=1)  # jobs the embedded dispatcher runs at once
    max_upload_bytes: int = Field(default=512 * MiB, gt=0)
    max_attempts: int = Field(default=3, ge=1)  # a job's solve is tried at most this often
    max_time_limit_s: float = Field(default=3600.0, gt=0)
    default_time_limit_s: float = Field(default=60.0, gt=0)
    broker_visibility_timeout_s: int = Field(default=7200, gt=0)  # above the longest solve
    progress_interval_s: float = Field(default=1.0, ge=0)  # progress rows at most this often
    # node agents
    enroll_token: str | None = None  # None: agents cannot register
    heartbeat_s: float = Field(default=10.0, gt=0)  # agents send one this often
    offline_after_s: float = Field(default=35.0, gt=0)  # no heartbeat this long: offline
    lease_s: float = Field(default=60.0, gt=0)  # an agent's task lease, renewed while it works
    task_max_attempts: int = Field(default=3, ge=1)  # leases of one agent task at most
    profile_wait_s: float = Field(default=3600.0, gt=0)  # a job waits this long for a profile
    # request limits
    max_body_bytes: int = Field(default=10 * MiB, gt=0)  # a request body but an upload: 413
    body_timeout_s: float = Field(default=30.0, gt=0)  # a body stalled this long: 408
    max_cost_model_bytes: int = Field(default=256 * MiB, gt=0)  # a job's cost model: 422 above
    # The secret node "local" registers with: only ``remat serve`` sets it (a new one each
    # run, passed to the agent it starts); None: the name "local" cannot be registered.
    local_agent_token: str | None = None
    # jobs that lose their worker or their broker message (workers/sweeper.py)
    job_heartbeat_s: float = Field(default=5.0, gt=0)  # a running job's worker reports this often
    job_stale_s: float = Field(default=30.0, gt=0)  # no heartbeat this long: the job is taken back
    sweep_interval_s: float = Field(default=10.0, gt=0)  # the API's sweeper runs this often
    queued_grace_s: float = Field(default=30.0, gt=0)  # queued this long, message gone: re-sent

    @model_validator(mode="after")
    def _stale_after_heartbeats(self) -> Settings:
        """A job is taken back only after it missed more than one heartbeat."""
        if self.job_stale_s < 2 * self.job_heartbeat_s:
            raise ValueError("REMAT_JOB_STALE_S must be at least twice REMAT_JOB_HEARTBEAT_S")
        return self

    @property
    def database(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'remat.db'}"

    @property
    def model_dir(self) -> Path:
        return self.data_dir / "models"

    def enroll_token_problem(self) -> str | None:
        """Why the enrollment token is unfit to run with (a known default or too short to
        resist guessing), or None; ``create_app`` refuses to start with one."""
        token = self.enroll_token
        if not token:  # enrollment disabled
            return None
        if token in WEAK_ENROLL_TOKENS:
            return f"REMAT_ENROLL_TOKEN is the well-known default {token!r}: set a secret one"
        if len(token) < MIN_ENROLL_TOKEN_CHARS:
            return (
                f"REMAT_ENROLL_TOKEN is shorter than {MIN_ENROLL_TOKEN_CHARS} characters: "
                "set a longer secret (e.g. python -c 'import secrets; "
                "print(secrets.token_urlsafe(24))')"
            )
        return None


WEAK_ENROLL_TOKENS = frozenset({"change-me", "changeme"})
MIN_ENROLL_TOKEN_CHARS = 16
