"""Forward graph -> training graph (Checkmate section 4, XEngine section 3).

The training graph is the forward nodes, one loss node (``remat.loss``: what it reads and
computes), and one backward node per forward node on a path to the loss that some gradient
reaches (not a comparison whose boolean output carries none, nor the computation of a
fused attention's mask from the data alone, ``DATA_MASK``), in that order:
forward nodes keep their indices, the loss comes next, then backward nodes in reverse order
of their forward node. Node index is the stage
of frontier-advancing schedules.

A backward node computes the gradient with respect to its forward node's inputs (and
accumulates weight gradients into fixed buffers). It depends on

* the upstream gradient(s): the backward nodes of the forward node's users on a path to the
  loss, and the loss itself when the loss reads the forward node;
* the forward values the op's gradient really needs, by op type (``GRADIENT_NEEDS``):

| needs            | op types                                                             |
|------------------|----------------------------------------------------------------------|
| output           | Relu, Sigmoid, Tanh, Softmax, LogSoftmax, Exp, Sqrt, MaxPool (its    |
|                  | argmax, kept with its output: below)                                 |
| inputs           | Conv, ConvTranspose, Gemm, MatMul, MatMulAdd, BatchNormalization,    |
|                  | InstanceNormalization, LayerNormalization, FusedLayerNorm,           |
|                  | FusedRMSNorm, LeakyRelu, Gelu, FusedGelu, FusedSilu, Elu, Log, Abs,  |
|                  | Pow, Erf,                                                            |
|                  | HardSigmoid, Clip, HardSwish, RNN, GRU, LSTM,                        |
| inputs + output  | ScaledDotProductAttention (its output and log-sum-exp, or its        |
|                  | weights, kept with its output: below), LRN; any op not listed        |
|                  | (conservative)                                                       |
| neither          | Add, Sub, Sum, Concat, Split, Reshape, Flatten, Transpose, Identity, |
|                  | Pad, AveragePool, GlobalAveragePool, Squeeze, Unsqueeze, Cast,       |
|                  | ReduceMean, ReduceSum, Slice, Neg, Expand, FusedUnbind, FusedLayout, |
|                  | and every operator without a gradient (Equal, IsNaN, ...)            |
| other operand    | Mul (each input's gradient needs the other: the activation inputs    |
|                  | are read when another operand is an activation or a trained fixed    |
|                  | tensor), Div (dividend and divisor, when the divisor is an           |
|                  | activation or trained; nothing when it is a constant)                |
| some inputs      | Where (the condition), Gather and GatherElements (the indices),      |
|                  | Resize (roi, scales, sizes), Dropout (ratio, training mode; and its  |
|                  | output)                                                              |

A MaxPool's gradient routes each output element's gradient to the input element it took
(its argmax). In a training graph a MaxPool keeps those indices with its output, as
PyTorch's autograd saves them: int64, one per output element, counted in its
``output_bytes`` (``kept_bytes``) unless the model already asks for them as its
``Indices`` output. Its backward node then reads its output alone, not its input, and
finds the argmax without running the pooling again.

A fused attention's backward is PyTorch's fused kernel's where its mask wants no gradient
(``ops.pytorch_attention_backward``): it reads the forward's output and the log-sum-exp
the forward kernel saved beside it, and recomputes the weights block by block, as eager
PyTorch differentiates ``scaled_dot_product_attention``. Elsewhere (a trained mask, such
as a relative position bias; operands of three dimensions) it is the closed form, and the
training graph's forward node computes the weights ``P = softmax(A @ B * scale + M)`` and
keeps them with its output, as autograd saves a softmax's output for a model that writes
attention as operators: a score matrix counted in its ``output_bytes`` (``kept_bytes``),
which its backward node reads instead of computing the scores again.

Clip and HardSwish need their input (Clip: and its bounds); Expand, like Reshape, only the
input's shape. Operators with no gradient at all (comparisons such as Equal, logical
operators, IsNaN, Shape, ArgMax, rounding) need neither: their backward node passes zeros
(and a node that only such operators read gets none).
"Some inputs" names ONNX input positions among the inputs present (``SOME_INPUTS``): the
backward node reads the activations at those positions only, the others are shapes to it.

"inputs" means activation inputs (values of other nodes); parameters are fixed memory and
always available. The backward node's output is one value: a gradient for each output of
its activation inputs that the forward node reads and that carries one (a float), sizes
summed (``gradient_slots``: none for another part of a Split, a Dropout's mask or an
index); gradients for parameters go to fixed gradient buffers, and the
model inputs, data, get none (see ``remat.simulator``). Its FLOPs are the forward FLOPs
times 2 for Conv/ConvTranspose/Gemm/MatMul/MatMulAdd (input and weight gradients; times 1
where the input is data: the weight's gradient alone), times 2.5 for
ScaledDotProductAttention by PyTorch's kernel (the scores again, then four products where
the forward pass has two), times 2 by the closed form from the weights kept, times 1
otherwise. A fused attention's backward node holds scratch memory while it runs: two score
matrices in the closed form, the keys by PyTorch's fused kernel; a forward node that keeps
its weights holds the scores while it runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from enum import Enum

from remat import ops
from remat.errors import InvalidInputError
from remat.graph import FixedKind, FixedTensor, Graph, Mode, Node, NodeKind
from remat.loss import MEAN_SQUARE, Loss, LossKind, labels_name
from remat.onnx_fusion import (
    ATTENTION,
    GELU,
    LAYER_NORM,
    LAYOUT,
    MATMUL_ADD,
    RMS_NORM,
    ROTARY,
    SILU,
    UNBIND,
)


class Needs(Enum):
    NEITHER = "neither"
    INPUTS = "inputs"
    OUTPUT = "output"
    BOTH = "inputs+output"
    MUL = "other operand"
    DIV = "divisor (and dividend)"
    SOME = "some inputs"  # the positions in SOME_INPUTS (and the output, if it says so)


def _ops(names: str, needs: Needs) -> dict[str, Needs]:
    return dict.fromkeys(names.split(), needs)


# Operators whose outputs carry no gradient (booleans, indices, shapes, rounding, random
# draws).
NO_GRADIENT_OPS = frozenset(
    _ops(
        "Equal Less LessOrEqual Greater GreaterOrEqual And Or Xor Not IsNaN IsInf Shape Size "
        "ArgMax ArgMin ConstantOfShape Floor Ceil Round Sign RandomUniformLike RandomNormalLike",
        Needs.NEITHER,
    )
)
# ONNX input positions that never receive a gradient: running statistics, shapes, indices,
# clip bounds. A constant read only at such positions is not trained (``remat.onnx_ingest``).
NON_DIFFERENTIABLE: dict[str, frozenset[int]] = {
    "BatchNormalization": frozenset({3, 4}),
    "Clip": frozenset({1, 2}),
    "Pad": frozenset({1, 2, 3}),
    "Pow": frozenset({1}),
    "Reshape": frozenset({1}),
    "Expand": frozenset({1}),
    "Tile": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}),
    "Squeeze": frozenset({1}),
    "Unsqueeze": frozenset({1}),
    "Split": frozenset({1}),
    "Gather": frozenset({1}),
    "GatherElements": frozenset({1}),
    "Where": frozenset({0}),
    "Resize": frozenset({1, 2, 3}),
    "RNN": frozenset({4}),
    "GRU": frozenset({4}),
    "LSTM": frozenset({4}),
    "Upsample": frozenset({1}),
    "ConstantOfShape": frozenset({0}),
    "Dropout": frozenset({1, 2}),
    "ReduceMean": frozenset({1}),
    "ReduceSum": frozenset({1}),
    "ReduceMax": frozenset({1}),
    "ReduceMin": frozenset({1}),
    "ReduceProd": frozenset({1}),
    "ReduceSumSquare": frozenset({1}),
    "ReduceL2": frozenset({1}),
}


def differentiable_input(op_type: str, position: int) -> bool:
    """Whether ONNX input ``position`` of an ``op_type`` node can receive a gradient."""
    if op_type in NO_GRADIENT_OPS:
        return False
    return position not in NON_DIFFERENTIABLE.get(op_type, frozenset())


# Needs.SOME: (ONNX input positions among the inputs present, whether the output too).
SOME_INPUTS: dict[str, tuple[frozenset[int], bool]] = {
    "Where": (frozenset({0}), False),  # the condition routes the gradient
    "Gather": (frozenset({1}), False),  # the indices add it back
    "GatherElements": (frozenset({1}), False),  # the indices scatter it back
    "Resize": (frozenset({1, 2, 3}), False),  # roi, scales, sizes: linear in the data
    "Upsample": (frozenset({1}), False),  # scales
    "Dropout": (frozenset({1, 2}), True),  # ratio, training mode, and the mask
    "Clip": (frozenset({1, 2}), True),  # the bounds, and the output (PyTorch's hardtanh's)
}
GRADIENT_NEEDS: dict[str, Needs] = {
    **_ops("Relu Sigmoid Tanh Softmax LogSoftmax Exp Sqrt MaxPool", Needs.OUTPUT),
    **_ops(
        f"Conv ConvTranspose Gemm MatMul {MATMUL_ADD} BatchNormalization "
        f"InstanceNormalization LayerNormalization {LAYER_NORM} {RMS_NORM} LeakyRelu Gelu "
        f"{GELU} {SILU} Elu Log Abs Pow Erf "
        "HardSigmoid HardSwish RNN GRU LSTM",
        Needs.INPUTS,
    ),
    **_ops(f"{ATTENTION} LRN", Needs.BOTH),
    **_ops(
        "Add Sub Sum Concat Split Reshape Flatten Transpose Identity Pad AveragePool "
        "GlobalAveragePool Squeeze Unsqueeze Cast ReduceMean ReduceSum Slice Neg Expand "
        f"{UNBIND} {LAYOUT}",
        Needs.NEITHER,
    ),
    **dict.fromkeys(NO_GRADIENT_OPS, Needs.NEITHER),
    **dict.fromkeys(SOME_INPUTS, Needs.SOME),
    "Mul": Needs.MUL,
    ROTARY: Needs.MUL,  # x cos + rotate_half(x) sin: products, as Mul's
    "Div": Needs.DIV,
}
_DOUBLE_BACKWARD = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", MATMUL_ADD})
_ATTENTION_BACKWARD = 2.5  # the scores recomputed, then dV, dP, dA and dB
_ATTENTION_BACKWARD_KEPT = 2.0  # dV, dP, dA and dB from the weights kept
_INDEX_BYTES = 8  # int64, as ONNX's and PyTorch's pooling indices


def kept_bytes(node: Node) -> int:
    """The bytes a training graph's forward node keeps beside its outputs for its backward
    node alone (a MaxPool's argmax, a fused attention's weights: the module docstring; 0
    for every other node): part of its ``output_bytes``, not of the gradient a user of it
    sends back (``gradient_bytes``)."""
    kept = node.attrs.get("kept_bytes", 0)
    assert isinstance(kept, int)
    return kept


def gradient_bytes(node: Node) -> int:
    """The bytes of the gradient with respect to a forward node's outputs."""
    return node.output_bytes - kept_bytes(node)


