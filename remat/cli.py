"""The ``remat`` command line: graph, plan, check, demo, max-batch.

Every error the library raises on purpose becomes a one-line message and exit status 2;
``check`` exits 1 when the plan is invalid.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO, TypedDict

import onnx

from remat.budgets import reference
from remat.costs import CostTable, analytical_costs, load_cost_table
from remat.devices import (
    Device,
    DeviceKind,
    format_bytes,
    parse_device,
    parse_rate,
    with_option,
)
from remat.errors import InvalidInputError, RematError
from remat.family import describe, plan_family
from remat.graph import Graph, Mode
from remat.loss import Loss, LossKind
from remat.max_batch import (
    DEFAULT_CAP,
    CostBound,
    MaxBatch,
    Trial,
    describe_trial,
    max_batch,
    max_batch_to_json,
    problems_by_batch,
)
from remat.objective import Objective, ObjectiveKind
from remat.onnx_external import load_archive, model_in_directory, starts_like_zip
from remat.onnx_fusion import ATTENTION
from remat.onnx_ingest import declared_inputs, load_model, parse_input_shape
from remat.plan import FIXED_OPS, PAGE_OPS, Plan, load_plan, plan_to_json
from remat.problem import DEFAULT_DEVICE, build_problem, cost_model, model_graph
from remat.shape_range import (
    check_ranged_dims_symbolic,
    parse_input_range,
    parse_observed,
    shape_range,
)
from remat.simulator import Simulation, simulate
from remat.solvers.model import Progress, SolveOptions
from remat.solvers.runner import BACKENDS, DEFAULT_BACKEND
from remat.strategies import AUTO, STRATEGIES, Problem, SolverSettings, StrategyResult, run_strategy
from remat.strategies.common.known import noted_if_known

MAX_BATCH_TIME_LIMIT_S = 10.0  # per try: a search makes about 2 log2(B) tries
AUTO_HELP = (
    "strategy (default: auto: the baselines, greedy eviction, offloading on a GPU, then a "
    "short exact solve where the graph is small enough; the cheapest plan wins)"
)


MODEL_HELP = (
    "ONNX model: a .onnx file, a directory holding one with its external data files, "
    "or a zip archive of them"
)
Commands = argparse._SubParsersAction  # the ``add_parser`` of ``remat``'s subcommands


def main(
    argv: Sequence[str] | None = None,
    extend: Callable[[Commands], None] | None = None,
) -> int:
    """``extend`` adds commands of layers above the library (``app.cli``: serve, submit)."""
    parser = _parser(extend)
    args = parser.parse_args(argv)
    if getattr(args, "verbose", False):
        logging.basicConfig(format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
        logging.getLogger("remat").setLevel(logging.DEBUG)
    try:
        return int(args.run(args))
    except RematError as exc:
        print(f"remat: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("remat: interrupted", file=sys.stderr)
        return 130


def _parser(extend: Callable[[Commands], None] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat", description="Plan rematerialization for training under memory budgets."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    graph = commands.add_parser("graph", help="summarise a model's graph")
    _model_arguments(graph)
    graph.add_argument("--json", action="store_true", help="print the graph as JSON")
    graph.set_defaults(run=_graph_command)

    plan = commands.add_parser("plan", help="plan a training step under budgets")
    _model_arguments(plan)
    _cost_arguments(plan)
    plan.add_argument(
        "--strategy",
        default=AUTO,
        choices=[AUTO, *STRATEGIES],
        help=AUTO_HELP,
    )
    plan.add_argument(
        "--host-bandwidth",
        metavar="RATE",
        help="each device's link to its host memory, e.g. 12GB/s, for the offloading "
        "strategies (default: the cost table's measurement, else 12GB/s for cuda, 10GB/s "
        "for cpu)",
    )
    plan.add_argument(
        "--storage-bandwidth",
        metavar="RATE",
        help="each device's link to the node's storage, e.g. 1GB/s, both ways, for paging "
        "(strategy port; default: the cost table's measurement, else 1GB/s written and "
        "1.5GB/s read)",
    )
    _objective_arguments(plan)
    _solver_arguments(plan)
    plan.add_argument(
        "--start-from",
        action="append",
        default=[],
        type=Path,
        metavar="PLAN",
        help="a plan made before for this model's graph (a plan JSON, repeatable): the "
        "optimal strategies start from it where it fits these budgets, and never end above it",
    )
    output = plan.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the plan JSON")
    output.add_argument("-o", "--output", type=Path, help="write the plan JSON to this file")
    plan.set_defaults(run=_plan_command)

    family = commands.add_parser(
        "family", help="plan for inputs whose size ranges (a plan family, Mimose)"
    )
    _model_arguments(
        family,
        shapes="shape of an input, a dimension a value or a range "
        "LOW..HIGH, e.g. input_ids=8x16..512 (repeatable)",
    )
    _cost_arguments(family)
    family.add_argument(
        "--strategy",
        default=AUTO,
        choices=[AUTO, *STRATEGIES],
        help="for each bucket's largest size (default: auto)",
    )
    family.add_argument(
        "--observed",
        metavar="SIZE:COUNT,...",
        help="the sizes the data has, with counts: the solve time goes where they are",
    )
    family.add_argument(
        "--size",
        action="append",
        default=[],
        type=_positive_int,
        metavar="S",
        help="also plan this size, as a cache miss would (repeatable)",
    )
    _solver_arguments(family)
    family.set_defaults(run=_family_command)

    check = commands.add_parser("check", help="check a plan with the simulator")
    _model_arguments(check)
    check.add_argument("plan", type=Path, help="plan JSON file")
    check.add_argument("--costs", type=Path, help="cost table JSON (default: analytical)")
    check.set_defaults(run=_check_command)

    demo = commands.add_parser("demo", help="compare every strategy on a sample network")
    demo.add_argument("--model", default="unet", help="sample network (default: unet)")
    demo.add_argument("--batch", type=_positive_int, default=4, help="batch size (default: 4)")
    demo.add_argument(
        "--time-limit",
        type=_positive_float,
        default=5.0,
        metavar="S",
        help="solver time limit per optimal plan (default 5)",
    )
    demo.set_defaults(run=_demo_command)

    _max_batch_arguments(commands)
    if extend is not None:
        extend(commands)
    return parser


def _max_batch_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    search = commands.add_parser(
        "max-batch",
        help="the largest batch size with a plan within the budgets and a cost bound",
        description="The largest batch size with a feasible plan under the budgets whose "
        "predicted time is at most one extra forward pass above the ideal (Checkmate eq. 10), "
        "or --max-overhead PCT above it: batch 1, doubling, then bisection.",
    )
    search.add_argument("model", type=Path, help=MODEL_HELP + " (symbolic batch dimension)")
    search.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=DIMS",
        help="whole shape of an input, the same at every batch size (repeatable)",
    )
    search.add_argument(
        "--device",
        action="append",
        default=[],
        metavar="NAME:KIND[:key=value,...]",
        help="a device, e.g. cpu0:cpu:threads=2 or cuda0:cuda (default: one cpu0)",
    )
    search.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="memory budget in bytes or KiB/MiB/GiB (not %%: it would change with the batch)",
    )
    search.add_argument(
        "--strategy",
        default=AUTO,
        choices=[AUTO, *STRATEGIES],
        help=AUTO_HELP,
    )
    search.add_argument(
        "--max-overhead",
        type=_percentage,
        metavar="PCT",
        help="at most PCT%% above the ideal instead of one extra forward pass (eq. 10)",
    )
    search.add_argument(
        "--max",
        type=_positive_int,
        default=DEFAULT_CAP,
        dest="cap",
        metavar="B",
        help=f"largest batch size to try (default {DEFAULT_CAP})",
    )
    loss_arguments(search)
    fusion_argument(search)
    _solver_arguments(search, time_limit_s=MAX_BATCH_TIME_LIMIT_S, per="per batch size tried")
    search.add_argument("--json", action="store_true", help="print the result as JSON")
    search.add_argument(
        "-o", "--output", type=Path, help="write the plan at the largest batch to this file"
    )
    search.set_defaults(run=_max_batch_command)


def _model_arguments(
    parser: argparse.ArgumentParser,
    shapes: str = "shape of an input, e.g. x=1x3x224x224 (repeatable)",
) -> None:
    parser.add_argument("model", type=Path, help=MODEL_HELP)
    parser.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.TRAINING.value)
    parser.add_argument("--batch", type=_positive_int, help="value of the leading dimension")
    parser.add_argument("--input", action="append", default=[], metavar="NAME=DIMS", help=shapes)
    loss_arguments(parser)
    fusion_argument(parser)


def fusion_argument(parser: argparse.ArgumentParser) -> None:
    """``--fuse-attention`` (the default) or ``--no-fuse-attention``: each attention chain
    as one node (``remat.onnx_fusion``), or node by node."""
    parser.add_argument(
        "--fuse-attention",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan and run each attention chain (MatMul, scale, mask, Softmax, MatMul) as one "
        "node, as PyTorch's scaled_dot_product_attention: its weights are not held "
        "(default: on; --no-fuse-attention plans the chain node by node)",
    )


def loss_arguments(parser: argparse.ArgumentParser) -> None:
    """``--loss``, ``--loss-output``, ``--loss-axis``: the training loss (``remat.loss``)."""
    parser.add_argument(
        "--loss",
        choices=[k.value for k in LossKind],
        default=LossKind.MEAN_SQUARE.value,
        help="training loss: 0.5 mean(y^2) over the outputs (default), cross-entropy of "
        "logits against labels, or the model's own scalar loss output",
    )
    parser.add_argument(
        "--loss-output", metavar="NAME", help="the output it reads (default: the only one)"
    )
    parser.add_argument(
        "--loss-axis",
        type=int,
        default=-1,
        metavar="K",
        help="cross_entropy: the class axis of the logits (default: -1, the last)",
    )


def loss_of(args: argparse.Namespace) -> Loss:
    return Loss(LossKind(args.loss), args.loss_output, args.loss_axis)


def _cost_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        action="append",
        default=[],
        metavar="NAME:KIND[:key=value,...]",
        help="a device, e.g. cpu0:cpu:threads=2 or cuda0:cuda (default: one cpu0)",
    )
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="memory budget: bytes, KiB/MiB/GiB, or %% of the checkpoint-all peak",
    )
    parser.add_argument("--costs", type=Path, help="cost table JSON (default: analytical)")


def _objective_arguments(parser: argparse.ArgumentParser) -> None:
    """What a plan minimises and its power caps (``remat.objective``, XEngine eq. 17-19)."""
    group = parser.add_argument_group(
        "objective (energy: remat.energy's power model or a profile's)"
    )
    group.add_argument(
        "--objective",
        choices=[k.value for k in ObjectiveKind],
        default=ObjectiveKind.TIME.value,
        help="minimise time (default), energy, or time + ALPHA x energy (weighted)",
    )
    group.add_argument(
        "--alpha", type=_positive_float, metavar="MS_PER_MJ", help="weighted: energy's weight"
    )
    group.add_argument(
        "--power-cap",
        action="append",
        default=[],
        metavar="NAME=W",
        help="a device's power cap in watts: no operator runs where it would draw more",
    )
    group.add_argument("--board-cap", type=_positive_float, metavar="W", help="the machine's cap")
    group.add_argument(
        "--board-power",
        type=_non_negative_float,
        default=0.0,
        metavar="W",
        help="the board's own draw besides the devices' (default 0)",
    )
    group.add_argument(
        "--time-cap",
        type=_positive_float,
        metavar="MS",
        help="a runtime cap: no plan slower than this (with --objective energy: POET's "
        "objective, which port plans for)",
    )


def _objective(args: argparse.Namespace) -> Objective:
    caps: dict[str, float] = {}
    for text in args.power_cap:
        name, sep, watts = text.partition("=")
        if not sep or not name:
            raise InvalidInputError(f"--power-cap {text!r}: expected NAME=W, e.g. gpu0=250")
        try:
            caps[name] = float(watts.strip().removesuffix("W"))
        except ValueError:
            raise InvalidInputError(f"--power-cap {text!r}: {watts!r} is not watts") from None
    return Objective(
        ObjectiveKind(args.objective),
        args.alpha or 0.0,
        caps,
        args.board_cap,
        args.board_power,
        args.time_cap,
    )


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError("must be a non-negative number")
    return value


def _solver_arguments(
    parser: argparse.ArgumentParser, time_limit_s: float = 60.0, per: str = ""
) -> None:
    solver = parser.add_argument_group("optimal strategies (checkmate_milp, lp rounding, xengine)")
    solver.add_argument("--solver", choices=BACKENDS, default=DEFAULT_BACKEND)
    each = f" {per}" if per else ""
    solver.add_argument(
        "--time-limit",
        type=_positive_float,
        default=time_limit_s,
        metavar="S",
        help=f"stop the solve after S seconds{each} and keep the best plan "
        f"(default {time_limit_s:g})",
    )
    solver.add_argument(
        "--gap",
        type=_fraction,
        default=1e-4,
        metavar="G",
        help="stop once the relative gap is below G (default 1e-4)",
    )
    solver.add_argument("--threads", type=_positive_int, default=1, metavar="N")
    solver.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log each phase of the search (warm start, restrictions, LP, RINS, full solve)",
    )


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _percentage(text: str) -> float:
    """``10`` or ``10%`` -> 10.0 (>= 0)."""
    stripped = text.strip().removesuffix("%")
    try:
        value = float(stripped)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError("must be below 1 (a relative gap, e.g. 0.01)")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


# --- loading ----------------------------------------------------------------------------


def _load_graph(args: argparse.Namespace) -> Graph:
    return model_graph(**_model_options(args))


class ModelOptions(TypedDict):
    model: Path | onnx.ModelProto
    batch: int | None
    inputs: dict[str, tuple[int, ...]] | None
    mode: Mode
    loss: Loss
    external_data_dir: Path
    fuse_attention: bool


def _model_options(args: argparse.Namespace, whole_shapes: bool = True) -> ModelOptions:
    """What ``_model_arguments`` says about the model, as ``model_graph`` and
    ``build_problem`` take it (without ``--input`` where not ``whole_shapes``: ranges)."""
    return {
        "model": _model(args),
        "batch": args.batch,
        "inputs": _inputs(args) if whole_shapes else None,
        "mode": Mode(args.mode),
        "loss": loss_of(args),
        "external_data_dir": _model_dir(args),
        "fuse_attention": args.fuse_attention,
    }


def _with_inputs(options: ModelOptions, shapes: dict[str, tuple[int, ...]]) -> ModelOptions:
    sized = options.copy()
    sized["inputs"] = shapes
    return sized


def _inputs(args: argparse.Namespace) -> dict[str, tuple[int, ...]] | None:
    return dict(parse_input_shape(text) for text in args.input) or None


def _model(args: argparse.Namespace) -> Path | onnx.ModelProto:
    """The model ``args.model`` names: an ONNX file; a directory holding one ``.onnx``
    file with its external data files; or a zip archive of them, loaded here with its
    external data read from the archive only and embedded."""
    path = Path(args.model)
    if path.is_dir():
        return model_in_directory(path)
    if path.is_file() and starts_like_zip(path):
        return load_model(load_archive(path).model.SerializeToString())
    return path


def _model_dir(args: argparse.Namespace) -> Path:
    """The directory a model file's external data may be read from: its own (a directory
    given as the model: that directory)."""
    path = Path(args.model)
    return path if path.is_dir() else path.parent


def _devices(args: argparse.Namespace) -> list[Device] | None:
    """The ``--device`` devices; None without any (the library's default)."""
    return [parse_device(spec) for spec in args.device] or None


def _budgets(args: argparse.Namespace) -> dict[str, str]:
    """``--budget NAME=SIZE`` by device name (the library parses the sizes)."""
    sizes = {}
    for item in args.budget:
        name, sep, size = item.partition("=")
        if not sep:
            raise InvalidInputError(f"budget {item!r}: expected NAME=SIZE")
        sizes[name] = size
    return sizes


def _solver_settings(args: argparse.Namespace) -> SolverSettings:
    if not hasattr(args, "solver"):
        return SolverSettings()
    options = SolveOptions(time_limit_s=args.time_limit, gap=args.gap, threads=args.threads)
    unit = _objective(args).unit if hasattr(args, "objective") else "ms"
    line = ProgressLine(sys.stderr, unit)
    return SolverSettings(args.solver, options, line.show, _cancel_on_sigint())


def _cancel_on_sigint() -> threading.Event:
    """Ctrl-C stops a running solve, which then returns its best plan so far."""
    cancel = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda *_: cancel.set())
    return cancel


