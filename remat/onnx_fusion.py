"""Operator fusion at ingest: a ``MatMul`` whose product only a bias ``Add`` reads becomes
one node, ``MatMulAdd`` of Remat's own domain, which is what PyTorch runs for a ``Linear``
layer (one ``addmm``).

PyTorch's exporters write ``nn.Linear`` on an input of three or more dimensions as
``MatMul`` then ``Add`` of the bias (ONNX's ``Gemm`` multiplies matrices only). Planned as
two nodes, the product before the bias is a value of its own: a plan holds it while the
``Add`` runs, the ``Add``'s backward node passes its gradient through, and an executor runs
two kernels and allocates twice where PyTorch allocates once. Fused, the graph has one node
and one value where eager PyTorch has one call and one tensor.

A pair is fused when the ``MatMul`` multiplies an input of two or more dimensions by a
matrix ``(K, N)``, the ``Add``'s other input is a constant of shape ``(N,)``, every tensor
is a float, and nothing but that ``Add`` reads the product (no other node, folded or
scheduled, and no model output). The fused node takes the ``MatMul``'s name and the
``Add``'s place and output: ``Y = A @ W + B`` with inputs ``(A, W, B)``.

Hugging Face's ``Conv1D`` (GPT-2) flattens the input's leading dimensions itself, and both
exporters write it as a ``Reshape`` to ``(M, K)``, a ``Gemm`` with the bias and a
``Reshape`` back: three nodes, two of which only view. Such a triple is one ``MatMulAdd``
too, of the unflattened input, with the
attribute ``transB`` where the ``Gemm`` multiplies by the transposed weight ``(N, K)``
(``nn.Linear``'s layout): the ``Gemm`` scales nothing (``alpha`` and ``beta`` 1, ``A`` not
transposed), its bias is a constant ``(N,)``, the first ``Reshape`` (or ``Flatten``)
makes ``(prod of the leading dimensions, K)`` and the second restores them with ``N``
last, and nothing but the next reads each value between them. It takes the ``Gemm``'s
name and the second ``Reshape``'s place. ``MultiheadAttention``'s output projection is
written with a first ``Reshape`` that merges the heads too (``(L, N, H, D)`` to ``(L N, H
D)``): its input is not the product's, and it stays a ``Gemm``.

Attention, ``softmax(A @ B * scale + M) @ V``, is written by every exporter as a chain:
``MatMul`` of the queries and the transposed keys, a ``Mul`` or ``Div`` by a scalar (or
both operands scaled before, as PyTorch's exporter writes ``scaled_dot_product_attention``),
an ``Add`` of a mask or a position bias, ``Softmax`` over the last axis and ``MatMul`` with
the values (PyTorch's dynamo exporter zeroes a fully masked row's weights after the
``Softmax``: ``Where(IsNaN(P), 0, P)``, as ``scaled_dot_product_attention`` does). Planned
node by node, the attention weights ``P`` (batch x heads x L x L, the
largest activation of a transformer at long sequences) are held from the forward pass to
the backward because ``Softmax``'s and the second ``MatMul``'s gradients read them, and an
executor runs five kernels where PyTorch runs one (``scaled_dot_product_attention``, whose
backward recomputes ``P`` from its inputs). Fused, the chain is one
``ScaledDotProductAttention`` node with inputs ``(A, B, V[, M])`` and the attribute
``scale``; its gradient reads its inputs, not ``P``. A mask that is a causal constant
(each slice zero on and below the diagonal of square scores and at most -1e4 above it,
as GPT-2's is folded from comparisons of positions, or written by the dynamo exporter as
an initializer) is the attribute ``causal`` instead,
as PyTorch's ``is_causal``: no scores-sized constant is held, and PyTorch's fused kernels
skip the masked half of the scores. A row whose every score is masked
(-inf) gets zero weights, as in PyTorch, where ONNX's ``Softmax`` alone gives NaN. A chain
is fused when nothing else reads its intermediate values, ``A``, ``B`` and ``V`` have the
same batch dimensions (three or more dimensions), the mask broadcasts to the scores, a
scale is a constant scalar, and every tensor is a float.

Grouped-query attention (LLaMA, Mistral, Qwen: H query heads share Hk < H key and value
heads, each read by H / Hk query heads in a row) is written with each key and value head
repeated for its group before the chain: Hugging Face's ``repeat_kv``, and the dynamo
exporter's ``scaled_dot_product_attention(enable_gqa=True)``, add an axis after the heads,
``Expand`` it and merge it into them. Planned so, each layer makes and holds two
repeated copies of its keys and values, H / Hk times their size, and their backward nodes
sum the copies' gradients back. After the attention chains are fused, a fused node whose
keys and values are such a repeat reads the Hk heads themselves (PyTorch's attention
kernels take them so: ``enable_gqa``), the keys through a new ``FusedLayout`` that
transposes them, as the node reads its keys. A repeat is found by what its operators do to
the axes, not by how they are written: layout operators and one ``Expand`` from the
nearest value of four dimensions ``(N, Hk, L, d)`` before it, which must make ``(N, Hk *
r, L, d)`` (the keys: ``(N, Hk * r, d, L)``) with each head's ``r`` copies in a row, every
value between read by the next operator alone; heads repeated as a whole instead (``(k0,
k1, k0, k1)``) are not grouped-query attention's, and stay.

GELU, ``x * (1 + erf(x / sqrt 2)) / 2`` or its tanh approximation, is written by
exporters of opsets before 20 (which has no ``Gelu``) as a chain of elementwise operators:
PyTorch's ``F.gelu`` as ``Div``, ``Erf``, ``Add``, ``Mul``, ``Mul``, and a model's own
formula (GPT-2's ``NewGELUActivation``) operator by operator, eight of them; SiLU (Swish,
``x * sigmoid(x)``, which ONNX has no operator for) as ``Sigmoid`` and ``Mul``. Planned
node by node, the chain's intermediate values, each the size of the layer's widest
activation, are held for its backward nodes (one to four per layer), and an executor runs
up to eight kernels forward and as many backward where PyTorch runs one each way. Fused,
the chain is one ``FusedGelu`` node with input ``x`` and attribute ``approximate``
(``none`` or ``tanh``, as PyTorch's), or one ``FusedSilu``; its gradient reads ``x``
alone. A chain is found by what it computes, not by how an exporter orders it: the
elementwise operators (``Add``, ``Sub``, ``Mul``, ``Div``, ``Pow``, ``Erf``, ``Tanh``,
``Sigmoid``, ``Sqrt``, ``Neg``) that read only ``x``, constant scalars and each other,
whose result equals the activation's on probe values of ``x``, with its core operator
(``Erf``, ``Tanh`` or ``Sigmoid``) among them; nothing else may read their intermediate
values, and the result has ``x``'s shape and a float type.

Layer normalization is written by exporters of opsets before 17 (which has no
``LayerNormalization``) as ``ReduceMean`` of ``x``, ``Sub`` of the mean, ``Pow`` by 2,
``ReduceMean``, ``Add`` of epsilon, ``Sqrt``, ``Div``, then ``Mul`` by the weight and
``Add`` of the bias (PyTorch's ``native_layer_norm`` symbolic): nine nodes, the centred
input, the standard deviation and the normalised value held for their backward nodes.
Fused, it is one ``FusedLayerNorm`` node with inputs ``(x, weight[, bias])`` and the
attributes ``axis`` and ``epsilon`` of ONNX's ``LayerNormalization``, run and
differentiated as that operator is. A chain is fused when both means are over the same
trailing axes and keep them, the square is ``Pow`` by 2 or ``Mul`` of the centred value by
itself, epsilon is a constant scalar, the weight and the bias are constants of the
normalised axes' shape, nothing else reads the chain's values, and every tensor is a float.

RMS normalization (T5, LLaMA), ``x / sqrt(mean(x^2) + eps) * weight``, which ONNX has no
operator for before opset 23, is written as ``Pow`` by 2 (or ``Mul`` of ``x`` by itself),
``ReduceMean``, ``Add`` of epsilon, ``Sqrt``, ``Div`` of 1 by it (or ``Reciprocal``),
``Mul`` by ``x`` and ``Mul`` by the weight, the normalised value held for the weight's
gradient. Fused, it is one ``FusedRMSNorm`` node with inputs ``(x, weight)`` and the
attributes ``axis`` and ``epsilon``, run as PyTorch's ``rms_norm``; the same conditions
hold as for layer normalization.

Rotary position embeddings (LLaMA, Mistral, Qwen, GPT-NeoX), ``x * cos + rotate_half(x)
* sin`` with ``rotate_half(x) = concat(-x2, x1)`` of the halves ``x1``, ``x2`` of the last
axis, are written as ``Mul`` by the cosines, two ``Slice``'s of the halves, ``Neg``,
``Concat``, ``Mul`` by the sines and ``Add``: seven nodes for each of a layer's queries
and keys, the halves, their rotation and both products held for their backward nodes,
which pad the halves' gradients back into zeros and sum three gradients of ``x``. Fused,
it is one ``FusedRotary`` node with inputs ``(x, cos, sin)``, which makes its output with
one product and two in-place products of halves, and its gradient of ``x`` likewise from
``cos`` and ``sin``. Cosines and sines that are constants, read by rotary embeddings
alone, are tables of positions (a model computes them from a buffer of frequencies, and
the dynamo exporter folds them into initializers): ingestion does not train them, so the
gradient does not read ``x`` (it would for trained ones, as a product's).
A chain is fused when the slices take the two halves of ``x``'s last axis (of even size,
static) with step 1, ``Concat`` joins the negated second and the first along it, the
cosines and sines broadcast to ``x``, nothing else reads the chain's values, and every
tensor is a float.

PyTorch's ``MultiheadAttention`` (``torch.nn.Transformer*``, torchvision's ViT) computes
queries, keys and values with one packed projection, and the TorchScript exporter writes
their separation as one ``Gather`` per part, each of one constant index along the same
axis of the same tensor. Planned node by node, each ``Gather``'s backward node makes a
gradient of the whole packed tensor (zeros but for its part), held until the three are
summed. Fused, the ``Gather``'s that pick every index of the axis exactly once are one
``FusedUnbind`` node with the packed tensor as input, one output per index (in index
order) and the attribute ``axis``, run as PyTorch's ``unbind`` (each part then copied to
storage of its own, as a ``Gather``'s output is); its gradient stacks the parts'
gradients into one tensor and reads no input. The node takes the place and the name of
the first of the ``Gather``'s; the packed tensor must be an activation of static shape and
a float. A node's outputs are one value, released together, so the parts are fused only
where each is read by layout operators alone (``Reshape``, ``Transpose``, ``Squeeze``,
``Unsqueeze``, ``Flatten``, ``Identity``, as ``MultiheadAttention`` splits the heads):
their gradients read no input, so each part is released once its readers have run in
the forward pass. A part that an operator's gradient reads (Swin's values, read by a
``MatMul``) would hold the others with it until the backward pass: those stay apart.

Exporters split and merge attention heads, patches and windows with chains of layout
operators (``Reshape``, ``Transpose``, ``Squeeze``, ``Unsqueeze``, ``Flatten``,
``Identity``): Hugging Face's GPT-2 and BERT write ``Reshape`` then ``Transpose`` for each
of the queries, keys and values, torchvision's ViT four in a row, Swin's window partition
six. Planned node by node, each member is a node with a value of its own and a backward
node that only reshapes or permutes a gradient; an executor runs a step for each, where
eager PyTorch makes views in one Python call each and runs their backward in C++. Fused,
a chain is one ``FusedLayout`` node with the chain's input, the last member's output and
its steps: the attribute ``steps`` names each (``reshape`` or ``transpose``), ``dims``
holds their target shapes and permutations one after another and ``ranks`` how many
entries each takes. Consecutive reshapes are one, consecutive transposes are composed, and
a step that changes nothing is dropped (a chain may end with none: the identity, a node
without attributes). Its gradient undoes the steps in reverse order and reads no input. A
chain is two or more layout operators of ONNX's domain, each member's output read by the
next alone (as its data, no model output), on a float tensor whose every shape along the
chain is static.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from onnx import NodeProto, helper

FUSED_DOMAIN = "ai.remat"
DEFAULT_DOMAINS = ("", "ai.onnx")  # how a model may name ONNX's own domain
MATMUL_ADD = "MatMulAdd"
ATTENTION = "ScaledDotProductAttention"
GELU = "FusedGelu"
SILU = "FusedSilu"
LAYER_NORM = "FusedLayerNorm"
RMS_NORM = "FusedRMSNorm"
UNBIND = "FusedUnbind"
LAYOUT = "FusedLayout"
ROTARY = "FusedRotary"
FUSED_OPS = frozenset(
    {MATMUL_ADD, ATTENTION, GELU, SILU, LAYER_NORM, RMS_NORM, UNBIND, LAYOUT, ROTARY}
)

Shape = tuple[int, ...]
Axis = tuple[str, ...]  # the named axes a reshaped one merges (``_axes_after``)
# Operators that move or view their input's elements, whose gradients read no input
_LAYOUT = frozenset(("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity"))


@dataclass(frozen=True)
class Tensors:
    """What ingestion found of a model's tensors, which the fusions ask: how many of the
    model's operators read each (a model output counts as a reader), whether it is a
    constant, its static shape (None where not static), whether it is a float, its ONNX
    element type (None where unknown), the value of a constant of one float element, that
    of a constant integer of rank 0, the values of a small constant integer vector, and the
    truth of a constant of one element (None for anything else), whether a small constant
    is zero everywhere, and whether a constant is a causal attention mask."""

    readers: Mapping[str, int]
    constant: Callable[[str], bool]
    shape: Callable[[str], Shape | None]
    is_float: Callable[[str], bool]
    elem_type: Callable[[str], int | None]
    scalar: Callable[[str], float | None]
    index: Callable[[str], int | None]
    ints: Callable[[str], tuple[int, ...] | None]
    flag: Callable[[str], bool | None]
    is_zero: Callable[[str], bool]
    causal: Callable[[str], bool]


def fused_node(
    op: str, inputs: Sequence[str], output: str | Sequence[str], name: str, **attributes: object
) -> NodeProto:
    """A node of one of ``FUSED_OPS`` (``output``: its one output, or all of them)."""
    outputs = [output] if isinstance(output, str) else list(output)
    node = helper.make_node(op, inputs, outputs, name=name, domain=FUSED_DOMAIN)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in attributes.items())
    return node


def fuse_linear_layers(
    nodes: Sequence[tuple[NodeProto, str]],
    tensors: Tensors,
) -> list[tuple[NodeProto, str]]:
    """``nodes`` (scheduled operators with their graph names, in topological order) with
    every fusable ``MatMul`` and bias ``Add`` replaced by one ``MatMulAdd`` at the ``Add``'s
    place; ``tensors``: what ingestion found of the model's tensors."""
    products = {
        proto.output[0]: (proto, name)
        for proto, name in nodes
        if _is_matmul(proto) and tensors.readers.get(proto.output[0], 0) == 1
    }
    found = _Replacements()
    for proto, _ in nodes:
        if not _is_add(proto):
            continue
        for position in (0, 1):
            product, bias = proto.input[position], proto.input[1 - position]
            matmul = products.get(product)
            if matmul is None or product == bias or not tensors.constant(bias):
                continue
            a, w = matmul[0].input
            if _fusable(tensors.shape(a), tensors.shape(w), tensors.shape(bias)) and all(
                tensors.is_float(t) for t in (a, w, bias, proto.output[0])
            ):
                node = fused_node(MATMUL_ADD, [a, w, bias], proto.output[0], matmul[1])
                found.add(node, matmul[1], [product])  # at the Add's place
                break
    return found.applied(nodes)


