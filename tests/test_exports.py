"""Real exports ingest: the corpus's small modules (``agents.pytorch.corpus``, ``test``
scale) exported by the TorchScript exporter at several opsets and, where onnxscript is
installed, by the default (dynamo) exporter; in training and in evaluation mode (Dropout's
mask, BatchNorm's running statistics)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx
import pytest

from agents.pytorch.corpus import CORPUS
from agents.pytorch.export import Exporter, export
from remat.graph import Mode
from remat.onnx_ingest import load_model
from remat.problem import model_graph

DYNAMO = importlib.util.find_spec("onnxscript") is not None


def _export(name: str, exporter: Exporter, opset: int, train: bool) -> onnx.ModelProto:
    entry = CORPUS[name]
    module, args = entry.module("test"), entry.example("test")
    return export(module, args, exporter=exporter, opset=opset, train=train)


def _check(model: onnx.ModelProto) -> None:
    model = load_model(model.SerializeToString())
    graph = model_graph(model, mode=Mode.TRAINING)
    ops = {n.op for n in graph.nodes}
    assert "Loss" in ops and len(graph) > 2
    assert graph.activation_bytes > 0
    assert all(n.output_bytes >= 0 for n in graph.nodes)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("opset", [9, 13, 18])
def test_cnn_with_dropout(opset: int, train: bool) -> None:
    """Opset 9 in training mode keeps Dropout-7's ``mask`` output, which nothing reads."""
    _check(_export("small_cnn", "torchscript", opset, train))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("opset", [14, 18])
def test_transformer_encoder(opset: int, train: bool) -> None:
    _check(_export("transformer_encoder", "torchscript", opset, train))


@pytest.mark.skipif(not DYNAMO, reason="the dynamo exporter needs onnxscript")
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_dynamo_exports(tmp_path: Path, train: bool) -> None:
    for name in ("small_cnn", "transformer_encoder"):
        path = tmp_path / f"{name}.onnx"
        onnx.save(_export(name, "dynamo", 18, train), path)
        _check(onnx.load(path))
