"""Forward graph -> training graph (Checkmate section 4, XEngine section 3).

The training graph is the forward nodes, one loss node, and one backward node per forward
node on a path to the loss, in that order: forward nodes keep their indices, the loss comes
next, then backward nodes in reverse order of their forward node. Node index is the stage
of frontier-advancing schedules.

A backward node computes the gradient with respect to its forward node's inputs (and
accumulates weight gradients into fixed buffers). It depends on

* the upstream gradient(s): the backward nodes of the forward node's users on a path to the
  loss, and the loss itself when the forward node is a model output;
* the forward values the op's gradient really needs, by op type (``GRADIENT_NEEDS``):

| needs            | op types                                                             |
|------------------|----------------------------------------------------------------------|
| output           | Relu, Sigmoid, Tanh, Softmax, LogSoftmax, Exp, Sqrt, Dropout (mask)  |
| inputs           | Conv, ConvTranspose, Gemm, MatMul, BatchNormalization,               |
|                  | InstanceNormalization, LayerNormalization, LeakyRelu, Gelu, Elu,     |
|                  | Log, Abs, Pow, Gather, Erf, HardSigmoid                              |
| inputs + output  | MaxPool (argmax), LRN; any op not listed (conservative)              |
| neither          | Add, Sub, Sum, Concat, Split, Reshape, Flatten, Transpose, Identity, |
|                  | Pad, AveragePool, GlobalAveragePool, Squeeze, Unsqueeze, Cast,       |
|                  | ReduceMean, ReduceSum, Slice, Neg                                    |
| other operand    | Mul (each input's gradient needs the other: the activation inputs    |
|                  | are needed only when two of them are activations), Div (the divisor, |
|                  | and the dividend too, when the divisor is an activation)             |

"inputs" means activation inputs (values of other nodes); parameters are fixed memory and
always available. The backward node's output is the gradient for each activation input
(one value, sizes summed); gradients for parameters and model inputs go to fixed gradient
buffers (see ``remat.simulator``). Its FLOPs are the forward FLOPs times 2 for
Conv/ConvTranspose/Gemm/MatMul (input and weight gradients), times 1 otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from remat.errors import InvalidInputError
from remat.graph import Graph, Mode, Node, NodeKind


class Needs(Enum):
    NEITHER = "neither"
    INPUTS = "inputs"
    OUTPUT = "output"
    BOTH = "inputs+output"
    MUL = "other operand"
    DIV = "divisor (and dividend)"


def _ops(names: str, needs: Needs) -> dict[str, Needs]:
    return dict.fromkeys(names.split(), needs)


GRADIENT_NEEDS: dict[str, Needs] = {
    **_ops("Relu Sigmoid Tanh Softmax LogSoftmax Exp Sqrt Dropout", Needs.OUTPUT),
    **_ops(
        "Conv ConvTranspose Gemm MatMul BatchNormalization InstanceNormalization "
        "LayerNormalization LeakyRelu Gelu Elu Log Abs Pow Gather Erf HardSigmoid",
        Needs.INPUTS,
    ),
    **_ops("MaxPool LRN", Needs.BOTH),
    **_ops(
        "Add Sub Sum Concat Split Reshape Flatten Transpose Identity Pad AveragePool "
        "GlobalAveragePool Squeeze Unsqueeze Cast ReduceMean ReduceSum Slice Neg",
        Needs.NEITHER,
    ),
    "Mul": Needs.MUL,
    "Div": Needs.DIV,
}
_DOUBLE_BACKWARD = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


def gradient_needs(node: Node) -> tuple[tuple[int, ...], bool]:
    """(activation inputs the gradient reads, whether it reads the node's output)."""
    needs = GRADIENT_NEEDS.get(node.op, Needs.BOTH)
    deps = node.deps
    if needs is Needs.INPUTS:
        return deps, False
    if needs is Needs.OUTPUT:
        return (), True
    if needs is Needs.BOTH:
        return deps, True
    if needs is Needs.MUL:
        return (deps if len(deps) >= 2 else ()), False
    if needs is Needs.DIV:
        divisor_is_value = _input_is_value(node, 1)
        return (deps if divisor_is_value else ()), False
    return (), False


def _input_is_value(node: Node, position: int) -> bool:
    """Whether the ONNX input at ``position`` is an activation (not a fixed tensor)."""
    onnx_inputs = node.attrs.get("onnx_inputs")
    if not isinstance(onnx_inputs, list) or position >= len(onnx_inputs):
        return len(node.deps) > 1
    return onnx_inputs[position] not in node.fixed


def training_graph(forward: Graph) -> Graph:
    """The training graph of a forward graph (see the module docstring)."""
    if forward.mode is not Mode.INFERENCE:
        raise InvalidInputError("training_graph expects a forward graph")
    if not forward.outputs:
        raise InvalidInputError("the forward graph has no outputs to compute a loss from")
    on_path = _on_path_to_loss(forward)
    names = _Names(n.name for n in forward.nodes)
    nodes = list(forward.nodes)
    loss = len(nodes)
    nodes.append(
        Node(
            id=loss,
            name=names.unique("loss"),
            op="Loss",
            kind=NodeKind.LOSS,
            deps=tuple(sorted(forward.outputs)),
            output_bytes=sum(forward.nodes[o].output_bytes for o in forward.outputs),
            flops=float(sum(forward.nodes[o].output_bytes for o in forward.outputs)),
            input_bytes=sum(forward.nodes[o].output_bytes for o in forward.outputs),
        )
    )
    backward_of: dict[int, int] = {}
    users = forward.users()
    outputs = set(forward.outputs)
    for f in reversed(range(len(forward))):
        if not on_path[f]:
            continue
        node = forward.nodes[f]
        index = len(nodes)
        backward_of[f] = index
        upstream = [backward_of[u] for u in users[f] if u in backward_of]
        if f in outputs:
            upstream.append(loss)
        nodes.append(_backward_node(node, index, upstream, nodes, names))
    return Graph(Mode.TRAINING, tuple(nodes), dict(forward.fixed), ())


def _backward_node(
    node: Node, index: int, upstream: list[int], nodes: list[Node], names: _Names
) -> Node:
    values, needs_output = gradient_needs(node)
    deps = set(upstream) | set(values)
    if needs_output:
        deps.add(node.id)
    grad_in = sum(nodes[u].output_bytes for u in upstream)
    reads = sum(nodes[d].output_bytes for d in deps) - sum(nodes[u].output_bytes for u in upstream)
    output_bytes = sum(nodes[d].output_bytes for d in node.deps)
    fixed_bytes = node.input_bytes - sum(nodes[d].output_bytes for d in node.deps)
    factor = 2.0 if node.op in _DOUBLE_BACKWARD else 1.0
    return Node(
        id=index,
        name=names.unique(f"{node.name}:grad"),
        op=node.op,
        kind=NodeKind.BACKWARD,
        deps=tuple(sorted(deps)),
        output_bytes=output_bytes,
        flops=factor * node.flops,
        input_bytes=grad_in + reads + max(fixed_bytes, 0),
        fixed=node.fixed,
        forward=node.id,
    )


def _on_path_to_loss(forward: Graph) -> list[bool]:
    on_path = [False] * len(forward)
    for output in forward.outputs:
        on_path[output] = True
    for node in reversed(forward.nodes):
        if on_path[node.id]:
            for dep in node.deps:
                on_path[dep] = True
    return on_path


class _Names:
    """Stable unique names: a derived name that collides gets a numeric suffix."""

    def __init__(self, taken: Iterable[str]) -> None:
        self.taken = set(taken)

    def unique(self, name: str) -> str:
        candidate, suffix = name, 1
        while candidate in self.taken:
            candidate = f"{name}_{suffix}"
            suffix += 1
        self.taken.add(candidate)
        return candidate


def for_mode(forward: Graph, mode: Mode) -> Graph:
    """The graph to schedule: the forward graph itself in inference, else its training
    graph."""
    return forward if mode is Mode.INFERENCE else training_graph(forward)