def fuse_flattened_gemms(
    nodes: Sequence[tuple[NodeProto, str]],
    tensors: Tensors,
) -> list[tuple[NodeProto, str]]:
    """``nodes`` (as for ``fuse_linear_layers``) with every ``Gemm`` between a ``Reshape``
    that flattens its input's leading dimensions and one that restores them replaced by
    one ``MatMulAdd`` at the second ``Reshape``'s place (the module docstring)."""
    around = _Neighbours.of(nodes, tensors)
    found = _Replacements()
    for proto, name in nodes:
        if proto.op_type != "Gemm" or proto.domain not in DEFAULT_DOMAINS or len(proto.input) != 3:
            continue
        attributes = {a.name: a for a in proto.attribute}
        scales = [attributes[k].f for k in ("alpha", "beta") if k in attributes]
        if any(scale != 1.0 for scale in scales) or (
            "transA" in attributes and attributes["transA"].i
        ):
            continue
        trans_b = int(attributes["transB"].i) if "transB" in attributes else 0
        flatten = around.producer.get(proto.input[0], (None, ""))[0]
        restore = around.only_reader(proto.output[0], ("Reshape",))
        if flatten is None or flatten.op_type not in ("Reshape", "Flatten") or restore is None:
            continue
        if around.only_reader(flatten.output[0], ("Gemm",)) is not proto:
            continue
        a, (_, w, bias) = flatten.input[0], proto.input
        if _flattened_product(a, w, bias, trans_b, flatten, restore, tensors):
            node = fused_node(
                MATMUL_ADD,
                [a, w, bias],
                restore.output[0],
                name,
                **({"transB": 1} if trans_b else {}),
            )
            found.add(node, name, [flatten.output[0], proto.output[0]])
    return found.applied(nodes)


