"""ONNX ingestion: model file -> forward graph.

Steps: load and check the model (``load_model``); give every graph input a concrete shape
(from the file, ``batch`` or ``inputs``); infer shapes with ONNX (data propagation on);
fold constants in one topological pass; fuse each ``Linear`` layer's ``MatMul`` and bias
``Add`` (or ``Gemm`` between the ``Reshape``'s that flatten and restore its input) into one
operator, each GELU, SiLU, layer and RMS normalization written as its formula,
the ``Gather``'s that unbind a packed projection, where asked each attention chain, and each
chain of layout operators (``remat.onnx_fusion``);
build one ``FORWARD`` node per remaining operator.

Folding. A node is *constant* when it is a standard ONNX operator without subgraphs or
randomness and every tensor it reads is constant (an initializer or a folded output), or
when it is ``Shape``/``Size`` of a tensor whose shape is static. Constant nodes are not
scheduled: the constants that scheduled nodes read become fixed ``PARAMETER`` tensors.
Values are computed (numpy, ``onnx.reference``) only where a shape depends on them and
ONNX's own data propagation did not get it (e.g. ``Shape`` before opset 15): the nodes it
could not infer are re-inferred one at a time with those values.

A model's external data stays on disk: only shapes are needed, and it may be read from
nowhere but the model's own directory (``remat.onnx_external``).
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import AttributeProto, NodeProto, TensorProto, helper, numpy_helper

from remat import ops
from remat.devices import MAX_BYTES, format_bytes
from remat.errors import EmptyModelError, InvalidInputError, ModelLoadError, ShapeError
from remat.graph import FixedKind, FixedTensor, Graph, Mode, Node, NodeKind
from remat.onnx_external import check_external_data
from remat.onnx_fusion import (
    DEFAULT_DOMAINS,
    FUSED_DOMAIN,
    ROTARY,
    Tensors,
    fuse_activation_chains,
    fuse_attention_chains,
    fuse_flattened_gemms,
    fuse_grouped_heads,
    fuse_layer_norms,
    fuse_layout_chains,
    fuse_linear_layers,
    fuse_rms_norms,
    fuse_rotary_embeddings,
    fuse_unbinds,
)
from remat.onnx_noops import bypass_noops
from remat.training import differentiable_input

if TYPE_CHECKING:
    from onnx.reference.op_run import OpRun

Dim = int | str | None  # int: known; str: symbolic name; None: unknown
# Random generators produce a fresh tensor per step: an activation, not a constant.
_NEVER_FOLD = frozenset(
    [
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
    ]
)
_SHAPE_OPS = frozenset(("Shape", "Size"))
# Operators whose output can be far larger than their inputs: folded only when shape
# inference tells the output's size first.
_EXPANDING = frozenset(
    ["ConstantOfShape", "Expand", "Tile", "Range", "Resize", "Upsample", "Pad", "OneHot",
     "EyeLike", "Constant", "MatMul", "Gemm", "Einsum", "Col2Im", "CenterCropPad"]
)  # fmt: skip
# Float initializers larger than this are handed to shape inference as typed inputs, so
# their bytes are never copied or serialized; shape-like tensors are always small ints.
_LARGE_INITIALIZER = 64
_FLOAT_TYPES = frozenset(
    (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
)
_INDEX_TYPES = frozenset((TensorProto.INT32, TensorProto.INT64))  # a Gather's indices
# Models are refused above this many nodes (subgraphs included): ingestion's time grows
# with them, and the largest networks Remat plans are far below.
MAX_NODES = 100_000
# A folded constant whose value is computed may take at most this many bytes: a file of a
# few bytes can ask for any size (``ConstantOfShape`` of a huge shape).
MAX_CONSTANT_BYTES = 256 << 20
# A score plus a mask entry at most this: its weight's exponential is zero in any float
# type beside the scores of a row, as the -inf of a causal mask
CAUSAL_MASKED = -1e4
# Constant values up to this many elements are handed to single-node shape inference
# (shape-like data is tiny; weights are not needed and costly to read).
_MAX_DATA_ELEMENTS = 1024


# --- element sizes ----------------------------------------------------------------------

_BITS_BY_NAME = {
    "FLOAT": 32, "UINT8": 8, "INT8": 8, "UINT16": 16, "INT16": 16, "INT32": 32, "INT64": 64,
    # Strings have no fixed size; count a pointer per element.
    "STRING": 64,
    "BOOL": 8, "FLOAT16": 16, "DOUBLE": 64, "UINT32": 32, "UINT64": 64, "COMPLEX64": 64,
    "COMPLEX128": 128, "BFLOAT16": 16, "FLOAT8E4M3FN": 8, "FLOAT8E4M3FNUZ": 8,
    "FLOAT8E5M2": 8, "FLOAT8E5M2FNUZ": 8, "FLOAT8E8M0": 8, "UINT4": 4, "INT4": 4,
    "FLOAT4E2M1": 4, "UINT2": 2, "INT2": 2,
}  # fmt: skip
# Resolved by name so that element types newer or older than this onnx build are skipped.
_BITS = {
    getattr(TensorProto, name): bits
    for name, bits in _BITS_BY_NAME.items()
    if hasattr(TensorProto, name)
}


def _element_bits(elem_type: int) -> int:
    try:
        return _BITS[elem_type]
    except KeyError:
        raise ShapeError(f"unsupported tensor element type {elem_type}") from None


@dataclass(frozen=True)
class TensorInfo:
    """Element type and shape of one tensor; ``shape`` is None when even the rank is unknown."""

    elem_type: int
    shape: tuple[Dim, ...] | None

    @property
    def static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    @property
    def dims(self) -> tuple[int, ...]:
        """The concrete shape; only valid when ``static``."""
        return self.shape  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        # Sub-byte types (int4, float4) pack; round the last byte up.
        return (math.prod(self.dims) * _element_bits(self.elem_type) + 7) // 8

    def describe(self) -> str:
        if self.shape is None:
            return "unknown rank"
        return "(" + ", ".join("?" if d is None else str(d) for d in self.shape) + ")"


class _NodeError(ShapeError):
    """Why one node cannot be planned: ``reason`` says it, and what would be needed,
    without naming the node (nodes with the same operator and reason are listed together)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _check_tensor_size(info: TensorInfo, what: str) -> None:
    """Refuse a tensor larger than any device (a file of a few bytes can declare any
    shape), saying the bytes it would need."""
    nbytes = info.nbytes
    if nbytes > MAX_BYTES:
        raise _NodeError(
            f"{what} has shape {info.describe()}: it would need {nbytes} bytes "
            f"({format_bytes(nbytes)}), more than any device holds "
            f"(at most {format_bytes(MAX_BYTES)})",
            f"an output would need {nbytes} bytes, more than any device holds",
        )


