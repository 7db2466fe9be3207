import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from remat.errors import InvalidInputError
from remat.graph import FixedKind, Graph, Mode, NodeKind
from remat.loss import Loss, LossKind, labels_name
from remat.onnx_ingest import forward_graph
from remat.training import for_mode, gradient_needs, training_graph

from graphs import chain, diamond, forward, split_and_dropout


def test_layout_forward_then_loss_then_backward_in_reverse():
    g = training_graph(chain(4))
    kinds = [n.kind for n in g.nodes]
    assert kinds == [NodeKind.FORWARD] * 4 + [NodeKind.LOSS] + [NodeKind.BACKWARD] * 4
    assert [n.forward for n in g.nodes[5:]] == [3, 2, 1, 0]
    assert g.mode is Mode.TRAINING
    assert [n.name for n in g.nodes[4:]] == ["loss", "n3:grad", "n2:grad", "n1:grad", "n0:grad"]


def test_relu_backward_reads_its_output_and_upstream_gradient():
    g = training_graph(chain(3))  # ops are Relu
    # n1:grad (index 5) reads n1 (its output) and n2:grad (index 4)
    assert g.nodes[5].name == "n1:grad"
    assert g.nodes[5].deps == (1, 4)
    # the last forward node's gradient reads the loss
    assert g.nodes[4].deps == (2, 3)


def test_conv_backward_reads_inputs_not_output():
    g = training_graph(forward([(), (0,), (1,)], op="Conv"))
    grad_n1 = next(n for n in g.nodes if n.name == "n1:grad")
    assert 0 in grad_n1.deps and 1 not in grad_n1.deps
    assert grad_n1.flops == 2 * g.nodes[1].flops


def test_add_backward_reads_neither_input_nor_output():
    g = training_graph(forward([(), (0,), (0,), (1, 2)], op="Add"))
    grad_join = next(n for n in g.nodes if n.name == "n3:grad")
    assert grad_join.deps == (4,)  # only the loss


def test_branch_gradient_sums_upstream_gradients():
    g = training_graph(diamond())
    grad0 = next(n for n in g.nodes if n.name == "n0:grad")
    grad1 = g.index("n1:grad")
    grad2 = g.index("n2:grad")
    assert {grad1, grad2} <= set(grad0.deps)
    assert g.nodes[grad1].output_bytes == 1000  # gradient w.r.t. n0


def test_nodes_off_the_loss_path_get_no_backward():
    base = forward([(), (0,), (0,)])  # two outputs: both feed the loss
    g = training_graph(base)
    assert sum(n.kind is NodeKind.BACKWARD for n in g.nodes) == 3


def test_name_collision_with_loss_is_resolved():
    base = chain(2)
    renamed = base.nodes[1].__class__(**{**base.nodes[1].__dict__, "name": "loss"})
    g = training_graph(base.__class__(base.mode, (base.nodes[0], renamed), base.fixed, (1,)))
    assert g.nodes[2].name == "loss_1"
    assert len({n.name for n in g.nodes}) == len(g)


def test_inference_mode_is_the_forward_graph():
    base = chain(3)
    assert for_mode(base, Mode.INFERENCE) is base
    try:
        training_graph(training_graph(base))
    except InvalidInputError:
        pass
    else:
        raise AssertionError("a training graph must not be differentiated again")


# --- gradient needs of single operators (ONNX models) ------------------------------------------