class ProgressLine:
    """The solver's progress on one line of stderr: rewritten in place on a terminal, at
    most one line a second otherwise; values in ``unit`` (the objective's)."""

    def __init__(self, stream: TextIO, unit: str = "ms") -> None:
        self.stream = stream
        self.unit = unit
        self.tty = stream.isatty()
        self.last = -1.0

    def show(self, progress: Progress) -> None:
        if not self.tty and progress.elapsed_s - self.last < 1.0:
            return
        self.last = progress.elapsed_s
        incumbent = "-" if progress.objective is None else f"{progress.objective:.4f} {self.unit}"
        bound = "-" if progress.bound is None else f"{progress.bound:.4f} {self.unit}"
        gap = "-" if progress.gap is None else f"{progress.gap:.2%}"
        line = f"[{progress.elapsed_s:6.1f} s] incumbent {incumbent}  bound {bound}  gap {gap}"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()


def _problem(args: argparse.Namespace) -> Problem:
    """``plan``'s problem, on the ``--device`` devices only (all of ``--costs``' without)."""
    devices = _devices(args)
    table = None if args.costs is None else load_cost_table(args.costs)
    rates = {
        "host_bandwidth": args.host_bandwidth,
        "storage_write_bandwidth": args.storage_bandwidth,
        "storage_read_bandwidth": args.storage_bandwidth,
    }
    for option, text in rates.items():
        if text is None:
            continue
        rate = parse_rate(text)
        named = devices or (
            [Device(d.name, d.kind) for d in table.devices] if table else [DEFAULT_DEVICE]
        )
        devices = [with_option(d, option, f"{rate:g}") for d in named]
    return build_problem(
        **_model_options(args),
        devices=devices,
        budgets=_budgets(args),
        table=table,
        solver=_solver_settings(args),
        objective=_objective(args),
    )