# --- loading ------------------------------------------------------------------------------


def load_model(
    source: str | Path | bytes,
    *,
    external_data_dir: Path | None = None,
    max_nodes: int = MAX_NODES,
) -> onnx.ModelProto:
    """Parse and check an ONNX model from a path or from its bytes.

    External data (tensors stored in other files) is refused unless
    ``external_data_dir`` names the directory the model's files live in, and then read
    from nowhere else (``remat.onnx_external``); it stays on disk either way. A model with
    more than ``max_nodes`` nodes (subgraphs and functions included) is refused before any
    work that grows with it. Nodes are put in topological order first (the checker insists
    on it, files do not always follow it). Raises ModelLoadError.
    """
    path = None if isinstance(source, bytes | bytearray | memoryview) else Path(source)
    data = bytes(source) if path is None else _read_file(path)  # type: ignore[arg-type]
    model = _parse(data)
    nodes = count_nodes(model)
    if nodes > max_nodes:
        raise ModelLoadError(f"the model has {nodes} nodes; at most {max_nodes} are accepted")
    check_external_data(model, external_data_dir)
    _sort_graph_in_place(model.graph)
    _check(model, path)
    return model


def count_nodes(model: onnx.ModelProto) -> int:
    """Every node of the model: its graph's, its subgraphs' and its functions'."""
    graphs = [model.graph]
    total = sum(len(f.node) for f in model.functions)
    while graphs:
        graph = graphs.pop()
        total += len(graph.node)
        graphs.extend(g for node in graph.node for g in _subgraphs(node))
    return total


def _read_file(path: Path) -> bytes:
    if not path.exists():
        raise ModelLoadError(f"no such file: {path}")
    if not path.is_file():
        raise ModelLoadError(f"not a file: {path}")
    try:
        return path.read_bytes()
    except OSError as error:
        raise ModelLoadError(f"cannot read {path}: {_first_line(error)}") from error


def _parse(data: bytes) -> onnx.ModelProto:
    if not data:
        raise ModelLoadError("not an ONNX model: the file is empty")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as error:
        what = "truncated or corrupt ONNX file" if _starts_like_onnx(data) else "not an ONNX model"
        raise ModelLoadError(f"{what}: {_first_line(error)}") from error
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise ModelLoadError("not an ONNX model: no IR version or graph")
    return model


def _starts_like_onnx(data: bytes) -> bool:
    # A serialized ModelProto starts with field 1 (ir_version, varint): tag 0x08, then a
    # small version number.
    return len(data) >= 2 and data[0] == 0x08 and 1 <= data[1] <= 32


def _check(model: onnx.ModelProto, path: Path | None) -> None:
    # With external data the checker must see the file, to resolve the data locations.
    by_path = path is not None and _uses_external_data(model)
    try:
        onnx.checker.check_model(str(path) if by_path else model, full_check=False)
    except Exception as error:  # the checker raises several unrelated types
        raise ModelLoadError(f"model fails onnx.checker: {_first_line(error)}") from error


def _uses_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)


def _first_line(error: BaseException) -> str:
    """The gist of an error on one line: its first line, or two when the first ends in a
    colon (the checker's "... of node:" is followed by the node)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    line = " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return line if len(line) <= 300 else line[:297] + "..."


# --- topological order --------------------------------------------------------------------


def _subgraphs(node: NodeProto) -> Iterable[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == AttributeProto.GRAPHS:
            yield from attr.graphs


def _has_subgraph(node: NodeProto) -> bool:
    return any(a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS) for a in node.attribute)


def _outer_reads(graph: onnx.GraphProto) -> list[str]:
    """Names a subgraph reads from enclosing scopes (If/Loop/Scan bodies)."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    reads: dict[str, None] = {}
    for node in graph.node:
        inner = [*node.input, *(n for g in _subgraphs(node) for n in _outer_reads(g))]
        reads.update((name, None) for name in inner if name and name not in defined)
        defined.update(node.output)
    return list(reads)


def _reads(node: NodeProto) -> list[str]:
    """Every tensor a node reads, in order and without repeats, subgraph captures included."""
    names = [n for n in node.input if n]
    if _has_subgraph(node):
        names += [n for g in _subgraphs(node) for n in _outer_reads(g)]
    return list(dict.fromkeys(names))


def tensors_read(model: onnx.ModelProto) -> set[str]:
    """Every tensor some node of ``model`` reads (subgraph captures included), and the
    model's outputs: an output of a node not among them is read by nothing."""
    read = {name for node in model.graph.node for name in _reads(node)}
    return read | {v.name for v in model.graph.output}


