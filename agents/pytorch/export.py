"""``torch.onnx.export`` as users call it, with either exporter, in training or evaluation
mode."""

from __future__ import annotations

import io
import warnings
from typing import Literal

import onnx
import torch

Exporter = Literal["torchscript", "dynamo"]
EXPORTERS: tuple[Exporter, ...] = ("torchscript", "dynamo")


def export(
    module: torch.nn.Module,
    args: tuple[torch.Tensor, ...],
    *,
    exporter: Exporter = "torchscript",
    opset: int = 17,
    train: bool = True,
) -> onnx.ModelProto:
    """``module`` at ``args`` as an ONNX model. ``torchscript``: ``dynamo=False`` with
    ``training`` set (constant folding off in training, which would fold the weights into
    their consumers); ``dynamo``: the default exporter of PyTorch 2.13 on the module in
    ``train`` mode. The module is left in that mode."""
    module.train(train)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            buffer = io.BytesIO()  # the TorchScript exporter writes to a file object too
            mode = torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL
            torch.onnx.export(
                module,
                args,
                buffer,  # type: ignore[arg-type]
                dynamo=False,
                opset_version=opset,
                training=mode,
                do_constant_folding=not train,
            )
            return onnx.load_from_string(buffer.getvalue())
        if exporter == "dynamo":
            program = torch.onnx.export(
                module, args, dynamo=True, opset_version=opset, verbose=False
            )
            if program is None:
                raise RuntimeError("the dynamo exporter returned no program")
            return program.model_proto
    raise ValueError(f"unknown exporter {exporter!r}: one of {', '.join(EXPORTERS)}")