# --- commands ---------------------------------------------------------------------------


def _graph_command(args: argparse.Namespace) -> int:
    graph = _load_graph(args)
    if args.json:
        return _print_lines([json.dumps(graph_to_json(graph))])
    costs = analytical_costs(graph, [Device("cpu0", DeviceKind.CPU)])
    ref = reference(graph, costs)
    lines = [f"mode: {graph.mode.value}, {len(graph)} nodes"]
    lines += [f"  {op:<24} {n}" for op, n in sorted(Counter(n.op for n in graph.nodes).items())]
    lines += [
        f"parameter bytes:        {format_bytes(graph.param_bytes)} ({graph.param_bytes} B)",
        f"input bytes:            {format_bytes(graph.input_bytes)} ({graph.input_bytes} B)",
        f"activation bytes:       {format_bytes(graph.activation_bytes)} "
        f"({graph.activation_bytes} B)",
        f"checkpoint-all peak:    {format_bytes(ref.peak_bytes)} ({ref.peak_bytes} B)",
    ]
    return _print_lines(lines)


def _print_lines(lines: Sequence[str]) -> int:
    """Print to stdout; a reader that stops early (``remat graph m.onnx | head -1``) ends
    the output quietly, not with a BrokenPipeError traceback."""
    try:
        for line in lines:
            print(line)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that it cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 0


