"""In-place activations (``agents.in_place``): which compute steps of a plan write a ReLU's
or Clip's output into its input, and that the executor runs them so with the gradients
unchanged."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from agents.executor import execute
from agents.in_place import in_place_steps
from agents.program import build_program
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.graph import Graph, Mode
from remat.onnx_ingest import forward_graph
from remat.plan import Offload, Plan
from remat.strategies import Problem, run_strategy
from remat.training import for_mode

CPU0 = Device("cpu0", DeviceKind.CPU, {"threads": "1"})


def _model(activation: str, input_read_again: bool) -> onnx.ModelProto:
    """x -> Conv -> c -> activation -> a -> Conv -> out; with ``input_read_again``, out is
    the second Conv's output plus c, so c is read after the activation."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
        numpy_helper.from_array(np.array(0.5, np.float32), "hi"),
    ]
    act_inputs = ["c", "lo", "hi"] if activation == "Clip" else ["c"]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c"], "conv1", pads=[1, 1, 1, 1]),
        helper.make_node(activation, act_inputs, ["a"], "act"),
        helper.make_node("Conv", ["a", "w2"], ["d" if input_read_again else "out"], "conv2"),
    ]
    if input_read_again:
        nodes.append(helper.make_node("Add", ["d", "c"], ["out"], "add"))
    graph = helper.make_graph(
        nodes,
        "in_place",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 6])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4, 6, 6])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _planned(model: onnx.ModelProto) -> tuple[Graph, Plan]:
    graph = for_mode(forward_graph(model), Mode.TRAINING)
    problem = Problem(graph, analytical_costs(graph, [CPU0]), {"cpu0": None})
    result = run_strategy("checkpoint_all", problem, "cpu0")
    assert result.plan is not None
    return graph, result.plan


def _found(model: onnx.ModelProto, graph: Graph, plan: Plan, devices: list[str]) -> set[str]:
    """The names of the nodes whose steps run in place."""
    sources = build_program(model, graph).sources
    steps = in_place_steps(plan, graph, sources, {"cpu0": "cpu0"}, devices)
    return {graph.nodes[plan.steps[i].node].name for i in steps}  # type: ignore[union-attr]


def test_an_activation_runs_in_place_only_where_its_input_dies_with_it() -> None:
    """A ReLU or Clip of a Conv's output that nothing reads after it runs in place on a CPU
    device; not where the output is read again (a residual Add), not on a device not
    asked (a CUDA device, whose peak is the allocator's), not in a concurrent plan, and not
    where a transfer of the input was issued before it (the offload may be in flight)."""
    for activation in ("Relu", "Clip"):
        model = _model(activation, input_read_again=False)
        graph, plan = _planned(model)
        assert _found(model, graph, plan, ["cpu0"]) == {"act"}, activation
        assert _found(model, graph, plan, []) == set()
        assert _found(model, graph, replace(plan, concurrent=True), ["cpu0"]) == set()
        conv1 = graph.index("conv1")
        at = next(i for i, s in enumerate(plan.steps) if getattr(s, "node", None) == conv1)
        offloaded = (*plan.steps[: at + 1], Offload(0, conv1, "cpu0"), *plan.steps[at + 1 :])
        assert _found(model, graph, replace(plan, steps=offloaded), ["cpu0"]) == set()
        model = _model(activation, input_read_again=True)
        assert _found(model, *_planned(model), ["cpu0"]) == set(), activation


def test_an_in_place_activation_is_executed_so_and_the_gradients_match() -> None:
    """The executor runs the ReLU that may be in place as PyTorch's ``relu_``, and the one
    whose input is read again out of place, with the gradients the reference computes and
    the peak the simulator predicts either way."""
    for read_again in (False, True):
        model = _model("Relu", read_again)
        graph, plan = _planned(model)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as run:
            report = execute(model, graph, plan, [CPU0], warmup=0, repeats=1)
        # (the reference's run, under autograd, runs ``relu``)
        assert ("aten::relu_" in {e.key for e in run.key_averages()}) is not read_again
        assert report.gradients_match is True, report.max_rel_error
        assert report.peak_bytes == report.predicted_peak_bytes
