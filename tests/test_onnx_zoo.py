"""Networks that others exported: the ONNX model zoo's classic CNNs as the ``onnx`` package
ships them (``onnx/backend/test/data/light``: AlexNet, DenseNet-121, Inception v1 and v2,
ResNet-50, ShuffleNet, SqueezeNet, VGG-19, ZFNet-512, converted from Caffe2 at opset 9, IR
version 3, weights made by ``ConstantOfShape``). Remat ingests each, its forward kernels
match onnxruntime operator by operator, and planned for training its plans run with the
predicted peak to the byte and the gradients of checkpoint-all.

Dropout-9's mask is of the data's type (bool only from Dropout-10), as onnxruntime and the
graph's bytes have it. onnxruntime fills an inference Dropout's mask with zeros where
ONNX's specification and reference evaluator give ones, so the comparison leaves out the
masks that nothing reads."""

from __future__ import annotations

import onnx
import pytest
import torch
from test_kernels import _assert_forward_matches

from agents.executor import execute
from agents.program import build_program, value_bytes
from agents.pytorch.check import CPU, plan_for_check
from remat import samples
from remat.onnx_ingest import forward_graph
from remat.problem import model_graph
from remat.solvers.model import SolveOptions
from remat.strategies import SearchConfig, SolverSettings

ZOO = samples.onnx_zoo()
NAMES = sorted(ZOO)
SETTINGS = SolverSettings(
    options=SolveOptions(time_limit_s=3.0, threads=1), search=SearchConfig(auto_exact_max_nodes=0)
)


def _zoo(name: str) -> onnx.ModelProto:
    if not NAMES:
        pytest.skip("this onnx package ships no zoo models")
    return onnx.load(ZOO[name])


def _without_unread_masks(model: onnx.ModelProto) -> onnx.ModelProto:
    read = {i for node in model.graph.node for i in node.input}
    read |= {o.name for o in model.graph.output}
    for node in model.graph.node:
        if node.op_type == "Dropout" and len(node.output) > 1 and node.output[1] not in read:
            del node.output[1]
    return model


def test_the_onnx_package_ships_the_zoo_models() -> None:
    assert len(NAMES) >= 9, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_forward_kernels_match_onnxruntime(name: str) -> None:
    _assert_forward_matches(_without_unread_masks(_zoo(name)))


def test_inference_dropouts_are_bypassed_and_the_model_still_matches() -> None:
    """The zoo's Dropouts are inference-mode (the identity): ingestion bypasses them
    (``remat.onnx_noops``) and the forward values still match onnxruntime's
    (``test_forward_kernels_match_onnxruntime``, on every zoo model)."""
    for name in ("bvlc_alexnet", "squeezenet", "vgg19"):
        model = _zoo(name)
        dropouts = sum(node.op_type == "Dropout" for node in model.graph.node)
        graph = forward_graph(model)
        assert dropouts and not any(n.op == "Dropout" for n in graph.nodes), name
        assert len(graph.nodes) < len(forward_graph(_with_dropout_masks_read(model)).nodes)


def _with_dropout_masks_read(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each Dropout's mask a model output, which keeps the Dropout."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        if node.op_type == "Dropout" and len(node.output) > 1 and node.output[1]:
            copy.graph.output.append(onnx.ValueInfoProto(name=node.output[1]))
    return copy


def test_dropout_9s_mask_has_the_datas_type() -> None:
    """SqueezeNet's Dropout before its last convolution, its mask read (a model output):
    a float mask, as its graph counts it."""
    model = _with_dropout_masks_read(_zoo("squeezenet"))
    program = build_program(model, forward_graph(model))
    dropouts = [n for n in program.graph.forward_nodes() if n.op == "Dropout"]
    assert dropouts
    values = program.forward_values()
    for node in dropouts:
        mask = values[node.id][1]
        assert mask.dtype == torch.float32 and bool((mask == 1).all()), node.name
        assert value_bytes(values[node.id]) == node.output_bytes, node.name


@pytest.mark.parametrize("name", ["squeezenet", "shufflenet"])
def test_training_plans_run_with_the_predicted_peak_and_gradients(name: str) -> None:
    """Checkpoint-all and a plan at 50% (SqueezeNet's checkpoint-all peak is at its
    Dropout, whose mask the executor held at a quarter of the graph's bytes before)."""
    model = _zoo(name)
    graph = model_graph(model)
    for budget in (None, "50%"):
        planned = plan_for_check(graph, budget, SETTINGS)
        plan = planned.result.plan
        assert plan is not None and planned.result.feasible, planned.result.message
        report = execute(model, graph, plan, [CPU])
        assert report.peak_bytes == report.predicted_peak_bytes, planned.budget
        assert report.gradients_match, (planned.budget, report.max_rel_error)
