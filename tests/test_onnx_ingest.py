"""ONNX ingestion: loading, input shapes, constant folding, node sizes and FLOPs.

Every model is built inline with onnx.helper.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from remat import ops
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.errors import (
    EmptyModelError,
    InvalidInputError,
    ModelLoadError,
    RematError,
    ShapeError,
)
from remat.graph import FixedKind, Graph, Mode, NodeKind
from remat.onnx_fusion import ATTENTION, LAYOUT, ROTARY
from remat.onnx_ingest import (
    forward_graph,
    load_forward_graph,
    load_model,
    parse_input_shape,
    reference_ops,
)
from remat.simulator import held_fixed_bytes
from remat.training import gradient_needs, kept_bytes, training_graph

from graphs import causal_attention, grouped_query_attention, rotary_embedding

F32 = TensorProto.FLOAT
OPSETS = (9, 13, 17, 21)
X_SHAPE = (2, 3, 8, 8)  # 384 elements


# --- builders -----------------------------------------------------------------------------


def vi(name: str, shape: Sequence[int | str] | None, dtype: int = F32) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def out(name: str, rank: int, dtype: int = F32) -> onnx.ValueInfoProto:
    """A graph output with symbolic dims: the checker wants a shape, ingestion ignores it."""
    return vi(name, [f"{name}_d{i}" for i in range(rank)], dtype)


def init(name: str, value: Sequence | np.ndarray, dtype: type = np.float32) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def ones(name: str, shape: Sequence[int], dtype: type = np.float32) -> TensorProto:
    return numpy_helper.from_array(np.ones(shape, dtype=dtype), name)


def const_node(name: str, value: Sequence | np.ndarray, dtype: type = np.int64) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, dtype))
    )


def model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[TensorProto] = (),
    opset: int = 17,
    value_info: Sequence[onnx.ValueInfoProto] = (),
    extra_opsets: Sequence[onnx.OperatorSetIdProto] = (),
) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes), "test", list(inputs), list(outputs), list(initializers), value_info=value_info
    )
    opsets = [helper.make_opsetid("", opset), *extra_opsets]
    return helper.make_model(graph, opset_imports=opsets)


def single_op(
    node: onnx.NodeProto,
    out_rank: int,
    initializers: Sequence[TensorProto] = (),
    opset: int = 17,
    x_shape: Sequence[int | str] = X_SHAPE,
    dtype: int = F32,
) -> onnx.ModelProto:
    outputs = [out(o, out_rank, dtype) for o in node.output if o]
    return model([node], [vi("x", x_shape, dtype)], outputs, initializers, opset)


def ingest(m: onnx.ModelProto, **kwargs) -> Graph:
    """Through bytes and load_model, as the CLI does (this also runs the checker)."""
    return load_forward_graph(m.SerializeToString(), **kwargs)


def ops_of(graph: Graph) -> list[str]:
    return [n.op for n in graph.nodes]


# --- every listed operator, across opsets --------------------------------------------------


@dataclass(frozen=True)
class OpCase:
    """One operator applied to ``x`` of shape X_SHAPE (unless ``x_shape`` says otherwise)."""

    build: Callable[[int], tuple[onnx.NodeProto, list[TensorProto]]]
    out_elems: int  # summed over outputs
    flops: float
    out_rank: int = 4
    x_shape: tuple[int, ...] = X_SHAPE


def _node(op: str, inputs: Sequence[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, list(inputs), ["y"], **attrs)


def _unary(op: str, **attrs) -> Callable[[int], tuple[onnx.NodeProto, list[TensorProto]]]:
    return lambda opset: (_node(op, ["x"], **attrs), [])


def _split(opset: int) -> tuple[onnx.NodeProto, list[TensorProto]]:
    if opset >= 13:
        node = helper.make_node("Split", ["x", "split"], ["y0", "y1"], axis=1)
        return node, [init("split", [1, 2], np.int64)]
    return helper.make_node("Split", ["x"], ["y0", "y1"], axis=1, split=[1, 2]), []


def _pad(opset: int) -> tuple[onnx.NodeProto, list[TensorProto]]:
    pads = [0, 0, 1, 1, 0, 0, 1, 1]
    if opset >= 11:
        return _node("Pad", ["x", "pads"]), [init("pads", pads, np.int64)]
    return _node("Pad", ["x"], pads=pads), []


def _with(op: str, params: dict[str, np.ndarray], **attrs):
    def build(opset: int) -> tuple[onnx.NodeProto, list[TensorProto]]:
        tensors = [numpy_helper.from_array(v, k) for k, v in params.items()]
        return _node(op, ["x", *params], **attrs), tensors

    return build


def _f(*shape: int) -> np.ndarray:
    return np.ones(shape, np.float32)


N = 384  # elements of X_SHAPE
OP_CASES: dict[str, OpCase] = {
    # out (2,4,8,8)=512: 2*512*3*9 MACs + 512 bias
    "Conv": OpCase(
        _with("Conv", {"W": _f(4, 3, 3, 3), "B": _f(4)}, pads=[1, 1, 1, 1]), 512, 28160, 4
    ),
    # out (2,4,10,10); 2 * in_elems(384) * Cout(4) * 9
    "ConvTranspose": OpCase(_with("ConvTranspose", {"W": _f(3, 4, 3, 3)}), 800, 27648),
    "BatchNormalization": OpCase(
        _with("BatchNormalization", {k: _f(3) for k in ("s", "b", "m", "v")}), N, 5 * N
    ),
    "InstanceNormalization": OpCase(
        _with("InstanceNormalization", {"s": _f(3), "b": _f(3)}), N, 8 * N
    ),
    "LayerNormalization": OpCase(_with("LayerNormalization", {"s": _f(8), "b": _f(8)}), N, 8 * N),
    "Relu": OpCase(_unary("Relu"), N, N),
    "LeakyRelu": OpCase(_unary("LeakyRelu", alpha=0.1), N, N),
    "Sigmoid": OpCase(_unary("Sigmoid"), N, 4 * N),
    "Tanh": OpCase(_unary("Tanh"), N, 4 * N),
    "Gelu": OpCase(_unary("Gelu"), N, 8 * N),
    "Softmax": OpCase(_unary("Softmax", axis=1), N, 5 * N),
    "LogSoftmax": OpCase(_unary("LogSoftmax", axis=1), N, 5 * N),
    # out (2,3,4,4)=96, 2x2 window
    "MaxPool": OpCase(_unary("MaxPool", kernel_shape=[2, 2], strides=[2, 2]), 96, 96 * 4),
    "AveragePool": OpCase(_unary("AveragePool", kernel_shape=[2, 2], strides=[2, 2]), 96, 96 * 4),
    "GlobalAveragePool": OpCase(_unary("GlobalAveragePool"), 6, N),
    # (2,16) x (10,16)^T + C: 2*M*N*K + M*N
    "Gemm": OpCase(_with("Gemm", {"B": _f(10, 16), "C": _f(10)}, transB=1), 20, 660, 2, (2, 16)),
    # (2,3,8,8) @ (8,5) -> (2,3,8,5)=240; 2 * 240 * 8
    "MatMul": OpCase(_with("MatMul", {"W": _f(8, 5)}), 240, 3840),
    "Add": OpCase(_with("Add", {"c": _f(8)}), N, N),
    "Sub": OpCase(_with("Sub", {"c": _f(8)}), N, N),
    "Mul": OpCase(_with("Mul", {"c": _f(8)}), N, N),
    "Div": OpCase(_with("Div", {"c": _f(8)}), N, N),
    "Sum": OpCase(_with("Sum", {"c": _f(8), "d": _f(8)}), N, 2 * N),
    "Concat": OpCase(_with("Concat", {"c": _f(*X_SHAPE)}, axis=1), 2 * N, 0),
    "Split": OpCase(_split, N, 0),
    "Reshape": OpCase(
        lambda opset: (_node("Reshape", ["x", "s"]), [init("s", [2, -1], np.int64)]), N, 0, 2
    ),
    "Flatten": OpCase(_unary("Flatten", axis=1), N, 0, 2),
    "Transpose": OpCase(_unary("Transpose", perm=[0, 2, 3, 1]), N, 0),
    "Dropout": OpCase(_unary("Dropout"), N, 0),
    "LRN": OpCase(_unary("LRN", size=3), N, 3 * N),
    "Pad": OpCase(_pad, 600, 0),
    "Identity": OpCase(_unary("Identity"), N, 0),
}


def _exists(op: str, opset: int) -> bool:
    try:
        onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return False
    return True


OP_PARAMS = [
    pytest.param(op, opset, id=f"{op}-opset{opset}")
    for op in OP_CASES
    for opset in OPSETS
    if _exists(op, opset)
]


def test_op_table_covers_each_listed_op_in_some_opset() -> None:
    # Guards the parametrization itself: an op silently dropped from every opset would
    # otherwise go untested.
    covered = {p.values[0] for p in OP_PARAMS}
    assert covered == set(OP_CASES)
    assert ("Gelu", 17) not in {tuple(p.values) for p in OP_PARAMS}


@pytest.mark.parametrize(("op", "opset"), OP_PARAMS)
def test_each_op_is_one_scheduled_node_with_exact_bytes_and_flops(op: str, opset: int) -> None:
    case = OP_CASES[op]
    node, params = case.build(opset)
    graph = ingest(single_op(node, case.out_rank, params, opset, case.x_shape))

    assert ops_of(graph) == [op]
    (scheduled,) = graph.nodes
    assert scheduled.kind is NodeKind.FORWARD
    assert scheduled.output_bytes == case.out_elems * 4
    assert scheduled.flops == pytest.approx(case.flops)
    assert scheduled.deps == ()
    assert scheduled.fixed[0] == "x"
    x_bytes = int(np.prod(case.x_shape)) * 4
    param_bytes = sum(int(np.prod(t.dims)) * (8 if t.data_type == 7 else 4) for t in params)
    assert scheduled.input_bytes == x_bytes + param_bytes
    assert set(scheduled.fixed) == {"x", *(t.name for t in params)}
    assert graph.outputs == (0,)
    assert graph.mode is Mode.INFERENCE


# --- sizes --------------------------------------------------------------------------------


def test_float16_model_counts_two_bytes_per_element() -> None:
    weight = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float16), "W")
    node = helper.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1, 1, 1])
    graph = ingest(single_op(node, 4, [weight], dtype=TensorProto.FLOAT16))
    assert graph.nodes[0].output_bytes == 512 * 2
    assert graph.fixed["W"].nbytes == 108 * 2
    assert graph.fixed["x"].nbytes == 384 * 2
    assert graph.nodes[0].input_bytes == (108 + 384) * 2


@pytest.mark.parametrize(
    ("dtype", "size"),
    [
        (TensorProto.FLOAT16, 2),
        (TensorProto.BFLOAT16, 2),
        (TensorProto.DOUBLE, 8),
        (TensorProto.INT64, 8),
        (TensorProto.INT32, 4),
        (TensorProto.INT8, 1),
        (TensorProto.UINT8, 1),
        (TensorProto.BOOL, 1),
    ],
)
def test_output_bytes_follow_dtype(dtype: int, size: int) -> None:
    node = helper.make_node("Cast", ["x"], ["y"], to=dtype)
    graph = ingest(model([node], [vi("x", X_SHAPE)], [out("y", 4, dtype)]))
    assert graph.nodes[0].output_bytes == 384 * size


def test_comparison_produces_bool_bytes() -> None:
    node = helper.make_node("Greater", ["x", "c"], ["y"])
    m = model([node], [vi("x", X_SHAPE)], [out("y", 4, TensorProto.BOOL)], [init("c", [0.0])])
    assert ingest(m).nodes[0].output_bytes == 384


def test_multi_output_node_sums_all_outputs() -> None:
    node = helper.make_node("Split", ["x", "split"], ["a", "b", "c"], axis=1)
    m = model(
        [node], [vi("x", X_SHAPE)], [out(n, 4) for n in "abc"], [init("split", [1, 1, 1], np.int64)]
    )
    graph = ingest(m)
    assert len(graph) == 1
    assert graph.nodes[0].output_bytes == 3 * 128 * 4
    assert graph.nodes[0].attrs["output_shapes"] == [(2, 1, 8, 8)] * 3


def test_unused_and_empty_optional_outputs() -> None:
    # A training Dropout's mask is a real (bool) output; LayerNorm's empty-named Mean is
    # skipped.
    dropout = helper.make_node("Dropout", ["x", "ratio", "training"], ["d", "mask"])
    norm = helper.make_node("LayerNormalization", ["d", "s", "b"], ["y", "", "inv"], axis=-1)
    m = model(
        [dropout, norm],
        [vi("x", X_SHAPE)],
        [out("y", 4), out("inv", 4)],
        [ones("s", [8]), ones("b", [8]), init("ratio", 0.5), init("training", True, np.bool_)],
    )
    graph = ingest(m)
    assert graph.nodes[0].output_bytes == 384 * 4 + 384 * 1
    assert graph.nodes[1].output_bytes == 384 * 4 + 48 * 4
    assert graph.nodes[1].attrs["onnx_outputs"] == ["y", "inv"]
    assert graph.outputs == (1,)


def test_repeated_input_is_one_dependency_and_counted_once() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "r"], ["y"])]
    graph = ingest(model(nodes, [vi("x", X_SHAPE)], [out("y", 4)]))
    assert graph.nodes[1].deps == (0,)
    assert graph.nodes[1].input_bytes == 384 * 4
    assert graph.nodes[1].fixed == ()


# --- parameters and folding ---------------------------------------------------------------


def test_old_style_initializers_listed_as_inputs_are_parameters() -> None:
    node = helper.make_node("Conv", ["x", "W"], ["y"])
    inputs = [vi("x", ["N", 3, 8, 8]), vi("W", [4, 3, 3, 3])]
    m = model([node], inputs, [out("y", 4)], [ones("W", [4, 3, 3, 3])], opset=9)
    m.ir_version = 3
    graph = ingest(m, batch=5)
    assert graph.fixed["W"].kind is FixedKind.PARAMETER
    assert graph.fixed["x"].kind is FixedKind.INPUT
    assert graph.fixed["x"].nbytes == 5 * 3 * 8 * 8 * 4
    assert graph.param_bytes == 108 * 4
    assert graph.nodes[0].output_bytes == 5 * 4 * 6 * 6 * 4
    with pytest.raises(InvalidInputError, match="'W'"):
        ingest(m, inputs={"W": [4, 3, 3, 3]})


def test_constant_of_shape_weights_are_folded_into_parameters() -> None:
    nodes = [
        const_node("wshape", [4, 3, 3, 3]),
        helper.make_node(
            "ConstantOfShape",
            ["wshape"],
            ["W"],
            value=numpy_helper.from_array(np.array([0.5], np.float32)),
        ),
        helper.make_node("Conv", ["x", "W"], ["y"]),
    ]
    graph = ingest(model(nodes, [vi("x", X_SHAPE)], [out("y", 4)]))
    assert ops_of(graph) == ["Conv"]
    assert graph.fixed["W"].kind is FixedKind.PARAMETER
    assert graph.fixed["W"].nbytes == 108 * 4
    assert "wshape" not in graph.fixed  # read only by the folded node
    assert graph.nodes[0].fixed == ("x", "W")


def test_operations_on_constants_are_folded() -> None:
    nodes = [
        helper.make_node("Transpose", ["Wt"], ["W"], perm=[1, 0]),
        helper.make_node("Identity", ["b0"], ["b"]),
        helper.make_node("Gemm", ["x", "W", "b"], ["y"]),
    ]
    params = [ones("Wt", [10, 16]), ones("b0", [10])]
    graph = ingest(model(nodes, [vi("x", [2, 16])], [out("y", 2)], params))
    assert ops_of(graph) == ["Gemm"]
    assert {n: t.nbytes for n, t in graph.fixed.items()} == {"x": 128, "W": 640, "b": 40}


def _shape_chain_model(opset: int) -> onnx.ModelProto:
    """The exporter idiom: Shape -> Gather -> Unsqueeze -> Concat -> Reshape, then a
    weight shaped from an activation's (static) Shape via Slice/Concat/ConstantOfShape."""
    if opset >= 13:
        unsqueeze = helper.make_node("Unsqueeze", ["b", "axes"], ["bu"])
    else:
        unsqueeze = helper.make_node("Unsqueeze", ["b"], ["bu"], axes=[0])
    if opset >= 10:
        slice_ = helper.make_node("Slice", ["rs", "start", "end"], ["last"])
    else:
        slice_ = helper.make_node("Slice", ["rs"], ["last"], starts=[1], ends=[2])
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        const_node("i0", 0),
        helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        unsqueeze,
        const_node("minus1", [-1]),
        helper.make_node("Concat", ["bu", "minus1"], ["shape"], axis=0),
        helper.make_node("Cast", ["shape"], ["shape64"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["x", "shape64"], ["r"]),
        helper.make_node("Shape", ["r"], ["rs"]),
        slice_,
        helper.make_node("Concat", ["last", "five"], ["wshape"], axis=0),
        helper.make_node(
            "ConstantOfShape",
            ["wshape"],
            ["W"],
            value=numpy_helper.from_array(np.array([1.0], np.float32)),
        ),
        helper.make_node("MatMul", ["r", "W"], ["y"]),
    ]
    params = [
        init("axes", [0], np.int64),
        init("start", [1], np.int64),
        init("end", [2], np.int64),
        init("five", [5], np.int64),
    ]
    return model(nodes, [vi("x", ["N", 3, 4, 4])], [out("y", 2)], params, opset)


