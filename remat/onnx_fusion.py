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
``scale``; its gradient reads its inputs, not ``P``. A row whose every score is masked
(-inf) gets zero weights, as in PyTorch, where ONNX's ``Softmax`` alone gives NaN. A chain
is fused when nothing else reads its intermediate values, ``A``, ``B`` and ``V`` have the
same batch dimensions (three or more dimensions), the mask broadcasts to the scores, a
scale is a constant scalar, and every tensor is a float.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from onnx import NodeProto, helper

FUSED_DOMAIN = "ai.remat"
DEFAULT_DOMAINS = ("", "ai.onnx")  # how a model may name ONNX's own domain
MATMUL_ADD = "MatMulAdd"
ATTENTION = "ScaledDotProductAttention"
FUSED_OPS = frozenset({MATMUL_ADD, ATTENTION})

Shape = tuple[int, ...]


def fused_node(
    op: str, inputs: Sequence[str], output: str, name: str, **attributes: float
) -> NodeProto:
    """A node of one of ``FUSED_OPS``."""
    node = helper.make_node(op, inputs, [output], name=name, domain=FUSED_DOMAIN)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in attributes.items())
    return node


def fuse_linear_layers(
    nodes: Sequence[tuple[NodeProto, str]],
    readers: Mapping[str, int],
    constant: Callable[[str], bool],
    shape: Callable[[str], Shape | None],
    is_float: Callable[[str], bool],
) -> list[tuple[NodeProto, str]]:
    """``nodes`` (scheduled operators with their graph names, in topological order) with
    every fusable ``MatMul`` and bias ``Add`` replaced by one ``MatMulAdd`` at the ``Add``'s
    place. ``readers[t]``: how many operators of the model read tensor ``t`` (a model
    output counts as a reader); ``constant``, ``shape`` and ``is_float`` describe a tensor
    as ingestion found it."""
    products = {
        proto.output[0]: (proto, name)
        for proto, name in nodes
        if _is_matmul(proto) and readers.get(proto.output[0], 0) == 1
    }
    fused: dict[str, tuple[NodeProto, str]] = {}  # the MatMul's output -> the fused node
    for proto, _ in nodes:
        if not _is_add(proto):
            continue
        for position in (0, 1):
            product, bias = proto.input[position], proto.input[1 - position]
            matmul = products.get(product)
            if matmul is None or product == bias or not constant(bias):
                continue
            a, w = matmul[0].input
            if _fusable(shape(a), shape(w), shape(bias)) and all(
                is_float(t) for t in (a, w, bias, proto.output[0])
            ):
                node = fused_node(MATMUL_ADD, [a, w, bias], proto.output[0], matmul[1])
                fused[product] = (node, matmul[1])
                break
    if not fused:
        return list(nodes)
    result = []
    for proto, name in nodes:
        if _is_matmul(proto) and proto.output[0] in fused:
            continue  # computed by the fused node, at the Add's place
        if _is_add(proto):
            product = next((t for t in proto.input if t in fused), None)
            if product is not None:
                result.append(fused[product])
                continue
        result.append((proto, name))
    return result


def fuse_attention_chains(
    nodes: Sequence[tuple[NodeProto, str]],
    readers: Mapping[str, int],
    shape: Callable[[str], Shape | None],
    is_float: Callable[[str], bool],
    scalar: Callable[[str], float | None],
    opset: int,
) -> list[tuple[NodeProto, str]]:
    """``nodes`` (as for ``fuse_linear_layers``) with every fusable attention chain replaced
    by one ``ScaledDotProductAttention`` at the place of its last ``MatMul``. ``scalar``
    gives a constant scalar's value (None for anything else); ``opset`` is the model's
    default-domain opset (``Softmax``'s default axis depends on it)."""
    producer = {out: entry for entry in nodes for out in entry[0].output if out}
    fused: dict[str, tuple[NodeProto, str]] = {}  # the last MatMul's output -> fused node
    absorbed: set[str] = set()  # outputs of the nodes a fused node replaces
    for proto, _ in nodes:
        if _is_matmul(proto):
            chain = _attention_chain(proto, producer, readers, shape, is_float, scalar, opset)
            if chain is not None:
                node, removed = chain
                fused[proto.output[0]] = (node, node.name)
                absorbed.update(removed)
    if not fused:
        return list(nodes)
    result = []
    for proto, name in nodes:
        if proto.output and proto.output[0] in fused:
            result.append(fused[proto.output[0]])
        elif not (proto.output and proto.output[0] in absorbed):
            result.append((proto, name))
    return result


def _attention_chain(
    last: NodeProto,
    producer: Mapping[str, tuple[NodeProto, str]],
    readers: Mapping[str, int],
    shape: Callable[[str], Shape | None],
    is_float: Callable[[str], bool],
    scalar: Callable[[str], float | None],
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
        return found[0] if readers.get(tensor, 0) == 1 and len(found[0].input) == 2 else None

    def scaled(tensor: str) -> tuple[str, float]:
        """``tensor`` without a ``Mul`` or ``Div`` by a constant scalar (the node is then
        removed with the chain), and that scalar; else ``tensor`` and 1."""
        node = step(tensor, ("Mul", "Div"))
        for position in (0, 1) if node is not None and node.op_type == "Mul" else (0,):
            factor = scalar(node.input[1 - position]) if node is not None else None
            if node is not None and factor is not None and factor != 0.0:
                removed.append(tensor)
                return node.input[position], factor if node.op_type == "Mul" else 1.0 / factor
        return tensor, 1.0

    p, v = last.input
    weights_readers = 1
    zeroed = _nan_zeroed(p, producer, readers, scalar)
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
    if readers.get(p, 0) != weights_readers:
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
    if not all(is_float(t) for t in [*inputs, last.output[0]]):
        return None
    if not _attention_shapes([shape(t) for t in inputs], _softmax_axis(softmax[0], opset)):
        return None
    node = fused_node(
        ATTENTION, inputs, last.output[0], matmul.name, scale=scale * scale_a * scale_b
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
    readers: Mapping[str, int],
    scalar: Callable[[str], float | None],
) -> tuple[str, str] | None:
    """Where ``tensor`` is ``Where(IsNaN(P), 0, P)`` read once (PyTorch's dynamo exporter
    writes attention's weights so, as ``scaled_dot_product_attention`` zeroes a row whose
    every score is masked): ``P`` and the ``IsNaN``'s output; else None."""
    where = producer.get(tensor)
    if where is None or where[0].op_type != "Where" or readers.get(tensor, 0) != 1:
        return None
    condition, zero, weights = where[0].input
    isnan = producer.get(condition)
    if isnan is None or isnan[0].op_type != "IsNaN" or list(isnan[0].input) != [weights]:
        return None
    if readers.get(condition, 0) != 1 or scalar(zero) != 0.0:
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


def _is_add(proto: NodeProto) -> bool:
    return proto.op_type == "Add" and proto.domain in DEFAULT_DOMAINS and len(proto.input) == 2


def _fusable(a: Shape | None, w: Shape | None, bias: Shape | None) -> bool:
    if a is None or w is None or bias is None:
        return False
    return len(a) >= 2 and len(w) == 2 and a[-1] == w[0] and bias == (w[1],)