def _topological_order(nodes: Sequence[NodeProto], reads: Sequence[list[str]]) -> list[int]:
    """Kahn's algorithm; ties go to file order, so sorted files keep their order."""
    producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    users: list[list[int]] = [[] for _ in nodes]
    pending = [0] * len(nodes)
    for i, names in enumerate(reads):
        for before in {producer[n] for n in names if n in producer} - {i}:
            users[before].append(i)
            pending[i] += 1
    ready = [i for i, count in enumerate(pending) if count == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for user in users[i]:
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(ready, user)
    if len(order) < len(nodes):
        stuck = next(i for i, count in enumerate(pending) if count > 0)
        raise ModelLoadError(f"the graph has a cycle through node {_describe(nodes[stuck], stuck)}")
    return order


def _sort_graph_in_place(graph: onnx.GraphProto) -> None:
    nodes = list(graph.node)
    order = _topological_order(nodes, [_reads(n) for n in nodes])
    if order != list(range(len(nodes))):
        sorted_nodes = [nodes[i] for i in order]
        del graph.node[:]
        graph.node.extend(sorted_nodes)


def _describe(node: NodeProto, index: int) -> str:
    return f"{node.name or f'#{index}'!r} ({node.op_type})"


# --- input shapes -------------------------------------------------------------------------


def _info_from_type(type_proto: onnx.TypeProto) -> TensorInfo | None:
    if type_proto.WhichOneof("value") != "tensor_type":
        return None
    tensor = type_proto.tensor_type
    if not tensor.HasField("shape"):
        return TensorInfo(tensor.elem_type, None)
    dims = tuple(
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
    )
    return TensorInfo(tensor.elem_type, dims)


def declared_inputs(model: onnx.ModelProto) -> dict[str, tuple[int | str | None, ...]]:
    """Each real graph input's dimensions as the model states them: a value, a symbolic
    name, or None (unknown); an input without a shape has none listed."""
    params = {t.name for t in model.graph.initializer}
    declared: dict[str, tuple[int | str | None, ...]] = {}
    for value in model.graph.input:
        info = _info_from_type(value.type)
        if value.name not in params and info is not None:
            declared[value.name] = info.shape or ()
    return declared


def _check_dims(label: str, dims: Sequence[int]) -> tuple[int, ...]:
    if not all(isinstance(d, int | np.integer) and not isinstance(d, bool) for d in dims):
        raise InvalidInputError(f"{label}: dimensions must be integers, got {list(dims)}")
    if any(d < 1 for d in dims):
        raise InvalidInputError(f"{label}: dimensions must be positive, got {list(dims)}")
    return tuple(int(d) for d in dims)


def _resolve_input_shapes(
    model: onnx.ModelProto,
    params: Mapping[str, object],
    batch: int | None,
    overrides: Mapping[str, Sequence[int]],
) -> dict[str, TensorInfo]:
    """Concrete shapes for the real graph inputs (old-style models list parameters too)."""
    real = [v for v in model.graph.input if v.name not in params]
    _check_override_names({v.name for v in real}, params, overrides)
    if batch is not None:
        _check_dims("--batch", [batch])
    return {v.name: _input_info(v, batch, overrides.get(v.name)) for v in real}


def _check_override_names(
    names: set[str], params: Mapping[str, object], overrides: Mapping[str, Sequence[int]]
) -> None:
    for name in overrides:
        if name in params:
            raise InvalidInputError(f"input {name!r} is a parameter (initializer), not an input")
        if name not in names:
            known = ", ".join(sorted(names)) or "none"
            raise InvalidInputError(f"unknown input {name!r}; the model's inputs are: {known}")


def _input_info(
    value: onnx.ValueInfoProto, batch: int | None, override: Sequence[int] | None
) -> TensorInfo:
    name = value.name
    declared = _info_from_type(value.type)
    if declared is None:
        raise ShapeError(f"input {name!r} is not a tensor; only tensor inputs are supported")
    if override is not None:
        dims = _check_dims(f"--input {name}", override)
        if declared.shape is not None and len(declared.shape) != len(dims):
            raise InvalidInputError(
                f"--input {name}: model declares rank {len(declared.shape)}, got {len(dims)} dims"
            )
        info = TensorInfo(declared.elem_type, dims)
        _check_tensor_size(info, f"input {name!r}")
        return info
    if declared.shape is None:
        raise ShapeError(f"input {name!r} has no shape: pass --input {name}=DIMS")
    shape = list(declared.shape)
    if batch is not None and shape and not _known(shape[0]):
        shape[0] = batch
    for axis, dim in enumerate(shape):
        if not _known(dim):
            symbol = f" ({dim!r})" if isinstance(dim, str) else ""
            raise ShapeError(
                f"input {name!r} dimension {axis}{symbol} has no value: "
                f"pass --batch or --input {name}=DIMS"
            )
    info = TensorInfo(declared.elem_type, tuple(shape))
    _check_tensor_size(info, f"input {name!r}")
    return info


def _known(dim: Dim) -> bool:
    # Old exporters write 0 (and some -1) for "unknown".
    return isinstance(dim, int) and dim > 0


# --- the working copy and shape inference ------------------------------------------------


def _value_info(name: str, info: TensorInfo) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, info.elem_type, info.shape)


def _is_large_float(tensor: TensorProto) -> bool:
    return tensor.data_type in _FLOAT_TYPES and math.prod(tensor.dims) > _LARGE_INITIALIZER


def _working_model(
    model: onnx.ModelProto, inputs: Mapping[str, TensorInfo], order: Sequence[int]
) -> onnx.ModelProto:
    """A copy for shape inference: sorted nodes, concrete inputs, no stale annotations.

    Declared output and intermediate shapes are dropped because they may contradict the
    shapes the user chose (e.g. a batch of 1 baked into value_info); those of operators
    without a schema are kept, as nothing else can tell their shapes.
    """
    src = model.graph
    # IR 4 lets initializers be absent from graph.input; inference of IR 3 files needs it.
    work = onnx.ModelProto(ir_version=max(model.ir_version, 4))
    work.opset_import.extend(model.opset_import)
    work.functions.extend(model.functions)
    graph = work.graph
    graph.name = src.name
    graph.node.extend(src.node[i] for i in order)
    graph.input.extend(_value_info(name, info) for name, info in inputs.items())
    for tensor in src.initializer:
        if _is_large_float(tensor):
            graph.input.append(_value_info(tensor.name, _initializer_info(tensor)))
        else:
            graph.initializer.append(tensor)
    graph.sparse_initializer.extend(src.sparse_initializer)
    graph.output.extend(_untyped_shape(v) for v in src.output)
    graph.value_info.extend(_schemaless_annotations(model))
    return work