@pytest.mark.parametrize("opset", [9, 11, 13, 17, 21])
def test_shape_gather_unsqueeze_concat_reshape_chain_is_folded(opset: int) -> None:
    # Before opset 15 ONNX does not propagate Shape values: the folder must compute them.
    graph = ingest(_shape_chain_model(opset), batch=2)
    assert ops_of(graph) == ["Reshape", "MatMul"]
    reshape, matmul = graph.nodes
    assert reshape.attrs["output_shapes"] == [(2, 48)]
    assert reshape.fixed == ("x", "shape64")
    assert graph.fixed["shape64"].nbytes == 16
    assert graph.fixed["W"].nbytes == 48 * 5 * 4
    assert matmul.deps == (0,)
    assert matmul.output_bytes == 2 * 5 * 4
    assert matmul.flops == 2 * 10 * 48


def test_shape_of_an_activation_is_a_constant() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Shape", ["r"], ["s"]),
        helper.make_node("Reshape", ["r", "s"], ["y"]),
    ]
    graph = ingest(model(nodes, [vi("x", X_SHAPE)], [out("y", 4)], opset=13))
    assert ops_of(graph) == ["Relu", "Reshape"]
    assert graph.fixed["s"].nbytes == 4 * 8
    assert graph.nodes[1].deps == (0,)


def test_only_constants_is_an_empty_model() -> None:
    nodes = [const_node("c", [1.0, 2.0], np.float32), helper.make_node("Relu", ["c"], ["y"])]
    m = model(nodes, [], [out("y", 1)])
    with pytest.raises(EmptyModelError):
        ingest(m)


def test_graph_without_nodes_is_an_empty_model() -> None:
    m = model([], [vi("x", [2])], [vi("x", [2])])
    with pytest.raises(EmptyModelError):
        ingest(m)


def test_graph_without_nodes_is_empty_even_with_symbolic_inputs() -> None:
    m = model([], [vi("x", ["N", 2])], [vi("x", ["N", 2])])
    with pytest.raises(EmptyModelError, match="no operators"):
        ingest(m)


def test_random_generators_are_not_folded() -> None:
    nodes = [
        helper.make_node("RandomNormal", [], ["noise"], shape=list(X_SHAPE)),
        helper.make_node("Add", ["x", "noise"], ["y"]),
    ]
    graph = ingest(model(nodes, [vi("x", X_SHAPE)], [out("y", 4)]))
    assert ops_of(graph) == ["RandomNormal", "Add"]
    assert graph.nodes[1].deps == (0,)


# --- a Linear layer's MatMul and bias Add fused -------------------------------------------


