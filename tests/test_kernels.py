"""The agent's kernels and programs: every forward operator against onnxruntime (the sample
model families and single operators with non-default attributes), every closed-form
gradient against autograd, and the value layout of training graphs against the graph's
byte counts."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch", reason="the agent extra (torch) is not installed")
pytest.importorskip("onnxruntime", reason="the agent extra (onnxruntime) is not installed")
import onnxruntime as ort
import torch

from agents import kernels
from agents.errors import UnsupportedOpError
from agents.executor import CUDA_ALLOWANCE, max_relative_error
from agents.kernels import OpSpec, VjpCall
from agents.program import GradientBuffers, Program, build_program, value_bytes
from agents.torch_devices import ieee_fp32
from remat import samples
from remat.graph import NodeKind
from remat.onnx_fusion import (
    ATTENTION,
    FUSED_DOMAIN,
    GELU,
    LAYER_NORM,
    LAYOUT,
    MATMUL_ADD,
    RMS_NORM,
    ROTARY,
    SILU,
    UNBIND,
)
from remat.onnx_ingest import forward_graph
from remat.training import training_graph

from graphs import causal_attention, grouped_query_attention, rotary_embedding

F32 = TensorProto.FLOAT
RTOL = 1e-4

FAMILIES: dict[str, Callable[[], onnx.ModelProto]] = {
    "vgg16": lambda: samples.vgg16(batch=2, image=32, width=4),
    "resnet18": lambda: samples.resnet18(batch=2, image=32, width=4),
    "unet": lambda: samples.unet(batch=1, image=32, width=4, depth=2),
    "mobilenet_v1": lambda: samples.mobilenet_v1(batch=1, image=32, width=4),
    "transformer": lambda: samples.transformer_block(batch=2),
    "old_style": lambda: samples.old_style_model(batch=2),
    "chain": lambda: samples.chain(6, batch=2),
}


# --- comparing with onnxruntime ---------------------------------------------------------------


def _onnxruntime_values(model: onnx.ModelProto, program: Program) -> dict[str, np.ndarray]:
    """Every tensor a forward node writes, as onnxruntime computes it (all intermediates
    made graph outputs, graph optimisations off so that they exist)."""
    values = program.forward_values()
    extended = onnx.ModelProto()
    extended.CopyFrom(model)
    present = {o.name for o in extended.graph.output}
    for node in program.graph.forward_nodes():
        for name, tensor in zip(node.attrs["onnx_outputs"], values[node.id], strict=True):
            if name not in present:
                elem = helper.np_dtype_to_tensor_dtype(tensor.numpy().dtype)
                info = helper.make_tensor_value_info(name, elem, list(tensor.shape))
                extended.graph.output.append(info)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        extended.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    feeds = {i.name: program.fixed[i.name].numpy() for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))


def _assert_forward_matches(
    model: onnx.ModelProto, device: torch.device | None = None, **graph_args: Any
) -> Program:
    """Our forward kernels (on ``device``; None: the host) against onnxruntime on the host,
    every intermediate tensor."""
    program = build_program(model, forward_graph(model, **graph_args))
    ours = program.forward_values(device)
    theirs = _onnxruntime_values(model, program)
    checked = 0
    for node in program.graph.forward_nodes():
        for name, tensor in zip(node.attrs["onnx_outputs"], ours[node.id], strict=True):
            expected = theirs[name]
            assert device is None or tensor.device.type == device.type, (node.name, name)
            got = tensor.cpu().numpy()
            assert got.shape == expected.shape, (node.name, name)
            assert got.dtype == expected.dtype, (node.name, name)
            scale = max(float(np.abs(expected).max(initial=0)), 1e-6)
            error = float(np.abs(got.astype(np.float64) - expected).max(initial=0)) / scale
            assert error <= RTOL, f"{node.name} ({node.op}) output {name}: rel error {error:.2e}"
            checked += 1
    assert checked >= len(program.graph)
    return program


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sample_families_match_onnxruntime_per_operator(family: str) -> None:
    _assert_forward_matches(FAMILIES[family]())


MANY_KEYS = 256  # a sequence of a fine-tuning context, beside the small cases' few keys


@pytest.mark.parametrize("tokens", [5, MANY_KEYS])
def test_causal_attention_matches_onnxruntime(tokens: int) -> None:
    """A causal mask folded from positions, as GPT-2's, run as the fused node's ``causal``
    attribute, against onnxruntime's chain with the mask."""
    program = _assert_forward_matches(
        causal_attention(tokens, float(np.finfo(np.float32).min)), fuse_attention=True
    )
    [attention] = [n for n in program.graph.nodes if n.op == ATTENTION]
    assert attention.attrs["fused_attributes"]["causal"] == 1  # type: ignore[index]


def test_grouped_query_attention_matches_onnxruntime() -> None:
    """Keys and values whose heads ``repeat_kv`` repeats, read by the attention node as
    they are (PyTorch's ``enable_gqa``), against onnxruntime's chain with the repeat."""
    model = grouped_query_attention()
    program = build_program(model, forward_graph(model))
    [attention] = [n for n in program.graph.nodes if n.op == ATTENTION]
    assert attention.attrs["input_shapes"][1:] == [(2, 2, 8, 3), (2, 2, 3, 8)]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    [expected] = session.run(["y"], {x: program.fixed[x].numpy() for x in ("q", "k", "v")})
    [relu] = [n for n in program.graph.nodes if n.op == "Relu"]
    ours = program.forward_values()[relu.id][0].numpy()
    np.testing.assert_allclose(ours, expected, rtol=RTOL, atol=RTOL)


def test_a_fused_rotary_embedding_matches_onnxruntime() -> None:
    """LLaMA's rotary embedding as one ``FusedRotary`` node against onnxruntime's chain."""
    program = _assert_forward_matches(rotary_embedding())
    assert [n.op for n in program.graph.nodes] == [ROTARY, "Relu"]


def test_fused_attention_matches_onnxruntime() -> None:
    """The transformer sample's attention as one node against onnxruntime's chain."""
    program = _assert_forward_matches(FAMILIES["transformer"](), fuse_attention=True)
    assert any(n.op == ATTENTION for n in program.graph.nodes)


# --- single operators with non-default attributes ---------------------------------------------


@dataclass
class Case:
    op: str
    inputs: dict[str, tuple[int, ...]]  # graph inputs (random normal)
    consts: dict[str, np.ndarray] = field(default_factory=dict)  # initializers
    attrs: dict[str, Any] = field(default_factory=dict)
    opset: int = 17
    outputs: int = 1
    order: Sequence[str] | None = None  # input order when consts come first or interleave


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _w(*shape: int) -> np.ndarray:
    return _rng(1).normal(0, 0.5, shape).astype(np.float32)


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


