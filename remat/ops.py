"""Analytical FLOP estimates per ONNX operator, for the analytical cost model.

``flops(op_type, input_shapes, output_shapes, attrs)`` counts multiply-adds as two FLOPs.
Inputs are positional (an omitted optional input in the middle has shape ``()``; trailing
omitted ones are left out). Operators not in the table are assumed memory-bound and cost
one FLOP per output element; pure data movement costs nothing (its time comes from the
bytes it moves, see ``remat.costs``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

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

Shape = tuple[int, ...]
Shapes = Sequence[Shape]
FlopsFn = Callable[[Shapes, Shapes, Mapping[str, object]], float]


def _numel(shape: Shape) -> int:
    return math.prod(shape)


def _out(outputs: Shapes) -> int:
    """Elements of the first output (the one that carries the result)."""
    return _numel(outputs[0]) if outputs else 0


def _per_output_elem(cost: float) -> FlopsFn:
    return lambda inputs, outputs, attrs: cost * _out(outputs)


def _per_input_elem(cost: float) -> FlopsFn:
    return lambda inputs, outputs, attrs: cost * (_numel(inputs[0]) if inputs else 0)


def _has_input(inputs: Shapes, index: int) -> bool:
    return len(inputs) > index


def _conv(inputs: Shapes, outputs: Shapes, attrs: Mapping[str, object]) -> float:
    # Weight is (Cout, Cin/group, *kernel): each output element is a dot product of
    # Cin/group * prod(kernel) pairs.
    weight = inputs[1]
    macs = _out(outputs) * weight[1] * math.prod(weight[2:])
    bias = _out(outputs) if _has_input(inputs, 2) else 0
    return 2.0 * macs + bias


def _conv_transpose(inputs: Shapes, outputs: Shapes, attrs: Mapping[str, object]) -> float:
    # Weight is (Cin, Cout/group, *kernel): every input element scatters into
    # Cout/group * prod(kernel) outputs.
    weight = inputs[1]
    macs = _numel(inputs[0]) * weight[1] * math.prod(weight[2:])
    bias = _out(outputs) if _has_input(inputs, 2) else 0
    return 2.0 * macs + bias


def _gemm(inputs: Shapes, outputs: Shapes, attrs: Mapping[str, object]) -> float:
    a = inputs[0]
    k = a[0] if attrs.get("transA", 0) else a[1]
    m_by_n = _out(outputs)
    bias = m_by_n if _has_input(inputs, 2) else 0
    return 2.0 * m_by_n * k + bias


def _matmul(inputs: Shapes, outputs: Shapes, attrs: Mapping[str, object]) -> float:
    # Batch dimensions broadcast into the output, so out_elems * K covers them.
    a = inputs[0]
    k = a[-1] if a else 1
    return 2.0 * max(_out(outputs), 1) * k


def _matmul_add(inputs: Shapes, outputs: Shapes, attrs: Mapping[str, object]) -> float:
    # remat.onnx_fusion's MatMul with its bias Add: one addition per output element more.
    return _matmul(inputs, outputs, attrs) + _out(outputs)


def _attention(inputs: Shapes, outputs: Shapes, attrs: Mapping[str, object]) -> float:
    # remat.onnx_fusion's softmax(A @ B * scale + M) @ V: both products, then the scale,
    # the mask and the softmax (5) per score; a causal one's scores on and below the
    # diagonal alone, as PyTorch's fused kernels skip the rest.
    d, keys = inputs[0][-1], inputs[1][-1]
    out = _out(outputs)
    scores = out // max(outputs[0][-1], 1) * keys
    computed = (keys + 1) / (2 * keys) if attrs.get("causal") else 1.0
    return computed * (2.0 * scores * d + 2.0 * out * keys + 7.0 * scores)


def _window(inputs: Shapes, outputs: Shapes, attrs: Mapping[str, object]) -> float:
    kernel = attrs.get("kernel_shape")
    window = math.prod(int(k) for k in kernel) if isinstance(kernel, list | tuple) else 1
    return float(_out(outputs) * window)


def _lrn(inputs: Shapes, outputs: Shapes, attrs: Mapping[str, object]) -> float:
    return float(int(attrs.get("size", 1)) * _out(outputs))  # type: ignore[call-overload]


def _variadic(inputs: Shapes, outputs: Shapes, attrs: Mapping[str, object]) -> float:
    # Sum/Max/Min/Mean of n tensors: n - 1 binary ops per output element.
    return float(max(len(inputs) - 1, 1) * _out(outputs))


def _free(inputs: Shapes, outputs: Shapes, attrs: Mapping[str, object]) -> float:
    return 0.0


def _recurrent(inputs: Shapes, outputs: Shapes, attrs: Mapping[str, object]) -> float:
    # RNN/GRU/LSTM: X is (seq, batch, I) or (batch, seq, I), W (dirs, gates*H, I), R (dirs,
    # gates*H, H). Every step of every direction multiplies [x_t, h_t-1] by [W; R] (2 FLOPs
    # a multiply-add) and applies the gates' activations (about 10 FLOPs per gate element).
    x, w, r = inputs[0], inputs[1], inputs[2]
    steps = _numel(x) // x[-1]  # seq * batch
    directions, gate_units, width = w[0], w[1], x[-1] + r[2]
    return float(steps * directions * gate_units * (2 * width + 10))


# fmt: off
_ELEMENTWISE = (
    "Relu", "LeakyRelu", "PRelu", "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Clip", "Pow",
    "Where", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Not",
    "Xor", "Cast", "Sign", "Floor", "Ceil", "Round", "Mod", "ThresholdedRelu", "HardSigmoid",
    "HardSwish", "Selu", "Elu", "Celu", "Reciprocal", "BitShift", "IsNaN", "IsInf",
)
_TRANSCENDENTAL = (
    "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Erf", "Sin", "Cos", "Softplus", "Softsign", "Mish",
)
_DATA_MOVEMENT = (
    "Reshape", "Flatten", "Transpose", "Identity", "Concat", "Split", "Pad", "Dropout",
    "Squeeze", "Unsqueeze", "Slice", "Gather", "GatherElements", "GatherND", "Expand", "Tile",
    "Shape", "Size", "DepthToSpace", "SpaceToDepth", "SplitToSequence", "ConcatFromSequence",
)
_REDUCTIONS = (
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin",
    "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool",
)
# fmt: on

FLOPS: dict[str, FlopsFn] = {
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "Gemm": _gemm,
    "MatMul": _matmul,
    MATMUL_ADD: _matmul_add,
    ATTENTION: _attention,
    # Inference-mode batch norm is a per-channel affine map plus the normalisation.
    "BatchNormalization": _per_output_elem(5),
    # Instance/layer/group norm compute mean and variance on the fly.
    "InstanceNormalization": _per_output_elem(8),
    "LayerNormalization": _per_output_elem(8),
    LAYER_NORM: _per_output_elem(8),
    RMS_NORM: _per_output_elem(6),
    "GroupNormalization": _per_output_elem(8),
    "Softmax": _per_output_elem(5),
    "LogSoftmax": _per_output_elem(5),
    "Gelu": _per_output_elem(8),
    GELU: _per_output_elem(8),
    SILU: _per_output_elem(5),  # a sigmoid and a product
    ROTARY: _per_output_elem(3),  # two products and a sum
    "MaxPool": _window,
    "AveragePool": _window,
    "LpPool": _window,
    "LRN": _lrn,
    **dict.fromkeys(("RNN", "GRU", "LSTM"), _recurrent),
    # Linear or cubic interpolation: a few neighbours weighted per output element.
    **dict.fromkeys(("Resize", "Upsample"), _per_output_elem(4)),
    **dict.fromkeys(("Sum", "Mean", "Max", "Min"), _variadic),
    **dict.fromkeys(_ELEMENTWISE, _per_output_elem(1)),
    # Transcendentals take a handful of FLOPs each on any hardware.
    **dict.fromkeys(_TRANSCENDENTAL, _per_output_elem(4)),
    **dict.fromkeys(_REDUCTIONS, _per_input_elem(1)),
    **dict.fromkeys((*_DATA_MOVEMENT, UNBIND, LAYOUT), _free),
}
_DEFAULT: FlopsFn = _per_output_elem(1)


def scratch_elements(
    op_type: str, input_shapes: list[tuple[int, ...]], output_shapes: list[tuple[int, ...]]
) -> int:
    """Elements an operator call's kernel holds beyond its inputs and output, where its
    shapes tell: a fused attention's score matrix (``softmax(A @ B * scale + M)``, which
    PyTorch's math kernel materialises, with grouped keys and values repeated), or, where
    its backward is PyTorch's (``pytorch_attention_backward``), the keys with unit stride,
    which PyTorch's fused kernels take instead; 0 for every other operator. Elements, not
    bytes: the caller multiplies by the element size."""
    if op_type != ATTENTION:
        return 0
    if pytorch_attention_backward(input_shapes, False):
        return _numel(input_shapes[1])
    return closed_form_attention_scratch_elements(input_shapes, output_shapes)


def closed_form_attention_scratch_elements(
    input_shapes: Sequence[Shape], output_shapes: Sequence[Shape]
) -> int:
    """Elements a fused attention's forward holds beyond its inputs and outputs where it
    computes its weights itself (PyTorch's math kernel, or a training graph's forward that
    keeps them, ``remat.training``): the scores before the softmax, and grouped keys and
    values repeated for their queries."""
    return _score_elements(input_shapes, output_shapes) + _repeated_elements(input_shapes)


def attention_weights_elements(
    input_shapes: Sequence[Shape], output_shapes: Sequence[Shape]
) -> int:
    """A fused attention's weights ``softmax(A @ B * scale + M)``: a score matrix."""
    return _score_elements(input_shapes, output_shapes)