def _untyped_shape(value: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    if copy.type.WhichOneof("value") == "tensor_type":
        copy.type.tensor_type.ClearField("shape")
    return copy


def _schemaless_annotations(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    opsets = _opsets(model)
    outputs = {
        out for node in model.graph.node if _schema(node, opsets) is None for out in node.output
    }
    declared = [*model.graph.value_info, *model.graph.output]
    return [v for v in declared if v.name in outputs and _static_info(v)]


def _static_info(value: onnx.ValueInfoProto) -> bool:
    info = _info_from_type(value.type)
    return info is not None and info.static


def _initializer_info(tensor: TensorProto) -> TensorInfo:
    return TensorInfo(tensor.data_type, tuple(tensor.dims))


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    versions = {o.domain or "": o.version for o in model.opset_import}
    if "ai.onnx" in versions:
        versions.setdefault("", versions["ai.onnx"])
    return versions


def _schema(node: NodeProto, opsets: Mapping[str, int]) -> onnx.defs.OpSchema | None:
    domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
    version = opsets.get(domain)
    if version is None:
        return None
    try:
        return onnx.defs.get_schema(node.op_type, version, domain)
    except onnx.defs.SchemaError:
        return None


def _infer(work: onnx.ModelProto) -> dict[str, TensorInfo]:
    """Shapes by ONNX's inference; with its data propagation only where that is safe.

    Data propagation holds every element of a 1-D tensor it follows in memory (about 150
    bytes each): a ``ConstantOfShape`` or ``Range`` of a length a file chooses would take
    any amount. So a first pass runs without it, and a second with it only when every 1-D
    output of an operator that can make one long has a length known to be short.
    """
    plain = _inferred_infos(work, data_prop=False)
    if not _data_propagation_is_bounded(work, plain):
        return plain
    return _inferred_infos(work, data_prop=True)


def _inferred_infos(work: onnx.ModelProto, data_prop: bool) -> dict[str, TensorInfo]:
    try:
        inferred = onnx.shape_inference.infer_shapes(work, strict_mode=False, data_prop=data_prop)
    except Exception as error:  # InferenceError, ValidationError, protobuf errors
        raise ShapeError(f"shape inference failed: {_first_line(error)}") from error
    graph = inferred.graph
    infos = {t.name: _initializer_info(t) for t in graph.initializer}
    for value in (*graph.input, *graph.value_info, *graph.output):
        info = _info_from_type(value.type)
        if info is not None:
            infos[value.name] = info
    return infos


def _data_propagation_is_bounded(work: onnx.ModelProto, infos: Mapping[str, TensorInfo]) -> bool:
    for node in work.graph.node:
        if node.op_type not in _EXPANDING:
            continue
        for name in node.output:
            info = infos.get(name)
            if info is None or info.shape is None:
                return False
            if len(info.shape) == 1 and not (
                isinstance(info.shape[0], int) and info.shape[0] <= _MAX_DATA_ELEMENTS
            ):
                return False
    return True


# --- constant folding ---------------------------------------------------------------------


# Operators whose outputs, of more than one element, a model may train as written weights
_WRITTEN_WEIGHTS = frozenset({"Constant", "ConstantOfShape"})


@dataclass
class _Folder:
    """Shapes and constant-ness of every tensor, filled in one topological pass."""

    infos: dict[str, TensorInfo]
    params: dict[str, TensorProto]
    opsets: dict[str, int]
    model: onnx.ModelProto
    # Tensors some node reads (subgraph captures included), and the graph's outputs.
    used: set[str] = field(default_factory=set)
    constants: set[str] = field(default_factory=set)
    producers: dict[str, NodeProto] = field(default_factory=dict)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    # Outputs nothing reads whose shapes are unknown: left out of the graph.
    dropped: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.constants.update(self.params)

    def foldable(self, node: NodeProto, reads: Sequence[str]) -> bool:
        if node.domain not in DEFAULT_DOMAINS or node.op_type in _NEVER_FOLD:
            return False
        if _has_subgraph(node):
            return False
        if node.op_type in _SHAPE_OPS and reads:
            return reads[0] in self.constants or self._is_static(reads[0])
        return all(name in self.constants for name in reads)

    def is_weight(self, name: str) -> bool:
        """Whether a constant is trained (a parameter): a float initializer, a float
        ``Constant`` or ``ConstantOfShape`` node's output of more than one element
        (exporters write weights as any of these), or a float value folded from one of
        those through float values (a weight transposed or cast at export). A value folded
        from scalars and from values that are not floats alone (a causal mask chosen by a
        comparison of positions) is a constant, as is every value that is not a float:
        neither has a gradient in the model."""
        seen: set[str] = set()
        stack = [name]
        while stack:
            tensor = stack.pop()
            if tensor in seen or not self.is_float(tensor):
                continue
            seen.add(tensor)
            if tensor in self.params:
                return True
            node = self.producers.get(tensor)
            if node is None or node.op_type in _WRITTEN_WEIGHTS:
                if math.prod(self.infos[tensor].dims) > 1:
                    return True
                continue
            stack.extend(i for i in node.input if i)
        return False

    def fold(self, node: NodeProto) -> None:
        # Values are computed later, and only if a scheduled node's shape needs them.
        outputs = [o for o in node.output if o]
        self.constants.update(outputs)
        self.producers.update((o, node) for o in outputs)

    def complete(self, node: NodeProto, reads: Sequence[str], display: str) -> None:
        """Make sure a scheduled node's inputs and outputs have static shapes."""
        for name in reads:
            if name in self.constants and not self._is_static(name):
                self._materialize(name, display)
        outputs = [o for o in node.output if o]
        failure: ShapeError | None = None
        if not all(self._is_static(o) for o in outputs):
            try:
                self._infer_single(node, reads, display)
            except ShapeError as error:
                failure = error  # raised below only if a used output stays unknown
        for index, name in enumerate(node.output):
            if not name or self._is_static(name):
                continue
            spec = _optional_output_info(node, index, self.infos, self.opsets)
            if spec is not None:
                self.infos[name] = spec
            elif name not in self.used:
                # Nothing reads it: its size cannot matter to a plan (e.g. the mask of
                # an inference-mode Dropout-7 that shape inference leaves untyped).
                self.dropped.add(name)
            elif failure is not None:
                raise failure
            else:
                info = self.infos.get(name)
                shape = "unknown" if info is None else info.describe()
                raise _NodeError(
                    f"cannot infer the shape of output {name!r} of node {display}: "
                    f"got {shape} (data-dependent or symbolic dimension)",
                    "its output shape depends on the data or is symbolic; "
                    "a static output shape is needed",
                )
        for name in outputs:
            if name not in self.dropped:
                _check_tensor_size(self.infos[name], f"output {name!r} of node {display}")

    def _is_static(self, name: str) -> bool:
        info = self.infos.get(name)
        return info is not None and info.static

    def static_dims(self, name: str) -> tuple[int, ...] | None:
        return self.infos[name].dims if self._is_static(name) else None

    def is_float(self, name: str) -> bool:
        info = self.infos.get(name)
        return info is not None and info.elem_type in _FLOAT_TYPES

    def elem_type(self, name: str) -> int | None:
        info = self.infos.get(name)
        return None if info is None else info.elem_type

    def index(self, name: str) -> int | None:
        """The value of a constant integer of rank 0, else None."""
        info = self.infos.get(name)
        if name not in self.constants or info is None or not info.static or info.dims:
            return None
        if info.elem_type not in _INDEX_TYPES:
            return None
        return int(self.value(name, name).reshape(()))

    def ints(self, name: str) -> tuple[int, ...] | None:
        """The values of a constant integer vector of at most 64 elements (a reduction's
        axes from opset 18 on), else None."""
        info = self.infos.get(name)
        if name not in self.constants or info is None or not info.static:
            return None
        if len(info.dims) != 1 or info.dims[0] > 64 or info.elem_type not in _INDEX_TYPES:
            return None
        return tuple(int(v) for v in self.value(name, name).reshape(-1))

    def scalar(self, name: str) -> float | None:
        """The value of a constant of one element (a float), else None."""
        info = self.infos.get(name)
        if name not in self.constants or info is None or not info.static:
            return None
        if math.prod(info.dims) != 1 or info.elem_type not in _FLOAT_TYPES:
            return None
        return float(self.value(name, name).reshape(()))

    def is_zero(self, name: str) -> bool:
        """Whether a constant of at most 64 elements (a Pad's pads) is zero everywhere."""
        info = self.infos.get(name)
        if name not in self.constants or info is None or not info.static:
            return False
        if math.prod(info.dims) > 64 or info.elem_type == TensorProto.STRING:
            return False
        return not np.any(self.value(name, name))

    def causal(self, name: str) -> bool:
        """Whether a constant is a causal attention mask: of shape (..., L, L), each L x L
        slice zero on and below the diagonal and at most ``CAUSAL_MASKED`` above it
        (GPT-2's most negative float, or -inf). Folded from comparisons of positions, or
        written as an initializer by an exporter that folds (the dynamo exporter's
        ``val_N``, expanded to the batch): no trained bias has that pattern."""
        info = self.infos.get(name)
        if name not in self.constants or info is None or not info.static:
            return False
        dims = info.dims
        if len(dims) < 2 or dims[-1] != dims[-2] or info.elem_type not in _FLOAT_TYPES:
            return False
        try:
            squares = self.value(name, name).reshape(-1, *dims[-2:])
        except (InvalidInputError, ShapeError):  # too large to compute: kept as a mask
            return False
        lower = np.tri(dims[-1], dtype=bool)
        return bool(np.all(squares[:, lower] == 0) and np.all(squares[:, ~lower] <= CAUSAL_MASKED))

    def flag(self, name: str) -> bool | None:
        """The truth of a constant of one element (a bool or a number), else None."""
        info = self.infos.get(name)
        if name not in self.constants or info is None or not info.static:
            return None
        if math.prod(info.dims) != 1 or info.elem_type == TensorProto.STRING:
            return None
        return bool(self.value(name, name).reshape(()))

    def _materialize(self, name: str, display: str) -> None:
        # Shapes ONNX did not infer (e.g. ConstantOfShape after an old-opset Shape chain):
        # the producer inferred alone with its inputs' values, else the computed value,
        # carries the shape.
        producer = self.producers.get(name)
        if producer is not None:
            self._infer_alone(producer, display)
            if self._is_static(name):
                return
        value = self.value(name, display)
        self.infos[name] = TensorInfo(
            helper.np_dtype_to_tensor_dtype(value.dtype), tuple(int(d) for d in value.shape)
        )

    def value(self, name: str, display: str) -> np.ndarray:
        """The value of a constant tensor, computing its producers first (no recursion)."""
        stack = [name]
        while stack:
            top = stack[-1]
            if top in self.values:
                stack.pop()
                continue
            if top in self.params:
                self.values[top] = self._param_value(top)
                stack.pop()
                continue
            node = self.producers[top]
            missing = [n for n in self._value_inputs(node) if n not in self.values]
            if missing:
                stack.extend(missing)
                continue
            self._check_size(node, display)
            self._evaluate(node, display)
            stack.pop()
        return self.values[name]

    def _check_size(self, node: NodeProto, display: str) -> None:
        """Refuse to compute a constant node whose outputs would take more than
        ``MAX_CONSTANT_BYTES``, or whose size cannot be told beforehand where the operator
        can make its output larger than its inputs."""
        outputs = [o for o in node.output if o]
        if node.op_type not in _SHAPE_OPS and not all(self._is_static(o) for o in outputs):
            self._infer_alone(node, display)
        total = 0
        for name in outputs:
            info = self.infos.get(name)
            if info is not None and info.static:
                total += info.nbytes
            elif node.op_type in _EXPANDING:
                raise ShapeError(
                    f"cannot fold constant node {node.name or node.op_type!r} ({node.op_type}) "
                    f"needed by node {display}: the size of its output {name!r} is unknown"
                )
        if total > MAX_CONSTANT_BYTES:
            raise ShapeError(
                f"constant node {node.name or node.op_type!r} ({node.op_type}) needed by node "
                f"{display} would take {total} bytes; at most {MAX_CONSTANT_BYTES} are computed"
            )

    def _infer_alone(self, node: NodeProto, display: str) -> None:
        """Single-node shape inference where the schema allows it; what it cannot tell
        stays unknown."""
        if _schema(node, self.opsets) is None:
            return
        with contextlib.suppress(ShapeError):
            self._infer_single(node, [n for n in node.input if n], display)

    def _value_inputs(self, node: NodeProto) -> list[str]:
        if node.op_type in _SHAPE_OPS:
            # Shape and Size need the input's shape; its value only if that is unknown.
            return [] if self._is_static(node.input[0]) else [node.input[0]]
        return [n for n in node.input if n]

    def _param_value(self, name: str) -> np.ndarray:
        try:
            return numpy_helper.to_array(self.params[name])
        except Exception as error:  # external data not loaded, malformed tensor
            raise ShapeError(f"cannot read the value of {name!r}: {_first_line(error)}") from error

    def _evaluate(self, node: NodeProto, display: str) -> None:
        try:
            results = self._run(node)
        except Exception as error:  # any failure of the reference implementation
            raise ShapeError(
                f"cannot fold constant node {node.name or node.op_type!r} ({node.op_type}) "
                f"needed by node {display}: {_first_line(error)}"
            ) from error
        for out, result in zip(node.output, results, strict=False):
            if out:
                self.values[out] = np.asarray(result)

    def _run(self, node: NodeProto) -> list[np.ndarray]:
        if node.op_type in _SHAPE_OPS:
            return [self._shape_value(node)]
        from onnx.reference import ReferenceEvaluator  # slow import, rarely needed

        feeds = {n: self.values[n] for n in node.input if n}
        inputs = [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in feeds.items()
        ]
        outputs = [helper.make_empty_tensor_value_info(o) for o in node.output if o]
        # A graph (not a bare node) so that the model's opset picks the operator version.
        graph = helper.make_graph([node], "fold", inputs, outputs)
        evaluator = ReferenceEvaluator(graph, opsets=self.opsets, new_ops=list(reference_ops()))
        return list(evaluator.run(None, feeds))

    def _shape_value(self, node: NodeProto) -> np.ndarray:
        source = node.input[0]
        static = self._is_static(source)
        shape = self.infos[source].dims if static else self.values[source].shape
        dims = np.array(shape, dtype=np.int64)
        if node.op_type == "Size":
            return np.array(math.prod(shape), dtype=np.int64)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        # Shape-15 start/end clamp like Python slices.
        return dims[attrs.get("start", 0) : attrs.get("end", len(dims))]

    def _infer_single(self, node: NodeProto, reads: Sequence[str], display: str) -> None:
        """Re-infer one node with the constant values its shape may depend on."""
        schema = _schema(node, self.opsets)
        if schema is None:
            operator = f"{node.domain or 'ai.onnx'}.{node.op_type}"
            raise _NodeError(
                f"cannot infer the shape of node {display}: operator {operator} has no "
                "shape inference; declare its output shapes in value_info",
                f"operator {operator} has no shape inference; "
                "its output shapes must be declared in value_info",
            )
        types = {n: _type_proto(self.infos[n]) for n in reads if n in self.infos}
        data = {
            n: numpy_helper.from_array(self.value(n, display), n)
            for n in node.input
            if n in self.constants and self._small(n)
        }
        try:
            outputs = onnx.shape_inference.infer_node_outputs(
                schema,
                node,
                types,
                data,
                None,
                list(self.model.opset_import),
                self.model.ir_version,
            )
        except Exception as error:  # InferenceError and friends
            raise ShapeError(
                f"cannot infer the shape of node {display}: {_first_line(error)}"
            ) from error
        for name, type_proto in outputs.items():
            info = _info_from_type(type_proto)
            if info is not None:
                self.infos[name] = info

    def _small(self, name: str) -> bool:
        info = self.infos.get(name)
        return info is None or not info.static or math.prod(info.dims) <= _MAX_DATA_ELEMENTS


def gather_elements(data: np.ndarray, indices: np.ndarray, axis: int = 0) -> np.ndarray:
    """ONNX GatherElements (negative indices count from the end of ``axis``)."""
    axis = axis + data.ndim if axis < 0 else axis
    size = data.shape[axis]
    indices = np.where(indices < 0, indices + size, indices).astype(np.int64)
    return np.take_along_axis(data, indices, axis=axis)


@functools.cache
def reference_ops() -> tuple[type[OpRun], ...]:
    """Implementations that replace ``onnx.reference``'s own wherever remat evaluates
    constants with it (pass as ``ReferenceEvaluator(..., new_ops=list(reference_ops()))``):
    its GatherElements uses ``np.choose``, which fails past 64 choices along the axis
    ("cannot reshape array of size 1 into shape (1,16)" on BERT's token type ids)."""
    from onnx.reference.op_run import OpRun  # slow import, rarely needed

    class GatherElements(OpRun):
        op_domain = ""

        def _run(
            self, data: np.ndarray, indices: np.ndarray, axis: int | None = None
        ) -> tuple[np.ndarray]:
            return (gather_elements(data, indices, 0 if axis is None else int(axis)),)

    return (GatherElements,)


def _optional_output_info(
    node: NodeProto, index: int, infos: Mapping[str, TensorInfo], opsets: Mapping[str, int]
) -> TensorInfo | None:
    """The shape the operator's specification gives an optional output (index > 0) when
    shape inference leaves it unknown: ONNX infers Dropout-7's mask, for one, not at all."""
    if index == 0 or node.domain not in DEFAULT_DOMAINS or not node.input:
        return None
    x = infos.get(node.input[0])
    if x is None or not x.static or not x.shape:
        return None
    dims, op = x.dims, node.op_type
    if op == "Dropout" and index == 1:
        # mask: data's shape; bool from Dropout-10 on, data's type before
        bool_mask = opsets.get("", 0) >= 10
        return TensorInfo(TensorProto.BOOL if bool_mask else x.elem_type, dims)
    if op == "MaxPool" and index == 1:
        y = infos.get(node.output[0])
        return TensorInfo(TensorProto.INT64, y.dims) if y is not None and y.static else None
    if op == "BatchNormalization" and len(dims) >= 2:
        # running (and saved) mean and variance: one value per channel, typed like mean
        mean = infos.get(node.input[3]) if len(node.input) > 3 else None
        return TensorInfo(x.elem_type if mean is None else mean.elem_type, (dims[1],))
    if op == "LayerNormalization" and index in (1, 2):
        # Mean and InvStdDev: data's shape with the normalized axes reduced to 1
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axis = int(attrs.get("axis", -1))
        axis = axis + len(dims) if axis < 0 else axis
        stash = int(attrs.get("stash_type", TensorProto.FLOAT))
        if not 0 <= axis < len(dims):
            return None
        return TensorInfo(stash, dims[:axis] + (1,) * (len(dims) - axis))
    return None


def _type_proto(info: TensorInfo) -> onnx.TypeProto:
    return helper.make_tensor_type_proto(info.elem_type, info.shape)


# --- names --------------------------------------------------------------------------------


def _unique_names(nodes: Sequence[NodeProto]) -> list[str]:
    """ONNX names where given and unique, else ``{op}_{index}``, de-duplicated with ``_k``.

    A name given in the file is never taken by a generated name, so names that were
    already unique stay as they are.
    """
    given = {n.name for n in nodes if n.name}
    used: set[str] = set()
    names = []
    for index, node in enumerate(nodes):
        base = node.name or f"{node.op_type}_{index}"
        name, suffix = base, 0
        while name in used or (name != node.name and name in given):
            suffix += 1
            name = f"{base}_{suffix}"
        used.add(name)
        names.append(name)
    return names


# --- the forward graph --------------------------------------------------------------------


def forward_graph(
    model: onnx.ModelProto,
    batch: int | None = None,
    inputs: Mapping[str, Sequence[int]] | None = None,
    *,
    fuse_attention: bool = True,
) -> Graph:
    """The forward graph of a (checked) model; see the module docstring for the steps.

    ``batch`` fills the leading dimension of inputs whose first dimension is symbolic;
    ``inputs`` gives whole shapes by input name and wins over ``batch``;
    ``fuse_attention``: each attention chain as one node (``remat.onnx_fusion``).

    Nodes are named by their ONNX name, or ``{op_type}_{i}`` with ``i`` their position in
    ``model.graph.node``. ``fixed`` holds every real graph input (kind INPUT) and every
    constant a scheduled node reads (kind CONSTANT for a scalar folded from ``Constant``
    nodes alone, else PARAMETER); constants read only by folded nodes (shape arithmetic) take no
    memory during the step and are left out. The caller's model
    is not modified.
    """
    if not model.graph.node:
        raise EmptyModelError("the model has no operators: its graph has no nodes")
    params = {t.name: t for t in model.graph.initializer}
    params.update((t.values.name, _sparse_shape(t)) for t in model.graph.sparse_initializer)
    input_infos = _resolve_input_shapes(model, params, batch, inputs or {})
    nodes = list(model.graph.node)
    reads = [_reads(n) for n in nodes]
    order = _topological_order(nodes, reads)
    names = _unique_names(nodes)
    work = _working_model(model, input_infos, order)
    used = tensors_read(model)
    folder = _Folder(_infer(work) | input_infos, params, _opsets(model), work, used)
    scheduled = _fold(folder, nodes, reads, names, order, {*input_infos, *params})
    if not scheduled:
        raise EmptyModelError(
            f"the model has no operators to schedule ({len(nodes)} nodes, all constant)"
        )
    readers = Counter(name for names in reads for name in names)
    readers.update(v.name for v in model.graph.output)
    tensors = Tensors(
        readers,
        constant=folder.constants.__contains__,
        shape=folder.static_dims,
        is_float=folder.is_float,
        elem_type=folder.elem_type,
        scalar=folder.scalar,
        index=folder.index,
        ints=folder.ints,
        flag=folder.flag,
        is_zero=folder.is_zero,
        causal=folder.causal,
    )
    opset = folder.opsets.get("", 0)
    kept, tensors = bypass_noops([(nodes[i], names[i]) for i in scheduled], tensors, opset)
    fused = fuse_linear_layers(kept, tensors)
    fused = fuse_flattened_gemms(fused, tensors)
    fused = fuse_layer_norms(fuse_activation_chains(fused, tensors), tensors)
    fused = fuse_unbinds(fuse_rms_norms(fused, tensors), tensors)
    fused = fuse_rotary_embeddings(fused, tensors)
    if fuse_attention:
        fused = fuse_attention_chains(fused, tensors, opset=opset)
        fused, made = fuse_grouped_heads(fused, tensors)
        folder.infos.update((t, TensorInfo(elem, shape)) for t, (elem, shape) in made.items())
        tensors = replace(tensors, readers={**tensors.readers, **dict.fromkeys(made, 1)})
    # last: the fusions above find their chains' members by the layout operators around them
    fused = fuse_layout_chains(fused, tensors)
    return _build(model, folder, input_infos, fused)


def _fold(
    folder: _Folder,
    nodes: Sequence[NodeProto],
    reads: Sequence[list[str]],
    names: Sequence[str],
    order: Sequence[int],
    defined: set[str],
) -> list[int]:
    """The topological pass: fold constant nodes, complete the shapes of the others.
    Returns the indices of the nodes left to schedule, in order.

    A node that cannot be planned does not stop the pass: every such node is named in
    one error at the end (``_unplannable_error``). Nodes that read what one of them
    makes are not named again."""
    scheduled = []
    problems: list[tuple[str, str, _NodeError]] = []
    blocked: set[str] = set()  # outputs of nodes that cannot be planned, and of their users
    for index in order:
        node = nodes[index]
        display = f"{names[index]!r} ({node.op_type})"
        undefined = [t for t in reads[index] if t not in defined]
        if undefined:
            raise ModelLoadError(f"node {display} reads undefined tensor {undefined[0]!r}")
        defined.update(o for o in node.output if o)
        downstream = bool(blocked.intersection(reads[index]))
        if not downstream and folder.foldable(node, reads[index]):
            folder.fold(node)
            continue
        # Downstream of an unusable node only its kind is judged: its shapes are unknown.
        problem = _unplannable(node, display)
        if problem is None and not downstream:
            try:
                folder.complete(node, reads[index], display)
            except ShapeError as error:
                problem = error if isinstance(error, _NodeError) else _NodeError(str(error), "")
        if problem is not None:
            problems.append((names[index], node.op_type, problem))
        if problem is not None or downstream:
            blocked.update(o for o in node.output if o)
        else:
            scheduled.append(index)
    if problems:
        raise _unplannable_error(problems)
    return scheduled


_CONTROL_FLOW = frozenset(("If", "Loop", "Scan"))
_SEQUENCE_OPS = frozenset(
    ["SequenceConstruct", "SequenceEmpty", "SequenceInsert", "SequenceErase", "SequenceAt",
     "SequenceLength", "SequenceMap", "SplitToSequence", "ConcatFromSequence", "Optional",
     "OptionalGetElement", "OptionalHasElement"]
)  # fmt: skip


def _unplannable(node: NodeProto, display: str) -> _NodeError | None:
    """Why a static plan cannot hold this operator, if it cannot: control flow (its memory
    lies in subgraphs run a data-dependent number of times), sequence/optional values."""
    if node.domain not in DEFAULT_DOMAINS:
        return None
    if node.op_type in _CONTROL_FLOW:
        need = {
            "If": "a constant condition (or the branch exported alone)",
            "Loop": "a static unrolling: export with a fixed trip count, traced, not scripted",
            "Scan": "a static unrolling: export the scanned step unrolled",
        }[node.op_type]
        return _NodeError(
            f"node {display} is control flow, which cannot be planned statically; "
            f"it would need {need}",
            f"control flow cannot be planned statically; it would need {need}",
        )
    if node.op_type in _SEQUENCE_OPS:
        return _NodeError(
            f"node {display} makes or reads a sequence or optional value; only tensors "
            "of static shape can be planned",
            "sequence and optional values are not supported; only tensors of static shape",
        )
    return None


_MAX_NAMED = 5  # nodes named per operator and reason in a summary


def _unplannable_error(problems: Sequence[tuple[str, str, _NodeError]]) -> ShapeError:
    """One line: a single node's own message, else every unusable operator with its
    count, nodes and reason."""
    if len(problems) == 1:
        return problems[0][2]
    groups: dict[tuple[str, str], list[str]] = {}
    for name, op, error in problems:
        groups.setdefault((op, error.reason or str(error)), []).append(name)
    parts = []
    for (op, reason), group in groups.items():
        shown = ", ".join(repr(n) for n in group[:_MAX_NAMED])
        more = f" and {len(group) - _MAX_NAMED} more" if len(group) > _MAX_NAMED else ""
        parts.append(f"{op} x{len(group)} ({shown}{more}): {reason}")
    kinds = len({op for op, _ in groups})
    operators = f"{kinds} operator" + ("s" if kinds > 1 else "")
    return ShapeError(f"{len(problems)} nodes ({operators}) cannot be planned: " + "; ".join(parts))


def _differentiated_reads(protos: Iterable[NodeProto]) -> set[str]:
    """The tensors some node reads where a gradient can reach them
    (``remat.training.differentiable_input``): not only where none does (a
    BatchNormalization's running statistics, a Clip's bounds, any input of an operator
    without gradients). Only these can be
    trained: PyTorch keeps running statistics as buffers, which get no gradient."""
    found: set[str] = set()
    for proto in protos:
        inputs = {
            name
            for position, name in enumerate(proto.input)
            if name and differentiable_input(proto.op_type, position)
        }
        found |= inputs | (set(_reads(proto)) - set(proto.input))  # captures: conservative
    return found


def _sparse_shape(sparse: onnx.SparseTensorProto) -> TensorProto:
    # A value-less dense stand-in: sizes need only the dense shape and type, and
    # densifying a large sparse tensor up front would cost its full dense memory.
    tensor = TensorProto(name=sparse.values.name, data_type=sparse.values.data_type)
    tensor.dims.extend(sparse.dims)
    return tensor


def _build(
    model: onnx.ModelProto,
    folder: _Folder,
    input_infos: Mapping[str, TensorInfo],
    scheduled: Sequence[tuple[NodeProto, str]],
) -> Graph:
    fixed = {
        name: FixedTensor(name, FixedKind.INPUT, info.nbytes) for name, info in input_infos.items()
    }
    producer: dict[str, int] = {}
    nodes = []
    tables = _position_tables(scheduled)
    differentiated = _differentiated_reads(proto for proto, _ in scheduled)
    for node_id, (proto, name) in enumerate(scheduled):
        reads = _reads(proto)
        for tensor in reads:
            if tensor in folder.constants and tensor not in fixed:
                info = folder.infos[tensor]
                _check_tensor_size(info, f"constant {tensor!r}")
                trained = (
                    folder.is_weight(tensor) and tensor not in tables and tensor in differentiated
                )
                kind = FixedKind.PARAMETER if trained else FixedKind.CONSTANT
                fixed[tensor] = FixedTensor(tensor, kind, info.nbytes)
        outputs = [o for o in proto.output if o and o not in folder.dropped]
        nodes.append(_node(node_id, proto, name, reads, outputs, producer, fixed, folder.infos))
        producer.update((out, node_id) for out in proto.output if out)
    outputs = sorted({producer[v.name] for v in model.graph.output if v.name in producer})
    for value in model.graph.output:  # what a loss may read, in the model's order
        if value.name in producer:
            written = nodes[producer[value.name]].attrs.setdefault("model_outputs", [])
            assert isinstance(written, list)
            written.append(value.name)
    return Graph(Mode.INFERENCE, tuple(nodes), fixed, tuple(outputs))


def _position_tables(scheduled: Sequence[tuple[NodeProto, str]]) -> set[str]:
    """The cosines and sines that rotary embeddings read (``FusedRotary``'s second and
    third inputs) where nothing else scheduled reads them: tables of positions, which a
    model computes from its frequencies (a buffer: the dynamo exporter folds them into
    initializers, as it folds a weight's transpose), not trained."""
    tables: set[str] = set()
    others: set[str] = set()
    for proto, _ in scheduled:
        if proto.op_type == ROTARY and proto.domain == FUSED_DOMAIN:
            tables.update(proto.input[1:3])
            others.add(proto.input[0])
        else:
            others.update(proto.input)
    return tables - others


def _node(
    node_id: int,
    proto: NodeProto,
    name: str,
    reads: Sequence[str],
    outputs: Sequence[str],
    producer: Mapping[str, int],
    fixed: Mapping[str, FixedTensor],
    infos: Mapping[str, TensorInfo],
) -> Node:
    input_shapes = _positional_shapes(proto, infos)
    output_shapes = [infos[o].dims for o in outputs]
    scratch = ops.scratch_elements(proto.op_type, input_shapes, output_shapes)
    attrs = {
        a.name: helper.get_attribute_value(a)
        for a in proto.attribute
        if a.type not in (AttributeProto.GRAPH, AttributeProto.GRAPHS)
    }
    return Node(
        id=node_id,
        name=name,
        op=proto.op_type,
        kind=NodeKind.FORWARD,
        deps=tuple(sorted({producer[t] for t in reads if t in producer})),
        output_bytes=sum(infos[o].nbytes for o in outputs),
        flops=ops.flops(proto.op_type, input_shapes, output_shapes, attrs),
        input_bytes=sum(infos[t].nbytes for t in reads),
        fixed=tuple(t for t in reads if t in fixed),
        # in the first output's element type
        scratch_bytes=(scratch * _element_bits(infos[outputs[0]].elem_type) + 7) // 8,
        attrs={
            "onnx_inputs": [n for n in proto.input if n],
            "onnx_outputs": list(outputs),
            "input_shapes": [infos[t].dims for t in proto.input if t],
            "output_shapes": output_shapes,
            # a backward node's gradient of each output: none for masks and indices
            "output_gradient_bytes": [
                infos[o].nbytes if infos[o].elem_type in _FLOAT_TYPES else 0 for o in outputs
            ],
            **({"fused_attributes": attrs} if proto.domain == FUSED_DOMAIN and attrs else {}),
        },
    )


def _positional_shapes(proto: NodeProto, infos: Mapping[str, TensorInfo]) -> list[tuple[int, ...]]:
    # Trailing omitted optional inputs are dropped, middle ones become ().
    names = list(proto.input)
    while names and not names[-1]:
        names.pop()
    return [infos[n].dims if n else () for n in names]


def load_forward_graph(
    source: str | Path | bytes,
    batch: int | None = None,
    inputs: Mapping[str, Sequence[int]] | None = None,
    *,
    external_data_dir: Path | None = None,
    fuse_attention: bool = True,
) -> Graph:
    """``forward_graph(load_model(source, external_data_dir=...), batch, inputs, ...)``."""
    model = load_model(source, external_data_dir=external_data_dir)
    return forward_graph(model, batch=batch, inputs=inputs, fuse_attention=fuse_attention)


# --- command-line helpers -----------------------------------------------------------------

_DIMS = re.compile(r"\d+(?:[x,]\d+)*")


def parse_input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``"NAME=1x3x224x224"`` -> ``("NAME", (1, 3, 224, 224))`` (``,`` also separates)."""
    name, sep, dims = text.rpartition("=")
    name, dims = name.strip(), dims.strip().lower()
    if not sep or not name or not _DIMS.fullmatch(dims):
        raise InvalidInputError(f"bad input shape {text!r}: expected NAME=DIMS, e.g. x=1x3x224x224")
    shape = tuple(int(d) for d in re.split(r"[x,]", dims))
    if any(d < 1 for d in shape):
        raise InvalidInputError(f"bad input shape {text!r}: dimensions must be positive")
    return name, shape