CASES: dict[str, Case] = {
    "conv_asymmetric_pads_dilated": Case(
        "Conv",
        {"x": (1, 2, 9, 9)},
        {"w": _w(3, 2, 3, 3), "b": _w(3)},
        {"pads": [0, 1, 1, 2], "strides": [2, 1], "dilations": [1, 2]},
    ),
    "conv_same_upper_grouped": Case(
        "Conv",
        {"x": (1, 4, 7, 7)},
        {"w": _w(4, 2, 3, 3)},
        {"auto_pad": "SAME_UPPER", "strides": [2, 2], "group": 2},
    ),
    "conv_1d": Case("Conv", {"x": (2, 3, 10)}, {"w": _w(4, 3, 3)}, {"pads": [1, 1]}),
    "conv_transpose_asymmetric": Case(
        "ConvTranspose",
        {"x": (1, 3, 5, 5)},
        {"w": _w(3, 2, 3, 3), "b": _w(2)},
        {"strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 1]},
    ),
    "conv_transpose_grouped": Case(
        "ConvTranspose",
        {"x": (1, 4, 4, 4)},
        {"w": _w(4, 1, 2, 2)},
        {"strides": [2, 2], "group": 2, "pads": [1, 1, 1, 1]},
    ),
    "maxpool_indices": Case(
        "MaxPool", {"x": (2, 3, 6, 6)}, attrs={"kernel_shape": [2, 2], "strides": [2, 2]}, outputs=2
    ),
    "maxpool_ceil_pads": Case(
        "MaxPool",
        {"x": (1, 2, 7, 7)},
        attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
    ),
    "maxpool_same_lower": Case(
        "MaxPool",
        {"x": (1, 2, 7, 7)},
        attrs={"kernel_shape": [2, 2], "strides": [2, 2], "auto_pad": "SAME_LOWER"},
    ),
    "avgpool_exclude_pad": Case(
        "AveragePool",
        {"x": (1, 2, 6, 6)},
        attrs={"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 0},
    ),
    "avgpool_asymmetric_include_pad": Case(
        "AveragePool",
        {"x": (1, 2, 6, 6)},
        attrs={"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 0, 0, 1]},
    ),
    "avgpool_asymmetric_exclude_pad": Case(
        "AveragePool",
        {"x": (1, 2, 6, 6)},
        attrs={"kernel_shape": [3, 3], "pads": [0, 2, 1, 0], "count_include_pad": 0},
    ),
    "gemm_trans_a_alpha_beta": Case(
        "Gemm",
        {"a": (5, 3)},
        {"b": _w(5, 4), "c": _w(3, 4)},
        {"transA": 1, "alpha": 0.5, "beta": 2.0},
    ),
    "softmax_opset11_coerced": Case("Softmax", {"x": (2, 3, 4)}, attrs={"axis": 1}, opset=11),
    "log_softmax_axis0": Case("LogSoftmax", {"x": (3, 4)}, attrs={"axis": 0}),
    "slice_negative_step": Case(
        "Slice",
        {"x": (3, 10)},
        {"starts": _i64(-1), "ends": _i64(-1000), "axes": _i64(1), "steps": _i64(-3)},
    ),
    "slice_clamped": Case(
        "Slice", {"x": (4, 6)}, {"starts": _i64(1, -4), "ends": _i64(99, -1), "axes": _i64(0, 1)}
    ),
    "pad_reflect": Case(
        "Pad", {"x": (1, 2, 4, 4)}, {"pads": _i64(0, 0, 1, 2, 0, 0, 2, 1)}, {"mode": "reflect"}
    ),
    "pad_constant_value": Case(
        "Pad",
        {"x": (2, 3)},
        {"pads": _i64(1, 0, 0, 2), "value": np.array(1.5, np.float32)},
        opset=13,
    ),
    "split_sizes": Case("Split", {"x": (2, 7)}, {"split": _i64(3, 4)}, {"axis": 1}, outputs=2),
    "split_num_outputs": Case(
        "Split", {"x": (7, 2)}, attrs={"num_outputs": 3}, opset=18, outputs=3
    ),
    "reduce_mean_attr_axes": Case(
        "ReduceMean", {"x": (2, 3, 4)}, attrs={"axes": [1, -1], "keepdims": 0}, opset=13
    ),
    "reduce_sum_input_axes": Case("ReduceSum", {"x": (2, 3, 4)}, {"axes": _i64(1)}, opset=13),
    "reduce_max_all": Case("ReduceMax", {"x": (2, 3)}, opset=18),
    "gather_constant_index": Case(
        "Gather", {"x": (3, 5)}, {"i": np.array(-2, np.int64)}, {"axis": 1}
    ),
    "gather_negative_indices": Case(
        "Gather", {"x": (3, 5)}, {"i": _i64(-1, 0, 2).reshape(3, 1)}, {"axis": 1}
    ),
    "clip_inputs": Case(
        "Clip",
        {"x": (4, 4)},
        {"lo": np.array(-0.2, np.float32), "hi": np.array(0.3, np.float32)},
        opset=13,
    ),
    "layer_norm_two_axes": Case(
        "LayerNormalization",
        {"x": (2, 3, 4)},
        {"scale": _w(3, 4), "bias": _w(3, 4)},
        {"axis": -2, "epsilon": 1e-3},
    ),
    "batch_norm_statistics": Case(
        "BatchNormalization",
        {"x": (2, 3, 4, 4)},
        {
            "scale": _w(3),
            "bias": _w(3),
            "mean": _w(3),
            "var": np.abs(_w(3)) + 0.5,
        },
        {"epsilon": 1e-3},
    ),
    "instance_norm": Case(
        "InstanceNormalization", {"x": (2, 3, 5, 5)}, {"scale": _w(3), "bias": _w(3)}
    ),
    "lrn": Case("LRN", {"x": (1, 6, 3, 3)}, attrs={"size": 3, "alpha": 1e-2, "beta": 0.5}),
    "prelu_channels": Case("PRelu", {"x": (2, 3, 4)}, {"slope": _w(3, 1)}),
    "hard_sigmoid": Case("HardSigmoid", {"x": (3, 4)}, attrs={"alpha": 0.3, "beta": 0.4}),
    "hard_swish": Case("HardSwish", {"x": (3, 4)}, opset=14),
    "elu": Case("Elu", {"x": (3, 4)}, attrs={"alpha": 0.7}),
    "selu": Case("Selu", {"x": (3, 4)}),
    "leaky_relu": Case("LeakyRelu", {"x": (3, 4)}, attrs={"alpha": 0.2}),
    "gelu_tanh": Case("Gelu", {"x": (3, 4)}, attrs={"approximate": "tanh"}, opset=20),
    "erf": Case("Erf", {"x": (3, 4)}),
    "pow_constant_exponent": Case("Pow", {"x": (3, 4)}, {"e": np.array(2.0, np.float32)}),
    "expand": Case("Expand", {"x": (3, 1)}, {"shape": _i64(2, 3, 4)}),
    "tile": Case("Tile", {"x": (2, 3)}, {"reps": _i64(2, 2)}),
    "where": Case(
        "Where",
        {"a": (3, 4), "b": (4,)},
        {"c": np.array([True, False, True, False])},
        order=["c", "a", "b"],
    ),
    "cast_to_double": Case("Cast", {"x": (3,)}, attrs={"to": TensorProto.DOUBLE}),
    "unsqueeze_opset11": Case("Unsqueeze", {"x": (3, 4)}, attrs={"axes": [0, -1]}, opset=11),
    "squeeze_opset13": Case("Squeeze", {"x": (3, 1, 4, 1)}, {"axes": _i64(-1)}, opset=13),
    "flatten_axis2": Case("Flatten", {"x": (2, 3, 4, 5)}, attrs={"axis": 2}),
    "transpose_default": Case("Transpose", {"x": (2, 3, 4)}),
    "matmul_broadcast": Case("MatMul", {"a": (2, 3, 4)}, {"b": _w(4, 5)}),
    "einsum": Case("Einsum", {"a": (2, 3), "b": (3, 4)}, attrs={"equation": "ij,jk->ik"}, opset=12),
    "argmax_last_index": Case(
        "ArgMax", {"x": (3, 4)}, attrs={"axis": 1, "keepdims": 0, "select_last_index": 1}
    ),
    "global_max_pool": Case("GlobalMaxPool", {"x": (2, 3, 4, 4)}),
    "reshape_zero_and_infer": Case("Reshape", {"x": (2, 3, 4)}, {"shape": _i64(0, -1)}),
    "concat_negative_axis": Case("Concat", {"a": (2, 3), "b": (2, 2)}, attrs={"axis": -1}),
    "sum_three": Case("Sum", {"a": (2, 3), "b": (3,), "c": (2, 1)}),
    "dropout_with_mask": Case("Dropout", {"x": (3, 4)}, outputs=2),
}


def _single_op_model(case: Case) -> onnx.ModelProto:
    """A one-operator model; the operator's output is fed through Identity only so that a
    model output is never the operator's input."""
    names = list(case.order) if case.order else [*case.inputs, *case.consts]
    outputs = [f"y{i}" for i in range(case.outputs)]
    node = helper.make_node(case.op, names, outputs, name="op", **case.attrs)
    graph = helper.make_graph(
        [node],
        "single",
        [helper.make_tensor_value_info(n, F32, list(s)) for n, s in case.inputs.items()],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        initializer=[numpy_helper.from_array(v, n) for n, v in case.consts.items()],
    )
    opsets = [helper.make_opsetid("", case.opset)]
    model = helper.make_model(
        graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets)
    )
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    for out, info in zip(model.graph.output, inferred.graph.output, strict=True):
        out.type.CopyFrom(info.type)
    return model


@pytest.mark.parametrize("name", sorted(CASES))
def test_single_operator_matches_onnxruntime(name: str) -> None:
    _assert_forward_matches(_single_op_model(CASES[name]))


def test_every_sample_operator_has_a_kernel() -> None:
    ops = {n.op for build in FAMILIES.values() for n in forward_graph(build()).nodes}
    assert ops <= set(kernels.KERNELS), ops - set(kernels.KERNELS)


def test_an_operator_without_kernel_is_named() -> None:
    case = Case("CumSum", {"x": (2, 3)}, {"axis": np.array(1, np.int64)}, opset=14)
    model = _single_op_model(case)
    with pytest.raises(UnsupportedOpError, match=r"ONNX op 'CumSum' \(node 'op'\)"):
        build_program(model, forward_graph(model))


def test_a_custom_domain_operator_is_named() -> None:
    model = samples.chain(2, batch=1)
    model.graph.node[1].domain = "com.example"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    model.graph.value_info.append(helper.make_tensor_value_info("act0", F32, [1, 16]))
    graph = forward_graph(model)
    with pytest.raises(UnsupportedOpError, match=r"'Relu' \(node 'act0'\).*com\.example"):
        build_program(model, graph)


# --- gradients ----------------------------------------------------------------------------------


@dataclass
class GradCase:
    op: str
    shapes: list[tuple[int, ...]]
    attrs: dict[str, Any] = field(default_factory=dict)
    opset: int = 17
    domain: str = ""
    outputs: int = 1
    kept: str = ""  # the suffix of a second output a training graph keeps for the backward


# A FusedLayout that splits the heads of (2, 6, 4), moves them before the tokens and
# merges them with the batch
HEADS_MOVED = {
    "steps": ["reshape", "transpose", "reshape"],
    "dims": [2, 6, 2, 2, 0, 2, 1, 3, 4, 12],
    "ranks": [4, 4, 2],
}
GRAD_CASES: dict[str, GradCase] = {
    "conv": GradCase(
        "Conv",
        [(2, 4, 7, 7), (6, 2, 3, 3), (6,)],
        {"pads": [1, 1, 1, 1], "group": 2, "strides": [2, 2]},
    ),
    "conv_asymmetric": GradCase("Conv", [(1, 2, 6, 6), (3, 2, 3, 3)], {"pads": [0, 1, 2, 0]}),
    "conv_transpose": GradCase(
        "ConvTranspose",
        [(1, 4, 3, 3), (4, 3, 2, 2), (3,)],
        {"strides": [2, 2], "pads": [1, 1, 1, 1]},
    ),
    "gemm": GradCase("Gemm", [(3, 4), (5, 4), (5,)], {"transB": 1}),
    "gemm_transposes_scaled": GradCase(
        "Gemm", [(4, 3), (5, 4), (3, 5)], {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 3.0}
    ),
    "matmul_batched_broadcast": GradCase("MatMul", [(2, 1, 3, 4), (3, 4, 5)]),
    "matmul_weight": GradCase("MatMul", [(2, 3, 4, 5), (5, 6)]),  # one product for the weight
    "matmul_add": GradCase(MATMUL_ADD, [(2, 3, 4), (4, 5), (5,)], domain=FUSED_DOMAIN),
    "matmul_add_matrix": GradCase(MATMUL_ADD, [(3, 4), (4, 5), (5,)], domain=FUSED_DOMAIN),
    "matmul_add_trans_b": GradCase(
        MATMUL_ADD, [(2, 3, 4), (5, 4), (5,)], {"transB": 1}, domain=FUSED_DOMAIN
    ),
    "gelu": GradCase("Gelu", [(3, 4)], opset=20),
    "gelu_tanh": GradCase("Gelu", [(3, 4)], {"approximate": "tanh"}, opset=20),
    "fused_gelu": GradCase(GELU, [(2, 3, 4)], {"approximate": "none"}, domain=FUSED_DOMAIN),
    "fused_gelu_tanh": GradCase(GELU, [(2, 3, 4)], {"approximate": "tanh"}, domain=FUSED_DOMAIN),
    "fused_silu": GradCase(SILU, [(2, 3, 4)], domain=FUSED_DOMAIN),
    "fused_rms_norm": GradCase(
        RMS_NORM, [(2, 3, 4), (4,)], {"axis": -1, "epsilon": 1e-6}, domain=FUSED_DOMAIN
    ),
    "fused_rotary": GradCase(
        ROTARY, [(2, 4, 3, 8), (1, 1, 3, 8), (1, 1, 3, 8)], domain=FUSED_DOMAIN
    ),
    # cosines and sines of one value per position, broadcast along the features
    "fused_rotary_broadcast": GradCase(
        ROTARY, [(2, 4, 3, 8), (3, 1), (1, 1, 3, 1)], domain=FUSED_DOMAIN
    ),
    "fused_layer_norm": GradCase(
        LAYER_NORM, [(2, 3, 4), (4,), (4,)], {"axis": -1, "epsilon": 1e-5}, domain=FUSED_DOMAIN
    ),
    "attention": GradCase(
        ATTENTION, [(2, 3, 4, 5), (2, 3, 5, 6), (2, 3, 6, 4)], {"scale": 0.4}, domain=FUSED_DOMAIN
    ),
    "attention_masked": GradCase(
        ATTENTION, [(2, 4, 5), (2, 5, 6), (2, 6, 3), (1, 4, 6)], domain=FUSED_DOMAIN
    ),
    "attention_causal": GradCase(
        ATTENTION,
        [(2, 3, 4, 5), (2, 3, 5, 4), (2, 3, 4, 6)],
        {"scale": 0.4, "causal": 1},
        domain=FUSED_DOMAIN,
    ),
    "attention_few_keys": GradCase(
        ATTENTION, [(2, 3, 4, 8), (2, 3, 8, 6), (2, 3, 6, 8)], {"scale": 0.4}, domain=FUSED_DOMAIN
    ),
    # a mask that wants a gradient: the closed form (``remat.ops.pytorch_attention_backward``)
    "attention_mask_trained": GradCase(
        ATTENTION,
        [(2, 3, 4, 5), (2, 3, 5, 6), (2, 3, 6, 4), (1, 3, 4, 6)],
        {"scale": 0.4},
        domain=FUSED_DOMAIN,
    ),
    # keys and values of two heads, each read by two query heads in a row
    "attention_grouped": GradCase(
        ATTENTION, [(2, 4, 3, 8), (2, 2, 8, 3), (2, 2, 3, 8)], {"scale": 0.4}, domain=FUSED_DOMAIN
    ),
    "attention_grouped_mask_trained": GradCase(
        ATTENTION,
        [(2, 4, 3, 8), (2, 2, 8, 5), (2, 2, 5, 6), (1, 4, 3, 5)],
        {"scale": 0.4},
        domain=FUSED_DOMAIN,
    ),
    # the closed form from the weights a training graph's forward node keeps
    "attention_weights_kept": GradCase(
        ATTENTION,
        [(2, 3, 4, 5), (2, 3, 5, 6), (2, 3, 6, 4), (1, 3, 4, 6)],
        {"scale": 0.4},
        domain=FUSED_DOMAIN,
        kept=kernels.KEPT_WEIGHTS,
    ),
    "attention_grouped_causal_weights_kept": GradCase(
        ATTENTION,
        [(2, 4, 5, 8), (2, 2, 8, 5), (2, 2, 5, 6), (1, 4, 5, 5)],
        {"scale": 0.4, "causal": 1},
        domain=FUSED_DOMAIN,
        kept=kernels.KEPT_WEIGHTS,
    ),
    "attention_many_keys_causal": GradCase(
        ATTENTION,
        [(1, 2, MANY_KEYS, 4), (1, 2, 4, MANY_KEYS), (1, 2, MANY_KEYS, 4)],
        {"scale": 0.4, "causal": 1},
        domain=FUSED_DOMAIN,
    ),
    "attention_many_keys": GradCase(
        ATTENTION,
        [(1, 2, 3, 4), (1, 2, 4, MANY_KEYS), (1, 2, MANY_KEYS, 4)],
        {"scale": 0.4},
        domain=FUSED_DOMAIN,
    ),
    "fused_unbind": GradCase(UNBIND, [(2, 3, 4)], {"axis": 1}, domain=FUSED_DOMAIN, outputs=3),
    # the heads of (2, 6, 4) split, moved before the tokens, and merged with them
    "fused_layout": GradCase(LAYOUT, [(2, 6, 4)], HEADS_MOVED, domain=FUSED_DOMAIN),
    "fused_layout_identity": GradCase(
        LAYOUT, [(2, 3)], {"steps": [], "dims": [], "ranks": []}, domain=FUSED_DOMAIN
    ),
    "layer_norm": GradCase("LayerNormalization", [(2, 3, 8), (8,), (8,)]),
    "layer_norm_two_axes": GradCase(
        "LayerNormalization", [(2, 3, 4), (3, 4), (3, 4)], {"axis": 1, "epsilon": 1e-3}
    ),
    "layer_norm_no_bias": GradCase("LayerNormalization", [(4, 6), (6,)]),
    "add_broadcast": GradCase("Add", [(2, 3, 4), (3, 1)]),
    "sub_broadcast": GradCase("Sub", [(4,), (2, 4)]),
    "mul_broadcast": GradCase("Mul", [(2, 3), (3,)]),
    "div": GradCase("Div", [(2, 3), (2, 3)]),
    "sum": GradCase("Sum", [(2, 3), (3,), (2, 1)]),
    "concat": GradCase("Concat", [(2, 3), (2, 1), (2, 2)], {"axis": 1}),
    "hard_sigmoid": GradCase("HardSigmoid", [(3, 40)], {"alpha": 1.0, "beta": 0.5}),
    "slice": GradCase("Slice", [(3, 5, 4)], {"starts": [1, 0], "ends": [3, -1], "axes": [0, 2]}, 9),
    "split": GradCase("Split", [(2, 3, 4)], {"axis": 1, "split": [1, 2]}, opset=11, outputs=2),
    "split_equal": GradCase("Split", [(2, 3, 5)], {"axis": -1}, opset=11, outputs=3),
    "transpose": GradCase("Transpose", [(2, 3, 4)], {"perm": [1, 2, 0]}),
    "flatten": GradCase("Flatten", [(2, 3, 4)], {"axis": 2}),
    "global_average_pool": GradCase("GlobalAveragePool", [(2, 3, 4, 5)]),
    "softmax": GradCase("Softmax", [(2, 3, 4)], {"axis": 1}),
    "softmax_opset11": GradCase("Softmax", [(2, 3, 4)], {"axis": 1}, 11),
    "log_softmax": GradCase("LogSoftmax", [(2, 5)]),
    "relu": GradCase("Relu", [(3, 4)]),
    "sigmoid": GradCase("Sigmoid", [(3, 4)]),
    "tanh": GradCase("Tanh", [(3, 4)]),
    "exp": GradCase("Exp", [(3, 4)]),
    "neg": GradCase("Neg", [(3, 4)]),
    "average_pool": GradCase(
        "AveragePool", [(2, 3, 7, 7)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1] * 4}
    ),
    "average_pool_ceil_counting_pads": GradCase(
        "AveragePool",
        [(1, 2, 6, 6)],
        {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1, "count_include_pad": 1},
    ),
    "average_pool_asymmetric": GradCase(
        "AveragePool", [(1, 2, 5, 5)], {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1]}
    ),
    "pad": GradCase("Pad", [(2, 3, 4, 5)], {"pads": [0, 0, 1, 2, 0, 0, 2, 1]}, opset=2),
    "pad_cropping": GradCase("Pad", [(2, 3, 4, 5)], {"pads": [0, 0, -1, 2, 0, 0, 1, -2]}, 2),
    "pad_reflect": GradCase(
        "Pad", [(1, 2, 4, 5)], {"pads": [0, 0, 1, 2, 0, 0, 2, 1], "mode": "reflect"}, opset=2
    ),
    "reduce_mean": GradCase("ReduceMean", [(2, 3, 4)], {"axes": [1, -1], "keepdims": 0}, 13),
    "reduce_mean_kept": GradCase("ReduceMean", [(2, 3, 4)], {"axes": [0]}, 13),
    "reduce_mean_everything": GradCase("ReduceMean", [(2, 3, 4)], {"keepdims": 0}, 13),
    "identity": GradCase("Identity", [(3, 4)]),
}


