"""The plan a node's agent profiles a graph under on one device, so that profiling never
needs more memory than the device may use (Mimose section 4.2: the collector runs under a
conservative checkpointing plan, so that collection itself does not run out of memory).

Where checkpoint-all (every node once, every value freed after its last use) fits the
limit, that is the plan: profiling times every node exactly once per pass, as a training
step without rematerialization runs it. Where it does not, the first of Mimose's greedy
scheduler (``input_aware``) and greedy eviction that fits the limit gives the plan, and
the profiler times every node at each of its evaluations. Both are heuristics planned in
milliseconds to seconds (greedy eviction: at most its
search's ``evict_time_s``) on analytical costs of that one device: their times only steer
which activations are recomputed; the bytes, from shape inference, are what the limit is
checked against, by the simulator.
"""

from __future__ import annotations

from remat.costs import analytical_costs
from remat.devices import Device, format_bytes
from remat.errors import InvalidInputError
from remat.graph import Graph
from remat.plan import Plan
from remat.strategies import Problem, run_strategy
from remat.strategies.common.floor import shortfall

# Tried in this order; the first whose plan fits the limit is profiled under.
PROFILING_STRATEGIES = ("checkpoint_all", "input_aware", "greedy_evict")


def profiling_plan(graph: Graph, device: Device, memory_bytes: int | None) -> Plan:
    """The plan to profile ``graph`` under on ``device`` holding at most ``memory_bytes``
    (None: no limit, checkpoint-all); ``InvalidInputError`` saying how much memory is
    needed where no plan fits."""
    problem = Problem(graph, analytical_costs(graph, [device]), {device.name: memory_bytes})
    needs = shortfall(problem, [device.name])
    if needs is not None:
        raise InvalidInputError(
            f"cannot profile on {device.name}: computing {needs.node} needs at least "
            f"{needs.needs[0].describe()}"
        )
    messages = []
    for strategy in PROFILING_STRATEGIES:
        result = run_strategy(strategy, problem, device.name)
        if result.plan is not None and result.simulation is not None and result.simulation.valid:
            return result.plan
        messages.append(f"{strategy}: {result.message}")
    assert memory_bytes is not None  # checkpoint-all fits when nothing limits it
    raise InvalidInputError(
        f"cannot profile on {device.name}: no plan found that holds at most "
        f"{format_bytes(memory_bytes)} ({'; '.join(messages)})"
    )
