"""Markdown tables from the benchmarks' result rows (``bench/results/*.csv``).

``docs/benchmarks.md`` holds its tables between markers that say which rows to show::

    <!-- table solvers run=targets-120s -->
    | model (stages) | budget | ...
    <!-- /table -->

The first word is the results file (``bench/results/solvers.csv``), the rest ``column=value``
filters on its rows (all must hold; a value may be a shell-style pattern, as
``run=issue37-long-context*``; ``run=latest`` is the last run in the file). Everything
outside the markers is prose and stays as it is.

    .venv/bin/python bench/report.py             # rewrite docs/benchmarks.md's tables
    .venv/bin/python bench/report.py --check     # exit 1 if a table is out of date
    .venv/bin/python bench/report.py solvers run=latest   # print one table
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase
from functools import partial
from pathlib import Path

from results import ROOT, read

DOC = ROOT / "docs" / "benchmarks.md"
MARKER = re.compile(r"^<!-- table (?P<spec>[^>]*?) -->\n.*?^<!-- /table -->$", re.M | re.S)
Rows = list[dict[str, str]]
Column = tuple[str, Callable[[dict[str, str]], str]]  # header, cell


def select(name: str, filters: Sequence[str]) -> Rows:
    """The rows of ``bench/results/NAME.csv`` that pass every ``column=value`` filter
    (``value`` matched as a shell-style pattern: ``*``, ``?``, ``[...]``)."""
    rows = read(name)
    for text in filters:
        column, sep, value = text.partition("=")
        if not sep:
            raise SystemExit(f"report: filter {text!r} is not column=value")
        if column == "run" and value == "latest" and rows:
            value = rows[-1]["run"]
        rows = [r for r in rows if fnmatchcase(r.get(column, ""), value)]
    if not rows:
        raise SystemExit(f"report: no rows in {name}.csv with {' '.join(filters)}")
    return rows


def render(name: str, filters: Sequence[str]) -> str:
    rows = select(name, filters)
    render_rows = RENDERERS.get(name, _generic)
    return render_rows(rows)


# --- cells ------------------------------------------------------------------------------


def _f(row: dict[str, str], key: str, spec: str, missing: str = "") -> str:
    text = row.get(key, "")
    return missing if text == "" else format(float(text), spec)


def _ratio(row: dict[str, str], top: str, bottom: str) -> str:
    """``row[top] / row[bottom]`` to two places; empty where either is missing."""
    if not (row.get(top) and row.get(bottom)):
        return ""
    return f"{float(row[top]) / float(row[bottom]):.2f}"


def _pct(row: dict[str, str], key: str, missing: str = "") -> str:
    text = row.get(key, "")
    if text == "":
        return missing
    value = float(text)
    return f"{0.0 if abs(value) < 5e-4 else value:+.1%}"


def _named(row: dict[str, str], key: str) -> str:
    nodes = row.get("nodes", "")
    return f"{row[key]} ({nodes})" if nodes else row[key]


def _per_device(text: str) -> dict[str, int]:
    """``cpu0=123;cpu1=456`` -> bytes per device."""
    pairs = (item.partition("=") for item in text.split(";") if item)
    return {device: int(float(value)) for device, _, value in pairs if value not in ("", "None")}


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# --- tables -----------------------------------------------------------------------------


def _table(rows: Rows, columns: Sequence[Column], right: Sequence[str] = ()) -> str:
    """A markdown table; columns empty in every row are left out, and a ``commit`` column
    is added when the rows come from more than one commit."""
    commits = list(dict.fromkeys(r.get("commit", "") for r in rows))
    if len(commits) > 1:
        columns = [*columns, ("commit", lambda r: r.get("commit", ""))]
    cells = [[cell(r) for _, cell in columns] for r in rows]
    keep = [i for i in range(len(columns)) if any(line[i] for line in cells)]
    header = [columns[i][0] for i in keep]
    rule = ["---:" if columns[i][0] in right else "---" for i in keep]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(line[i] for i in keep) + " |" for line in cells]
    return "\n".join(lines)


def _generic(rows: Rows) -> str:
    keys = [k for k in rows[0] if k not in ("date", "run")]
    columns: list[Column] = [(k, partial(_get, key=k)) for k in keys]
    return _table(rows, columns)


def _get(row: dict[str, str], key: str) -> str:
    return row.get(key, "")


def _baselines(rows: Rows) -> str:
    """Strategies down, budgets across: overhead vs the ideal, or the budget it needs."""
    budgets = list(dict.fromkeys(r["budget"] for r in rows))
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for r in rows:
        cells.setdefault((_named(r, "model"), r["strategy"]), {})[r["budget"]] = _overhead(r)
    lines = [
        "| model (training nodes) | strategy | " + " | ".join(budgets) + " |",
        "|" + "---|" * (2 + len(budgets)),
    ]
    for (model, strategy), by_budget in cells.items():
        row = " | ".join(by_budget.get(b, "") for b in budgets)
        lines.append(f"| {model} | {strategy} | {row} |")
    return "\n".join(lines)


def _overhead(row: dict[str, str]) -> str:
    if row.get("note"):
        return row["note"]
    if row.get("overhead"):
        return _pct(row, "overhead")
    if row.get("need_percent"):
        return f"needs {float(row['need_percent']):.0f}%"
    return "infeasible"


def _ingestion(rows: Rows) -> str:
    columns: list[Column] = [
        ("step", lambda r: r["step"]),
        ("seconds", lambda r: _f(r, "seconds", ".3f")),
    ]
    return _table(rows, columns)


def _api(rows: Rows) -> str:
    servers = set(r.get("server", "") for r in rows)
    columns: list[Column] = [("server", lambda r: r.get("server", ""))] if len(servers) > 1 else []
    columns += [
        ("scenario", lambda r: r["scenario"]),
        ("requests", lambda r: r["requests"]),
        ("errors", lambda r: r["errors"]),
        ("achieved req/s", lambda r: r.get("achieved_rps", "")),
        ("p50 ms", lambda r: r.get("p50_ms", "")),
        ("p99 ms", lambda r: r.get("p99_ms", "")),
        ("jobs", lambda r: r.get("jobs", "")),
        ("workers", lambda r: r.get("workers", "")),
        ("drain s", lambda r: r.get("drain_s", "")),
        ("jobs/s", lambda r: r.get("jobs_per_s", "")),
    ]
    right = ("requests", "errors", "achieved req/s", "p50 ms", "p99 ms", "drain s", "jobs/s")
    return _table(rows, columns, right)


def _solvers(rows: Rows) -> str:
    def gap(r: dict[str, str]) -> str:
        if r.get("gap_1pct_s"):
            return _f(r, "gap_1pct_s", ".1f")
        if r.get("gap"):
            return f"gap {float(r['gap']):.1%}"
        return "-"

    columns: list[Column] = [
        ("model (stages)", lambda r: _named(r, "model")),
        ("budget", lambda r: r["budget"]),
        ("devices", _started_devices),
        ("backend", lambda r: solver_label(r.get("strategy", ""), r["backend"])),
        ("status", lambda r: r["status"]),
        ("first plan s", lambda r: _f(r, "first_plan_s", ".1f", "-")),
        ("final plan s", lambda r: _f(r, "final_plan_s", ".1f", "-")),
        ("1% gap s", gap),
        ("objective ms", lambda r: _f(r, "objective", ".3f", "-")),
        ("vs best baseline", lambda r: _pct(r, "vs_baseline", "-")),
        ("vs ideal", lambda r: _pct(r, "vs_ideal", "-")),
        ("total s", lambda r: _f(r, "seconds", ".1f", "-")),
    ]
    if any("peak_mib" in r for r in rows):  # runs since the 5% gap and the memory were kept
        columns[7:7] = [("5% gap s", lambda r: _f(r, "gap_5pct_s", ".1f", "-"))]
        columns.append(("peak MiB", lambda r: _f(r, "peak_mib", ".0f", "-")))
    return _table(rows, columns)


def _started_devices(r: dict[str, str]) -> str:
    """The row's devices, and the earlier rows' plans its search started from (``--reuse``)."""
    started = int(r.get("reuse") or 0)
    return r["devices"] + (f" from {started} plan{'s' if started > 1 else ''}" if started else "")


def solver_label(strategy: str, backend: str) -> str:
    """The backend of the exact search, or the strategy where another one ran (``moccasin``
    always solves with CP-SAT)."""
    if strategy in ("", "checkmate_milp", "xengine"):
        return backend
    return f"{strategy} ({backend})"


def _agent(rows: Rows) -> str:
    devices = list(dict.fromkeys(d for r in rows for d in _per_device(r["predicted_peak"])))

    def peak(device: str) -> Callable[[dict[str, str]], str]:
        def cell(r: dict[str, str]) -> str:
            predicted = _per_device(r["predicted_peak"])
            if device not in predicted:  # a device of the run that the plan left unused
                return f"{_bytes(0)} / {_bytes(0)}" if device in r["devices"].split("+") else ""
            measured = _per_device(r["measured_peak"])[device]
            text = f"{_bytes(predicted[device])} / {_bytes(measured)}"
            allocator = _per_device(r.get("allocator_peak", ""))
            return text + (f" ({_bytes(allocator[device])})" if device in allocator else "")

        return cell

    def error(r: dict[str, str]) -> str:
        text = r.get("grad_rel_error", "")
        return f"{float(text):.1e}" if text not in ("", "None") else "n/a"

    columns: list[Column] = [
        ("model (nodes)", lambda r: _named(r, "model")),
        ("budget", lambda r: r["budget"]),
        ("devices", lambda r: r["devices"]),
        ("plan", lambda r: r.get("placement", "")),
        ("predicted ms", lambda r: _f(r, "objective", ".1f")),
        ("measured ms", lambda r: _f(r, "measured_ms", ".1f")),
        ("time error", lambda r: _pct(r, "time_error")),
    ]
    alloc = " (allocator)" if any(r.get("allocator_peak") for r in rows) else ""
    columns += [(f"peak {d} pred / meas{alloc}", peak(d)) for d in devices]
    columns += [("grad rel error", error), ("targets", _targets)]
    return _table(rows, columns, ("predicted ms", "measured ms", "time error", "grad rel error"))


def _targets(row: dict[str, str]) -> str:
    """``met``, or ``missed: time: ...; peak cpu0: ...`` shortened to ``missed (time, peak
    cpu0)``."""
    text = row.get("targets", "")
    if not text.startswith("missed: "):
        return text
    misses = [miss.split(":")[0] for miss in text.removeprefix("missed: ").split("; ")]
    return f"missed ({', '.join(misses)})"


def _models(rows: Rows) -> str:
    """Real exports: ingest, the ``auto`` plan (at 50%, or the budget it was made at), the
    executor's own check and its gradients against PyTorch's, or the first error on the way
    (one line)."""

    def ingest(r: dict[str, str]) -> str:
        if r.get("export", "ok") != "ok":
            return f"export failed: {_cell(r['export'])}"
        return _cell(r.get("ingest", ""))

    def plan(r: dict[str, str]) -> str:
        if not r.get("overhead"):
            return _cell(r.get("plan", ""))
        budget = r.get("budget", "50%")
        at = "" if budget == "50%" else f" at {budget}"
        return f"{r['plan']} {_pct(r, 'overhead')}{at}"

    def check(r: dict[str, str]) -> str:
        error = r.get("rel_error", "")
        text = _cell(r.get("check", ""))
        return f"{text} {float(error):.1e}" if error not in ("", "None") else text

    def against_torch(r: dict[str, str]) -> str:
        if r.get("torch_error", "") == "":
            return ""
        unpaired = r.get("unpaired", "").split()
        verdict = r.get("torch_check", "")
        text = f"{verdict} {float(r['torch_error']):.1e}".strip()
        if r.get("torch_fp32_error", "") != "":
            text += f" (PyTorch fp32: {float(r['torch_fp32_error']):.1e})"
        text += f", {r.get('paired', '')} parameters"
        if unpaired:
            text += f"; {len(unpaired)} not in the export: {', '.join(unpaired[:2])}"
            text += ", ..." if len(unpaired) > 2 else ""
        return text

    columns: list[Column] = [
        ("model", lambda r: r["model"]),
        ("source", lambda r: r["source"]),
        ("exporter", lambda r: f"{r['exporter']} {r.get('opset', '')}".strip()),
        ("mode", lambda r: r["mode"]),
        ("ONNX nodes", lambda r: r.get("onnx_nodes", "")),
        ("graph nodes", lambda r: r.get("nodes", "")),
        ("ingest", ingest),
        ("plan@50% (auto) vs ideal", plan),
        ("executor: grad (output) error", check),
        ("grad error vs PyTorch (float64)", against_torch),
        ("s", lambda r: _f(r, "seconds", ".1f")),
    ]
    return _table(rows, columns, ("ONNX nodes", "graph nodes", "s"))


def _ratio_cells(
    line: dict[str, str], by: dict[str, dict[str, str]], strategies: list[str]
) -> list[str]:
    """Each strategy's ratio in ``line`` (``-``: no plan), the best in bold; the strategies
    that have one."""
    ratios = {s: float(by[s]["ratio"]) for s in strategies if by.get(s, {}).get("ratio")}
    best = min(ratios.values(), default=None)
    for strategy in strategies:
        value = ratios.get(strategy)
        text = "-" if value is None else f"{value:.3f}"
        line[strategy] = f"**{text}**" if value is not None and value == best else text
    return list(ratios)


def _offload(rows: Rows) -> str:
    """One line per model and budget: Proposition 3's bound and each strategy's makespan
    as a ratio to it (``-``: no plan at this budget), the best marked."""
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    lines: dict[tuple[str, str], dict[str, dict[str, str]]] = {}
    for r in rows:
        lines.setdefault((_named(r, "model"), r["budget"]), {})[r["strategy"]] = r
    pivoted = []
    for (model, budget), by in lines.items():
        first = next(iter(by.values()))
        line = {"model": model, "budget": budget, "bound": _f(first, "bound_ms", ".4g")}
        _ratio_cells(line, by, strategies)
        pivoted.append(line)
    columns: list[Column] = [
        ("model (nodes)", lambda r: r["model"]),
        ("budget", lambda r: r["budget"]),
        ("bound ms", lambda r: r["bound"]),
        *[(s, partial(_get, key=s)) for s in strategies],
    ]
    return _table(pivoted, columns, ("bound ms", *strategies))


def _by_budget(rows: Rows, extra: Callable[[dict[str, dict[str, str]]], dict[str, str]]) -> str:
    """One line per model and budget: the ideal and each strategy's makespan as a ratio to
    it (``-``: no plan at this budget), the best marked, and ``extra``'s columns of the
    line's rows by strategy; after a model's lines, the smallest budget each strategy found
    a plan for, among those tried."""
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    lines: dict[str, dict[str, dict[str, dict[str, str]]]] = {}
    for r in rows:
        lines.setdefault(_named(r, "model"), {}).setdefault(r["budget"], {})[r["strategy"]] = r
    pivoted = []
    extras: list[str] = []
    for model, by_budget in lines.items():
        smallest: dict[str, tuple[float, str]] = {}
        for budget, by in by_budget.items():
            first = next(iter(by.values()))
            line = {"model": model, "budget": budget, "ideal": _f(first, "ideal_ms", ".4g")}
            size = _budget_size(first)
            for strategy in _ratio_cells(line, by, strategies):
                smallest[strategy] = min(smallest.get(strategy, (size, budget)), (size, budget))
            more = extra(by)
            extras = extras or list(more)
            pivoted.append(line | more)
        least = {s: smallest[s][1] if s in smallest else "none" for s in strategies}
        pivoted.append({"model": model, "budget": "smallest feasible, among those tried"} | least)
    columns: list[Column] = [
        ("model (nodes)", lambda r: r["model"]),
        ("budget", lambda r: r["budget"]),
        ("ideal ms", lambda r: r.get("ideal", "")),
        *[(s, partial(_get, key=s)) for s in strategies],
        *[(e, lambda r, e=e: r.get(e, "")) for e in extras],
    ]
    return _table(pivoted, columns, ("ideal ms", *strategies, *extras))


def _budget_size(row: dict[str, str]) -> float:
    """A row's budget in bytes where it has them (budgets of two kinds, such as percentages
    of the activations and of the whole peak, then compare), else its percentage."""
    if row.get("budget_bytes"):
        return float(row["budget_bytes"])
    return float(row["budget"].rstrip("%"))


def _port(rows: Rows) -> str:
    """``_by_budget`` with ``port``'s recomputations and page transfers."""

    def counts(by: dict[str, dict[str, str]]) -> dict[str, str]:
        port = by.get("port", {})
        return {
            "port recomputations": port.get("recomputations") or "-",
            "port page transfers": port.get("page_transfers") or "-",
        }

    return _by_budget(rows, counts)


