"""The ``remat`` command: the library's commands (``remat.cli``) and the service's:

- ``remat serve``: the API with the embedded dispatcher on SQLite under the data
  directory (``REMAT_DATA_DIR``, default ``~/.remat``); no PostgreSQL or Redis needed;
- ``remat submit``: a thin HTTP client; uploads a model (or a sample), submits a job,
  shows its progress and prints the finished plan's summary;
- ``remat api-key create NAME``: a key for the API (printed once, stored hashed).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from app.settings import Settings
from remat import cli as remat_cli
from remat import samples
from remat.devices import format_bytes
from remat.errors import InvalidInputError

DEFAULT_PORT = 8642
POLL_S = 1.0


def main(argv: Sequence[str] | None = None) -> int:
    return remat_cli.main(argv, extend=_service_commands)


def _service_commands(commands: remat_cli.Commands) -> None:
    serve = commands.add_parser("serve", help="run the API with an embedded worker")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.add_argument(
        "--agent-device",
        action="append",
        default=[],
        metavar="NAME:KIND[:threads=N]",
        help="a device for the local agent, repeatable (default: this machine's devices)",
    )
    serve.add_argument("--no-agent", action="store_true", help="start no local agent")
    serve.set_defaults(run=_serve)

    submit = commands.add_parser("submit", help="submit a job to a server, print its plan")
    model = submit.add_mutually_exclusive_group(required=True)
    model.add_argument("model", nargs="?", type=Path, help="ONNX file")
    model.add_argument("--sample", choices=sorted(samples.ZOO), help="a built-in network")
    submit.add_argument("--server", default=f"http://127.0.0.1:{DEFAULT_PORT}")
    submit.add_argument("--api-key", help="API key (when the server requires one)")
    submit.add_argument("--device", action="append", default=[], metavar="NAME:KIND[:k=v]")
    submit.add_argument("--budget", action="append", default=[], metavar="NAME=SIZE")
    submit.add_argument("--batch", type=int, help="batch size")
    submit.add_argument("--mode", choices=["training", "inference"], default="training")
    submit.add_argument("--strategy", default="xengine")
    submit.add_argument("--solver", default="highs")
    submit.add_argument("--time-limit", type=float, default=30.0, metavar="S")
    submit.set_defaults(run=_submit)

    keys = commands.add_parser("api-key", help="manage API keys")
    keys.add_argument("action", choices=["create"])
    keys.add_argument("name")
    keys.set_defaults(run=_api_key)


# --- serve -------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.main import create_app
    from app.migrate import upgrade

    settings = Settings()
    if not settings.enroll_token:
        settings = Settings(enroll_token=secrets.token_urlsafe(24))
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database)
    app = create_app(settings)
    url = f"http://{args.host}:{args.port}"
    where = "Celery via " + settings.broker_url if settings.broker_url else "embedded worker"
    print(f"Remat serving on {url} ({where}; data: {settings.data_dir})")
    print(f"API docs: {url}/docs")
    print(f"agent enrollment token: {settings.enroll_token}", flush=True)
    agent = None if args.no_agent else _local_agent(url, settings, args.agent_device)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
    return 0


def _local_agent(
    url: str, settings: Settings, devices: list[str]
) -> subprocess.Popen[bytes] | None:
    """A ``remat-agent`` for this machine's devices (it needs the ``[agent]`` extra)."""
    if importlib.util.find_spec("torch") is None:
        print("no local agent: PyTorch is missing (pip install 'remat[agent]')", flush=True)
        return None
    command = [sys.executable, "-m", "agents.agent", "--server", url, "--name", "local"]
    command += ["--cache-dir", str(settings.data_dir / "agent")]
    for device in devices:
        command += ["--device", device]
    env = {**os.environ, "REMAT_ENROLL_TOKEN": settings.enroll_token or ""}
    print("local agent: starting (node 'local')", flush=True)
    return subprocess.Popen(command, env=env)


# --- submit ------------------------------------------------------------------------------