def _flattened_product(
    a: str,
    w: str,
    bias: str,
    trans_b: int,
    flatten: NodeProto,
    restore: NodeProto,
    tensors: Tensors,
) -> bool:
    """Whether ``flatten`` makes ``a`` (..., K) a matrix (M, K), the weight ``w`` is (K, N)
    ((N, K) where ``trans_b``), the bias a constant (N,) and ``restore`` makes the product
    (..., N), every tensor a float."""
    a_shape, w_shape = tensors.shape(a), tensors.shape(w)
    if a_shape is None or w_shape is None or len(a_shape) < 2 or len(w_shape) != 2:
        return False
    k, n = reversed(w_shape) if trans_b else w_shape
    leading = a_shape[:-1]
    return (
        a_shape[-1] == k
        and tensors.shape(flatten.output[0]) == (math.prod(leading), k)
        and tensors.shape(restore.output[0]) == (*leading, n)
        and tensors.constant(bias)
        and tensors.shape(bias) == (n,)
        and all(tensors.is_float(t) for t in (a, w, bias, restore.output[0]))
    )


def fuse_attention_chains(
    nodes: Sequence[tuple[NodeProto, str]],
    tensors: Tensors,
    opset: int,
) -> list[tuple[NodeProto, str]]:
    """``nodes`` (as for ``fuse_linear_layers``) with every fusable attention chain replaced
    by one ``ScaledDotProductAttention`` at the place of its last ``MatMul``; ``opset`` is
    the model's default-domain opset (``Softmax``'s default axis depends on it)."""
    producer = {out: entry for entry in nodes for out in entry[0].output if out}
    found = _Replacements()
    for proto, _ in nodes:
        if _is_matmul(proto):
            chain = _attention_chain(proto, producer, tensors, opset)
            if chain is not None:
                node, removed = chain
                found.add(node, node.name, removed)
    return found.applied(nodes)


def fuse_grouped_heads(
    nodes: Sequence[tuple[NodeProto, str]],
    tensors: Tensors,
) -> tuple[list[tuple[NodeProto, str]], dict[str, tuple[int, Shape]]]:
    """``nodes`` (as for ``fuse_linear_layers``, attention chains already fused) with each
    ``ScaledDotProductAttention`` whose keys and values are grouped-query heads repeated
    (the module docstring) reading the key and value heads themselves; the keys through a
    new ``FusedLayout`` that transposes them, since the node reads them transposed. Also
    returns the tensors those make: name -> (ONNX element type, shape)."""
    around = _Neighbours.of(nodes, tensors)
    names = {name for _, name in nodes}
    found = _Replacements()
    made: dict[str, tuple[int, Shape]] = {}
    for proto, name in nodes:
        if proto.op_type != ATTENTION or proto.domain != FUSED_DOMAIN:
            continue
        keys = _repeated_heads(proto.input[1], around, transposed=True)
        values = _repeated_heads(proto.input[2], around, transposed=False)
        if keys is None or values is None:
            continue
        (k, k_chain), (v, v_chain) = keys, values
        k_shape, v_shape, elem_type = tensors.shape(k), tensors.shape(v), tensors.elem_type(k)
        if k_shape is None or v_shape is None or elem_type is None or k_shape[:3] != v_shape[:3]:
            continue
        transposed = _fresh(f"{k}_transposed", lambda t: tensors.elem_type(t) is not None)
        flip_name = _fresh(f"{name}_keys", names.__contains__)
        names.add(flip_name)
        flip = fused_node(
            LAYOUT, [k], transposed, flip_name, steps=["transpose"], dims=[0, 1, 3, 2], ranks=[4]
        )
        grouped = NodeProto()
        grouped.CopyFrom(proto)
        grouped.input[1], grouped.input[2] = transposed, v
        found.add(grouped, name, [*k_chain[:-1], *v_chain])
        found.add(flip, flip_name, [], at=k_chain[-1])  # in the place of the keys' last
        made[transposed] = (elem_type, (*k_shape[:2], k_shape[3], k_shape[2]))
    return found.applied(nodes), made


def _fresh(base: str, taken: Callable[[str], bool]) -> str:
    """``base``, or ``base`` with the first numeric suffix that ``taken`` says is free."""
    name, suffix = base, 0
    while taken(name):
        suffix += 1
        name = f"{base}_{suffix}"
    return name