def graph_to_json(graph: Graph) -> dict[str, object]:
    return {
        "mode": graph.mode.value,
        "nodes": [
            {
                "id": n.id,
                "name": n.name,
                "op": n.op,
                "kind": n.kind.value,
                "deps": list(n.deps),
                "output_bytes": n.output_bytes,
            }
            for n in graph.nodes
        ],
        "param_bytes": graph.param_bytes,
    }


def _plan_command(args: argparse.Namespace) -> int:
    problem = _problem(args)
    starts = {str(path): _start(path, problem) for path in args.start_from}
    problem = problem.starting_from(starts.values())
    start = time.monotonic()
    result = noted_if_known(run_strategy(args.strategy, problem), starts)
    searched_s = time.monotonic() - start
    if result.plan is None:
        raise InvalidInputError(result.message)
    document = plan_to_json(result.plan)
    if args.output is not None:
        args.output.write_text(json.dumps(document, indent=1))
        print(f"wrote {args.output}", file=sys.stderr)
    if args.json:
        print(json.dumps(document))
    else:
        _print_summary(problem, result, searched_s)
    return 0


def _start(path: Path, problem: Problem) -> Plan:
    """The plan ``--start-from`` names, refused where it cannot start this problem's
    search: made for another graph (or before plans recorded theirs), or on a device the
    problem does not have."""
    plan = load_plan(path)
    fingerprint = problem.graph.fingerprint
    if plan.graph is None:
        raise InvalidInputError(
            f"--start-from {path}: the plan does not record its graph (made by an earlier "
            "Remat); plan again, or check it with remat check"
        )
    if plan.graph != fingerprint:
        raise InvalidInputError(
            f"--start-from {path}: the plan was made for another graph ({plan.graph}); "
            f"this model's is {fingerprint}"
        )
    names = {d.name for d in problem.costs.devices}
    if unknown := [d.name for d in plan.devices if d.name not in names]:
        raise InvalidInputError(
            f"--start-from {path}: the plan runs on {', '.join(unknown)}, not among "
            f"the devices {', '.join(sorted(names))}"
        )
    return plan