def gradient_slots(node: Node, nodes: Sequence[Node]) -> list[tuple[int, int, int]]:
    """The gradients a backward node of forward ``node`` makes, one for each output of its
    dependencies that ``node`` reads and that carries a gradient (a float: ingestion's
    ``output_gradient_bytes``), as (dependency, output index, bytes) in dependency then
    output order: not for an output it does not read (another part of a Split), nor for a
    mask or an index, nor for a fused attention's mask computed from data alone
    (``DATA_MASK``). A graph that does not name its tensors (built by hand) has one
    gradient per dependency, of all its outputs."""
    read = node.attrs.get("onnx_inputs")
    if isinstance(read, list) and node.attrs.get(DATA_MASK):  # the mask gets none
        read = read[:3]
    slots: list[tuple[int, int, int]] = []
    for dep in node.deps:
        names = nodes[dep].attrs.get("onnx_outputs")
        sizes = nodes[dep].attrs.get("output_gradient_bytes")
        if not (isinstance(read, list) and isinstance(names, list) and isinstance(sizes, list)):
            slots.append((dep, 0, gradient_bytes(nodes[dep])))
            continue
        slots += [
            (dep, k, size)
            for k, (name, size) in enumerate(zip(names, sizes, strict=True))
            if isinstance(size, int) and size and name in read
        ]
    return slots