def _repeated_heads(
    tensor: str, around: _Neighbours, *, transposed: bool
) -> tuple[str, list[str]] | None:
    """Where ``tensor`` (N, H, L, d), or (N, H, d, L) where ``transposed``, is ``x`` (N,
    Hk, L, d) with each of its Hk heads repeated H / Hk times in a row (PyTorch's
    ``repeat_interleave`` over the heads, as Hugging Face's ``repeat_kv`` and the dynamo
    exporter's ``enable_gqa`` write it): layout operators around one ``Expand``, from the
    nearest value of four dimensions before it, every value after ``x`` read by the next
    operator alone. Returns ``x`` and those operators' outputs in order; else None."""
    tensors = around.tensors
    chain: list[NodeProto] = []
    current, expanded = tensor, False
    while not (expanded and len(tensors.shape(current) or ()) == 4):
        found = around.producer.get(current)
        node = found[0] if found is not None else None
        if node is None or node.domain not in DEFAULT_DOMAINS or not node.input:
            return None
        if node.op_type == "Expand" and not expanded:
            expanded = True
        elif node.op_type not in _LAYOUT:
            return None
        chain.insert(0, node)
        current = node.input[0]
    outputs = [node.output[0] for node in chain]
    if any(tensors.readers.get(o, 0) != 1 for o in outputs):
        return None  # a value read twice, or a model output, stays
    source = tensors.shape(current)
    axes = _axes_after(current, chain, tensors)
    if source is None or axes is None:
        return None
    kept = [(f"s{i}",) if size > 1 else () for i, size in enumerate(source)]
    features = [kept[3], kept[2]] if transposed else [kept[2], kept[3]]
    return (current, outputs) if axes == [kept[0], (*kept[1], "r"), *features] else None


def _axes_after(source: str, chain: Sequence[NodeProto], tensors: Tensors) -> list[Axis] | None:
    """What each axis of the last output of ``chain`` (layout operators and one ``Expand``
    from ``source``) is made of: the axes of ``source`` it merges, in order, named ``s0``,
    ``s1``, ..., and ``r`` for the one axis the ``Expand`` repeats, axes of size 1 left out.
    None where a reshape splits an axis of ``source`` or the ``Expand`` repeats more than
    one axis or one that is not new."""
    shape = tensors.shape(source)
    if shape is None:
        return None
    axes: list[list[tuple[str, int]]] = [
        [(f"s{i}", size)] if size > 1 else [] for i, size in enumerate(shape)
    ]
    for node in chain:
        after = tensors.shape(node.output[0])
        if after is None:
            return None
        if node.op_type == "Transpose":
            perm = _permutation(node, len(axes))
            if perm is None:
                return None
            axes = [axes[p] for p in perm]
        elif node.op_type == "Expand":
            grown = [i for i, (a, b) in enumerate(zip(shape, after, strict=False)) if a != b]
            if len(after) != len(shape) or len(grown) != 1 or axes[grown[0]]:
                return None
            axes[grown[0]] = [("r", after[grown[0]])]
        elif node.op_type != "Identity":
            regrouped = _regrouped([atom for axis in axes for atom in axis], after)
            if regrouped is None:
                return None
            axes = regrouped
        shape = after
    return [tuple(name for name, _ in axis) for axis in axes]


def _regrouped(
    atoms: Sequence[tuple[str, int]], shape: Shape
) -> list[list[tuple[str, int]]] | None:
    """``atoms`` (named axes of size 2 or more, in memory order) grouped into the axes of a
    reshape to ``shape``; None where an axis of ``shape`` would split one."""
    rest = list(atoms)
    axes = []
    for size in shape:
        axis, product = [], 1
        while product < size and rest:
            atom = rest.pop(0)
            axis.append(atom)
            product *= atom[1]
        if product != size:
            return None
        axes.append(axis)
    return None if rest else axes


def fuse_unbinds(
    nodes: Sequence[tuple[NodeProto, str]],
    tensors: Tensors,
) -> list[tuple[NodeProto, str]]:
    """``nodes`` (as for ``fuse_linear_layers``) with the ``Gather``'s that pick each index
    of one axis of one activation once, each by a constant index of rank 0, replaced by one
    ``FusedUnbind`` at the first one's place, named as it, where layout operators alone
    read the parts (the module docstring)."""
    around = _Neighbours.of(nodes, tensors)
    parts: dict[tuple[str, int], list[tuple[int, NodeProto, str]]] = {}
    for proto, name in nodes:
        picked = _picked(proto, tensors)
        if picked is not None and around.read_by_layout_alone(proto.output[0]):
            data, axis, index = picked
            parts.setdefault((data, axis), []).append((index, proto, name))
    found = _Replacements()
    for (data, axis), picks in parts.items():
        if sorted(index for index, _, _ in picks) != list(range(len(picks))):
            continue  # an index picked twice, or one not picked
        outputs = [proto.output[0] for _, proto, _ in sorted(picks, key=lambda p: p[0])]
        _, first, name = picks[0]  # in ``nodes``' order
        node = fused_node(UNBIND, [data], outputs, name, axis=axis)
        found.add(node, name, [p.output[0] for _, p, _ in picks[1:]], at=first.output[0])
    return found.applied(nodes)


def fuse_rotary_embeddings(
    nodes: Sequence[tuple[NodeProto, str]],
    tensors: Tensors,
) -> list[tuple[NodeProto, str]]:
    """``nodes`` (as for ``fuse_linear_layers``) with every rotary position embedding
    written as its formula (the module docstring) replaced by one ``FusedRotary`` at its
    ``Add``'s place, named as the product by the cosines."""
    around = _Neighbours.of(nodes, tensors)
    found = _Replacements()
    for proto, _ in nodes:
        chain = _rotary_chain(proto, around) if _is_add(proto) else None
        if chain is not None:
            node, removed = chain
            found.add(node, node.name, removed)
    return found.applied(nodes)


def _rotary_chain(add: NodeProto, around: _Neighbours) -> tuple[NodeProto, list[str]] | None:
    """The fused node for the rotary embedding whose sum is ``add`` and the outputs of the
    nodes it replaces, or None where it is not one ``fuse_rotary_embeddings`` fuses."""
    tensors = around.tensors
    producers = [around.producer.get(t) for t in add.input]
    products = [p for p in producers if p is not None and _is_product(p[0])]
    if len(products) != 2:
        return None
    for (direct, name), (rotated, _) in (products, products[::-1]):
        halves = _rotated_halves(rotated, around)
        if halves is None:
            continue
        x, sin, members = halves
        cos = _other(direct, x)
        shape = tensors.shape(x)
        if cos is None or shape is None or tensors.shape(add.output[0]) != shape:
            continue
        if not all(_broadcasts(tensors.shape(t), shape) for t in (cos, sin)):
            continue
        removed = [direct.output[0], *(m.output[0] for m in members)]
        if any(tensors.readers.get(t, 0) != 1 for t in removed):
            continue
        if all(tensors.is_float(t) for t in (x, cos, sin, add.output[0])):
            return fused_node(ROTARY, [x, cos, sin], add.output[0], name), removed
    return None


def _rotated_halves(
    product: NodeProto, around: _Neighbours
) -> tuple[str, str, list[NodeProto]] | None:
    """Where ``product`` is ``concat(-x2, x1) * sin`` of the halves ``x1``, ``x2`` of the
    last axis of ``x`` (two ``Slice``'s, ``Neg``, ``Concat``): ``x``, ``sin`` and those
    nodes with ``product``, in order; else None."""
    tensors = around.tensors
    for position in (0, 1):
        found = around.producer.get(product.input[position])
        concat = found[0] if found is not None else None
        if concat is None or concat.op_type != "Concat" or len(concat.input) != 2:
            continue
        negated, first = (around.producer.get(t) for t in concat.input)
        neg = negated[0] if negated is not None else None
        if neg is None or neg.op_type != "Neg" or first is None:
            continue
        second = around.producer.get(neg.input[0])
        if second is None or second[0].op_type != "Slice" or first[0].op_type != "Slice":
            continue
        x = first[0].input[0]
        shape = tensors.shape(x)
        if second[0].input[0] != x or shape is None or shape[-1] % 2:
            continue
        last, half = len(shape) - 1, shape[-1] // 2
        axis = next((int(a.i) for a in concat.attribute if a.name == "axis"), None)
        if axis is None or axis % len(shape) != last:
            continue
        if _sliced(first[0], shape, tensors) != (last, 0, half):
            continue
        if _sliced(second[0], shape, tensors) != (last, half, 2 * half):
            continue
        return x, product.input[1 - position], [first[0], second[0], neg, concat, product]
    return None