def _family_command(args: argparse.Namespace) -> int:
    observed = parse_observed(args.observed) if args.observed else ()
    ranged = shape_range([parse_input_range(text) for text in args.input], observed)
    options = _model_options(args, whole_shapes=False)
    model = options["model"]
    if not isinstance(model, onnx.ModelProto):  # loaded once, for every size
        model = load_model(model, external_data_dir=_model_dir(args))
    options["model"] = model
    check_ranged_dims_symbolic(ranged, declared_inputs(model))
    devices, table = _devices(args), None if args.costs is None else load_cost_table(args.costs)
    solver = _solver_settings(args)
    # Budgets in bytes, the same at every size: a percentage is of the largest size's peak.
    largest = build_problem(
        **_with_inputs(options, ranged.shapes(ranged.high)),
        devices=devices,
        budgets=_budgets(args),
        table=table,
        solver=solver,
    )
    names = [d.name for d in largest.costs.devices]
    if len(names) != 1:
        raise InvalidInputError(f"a plan family is for one device; got {', '.join(names)}")

    def problem_at(size: int) -> Problem:
        return build_problem(
            **_with_inputs(options, ranged.shapes(size)),
            devices=devices,
            budgets=largest.budgets,
            table=table,
            solver=solver,
        )

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    family = plan_family(problem_at, ranged, names[0], args.strategy, progress=progress)
    budget = largest.budgets.get(names[0])
    shown = "unlimited" if budget is None else format_bytes(budget)
    print(f"sizes {ranged.low}..{ranged.high} on {names[0]}, budget {shown}")
    for line in describe(family):
        print(f"  {line}")
    for size in args.size:
        started = time.monotonic()
        sized = family.plan_for(size)
        seconds = time.monotonic() - started
        peak = format_bytes(sized.simulation.peak_bytes[names[0]])
        print(
            f"size {size}: {sized.origin}, {sized.simulation.total_ms:.4g} ms, peak {peak} "
            f"(planned in {seconds * 1e3:.0f} ms)"
        )
    return 0