def _grad_call(case: GradCase) -> VjpCall:
    """``case``'s op on seeded float64 inputs with seeded output gradients, on the host."""
    generator = torch.Generator().manual_seed(3)
    args = [torch.randn(s, generator=generator, dtype=torch.float64) for s in case.shapes]
    spec = OpSpec(
        case.op,
        "node",
        domain=case.domain,
        opset=case.opset,
        attrs=case.attrs,
        inputs=tuple(f"in{i}" for i in range(len(args))),
        outputs=tuple(f"out{i}" for i in range(case.outputs))
        + ((f"out0{case.kept}",) * bool(case.kept)),
    )
    output = kernels.run_forward(spec, args)
    grads: list[torch.Tensor | None] = [
        torch.randn(o.shape, generator=generator, dtype=torch.float64) for o in output
    ]
    if case.kept:  # the backward's alone: no gradient flows to it
        grads[-1] = None
    return VjpCall(spec, args, output, grads, [True] * len(args))


def test_an_attention_that_keeps_its_weights_gives_them_as_its_second_output() -> None:
    """A training graph's fused attention whose backward is the closed form keeps its
    weights (``remat.training``): its forward gives ``softmax(A B scale + M)`` beside the
    output, which is the weights times the values, and its backward reads them."""
    call = _grad_call(GRAD_CASES["attention_weights_kept"])
    a, b, v, mask = call.args
    assert call.output is not None
    output, weights = call.output
    torch.testing.assert_close(weights, torch.softmax(a @ b * 0.4 + mask, dim=-1))
    torch.testing.assert_close(output, weights @ v)
    assert kernels.forward_and_saved(call.spec, call.args)[1] is None  # nothing held beside
    assert "aten::_softmax" not in _kernels_run(call)  # the weights not computed again
    recomputed = kernels.attention_grad_closed_form(call)
    for ours, reference in zip(kernels.vjp(call), recomputed, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_closed_form_gradients_match_autograd(name: str) -> None:
    case = GRAD_CASES[name]
    assert case.op in kernels.VJP_RULES
    call = _grad_call(case)
    ours, reference = kernels.vjp(call), kernels.autograd_vjp(call)
    for position, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert a is not None and b is not None, position
        assert a.shape == b.shape, position
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def _batch_norm_training_call() -> VjpCall:
    generator = torch.Generator().manual_seed(4)
    shapes = [(2, 3, 4, 4), (3,), (3,), (3,), (3,)]
    args = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    args[4] = args[4].abs() + 0.5
    spec = OpSpec(
        "BatchNormalization",
        "bn",
        opset=15,
        attrs={"epsilon": 1e-3, "training_mode": 1},
        inputs=("x", "scale", "bias", "mean", "var"),
        outputs=("y",),
    )
    output = kernels.run_forward(spec, args)
    g = torch.randn(output[0].shape, generator=generator, dtype=torch.float64)
    grads = [g, *[None] * (len(output) - 1)]
    return VjpCall(spec, args, output, grads, [True, True, True, False, False])


@pytest.mark.parametrize("name", ["conv", "conv_transpose", "batch_norm_training"])
def test_a_prepared_rule_runs_no_dispatch_and_matches_autograd(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prepared_vjp`` binds what a convolution's or a training-mode normalisation's rule
    decides from the node alone (window, groups, wanted gradients) once: the rule it gives
    runs PyTorch's fused backward without ``vjp``'s dispatch, with autograd's gradients,
    also with what the forward saved; an asymmetric padding's goes through ``vjp``."""
    call = _batch_norm_training_call() if name == "batch_norm_training" else None
    call = call or _grad_call(GRAD_CASES[name])
    rule = kernels.prepared_vjp(call.spec, call.args, call.wanted)
    reference = kernels.autograd_vjp(call)
    saved = kernels.forward_and_saved(call.spec, call.args)[1]
    asymmetric = _grad_call(GRAD_CASES["conv_asymmetric"])
    generic = kernels.prepared_vjp(asymmetric.spec, asymmetric.args, asymmetric.wanted)

    def dispatched(call: VjpCall) -> kernels.Grads:
        raise AssertionError("vjp dispatched")

    monkeypatch.setattr(kernels, "vjp", dispatched)
    for held in (None, saved):
        ours = rule(call.args, call.output, call.grads, held)
        for position, (a, b) in enumerate(zip(ours, reference, strict=True)):
            assert (a is None) == (b is None), position
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    with pytest.raises(AssertionError, match="dispatched"):
        generic(asymmetric.args, asymmetric.output, asymmetric.grads, None)
    if name == "batch_norm_training":  # a gradient for a running statistic alone: autograd's
        spec = replace(call.spec, outputs=("y", "running_mean", "running_var"))
        output = kernels.run_forward(spec, call.args)
        stats = kernels.prepared_vjp(spec, call.args, call.wanted)
        alone = [None, torch.ones_like(output[1]), None]
        assert stats(call.args, output, alone, None) == [None] * len(call.args)


def _kernels_run(call: VjpCall) -> set[str]:
    """The ATen operators that ``call``'s gradient runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        kernels.vjp(call)
    return {event.name for event in profile.events()}


FLASH_BACKWARD = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"


def test_attention_is_differentiated_by_pytorchs_fused_kernel() -> None:
    """The gradient is PyTorch's fused kernel's (no score matrix held), over few keys and
    many, also with a mask that wants none; with a mask that wants a gradient (PyTorch's
    CPU kernel has none for it), or operands of three dimensions, the closed form, as
    where PyTorch has no fused kernel for the operands (queries and values of different
    widths)."""
    assert FLASH_BACKWARD in _kernels_run(_grad_call(GRAD_CASES["attention_few_keys"]))
    many = _grad_call(GRAD_CASES["attention_many_keys"])
    assert FLASH_BACKWARD in _kernels_run(many)
    assert FLASH_BACKWARD in _kernels_run(_grad_call(GRAD_CASES["attention_many_keys_causal"]))
    assert FLASH_BACKWARD in _kernels_run(_grad_call(GRAD_CASES["attention_grouped"]))
    mask = torch.zeros(1, 1, 1, MANY_KEYS, dtype=torch.float64)
    mask[..., MANY_KEYS // 2 :] = -math.inf  # padding: half the keys masked
    masked = VjpCall(many.spec, [*many.args, mask], None, many.grads, [True, True, True, False])
    assert FLASH_BACKWARD in _kernels_run(masked)
    closed = kernels.attention_grad_closed_form(masked)
    for ours, reference in zip(kernels.vjp(masked), closed, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-9, atol=1e-9)
    masked.wanted = [True, True, True, True]
    assert FLASH_BACKWARD not in _kernels_run(masked)
    assert FLASH_BACKWARD not in _kernels_run(_grad_call(GRAD_CASES["attention_mask_trained"]))
    grouped_closed_form = _grad_call(GRAD_CASES["attention_grouped_mask_trained"])
    assert FLASH_BACKWARD not in _kernels_run(grouped_closed_form)
    assert FLASH_BACKWARD not in _kernels_run(_grad_call(GRAD_CASES["attention_masked"]))
    assert FLASH_BACKWARD not in _kernels_run(_grad_call(GRAD_CASES["attention"]))


FLASH_FORWARD = "aten::_scaled_dot_product_flash_attention_for_cpu"


@pytest.mark.parametrize(
    "case",
    [
        "attention_few_keys",
        "attention_many_keys",
        "attention_many_keys_causal",
        "attention_grouped",
    ],
)
@pytest.mark.parametrize("strided", [False, True], ids=["unit_stride_keys", "strided_keys"])
def test_attention_is_differentiated_from_what_its_forward_saved(case: str, strided: bool) -> None:
    """The forward runs PyTorch's fused kernel (also where ``B`` is stored transposed, its
    keys then copied with unit stride) and saves its log-sum-exp; the backward reads it
    with the output and runs that kernel's backward alone, as autograd does after eager's
    forward, not the forward again; the gradients are those of the backward that runs the
    forward again."""
    call = _grad_call(GRAD_CASES[case])
    if not strided:  # B as a transposed view of keys stored (..., keys, features)
        call.args[1] = call.args[1].transpose(-1, -2).contiguous().transpose(-1, -2)
    spec = call.spec
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as forward:
        output, saved = kernels.forward_and_saved(spec, call.args)
    assert FLASH_FORWARD in {event.name for event in forward.events()}
    assert saved is not None and saved[0].shape == output[0].shape[:-1]  # one per query
    torch.testing.assert_close(output[0], kernels.run_forward(spec, call.args)[0])
    from_saved = VjpCall(spec, call.args, output, call.grads, call.wanted, saved)
    run = _kernels_run(from_saved)
    assert FLASH_BACKWARD in run and FLASH_FORWARD not in run
    again = _kernels_run(call)  # nothing saved: the forward again
    assert FLASH_BACKWARD in again and FLASH_FORWARD in again
    for ours, reference in zip(kernels.vjp(from_saved), kernels.vjp(call), strict=True):
        assert ours is not None and reference is not None
        torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("steps", [[2, 1], [1, -2]], ids=["step_2", "negative_step"])
def test_a_slices_gradient_with_steps_matches_autograd(steps: list[int]) -> None:
    """Starts, ends, axes and steps as inputs (opset 13); a negative step is autograd's."""
    x = torch.randn(5, 6, dtype=torch.float64)
    bounds = [[0, 5], [4, -6]] if steps[1] < 0 else [[0, 1], [5, 6]]
    ints = [torch.tensor(v) for v in (*bounds, [0, 1], steps)]
    spec = OpSpec(
        "Slice", "node", opset=13, inputs=tuple(f"in{i}" for i in range(5)), outputs=("out",)
    )
    args = [x, *ints]
    [y] = kernels.run_forward(spec, args)
    g = torch.randn(y.shape, dtype=torch.float64)
    call = VjpCall(spec, args, (y,), [g], [True, False, False, False, False])
    ours, reference = kernels.vjp(call)[0], kernels.autograd_vjp(call)[0]
    assert ours is not None and reference is not None
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_an_rms_norms_backward_reads_the_inverse_root_its_forward_saved() -> None:
    """The forward runs PyTorch's fused kernel and saves its inverse root mean square per
    slice; the backward from it gives the gradients of the backward that takes it again
    from the input, and of autograd."""
    call = _grad_call(GRAD_CASES["fused_rms_norm"])
    output, saved = kernels.forward_and_saved(call.spec, call.args)
    assert saved is not None and saved[0].shape == (*output[0].shape[:-1], 1)
    torch.testing.assert_close(output[0], kernels.run_forward(call.spec, call.args)[0])
    from_saved = VjpCall(call.spec, call.args, output, call.grads, call.wanted, saved)
    reference = kernels.autograd_vjp(call)
    for ours, again, exact in zip(
        kernels.vjp(from_saved), kernels.vjp(call), reference, strict=True
    ):
        assert ours is not None and again is not None and exact is not None
        torch.testing.assert_close(ours, again, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ours, exact, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("keepdims", [0, 1])
def test_a_means_gradient_with_its_axes_an_input_matches_autograd(keepdims: int) -> None:
    """``ReduceMean`` from opset 18 on, its axes an input (as the dynamo exporter writes a
    global average pool or a squeeze-excitation's)."""
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    spec = OpSpec(
        "ReduceMean", "node", opset=18, attrs={"keepdims": keepdims},
        inputs=("in0", "in1"), outputs=("out",),
    )  # fmt: skip
    args = [x, torch.tensor([-1, 2])]
    [y] = kernels.run_forward(spec, args)
    g = torch.randn(y.shape, dtype=torch.float64)
    call = VjpCall(spec, args, (y,), [g], [True, False])
    ours, reference = kernels.vjp(call)[0], kernels.autograd_vjp(call)[0]
    assert ours is not None and reference is not None
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["fused_unbind", "split_equal"])
def test_a_parts_gradient_is_zero_where_none_flows_to_it(name: str) -> None:
    """An unbind's and a Split's gradient where the second part gets none."""
    call = _grad_call(GRAD_CASES[name])
    call.grads = [call.grads[0], None, call.grads[2]]
    ours, reference = kernels.vjp(call)[0], kernels.autograd_vjp(call)[0]
    assert ours is not None and reference is not None
    torch.testing.assert_close(ours, reference, rtol=1e-9, atol=1e-9)
    second = ours[:, 1] if name == "fused_unbind" else ours[..., 2:4]
    assert not second.any()


def test_gradients_that_need_no_inputs_work_from_placeholders() -> None:
    """Add's, Concat's and AveragePool's gradients need shapes only: zero-stride
    placeholders allocate nothing and give the same gradients as the real inputs."""
    pool = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}
    for op, shapes, attrs in (
        ("Add", [(2, 3), (3,)], {}),
        ("Concat", [(2, 3), (2, 2)], {"axis": 1}),
        ("AveragePool", [(2, 3, 7, 7)], pool),
    ):
        names = ("a", "b")[: len(shapes)]
        spec = OpSpec(op, "n", attrs=attrs, inputs=names, outputs=("y",))
        real = [torch.randn(s) for s in shapes]
        fake = [kernels.placeholder(s, torch.float32, torch.device("cpu")) for s in shapes]
        assert all(p.untyped_storage().nbytes() == 4 for p in fake)
        g = torch.randn(kernels.run_forward(spec, real)[0].shape)
        wanted = [True] * len(shapes)
        with_real = kernels.vjp(VjpCall(spec, real, None, [g], wanted))
        with_fake = kernels.vjp(VjpCall(spec, fake, None, [g], wanted))
        for a, b in zip(with_real, with_fake, strict=True):
            assert a is not None and b is not None
            torch.testing.assert_close(a, b)