def _linear_model(
    *, bias_shape: Sequence[int] = (5,), extra: Sequence[onnx.NodeProto] = (),
    outputs: Sequence[str] = ("y",), bias_input: bool = False, transposed: bool = False,
) -> onnx.ModelProto:  # fmt: skip
    """x (2, 3, 4) @ W (4, 5) + b, then Relu: PyTorch's export of ``Linear`` then ``ReLU``
    on a 3-D input (``transposed``: W as the TorchScript exporter writes it in training
    mode, a Transpose of the (5, 4) initializer; ``bias_input``: b a model input)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["p"], name="fc/MatMul"),
        helper.make_node("Add", ["p", "b"], ["h"], name="fc/Add"),
        helper.make_node("Relu", ["h"], ["y"], name="relu"),
        *extra,
    ]
    params = [] if bias_input else [ones("b", bias_shape)]
    if transposed:
        nodes.insert(0, helper.make_node("Transpose", ["Wt"], ["W"], perm=[1, 0]))
        params.append(ones("Wt", (5, 4)))
    else:
        params.append(ones("W", (4, 5)))
    inputs = [vi("x", (2, 3, 4)), *([vi("b", bias_shape)] if bias_input else [])]
    ranks = {"y": 3, "p": 3, "z": 3}
    return model(nodes, inputs, [out(o, ranks[o]) for o in outputs], params)


@pytest.mark.parametrize("transposed", [False, True], ids=["weight", "transposed_weight"])
def test_a_linear_layers_matmul_and_bias_add_are_one_node(transposed: bool) -> None:
    graph = ingest(_linear_model(transposed=transposed))
    assert ops_of(graph) == ["MatMulAdd", "Relu"]
    linear, relu = graph.nodes
    assert linear.name == "fc/MatMul"
    assert linear.attrs["onnx_inputs"] == ["x", "W", "b"]
    assert linear.attrs["onnx_outputs"] == ["h"]
    assert linear.attrs["input_shapes"] == [(2, 3, 4), (4, 5), (5,)]
    assert linear.output_bytes == 2 * 3 * 5 * 4
    assert linear.flops == 2 * 30 * 4 + 30
    assert linear.fixed == ("x", "W", "b")
    assert graph.fixed["W"].kind is FixedKind.PARAMETER
    assert relu.deps == (0,)


NEG_OF_PRODUCT = helper.make_node("Neg", ["p"], ["z"])


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("product_read_twice", {"extra": [NEG_OF_PRODUCT], "outputs": ["y", "z"]}),
        ("product_a_model_output", {"outputs": ["y", "p"]}),
        ("bias_not_a_vector", {"bias_shape": (3, 5)}),
        ("bias_an_activation", {"bias_input": True}),
    ],
)  # fmt: skip
def test_a_matmul_and_add_stay_apart_unless_they_are_a_linear_layer(
    case: str, kwargs: dict[str, Any]
) -> None:
    graph = ingest(_linear_model(**kwargs))
    assert "MatMulAdd" not in ops_of(graph), case
    assert ops_of(graph)[:3] == ["MatMul", "Add", "Relu"], case


def _flattened_gemm_model(
    *, trans_b: bool = False, alpha: float = 1.0, restored: Sequence[int] = (2, 3, 5),
    bias_input: bool = False, outputs: Sequence[str] = ("y",),
) -> onnx.ModelProto:  # fmt: skip
    """Relu of x (2, 3, 4), a Reshape to (6, 4), a Gemm by W (4, 5) (``trans_b``: (5, 4)
    transposed, as ``nn.Linear``'s weight) and the bias b (5,), a Reshape to ``restored``,
    then Relu: Hugging Face's ``Conv1D`` as both exporters write it (``bias_input``: b a
    model input)."""
    nodes = [
        helper.make_node("Relu", ["x0"], ["x"], name="pre"),
        const_node("flat", [6, 4]),
        helper.make_node("Reshape", ["x", "flat"], ["f"], name="fc/Reshape"),
        helper.make_node(
            "Gemm", ["f", "W", "b"], ["p"], name="fc/Gemm", alpha=alpha, transB=int(trans_b)
        ),
        const_node("back", list(restored)),
        helper.make_node("Reshape", ["p", "back"], ["h"], name="fc/Reshape_1"),
        helper.make_node("Relu", ["h"], ["y"], name="post"),
    ]
    params = [ones("W", (5, 4) if trans_b else (4, 5)), *([] if bias_input else [ones("b", (5,))])]
    inputs = [vi("x0", (2, 3, 4)), *([vi("b", (5,))] if bias_input else [])]
    ranks = {"y": 3, "f": 2}
    return model(nodes, inputs, [out(o, ranks[o]) for o in outputs], params)


@pytest.mark.parametrize("trans_b", [False, True], ids=["weight", "transposed_weight"])
def test_a_gemm_between_the_reshapes_that_flatten_and_restore_its_input_is_one_node(
    trans_b: bool,
) -> None:
    graph = ingest(_flattened_gemm_model(trans_b=trans_b))
    assert ops_of(graph) == ["Relu", "MatMulAdd", "Relu"]
    linear = graph.nodes[1]
    assert linear.name == "fc/Gemm"
    assert linear.attrs["onnx_inputs"] == ["x", "W", "b"]
    assert linear.attrs["onnx_outputs"] == ["h"]
    assert linear.attrs["input_shapes"] == [(2, 3, 4), (5, 4) if trans_b else (4, 5), (5,)]
    assert linear.attrs.get("fused_attributes", {}) == ({"transB": 1} if trans_b else {})
    assert linear.flops == 2 * 30 * 4 + 30
    assert graph.nodes[2].deps == (1,)


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("scaled", {"alpha": 0.5}),
        ("not_restored", {"restored": (3, 2, 5)}),
        ("bias_an_activation", {"bias_input": True}),
        ("flattened_input_a_model_output", {"outputs": ["y", "f"]}),
    ],
)  # fmt: skip
def test_a_gemm_and_its_reshapes_stay_apart_unless_they_flatten_and_restore(
    case: str, kwargs: dict[str, Any]
) -> None:
    graph = ingest(_flattened_gemm_model(**kwargs))
    assert "MatMulAdd" not in ops_of(graph), case
    assert "Gemm" in ops_of(graph), case


# --- attention's chain fused -------------------------------------------------------------

ATTENTION_SHAPE = (2, 4, 3, 8)  # batch, heads, tokens, head width


def _attention_model(
    *, mask_shape: Sequence[int] | None = (1, 1, 3, 3), prescaled: bool = False,
    axis: int = -1, extra: Sequence[onnx.NodeProto] = (), outputs: Sequence[str] = ("y",),
    scale: Sequence[float] | float = 8**0.5, nan_zeroed: bool = False,
    padding_mask: bool = False, tokens: int = 3,
) -> onnx.ModelProto:  # fmt: skip
    """softmax(q k^T / sqrt(8) + mask) v, then Relu, as Hugging Face's eager attention is
    exported (``prescaled``: q and k^T each multiplied by 8 ** -0.25 before the product,
    as PyTorch exports ``scaled_dot_product_attention``; ``scale``: the divisor;
    ``nan_zeroed``: a fully masked row's weights zeroed, as the dynamo exporter writes;
    ``padding_mask``: the mask a model input times the most negative float, read once;
    ``tokens``: queries and keys, 3 as in ``ATTENTION_SHAPE``)."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2])]
    params = [init("c", scale)]
    a, b = "q", "kt"
    if prescaled:
        nodes += [
            helper.make_node("Mul", ["q", "r"], ["qs"]),
            helper.make_node("Mul", ["r", "kt"], ["ks"]),
        ]
        params.append(init("r", 8**-0.25))
        a, b = "qs", "ks"
    nodes.append(helper.make_node("MatMul", [a, b], ["s"], name="attn/MatMul"))
    scores = "s"
    if not prescaled:
        nodes.append(helper.make_node("Div", ["s", "c"], ["sd"]))
        scores = "sd"
    batch, heads, _, width = ATTENTION_SHAPE
    inputs = [vi(name, (batch, heads, tokens, width)) for name in ("q", "k", "v")]
    if padding_mask:
        nodes.append(helper.make_node("Mul", ["pad", "lowest"], ["m"]))
        inputs.append(vi("pad", (batch, 1, 1, tokens)))
        params.append(init("lowest", np.finfo(np.float32).min))
    elif mask_shape is not None:
        params.append(init("m", np.zeros(mask_shape)))
    if padding_mask or mask_shape is not None:
        nodes.append(helper.make_node("Add", ["m", scores], ["sm"]))
        scores = "sm"
    nodes.append(helper.make_node("Softmax", [scores], ["p"], axis=axis))
    weights = "p"
    if nan_zeroed:
        nodes += [
            helper.make_node("IsNaN", ["p"], ["nan"]),
            helper.make_node("Where", ["nan", "zero", "p"], ["pz"]),
        ]
        params.append(init("zero", 0.0))
        weights = "pz"
    nodes += [
        helper.make_node("MatMul", [weights, "v"], ["o"], name="attn/MatMul_1"),
        helper.make_node("Relu", ["o"], ["y"]),
        *extra,
    ]
    return model(nodes, inputs, [out(o, 4) for o in outputs], params)


@pytest.mark.parametrize(
    ("prescaled", "nan_zeroed"),
    [(False, False), (True, False), (True, True)],
    ids=["scores_divided", "operands_scaled", "dynamo_zeroed_rows"],
)
def test_attentions_chain_is_one_node_that_holds_no_weights(
    prescaled: bool, nan_zeroed: bool
) -> None:
    mask = None if prescaled else (1, 1, 3, 3)
    attention_model = _attention_model(prescaled=prescaled, mask_shape=mask, nan_zeroed=nan_zeroed)
    graph = ingest(attention_model, fuse_attention=True)
    assert ops_of(graph) == ["Transpose", "ScaledDotProductAttention", "Relu"]
    attention = graph.nodes[1]
    assert attention.name == "attn/MatMul"
    inputs = ["q", "kt", "v"] if prescaled else ["q", "kt", "v", "m"]
    assert attention.attrs["onnx_inputs"] == inputs
    assert attention.attrs["onnx_outputs"] == ["o"]
    assert attention.attrs["fused_attributes"] == {"scale": pytest.approx(8**-0.5)}
    assert attention.output_bytes == 2 * 4 * 3 * 8 * 4
    scores = 2 * 4 * 3 * 3
    assert attention.flops == 2 * scores * 8 + 2 * (2 * 4 * 3 * 8) * 3 + 7 * scores
    trained = training_graph(graph)
    [backward] = [n for n in trained.nodes if n.forward == attention.id]
    assert 0 in backward.deps  # it reads its inputs (the keys transposed)
    assert attention.id in backward.deps  # and the output with the log-sum-exp or weights
    # PyTorch's fused kernels hold the keys with unit stride beside their inputs and
    # output; the closed form, which a trained mask's gradient takes, the scores in the
    # forward, whose node keeps the weights, and two score matrices in the backward: the
    # analytical model's workspace.
    keys = 2 * 4 * 3 * 8
    assert attention.scratch_bytes == keys * 4
    kept = trained.nodes[attention.id]
    if mask:
        assert backward.flops == 2.0 * attention.flops
        assert kept.output_bytes == attention.output_bytes + scores * 4
        assert kept.scratch_bytes == scores * 4 and backward.scratch_bytes == 2 * scores * 4
    else:
        assert backward.flops == 2.5 * attention.flops
        assert kept == attention and backward.scratch_bytes == keys * 4
    assert all(n.scratch_bytes == 0 for n in trained.nodes if n.op != ATTENTION)
    workspace = analytical_costs(trained, [Device("cpu0", DeviceKind.CPU)]).workspace_bytes
    assert workspace is not None
    assert workspace[:, 0].tolist() == [n.scratch_bytes for n in trained.nodes]


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_grouped_query_attention_reads_the_key_and_value_heads(tiled: bool) -> None:
    """Keys and values whose heads are repeated for groups of query heads in a row
    (grouped-query attention, as ``repeat_kv`` writes it) are read by the attention node
    as they are, the keys through a transpose: no repeated copy is made nor held. Heads
    repeated as a whole are not grouped-query attention's: they stay."""
    graph = ingest(grouped_query_attention(tiled), fuse_attention=True)
    [attention] = [n for n in graph.nodes if n.op == ATTENTION]
    if tiled:
        assert ops_of(graph).count("Expand") == 2
        assert attention.attrs["input_shapes"][1:] == [(2, 4, 8, 3), (2, 4, 3, 8)]
        return
    assert ops_of(graph) == [LAYOUT, ATTENTION, "Relu"]
    assert attention.attrs["onnx_inputs"] == ["q", "k_transposed", "v"]
    assert attention.attrs["input_shapes"] == [(2, 4, 3, 8), (2, 2, 8, 3), (2, 2, 3, 8)]
    assert graph.nodes[0].attrs["output_shapes"] == [(2, 2, 8, 3)]
    assert attention.deps == (0,)


@pytest.mark.parametrize("mask", ["none", "trained", "computed"])
def test_an_attention_backward_holds_no_scores_unless_its_mask_is_trained(mask: str) -> None:
    """The forward runs PyTorch's fused kernel, its scratch the keys with unit stride, not
    the scores, and the backward node is that kernel's backward
    (``ops.pytorch_attention_backward``): it reads the forward's output (and the
    log-sum-exp saved beside it), holds the keys, not two score matrices, and its FLOPs
    are the closed form's with the weights recomputed. A mask that carries a gradient (a
    trained one, or a value computed in the model, whose producer's backward node gets it)
    keeps the closed form: the training graph's forward node computes the weights, holding
    the scores while it runs, and keeps them with its output, as autograd saves a
    softmax's output; its backward reads them and recomputes nothing."""
    tokens = 16
    attention_model = _attention_model(
        prescaled=mask == "none",
        mask_shape=(1, 1, tokens, tokens) if mask == "trained" else None,
        padding_mask=mask == "computed",
        tokens=tokens,
    )
    graph = ingest(attention_model, fuse_attention=True)
    [attention] = [n for n in graph.nodes if n.op == ATTENTION]
    trained = training_graph(graph)
    [backward] = [n for n in trained.nodes if n.forward == attention.id]
    kept = trained.nodes[attention.id]
    batch, heads, _, width = ATTENTION_SHAPE
    scores = batch * heads * tokens * tokens
    output = batch * heads * tokens * width
    keys = output  # as many as the queries here, of the values' width
    assert attention.scratch_bytes == keys * 4
    assert attention.id in backward.deps
    if mask == "none":
        assert kept == attention and kept_bytes(kept) == 0
        assert backward.scratch_bytes == keys * 4 and backward.flops == 2.5 * attention.flops
    else:
        assert kept.attrs["keeps_weights"] and kept_bytes(kept) == scores * 4
        assert kept.output_bytes == output * 4 + scores * 4 and kept.scratch_bytes == scores * 4
        assert backward.scratch_bytes == 2 * scores * 4 and backward.flops == 2.0 * attention.flops


def test_what_is_trained_is_what_the_module_trains() -> None:
    """A float mask folded from a comparison of positions (GPT-2's causal mask: a ``Where``
    of scalars chosen by ``Equal`` of a ``Trilu``) and an integer initializer are constants,
    without gradient buffers; a weight transposed at export, and rows gathered from one,
    stay parameters."""
    nodes = [
        const_node("one", 1.0, np.float32),
        const_node("square", [3, 3]),
        helper.make_node("Expand", ["one", "square"], ["grid"]),
        helper.make_node("Trilu", ["grid"], ["tri"]),
        const_node("zero", 0.0, np.float32),
        helper.make_node("Equal", ["tri", "zero"], ["above"]),
        const_node("lowest", -1e9, np.float32),
        helper.make_node("Where", ["above", "lowest", "zero"], ["mask"]),
        helper.make_node("Add", ["x", "mask"], ["h"]),
        helper.make_node("Transpose", ["W"], ["Wt"]),
        helper.make_node("MatMul", ["h", "Wt"], ["h2"]),
        helper.make_node("Gather", ["h2", "rows"], ["g"]),
        helper.make_node("Gather", ["E", "rows"], ["e"]),
        helper.make_node("Add", ["g", "e"], ["y"]),
    ]
    params = [
        ones("W", (3, 3)),
        ones("E", (4, 3)),
        init("rows", [2, 0, 1], np.int64),
    ]
    graph = ingest(model(nodes, [vi("x", (3, 3))], [out("y", 2)], params))
    assert ops_of(graph) == ["Add", "MatMul", "Gather", "Add"]
    kinds = {name: tensor.kind for name, tensor in graph.fixed.items()}
    assert kinds == {
        "x": FixedKind.INPUT,
        "mask": FixedKind.CONSTANT,
        "Wt": FixedKind.PARAMETER,
        "rows": FixedKind.CONSTANT,
        "e": FixedKind.PARAMETER,
    }