def _port_m(rows: Rows) -> str:
    """``_by_budget`` with whether ``port_m``'s plan is concurrent and, where the run has a
    ``poet`` column, PORT-M's speedup over it and the device POET chose."""
    with_poet = any(r["strategy"] == "poet" for r in rows)

    def concurrent(by: dict[str, dict[str, str]]) -> dict[str, str]:
        port_m = by.get("port_m", {})
        flag = port_m.get("concurrent", "")
        cells = {"port_m concurrent": {"True": "yes", "False": "no"}.get(flag, "-")}
        if not with_poet:
            return cells
        poet = by.get("poet", {})
        both = poet.get("objective") and port_m.get("objective")
        cells["poet / port_m"] = (
            f"{float(poet['objective']) / float(port_m['objective']):.3f}x" if both else "-"
        )
        cells["poet's device"] = poet.get("plan_devices") or "-"
        return cells

    return _by_budget(rows, concurrent)


def _eager(rows: Rows) -> str:
    columns: list[Column] = [
        ("model (nodes)", _model_at_shape),
        ("steps", lambda r: r["steps"]),
        ("eager ms", lambda r: _f(r, "eager_ms", ".2f")),
        ("executor ms", lambda r: _f(r, "measured_ms", ".2f")),
        ("executor / eager", lambda r: _f(r, "ratio", ".2f")),
        ("range", _ratio_range),
        ("outside the kernels, us per step", lambda r: _f(r, "outside_us_per_step", ".1f")),
        ("step overhead, us", lambda r: _f(r, "step_overhead_us", ".1f", "-")),
        ("attention steps ms", lambda r: _f(r, "attention_ms", ".1f")),
        ("predicted peak MiB", lambda r: _f(r, "predicted_peak_mib", ".1f")),
        ("gradients match", lambda r: "yes" if r.get("gradients_match") == "True" else "no"),
    ]
    right = ("steps", "eager ms", "executor ms", "executor / eager", "range")
    return _table(rows, columns, right)


