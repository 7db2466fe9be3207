"""Operators in training mode and the kernels and gradients of issue 32: BatchNormalization
with batch statistics (and its running-statistics outputs), Dropout with a seeded mask,
running statistics sharing an initializer with a scale, IsNaN/IsInf, Resize/Upsample, and
the closed-form gradients of Clip, HardSwish, Where, Expand and GatherElements. Forward
values against onnxruntime; gradients against autograd and against PyTorch's own module."""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch", reason="the agent extra (torch) is not installed")
pytest.importorskip("onnxruntime", reason="the agent extra (onnxruntime) is not installed")
import onnxruntime as ort
import torch
import torch.nn.functional as F
from test_kernels import Case, _assert_forward_matches, _onnxruntime_values, _single_op_model, _w

from agents import kernels
from agents.executor import execute
from agents.kernels import OpSpec, VjpCall
from agents.program import build_program
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.graph import Mode, NodeKind
from remat.onnx_ingest import forward_graph
from remat.plan import Compute
from remat.strategies import Problem, run_strategy
from remat.training import for_mode, training_graph

F32 = TensorProto.FLOAT
CPU0 = Device("cpu0", DeviceKind.CPU, {"threads": "1"})


def _plan(graph: Any, strategy: str) -> Any:
    problem = Problem(graph, analytical_costs(graph, [CPU0]), {"cpu0": None})
    result = run_strategy(strategy, problem, "cpu0")
    assert result.plan is not None, result.message
    return result.plan


# --- BatchNormalization in training mode ------------------------------------------------------

_BN_CONSTS = {"scale": _w(3), "bias": _w(3) + 0.1, "mean": _w(3), "var": np.abs(_w(3)) + 0.5}

TRAINING_CASES: dict[str, Case] = {
    "batch_norm_training_mode": Case(
        "BatchNormalization",
        {"x": (2, 3, 4, 4)},
        _BN_CONSTS,
        {"epsilon": 1e-3, "momentum": 0.8, "training_mode": 1},
        opset=15,
        outputs=3,
    ),
    "batch_norm_training_mode_1d": Case(
        "BatchNormalization",
        {"x": (5, 3)},
        _BN_CONSTS,
        {"training_mode": 1},
        opset=14,
        outputs=3,
    ),
    "batch_norm_opset9_statistics_outputs": Case(
        "BatchNormalization", {"x": (2, 3, 5)}, _BN_CONSTS, {"momentum": 0.7}, opset=9, outputs=5
    ),
    "is_nan": Case("IsNaN", {"x": (3, 4)}, opset=13),
    "is_inf_negative_only": Case("IsInf", {"x": (3, 4)}, attrs={"detect_positive": 0}, opset=10),
    "dropout_ratio_zero_training": Case(
        "Dropout",
        {"x": (3, 4)},
        {"ratio": np.array(0.0, np.float32), "training": np.array(True)},
        opset=13,
        outputs=2,
    ),
    "dropout_inference_mode_input": Case(
        "Dropout",
        {"x": (3, 4)},
        {"ratio": np.array(0.3, np.float32), "training": np.array(False)},
        opset=13,
        outputs=2,
    ),
}


