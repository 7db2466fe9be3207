"""Solve a ``MILPModel`` with one backend in a fresh subprocess.

Every solve runs in its own process (docs/architecture.md, section "Solver subprocesses"),
forked by multiprocessing's fork server (``process_context``): ortools and highspy cannot be
imported into the same process, and a process gives clean cancellation, time limits and
crash isolation. The child streams progress and incumbents back over a pipe; the parent
delivers progress to ``on_progress``, stops the child cooperatively on cancel or at the hard
time limit (and terminates it if it does not stop), and turns every solver failure into a
``SolveResult`` with status ``error`` instead of raising. While the caller's ``hold`` flag is
set the child is suspended (SIGSTOP, resumed with SIGCONT): on 2 cores a search suspends its
full solve while another solve that needs the CPU more runs (``remat.strategies.exact.rins``).
The child's time limit keeps counting meanwhile: a held solve does less, never longer. A
held child is resumed while the parent reads a message from it: an incumbent is larger than
a pipe holds, and a child stopped half-way through sending one would never finish it.

As with ``spawn``, the caller's ``__main__`` must be importable without side effects
(scripts guard their entry point with ``if __name__ == "__main__"``): the fork server
imports it.

The backends are ``SOLVERS``, one module each (``highs``, ``cpsat``, ``scip``, ``gurobi``),
whose ``solve`` follows ``remat.solvers.backend.Backend``; adding one is a module, an
entry there and its package in ``PACKAGES``. The backend modules import their solver
library only inside ``solve``, in the child, so neither this module nor they import one
here.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from remat.solvers import cpsat, gurobi, highs, scip
from remat.solvers.backend import Backend, Incumbent, SolverUnavailable, relative_gap
from remat.solvers.model import (
    MILPModel,
    Progress,
    SolveOptions,
    SolveResult,
    SolveStatus,
    StopFlag,
)

SOLVERS: dict[str, Backend] = {
    "highs": highs.solve,
    "cpsat": cpsat.solve,
    "scip": scip.solve,
    "gurobi": gurobi.solve,
}
"""Every backend by name: what ``solve`` accepts and what the CLI, the API and the bench
list. Called in the solve's subprocess only."""
PACKAGES: dict[str, str] = {
    "highs": "highspy",
    "cpsat": "ortools",
    "scip": "pyscipopt",
    "gurobi": "gurobipy",
}
"""The Python package each backend's ``solve`` imports: a backend whose package is not
installed is unavailable (``GET /v1/strategies``)."""
BACKENDS: tuple[str, ...] = tuple(SOLVERS)
DEFAULT_BACKEND = "highs"  # ahead or level on every row of bench/solvers.py (docs/benchmarks.md)

# After a stop request the child gets this long to return its own result (with the
# incumbent) before it is terminated; terminate + kill fit in the rest of the 2 s budget.
COOPERATIVE_WAIT_S = 0.3
TERMINATE_WAIT_S = 0.4
POLL_S = 0.05
DEFAULT_GRACE_S = 5.0  # beyond time_limit_s: process start, imports, model building
MIN_LIMIT_S = 0.01  # the least a child's solver is given: it still checks the warm start

# ----------------------------------------------------------------------------- child side

PRELOAD = ("__main__", "remat.solvers.runner", "remat.strategies", "pandas")
"""What the fork server imports once, so that a child forked from it starts at once:
Remat's strategies, and pandas, which ortools' CP-SAT API imports (a third of a second in
every ``cpsat`` solve otherwise). Not the solver libraries: ortools and highspy cannot
share a process. A module that is not installed is skipped."""


