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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from onnx import NodeProto, helper

FUSED_DOMAIN = "ai.remat"
MATMUL_ADD = "MatMulAdd"

Shape = tuple[int, ...]


def matmul_add(a: str, w: str, bias: str, output: str, name: str) -> NodeProto:
    """The fused node ``output = a @ w + bias``."""
    return helper.make_node(MATMUL_ADD, [a, w, bias], [output], name=name, domain=FUSED_DOMAIN)


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
                fused[product] = (matmul_add(a, w, bias, proto.output[0], matmul[1]), matmul[1])
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


def _is_matmul(proto: NodeProto) -> bool:
    return proto.op_type == "MatMul" and proto.domain in ("", "ai.onnx") and len(proto.input) == 2


def _is_add(proto: NodeProto) -> bool:
    return proto.op_type == "Add" and proto.domain in ("", "ai.onnx") and len(proto.input) == 2


def _fusable(a: Shape | None, w: Shape | None, bias: Shape | None) -> bool:
    if a is None or w is None or bias is None:
        return False
    return len(a) >= 2 and len(w) == 2 and a[-1] == w[0] and bias == (w[1],)