def _f(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def _i(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _resize(
    shape: tuple[int, ...],
    scales: np.ndarray | None = None,
    sizes: np.ndarray | None = None,
    roi: np.ndarray | None = None,
    opset: int = 13,
    **attrs: Any,
) -> Case:
    consts: dict[str, np.ndarray] = {"roi": roi if roi is not None else _f()}
    order = ["x", "roi"]
    if scales is not None:
        consts["scales"] = scales
        order.append("scales")
    else:
        order.append("")
    if sizes is not None:
        consts["sizes"] = sizes
        order.append("sizes")
    return Case("Resize", {"x": shape}, consts, attrs, opset=opset, order=order)


RESIZE_CASES: dict[str, Case] = {
    "nearest_up_default": _resize((1, 2, 3, 4), _f(1, 1, 2, 2)),
    "nearest_up_asymmetric_floor": _resize(
        (1, 2, 3, 4),
        _f(1, 1, 2, 3),
        coordinate_transformation_mode="asymmetric",
        nearest_mode="floor",
    ),
    "nearest_down_round_prefer_ceil": _resize(
        (1, 2, 8, 6), _f(1, 1, 0.5, 0.7), nearest_mode="round_prefer_ceil"
    ),
    "nearest_sizes_align_corners_ceil": _resize(
        (1, 1, 4, 5),
        sizes=_i(1, 1, 7, 3),
        coordinate_transformation_mode="align_corners",
        nearest_mode="ceil",
    ),
    "linear_half_pixel_up": _resize((2, 3, 4, 5), _f(1, 1, 2, 2), mode="linear"),
    "linear_half_pixel_down": _resize((1, 2, 8, 8), _f(1, 1, 0.5, 0.75), mode="linear"),
    "linear_align_corners_sizes": _resize(
        (1, 2, 3, 4),
        sizes=_i(1, 2, 7, 9),
        mode="linear",
        coordinate_transformation_mode="align_corners",
    ),
    "linear_pytorch_half_pixel": _resize(
        (1, 2, 5, 4),
        sizes=_i(1, 2, 1, 9),
        mode="linear",
        coordinate_transformation_mode="pytorch_half_pixel",
    ),
    "linear_asymmetric_3d": _resize(
        (1, 1, 3, 4, 2),
        _f(1, 1, 2, 1.5, 2),
        mode="linear",
        coordinate_transformation_mode="asymmetric",
    ),
    "cubic_default": _resize((1, 2, 4, 4), _f(1, 1, 2, 1.5), mode="cubic"),
    "cubic_exclude_outside": _resize(
        (1, 1, 5, 5), _f(1, 1, 0.6, 1.7), mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1
    ),
    "tf_crop_and_resize": _resize(
        (1, 1, 6, 6),
        sizes=_i(1, 1, 4, 5),
        roi=_f(0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2),
        mode="linear",
        coordinate_transformation_mode="tf_crop_and_resize",
        extrapolation_value=-2.0,
    ),
    "axes_keep_aspect_not_larger": _resize(
        (1, 2, 6, 4),
        sizes=_i(3, 3),
        opset=18,
        axes=[2, 3],
        keep_aspect_ratio_policy="not_larger",
        mode="linear",
    ),
    "opset10_nearest": Case(
        "Resize", {"x": (1, 2, 3, 3)}, {"scales": _f(1, 1, 2, 2)}, {"mode": "nearest"}, opset=10
    ),
    "opset10_linear": Case(
        "Resize", {"x": (1, 2, 3, 3)}, {"scales": _f(1, 1, 2, 1.5)}, {"mode": "linear"}, opset=10
    ),
    "upsample_opset9": Case(
        "Upsample", {"x": (1, 2, 3, 3)}, {"scales": _f(1, 1, 2, 2)}, {"mode": "nearest"}, opset=9
    ),
}


@pytest.mark.parametrize("name", sorted(TRAINING_CASES))
def test_training_mode_operators_match_onnxruntime(name: str) -> None:
    _assert_forward_matches(_single_op_model(TRAINING_CASES[name]))


@pytest.mark.parametrize("name", sorted(RESIZE_CASES))
def test_resize_matches_onnxruntime(name: str) -> None:
    _assert_forward_matches(_single_op_model(RESIZE_CASES[name]))


def test_is_nan_sees_nans() -> None:
    spec = OpSpec("IsNaN", "n", inputs=("x",), outputs=("y",))
    x = torch.tensor([1.0, float("nan"), float("inf")])
    assert kernels.run_forward(spec, [x])[0].tolist() == [False, True, False]
    assert not kernels.differentiable(spec, 0)


# --- Dropout in training mode --------------------------------------------------------------------


def _dropout_spec(seed: int, ratio: float = 0.4, name: str = "drop") -> OpSpec:
    return OpSpec(
        "Dropout",
        name,
        opset=13,
        inputs=("x", "ratio", "training"),
        outputs=("y", "mask"),
        consts={1: np.array(ratio, np.float32), 2: np.array(True)},
        seed=seed,
    )


def test_dropout_mask_is_seeded_and_scaled() -> None:
    x = torch.randn(64, 64)
    spec = _dropout_spec(kernels.node_seed(0, "drop"))
    y, mask = kernels.run_forward(spec, [x, None, None])
    assert mask.dtype == torch.bool
    assert 0.35 < 1 - float(mask.float().mean()) < 0.45
    torch.testing.assert_close(y, torch.where(mask, x / 0.6, 0.0))
    again = kernels.run_forward(spec, [x.double(), None, None])
    assert torch.equal(again[1], mask)  # same mask in float64 and on every evaluation
    other = kernels.run_forward(_dropout_spec(kernels.node_seed(0, "drop2")), [x, None, None])
    assert not torch.equal(other[1], mask)  # each node draws its own
    reseeded = kernels.run_forward(_dropout_spec(kernels.node_seed(1, "drop")), [x, None, None])
    assert not torch.equal(reseeded[1], mask)


@pytest.mark.parametrize("with_mask", [True, False])
def test_dropout_gradient_uses_the_mask(with_mask: bool) -> None:
    """With or without the mask output, the gradient is autograd's through the same mask
    (a kept zero input still passes its gradient)."""
    spec = _dropout_spec(5)
    x = torch.relu(torch.randn(8, 9, dtype=torch.float64))
    args = [x, None, None]
    output = kernels.run_forward(spec, args)
    g = torch.randn(8, 9, dtype=torch.float64)
    call = VjpCall(spec, args, output if with_mask else output[:1], [g, None], [True, False, False])
    ours = kernels.vjp(call)[0]
    reference = kernels.autograd_vjp(VjpCall(spec, args, output, [g, None], [True, False, False]))[
        0
    ]
    assert ours is not None and reference is not None
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(ours, g * output[1] / 0.6)


def test_an_opset_11_dropout_is_the_identity() -> None:
    spec = OpSpec("Dropout", "d", opset=11, attrs={"ratio": 0.5}, inputs=("x",), outputs=("y",))
    x = torch.randn(3, 4)
    assert torch.equal(kernels.run_forward(spec, [x])[0], x)


# --- an exported CNN with BatchNorm and Dropout in training mode ---------------------------------


class _TrainNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.drop = torch.nn.Dropout(0.3)
        self.c2 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.relu(self.bn(self.c(x)))
        y = self.drop(y) if mask is None else y * mask / 0.7
        y = torch.relu(self.bn2(self.c2(y))) + y
        return self.fc(torch.flatten(y, 1))


def _export_training() -> tuple[_TrainNet, torch.Tensor, onnx.ModelProto]:
    torch.manual_seed(0)
    net = _TrainNet().train()
    x = torch.randn(2, 3, 4, 4)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(
                net,
                (x,),
                buffer,
                dynamo=False,
                opset_version=17,
                training=torch.onnx.TrainingMode.TRAINING,
                do_constant_folding=False,
            )
        except Exception as error:  # the exporter needs optional packages on some installs
            pytest.skip(f"torch.onnx.export is unavailable here: {error}")
    return net, x, onnx.load_from_string(buffer.getvalue())


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """``model`` with the tensors ``names`` among its outputs too (so they are read)."""
    extended = onnx.ModelProto()
    extended.CopyFrom(model)
    extended.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    return extended


def test_an_exported_training_model_matches_onnxruntime_up_to_the_mask() -> None:
    """Every tensor before the Dropout matches onnxruntime (batch statistics, updated
    running statistics, made model outputs: the export's are read by nothing); the Dropout
    output is its input through its own mask, scaled, on both sides (onnxruntime draws its
    own mask)."""
    _, x, exported = _export_training()
    ops = [n.op_type for n in exported.graph.node]
    assert "Dropout" in ops and ops.count("BatchNormalization") == 2
    first_bn = next(p for p in exported.graph.node if p.op_type == "BatchNormalization")
    model = _with_outputs(exported, list(first_bn.output[1:]))
    name = model.graph.input[0].name
    program = build_program(model, forward_graph(model), inputs={name: x.numpy()})
    ours = program.forward_values()
    theirs = _onnxruntime_values(model, program)
    by_output = {
        tensor: value
        for node in program.graph.forward_nodes()
        for tensor, value in zip(node.attrs["onnx_outputs"], ours[node.id], strict=True)
    }
    dropout = next(p for p in model.graph.node if p.op_type == "Dropout")
    for tensor in [*first_bn.output, dropout.input[0]]:
        np.testing.assert_allclose(by_output[tensor].numpy(), theirs[tensor], rtol=1e-5, atol=1e-5)
    x_in = by_output[dropout.input[0]]
    for values in (by_output, {k: torch.from_numpy(v) for k, v in theirs.items()}):
        y, mask = values[dropout.output[0]], values[dropout.output[1]]
        assert mask.dtype == torch.bool and 0 < float(mask.float().mean()) < 1
        torch.testing.assert_close(y, torch.where(mask, x_in / 0.7, 0.0))
    # The running statistics moved towards the batch's (onnxruntime agrees above).
    running = by_output[first_bn.output[1]]
    assert not torch.equal(running, program.fixed[first_bn.input[3]])


@pytest.mark.parametrize("strategy", ["checkpoint_all", "ap_sqrt"])
def test_an_exported_training_model_trains_like_pytorch(strategy: str) -> None:
    """A scheduled run (recomputing the Dropout and BatchNorms under ap_sqrt) gives the
    plain run's gradients, and those are PyTorch's own for the module in training mode with
    the same dropout mask."""
    net, x, model = _export_training()
    name = model.graph.input[0].name
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    plan = _plan(graph, strategy)
    computes = [s.node for s in plan.steps if isinstance(s, Compute)]
    assert (len(computes) > len(set(computes))) == (strategy == "ap_sqrt")
    report = execute(model, graph, plan, [CPU0], inputs={name: x.numpy()})
    assert report.gradients_match is True, report.max_rel_error
    assert report.peak_bytes == report.predicted_peak_bytes
    program = build_program(model, graph, inputs={name: x.numpy()})
    ours = program.reference_gradients()
    dropout = next(p for p in model.graph.node if p.op_type == "Dropout")
    node = next(n for n in graph.forward_nodes() if n.attrs["onnx_outputs"][0] == dropout.output[0])
    mask = program.forward_values()[node.id][1]
    loss = 0.5 * (net(x, mask.float()) ** 2).mean()
    loss.backward()
    theirs = {n: p.grad for n, p in net.named_parameters()}
    shared = sorted(set(ours) & set(theirs))
    assert {"bn.weight", "bn.bias", "bn2.weight", "c.weight", "fc.weight"} <= set(shared)
    assert name not in ours
    for tensor in shared:
        torch.testing.assert_close(ours[tensor], theirs[tensor], rtol=1e-4, atol=1e-6)


def test_running_statistics_nothing_reads_are_not_computed() -> None:
    """The export's running statistics are read by no node and are no model output: the
    kernel gives the running statistics it was given in their place (the same shapes and
    bytes), and the same output; where they are model outputs, it updates them."""
    _, x, exported = _export_training()
    name = exported.graph.input[0].name
    values, specs = [], []
    for model in (exported, _with_outputs(exported, _running_outputs(exported))):
        program = build_program(model, forward_graph(model), inputs={name: x.numpy()})
        bn = next(n for n in program.graph.forward_nodes() if n.op == "BatchNormalization")
        specs.append(program.specs[bn.id])
        values.append(program.forward_values()[bn.id])
        running = program.fixed[specs[-1].inputs[3]]
    assert specs[0].unread == {1, 2} and not specs[0].reads_output(1)
    assert specs[1].unread == frozenset() and specs[1].reads_output(1)
    (y, mean, _), (y_read, mean_read, _) = values
    torch.testing.assert_close(y, y_read)
    assert torch.equal(mean, running) and mean.untyped_storage().nbytes() == running.nbytes
    assert not torch.equal(mean_read, running)
    # Their backward gets no upstream gradient for them (zero): none is made at each step.
    graph = for_mode(forward_graph(exported), Mode.TRAINING)
    program = build_program(exported, graph, inputs={name: x.numpy()})
    bn = next(n for n in graph.nodes if n.forward is not None and n.op == "BatchNormalization")
    upstream = program._call(bn.id).upstream
    assert upstream[0] is not None and upstream[1:3] == (None, None)


def _running_outputs(model: onnx.ModelProto) -> list[str]:
    return [o for p in model.graph.node if p.op_type == "BatchNormalization" for o in p.output[1:]]


# --- running statistics sharing an initializer with a scale --------------------------------------


def _shared_initializer_model(training: bool) -> onnx.ModelProto:
    """x -> Conv -> BatchNormalization whose scale and running variance are one initializer
    of ones (as exporters deduplicate a fresh BatchNorm's weight and running_var)."""
    ones = numpy_helper.from_array(np.ones(3, np.float32), "ones")
    zeros = numpy_helper.from_array(np.zeros(3, np.float32), "zeros")
    weight = numpy_helper.from_array(_w(3, 2, 3, 3), "w")
    outputs = ["y", "rm", "rv"] if training else ["y"]
    attrs = {"training_mode": 1} if training else {}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["h"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization", ["h", "ones", "zeros", "zeros", "ones"], outputs, "bn", **attrs
        ),
        helper.make_node("Relu", ["y"], ["out"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "shared",
        [helper.make_tensor_value_info("x", F32, [2, 2, 5, 5])],
        [helper.make_tensor_value_info("out", F32, [2, 3, 5, 5])],
        initializer=[ones, zeros, weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


@pytest.mark.parametrize("training", [False, True])
def test_running_statistics_sharing_a_scale_are_not_differentiated(training: bool) -> None:
    model = _shared_initializer_model(training)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    program = build_program(model, graph)
    ours = program.reference_gradients()  # raised native_batch_norm's RuntimeError before
    assert {"ones", "zeros", "w"} <= set(ours) and "x" not in ours
    # PyTorch's own: the scale and bias trained, the statistics buffers.
    x = program.fixed["x"].clone()
    w = program.fixed["w"].clone().requires_grad_(True)
    scale = torch.ones(3, requires_grad=True)
    bias = torch.zeros(3, requires_grad=True)
    h = F.conv2d(x, w, padding=1)
    y = F.batch_norm(h, torch.zeros(3), torch.ones(3), scale, bias, training, 0.0, 1e-5)
    (0.5 * (torch.relu(y) ** 2).mean()).backward()
    for tensor, expected in (("w", w), ("ones", scale), ("zeros", bias)):
        torch.testing.assert_close(ours[tensor], expected.grad, rtol=1e-4, atol=1e-6)
    report = execute(model, graph, _plan(graph, "checkpoint_all"), [CPU0])
    assert report.gradients_match is True


def test_batch_norms_backward_reads_the_statistics_its_forward_saved_from_that_input() -> None:
    """A training BatchNormalization's backward takes the batch statistics its forward
    kernel saved, where it gets the very input tensor they were computed from; from any
    other tensor (recomputed, paged in) it takes them again, and gets the same gradients."""
    model = _shared_initializer_model(True)
    program = build_program(model, for_mode(forward_graph(model), Mode.TRAINING))
    bn = next(n for n in program.graph.forward_nodes() if n.op == "BatchNormalization")
    cpu = torch.device("cpu")
    values = {}
    for node in program.graph.forward_nodes():
        values[node.id] = program.compute(node.id, values, program.fixed, None, cpu)
    args = program._fetch(program._call(bn.id).args, values, program.fixed, cpu)
    saved = program._saved_for(bn.id, args)
    assert saved is not None and len(saved) == 2
    assert program._saved_for(bn.id, [args[0].clone(), *args[1:]]) is None
    spec, g = program.specs[bn.id], torch.randn_like(args[0])
    wanted = [True, True, True, False, False]
    with_saved = kernels.vjp(VjpCall(spec, args, None, [g], wanted, saved))
    again = kernels.vjp(VjpCall(spec, args, None, [g], wanted))
    for a, b in zip(with_saved[:3], again[:3], strict=True):
        torch.testing.assert_close(a, b)
    shifted = (saved[0] + 1.0, saved[1])
    moved = kernels.vjp(VjpCall(spec, args, None, [g], wanted, shifted))
    assert not torch.allclose(moved[0], with_saved[0])


def test_layer_norms_backward_reads_the_statistics_its_forward_saved() -> None:
    """LayerNormalization's kernel saves the mean and inverse standard deviation PyTorch's
    forward gives with the output; its backward from them equals its backward taking them
    again, and uses them (shifted statistics change it). A model that asks for the
    statistics gets them as outputs, with a gradient, and nothing is saved."""
    x, scale, bias = _double(2, 3, 8), _double(8, seed=1), _double(8, seed=2)
    spec = OpSpec(
        "LayerNormalization", "ln", opset=17, attrs={}, inputs=("x", "s", "b"), outputs=("y",)
    )
    output, saved = kernels.forward_and_saved(spec, [x, scale, bias])
    assert saved is not None and len(saved) == 2 and len(output) == 1
    g, wanted = torch.randn_like(output[0]), [True, True, True]
    with_saved = kernels.vjp(VjpCall(spec, [x, scale, bias], None, [g], wanted, saved))
    again = kernels.vjp(VjpCall(spec, [x, scale, bias], None, [g], wanted))
    for a, b in zip(with_saved, again, strict=True):
        torch.testing.assert_close(a, b)
    shifted = (saved[0] + 1.0, saved[1])
    moved = kernels.vjp(VjpCall(spec, [x, scale, bias], None, [g], wanted, shifted))
    assert not torch.allclose(moved[0], with_saved[0])
    asked = OpSpec(
        "LayerNormalization",
        "ln",
        opset=17,
        attrs={},
        inputs=("x", "s", "b"),
        outputs=("y", "mean", "inv_std"),
    )
    output, saved = kernels.forward_and_saved(asked, [x, scale, bias])
    assert saved is None and len(output) == 3


# --- closed-form gradients ----------------------------------------------------------------------


def _call(
    op: str,
    args: list[torch.Tensor],
    opset: int = 17,
    consts: dict[int, np.ndarray] | None = None,
    **attrs: Any,
) -> VjpCall:
    spec = OpSpec(
        op,
        "n",
        opset=opset,
        attrs=attrs,
        inputs=tuple(f"in{i}" for i in range(len(args))),
        outputs=("out",),
        consts=consts or {},
    )
    output = kernels.run_forward(spec, args)
    g = torch.randn(
        output[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    wanted = [a.is_floating_point() and kernels.differentiable(spec, i) for i, a in enumerate(args)]
    return VjpCall(spec, args, output, [g], wanted)


def _double(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


CLOSED_FORMS: dict[str, Any] = {
    "clip": lambda: _call(
        "Clip", [_double(4, 5), torch.tensor(-0.3, dtype=torch.float64), torch.tensor(0.4)]
    ),
    "clip_opset6": lambda: _call("Clip", [_double(4, 5)], opset=6, min=-0.5),
    "clip_unbounded": lambda: _call("Clip", [_double(4, 5)]),
    # inputs at the bounds themselves get the gradient, as autograd's clamp gives it
    "clip_at_its_bounds": lambda: _call(
        "Clip",
        [torch.tensor([-0.5, 0.5, 0.0, -0.6, 0.7], dtype=torch.float64)],
        opset=6,
        min=-0.5,
        max=0.5,
    ),
    "hard_swish": lambda: _call(
        "HardSwish", [torch.cat([_double(20) * 4, torch.tensor([-3.0, 3.0], dtype=torch.float64)])]
    ),
    "where": lambda: _call("Where", [_double(3, 4) > 0, _double(3, 4, seed=1), _double(4, seed=2)]),
    "expand": lambda: _call("Expand", [_double(3, 1), torch.tensor([2, 3, 4])]),
    "gather_elements": lambda: _call(
        "GatherElements",
        [_double(3, 4), torch.tensor([[0, -1, 2, 0], [1, 1, 0, 3]])],
        axis=1,
    ),
    # a scalar index (a transformer's q, k, v picked from one projection), repeated and
    # negative indices (added twice), and a matrix of indices on an inner axis
    "gather_scalar": lambda: _call("Gather", [_double(3, 2, 4), torch.tensor(1)], axis=0),
    # the same as a constant (a slice of the data), and a negative one on an inner axis
    "gather_constant": lambda: _call(
        "Gather", [_double(3, 2, 4), torch.tensor(1)], consts={1: np.array(1)}, axis=0
    ),
    "gather_constant_negative": lambda: _call(
        "Gather", [_double(3, 2, 4), torch.tensor(-1)], consts={1: np.array(-1)}, axis=2
    ),
    "gather_repeated": lambda: _call(
        "Gather", [_double(2, 5, 3), torch.tensor([[0, -1], [4, 0]])], axis=1
    ),
}


@pytest.mark.parametrize("name", sorted(CLOSED_FORMS))
def test_new_closed_form_gradients_match_autograd(name: str) -> None:
    call = CLOSED_FORMS[name]()
    assert call.spec.op_type in kernels.VJP_RULES
    ours, reference = kernels.vjp(call), kernels.autograd_vjp(call)
    assert any(w for w in call.wanted)
    for position, (a, b) in enumerate(zip(ours, reference, strict=True)):
        if not call.wanted[position]:
            assert a is None, position
            continue
        assert a is not None and b is not None, position
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_clips_gradient_is_pytorchs_hardtanhs_from_its_output(dtype: torch.dtype) -> None:
    """Clip differentiates as PyTorch's ``hardtanh`` (ReLU6, which exporters write as a
    Clip): from its output alone (the input is a placeholder: the training graph frees it
    once the output is computed), through where the output is strictly inside the bounds,
    so the values at a bound get none; with one bound omitted, the other's alone."""
    cpu = torch.device("cpu")
    x = torch.tensor([0.0, 6.0, -1e-30, 6.0000005, 3.0, 0.1, -7.0], dtype=dtype)
    g = torch.arange(1.0, 8.0, dtype=dtype)
    for low, high in ((0.0, 6.0), (0.1, 6.0), (None, 6.0), (0.0, None)):
        attrs = {k: v for k, v in (("min", low), ("max", high)) if v is not None}
        spec = OpSpec("Clip", "n", opset=6, attrs=attrs, outputs=("y",))
        [y] = kernels.run_forward(spec, [x])
        hollow = kernels.placeholder(tuple(x.shape), dtype, cpu)
        found = kernels.vjp(VjpCall(spec, [hollow], (y,), [g], [True]))[0]
        # autograd's hardtanh in float64 with the bounds as the type holds them (0.1 in
        # bfloat16 is above 0.1): an input at a bound is one its output cannot tell from
        # one clipped there, and gets no gradient
        leaf = x.to(torch.float64, copy=True).requires_grad_(True)
        lo = -math.inf if low is None else torch.tensor(low, dtype=dtype).item()
        hi = math.inf if high is None else torch.tensor(high, dtype=dtype).item()
        F.hardtanh(leaf, lo, hi).backward(g.double())
        assert found is not None and torch.equal(found.double(), leaf.grad), (low, high)
        assert torch.equal(y, x.clamp(low, high))
    assert found[0] == 0.0 and found[1] == 2.0 and found[3] == 4.0  # at 0 and beyond 6


def _scalar(name: str, value: float) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, np.float32), name)


def test_clips_input_is_not_kept_for_its_gradient() -> None:
    """A Clip's backward node reads its output and bounds, not its input: the training
    graph frees the input once the Clip has run (eager PyTorch's in-place ReLU6)."""
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Relu", ["x"], ["r"], "relu"),
                helper.make_node("Clip", ["r", "lo", "hi"], ["y"], "clip"),
            ],
            "clip",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
            [_scalar("lo", 0.0), _scalar("hi", 6.0)],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    graph = training_graph(forward_graph(model))
    clip = next(n for n in graph.nodes if n.op == "Clip" and n.kind is NodeKind.FORWARD)
    backward = next(n for n in graph.nodes if n.forward == clip.id)
    assert clip.id in backward.deps and clip.deps[0] not in backward.deps


def test_where_expand_gather_elements_gradients_work_from_placeholders() -> None:
    """What the training graph does not give their backward nodes (the branches of a Where,
    the data of Expand, Gather and GatherElements) is a shape to their gradients."""
    cpu = torch.device("cpu")
    for name, shaped in (
        ("where", [1, 2]),
        ("expand", [0]),
        ("gather_elements", [0]),
        ("gather_scalar", [0]),
        ("gather_constant", [0]),
        ("gather_constant_negative", [0]),
        ("gather_repeated", [0]),
    ):
        call = CLOSED_FORMS[name]()
        args = [
            kernels.placeholder(a.shape, a.dtype, cpu) if i in shaped else a
            for i, a in enumerate(call.args)
        ]
        fake = VjpCall(call.spec, args, None, call.grads, call.wanted)
        for a, b in zip(kernels.vjp(fake), kernels.vjp(call), strict=True):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                torch.testing.assert_close(a, b)


def test_resize_gradient_is_pytorchs_and_needs_only_shapes() -> None:
    x = _double(1, 2, 3, 4)
    spec = OpSpec(
        "Resize",
        "r",
        opset=13,
        attrs={"mode": "linear"},
        inputs=("x", "", "scales"),
        outputs=("y",),
        consts={2: _f(1, 1, 2, 2)},
    )
    y = kernels.run_forward(spec, [x, None, None])[0]
    leaf = x.clone().requires_grad_(True)
    expected = F.interpolate(leaf, scale_factor=2, mode="bilinear", align_corners=False)
    torch.testing.assert_close(y, expected.detach())
    g = _double(*y.shape, seed=3)
    (expected * g).sum().backward()
    fake = kernels.placeholder(x.shape, x.dtype, torch.device("cpu"))
    grad = kernels.vjp(VjpCall(spec, [fake, None, None], None, [g], [True, False, False]))[0]
    assert grad is not None
    torch.testing.assert_close(grad, leaf.grad)


# --- a model of the new operators, scheduled -----------------------------------------------------


def _new_ops_model() -> onnx.ModelProto:
    """Resize, Clip, HardSwish, Where (condition from Equal and IsNaN of activations),
    Expand (of a parameter plus an activation) and GatherElements on a path to the loss;
    the model input is scaled by a parameter first, so that a gradient flows back through
    all of them."""
    inits = [
        numpy_helper.from_array(_f(1.5, -0.7).reshape(1, 2, 1, 1), "s"),
        numpy_helper.from_array(np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 2, 1, 8), "b"),
        numpy_helper.from_array(_f(1, 1, 2, 2), "scales"),
        numpy_helper.from_array(_f(), "roi"),
        numpy_helper.from_array(np.array(-0.5, np.float32), "lo"),
        numpy_helper.from_array(np.array(0.8, np.float32), "hi"),
        numpy_helper.from_array(_i(2, 2, 8, 8), "shape"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(
            np.random.default_rng(0).integers(0, 8, (2, 2, 8, 3)).astype(np.int64), "idx"
        ),
    ]
    nodes = [
        helper.make_node("Mul", ["x", "s"], ["xs"], "scale"),
        helper.make_node("Resize", ["xs", "roi", "scales"], ["up"], "up", mode="linear"),
        helper.make_node("Clip", ["up", "lo", "hi"], ["clip"], "clip"),
        helper.make_node("HardSwish", ["up"], ["hs"], "hs"),
        helper.make_node("ReduceMean", ["x"], ["mean"], "mean", axes=[2, 3], keepdims=1),
        helper.make_node("Add", ["b", "mean"], ["row"], "row"),
        helper.make_node("Expand", ["row", "shape"], ["wide"], "wide"),
        helper.make_node("Add", ["hs", "wide"], ["sum"], "sum"),
        helper.make_node("Round", ["clip"], ["rounded"], "round"),
        helper.make_node("Equal", ["rounded", "zero"], ["eq"], "eq"),
        helper.make_node("IsNaN", ["sum"], ["nan"], "nan"),
        helper.make_node("Or", ["eq", "nan"], ["cond"], "cond"),
        helper.make_node("Where", ["cond", "sum", "clip"], ["picked"], "where"),
        helper.make_node("GatherElements", ["picked", "idx"], ["out"], "gather", axis=3),
    ]
    graph = helper.make_graph(
        nodes,
        "new_ops",
        [helper.make_tensor_value_info("x", F32, [2, 2, 4, 4])],
        [helper.make_tensor_value_info("out", F32, [2, 2, 8, 3])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_model_of_the_new_operators_matches_onnxruntime_and_trains() -> None:
    model = _new_ops_model()
    _assert_forward_matches(model)
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    for strategy in ("checkpoint_all", "ap_sqrt"):
        plan = _plan(graph, strategy)
        report = execute(model, graph, plan, [CPU0])
        assert report.gradients_match is True, (strategy, report.max_rel_error)
        assert report.peak_bytes == report.predicted_peak_bytes
    program = build_program(model, graph)
    gradients = program.reference_gradients()
    assert float(gradients["s"].abs().max()) > 0 and float(gradients["b"].abs().max()) > 0


def test_onnxruntime_is_available() -> None:
    assert "CPUExecutionProvider" in ort.get_available_providers()


# --- recurrent layers ---------------------------------------------------------------------------


def _recurrent(
    op: str,
    hidden: int = 3,
    directions: int = 1,
    seq: int = 4,
    batch: int = 2,
    size: int = 5,
    lens: np.ndarray | None = None,
    initial: bool = False,
    peepholes: bool = False,
    layout: int = 0,
    **attrs: Any,
) -> Case:
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    consts: dict[str, np.ndarray] = {
        "W": _w(directions, gates * hidden, size),
        "R": _w(directions, gates * hidden, hidden) * 0.8,
        "B": _w(directions, 2 * gates * hidden),
    }
    order = ["x", "W", "R", "B"]
    if lens is not None:
        consts["lens"] = lens.astype(np.int32)
    order.append("lens" if lens is not None else "")
    state = (batch, directions, hidden) if layout else (directions, batch, hidden)
    if initial:
        consts["h0"] = _w(*state)
        order.append("h0")
        if op == "LSTM":
            consts["c0"] = _w(*state) + 0.3
            order.append("c0")
    elif op == "LSTM" and peepholes:
        order += ["", ""]
    if peepholes:
        consts["P"] = _w(directions, 3 * hidden)
        order.append("P")
    while order[-1] == "":
        order.pop()
    direction = {1: "forward", 2: "bidirectional"}[directions]
    x_shape = (batch, seq, size) if layout else (seq, batch, size)
    return Case(
        op,
        {"x": x_shape},
        consts,
        {"hidden_size": hidden, "direction": attrs.pop("direction", direction), **attrs},
        opset=14,
        outputs=3 if op == "LSTM" else 2,
        order=order,
    )


RECURRENT_CASES: dict[str, Case] = {
    "rnn": _recurrent("RNN"),
    "rnn_reverse_relu": _recurrent("RNN", direction="reverse", activations=["Relu"]),
    "gru": _recurrent("GRU"),
    "gru_bidirectional_linear_before_reset": _recurrent(
        "GRU", directions=2, linear_before_reset=1, initial=True
    ),
    "gru_sequence_lens": _recurrent("GRU", lens=np.array([4, 2]), directions=2),
    "lstm": _recurrent("LSTM"),
    "lstm_bidirectional_initial_peepholes": _recurrent(
        "LSTM", directions=2, initial=True, peepholes=True
    ),
    "lstm_clip": _recurrent("LSTM", clip=0.7, initial=True),
    "lstm_sequence_lens_reverse": _recurrent("LSTM", lens=np.array([3, 1]), direction="reverse"),
    "lstm_input_forget_hard_sigmoid": _recurrent(
        "LSTM",
        input_forget=1,
        activations=["HardSigmoid", "Tanh", "Tanh"],
        activation_alpha=[0.3],
        activation_beta=[0.4],
    ),
}


@pytest.mark.parametrize("name", sorted(RECURRENT_CASES))
def test_recurrent_layers_match_onnxruntime(name: str) -> None:
    _assert_forward_matches(_single_op_model(RECURRENT_CASES[name]))


def _recurrent_call(case: Case) -> tuple[OpSpec, list[torch.Tensor | None]]:
    """``case``'s operator and its arguments in input order, a random input ``x``."""
    order = list(case.order or ())
    shapes = {name: torch.randn(shape) for name, shape in case.inputs.items()}
    values = {**shapes, **{k: torch.from_numpy(v) for k, v in case.consts.items()}}
    args = [values[n] if n else None for n in order]
    outputs = ("y", "h", "c")[: case.outputs]
    spec = OpSpec(case.op, "op", opset=14, attrs=case.attrs, inputs=tuple(order), outputs=outputs)
    return spec, args


@pytest.mark.parametrize(
    ("name", "fused"),
    [
        ("rnn", "aten::rnn_tanh"),
        ("rnn_reverse_relu", None),  # reverse alone: PyTorch has no such layer
        ("gru", None),  # the reset before the linear map: not PyTorch's GRU
        ("gru_bidirectional_linear_before_reset", "aten::gru"),
        ("lstm", "aten::lstm"),
        ("lstm_bidirectional_initial_peepholes", None),
        ("lstm_clip", None),
    ],
)
def test_recurrent_layers_pytorch_has_run_its_fused_kernel(name: str, fused: str | None) -> None:
    """A recurrent operator that is one of PyTorch's layers runs PyTorch's fused layer, as
    eager ``nn.LSTM`` does, not a loop over time steps; the others loop (both match
    onnxruntime: ``test_recurrent_layers_match_onnxruntime``)."""
    spec, args = _recurrent_call(RECURRENT_CASES[name])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        kernels.run_forward(spec, args)
    ops = {e.key for e in profiled.key_averages()}
    layers = {"aten::lstm", "aten::gru", "aten::rnn_tanh", "aten::rnn_relu"}
    assert ops & layers == ({fused} if fused else set())


@pytest.mark.parametrize("name", ["gru_bidirectional_linear_before_reset", "lstm"])
def test_recurrent_layers_gates_are_reordered_without_an_advanced_index(name: str) -> None:
    """PyTorch's fused layer gets ONNX's gate blocks in its order by ``index_select``, in
    the forward and its gradient, not by indexing with a list (``aten::index``, whose
    gradient is an accumulating ``aten::index_put_``, several times slower); the gradient
    still matches the time-step loop's."""
    spec, args = _recurrent_call(RECURRENT_CASES[name])
    looped = replace(spec, attrs={**spec.attrs, "clip": 1e9})  # no PyTorch layer: the loop
    grads = [torch.randn_like(t) for t in kernels.run_forward(spec, args)]
    wanted = [a is not None and a.is_floating_point() for a in args]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        found = kernels.autograd_vjp(VjpCall(spec, args, None, grads, wanted))
    ops = {e.key for e in profiled.key_averages()}
    assert "aten::index_select" in ops
    assert not ops & {"aten::index", "aten::index_put_", "aten::_index_put_impl_"}
    expected = kernels.autograd_vjp(VjpCall(looped, args, None, grads, wanted))
    for a, b in zip(found, expected, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_recurrent_layout_1_is_layout_0_transposed(op: str) -> None:
    """onnxruntime's CPU kernels ignore ``layout``: batch-first is checked against the
    sequence-first layout on transposed tensors."""
    case = _recurrent(op, initial=True, directions=2)
    order = list(case.order or ())
    x = torch.from_numpy(np.random.default_rng(4).normal(size=(4, 2, 5)).astype(np.float32))
    values = {"x": x, **{k: torch.from_numpy(v) for k, v in case.consts.items()}}
    args = [values[name] if name else None for name in order]
    outputs = ("y", "h", "c")
    first = kernels.run_forward(
        OpSpec(op, "op", opset=14, attrs=case.attrs, inputs=tuple(order), outputs=outputs), args
    )
    transposed = [
        a.transpose(0, 1) if a is not None and name in ("x", "h0", "c0") else a
        for a, name in zip(args, order, strict=True)
    ]
    attrs = {**case.attrs, "layout": 1}
    spec = OpSpec(op, "op", opset=14, attrs=attrs, inputs=tuple(order), outputs=outputs)
    y, *states = kernels.run_forward(spec, transposed)
    torch.testing.assert_close(y.permute(1, 2, 0, 3), first[0])
    for a, b in zip(states, first[1:], strict=True):
        torch.testing.assert_close(a.transpose(0, 1), b)


class _Recurrent(torch.nn.Module):
    """An LSTM and a GRU after a trained scale of the input, whose gradient flows back
    through both (the exporter repacks their own weights under other names)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.lstm = torch.nn.LSTM(4, 5, batch_first=True, bidirectional=True)
        self.gru = torch.nn.GRU(10, 3, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x * self.scale)
        z, h = self.gru(y)
        return z.sum(1) + h[0]


def test_exported_lstm_and_gru_train_like_pytorch() -> None:
    torch.manual_seed(0)
    net = _Recurrent()
    x = torch.randn(2, 6, 4)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(net, (x,), buffer, dynamo=False, opset_version=14)
        except Exception as error:  # the exporter needs optional packages on some installs
            pytest.skip(f"torch.onnx.export is unavailable here: {error}")
    model = onnx.load_from_string(buffer.getvalue())
    assert {"LSTM", "GRU"} <= {n.op_type for n in model.graph.node}
    name = model.graph.input[0].name
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    report = execute(model, graph, _plan(graph, "ap_sqrt"), [CPU0], inputs={name: x.numpy()})
    assert report.gradients_match is True, report.max_rel_error
    ours = build_program(model, graph, inputs={name: x.numpy()}).reference_gradients()
    (0.5 * (net(x) ** 2).mean()).backward()
    assert net.scale.grad is not None and name not in ours
    torch.testing.assert_close(ours["scale"], net.scale.grad, rtol=1e-4, atol=1e-6)


# --- random draws (stochastic depth) -------------------------------------------------------------


def _stochastic_depth_model() -> onnx.ModelProto:
    """y = x W, kept where a RandomUniformLike draw of y's shape is under 0.8 (torchvision's
    StochasticDepth in EfficientNet exports draws its noise like this)."""
    w = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"], "mm"),
        helper.make_node("RandomUniformLike", ["y"], ["noise"], "noise"),
        helper.make_node("Less", ["noise", "survive"], ["keep"], "keep"),
        helper.make_node("Cast", ["keep"], ["keepf"], "keepf", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["y", "keepf"], ["out"], "drop"),
    ]
    graph = helper.make_graph(
        nodes,
        "stochastic_depth",
        [helper.make_tensor_value_info("x", F32, [4, 8])],
        [helper.make_tensor_value_info("out", F32, [4, 16])],
        initializer=[
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(np.array(0.8, np.float32), "survive"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_random_draws_are_seeded_per_node_and_plans_train_through_them() -> None:
    model = _stochastic_depth_model()
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    spec = OpSpec("RandomUniformLike", "noise", inputs=("y",), outputs=("noise",), seed=7)
    like = torch.zeros(4, 16)
    [first] = kernels.KERNELS["RandomUniformLike"](spec, (like,))
    [again] = kernels.KERNELS["RandomUniformLike"](spec, (like,))
    assert torch.equal(first, again) and 0.0 <= float(first.min()) < float(first.max()) < 1.0
    for strategy in ("checkpoint_all", "ap_sqrt"):
        report = execute(model, graph, _plan(graph, strategy), [CPU0])
        assert report.gradients_match is True, (strategy, report.max_rel_error)
    gradients = build_program(model, graph).reference_gradients()
    assert float(gradients["w"].abs().max()) > 0  # the kept elements still train W