def test_running_statistics_and_clip_bounds_are_not_trained() -> None:
    """An initializer read only where no gradient reaches it (a BatchNormalization's running
    mean and variance, a Clip's bounds) is a constant without a gradient buffer, as PyTorch
    keeps running statistics as buffers; one read at a differentiable input too (a scale
    that is also a running variance of ones) stays a parameter; and a training graph's
    fixed memory counts a gradient buffer for the parameters alone."""
    nodes = [
        helper.make_node("BatchNormalization", ["x", "ones", "B", "M", "ones"], ["h"]),
        helper.make_node("BatchNormalization", ["h", "S", "B", "M", "V"], ["h2"]),
        helper.make_node("Clip", ["h2", "low", "high"], ["y"]),
    ]
    params = [
        ones("ones", (3,)),
        ones("S", (3,)),
        ones("B", (3,)),
        ones("M", (3,)),
        ones("V", (3,)),
        init("low", 0.0),
        init("high", 6.0),
    ]
    graph = ingest(model(nodes, [vi("x", (2, 3, 4, 4))], [out("y", 4)], params))
    trained = {name for name, tensor in graph.fixed.items() if tensor.has_gradient}
    assert trained == {"ones", "S", "B"}
    assert {graph.fixed[n].kind for n in ("M", "V", "low", "high")} == {FixedKind.CONSTANT}
    training = training_graph(graph)
    held = sum(t.nbytes for t in graph.fixed.values())
    assert held_fixed_bytes(training, range(len(training.nodes))) == held + 3 * 3 * 4


@pytest.mark.parametrize(
    ("masked", "initializer"),
    [
        (float(np.finfo(np.float32).min), False),
        (-math.inf, False),
        (float(np.finfo(np.float32).min), True),
        (-100.0, False),
    ],
    ids=["most_negative_float", "minus_infinity", "initializer", "not_causal"],
)
def test_a_causal_mask_is_the_causal_attribute(masked: float, initializer: bool) -> None:
    """GPT-2's causal mask, folded from comparisons of positions (or folded by the
    exporter into an initializer, expanded to the batch), is the fused node's ``causal``
    attribute and no constant; one whose masked entries do not vanish beside the scores
    (-100) stays the mask."""
    graph = ingest(causal_attention(5, masked, initializer), fuse_attention=True)
    [attention] = [n for n in graph.nodes if n.op == ATTENTION]
    scores = 2 * 2 * 5 * 5
    every_score = 2 * scores * 4 + 2 * (2 * 2 * 5 * 4) * 5 + 7 * scores
    if masked == -100.0:
        assert attention.attrs["onnx_inputs"] == ["q", "kt", "v", "m"]
        assert graph.fixed["m"].kind is FixedKind.CONSTANT
        assert attention.flops == every_score
        return
    assert attention.attrs["onnx_inputs"] == ["q", "kt", "v"]
    assert attention.attrs["fused_attributes"] == {"scale": 0.125, "causal": 1}
    assert "m" not in graph.fixed
    assert attention.flops == pytest.approx(every_score * 15 / 25)  # on and below the diagonal


def test_a_padding_mask_computed_in_the_model_is_the_fused_nodes_mask() -> None:
    graph = ingest(_attention_model(padding_mask=True), fuse_attention=True)
    assert ops_of(graph) == ["Transpose", "Mul", "ScaledDotProductAttention", "Relu"]
    assert graph.nodes[2].attrs["onnx_inputs"] == ["q", "kt", "v", "m"]


P_READ_TWICE = helper.make_node("Neg", ["p"], ["z"])


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("weights_read_twice", {"extra": [P_READ_TWICE], "outputs": ["y", "z"]}),
        ("weights_a_model_output", {"outputs": ["y", "p"]}),
        ("softmax_over_queries", {"axis": 2}),
        ("mask_widens_the_scores", {"mask_shape": (5, 1, 1, 3, 3)}),
        ("scale_not_a_scalar", {"scale": [1.0, 2.0, 3.0]}),
    ],
)  # fmt: skip
def test_a_softmax_between_products_stays_apart_unless_it_is_attention(
    case: str, kwargs: dict[str, Any]
) -> None:
    graph = ingest(_attention_model(**kwargs), fuse_attention=True)
    assert "ScaledDotProductAttention" not in ops_of(graph), case
    assert "Softmax" in ops_of(graph) and ops_of(graph).count("MatMul") == 2, case


# --- GELU's chain fused -------------------------------------------------------------------

GELU_SHAPE = (2, 3, 8)


def _gelu_model(
    form: str = "erf", *, half: float = 0.5, extra: Sequence[onnx.NodeProto] = (),
    outputs: Sequence[str] = ("y",),
) -> onnx.ModelProto:  # fmt: skip
    """Relu, then GELU as an exporter writes it, then Relu: ``erf``, PyTorch's ``F.gelu``
    at opsets before 20 (``Div``, ``Erf``, ``Add``, ``Mul``, ``Mul``); ``tanh``, GPT-2's
    ``NewGELUActivation`` operator by operator (``half``: the formula's 0.5)."""
    nodes = [helper.make_node("Relu", ["x0"], ["x"], name="pre")]
    if form == "erf":
        params = [init("sqrt2", 2**0.5), init("one", 1.0), init("half", half)]
        nodes += [
            helper.make_node("Div", ["x", "sqrt2"], ["d"]),
            helper.make_node("Erf", ["d"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["e1"]),
            helper.make_node("Mul", ["x", "e1"], ["m"]),
            helper.make_node("Mul", ["m", "half"], ["g"], name="act/Mul_1"),
        ]
    else:
        params = [init("half", half), init("three", 3.0), init("kappa", 0.044715),
                  init("beta", (2 / np.pi) ** 0.5), init("one", 1.0)]  # fmt: skip
        nodes += [
            helper.make_node("Mul", ["half", "x"], ["hx"]),
            helper.make_node("Pow", ["x", "three"], ["cube"]),
            helper.make_node("Mul", ["kappa", "cube"], ["kc"]),
            helper.make_node("Add", ["x", "kc"], ["inner"]),
            helper.make_node("Mul", ["beta", "inner"], ["scaled"]),
            helper.make_node("Tanh", ["scaled"], ["t"]),
            helper.make_node("Add", ["one", "t"], ["t1"]),
            helper.make_node("Mul", ["hx", "t1"], ["g"], name="act/Mul_7"),
        ]
    nodes += [helper.make_node("Relu", ["g"], ["y"], name="post"), *extra]
    return model(nodes, [vi("x0", GELU_SHAPE)], [out(o, 3) for o in outputs], params)


@pytest.mark.parametrize(("form", "last"), [("erf", "act/Mul_1"), ("tanh", "act/Mul_7")])
def test_a_gelu_written_as_elementwise_operators_is_one_node(form: str, last: str) -> None:
    graph = ingest(_gelu_model(form))
    assert ops_of(graph) == ["Relu", "FusedGelu", "Relu"]
    gelu = graph.nodes[1]
    assert gelu.name == last and gelu.deps == (0,)
    assert gelu.attrs["onnx_inputs"] == ["x"] and gelu.attrs["onnx_outputs"] == ["g"]
    approximate = gelu.attrs["fused_attributes"]["approximate"]
    assert approximate == {"erf": b"none", "tanh": b"tanh"}[form]
    # the backward reads the input alone: no value of the chain is held for it
    training = training_graph(graph)
    [backward] = [n for n in training.nodes if n.forward == 1]
    assert backward.deps[0] == 0 and 1 not in backward.deps


def test_x_times_its_sigmoid_is_one_silu_node_and_a_gate_is_not() -> None:
    """SiLU (``x * sigmoid(x)``, as exporters write ``F.silu``) fuses; a squeeze-excitation
    gate (``y * sigmoid(s)``, another tensor gated) does not."""
    nodes = [
        helper.make_node("Relu", ["x0"], ["x"], name="pre"),
        helper.make_node("Sigmoid", ["x"], ["s"]),
        helper.make_node("Mul", ["x", "s"], ["silu"], name="act/Mul"),
        helper.make_node("Sigmoid", ["silu"], ["gate"]),
        helper.make_node("Mul", ["x", "gate"], ["y"], name="gated"),
    ]
    graph = ingest(model(nodes, [vi("x0", GELU_SHAPE)], [out("y", 3)]))
    assert ops_of(graph) == ["Relu", "FusedSilu", "Sigmoid", "Mul"]
    silu = graph.nodes[1]
    assert silu.name == "act/Mul" and silu.attrs["onnx_inputs"] == ["x"]
    assert "fused_attributes" not in silu.attrs


NEG_OF_ERF = helper.make_node("Neg", ["e"], ["z"])


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("intermediate_read_elsewhere", {"extra": [NEG_OF_ERF], "outputs": ["y", "z"]}),
        ("intermediate_a_model_output", {"outputs": ["y", "e"]}),
        ("another_function", {"half": 0.6}),
    ],
)  # fmt: skip
def test_elementwise_operators_stay_apart_unless_they_are_a_gelu(
    case: str, kwargs: dict[str, Any]
) -> None:
    graph = ingest(_gelu_model(**kwargs))
    assert "FusedGelu" not in ops_of(graph), case
    assert "Erf" in ops_of(graph), case


# --- a packed projection's parts picked by Gathers: one unbind ----------------------------

UNBIND_SHAPE = (3, 2, 4)  # q, k and v of a packed projection along axis 0


def _unbind_model(
    *, indices: Sequence[Any] = (1, 0, -1), axis: int = 0, index_input: bool = False,
    reader: str = "Transpose", outputs: Sequence[str] = ("y",),
) -> onnx.ModelProto:  # fmt: skip
    """Relu of x (3, 2, 4), then one ``Gather`` per index along ``axis``, each index a
    ``Constant`` (``index_input``: the first one a model input), each part read by a
    ``reader`` (a ``Transpose``: the heads split), their results summed:
    ``torch.nn.MultiheadAttention``'s separation of q, k and v as TorchScript exports it."""
    nodes = [helper.make_node("Relu", ["x0"], ["x"], name="packed")]
    read = []
    for position, index in enumerate(indices):
        name, part = f"i{position}", f"p{position}"
        if not (index_input and position == 0):
            nodes.append(const_node(name, np.asarray(index, np.int64)))
        nodes.append(helper.make_node("Gather", ["x", name], [part], f"pick{position}", axis=axis))
        nodes.append(helper.make_node(reader, [part], [f"r{position}"], f"read{position}"))
        read.append(f"r{position}")
    nodes.append(helper.make_node("Sum", read, ["y"], name="sum"))
    inputs = [vi("x0", UNBIND_SHAPE), *([vi("i0", [], TensorProto.INT64)] if index_input else [])]
    return model(nodes, inputs, [out(o, 2) for o in outputs])


def test_gathers_of_each_index_of_an_axis_are_one_unbind() -> None:
    graph = ingest(_unbind_model())
    assert ops_of(graph) == ["Relu", "FusedUnbind", *["Transpose"] * 3, "Sum"]
    unbind = graph.nodes[1]
    assert unbind.name == "pick0"  # the first Gather's place and name
    assert unbind.attrs["onnx_inputs"] == ["x"]
    assert unbind.attrs["onnx_outputs"] == ["p1", "p0", "p2"]  # by index: 0, 1, 2 (-1)
    assert unbind.attrs["output_shapes"] == [(2, 4)] * 3
    assert unbind.attrs["fused_attributes"] == {"axis": 0}
    assert unbind.output_bytes == 3 * 2 * 4 * 4
    assert [n.deps for n in graph.nodes[2:5]] == [(1,)] * 3
    # its gradient reads no forward value: shapes only, as a Gather's data
    training = training_graph(graph)
    [backward] = [n for n in training.nodes if n.forward == 1]
    assert 0 not in backward.deps and 1 not in backward.deps
    assert backward.output_bytes == 3 * 2 * 4 * 4


