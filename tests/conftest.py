"""Shared fixtures, and each test module's layer as a marker on its tests.

Layers (markers registered in pyproject.toml): a module's tests are ``slow``, ``service``,
``browser`` or ``cli`` as ``tests/layers.py`` says, the rest are the fast in-process layer.
CI runs them all; ``pytest -m "not service and not browser"`` needs no server, database or
browser, and ``-m "not service and not browser and not slow"`` takes under a minute. A new
module that starts processes (``tests/service.py``) or needs PostgreSQL or Redis goes into
``service``.

A test whose assertion depends on how much of the CPU it gets (what ``auto`` picks within
its time limit, a measured slowdown) is marked ``alone``: scripts/test runs the in-process
layers on two workers, then those tests by themselves.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from layers import LAYERS

from remat import samples

if TYPE_CHECKING:
    from fastapi.testclient import TestClient

    from app.settings import Settings


def pytest_configure(config: pytest.Config) -> None:
    """A module renamed or removed must leave ``LAYERS`` too (else its successor would
    silently land in the fast layer)."""
    here = Path(__file__).parent
    gone = sorted(
        m for modules in LAYERS.values() for m in modules if not (here / f"{m}.py").exists()
    )
    if gone:
        raise pytest.UsageError(f"tests/conftest.py: LAYERS names missing modules {gone}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for marker, modules in LAYERS.items():
            if item.path.stem in modules:
                item.add_marker(marker)


# --- services with real processes (a module's ``server`` fixture: a dict with its url) -----


@pytest.fixture
def client(server: dict[str, Any]) -> Iterator[httpx.Client]:
    """An HTTP client of the module's ``server``."""
    with httpx.Client(base_url=server["url"], timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def vgg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The VGG-16 sample as an ONNX file."""
    path = tmp_path_factory.mktemp("models") / "vgg16.onnx"
    path.write_bytes(samples.vgg16().SerializeToString())
    return path


# --- the API in process: FastAPI's TestClient on SQLite, no subprocesses -----------------


@dataclass
class RecordingDispatcher:
    """A dispatcher that only records the jobs it is handed (they stay queued); ``run``
    solves them here, as a worker would."""

    settings: Settings
    enqueued: list[str] = field(default_factory=list)

    def enqueue(self, job_id: str) -> None:
        self.enqueued.append(job_id)

    def check(self) -> None:
        pass

    def run(self) -> None:
        """Solve every job handed over so far with the workers' ``solve_job``."""
        from workers.context import WorkerContext
        from workers.solve import solve_job

        context = WorkerContext.of(self.settings)
        try:
            while self.enqueued:
                solve_job(context, self.enqueued.pop(0))
        finally:
            context.db.dispose()


@dataclass
class InProcessApi:
    client: TestClient
    dispatcher: RecordingDispatcher
    settings: Settings


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite database with every migration applied, copied by each test that needs one."""
    from app.migrate import upgrade

    path = tmp_path_factory.mktemp("migrated") / "remat.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def api(
    request: pytest.FixtureRequest, tmp_path: Path, migrated_sqlite: Path
) -> Iterator[InProcessApi]:
    """The app of ``create_app`` on a fresh SQLite database under ``tmp_path``, with a
    ``RecordingDispatcher``, behind FastAPI's TestClient. Other settings: parametrize it
    indirectly with a dict (``@pytest.mark.parametrize("api", [{...}], indirect=True)``)."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    shutil.copyfile(migrated_sqlite, tmp_path / "remat.db")
    overrides = getattr(request, "param", {})
    settings = Settings(
        data_dir=tmp_path, database_url=None, broker_url=None, enroll_token=None, **overrides
    )
    dispatcher = RecordingDispatcher(settings)
    with TestClient(create_app(settings, dispatcher)) as client:
        yield InProcessApi(client, dispatcher, settings)