def _print_summary(problem: Problem, result: StrategyResult, searched_s: float) -> None:
    """The plan's summary; ``searched_s``: how long the strategy took (the exact
    strategies' solver seconds are the full model's solve, one part of their search)."""
    assert result.plan is not None and result.simulation is not None
    sim = result.simulation
    used = [d.name for d in result.plan.devices]
    ideal = problem.costs.ideal_ms(used[0] if len(used) == 1 else None)
    print(f"strategy:   {result.plan.strategy}")
    print(f"costs:      {problem.costs.source.value}")
    print(f"predicted:  {sim.total_ms:.3f} ms ({sim.total_ms / ideal - 1:+.1%} vs ideal)")
    measured = "measured" if any(problem.costs.energy_model().measured) else "power model"
    print(f"energy:     {sim.energy_mj:.3f} mJ ({measured})")
    if not problem.objective.time_only:
        print(f"objective:  {problem.objective.describe()}")
    for device in result.plan.devices:
        budget = "unlimited" if device.budget_bytes is None else format_bytes(device.budget_bytes)
        peak = sim.peak_bytes[device.name]
        print(f"{device.name + ':':<11} peak {format_bytes(peak)} ({peak} B), budget {budget}")
    nodes = len(problem.graph)
    print(f"steps:      {len(result.plan.steps)} ({sim.computes} computes of {nodes} nodes)")
    if sim.transfer_ms:
        ops = {step.op for step in result.plan.steps}
        lanes = (("host memory", {"offload", "prefetch"}), ("storage", PAGE_OPS | FIXED_OPS))
        tiers = [tier for tier, kinds in lanes if ops & kinds]
        print(
            f"transfers:  {sim.transfer_ms:.3f} ms to and from {' and '.join(tiers)}, beside "
            f"compute; compute waited {sim.stall_ms:.3f} ms for them"
        )
    solver = result.plan.solver
    if solver is not None:
        parts = [solver.status]
        if solver.bound is not None:
            parts.append(f"bound {solver.bound:.4f} {problem.objective.unit}")
        if solver.gap is not None:
            parts.append(f"gap {solver.gap:.2%}")
        if solver.seconds:
            parts.append(f"{solver.seconds:.1f} s in the solver")
        print(f"solver:     {', '.join(parts)}")
    print(f"search:     {searched_s:.1f} s in all")
    if result.message:
        print(f"note:       {result.message}")


