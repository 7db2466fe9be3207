"""The service's settings, from ``REMAT_*`` environment variables (pydantic-settings).

The embedded default needs none of them: SQLite and model files under the data directory,
jobs run by an in-process dispatcher. Production sets a PostgreSQL database and a Redis
broker, and jobs go to Celery workers.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
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

    @property
    def database(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'remat.db'}"

    @property
    def model_dir(self) -> Path:
        return self.data_dir / "models"