def _sliced(proto: NodeProto, shape: Shape, tensors: Tensors) -> tuple[int, int, int] | None:
    """A ``Slice`` of one axis with step 1: (axis, start, stop), each normalised to
    ``shape`` as Python's slices are; else None. Its bounds are attributes before opset
    10, constant inputs from it."""
    if len(proto.input) == 1:
        attributes = {a.name: tuple(int(i) for i in a.ints) for a in proto.attribute}
        starts, ends = attributes.get("starts"), attributes.get("ends")
        axes, steps = attributes.get("axes"), None
    else:
        found = [tensors.ints(t) if t else None for t in proto.input[1:5]]
        starts, ends, axes, steps = (*found, None, None, None)[:4]
    if starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
        return None
    if (axes is not None and len(axes) != 1) or (steps is not None and steps != (1,)):
        return None
    axis = axes[0] if axes is not None else 0
    if not -len(shape) <= axis < len(shape):
        return None
    axis %= len(shape)
    start, stop, _ = slice(starts[0], ends[0]).indices(shape[axis])
    return axis, start, stop


def _broadcasts(shape: Shape | None, to: Shape) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``to`` without enlarging it."""
    if shape is None or len(shape) > len(to):
        return False
    return all(d in (1, t) for d, t in zip(shape[::-1], to[::-1], strict=False))


def fuse_layout_chains(
    nodes: Sequence[tuple[NodeProto, str]],
    tensors: Tensors,
) -> list[tuple[NodeProto, str]]:
    """``nodes`` (as for ``fuse_linear_layers``) with every chain of two or more layout
    operators replaced by one ``FusedLayout`` at the last one's place, named as the first
    (the module docstring)."""
    around = _Neighbours.of(nodes, tensors)
    following: dict[str, NodeProto] = {}  # a member's output -> the member that reads it
    for proto, _ in nodes:
        if _is_layout(proto) and tensors.is_float(proto.input[0]):
            after = around.only_reader(proto.output[0], tuple(_LAYOUT))
            if after is not None and after.input[0] == proto.output[0]:
                following[proto.output[0]] = after
    continued = {after.output[0] for after in following.values()}
    found = _Replacements()
    for proto, name in nodes:
        if proto.output[0] not in following or proto.output[0] in continued:
            continue  # not a chain's first member
        chain = [proto]
        while (after := following.get(chain[-1].output[0])) is not None:
            chain.append(after)
        steps = _layout_steps(chain, tensors)
        if steps is None:
            continue
        attributes = {  # none for the identity: ONNX has no empty list attribute
            "steps": [kind for kind, _ in steps],
            "dims": [d for _, dims in steps for d in dims],
            "ranks": [len(dims) for _, dims in steps],
        }
        attributes = attributes if steps else {}
        node = fused_node(LAYOUT, [proto.input[0]], chain[-1].output[0], name, **attributes)
        found.add(node, name, [member.output[0] for member in chain[:-1]])
    return found.applied(nodes)


def _is_layout(proto: NodeProto) -> bool:
    return (
        proto.op_type in _LAYOUT
        and proto.domain in DEFAULT_DOMAINS
        and len(proto.input) >= 1
        and len(proto.output) == 1
    )


def _layout_steps(chain: Sequence[NodeProto], tensors: Tensors) -> list[tuple[str, Shape]] | None:
    """The steps of a layout chain, (``reshape``, target shape) or (``transpose``,
    permutation), merged and without those that change nothing; None where a shape along
    the chain is not static or a permutation is not one."""
    start = tensors.shape(chain[0].input[0])
    if start is None:
        return None
    steps: list[tuple[str, Shape, Shape]] = []  # (kind, dims, the shape before the step)
    shape = start
    for member in chain:
        after = tensors.shape(member.output[0])
        if after is None:
            return None
        if member.op_type == "Transpose":
            perm = _permutation(member, len(shape))
            if perm is None:
                return None
            if steps and steps[-1][0] == "transpose":  # permute(p) then permute(q)
                _, first, before = steps.pop()
                perm = tuple(first[i] for i in perm)
                shape = before
            if perm != tuple(range(len(perm))):
                steps.append(("transpose", perm, shape))
        elif member.op_type != "Identity":
            if steps and steps[-1][0] == "reshape":
                shape = steps.pop()[2]
            if after != shape:
                steps.append(("reshape", after, shape))
        shape = after
    return [(kind, dims) for kind, dims, _ in steps]


def _permutation(transpose: NodeProto, rank: int) -> tuple[int, ...] | None:
    """A ``Transpose``'s permutation of ``rank`` axes (reversed where it names none); None
    where its ``perm`` is not one."""
    perm = next((tuple(a.ints) for a in transpose.attribute if a.name == "perm"), None)
    perm = perm or tuple(reversed(range(rank)))
    return perm if sorted(perm) == list(range(rank)) else None


def _picked(proto: NodeProto, tensors: Tensors) -> tuple[str, int, int] | None:
    """A ``Gather`` of one constant index of rank 0 from a float activation of static shape
    whose axis has two or more entries: (the activation, the axis, the index), both
    normalised to be non-negative; else None."""
    if proto.op_type != "Gather" or proto.domain not in DEFAULT_DOMAINS or len(proto.input) != 2:
        return None
    data, indices = proto.input
    shape, index = tensors.shape(data), tensors.index(indices)
    if shape is None or index is None or tensors.constant(data) or not tensors.is_float(data):
        return None
    axis = next((int(a.i) for a in proto.attribute if a.name == "axis"), 0)
    if not -len(shape) <= axis < len(shape):
        return None
    axis %= len(shape)
    size = shape[axis]
    if size < 2 or not -size <= index < size:
        return None
    return data, axis, index % size


@dataclass
class _Replacements:
    """The fused nodes a fusion found, each by the output of the node whose place it
    takes (by default its own output, that of the last node it replaces), and the outputs
    of the other nodes they replace."""

    fused: dict[str, tuple[NodeProto, str]] = field(default_factory=dict)
    absorbed: set[str] = field(default_factory=set)

    def add(
        self, node: NodeProto, name: str, replaced: Sequence[str], at: str | None = None
    ) -> None:
        """``node`` (named ``name``) in place of the node making output ``at`` (default:
        its own first output) and of the nodes making ``replaced``, unless one of those
        is another fused node's already."""
        place = node.output[0] if at is None else at
        outputs = [*replaced, place]
        if not any(o in self.absorbed or o in self.fused for o in outputs):
            self.fused[place] = (node, name)
            self.absorbed.update(replaced)

    def applied(self, nodes: Sequence[tuple[NodeProto, str]]) -> list[tuple[NodeProto, str]]:
        """``nodes`` with the node at each fused node's place replaced by it, and the
        nodes making the outputs it absorbed dropped."""
        result = []
        for proto, name in nodes:
            if proto.output and proto.output[0] in self.fused:
                result.append(self.fused[proto.output[0]])
            elif not (proto.output and proto.output[0] in self.absorbed):
                result.append((proto, name))
        return result