def process_context() -> Any:
    """The multiprocessing context of every solve and ``Beside`` worker: ``forkserver``,
    its server preloading ``PRELOAD``. A child is forked from that clean, single-threaded
    server, never from the caller (whose threads a fork would copy mid-state), and does not
    import Python and numpy anew as a ``spawn``-ed one does."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _child_main(
    backend: str,
    inbox: Connection,
    conn: Connection,
    stop: Any,  # multiprocessing Event
) -> None:
    die_with_parent()
    _leave_fork_server()
    lock = threading.Lock()  # solver threads may report concurrently

    def send(message: tuple[Any, ...]) -> None:
        with lock:
            conn.send(message)

    try:
        send(("started",))  # may be suspended from now on (``die_with_parent`` has run)
        model, options, backend_options, deadline = inbox.recv()
        inbox.close()
        # The limit counts from the parent's start of the solve (CLOCK_MONOTONIC is the
        # same clock in every process): this process's start and the model's transfer
        # come out of it, not on top of it.
        options = replace(options, time_limit_s=max(MIN_LIMIT_S, deadline - time.monotonic()))
        solve_with = SOLVERS[backend]
        result = solve_with(
            model,
            options,
            lambda p: send(("progress", p)),
            stop.is_set,
            incumbent=lambda x, obj: send(("incumbent", x, obj)),
            **backend_options,
        )
        send(("result", replace(result, backend=backend)))
    except SolverUnavailable as exc:
        send(("unavailable", str(exc)))
    except BaseException as exc:  # report everything; the parent must never hang
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        send(("crash", f"{detail}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Have the kernel send this process ``signum`` when the thread that started it dies
    (Linux's PR_SET_PDEATHSIG; elsewhere nothing). A solver child suspended by ``hold``
    when its parent is killed would never notice (a running one does, at its next message)
    and would keep its memory for good. The starting thread waits in ``solve`` until the
    child has ended, so only its death (the process's) fires it. ``remat serve``'s local
    agent calls it too (``agents.agent``), so that it never outlives the server."""
    if sys.platform != "linux":
        return
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum)


def _leave_fork_server() -> None:
    """Close the fork server's liveness pipe, which a child forked by it inherits so that it
    could start processes of its own (a solve starts none). The server exits when every
    holder of the pipe's write end is gone, and its children then die with it
    (``die_with_parent``); a child suspended by ``hold`` would hold it forever, and keep the
    server and itself alive after its caller was killed. CPython keeps the descriptor on
    its fork server singleton, a private attribute: without it there is nothing to close."""
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if server is not None and fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None


# ---------------------------------------------------------------------------- parent side


@dataclass
class _Seen:
    """What the parent knows about a running child, for when it has to kill it."""

    start: float
    heard: bool = False  # a message came: the child has run ``die_with_parent``
    x: np.ndarray | None = None
    objective: float | None = None
    bound: float | None = None


@dataclass
class _Outcome:
    result: SolveResult | None = None
    unavailable: str | None = None


def solve(
    model: MILPModel,
    backend: str = DEFAULT_BACKEND,
    options: SolveOptions = SolveOptions(),  # noqa: B008 - frozen dataclass
    on_progress: Callable[[Progress], None] | None = None,
    cancel: StopFlag | None = None,
    fallback: str | None = "highs",
    *,
    grace_s: float = DEFAULT_GRACE_S,
    backend_options: Mapping[str, Any] | None = None,
    on_incumbent: Incumbent | None = None,
    hold: StopFlag | None = None,
) -> SolveResult:
    """Solve ``model`` with ``backend`` in a subprocess; see the module docstring.

    ``backend_options`` are passed to the backend's ``solve`` as keywords (e.g. cpsat's
    ``resolution``). While ``hold`` is set the child is suspended (POSIX signals). Only
    ``ValueError`` for an unknown backend is raised; solver failures, crashes and kills come
    back as results. ``on_progress`` and ``on_incumbent`` (each
    improving solution the child streams, at most one per progress interval) run in the
    calling thread; an exception they raise propagates, after the child has been stopped.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown solver backend {backend!r}; choose one of {BACKENDS}")
    if fallback is not None and fallback not in BACKENDS:
        raise ValueError(f"unknown fallback backend {fallback!r}")
    listeners = _Listeners(on_progress, on_incumbent)
    flags = _Flags(cancel, hold)
    outcome = _run_child(model, backend, options, listeners, flags, grace_s, backend_options)
    if outcome.result is not None:
        return outcome.result
    reason = outcome.unavailable or "unavailable"
    if fallback is None or fallback == backend:
        return _empty(SolveStatus.ERROR, backend, 0.0, f"{backend}: {reason}")
    result = solve(
        model,
        fallback,
        options,
        on_progress,
        cancel,
        None,
        grace_s=grace_s,
        on_incumbent=on_incumbent,
        hold=hold,
    )
    note = f"{backend}: {reason}; solved with {fallback}"
    return replace(result, message=_join(note, result.message))


@dataclass(frozen=True)
class _Listeners:
    """The caller's hooks for what the child streams."""

    progress: Callable[[Progress], None] | None
    incumbent: Incumbent | None


