"""The real-model corpus: PyTorch modules as users export them, each at two scales.

One definition serves the tests and the benchmark: ``test`` is small enough that CI exports,
plans, executes and differentiates it in seconds (few channels, tiny images, a 64-token
vocabulary); ``bench`` is the size ``bench/models.py`` measures (torchvision's default
classifier heads on 64x64 images, Hugging Face configurations of width 64 and a 1000-token
vocabulary; ``bert_base`` and ``gpt2_small`` at their base models' shape, and
``gpt2_small_1k`` over one sequence of 1,024 tokens, ``bert_base_padded`` over two of 512
with their padding masked). Nothing is
downloaded: weights are random, torchvision comes from ``agents.pytorch.torchvision_models``
(beside the venv) and Hugging Face models from their configurations.

Each entry names the loss its output calls for (cross-entropy on a classifier's or a
language model's logits, per pixel on a segmentation map; the mean square elsewhere) and
the exporters' opsets (``OPSETS``: the TorchScript exporter at 17, the dynamo exporter at
its native 18; converting the dynamo export down to 17 can produce invalid models, e.g.
GPT-2's ``Split`` keeps opset 18's ``num_outputs``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from agents.pytorch.export import Exporter
from remat.loss import MEAN_SQUARE, Loss, LossKind

Scale = Literal["test", "bench"]
SCALES: tuple[Scale, ...] = ("test", "bench")
OPSETS: dict[Exporter, int] = {"torchscript": 17, "dynamo": 18}
CROSS_ENTROPY = Loss(LossKind.CROSS_ENTROPY)
PER_PIXEL = Loss(LossKind.CROSS_ENTROPY, axis=1)


@dataclass(frozen=True)
class Entry:
    """A model of the corpus: ``build`` makes the module and ``shape`` gives its first
    input's shape at a scale; ``tokens`` says the input is int64 token ids below that
    vocabulary size (else a standard normal float tensor)."""

    name: str
    source: str  # torch.nn, hand-built, torchvision, transformers
    build: Callable[[Scale], torch.nn.Module]
    shapes: dict[Scale, tuple[int, ...]]
    loss: Loss = MEAN_SQUARE
    tokens: dict[Scale, int] | None = None

    def module(self, scale: Scale) -> torch.nn.Module:
        """A fresh module, its random weights seeded."""
        torch.manual_seed(0)
        return self.build(scale)

    def example(self, scale: Scale) -> tuple[torch.Tensor, ...]:
        """The example inputs, seeded."""
        generator = torch.Generator().manual_seed(0)
        shape = self.shapes[scale]
        if self.tokens is not None:
            return (torch.randint(0, self.tokens[scale], shape, generator=generator),)
        return (torch.randn(*shape, generator=generator),)


class SmallCNN(torch.nn.Module):
    """Two convolutions with BatchNorm, max pooling, dropout and a linear classifier."""

    def __init__(self, width: int, image: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, width, 3, padding=1)
        self.norm1 = torch.nn.BatchNorm2d(width)
        self.conv2 = torch.nn.Conv2d(width, 2 * width, 3, padding=1)
        self.norm2 = torch.nn.BatchNorm2d(2 * width)
        self.drop = torch.nn.Dropout(0.5)
        self.fc = torch.nn.Linear(2 * width * (image // 4) ** 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.norm1(self.conv1(x))), 2)
        x = torch.max_pool2d(torch.relu(self.norm2(self.conv2(x))), 2)
        return self.fc(self.drop(x.flatten(1)))


class Recurrent(torch.nn.Module):
    """A two-layer LSTM or GRU and a linear head on its last output."""

    def __init__(self, cell: type[torch.nn.LSTM] | type[torch.nn.GRU], width: int) -> None:
        super().__init__()
        self.rnn = cell(width // 2, width, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class SegmentationOut(torch.nn.Module):
    """A torchvision segmentation model's ``'out'`` map (the models return a dict)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(x)["out"]
        return out


class LanguageModel(torch.nn.Module):
    """A Hugging Face model's logits on token ids (an encoder-decoder model reads the
    same ids as its decoder's input); ``padded``: the ids equal to ``PAD`` are padding,
    masked by an attention mask computed from the ids, as a fine-tuning batch of
    sentences of different lengths is."""

    def __init__(self, model: torch.nn.Module, seq2seq: bool = False, padded: bool = False):
        super().__init__()
        self.model = model
        self.seq2seq = seq2seq
        self.padded = padded

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.seq2seq:
            logits: torch.Tensor = self.model(input_ids=ids, decoder_input_ids=ids).logits
        elif self.padded:
            logits = self.model(input_ids=ids, attention_mask=(ids != PAD).long()).logits
        else:
            logits = self.model(input_ids=ids).logits
        return logits


PAD = 0  # the padding token of ``LanguageModel(padded=True)``


def _small_cnn(scale: Scale) -> torch.nn.Module:
    return SmallCNN(8, 16) if scale == "test" else SmallCNN(16, 32)