def gradient_needs(
    node: Node,
    producer: Mapping[str, int] | None = None,
    fixed: Mapping[str, FixedTensor] | None = None,
) -> tuple[tuple[int, ...], bool]:
    """(activation inputs the gradient reads, whether it reads the node's output).
    ``producer`` maps tensor names to the forward nodes writing them: without it (or
    without the node's ``onnx_inputs``) a ``Needs.SOME`` operator reads all its inputs.
    ``fixed`` tells trained fixed tensors from constants (``FixedTensor.has_gradient``):
    without it every fixed operand of a Mul or Div is taken as trained."""
    needs = GRADIENT_NEEDS.get(node.op, Needs.BOTH)
    deps = node.deps
    if needs is Needs.SOME:
        positions, output = SOME_INPUTS[node.op]
        return _deps_at(node, positions, producer), output
    if needs is Needs.INPUTS:
        return deps, False
    if needs is Needs.OUTPUT:
        return (), True
    if needs is Needs.BOTH:
        return deps, True
    if needs is Needs.MUL:
        # d(a*b)/db = a: an activation operand is read when another operand is trained.
        trained_operand = len(deps) >= 2 or any(_trained(t, fixed) for t in node.fixed)
        return (deps if trained_operand else ()), False
    if needs is Needs.DIV:
        # d(a/b)/da = 1/b, d(a/b)/db = -a/b^2: both when the divisor is an activation, the
        # dividend when the divisor is trained.
        divisor = _input_at(node, 1)
        if divisor is None or divisor not in node.fixed or _trained(divisor, fixed):
            return deps, False
        return (), False
    return (), False