@dataclass(frozen=True)
class _Neighbours:
    """Who makes and who reads each tensor among the scheduled operators, and what
    ingestion found of the tensors."""

    producer: Mapping[str, tuple[NodeProto, str]]
    readers_of: Mapping[str, list[NodeProto]]
    tensors: Tensors

    @classmethod
    def of(cls, nodes: Sequence[tuple[NodeProto, str]], tensors: Tensors) -> _Neighbours:
        readers_of: dict[str, list[NodeProto]] = {}
        for proto, _ in nodes:
            for tensor in dict.fromkeys(proto.input):
                readers_of.setdefault(tensor, []).append(proto)
        producer = {out: entry for entry in nodes for out in entry[0].output if out}
        return cls(producer, readers_of, tensors)

    def read_by_layout_alone(self, tensor: str) -> bool:
        """Whether ``tensor`` is read, and only by scheduled layout operators of ONNX's
        domain (no model output, no folded node)."""
        found = self.readers_of.get(tensor, [])
        return (
            bool(found)
            and self.tensors.readers.get(tensor, 0) == len(found)
            and all(n.op_type in _LAYOUT and n.domain in DEFAULT_DOMAINS for n in found)
        )

    def only_reader(self, tensor: str, ops: tuple[str, ...]) -> NodeProto | None:
        """The one operator reading ``tensor`` where it is one of ``ops`` of ONNX's domain
        and nothing else (no model output) reads ``tensor``."""
        found = self.readers_of.get(tensor, [])
        if len(found) != 1 or self.tensors.readers.get(tensor, 0) != 1:
            return None
        node = found[0]
        return node if node.op_type in ops and node.domain in DEFAULT_DOMAINS else None


def _attention_chain(
    last: NodeProto,
    producer: Mapping[str, tuple[NodeProto, str]],
    tensors: Tensors,
    opset: int,
) -> tuple[NodeProto, list[str]] | None:
    """The fused node for the chain ending in ``last`` (``P @ V``) and the outputs of the
    nodes it replaces, or None where the chain is not one ``fuse_attention_chains``
    fuses."""
    removed: list[str] = []

    def step(tensor: str, ops: tuple[str, ...]) -> NodeProto | None:
        """The producer of ``tensor`` where it is one of ``ops`` of two inputs and nothing
        else reads ``tensor``."""
        found = producer.get(tensor)
        if found is None or found[0].op_type not in ops or found[0].domain not in DEFAULT_DOMAINS:
            return None
        return (
            found[0] if tensors.readers.get(tensor, 0) == 1 and len(found[0].input) == 2 else None
        )

    def scaled(tensor: str) -> tuple[str, float]:
        """``tensor`` without a ``Mul`` or ``Div`` by a constant scalar (the node is then
        removed with the chain), and that scalar; else ``tensor`` and 1."""
        node = step(tensor, ("Mul", "Div"))
        for position in (0, 1) if node is not None and node.op_type == "Mul" else (0,):
            factor = tensors.scalar(node.input[1 - position]) if node is not None else None
            if node is not None and factor is not None and factor != 0.0:
                removed.append(tensor)
                return node.input[position], factor if node.op_type == "Mul" else 1.0 / factor
        return tensor, 1.0

    p, v = last.input
    weights_readers = 1
    zeroed = _nan_zeroed(p, producer, tensors)
    if zeroed is not None:  # Where(IsNaN(P), 0, P): a fully masked row's weights zeroed
        removed.extend((p, zeroed[1]))
        p, weights_readers = zeroed[0], 2
    softmax = producer.get(p)
    if (
        softmax is None
        or softmax[0].op_type != "Softmax"
        or softmax[0].domain not in DEFAULT_DOMAINS
    ):
        return None
    if tensors.readers.get(p, 0) != weights_readers:
        return None
    removed.append(p)
    scores, mask = softmax[0].input[0], None
    add = step(scores, ("Add",))
    if add is not None:
        side = _scores_side(add, producer)
        if side is None:
            return None
        removed.append(scores)
        scores, mask = add.input[side], add.input[1 - side]
    product, scale = scaled(scores)
    matmul = step(product, ("MatMul",))
    if matmul is None:
        return None
    removed.append(product)
    (a, scale_a), (b, scale_b) = scaled(matmul.input[0]), scaled(matmul.input[1])
    inputs = [a, b, v] + ([mask] if mask is not None else [])
    if not all(tensors.is_float(t) for t in [*inputs, last.output[0]]):
        return None
    if not _attention_shapes([tensors.shape(t) for t in inputs], _softmax_axis(softmax[0], opset)):
        return None
    causal = {}
    queries, keys = tensors.shape(a), tensors.shape(b)
    if mask is not None and queries and keys and queries[-2] == keys[-1] and tensors.causal(mask):
        inputs, causal = inputs[:3], {"causal": 1}  # as scaled_dot_product_attention's
    node = fused_node(
        ATTENTION, inputs, last.output[0], matmul.name, scale=scale * scale_a * scale_b, **causal
    )
    return node, removed


def _scores_side(add: NodeProto, producer: Mapping[str, tuple[NodeProto, str]]) -> int | None:
    """Which input of the mask's ``Add`` is the scores: a ``MatMul``'s product, or a
    ``Mul`` or ``Div`` of one (the mask may be a product too, as a padding mask scaled by
    the most negative float)."""
    for side in (0, 1):
        found = producer.get(add.input[side])
        node = found[0] if found is not None else None
        if node is not None and node.op_type in ("Mul", "Div"):
            node = next(
                (p[0] for t in node.input if (p := producer.get(t)) and p[0].op_type == "MatMul"),
                None,
            )
        if node is not None and node.op_type == "MatMul":
            return side
    return None


def _nan_zeroed(
    tensor: str,
    producer: Mapping[str, tuple[NodeProto, str]],
    tensors: Tensors,
) -> tuple[str, str] | None:
    """Where ``tensor`` is ``Where(IsNaN(P), 0, P)`` read once (PyTorch's dynamo exporter
    writes attention's weights so, as ``scaled_dot_product_attention`` zeroes a row whose
    every score is masked): ``P`` and the ``IsNaN``'s output; else None."""
    where = producer.get(tensor)
    if where is None or where[0].op_type != "Where" or tensors.readers.get(tensor, 0) != 1:
        return None
    condition, zero, weights = where[0].input
    isnan = producer.get(condition)
    if isnan is None or isnan[0].op_type != "IsNaN" or list(isnan[0].input) != [weights]:
        return None
    if tensors.readers.get(condition, 0) != 1 or tensors.scalar(zero) != 0.0:
        return None
    return weights, condition


def _softmax_axis(softmax: NodeProto, opset: int) -> int:
    for attribute in softmax.attribute:
        if attribute.name == "axis":
            return int(attribute.i)
    return -1 if opset >= 13 else 1


def _attention_shapes(shapes: Sequence[Shape | None], axis: int) -> bool:
    """Queries (..., Lq, d), transposed keys (..., d, Lk) and values (..., Lk, dv) of the
    same batch dimensions, a mask that broadcasts to the scores, the softmax over Lk."""
    known = [s for s in shapes if s is not None]
    if len(known) != len(shapes):
        return False
    a, b, v, masks = known[0], known[1], known[2], known[3:]
    rank = len(a)
    if rank < 3 or len(b) != rank or len(v) != rank or axis not in (-1, rank - 1):
        return False
    if not (a[:-2] == b[:-2] == v[:-2] and a[-1] == b[-2] and b[-1] == v[-2]):
        return False
    scores = (*a[:-1], b[-1])
    return all(
        len(m) <= rank and all(d in (1, s) for d, s in zip(m[::-1], scores[::-1], strict=False))
        for m in masks
    )