def test_an_unbind_along_an_inner_axis_keeps_it() -> None:
    graph = ingest(_unbind_model(indices=(0, 1), axis=-2))
    assert ops_of(graph) == ["Relu", "FusedUnbind", "Transpose", "Transpose", "Sum"]
    assert graph.nodes[1].attrs["fused_attributes"] == {"axis": 1}
    assert graph.nodes[1].attrs["output_shapes"] == [(3, 4)] * 2


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("an_index_not_picked", {"indices": (0, 2)}),
        ("an_index_picked_twice", {"indices": (0, 1, 2, 1)}),
        ("an_index_of_rank_1", {"indices": ([0], [1], [2])}),
        ("an_index_not_a_constant", {"index_input": True}),
        # a reader other than a layout operator (whose gradient may read the part)
        ("a_part_read_by_more_than_layout", {"reader": "Sigmoid"}),
        ("a_part_a_model_output", {"outputs": ("y", "p1")}),
    ],
)  # fmt: skip
def test_gathers_stay_apart_unless_they_pick_each_index_once(
    case: str, kwargs: dict[str, Any]
) -> None:
    graph = ingest(_unbind_model(**kwargs))
    assert "FusedUnbind" not in ops_of(graph), case
    assert "Gather" in ops_of(graph), case


# --- chains of layout operators: one node ---------------------------------------------------

LAYOUT_SHAPE = (2, 6, 4)  # (batch, tokens, width): two heads of width 2


def _layout_model(
    members: Sequence[tuple[str, Any]], *, read_also: int | None = None,
    outputs: Sequence[str] = ("y",), dtype: int = F32,
) -> onnx.ModelProto:  # fmt: skip
    """Relu of x (2, 6, 4), then ``members`` in a row, each (``Reshape``, its shape),
    (``Transpose``, its perm), (``Squeeze``/``Unsqueeze``, its axes) or (``Identity``,
    None), then Relu (``read_also``: member of that index also read by a Neg, summed in;
    ``dtype``: the chain's element type, cast there and back)."""
    nodes = [helper.make_node("Relu", ["x0"], ["x"], name="pre")]
    tensor = "x"
    if dtype != F32:
        nodes.append(helper.make_node("Cast", ["x"], ["xc"], name="cast", to=dtype))
        tensor = "xc"
    for position, (op, value) in enumerate(members):
        made, name = f"m{position}", f"member{position}"
        if op == "Transpose":
            nodes.append(helper.make_node(op, [tensor], [made], name, perm=list(value)))
        elif op == "Identity":
            nodes.append(helper.make_node(op, [tensor], [made], name))
        else:
            nodes.append(const_node(f"c{position}", value))
            nodes.append(helper.make_node(op, [tensor, f"c{position}"], [made], name))
        tensor = made
    if dtype != F32:
        nodes.append(helper.make_node("Cast", [tensor], ["back"], name="back", to=F32))
        tensor = "back"
    nodes.append(helper.make_node("Relu", [tensor], ["y"], name="post"))
    if read_also is not None:
        nodes.append(helper.make_node("Neg", [f"m{read_also}"], ["z"], name="other"))
    return model(nodes, [vi("x0", LAYOUT_SHAPE)], [out(o, 2) for o in outputs])


HEADS_MOVED = [("Reshape", [2, 6, 2, 2]), ("Transpose", [0, 2, 1, 3]), ("Reshape", [4, 12])]


def test_a_rotary_embedding_is_one_node() -> None:
    """LLaMA's ``x * cos + rotate_half(x) * sin``, seven nodes as exported, is one
    ``FusedRotary`` node reading ``x``, the cosines and the sines. The cosines and sines,
    initializers that nothing else reads, are tables of positions: not trained. Its
    gradient reads the other operands, as a product's: ``x`` only where the cosines or
    sines are trained."""
    graph = ingest(rotary_embedding())
    assert ops_of(graph) == [ROTARY, "Relu"]
    rotary = graph.nodes[0]
    assert rotary.name == "rotary/Mul"
    assert rotary.attrs["onnx_inputs"] == ["x", "cos", "sin"]
    assert rotary.attrs["onnx_outputs"] == ["y"]
    assert rotary.flops == 3 * 2 * 4 * 3 * 8
    assert graph.fixed["cos"].kind is graph.fixed["sin"].kind is FixedKind.CONSTANT
    as_activation = replace(rotary, deps=(7,))  # x computed by node 7
    assert gradient_needs(as_activation, fixed=graph.fixed) == ((), False)
    trained = {
        name: replace(t, kind=FixedKind.PARAMETER) if name in ("cos", "sin") else t
        for name, t in graph.fixed.items()
    }
    assert gradient_needs(as_activation, fixed=trained) == ((7,), False)


def test_a_negated_first_half_is_no_rotary_embedding() -> None:
    """``concat(-x1, x2)`` is no rotation: the chain stays."""
    graph = ingest(rotary_embedding("negated_first"))
    assert ROTARY not in ops_of(graph)
    assert ops_of(graph).count("Slice") == 2


def test_a_chain_of_layout_operators_is_one_node() -> None:
    graph = ingest(_layout_model(HEADS_MOVED))
    assert ops_of(graph) == ["Relu", "FusedLayout", "Relu"]
    layout = graph.nodes[1]
    assert layout.name == "member0"  # the first member's name, the last one's place
    assert layout.attrs["onnx_inputs"] == ["x"]
    assert layout.attrs["onnx_outputs"] == ["m2"]
    assert layout.attrs["output_shapes"] == [(4, 12)]
    assert layout.attrs["fused_attributes"] == {  # strings as ONNX's attributes hold them
        "steps": [b"reshape", b"transpose", b"reshape"],
        "dims": [2, 6, 2, 2, 0, 2, 1, 3, 4, 12],
        "ranks": [4, 4, 2],
    }
    assert layout.flops == 0
    # its gradient reads no forward value: the input's shape only
    [backward] = [n for n in training_graph(graph).nodes if n.forward == 1]
    assert 0 not in backward.deps and 1 not in backward.deps


@pytest.mark.parametrize(
    ("members", "steps", "dims"),
    [
        # reshapes in a row are one; transposes in a row are one permutation
        ([("Unsqueeze", [0]), ("Reshape", [2, 24])], [b"reshape"], [2, 24]),
        ([("Transpose", [1, 0, 2]), ("Transpose", [0, 2, 1])], [b"transpose"], [1, 2, 0]),
        # steps that undo each other leave the identity
        ([("Unsqueeze", [1]), ("Identity", None), ("Squeeze", [1])], [], []),
        ([("Transpose", [0, 2, 1]), ("Reshape", [2, 4, 6]), ("Transpose", [0, 2, 1])], [], []),
    ],
    ids=["reshapes", "transposes", "squeeze_undone", "transpose_undone"],
)
def test_a_layout_chains_steps_are_merged(
    members: list[tuple[str, Any]], steps: list[bytes], dims: list[int]
) -> None:
    graph = ingest(_layout_model(members))
    assert ops_of(graph) == ["Relu", "FusedLayout", "Relu"]
    attributes = graph.nodes[1].attrs.get("fused_attributes", {})
    assert attributes.get("steps", []) == steps
    assert attributes.get("dims", []) == dims


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("one_operator", {"members": HEADS_MOVED[:1]}),
        ("a_member_read_elsewhere", {"members": HEADS_MOVED[:2], "read_also": 0}),
        ("a_member_a_model_output", {"members": HEADS_MOVED[:2], "outputs": ("y", "m0")}),
        ("integers", {"members": HEADS_MOVED[:2], "dtype": TensorProto.INT64}),
    ],
)  # fmt: skip
def test_layout_operators_stay_apart_unless_a_chain_of_floats(
    case: str, kwargs: dict[str, Any]
) -> None:
    graph = ingest(_layout_model(**kwargs))
    assert "FusedLayout" not in ops_of(graph), case
    assert "Reshape" in ops_of(graph), case


# --- operators that compute nothing: bypassed ----------------------------------------------


def _noop_model(
    dropout_inputs: Sequence[str] = (), initializers: Sequence[TensorProto] = (), *,
    opset: int = 17, outputs: Sequence[str] = ("y",), inputs: Sequence[onnx.ValueInfoProto] = (),
) -> onnx.ModelProto:  # fmt: skip
    """Relu of x, an Identity, a Dropout (reading ``dropout_inputs`` after its data), a
    Sigmoid; ``outputs``: the model's outputs among r, i, d, mask and y."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Identity", ["r"], ["i"], name="identity"),
        helper.make_node("Dropout", ["i", *dropout_inputs], ["d", "mask"], name="dropout"),
        helper.make_node("Sigmoid", ["d"], ["y"], name="sigmoid"),
    ]
    ranks = {"mask": (4, TensorProto.BOOL if opset >= 10 else F32)}
    graph_outputs = [out(o, *ranks.get(o, (4,))) for o in outputs]
    return model(nodes, [vi("x", X_SHAPE), *inputs], graph_outputs, initializers, opset)


@pytest.mark.parametrize(
    ("opset", "dropout_inputs", "initializers"),
    [
        (9, (), ()),  # Dropout-7: no training mode
        (17, (), ()),  # training mode omitted: inference
        (17, ("ratio", "mode"), (init("ratio", 0.5), init("mode", False, np.bool_))),
        (17, ("ratio", "mode"), (init("ratio", 0.0), init("mode", True, np.bool_))),
    ],
    ids=["dropout-7", "no-mode", "inference", "training-at-0"],
)
def test_an_identity_and_a_dropout_that_is_one_are_bypassed(
    opset: int, dropout_inputs: Sequence[str], initializers: Sequence[TensorProto]
) -> None:
    m = _noop_model(dropout_inputs, initializers, opset=opset)
    before = m.SerializeToString()
    graph = ingest(m)
    assert ops_of(graph) == ["Relu", "Sigmoid"]
    sigmoid = graph.nodes[1]
    assert sigmoid.deps == (0,) and sigmoid.attrs["onnx_inputs"] == ["r"]
    assert sigmoid.input_bytes == 384 * 4
    assert m.SerializeToString() == before  # the caller's model is not modified
    training = training_graph(graph)
    assert [n.op for n in training.nodes if n.kind is NodeKind.BACKWARD] == ["Sigmoid", "Relu"]


@pytest.mark.parametrize(
    ("kept", "dropout_inputs", "initializers", "outputs", "inputs"),
    [
        (["Dropout"], ("ratio", "mode"), (init("ratio", 0.1), init("mode", True, np.bool_)),
         ("y",), ()),
        (["Dropout"], ("", "mode"), (init("mode", True, np.bool_),), ("y",), ()),  # ratio 0.5
        (["Dropout"], ("ratio", "mode"), (init("ratio", 0.0),), ("y",),
         (vi("mode", [], TensorProto.BOOL),)),  # its mode is known at run time only
        (["Dropout"], (), (), ("y", "mask"), ()),
        (["Identity"], (), (), ("y", "i"), ()),
    ],
    ids=["dropping", "default-ratio", "mode-an-input", "mask-read", "identity-an-output"],
)  # fmt: skip
def test_an_operator_whose_output_may_differ_or_is_named_is_kept(
    kept: list[str],
    dropout_inputs: Sequence[str],
    initializers: Sequence[TensorProto],
    outputs: Sequence[str],
    inputs: Sequence[onnx.ValueInfoProto],
) -> None:
    graph = ingest(_noop_model(dropout_inputs, initializers, outputs=outputs, inputs=inputs))
    assert ops_of(graph) == ["Relu", *kept, "Sigmoid"]


@pytest.mark.parametrize(
    ("op", "to", "kept"),
    [("Cast", F32, []), ("CastLike", F32, []), ("Cast", TensorProto.DOUBLE, ["Cast"])],
    ids=["cast-same", "castlike-same", "cast-to-double"],
)
def test_a_cast_to_its_inputs_type_is_bypassed(op: str, to: int, kept: list[str]) -> None:
    """``.to(torch.float32)`` of a float32 tensor, as T5's RMS normalization writes it."""
    like = [init("like", np.zeros((), helper.tensor_dtype_to_np_dtype(to)))]
    cast = (
        helper.make_node("Cast", ["r"], ["c"], to=to)
        if op == "Cast"
        else helper.make_node("CastLike", ["r", "like"], ["c"])
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        cast,
        helper.make_node("Sigmoid", ["c"], ["y"]),
    ]
    graph = ingest(
        model(nodes, [vi("x", X_SHAPE)], [out("y", 4, to)], like if op != "Cast" else [])
    )
    assert ops_of(graph) == ["Relu", *kept, "Sigmoid"]