def _trained(name: str, fixed: Mapping[str, FixedTensor] | None) -> bool:
    return fixed is None or name not in fixed or fixed[name].has_gradient


def _input_at(node: Node, position: int) -> str | None:
    """The name of the node's ONNX input at ``position`` (None when unknown)."""
    onnx_inputs = node.attrs.get("onnx_inputs")
    if not isinstance(onnx_inputs, list) or position >= len(onnx_inputs):
        return None
    return str(onnx_inputs[position])


def _deps_at(
    node: Node, positions: frozenset[int], producer: Mapping[str, int] | None
) -> tuple[int, ...]:
    """The dependencies writing the node's inputs at ``positions`` (all of them when the
    inputs cannot be told apart)."""
    onnx_inputs = node.attrs.get("onnx_inputs")
    if producer is None or not isinstance(onnx_inputs, list):
        return node.deps
    found = {
        producer[name]
        for position, name in enumerate(onnx_inputs)
        if position in positions and name in producer and name not in node.fixed
    }
    return tuple(d for d in node.deps if d in found)


def training_graph(forward: Graph, loss: Loss = MEAN_SQUARE) -> Graph:
    """The training graph of a forward graph (see the module docstring) for ``loss``."""
    if forward.mode is not Mode.INFERENCE:
        raise InvalidInputError("training_graph expects a forward graph")
    if not forward.outputs:
        raise InvalidInputError("the forward graph has no outputs to compute a loss from")
    fixed = dict(forward.fixed)
    reads, attrs = _loss_reads(forward, loss, fixed)
    on_path = _on_path_to_loss(forward, reads)
    names = _Names(n.name for n in forward.nodes)
    producer: dict[str, int] = {}
    for n in forward.nodes:
        written = n.attrs.get("onnx_outputs")
        if isinstance(written, list):
            producer.update((str(name), n.id) for name in written)
    marked = _marking_data_masks(list(forward.nodes), _data_only(forward), producer)
    nodes = [_kept(n, marked, fixed) if on_path[n.id] else n for n in marked]
    loss_id = len(nodes)
    read_bytes = sum(gradient_bytes(nodes[o]) for o in reads)
    labels = tuple(t for t in fixed if t not in forward.fixed)
    nodes.append(
        Node(
            id=loss_id,
            name=names.unique("loss"),
            op="Loss",
            kind=NodeKind.LOSS,
            deps=reads,
            output_bytes=read_bytes,
            flops=float(read_bytes),
            input_bytes=read_bytes + sum(fixed[t].nbytes for t in labels),
            fixed=labels,
            attrs=attrs,
        )
    )
    backward_of: dict[int, int] = {}
    users = forward.users()
    sends: dict[int, set[int]] = {}  # by forward node: the nodes its backward node sends to
    for f in reversed(range(len(forward))):
        if not on_path[f]:
            continue
        node = nodes[f]
        upstream = [backward_of[u] for u in users[f] if u in backward_of and f in sends[u]]
        if f in reads:
            upstream.append(loss_id)
        elif not upstream:  # no gradient reaches it (an attention's mask computed from data)
            continue
        index = len(nodes)
        backward_of[f] = index
        slots = gradient_slots(node, nodes)
        sends[f] = {dep for dep, _, _ in slots}
        gradients = sum(size for _, _, size in slots)
        nodes.append(
            _backward_node(node, index, upstream, gradients, nodes, names, producer, fixed)
        )
    return Graph(Mode.TRAINING, tuple(nodes), fixed, ())