def _model_at_shape(row: dict[str, str]) -> str:
    """The model, its nodes, and the input shape where the run gave one."""
    shape = row.get("input_shape")
    return f"{row['model']} ({row['nodes']})" + (f" at {shape}" if shape else "")


def _attention(rows: Rows) -> str:
    columns: list[Column] = [
        ("positions", lambda r: r["positions"]),
        ("batch", lambda r: r["batch"]),
        ("mask", lambda r: r["mask"]),
        ("closed form ms", lambda r: _f(r, "closed_ms", ".1f")),
        ("from saved ms", lambda r: _f(r, "saved_ms", ".1f")),
        ("forward again ms", lambda r: _f(r, "pytorch_ms", ".1f")),
        ("closed / from saved", lambda r: _ratio(r, "closed_ms", "saved_ms")),
        ("closed / forward again", lambda r: _ratio(r, "closed_ms", "pytorch_ms")),
        ("closed form MiB", lambda r: _f(r, "closed_mib", ".1f")),
        ("from saved MiB", lambda r: _f(r, "saved_mib", ".1f")),
        ("forward again MiB", lambda r: _f(r, "pytorch_mib", ".1f")),
        ("the executor takes", lambda r: r["takes"]),
    ]
    text = ("mask", "the executor takes")
    return _table(rows, columns, tuple(name for name, _ in columns if name not in text))


