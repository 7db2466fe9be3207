"""Running ``remat`` (the CLI) as a real process from tests: awaited, or started and
awaited later so that processes that do not depend on each other run side by side."""

from __future__ import annotations

import subprocess
import sys

TIMEOUT_S = 300


def remat(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "remat.cli", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def start(*args: str) -> subprocess.Popen[str]:
    """``remat`` started, not awaited: processes that do not depend on each other run side
    by side (each spends a second importing before it does anything)."""
    command = [sys.executable, "-m", "remat.cli", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(process: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def remat_all(*runs: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """``remat`` with each argument list, the processes side by side."""
    return [finished(process) for process in [start(*args) for args in runs]]
