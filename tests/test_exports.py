"""Real exports ingest: models exported from torch at test time (small sizes), by the
TorchScript exporter at several opsets and, where onnxscript is installed, by the default
(dynamo) exporter; in training and in evaluation mode (Dropout's mask, BatchNorm's
running statistics)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx
import pytest
import torch

from agents.pytorch.export import export
from remat.graph import Mode
from remat.onnx_ingest import load_model
from remat.problem import model_graph

DYNAMO = importlib.util.find_spec("onnxscript") is not None


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.norm = torch.nn.BatchNorm2d(8)
        self.pool = torch.nn.MaxPool2d(2)
        self.drop = torch.nn.Dropout(0.5)
        self.fc = torch.nn.Linear(8 * 3 * 3, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.norm(self.conv(x))))
        return self.fc(self.drop(x).flatten(1))


def _encoder() -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _export(module: torch.nn.Module, args: tuple, opset: int, train: bool) -> onnx.ModelProto:
    torch.manual_seed(0)
    return export(module, args, exporter="torchscript", opset=opset, train=train)


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
    _check(_export(SmallCNN(), (torch.randn(2, 3, 8, 8),), opset, train))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("opset", [14, 18])
def test_transformer_encoder(opset: int, train: bool) -> None:
    _check(_export(_encoder(), (torch.randn(2, 16, 128),), opset, train))


@pytest.mark.skipif(not DYNAMO, reason="the dynamo exporter needs onnxscript")
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_dynamo_exports(tmp_path: Path, train: bool) -> None:
    for name, module, args in [
        ("cnn", SmallCNN(), (torch.randn(2, 3, 8, 8),)),
        ("encoder", _encoder(), (torch.randn(2, 16, 128),)),
    ]:
        path = tmp_path / f"{name}.onnx"
        onnx.save(export(module, args, exporter="dynamo", train=train), path)
        _check(onnx.load(path))
