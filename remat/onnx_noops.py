"""Operators that compute nothing, bypassed at ingest: ``Identity``, a ``Cast`` to the type
its input has, a ``Dropout`` that is the identity, a ``Concat`` of one input, a ``Pad``
by zero, and a ``Reshape``, ``Flatten``, ``Squeeze``, ``Unsqueeze`` or ``Expand`` to its
input's shape.

Exporters write all of them. A training-mode export of a module whose dropout
probability is 0 (attention dropout in LLaMA-style models and in many Hugging Face
configurations, a module made deterministic for a check) has ``Dropout`` with ratio 0
and training mode true; inference graphs from older exporters keep their ``Dropout``
nodes (the ONNX model zoo's AlexNet, VGG, SqueezeNet, Inception), which Remat, like
every inference runtime, runs as the identity. A module's ``.to(torch.float32)`` of a
float32 tensor (T5's and LLaMA's RMS normalization compute their variance in float32
whatever the model's type) is a ``Cast`` to the same type. ``Identity`` is left behind
by exporters and graph rewriters; a traced module's shape arithmetic leaves a ``Concat``
of one part and a ``Reshape`` to the shape its input has (GPT-2's, T5's and DenseNet's
exports), and a module that pads to a multiple (Swin's windows) a ``Pad`` by zero where
its input is one already. Planned, each is a node whose value is its input's: a plan
holds or frees a value of its own, its backward node passes the gradient through, and an
executor runs a step each way where PyTorch runs nothing (its dropout at p = 0 and
``.to`` of the same type return their input). Bypassed, the readers of its output read
its input.

A ``Dropout`` is the identity, as the kernels run it (``agents.kernels.dropout_ratio``),
before opset 12 (which has no training mode), and from it on where its training mode is
omitted or a constant false, or its ratio is a constant 0 (with training mode a
constant). A node is bypassed when the scheduled operators alone read its output (not a
model output, whose name the graph must keep, nor a folded operator's input: a ``Shape``
of it, which the agent evaluates by name) and nothing reads a ``Dropout``'s mask.

As ONNX optimizers' ``eliminate_identity`` and ``eliminate_nop_*`` passes (cast,
dropout, concat, pad, reshape, flatten, expand) do; here on the scheduled operators,
after constant folding and before the fusions (a bypassed node no longer stands between
the members of a chain).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

from onnx import NodeProto

from remat.onnx_fusion import DEFAULT_DOMAINS, Tensors

# Operators that only reshape or broadcast: the identity where the shape stays
_RESHAPING = frozenset(("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand"))


def bypass_noops(
    nodes: Sequence[tuple[NodeProto, str]],
    tensors: Tensors,
    opset: int,
) -> tuple[list[tuple[NodeProto, str]], Tensors]:
    """``nodes`` (scheduled operators with their graph names, in topological order) without
    the ones that compute nothing, their readers reading their inputs instead, and
    ``tensors`` with its reader counts moved with them (``opset``: the model's
    default-domain opset). The protos of the caller's model are not modified: a node whose
    inputs change is a copy."""
    # reads by the scheduled operators: an output also read by a folded one (a Shape of
    # it) or a model output (``tensors.readers`` counts both) is kept, since what reads it
    # outside the graph reads it by name
    scheduled = Counter(tensor for proto, _ in nodes for tensor in proto.input)
    alias: dict[str, str] = {}  # a bypassed node's output -> the tensor it passes on
    kept: list[tuple[NodeProto, str]] = []
    for proto, name in nodes:
        proto = reading(proto, [alias.get(tensor, tensor) for tensor in proto.input])
        read_here = bool(proto.output) and (
            tensors.readers.get(proto.output[0], 0) == scheduled[proto.output[0]]
        )
        if read_here and _is_noop(proto, tensors, opset):
            alias[proto.output[0]] = proto.input[0]
        else:
            kept.append((proto, name))
    return kept, replace(tensors, readers=_moved(tensors.readers, alias))


def reading(proto: NodeProto, inputs: Sequence[str]) -> NodeProto:
    """``proto`` reading ``inputs`` (one name per input position, ``""`` where omitted):
    itself where they are its own, else a copy (the caller's model is not modified)."""
    if list(inputs) == list(proto.input):
        return proto
    copy = NodeProto()
    copy.CopyFrom(proto)
    del copy.input[:]
    copy.input.extend(inputs)
    return copy


def _is_noop(proto: NodeProto, tensors: Tensors, opset: int) -> bool:
    if proto.domain not in DEFAULT_DOMAINS or not proto.input or not proto.input[0]:
        return False
    if proto.op_type == "Identity" or (proto.op_type == "Concat" and len(proto.input) == 1):
        return True
    if proto.op_type in _RESHAPING:
        shape = tensors.shape(proto.input[0])
        return shape is not None and shape == tensors.shape(proto.output[0])
    if proto.op_type == "Pad":
        return _pads_nothing(proto, tensors)
    if proto.op_type in ("Cast", "CastLike"):
        source = tensors.elem_type(proto.input[0])
        return source is not None and source == tensors.elem_type(proto.output[0])
    if proto.op_type != "Dropout":
        return False
    mask = proto.output[1] if len(proto.output) > 1 else ""
    return not (mask and tensors.readers.get(mask, 0)) and _dropout_is_identity(
        proto, tensors, opset
    )


def _dropout_is_identity(proto: NodeProto, tensors: Tensors, opset: int) -> bool:
    if opset < 12:
        return True
    training = proto.input[2] if len(proto.input) > 2 else ""
    if not training:
        return True
    mode = tensors.flag(training)
    if mode is None:  # decided at run time
        return False
    ratio = proto.input[1] if len(proto.input) > 1 else ""
    return not mode or (bool(ratio) and tensors.scalar(ratio) == 0.0)


def _pads_nothing(proto: NodeProto, tensors: Tensors) -> bool:
    """A ``Pad`` by zero on every side: its ``pads`` a constant input of zeros (opset 11
    on), or an attribute of zeros (before)."""
    if len(proto.input) > 1 and proto.input[1]:
        return tensors.is_zero(proto.input[1])
    pads = next((a for a in proto.attribute if a.name == "pads"), None)
    return pads is not None and not any(pads.ints)


def _moved(readers: Mapping[str, int], alias: Mapping[str, str]) -> Counter[str]:
    """Reader counts where each bypassed output's readers (scheduled operators alone) read
    its source, which loses the bypassed node's own read."""
    moved = Counter(readers)
    for output, source in alias.items():
        moved[source] += moved.pop(output, 0) - 1
    return moved
