"""Real exports end to end: export -> ingest -> plan at 50% with ``auto`` -> execute.

A corpus of models exported from torch at small sizes (``torch.nn`` modules, a hand-built
CNN, torchvision's classifiers and segmentation models through
``agents/pytorch/torchvision_models.py`` when installed there, Hugging Face transformers'
GPT-2, BERT and T5 built from small configs on token ids, nothing downloaded), at opset 17
by the TorchScript exporter (``dynamo=False``) and by the dynamo exporter, in training
mode (and evaluation mode for the small ones). Per export: ONNX nodes, the training (or
inference) graph's nodes, whether remat ingests it (else the error's first line), the
``auto`` plan at 50% of the checkpoint-all peak on one CPU (analytical costs; its overhead
vs the ideal, or why there is none) and the agent's executor running that plan: the
gradients' worst relative error against plain autograd (the outputs' in evaluation mode).
Models with more than ``--max-check-params`` parameters skip the execution (said in the
row).

Prints a markdown table and appends its rows to ``bench/results/models.csv`` as they are
measured (``bench/report.py`` renders them).

    .venv/bin/python bench/models.py [--models small_cnn,resnet18,...]
        [--exporters torchscript,dynamo] [--time-limit 10]
        [--max-check-params 40000000] [--no-eval] [--run LABEL]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import onnx
import torch
from results import Writer, add_run_argument

from agents.executor import execute
from agents.pytorch.export import EXPORTERS, export
from remat.devices import Device, DeviceKind
from remat.graph import Mode
from remat.onnx_ingest import load_model
from remat.problem import model_graph, problem_from_graph
from remat.solvers.model import SolveOptions
from remat.strategies import SolverSettings, run_strategy

OPSET = 17
CPU = Device("cpu0", DeviceKind.CPU, {"threads": "1"})
MESSAGE_CHARS = 140
PROVED = "infeasible at this budget: auto proved that no schedule fits: "


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.norm1 = torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.norm2 = torch.nn.BatchNorm2d(32)
        self.drop = torch.nn.Dropout(0.5)
        self.fc = torch.nn.Linear(32 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.norm1(self.conv1(x))), 2)
        x = torch.max_pool2d(torch.relu(self.norm2(self.conv2(x))), 2)
        return self.fc(self.drop(x.flatten(1)))


class Recurrent(torch.nn.Module):
    """An LSTM or GRU and a linear head on its last output (the loss needs one tensor)."""

    def __init__(self, cell: type[torch.nn.LSTM] | type[torch.nn.GRU]) -> None:
        super().__init__()
        self.rnn = cell(32, 64, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _encoder() -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@dataclass(frozen=True)
class Entry:
    """A model and its example inputs: ``shape`` is the first (float) input's shape, for
    the row; ``inputs`` builds the example args (after ``torch.manual_seed(0)``; default:
    one standard normal tensor of ``shape``)."""

    source: str
    build: Callable[[], torch.nn.Module]
    shape: tuple[int, ...]
    eval_too: bool = False  # also export in evaluation mode (cheap models)
    inputs: Callable[[tuple[int, ...]], tuple[torch.Tensor, ...]] | None = None

    def example(self) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(0)
        if self.inputs is not None:
            return self.inputs(self.shape)
        return (torch.randn(*self.shape),)


def _torchvision(name: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        from agents.pytorch.torchvision_models import load  # only when asked for

        return getattr(load().models, name)(weights=None)

    return build


class SegmentationOut(torch.nn.Module):
    """A segmentation model's ``'out'`` tensor (the models return a dict)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(x)["out"]
        return out


