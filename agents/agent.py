"""``remat-agent``: the node agent process.

It registers with the enrollment token (and gets its own token, kept in the cache
directory: registering the same name again, after a restart, needs it), sends heartbeats
at the interval the server gives, long-polls for a task, and runs it in a worker thread
while the main thread keeps the lease renewed. Results are reported with the attempt's
lease token, so a retried report is recorded once. An unreachable server is retried with
back-off and jitter; an unknown token (the server forgot this node) means registering
again. A registration the server refuses (wrong enrollment token, the name taken by
another agent) ends the agent with status 1. SIGTERM or SIGINT: the task in hand is given
back (its lease released) and the agent exits. With ``--parent-pid`` (``remat serve``'s
local agent) it also exits when that process does, however it ends.

Tasks run the kernels of the ``[agent]`` extra (PyTorch): ``agents.profiler`` and
``agents.executor``. Plans that page (plan version 3) write their tensors to the node's
storage directory (``--storage``, else ``$REMAT_STORAGE``, else ``~/.cache/remat/storage``,
``agents.storage``), which the profiler measures too; one named that is missing, not a
directory or not writable ends the agent at start with status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ValidationError

from agents.client import AgentClient, Rejected, StaleLease, Stopped, Unauthorized
from agents.errors import StorageError
from agents.storage import STORAGE_ENV, resolve_storage
from remat.agent_protocol import (
    AgentDevice,
    Enrolled,
    ExecutePayload,
    ModelRef,
    ProfilePayload,
    Registration,
    SizedProfile,
    Task,
    TaskKind,
    TaskProgress,
    TaskReport,
)
from remat.devices import Device, parse_device
from remat.errors import RematError

log = logging.getLogger("remat.agent")
PROGRESS_INTERVAL_S = 1.0
PARENT_CHECK_S = 1.0  # how often an agent with --parent-pid checks that its parent lives
STOP_CHECK_S = 0.25  # a stop request is noticed this fast while a task runs
VERSION = "1"


@dataclass
class AgentConfig:
    server: str
    enroll_token: str
    name: str
    devices: list[Device]
    cache_dir: Path
    lease_wait_s: float = 20.0
    parent_pid: int | None = None  # exit when this process (the agent's parent) is gone
    storage: Path | None = None  # where plans page to (None: ``resolve_storage``'s default)


@dataclass
class _Outcome:
    report: TaskReport | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Agent:
    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.stop = threading.Event()
        self.client = AgentClient(config.server, self.stop)
        self.enrolled: Enrolled | None = None
        self.refused: str | None = None  # why the server refused to register this agent
        self._idle = True

    # --- lifecycle ------------------------------------------------------------------

    def run(self) -> int:
        if self.config.parent_pid is not None:
            watch = threading.Thread(target=self._watch_parent, name="parent", daemon=True)
            watch.start()
        try:
            self._enroll()
            threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()
            while not self.stop.is_set():
                self._serve_one()
        except Rejected as exc:  # the first registration, refused
            self.refused = exc.detail
        except Stopped:
            pass
        finally:
            self.client.close()
        if self.refused is not None:
            log.error("agent %s: registration refused: %s", self.config.name, self.refused)
            return 1
        log.info("agent %s stopped", self.config.name)
        return 0

    def request_stop(self, signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        self.stop.set()
        if self._idle:  # waiting on the server: leave now, nothing to give back
            # Once: a second signal (Ctrl-C reaches remat serve's whole process group, which
            # then stops its agent too) must not interrupt the way out (client.close()).
            self._idle = False
            raise Stopped

    def _watch_parent(self) -> None:
        """Stop (as on SIGTERM) once the parent process is gone: the fallback where the
        kernel's death signal (``die_with_parent``) is not available."""
        while not self.stop.wait(PARENT_CHECK_S):
            if os.getppid() != self.config.parent_pid:
                log.warning("the parent process %s is gone: stopping", self.config.parent_pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def _enroll(self) -> None:
        registration = Registration(
            enroll_token=self.config.enroll_token,
            name=self.config.name,
            devices=[
                AgentDevice(name=d.name, kind=d.kind, options=dict(d.options))
                for d in self.config.devices
            ],
            version=VERSION,
            node_token=self._saved_token(),
        )
        self.enrolled = self.client.register(registration)
        self._save_token(self.enrolled.token)
        names = ", ".join(d.name for d in self.config.devices)
        log.info("registered as node %s (devices: %s)", self.enrolled.node_id, names)
        print(f"remat-agent {self.config.name}: node {self.enrolled.node_id} ({names})", flush=True)

    def _heartbeats(self) -> None:
        while not self.stop.is_set():
            interval = self.enrolled.heartbeat_s if self.enrolled else 10.0
            if self.stop.wait(interval):
                return
            try:
                self.client.heartbeat()
            except Unauthorized:
                self._reenroll()
            except (Rejected, Stopped) as exc:
                log.warning("heartbeat failed: %s", exc)

    def _token_file(self) -> Path:
        return self.config.cache_dir / f"node-{self.config.name}.token"

    def _saved_token(self) -> str | None:
        try:
            return self._token_file().read_text().strip() or None
        except OSError:
            return None

    def _save_token(self, token: str) -> None:
        """Keep the node's token (owner-only) for registering the name again later."""
        path = self._token_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(token)
        partial.replace(path)

    def _reenroll(self) -> bool:
        """Register again; False (and the agent stops) if the server refuses."""
        log.warning("the server no longer knows this agent's token: registering again")
        try:
            self._enroll()
        except Rejected as exc:
            self.refused = exc.detail
            self.stop.set()
            return False
        except Stopped:
            return False
        return True

    # --- tasks ----------------------------------------------------------------------

    def _serve_one(self) -> None:
        try:
            task = self.client.lease(self.config.lease_wait_s)
        except Unauthorized:
            self._reenroll()
            return
        if task is None:
            return
        self._idle = False
        try:
            self._work_on(task)
        finally:
            self._idle = True

    def _work_on(self, task: Task) -> None:
        """Run ``task`` in a thread; renew its lease until it ends or the agent stops."""
        log.info("task %s (%s, attempt %d)", task.id, task.kind, task.attempt)
        outcome = _Outcome()
        worker = threading.Thread(
            target=self._run_task, args=(task, outcome), name=f"task-{task.id}", daemon=True
        )
        worker.start()
        assert self.enrolled is not None
        renew_every = max(self.enrolled.lease_s / 3, 0.2)
        renewed = time.monotonic()
        while not outcome.done.wait(STOP_CHECK_S):
            if self.stop.is_set():
                self._give_back(task)
            if time.monotonic() - renewed >= renew_every:
                renewed = time.monotonic()
                self._renew(task)
        if outcome.report is not None:
            self._report(task, outcome.report)

    def _renew(self, task: Task) -> None:
        try:
            self.client.renew(task.id, task.lease_token)
        except StaleLease:
            log.warning("task %s: lease lost; its result will be refused", task.id)
        except Unauthorized:
            self._reenroll()
        except Rejected as exc:
            log.warning("task %s: renewing failed: %s", task.id, exc)

    def _give_back(self, task: Task) -> None:
        try:
            self.client.release(task.id, task.lease_token)
            log.info("task %s: lease given back", task.id)
        except (Rejected, Stopped) as exc:
            log.warning("task %s: could not give the lease back: %s", task.id, exc)
        raise Stopped

    def _report(self, task: Task, report: TaskReport) -> None:
        try:
            try:
                accepted = self.client.report(task.id, report)
            except Unauthorized:  # the node got a new token (registered again): same lease
                if not self._reenroll():
                    raise Stopped from None
                accepted = self.client.report(task.id, report)
        except StaleLease as exc:
            log.warning("task %s: report refused, the lease is gone: %s", task.id, exc.detail)
            return
        except Rejected as exc:  # the result did not pass the server's checks
            log.error("task %s: result rejected: %s", task.id, exc.detail)
            failed = TaskReport(
                lease_token=task.lease_token,
                status="failed",
                error=f"the server rejected the agent's result: {exc.detail}",
            )
            self.client.report(task.id, failed)
            return
        log.info("task %s: %s%s", task.id, accepted.status, " (again)" * accepted.duplicate)

    def _run_task(self, task: Task, outcome: _Outcome) -> None:
        try:
            result = self._result_of(task)
            outcome.report = TaskReport(
                lease_token=task.lease_token, status="succeeded", result=result
            )
        except Exception as exc:
            outcome.report = TaskReport(
                lease_token=task.lease_token, status="failed", error=_describe(exc)
            )
            log.warning("task %s failed: %s", task.id, outcome.report.error)
        finally:
            outcome.done.set()

    def _result_of(self, task: Task) -> dict[str, Any]:
        if task.kind is TaskKind.PROFILE:
            return self._profile(task, ProfilePayload.model_validate(task.payload))
        return self._execute(ExecutePayload.model_validate(task.payload))

    def _profile(self, task: Task, payload: ProfilePayload) -> dict[str, Any]:
        from agents.profiler import profile

        model = self._model(payload.model)
        devices = self._devices(payload.devices)
        measure = partial(profile, devices=devices, repeats=payload.repeats,
                          warmup=payload.warmup, memory_bytes=payload.memory_bytes,
                          storage=self.config.storage)  # fmt: skip
        if payload.sizes is None:
            report = _ProgressReporter(self.client, task)
            graph = payload.model.graph(model)
            return measure(model, graph, on_progress=report).model_dump(mode="json")
        tables: dict[str, dict[str, Any]] = {}
        for index, (size, inputs) in enumerate(payload.sizes.items()):
            sized = payload.model.model_copy(update={"inputs": inputs}).graph(model)
            report = _ProgressReporter(
                self.client, task, f"size {size} ({index + 1} of {len(payload.sizes)})"
            )
            tables[size] = measure(model, sized, on_progress=report).model_dump(mode="json")
        return SizedProfile(tables=tables).model_dump(mode="json")

    def _execute(self, payload: ExecutePayload) -> dict[str, Any]:
        from agents.executor import execute
        from remat.plan import plan_from_json

        if payload.sized is not None:
            return self._execute_sized(payload)
        model, graph = self._model_and_graph(payload.model)
        plan = plan_from_json(payload.plan)
        return execute(
            model, graph, plan, self.config.devices, storage=self.config.storage
        ).to_json()

    def _execute_sized(self, payload: ExecutePayload) -> dict[str, Any]:
        """A family's steps in order, each size's graph and plan built at its first step
        (which also warms it up), every step measured; the gradients checked at each size's
        first step. The result sums the steps' times and takes their peaks."""
        from agents.errors import TaskError
        from agents.executor import execute
        from remat.plan import plan_from_json

        run = payload.sized
        assert run is not None
        model = self._model(payload.model)
        built: dict[int, tuple[Any, Any]] = {}
        steps: list[dict[str, Any]] = []
        checks: list[tuple[bool | None, float | None]] = []
        for size in run.sizes:
            key = str(size)
            if key not in run.plans or key not in run.inputs:
                raise TaskError(f"the task has no plan or inputs for size {size}")
            first = size not in built
            if first:
                ref = payload.model.model_copy(update={"inputs": run.inputs[key]})
                built[size] = (ref.graph(model), plan_from_json(run.plans[key]))
            graph, plan = built[size]
            report = execute(
                model,
                graph,
                plan,
                self.config.devices,
                warmup=1 if first else 0,
                storage=self.config.storage,
            )
            if first:
                checks.append((report.gradients_match, report.max_rel_error))
            steps.append(
                {
                    "size": size,
                    "total_ms": report.total_ms,
                    "peak_bytes": dict(report.peak_bytes),
                    "plan_cached": not first or size in run.cached,
                }
            )
        peaks: dict[str, int] = {}
        for step in steps:
            for device, peak in step["peak_bytes"].items():
                peaks[device] = max(peaks.get(device, 0), peak)
        matches = [m for m, _ in checks if m is not None]
        errors = [e for _, e in checks if e is not None]
        return {
            "measured": {"total_ms": sum(s["total_ms"] for s in steps), "peak_bytes": peaks},
            "gradients_match": all(matches) if matches else None,
            "max_rel_error": max(errors) if errors else None,
            "sized": steps,
        }

    def _model(self, ref: ModelRef) -> Any:
        """The model ``ref`` names, from this agent's cache or downloaded."""
        from remat.onnx_ingest import load_model

        return load_model(self.client.model_file(ref.model_id, ref.sha256, self.config.cache_dir))

    def _model_and_graph(self, ref: ModelRef) -> tuple[Any, Any]:
        model = self._model(ref)
        return model, ref.graph(model)

    def _devices(self, names: Sequence[str]) -> list[Device]:
        from agents.errors import DeviceError

        have = {d.name: d for d in self.config.devices}
        missing = [n for n in names if n not in have]
        if missing:
            raise DeviceError(
                f"this agent has no device {missing[0]!r} (it has: {', '.join(have)})"
            )
        return [have[n] for n in names]


class _ProgressReporter:
    """The profiler's progress to the server, at most once a second (it renews too)."""

    def __init__(self, client: AgentClient, task: Task, message: str = "") -> None:
        self.client, self.task, self.message = client, task, message
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if time.monotonic() - self._last < PROGRESS_INTERVAL_S and done < total:
            return
        self._last = time.monotonic()
        body = TaskProgress(
            lease_token=self.task.lease_token, done=done, total=total, message=self.message
        )
        try:
            self.client.progress(self.task.id, body)
        except (Rejected, Stopped) as exc:
            log.warning("task %s: progress not sent: %s", self.task.id, exc)


def _describe(exc: BaseException) -> str:
    from agents.errors import TaskError

    if isinstance(exc, TaskError | RematError):
        return str(exc)
    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        return f"malformed task payload: {where}: {error['msg']}"
    if isinstance(exc, Rejected):
        return f"the server refused a call the task needed: {exc.detail}"
    return f"internal error in the agent: {type(exc).__name__}: {exc}"


# --- command line ---------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat-agent",
        description="Remat node agent: profiles operators and executes plans on this node.",
    )
    parser.add_argument("--server", required=True, help="the Remat API, e.g. http://host:8642")
    parser.add_argument(
        "--enroll-token",
        default=os.environ.get("REMAT_ENROLL_TOKEN"),
        help="the server's enrollment token (default: $REMAT_ENROLL_TOKEN)",
    )
    parser.add_argument(
        "--device",
        action="append",
        metavar="NAME:KIND[:threads=N]",
        help="a device to offer, repeatable (default: this machine's CPU and each CUDA GPU)",
    )
    parser.add_argument("--name", default=socket.gethostname(), help="node name (one agent each)")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".remat" / "agent",
        help="where downloaded models are kept",
    )
    parser.add_argument(
        "--storage",
        type=Path,
        help=f"the directory plans page tensors to (default: ${STORAGE_ENV}, else "
        "~/.cache/remat/storage, created if missing)",
    )
    parser.add_argument("--lease-wait", type=float, default=20.0, help="long-poll seconds")
    parser.add_argument(
        "--parent-pid",
        type=int,
        help="exit when this process, the agent's parent, exits (remat serve's local agent)",
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also log every HTTP request (heartbeats, long polls) at INFO",
    )
    return parser