MAX_POOLS: dict[str, tuple[tuple[int, ...], dict[str, Any]]] = {
    "2x2": ((2, 3, 6, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    "overlapping_ceil": (
        (1, 2, 7, 7),
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
    ),
    "asymmetric_pads": ((1, 2, 7, 7), {"kernel_shape": [2, 2], "auto_pad": "SAME_LOWER"}),
    "large_pads": ((1, 1, 5, 5), {"kernel_shape": [3, 3], "pads": [2, 0, 0, 2]}),
    "dilated": ((1, 2, 9, 9), {"kernel_shape": [2, 2], "dilations": [2, 2]}),
    "1d": ((2, 3, 9), {"kernel_shape": [3], "strides": [2]}),
    "3d": ((1, 2, 4, 4, 4), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}),
}


# Where torch cannot pool the input itself (it is padded with -inf first), a kept argmax
# holds ONNX's indices too
ONNX_ARGMAX = {"asymmetric_pads", "large_pads"}


@pytest.mark.parametrize("kept", [False, True], ids=["indices", "kept_argmax"])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("name", sorted(MAX_POOLS))
def test_maxpool_gradient_from_its_argmax_matches_autograd(
    name: str, ties: bool, kept: bool
) -> None:
    """MaxPool's gradient from the argmax its forward kernel gave, with a placeholder for
    the input, against autograd re-running the pooling: the model's ``Indices`` hold ONNX's
    indices (into the flattened input, ignoring padding), a training graph's kept argmax
    PyTorch's (per plane) where torch pools the input itself; ``ties``: a ReLU'd input,
    whose zeros tie."""
    shape, attrs = MAX_POOLS[name]
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    if ties:
        x = x.clamp(min=0)
    argmax = "y" + kernels.KEPT_ARGMAX if kept else "indices"
    spec = OpSpec("MaxPool", "pool", attrs=attrs, inputs=("x",), outputs=("y", argmax))
    output = kernels.run_forward(spec, [x])
    assert output[1].dtype == torch.int64
    if kept and name not in ONNX_ARGMAX:  # PyTorch's, per plane
        taken = x.flatten(2).gather(2, output[1].flatten(2))
        assert torch.equal(taken, output[0].flatten(2))
    else:
        assert torch.equal(x.flatten()[output[1]], output[0])  # ONNX's indices, as ORT's
    g = torch.randn(output[0].shape, generator=generator, dtype=torch.float64)
    hollow = kernels.placeholder(shape, x.dtype, x.device)
    (ours,) = kernels.vjp(VjpCall(spec, [hollow], output, [g, None], [True]))
    (reference,) = kernels.autograd_vjp(VjpCall(spec, [x], output, [g, None], [True]))
    assert ours is not None and reference is not None
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12)


