"""Gradients that are right, not only self-consistent: real exports of the corpus's PyTorch
modules (``agents.pytorch.corpus`` at its ``test`` scale), planned with checkpoint-all
and at 50% of its peak, run by the agent's executor, and compared with the module's own
autograd for the same weights, inputs and loss (``agents.pytorch.reference``), at most
1e-4 relative error in fp32.

The subset covers what a gradient rule can get wrong: BatchNorm in training mode, a
LayerNorm decomposed into Mul/Add by a parameter (opset 14), attention, recurrent layers
whose gates the exporter packs with constant subgraphs, residual CNNs, a segmentation
model's hard-swish and squeeze-excitation blocks and its head's Resize under a per-pixel
cross-entropy (torchvision, installed beside the venv by ``scripts/test``), Hugging Face
transformers (GPT-2, BERT, T5) from small configurations, and each loss a job can
choose. The module side differentiates an ``Embedding`` with its ``padding_idx`` off
(BERT's pad token), since the exported ``Gather`` has no such rule."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence

import pytest

from agents.pytorch.check import CPU, export_entry, graph_of, plan_for_check
from agents.pytorch.corpus import CORPUS, CROSS_ENTROPY
from agents.pytorch.export import Exporter
from agents.pytorch.reference import ModuleComparison, compare_with_module
from agents.pytorch.torchvision_models import Unavailable
from remat.graph import Mode
from remat.loss import MEAN_SQUARE, Loss
from remat.onnx_fusion import (
    ATTENTION,
    GELU,
    LAYER_NORM,
    LAYOUT,
    MATMUL_ADD,
    RMS_NORM,
    ROTARY,
    SILU,
    UNBIND,
)
from remat.solvers.model import SolveOptions
from remat.strategies import SearchConfig, SolverSettings
from remat.training import DATA_MASK, kept_bytes

TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# auto without its exact solve, which finds no cheaper plan for any of these models in 5 s:
# greedy eviction's plans, the cheapest for most of them, take it under 2 s of the 3
NO_EXACT = SearchConfig(auto_exact_max_nodes=0)
SETTINGS = SolverSettings(options=SolveOptions(time_limit_s=3.0, threads=1), search=NO_EXACT)


def _check(
    name: str, *, exporter: Exporter = "torchscript", opset: int | None = None,
    loss: Loss | None = None, fuse_attention: bool = True, attention: bool = False,
    folded: int = 0, fused: Sequence[str] = (), scoreless: bool = False, causal: bool = False,
    grouped: bool = False, weights_kept: bool = False,
) -> list[ModuleComparison]:  # fmt: skip
    """Export corpus model ``name``, plan it with checkpoint-all and at 50% (or, where 50%
    is under the least any schedule needs, between that and the peak), check each plan in
    the simulator and compare the executor's gradients with the module's (``folded``: how
    many of its weights the export folds into constants, so that they have no gradient).
    ``fuse_attention`` as in a job (the default); ``attention``: some attention chain must
    have become one node; ``fused``: operators ingestion must have made of the export's
    (``remat.onnx_fusion``); ``scoreless``: every attention's backward node must be
    PyTorch's fused kernel's (``remat.ops.pytorch_attention_backward``), which holds no
    score matrix; ``causal``: every attention's mask must have become its ``causal``
    attribute; ``grouped``: every attention must read keys and values of fewer heads than
    its queries, no repeated copy (no ``Expand`` left); ``weights_kept``: every attention's
    backward is the closed form, from the weights its forward node keeps with its output
    (``remat.training.kept_bytes``), and each plan's measured peak is within its predicted
    one."""
    entry = CORPUS[name]
    try:
        exported = export_entry(entry, "test", exporter, opset=opset)
    except Unavailable as error:
        pytest.skip(str(error))
    graph = graph_of(exported, Mode.TRAINING, loss or entry.loss, fuse_attention)
    assert not attention or any(n.op == ATTENTION for n in graph.nodes)
    assert set(fused) <= {n.op for n in graph.nodes}, fused
    if causal:
        attentions = [n for n in graph.nodes if n.op == ATTENTION and n.forward is None]
        assert attentions
        assert all(len(n.attrs["onnx_inputs"]) == 3 for n in attentions)  # type: ignore[arg-type]
        assert all(n.attrs["fused_attributes"]["causal"] == 1 for n in attentions)  # type: ignore[index]
    if grouped:
        for node in graph.nodes:
            if node.op == ATTENTION and node.forward is None:
                queries, keys, values = node.attrs["input_shapes"][:3]  # type: ignore[index,misc]
                assert keys[1] == values[1] < queries[1]
        assert "Expand" not in {n.op for n in graph.nodes}
    if scoreless:  # from the output and the log-sum-exp; the closed form holds the scores
        backward = [n for n in graph.nodes if n.op == ATTENTION and n.forward is not None]
        assert backward and all(n.forward in n.deps for n in backward)
        for node in backward:  # the keys with unit stride (float32), not two score matrices
            keys = graph.nodes[node.forward].attrs["input_shapes"][1]  # type: ignore[index]
            assert node.scratch_bytes == 4 * math.prod(keys)  # type: ignore[arg-type]
    if weights_kept:
        forward = [n for n in graph.nodes if n.op == ATTENTION and n.forward is None]
        assert forward and all(n.attrs.get("keeps_weights") and kept_bytes(n) for n in forward)
        backward = [n for n in graph.nodes if n.op == ATTENTION and n.forward is not None]
        assert backward and all(n.forward in n.deps for n in backward)
    results = []
    for budget in (None, "50%"):
        planned = plan_for_check(graph, budget, SETTINGS)
        result = planned.result
        assert result.plan is not None and result.simulation is not None, result.message
        assert result.feasible, (planned.budget, result.message)
        comparison = compare_with_module(
            exported.module, exported.args, exported.model, graph, result.plan, [CPU]
        )
        assert comparison.report.gradients_match, (planned.budget, comparison.report.max_rel_error)
        if weights_kept:  # the prediction also counts the kernels' workspace, unseen here
            measured, predicted = (
                comparison.report.peak_bytes,
                comparison.report.predicted_peak_bytes,
            )
            assert measured.keys() == predicted.keys()
            assert all(measured[d] <= predicted[d] for d in measured), (measured, predicted)
        assert len(comparison.unpaired) == folded, comparison.unpaired
        assert comparison.paired > 0 and comparison.error <= comparison.tolerance, (
            planned.budget,
            comparison.error,
        )
        results.append(comparison)
    return results


@pytest.mark.parametrize(("opset", "loss"), [(9, MEAN_SQUARE), (17, CROSS_ENTROPY)])
def test_cnn_with_batch_norm_in_training_mode(opset: int, loss: Loss) -> None:
    (full, _) = _check("small_cnn", opset=opset, loss=loss)
    assert full.loss == loss.kind.value


@pytest.mark.parametrize(("exporter", "opset"), [("torchscript", 14), ("dynamo", 18)])
def test_transformer_encoder(exporter: Exporter, opset: int) -> None:
    """Opset 14 has no LayerNormalization: the exporter writes its formula, which ingestion
    makes one ``FusedLayerNorm``; dynamo at 18 writes the operator. Both exporters pick the
    packed projection's queries, keys and values with a ``Gather`` each: one
    ``FusedUnbind``. The heads' splits and merges are ``FusedLayout`` nodes."""
    fused = (UNBIND, LAYOUT, LAYER_NORM) if opset < 17 else (UNBIND, LAYOUT)
    _check("transformer_encoder", exporter=exporter, opset=opset, fused=fused)


