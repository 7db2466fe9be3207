"""A zoo of small test and demo networks, built with ``onnx.helper``.

Every builder returns a valid ``onnx.ModelProto`` (it passes ``onnx.checker.check_model``
and strict shape inference) whose weights are real float32 initializers filled with
small random numbers from a seeded generator, so the result is deterministic.

The leading (batch) dimension of every graph input is the symbolic dim ``"N"`` unless
``batch`` is given. Default sizes are small enough to build in well under a second, and
chosen so that activations outweigh parameters at batch >= 4 (what memory-budget
experiments need).

Also here: inputs that ingestion must reject or treat specially (``truncated_bytes``,
``checker_failing_model``, ``no_operator_model``, ``symbolic_model``), and networks that
others exported: the ONNX model zoo's CNNs that the onnx package ships (``onnx_zoo``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "ZOO",
    "chain",
    "checker_failing_model",
    "large",
    "mobilenet_v1",
    "no_operator_model",
    "old_style_model",
    "onnx_zoo",
    "resnet18",
    "symbolic_model",
    "transformer_block",
    "truncated_bytes",
    "unet",
    "vgg16",
]

BATCH_DIM = "N"
_FLOAT = TensorProto.FLOAT


class _Builder:
    """Accumulates nodes and initializers; hands out unique node and tensor names.

    A node's (first) output tensor has the same name as the node, so graphs read well.
    """

    def __init__(self, name: str, seed: int = 0) -> None:
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.rng = np.random.default_rng(seed)
        self._counts: dict[str, int] = {}
        self._used: set[str] = set()

    # -- names ---------------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        """A name not used before in this graph: ``prefix``, ``prefix_1``, ..."""
        n = self._counts.get(prefix, 0)
        name = prefix if n == 0 else f"{prefix}_{n}"
        while name in self._used:
            n += 1
            name = f"{prefix}_{n}"
        self._counts[prefix] = n + 1
        self._used.add(name)
        return name

    # -- tensors -------------------------------------------------------------------
    def input(self, name: str, shape: Sequence[int | str | None]) -> str:
        self._used.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, _FLOAT, list(shape)))
        return name

    def const(self, prefix: str, value: np.ndarray) -> str:
        """An initializer holding exactly ``value``."""
        name = self.fresh(prefix)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, prefix: str, shape: Sequence[int], fan_in: int | None = None) -> str:
        """A float32 initializer of small random numbers (scaled by 1/sqrt(fan_in))."""
        fan = fan_in if fan_in is not None else (int(np.prod(shape[1:])) or 1)
        data = self.rng.normal(0.0, 1.0 / math.sqrt(max(fan, 1)), size=tuple(shape))
        return self.const(prefix, data.astype(np.float32))

    def bias(self, prefix: str, size: int) -> str:
        data = self.rng.normal(0.0, 0.01, size=(size,)).astype(np.float32)
        return self.const(prefix, data)

    # -- nodes ---------------------------------------------------------------------
    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        *,
        name: str | None = None,
        outputs: int = 1,
        **attrs: Any,  # ONNX attributes: whatever helper.make_attribute takes
    ) -> str:
        """Append one node; return the name of its first output."""
        node_name = self.fresh(name or op_type.lower())
        outs = [node_name] + [self.fresh(f"{node_name}_out{i}") for i in range(1, outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=node_name, **attrs))
        return node_name

    # -- common layers ---------------------------------------------------------------
    def conv(
        self,
        x: str,
        cin: int,
        cout: int,
        k: int = 3,
        *,
        stride: int = 1,
        group: int = 1,
        bias: bool = True,
        name: str = "conv",
    ) -> str:
        w = self.weight(f"{name}_W", [cout, cin // group, k, k])
        ins = [x, w] + ([self.bias(f"{name}_B", cout)] if bias else [])
        pad = k // 2
        return self.op(
            "Conv",
            ins,
            name=name,
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[pad] * 4,
            group=group,
        )

    def batchnorm(self, x: str, channels: int, *, name: str = "bn") -> str:
        scale = self.const(f"{name}_scale", np.ones(channels, np.float32))
        b = self.const(f"{name}_B", np.zeros(channels, np.float32))
        mean = self.const(f"{name}_mean", np.zeros(channels, np.float32))
        var = self.const(f"{name}_var", np.ones(channels, np.float32))
        return self.op("BatchNormalization", [x, scale, b, mean, var], name=name, epsilon=1e-5)

    def instancenorm(self, x: str, channels: int, *, name: str = "in") -> str:
        scale = self.const(f"{name}_scale", np.ones(channels, np.float32))
        b = self.const(f"{name}_B", np.zeros(channels, np.float32))
        return self.op("InstanceNormalization", [x, scale, b], name=name, epsilon=1e-5)

    def layernorm(self, x: str, d: int, *, name: str = "ln") -> str:
        scale = self.const(f"{name}_scale", np.ones(d, np.float32))
        b = self.const(f"{name}_B", np.zeros(d, np.float32))
        return self.op("LayerNormalization", [x, scale, b], name=name, axis=-1, epsilon=1e-5)

    def conv_bn_relu(
        self, x: str, cin: int, cout: int, k: int = 3, *, stride: int = 1, group: int = 1, name: str
    ) -> str:
        y = self.conv(x, cin, cout, k, stride=stride, group=group, bias=False, name=f"{name}_conv")
        y = self.batchnorm(y, cout, name=f"{name}_bn")
        return self.op("Relu", [y], name=f"{name}_relu")

    def maxpool(self, x: str, k: int = 2, stride: int = 2, pad: int = 0, *, name: str) -> str:
        return self.op(
            "MaxPool", [x], name=name, kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4
        )

    def gemm(self, x: str, fin: int, fout: int, *, name: str) -> str:
        w = self.weight(f"{name}_W", [fout, fin], fan_in=fin)
        b = self.bias(f"{name}_B", fout)
        return self.op("Gemm", [x, w, b], name=name, transB=1)

    def matmul_bias(self, x: str, fin: int, fout: int, *, name: str) -> str:
        w = self.weight(f"{name}_W", [fin, fout], fan_in=fin)
        y = self.op("MatMul", [x, w], name=name)
        return self.op("Add", [y, self.bias(f"{name}_B", fout)], name=f"{name}_bias")

    # -- model ---------------------------------------------------------------------
    def model(
        self,
        outputs: Sequence[str],
        *,
        opset: int,
        ir_version: int | None = None,
        initializers_as_inputs: bool = False,
        output_shapes: Sequence[Sequence[int | str]] | None = None,
    ) -> onnx.ModelProto:
        """Assemble the model. Output types come from shape inference, or from
        ``output_shapes`` where given (for graphs inference cannot see through)."""
        graph_inputs = list(self.inputs)
        shapes: list[Sequence[int | str] | None] = (
            list(output_shapes) if output_shapes else [None] * len(outputs)
        )
        if initializers_as_inputs:
            graph_inputs += [
                helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                for t in self.initializers
            ]
        graph = helper.make_graph(
            self.nodes,
            self.name,
            graph_inputs,
            [
                helper.make_tensor_value_info(o, _FLOAT, shape)
                for o, shape in zip(outputs, shapes, strict=True)
            ],
            initializer=self.initializers,
        )
        opsets = [helper.make_opsetid("", opset)]
        if ir_version is None:
            ir_version = helper.find_min_ir_version_for(opsets)
        model = helper.make_model(
            graph, opset_imports=opsets, ir_version=ir_version, producer_name="remat.samples"
        )
        if output_shapes is not None:
            return model
        # Give the graph outputs their full (inferred) types, as real exporters do.
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        for out, inf in zip(model.graph.output, inferred.graph.output, strict=True):
            out.type.CopyFrom(inf.type)
        return model


def _batch(batch: int | None) -> int | str:
    return BATCH_DIM if batch is None else batch


def _check_divisible(image: int, factor: int, what: str) -> None:
    if image % factor:
        raise ValueError(f"{what}: image size {image} must be divisible by {factor}")


# --------------------------------------------------------------------------------------
# Convolutional networks
# --------------------------------------------------------------------------------------


def vgg16(
    batch: int | None = None,
    image: int = 64,
    width: int = 16,
    classes: int = 10,
    opset: int = 17,
) -> onnx.ModelProto:
    """VGG16: 13 conv3x3+Relu in 5 blocks, each followed by MaxPool, then 3 Gemm layers.

    ``width`` is the channel count of the first block (64 in the real network); it
    doubles per block, capped at ``8 * width``. The hidden Gemm layers have
    ``16 * width`` units (4096 in the real network).
    """
    _check_divisible(image, 32, "vgg16")
    b = _Builder("vgg16")
    x = b.input("input", [_batch(batch), 3, image, image])
    cin = 3
    for block, convs in enumerate([2, 2, 3, 3, 3], start=1):
        cout = min(width * 2 ** (block - 1), 8 * width)
        for i in range(1, convs + 1):
            x = b.conv(x, cin, cout, 3, name=f"block{block}_conv{i}")
            x = b.op("Relu", [x], name=f"block{block}_relu{i}")
            cin = cout
        x = b.maxpool(x, name=f"block{block}_pool")
    x = b.op("Flatten", [x], name="flatten", axis=1)
    side = image // 32
    hidden = 16 * width
    x = b.gemm(x, cin * side * side, hidden, name="fc1")
    x = b.op("Relu", [x], name="fc1_relu")
    x = b.op("Dropout", [x], name="fc1_dropout")
    x = b.gemm(x, hidden, hidden, name="fc2")
    x = b.op("Relu", [x], name="fc2_relu")
    x = b.op("Dropout", [x], name="fc2_dropout")
    x = b.gemm(x, hidden, classes, name="fc3")
    return b.model([x], opset=opset)


def _basic_block(b: _Builder, x: str, cin: int, cout: int, stride: int, name: str) -> str:
    y = b.conv_bn_relu(x, cin, cout, 3, stride=stride, name=f"{name}_a")
    y = b.conv(y, cout, cout, 3, bias=False, name=f"{name}_b_conv")
    y = b.batchnorm(y, cout, name=f"{name}_b_bn")
    if stride != 1 or cin != cout:
        shortcut = b.conv(x, cin, cout, 1, stride=stride, bias=False, name=f"{name}_down_conv")
        shortcut = b.batchnorm(shortcut, cout, name=f"{name}_down_bn")
    else:
        shortcut = x
    y = b.op("Add", [y, shortcut], name=f"{name}_add")
    return b.op("Relu", [y], name=f"{name}_relu")


def resnet18(
    batch: int | None = None,
    image: int = 64,
    width: int = 8,
    classes: int = 10,
    opset: int = 17,
) -> onnx.ModelProto:
    """ResNet-18: 7x7/2 conv-bn-relu stem + 3x3/2 max pool, 4 stages x 2 BasicBlocks
    (projection shortcut where the shape changes), GlobalAveragePool, Flatten, Gemm.

    ``width`` is the channel count of the first stage (64 in the real network).
    """
    _check_divisible(image, 32, "resnet18")
    b = _Builder("resnet18")
    x = b.input("input", [_batch(batch), 3, image, image])
    x = b.conv_bn_relu(x, 3, width, 7, stride=2, name="stem")
    x = b.maxpool(x, 3, 2, 1, name="stem_pool")
    cin = width
    for stage in range(1, 5):
        cout = width * 2 ** (stage - 1)
        for block in range(1, 3):
            stride = 2 if (stage > 1 and block == 1) else 1
            x = _basic_block(b, x, cin, cout, stride, f"layer{stage}_{block}")
            cin = cout
    x = b.op("GlobalAveragePool", [x], name="avgpool")
    x = b.op("Flatten", [x], name="flatten", axis=1)
    x = b.gemm(x, cin, classes, name="fc")
    return b.model([x], opset=opset)


def _unet_block(b: _Builder, x: str, cin: int, cout: int, name: str) -> str:
    for i in (1, 2):
        x = b.conv(x, cin, cout, 3, name=f"{name}_conv{i}")
        x = b.instancenorm(x, cout, name=f"{name}_norm{i}")
        x = b.op("LeakyRelu", [x], name=f"{name}_lrelu{i}", alpha=0.01)
        cin = cout
    return x


def _upconv(b: _Builder, x: str, cin: int, cout: int, name: str) -> str:
    w = b.weight(f"{name}_W", [cin, cout, 2, 2], fan_in=cin * 4)
    return b.op(
        "ConvTranspose",
        [x, w, b.bias(f"{name}_B", cout)],
        name=name,
        kernel_shape=[2, 2],
        strides=[2, 2],
    )


def unet(
    batch: int | None = None,
    image: int = 64,
    width: int = 8,
    depth: int = 4,
    classes: int = 2,
    opset: int = 17,
) -> onnx.ModelProto:
    """U-Net as in XEngine (figure 5).

    Each block is two (Conv3x3, InstanceNormalization, LeakyRelu). ``depth`` encoder
    blocks (channels ``width * 2**i``), each followed by MaxPool; a bottleneck block;
    every block below the top level is followed by a stride-2 ConvTranspose up, whose
    output is concatenated with the encoder block's output (the skip connection) and
    fed to the decoder block of that level. A final 1x1 Conv gives ``classes`` maps.
    """
    if depth < 1:
        raise ValueError("unet: depth must be >= 1")
    _check_divisible(image, 2**depth, "unet")
    b = _Builder("unet")
    x = b.input("input", [_batch(batch), 1, image, image])
    cin = 1
    skips: list[tuple[str, int]] = []
    for level in range(depth):
        cout = width * 2**level
        x = _unet_block(b, x, cin, cout, f"enc{level}")
        skips.append((x, cout))
        x = b.maxpool(x, name=f"enc{level}_pool")
        cin = cout
    cout = width * 2**depth
    x = _unet_block(b, x, cin, cout, "bottleneck")
    cin = cout
    for level in reversed(range(depth)):
        skip, cskip = skips[level]
        x = _upconv(b, x, cin, cskip, f"up{level}")
        x = b.op("Concat", [skip, x], name=f"dec{level}_concat", axis=1)
        x = _unet_block(b, x, 2 * cskip, cskip, f"dec{level}")
        cin = cskip
    x = b.conv(x, cin, classes, 1, name="head")
    return b.model([x], opset=opset)


# MobileNet v1: (output channels relative to the stem, stride) of the 13 blocks.
_MOBILENET_BLOCKS = [
    (2, 1), (4, 2), (4, 1), (8, 2), (8, 1), (16, 2),
    (16, 1), (16, 1), (16, 1), (16, 1), (16, 1), (32, 2), (32, 1),
]  # fmt: skip


def mobilenet_v1(
    batch: int | None = None,
    image: int = 64,
    width: int = 8,
    classes: int = 10,
    opset: int = 17,
) -> onnx.ModelProto:
    """MobileNet v1: 3x3/2 conv stem, 13 depthwise-separable blocks (depthwise 3x3 Conv
    with group=channels + BN + Relu, pointwise 1x1 Conv + BN + Relu), GlobalAveragePool,
    Flatten, Gemm.

    ``width`` is the stem's channel count (32 in the real network, which ends at 1024).
    """
    _check_divisible(image, 32, "mobilenet_v1")
    b = _Builder("mobilenet_v1")
    x = b.input("input", [_batch(batch), 3, image, image])
    x = b.conv_bn_relu(x, 3, width, 3, stride=2, name="stem")
    cin = width
    for i, (mult, stride) in enumerate(_MOBILENET_BLOCKS, start=1):
        cout = width * mult
        x = b.conv_bn_relu(x, cin, cin, 3, stride=stride, group=cin, name=f"block{i}_dw")
        x = b.conv_bn_relu(x, cin, cout, 1, name=f"block{i}_pw")
        cin = cout
    x = b.op("GlobalAveragePool", [x], name="avgpool")
    x = b.op("Flatten", [x], name="flatten", axis=1)
    x = b.gemm(x, cin, classes, name="fc")
    return b.model([x], opset=opset)


# --------------------------------------------------------------------------------------
# Transformer
# --------------------------------------------------------------------------------------


def _encoder_layer(
    b: _Builder, x: str, d_model: int, heads: int, d_ff: int, consts: dict[str, str], name: str
) -> str:
    h = b.layernorm(x, d_model, name=f"{name}_ln1")
    q = b.matmul_bias(h, d_model, d_model, name=f"{name}_q")
    k = b.matmul_bias(h, d_model, d_model, name=f"{name}_k")
    v = b.matmul_bias(h, d_model, d_model, name=f"{name}_v")
    split = consts["split_heads"]
    q = b.op("Reshape", [q, split], name=f"{name}_q_heads")
    k = b.op("Reshape", [k, split], name=f"{name}_k_heads")
    v = b.op("Reshape", [v, split], name=f"{name}_v_heads")
    q = b.op("Transpose", [q], name=f"{name}_q_t", perm=[0, 2, 1, 3])  # N,H,S,dh
    k = b.op("Transpose", [k], name=f"{name}_k_t", perm=[0, 2, 3, 1])  # N,H,dh,S
    v = b.op("Transpose", [v], name=f"{name}_v_t", perm=[0, 2, 1, 3])  # N,H,S,dh
    s = b.op("MatMul", [q, k], name=f"{name}_scores")
    s = b.op("Div", [s, consts["sqrt_dh"]], name=f"{name}_scale")
    p = b.op("Softmax", [s], name=f"{name}_softmax", axis=-1)
    a = b.op("MatMul", [p, v], name=f"{name}_attn")
    a = b.op("Transpose", [a], name=f"{name}_attn_t", perm=[0, 2, 1, 3])  # N,S,H,dh
    a = b.op("Reshape", [a, consts["merge_heads"]], name=f"{name}_attn_merge")
    a = b.matmul_bias(a, d_model, d_model, name=f"{name}_proj")
    x = b.op("Add", [x, a], name=f"{name}_residual1")
    h = b.layernorm(x, d_model, name=f"{name}_ln2")
    h = b.matmul_bias(h, d_model, d_ff, name=f"{name}_ff1")
    h = b.op("Gelu", [h], name=f"{name}_gelu")
    h = b.matmul_bias(h, d_ff, d_model, name=f"{name}_ff2")
    return b.op("Add", [x, h], name=f"{name}_residual2")


def _transformer(
    name: str,
    batch: int | None,
    seq: int | str,
    d_model: int,
    heads: int,
    d_ff: int,
    layers: int,
    opset: int,
) -> onnx.ModelProto:
    if d_model % heads:
        raise ValueError(f"{name}: d_model {d_model} must be divisible by heads {heads}")
    if opset < 20:
        raise ValueError(f"{name}: Gelu needs opset >= 20, got {opset}")
    dh = d_model // heads
    b = _Builder(name)
    x = b.input("input", [_batch(batch), seq, d_model])
    consts = {
        "split_heads": b.const("split_heads_shape", np.array([0, 0, heads, dh], np.int64)),
        "merge_heads": b.const("merge_heads_shape", np.array([0, 0, d_model], np.int64)),
        "sqrt_dh": b.const("sqrt_dh", np.array(math.sqrt(dh), np.float32)),
    }
    for layer in range(layers):
        x = _encoder_layer(b, x, d_model, heads, d_ff, consts, f"layer{layer}")
    x = b.layernorm(x, d_model, name="final_ln")
    return b.model([x], opset=opset)


def transformer_block(
    batch: int | None = None,
    seq: int | str = 16,
    d_model: int = 32,
    heads: int = 4,
    d_ff: int = 64,
    layers: int = 1,
    opset: int = 20,
) -> onnx.ModelProto:
    """A pre-norm transformer encoder of ``layers`` layers on input (N, seq, d_model);
    ``seq`` a name (e.g. ``"S"``) makes the sequence length symbolic too.

    Per layer: LayerNormalization; Q/K/V MatMul + Add bias; Reshape/Transpose into
    heads; MatMul Q K^T; Div by sqrt(d_head); Softmax; MatMul with V; Transpose/Reshape
    back; output projection; residual Add; LayerNormalization; MatMul to ``d_ff`` +
    bias; Gelu; MatMul back + bias; residual Add. A final LayerNormalization.
    """
    return _transformer("transformer", batch, seq, d_model, heads, d_ff, layers, opset)


# --------------------------------------------------------------------------------------
# Old exporter style, chain, large
# --------------------------------------------------------------------------------------


def old_style_model(batch: int | None = None) -> onnx.ModelProto:
    """A model as old exporters wrote it: opset 9, IR version 3.

    - every initializer is also listed in ``graph.input``;
    - one weight (a conv bias) comes from ``ConstantOfShape`` of a ``Constant`` shape;
    - the flatten before the classifier is ``Reshape(x, Concat(Unsqueeze(Gather(
      Shape(x), 0)), [-1]))``, i.e. ``x.view(x.size(0), -1)``.
    """
    b = _Builder("old_style")
    x = b.input("input", [_batch(batch), 3, 16, 16])
    x = b.conv(x, 3, 8, 3, name="conv1")
    x = b.op("Relu", [x], name="relu1")
    x = b.maxpool(x, name="pool1")
    # conv2's bias is produced at run time: ConstantOfShape(Constant([16])) filled with 0.01.
    bias_shape = b.op(
        "Constant",
        [],
        name="conv2_bias_shape",
        value=numpy_helper.from_array(np.array([16], np.int64), "conv2_bias_shape_value"),
    )
    bias = b.op(
        "ConstantOfShape",
        [bias_shape],
        name="conv2_bias",
        value=numpy_helper.from_array(np.array([0.01], np.float32), "conv2_bias_value"),
    )
    w2 = b.weight("conv2_W", [16, 8, 3, 3])
    x = b.op("Conv", [x, w2, bias], name="conv2", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    x = b.op("Relu", [x], name="relu2")
    x = b.maxpool(x, name="pool2")  # (N, 16, 4, 4)
    # x.view(x.size(0), -1)
    shape = b.op("Shape", [x], name="flatten_shape")
    index = b.const("flatten_index", np.array(0, np.int64))
    n = b.op("Gather", [shape, index], name="flatten_gather", axis=0)
    n = b.op("Unsqueeze", [n], name="flatten_unsqueeze", axes=[0])
    rest = b.const("flatten_rest", np.array([-1], np.int64))
    target = b.op("Concat", [n, rest], name="flatten_concat", axis=0)
    x = b.op("Reshape", [x, target], name="flatten")
    x = b.gemm(x, 16 * 4 * 4, 32, name="fc1")
    x = b.op("Relu", [x], name="fc1_relu")
    x = b.gemm(x, 32, 10, name="fc2")
    # Reshape-5 cannot infer through the computed shape, so state the output's shape.
    return b.model(
        [x],
        opset=9,
        ir_version=3,
        initializers_as_inputs=True,
        output_shapes=[[_batch(batch), 10]],
    )


def chain(n: int = 8, batch: int | None = None, features: int = 16) -> onnx.ModelProto:
    """A path graph: one MatMul followed by ``n`` elementwise ops alternating Relu/Tanh
    (``n + 1`` nodes), for Griewank/checkpointing tests."""
    if n < 0:
        raise ValueError("chain: n must be >= 0")
    b = _Builder("chain")
    x = b.input("input", [_batch(batch), features])
    w = b.weight("matmul_W", [features, features], fan_in=features)
    x = b.op("MatMul", [x, w], name="matmul")
    for i in range(n):
        x = b.op("Relu" if i % 2 == 0 else "Tanh", [x], name=f"act{i}")
    return b.model([x], opset=17)


def large(batch: int | None = None, blocks: int = 69) -> onnx.ModelProto:
    """About 2,000 operators (29 per block + 1) for the ingestion benchmark: a deep stack
    of tiny transformer encoder layers (seq 8, d_model 8, 2 heads, d_ff 16)."""
    return _transformer("large", batch, 8, 8, 2, 16, blocks, 20)


ZOO: dict[str, Callable[..., onnx.ModelProto]] = {
    "vgg16": vgg16,
    "resnet18": resnet18,
    "unet": unet,
    "mobilenet_v1": mobilenet_v1,
    "transformer": transformer_block,
    "old_style": old_style_model,
    "chain": chain,
}


# --------------------------------------------------------------------------------------
# Bad and special inputs
# --------------------------------------------------------------------------------------


def onnx_zoo() -> dict[str, Path]:
    """The ONNX model zoo's classic CNNs as the onnx package ships them for its backend
    tests, by name (``resnet50``, ``inception_v2``, ``densenet121``, ...): converted from
    Caffe2 at opset 9 with IR version 3, their weights made by ``ConstantOfShape``. Empty
    where the installed onnx ships none."""
    light = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
    return {p.stem.removeprefix("light_"): p for p in sorted(light.glob("light_*.onnx"))}


def truncated_bytes() -> bytes:
    """A valid serialized model cut roughly in half: it does not parse."""
    data = chain().SerializeToString()
    for cut in range(len(data) // 2, len(data)):
        try:
            onnx.load_from_string(data[:cut])
        except Exception:
            return data[:cut]
    raise AssertionError("no cut point makes the model unparsable")  # pragma: no cover


def checker_failing_model() -> onnx.ModelProto:
    """A model that ``onnx.checker.check_model`` rejects: a node reads an undefined tensor."""
    x = helper.make_tensor_value_info("input", _FLOAT, [BATCH_DIM, 4])
    y = helper.make_tensor_value_info("output", _FLOAT, [BATCH_DIM, 4])
    node = helper.make_node("Add", ["input", "undefined_tensor"], ["output"], name="add")
    graph = helper.make_graph([node], "checker_failing", [x], [y])
    opsets = [helper.make_opsetid("", 17)]
    return helper.make_model(
        graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets)
    )


def no_operator_model() -> onnx.ModelProto:
    """A valid model with zero nodes: the graph input is the graph output."""
    x = helper.make_tensor_value_info("input", _FLOAT, [BATCH_DIM, 4])
    graph = helper.make_graph([], "no_operator", [x], [x])
    opsets = [helper.make_opsetid("", 17)]
    return helper.make_model(
        graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets)
    )


def symbolic_model() -> onnx.ModelProto:
    """A model whose batch dimension is symbolic (``"N"``): users must pass a batch."""
    return chain(batch=None)
