"""Work beside a search in a subprocess.

A strategy that runs a heuristic and an exact search in one time limit has two poor choices
in one process: one after the other (the search gets only what the heuristic leaves), or in
a thread (the heuristic's Python holds the interpreter lock that the search's orchestration
needs: on bert_base the search's plan was then worse than with the heuristic's time taken
away). A process (``remat.solvers.runner.process_context``) shares the cores with the
search's solver processes at the same priority, and its result arrives over a pipe. (At the
lowest priority the heuristic got no core while the solvers held both of a 2-core machine,
and did not finish in time.) The work is a module-level function whose arguments and result
pickle: no callbacks or events (strip a ``Problem``'s solver settings with ``picklable``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

from remat.solvers.runner import process_context
from remat.strategies.common.problem import Problem, SolverSettings

T = TypeVar("T")
TERMINATE_WAIT_S = 1.0


def picklable(problem: Problem) -> Problem:
    """``problem`` without its solver settings' callbacks and cancel flag."""
    solver = problem.solver
    settings = SolverSettings(backend=solver.backend, options=solver.options, search=solver.search)
    return replace(problem, solver=settings)


class Beside(Generic[T]):
    """``work(*args)`` running in its own process from construction on."""

    def __init__(self, work: Callable[..., T], *args: Any) -> None:
        ctx = process_context()
        self._receiver, sender = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=_child, args=(sender, work, args), name="remat-beside", daemon=True
        )
        self._process.start()
        sender.close()  # the child holds the only writer: its exit shows as EOF here

    @property
    def running(self) -> bool:
        return self._process.is_alive()

    def ready(self, timeout: float) -> bool:
        """Whether the result (or the process's end) has arrived, waiting ``timeout`` s at
        most."""
        try:
            return self._receiver.poll(timeout)
        except (EOFError, OSError):
            return True

    def result(self, deadline: float) -> tuple[T | None, str]:
        """The work's result, waiting until ``deadline`` (a ``time.monotonic()``) at most,
        and "" ; or None and why (not done by then: the process is terminated; failed)."""
        try:
            if not self._receiver.poll(max(deadline - time.monotonic(), 0.0)):
                return None, "not done in time"
            failed, value = self._receiver.recv()
        except (EOFError, OSError):
            return None, f"its process ended without a result (exit {self._process.exitcode})"
        finally:
            self._end()
        return (None, value) if failed else (value, "")

    def _end(self) -> None:
        self._receiver.close()
        self._process.join(TERMINATE_WAIT_S)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(TERMINATE_WAIT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _child(sender: Connection, work: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        message: tuple[bool, Any] = (False, work(*args))
    except Exception as exc:  # reported to the parent, which carries on without the result
        message = (True, f"{type(exc).__name__}: {exc}")
    try:
        sender.send(message)
    except OSError:
        pass  # the parent stopped waiting
    finally:
        sender.close()
