"""The ``remat`` command: the library's commands (``remat.cli``) and the service's:

- ``remat serve``: the API with the embedded dispatcher on SQLite under the data
  directory (``REMAT_DATA_DIR``, default ``~/.remat``); no PostgreSQL or Redis needed.
  Its console shows its own lifecycle lines and warnings; ``--verbose`` adds every HTTP
  request (uvicorn's access log, the local agent's heartbeats and long polls);
- ``remat submit``: a thin HTTP client; waits for a server that is still starting
  (``--wait-for-server``), uploads a model (or a sample), submits a job, shows its
  progress and prints the finished plan's summary;
- ``remat api-key create NAME``: a key for the API (printed once, stored hashed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import httpx
from uvicorn import server as uvicorn_server

from app.settings import Settings
from remat import cli as remat_cli
from remat import samples
from remat.agent_protocol import LOCAL_NODE
from remat.devices import format_bytes
from remat.errors import InvalidInputError
from remat.onnx_external import archive_with_external_data, is_zip, model_in_directory

if TYPE_CHECKING:
    from remat.solvers.model import Progress

DEFAULT_PORT = 8642
POLL_S = 1.0
AGENT_STOP_S = 15.0  # the local agent gives its lease back in this time, or is killed
WAIT_FOR_SERVER_S = 30.0  # how long ``remat submit`` waits for a server that is starting
LOG_FORMAT = "%(asctime)s %(name)s %(message)s"


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
    serve.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log every HTTP request (access log, the local agent's heartbeats) and INFO lines",
    )
    serve.set_defaults(run=_serve)

    submit = commands.add_parser("submit", help="submit a job to a server, print its plan")
    model = submit.add_mutually_exclusive_group(required=True)
    model.add_argument("model", nargs="?", type=Path, help="ONNX file")
    model.add_argument("--sample", choices=sorted(samples.ZOO), help="a built-in network")
    submit.add_argument("--server", default=f"http://127.0.0.1:{DEFAULT_PORT}")
    submit.add_argument(
        "--wait-for-server",
        type=float,
        default=WAIT_FOR_SERVER_S,
        metavar="S",
        help="wait this long for a server that is starting to be ready "
        f"(default: {WAIT_FOR_SERVER_S:g} s; 0: try once)",
    )
    submit.add_argument("--api-key", help="API key (when the server requires one)")
    submit.add_argument("--device", action="append", default=[], metavar="NAME:KIND[:k=v]")
    submit.add_argument("--budget", action="append", default=[], metavar="NAME=SIZE")
    submit.add_argument("--batch", type=int, help="batch size")
    submit.add_argument("--mode", choices=["training", "inference"], default="training")
    remat_cli.loss_arguments(submit)
    remat_cli.fusion_argument(submit)
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

    _configure_logging(args.verbose)
    settings = Settings()
    # The local agent registers as node "local" with a secret of this run's, which no
    # other agent (nor one left over from an earlier run) has.
    local_token = None if args.no_agent else secrets.token_urlsafe(32)
    overrides: dict[str, Any] = {"local_agent_token": local_token}
    if not settings.enroll_token:
        overrides["enroll_token"] = secrets.token_urlsafe(24)
    settings = Settings(**overrides)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database)
    app = create_app(settings)
    url = f"http://{args.host}:{args.port}"
    where = "Celery via " + settings.broker_url if settings.broker_url else "embedded worker"
    print(f"Remat serving on {url} ({where}; data: {settings.data_dir})")
    print(f"API docs: {url}/docs")
    print(f"agent enrollment token: {settings.enroll_token}", flush=True)
    level = "info" if args.verbose else "warning"  # info: uvicorn's access log too
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=level)
    server = _Server(config, app)
    try:
        if local_token is not None:
            server.agent = _local_agent(
                url, settings, args.agent_device, local_token, verbose=args.verbose
            )
        server.run()
    finally:
        server.cleanup()  # e.g. the port was taken: the agent must not stay behind
    return 0


class _Server(uvicorn_server.Server):
    """uvicorn's server with ``remat serve``'s shutdown. On SIGTERM or SIGINT: the app's
    shutdown flag is set at once (event streams and agents' long polls end; uvicorn would
    wait for them), the embedded dispatcher takes no new job, and the local agent stops
    first, while the API still answers it (it gives back the lease of a task in hand);
    then uvicorn shuts down. However the server ends, the agent is gone before the process
    is: ``cleanup`` runs before uvicorn re-raises the signal that stopped it. SIGKILL
    leaves no chance for that: the agent dies with its parent by itself (``--parent-pid``).
    """

    def __init__(self, config: Any, app: Any) -> None:
        super().__init__(config)
        self._app = app
        self.agent: subprocess.Popen[bytes] | None = None
        self._stopping: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        from app.lifecycle import shutdown_event

        shutdown_event(self._app).set()
        if self._stopping is None:
            self._stopping = threading.Thread(
                target=self._stop_then_exit, args=(sig,), name="remat-serve-stop", daemon=True
            )
            self._stopping.start()
        else:  # a second signal: stop waiting
            super().handle_exit(sig, frame)

    def _stop_then_exit(self, sig: int) -> None:
        _stop_dispatcher(self._app)
        self._stop_agent()
        super().handle_exit(sig, None)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self.cleanup()

    def cleanup(self) -> None:
        self._stop_agent()

    def _stop_agent(self) -> None:
        agent = self.agent
        if agent is None or agent.poll() is not None:
            return
        agent.terminate()
        try:
            agent.wait(timeout=AGENT_STOP_S)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()


def _stop_dispatcher(app: Any) -> None:
    """Have the embedded dispatcher's threads take no new job (a job in hand is left to
    the next start, as after a crash); Celery's dispatcher has nothing to stop."""
    stop = getattr(app.state.services.dispatcher, "stop", None)
    if stop is not None:
        threading.Thread(target=stop, name="remat-dispatcher-stop", daemon=True).start()