@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_recurrent_layers_with_packed_gates(name: str) -> None:
    _check(name)


@pytest.mark.parametrize(
    "name", ["resnet18", "deeplabv3_mobilenet_v3_large", "efficientnet_b0", "vit_small"]
)
def test_torchvision_models(name: str) -> None:
    """EfficientNet's SiLU (``x * sigmoid(x)``) is one ``FusedSilu`` node; its
    squeeze-excitation gates (another tensor times a sigmoid) stay apart. The ViT's
    ``MultiheadAttention`` picks its queries, keys and values with one ``FusedUnbind`` and
    splits and merges its heads with ``FusedLayout`` chains."""
    fused = {"efficientnet_b0": (SILU,), "vit_small": (UNBIND, LAYOUT)}.get(name, ())
    _check(name, fused=fused)


@pytest.mark.skipif(not TRANSFORMERS, reason="transformers is not installed (dev extra)")
@pytest.mark.parametrize(
    "name",
    [
        "gpt2",
        "bert",
        "t5",
    ],
)
def test_hugging_face_language_models(name: str) -> None:
    """Attention node by node (fused: ``test_attention_fused_into_one_node``)."""
    _check(name, fuse_attention=False)


@pytest.mark.skipif(not TRANSFORMERS, reason="transformers is not installed (dev extra)")
@pytest.mark.parametrize(
    ("name", "exporter"),
    [
        ("transformer_encoder", "torchscript"),
        ("bert", "torchscript"),
        ("gpt2", "torchscript"),
        ("t5", "torchscript"),
        ("bert", "dynamo"),
        ("gpt2", "dynamo"),
    ],
)
def test_attention_fused_into_one_node(name: str, exporter: Exporter) -> None:
    """Each attention chain as one ``ScaledDotProductAttention`` node (PyTorch's
    ``scaled_dot_product_attention`` as each exporter writes it, GPT-2's causal mask, T5's
    learned position bias): the gradients still match the module's autograd. The dynamo
    exporter folds the position embeddings' lookup of constant positions into a constant:
    that weight gets no gradient. BERT's and GPT-2's GELU, written as elementwise
    operators by both exporters, is one ``FusedGelu`` node too, T5's RMS normalization one
    ``FusedRMSNorm``, and each model's splits and merges of its heads ``FusedLayout``
    chains. GPT-2's ``Conv1D`` layers, a ``Gemm`` between two ``Reshape``'s, are
    ``MatMulAdd`` nodes. Each attention's backward is PyTorch's fused kernel's where its
    mask is not trained: not T5's position bias, nor BERT's mask as the dynamo exporter
    writes it, an initializer (trained, as every float initializer is): theirs is the closed
    form, from the weights the forward node keeps, and the plans' peaks are within the
    predicted."""
    fused = {"bert": (GELU,), "gpt2": (GELU, MATMUL_ADD), "t5": (RMS_NORM,)}.get(name, ())
    fused = (*fused, LAYOUT)
    folded = int(exporter == "dynamo")
    scoreless = name != "t5" and (name, exporter) != ("bert", "dynamo")
    _check(
        name, exporter=exporter, attention=True, folded=folded, fused=fused,
        scoreless=scoreless, weights_kept=not scoreless,
    )  # fmt: skip