def _is_matmul(proto: NodeProto) -> bool:
    return proto.op_type == "MatMul" and proto.domain in DEFAULT_DOMAINS and len(proto.input) == 2


def _is_product(proto: NodeProto) -> bool:
    return proto.op_type == "Mul" and proto.domain in DEFAULT_DOMAINS and len(proto.input) == 2


def _is_add(proto: NodeProto) -> bool:
    return proto.op_type == "Add" and proto.domain in DEFAULT_DOMAINS and len(proto.input) == 2


def _fusable(a: Shape | None, w: Shape | None, bias: Shape | None) -> bool:
    if a is None or w is None or bias is None:
        return False
    return len(a) >= 2 and len(w) == 2 and a[-1] == w[0] and bias == (w[1],)


# --- activations ------------------------------------------------------------------------

_ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.divide,
    "Pow": np.power,
    "Erf": np.vectorize(math.erf, otypes=[np.float64]),
    "Tanh": np.tanh,
    "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "Sqrt": np.sqrt,
    "Neg": np.negative,
}
_CHAIN_MAX_NODES = 12  # GPT-2's GELU formula has 8, PyTorch's erf form 5, SiLU 2
_PROBE = np.linspace(-6.0, 6.0, 49)
_TOLERANCE = 1e-5  # GELU's tanh approximation is up to 5e-4 from its erf form


@dataclass(frozen=True)
class _Activation:
    """A function that exporters write as elementwise operators: the fused operator that
    computes it, with its attributes; one of the operators the chain must have; and its
    values on ``_PROBE``."""

    op: str
    attributes: Mapping[str, str]
    core: str
    values: np.ndarray


_ACTIVATIONS = (
    _Activation(
        GELU,
        {"approximate": "none"},
        "Erf",
        0.5 * _PROBE * (1.0 + _ELEMENTWISE["Erf"](_PROBE / math.sqrt(2.0))),
    ),
    _Activation(
        GELU,
        {"approximate": "tanh"},
        "Tanh",
        0.5 * _PROBE * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (_PROBE + 0.044715 * _PROBE**3))),
    ),
    _Activation(SILU, {}, "Sigmoid", _PROBE / (1.0 + np.exp(-_PROBE))),
)


def fuse_activation_chains(
    nodes: Sequence[tuple[NodeProto, str]],
    tensors: Tensors,
) -> list[tuple[NodeProto, str]]:
    """``nodes`` (as for ``fuse_linear_layers``) with every GELU and SiLU written as a chain
    of elementwise operators (the module docstring) replaced by one ``FusedGelu`` or
    ``FusedSilu`` at the place of the chain's last node, named as it."""
    around = _Neighbours.of(nodes, tensors)
    found = _Replacements()
    tried: set[str] = set()
    for proto, _ in nodes:
        for x in dict.fromkeys(proto.input):
            if x in tried or len(around.readers_of.get(x, [])) < 2 or not tensors.is_float(x):
                continue
            tried.add(x)
            chain = _activation_chain(x, around)
            if chain is None:
                continue
            members, activation = chain
            outputs = [n.output[0] for n in members]
            name = around.producer[outputs[-1]][1]
            node = fused_node(activation.op, [x], outputs[-1], name, **activation.attributes)
            found.add(node, name, outputs[:-1])
    return found.applied(nodes)


def _activation_chain(x: str, around: _Neighbours) -> tuple[list[NodeProto], _Activation] | None:
    """The nodes of an activation of ``x`` in topological order (the last one's output is
    its result) and which it is, or None: the elementwise nodes computed from ``x`` and
    constant scalars alone are grown from ``x`` in order, and the first value among them
    that is an activation's on the probe values, with nothing outside reading the values
    before it, ends the chain."""
    values: dict[str, np.ndarray] = {x: _PROBE}
    members: list[NodeProto] = []
    frontier = [x]
    while frontier and len(members) < _CHAIN_MAX_NODES:
        tensor = frontier.pop(0)
        for node in around.readers_of.get(tensor, []):
            if node.output[0] in values or not _computable(node, values, around.tensors):
                continue
            scalar = around.tensors.scalar
            operands = [values[t] if t in values else scalar(t) for t in node.input]
            with np.errstate(all="ignore"):
                values[node.output[0]] = _ELEMENTWISE[node.op_type](*operands)
            members.append(node)
            frontier.append(node.output[0])
            found = _activation_ending(x, members, values, around.tensors)
            if found is not None:
                return found
    return None


def _computable(node: NodeProto, values: Mapping[str, np.ndarray], tensors: Tensors) -> bool:
    """Whether ``node`` is an elementwise operator of ONNX's domain, with one output, whose
    every input is a value of the chain or a constant scalar."""
    if node.op_type not in _ELEMENTWISE or node.domain not in DEFAULT_DOMAINS:
        return False
    if len(node.output) != 1 or not node.input:
        return False
    return all(t in values or tensors.scalar(t) is not None for t in node.input)


def _activation_ending(
    x: str,
    members: Sequence[NodeProto],
    values: Mapping[str, np.ndarray],
    tensors: Tensors,
) -> tuple[list[NodeProto], _Activation] | None:
    """``members`` ending in its last node as an activation of ``x``, and which, where the
    last node's value is the activation's and the nodes it needs are the chain: each read
    only inside it, the activation's core operator among them."""
    y = members[-1].output[0]
    result = values[y]
    if np.shape(result) != _PROBE.shape or tensors.shape(y) is None:
        return None
    if tensors.shape(y) != tensors.shape(x) or not tensors.is_float(y):
        return None
    activation = next(
        (a for a in _ACTIVATIONS if np.allclose(result, a.values, atol=_TOLERANCE)), None
    )
    if activation is None:
        return None
    producers = {m.output[0]: m for m in members}
    needed: dict[int, NodeProto] = {}
    stack = [members[-1]]
    while stack:
        node = stack.pop()
        if id(node) not in needed:
            needed[id(node)] = node
            stack.extend(producers[t] for t in node.input if t in producers)
    chain = [m for m in members if id(m) in needed]
    if not any(m.op_type == activation.core for m in chain):
        return None
    reads_inside: dict[str, int] = {}
    for node in chain:
        for tensor in dict.fromkeys(node.input):  # as ``readers`` counts: once per node
            reads_inside[tensor] = reads_inside.get(tensor, 0) + 1
    for node in chain[:-1]:
        if tensors.readers.get(node.output[0], 0) != reads_inside.get(node.output[0], 0):
            return None
    return chain, activation


# --- normalizations ---------------------------------------------------------------------


def fuse_layer_norms(
    nodes: Sequence[tuple[NodeProto, str]],
    tensors: Tensors,
) -> list[tuple[NodeProto, str]]:
    """``nodes`` (as for ``fuse_linear_layers``) with every layer normalization written as
    its formula (the module docstring) replaced by one ``FusedLayerNorm`` at the place of
    its last node, named as it."""
    return _fuse_normalizations(nodes, tensors, LAYER_NORM, _layer_norm_chain)


_NormChain = Callable[
    [NodeProto, _Neighbours], tuple[list[NodeProto], list[str], int, float] | None
]