def _configure_logging(verbose: bool) -> None:
    """The service's own log lines at WARNING (INFO with ``verbose``); HTTP clients'
    per-request lines (httpx at INFO, httpcore at DEBUG) only with ``verbose``."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=LOG_FORMAT)
    if not verbose:
        for name in ("httpx", "httpcore", "uvicorn.access"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _local_agent(
    url: str, settings: Settings, devices: list[str], token: str, verbose: bool = False
) -> subprocess.Popen[bytes] | None:
    """A ``remat-agent`` for this machine's devices (it needs the ``[agent]`` extra), node
    ``local``: it enrolls with ``token`` and exits with this process (``--parent-pid``).
    Its lifecycle lines (registered, each task, stopped) show at INFO; its HTTP requests
    (a heartbeat every few seconds) only with ``verbose``."""
    if importlib.util.find_spec("torch") is None:
        print("no local agent: PyTorch is missing (pip install 'remat[agent]')", flush=True)
        return None
    command = [sys.executable, "-m", "agents.agent", "--server", url, "--name", LOCAL_NODE]
    command += ["--cache-dir", str(settings.data_dir / "agent"), "--parent-pid", str(os.getpid())]
    for device in devices:
        command += ["--device", device]
    if verbose:
        command.append("--verbose")
    env = {**os.environ, "REMAT_ENROLL_TOKEN": token}
    print(f"local agent: starting (node {LOCAL_NODE!r})", flush=True)
    return subprocess.Popen(command, env=env)


# --- submit ------------------------------------------------------------------------------


def _submit(args: argparse.Namespace) -> int:
    headers = {"X-API-Key": args.api_key} if args.api_key else {}
    with httpx.Client(base_url=args.server, headers=headers, timeout=60) as client:
        wait_for_server(client, args.wait_for_server)
        model = _upload(client, args)
        job = _call(client, "POST", "/v1/jobs", json=_job_body(args, model["id"]))
        print(f"job {job['id']} queued ({model['filename']}, {model['summary']['nodes']} nodes)")
        job = _wait(client, job["id"])
        if job["status"] != "succeeded":
            raise InvalidInputError(f"job {job['id']} {job['status']}: {job['error'] or ''}")
        plan = _call(client, "GET", f"/v1/jobs/{job['id']}/plan")
    _print_plan(job, plan)
    return 0


def wait_for_server(client: httpx.Client, wait_s: float) -> None:
    """Wait up to ``wait_s`` for the server to answer ``/readyz`` with 200 (a server that
    is starting: not listening yet, or its database not ready), saying so once on stderr;
    InvalidInputError (one line, exit 2) if it never does. Any other answer is left to the
    calls that follow (a 404: not a Remat server)."""
    deadline = time.monotonic() + max(wait_s, 0.0)
    said = False
    while True:
        try:
            response = client.get("/readyz", timeout=min(5.0, max(wait_s, 1.0)))
        except httpx.HTTPError as exc:
            why = _unreachable(exc)
        else:
            if response.status_code != 503:
                return
            why = "not ready"
            with contextlib.suppress(ValueError, AttributeError):
                why = f"not ready: {response.json()['detail']}"
        if time.monotonic() >= deadline:
            waited = f" after {wait_s:g} s" if wait_s > 0 else ""
            raise InvalidInputError(
                f"no Remat server ready at {client.base_url}{waited} ({why}); "
                "start one with `remat serve`, or name another with --server"
            )
        if not said:
            print(f"waiting for the server at {client.base_url}...", file=sys.stderr, flush=True)
            said = True
        time.sleep(min(0.25, max(deadline - time.monotonic(), 0.0)))


def _unreachable(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "no answer"
    return str(exc) or type(exc).__name__


def _upload(client: httpx.Client, args: argparse.Namespace) -> dict[str, Any]:
    if args.sample:
        name, data = f"{args.sample}.onnx", samples.ZOO[args.sample]().SerializeToString()
    else:
        name, data = _model_upload(args.model)
    files = {"file": (name, data, "application/octet-stream")}
    return _call(client, "POST", "/v1/models", files=files)


def _model_upload(path: Path) -> tuple[str, bytes]:
    """The name and bytes to upload for ``path``: a zip archive as it is; an ONNX file
    (or a directory's one ``.onnx`` file) as it is when self-contained, else packed in
    memory into a zip archive with the data files its initializers name."""
    if path.is_dir():
        path = model_in_directory(path)
    data = _read(path)
    if is_zip(data[:4]):
        return path.name, data
    archive = archive_with_external_data(path)
    return (path.name, data) if archive is None else (f"{path.stem}.zip", archive)


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
        "loss": {"kind": args.loss, "output": args.loss_output, "axis": args.loss_axis},
        "fuse_attention": args.fuse_attention,
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


def _as_progress(progress: dict[str, Any]) -> Progress:
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
    document: dict[str, Any] = response.json()
    return document


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
    from app.database import Database
    from app.migrate import upgrade
    from app.services import key_digest
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