def _encoder(scale: Scale) -> torch.nn.Module:
    width = 32 if scale == "test" else 128
    layer = torch.nn.TransformerEncoderLayer(width, 4, 2 * width, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _recurrent(
    cell: type[torch.nn.LSTM] | type[torch.nn.GRU],
) -> Callable[[Scale], torch.nn.Module]:
    return lambda scale: Recurrent(cell, 16 if scale == "test" else 64)


def _torchvision(name: str, **kwargs: object) -> Callable[[Scale], torch.nn.Module]:
    """A torchvision classifier without pretrained weights: 10 classes in tests,
    the default 1000 in the benchmark."""

    def build(scale: Scale) -> torch.nn.Module:
        from agents.pytorch.torchvision_models import load  # only when asked for

        classes = {"num_classes": 10} if scale == "test" else {}
        module: torch.nn.Module = getattr(load().models, name)(weights=None, **classes, **kwargs)
        return module

    return build


def _segmentation(name: str) -> Callable[[Scale], torch.nn.Module]:
    def build(scale: Scale) -> torch.nn.Module:
        from agents.pytorch.torchvision_models import load  # only when asked for

        classes = {"num_classes": 4} if scale == "test" else {}
        models = load().models.segmentation
        model = getattr(models, name)(weights=None, weights_backbone=None, **classes)
        return SegmentationOut(model)

    return build


def _small_vit(scale: Scale) -> torch.nn.Module:
    """torchvision's ``VisionTransformer`` (``vit_b_16``'s class) at 2 layers."""
    from agents.pytorch.torchvision_models import load  # only when asked for

    width = 32 if scale == "test" else 64
    return load().models.vision_transformer.VisionTransformer(
        image_size=32 if scale == "test" else 64,
        patch_size=16 if scale == "bench" else 8,
        num_layers=2,
        num_heads=4,
        hidden_dim=width,
        mlp_dim=2 * width,
        num_classes=10 if scale == "test" else 1000,
    )


def _transformers(
    name: str,
    *,
    base: bool = False,
    positions: Mapping[Scale, int] | None = None,
    padded: bool = False,
) -> Callable[[Scale], torch.nn.Module]:
    """A Hugging Face model from a small configuration (2 layers); with ``base``, at its
    bench scale the shape of BERT-base or GPT-2 small (12 layers of width 768, 12 heads,
    128 positions), the transformers of issue-size graphs (about 1,000 training nodes);
    ``positions``: how many it embeds, by scale (else 64, or the base model's 128);
    ``padded``: BERT masks its padding (``LanguageModel``)."""

    def build(scale: Scale) -> torch.nn.Module:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers  # only when asked for

        width, vocab = (32, 64) if scale == "test" else (64, VOCAB["bench"])
        layers, heads, embedded = 2, 4, 64
        if base and scale == "bench":
            width, layers, heads, embedded = 768, 12, 12, 128
        if positions is not None:
            embedded = positions[scale]
        if name == "gpt2":
            gpt2 = transformers.GPT2Config(
                vocab_size=vocab, n_positions=embedded, n_embd=width, n_layer=layers,
                n_head=heads, bos_token_id=0, eos_token_id=0,
            )  # fmt: skip
            return LanguageModel(transformers.GPT2LMHeadModel(gpt2))
        if name == "bert":
            bert = transformers.BertConfig(
                vocab_size=vocab, hidden_size=width, num_hidden_layers=layers,
                num_attention_heads=heads, intermediate_size=(4 if base else 2) * width,
                max_position_embeddings=embedded,
            )  # fmt: skip
            return LanguageModel(transformers.BertForMaskedLM(bert), padded=padded)
        if name in DECODERS:  # grouped-query attention: 2 keys and values for 4 heads
            config, model, attention = DECODERS[name]
            decoder = getattr(transformers, config)(
                vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=heads // 2, max_position_embeddings=embedded,
                bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation=attention,
            )  # fmt: skip
            model = getattr(transformers, model)
            return LanguageModel(model(decoder))
        t5 = transformers.T5Config(
            vocab_size=vocab, d_model=width, d_kv=width // 4, d_ff=2 * width, num_layers=2,
            num_decoder_layers=2, num_heads=4,
        )  # fmt: skip
        return LanguageModel(transformers.T5ForConditionalGeneration(t5), seq2seq=True)

    return build


# LLaMA-style decoders by Hugging Face's config and model classes and attention
# implementation: Qwen2's layers are LLaMA's with biased query, key and value projections;
# ``llama_eager`` writes attention as its operators after repeating the key and value heads
# (``repeat_kv``), which TorchScript's exporter exports too
DECODERS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "sdpa"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "sdpa"),
    "llama_eager": ("LlamaConfig", "LlamaForCausalLM", "eager"),
}
VOCAB: dict[Scale, int] = {"test": 64, "bench": 1000}
IMAGE: dict[Scale, tuple[int, ...]] = {"test": (4, 3, 32, 32), "bench": (8, 3, 64, 64)}
TOKENS: dict[Scale, tuple[int, ...]] = {"test": (2, 16), "bench": (4, 16)}
LONG_TOKENS: dict[Scale, tuple[int, ...]] = {"test": (2, 16), "bench": (8, 128)}
# one sequence of a fine-tuning context
CONTEXT: dict[Scale, tuple[int, ...]] = {"test": (1, 256), "bench": (1, 1024)}
# a fine-tuning batch at BERT's longest sequences, its padding masked
PADDED: dict[Scale, tuple[int, ...]] = {"test": (1, 256), "bench": (2, 512)}


