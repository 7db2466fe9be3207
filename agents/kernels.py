"""Kernels: each ONNX operator as the equivalent PyTorch operation, and its vector-Jacobian
product (VJP) for backward nodes.

A kernel takes an ``OpSpec`` (the operator's type, decoded attributes, opset and the small
constant inputs such as shapes and axes) and its inputs by ONNX position (``None`` for an
omitted optional input), and returns one tensor per ONNX output. Semantics follow the ONNX
operator specification at the model's opset (attribute defaults, ``pads`` as
``[begin..., end...]``, ``auto_pad``, ``transA``/``transB``, axis conventions), including
the training modes a model declares: a BatchNormalization with ``training_mode=1`` (or,
before opset 14, its statistics outputs) normalises with the batch's statistics and outputs
the updated running statistics (``batch_norm_training``); a Dropout with a true
``training_mode`` input zeroes a random mask and scales the rest. That mask is a function
of the node's seed (``OpSpec.seed``, from the program's seed and the node's name) alone, so
every evaluation of the node (a recomputation, another device, the plain reference run)
draws the same one and scheduled gradients can be checked against plain autograd
(``random_mask``). Without those declarations the operators have inference semantics
(running statistics; the identity).

The VJP of an operator is, by preference, a closed form (``VJP_RULES``): from the output
alone for the operators whose gradient needs only their output (Relu, Sigmoid, Tanh,
Softmax, ...), from shapes alone for those that need neither inputs nor output (Add,
Reshape, Transpose, Concat, ...), and direct formulas for the heavy ones (Conv, MatMul,
Gemm). Everything else re-runs the forward kernel under autograd on its inputs and calls
``torch.autograd.grad`` with the upstream gradients. Inputs a backward node does not
receive (``remat.training.gradient_needs``) arrive as *placeholders*: zero tensors expanded
with stride 0 to the input's shape, which allocate nothing and carry only shape and dtype.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import AttributeProto, TensorProto, helper, numpy_helper
from torch.nn.attention import SDPBackend

from agents.errors import UnsupportedOpError
from remat.onnx_fusion import (
    ATTENTION,
    FUSED_DOMAIN,
    FUSED_OPS,
    GELU,
    LAYER_NORM,
    LAYOUT,
    MATMUL_ADD,
    RMS_NORM,
    ROTARY,
    SILU,
    UNBIND,
)
from remat.ops import pytorch_attention_backward
from remat.training import GRADIENT_NEEDS, Needs, differentiable_input

Tensor = torch.Tensor
Args = Sequence[Tensor | None]
Outputs = tuple[Tensor, ...]
Grads = list[Tensor | None]

_DEFAULT_DOMAINS = ("", "ai.onnx")

DTYPES: dict[int, torch.dtype] = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.DOUBLE: torch.float64,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.INT8: torch.int8,
    TensorProto.INT16: torch.int16,
    TensorProto.INT32: torch.int32,
    TensorProto.INT64: torch.int64,
    TensorProto.UINT8: torch.uint8,
    TensorProto.UINT16: torch.uint16,
    TensorProto.UINT32: torch.uint32,
    TensorProto.UINT64: torch.uint64,
    TensorProto.BOOL: torch.bool,
    TensorProto.COMPLEX64: torch.complex64,
    TensorProto.COMPLEX128: torch.complex128,
}


def torch_dtype(elem_type: int) -> torch.dtype:
    try:
        return DTYPES[elem_type]
    except KeyError:
        name = TensorProto.DataType.Name(elem_type) if elem_type else "undefined"
        raise UnsupportedOpError(f"no PyTorch dtype for ONNX element type {name}") from None


@dataclass(frozen=True)
class OpSpec:
    """One ONNX operator as a kernel sees it."""

    op_type: str
    name: str  # the graph node's name, for messages
    domain: str = ""
    opset: int = 17
    attrs: Mapping[str, Any] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()  # ONNX input names by position; "" = omitted
    outputs: tuple[str, ...] = ()  # ONNX output names by position; "" = not wanted
    consts: Mapping[int, np.ndarray] = field(default_factory=dict)  # small constant inputs
    # Seeds the operator's randomness (Dropout's mask in training mode): the same seed gives
    # the same mask on every run, recomputation and device (see ``random_mask``).
    seed: int = 0
    # Positions of named outputs that nothing reads (no node, not a model output): a
    # kernel that checks ``reads_output`` may give a stand-in of the same shape and bytes
    # there instead of computing it (BatchNormalization's running statistics).
    unread: frozenset[int] = frozenset()

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    def wants_output(self, position: int) -> bool:
        return position < len(self.outputs) and bool(self.outputs[position])

    def reads_output(self, position: int) -> bool:
        """Named and read by something: not only wanted (``wants_output``) but used."""
        return self.wants_output(position) and position not in self.unread

    def has_input(self, position: int) -> bool:
        return position < len(self.inputs) and bool(self.inputs[position])

    def ints(self, position: int, args: Args) -> list[int] | None:
        """A constant-like input (shape, axes, pads, ...) as Python ints; None if omitted.
        Constants come from the host copy, so a CUDA kernel does not synchronise."""
        if not self.has_input(position):
            return None
        if position in self.consts:
            found = self._const_ints.get(position)
            if found is None:
                values = np.asarray(self.consts[position]).reshape(-1)
                found = self._const_ints[position] = tuple(int(v) for v in values)
            return list(found)
        value = args[position]
        assert value is not None
        return [int(v) for v in value.reshape(-1).tolist()]

    @cached_property
    def _const_ints(self) -> dict[int, tuple[int, ...]]:
        """Constant inputs as ints, each converted at its first read: a Reshape's shape is
        read at every step that computes it."""
        return {}

    @cached_property
    def windows(self) -> dict[tuple[tuple[int, ...], tuple[int, ...] | None], _Window]:
        """A convolution's or pooling's window by input spatial shape and kernel, made at
        its first use (``_window``): read at every step that computes the node."""
        return {}

    @cached_property
    def slices(self) -> dict[tuple[int, ...], tuple[tuple[int, tuple[int, int, int]], ...]]:
        """A ``Slice``'s ranges by input shape where its starts, ends, axes and steps are
        constants, made at their first use (``_slice_ranges``): read at every step that
        computes the node or its gradient."""
        return {}

    @cached_property
    def pytorch_hard_sigmoid(self) -> bool:
        """Whether a ``HardSigmoid``'s line is PyTorch's ``hardsigmoid``'s (alpha 1/6 as a
        float32 attribute holds it, beta 1/2): read at every step that computes the node or
        its gradient."""
        alpha, beta = float(self.attr("alpha", 0.2)), float(self.attr("beta", 0.5))
        return math.isclose(alpha, 1 / 6, rel_tol=1e-6) and beta == 0.5

    @cached_property
    def layout_steps(self) -> tuple[tuple[bool, tuple[int, ...]], ...]:
        """A ``FusedLayout``'s steps as (whether it is a transpose, its target shape or
        permutation), read from its attributes once."""
        steps: list[tuple[bool, tuple[int, ...]]] = []
        dims, start = self.attr("dims", []), 0
        for kind, rank in zip(self.attr("steps", []), self.attr("ranks", []), strict=True):
            steps.append((kind == "transpose", tuple(dims[start : start + rank])))
            start += rank
        return tuple(steps)

    def scalar(self, position: int, args: Args) -> float | None:
        if not self.has_input(position):
            return None
        if position in self.consts:
            return float(np.asarray(self.consts[position]).reshape(-1)[0])
        value = args[position]
        assert value is not None
        return float(value.reshape(-1)[0].item())

    def floats(self, position: int, args: Args) -> list[float] | None:
        """A constant-like float input (scales, roi) as Python floats; None if omitted."""
        if not self.has_input(position):
            return None
        if position in self.consts:
            return [float(v) for v in np.asarray(self.consts[position]).reshape(-1)]
        value = args[position]
        assert value is not None
        return [float(v) for v in value.reshape(-1).tolist()]

    def unsupported(self, why: str = "") -> UnsupportedOpError:
        detail = f": {why}" if why else ""
        return UnsupportedOpError(
            f"no kernel for ONNX op {self.op_type!r} (node {self.name!r}){detail}"
        )


def spec_of(
    proto: onnx.NodeProto,
    name: str,
    opsets: Mapping[str, int],
    consts: Mapping[int, np.ndarray] | None = None,
    seed: int = 0,
) -> OpSpec:
    """The kernel's view of ``proto`` (``name`` is its graph node's name; ``seed``: its
    randomness, see ``node_seed``)."""
    domain = "" if proto.domain in _DEFAULT_DOMAINS else proto.domain
    return OpSpec(
        op_type=proto.op_type,
        name=name,
        domain=domain,
        opset=opsets.get(domain, opsets.get("", 17)),
        attrs={a.name: _attribute(a) for a in proto.attribute},
        inputs=tuple(proto.input),
        outputs=tuple(proto.output),
        consts=dict(consts or {}),
        seed=seed,
    )


def node_seed(seed: int, name: str) -> int:
    """A node's own seed: the run's ``seed`` and the node's name (stable across processes,
    unlike ``hash``), so that two Dropouts of one model draw different masks."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def _attribute(attribute: AttributeProto) -> Any:
    value = helper.get_attribute_value(attribute)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode() for v in value]
    return value


def check_supported(spec: OpSpec) -> None:
    """UnsupportedOpError naming the operator and node when no kernel computes it."""
    fused = spec.domain == FUSED_DOMAIN  # remat.onnx_fusion's operators
    if spec.domain and not fused:
        raise spec.unsupported(f"operators of domain {spec.domain!r} are not supported")
    if spec.op_type not in KERNELS or fused != (spec.op_type in FUSED_OPS):
        raise spec.unsupported()


def run_forward(spec: OpSpec, args: Args) -> Outputs:
    """The operator's outputs (one tensor per wanted ONNX output)."""
    return forward_and_saved(spec, args)[0]


def forward_and_saved(spec: OpSpec, args: Args) -> tuple[Outputs, Outputs | None]:
    """The operator's outputs, and what its kernel computed beside them that its gradient
    reads (as autograd saves it: a training BatchNormalization's batch mean and inverse
    standard deviation, ``SAVES``); None where nothing."""
    return prepared_forward(spec)(args)


def prepared_forward(
    spec: OpSpec, in_place: bool = False
) -> Callable[[Args], tuple[Outputs, Outputs | None]]:
    """``forward_and_saved`` for one node, with its kernel, its saver and its wanted
    outputs looked up once: the executor evaluates a node at every step that computes it.
    ``in_place``: its kernel that writes the output into the input (``IN_PLACE_KERNELS``),
    where the executor knows nothing reads the input after it (``agents.in_place``)."""
    check_supported(spec)
    kernel = IN_PLACE_KERNELS[spec.op_type] if in_place else KERNELS[spec.op_type]
    saves = SAVES.get(spec.op_type)
    count = len(spec.outputs)
    every = all(spec.outputs)  # else some outputs are omitted (empty names)

    def forward(args: Args) -> tuple[Outputs, Outputs | None]:
        outputs = kernel(spec, args)
        if every:
            wanted = tuple(outputs[:count])
        else:
            wanted = tuple(out for out, name in zip(outputs, spec.outputs, strict=False) if name)
        return wanted, saves(spec, outputs) if saves is not None else None

    return forward


# --- helpers --------------------------------------------------------------------------------


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _float(t: Tensor | None) -> bool:
    return t is not None and (t.is_floating_point() or t.is_complex())


def _torch_pad(begins: Sequence[int], ends: Sequence[int]) -> list[int]:
    """ONNX [b1..bn], [e1..en] for the last n dims -> F.pad's (bn, en, ..., b1, e1)."""
    pad: list[int] = []
    for b, e in zip(reversed(begins), reversed(ends), strict=True):
        pad += [b, e]
    return pad