def _check_command(args: argparse.Namespace) -> int:
    graph = _load_graph(args)
    plan = load_plan(args.plan)
    table = None if args.costs is None else load_cost_table(args.costs)
    result = _simulated(plan, graph, table)
    if not result.valid:
        print(f"invalid: {result.violation}")
        if _valid_unfused(args, graph, plan, table):
            print("it is valid for the graph with attention node by node: plans made before")
            print("attention was fused by default are checked with --no-fuse-attention")
        return 1
    peaks = ", ".join(f"{d} {format_bytes(v)}" for d, v in result.peak_bytes.items())
    print(f"valid: predicted {result.total_ms:.3f} ms; peak {peaks}")
    return 0


def _simulated(plan: Plan, graph: Graph, table: CostTable | None) -> Simulation:
    """``plan`` on ``graph``, costed by ``table`` (analytical where None) on its devices."""
    devices = [Device(d.name, d.kind, d.options) for d in plan.devices]
    return simulate(plan, graph, cost_model(graph, devices, table))


def _valid_unfused(
    args: argparse.Namespace, fused: Graph, plan: Plan, table: CostTable | None
) -> bool:
    """Whether ``plan``, invalid on ``fused`` (the graph with attention fused), is valid on
    the graph without: a plan made before fusing was the default."""
    if not args.fuse_attention or not any(n.op == ATTENTION for n in fused.nodes):
        return False
    options = _model_options(args)
    options["fuse_attention"] = False
    graph = model_graph(**options)
    try:
        return _simulated(plan, graph, table).valid
    except RematError:  # e.g. a cost table of the fused graph
        return False