def _judging(rows: Rows) -> str:
    def saved(r: dict[str, str]) -> str:
        return f"{1 - float(r['seconds_shared_once']) / float(r['seconds_each_part']):.0%}"

    columns: list[Column] = [
        ("model (nodes)", lambda r: f"{r['model']} ({r['nodes']})"),
        ("budget", lambda r: r["budget"]),
        ("choices", lambda r: r["choices"]),
        ("judge plans, each part", lambda r: r["plans_each_part"]),
        ("seconds, each part", lambda r: _f(r, "seconds_each_part", ".2f")),
        ("judge plans, shared parts once", lambda r: r["plans_shared_once"]),
        ("seconds, shared parts once", lambda r: _f(r, "seconds_shared_once", ".2f")),
        ("time saved", saved),
    ]
    right = ("choices", "seconds, each part", "seconds, shared parts once", "time saved")
    return _table(rows, columns, right)


def _ratio_range(row: dict[str, str]) -> str:
    """The ratio's range over the bench's processes (rows from before it ran several: none)."""
    if not row.get("ratio_min"):
        return ""
    return f"{float(row['ratio_min']):.2f}-{float(row['ratio_max']):.2f}"


def _profiling(rows: Rows) -> str:
    columns: list[Column] = [
        ("model (nodes)", lambda r: f"{r['model']} ({r['nodes']})"),
        ("limit MiB", lambda r: f"{int(r['limit_bytes']) / 2**20:.1f}"),
        ("passes ms", lambda r: _f(r, "passes_ms", ".2f")),
        ("passes' overhead ms", lambda r: _f(r, "overhead_ms", ".2f")),
        ("node by node ms", lambda r: _f(r, "alone_ms", ".2f")),
        ("node by node / passes", lambda r: _f(r, "ratio", ".3f")),
        ("/ passes with overhead", lambda r: _f(r, "ratio_with_overhead", ".3f")),
    ]
    return _table(rows, columns, tuple(header for header, _ in columns[1:]))