@dataclass(frozen=True)
class _Flags:
    """The caller's flags: ``cancel`` stops the child, ``hold`` suspends it while set."""

    cancel: StopFlag | None
    hold: StopFlag | None

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def held(self) -> bool:
        return self.hold is not None and self.hold.is_set()


def _run_child(
    model: MILPModel,
    backend: str,
    options: SolveOptions,
    listeners: _Listeners,
    flags: _Flags,
    grace_s: float,
    backend_options: Mapping[str, Any] | None,
) -> _Outcome:
    if flags.cancelled():
        return _Outcome(_empty(SolveStatus.UNKNOWN, backend, 0.0, "cancelled before start"))
    ctx = process_context()
    receiver, sender = ctx.Pipe(duplex=False)
    inbox, outbox = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    # The model does not travel in the process arguments: start() writes those to the child
    # while holding the pipe's read end itself, so a child that dies while bootstrapping
    # (e.g. an unguarded __main__) would block start() forever on a model over 64 KiB.
    process = ctx.Process(
        target=_child_main,
        args=(backend, inbox, sender, stop),
        name=f"remat-solve-{backend}",
        daemon=True,  # never outlive the caller
    )
    seen = _Seen(start=time.monotonic())
    process.start()
    sender.close()  # the child holds the only writer: its exit shows as EOF here
    inbox.close()
    feeder = threading.Thread(
        target=_feed,
        args=(
            outbox,
            (model, options, dict(backend_options or {}), seen.start + options.time_limit_s),
        ),
        daemon=True,
    )
    feeder.start()  # a thread: a child that never reads must not block the caller
    try:
        return _supervise(
            process, receiver, stop, backend, options, listeners, flags, grace_s, seen
        )
    finally:
        _ensure_dead(process)
        receiver.close()
        feeder.join()


def _feed(outbox: Connection, payload: tuple[Any, ...]) -> None:
    try:
        outbox.send(payload)
    except OSError:
        pass  # the child died first; the supervisor reports it
    finally:
        outbox.close()


def _supervise(
    process: Any,
    receiver: Connection,
    stop: Any,
    backend: str,
    options: SolveOptions,
    listeners: _Listeners,
    flags: _Flags,
    grace_s: float,
    seen: _Seen,
) -> _Outcome:
    deadline = seen.start + options.time_limit_s + grace_s
    stop_requested: float | None = None
    why = ""
    suspended = _Suspension(process)
    while True:
        suspended.follow(flags.held() and seen.heard and stop_requested is None)
        if receiver.poll(POLL_S):
            # The message may be half sent (an incumbent is larger than the pipe holds): a
            # suspended child would never send the rest, and recv would wait for it forever.
            suspended.follow(False)
            try:
                message = receiver.recv()
            except (EOFError, OSError):
                return _Outcome(_crashed(process, backend, seen))
            outcome = _handle(message, backend, listeners, seen)
            if outcome is not None:
                return _annotate(outcome, why)
        now = time.monotonic()  # checked after every message too: a chatty child is stoppable
        if stop_requested is None:
            why = _stop_reason(flags, now, deadline)
            if why:
                suspended.follow(False)  # a suspended child cannot stop by itself
                stop.set()  # the backend's should_stop() sees it and stops cooperatively
                stop_requested = now
        elif now - stop_requested > COOPERATIVE_WAIT_S:
            _ensure_dead(process)
            ended = f"{why} (the solver did not stop by itself and was ended)"
            return _Outcome(_from_seen(seen, backend, ended))