def config_from(args: argparse.Namespace) -> AgentConfig:
    if not args.enroll_token:
        raise RematError("an enrollment token is required: --enroll-token or REMAT_ENROLL_TOKEN")
    try:
        storage = resolve_storage(args.storage)
    except StorageError as exc:
        raise RematError(str(exc)) from None
    if args.device:
        devices = [parse_device(text) for text in args.device]
    else:
        from agents.torch_devices import detect_devices

        devices = detect_devices()
    return AgentConfig(
        server=args.server,
        enroll_token=args.enroll_token,
        name=args.name,
        devices=devices,
        cache_dir=args.cache_dir,
        lease_wait_s=args.lease_wait,
        parent_pid=args.parent_pid,
        storage=storage,
    )


def quiet_http_logs(verbose: bool) -> None:
    """httpx logs every request at INFO (a heartbeat every few seconds, every long poll):
    at WARNING unless ``verbose``; httpcore's connection details only at DEBUG."""
    if not verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("httpcore").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None, run: Callable[[Agent], int] = Agent.run) -> int:
    args = _parser().parse_args(argv)
    if args.parent_pid is not None:
        from remat.solvers.runner import die_with_parent

        die_with_parent()  # the kernel kills the agent with its parent, even on SIGKILL
        if os.getppid() != args.parent_pid:  # the parent died before that took effect
            return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    quiet_http_logs(args.verbose)
    try:
        config = config_from(args)
    except RematError as exc:
        print(f"remat-agent: error: {exc}", file=sys.stderr)
        return 2
    agent = Agent(config)
    signal.signal(signal.SIGTERM, agent.request_stop)
    signal.signal(signal.SIGINT, agent.request_stop)
    code = run(agent)
    # Stopping already: a second signal (remat serve's, after its process group's) must not
    # raise Stopped into interpreter shutdown (a traceback from a finalizer).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if any(t.name.startswith("task-") for t in threading.enumerate()):
        # A task given back is still running in native code (PyTorch): interpreter
        # shutdown would abort under it, so leave without one.
        logging.shutdown()
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