def _loss_reads(
    forward: Graph, loss: Loss, fixed: dict[str, FixedTensor]
) -> tuple[tuple[int, ...], dict[str, object]]:
    """The forward nodes the loss node reads and its attributes; a cross-entropy's labels
    are added to ``fixed``."""
    attrs: dict[str, object] = {"loss": loss.kind.value}
    if loss.kind is LossKind.MEAN_SQUARE:
        return tuple(sorted(forward.outputs)), attrs
    written = {
        str(name): node.id for node in forward.nodes for name in _listed(node, "model_outputs")
    }
    output = loss.output
    if output is None:
        if len(written) != 1:
            raise InvalidInputError(
                f"the {loss.kind.value} loss must name the output it reads: the model has "
                f"{len(written)} outputs ({_quoted(written)})"
            )
        output = next(iter(written))
    if output not in written:
        raise InvalidInputError(
            f"the {loss.kind.value} loss reads output {output!r}, which the model does not "
            f"have; its outputs: {_quoted(written)}"
        )
    node = forward.nodes[written[output]]
    shape = _listed(node, "output_shapes")[_listed(node, "onnx_outputs").index(output)]
    assert isinstance(shape, (list, tuple))
    dims = [int(d) for d in shape]
    attrs |= {"loss_output": output}
    if loss.kind is LossKind.OUTPUT:
        if math.prod(dims) != 1:
            raise InvalidInputError(
                f"the output loss reads {output!r}, which is not a scalar: shape {tuple(dims)}"
            )
        return (node.id,), attrs
    if not -len(dims) <= loss.axis < len(dims):
        raise InvalidInputError(
            f"the cross_entropy loss's class axis {loss.axis} is out of range for output "
            f"{output!r} of shape {tuple(dims)}"
        )
    axis = loss.axis % len(dims)
    labels = labels_name(output)
    fixed[labels] = FixedTensor(labels, FixedKind.CONSTANT, 8 * math.prod(dims) // dims[axis])
    return (node.id,), attrs | {"loss_axis": axis, "loss_labels": labels}


def _listed(node: Node, key: str) -> list[object]:
    value = node.attrs.get(key, [])
    return value if isinstance(value, list) else []


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names) or "none"