def _window_pads(
    spec: OpSpec,
    spatial: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
) -> tuple[list[int], list[int]]:
    """(begin, end) pads per spatial dim for Conv and pooling, ``auto_pad`` included."""
    r = len(spatial)
    auto = spec.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for size, k, s, d in zip(spatial, kernel, strides, dilations, strict=True):
            out = -(-size // s)
            total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
            small = total // 2
            begins.append(small if auto == "SAME_UPPER" else total - small)
            ends.append(total - begins[-1])
        return begins, ends
    if auto == "VALID":
        return [0] * r, [0] * r
    pads = list(spec.attr("pads", [0] * (2 * r)))
    return pads[:r], pads[r:]


@dataclass(frozen=True)
class _Window:
    kernel: list[int]
    strides: list[int]
    dilations: list[int]
    begins: list[int]
    ends: list[int]

    @property
    def symmetric(self) -> bool:
        return self.begins == self.ends


def _window(spec: OpSpec, x: Tensor, kernel: Sequence[int] | None = None) -> _Window:
    key = (tuple(x.shape[2:]), None if kernel is None else tuple(kernel))
    found = spec.windows.get(key)
    if found is None:
        r = x.dim() - 2
        sizes = list(kernel if kernel is not None else spec.attr("kernel_shape"))
        strides = list(spec.attr("strides", [1] * r))
        dilations = list(spec.attr("dilations", [1] * r))
        begins, ends = _window_pads(spec, list(x.shape[2:]), sizes, strides, dilations)
        found = spec.windows[key] = _Window(sizes, strides, dilations, begins, ends)
    return found


# --- elementwise -----------------------------------------------------------------------------


def _unary(fn: Callable[[Tensor], Tensor]) -> Callable[[OpSpec, Args], Outputs]:
    def kernel(spec: OpSpec, args: Args) -> Outputs:
        assert args[0] is not None
        return (fn(args[0]),)

    return kernel


def _binary(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[OpSpec, Args], Outputs]:
    def kernel(spec: OpSpec, args: Args) -> Outputs:
        a, b = args[0], args[1]
        assert a is not None and b is not None
        return (fn(a, b),)

    return kernel


def _variadic(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[OpSpec, Args], Outputs]:
    def kernel(spec: OpSpec, args: Args) -> Outputs:
        values = [a for a in args if a is not None]
        result = values[0]
        for value in values[1:]:
            result = fn(result, value)
        return (result,)

    return kernel


def _div(a: Tensor, b: Tensor) -> Tensor:
    if a.is_floating_point() or b.is_floating_point():
        return a / b
    return torch.div(a, b, rounding_mode="trunc")  # ONNX integer division truncates


def _mean(spec: OpSpec, args: Args) -> Outputs:
    values = [a for a in args if a is not None]
    return (_variadic(torch.add)(spec, values)[0] / len(values),)


def _leaky_relu(spec: OpSpec, args: Args) -> Outputs:
    assert args[0] is not None
    return (F.leaky_relu(args[0], spec.attr("alpha", 0.01)),)


def _elu(spec: OpSpec, args: Args) -> Outputs:
    assert args[0] is not None
    return (F.elu(args[0], spec.attr("alpha", 1.0)),)


def _selu(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    alpha = spec.attr("alpha", 1.67326319217681884765625)
    gamma = spec.attr("gamma", 1.05070102214813232421875)
    return (gamma * torch.where(x > 0, x, alpha * (torch.exp(x) - 1)),)


def _hard_sigmoid(spec: OpSpec, args: Args) -> Outputs:
    """``clamp(alpha x + beta, 0, 1)``: PyTorch's kernel where the line is its own (x / 6 +
    1/2, as exporters write ``Hardsigmoid``), one pass."""
    x = args[0]
    assert x is not None
    if spec.pytorch_hard_sigmoid:
        return (F.hardsigmoid(x),)
    alpha, beta = spec.attr("alpha", 0.2), spec.attr("beta", 0.5)
    return (torch.clamp(alpha * x + beta, 0.0, 1.0),)


def _hard_swish(spec: OpSpec, args: Args) -> Outputs:
    """``x clamp(x / 6 + 1/2, 0, 1)``: PyTorch's ``hardswish`` kernel, one pass."""
    x = args[0]
    assert x is not None
    return (F.hardswish(x),)


def _prelu(spec: OpSpec, args: Args) -> Outputs:
    x, slope = args[0], args[1]
    assert x is not None and slope is not None
    return (torch.where(x < 0, x * slope, x),)


def _gelu(spec: OpSpec, args: Args) -> Outputs:
    assert args[0] is not None
    return (F.gelu(args[0], approximate=spec.attr("approximate", "none")),)


def _silu(spec: OpSpec, args: Args) -> Outputs:
    assert args[0] is not None
    return (F.silu(args[0]),)


def _rotary(spec: OpSpec, args: Args) -> Outputs:
    """``remat.onnx_fusion``'s ``FusedRotary``: ``x * cos + concat(-x2, x1) * sin`` of the
    halves ``x1``, ``x2`` of ``x``'s last axis, as one product and a product added into
    each half of it in place (no halves, rotation or second product made)."""
    x, cos, sin = args[0], args[1], args[2]
    assert x is not None and cos is not None and sin is not None
    half = x.shape[-1] // 2
    sin1, sin2 = _halves(sin, half)
    y = x * cos
    y[..., :half].addcmul_(x[..., half:], sin1, value=-1)
    y[..., half:].addcmul_(x[..., :half], sin2)
    return (y,)


def _halves(t: Tensor, half: int) -> tuple[Tensor, Tensor]:
    """The halves of ``t``'s last axis (``t`` itself twice where it broadcasts along it)."""
    return (t, t) if t.shape[-1] == 1 else (t[..., :half], t[..., half:])


def _clip(spec: OpSpec, args: Args, in_place: bool = False) -> Outputs:
    """A float input's as PyTorch's ``hardtanh`` (ReLU6, which exporters write as ``Clip``),
    whose gradient, from the output, is exclusive at the bounds (``_clip_grad``): autograd
    differentiates it so where the references run it; otherwise ``clamp``. ``in_place``:
    into the input (``IN_PLACE_KERNELS``)."""
    x = args[0]
    assert x is not None
    low, high = _clip_bounds(spec, args)
    if low is None and high is None:
        return (x,)
    below, above = -math.inf if low is None else low, math.inf if high is None else high
    if x.is_floating_point() and below <= above:
        return (F.hardtanh(x, below, above, in_place),)
    return (torch.clamp_(x, low, high) if in_place else torch.clamp(x, low, high),)


def _clip_bounds(spec: OpSpec, args: Args) -> tuple[float | None, float | None]:
    if spec.opset < 11:
        return spec.attr("min"), spec.attr("max")
    return spec.scalar(1, args), spec.scalar(2, args)


def _where(spec: OpSpec, args: Args) -> Outputs:
    cond, a, b = args[0], args[1], args[2]
    assert cond is not None and a is not None and b is not None
    return (torch.where(cond, a, b),)


def _cast(spec: OpSpec, args: Args) -> Outputs:
    assert args[0] is not None
    return (args[0].to(torch_dtype(spec.attr("to"))),)


def _softmax_like(fn: Callable[..., Tensor]) -> Callable[[OpSpec, Args], Outputs]:
    def kernel(spec: OpSpec, args: Args) -> Outputs:
        x = args[0]
        assert x is not None
        return (_softmax_apply(spec, x, lambda t, dim: fn(t, dim=dim)),)

    return kernel


def _softmax_apply(spec: OpSpec, x: Tensor, fn: Callable[[Tensor, int], Tensor]) -> Tensor:
    """Before opset 13 Softmax coerces its input to 2-D at ``axis`` (default 1); from 13 it
    works along ``axis`` (default -1)."""
    if spec.opset < 13:
        axis = _axis(spec.attr("axis", 1), x.dim())
        flat = x.reshape(math.prod(x.shape[:axis]), -1)
        return fn(flat, 1).reshape(x.shape)
    return fn(x, spec.attr("axis", -1))


# --- linear algebra and convolution ------------------------------------------------------------


def _gemm(spec: OpSpec, args: Args) -> Outputs:
    a, b = args[0], args[1]
    c = args[2] if len(args) > 2 else None
    assert a is not None and b is not None
    alpha, beta = float(spec.attr("alpha", 1.0)), float(spec.attr("beta", 1.0))
    a = a.t() if spec.attr("transA", 0) else a
    if spec.attr("transB", 0) and alpha == 1.0 and beta == 1.0 and (c is None or c.dim() <= 1):
        return (F.linear(a, b, c),)  # one fused call for the common layer
    b = b.t() if spec.attr("transB", 0) else b
    if c is None or beta == 0.0:
        product = a @ b
        return (product if alpha == 1.0 else alpha * product,)
    return (torch.addmm(c, a, b, beta=beta, alpha=alpha),)


def _matmul_add(spec: OpSpec, args: Args) -> Outputs:
    """``remat.onnx_fusion``'s ``A @ W + B`` with ``W`` a matrix (K, N), or (N, K) with
    ``transB``: ``F.linear``, as PyTorch runs a ``Linear`` layer (one ``addmm`` over the
    flattened batch where the input is contiguous). An input of three or more axes that is
    not (a transposed view: attention's input projection after a layout change) is made
    contiguous first: PyTorch would otherwise multiply it batch by batch against the
    weight broadcast (``bmm``), which costs more than the copy."""
    a, w, bias = args[0], args[1], args[2]
    assert a is not None and w is not None and bias is not None
    if a.dim() > 2 and not a.is_contiguous():
        a = a.contiguous()
    return (F.linear(a, w if spec.attr("transB", 0) else w.t(), bias),)


def _attention(spec: OpSpec, args: Args) -> Outputs:
    """``remat.onnx_fusion``'s ``softmax(A @ B * scale + M) @ V`` with ``B`` the transposed
    keys (``causal``: each query attends to the keys up to its own position): PyTorch's
    ``scaled_dot_product_attention``, as eager PyTorch runs attention. Where the backward
    is PyTorch's (``remat.ops.pytorch_attention_backward``), the keys are given unit stride
    so that PyTorch takes a fused kernel, which holds no score matrix; on a CPU that kernel
    is called itself, and its log-sum-exp per query is a second output
    (``_second_output``), which the backward reads instead of running the forward again,
    as autograd saves it. Where a training graph's node keeps its weights for the closed
    form's backward (``keeps_weights``), they are computed as such and are its second
    output, as autograd saves a softmax's output."""
    a, b, v = args[0], args[1], args[2]
    assert a is not None and b is not None and v is not None
    mask = args[3] if len(args) > 3 else None
    scale = float(spec.attr("scale", 1.0))
    causal = bool(spec.attr("causal", 0))
    if keeps_weights(spec):
        b, v, _ = _repeated_heads(a, b, v)
        p = _weights(a, b, mask, scale, causal)
        return torch.matmul(p, v), p
    keys, grouped = b.transpose(-1, -2), _grouped(a, b)
    if pytorch_attention_backward([tuple(a.shape), tuple(b.shape), tuple(v.shape)], False):
        keys = _unit_stride(keys)
        if a.device.type == "cpu" and _fused_choice(a, keys, v, mask, causal, scale) == FLASH:
            return tuple(
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    a, keys, v, 0.0, causal, attn_mask=mask, scale=scale
                )
            )
    return (
        F.scaled_dot_product_attention(
            a, keys, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=grouped
        ),
    )


FLASH = SDPBackend.FLASH_ATTENTION.value
# The name's suffix of a fused attention's second output where a training graph keeps its
# weights for the closed form's backward (``agents.program``; ``remat.training.kept_bytes``)
KEPT_WEIGHTS = ":weights"


def keeps_weights(spec: OpSpec) -> bool:
    """Whether a fused attention's second output is its weights (``KEPT_WEIGHTS``)."""
    return _keeps(spec, KEPT_WEIGHTS)


def _keeps(spec: OpSpec, suffix: str) -> bool:
    """Whether the node's second output is what a training graph keeps for its backward
    (``suffix``: ``KEPT_WEIGHTS``, ``KEPT_ARGMAX``), not one of the operator's own."""
    return len(spec.outputs) > 1 and spec.outputs[1].endswith(suffix)


def _weights(a: Tensor, b: Tensor, mask: Tensor | None, scale: float, causal: bool) -> Tensor:
    """Attention's weights ``P = softmax(A B scale + M)`` (``causal``: the keys after each
    query's own position masked); a row whose every score is masked has zero weights."""
    p = torch.matmul(a, b).mul_(scale) if scale != 1.0 else torch.matmul(a, b)
    if mask is not None:
        p.add_(mask)
    if causal:
        later = torch.ones(p.shape[-2:], dtype=torch.bool, device=p.device).triu_(1)
        p.masked_fill_(later, -math.inf)
    p = torch.softmax(p, dim=-1)
    if mask is not None:  # in place but under autograd (a reference), which keeps P itself
        p = p.nan_to_num(0.0) if p.requires_grad else p.nan_to_num_(0.0)
    return p


def _repeated_heads(a: Tensor, b: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
    """Keys ``b`` and values ``v`` with each of their heads repeated for its group of query
    heads where they have fewer heads than the queries ``a`` (``_grouped``), and their
    number of heads (0 where not grouped)."""
    if not _grouped(a, b):
        return b, v, 0
    heads = b.shape[-3]
    group = a.shape[-3] // heads
    return b.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3), heads


def _fused_choice(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float
) -> int:
    """The kernel ``scaled_dot_product_attention`` takes for these operands (an
    ``SDPBackend`` value)."""
    choice = torch._fused_sdp_choice(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=_grouped(q, k)
    )
    return int(choice)


def _grouped(queries: Tensor, keys: Tensor) -> bool:
    """Whether attention's keys and values have fewer heads than its queries, each read by
    a group of them in a row (grouped-query attention, PyTorch's ``enable_gqa``)."""
    return queries.dim() == 4 and queries.shape[1] != keys.shape[1]


def _unit_stride(t: Tensor) -> Tensor:
    """``t``, copied where its last axis is strided: PyTorch's fused attention kernels
    take operands whose features are adjacent."""
    return t if t.stride(-1) == 1 else t.contiguous()


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _conv(spec: OpSpec, args: Args) -> Outputs:
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    assert x is not None and w is not None
    win = _window(spec, x, spec.attr("kernel_shape") or list(w.shape[2:]))
    padding = win.begins
    if not win.symmetric:
        x = F.pad(x, _torch_pad(win.begins, win.ends))
        padding = [0] * len(win.begins)
    conv = _CONV.get(x.dim() - 2)
    if conv is None:
        raise spec.unsupported(f"{x.dim() - 2}-D convolution")
    return (conv(x, w, b, win.strides, padding, win.dilations, spec.attr("group", 1)),)


@dataclass(frozen=True)
class _Transposed:
    strides: list[int]
    dilations: list[int]
    output_padding: list[int]
    begins: list[int]
    ends: list[int]


def _transposed(spec: OpSpec, x: Tensor, w: Tensor) -> _Transposed:
    r = x.dim() - 2
    kernel = list(spec.attr("kernel_shape") or w.shape[2:])
    strides = list(spec.attr("strides", [1] * r))
    dilations = list(spec.attr("dilations", [1] * r))
    output_padding = list(spec.attr("output_padding", [0] * r))
    pads = list(spec.attr("pads", [0] * (2 * r)))
    begins, ends = pads[:r], pads[r:]
    output_shape = spec.attr("output_shape")
    auto = spec.attr("auto_pad", "NOTSET")
    if output_shape is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        sizes = x.shape[2:]
        targets = list(output_shape)[-r:] if output_shape is not None else None
        begins, ends = [], []
        for i in range(r):
            target = targets[i] if targets else sizes[i] * strides[i]
            full = strides[i] * (sizes[i] - 1) + output_padding[i]
            total = max(full + (kernel[i] - 1) * dilations[i] + 1 - target, 0)
            upper = auto == "SAME_UPPER"
            begins.append(total - total // 2 if upper else total // 2)
            ends.append(total - begins[-1])
    elif auto == "VALID":
        begins, ends = [0] * r, [0] * r
    return _Transposed(strides, dilations, output_padding, begins, ends)


def _conv_transpose(spec: OpSpec, args: Args) -> Outputs:
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    assert x is not None and w is not None
    conv = _CONV_T.get(x.dim() - 2)
    if conv is None:
        raise spec.unsupported(f"{x.dim() - 2}-D transposed convolution")
    t = _transposed(spec, x, w)
    group = spec.attr("group", 1)
    if t.begins == t.ends:
        return (conv(x, w, b, t.strides, t.begins, t.output_padding, group, t.dilations),)
    full = conv(x, w, b, t.strides, 0, t.output_padding, group, t.dilations)
    crop = [slice(None), slice(None)]
    for i, (begin, end) in enumerate(zip(t.begins, t.ends, strict=True)):
        crop.append(slice(begin, full.shape[2 + i] - end))
    return (full[tuple(crop)],)


# --- pooling and normalization ----------------------------------------------------------------

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_MAX_POOL_BACKWARD = {
    2: torch.ops.aten.max_pool2d_with_indices_backward,
    3: torch.ops.aten.max_pool3d_with_indices_backward,
}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
# The name's suffix of MaxPool's second output where a training graph keeps its argmax
# (``agents.program``; ``remat.training.kept_bytes``), not the model's ``Indices``
KEPT_ARGMAX = ":argmax"


@dataclass(frozen=True)
class _MaxPoolWindow:
    """A MaxPool's window as torch pools it: ``padded``, the input is padded with -inf
    first (torch pads by at most half the kernel and only symmetrically), and then
    ``padding`` is zeros."""

    window: _Window
    padding: list[int]
    padded: bool
    ceil: bool

    @classmethod
    def of(cls, spec: OpSpec, x: Tensor) -> _MaxPoolWindow:
        win = _window(spec, x)
        ceil = bool(spec.attr("ceil_mode", 0))
        if not win.symmetric or any(2 * p > k for p, k in zip(win.begins, win.kernel, strict=True)):
            return cls(win, [0] * len(win.begins), True, ceil)
        return cls(win, win.begins, False, ceil)

    @property
    def torch_window(self) -> tuple[list[int], list[int], list[int], list[int], bool]:
        """Kernel, strides, padding, dilations and ceil mode, as torch's pooling and its
        backward take them."""
        win = self.window
        return win.kernel, win.strides, self.padding, win.dilations, self.ceil

    def per_plane(self, spec: OpSpec) -> bool:
        """The argmax is PyTorch's own, per plane: a training graph's kept argmax, which
        only the node's backward reads, where torch pools the input itself (on every
        device alike: a plan may pool on one device and differentiate on another); a
        model's ``Indices`` holds ONNX's."""
        return _keeps(spec, KEPT_ARGMAX) and not self.padded


def _max_pool(spec: OpSpec, args: Args) -> Outputs:
    """The pooled values, and where ``Indices`` is wanted ONNX's indices: into the whole
    flattened input, not counting padding (a training graph's kept argmax: PyTorch's,
    ``_MaxPoolWindow.per_plane``)."""
    x = args[0]
    assert x is not None
    pool = _MAX_POOL.get(x.dim() - 2)
    if pool is None:
        raise spec.unsupported(f"{x.dim() - 2}-D pooling")
    at = _MaxPoolWindow.of(spec, x)
    win = at.window
    padded = F.pad(x, _torch_pad(win.begins, win.ends), value=-math.inf) if at.padded else x
    window = at.torch_window
    if not spec.wants_output(1):
        return (pool(padded, *window, return_indices=False),)
    if spec.attr("storage_order", 0):
        raise spec.unsupported("column-major storage_order")
    values, indices = pool(padded, *window, return_indices=True)
    if at.per_plane(spec):
        return values, indices
    if at.padded:
        indices = _unpadded(spec, indices, padded.shape[2:], x.shape[2:], win)
    return values, indices + _plane_starts(x)


def _unpadded(
    spec: OpSpec,
    indices: Tensor,
    padded: Sequence[int],
    shape: Sequence[int],
    win: _Window,
) -> Tensor:
    """Indices into planes of the padded shape -> into planes of the input's ``shape``."""
    extents = [(k - 1) * d + 1 for k, d in zip(win.kernel, win.dilations, strict=True)]
    if any(p >= e for p, e in zip(win.begins + win.ends, extents * 2, strict=True)):
        raise spec.unsupported("MaxPool indices with windows wholly in the padding")
    coords = torch.unravel_index(indices, tuple(padded))
    flat = torch.zeros_like(indices)
    for coord, begin, size in zip(coords, win.begins, shape, strict=True):
        flat = flat * size + (coord - begin)
    return flat


def _plane_starts(x: Tensor) -> Tensor:
    """Where each (batch, channel) plane of ``x`` starts in the flattened tensor, shaped to
    add to per-plane indices: PyTorch's pooling indices count within a plane, ONNX's over
    the whole tensor."""
    n, c = x.shape[0], x.shape[1]
    starts = torch.arange(n * c, device=x.device, dtype=torch.int64) * math.prod(x.shape[2:])
    return starts.reshape(n, c, *([1] * (x.dim() - 2)))


def _average_pool(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    pool = _AVG_POOL.get(x.dim() - 2)
    if pool is None:
        raise spec.unsupported(f"{x.dim() - 2}-D pooling")
    win = _window(spec, x)
    ceil = bool(spec.attr("ceil_mode", 0))
    include = bool(spec.attr("count_include_pad", 0))
    if any(d != 1 for d in win.dilations):
        raise spec.unsupported("dilated AveragePool")
    if _pooled_as_is(win):
        return (pool(x, win.kernel, win.strides, win.begins, ceil, include),)
    # Pad explicitly; without count_include_pad divide by the number of real elements.
    pad = _torch_pad(win.begins, win.ends)
    total = pool(F.pad(x, pad), win.kernel, win.strides, 0, ceil, True)
    if include:
        return (total,)
    ones = F.pad(torch.ones_like(x[:1, :1]), pad)
    count = pool(ones, win.kernel, win.strides, 0, ceil, True)
    return (total / count,)


def _pooled_as_is(win: _Window) -> bool:
    """Whether PyTorch's average pooling takes the window as it is: undilated, its pads
    symmetric and at most half the kernel (else ``_average_pool`` pads explicitly)."""
    return (
        win.symmetric
        and all(d == 1 for d in win.dilations)
        and all(2 * p <= k for p, k in zip(win.begins, win.kernel, strict=True))
    )


def _global_average_pool(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    return (x.mean(dim=tuple(range(2, x.dim())), keepdim=True),)


def _global_max_pool(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    return (x.amax(dim=tuple(range(2, x.dim())), keepdim=True),)


def batch_norm_training(spec: OpSpec) -> bool:
    """Whether a BatchNormalization normalises with the batch's statistics: from opset 14
    its ``training_mode`` attribute; before, its optional statistics outputs (opsets 9-13
    have them only in training)."""
    if spec.opset >= 14:
        return bool(spec.attr("training_mode", 0))
    return sum(1 for name in spec.outputs if name) > 1


def _statistics(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Statistics (which carry no gradient) cut from autograd's graph where one is being
    recorded (the reference's run), and as they are where none is (the executor's steps,
    where a detach per tensor would cost a call each)."""
    if torch.is_grad_enabled():
        return tuple(t.detach() for t in tensors)
    return tensors


def _batch_norm(spec: OpSpec, args: Args) -> Outputs:
    x, scale, bias, mean, var = args[:5]
    assert x is not None and mean is not None and var is not None
    eps = spec.attr("epsilon", 1e-5)
    # Running statistics are buffers, never differentiated (an exporter may share one
    # initializer between a scale and a running variance of ones: the scale still trains).
    mean, var = _statistics(mean, var)
    if not batch_norm_training(spec):
        # Inference semantics: the running statistics normalise; statistics outputs, if a
        # model declares them anyway, are the running statistics unchanged.
        y = F.batch_norm(x, mean, var, scale, bias, False, 0.0, eps)
        return y, mean, var, mean, var
    # Training semantics (ONNX and onnxruntime): normalise with the batch's mean and biased
    # variance; the running statistics move by ``1 - momentum`` towards them (the biased
    # variance too, unlike PyTorch's own update); opsets 9-13 also output the batch's mean
    # and inverse standard deviation. The statistics outputs carry no gradient.
    # PyTorch's kernel gives the batch's mean and inverse standard deviation with the
    # output, in the same pass (as autograd keeps them for the backward).
    y, batch_mean, inv_std = torch.native_batch_norm(x, scale, bias, None, None, True, 0.0, eps)
    batch_mean, inv_std = _statistics(batch_mean, inv_std)
    if not (spec.reads_output(1) or spec.reads_output(2)):
        return y, mean, var, batch_mean, inv_std  # running statistics not read
    with torch.no_grad():
        momentum = float(spec.attr("momentum", 0.9))
        # lerp(batch, running, momentum) = running * momentum + batch * (1 - momentum)
        running_mean = torch.lerp(batch_mean.to(mean.dtype), mean, momentum)
        batch_var = inv_std.pow(-2).sub_(eps).to(var.dtype)
        running_var = torch.lerp(batch_var, var, momentum)
    return y, running_mean, running_var, batch_mean, inv_std


def _batch_norm_saved(spec: OpSpec, outputs: Outputs) -> Outputs | None:
    """In training, the batch's mean and inverse standard deviation (``_batch_norm``'s last
    two outputs), which ``_prepared_batch_norm_grad`` would otherwise take again from the input."""
    return tuple(outputs[3:5]) if batch_norm_training(spec) else None


def _layer_norm_saved(spec: OpSpec, outputs: Outputs) -> Outputs | None:
    """The mean and inverse standard deviation PyTorch's kernel gave with the output
    (``_layer_norm``), which ``_layer_norm_grad`` would otherwise take again from the input;
    None where something reads them (they are outputs then, with a gradient)."""
    if spec.reads_output(1) or spec.reads_output(2):
        return None
    return tuple(outputs[1:3])


def _normalised_shape(scale: Tensor | None, bias: Tensor | None, shape: list[int]) -> bool:
    """Whether the scale (and bias) have the normalised axes' shape, as PyTorch's fused
    kernels take them (ONNX lets them broadcast)."""
    return (
        scale is not None
        and list(scale.shape) == shape
        and (bias is None or list(bias.shape) == shape)
    )


def _second_output(spec: OpSpec, outputs: Outputs) -> Outputs | None:
    """The second output a fused kernel gave beside the operator's, where it gave one:
    attention's log-sum-exp per query (``_attention``), which its backward reads with the
    output, and RMS normalization's inverse root mean square per slice (``_rms_norm``),
    which ``_rms_norm_grad`` would otherwise take again from the input."""
    return tuple(outputs[1:2]) if len(outputs) > 1 else None


def _attention_saved(spec: OpSpec, outputs: Outputs) -> Outputs | None:
    """Attention's log-sum-exp per query (``_second_output``); nothing where its second
    output is the weights a training graph keeps in the node's value
    (``keeps_weights``)."""
    return None if keeps_weights(spec) else _second_output(spec, outputs)


SAVES: dict[str, Callable[[OpSpec, Outputs], Outputs | None]] = {
    "BatchNormalization": _batch_norm_saved,
    "LayerNormalization": _layer_norm_saved,
    LAYER_NORM: _layer_norm_saved,
    RMS_NORM: _second_output,
    ATTENTION: _attention_saved,
}
"""Per operator, what its kernel's outputs hold beyond the ONNX outputs that its gradient
reads (``forward_and_saved``)."""


def _instance_norm(spec: OpSpec, args: Args) -> Outputs:
    x, scale, bias = args[:3]
    assert x is not None
    return (F.instance_norm(x, weight=scale, bias=bias, eps=spec.attr("epsilon", 1e-5)),)


def _layer_norm(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    scale = args[1]
    bias = args[2] if len(args) > 2 else None
    assert x is not None and scale is not None
    axis = _axis(spec.attr("axis", -1), x.dim())
    eps = spec.attr("epsilon", 1e-5)
    shape = list(x.shape[axis:])
    if not (spec.reads_output(1) or spec.reads_output(2)) and _normalised_shape(scale, bias, shape):
        # PyTorch's kernel gives the mean and inverse standard deviation with the output,
        # in the same pass (as autograd keeps them for the backward, ``SAVES``).
        y, mean, inv_std = torch.native_layer_norm(x, shape, scale, bias, eps)
        return (y, *_statistics(mean, inv_std))
    # Statistics a model asks for carry a gradient (ONNX's outputs), so they are built from
    # differentiable operations.
    dims = tuple(range(axis, x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    inv_std = torch.rsqrt(((x - mean) ** 2).mean(dim=dims, keepdim=True) + eps)
    y = (x - mean) * inv_std * scale
    if bias is not None:
        y = y + bias
    return y, mean, inv_std


def _rms_norm(spec: OpSpec, args: Args) -> Outputs:
    """``remat.onnx_fusion``'s ``FusedRMSNorm``: PyTorch's ``rms_norm`` over the axes from
    ``axis`` on; where the weight has the normalised axes' shape, its fused kernel, whose
    inverse root mean square is a second output (``_second_output``)."""
    x, weight = args[0], args[1]
    assert x is not None and weight is not None
    shape = list(x.shape[_axis(spec.attr("axis", -1), x.dim()) :])
    # in the wider of the two types, as the chain's last Mul by the weight gives it
    x = x.to(torch.promote_types(x.dtype, weight.dtype))
    weight, eps = weight.to(x.dtype), float(spec.attr("epsilon", 1e-6))
    if list(weight.shape) == shape:
        return tuple(torch.ops.aten._fused_rms_norm(x, shape, weight, eps))
    return (F.rms_norm(x, shape, weight, eps),)


def _lrn(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    return (
        F.local_response_norm(
            x,
            spec.attr("size"),
            alpha=spec.attr("alpha", 1e-4),
            beta=spec.attr("beta", 0.75),
            k=spec.attr("bias", 1.0),
        ),
    )


# --- shape and data movement ------------------------------------------------------------------


def _reshape(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    shape = spec.ints(1, args) if spec.opset >= 5 else list(spec.attr("shape"))
    assert shape is not None
    if not spec.attr("allowzero", 0):
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return (x.reshape(shape),)


def _flatten(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    axis = _axis(spec.attr("axis", 1), x.dim())
    return (x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:])),)


def _transpose(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    perm = spec.attr("perm") or list(reversed(range(x.dim())))
    return (x.permute(*perm),)


def _axes(spec: OpSpec, args: Args, since: int) -> list[int] | None:
    """``axes`` from an attribute before opset ``since``, from input 1 from then on."""
    if spec.opset >= since:
        return spec.ints(1, args)
    axes = spec.attr("axes")
    return list(axes) if axes is not None else None


def _squeeze(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    axes = _axes(spec, args, 13)
    if axes is None:
        return (x.squeeze(),)
    keep = {_axis(a, x.dim()) for a in axes}
    return (x.reshape([d for i, d in enumerate(x.shape) if i not in keep]),)


def _unsqueeze(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    axes = _axes(spec, args, 13)
    assert axes is not None
    rank = x.dim() + len(axes)
    inserted = {_axis(a, rank) for a in axes}
    dims = iter(x.shape)
    return (x.reshape([1 if i in inserted else next(dims) for i in range(rank)]),)


def _concat(spec: OpSpec, args: Args) -> Outputs:
    return (torch.cat([a for a in args if a is not None], dim=spec.attr("axis")),)


def _split(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    axis = _axis(spec.attr("axis", 0), x.dim())
    return tuple(torch.split(x, _split_sizes(spec, args, x.shape[axis]), dim=axis))


def _split_sizes(spec: OpSpec, args: Args, length: int) -> list[int]:
    """Each part's length along a ``Split``'s axis of ``length``: as given, else equal
    parts, the last one shorter where they do not divide it."""
    sizes = spec.ints(1, args) if spec.opset >= 13 else spec.attr("split")
    if sizes is not None:
        return list(sizes)
    count = len(spec.outputs)
    chunk = -(-length // count)
    return [min(chunk, length - i * chunk) for i in range(count)]


def _unbind(spec: OpSpec, args: Args) -> Outputs:
    """``remat.onnx_fusion``'s ``FusedUnbind``: the input's parts along ``axis``, as the
    ``Gather``'s of each index it stands for."""
    x = args[0]
    assert x is not None
    return x.unbind(int(spec.attr("axis", 0)))


def _layout(spec: OpSpec, args: Args) -> Outputs:
    """``remat.onnx_fusion``'s ``FusedLayout``: its reshapes and transposes in order, views
    where PyTorch can make them, as the chain of layout operators it stands for."""
    x = args[0]
    assert x is not None
    for transpose, dims in spec.layout_steps:
        x = x.permute(dims) if transpose else x.reshape(dims)
    return (x,)


def _slice(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    result = x
    for dim, (begin, stop, stride) in _slice_ranges(spec, args, x.shape):
        if stride > 0:
            index = [slice(None)] * x.dim()
            index[dim] = slice(begin, stop, stride)
            result = result[tuple(index)]
        else:
            picks = torch.arange(begin, stop, stride, device=x.device)
            result = result.index_select(dim, picks)
    return (result,)


def _slice_ranges(
    spec: OpSpec, args: Args, shape: Sequence[int]
) -> tuple[tuple[int, tuple[int, int, int]], ...]:
    """A ``Slice``'s (axis, (start, stop, step)) for each axis it slices, normalised to
    ``shape`` as Python's slices are."""
    key = tuple(shape)
    found = spec.slices.get(key)
    if found is not None:
        return found
    if spec.opset < 10:
        starts, ends = list(spec.attr("starts")), list(spec.attr("ends"))
        axes, steps = spec.attr("axes"), None
    else:
        starts, ends = spec.ints(1, args) or [], spec.ints(2, args) or []
        axes, steps = spec.ints(3, args), spec.ints(4, args)
    axes = list(axes) if axes is not None else list(range(len(starts)))
    steps = list(steps) if steps is not None else [1] * len(starts)
    ranges = []
    for axis, start, end, step in zip(axes, starts, ends, steps, strict=True):
        dim = _axis(axis, len(shape))
        ranges.append((dim, slice(start, end, step).indices(shape[dim])))
    found = tuple(ranges)
    if spec.opset < 10 or all(p in spec.consts or not spec.has_input(p) for p in range(1, 5)):
        spec.slices[key] = found
    return found


def _one_index(spec: OpSpec, args: Args) -> int | None:
    """A Gather's index where it is one constant (a transformer picking q, k or v from
    one projection): a slice of the data, no index arithmetic. None otherwise."""
    indices = args[1]
    if indices is None or indices.dim() != 0 or 1 not in spec.consts:
        return None
    found = spec.ints(1, args)
    return found[0] if found else None


def _gather(spec: OpSpec, args: Args) -> Outputs:
    data, indices = args[0], args[1]
    assert data is not None and indices is not None
    axis = _axis(spec.attr("axis", 0), data.dim())
    if (index := _one_index(spec, args)) is not None:
        return (data.select(axis, index),)
    size = data.shape[axis]
    flat = indices.reshape(-1).long()
    flat = torch.where(flat < 0, flat + size, flat)
    picked = data.index_select(axis, flat)
    shape = [*data.shape[:axis], *indices.shape, *data.shape[axis + 1 :]]
    return (picked.reshape(shape),)


def _gather_elements(spec: OpSpec, args: Args) -> Outputs:
    data, indices = args[0], args[1]
    assert data is not None and indices is not None
    axis = _axis(spec.attr("axis", 0), data.dim())
    index = indices.long()
    index = torch.where(index < 0, index + data.shape[axis], index)
    return (torch.gather(data, axis, index),)


def _expand(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    shape = spec.ints(1, args)
    assert shape is not None
    return (torch.broadcast_to(x, torch.broadcast_shapes(tuple(x.shape), tuple(shape))),)


def _tile(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    repeats = spec.ints(1, args)
    assert repeats is not None
    return (x.repeat(*repeats),)


def _pad(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    mode, torch_pad, value = _pad_of(spec, args, x.dim())
    if mode == "constant":
        return (F.pad(x, torch_pad, value=value),)
    torch_mode = {"reflect": "reflect", "edge": "replicate", "wrap": "circular"}.get(mode)
    if torch_mode is None:
        raise spec.unsupported(f"Pad mode {mode!r}")
    return (F.pad(x, torch_pad, mode=torch_mode),)


def _pad_of(spec: OpSpec, args: Args, rank: int) -> tuple[str, list[int], float]:
    """A ``Pad``'s mode, its pads as ``F.pad`` takes them (from the first padded axis on)
    and its constant value."""
    mode = spec.attr("mode", "constant")
    if spec.opset < 11:
        pads, value = list(spec.attr("pads")), float(spec.attr("value", 0.0))
    else:
        pads = spec.ints(1, args) or []
        value = spec.scalar(2, args) or 0.0
    axes = spec.ints(3, args) if spec.opset >= 18 else None
    axes = [_axis(a, rank) for a in axes] if axes is not None else list(range(rank))
    n = len(axes)
    begins, ends = [0] * rank, [0] * rank
    for i, axis in enumerate(axes):
        begins[axis], ends[axis] = pads[i], pads[n + i]
    first = next((i for i in range(rank) if begins[i] or ends[i]), rank)
    return mode, _torch_pad(begins[first:], ends[first:]), value


def _constant_of_shape(spec: OpSpec, args: Args) -> Outputs:
    shape = spec.ints(0, args)
    assert shape is not None
    value = spec.attr("value")
    array = numpy_helper.to_array(value) if value is not None else np.zeros(1, np.float32)
    device = args[0].device if args[0] is not None else torch.device("cpu")
    fill = torch.as_tensor(array.reshape(-1)[:1].copy(), device=device)
    return (fill.expand(shape).clone() if shape else fill.reshape(()).clone(),)


def _shape(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    dims = list(x.shape)[spec.attr("start", 0) : spec.attr("end", x.dim())]
    return (torch.tensor(dims, dtype=torch.int64, device=x.device),)


def _size(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    return (torch.tensor(x.numel(), dtype=torch.int64, device=x.device),)


def _identity(spec: OpSpec, args: Args) -> Outputs:
    assert args[0] is not None
    return (args[0],)


def dropout_ratio(spec: OpSpec, args: Args) -> float | None:
    """The probability a Dropout zeroes an element in training mode; None in inference
    mode (the identity). Training mode is input 2 from opset 12 (default false); earlier
    opsets have no training mode in inference runtimes."""
    if spec.opset < 12 or not spec.has_input(2):
        return None
    training = spec.scalar(2, args)
    if not training:
        return None
    ratio = spec.scalar(1, args)
    return 0.5 if ratio is None else ratio


def random_mask(spec: OpSpec, shape: Sequence[int], ratio: float, device: torch.device) -> Tensor:
    """Dropout's keep-mask for ``spec``: drawn on the host from a generator seeded with the
    node's own seed (``OpSpec.seed``), then moved to ``device``. It depends on nothing else,
    so a recomputation, a plan on any device (CPU or CUDA), the float64 run and the plain
    reference all draw the same mask and their gradients are comparable; the price is a
    host draw and a copy per evaluation (the mask is not a fresh one per training step)."""
    generator = torch.Generator().manual_seed(spec.seed)
    keep = torch.rand(tuple(shape), generator=generator) >= ratio
    return keep.to(device)


def _dropout(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    ratio = dropout_ratio(spec, args)
    if ratio is None or ratio == 0.0:
        # Inference semantics (or nothing to drop): the identity, a mask of ones, of the
        # data's type before Dropout-10 (ONNX's T there, as onnxruntime and the graph's
        # bytes have it), bool from it on.
        return x, torch.ones_like(x, dtype=torch.bool if spec.opset >= 10 else x.dtype)
    if not 0.0 < ratio < 1.0:
        raise spec.unsupported(f"Dropout ratio {ratio} outside [0, 1)")
    keep = random_mask(spec, x.shape, ratio, x.device)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - ratio)), keep


def _random_like(normal: bool) -> Callable[[OpSpec, Args], Outputs]:
    """RandomUniformLike / RandomNormalLike: values of the input's shape (its dtype unless
    ``dtype`` says otherwise), drawn like Dropout's mask from the node's own seed, so that
    every run of a check (planned, recomputed, float64, reference) sees the same values
    (stochastic depth in torchvision's EfficientNet exports). No gradient flows through."""

    def kernel(spec: OpSpec, args: Args) -> Outputs:
        x = args[0]
        assert x is not None
        dtype = DTYPES[spec.attr("dtype")] if spec.attr("dtype") is not None else x.dtype
        generator = torch.Generator().manual_seed(spec.seed)
        if normal:
            draw = torch.randn(tuple(x.shape), generator=generator, dtype=torch.float64)
            values = draw * float(spec.attr("scale", 1.0)) + float(spec.attr("mean", 0.0))
        else:
            low, high = float(spec.attr("low", 0.0)), float(spec.attr("high", 1.0))
            draw = torch.rand(tuple(x.shape), generator=generator, dtype=torch.float64)
            values = draw * (high - low) + low
        return (values.to(dtype=dtype, device=x.device),)

    return kernel


# --- Resize ------------------------------------------------------------------------------------


def _cubic(ratio: np.ndarray, a: float) -> np.ndarray:
    """The four cubic convolution coefficients (neighbours -1, 0, 1, 2) for each ratio."""
    r = ratio[:, None]
    d = np.concatenate([r + 1, r, 1 - r, 2 - r], axis=1)  # distances to the neighbours
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, far)


@dataclass(frozen=True)
class _Axis:
    """How one axis is resampled: ``indices`` (out, k) of the input and their ``weights``
    (None: nearest, k = 1); ``outside``: output positions a crop puts outside the input."""

    indices: np.ndarray
    weights: np.ndarray | None
    outside: np.ndarray | None


def _original(
    spec: OpSpec, size: int, out: int, scale: float, roi: tuple[float, float] | None
) -> np.ndarray:
    """Each output position's coordinate in the input (``coordinate_transformation_mode``,
    in float32 as onnxruntime computes it)."""
    mode = spec.attr("coordinate_transformation_mode", "half_pixel") if spec.opset >= 11 else ""
    x = np.arange(out, dtype=np.float32)
    s = np.float32(scale)
    if mode == "align_corners":
        return x * np.float32((size - 1) / (out - 1)) if out > 1 else np.zeros_like(x)
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / s - 0.5 if out > 1 else np.zeros_like(x)
    if mode == "half_pixel":
        return (x + 0.5) / s - 0.5
    if mode == "half_pixel_symmetric":
        offset = np.float32(size / 2 * (1 - out / (size * scale)))
        return offset + (x + 0.5) / s - 0.5
    if mode == "tf_crop_and_resize":
        assert roi is not None
        start, end = roi
        if out == 1:
            return np.full_like(x, 0.5 * (start + end) * (size - 1))
        return np.float32(start * (size - 1)) + x * np.float32(
            (end - start) * (size - 1) / (out - 1)
        )
    if mode in ("asymmetric", ""):
        return x / s
    raise spec.unsupported(f"coordinate_transformation_mode {mode!r}")


def _resize_axis(
    spec: OpSpec, size: int, out: int, scale: float, roi: tuple[float, float] | None
) -> _Axis:
    mode = spec.attr("mode", "nearest")
    coords = _original(spec, size, out, scale, roi)
    outside = None
    if spec.opset >= 11 and spec.attr("coordinate_transformation_mode") == "tf_crop_and_resize":
        outside = (coords < 0) | (coords > size - 1)
    if mode == "nearest":
        rounding = spec.attr("nearest_mode", "round_prefer_floor") if spec.opset >= 11 else ""
        floor = np.floor(coords)
        if rounding == "round_prefer_floor":
            index = np.where(coords - floor == 0.5, floor, np.floor(coords + 0.5))
        elif rounding == "round_prefer_ceil":
            index = np.floor(coords + 0.5)
        elif rounding == "floor":
            index = floor
        elif rounding == "ceil":
            index = np.ceil(coords)
        elif rounding == "":  # opset 10 (onnxruntime's "simple"): ceil when downsampling
            index = np.ceil(coords) if scale < 1 else np.trunc(coords)
        else:
            raise spec.unsupported(f"nearest_mode {rounding!r}")
        indices = np.clip(index, 0, size - 1).astype(np.int64)[:, None]
        return _Axis(indices, None, outside)
    floor = np.floor(coords)
    ratio = coords - floor
    if mode == "linear":
        offsets = np.arange(2)
        weights = np.stack([1 - ratio, ratio], axis=1)
    elif mode == "cubic":
        offsets = np.arange(-1, 3)
        weights = _cubic(ratio.astype(np.float64), float(spec.attr("cubic_coeff_a", -0.75)))
    else:
        raise spec.unsupported(f"Resize mode {mode!r}")
    neighbours = floor.astype(np.int64)[:, None] + offsets[None, :]
    if mode == "cubic" and spec.attr("exclude_outside", 0):
        weights = np.where((neighbours < 0) | (neighbours > size - 1), 0.0, weights)
        weights = weights / weights.sum(axis=1, keepdims=True)
    return _Axis(np.clip(neighbours, 0, size - 1), weights, outside)


def _resize_plan(spec: OpSpec, args: Args, shape: Sequence[int]) -> dict[int, tuple[int, float]]:
    """(output size, scale) of every axis a Resize/Upsample changes."""
    rank = len(shape)
    if spec.op_type == "Upsample" or spec.opset < 11:
        scales = list(spec.attr("scales")) if spec.opset < 9 else spec.floats(1, args)
        sizes = None
    else:
        scales = spec.floats(2, args) or None
        sizes = spec.ints(3, args) or None
    axes = spec.attr("axes") if spec.opset >= 18 else None
    axes = [_axis(a, rank) for a in axes] if axes is not None else list(range(rank))
    result: dict[int, tuple[int, float]] = {}
    if sizes is not None:
        policy = spec.attr("keep_aspect_ratio_policy", "stretch") if spec.opset >= 18 else "stretch"
        ratios = [sizes[i] / shape[a] for i, a in enumerate(axes)]
        if policy == "stretch":
            for i, a in enumerate(axes):
                result[a] = (sizes[i], ratios[i])
        else:
            common = min(ratios) if policy == "not_larger" else max(ratios)
            for a in axes:
                result[a] = (math.floor(shape[a] * common + 0.5), common)
    elif scales is not None:
        roi_values = spec.floats(1, args) if spec.opset >= 11 else None
        crop = spec.attr("coordinate_transformation_mode") == "tf_crop_and_resize"
        for i, a in enumerate(axes):
            extent = 1.0
            if crop and roi_values:
                extent = roi_values[len(axes) + i] - roi_values[i]
            result[a] = (math.floor(shape[a] * extent * scales[i]), scales[i])
    else:
        raise spec.unsupported("Resize needs scales or sizes")
    return result


def _resize(spec: OpSpec, args: Args) -> Outputs:
    """Resize (and the older Upsample): nearest, linear (N-linear) and cubic, separably one
    axis at a time as a gather of neighbours and their weights (the index and weight
    tables are computed on the host); differentiable in the data by autograd."""
    x = args[0]
    assert x is not None
    plan = _resize_plan(spec, args, list(x.shape))
    shrinks = any(out < x.shape[axis] for axis, (out, _) in plan.items())
    if spec.attr("antialias", 0) and spec.attr("mode", "nearest") != "nearest" and shrinks:
        raise spec.unsupported("antialiased downsampling")
    crop = spec.opset >= 11 and spec.attr("coordinate_transformation_mode") == "tf_crop_and_resize"
    roi_values = spec.floats(1, args) if crop else None
    axes = spec.attr("axes") if spec.opset >= 18 else None
    axes_list = [_axis(a, x.dim()) for a in axes] if axes is not None else list(range(x.dim()))
    outside: Tensor | None = None
    result = x
    for axis, (out, scale) in sorted(plan.items()):
        size = x.shape[axis]
        roi = None
        if crop:
            if not roi_values:
                raise spec.unsupported("tf_crop_and_resize without roi")
            i = axes_list.index(axis)
            roi = (roi_values[i], roi_values[len(axes_list) + i])
        elif out == size and scale == 1.0:
            continue
        table = _resize_axis(spec, size, out, scale, roi)
        index = torch.as_tensor(table.indices, device=x.device)
        picked = result.index_select(axis, index.reshape(-1))
        if table.weights is None:
            result = picked
        else:
            k = table.indices.shape[1]
            picked = picked.reshape(*result.shape[:axis], out, k, *result.shape[axis + 1 :])
            view = [1] * axis + [out, k] + [1] * (result.dim() - axis - 1)
            weights = torch.as_tensor(table.weights, dtype=x.dtype, device=x.device)
            result = (picked * weights.reshape(view)).sum(dim=axis + 1)
        if table.outside is not None:
            mask = torch.as_tensor(table.outside, device=x.device)
            mask = mask.reshape([1] * axis + [out] + [1] * (x.dim() - axis - 1))
            outside = mask if outside is None else outside | mask
    if outside is not None:
        fill = float(spec.attr("extrapolation_value", 0.0))
        result = torch.where(outside, torch.full((), fill, dtype=x.dtype, device=x.device), result)
    return (result,)


# --- recurrent layers ----------------------------------------------------------------------------

# Activations of RNN/GRU/LSTM by name, with whether they take alpha / beta and the defaults.
_RECURRENT_ACTIVATIONS: dict[str, tuple[int, float, float]] = {
    "Sigmoid": (0, 0.0, 0.0),
    "Tanh": (0, 0.0, 0.0),
    "Relu": (0, 0.0, 0.0),
    "Softsign": (0, 0.0, 0.0),
    "Softplus": (0, 0.0, 0.0),
    "LeakyRelu": (1, 0.01, 0.0),
    "ThresholdedRelu": (1, 1.0, 0.0),
    "Elu": (1, 1.0, 0.0),
    "HardSigmoid": (2, 0.2, 0.5),
    "ScaledTanh": (2, 1.0, 1.0),
    "Affine": (2, 1.0, 0.0),
}


def _activation(name: str, alpha: float, beta: float) -> Callable[[Tensor], Tensor]:
    functions: dict[str, Callable[[Tensor], Tensor]] = {
        "Sigmoid": torch.sigmoid,
        "Tanh": torch.tanh,
        "Relu": torch.relu,
        "Softsign": F.softsign,
        "Softplus": F.softplus,
        "LeakyRelu": lambda t: F.leaky_relu(t, alpha),
        "ThresholdedRelu": lambda t: torch.where(t > alpha, t, 0.0),
        "Elu": lambda t: F.elu(t, alpha),
        "HardSigmoid": lambda t: torch.clamp(alpha * t + beta, 0.0, 1.0),
        "ScaledTanh": lambda t: alpha * torch.tanh(beta * t),
        "Affine": lambda t: alpha * t + beta,
    }
    return functions[name]


def _recurrent_activations(
    spec: OpSpec, directions: int, defaults: Sequence[str]
) -> list[list[Callable[[Tensor], Tensor]]]:
    """Per direction, the operator's activation functions (``activations`` with
    ``activation_alpha``/``activation_beta`` consumed in order by those that take them)."""
    names = list(spec.attr("activations") or list(defaults) * directions)
    alphas = list(spec.attr("activation_alpha") or [])
    betas = list(spec.attr("activation_beta") or [])
    if len(names) != len(defaults) * directions:
        raise spec.unsupported(f"{len(names)} activations for {directions} direction(s)")
    functions = []
    for name in names:
        key = next((k for k in _RECURRENT_ACTIVATIONS if k.lower() == str(name).lower()), None)
        if key is None:
            raise spec.unsupported(f"activation {name!r}")
        takes, alpha, beta = _RECURRENT_ACTIVATIONS[key]
        if takes >= 1 and alphas:
            alpha = alphas.pop(0)
        if takes >= 2 and betas:
            beta = betas.pop(0)
        functions.append(_activation(key, alpha, beta))
    n = len(defaults)
    return [functions[d * n : (d + 1) * n] for d in range(directions)]


# ONNX's gate blocks in PyTorch's order: LSTM i, o, f, c -> i, f, c, o; GRU z, r, h -> r, z, h
_PYTORCH_GATES = {"RNN": [0], "GRU": [1, 0, 2], "LSTM": [0, 2, 3, 1]}
# Each operator's activations where it names none (ONNX's defaults, PyTorch's layers')
_DEFAULT_ACTIVATIONS = {
    "RNN": ["tanh"],
    "GRU": ["sigmoid", "tanh"],
    "LSTM": ["sigmoid", "tanh", "tanh"],
}


def _recurrent(spec: OpSpec, args: Args) -> Outputs:
    """RNN, GRU and LSTM (ONNX gate orders: GRU z, r, h; LSTM i, o, f, c): PyTorch's fused
    layer where the operator is one of PyTorch's (``_pytorch_layer``), as eager
    PyTorch runs ``nn.LSTM``; else one time step at a time in each direction, where
    ``sequence_lens`` freezes a sequence's state after its end and zeroes its outputs
    there. Both are differentiable by autograd."""
    op = spec.op_type
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    x, w, r = args[0], args[1], args[2]
    assert x is not None and w is not None and r is not None
    bias = args[3] if len(args) > 3 else None
    lens = args[4] if len(args) > 4 else None
    h0 = args[5] if len(args) > 5 else None
    c0 = args[6] if len(args) > 6 else None
    peep = args[7] if len(args) > 7 else None
    layout = spec.attr("layout", 0)
    if layout:
        x = x.transpose(0, 1)  # -> [seq, batch, input]
        h0 = h0.transpose(0, 1) if h0 is not None else None
        c0 = c0.transpose(0, 1) if c0 is not None else None
    direction = spec.attr("direction", "forward")
    directions = 2 if direction == "bidirectional" else 1
    hidden = r.shape[-1]
    seq, batch = x.shape[0], x.shape[1]
    clip = spec.attr("clip")
    acts = _recurrent_activations(spec, directions, _DEFAULT_ACTIVATIONS[op])

    layer = _pytorch_layer(spec, args)
    if layer is not None:
        y, y_h, y_c = _fused_recurrent(layer, spec, x, w, r, bias, h0, c0, directions)
        if layout:
            return y.permute(2, 0, 1, 3), y_h.transpose(0, 1), y_c.transpose(0, 1)
        return y, y_h, y_c

    def clipped(t: Tensor) -> Tensor:
        return torch.clamp(t, -clip, clip) if clip is not None else t

    ys, hs, cs = [], [], []
    for d in range(directions):
        reverse = direction == "reverse" or d == 1
        f, g = acts[d][0], acts[d][-1 if op != "LSTM" else 1]
        wd, rd = w[d], r[d]
        wb = bias[d, : gates * hidden] if bias is not None else None
        rb = bias[d, gates * hidden :] if bias is not None else None
        h = h0[d] if h0 is not None else x.new_zeros(batch, hidden)
        c = c0[d] if c0 is not None else x.new_zeros(batch, hidden)
        projected = F.linear(x, wd, wb)  # [seq, batch, gates * hidden]
        outputs: list[Tensor] = [x.new_zeros(0)] * seq
        for t in reversed(range(seq)) if reverse else range(seq):
            xt = projected[t]
            if op == "GRU":
                xz, xr, xh = xt.chunk(3, dim=-1)
                rz, rr, rh = rd.chunk(3, dim=0)
                bz, br, bh = rb.chunk(3) if rb is not None else (None, None, None)
                z = f(clipped(xz + F.linear(h, rz, bz)))
                reset = f(clipped(xr + F.linear(h, rr, br)))
                if spec.attr("linear_before_reset", 0):
                    candidate = g(clipped(xh + reset * F.linear(h, rh, bh)))
                else:
                    candidate = g(clipped(xh + F.linear(reset * h, rh, bh)))
                new_h, new_c = (1 - z) * candidate + z * h, c
            elif op == "LSTM":
                pre = xt + F.linear(h, rd, rb)
                pi, po, pf, pc = pre.chunk(4, dim=-1)
                peep_i, peep_o, peep_f = peep[d].chunk(3) if peep is not None else (0, 0, 0)
                i_gate = f(clipped(pi + peep_i * c))
                coupled = spec.attr("input_forget", 0)
                f_gate = 1 - i_gate if coupled else f(clipped(pf + peep_f * c))
                new_c = f_gate * c + i_gate * g(clipped(pc))
                o_gate = f(clipped(po + peep_o * new_c))
                new_h = o_gate * acts[d][2](new_c)
            else:
                new_h, new_c = f(clipped(xt + F.linear(h, rd, rb))), c
            if lens is not None:
                valid = (t < lens.to(torch.int64)).reshape(batch, 1)
                outputs[t] = torch.where(valid, new_h, 0.0)
                h, c = torch.where(valid, new_h, h), torch.where(valid, new_c, c)
            else:
                outputs[t], h, c = new_h, new_h, new_c
        ys.append(torch.stack(outputs))
        hs.append(h)
        cs.append(c)
    y = torch.stack(ys, dim=1)  # [seq, directions, batch, hidden]
    y_h, y_c = torch.stack(hs), torch.stack(cs)
    if layout:
        return y.permute(2, 0, 1, 3), y_h.transpose(0, 1), y_c.transpose(0, 1)
    return y, y_h, y_c


def _pytorch_layer(spec: OpSpec, args: Args) -> Callable[..., Any] | None:
    """PyTorch's fused layer for a recurrent operator that is one of PyTorch's layers
    (``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh``, ``torch.rnn_relu``), None for
    another: its default activations (an RNN's may be ReLU), no clip, no
    ``sequence_lens``, no peepholes or coupled input and forget gates, a GRU's reset
    applied after its linear map (``linear_before_reset``), forward or both directions,
    one floating type."""
    op = spec.op_type
    names = [str(n).lower() for n in spec.attr("activations") or []]
    directions = 2 if spec.attr("direction", "forward") == "bidirectional" else 1
    relu = op == "RNN" and names == ["relu"] * directions
    own = not names or names == _DEFAULT_ACTIVATIONS[op] * directions or relu
    tensors = [a for a in args if a is not None and a.is_floating_point()]
    pytorchs = (
        own
        and not spec.attr("activation_alpha")
        and not spec.attr("activation_beta")
        and spec.attr("clip") is None
        and spec.attr("direction", "forward") in ("forward", "bidirectional")
        and (len(args) <= 4 or args[4] is None)  # sequence_lens
        and (len(args) <= 7 or args[7] is None)  # peepholes
        and not spec.attr("input_forget", 0)
        and (op != "GRU" or bool(spec.attr("linear_before_reset", 0)))
        and len({t.dtype for t in tensors}) == 1
    )
    if not pytorchs:
        return None
    layers: dict[str, Callable[..., Any]] = {
        "LSTM": torch.lstm,
        "GRU": torch.gru,
        "RNN": torch.rnn_tanh,
    }
    return torch.rnn_relu if relu else layers[op]


def _fused_recurrent(
    layer: Callable[..., Any],
    spec: OpSpec,
    x: Tensor,
    w: Tensor,
    r: Tensor,
    bias: Tensor | None,
    h0: Tensor | None,
    c0: Tensor | None,
    directions: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """ONNX's Y [seq, directions, batch, hidden], Y_h and Y_c (an RNN's or GRU's: Y_h, not
    an output) of a recurrent layer PyTorch has, from its fused ``layer``
    (``_pytorch_layer``) with the gates reordered to PyTorch's."""
    op, hidden, seq, batch = spec.op_type, r.shape[-1], x.shape[0], x.shape[1]
    order, index = _PYTORCH_GATES[op], _gate_order(op, x.device)

    def reordered(t: Tensor) -> Tensor:  # gate blocks along the first axis
        blocks = t.reshape(len(order), hidden, *t.shape[1:])
        return blocks.index_select(0, index).reshape(t.shape)

    gates = len(order) * hidden
    params: list[Tensor] = []
    for d in range(directions):
        params += [reordered(w[d]), reordered(r[d])]
        if bias is not None:
            params += [reordered(bias[d, :gates]), reordered(bias[d, gates:])]
    h = h0 if h0 is not None else x.new_zeros(directions, batch, hidden)
    both, train = directions == 2, torch.is_grad_enabled()  # train: autograd keeps its state
    if op == "LSTM":
        c = c0 if c0 is not None else x.new_zeros(directions, batch, hidden)
        y, y_h, y_c = layer(x, (h, c), params, bias is not None, 1, 0.0, train, both, False)
    else:
        y, y_h = layer(x, h, params, bias is not None, 1, 0.0, train, both, False)
        y_c = y_h
    return y.view(seq, batch, directions, hidden).permute(0, 2, 1, 3), y_h, y_c


@cache
def _gate_order(op: str, device: torch.device) -> Tensor:
    """``_PYTORCH_GATES[op]`` as an index tensor on ``device``, made once: ``index_select``
    by it, and its gradient's ``index_add``, cost a fraction of indexing by a list (an
    advanced index, differentiated by an accumulating ``index_put``)."""
    return torch.tensor(_PYTORCH_GATES[op], device=device)


def _is_inf(spec: OpSpec, args: Args) -> Outputs:
    x = args[0]
    assert x is not None
    positive = (
        x == math.inf if spec.attr("detect_positive", 1) else torch.zeros_like(x, dtype=torch.bool)
    )
    negative = (
        x == -math.inf if spec.attr("detect_negative", 1) else torch.zeros_like(x, dtype=torch.bool)
    )
    return (positive | negative,)


def _reduce(
    fn: Callable[[Tensor, tuple[int, ...], bool], Tensor], axes_input_since: int
) -> Callable[[OpSpec, Args], Outputs]:
    def kernel(spec: OpSpec, args: Args) -> Outputs:
        x = args[0]
        assert x is not None
        dims = _reduced_dims(spec, args, x.dim(), axes_input_since)
        if dims is None:
            return (x,)
        return (fn(x, dims, bool(spec.attr("keepdims", 1))),)

    return kernel


def _reduced_dims(spec: OpSpec, args: Args, rank: int, since: int) -> tuple[int, ...] | None:
    """The axes a reduction reduces (``axes`` an input from opset ``since``), all where it
    names none; None where it names none and ``noop_with_empty_axes`` makes it the
    identity."""
    axes = _axes(spec, args, since)
    if not axes:
        if spec.attr("noop_with_empty_axes", 0):
            return None
        axes = list(range(rank))
    return tuple(_axis(a, rank) for a in axes)


def _arg(fn: Callable[..., Tensor]) -> Callable[[OpSpec, Args], Outputs]:
    def kernel(spec: OpSpec, args: Args) -> Outputs:
        x = args[0]
        assert x is not None
        axis = _axis(spec.attr("axis", 0), x.dim())
        keep = bool(spec.attr("keepdims", 1))
        if spec.attr("select_last_index", 0):
            flipped = fn(x.flip(axis), dim=axis, keepdim=keep)
            return (x.shape[axis] - 1 - flipped,)
        return (fn(x, dim=axis, keepdim=keep),)

    return kernel


def _einsum(spec: OpSpec, args: Args) -> Outputs:
    return (torch.einsum(spec.attr("equation"), *[a for a in args if a is not None]),)


KERNELS: dict[str, Callable[[OpSpec, Args], Outputs]] = {
    # elementwise
    "Add": _binary(torch.add),
    "Sub": _binary(torch.sub),
    "Mul": _binary(torch.mul),
    "Div": _binary(_div),
    "Pow": _binary(torch.pow),
    "Sum": _variadic(torch.add),
    "Mean": _mean,
    "Max": _variadic(torch.maximum),
    "Min": _variadic(torch.minimum),
    "Equal": _binary(torch.eq),
    "Less": _binary(torch.lt),
    "LessOrEqual": _binary(torch.le),
    "Greater": _binary(torch.gt),
    "GreaterOrEqual": _binary(torch.ge),
    "And": _binary(torch.logical_and),
    "Or": _binary(torch.logical_or),
    "Xor": _binary(torch.logical_xor),
    "Not": _unary(torch.logical_not),
    "IsNaN": _unary(torch.isnan),
    "IsInf": _is_inf,
    "Where": _where,
    "Relu": _unary(torch.relu),
    "Sigmoid": _unary(torch.sigmoid),
    "Tanh": _unary(torch.tanh),
    "Exp": _unary(torch.exp),
    "Log": _unary(torch.log),
    "Sqrt": _unary(torch.sqrt),
    "Abs": _unary(torch.abs),
    "Neg": _unary(torch.neg),
    "Reciprocal": _unary(torch.reciprocal),
    "Floor": _unary(torch.floor),
    "Ceil": _unary(torch.ceil),
    "Round": _unary(torch.round),
    "Sign": _unary(torch.sign),
    "Sin": _unary(torch.sin),
    "Cos": _unary(torch.cos),
    "Erf": _unary(torch.erf),
    "Softplus": _unary(F.softplus),
    "Softsign": _unary(F.softsign),
    "LeakyRelu": _leaky_relu,
    "Elu": _elu,
    "Selu": _selu,
    "HardSigmoid": _hard_sigmoid,
    "HardSwish": _hard_swish,
    "PRelu": _prelu,
    "Gelu": _gelu,
    GELU: _gelu,
    SILU: _silu,
    ROTARY: _rotary,
    UNBIND: _unbind,
    LAYOUT: _layout,
    "Clip": _clip,
    "Cast": _cast,
    "Softmax": _softmax_like(torch.softmax),
    "LogSoftmax": _softmax_like(torch.log_softmax),
    # linear algebra, convolution
    "MatMul": _binary(torch.matmul),
    MATMUL_ADD: _matmul_add,
    ATTENTION: _attention,
    "Gemm": _gemm,
    "Einsum": _einsum,
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    # pooling, normalization
    "MaxPool": _max_pool,
    "AveragePool": _average_pool,
    "GlobalAveragePool": _global_average_pool,
    "GlobalMaxPool": _global_max_pool,
    "BatchNormalization": _batch_norm,
    "InstanceNormalization": _instance_norm,
    "LayerNormalization": _layer_norm,
    LAYER_NORM: _layer_norm,
    RMS_NORM: _rms_norm,
    "LRN": _lrn,
    # shape, data movement
    "Reshape": _reshape,
    "Flatten": _flatten,
    "Transpose": _transpose,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Concat": _concat,
    "Split": _split,
    "Slice": _slice,
    "Gather": _gather,
    "GatherElements": _gather_elements,
    "Expand": _expand,
    "Tile": _tile,
    "Pad": _pad,
    "ConstantOfShape": _constant_of_shape,
    "Shape": _shape,
    "Size": _size,
    "Identity": _identity,
    "Dropout": _dropout,
    "RandomUniformLike": _random_like(normal=False),
    "RandomNormalLike": _random_like(normal=True),
    "Resize": _resize,
    "Upsample": _resize,
    # recurrent layers
    "RNN": _recurrent,
    "GRU": _recurrent,
    "LSTM": _recurrent,
    # reductions
    "ReduceMean": _reduce(lambda x, d, k: x.mean(dim=d, keepdim=k), 18),
    "ReduceSum": _reduce(lambda x, d, k: x.sum(dim=d, keepdim=k), 13),
    "ReduceMax": _reduce(lambda x, d, k: x.amax(dim=d, keepdim=k), 18),
    "ReduceMin": _reduce(lambda x, d, k: x.amin(dim=d, keepdim=k), 18),
    "ReduceProd": _reduce(lambda x, d, k: _prod(x, d, k), 18),
    "ReduceSumSquare": _reduce(lambda x, d, k: (x * x).sum(dim=d, keepdim=k), 18),
    "ReduceL2": _reduce(lambda x, d, k: (x * x).sum(dim=d, keepdim=k).sqrt(), 18),
    "ArgMax": _arg(torch.argmax),
    "ArgMin": _arg(torch.argmin),
}

# Operators whose gradient rules give each fixed input's gradient as a tensor of its own,
# of the input's shape and type, that nothing else holds (PyTorch's fused backward kernels,
# or autograd's where a rule falls back to it): a gradient buffer takes it unchecked.
FRESH_GRADIENTS = frozenset({"Conv", "ConvTranspose", "BatchNormalization"})

# Kernels that write their output into their first input, as eager PyTorch's in-place
# activations (``nn.ReLU(inplace=True)``, ReLU6) do: no output to allocate.
IN_PLACE_KERNELS: dict[str, Callable[[OpSpec, Args], Outputs]] = {
    "Relu": lambda spec, args: (torch.relu_(args[0]),),  # type: ignore[arg-type]
    "Clip": functools.partial(_clip, in_place=True),
}


def _prod(x: Tensor, dims: tuple[int, ...], keep: bool) -> Tensor:
    for dim in sorted(dims, reverse=True):
        x = x.prod(dim=dim, keepdim=keep)
    return x


def differentiable(spec: OpSpec, position: int) -> bool:
    """Whether input ``position`` of the operator can receive a gradient."""
    return differentiable_input(spec.op_type, position)


# --- vector-Jacobian products ----------------------------------------------------------------


def placeholder(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of ``shape`` that allocates nothing: a zero expanded with stride 0."""
    return torch.zeros((), dtype=dtype, device=device).expand(*shape)


@dataclass(slots=True)
class VjpCall:
    """One backward evaluation: inputs by position (placeholders where the gradient does
    not read them), the output when the gradient needs it, the upstream gradient of each
    output (None: zero), which input positions want a gradient, and what the forward kernel
    saved for it from these very inputs (``forward_and_saved``; None: take it again).
    Made at every backward step, so not frozen: a frozen dataclass's construction costs
    several times a plain one's."""

    spec: OpSpec
    args: Args
    output: Outputs | None
    grads: Sequence[Tensor | None]
    wanted: Sequence[bool]
    saved: Outputs | None = None

    @property
    def g(self) -> Tensor:
        grad = self.grads[0]
        assert grad is not None
        return grad

    def arg(self, position: int) -> Tensor:
        value = self.args[position] if position < len(self.args) else None
        assert value is not None
        return value

    def optional(self, position: int) -> Tensor | None:
        return self.args[position] if position < len(self.args) else None

    def only(self, *makers: Callable[[], Tensor] | None) -> Grads:
        """The gradient of each wanted position, evaluated lazily (makers by position)."""
        result: Grads = [None] * len(self.args)
        for position, make in enumerate(makers):
            if make is not None and position < len(self.wanted) and self.wanted[position]:
                result[position] = make()
        return result


Rule = Callable[[VjpCall], Grads]
# A backward node's rule with what it decides from the node alone made once: it takes the
# arguments, the output, the upstream gradients and what the forward saved.
Prepared = Callable[[Args, Outputs | None, Sequence[Tensor | None], Outputs | None], Grads]
Preparer = Callable[[OpSpec, Args, Sequence[bool]], Prepared | None]


def vjp(call: VjpCall) -> Grads:
    """The gradient for each input position (None where not wanted or zero)."""
    if not any(call.wanted):
        return [None] * len(call.args)
    for g in call.grads:  # a loop, not a generator: this runs at every backward step
        if g is not None:
            break
    else:
        return [None] * len(call.args)
    rule = VJP_RULES.get(call.spec.op_type)
    if rule is not None:
        return rule(call)
    if call.spec.op_type in OUTPUT_ONLY:
        raise call.spec.unsupported("no gradient from the output")
    return autograd_vjp(call)


def prepared_vjp(spec: OpSpec, args: Args, wanted: Sequence[bool]) -> Prepared:
    """``vjp`` for one backward node (``args``: its first evaluation's, for their shapes;
    ``wanted``: the positions it computes), with what the operator's rule decides from the
    node alone (attributes, shapes, wanted gradients) made once, where the rule has such a
    part (``PREPARED_RULES``): the executor evaluates the node at every step that computes
    it. Any other runs as ``vjp``."""
    prepare = PREPARED_RULES.get(spec.op_type)
    found = prepare(spec, args, wanted) if prepare is not None and any(wanted) else None
    if found is not None:
        return found

    def rule(
        args: Args, output: Outputs | None, grads: Sequence[Tensor | None], saved: Outputs | None
    ) -> Grads:
        return vjp(VjpCall(spec, args, output, grads, wanted, saved))

    return rule


def _from_prepared(prepare: Preparer) -> Rule:
    """A prepared rule as a plain one: prepared for this call, or through autograd where
    it has none."""

    def rule(call: VjpCall) -> Grads:
        prepared = prepare(call.spec, call.args, call.wanted)
        if prepared is None:
            return autograd_vjp(call)
        return prepared(call.args, call.output, call.grads, call.saved)

    return rule


def autograd_vjp(call: VjpCall) -> Grads:
    """Re-run the forward kernel under autograd and differentiate it."""
    wanted = [w and a is not None for a, w in zip(call.args, call.wanted, strict=True)]
    with torch.enable_grad():
        leaves = [
            a.detach().requires_grad_(True) if w and a is not None else a
            for a, w in zip(call.args, wanted, strict=True)
        ]
        outputs = run_forward(call.spec, leaves)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, call.grads, strict=False)
            if grad is not None and out.requires_grad
        ]
        targets = [leaf for leaf, w in zip(leaves, wanted, strict=True) if w and leaf is not None]
        if not pairs or not targets:
            return [None] * len(call.args)
        found = iter(
            torch.autograd.grad(
                [o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True
            )
        )
    return [next(found) if w else None for w in wanted]


# Closed forms from the output y and the upstream gradient g.
def _from_output(fn: Callable[[OpSpec, Tensor, Tensor], Tensor]) -> Rule:
    def rule(call: VjpCall) -> Grads:
        assert call.output is not None
        return call.only(lambda: fn(call.spec, call.output[0], call.g))  # type: ignore[index]

    return rule


def _softmax_grad(spec: OpSpec, y: Tensor, g: Tensor) -> Tensor:
    def grad(yy: Tensor, dim: int) -> Tensor:
        gg = g.reshape(yy.shape)
        return yy * (gg - (gg * yy).sum(dim=dim, keepdim=True))

    return _softmax_apply(spec, y, grad)


def _log_softmax_grad(spec: OpSpec, y: Tensor, g: Tensor) -> Tensor:
    def grad(yy: Tensor, dim: int) -> Tensor:
        gg = g.reshape(yy.shape)
        return gg - torch.exp(yy) * gg.sum(dim=dim, keepdim=True)

    return _softmax_apply(spec, y, grad)


# Closed forms that need only shapes (inputs may be placeholders).
def _add(call: VjpCall) -> Grads:
    g = call.g
    return call.only(
        lambda: g.sum_to_size(call.arg(0).shape), lambda: g.sum_to_size(call.arg(1).shape)
    )


def _sub(call: VjpCall) -> Grads:
    g = call.g
    return call.only(
        lambda: g.sum_to_size(call.arg(0).shape), lambda: (-g).sum_to_size(call.arg(1).shape)
    )


def _sum(call: VjpCall) -> Grads:
    g = call.g
    return [
        g.sum_to_size(a.shape) if w and a is not None else None
        for a, w in zip(call.args, call.wanted, strict=True)
    ]


def _mul(call: VjpCall) -> Grads:
    a, b, g = call.arg(0), call.arg(1), call.g
    return call.only(lambda: (g * b).sum_to_size(a.shape), lambda: (g * a).sum_to_size(b.shape))


def _div_grad(call: VjpCall) -> Grads:
    a, b, g = call.arg(0), call.arg(1), call.g
    if not (a.is_floating_point() and b.is_floating_point()):
        return [None] * len(call.args)
    return call.only(
        lambda: (g / b).sum_to_size(a.shape), lambda: (-g * a / (b * b)).sum_to_size(b.shape)
    )


def _reshape_grad(call: VjpCall) -> Grads:
    return call.only(lambda: call.g.reshape(call.arg(0).shape))


def _transpose_grad(call: VjpCall) -> Grads:
    g = call.g
    perm = call.spec.attr("perm") or list(reversed(range(g.dim())))
    return call.only(lambda: g.permute(_inverse(perm)))


def _concat_grad(call: VjpCall) -> Grads:
    g = call.g
    axis = _axis(call.spec.attr("axis"), g.dim())
    present = [a for a in call.args if a is not None]
    pieces = iter(torch.split(g, [a.shape[axis] for a in present], dim=axis))
    result: Grads = []
    for arg, want in zip(call.args, call.wanted, strict=True):
        piece = next(pieces) if arg is not None else None
        result.append(piece if want else None)
    return result


def _global_average_pool_grad(call: VjpCall) -> Grads:
    shape = call.arg(0).shape
    return call.only(lambda: (call.g / math.prod(shape[2:])).expand(shape))


def _identity_grad(call: VjpCall) -> Grads:
    return call.only(lambda: call.g)


def _dropout_grad(call: VjpCall) -> Grads:
    """The identity in inference mode; in training mode the upstream gradient through the
    same mask, scaled: the mask output when the backward node has it, else the same mask
    drawn again from the node's seed (``random_mask``), never inferred from zeros of the
    output (a zero input kept by the mask still passes its gradient)."""
    ratio = dropout_ratio(call.spec, call.args)
    if ratio is None or ratio == 0.0:
        return _identity_grad(call)
    g = call.g
    output = call.output
    if output is not None and len(output) > 1 and output[1].dtype == torch.bool:
        keep = output[1]
    else:
        keep = random_mask(call.spec, g.shape, ratio, g.device)
    scale = 1.0 / (1.0 - ratio)
    return call.only(lambda: torch.ops.aten.native_dropout_backward(g, keep.bool(), scale))


# Direct formulas for the heavy operators (no forward re-run).
def _weight_grad(a: Tensor, g: Tensor) -> Tensor:
    """dW of ``a @ W`` for a matrix ``W``: one product over the flattened batch."""
    return a.reshape(-1, a.shape[-1]).t() @ g.reshape(-1, g.shape[-1])


def _foldable(g: Tensor) -> Tensor:
    """An upstream gradient of three or more axes made contiguous where it is not (a
    layout change's gradient: a transposed view), once for the products and the sum that
    read it: PyTorch multiplies a view whose batch does not flatten batch by batch against
    the matrix broadcast (``bmm``), and each reshape would copy it again."""
    return g.contiguous() if g.dim() > 2 and not g.is_contiguous() else g


def _matmul_grad(call: VjpCall) -> Grads:
    a, b, g = call.arg(0), call.arg(1), call.g
    if a.dim() < 2 or b.dim() < 2:
        return autograd_vjp(call)
    if b.dim() == 2:
        g = _foldable(g)

    def grad_b() -> Tensor:
        if b.dim() == 2 and a.dim() > 2:  # a weight
            return _weight_grad(a, g)
        return (a.transpose(-1, -2) @ g).sum_to_size(b.shape)

    return call.only(lambda: (g @ b.transpose(-1, -2)).sum_to_size(a.shape), grad_b)


def _matmul_add_grad(call: VjpCall) -> Grads:
    """``Linear``'s backward: dA = g W^T, dW = A^T g (its transpose, g^T A, with
    ``transB``) and dB = g summed over the batch, each one product or reduction over the
    flattened leading dimensions."""
    a, w, g = call.arg(0), call.arg(1), _foldable(call.g)
    if call.spec.attr("transB", 0):
        return call.only(
            lambda: g @ w,
            lambda: _weight_grad(g, a),
            lambda: g.reshape(-1, g.shape[-1]).sum(0),
        )
    return call.only(
        lambda: g @ w.t(),
        lambda: _weight_grad(a, g),
        lambda: g.reshape(-1, g.shape[-1]).sum(0),
    )


def _attention_grad(call: VjpCall) -> Grads:
    """Attention's backward by PyTorch's fused kernel where ``remat.ops.pytorch_attention_
    backward`` says so and PyTorch has one for these operands: from the output and the
    log-sum-exp the forward kernel saved (``_attention``), or else with the forward run
    again; the closed form otherwise, from the weights the forward node kept where it kept
    them (``keeps_weights``)."""
    if keeps_weights(call.spec) and call.output is not None:
        return attention_grad_closed_form(call, call.output[1])
    shapes = [tuple(t.shape) for t in call.args if t is not None]
    mask_wanted = len(call.wanted) > 3 and call.wanted[3] and call.optional(3) is not None
    if pytorch_attention_backward(shapes, mask_wanted):
        if call.saved is not None and call.output is not None:
            return attention_grad_from_saved(call)
        found = attention_grad_by_pytorch(call)
        if found is not None:
            return found
    return attention_grad_closed_form(call)


def attention_grad_from_saved(call: VjpCall) -> Grads:
    """Attention's backward by PyTorch's fused CPU kernel from the forward's output and the
    log-sum-exp its kernel saved (``call.saved``), as autograd runs it after eager PyTorch's
    forward: it recomputes the weights block by block and holds no score matrix."""
    a, b, v, mask = call.arg(0), call.arg(1), call.arg(2), call.optional(3)
    assert call.output is not None and call.saved is not None
    scale = float(call.spec.attr("scale", 1.0))
    causal = bool(call.spec.attr("causal", 0))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        call.g, a, _unit_stride(b.transpose(-1, -2)), v, call.output[0], call.saved[0], 0.0,
        causal, attn_mask=mask, scale=scale,
    )  # fmt: skip
    return call.only(lambda: dq, lambda: dk.transpose(-1, -2), lambda: dv)


def attention_grad_by_pytorch(call: VjpCall) -> Grads | None:
    """Attention's backward as eager PyTorch computes it: ``scaled_dot_product_attention``
    again under autograd, the keys given unit stride so that its fused kernel takes them,
    then that kernel's backward, which recomputes the weights block by block and holds no
    score matrix. None where PyTorch would take its math path for these operands."""
    a, b, v, mask = call.arg(0), call.arg(1), call.arg(2), call.optional(3)
    scale = float(call.spec.attr("scale", 1.0))
    wanted = [position < len(call.wanted) and call.wanted[position] for position in range(3)]
    q, k, vv = a.detach(), _unit_stride(b.detach().transpose(-1, -2)), v.detach()
    leaves = [q, k, vv]
    causal = bool(call.spec.attr("causal", 0))
    with torch.enable_grad():
        for leaf, want in zip(leaves, wanted, strict=True):
            leaf.requires_grad_(want)
        if _fused_choice(q, k, vv, mask, causal, scale) == SDPBackend.MATH.value:
            return None
        out = F.scaled_dot_product_attention(
            q, k, vv, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=_grouped(q, k)
        )
        targets = [leaf for leaf, want in zip(leaves, wanted, strict=True) if want]
        found = iter(torch.autograd.grad(out, targets, call.g))
    grads: Grads = [next(found) if want else None for want in wanted]
    grads += [None] * (len(call.args) - 3)
    if grads[1] is not None:  # the keys' gradient, as B's
        grads[1] = grads[1].transpose(-1, -2)
    return grads


def attention_grad_closed_form(call: VjpCall, weights: Tensor | None = None) -> Grads:
    """Attention's backward from its inputs and its ``weights`` P = softmax(A B s + M)
    (None: recomputed, as ``scaled_dot_product_attention``'s backward does): dV = P^T g;
    dS = P * (dP - rowsum(dP * P)) with dP = g V^T; dA = dS B^T s, dB = A^T dS s, dM = dS
    summed to M's shape. Keys and values of fewer heads (``_grouped``) are repeated for
    their groups of queries, and their gradients summed over each group."""
    a, b, v, g = call.arg(0), call.arg(1), call.arg(2), call.g
    mask = call.optional(3)
    b, v, heads = _repeated_heads(a, b, v)
    scale = float(call.spec.attr("scale", 1.0))
    # Two score-sized buffers at most beside the inputs and P: dP, made dS in place, and
    # its product with P.
    causal = bool(call.spec.attr("causal", 0))
    p = _weights(a, b, mask, scale, causal) if weights is None else weights
    wanted = call.wanted
    ds = None
    if any(wanted[i] for i in (0, 1, 3) if i < len(wanted)):
        dp = torch.matmul(g, v.transpose(-1, -2))
        ds = dp.sub_((dp * p).sum(dim=-1, keepdim=True)).mul_(p)

    def scaled(t: Tensor) -> Tensor:
        return t.mul_(scale) if scale != 1.0 else t

    def summed(t: Tensor) -> Tensor:  # over each group of query heads
        return t.unflatten(-3, (heads, -1)).sum(-3) if heads else t

    return call.only(
        lambda: scaled(torch.matmul(ds, b.transpose(-1, -2))),  # type: ignore[arg-type]
        lambda: summed(scaled(torch.matmul(a.transpose(-1, -2), ds))),  # type: ignore[arg-type]
        lambda: summed(torch.matmul(p.transpose(-1, -2), g)),
        lambda: ds.sum_to_size(mask.shape),  # type: ignore[union-attr]
    )


def _gemm_grad(call: VjpCall) -> Grads:
    spec, g = call.spec, call.g
    alpha, beta = float(spec.attr("alpha", 1.0)), float(spec.attr("beta", 1.0))
    trans_a, trans_b = spec.attr("transA", 0), spec.attr("transB", 0)
    a = call.arg(0).t() if trans_a else call.arg(0)  # the operands as multiplied
    b = call.arg(1).t() if trans_b else call.arg(1)
    c = call.optional(2)
    scaled = g if alpha == 1.0 else alpha * g
    return call.only(
        # dA' = g B'^T, transposed back (as B' g^T) when A was transposed; likewise for B.
        lambda: b @ scaled.t() if trans_a else scaled @ b.t(),
        lambda: scaled.t() @ a if trans_b else a.t() @ scaled,
        lambda: (g if beta == 1.0 else beta * g).sum_to_size(c.shape),  # type: ignore[union-attr]
    )


def _prepared_batch_norm_grad(spec: OpSpec, args: Args, wanted: Sequence[bool]) -> Prepared | None:
    """Training mode: PyTorch's fused backward from the batch's statistics, those the
    forward kernel saved (``saved``) or else taken again from the input by PyTorch's
    forward kernel (whose output is dropped; a strided ``var_mean`` over the batch and
    spatial axes was slower), rather than the whole forward re-run under autograd; only the
    output ``Y`` carries a gradient. Inference mode: through autograd (None)."""
    if not batch_norm_training(spec) or len(args) < 2 or args[1] is None:
        return None
    eps = spec.attr("epsilon", 1e-5)
    count = len(wanted)
    mask = [count > 0 and wanted[0], count > 1 and wanted[1], count > 2 and wanted[2]]
    positions = [p for p in range(min(3, len(args))) if mask[p]]
    size = len(args)

    def rule(
        args: Args, output: Outputs | None, grads: Sequence[Tensor | None], saved: Outputs | None
    ) -> Grads:
        x, scale, g = args[0], args[1], grads[0]
        if g is None:  # a gradient for the statistics alone
            return autograd_vjp(VjpCall(spec, args, output, grads, wanted, saved))
        assert x is not None and scale is not None
        if saved is not None:
            batch_mean, inv_std = saved
        else:
            _, batch_mean, inv_std = torch.native_batch_norm(
                x, scale, None, None, None, True, 0.0, eps
            )
        computed = torch.ops.aten.native_batch_norm_backward(
            g, x, scale, None, None, batch_mean, inv_std, True, eps, mask
        )
        found: Grads = [None] * size
        for position in positions:
            found[position] = computed[position]
        return found

    return rule


def _layer_norm_grad(call: VjpCall) -> Grads:
    """PyTorch's fused backward (``native_layer_norm_backward``) from the statistics the
    forward kernel saved (``call.saved``) or else taken again by PyTorch's forward kernel,
    rather than the whole forward re-run under autograd, where only the output ``Y``
    carries a gradient and the scale and bias have the normalised shape; otherwise through
    autograd."""
    spec, x, g = call.spec, call.arg(0), call.grads[0]
    scale, bias = call.optional(1), call.optional(2)
    shape = list(x.shape[_axis(spec.attr("axis", -1), x.dim()) :])
    if (
        g is None
        or any(other is not None for other in call.grads[1:])
        or not _normalised_shape(scale, bias, shape)
    ):
        return autograd_vjp(call)
    if call.saved is not None:
        mean, rstd = call.saved
    else:
        eps = spec.attr("epsilon", 1e-5)
        _, mean, rstd = torch.native_layer_norm(x, shape, scale, bias, eps)
    wanted = list(call.wanted) + [False] * (3 - len(call.wanted))
    mask = [wanted[0], wanted[1], bias is not None and wanted[2]]
    grads = torch.ops.aten.native_layer_norm_backward(g, x, shape, mean, rstd, scale, bias, mask)
    found = [grad if m else None for grad, m in zip(grads, mask, strict=True)]
    return (found + [None] * len(call.args))[: len(call.args)]


def _prepared_conv_grad(transposed: bool) -> Preparer:
    """PyTorch's fused backward (``convolution_backward``) with the node's window, groups
    and wanted gradients bound; a convolution whose padding is not symmetric: through
    autograd (None)."""

    def prepare(spec: OpSpec, args: Args, wanted: Sequence[bool]) -> Prepared | None:
        x, w = args[0], args[1]
        assert x is not None and w is not None
        bias = args[2] if len(args) > 2 else None
        group = spec.attr("group", 1)
        if transposed:
            t = _transposed(spec, x, w)
            symmetric, strides, dilations = t.begins == t.ends, t.strides, t.dilations
            padding, output_padding = t.begins, t.output_padding
            bias_size = w.shape[1] * group
        else:
            win = _window(spec, x, spec.attr("kernel_shape") or w.shape[2:])
            symmetric, strides, dilations = win.symmetric, win.strides, win.dilations
            padding, output_padding = win.begins, [0] * len(win.begins)
            bias_size = w.shape[0]
        if not symmetric:
            return None
        count = len(wanted)
        mask = [
            count > 0 and wanted[0],
            count > 1 and wanted[1],
            bias is not None and count > 2 and wanted[2],
        ]
        bias_sizes = [bias_size] if bias is not None else None
        size = len(args)

        def rule(
            args: Args,
            output: Outputs | None,
            grads: Sequence[Tensor | None],
            saved: Outputs | None,
        ) -> Grads:
            g = grads[0]
            if g is None:
                return [None] * size
            computed = torch.ops.aten.convolution_backward(
                g,
                args[0],
                args[1],
                bias_sizes,
                strides,
                padding,
                dilations,
                transposed,
                output_padding,
                group,
                mask,
            )
            found = [
                computed[0] if mask[0] else None,
                computed[1] if mask[1] else None,
                computed[2] if mask[2] else None,
            ]
            return found[:size]

        return rule

    return prepare


def _max_pool_grad(call: VjpCall) -> Grads:
    """Each output element's gradient to the input element it took: the argmax, which the
    forward kernel gave beside its values (the model's ``Indices`` output, ONNX's indices,
    or the argmax a training graph keeps: ``remat.training.kept_bytes``, PyTorch's per
    plane where torch pooled the input itself); the input is a shape only. PyTorch's
    argmax on the host goes to PyTorch's backward kernel; elsewhere the gradient is
    scattered to it (on CUDA that kernel may make the input placeholder contiguous, an
    allocation of the input's size that no cost table holds)."""
    assert call.output is not None and len(call.output) > 1, "MaxPool without its argmax"
    spec, x, g, indices = call.spec, call.arg(0), call.g, call.output[1]
    at = _MaxPoolWindow.of(spec, x)
    per_plane = at.per_plane(spec)
    if per_plane and x.device.type == "cpu" and x.dim() - 2 in _MAX_POOL_BACKWARD:
        backward = _MAX_POOL_BACKWARD[x.dim() - 2]
        return call.only(lambda: backward(g, x, *at.torch_window, indices))

    def grad() -> Tensor:
        planes = (indices if per_plane else indices - _plane_starts(x)).flatten(2)
        dx = torch.zeros(x.shape, dtype=g.dtype, device=g.device)
        dx.flatten(2).scatter_add_(2, planes, g.flatten(2))
        return dx

    return call.only(grad)


def _clip_grad(call: VjpCall) -> Grads:
    """From the output, through where it is strictly inside the bounds, as PyTorch
    differentiates ``hardtanh`` (ReLU6): its kernel, one pass. The input is not read, so
    that it can be freed once the output is computed, as eager PyTorch's in-place ReLU6
    frees it."""
    spec, g = call.spec, call.g
    assert call.output is not None
    y = call.output[0]
    low, high = _clip_bounds(spec, call.args)
    if low is None and high is None:
        return call.only(lambda: g)
    below, above = _in_type(low, y.dtype, -math.inf), _in_type(high, y.dtype, math.inf)
    return call.only(lambda: torch.ops.aten.hardtanh_backward(g, y, below, above))


@functools.lru_cache(maxsize=64)
def _in_type(bound: float | None, dtype: torch.dtype, unbounded: float) -> float:
    """``bound`` as ``dtype`` holds it (None: ``unbounded``): the output's values at a
    bound, which PyTorch's kernel compares in a wider type (0.1 in bfloat16 is above 0.1)."""
    if bound is None:
        return unbounded
    return float(torch.tensor(bound, dtype=dtype).item())


def _hard_swish_grad(call: VjpCall) -> Grads:
    """d/dx x*clamp(x/6 + 1/2, 0, 1): 0 below -3, x/3 + 1/2 on [-3, 3], 1 above; PyTorch's
    ``hardswish_backward``, one pass."""
    x, g = call.arg(0), call.g
    return call.only(lambda: torch.ops.aten.hardswish_backward(g, x))


def _hard_sigmoid_grad(call: VjpCall) -> Grads:
    """d/dx clamp(alpha x + beta, 0, 1): alpha where the line is inside (0, 1), else 0."""
    x, g = call.arg(0), call.g
    if call.spec.pytorch_hard_sigmoid:  # PyTorch's own line: its kernel, one pass
        return call.only(lambda: torch.ops.aten.hardsigmoid_backward(g, x))
    alpha, beta = float(call.spec.attr("alpha", 0.2)), float(call.spec.attr("beta", 0.5))
    line = alpha * x + beta
    inside = (line > 0) & (line < 1)
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    return call.only(lambda: torch.where(inside, g * alpha, zero))


def _where_grad(call: VjpCall) -> Grads:
    """The condition routes the gradient; the branches are shapes only."""
    cond, g = call.arg(0), call.g
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    return call.only(
        None,
        lambda: torch.where(cond, g, zero).sum_to_size(call.arg(1).shape),
        lambda: torch.where(cond, zero, g).sum_to_size(call.arg(2).shape),
    )


def _expand_grad(call: VjpCall) -> Grads:
    """A sum over the broadcast dimensions: the input's shape only."""
    return call.only(lambda: call.g.sum_to_size(call.arg(0).shape))


def _gather_elements_grad(call: VjpCall) -> Grads:
    """The gradient scattered back to where the indices picked it (data: shape only)."""
    data, indices, g = call.arg(0), call.arg(1), call.g
    axis = _axis(call.spec.attr("axis", 0), data.dim())
    index = indices.long()
    index = torch.where(index < 0, index + data.shape[axis], index)
    return call.only(
        lambda: torch.zeros(data.shape, dtype=g.dtype, device=g.device).scatter_add_(axis, index, g)
    )


def _average_pool_grad(call: VjpCall) -> Grads:
    """A 2-D ``AveragePool``'s, where PyTorch's pooling takes its window as it is
    (``_average_pool``): PyTorch's backward kernel, which reads the input's shape alone;
    other windows are differentiated by autograd."""
    spec, x = call.spec, call.arg(0)
    win = _window(spec, x)
    if x.dim() != 4 or not _pooled_as_is(win):
        return autograd_vjp(call)
    ceil = bool(spec.attr("ceil_mode", 0))
    include = bool(spec.attr("count_include_pad", 0))
    return call.only(
        lambda: torch.ops.aten.avg_pool2d_backward(
            call.g, x, win.kernel, win.strides, win.begins, ceil, include, None
        )
    )


def _pad_grad(call: VjpCall) -> Grads:
    """A constant ``Pad``'s: the upstream gradient with the padding cut off again (and
    zeros where the pad cropped); other modes are differentiated by autograd."""
    mode, torch_pad, _ = _pad_of(call.spec, call.args, call.arg(0).dim())
    if mode != "constant":
        return autograd_vjp(call)
    return call.only(lambda: F.pad(call.g, [-p for p in torch_pad]))


def _reduce_mean_grad(call: VjpCall) -> Grads:
    """``ReduceMean``'s: the upstream gradient spread evenly over the elements each mean
    took (the input is a shape only), instead of the forward re-run under autograd."""
    shape, g = call.arg(0).shape, call.g
    reduced = _reduced_dims(call.spec, call.args, len(shape), 18)
    if reduced is None:
        return call.only(lambda: g)
    dims = sorted(set(reduced))
    count = math.prod(shape[d] for d in dims)

    def spread() -> Tensor:
        up = g
        if not call.spec.attr("keepdims", 1):
            for d in dims:
                up = up.unsqueeze(d)
        return up.div(count).expand(shape).contiguous()

    return call.only(spread)


def _gather_grad(call: VjpCall) -> Grads:
    """The gradient added back at the picked positions along the axis (data: shape only),
    as one ``index_add_`` instead of the forward re-run under autograd."""
    data, indices, g = call.arg(0), call.arg(1), call.g
    axis = _axis(call.spec.attr("axis", 0), data.dim())
    if (index := _one_index(call.spec, call.args)) is not None:

        def sliced() -> Tensor:
            grad = torch.zeros(data.shape, dtype=g.dtype, device=g.device)
            grad.select(axis, index).copy_(g)
            return grad

        return call.only(sliced)
    size = data.shape[axis]
    flat = indices.reshape(-1).long()
    flat = torch.where(flat < 0, flat + size, flat)
    picked = g.reshape(*data.shape[:axis], flat.numel(), *data.shape[axis + 1 :])
    return call.only(
        lambda: torch.zeros(data.shape, dtype=g.dtype, device=g.device).index_add_(
            axis, flat, picked
        )
    )


def _slice_grad(call: VjpCall) -> Grads:
    """``Slice``'s: the gradient written into zeros of the input's shape where the slice
    took its elements (the input is a shape only); a slice with a negative step is
    differentiated by autograd."""
    shape, g = call.arg(0).shape, call.g
    ranges = _slice_ranges(call.spec, call.args, shape)
    if any(stride < 0 for _, (_, _, stride) in ranges):
        return autograd_vjp(call)
    index = [slice(None)] * len(shape)
    for dim, (begin, stop, stride) in ranges:
        index[dim] = slice(begin, stop, stride)

    def scattered() -> Tensor:
        grad = torch.zeros(shape, dtype=g.dtype, device=g.device)
        grad[tuple(index)] = g
        return grad

    return call.only(scattered)


def _split_grad(call: VjpCall) -> Grads:
    """``Split``'s: the parts' gradients concatenated along the axis (zeros for a part no
    gradient flows to; the input is a shape only)."""
    shape = call.arg(0).shape
    axis = _axis(call.spec.attr("axis", 0), len(shape))
    like = next(g for g in call.grads if g is not None)

    def joined() -> Tensor:
        sizes = _split_sizes(call.spec, call.args, shape[axis])
        parts = [
            torch.zeros(
                (*shape[:axis], size, *shape[axis + 1 :]), dtype=like.dtype, device=like.device
            )
            if g is None
            else g
            for g, size in zip(call.grads, sizes, strict=True)
        ]
        return torch.cat(parts, dim=axis)

    return call.only(joined)


def _layout_grad(call: VjpCall) -> Grads:
    """``FusedLayout``'s: the upstream gradient through the steps undone in reverse order,
    each reshape back to the shape before it, each transpose by the inverse permutation
    (the input is a shape only)."""
    steps = call.spec.layout_steps
    shapes = []  # the shape before each step
    shape = tuple(call.arg(0).shape)
    for transpose, dims in steps:
        shapes.append(shape)
        shape = tuple(shape[d] for d in dims) if transpose else dims

    def undone() -> Tensor:
        g = call.g
        for (transpose, dims), before in zip(reversed(steps), reversed(shapes), strict=True):
            g = g.permute(_inverse(dims)) if transpose else g.reshape(before)
        return g

    return call.only(undone)


def _inverse(perm: Sequence[int]) -> list[int]:
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return inverse


def _unbind_grad(call: VjpCall) -> Grads:
    """``FusedUnbind``'s: the parts' gradients stacked along the axis into one tensor of the
    input's shape (zeros for a part no gradient flows to; the input is a shape only)."""
    shape, axis = call.arg(0).shape, int(call.spec.attr("axis", 0))
    part = (*shape[:axis], *shape[axis + 1 :])
    like = next(g for g in call.grads if g is not None)

    def stacked() -> Tensor:
        parts, zeros = [], None  # zeros made only where a part has no gradient
        for g in call.grads:
            if g is None:
                if zeros is None:
                    zeros = torch.zeros(part, dtype=like.dtype, device=like.device)
                g = zeros
            parts.append(g)
        return torch.stack(parts, dim=axis)

    return call.only(stacked)


def _gelu_grad(call: VjpCall) -> Grads:
    """PyTorch's ``gelu_backward``, from the input: ONNX's ``Gelu`` and
    ``remat.onnx_fusion``'s ``FusedGelu``."""
    approximate = call.spec.attr("approximate", "none")
    return call.only(
        lambda: torch.ops.aten.gelu_backward(call.g, call.arg(0), approximate=approximate)
    )


def _rms_norm_grad(call: VjpCall) -> Grads:
    """``y = n w`` with ``n = x r`` and ``r = (mean(x^2) + eps)^-1/2`` over the normalised
    axes: ``dx = r (g w - n mean(g w n))``, ``dw = g n`` summed to the weight's shape; ``r``
    as the forward kernel saved it (``_second_output``), else from the input."""
    spec, x_in, weight, g = call.spec, call.arg(0), call.arg(1), call.g
    x = x_in.to(g.dtype)  # the forward's wider type (``_rms_norm``)
    dims = tuple(range(_axis(spec.attr("axis", -1), x.dim()), x.dim()))
    if call.saved is not None:
        r = call.saved[0]
    else:
        r = torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + spec.attr("epsilon", 1e-6))
    n, gw = x * r, g * weight
    return call.only(
        lambda: (r * (gw - n * (gw * n).mean(dim=dims, keepdim=True))).to(x_in.dtype),
        lambda: (g * n).sum_to_size(weight.shape).to(weight.dtype),
    )


def _rotary_grad(call: VjpCall) -> Grads:
    """``FusedRotary`` (``_rotary``): ``dx = g cos + concat(g2 sin2, -g1 sin1)`` by halves
    of the last axis, as the forward; ``dcos = g x`` and ``dsin = g concat(-x2, x1)``
    summed to their shapes."""
    cos, sin, g = call.arg(1), call.arg(2), call.g
    half = g.shape[-1] // 2

    def dx() -> Tensor:
        sin1, sin2 = _halves(sin, half)
        found = g * cos
        found[..., :half].addcmul_(g[..., half:], sin2)
        found[..., half:].addcmul_(g[..., :half], sin1, value=-1)
        return found

    def dsin() -> Tensor:
        x = call.arg(0)
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (g * rotated).sum_to_size(sin.shape)

    return call.only(dx, lambda: (g * call.arg(0)).sum_to_size(cos.shape), dsin)


def _silu_grad(call: VjpCall) -> Grads:
    """PyTorch's ``silu_backward``, from the input (``remat.onnx_fusion``'s ``FusedSilu``)."""
    return call.only(lambda: torch.ops.aten.silu_backward(call.g, call.arg(0)))


# Rules whose decisions from the node alone are made once per node (``prepared_vjp``).
PREPARED_RULES: dict[str, Preparer] = {
    "Conv": _prepared_conv_grad(False),
    "ConvTranspose": _prepared_conv_grad(True),
    "BatchNormalization": _prepared_batch_norm_grad,
}


VJP_RULES: dict[str, Rule] = {
    "Relu": _from_output(lambda s, y, g: torch.ops.aten.threshold_backward(g, y, 0)),
    "Sigmoid": _from_output(lambda s, y, g: torch.ops.aten.sigmoid_backward(g, y)),
    "Tanh": _from_output(lambda s, y, g: torch.ops.aten.tanh_backward(g, y)),
    "Exp": _from_output(lambda s, y, g: g * y),
    "Sqrt": _from_output(lambda s, y, g: g / (2 * y)),
    "Softmax": _from_output(_softmax_grad),
    "LogSoftmax": _from_output(_log_softmax_grad),
    "Dropout": _dropout_grad,
    "Clip": _clip_grad,
    "HardSwish": _hard_swish_grad,
    "HardSigmoid": _hard_sigmoid_grad,
    "Where": _where_grad,
    "Expand": _expand_grad,
    "Neg": lambda call: call.only(lambda: torch.neg(call.g)),
    "Pad": _pad_grad,
    "AveragePool": _average_pool_grad,
    "ReduceMean": _reduce_mean_grad,
    "Gather": _gather_grad,
    "GatherElements": _gather_elements_grad,
    "Add": _add,
    "Sub": _sub,
    "Sum": _sum,
    "Mul": _mul,
    "Div": _div_grad,
    "Reshape": _reshape_grad,
    "Flatten": _reshape_grad,
    "Squeeze": _reshape_grad,
    "Unsqueeze": _reshape_grad,
    "Transpose": _transpose_grad,
    "Identity": _identity_grad,
    "Concat": _concat_grad,
    "Split": _split_grad,
    "Slice": _slice_grad,
    "GlobalAveragePool": _global_average_pool_grad,
    "MaxPool": _max_pool_grad,
    "MatMul": _matmul_grad,
    MATMUL_ADD: _matmul_add_grad,
    ATTENTION: _attention_grad,
    "Gemm": _gemm_grad,
    # the prepared rules, prepared for each call
    **{op: _from_prepared(prepare) for op, prepare in PREPARED_RULES.items()},
    "LayerNormalization": _layer_norm_grad,
    LAYER_NORM: _layer_norm_grad,
    RMS_NORM: _rms_norm_grad,
    ROTARY: _rotary_grad,
    "Gelu": _gelu_grad,
    GELU: _gelu_grad,
    SILU: _silu_grad,
    UNBIND: _unbind_grad,
    LAYOUT: _layout_grad,
}
# Operators whose gradient the training graph computes from their output alone.
OUTPUT_ONLY = frozenset(op for op, needs in GRADIENT_NEEDS.items() if needs is Needs.OUTPUT)