def _energy(rows: Rows) -> str:
    columns: list[Column] = [
        ("model (nodes)", lambda r: f"{r['model']} ({r['nodes']})"),
        ("regime", lambda r: r["regime"]),
        ("objective", lambda r: r["goal"] + (" *" if r.get("pareto") == "True" else "")),
        ("time ms", lambda r: _f(r, "time_ms", ".4g")),
        ("energy mJ", lambda r: _f(r, "energy_mj", ".4g")),
        ("gap", lambda r: f"{float(r['gap']):.1%}" if r.get("gap") else "-"),
        ("computes cpu0 / gpu0", lambda r: f"{r['computes_cpu0']} / {r['computes_gpu0']}"),
    ]
    return _table(rows, columns, ("time ms", "energy mJ", "gap", "computes cpu0 / gpu0"))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


RENDERERS: dict[str, Callable[[Rows], str]] = {
    "baselines": _baselines,
    "ingestion": _ingestion,
    "api": _api,
    "solvers": _solvers,
    "agent": _agent,
    "models": _models,
    "offload": _offload,
    "port": _port,
    "port_m": _port_m,
    "eager": _eager,
    "attention": _attention,
    "judging": _judging,
    "profiling": _profiling,
    "energy": _energy,
}


# --- the document -----------------------------------------------------------------------


def rewrite(text: str) -> str:
    def table(match: re.Match[str]) -> str:
        name, *filters = match["spec"].split()
        return f"<!-- table {match['spec']} -->\n{render(name, filters)}\n<!-- /table -->"

    return MARKER.sub(table, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", nargs="*", help="NAME [column=value ...]: print one table")
    parser.add_argument("--doc", type=Path, default=DOC, help="the document to rewrite")
    parser.add_argument("--check", action="store_true", help="exit 1 if the document is stale")
    args = parser.parse_args()
    if args.table:
        print(render(args.table[0], args.table[1:]))
        return 0
    text = args.doc.read_text()
    new = rewrite(text)
    if args.check:
        if new != text:
            print(f"{args.doc}: tables out of date; run bench/report.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.doc.write_text(new)
        print(f"rewrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
