"""Property-based fuzzing of every endpoint from the OpenAPI schema (schemathesis), on both
shapes of the service: ``remat serve`` (SQLite, embedded worker) and the production shape
(uvicorn, PostgreSQL, Redis, a Celery worker). No request may get a 5xx, and every
response must conform to the schema: its status documented, its content type and body
as documented.

The servers hold a model and a finished job, and the fuzzer sends a node's agent token, so
that requests reach past the 404s and 401s into the handlers. The agent's long poll
(``POST /v1/agent/lease``) is left out: each call may wait a minute by design.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
from service import (
    BIN,
    api_server,
    celery_worker,
    job_body,
    postgres_database,
    redis_url,
    remat_serve,
    sample_bytes,
    service_env,
    upload,
    wait_job,
)

from app.migrate import upgrade

ENROLL = "fuzz-enrollment-token-0123456789"
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
]
MAX_TIME_S = 8  # per shape: the fuzzing phase repeats until it is spent
REDIS_DB = 8


def _populate(url: str) -> str:
    """A model, a finished job and a registered node; the node's agent token."""
    with httpx.Client(base_url=url, timeout=60) as client:
        model = upload(client, sample_bytes("chain", n=6), "chain.onnx").json()
        body = job_body(model["id"], batch=2, strategy="chen_sqrt", budgets={"cpu0": "80%"})
        job = client.post("/v1/jobs", json=body).json()
        assert wait_job(client, job["id"])["status"] == "succeeded"
        node = client.post(
            "/v1/agent/register",
            json={
                "enroll_token": ENROLL,
                "name": "fuzz",
                "devices": [{"name": "cpu0", "kind": "cpu"}],
            },
        )
        assert node.status_code == 200, node.text
        return str(node.json()["token"])


def _fuzz(url: str, token: str, log: Path) -> None:
    args = [
        str(BIN / "schemathesis"),
        "run",
        f"{url}/openapi.json",
        "--checks",
        ",".join(CHECKS),
        "--phases",
        "examples,coverage,fuzzing",
        "--max-time",
        str(MAX_TIME_S),
        "--max-examples",
        "50",
        "--generation-allow-x00",
        "true",
        "--request-timeout",
        "30",
        "--exclude-path",
        "/v1/agent/lease",
        "--seed",
        "30",
        "-H",
        f"Authorization: Bearer {token}",
    ]
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=MAX_TIME_S * 5, cwd=log.parent
    )
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_the_embedded_server_survives_fuzzing(tmp_path: Path) -> None:
    env = service_env(data_dir=str(tmp_path / "data"), enroll_token=ENROLL)
    server, url = remat_serve(env, tmp_path / "serve.log", Path.cwd(), "--no-agent")
    try:
        _fuzz(url, _populate(url), tmp_path / "schemathesis.log")
    finally:
        server.stop()
    assert "Traceback" not in server.output()


def test_the_production_shape_survives_fuzzing(tmp_path: Path) -> None:
    with postgres_database() as database:
        upgrade(database)
        env = service_env(
            database_url=database,
            broker_url=redis_url(REDIS_DB),
            data_dir=str(tmp_path / "data"),
            enroll_token=ENROLL,
        )
        worker = celery_worker(env, tmp_path / "worker.log")
        server, url = api_server(env, tmp_path / "api.log")
        processes: list[Any] = [server, worker]
        try:
            _fuzz(url, _populate(url), tmp_path / "schemathesis.log")
        finally:
            for process in processes:
                process.stop()
        assert "Traceback" not in server.output()
