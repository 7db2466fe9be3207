"""The largest batch size with a feasible plan under the memory budgets and a cost bound
(Checkmate section 6.4, eq. 10), on one device or several.

A *try* builds the problem at batch B (the caller's ``build``: training graph, cost model
and budgets in bytes for that batch), runs the strategy, and accepts B when the strategy
returns a plan the simulator accepts (``result.feasible``) whose predicted time is within
the cost bound at that batch. The bound is Checkmate's eq. (10) by default,

    total cost <= 2 * sum_{forward} C_i + sum_{loss, backward} C_i,

the ideal cost (every node once) plus one extra forward pass, with C_i the node's time on
its fastest device (``CostModel.ideal_ms()`` semantics); or, with ``max_overhead``, at most
that fraction above the ideal.

The search assumes feasibility is monotone in B (if B fits, every smaller batch fits): it
tries B = 1, doubles until a batch does not fit or the cap is reached, then bisects between
the last batch that fitted and the first that did not. Memory grows with B and the bound
scales with B, so this holds for the heuristics; an optimal strategy stopped by its time
limit may miss a plan at one batch that it finds at a larger one, and the answer is then
a lower bound.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from remat.costs import CostModel
from remat.devices import Device, Size, format_bytes, parse_size
from remat.errors import InvalidInputError
from remat.graph import Graph, Mode, NodeKind
from remat.loss import MEAN_SQUARE, Loss
from remat.onnx_ingest import load_model
from remat.problem import Budget, build_problem
from remat.strategies import AUTO, Problem, SolverSettings, StrategyResult, run_strategy
from remat.strategies.auto import auto

DEFAULT_CAP = 4096
# Predicted times and bounds are sums of the same floats in different orders: accept a
# plan within this relative tolerance of the bound (checkpoint-all at max_overhead=0).
_TOLERANCE = 1e-9


def problems_by_batch(
    model: onnx.ModelProto | str | Path,
    *,
    devices: Sequence[Device] | None = None,
    budgets: Mapping[str, Budget],
    inputs: Mapping[str, Sequence[int]] | None = None,
    solver: SolverSettings | None = None,
    external_data_dir: Path | None = None,
    loss: Loss = MEAN_SQUARE,
    fuse_attention: bool = True,
) -> Callable[[int], Problem]:
    """``build`` for ``max_batch``: the training problem of ``model`` at each batch size
    (``remat.problem.build_problem``, analytical costs on ``devices``, differentiating
    ``loss``, each attention chain one node where ``fuse_attention``). Budgets must be in
    bytes, for at least one device: a percentage of the checkpoint-all peak would move with
    the batch, and without a limit every batch fits. Budgets below the fixed memory are a
    batch that does not fit (the strategy says what it needs), not an error."""
    sizes: dict[str, Budget] = {}
    for name, budget in budgets.items():
        size = parse_size(budget) if isinstance(budget, str) else budget
        if isinstance(size, Size) and size.percent is not None:
            raise InvalidInputError(
                f"budget for {name!r}: max-batch needs a size in bytes (e.g. {name}=512MiB); "
                "a percentage of the checkpoint-all peak changes with the batch size"
            )
        sizes[name] = size
    if all(size is None for size in sizes.values()):
        raise InvalidInputError(
            "max-batch needs a budget for at least one device: "
            "without a memory limit every batch size fits"
        )
    if not isinstance(model, onnx.ModelProto):
        model = load_model(model, external_data_dir=external_data_dir)
    loaded = model

    def build(batch: int) -> Problem:
        return build_problem(
            loaded,
            batch=batch,
            inputs=inputs,
            mode=Mode.TRAINING,
            loss=loss,
            devices=devices,
            budgets=sizes,
            solver=solver,
            check_fixed=False,
            fuse_attention=fuse_attention,
        )

    return build


def one_extra_forward_ms(graph: Graph, costs: CostModel) -> float:
    """Checkmate eq. (10): ``2 * sum_fwd C_i + sum_bwd C_i`` (the loss counts once), C_i
    the node's time on its fastest device."""
    times = costs.compute_ms.min(axis=1).tolist()
    nodes = zip(graph.nodes, times, strict=True)
    forward = sum(t for node, t in nodes if node.kind is NodeKind.FORWARD)
    return costs.ideal_ms() + float(forward)