def _backward_node(
    node: Node,
    index: int,
    upstream: list[int],
    output_bytes: int,
    nodes: list[Node],
    names: _Names,
    producer: Mapping[str, int],
    fixed: Mapping[str, FixedTensor],
) -> Node:
    """Forward ``node``'s backward node, at ``index``, reading the gradients of
    ``upstream`` and making ``output_bytes`` of gradients (``gradient_slots``)."""
    values, needs_output = gradient_needs(node, producer, fixed)
    # the input's and the weight's gradients; only the weight's where the input is data
    factor = 2.0 if node.op in _DOUBLE_BACKWARD and node.deps else 1.0
    scratch = 0
    if node.op == ATTENTION:
        # PyTorch's kernel reads the output (and the log-sum-exp saved with it), the closed
        # form the weights kept with it
        factor = _ATTENTION_BACKWARD_KEPT if kept_bytes(node) else _ATTENTION_BACKWARD
        scratch, needs_output = _attention_backward(node, nodes, fixed)
    deps = set(upstream) | set(values)
    if needs_output:
        deps.add(node.id)
    grad_in = sum(nodes[u].output_bytes for u in upstream)
    reads = sum(nodes[d].output_bytes for d in deps) - sum(nodes[u].output_bytes for u in upstream)
    fixed_bytes = node.input_bytes - output_bytes  # what it reads beside its dependencies
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
        scratch_bytes=scratch,
    )


def _attention_backward(
    node: Node, nodes: Sequence[Node], fixed: Mapping[str, FixedTensor]
) -> tuple[int, bool]:
    """A fused attention's backward's scratch bytes and whether it reads the forward's
    output, by the kernel the executor runs it with (``ops.pytorch_attention_backward``:
    PyTorch's reads the output and its log-sum-exp; the closed form, the weights the
    forward node keeps, ``_keeping_weights``); a graph without shapes (built by hand): the
    closed form with the weights recomputed, two score matrices of ``scratch_bytes``
    each."""
    shapes = _attention_shapes(node)
    if shapes is None:
        return 2 * node.scratch_bytes, False
    ins, outs = shapes
    pytorch = ops.pytorch_attention_backward(ins, _mask_trained(node, nodes, fixed))
    elements = ops.attention_backward_scratch_elements(ins, outs, pytorch)
    return elements * _element_bytes(node, outs), True


def _attention_shapes(node: Node) -> tuple[list[ops.Shape], list[ops.Shape]] | None:
    """A fused attention's input and output shapes (None in a graph built by hand)."""
    inputs, outputs = node.attrs.get("input_shapes"), node.attrs.get("output_shapes")
    if not (isinstance(inputs, list) and isinstance(outputs, list) and outputs):
        return None
    return [tuple(s) for s in inputs], [tuple(s) for s in outputs]


def _element_bytes(node: Node, outs: Sequence[ops.Shape]) -> int:
    """The bytes of one element of ``node``'s first output (``outs``: its shapes)."""
    return gradient_bytes(node) // max(math.prod(outs[0]), 1)


def _mask_trained(node: Node, nodes: Sequence[Node], fixed: Mapping[str, FixedTensor]) -> bool:
    """Whether a fused attention's mask (its fourth input) carries a gradient: a trained
    fixed tensor, or an output of another node that its backward node sends one to."""
    read = node.attrs.get("onnx_inputs")
    if not isinstance(read, list) or len(read) < 4:
        return False
    mask = read[3]
    if mask in fixed:
        return fixed[mask].has_gradient
    for dep, k, _ in gradient_slots(node, nodes):
        names = nodes[dep].attrs.get("onnx_outputs")
        if isinstance(names, list) and names[k] == mask:
            return True
    return False


def _kept(node: Node, nodes: Sequence[Node], fixed: Mapping[str, FixedTensor]) -> Node:
    """``node`` keeping beside its outputs what its backward node reads of its kernel's
    (the module docstring)."""
    return _keeping_weights(_keeping_argmax(node), nodes, fixed)