# --- program layout -------------------------------------------------------------------------


def _training_values(
    program: Program, device: torch.device
) -> tuple[dict[int, tuple[torch.Tensor, ...]], dict[str, torch.Tensor]]:
    """Every node's value of a training graph computed in node order on ``device``, each
    checked for the graph's bytes and for spanning its storage (no view into part of a
    larger buffer, which would keep all of it); and the gradient buffers."""
    fixed = {name: t.to(device) for name, t in program.fixed.items()}
    grads = GradientBuffers.allocate(sorted(program.trainable), program.fixed, device)
    values: dict[int, tuple[torch.Tensor, ...]] = {}
    for node in program.graph.nodes:
        value = program.compute(node.id, values, fixed, grads, device)
        assert value_bytes(value) == node.output_bytes, node.name
        for t in value:
            assert t.device.type == device.type, node.name
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), node.name
        values[node.id] = value
    grads.settle()
    return values, grads


def test_a_gradient_buffer_takes_its_first_gradient_unless_shared_then_adds() -> None:
    """The first gradient written into a buffer takes its place (no fill, no add) unless
    its storage is another tensor's too; later ones are added; a buffer never written
    settles to zeros."""
    like = {"w": torch.zeros(3), "v": torch.zeros(3), "u": torch.zeros(3)}
    buffers = GradientBuffers.allocate(["w", "v", "u"], like, torch.device("cpu"))
    g = torch.ones(3)
    buffers.add("w", g, shared=False)
    assert buffers["w"].data_ptr() == g.data_ptr()
    buffers.add("w", torch.full((3,), 2.0), shared=False)
    upstream = torch.full((3,), 5.0)
    buffers.add("v", upstream, shared=True)
    assert buffers["v"].data_ptr() != upstream.data_ptr()
    buffers.add("v", torch.ones(1), shared=False)  # broadcast, as add_ does
    buffers.settle()
    assert buffers["w"].tolist() == [3.0] * 3 and upstream.tolist() == [5.0] * 3
    assert buffers["v"].tolist() == [6.0] * 3 and buffers["u"].tolist() == [0.0] * 3
    buffers.rewind()
    buffers.add("u", torch.ones(3), shared=False)
    assert buffers["u"].tolist() == [1.0] * 3