@dataclass(frozen=True)
class CostBound:
    """The most a plan may cost at a batch size: one extra forward pass (Checkmate eq. 10)
    when ``max_overhead`` is None, else the ideal times ``1 + max_overhead`` (0.1: at most
    10% above the ideal)."""

    max_overhead: float | None = None

    def __post_init__(self) -> None:
        if self.max_overhead is not None and not self.max_overhead >= 0:
            raise InvalidInputError(f"max overhead must be >= 0, got {self.max_overhead}")

    def limit_ms(self, graph: Graph, costs: CostModel) -> float:
        if self.max_overhead is None:
            return one_extra_forward_ms(graph, costs)
        return costs.ideal_ms() * (1.0 + self.max_overhead)

    def describe(self) -> str:
        if self.max_overhead is None:
            return "one extra forward pass (Checkmate eq. 10)"
        return f"at most {self.max_overhead:.1%} above the ideal"


@dataclass(frozen=True)
class Trial:
    """One batch size tried: the strategy's result and the verdict against the bound.

    ``predicted_ms`` is the time of the strategy's plan (None without one); ``reason`` says
    why the batch does not fit ("" when it does)."""

    batch: int
    fits: bool
    predicted_ms: float | None
    bound_ms: float
    ideal_ms: float
    reason: str
    result: StrategyResult = field(repr=False, compare=False)
    problem: Problem = field(repr=False, compare=False)

    @property
    def overhead(self) -> float | None:
        """Predicted time vs ideal, minus 1 (0.12: 12% slower than every node once)."""
        return None if self.predicted_ms is None else self.predicted_ms / self.ideal_ms - 1

    @property
    def needed_bytes(self) -> dict[str, int] | None:
        """When no plan fits the budgets: the least memory per device the strategy needs."""
        return self.result.min_budget_bytes


@dataclass(frozen=True)
class MaxBatch:
    """The search's answer. ``batch`` is None when even batch 1 does not fit; ``capped``:
    the cap itself fitted, so larger batches may fit too; ``interrupted``: the solve was
    cancelled (Ctrl-C) and the search stopped early, so ``batch`` is a lower bound."""

    batch: int | None
    best: Trial | None
    tries: tuple[Trial, ...]
    cap: int
    capped: bool = False
    interrupted: bool = False

    @property
    def first_failure(self) -> Trial | None:
        """The try that stopped the search: batch 1, or ``batch + 1``."""
        failed = [t for t in self.tries if not t.fits]
        if not failed:
            return None
        return min(failed, key=lambda t: t.batch)


def try_batch(
    problem: Problem, batch: int, strategy: str = AUTO, bound: CostBound | None = None
) -> Trial:
    """Run ``strategy`` on ``problem`` (built at ``batch``) and judge it against ``bound``."""
    bound = bound or CostBound()
    limit = bound.limit_ms(problem.graph, problem.costs)
    ideal = problem.costs.ideal_ms()
    if strategy == AUTO:  # the exact solve only where the cheap phases miss the bound
        result = auto(problem, good_enough_ms=limit * (1 + _TOLERANCE))
    else:
        result = run_strategy(strategy, problem)
    if not result.feasible or result.simulation is None:
        reason = result.message or "no plan fits the budgets"
        return Trial(batch, False, None, limit, ideal, reason, result, problem)
    predicted = result.simulation.total_ms
    if predicted > limit * (1 + _TOLERANCE):
        reason = f"predicted {predicted:.3f} ms is over the bound {limit:.3f} ms"
        return Trial(batch, False, predicted, limit, ideal, reason, result, problem)
    return Trial(batch, True, predicted, limit, ideal, "", result, problem)