def _segmentation(name: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        from agents.pytorch.torchvision_models import load  # only when asked for

        models = load().models.segmentation
        return SegmentationOut(getattr(models, name)(weights=None, weights_backbone=None))

    return build


def _small_vit() -> torch.nn.Module:
    """torchvision's ``VisionTransformer`` (``vit_b_16``'s class) at 2 layers, width 64."""
    from agents.pytorch.torchvision_models import load  # only when asked for

    vision_transformer = load().models.vision_transformer
    return vision_transformer.VisionTransformer(
        image_size=64, patch_size=16, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128
    )


def _no_aux(name: str) -> Callable[[], torch.nn.Module]:
    """googlenet and inception_v3 without their auxiliary heads (which make training
    mode's output a tuple)."""

    def build() -> torch.nn.Module:
        from agents.pytorch.torchvision_models import load  # only when asked for

        return getattr(load().models, name)(weights=None, aux_logits=False, init_weights=True)

    return build


VOCAB = 1000
TOKENS = (4, 16)  # batch, sequence


class LanguageModel(torch.nn.Module):
    """A Hugging Face transformers model on token ids, returning its first output tensor
    (logits or the last hidden state) without caches."""

    def __init__(self, model: torch.nn.Module, seq2seq: bool = False) -> None:
        super().__init__()
        self.model = model
        self.seq2seq = seq2seq

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.seq2seq:
            out = self.model(input_ids=ids, decoder_input_ids=ids, use_cache=False)
        else:
            out = self.model(input_ids=ids, use_cache=False)
        first: torch.Tensor = out[0]
        return first


def _transformers(name: str) -> Callable[[], torch.nn.Module]:
    """A small configuration (2 layers, width 64, a 1000-token vocabulary) of a Hugging
    Face model, built from its config: nothing is downloaded."""

    def build() -> torch.nn.Module:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers  # only when asked for

        if name == "gpt2":
            config = transformers.GPT2Config(
                vocab_size=VOCAB,
                n_positions=64,
                n_embd=64,
                n_layer=2,
                n_head=4,
                bos_token_id=0,
                eos_token_id=0,
            )
            return LanguageModel(transformers.GPT2LMHeadModel(config))
        if name == "bert":
            bert = transformers.BertConfig(
                vocab_size=VOCAB,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                max_position_embeddings=64,
            )
            return LanguageModel(transformers.BertForMaskedLM(bert))
        t5 = transformers.T5Config(
            vocab_size=VOCAB,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
        )
        return LanguageModel(transformers.T5ForConditionalGeneration(t5), seq2seq=True)

    return build


def _token_ids(shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, shape, dtype=torch.int64),)


IMAGE = (8, 3, 64, 64)
CORPUS: dict[str, Entry] = {
    "transformer_encoder": Entry("torch.nn", _encoder, (8, 32, 128), eval_too=True),
    "lstm": Entry("torch.nn", lambda: Recurrent(torch.nn.LSTM), (8, 32, 32), eval_too=True),
    "gru": Entry("torch.nn", lambda: Recurrent(torch.nn.GRU), (8, 32, 32), eval_too=True),
    "small_cnn": Entry("hand-built", SmallCNN, (8, 3, 32, 32), eval_too=True),
    "resnet18": Entry("torchvision", _torchvision("resnet18"), IMAGE, eval_too=True),
    "mobilenet_v2": Entry("torchvision", _torchvision("mobilenet_v2"), IMAGE),
    "squeezenet1_0": Entry("torchvision", _torchvision("squeezenet1_0"), IMAGE),
    "efficientnet_b0": Entry("torchvision", _torchvision("efficientnet_b0"), IMAGE),
    "densenet121": Entry("torchvision", _torchvision("densenet121"), IMAGE),
    "shufflenet_v2_x0_5": Entry("torchvision", _torchvision("shufflenet_v2_x0_5"), IMAGE),
    "regnet_y_400mf": Entry("torchvision", _torchvision("regnet_y_400mf"), IMAGE),
    "vgg11": Entry("torchvision", _torchvision("vgg11"), IMAGE),
    "mobilenet_v3_small": Entry("torchvision", _torchvision("mobilenet_v3_small"), IMAGE),
    "googlenet": Entry("torchvision", _no_aux("googlenet"), IMAGE),
    "inception_v3": Entry("torchvision", _no_aux("inception_v3"), (4, 3, 80, 80)),
    "convnext_tiny": Entry("torchvision", _torchvision("convnext_tiny"), IMAGE),
    "vit_small": Entry("torchvision", _small_vit, IMAGE),
    "swin_t": Entry("torchvision", _torchvision("swin_t"), IMAGE),
    "resnet50": Entry("torchvision", _torchvision("resnet50"), IMAGE),
    "deeplabv3_mobilenet_v3_large": Entry(
        "torchvision", _segmentation("deeplabv3_mobilenet_v3_large"), IMAGE
    ),
    "fcn_resnet50": Entry("torchvision", _segmentation("fcn_resnet50"), IMAGE),
    "gpt2": Entry("transformers", _transformers("gpt2"), TOKENS, inputs=_token_ids),
    "bert": Entry("transformers", _transformers("bert"), TOKENS, inputs=_token_ids),
    "t5": Entry("transformers", _transformers("t5"), TOKENS, inputs=_token_ids),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CORPUS))
    parser.add_argument("--exporters", default="torchscript,dynamo")
    parser.add_argument("--time-limit", type=float, default=10.0, help="plan time limit, s")
    parser.add_argument(
        "--max-check-params",
        type=int,
        default=40_000_000,
        help="skip the executor's check on models with more parameters",
    )
    parser.add_argument("--no-eval", action="store_true", help="training mode only")
    add_run_argument(parser)
    args = parser.parse_args()
    out = Writer("models", args.run)
    torch.set_num_threads(1)
    print(
        "| model | source | exporter | mode | ONNX nodes | graph nodes | ingest "
        "| plan@50% (auto) | grad / output error | s |"
    )
    print("|---|---|---|---|---:|---:|---|---|---|---:|")
    for name in args.models.split(","):
        entry = CORPUS[name]
        try:
            module = entry.build()
        except ImportError as error:  # torchvision (beside the venv) or transformers missing
            print(f"... {name}: {_line(error)}", file=sys.stderr, flush=True)
            continue
        modes = [Mode.TRAINING] + ([Mode.INFERENCE] if entry.eval_too and not args.no_eval else [])
        for exporter in args.exporters.split(","):
            for mode in modes:
                row = _measure(name, entry, module, exporter, mode, args)
                out.add(row)
                print(_markdown(row), flush=True)


