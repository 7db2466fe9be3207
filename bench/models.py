"""Real exports end to end: export -> ingest -> plan at 50% with ``auto`` -> execute ->
gradients against PyTorch.

The corpus is ``agents/pytorch/corpus.py`` (``torch.nn`` modules, a hand-built CNN,
torchvision's classifiers and segmentation models through
``agents/pytorch/torchvision_models.py``, Hugging Face transformers' GPT-2, BERT and T5
from small configs on token ids; nothing downloaded) at its ``bench`` scale (``--scale
test``: the tests' sizes), exported by the TorchScript exporter (``dynamo=False``, opset
17) and by the dynamo exporter (opset 18), in training and in evaluation mode. Per
export: ONNX nodes, the training (or inference) graph's nodes, whether remat ingests it
(else the error's first line), the ``auto`` plan on one CPU (analytical costs) at 50% of
the checkpoint-all peak, or where 50% is under the least any schedule needs, at the
midpoint between that floor and the peak (``agents.pytorch.check.plan_for_check``), its
overhead vs the ideal; then the agent's executor runs that plan: its own check (planned
vs plain run of the same program: gradients in training, outputs in evaluation) and, in
training, the gradient of every parameter against the module's autograd in float64 for
the entry's loss (``agents.pytorch.reference.compare_with_module``: worst relative
error, PyTorch's own fp32 error beside it, and the parameters the export holds no tensor
for). Models with more than ``--max-check-params`` parameters skip the execution (said
in the row).

Prints a markdown table and appends its rows to ``bench/results/models.csv`` as they are
measured (``bench/report.py`` renders them).

    .venv/bin/python bench/models.py [--models small_cnn,resnet18,...] [--scale bench|test]
        [--exporters torchscript,dynamo] [--time-limit 10]
        [--max-check-params 40000000] [--modes training,inference] [--run LABEL]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

import torch
from report import RENDERERS
from results import Writer, add_run_argument

from agents.executor import execute
from agents.pytorch.check import CPU, export_entry, graph_of, plan_for_check
from agents.pytorch.corpus import CORPUS, OPSETS, SCALES, Entry
from agents.pytorch.export import EXPORTERS, Exporter
from agents.pytorch.reference import compare_with_module
from remat.graph import Mode
from remat.solvers.model import SolveOptions
from remat.strategies import SolverSettings

render_models = RENDERERS["models"]
MESSAGE_CHARS = 140
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
PROVED = "infeasible at this budget: auto proved that no schedule fits: "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CORPUS))
    parser.add_argument("--scale", choices=SCALES, default="bench")
    parser.add_argument("--exporters", default=",".join(EXPORTERS))
    parser.add_argument("--time-limit", type=float, default=10.0, help="plan time limit, s")
    parser.add_argument(
        "--max-check-params",
        type=int,
        default=40_000_000,
        help="skip the executor's check on models with more parameters",
    )
    parser.add_argument(
        "--modes", default="training,inference", help="export in these modes (train / eval)"
    )
    add_run_argument(parser)
    args = parser.parse_args()
    exporters = args.exporters.split(",")
    modes = [Mode(mode) for mode in args.modes.split(",")]
    for name in [n for n in args.models.split(",") if n not in CORPUS] + [
        e for e in exporters if e not in EXPORTERS
    ]:
        parser.error(f"unknown model or exporter {name!r}")
    out = Writer("models", args.run)
    torch.set_num_threads(1)
    rows: list[dict[str, str]] = []
    for name in args.models.split(","):
        entry = CORPUS[name]
        for exporter in exporters:
            for mode in modes:
                try:
                    row = _measure(entry, exporter, mode, args)
                except ImportError as error:  # torchvision (beside the venv) or transformers
                    print(f"... {name}: {_line(error)}", file=sys.stderr, flush=True)
                    break
                out.add(row)
                rows.append({k: "" if v is None else str(v) for k, v in row.items()})
                print(f"... {render_models(rows[-1:]).splitlines()[-1]}", file=sys.stderr)
    print(render_models(rows))


def _measure(
    entry: Entry, exporter: Exporter, mode: Mode, args: argparse.Namespace
) -> dict[str, Any]:
    start = time.monotonic()
    row: dict[str, Any] = {"model": entry.name, "source": entry.source, "exporter": exporter}
    row |= {"opset": OPSETS[exporter], "mode": mode.value, "scale": args.scale}
    row |= {"input": "x".join(map(str, entry.shapes[args.scale]))}
    row |= {"budget": "50%", "devices": CPU.name, "time_limit_s": args.time_limit}
    row |= {"loss": entry.loss.kind.value if mode is Mode.TRAINING else ""}
    try:
        exported = export_entry(entry, args.scale, exporter, train=mode is Mode.TRAINING)
    except ImportError:
        raise
    except Exception as error:
        return row | {"export": _line(error), "seconds": time.monotonic() - start}
    model = exported.model
    params = sum(p.numel() for p in exported.module.parameters())
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    row |= {"export": "ok", "opset": opset, "onnx_nodes": len(model.graph.node), "params": params}
    try:
        graph = graph_of(exported, mode, entry.loss)
    except Exception as error:
        return row | {"ingest": _line(error), "seconds": time.monotonic() - start}
    row |= {"ingest": "ok", "nodes": len(graph)}
    try:
        options = SolveOptions(time_limit_s=args.time_limit, threads=1)
        planned = plan_for_check(graph, "50%", SolverSettings(options=options))
    except Exception as error:
        return row | {"plan": _line(error), "seconds": time.monotonic() - start}
    result = planned.result
    row["budget"] = planned.budget
    if not result.feasible or result.plan is None or result.simulation is None:
        message = _line(result.message.replace(PROVED, "infeasible: ") or "no plan")
        return row | {"plan": message, "seconds": time.monotonic() - start}
    ideal = planned.problem.costs.ideal_ms(CPU.name)
    row |= {"plan": result.strategy, "objective": result.simulation.total_ms}
    row["overhead"] = result.simulation.total_ms / ideal - 1
    if params > args.max_check_params:
        row["check"] = f"skipped (> {args.max_check_params:,} parameters)"
        return row | {"seconds": time.monotonic() - start}
    try:
        if mode is Mode.TRAINING:
            comparison = compare_with_module(
                exported.module, exported.args, model, graph, result.plan, [CPU]
            )
            report = comparison.report
            row |= {"torch_error": comparison.error, "paired": comparison.paired}
            row |= {"torch_fp32_error": comparison.torch_error}
            row["torch_check"] = "match" if comparison.matches else "MISMATCH"
            row["unpaired"] = " ".join(comparison.unpaired)
        else:
            report = execute(model, graph, result.plan, [CPU], warmup=0, repeats=1)
    except Exception as error:
        return row | {"check": _line(error), "seconds": time.monotonic() - start}
    if mode is Mode.TRAINING:
        row |= {"check": _verdict(report.gradients_match), "rel_error": report.max_rel_error}
    else:
        row |= {"check": _verdict(report.outputs_match), "rel_error": report.outputs_rel_error}
    return row | {"seconds": time.monotonic() - start}


def _verdict(match: bool | None) -> str:
    return {True: "match", False: "MISMATCH", None: "n/a"}[match]


def _line(error: BaseException | str) -> str:
    """One line: the error's type and the first line of its message, shortened."""
    if isinstance(error, BaseException):
        first = next((line for line in str(error).splitlines() if line.strip()), "")
        text = f"{type(error).__name__}: {first.strip()}"
    else:
        text = error.splitlines()[0] if error else ""
    text = ANSI_ESCAPE.sub("", text)  # the dynamo exporter colours its messages
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


if __name__ == "__main__":
    main()
