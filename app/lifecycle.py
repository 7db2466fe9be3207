"""The application's shutdown flag, set as soon as the server is asked to stop.

uvicorn stops on SIGTERM or SIGINT by closing its sockets, then waiting for every request
in flight to finish, and only then runs the lifespan's shutdown. Long requests must
therefore see the stop request themselves: ``/v1/jobs/{id}/events`` streams end and an
agent's long poll for a task is answered 503 once ``stopping(app)`` is true, so that an
open stream or poll does not hold the exit up.

The flag is set by the first SIGTERM or SIGINT (the lifespan chains a handler in front of
the server's own when it runs in the main thread, as uvicorn's does), by ``remat serve``
directly, and at the latest by the lifespan's shutdown.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

from starlette.applications import Starlette

EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)
Handler = Callable[[int, FrameType | None], Any]


def shutdown_event(app: Starlette) -> threading.Event:
    """The app's shutdown flag (a thread-safe event: signal handlers and threads set it)."""
    event: threading.Event | None = getattr(app.state, "shutdown", None)
    if event is None:
        event = threading.Event()
        app.state.shutdown = event
    return event


def stopping(app: Starlette) -> bool:
    return shutdown_event(app).is_set()


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    event = shutdown_event(app)
    restore = _chain_exit_signals(event)
    try:
        yield
    finally:
        event.set()
        restore()


def _chain_exit_signals(event: threading.Event) -> Callable[[], None]:
    """Set ``event`` on SIGINT and SIGTERM, then call the handler installed before (the
    server's); a function that puts the handlers back. Only the main thread can install
    signal handlers, and only a Python handler is chained (the server's own shutdown)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    chained: dict[int, Handler] = {}
    for signum in EXIT_SIGNALS:
        previous = signal.getsignal(signum)
        if callable(previous):
            chained[signum] = _setting(event, previous)
            signal.signal(signum, chained[signum])

    def restore() -> None:
        for signum, handler in chained.items():
            if signal.getsignal(signum) is handler:
                signal.signal(signum, handler.previous)  # type: ignore[attr-defined]

    return restore


def _setting(event: threading.Event, previous: Handler) -> Handler:
    def handler(signum: int, frame: FrameType | None) -> Any:
        event.set()
        return previous(signum, frame)

    handler.previous = previous  # type: ignore[attr-defined]
    return handler