def test_fused_backward_kernels_parameter_gradients_are_taken_unchecked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Conv's and a BatchNormalization's parameter gradients, which PyTorch's fused
    backward kernels make as tensors of their own, are taken by their buffers without the
    storage check (``kernels.FRESH_GRADIENTS``, ``GradientBuffers.take``); a Gemm's go
    through it (``add``); every buffer is written."""
    model = FAMILIES["resnet18"]()
    graph = training_graph(forward_graph(model))
    checked: list[str] = []
    add = GradientBuffers.add

    def noted(self: GradientBuffers, name: str, grad: torch.Tensor, shared: bool) -> None:
        checked.append(name)
        add(self, name, grad, shared)

    monkeypatch.setattr(GradientBuffers, "add", noted)
    _, grads = _training_values(build_program(model, graph), torch.device("cpu"))
    reader = {t: node.op for node in graph.forward_nodes() for t in node.fixed}
    assert {reader[t] for t in set(grads) - set(checked)} == {"Conv", "BatchNormalization"}
    assert {reader[t] for t in checked} == {"Gemm"}
    assert all(float(g.abs().max()) > 0 for g in grads.values())


@pytest.mark.parametrize("family", ["resnet18", "unet", "transformer", "old_style"])
def test_training_values_have_the_graphs_bytes(family: str) -> None:
    """Every node's value (forward, loss, backward) in node order is exactly as large as
    the graph says, and spans its storage."""
    model = FAMILIES[family]()
    graph = training_graph(forward_graph(model))
    _, grads = _training_values(build_program(model, graph), torch.device("cpu"))
    kinds = {n.kind for n in graph.nodes}
    assert kinds == {NodeKind.FORWARD, NodeKind.LOSS, NodeKind.BACKWARD}
    assert any(float(g.abs().max()) > 0 for g in grads.values())


def test_a_training_step_pools_once_per_maxpool() -> None:
    """A MaxPool's backward node takes the argmax its forward kept: over a training step of
    VGG16 (five pools) PyTorch's pooling kernel runs five times, not ten, and its backward
    kernel takes that argmax as it is (PyTorch's indices, not ONNX's)."""
    model = FAMILIES["vgg16"]()
    graph = training_graph(forward_graph(model))
    pools = sum(1 for n in graph.forward_nodes() if n.op == "MaxPool")
    assert pools == 5
    program = build_program(model, graph)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        _training_values(program, torch.device("cpu"))
    calls = {e.key: e.count for e in profiled.key_averages()}
    assert calls.get("aten::max_pool2d_with_indices") == pools
    assert calls.get("aten::max_pool2d_with_indices_backward") == pools


def test_a_value_shares_a_whole_storage_and_copies_part_of_one() -> None:
    """A Transpose of a whole tensor shares its storage (as eager PyTorch's view does; the
    account counts it as its own bytes); a Slice of part of one is copied, since it would
    keep the whole buffer allocated for its own bytes."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[1, 0]),
        helper.make_node("Slice", ["r", "starts", "ends"], ["s"], name="slice"),
        helper.make_node("Add", ["t", "t"], ["y"], name="add_t"),
        helper.make_node("Add", ["s", "s"], ["z"], name="add_s"),
    ]
    consts = {"starts": np.array([1], np.int64), "ends": np.array([3], np.int64)}
    graph = helper.make_graph(
        nodes,
        "views",
        [helper.make_tensor_value_info("x", F32, [4, 6])],
        [helper.make_tensor_value_info(o, F32, None) for o in ("y", "z")],
        initializer=[numpy_helper.from_array(v, n) for n, v in consts.items()],
    )
    opsets = [helper.make_opsetid("", 17)]
    model = helper.make_model(
        graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets)
    )
    program = build_program(model, forward_graph(model))
    values = program.forward_values()
    by_name = {program.graph.nodes[i].name: v[0] for i, v in values.items()}
    relu, transposed, sliced = by_name["relu"], by_name["transpose"], by_name["slice"]
    assert transposed.untyped_storage().data_ptr() == relu.untyped_storage().data_ptr()
    assert torch.equal(transposed, relu.t())
    assert sliced.untyped_storage().nbytes() == sliced.numel() * 4 == relu.nbytes // 2
    assert torch.equal(sliced, relu[1:3])


