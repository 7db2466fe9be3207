"""A plan family: plans for an input whose size ranges over ``low..high`` (Mimose), one
device, one budget in bytes for every size.

- **Buckets.** The size estimator (``size_estimator``, fitted at the range's ends and
  middle) predicts checkpoint-all's peak at every size: the same steps at every size, each
  value's bytes from its polynomial. Sizes go into buckets whose predicted peak grows by at
  most ``BUCKET_GROWTH`` (10%, Mimose's grouping) from the bucket's first size, or more
  where that would make over ``max_buckets`` buckets. A bucket's *representative* is its
  largest size.
- **Representatives** are planned by the family's strategy (an exact one, or ``auto``),
  the time limit shared out by the observed sizes in each bucket (plus one each), so the
  work goes where the data is. A representative's plan holds for every size of its bucket
  where no value's bytes shrink as the size grows; the simulator checks it there.
- **Other sizes** (``plan_for``), on demand: the graph at the size (shape inference, exact
  bytes), ``input_aware``'s plan and the bucket representative's plan replayed at the size;
  the cheaper that the simulator accepts is cached by size. A size outside the range is
  refused, never planned over the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from remat.devices import format_bytes
from remat.errors import InvalidInputError
from remat.plan import Compute, Free, Plan
from remat.shape_range import ShapeRange
from remat.simulator import Simulation, simulate
from remat.size_estimator import SizeModel, fit_size_model
from remat.strategies import Problem, StrategyResult, run_strategy
from remat.strategies.baselines.checkpoint_all import checkpoint_all
from remat.strategies.common.policy import device_fixed_bytes
from remat.strategies.common.problem import with_prediction

BUCKET_GROWTH = 1.1
MAX_BUCKETS = 6
GRID = 257  # sizes at which the peak is predicted


@dataclass(frozen=True)
class Bucket:
    low: int
    high: int  # the representative
    predicted_peak_bytes: int  # checkpoint-all's at ``high``, by the estimator


@dataclass(frozen=True)
class SizedPlan:
    """A plan for one size; ``origin`` says where it came from."""

    size: int
    plan: Plan
    simulation: Simulation
    origin: str


@dataclass
class PlanFamily:
    """The buckets, their representatives' plans, and the plans of other sizes as they
    are asked for (``cache``, by size)."""

    ranged: ShapeRange
    device: str
    problem_at: Callable[[int], Problem] = field(repr=False)
    estimator: SizeModel = field(repr=False)
    buckets: list[Bucket]
    cache: dict[int, SizedPlan] = field(default_factory=dict)
    hits: int = 0

    def bucket_of(self, size: int) -> Bucket:
        self.ranged.shapes(size)  # a size outside the range is refused
        return next(b for b in self.buckets if b.low <= size <= b.high)

    def plan_for(self, size: int) -> SizedPlan:
        """The plan for ``size``: from the cache, else planned now (``plan_size``)."""
        bucket = self.bucket_of(size)
        if size in self.cache:
            self.hits += 1
            return self.cache[size]
        representative = self.cache.get(bucket.high)
        if representative is None:
            raise InvalidInputError(
                f"no plan fits the budget at size {bucket.high}, so none is given for sizes "
                f"{bucket.low}..{bucket.high}"
            )
        problem = self.problem_at(size)
        sized = plan_size(problem, size, self.device, representative.plan, bucket.high)
        self.cache[size] = sized
        return sized


def plan_size(
    problem: Problem, size: int, device: str, representative: Plan, planned_for: int
) -> SizedPlan:
    """The plan for ``problem`` (at ``size``): ``input_aware``'s or the bucket
    representative's plan (made for size ``planned_for``) replayed at the size, the
    cheaper that the simulator accepts; ``InvalidInputError`` where neither fits."""
    found: list[SizedPlan] = []
    replay = simulate(representative, problem.graph, problem.costs, problem.budgets)
    if replay.valid:  # its prediction is the replay's, at this size
        replayed = with_prediction(representative, replay)
        found.append(SizedPlan(size, replayed, replay, f"the plan for {planned_for}"))
    fast = run_strategy("input_aware", problem, device)
    if _fits(fast):
        assert fast.plan is not None and fast.simulation is not None
        found.append(SizedPlan(size, fast.plan, fast.simulation, "input_aware"))
    if not found:
        raise InvalidInputError(
            f"no plan fits the budget at size {size}: the plan for {planned_for} does "
            f"not ({replay.violation}) and input_aware found none ({fast.message})"
        )
    return min(found, key=lambda p: p.simulation.total_ms)


def plan_family(
    problem_at: Callable[[int], Problem],
    ranged: ShapeRange,
    device: str,
    strategy: str = "auto",
    max_buckets: int = MAX_BUCKETS,
    progress: Callable[[str], None] | None = None,
) -> PlanFamily:
    """The family of ``problem_at``'s problems over ``ranged`` on ``device``: buckets by
    predicted peak, each representative planned by ``strategy`` within its share of the
    problem's time limit (module docstring)."""
    problems = {s: problem_at(s) for s in fitted_sizes(ranged)}
    estimator = fit_size_model(problems)
    buckets = _buckets(problems[ranged.low], estimator, problems, ranged, device, max_buckets)
    family = PlanFamily(ranged, device, problem_at, estimator, buckets)
    shares = time_shares(buckets, ranged)
    for bucket, share in zip(buckets, shares, strict=True):
        problem = problems.get(bucket.high) or problem_at(bucket.high)
        options = problem.solver.options
        limit = replace(options, time_limit_s=max(options.time_limit_s * share, 1.0))
        problem = replace(problem, solver=replace(problem.solver, options=limit))
        if progress is not None:
            progress(f"sizes {bucket.low}..{bucket.high}: {strategy} at {bucket.high}")
        result = run_strategy(strategy, problem, device)
        if _fits(result):
            assert result.plan is not None and result.simulation is not None
            family.cache[bucket.high] = SizedPlan(
                bucket.high, result.plan, result.simulation, f"{strategy} at {bucket.high}"
            )
    return family