def test_a_concat_of_one_part_and_a_reshape_to_the_same_shape_are_bypassed() -> None:
    """As a traced module's shape arithmetic leaves them (GPT-2's, DenseNet's exports);
    a Reshape that changes the shape, and a channel shuffle (a Reshape, Transpose and
    Reshape back to the same shape, its elements moved) stay."""
    same = init("same", X_SHAPE, np.int64)
    split = init("split", (2, 3, 4, 16), np.int64)
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Concat", ["r"], ["c"], axis=1),
        helper.make_node("Reshape", ["c", "same"], ["s"]),
        helper.make_node("Expand", ["s", "same"], ["e"]),
        helper.make_node("Reshape", ["e", "split"], ["p"]),
        helper.make_node("Transpose", ["p"], ["t"], perm=[0, 1, 3, 2]),
        helper.make_node("Reshape", ["t", "same"], ["y"]),
    ]
    graph = ingest(model(nodes, [vi("x", X_SHAPE)], [out("y", 4)], [same, split]))
    assert ops_of(graph) == ["Relu", "FusedLayout"]
    assert graph.nodes[1].attrs["onnx_inputs"] == ["r"]


@pytest.mark.parametrize(
    ("opset", "pads", "kept"),
    [(17, [0] * 8, []), (17, [0, 0, 1, 0, 0, 0, 1, 0], ["Pad"]), (9, [0] * 8, [])],
    ids=["zeros", "padding", "pad-2-zeros"],
)
def test_a_pad_by_zero_is_bypassed(opset: int, pads: list[int], kept: list[str]) -> None:
    """As Swin pads its windows to a multiple it already is."""
    if opset >= 11:
        pad = helper.make_node("Pad", ["r", "pads"], ["p"])
        params = [init("pads", pads, np.int64)]
    else:
        pad, params = helper.make_node("Pad", ["r"], ["p"], pads=pads), []
    nodes = [helper.make_node("Relu", ["x"], ["r"]), pad, helper.make_node("Sigmoid", ["p"], ["y"])]
    graph = ingest(model(nodes, [vi("x", X_SHAPE)], [out("y", 4)], params, opset))
    assert ops_of(graph) == ["Relu", *kept, "Sigmoid"]


# --- layer normalization's formula fused -------------------------------------------------


def _mean(x: str, output: str, axes: Sequence[int], opset: int) -> onnx.NodeProto:
    """``ReduceMean`` of ``x`` over ``axes``, kept: an attribute before opset 18, from 18
    on the constant input ``axes`` (``_axes_init``)."""
    if opset >= 18:
        return helper.make_node("ReduceMean", [x, "axes"], [output])
    return helper.make_node("ReduceMean", [x], [output], axes=list(axes))


def _axes_init(axes: Sequence[int], opset: int) -> list[TensorProto]:
    return [init("axes", list(axes), np.int64)] if opset >= 18 else []


def _layer_norm_model(
    *, square: str = "Pow", bias: bool = True, axes: Sequence[int] = (-1,),
    extra: Sequence[onnx.NodeProto] = (), outputs: Sequence[str] = ("y",), opset: int = 14,
) -> onnx.ModelProto:  # fmt: skip
    """Relu, then layer normalization over the last axis as PyTorch exports it before
    opset 17, then Relu (``square``: ``Pow`` by 2, or ``Mul`` of the centred value by
    itself; ``opset``: from 18 on, the means' axes are an input)."""
    nodes = [
        helper.make_node("Relu", ["x0"], ["x"], name="pre"),
        _mean("x", "mean", axes, opset),
        helper.make_node("Sub", ["x", "mean"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["sq"])
        if square == "Pow"
        else helper.make_node("Mul", ["d", "d"], ["sq"]),
        _mean("sq", "var", axes, opset),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["std"]),
        helper.make_node("Div", ["d", "std"], ["n"]),
        helper.make_node("Mul", ["n", "w"], ["nw"], name="ln/Mul"),
    ]
    last = "nw"
    if bias:
        nodes.append(helper.make_node("Add", ["nw", "b"], ["nb"], name="ln/Add_1"))
        last = "nb"
    nodes += [helper.make_node("Relu", [last], ["y"], name="post"), *extra]
    params = [init("two", 2.0), init("eps", 1e-5), ones("w", (8,)), ones("b", (8,))]
    params += _axes_init(axes, opset)
    return model(nodes, [vi("x0", GELU_SHAPE)], [out(o, 3) for o in outputs], params, opset)


@pytest.mark.parametrize(
    ("square", "bias", "last", "opset"),
    [
        ("Pow", True, "ln/Add_1", 14),
        ("Mul", True, "ln/Add_1", 14),
        ("Pow", False, "ln/Mul", 14),
        ("Pow", True, "ln/Add_1", 18),  # the means' axes an input
    ],
)
def test_a_layer_norm_written_as_its_formula_is_one_node(
    square: str, bias: bool, last: str, opset: int
) -> None:
    graph = ingest(_layer_norm_model(square=square, bias=bias, opset=opset))
    assert ops_of(graph) == ["Relu", "FusedLayerNorm", "Relu"]
    norm = graph.nodes[1]
    assert norm.name == last and norm.deps == (0,)
    assert norm.attrs["onnx_inputs"] == ["x", "w", "b"][: 3 if bias else 2]
    assert norm.attrs["fused_attributes"] == {"axis": -1, "epsilon": pytest.approx(1e-5)}
    assert norm.fixed == ("w", "b")[: 2 if bias else 1]


@pytest.mark.parametrize(
    ("case", "kwargs"),
    [
        ("centred_value_read_elsewhere", {"extra": [helper.make_node("Neg", ["d"], ["z"])],
                                          "outputs": ["y", "z"]}),
        ("a_mean_a_model_output", {"outputs": ["y", "mean"]}),
        ("over_a_leading_axis", {"axes": (0,)}),
        ("over_a_leading_axis_as_an_input", {"axes": (0,), "opset": 18}),
    ],
)  # fmt: skip
def test_a_layer_norms_operators_stay_apart_unless_they_are_one(
    case: str, kwargs: dict[str, Any]
) -> None:
    graph = ingest(_layer_norm_model(**kwargs))
    assert "FusedLayerNorm" not in ops_of(graph), case
    assert "ReduceMean" in ops_of(graph), case


def _rms_norm_model(
    *, inverse: str = "Div", extra: Sequence[onnx.NodeProto] = (), opset: int = 17
) -> onnx.ModelProto:
    """Relu, then RMS normalization as T5's ``T5LayerNorm`` exports (``inverse``: ``Div``
    of 1 by the root, or ``Reciprocal``, as the dynamo exporter writes LLaMA's at opset
    18, where the mean's axes are an input), then Relu."""
    nodes = [
        helper.make_node("Relu", ["x0"], ["x"], name="pre"),
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        _mean("sq", "ms", [-1], opset),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["root"]),
        helper.make_node("Div", ["one", "root"], ["inv"])
        if inverse == "Div"
        else helper.make_node("Reciprocal", ["root"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["n"]),
        helper.make_node("Mul", ["w", "n"], ["nw"], name="norm/Mul_1"),
        helper.make_node("Relu", ["nw"], ["y"], name="post"),
        *extra,
    ]
    params = [init("two", 2.0), init("eps", 1e-6), init("one", 1.0), ones("w", (8,))]
    params += _axes_init([-1], opset)
    outputs = [out("y", 3)] + [out(o, 3) for n in extra for o in n.output]
    return model(nodes, [vi("x0", GELU_SHAPE)], outputs, params, opset)


@pytest.mark.parametrize(
    ("inverse", "opset"), [("Div", 17), ("Reciprocal", 17), ("Reciprocal", 18)]
)
def test_an_rms_norm_written_as_its_formula_is_one_node(inverse: str, opset: int) -> None:
    graph = ingest(_rms_norm_model(inverse=inverse, opset=opset))
    assert ops_of(graph) == ["Relu", "FusedRMSNorm", "Relu"]
    norm = graph.nodes[1]
    assert norm.name == "norm/Mul_1" and norm.attrs["onnx_inputs"] == ["x", "w"]
    assert norm.attrs["fused_attributes"] == {"axis": -1, "epsilon": pytest.approx(1e-6)}
    kept = ingest(_rms_norm_model(extra=[helper.make_node("Neg", ["inv"], ["z"])]))
    assert "FusedRMSNorm" not in ops_of(kept)  # its inverse root read elsewhere


# --- operators outside the table and shape failures ----------------------------------------


def test_standard_op_outside_the_flops_table_is_schedulable() -> None:
    assert "Hardmax" not in ops.FLOPS
    graph = ingest(single_op(helper.make_node("Hardmax", ["x"], ["y"]), 4))
    assert ops_of(graph) == ["Hardmax"]
    assert graph.nodes[0].flops == 384  # memory-bound default: one per output element
    assert graph.nodes[0].output_bytes == 384 * 4


def _custom_model(annotate: bool) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="pre"),
        helper.make_node("Fancy", ["r"], ["f"], name="fancy", domain="com.example"),
        helper.make_node("Relu", ["f"], ["y"], name="post"),
    ]
    annotations = [vi("f", [2, 6, 8, 8])] if annotate else []
    return model(
        nodes,
        [vi("x", X_SHAPE)],
        [out("y", 4)],
        value_info=annotations,
        extra_opsets=[helper.make_opsetid("com.example", 1)],
    )


def test_custom_op_with_declared_shape_is_schedulable() -> None:
    graph = ingest(_custom_model(annotate=True))
    assert ops_of(graph) == ["Relu", "Fancy", "Relu"]
    assert graph.nodes[1].output_bytes == 768 * 4
    assert graph.nodes[2].output_bytes == 768 * 4
    assert graph.nodes[1].flops == 768


def test_custom_op_without_shape_is_a_shape_error_naming_it() -> None:
    with pytest.raises(ShapeError, match=r"'fancy' \(Fancy\)"):
        ingest(_custom_model(annotate=False))


def test_data_dependent_shape_is_a_shape_error_naming_the_node() -> None:
    nodes = [
        helper.make_node("NonZero", ["x"], ["nz"], name="where_nonzero"),
        helper.make_node("Transpose", ["nz"], ["y"]),
    ]
    m = model(nodes, [vi("x", X_SHAPE)], [out("y", 2, TensorProto.INT64)])
    with pytest.raises(ShapeError, match=r"'where_nonzero' \(NonZero\)") as info:
        ingest(m)
    assert "\n" not in str(info.value)


def test_inconsistent_shapes_are_a_shape_error_naming_the_node() -> None:
    node = helper.make_node("MatMul", ["x", "W"], ["y"], name="bad_matmul")
    m = single_op(node, 4, [ones("W", [7, 5])])
    with pytest.raises(ShapeError, match=r"'bad_matmul' \(MatMul\)"):
        ingest(m)


# --- input shapes -------------------------------------------------------------------------


def _symbolic_model() -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    return model(nodes, [vi("x", ["batch", 3, "H", "W"])], [out("y", 4)])


def test_symbolic_dims_without_values_name_input_dim_and_flags() -> None:
    with pytest.raises(ShapeError) as info:
        ingest(_symbolic_model())
    message = str(info.value)
    assert "'x'" in message and "dimension 0" in message and "'batch'" in message
    assert "--batch" in message and "--input x=DIMS" in message


def test_batch_only_fills_the_leading_dimension() -> None:
    with pytest.raises(ShapeError, match=r"dimension 2 \('H'\)"):
        ingest(_symbolic_model(), batch=4)


def test_input_override_gives_full_shape() -> None:
    graph = ingest(_symbolic_model(), inputs={"x": [4, 3, 16, 16]})
    assert graph.fixed["x"].nbytes == 4 * 3 * 16 * 16 * 4
    assert graph.nodes[0].output_bytes == 4 * 3 * 16 * 16 * 4


def test_batch_sets_leading_symbolic_dim_of_every_input() -> None:
    nodes = [helper.make_node("Add", ["a", "b"], ["y"])]
    m = model(nodes, [vi("a", ["N", 8]), vi("b", ["M", 8])], [out("y", 2)])
    graph = ingest(m, batch=3)
    assert graph.fixed["a"].nbytes == graph.fixed["b"].nbytes == 3 * 8 * 4
    assert graph.nodes[0].output_bytes == 3 * 8 * 4


def test_input_override_wins_over_batch_and_over_stale_declared_shapes() -> None:
    # Declared output shape says batch 1; the override must not clash with it.
    node = helper.make_node("Relu", ["x"], ["y"])
    m = model([node], [vi("x", [1, 3, 8, 8])], [vi("y", [1, 3, 8, 8])])
    graph = ingest(m, batch=7, inputs={"x": [6, 3, 8, 8]})
    assert graph.nodes[0].output_bytes == 6 * 192 * 4


