"""Which compute steps of a plan run their node in place, writing its output into its
input's storage, as eager PyTorch's in-place activations do (``nn.ReLU(inplace=True)``,
ReLU6): an operator with an in-place kernel (``kernels.IN_PLACE_KERNELS``) whose input is
the first output of a node whose kernel allocates it (``FRESH_OUTPUTS``: no other tensor
shares its storage), computed in the same memory space, where no later step reads that
input before the plan frees it there and no transfer of it may still be in flight.

The executor's account is unchanged: the output counts as its own bytes and the input
until its free, as the simulator predicts. A CPU device's measured peak is that account,
so its promise holds; a CUDA device's is the allocator's, which in-place steps would take
below the prediction, so the executor asks this only for CPU devices."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from agents.kernels import IN_PLACE_KERNELS
from agents.program import Source
from remat.graph import Graph, NodeKind
from remat.onnx_fusion import MATMUL_ADD
from remat.plan import Compute, Copy, Free, Offload, PageIn, PageOut, Plan, Prefetch, Step

# Operators whose kernels return their first output as a tensor of its own, a view of
# nothing and held by nothing else.
FRESH_OUTPUTS = frozenset({"Conv", "ConvTranspose", "BatchNormalization", "Add", MATMUL_ADD})


def in_place_steps(
    plan: Plan,
    graph: Graph,
    sources: Mapping[int, Sequence[Source]],
    space: Mapping[str, str],
    devices: Collection[str],
) -> frozenset[int]:
    """The indices of ``plan``'s compute steps on ``devices`` that may run in place
    (``space``: each device's memory space; ``sources``: each forward node's inputs). A
    concurrent plan's sections run on threads, so none of its steps does."""
    if plan.concurrent:
        return frozenset()
    steps = plan.steps
    # (memory space, node) -> whether its value there is the tensor a compute step made
    # there, with no transfer of it issued since
    made: dict[tuple[str, int], bool] = {}
    found: set[int] = set()
    for index, step in enumerate(steps):
        if isinstance(step, Compute):
            memory = space[step.device]
            if step.device in devices and graph.nodes[step.node].kind is NodeKind.FORWARD:
                source = _fresh_input(graph, sources, step.node)
                if (
                    source is not None
                    and made.get((memory, source))
                    and _dies_here(steps, index, memory, source, graph, space)
                ):
                    found.add(index)
            made[(memory, step.node)] = True
        elif isinstance(step, Copy):
            made[(space[step.dst], step.node)] = False
        elif isinstance(step, Offload | Prefetch | PageOut | PageIn):
            made[(space[step.device], step.node)] = False
    return frozenset(found)


def _fresh_input(graph: Graph, sources: Mapping[int, Sequence[Source]], node: int) -> int | None:
    """The node whose first output is ``node``'s input, where ``node`` has an in-place
    kernel and that node's kernel allocates the output; else None."""
    if graph.nodes[node].op not in IN_PLACE_KERNELS:
        return None
    inputs = sources[node]
    source = inputs[0] if inputs else None
    if source is None or source.node is None or source.output != 0:
        return None
    return source.node if graph.nodes[source.node].op in FRESH_OUTPUTS else None


def _dies_here(
    steps: Sequence[Step],
    index: int,
    memory: str,
    producer: int,
    graph: Graph,
    space: Mapping[str, str],
) -> bool:
    """Whether no step after ``index`` reads ``producer``'s value in ``memory`` before the
    plan frees it there (or computes it again)."""
    for step in steps[index + 1 :]:
        if isinstance(step, Copy):
            if step.node == producer and space[step.src] == memory:
                return False
            continue
        if not isinstance(step, Compute | Free | Offload | PageOut) or space[step.device] != memory:
            continue
        if isinstance(step, Free | Compute) and step.node == producer:
            return True
        if isinstance(step, Offload | PageOut) and step.node == producer:
            return False
        if isinstance(step, Compute) and producer in graph.nodes[step.node].deps:
            return False
    return False  # held to the end: a model output