def _fuse_normalizations(
    nodes: Sequence[tuple[NodeProto, str]], tensors: Tensors, op: str, chain_of: _NormChain
) -> list[tuple[NodeProto, str]]:
    """``nodes`` with each normalization ``chain_of`` finds from a ``ReduceMean`` (its
    nodes, the fused node's inputs, axis and epsilon) replaced by one ``op`` at the place
    of its last node, named as it."""
    around = _Neighbours.of(nodes, tensors)
    found = _Replacements()
    for proto, _ in nodes:
        if proto.op_type != "ReduceMean" or proto.domain not in DEFAULT_DOMAINS:
            continue
        chain = chain_of(proto, around)
        if chain is None:
            continue
        members, inputs, axis, epsilon = chain
        outputs = [m.output[0] for m in members]
        name = around.producer[outputs[-1]][1]
        node = fused_node(op, inputs, outputs[-1], name, axis=axis, epsilon=epsilon)
        found.add(node, name, outputs[:-1])
    return found.applied(nodes)


def _layer_norm_chain(
    mean: NodeProto, around: _Neighbours
) -> tuple[list[NodeProto], list[str], int, float] | None:
    """The nodes of the layer normalization whose first mean is ``mean`` (in order; the
    last one's output is its result), the fused node's inputs, its axis and epsilon; or
    None where the chain is not one ``fuse_layer_norms`` fuses."""
    tensors = around.tensors
    x = mean.input[0] if mean.input else ""
    x_shape = tensors.shape(x) if x else None
    axes = _trailing_axes(mean, x_shape, tensors)
    if x_shape is None or axes is None or not tensors.is_float(x):
        return None
    centre = around.only_reader(mean.output[0], ("Sub",))
    if centre is None or list(centre.input) != [x, mean.output[0]]:
        return None
    d = centre.output[0]
    d_readers = around.readers_of.get(d, [])
    square = next((n for n in d_readers if n.op_type in ("Pow", "Mul")), None)
    divide = next((n for n in d_readers if n.op_type == "Div"), None)
    if square is None or divide is None or len(d_readers) != 2:
        return None
    if square.op_type == "Pow" and not (
        square.input[0] == d and tensors.scalar(square.input[1]) == 2.0
    ):
        return None
    if square.op_type == "Mul" and list(square.input) != [d, d]:
        return None
    variance = around.only_reader(square.output[0], ("ReduceMean",))
    if variance is None or _trailing_axes(variance, x_shape, tensors) != axes:
        return None
    shifted = around.only_reader(variance.output[0], ("Add",))
    if shifted is None:
        return None
    epsilon = _other_scalar(shifted, variance.output[0], tensors)
    std = around.only_reader(shifted.output[0], ("Sqrt",))
    if epsilon is None or std is None or list(divide.input) != [d, std.output[0]]:
        return None
    if around.only_reader(std.output[0], ("Div",)) is not divide:
        return None
    normalised = (*x_shape[len(x_shape) - axes :],)
    scaled = around.only_reader(divide.output[0], ("Mul",))
    weight = None if scaled is None else _other(scaled, divide.output[0])
    if (
        scaled is None
        or weight is None
        or not tensors.constant(weight)
        or tensors.shape(weight) != normalised
    ):
        return None
    members = [mean, centre, square, variance, shifted, std, divide, scaled]
    inputs = [x, weight]
    shifted_by = around.only_reader(scaled.output[0], ("Add",))
    bias = None if shifted_by is None else _other(shifted_by, scaled.output[0])
    if (
        shifted_by is not None
        and bias is not None
        and tensors.constant(bias)
        and tensors.shape(bias) == normalised
    ):
        members.append(shifted_by)
        inputs.append(bias)
    if not all(tensors.is_float(t) for t in [*inputs, members[-1].output[0]]):
        return None
    return members, inputs, -axes, epsilon


def _trailing_axes(mean: NodeProto, x_shape: Shape | None, tensors: Tensors) -> int | None:
    """How many trailing axes a ``ReduceMean`` averages while keeping them, its axes an
    attribute (before opset 18) or a constant input (from 18 on); None for any other
    reduction."""
    attrs = {a.name: helper.get_attribute_value(a) for a in mean.attribute}
    if x_shape is None or int(attrs.get("keepdims", 1)) != 1:
        return None
    if len(mean.input) == 1:
        listed: Sequence[int] | None = attrs.get("axes", [])
    else:
        listed = tensors.ints(mean.input[1]) if len(mean.input) == 2 else None
    if listed is None:
        return None
    rank = len(x_shape)
    axes = sorted(int(a) + rank if int(a) < 0 else int(a) for a in listed)
    if not axes or axes != list(range(rank - len(axes), rank)):
        return None
    return len(axes)


def _other(node: NodeProto, tensor: str) -> str | None:
    """The other input of a two-input ``node`` that reads ``tensor``."""
    if len(node.input) != 2 or tensor not in node.input or node.input[0] == node.input[1]:
        return None
    return node.input[1] if node.input[0] == tensor else node.input[0]


def _other_scalar(node: NodeProto, tensor: str, tensors: Tensors) -> float | None:
    other = _other(node, tensor)
    return None if other is None else tensors.scalar(other)


def fuse_rms_norms(
    nodes: Sequence[tuple[NodeProto, str]],
    tensors: Tensors,
) -> list[tuple[NodeProto, str]]:
    """``nodes`` (as for ``fuse_linear_layers``) with every RMS normalization written as
    its formula (the module docstring) replaced by one ``FusedRMSNorm`` at the place of
    its last node, named as it."""
    return _fuse_normalizations(nodes, tensors, RMS_NORM, _rms_norm_chain)


def _rms_norm_chain(
    mean: NodeProto, around: _Neighbours
) -> tuple[list[NodeProto], list[str], int, float] | None:
    """The nodes of the RMS normalization whose mean of squares is ``mean`` (in order; the
    last one's output is its result), the fused node's inputs, its axis and epsilon; or
    None where the chain is not one ``fuse_rms_norms`` fuses."""
    tensors = around.tensors
    found = around.producer.get(mean.input[0]) if mean.input else None
    square = found[0] if found is not None else None
    if square is None or square.domain not in DEFAULT_DOMAINS:
        return None
    if around.only_reader(square.output[0], ("ReduceMean",)) is not mean:
        return None
    x = square.input[0]
    if square.op_type == "Pow":
        if tensors.scalar(square.input[1]) != 2.0:
            return None
    elif square.op_type != "Mul" or list(square.input) != [x, x]:
        return None
    x_shape = tensors.shape(x)
    axes = _trailing_axes(mean, x_shape, tensors)
    if x_shape is None or axes is None or not tensors.is_float(x):
        return None
    shifted = around.only_reader(mean.output[0], ("Add",))
    epsilon = None if shifted is None else _other_scalar(shifted, mean.output[0], tensors)
    root = None if shifted is None else around.only_reader(shifted.output[0], ("Sqrt",))
    if shifted is None or epsilon is None or root is None:
        return None
    inverse = around.only_reader(root.output[0], ("Div", "Reciprocal"))
    if inverse is None:
        return None
    if inverse.op_type == "Div" and (
        inverse.input[1] != root.output[0] or tensors.scalar(inverse.input[0]) != 1.0
    ):
        return None
    normalised = around.only_reader(inverse.output[0], ("Mul",))
    if normalised is None or _other(normalised, inverse.output[0]) != x:
        return None
    scaled = around.only_reader(normalised.output[0], ("Mul",))
    weight = None if scaled is None else _other(scaled, normalised.output[0])
    shape = (*x_shape[len(x_shape) - axes :],)
    if scaled is None or weight is None or not tensors.constant(weight):
        return None
    if tensors.shape(weight) != shape or not tensors.is_float(scaled.output[0]):
        return None
    members = [square, mean, shifted, root, inverse, normalised, scaled]
    return members, [x, weight], -axes, epsilon