def test_batch_does_not_change_concrete_leading_dims() -> None:
    graph = ingest(single_op(helper.make_node("Relu", ["x"], ["y"]), 4), batch=9)
    assert graph.nodes[0].output_bytes == 384 * 4


def test_unknown_input_name_is_invalid_input_naming_it() -> None:
    with pytest.raises(InvalidInputError, match="'nope'"):
        ingest(_symbolic_model(), inputs={"nope": [1, 2]})


@pytest.mark.parametrize("dims", [[1, 3, 8], [0, 3, 8, 8], [1.5, 3, 8, 8]])
def test_bad_override_dims_are_invalid_input(dims: list) -> None:
    with pytest.raises(InvalidInputError, match="x"):
        ingest(_symbolic_model(), inputs={"x": dims})


@pytest.mark.parametrize("batch", [0, -1])
def test_bad_batch_is_invalid_input(batch: int) -> None:
    with pytest.raises(InvalidInputError, match="batch"):
        ingest(_symbolic_model(), batch=batch)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x=1x3x224x224", ("x", (1, 3, 224, 224))),
        ("input.1=8", ("input.1", (8,))),
        (" ids = 2,128 ", ("ids", (2, 128))),
        ("a=b=2X3", ("a=b", (2, 3))),
    ],
)
def test_parse_input_shape(text: str, expected: tuple) -> None:
    assert parse_input_shape(text) == expected


@pytest.mark.parametrize("text", ["x", "=1x2", "x=", "x=1xx2", "x=1x-2", "x=0x3", "x=ax3"])
def test_parse_input_shape_rejects_bad_text(text: str) -> None:
    with pytest.raises(InvalidInputError):
        parse_input_shape(text)


# --- names and order ----------------------------------------------------------------------


def test_empty_names_are_generated_and_all_names_unique() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),  # unnamed -> Relu_0, but Relu_0 is taken
        helper.make_node("Relu", ["a"], ["b"], name="Relu_0"),
        helper.make_node("Sigmoid", ["b"], ["c"], name="dup"),
        helper.make_node("Sigmoid", ["c"], ["d"], name="dup"),
        helper.make_node("Tanh", ["d"], ["y"]),
    ]
    m = model(nodes, [vi("x", X_SHAPE)], [out("y", 4)])
    m.graph.node[3].name = "dup"  # the checker does not require unique names
    names = [n.name for n in ingest(m).nodes]
    assert names == ["Relu_0_1", "Relu_0", "dup", "dup_1", "Tanh_4"]
    assert names == [n.name for n in ingest(m).nodes]  # stable


def test_nodes_listed_out_of_order_are_sorted_topologically() -> None:
    chain = [
        helper.make_node("Relu", ["x"], ["a"], name="first"),
        helper.make_node("Sigmoid", ["a"], ["b"], name="second"),
        helper.make_node("Add", ["a", "b"], ["c"], name="third"),
        helper.make_node("Tanh", ["c"], ["y"], name="fourth"),
    ]
    shuffled = [chain[3], chain[1], chain[2], chain[0]]
    m = model(shuffled, [vi("x", X_SHAPE)], [out("y", 4)])
    for graph in (ingest(m), forward_graph(m)):  # via load_model, and unchecked proto
        assert [n.name for n in graph.nodes] == ["first", "second", "third", "fourth"]
        assert [n.deps for n in graph.nodes] == [(), (0,), (0, 1), (2,)]
        assert graph.outputs == (3,)
    assert m.graph.node[0].name == "fourth"  # the caller's model is untouched


def test_several_graph_outputs() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Sigmoid", ["a"], ["b"]),
        helper.make_node("Tanh", ["a"], ["c"]),
    ]
    graph = ingest(model(nodes, [vi("x", X_SHAPE)], [out("c", 4), out("b", 4)]))
    assert graph.outputs == (1, 2)


def test_attrs_record_onnx_io() -> None:
    node = helper.make_node("Conv", ["x", "W"], ["y"])
    graph = ingest(single_op(node, 4, [ones("W", [4, 3, 3, 3])]))
    attrs = graph.nodes[0].attrs
    assert attrs["onnx_inputs"] == ["x", "W"]
    assert attrs["onnx_outputs"] == ["y"]
    assert attrs["input_shapes"] == [X_SHAPE, (4, 3, 3, 3)]
    assert attrs["output_shapes"] == [(2, 4, 6, 6)]


def _branches() -> tuple[onnx.GraphProto, onnx.GraphProto]:
    then = helper.make_graph(
        [helper.make_node("Relu", ["a"], ["t"])], "then", [], [vi("t", X_SHAPE)]
    )
    other = helper.make_graph(
        [helper.make_node("Sigmoid", ["a"], ["e"])], "else", [], [vi("e", X_SHAPE)]
    )
    return then, other


def _loop_body() -> onnx.GraphProto:
    nodes = [
        helper.make_node("Identity", ["c_in"], ["c_out"]),
        helper.make_node("Add", ["v_in", "v_in"], ["v_out"]),
    ]
    inputs = [vi("i", [], TensorProto.INT64), vi("c_in", [], TensorProto.BOOL), vi("v_in", X_SHAPE)]
    return helper.make_graph(
        nodes, "body", inputs, [vi("c_out", [], TensorProto.BOOL), vi("v_out", X_SHAPE)]
    )


def _scan_body() -> onnx.GraphProto:
    nodes = [
        helper.make_node("Add", ["s_in", "x_i"], ["s_out"]),
        helper.make_node("Identity", ["s_out"], ["y_i"]),
    ]
    row = list(X_SHAPE[1:])
    return helper.make_graph(
        nodes, "scan", [vi("s_in", row), vi("x_i", row)], [vi("s_out", row), vi("y_i", row)]
    )


def test_control_flow_is_one_line_naming_every_node() -> None:
    """If, Loop and Scan cannot be planned statically: all of them are named at once,
    with their counts, also those downstream of another (their shapes are unknown)."""
    then, other = _branches()
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("If", ["cond"], ["b"], then_branch=then, else_branch=other, name="if1"),
        helper.make_node("If", ["cond"], ["c"], then_branch=then, else_branch=other, name="if2"),
        helper.make_node("Loop", ["trip", "", "b"], ["d"], body=_loop_body(), name="loop"),
        helper.make_node(
            "Scan", ["zero", "d"], ["s", "e"], body=_scan_body(), num_scan_inputs=1, name="scan"
        ),
        helper.make_node("Add", ["c", "e"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", X_SHAPE), vi("cond", [], TensorProto.BOOL)],
        [out("y", 4)],
        [init("trip", np.array(3), np.int64), ones("zero", X_SHAPE[1:])],
    )
    with pytest.raises(ShapeError) as info:
        ingest(m)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("4 nodes (3 operators) cannot be planned")
    assert "If x2 ('if1', 'if2'): control flow" in message
    assert "Loop x1 ('loop')" in message and "Scan x1 ('scan')" in message
    assert "static unrolling" in message
    assert "Add" not in message  # downstream of unusable nodes, not itself unusable


def test_one_control_flow_node_names_it_and_what_is_needed() -> None:
    then, other = _branches()
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other, name="gate"),
    ]
    m = model(nodes, [vi("x", X_SHAPE), vi("cond", [], TensorProto.BOOL)], [out("y", 4)])
    with pytest.raises(ShapeError, match=r"node 'gate' \(If\) is control flow.*would need"):
        ingest(m)


def test_every_unsupported_operator_is_listed_with_counts() -> None:
    nodes = [
        helper.make_node("NonZero", ["x"], ["nz1"], name="nz1"),
        helper.make_node("NonZero", ["x"], ["nz2"], name="nz2"),
        helper.make_node("Fancy", ["x"], ["f"], domain="com.example", name="fancy"),
        helper.make_node("SequenceConstruct", ["x", "x"], ["seq"], name="seq"),
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Transpose", ["nz1"], ["t"]),  # downstream: not named
    ]
    m = model(
        nodes,
        [vi("x", X_SHAPE)],
        [
            out("t", 2, TensorProto.INT64),
            out("nz2", 2, TensorProto.INT64),
            out("f", 4),
            out("r", 4),
        ],
        extra_opsets=[helper.make_opsetid("com.example", 1)],
    )
    m.graph.output.append(helper.make_tensor_sequence_value_info("seq", F32, None))
    with pytest.raises(ShapeError) as info:
        ingest(m)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("4 nodes (3 operators) cannot be planned")
    assert "NonZero x2 ('nz1', 'nz2'): its output shape depends on the data" in message
    assert "Fancy x1 ('fancy'): operator com.example.Fancy has no shape inference" in message
    assert "value_info" in message
    assert "SequenceConstruct x1 ('seq'): sequence" in message
    assert "Transpose" not in message


def test_long_lists_of_nodes_are_cut() -> None:
    nodes = [helper.make_node("NonZero", ["x"], [f"nz{i}"], name=f"nz{i}") for i in range(8)]
    outputs = [out(f"nz{i}", 2, TensorProto.INT64) for i in range(8)]
    with pytest.raises(ShapeError, match=r"NonZero x8 \('nz0', .*'nz4' and 3 more\)"):
        ingest(model(nodes, [vi("x", X_SHAPE)], outputs))


# --- optional and unused outputs ------------------------------------------------------------


