"""Where a model's tensors may be read from: the rule for ONNX external data.

A tensor with ``data_location: EXTERNAL`` names a file (``location``) relative to the
model's directory. Read naively (``numpy_helper.to_array`` with no base directory) that
location is resolved against the process's working directory, so a crafted model can
make whoever ingests it read any file it can open. Remat therefore reads no external
data unless the caller names the directory the model's own files live in, and even then
only initializers whose location stays inside it.

Uploads to the service and the models agents download are single files: they are loaded
with no directory at all, so any external data is refused. ``remat plan model.onnx``
passes the model's own directory. Refusals name the tensor and the location as written in
the file, never whether a path exists or what it holds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath

import onnx
from onnx import AttributeProto, TensorProto

from remat.errors import ModelLoadError


def check_external_data(model: onnx.ModelProto, base_dir: Path | None) -> None:
    """Refuse external data that Remat may not read: any, where ``base_dir`` is None;
    otherwise any outside ``base_dir`` and any in a node attribute. Raises ModelLoadError."""
    for owner, tensor in _tensors(model):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        if base_dir is None:
            raise ModelLoadError(
                f"{owner} keeps its data outside the model file (ONNX external data); "
                "upload a self-contained model: onnx.save(model, path, "
                "save_as_external_data=False)"
            )
        if not owner.startswith("initializer"):
            raise ModelLoadError(
                f"{owner} keeps its data outside the model file (ONNX external data); "
                "only initializers may"
            )
        _check_location(owner, _location(tensor), base_dir)


def _location(tensor: TensorProto) -> str:
    entries = {entry.key: entry.value for entry in tensor.external_data}
    return entries.get("location", "")


def _check_location(owner: str, location: str, base_dir: Path) -> None:
    """``location`` must be a plain relative path that stays inside ``base_dir`` once
    symbolic links are followed."""
    shown = location if len(location) <= 120 else location[:117] + "..."
    refusal = ModelLoadError(
        f"{owner}: external data location {shown!r} is not a file inside the model's directory"
    )
    if not location or "\0" in location:
        raise refusal
    for flavour in (PurePosixPath(location), PureWindowsPath(location)):
        if flavour.is_absolute() or flavour.drive or ".." in flavour.parts:
            raise refusal
    root = os.path.realpath(base_dir)
    target = os.path.realpath(os.path.join(root, location))
    if os.path.commonpath([root, target]) != root or target == root:
        raise refusal


def _tensors(model: onnx.ModelProto) -> Iterator[tuple[str, TensorProto]]:
    """Every tensor stored in the model, with a description of where it sits: the main
    graph's initializers and those of every subgraph and function, sparse tensors' values
    and indices, and tensors in node attributes (``Constant``'s ``value`` and the like)."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[tuple[str, TensorProto]]:
    for tensor in graph.initializer:
        yield f"initializer {tensor.name!r}", tensor
    for sparse in graph.sparse_initializer:
        yield f"initializer {sparse.values.name!r} (sparse values)", sparse.values
        yield f"initializer {sparse.values.name!r} (sparse indices)", sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[tuple[str, TensorProto]]:
    label = f"node {node.name or node.op_type!r} ({node.op_type})"
    for attr in node.attribute:
        where = f"attribute {attr.name!r} of {label}"
        if attr.type == AttributeProto.TENSOR:
            yield where, attr.t
        elif attr.type == AttributeProto.TENSORS:
            yield from ((where, t) for t in attr.tensors)
        elif attr.type == AttributeProto.SPARSE_TENSOR:
            yield from ((where, t) for t in (attr.sparse_tensor.values, attr.sparse_tensor.indices))
        elif attr.type == AttributeProto.SPARSE_TENSORS:
            for sparse in attr.sparse_tensors:
                yield from ((where, t) for t in (sparse.values, sparse.indices))
        elif attr.type == AttributeProto.GRAPH:
            yield from _graph_tensors(attr.g)
        elif attr.type == AttributeProto.GRAPHS:
            for graph in attr.graphs:
                yield from _graph_tensors(graph)