class _Suspension:
    """Whether the child is suspended (SIGSTOP), kept in line with what is asked."""

    def __init__(self, process: Any) -> None:
        self.process = process
        self.suspended = False

    def follow(self, wanted: bool) -> None:
        if wanted == self.suspended or self.process.pid is None:
            return
        try:
            os.kill(self.process.pid, signal.SIGSTOP if wanted else signal.SIGCONT)
        except ProcessLookupError:
            return  # it has exited; the pipe's EOF reports it
        self.suspended = wanted


def _stop_reason(flags: _Flags, now: float, deadline: float) -> str:
    if flags.cancelled():
        return "cancelled"
    if now > deadline:
        return "stopped at its time limit"
    return ""


def _handle(
    message: tuple[Any, ...],
    backend: str,
    listeners: _Listeners,
    seen: _Seen,
) -> _Outcome | None:
    kind = message[0]
    seen.heard = True
    if kind == "started":
        return None
    if kind == "progress":
        progress: Progress = message[1]
        seen.bound = progress.bound if progress.bound is not None else seen.bound
        if listeners.progress is not None:
            listeners.progress(progress)
        return None
    if kind == "incumbent":
        seen.x, seen.objective = message[1], message[2]
        if listeners.incumbent is not None:
            listeners.incumbent(seen.x, seen.objective)
        return None
    if kind == "result":
        return _Outcome(result=message[1])
    if kind == "unavailable":
        return _Outcome(unavailable=message[1])
    if kind == "crash":
        return _Outcome(_from_seen(seen, backend, f"{backend} failed: {message[1]}", error=True))
    return _Outcome(_from_seen(seen, backend, f"unexpected message {kind!r}", error=True))


def _annotate(outcome: _Outcome, why: str) -> _Outcome:
    if outcome.result is None or not why:
        return outcome
    return _Outcome(replace(outcome.result, message=_join(why, outcome.result.message)))


def _crashed(process: Any, backend: str, seen: _Seen) -> SolveResult:
    process.join(TERMINATE_WAIT_S)
    code = process.exitcode
    return _from_seen(
        seen, backend, f"{backend} process died (exit code {code}; see its stderr)", error=True
    )


def _from_seen(seen: _Seen, backend: str, message: str, error: bool = False) -> SolveResult:
    """The result of a child that gave none: its last streamed incumbent, if any. A crash is
    an error even with an incumbent (kept in x for inspection); a stop is not."""
    seconds = time.monotonic() - seen.start
    if seen.x is None:
        status = SolveStatus.ERROR if error else SolveStatus.UNKNOWN
        return _empty(status, backend, seconds, message)
    bound = seen.bound
    if bound is not None and seen.objective is not None:
        bound = min(bound, seen.objective)
    return SolveResult(
        status=SolveStatus.ERROR if error else SolveStatus.FEASIBLE,
        x=seen.x,
        objective=seen.objective,
        bound=bound,
        gap=relative_gap(seen.objective, bound),
        seconds=seconds,
        message=message + ("; last incumbent kept" if error else ""),
        backend=backend,
    )


def _ensure_dead(process: Any) -> None:
    if process.is_alive():
        with contextlib.suppress(ProcessLookupError):  # it may exit meanwhile
            os.kill(process.pid, signal.SIGCONT)  # a suspended child would not stop
        process.terminate()  # SIGTERM: solvers install no handler for it
        process.join(TERMINATE_WAIT_S)
    if process.is_alive():
        process.kill()
    process.join()


def _empty(status: SolveStatus, backend: str, seconds: float, message: str) -> SolveResult:
    return SolveResult(status, None, None, None, None, seconds, message, backend)


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)