def _keeping_argmax(node: Node) -> Node:
    """A MaxPool that keeps its argmax for its backward node (the module docstring), where
    its ``Indices`` output is not already there."""
    outputs = node.attrs.get("onnx_outputs")
    if node.op != "MaxPool" or not isinstance(outputs, list) or len(outputs) != 1:
        return node
    shapes = node.attrs["output_shapes"]
    assert isinstance(shapes, list)
    return _keeping(node, "keeps_argmax", _INDEX_BYTES * math.prod(int(d) for d in shapes[0]))


def _keeping_weights(node: Node, nodes: Sequence[Node], fixed: Mapping[str, FixedTensor]) -> Node:
    """A fused attention whose backward is the closed form (``ops.pytorch_attention_
    backward``: its mask is trained, or its operands have three dimensions) keeps its
    weights ``P = softmax(A @ B * scale + M)`` for its backward node, as autograd saves a
    softmax's output (the module docstring); while it runs, it holds the scores before the
    softmax (``ops.closed_form_attention_scratch_elements``)."""
    shapes = _attention_shapes(node)
    if node.op != ATTENTION or shapes is None:
        return node
    ins, outs = shapes
    if ops.pytorch_attention_backward(ins, _mask_trained(node, nodes, fixed)):
        return node
    element_bytes = _element_bytes(node, outs)
    weights = ops.attention_weights_elements(ins, outs) * element_bytes
    scratch = ops.closed_form_attention_scratch_elements(ins, outs) * element_bytes
    return replace(_keeping(node, "keeps_weights", weights), scratch_bytes=scratch)


def _keeping(node: Node, flag: str, nbytes: int) -> Node:
    """``node`` keeping ``nbytes`` beside its outputs for its backward node (``flag``:
    what, for the executor's program)."""
    attrs = {**node.attrs, flag: True, "kept_bytes": kept_bytes(node) + nbytes}
    return replace(node, attrs=attrs, output_bytes=node.output_bytes + nbytes)


DATA_MASK = "mask_from_data"
"""A training graph's fused attention whose mask is computed from the model's inputs and
constants alone (a padding mask): no gradient flows to it, as none flows to the data, so
its backward may be PyTorch's fused kernel's, which has none for a mask on CPUs."""


def _data_only(forward: Graph) -> list[bool]:
    """Per forward node, whether its value is computed from the model's inputs and
    constants alone: no parameter, and no value held from another part of a decomposed
    graph (whose gradient is wanted), upstream of it."""
    data = [False] * len(forward)
    for node in forward.nodes:
        fixed_data = all(
            forward.fixed[t].kind in (FixedKind.INPUT, FixedKind.CONSTANT)
            for t in node.fixed
            if t in forward.fixed
        )
        data[node.id] = fixed_data and all(data[d] for d in node.deps)
    return data


def _marking_data_masks(
    nodes: list[Node], data: Sequence[bool], producer: Mapping[str, int]
) -> list[Node]:
    """``nodes`` with each fused attention whose mask a data-only node computes marked
    ``DATA_MASK``."""
    marked = []
    for node in nodes:
        read = node.attrs.get("onnx_inputs")
        if node.op == ATTENTION and isinstance(read, list) and len(read) > 3:
            mask = producer.get(str(read[3]))
            if mask is not None and data[mask]:
                node = replace(node, attrs={**node.attrs, DATA_MASK: True})
        marked.append(node)
    return marked


def _on_path_to_loss(forward: Graph, reads: Iterable[int]) -> list[bool]:
    on_path = [False] * len(forward)
    for output in reads:
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


def for_mode(forward: Graph, mode: Mode, loss: Loss = MEAN_SQUARE) -> Graph:
    """The graph to schedule: the forward graph itself in inference, else its training
    graph for ``loss``."""
    return forward if mode is Mode.INFERENCE else training_graph(forward, loss)