def _demo_command(args: argparse.Namespace) -> int:
    from remat.demo import run_demo

    run_demo(args.model, args.batch, args.time_limit)
    return 0


def _max_batch_command(args: argparse.Namespace) -> int:
    build = problems_by_batch(
        _model(args),
        devices=_devices(args),
        budgets=_budgets(args),
        inputs=_inputs(args),
        solver=_solver_settings(args),
        external_data_dir=_model_dir(args),
        loss=loss_of(args),
        fuse_attention=args.fuse_attention,
    )
    bound = CostBound(None if args.max_overhead is None else args.max_overhead / 100.0)

    def progress(trial: Trial) -> None:
        print(describe_trial(trial), file=sys.stderr, flush=True)

    found = max_batch(build, args.strategy, bound, args.cap, on_trial=progress)
    best = found.best
    if best is not None and args.output is not None:
        assert best.result.plan is not None
        args.output.write_text(json.dumps(plan_to_json(best.result.plan), indent=1))
        print(f"wrote {args.output}", file=sys.stderr)
    if args.json:
        print(json.dumps(max_batch_to_json(found, bound)))
    elif best is not None:
        _print_max_batch(found, bound)
    if best is None:
        first = found.tries[0]
        print(f"remat: even batch 1 does not fit: {first.reason}", file=sys.stderr)
        return 1
    if found.interrupted:
        print(
            f"remat: interrupted: batch {found.batch} fits, larger ones were not settled",
            file=sys.stderr,
        )
        return 130
    return 0


def _print_max_batch(found: MaxBatch, bound: CostBound) -> None:
    best = found.best
    assert best is not None and best.result.plan is not None and best.result.simulation
    plan, sim = best.result.plan, best.result.simulation
    if found.capped:
        note = f"the largest tried (--max {found.cap}); larger batches may fit"
    elif found.interrupted:
        note = "at least: the search was interrupted"
    else:
        failure = found.first_failure
        note = "" if failure is None else f"batch {failure.batch}: {_short(failure)}"
    print(f"max batch:  {found.batch}" + (f" ({note})" if note else ""))
    print(f"strategy:   {plan.strategy}")
    print(f"bound:      {best.bound_ms:.3f} ms, {bound.describe()}")
    print(
        f"predicted:  {best.predicted_ms:.3f} ms ({best.overhead:+.1%} vs ideal "
        f"{best.ideal_ms:.3f} ms)"
    )
    for device in plan.devices:
        budget = "unlimited" if device.budget_bytes is None else format_bytes(device.budget_bytes)
        peak = sim.peak_bytes[device.name]
        print(f"{device.name + ':':<11} peak {format_bytes(peak)} ({peak} B), budget {budget}")
    print(f"tries:      {len(found.tries)} (batch {', '.join(str(t.batch) for t in found.tries)})")
    solver = plan.solver
    if solver is not None:
        print(f"solver:     {solver.status}, gap {solver.gap:.2%}, {solver.seconds:.1f} s")


def _short(trial: Trial) -> str:
    """Why a batch did not fit, in a few words."""
    text = describe_trial(trial)
    return " ".join(text.split(":", 1)[1].split())


if __name__ == "__main__":
    sys.exit(main())