def _classifier(name: str, **kwargs: object) -> Entry:
    return Entry(name, "torchvision", _torchvision(name, **kwargs), IMAGE, CROSS_ENTROPY)


def _language_model(name: str) -> Entry:
    return Entry(name, "transformers", _transformers(name), TOKENS, CROSS_ENTROPY, VOCAB)


def _base_language_model(name: str, size: str) -> Entry:
    """``name`` at the shape of its base model: 12 layers, 8 sequences of 128 tokens."""
    build = _transformers(name, base=True)
    return Entry(f"{name}_{size}", "transformers", build, LONG_TOKENS, CROSS_ENTROPY, VOCAB)


def _long_context_model(name: str, size: str) -> Entry:
    """``name`` at the shape of its base model over one sequence of ``CONTEXT`` tokens."""
    positions = {scale: shape[1] for scale, shape in CONTEXT.items()}
    build = _transformers(name, base=True, positions=positions)
    return Entry(f"{name}_{size}_1k", "transformers", build, CONTEXT, CROSS_ENTROPY, VOCAB)


def _padded_model(name: str, size: str) -> Entry:
    """``name`` at the shape of its base model over ``PADDED`` tokens, its padding masked
    by a mask computed from the ids (``LanguageModel``)."""
    positions = {scale: shape[1] for scale, shape in PADDED.items()}
    build = _transformers(name, base=True, positions=positions, padded=True)
    return Entry(f"{name}_{size}_padded", "transformers", build, PADDED, CROSS_ENTROPY, VOCAB)


_ENTRIES = [
    Entry(
        "transformer_encoder",
        "torch.nn",
        _encoder,
        {"test": (4, 16, 32), "bench": (8, 32, 128)},
    ),
    Entry(
        "lstm",
        "torch.nn",
        _recurrent(torch.nn.LSTM),
        {"test": (4, 6, 8), "bench": (8, 32, 32)},
    ),
    Entry(
        "gru",
        "torch.nn",
        _recurrent(torch.nn.GRU),
        {"test": (4, 6, 8), "bench": (8, 32, 32)},
    ),
    Entry(
        "small_cnn",
        "hand-built",
        _small_cnn,
        {"test": (8, 3, 16, 16), "bench": (8, 3, 32, 32)},
        CROSS_ENTROPY,
    ),
    Entry("resnet18", "torchvision", _torchvision("resnet18"), IMAGE, CROSS_ENTROPY),
    _classifier("mobilenet_v2"),
    _classifier("squeezenet1_0"),
    _classifier("efficientnet_b0"),
    _classifier("densenet121"),
    _classifier("shufflenet_v2_x0_5"),
    _classifier("regnet_y_400mf"),
    # vgg11's adaptive pooling to 7x7 exports by the TorchScript exporter only from a
    # multiple of 7: 224x224 images (32x32 reach it at 1x1, which it cannot split).
    Entry(
        "vgg11",
        "torchvision",
        _torchvision("vgg11"),
        {"test": (1, 3, 224, 224), "bench": (2, 3, 224, 224)},
        CROSS_ENTROPY,
    ),
    _classifier("mobilenet_v3_small"),
    # googlenet and inception_v3 without their auxiliary heads, which make the training
    # mode's output a tuple; inception_v3 needs at least 75x75 pixels.
    _classifier("googlenet", aux_logits=False, init_weights=True),
    Entry(
        "inception_v3",
        "torchvision",
        _torchvision("inception_v3", aux_logits=False, init_weights=True),
        {"test": (2, 3, 80, 80), "bench": (4, 3, 80, 80)},
        CROSS_ENTROPY,
    ),
    _classifier("convnext_tiny"),
    Entry("vit_small", "torchvision", _small_vit, IMAGE, CROSS_ENTROPY),
    _classifier("swin_t"),
    _classifier("resnet50"),
    _classifier("mobilenet_v3_large"),
    Entry(
        "deeplabv3_mobilenet_v3_large",
        "torchvision",
        _segmentation("deeplabv3_mobilenet_v3_large"),
        IMAGE,
        PER_PIXEL,
    ),
    Entry("fcn_resnet50", "torchvision", _segmentation("fcn_resnet50"), IMAGE, PER_PIXEL),
    _language_model("gpt2"),
    _language_model("bert"),
    _language_model("t5"),
    # grouped-query attention, which only the dynamo exporter exports
    _language_model("llama"),
    _language_model("qwen2"),
    _language_model("llama_eager"),
    _base_language_model("bert", "base"),
    _base_language_model("gpt2", "small"),
    _base_language_model("llama", "base"),
    _long_context_model("gpt2", "small"),
    _padded_model("bert", "base"),
]
CORPUS: dict[str, Entry] = {entry.name: entry for entry in _ENTRIES}
