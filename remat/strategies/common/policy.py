"""From S policies to a StrategyResult: solve R, prune S, predict, then judge a few.

Compiling and simulating a plan of a graph with thousands of nodes takes about a second,
and the greedy baselines and Griewank try dozens of policies. So every candidate is first
*predicted*: cost and peak memory from the sparse schedule by Checkmate's accounting (eq.
2-5) under the compiler's free rule (``remat.compiler``), in one pass over its nonzeros.
Only the candidates that decide the result are compiled and judged by the simulator: the
cheapest predicted to fit (the next one if the simulator disagrees), else the one with the
smallest predicted peak (for the "needs at least" message).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from remat.simulator import held_fixed_bytes
from remat.strategies.common.problem import (
    Evaluation,
    Problem,
    StrategyResult,
    evaluate,
    select_best,
)
from remat.strategies.common.rsolve import Holds, Sparse, solve_and_prune_sparse, span_events

MAX_JUDGED = 4  # predicted-feasible candidates the simulator may reject before giving up


@dataclass(frozen=True)
class Prediction:
    cost_ms: float
    stage_peaks: tuple[int, ...]  # the most each stage holds at once, fixed memory included

    @property
    def peak_bytes(self) -> int:
        return max(self.stage_peaks, default=0)


@dataclass(frozen=True)
class Candidate:
    sparse: Sparse
    prediction: Prediction


def device_fixed_bytes(problem: Problem, device: str) -> int:
    """Fixed memory when every node runs on ``device`` (the simulator's own rule)."""
    return held_fixed_bytes(problem.graph, range(len(problem.graph)))


def predict(problem: Problem, device: str, sparse: Sparse, fixed: int) -> Prediction:
    """Cost and per-stage peak memory of the plan ``compile_plan`` makes from ``sparse``.

    Per stage: checkpoints nobody reads or keeps are freed first; each computed node is
    allocated (unless already resident), then each of its dependencies and itself is freed
    unless a later node of the stage reads it, it is kept for the next stage, or it is a
    model output."""
    graph = problem.graph
    d = problem.costs.device_index(device)
    size = [int(b) for b in problem.costs.output_bytes]
    time = problem.costs.compute_ms[:, d].tolist()
    deps = [node.deps for node in graph.nodes]
    outputs = set(graph.outputs)
    n = len(graph)
    starts, stops = span_events(sparse.holds)
    held_next = bytearray(n)  # S[t + 1] during the sweep
    for i in starts.get(0, ()):
        held_next[i] = 1
    resident = bytearray(n)
    memory = 0
    cost = 0.0
    peaks: list[int] = []
    for t, nodes in enumerate(sparse.computed):
        ending = stops.get(t + 1, ())
        for i in ending:
            held_next[i] = 0
        for i in starts.get(t + 1, ()):
            held_next[i] = 1
        computing = set(nodes)
        last_reader: dict[int, int] = {}
        for k in nodes:
            for i in deps[k]:
                last_reader[i] = k
        for i in ending:  # held in t, not in t+1: freed at once if nobody reads it
            if resident[i] and i not in last_reader and i not in outputs and i not in computing:
                resident[i] = 0
                memory -= size[i]
        peak = memory
        for k in nodes:
            if not resident[k]:
                resident[k] = 1
                memory += size[k]
                cost += time[k]
                peak = max(peak, memory)
            for i in (*deps[k], k):
                if (
                    resident[i]
                    and last_reader.get(i, -1) <= k
                    and not held_next[i]
                    and i not in outputs
                ):
                    resident[i] = 0
                    memory -= size[i]
        peaks.append(fixed + peak)
    return Prediction(cost, tuple(peaks) or (fixed,))


def candidates(problem: Problem, device: str, policies: Iterable[Holds]) -> list[Candidate]:
    """Solve and predict each distinct policy."""
    fixed = device_fixed_bytes(problem, device)
    result: list[Candidate] = []
    seen: set[str] = set()
    for holds in policies:
        sparse = solve_and_prune_sparse(problem.graph, holds)
        key = repr(sparse.holds)
        if key in seen:
            continue
        seen.add(key)
        result.append(Candidate(sparse, predict(problem, device, sparse, fixed)))
    return result


def choose(problem: Problem, device: str, strategy: str, pool: list[Candidate]) -> StrategyResult:
    """Judge the deciding candidates with the simulator; the result follows select_best."""
    budget = problem.budgets.get(device)
    fitting = sorted(
        (c for c in pool if budget is None or c.prediction.peak_bytes <= budget),
        key=lambda c: (c.prediction.cost_ms, c.prediction.peak_bytes),
    )
    judged: list[Evaluation] = []
    for candidate in fitting[:MAX_JUDGED]:
        judged.append(judge(problem, device, strategy, candidate))
        if judged[-1].fits:
            return select_best(strategy, judged)
    if pool:
        smallest = min(pool, key=lambda c: (c.prediction.peak_bytes, c.prediction.cost_ms))
        judged.append(judge(problem, device, strategy, smallest))
    return select_best(strategy, judged)


def judge(problem: Problem, device: str, strategy: str, candidate: Candidate) -> Evaluation:
    return evaluate(problem, candidate.sparse.schedule(device), strategy)


def run_policies(
    problem: Problem, device: str, strategy: str, policies: Iterable[Holds]
) -> StrategyResult:
    return choose(problem, device, strategy, candidates(problem, device, policies))
