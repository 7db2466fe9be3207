"""What a worker needs to run jobs: settings, the database and the model files."""

from __future__ import annotations

from dataclasses import dataclass

from app.database import Database
from app.settings import Settings
from app.storage import ModelStore


@dataclass(frozen=True)
class WorkerContext:
    settings: Settings
    db: Database
    store: ModelStore

    @classmethod
    def of(cls, settings: Settings) -> WorkerContext:
        return cls(settings, Database(settings.database), ModelStore(settings.model_dir))