@pytest.mark.parametrize("opset", [7, 9, 10, 13, 17])
def test_dropout_with_an_unused_mask_ingests(opset: int) -> None:
    """The classic zoo's opset-9 models (AlexNet, VGG, ...): shape inference leaves the
    mask of Dropout-7 untyped; its shape is the data's, as the specification says."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Dropout", ["r"], ["y", "mask"], name="drop"),
    ]
    graph = ingest(model(nodes, [vi("x", X_SHAPE)], [out("y", 4)], opset=opset))
    assert ops_of(graph) == ["Relu", "Dropout"]
    drop = graph.nodes[1]
    assert drop.attrs["onnx_outputs"] == ["y", "mask"]
    assert drop.attrs["output_shapes"] == [X_SHAPE, X_SHAPE]
    mask_bytes = 384 if opset >= 10 else 384 * 4  # bool from Dropout-10 on, else T
    assert drop.output_bytes == 384 * 4 + mask_bytes


def test_dropout_mask_read_by_a_node_has_the_specified_shape() -> None:
    nodes = [
        helper.make_node("Dropout", ["x"], ["d", "mask"]),
        helper.make_node("Neg", ["mask"], ["m"]),  # Dropout-7: a float mask
        helper.make_node("Mul", ["d", "m"], ["y"]),
    ]
    graph = ingest(model(nodes, [vi("x", X_SHAPE)], [out("y", 4)], opset=9))
    assert graph.nodes[1].attrs["input_shapes"] == [X_SHAPE]


def test_an_unused_output_of_unknown_shape_is_left_out() -> None:
    nodes = [
        helper.make_node("Fancy", ["x"], ["f", "aux"], domain="com.example"),
        helper.make_node("Relu", ["f"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", X_SHAPE)],
        [out("y", 4)],
        value_info=[vi("f", X_SHAPE)],
        extra_opsets=[helper.make_opsetid("com.example", 1)],
    )
    graph = ingest(m)
    assert graph.nodes[0].attrs["onnx_outputs"] == ["f"]
    assert graph.nodes[0].output_bytes == 384 * 4


def test_a_used_output_of_unknown_shape_still_fails() -> None:
    nodes = [
        helper.make_node("Fancy", ["x"], ["f", "aux"], domain="com.example", name="fancy"),
        helper.make_node("Add", ["f", "aux"], ["y"]),
    ]
    m = model(
        nodes,
        [vi("x", X_SHAPE)],
        [out("y", 4)],
        value_info=[vi("f", X_SHAPE)],
        extra_opsets=[helper.make_opsetid("com.example", 1)],
    )
    with pytest.raises(ShapeError, match=r"'fancy' \(Fancy\)"):
        ingest(m)


# --- constant folding and sizes -------------------------------------------------------------


def test_gather_elements_folds_past_the_reference_evaluators_limit() -> None:
    """BERT: onnx.reference's GatherElements fails with more than 32/64 choices
    ("cannot reshape array of size 1 into shape (1,32)")."""
    nodes = [
        helper.make_node("GatherElements", ["table", "idx"], ["g"], axis=1),
        helper.make_node("Squeeze", ["g", "axes"], ["shape"]),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    table = init("table", np.arange(512).reshape(1, 512), np.int64)
    inits = [table, init("idx", [[6, -448]], np.int64), init("axes", [0], np.int64)]
    graph = ingest(model(nodes, [vi("x", X_SHAPE)], [out("y", 2)], inits))
    assert ops_of(graph) == ["Reshape"]
    assert graph.nodes[0].attrs["output_shapes"] == [(6, 64)]


@pytest.mark.parametrize("axis", [None, 1, -1])
def test_reference_ops_gather_elements_matches_numpy_past_the_limit(axis: int | None) -> None:
    """What remat hands ``onnx.reference`` (the agent's constant evaluation too) gathers
    from 100 choices, negative indices included, with the attribute's default of 0."""
    from onnx.reference import ReferenceEvaluator

    table = np.arange(200, dtype=np.int64).reshape(2, 100)
    idx = np.array([[3, -1, 70], [99, 0, -100]], dtype=np.int64)
    attrs = {} if axis is None else {"axis": axis}
    if axis is None:
        table, idx = table.T.copy(), np.array([[3, 1], [-1, 0], [70, 99]], dtype=np.int64)
    node = helper.make_node("GatherElements", ["t", "i"], ["g"], **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [],
        [helper.make_empty_tensor_value_info("g")],
        initializer=[numpy_helper.from_array(table, "t"), numpy_helper.from_array(idx, "i")],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (got,) = ReferenceEvaluator(m, new_ops=list(reference_ops())).run(None, {})
    dim = 0 if axis is None else axis
    want = np.take_along_axis(table, np.where(idx < 0, idx + table.shape[dim], idx), axis=dim)
    np.testing.assert_array_equal(got, want)


def test_a_huge_declared_input_is_refused_with_its_bytes() -> None:
    big = [1 << 20] * 3
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", big)], [out("y", 3)])
    with pytest.raises(ShapeError, match=r"input 'x' .*would need 4611686018427387904 bytes"):
        ingest(m)


def test_a_huge_computed_output_is_refused_with_its_bytes() -> None:
    nodes = [
        helper.make_node("Expand", ["x", "shape"], ["e"], name="expand"),
        helper.make_node("Relu", ["e"], ["y"]),
    ]
    inits = [init("shape", [1 << 31, 1 << 31, 1 << 31], np.int64)]
    m = model(nodes, [vi("x", [1])], [out("y", 3)], inits)
    with pytest.raises(ShapeError, match=r"node 'expand' \(Expand\).*would need \d+ bytes"):
        ingest(m)


def test_graph_piped_into_head_prints_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(
        model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", X_SHAPE)], [out("y", 4)]), path
    )
    remat = Path(sys.executable).parent / "remat"
    proc = subprocess.Popen(
        [str(remat), "graph", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before anything is written
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr


# --- bad files ----------------------------------------------------------------------------


def _weighty_model() -> onnx.ModelProto:
    node = helper.make_node("MatMul", ["x", "W"], ["y"])
    return model([node], [vi("x", [2, 64])], [out("y", 2)], [ones("W", [64, 64])])


def _fails_checker() -> bytes:
    """A node reads a tensor nothing defines."""
    m = model([helper.make_node("Relu", ["nowhere"], ["y"])], [vi("x", [2])], [out("y", 1)])
    return m.SerializeToString()


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (b"", ModelLoadError, "empty"),
        (b"\x00\xff garbage, certainly not a protobuf \xff" * 3, ModelLoadError, "not an ONNX"),
        (_weighty_model().SerializeToString()[:5000], ModelLoadError, "truncated"),
        (_fails_checker(), ModelLoadError, "onnx.checker"),
    ],
    ids=["empty", "garbage", "truncated", "checker"],
)
def test_bad_bytes_raise_one_line_model_load_errors(data: bytes, error: type, message: str) -> None:
    with pytest.raises(error, match=message) as info:
        load_model(data)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(tmp_path / "missing.onnx")


def test_directory_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a file"):
        load_model(tmp_path)


def test_truncated_file_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "cut.onnx"
    path.write_bytes(_weighty_model().SerializeToString()[:3000])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_forward_graph(str(path))


def test_load_from_path_and_str(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_weighty_model(), path)
    for source in (path, str(path)):
        graph = load_forward_graph(source)
        assert ops_of(graph) == ["MatMul"]
        assert graph.fixed["W"].nbytes == 64 * 64 * 4


def test_external_data_stays_on_disk_but_is_sized(tmp_path: Path) -> None:
    path = tmp_path / "ext.onnx"
    onnx.save(
        _weighty_model(), path, save_as_external_data=True, location="ext.bin", size_threshold=0
    )
    graph = load_forward_graph(path, external_data_dir=tmp_path)
    assert graph.fixed["W"].nbytes == 64 * 64 * 4
    assert graph.nodes[0].output_bytes == 2 * 64 * 4


def test_no_raw_onnx_or_protobuf_exception_escapes() -> None:
    sources: list[bytes] = [b"\x08\x07\x12", b"\x0a\xff\xff\xff\xff", bytes(range(256))]
    for data in sources:
        with pytest.raises(RematError):
            load_forward_graph(data)


def test_unchecked_model_reading_an_undefined_tensor() -> None:
    m = model(
        [helper.make_node("Add", ["x", "ghost"], ["y"], name="add")], [vi("x", [2])], [out("y", 1)]
    )
    with pytest.raises(ModelLoadError, match=r"'add' \(Add\) reads undefined tensor 'ghost'"):
        forward_graph(m)


def test_cycle_is_a_model_load_error() -> None:
    nodes = [helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Relu", ["a"], ["b"])]
    m = model(nodes, [vi("x", [2])], [out("b", 1)])
    with pytest.raises(ModelLoadError, match="cycle"):
        load_model(m.SerializeToString())


# --- performance --------------------------------------------------------------------------


def _long_model(blocks: int, opset: int) -> onnx.ModelProto:
    """Blocks of MatMul, Add, the Shape->Gather->Unsqueeze->Concat->Reshape idiom, Relu."""
    params = [init("i0", 0, np.int64), init("axes", [0], np.int64)]
    params.append(init("tail", [-1, 32], np.int64))
    nodes, prev = [], "x"
    for b in range(blocks):
        params += [ones(f"w{b}", [32, 32]), ones(f"b{b}", [32])]
        nodes += [
            helper.make_node("MatMul", [prev, f"w{b}"], [f"m{b}"]),
            helper.make_node("Add", [f"m{b}", f"b{b}"], [f"a{b}"]),
            helper.make_node("Shape", [f"a{b}"], [f"s{b}"]),
            helper.make_node("Gather", [f"s{b}", "i0"], [f"g{b}"], axis=0),
            helper.make_node("Unsqueeze", [f"g{b}", "axes"], [f"u{b}"]),
            helper.make_node("Concat", [f"u{b}", "tail"], [f"c{b}"], axis=0),
            helper.make_node("Reshape", [f"a{b}", f"c{b}"], [f"r{b}"]),
            helper.make_node("Relu", [f"r{b}"], [f"y{b}"]),
        ]
        prev = f"y{b}"
    return model(nodes, [vi("x", ["N", 32])], [out(prev, 2)], params, opset)


@pytest.mark.parametrize("opset", [13, 17])
def test_two_thousand_nodes_ingest_with_shape_idioms_folded(opset: int) -> None:
    """Ingestion time of such graphs is measured by bench/baselines.py (ingestion.csv)."""
    data = _long_model(250, opset).SerializeToString()
    graph = load_forward_graph(data, batch=4)
    # per block: MatMul and Add one node, the 4 shape-idiom nodes folded, and the Reshape
    # to (N, 1, 32): after the first block, to the shape its input has (bypassed)
    assert ops_of(graph) == ["MatMulAdd", "Reshape", "Relu"] + ["MatMulAdd", "Relu"] * 249
    assert all(n.output_bytes == 4 * 32 * 4 for n in graph.nodes)


# --- FLOP estimates -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "inputs", "outputs", "attrs", "expected"),
    [
        # Gemm with A transposed: A is (K, M) = (16, 2)
        ("Gemm", [(16, 2), (16, 10)], [(2, 10)], {"transA": 1}, 2 * 2 * 10 * 16),
        # batched MatMul broadcasting a 2-D weight: 2 * out_elems * K
        ("MatMul", [(4, 2, 8, 16), (16, 5)], [(4, 2, 8, 5)], {}, 2 * 320 * 16),
        ("MatMul", [(16,), (16,)], [()], {}, 2 * 16),  # 1-D dot product
        # depthwise conv: weight (C, 1, 3, 3) -> one input channel per output
        ("Conv", [(1, 8, 4, 4), (8, 1, 3, 3)], [(1, 8, 2, 2)], {"group": 8}, 2 * 32 * 9),
        # grouped ConvTranspose: weight (Cin, Cout/group, k, k)
        ("ConvTranspose", [(1, 4, 2, 2), (4, 3, 2, 2), (6,)], [(1, 6, 4, 4)], {}, 384 + 96),
        ("Max", [(4,), (4,), (4,)], [(4,)], {}, 8),
        ("ReduceMean", [(2, 8)], [(2, 1)], {}, 16),
        ("Dropout", [(2, 8)], [(2, 8), (2, 8)], {}, 0),
        ("SomethingNew", [(2, 8)], [(3, 8)], {}, 24),
        # LSTM, bidirectional: X (seq 5, batch 2, I 3), W (2, 4H, I), R (2, 4H, H) with H 4:
        # 10 steps x 2 directions x 16 gate units x (2 (I + H) + 10)
        ("LSTM", [(5, 2, 3), (2, 16, 3), (2, 16, 4)], [(5, 2, 2, 4)], {}, 10 * 2 * 16 * 24),
        ("GRU", [(2, 5, 3), (1, 12, 3), (1, 12, 4)], [(2, 1, 5, 4)], {"layout": 1}, 10 * 12 * 24),
        ("Resize", [(1, 2, 4, 4)], [(1, 2, 8, 8)], {}, 4 * 128),
        ("Conv", [(1, 8, 4, 4)], [(1, 8, 2, 2)], {}, 32),  # malformed: default estimate
    ],
)
def test_flops_estimates(
    op: str, inputs: list, outputs: list, attrs: dict, expected: float
) -> None:
    assert ops.flops(op, inputs, outputs, attrs) == pytest.approx(expected)


# --- sample models ------------------------------------------------------------------------

CONSTANT_LIKE = {"Constant", "ConstantOfShape", "Shape", "Size"}


def _sample_builders() -> list[tuple[str, Callable[[], onnx.ModelProto]]]:
    if importlib.util.find_spec("remat.samples") is None:
        return []
    from remat import samples

    names = [
        "vgg16",
        "resnet18",
        "unet",
        "mobilenet_v1",
        "transformer_block",
        "old_style_model",
        "chain",
    ]
    return [(n, getattr(samples, n)) for n in names if callable(getattr(samples, n, None))]


@pytest.mark.parametrize(("name", "build"), _sample_builders() or [pytest.param("none", None)])
def test_sample_models_ingest(name: str, build: Callable[[], onnx.ModelProto] | None) -> None:
    if build is None:
        pytest.skip("remat.samples is not available")
    sample = build()
    graph = forward_graph(load_model(sample.SerializeToString()), batch=1)
    assert len(graph) > 0
    assert not CONSTANT_LIKE & set(ops_of(graph))
    assert all(n.output_bytes > 0 for n in graph.nodes)
    assert graph.outputs


def test_large_sample_ingests() -> None:
    """Its ingestion time is measured by bench/baselines.py (ingestion.csv)."""
    if importlib.util.find_spec("remat.samples") is None:
        pytest.skip("remat.samples is not available")
    from remat import samples

    model = samples.large()
    graph = load_forward_graph(model.SerializeToString(), batch=8, fuse_attention=False)
    fused = sum(n.op == "MatMulAdd" for n in graph.nodes)
    assert len(model.graph.node) >= 2000 and fused >= 400
    # one node per operator, pairs fused, each chain of layout operators one node
    layout = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity"}
    chained = sum(n.op_type in layout for n in model.graph.node) - sum(
        n.op in layout for n in graph.nodes
    )
    chains = sum(n.op == "FusedLayout" for n in graph.nodes)
    assert chains > 0
    assert len(graph) == len(model.graph.node) - fused - (chained - chains)