def _measure(
    name: str,
    entry: Entry,
    module: torch.nn.Module,
    exporter: str,
    mode: Mode,
    args: argparse.Namespace,
) -> dict[str, Any]:
    start = time.monotonic()
    params = sum(p.numel() for p in module.parameters())
    row: dict[str, Any] = {"model": name, "source": entry.source, "exporter": exporter}
    row |= {"opset": OPSET, "mode": mode.value, "params": params, "input": _shape(entry)}
    row |= {"budget": "50%", "devices": CPU.name, "time_limit_s": args.time_limit}
    try:
        model = _export(module, entry.example(), exporter, mode)
    except Exception as error:
        return row | {"export": _line(error), "seconds": time.monotonic() - start}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    row |= {"export": "ok", "opset": opset, "onnx_nodes": len(model.graph.node)}
    try:
        model = load_model(model.SerializeToString())
        graph = model_graph(model, mode=mode)
    except Exception as error:
        return row | {"ingest": _line(error), "seconds": time.monotonic() - start}
    row |= {"ingest": "ok", "nodes": len(graph)}
    try:
        options = SolveOptions(time_limit_s=args.time_limit, threads=1)
        problem = problem_from_graph(
            graph, devices=[CPU], budgets={CPU.name: "50%"}, solver=SolverSettings(options=options)
        )
        result = run_strategy("auto", problem, CPU.name)
    except Exception as error:
        return row | {"plan": _line(error), "seconds": time.monotonic() - start}
    if not result.feasible or result.plan is None or result.simulation is None:
        message = _line(result.message.replace(PROVED, "infeasible: ") or "no plan")
        return row | {"plan": message, "seconds": time.monotonic() - start}
    ideal = problem.costs.ideal_ms(CPU.name)
    row |= {"plan": result.strategy, "objective": result.simulation.total_ms}
    row["overhead"] = result.simulation.total_ms / ideal - 1
    if params > args.max_check_params:
        row["check"] = f"skipped (> {args.max_check_params:,} parameters)"
        return row | {"seconds": time.monotonic() - start}
    try:
        report = execute(model, graph, result.plan, [CPU], warmup=0, repeats=1)
    except Exception as error:
        return row | {"check": _line(error), "seconds": time.monotonic() - start}
    if mode is Mode.TRAINING:
        row |= {"check": _verdict(report.gradients_match), "rel_error": report.max_rel_error}
    else:
        row |= {"check": _verdict(report.outputs_match), "rel_error": report.outputs_rel_error}
    return row | {"seconds": time.monotonic() - start}


def _export(
    module: torch.nn.Module, args: tuple[torch.Tensor, ...], exporter: str, mode: Mode
) -> onnx.ModelProto:
    if exporter not in EXPORTERS:
        raise SystemExit(f"unknown exporter {exporter!r}: one of {', '.join(EXPORTERS)}")
    return export(module, args, exporter=exporter, opset=OPSET, train=mode is Mode.TRAINING)  # type: ignore[arg-type]


def _shape(entry: Entry) -> str:
    return "x".join(str(d) for d in entry.shape)


def _verdict(match: bool | None) -> str:
    return {True: "match", False: "MISMATCH", None: "n/a"}[match]


def _line(error: BaseException | str) -> str:
    """One line: the error's type and the first line of its message, shortened."""
    if isinstance(error, BaseException):
        first = next((line for line in str(error).splitlines() if line.strip()), "")
        text = f"{type(error).__name__}: {first.strip()}"
    else:
        text = error.splitlines()[0] if error else ""
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


def _markdown(row: dict[str, Any]) -> str:
    def cell(key: str) -> str:
        return str(row.get(key, "")).replace("|", "\\|")

    if row.get("export", "ok") != "ok":
        ingest = f"export failed: {cell('export')}"
    else:
        ingest = cell("ingest")
    plan = cell("plan")
    if "overhead" in row:
        plan = f"{row['plan']} {row['overhead']:+.1%}"
    check = cell("check")
    if row.get("rel_error") is not None:
        check = f"{check} {row['rel_error']:.1e}"
    exporter = f"{row['exporter']} {row['opset']}"
    return (
        f"| {row['model']} | {row['source']} | {exporter} | {row['mode']} | "
        f"{cell('onnx_nodes')} | {cell('nodes')} | {ingest} | {plan} | {check} | "
        f"{row['seconds']:.1f} |"
    )


if __name__ == "__main__":
    main()
