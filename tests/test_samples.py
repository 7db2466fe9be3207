"""The sample zoo: valid models, expected structure, bad-input helpers."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from remat import samples

BUILDERS = {**samples.ZOO, "large": samples.large}


def _check(model: onnx.ModelProto) -> onnx.ModelProto:
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def _batch_dims(model: onnx.ModelProto) -> list[onnx.TensorShapeProto.Dimension]:
    inits = {t.name for t in model.graph.initializer}
    return [vi.type.tensor_type.shape.dim[0] for vi in model.graph.input if vi.name not in inits]


def _op_types(model: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in model.graph.node)


def test_zoo_names() -> None:
    assert set(samples.ZOO) == {
        "vgg16",
        "resnet18",
        "unet",
        "mobilenet_v1",
        "transformer",
        "old_style",
        "chain",
    }
    assert "large" not in samples.ZOO


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_valid_with_symbolic_batch(name: str) -> None:
    model = BUILDERS[name]()
    _check(model)
    dims = _batch_dims(model)
    assert dims and all(d.dim_param == samples.BATCH_DIM for d in dims)
    for out in model.graph.output:
        assert out.type.tensor_type.shape.dim[0].dim_param == samples.BATCH_DIM


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_valid_with_concrete_batch(name: str) -> None:
    model = BUILDERS[name](batch=2)
    inferred = _check(model)
    assert all(d.dim_value == 2 for d in _batch_dims(model))
    for out in inferred.graph.output:
        assert out.type.tensor_type.shape.dim[0].dim_value == 2


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_node_names_unique_and_set(name: str) -> None:
    model = BUILDERS[name]()
    names = [n.name for n in model.graph.node]
    assert all(names)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", sorted(samples.ZOO))
def test_float32_weights(name: str) -> None:
    model = samples.ZOO[name]()
    _check(model)
    floats = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    assert floats
    assert all(np.all(np.isfinite(numpy_helper.to_array(t))) for t in floats)


@pytest.mark.parametrize("name", sorted(samples.ZOO))
def test_deterministic(name: str) -> None:
    assert samples.ZOO[name]().SerializeToString() == samples.ZOO[name]().SerializeToString()


@pytest.mark.parametrize("name", ["vgg16", "resnet18", "unet", "mobilenet_v1", "transformer"])
def test_activations_dominate_parameters_at_batch_4(name: str) -> None:
    inferred = _check(samples.ZOO[name](batch=4))
    inits = {t.name for t in inferred.graph.initializer}
    params = sum(int(np.prod(t.dims)) for t in inferred.graph.initializer)
    acts = sum(
        int(np.prod([d.dim_value for d in vi.type.tensor_type.shape.dim]))
        for vi in [*inferred.graph.value_info, *inferred.graph.output]
        if vi.name not in inits
    )
    assert acts > params


def test_vgg16_structure() -> None:
    ops = _op_types(samples.vgg16())
    assert ops["Conv"] == 13
    assert ops["MaxPool"] == 5
    assert ops["Gemm"] == 3
    assert ops["Dropout"] == 2
    assert ops["Relu"] == 15
    assert ops["Flatten"] == 1


def test_resnet18_structure() -> None:
    model = samples.resnet18()
    ops = _op_types(model)
    assert ops["Conv"] == 1 + 16 + 3  # stem, 8 blocks x 2, 3 downsample projections
    assert ops["BatchNormalization"] == ops["Conv"]
    assert ops["Add"] == 8
    assert ops["MaxPool"] == 1
    assert ops["GlobalAveragePool"] == 1
    assert ops["Gemm"] == 1


def test_unet_structure() -> None:
    model = samples.unet()
    ops = _op_types(model)
    depth = 4
    for op in ("Concat", "ConvTranspose", "InstanceNormalization", "LeakyRelu", "MaxPool"):
        assert ops[op] > 0, op
    assert ops["Concat"] == depth
    assert ops["ConvTranspose"] == depth
    assert ops["MaxPool"] == depth
    assert ops["Conv"] == 2 * (2 * depth + 1) + 1
    assert ops["InstanceNormalization"] == ops["LeakyRelu"] == 2 * (2 * depth + 1)
    head = model.graph.node[-1]
    assert head.op_type == "Conv"
    kernel = next(a for a in head.attribute if a.name == "kernel_shape")
    assert list(kernel.ints) == [1, 1]


def test_unet_depth_and_image_checked() -> None:
    _check(samples.unet(depth=2, image=16, width=4))
    with pytest.raises(ValueError):
        samples.unet(image=20)


def test_mobilenet_structure() -> None:
    model = samples.mobilenet_v1()
    groups = [
        helper.get_attribute_value(a)
        for n in model.graph.node
        if n.op_type == "Conv"
        for a in n.attribute
        if a.name == "group"
    ]
    assert sum(g > 1 for g in groups) == 13
    ops = _op_types(model)
    assert ops["Conv"] == 1 + 13 * 2
    assert ops["BatchNormalization"] == ops["Relu"] == ops["Conv"]
    assert ops["GlobalAveragePool"] == ops["Flatten"] == ops["Gemm"] == 1


def test_transformer_structure() -> None:
    model = samples.transformer_block()
    assert model.opset_import[0].version == 20
    ops = _op_types(model)
    for op in ("Softmax", "LayerNormalization", "Gelu", "MatMul", "Reshape", "Transpose"):
        assert ops[op] > 0, op
    reshape_shapes = {n.input[1] for n in model.graph.node if n.op_type == "Reshape"}
    int_inits = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT64}
    assert reshape_shapes <= int_inits
    two = _op_types(samples.transformer_block(layers=2))
    assert two["Softmax"] == 2
    with pytest.raises(ValueError):
        samples.transformer_block(opset=17)


def test_old_style_structure() -> None:
    model = samples.old_style_model()
    assert model.ir_version == 3
    assert model.opset_import[0].version == 9
    input_names = {vi.name for vi in model.graph.input}
    assert model.graph.initializer
    assert all(t.name in input_names for t in model.graph.initializer)
    ops = _op_types(model)
    for op in ("ConstantOfShape", "Constant", "Shape", "Gather", "Unsqueeze", "Concat", "Reshape"):
        assert ops[op] > 0, op
    for op in ("Conv", "Relu", "Gemm"):
        assert ops[op] > 0, op
    # the ConstantOfShape output is used as a weight
    produced = next(n.output[0] for n in model.graph.node if n.op_type == "ConstantOfShape")
    assert any(produced in n.input for n in model.graph.node if n.op_type == "Conv")


def test_chain_is_a_path() -> None:
    model = samples.chain(n=5)
    nodes = model.graph.node
    assert len(nodes) == 6
    assert [n.op_type for n in nodes] == ["MatMul", "Relu", "Tanh", "Relu", "Tanh", "Relu"]
    for prev, node in pairwise(nodes):
        assert list(node.input) == [prev.output[0]]
    assert model.graph.output[0].name == nodes[-1].output[0]
    assert len(samples.chain().graph.node) == 9


def test_large_size() -> None:
    model = samples.large()
    assert 1800 <= len(model.graph.node) <= 2400
    _check(model)


def test_truncated_bytes_do_not_parse() -> None:
    data = samples.truncated_bytes()
    full = samples.chain().SerializeToString()
    assert full.startswith(data)
    assert len(full) // 2 <= len(data) < len(full)
    with pytest.raises(Exception):  # noqa: B017 - protobuf's DecodeError
        onnx.load_from_string(data)


def test_checker_failing_model() -> None:
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(samples.checker_failing_model())


def test_no_operator_model() -> None:
    model = samples.no_operator_model()
    onnx.checker.check_model(model)
    assert len(model.graph.node) == 0
    assert model.graph.input[0].name == model.graph.output[0].name


def test_symbolic_model() -> None:
    model = samples.symbolic_model()
    _check(model)
    assert _batch_dims(model)[0].dim_param == samples.BATCH_DIM