@pytest.mark.skipif(not TRANSFORMERS, reason="transformers is not installed (dev extra)")
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_llama_decoder_by_the_dynamo_exporter(name: str) -> None:
    """A LLaMA-style decoder (RMS normalization, rotary position embeddings, a SiLU-gated
    MLP, grouped-query attention: 4 heads sharing 2 keys and values; Qwen2's the same
    with biased query, key and value projections, ``MatMulAdd`` nodes) as the dynamo
    exporter writes it at opset 18, where a mean's axes are an input: its RMS
    normalizations are ``FusedRMSNorm`` nodes, its SiLU ``FusedSilu``, its rotary
    embeddings ``FusedRotary``, each attention one node that reads the 2 key and value
    heads themselves, whose causal mask is its ``causal`` attribute and whose backward is
    PyTorch's fused kernel's; the gradients match the module's."""
    fused = (RMS_NORM, SILU, LAYOUT, ROTARY, *((MATMUL_ADD,) if name == "qwen2" else ()))
    _check(
        name, exporter="dynamo", attention=True, fused=fused, scoreless=True, causal=True,
        grouped=True,
    )  # fmt: skip


@pytest.mark.skipif(not TRANSFORMERS, reason="transformers is not installed (dev extra)")
def test_a_long_context_takes_pytorchs_attention_backward() -> None:
    """GPT-2 over 256 tokens: every attention's causal mask, folded from comparisons of
    positions, is its ``causal`` attribute, its backward PyTorch's fused kernel's, and the
    gradients still match."""
    fused = (MATMUL_ADD, LAYOUT)
    _check("gpt2_small_1k", attention=True, scoreless=True, causal=True, fused=fused)


@pytest.mark.skipif(not TRANSFORMERS, reason="transformers is not installed (dev extra)")
def test_a_padding_mask_from_the_data_takes_pytorchs_attention_backward() -> None:
    """BERT over 256 tokens with its padding masked by a mask computed from the ids: no
    gradient flows to that mask (none flows to the data), so each attention's backward is
    PyTorch's fused kernel's, which has none for a mask on CPUs, and the mask's
    computation gets no backward node; the gradients still match."""
    _check("bert_base_padded", attention=True, scoreless=True, fused=(GELU, LAYOUT))
    entry = CORPUS["bert_base_padded"]
    graph = graph_of(export_entry(entry, "test"), Mode.TRAINING, entry.loss, True)
    attentions = [n for n in graph.nodes if n.op == ATTENTION and n.forward is None]
    assert attentions and all(n.attrs.get(DATA_MASK) for n in attentions)
    assert all(len(n.attrs["onnx_inputs"]) == 4 for n in attentions)  # type: ignore[arg-type]
    masks = {n.deps[-1] for n in attentions}  # the mask's producer, shared by the layers
    assert not [n for n in graph.nodes if n.forward in masks]


@pytest.mark.skipif(not TRANSFORMERS, reason="transformers is not installed (dev extra)")
def test_a_llama_decoder_with_eager_attention_by_the_torchscript_exporter() -> None:
    """The LLaMA decoder with Hugging Face's eager attention (its key and value heads
    repeated by ``repeat_kv``, then the products and the softmax as operators), which
    TorchScript's exporter exports: the same fusions as the dynamo export's, each
    attention one node reading the shared key and value heads, its causal mask its
    ``causal`` attribute, and gradients matching."""
    fused = (RMS_NORM, SILU, LAYOUT, ROTARY)
    _check(
        "llama_eager", exporter="torchscript", attention=True, fused=fused, scoreless=True,
        causal=True, grouped=True,
    )  # fmt: skip