def fitted_sizes(ranged: ShapeRange) -> list[int]:
    """Where the size estimator is fitted (and a node's costs profiled): the range's ends
    and middle."""
    return sorted({ranged.low, (ranged.low + ranged.high) // 2, ranged.high})


def _fits(result: StrategyResult) -> bool:
    return result.feasible and result.plan is not None and result.simulation is not None


def _buckets(
    structure: Problem,
    estimator: SizeModel,
    problems: dict[int, Problem],
    ranged: ShapeRange,
    device: str,
    max_buckets: int,
) -> list[Bucket]:
    """Buckets by checkpoint-all's predicted peak (module docstring)."""
    grid = np.unique(np.linspace(ranged.low, ranged.high, GRID).round().astype(np.int64))
    peaks = _predicted_peaks(structure, estimator, problems, device, grid)
    first, last = float(peaks[0]), float(peaks[-1])
    growth = max(BUCKET_GROWTH, (last / first) ** (1 / max_buckets) if first > 0 else 1.0)
    buckets: list[Bucket] = []
    start = 0
    while start < len(grid):
        within = np.flatnonzero(peaks[start:] <= peaks[start] * growth)
        end = start + int(within.max(initial=0))
        buckets.append(Bucket(int(grid[start]), int(grid[end]), int(peaks[end])))
        start = end + 1
    return buckets


def _predicted_peaks(
    structure: Problem,
    estimator: SizeModel,
    problems: dict[int, Problem],
    device: str,
    grid: np.ndarray,
) -> np.ndarray:
    """Checkpoint-all's peak at each size of ``grid``: its steps (the same at every size)
    with each value's predicted bytes, plus the fixed memory's polynomial."""
    unlimited = replace(structure, budgets={})
    steps = checkpoint_all(unlimited, device).plan
    assert steps is not None
    nodes: list[int] = []
    signs: list[int] = []
    for step in steps.steps:
        if isinstance(step, Compute | Free):
            nodes.append(step.node)
            signs.append(1 if isinstance(step, Compute) else -1)
    sizes = np.stack([estimator.output_bytes(int(s)) for s in grid], axis=1)  # [n, grid]
    memory = np.cumsum(sizes[nodes] * np.asarray(signs)[:, None], axis=0)
    fitted = sorted(problems)
    fixed = [device_fixed_bytes(problems[s], device) for s in fitted]
    degree = min(2, len(fitted) - 1)
    fixed_at = np.polyval(np.polyfit(fitted, fixed, degree), grid)
    return memory.max(axis=0, initial=0) + np.maximum(fixed_at, 0)


def time_shares(buckets: list[Bucket], ranged: ShapeRange) -> list[float]:
    """Each bucket's share of the time limit: its observed count plus one, over all."""
    counts = [1 + sum(c for s, c in ranged.observed if b.low <= s <= b.high) for b in buckets]
    total = float(sum(counts))
    return [c / total for c in counts] if total else [1.0 / len(buckets)] * len(buckets)


def describe(family: PlanFamily) -> list[str]:
    """One line per bucket: its sizes, its representative's plan (or that none fits)."""
    lines = []
    for bucket in family.buckets:
        sized = family.cache.get(bucket.high)
        if sized is None:
            lines.append(f"sizes {bucket.low}..{bucket.high}: no plan fits at {bucket.high}")
            continue
        peak = format_bytes(sized.simulation.peak_bytes[family.device])
        lines.append(
            f"sizes {bucket.low}..{bucket.high}: {sized.origin}, "
            f"{sized.simulation.total_ms:.4g} ms, peak {peak}"
        )
    return lines