def _score_elements(input_shapes: Sequence[Shape], output_shapes: Sequence[Shape]) -> int:
    """A fused attention's score matrix: a score per query and key (0 without shapes)."""
    try:
        out, keys = output_shapes[0], input_shapes[1][-1]
        return _numel(out) // max(out[-1], 1) * keys
    except IndexError:
        return 0


def _repeated_elements(input_shapes: Sequence[Shape]) -> int:
    """Where keys and values have fewer heads than the queries (grouped-query attention,
    ``remat.onnx_fusion``), their copies with each head repeated for its group of
    queries, which PyTorch's math kernel and the closed-form backward make; else 0."""
    if len(input_shapes) < 3 or len(input_shapes[0]) != 4 or len(input_shapes[1]) != 4:
        return 0
    heads, shared = input_shapes[0][1], input_shapes[1][1]
    if heads == shared or not shared:
        return 0
    return heads // shared * (_numel(input_shapes[1]) + _numel(input_shapes[2]))


def pytorch_attention_backward(input_shapes: Sequence[Shape], mask_trained: bool) -> bool:
    """Whether the executor differentiates a fused attention (inputs ``(A, B, V[, M])``,
    ``B`` the transposed keys) as PyTorch does, by its fused kernel's backward from the
    output and the log-sum-exp the forward kernel saved beside it, which holds no score
    matrix, as eager PyTorch differentiates ``scaled_dot_product_attention``: operands of
    four dimensions (batch, heads, positions, features) and no gradient wanted for the mask
    (PyTorch's CPU kernels have none: it would take its math path, slower than the closed
    form). Else the closed form, which holds two score-sized buffers
    (``attention_backward_scratch_elements``)."""
    if len(input_shapes) < 3 or len(input_shapes[0]) != 4 or not input_shapes[1]:
        return False
    return not mask_trained


def attention_backward_scratch_elements(
    input_shapes: Sequence[Shape], output_shapes: Sequence[Shape], pytorch: bool
) -> int:
    """Elements a fused attention's backward holds beyond its inputs and gradients: by
    PyTorch's kernel (``pytorch``, as ``pytorch_attention_backward`` decides), the keys
    with unit stride; by the closed form, two score matrices (the weights' gradient and its
    product with the weights, which a training graph's forward node keeps:
    ``remat.training``), and grouped keys and values repeated for their queries."""
    if not pytorch:
        return 2 * _score_elements(input_shapes, output_shapes) + _repeated_elements(input_shapes)
    return _numel(input_shapes[1])


def flops(
    op_type: str,
    input_shapes: list[tuple[int, ...]],
    output_shapes: list[tuple[int, ...]],
    attrs: dict,
) -> float:
    """Estimated FLOPs of one operator call (memory-bound default: one per output element)."""
    estimate = FLOPS.get(op_type, _DEFAULT)
    try:
        return float(estimate(input_shapes, output_shapes, attrs))
    except (IndexError, TypeError, ValueError):
        # A malformed call (missing weight shape, odd attribute) still gets a usable guess.
        return float(_DEFAULT(input_shapes, output_shapes, attrs))
