"""Real service processes for the service tests: a fresh PostgreSQL database, a Redis
database, Celery workers, the API under uvicorn and ``remat serve``, each a subprocess on
this machine; and a small HTTP client with the waits the tests need."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg

from remat import samples

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PG_ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
REDIS = "redis://127.0.0.1:6379"
FINISHED = {"succeeded", "failed", "cancelled"}
WAIT_S = 120.0  # no test waits this long unless something is broken


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def postgres_database() -> Iterator[str]:
    """A new, empty database; its SQLAlchemy URL; dropped afterwards."""
    name = f"remat_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def redis_url(db: int) -> str:
    """Redis database ``db``, emptied. Each module uses its own numbers: scripts/test runs
    the service modules on two pytest-xdist workers, side by side."""
    import redis

    redis.Redis.from_url(f"{REDIS}/{db}").flushdb()
    return f"{REDIS}/{db}"


class Process:
    """A subprocess in its own process group, its output in a log file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> None:
        self.log = log
        self.handle = log.open("wb")
        self.popen = subprocess.Popen(
            args,
            cwd=cwd,
            env=env,
            stdout=self.handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_output(self, text: str, timeout: float = WAIT_S) -> None:
        wait(lambda: text in self.output() or self.popen.poll() is not None, timeout, text)
        assert text in self.output(), self.output()[-3000:]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """``sig`` to the whole group (the worker and its solver subprocesses)."""
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)
        self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.handle.close()


def service_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMAT_")}
    env.update({f"REMAT_{k.upper()}": v for k, v in settings.items()})
    return env


def celery_worker(env: dict[str, str], log: Path) -> Process:
    args = [
        str(BIN / "celery"),
        "-A",
        "workers.celery_app",
        "worker",
        "--pool",
        "threads",
        "--concurrency",
        "2",
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
    ]
    worker = Process(args, env, log)
    worker.wait_for_output("ready.")
    return worker


def api_server(env: dict[str, str], log: Path) -> tuple[Process, str]:
    port = free_port()
    args = [str(BIN / "uvicorn"), "--factory", "app.main:create_app", "--port", str(port)]
    server = Process(args, env, log)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, server)
    return server, url


def remat_serve(
    env: dict[str, str], log: Path, cwd: Path = ROOT, *options: str
) -> tuple[Process, str]:
    port = free_port()
    args = [str(BIN / "remat"), "serve", "--port", str(port), *options]
    server = Process(args, env, log, cwd)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, server)
    return server, url


def wait_ready(url: str, process: Process) -> None:
    def ready() -> bool:
        assert process.popen.poll() is None, process.output()[-3000:]
        try:
            return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait(ready, WAIT_S, f"{url} ready")


def wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# --- the API, as a client uses it ---------------------------------------------------------


def upload(client: httpx.Client, data: bytes, name: str = "model.onnx") -> httpx.Response:
    return client.post("/v1/models", files={"file": (name, data, "application/octet-stream")})


def problem(response: httpx.Response, status: int) -> dict[str, Any]:
    """The problem document (RFC 9457) of an error ``response``, which must have ``status``."""
    assert response.status_code == status, response.text[:2000]
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["status"] == status and body["title"] and body["detail"], body
    return body


def sample_bytes(name: str = "unet", **kwargs: Any) -> bytes:
    return samples.ZOO[name](**kwargs).SerializeToString()


def job_body(model_id: str, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model_id": model_id,
        "batch": 4,
        "devices": [{"name": "cpu0", "kind": "cpu"}],
        "budgets": {"cpu0": "50%"},
        "strategy": "checkmate_milp",
        "solver": {"backend": "highs", "time_limit_s": 5},
    }
    body.update(overrides)
    return body


def profiled_table(names: list[str]) -> dict[str, Any]:
    """A profiled cost table for nodes ``names`` as an agent reports it: cpu0 (1 thread)
    and cpu1 (2 threads), cpu1 ten times faster."""
    return {
        "source": "profiled",
        "devices": [
            {"name": "cpu0", "kind": "cpu", "threads": 1},
            {"name": "cpu1", "kind": "cpu", "threads": 2},
        ],
        "nodes": {
            n: {"compute_ms": {"cpu0": 10.0, "cpu1": 1.0}, "output_bytes": 64} for n in names
        },
        "copy_ms": {n: {"cpu0->cpu1": 0.5, "cpu1->cpu0": 0.5} for n in names},
    }


def wait_job(client: httpx.Client, job_id: str, statuses: set[str] = FINISHED) -> dict[str, Any]:
    found: dict[str, Any] = {}

    def reached() -> bool:
        found.update(client.get(f"/v1/jobs/{job_id}").json())
        return found["status"] in statuses

    wait(reached, WAIT_S, f"job {job_id} in {statuses}")
    return found