def test_folded_constants_are_evaluated() -> None:
    """old_style's conv bias (ConstantOfShape) and flatten shape (Shape/Gather/Concat of an
    activation) are fixed tensors computed when the program is built."""
    model = samples.old_style_model(batch=3)
    program = build_program(model, forward_graph(model))
    assert program.fixed["conv2_bias"].tolist() == pytest.approx([0.01] * 16)
    assert program.fixed["flatten_concat"].tolist() == [3, -1]


def test_a_node_reads_what_an_operator_ingestion_bypassed_read() -> None:
    """An Identity before a Clip whose min is omitted (an empty middle input): ingestion
    bypasses the Identity (``remat.onnx_noops``), and the program binds the Clip's input
    to the Relu's output, in its position, matching onnxruntime on the model as given."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Identity", ["r"], ["i"], name="identity"),
        helper.make_node("Clip", ["i", "", "high"], ["y"], name="clip"),
    ]
    graph = helper.make_graph(
        nodes,
        "bypassed",
        [helper.make_tensor_value_info("x", F32, [2, 5])],
        [helper.make_tensor_value_info("y", F32, [2, 5])],
        [numpy_helper.from_array(np.array(0.5, np.float32), "high")],
    )
    opsets = [helper.make_opsetid("", 17)]
    model = helper.make_model(
        graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets)
    )
    program = _assert_forward_matches(model)
    assert [n.op for n in program.graph.nodes] == ["Relu", "Clip"]
    assert program.specs[1].op_type == "Clip" and program.sources[1][0].node == 0
    assert program.sources[1][2].fixed == "high"


def test_an_operator_whose_output_a_folded_shape_reads_is_kept() -> None:
    """A Dropout in inference mode computes nothing, but a folded ``Shape`` reads its
    output by name (the program evaluates that shape from the graph's tensors): it stays a
    node, and the Reshape to that shape (a model output) runs against onnxruntime."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Dropout", ["r"], ["d"], name="dropout"),
        helper.make_node("Shape", ["d"], ["s"], name="shape"),
        helper.make_node("Reshape", ["d", "s"], ["y"], name="reshape"),
    ]
    graph = helper.make_graph(
        nodes,
        "kept",
        [helper.make_tensor_value_info("x", F32, [2, 5])],
        [helper.make_tensor_value_info("y", F32, [2, 5])],
    )
    opsets = [helper.make_opsetid("", 17)]
    model = helper.make_model(
        graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets)
    )
    program = _assert_forward_matches(model)
    assert [n.op for n in program.graph.nodes] == ["Relu", "Dropout", "Reshape"]


def test_inputs_are_seeded_or_given() -> None:
    model = samples.chain(2, batch=2, features=4)
    graph = forward_graph(model)
    first, again = build_program(model, graph, seed=5), build_program(model, graph, seed=5)
    torch.testing.assert_close(first.fixed["input"], again.fixed["input"])
    given = np.ones((2, 4), np.float32)
    program = build_program(model, graph, inputs={"input": given})
    assert program.fixed["input"].tolist() == given.tolist()


# --- CUDA -----------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda", 0)


@pytest.fixture
def ieee() -> Iterator[None]:
    """CUDA in IEEE fp32, as the executor and the profiler run it (PyTorch's default TF32
    convolutions are 3e-4 off onnxruntime on the small ResNet and MobileNet)."""
    with ieee_fp32():
        yield


def _relative_error(got: torch.Tensor, expected: torch.Tensor, floor: float = 1e-6) -> float:
    """``max|a - b| / max|b|``, ``max|b|`` floored at ``floor`` (a value that is zero in exact
    arithmetic holds rounding noise, not a scale)."""
    a, b = got.detach().double().cpu(), expected.detach().double().cpu()
    if not b.numel():
        return 0.0
    scale = max(float(b.abs().max()), floor)
    return float((a - b).abs().max()) / scale


@needs_cuda
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sample_families_on_cuda_match_onnxruntime(
    family: str, ieee: None
) -> None:  # pragma: no cover
    _assert_forward_matches(FAMILIES[family](), CUDA)


@needs_cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_single_operator_on_cuda_matches_onnxruntime(
    name: str, ieee: None
) -> None:  # pragma: no cover
    _assert_forward_matches(_single_op_model(CASES[name]), CUDA)


@needs_cuda
@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_closed_form_gradients_on_cuda_match_the_host(name: str) -> None:  # pragma: no cover
    """float64: the closed forms on CUDA equal autograd on CUDA and the host's closed forms."""
    call = _grad_call(GRAD_CASES[name])
    host = kernels.vjp(call)
    moved = VjpCall(
        call.spec,
        [a.to(CUDA) for a in call.args],
        [o.to(CUDA) for o in call.output],
        [None if g is None else g.to(CUDA) for g in call.grads],
        call.wanted,
    )
    ours, reference = kernels.vjp(moved), kernels.autograd_vjp(moved)
    for position, (a, b, h) in enumerate(zip(ours, reference, host, strict=True)):
        assert a is not None and b is not None and h is not None, position
        assert a.device.type == "cuda", position
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(a.cpu(), h, rtol=1e-9, atol=1e-9)