def _onnx_training_graph() -> Graph:
    """x -> Relu(a), Neg(b); Equal(a, b) -> cond; Where(cond, a, b) -> w; Clip(w) -> c;
    HardSwish(c) -> h; Expand(h) -> e; GatherElements(e, indices kk) -> out, the indices an
    activation (Expand of a Cast of a)."""
    f32 = TensorProto.FLOAT
    inits = [
        numpy_helper.from_array(np.array(-0.5, np.float32), "lo"),
        numpy_helper.from_array(np.array(0.5, np.float32), "hi"),
        numpy_helper.from_array(np.array([2, 3, 4], np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], "a"),
        helper.make_node("Neg", ["x"], ["b"], "b"),
        helper.make_node("Equal", ["a", "b"], ["cond"], "cond"),
        helper.make_node("Where", ["cond", "a", "b"], ["w"], "where"),
        helper.make_node("Clip", ["w", "lo", "hi"], ["c"], "clip"),
        helper.make_node("HardSwish", ["c"], ["h"], "hs"),
        helper.make_node("Expand", ["h", "shape"], ["e"], "expand"),
        helper.make_node("Cast", ["a"], ["k"], "k", to=TensorProto.INT64),
        helper.make_node("Expand", ["k", "shape"], ["kk"], "kk"),
        helper.make_node("GatherElements", ["e", "kk"], ["out"], "gather", axis=0),
    ]
    graph = helper.make_graph(
        nodes,
        "needs",
        [helper.make_tensor_value_info("x", f32, [3, 4])],
        [helper.make_tensor_value_info("out", f32, [2, 3, 4])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return training_graph(forward_graph(model))


def test_selected_operators_read_only_what_their_gradient_needs():
    g = _onnx_training_graph()

    def deps_of(name: str) -> set[str]:
        node = g.nodes[g.index(f"{name}:grad")]
        return {g.nodes[d].name for d in node.deps if g.nodes[d].kind is NodeKind.FORWARD}

    assert deps_of("where") == {"cond"}  # the condition, not the branches
    assert deps_of("gather") == {"kk"}  # the indices, not the data
    assert deps_of("clip") == {"clip"}  # its output (the bounds are constants)
    assert deps_of("hs") == {"clip"}
    assert deps_of("expand") == set()  # a sum to the input's shape
    # Equal's output is a boolean: no gradient reaches Equal, which gets no backward node
    assert "cond:grad" not in {n.name for n in g.nodes}


def test_some_inputs_without_onnx_names_read_every_input():
    base = forward([(), (0,), (0, 1)], op="Where")
    assert gradient_needs(base.nodes[2]) == ((0, 1), False)


def _scaled_model(scale_is_parameter: bool) -> onnx.ModelProto:
    """y = (x @ W) * s / d: ``s`` a parameter (initializer) or a scalar Constant, ``d`` a
    scalar Constant; logits (4, 5) and a scalar output."""
    f32 = TensorProto.FLOAT
    inits = [numpy_helper.from_array(np.ones((3, 5), np.float32), "W")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], "mm")]
    if scale_is_parameter:
        inits.append(numpy_helper.from_array(np.full((5,), 2.0, np.float32), "s"))
    else:
        nodes.append(helper.make_node("Constant", [], ["s"], value_float=2.0))
    nodes += [
        helper.make_node("Constant", [], ["d"], value_float=4.0),
        helper.make_node("Mul", ["h", "s"], ["m"], "mul"),
        helper.make_node("Div", ["m", "d"], ["logits"], "div"),
        helper.make_node("ReduceSum", ["logits"], ["total"], "sum", keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "scaled",
        [helper.make_tensor_value_info("x", f32, [4, 3])],
        [
            helper.make_tensor_value_info("logits", f32, [4, 5]),
            helper.make_tensor_value_info("total", f32, []),
        ],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_mul_by_a_parameter_reads_the_activation_and_by_a_constant_does_not():
    for parameter in (True, False):
        g = training_graph(forward_graph(_scaled_model(parameter)))
        mul = g.nodes[g.index("mul:grad")]
        reads = {g.nodes[d].name for d in mul.deps if g.nodes[d].kind is NodeKind.FORWARD}
        assert reads == ({"mm"} if parameter else set())
        assert g.fixed["s"].kind is (FixedKind.PARAMETER if parameter else FixedKind.CONSTANT)
        assert g.fixed["s"].has_gradient is parameter
        div = g.nodes[g.index("div:grad")]  # by a constant: reads nothing
        assert not any(g.nodes[d].kind is NodeKind.FORWARD for d in div.deps)


def test_a_loss_reads_only_its_output_and_holds_its_labels():
    forward = forward_graph(_scaled_model(True))
    default = training_graph(forward)
    assert len(default.nodes[default.index("loss")].deps) == 2  # both outputs
    ce = training_graph(forward, Loss(LossKind.CROSS_ENTROPY, "logits"))
    loss = ce.nodes[ce.index("loss")]
    assert [ce.nodes[d].name for d in loss.deps] == ["div"]
    assert loss.fixed == (labels_name("logits"),)
    assert ce.fixed[labels_name("logits")].nbytes == 4 * 8  # int64 per row of (4, 5)
    assert ce.fixed[labels_name("logits")].kind is FixedKind.CONSTANT
    assert "sum:grad" not in {n.name for n in ce.nodes}  # not on the path to the loss
    own = training_graph(forward, Loss(LossKind.OUTPUT, "total"))
    assert [own.nodes[d].name for d in own.nodes[own.index("loss")].deps] == ["sum"]


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        (Loss(LossKind.CROSS_ENTROPY), "must name the output it reads: the model has 2"),
        (Loss(LossKind.CROSS_ENTROPY, "nope"), "does not have; its outputs: 'logits', 'total'"),
        (Loss(LossKind.CROSS_ENTROPY, "logits", axis=2), "class axis 2 is out of range"),
        (Loss(LossKind.OUTPUT, "logits"), "not a scalar: shape (4, 5)"),
    ],
)
def test_a_loss_that_does_not_fit_the_model_is_refused(loss: Loss, message: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        training_graph(forward_graph(_scaled_model(True)), loss)


def _pooled_model(indices: bool) -> onnx.ModelProto:
    """x (1, 2, 6, 6) -> Relu -> MaxPool 2x2 (with its Indices output or not) -> Conv."""
    f32 = TensorProto.FLOAT
    pool_out = ["p", "idx"] if indices else ["p"]
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], "relu"),
            helper.make_node(
                "MaxPool", ["r"], pool_out, "pool", kernel_shape=[2, 2], strides=[2, 2]
            ),
            helper.make_node("Conv", ["p", "w"], ["y"], "conv", kernel_shape=[1, 1]),
        ],
        "pooled",
        [helper.make_tensor_value_info("x", f32, [1, 2, 6, 6])],
        [helper.make_tensor_value_info("y", f32, [1, 3, 3, 3])],
        initializer=[numpy_helper.from_array(np.ones((3, 2, 1, 1), np.float32), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("indices", [False, True])
def test_maxpool_keeps_its_argmax_and_its_backward_reads_only_its_output(indices: bool):
    """A training MaxPool's value holds its argmax (int64 per output element) beside its
    output, unless the model's Indices output is already there; its backward node reads
    that value and not the input, and the gradient its user sends holds no argmax, kept
    or the model's own Indices output (no gradient for an index)."""
    g = training_graph(forward_graph(_pooled_model(indices)))
    relu, pool, conv = (g.nodes[g.index(name)] for name in ("relu", "pool", "conv"))
    pooled = 1 * 2 * 3 * 3
    assert pool.output_bytes == 4 * pooled + 8 * pooled
    assert bool(pool.attrs.get("keeps_argmax")) is not indices
    pool_grad = g.nodes[g.index("pool:grad")]
    assert pool.id in pool_grad.deps and relu.id not in pool_grad.deps
    assert g.nodes[g.index("conv:grad")].output_bytes == 4 * pooled
    assert conv.output_bytes == 4 * 3 * 3 * 3
    # the forward graph (inference) is as the model says
    assert forward_graph(_pooled_model(False)).nodes[1].output_bytes == 4 * pooled


def test_a_backward_node_sends_gradients_for_the_float_outputs_its_node_reads() -> None:
    """A user of one part of a Split sends back a gradient for that part alone, a user of
    a training Dropout's output none for its mask; the Split's backward node reads both."""
    g = training_graph(forward_graph(split_and_dropout()))
    names = ("split", "dropout", "sigmoid", "tanh")
    grad = {name: g.nodes[g.index(f"{name}:grad")] for name in names}
    floats = 4
    assert grad["sigmoid"].output_bytes == 4 * 2 * floats  # d0, not the mask
    assert grad["tanh"].output_bytes == 4 * 4 * floats  # s1 alone
    assert grad["dropout"].output_bytes == 4 * 2 * floats  # s0 alone
    assert grad["split"].output_bytes == 4 * 6 * floats  # the whole of r
    assert {grad["dropout"].id, grad["tanh"].id} <= set(grad["split"].deps)