def max_batch(
    build: Callable[[int], Problem],
    strategy: str = AUTO,
    bound: CostBound | None = None,
    cap: int = DEFAULT_CAP,
    on_trial: Callable[[Trial], None] | None = None,
) -> MaxBatch:
    """The largest batch B <= ``cap`` at which ``strategy`` finds a plan within the budgets
    and ``bound``: B = 1, then doubling, then bisection (feasibility assumed monotone in B;
    see the module docstring). ``build(B)`` returns the problem at batch B (budgets in
    bytes); ``on_trial`` sees each try as it finishes (progress). Raises
    ``InvalidInputError`` when the batch size does not change the graph (no symbolic batch
    dimension), as the search would then be meaningless."""
    if cap < 1:
        raise InvalidInputError(f"the largest batch to try must be >= 1, got {cap}")
    bound = bound or CostBound()
    tries: list[Trial] = []
    sizes: dict[int, tuple[int, int]] = {}

    def attempt(batch: int) -> Trial:
        problem = build(batch)
        graph = problem.graph
        sizes[batch] = (graph.activation_bytes, graph.input_bytes)
        if batch > 1 and sizes[batch] == sizes[1]:
            raise InvalidInputError(
                f"the graph at batch {batch} is the same as at batch 1: the model has no "
                "symbolic batch dimension to vary (or an input shape fixes it)"
            )
        trial = try_batch(problem, batch, strategy, bound)
        tries.append(trial)
        if on_trial is not None:
            on_trial(trial)
        return trial

    def answer(best: Trial | None, capped: bool = False, interrupted: bool = False) -> MaxBatch:
        batch = None if best is None else best.batch
        return MaxBatch(batch, best, tuple(tries), cap, capped, interrupted)

    first = attempt(1)
    if not first.fits:
        return answer(None)
    best, worst = first, None
    while worst is None and best.batch < cap:
        if best.problem.cancelled:
            return answer(best, interrupted=True)
        trial = attempt(min(2 * best.batch, cap))
        if trial.fits:
            best = trial
        else:
            worst = trial
    if worst is None:
        return answer(best, capped=True)
    while worst.batch - best.batch > 1:
        if best.problem.cancelled:
            return answer(best, interrupted=True)
        trial = attempt((best.batch + worst.batch) // 2)
        if trial.fits:
            best = trial
        else:
            worst = trial
    return answer(best, interrupted=worst.problem.cancelled)


def describe_trial(trial: Trial) -> str:
    """One progress line: batch, verdict, predicted time vs the bound."""
    strategy = trial.result.plan.strategy if trial.result.plan is not None else None
    if trial.fits:
        assert trial.predicted_ms is not None
        verdict = (
            f"fits      {trial.predicted_ms:.3f} ms <= bound {trial.bound_ms:.3f} ms "
            f"({trial.overhead:+.1%} vs ideal, {strategy})"
        )
    elif trial.predicted_ms is not None:
        verdict = (
            f"too slow  {trial.predicted_ms:.3f} ms > bound {trial.bound_ms:.3f} ms "
            f"({trial.overhead:+.1%} vs ideal, {strategy})"
        )
    elif trial.needed_bytes:
        needs = ", ".join(
            f"{format_bytes(v)} on {d} (budget {_budget(trial, d)})"
            for d, v in trial.needed_bytes.items()
        )
        verdict = f"too big   needs {needs}"
    else:
        verdict = f"no plan   {trial.reason}"
    return f"batch {trial.batch:>5}: {verdict}"


def _budget(trial: Trial, device: str) -> str:
    budget = trial.problem.budgets.get(device)
    return "unlimited" if budget is None else format_bytes(budget)


def max_batch_to_json(found: MaxBatch, bound: CostBound) -> dict[str, Any]:
    """The search's answer as a JSON object: the largest batch, its plan's prediction and
    peak per device, and every try."""
    best = found.best
    document: dict[str, Any] = {
        "max_batch": found.batch,
        "cap": found.cap,
        "capped": found.capped,
        "interrupted": found.interrupted,
        "bound": {
            "kind": "one_extra_forward" if bound.max_overhead is None else "max_overhead",
            "max_overhead": bound.max_overhead,
        },
        "strategy": None,
        "predicted_ms": None,
        "bound_ms": None,
        "ideal_ms": None,
        "overhead": None,
        "peak_bytes": None,
        "budget_bytes": None,
    }
    if best is not None and best.result.plan is not None and best.result.simulation is not None:
        plan = best.result.plan
        document |= {
            "strategy": plan.strategy,
            "predicted_ms": best.predicted_ms,
            "bound_ms": best.bound_ms,
            "ideal_ms": best.ideal_ms,
            "overhead": best.overhead,
            "peak_bytes": {d.name: best.result.simulation.peak_bytes[d.name] for d in plan.devices},
            "budget_bytes": {d.name: d.budget_bytes for d in plan.devices},
        }
    document["tries"] = [
        {
            "batch": t.batch,
            "fits": t.fits,
            "predicted_ms": t.predicted_ms,
            "bound_ms": t.bound_ms,
            "ideal_ms": t.ideal_ms,
            "needed_bytes": t.needed_bytes,
            "reason": t.reason,
        }
        for t in found.tries
    ]
    return document