@needs_cuda
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_on_cuda_matches_the_host(family: str, ieee: None) -> None:  # pragma: no cover
    """Every node's value of a training graph on CUDA has the graph's bytes and owns its
    storage; the forward values and the loss equal the host's (fp32: relative error at most
    1e-4); the gradients accumulated into the buffers are as close to exact (float64) as the
    executor requires (see ``agents.executor.accuracy``). Backward values are not compared
    one by one: where a gradient is zero in exact arithmetic (all of them below the
    transformer's final LayerNorm, whose loss is scale-invariant) both sides hold rounding
    noise."""
    model = FAMILIES[family]()
    program = build_program(model, training_graph(forward_graph(model)))
    host, host_grads = _training_values(program, torch.device("cpu"))
    cuda, cuda_grads = _training_values(program, CUDA)
    for node in program.graph.nodes:
        if node.kind is NodeKind.BACKWARD:
            continue
        for k, (a, b) in enumerate(zip(cuda[node.id], host[node.id], strict=True)):
            if not b.is_floating_point():
                assert torch.equal(a.cpu(), b), (node.name, k)
                continue
            error = _relative_error(a, b)
            assert error <= RTOL, f"{node.name} ({node.op}) value {k}: rel error {error:.2e}"
    exact = program.in_float64().reference_gradients()
    assert set(cuda_grads) == set(host_grads) == set(exact)
    allowed = max(RTOL, CUDA_ALLOWANCE * max_relative_error(host_grads, exact))
    error = max_relative_error(cuda_grads, exact)
    assert error <= allowed, f"gradients: rel error {error:.2e} (allowed {allowed:.2e})"


def test_a_gradient_shares_storage_with_its_views_bases_and_the_tensors_read() -> None:
    """A gradient is taken into its buffer only where no other tensor holds its storage:
    not where it is a view of the upstream gradient or has a view of its own, is itself a
    tensor the node read (a pass-through), or is the gradient at two positions."""
    from agents.program import _shares_storage

    upstream = torch.ones(2, 3)
    fresh = upstream * 2
    assert not _shares_storage(fresh, [fresh, None], ([upstream], ()))
    assert _shares_storage(upstream, [upstream], ([], [upstream]))  # a pass-through
    view = upstream.reshape(3, 2)
    assert _shares_storage(view, [view], ([], [upstream]))  # a view of what was read
    base = torch.ones(6)
    held = base.view(2, 3)
    assert _shares_storage(base, [base], ())  # a tensor holds a view of it
    del held
    assert not _shares_storage(base, [base], ())
    assert _shares_storage(fresh, [fresh, fresh], ())  # the gradient at two positions


def test_a_linear_layers_transposed_input_is_multiplied_as_one_matrix() -> None:
    """A ``MatMulAdd`` whose input is a transposed view of three axes (attention's input
    projection after a layout change) runs as one ``addmm`` over the flattened batch, not
    PyTorch's batch-by-batch ``bmm`` against the broadcast weight, with the same result."""
    x = torch.randn(8, 32, 16).transpose(0, 1)
    w, b = torch.randn(16, 24), torch.randn(24)
    spec = OpSpec(
        MATMUL_ADD,
        "node",
        domain=FUSED_DOMAIN,
        inputs=("x", "w", "b"),
        outputs=("y",),
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        [y] = kernels.run_forward(spec, [x, w, b])
    ops = {e.key for e in profiled.key_averages()}
    assert "aten::addmm" in ops and "aten::bmm" not in ops
    torch.testing.assert_close(y, x @ w + b)


@pytest.mark.parametrize("fused", [True, False], ids=["matmul_add", "matmul"])
def test_a_products_transposed_upstream_gradient_is_multiplied_as_one_matrix(
    fused: bool,
) -> None:
    """The backward of a product with a weight matrix, whose upstream gradient of four axes
    is a layout change's transposed view (ConvNeXt's channels-last blocks: a batch that
    does not flatten), multiplies it as one matrix (``mm``), not batch by batch (``bmm``),
    and matches autograd's gradients."""
    x, w, b = torch.randn(8, 2, 2, 16), torch.randn(16, 24), torch.randn(24)
    g = torch.randn(8, 24, 2, 2).permute(0, 2, 3, 1)
    if fused:
        spec = OpSpec(
            MATMUL_ADD, "node", domain=FUSED_DOMAIN, inputs=("x", "w", "b"), outputs=("y",)
        )
        args: list[torch.Tensor | None] = [x, w, b]
    else:
        spec = OpSpec("MatMul", "node", inputs=("x", "w"), outputs=("y",))
        args = [x, w]
    call = VjpCall(spec, args, None, [g], [True] * len(args))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        found = kernels.vjp(call)
    ops = {e.key for e in profiled.key_averages()}
    assert "aten::mm" in ops and "aten::bmm" not in ops
    leaves = [a.clone().requires_grad_(True) for a in args if a is not None]
    y = leaves[0] @ leaves[1] + (leaves[2] if fused else 0)
    expected = torch.autograd.grad(y, leaves, g)
    for got, want in zip(found, expected, strict=True):
        torch.testing.assert_close(got, want)


_SIXTH = float(np.float32(1 / 6))  # as an exporter's float32 attribute holds it


@pytest.mark.parametrize(
    ("case", "formula", "kernel"),
    [
        (
            GradCase("HardSwish", [(4, 50)], opset=14),
            lambda x: x * torch.clamp(x / 6 + 0.5, 0, 1),
            "aten::hardswish_backward",
        ),
        (
            GradCase("HardSigmoid", [(4, 50)], {"alpha": _SIXTH, "beta": 0.5}),
            lambda x: torch.clamp(_SIXTH * x + 0.5, 0, 1),
            "aten::hardsigmoid_backward",
        ),
        (GradCase("Sigmoid", [(4, 50)]), torch.sigmoid, "aten::sigmoid_backward"),
        (GradCase("Tanh", [(4, 50)]), torch.tanh, "aten::tanh_backward"),
    ],
    ids=["hard_swish", "hard_sigmoid_sixth", "sigmoid", "tanh"],
)
def test_activations_are_differentiated_by_pytorchs_one_pass_kernels(
    case: GradCase, formula: Callable[[torch.Tensor], torch.Tensor], kernel: str
) -> None:
    """HardSwish, HardSigmoid on PyTorch's own line, Sigmoid and Tanh take PyTorch's
    backward kernel (one pass, as eager autograd runs them, not three elementwise
    operations), and their gradients are those of the ONNX formula."""
    call = _grad_call(case)
    assert kernel in _kernels_run(call)
    x = call.arg(0).detach().mul(4).requires_grad_(True)  # past the hard kinks at +-3
    call = VjpCall(
        call.spec, [x.detach()], kernels.run_forward(call.spec, [x.detach()]), [call.g], [True]
    )
    [expected] = torch.autograd.grad(formula(x), [x], call.g)
    [ours] = kernels.vjp(call)
    assert ours is not None
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-12)


def test_an_upstream_gradient_of_several_parts_sums_into_one_new_tensor() -> None:
    """Three consumers' gradients of one output sum into one tensor of its own (the second
    and third added into it), and the consumers' values are left as they were."""
    from agents.program import _summed

    parts = [torch.full((2, 3), float(k)) for k in (1, 2, 4)]
    values = {10 + k: (torch.zeros(1), part) for k, part in enumerate(parts)}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        total = _summed(
            values, [(10, 1), (11, 1), (12, 1)], (2, 3), torch.float32, torch.device("cpu")
        )
    calls = {e.key: e.count for e in profiled.key_averages()}
    assert calls.get("aten::add") == 1 and calls.get("aten::add_") == 1
    assert total.tolist() == [[7.0] * 3] * 2
    assert all(total.data_ptr() != part.data_ptr() for part in parts)
    assert [float(part[0, 0]) for part in parts] == [1.0, 2.0, 4.0]
