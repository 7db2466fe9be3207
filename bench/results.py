"""Result rows of the benchmarks: every bench appends what it measured to a CSV file under
``bench/results/`` (``NAME.csv``), and ``bench/report.py`` renders the tables of
``docs/benchmarks.md`` from those files.

Every row starts with the same columns (``COMMON``): when and at which commit it was
measured, the run it belongs to (``--run LABEL``, default: the run's date), what was solved
(model, budget, devices, solver backend) and the outcome (objective in ms, relative gap,
seconds). A bench adds its own columns after them; a column a bench does not fill stays
empty. A file whose header lacks a new column is rewritten once with the column added
(its old rows leave it empty), so files grow with their benches.

Used by the scripts beside it (``python bench/NAME.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
COMMON = (
    "date",
    "run",
    "commit",
    "model",
    "budget",
    "devices",
    "backend",
    "objective",
    "gap",
    "seconds",
)


def commit() -> str:
    """The checkout's short commit hash, with ``+dirty`` when the tree has changes."""
    head = _git("rev-parse", "--short", "HEAD")
    if not head:
        return ""
    return head + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def add_run_argument(parser: argparse.ArgumentParser) -> None:
    """``--run LABEL``: the name the rows of this invocation share in the results (the
    tables of ``docs/benchmarks.md`` select rows by it)."""
    parser.add_argument(
        "--run", help="label of this run's rows in bench/results/ (default: the date)"
    )


def add_strategies_argument(parser: argparse.ArgumentParser, known: Sequence[str]) -> None:
    """``--strategies A,B``: the columns of ``known`` to run, in that order (all by
    default); a name not in ``known`` is refused."""

    def columns(text: str) -> list[str]:
        chosen = text.split(",")
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown strategies {', '.join(unknown)}; known: {', '.join(known)}"
            )
        return chosen

    parser.add_argument("--strategies", type=columns, default=list(known))


class Writer:
    """The rows of one bench invocation: ``add`` them as they are measured (so an
    interrupted run keeps what it measured), each stamped with the run's date, label and
    commit."""

    def __init__(self, name: str, run: str | None = None) -> None:
        self.path = RESULTS_DIR / f"{name}.csv"
        self.date = now()
        self.run = run or self.date
        self.commit = commit()

    def add(self, row: Mapping[str, Any]) -> None:
        self.add_all([row])

    def add_all(self, rows: Iterable[Mapping[str, Any]]) -> None:
        stamp = {"date": self.date, "run": self.run, "commit": self.commit}
        append(self.path, [stamp | dict(row) for row in rows])


def append(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append ``rows`` to the CSV file at ``path`` (made with a header if missing; rewritten
    with the union of the columns if a row brings a column its header lacks)."""
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(COMMON)
    old: list[dict[str, str]] = []
    if path.exists():
        with path.open(newline="") as source:
            reader = csv.DictReader(source)
            header = list(reader.fieldnames or [])
            fields = _union(header, fields)
            old = list(reader)
    else:
        header = []
    for row in rows:
        fields = _union(fields, row)
    rewrite = fields != header
    with path.open("w" if rewrite else "a", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=fields, restval="")
        if rewrite:
            writer.writeheader()
            writer.writerows(old)
        writer.writerows({k: _text(v) for k, v in row.items()} for row in rows)


def read(name: str) -> list[dict[str, str]]:
    """The rows of ``bench/results/NAME.csv``, in file order."""
    with (RESULTS_DIR / f"{name}.csv").open(newline="") as source:
        return list(csv.DictReader(source))


def _union(fields: list[str], more: Iterable[str]) -> list[str]:
    return fields + [f for f in more if f not in fields]


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
