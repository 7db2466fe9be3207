"""Small hand-made forward graphs for unit tests of pure logic, and small ONNX models of
the shapes they need."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from remat.graph import FixedKind, FixedTensor, Graph, Mode, Node, NodeKind


def forward(deps: list[tuple[int, ...]], sizes: list[int] | None = None, op: str = "Relu") -> Graph:
    """A forward graph: node i reads ``deps[i]``; nodes without deps read the input x;
    every sink is a model output; each node has a 100-byte weight w{i}."""
    sizes = sizes or [1000] * len(deps)
    fixed = {"x": FixedTensor("x", FixedKind.INPUT, 400)}
    nodes = []
    for i, d in enumerate(deps):
        fixed[f"w{i}"] = FixedTensor(f"w{i}", FixedKind.PARAMETER, 100)
        reads = (("x",) if not d else ()) + (f"w{i}",)
        nodes.append(
            Node(
                i,
                f"n{i}",
                op,
                NodeKind.FORWARD,
                tuple(d),
                sizes[i],
                flops=float(sizes[i]) * 1000,
                input_bytes=sum(sizes[j] for j in d) + 100,
                fixed=reads,
            )
        )
    users = {j for d in deps for j in d}
    outputs = tuple(i for i in range(len(deps)) if i not in users)
    return Graph(Mode.INFERENCE, tuple(nodes), fixed, outputs)


def chain(n: int, size: int = 1000) -> Graph:
    return forward([(i - 1,) if i else () for i in range(n)], [size] * n)


def diamond() -> Graph:
    """0 -> (1, 2) -> 3."""
    return forward([(), (0,), (0,), (1, 2)])


def split_and_dropout() -> onnx.ModelProto:
    """x (4, 6) -> Relu -> Split into s0 (4, 2) and s1 (4, 4); s0 -> training-mode Dropout
    (its mask an output of the node, as exporters write it) -> Sigmoid -> y0; s1 -> Tanh
    -> y1: nodes that read one output of a node with several, none of them a mask."""
    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], "relu"),
        helper.make_node("Split", ["r", "sizes"], ["s0", "s1"], "split", axis=1),
        helper.make_node("Dropout", ["s0", "ratio", "training"], ["d0", "mask"], "dropout"),
        helper.make_node("Sigmoid", ["d0"], ["y0"], "sigmoid"),
        helper.make_node("Tanh", ["s1"], ["y1"], "tanh"),
    ]
    graph = helper.make_graph(
        nodes,
        "split_and_dropout",
        [helper.make_tensor_value_info("x", f32, [4, 6])],
        [helper.make_tensor_value_info(y, f32, [4, n]) for y, n in (("y0", 2), ("y1", 4))],
        initializer=[
            numpy_helper.from_array(np.array([2, 4], np.int64), "sizes"),
            numpy_helper.from_array(np.array(0.25, np.float32), "ratio"),
            numpy_helper.from_array(np.array(True), "training"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def causal_attention(tokens: int, masked: float, initializer: bool = False) -> onnx.ModelProto:
    """softmax(q k^T / 8 + m) v on q, k, v of (2, 2, ``tokens``, 4), then Relu, with ``m``
    folded from scalars as GPT-2's causal mask is: ``masked`` strictly above the diagonal
    (chosen by ``Equal`` of a ``Trilu`` of ones), zero elsewhere; with ``initializer``,
    ``m`` that mask of (2, 1, ``tokens``, ``tokens``) as an initializer, as the dynamo
    exporter folds it."""
    f32 = TensorProto.FLOAT
    shape = [2, 2, tokens, 4]
    constants = {
        "one": np.array(1.0, np.float32),
        "zero": np.array(0.0, np.float32),
        "masked": np.array(masked, np.float32),
        "eight": np.array(8.0, np.float32),
        "square": np.array([tokens, tokens], np.int64),
        "above_diagonal": np.array(1, np.int64),
    }
    nodes = [
        helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value))
        for name, value in constants.items()
    ]
    if not initializer:
        nodes += [
            helper.make_node("Expand", ["one", "square"], ["ones"]),
            helper.make_node("Trilu", ["ones", "above_diagonal"], ["upper"]),
            helper.make_node("Equal", ["upper", "one"], ["later"]),
            helper.make_node("Where", ["later", "masked", "zero"], ["m"]),
        ]
    nodes += [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"], name="attn/MatMul"),
        helper.make_node("Div", ["s", "eight"], ["sd"]),
        helper.make_node("Add", ["sd", "m"], ["sm"]),
        helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"], name="attn/MatMul_1"),
        helper.make_node("Relu", ["o"], ["y"]),
    ]
    mask = np.triu(np.full((tokens, tokens), masked, np.float32), 1)
    graph = helper.make_graph(
        nodes,
        "causal_attention",
        [helper.make_tensor_value_info(name, f32, shape) for name in ("q", "k", "v")],
        [helper.make_tensor_value_info("y", f32, shape)],
        [numpy_helper.from_array(np.stack([mask[None]] * 2), "m")] if initializer else [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def grouped_query_attention(tiled: bool = False) -> onnx.ModelProto:
    """softmax(q k^T / 8) v, then Relu, with q of (2, 4, 3, 8) and k, v of two heads (2, 2,
    3, 8), each key and value head repeated for two query heads in a row, as Hugging
    Face's ``repeat_kv`` writes it (a reshape adding an axis, ``Expand`` along it, a
    reshape merging it into the heads); with ``tiled``, the heads repeated as a whole
    instead (``(k0, k1, k0, k1)``), which is not grouped-query attention."""
    f32 = TensorProto.FLOAT
    added = [2, 1, 2, 3, 8] if tiled else [2, 2, 1, 3, 8]
    constants = {
        "added": np.array(added, np.int64),
        "repeated": np.array([2, 2, 2, 3, 8], np.int64),
        "heads": np.array([2, 4, 3, 8], np.int64),
        "eight": np.array(8.0, np.float32),
    }
    nodes = []
    for x in ("k", "v"):
        nodes += [
            helper.make_node("Reshape", [x, "added"], [f"{x}_added"]),
            helper.make_node("Expand", [f"{x}_added", "repeated"], [f"{x}_repeated"]),
            helper.make_node("Reshape", [f"{x}_repeated", "heads"], [f"{x}_heads"]),
        ]
    nodes += [
        helper.make_node("Transpose", ["k_heads"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"], name="attn/MatMul"),
        helper.make_node("Div", ["s", "eight"], ["sd"]),
        helper.make_node("Softmax", ["sd"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v_heads"], ["o"], name="attn/MatMul_1"),
        helper.make_node("Relu", ["o"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("q", f32, [2, 4, 3, 8])]
    inputs += [helper.make_tensor_value_info(x, f32, [2, 2, 3, 8]) for x in ("k", "v")]
    graph = helper.make_graph(
        nodes,
        "grouped_query_attention",
        inputs,
        [helper.make_tensor_value_info("y", f32, [2, 4, 3, 8])],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def rotary_embedding(rotation: str = "rotate_half") -> onnx.ModelProto:
    """``x * cos + rotate_half(x) * sin`` on x of (2, 4, 3, 8), then Relu, as the dynamo
    exporter writes LLaMA's rotary embedding: ``Mul``, two ``Slice``'s of the halves of the
    last axis (the second to the largest int64, as ``x[..., 4:]`` is written), ``Neg``,
    ``Concat``, ``Mul``, ``Add``; cosines and sines are (1, 1, 3, 8) initializers. With
    ``rotation`` ``"negated_first"``, ``concat(-x1, x2)`` instead, which is no rotation."""
    f32 = TensorProto.FLOAT
    angles = np.arange(24, dtype=np.float32).reshape(1, 1, 3, 8) / 7
    constants = {
        "cos": np.cos(angles),
        "sin": np.sin(angles),
        "zero": np.array([0], np.int64),
        "half": np.array([4], np.int64),
        "end": np.array([np.iinfo(np.int64).max], np.int64),
        "last": np.array([-1], np.int64),
    }
    negated, kept = ("x1", "x2") if rotation == "negated_first" else ("x2", "x1")
    nodes = [
        helper.make_node("Mul", ["x", "cos"], ["xc"], name="rotary/Mul"),
        helper.make_node("Slice", ["x", "zero", "half", "last"], ["x1"]),
        helper.make_node("Slice", ["x", "half", "end", "last"], ["x2"]),
        helper.make_node("Neg", [negated], ["negated"]),
        helper.make_node("Concat", ["negated", kept], ["rotated"], axis=-1),
        helper.make_node("Mul", ["rotated", "sin"], ["rs"]),
        helper.make_node("Add", ["xc", "rs"], ["y"]),
        helper.make_node("Relu", ["y"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "rotary_embedding",
        [helper.make_tensor_value_info("x", f32, [2, 4, 3, 8])],
        [helper.make_tensor_value_info("out", f32, [2, 4, 3, 8])],
        [numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