def _submit(args: argparse.Namespace) -> int:
    headers = {"X-API-Key": args.api_key} if args.api_key else {}
    with httpx.Client(base_url=args.server, headers=headers, timeout=60) as client:
        model = _upload(client, args)
        job = _call(client, "POST", "/v1/jobs", json=_job_body(args, model["id"]))
        print(f"job {job['id']} queued ({model['filename']}, {model['summary']['nodes']} nodes)")
        job = _wait(client, job["id"])
        if job["status"] != "succeeded":
            raise InvalidInputError(f"job {job['id']} {job['status']}: {job['error'] or ''}")
        plan = _call(client, "GET", f"/v1/jobs/{job['id']}/plan")
    _print_plan(job, plan)
    return 0


def _upload(client: httpx.Client, args: argparse.Namespace) -> dict[str, Any]:
    if args.sample:
        name, data = f"{args.sample}.onnx", samples.ZOO[args.sample]().SerializeToString()
    else:
        name, data = args.model.name, _read(args.model)
    files = {"file": (name, data, "application/octet-stream")}
    return _call(client, "POST", "/v1/models", files=files)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidInputError(f"cannot read {path}: {exc.strerror}") from None


def _job_body(args: argparse.Namespace, model_id: str) -> dict[str, Any]:
    devices = []
    for text in args.device or ["cpu0:cpu"]:
        name, _, rest = text.partition(":")
        kind, _, options = rest.partition(":")
        pairs = dict(item.split("=", 1) for item in options.split(",") if "=" in item)
        devices.append({"name": name, "kind": kind, "options": pairs})
    budgets = dict(item.split("=", 1) for item in args.budget if "=" in item)
    return {
        "model_id": model_id,
        "mode": args.mode,
        "batch": args.batch,
        "devices": devices,
        "budgets": budgets,
        "strategy": args.strategy,
        "solver": {"backend": args.solver, "time_limit_s": args.time_limit},
    }


def _wait(client: httpx.Client, job_id: str) -> dict[str, Any]:
    line = remat_cli.ProgressLine(sys.stderr)
    while True:
        job = _call(client, "GET", f"/v1/jobs/{job_id}")
        progress = job["progress"]
        if progress["incumbent_ms"] is not None and progress["elapsed_s"] is not None:
            line.show(_as_progress(progress))
        if job["status"] in ("succeeded", "failed", "cancelled"):
            if line.tty:
                sys.stderr.write("\n")
            return job
        time.sleep(POLL_S)


def _as_progress(progress: dict[str, Any]):  # type: ignore[no-untyped-def]
    from remat.solvers.model import Progress

    return Progress(
        progress["elapsed_s"], progress["incumbent_ms"], progress["bound_ms"], progress["gap"]
    )


def _call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    try:
        response = client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        raise InvalidInputError(f"cannot reach {client.base_url}: {exc}") from None
    if response.is_error:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise InvalidInputError(f"{method} {path}: {response.status_code} {detail}")
    return response.json()  # type: ignore[no-any-return]


def _print_plan(job: dict[str, Any], plan: dict[str, Any]) -> None:
    predicted = plan.get("predicted") or {}
    print(f"job:        {job['id']} {job['status']}")
    print(f"strategy:   {plan['strategy']}")
    print(f"predicted:  {predicted.get('total_ms', float('nan')):.3f} ms")
    for device in plan["devices"]:
        budget = device["budget_bytes"]
        peak = predicted.get("peak_bytes", {}).get(device["name"], 0)
        limit = "unlimited" if budget is None else format_bytes(budget)
        print(f"{device['name'] + ':':<11} peak {format_bytes(peak)}, budget {limit}")
    print(f"steps:      {len(plan['steps'])}")
    solver = plan.get("solver")
    if solver:
        print(
            f"solver:     {solver['status']}, bound {solver['bound']:.4f} ms, "
            f"gap {solver['gap']:.2%}, {solver['seconds']:.1f} s"
        )


# --- api-key ----------------------------------------------------------------------------


def _api_key(args: argparse.Namespace) -> int:
    from app.context import key_digest
    from app.database import Database
    from app.migrate import upgrade
    from app.tables import ApiKeyRow

    settings = Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database)
    key = "rk_" + secrets.token_urlsafe(24)
    db = Database(settings.database)
    with db.session() as session:
        session.add(ApiKeyRow(name=args.name, sha256=key_digest(key)))
    print(key)
    print("(shown once; send it in the X-API-Key header)", file=sys.stderr)
    return 0
