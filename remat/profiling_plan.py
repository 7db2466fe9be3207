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

Where no plan of the whole graph fits (a device that holds part of a model's parameters,
in a job that splits the model over several devices), there is none, and the profiler
times the nodes one at a time, each with only its own fixed tensors, inputs and output on
the device: that needs the most any one node needs (``shortfall`` with ``alone``).
"""

from __future__ import annotations

from remat.costs import analytical_costs
from remat.devices import Device
from remat.errors import InvalidInputError
from remat.graph import Graph
from remat.plan import Plan
from remat.strategies import Problem, run_strategy
from remat.strategies.common.floor import shortfall

# Tried in this order; the first whose plan fits the limit is profiled under.
PROFILING_STRATEGIES = ("checkpoint_all", "input_aware", "greedy_evict")


def profiling_plan(graph: Graph, device: Device, memory_bytes: int | None) -> Plan | None:
    """The plan to profile ``graph`` under on ``device`` holding at most ``memory_bytes``
    (None: no limit, checkpoint-all); None where no plan of the whole graph fits but every
    node fits alone (profile node by node); ``InvalidInputError`` saying how much memory
    is needed where some node does not."""
    problem = Problem(graph, analytical_costs(graph, [device]), {device.name: memory_bytes})
    if shortfall(problem, [device.name]) is None:
        for strategy in PROFILING_STRATEGIES:
            result = run_strategy(strategy, problem, device.name)
            if result.plan is not None and result.simulation and result.simulation.valid:
                return result.plan
    needs = shortfall(problem, [device.name], alone=True)
    if needs is not None:
        raise InvalidInputError(
            f"cannot profile on {device.name}: computing {needs.node} alone needs at least "
            f"{needs.needs[0].describe()}"
        )
    return None
