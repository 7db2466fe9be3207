from remat.errors import InvalidInputError
from remat.graph import Mode, NodeKind
from remat.training import for_mode, training_graph

from graphs import chain, diamond, forward


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
