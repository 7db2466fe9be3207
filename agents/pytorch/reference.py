"""The executor's gradients against the autograd of the PyTorch module a model was
exported from: the check that a gradient rule is right, not only self-consistent (the
executor's own check compares a planned run with a plain run of the same ONNX program
through the same kernels, so a wrong rule would pass both).

``compare_with_module`` runs a plan of ``graph`` (built by remat from the export of
``module`` at ``args``) on the agent's executor with the same inputs, and ``module``'s
autograd for the same loss, and compares the gradient of every parameter of the module:

* the run's gradients are taken back to the model's initializers
  (``agents.program.initializer_gradients``: weights the exporter packs or reorders with
  constant subgraphs, as for LSTM and GRU gates, pass theirs back through them);
* parameters are paired with initializers by name (both exporters name an initializer
  after its parameter), else by identical value or transpose (``perturb`` first, so that
  no two parameters are equal); a parameter that receives a gradient in PyTorch and pairs with
  no initializer is reported (``unpaired``), and the check fails;
* the loss is the graph's (``remat.loss``); the module side computes it on the module's
  outputs flattened in order (``cross_entropy`` and ``output`` read the first), with the
  same labels;
* the module's gradient is the derivative of what it computes: an ``Embedding``'s
  ``padding_idx`` (which only withholds the gradient of that row from the lookup; BERT's
  word embedding has one) is off while it is taken, since the export reads the table with
  a plain Gather whose gradient reaches every row it reads;
* the reference is the module's autograd in float64 (a copy of the module and the inputs
  in double precision): the error is ``max|a - b| / max|b|`` per parameter, the worst
  over parameters (``agents.executor.max_relative_error``), with ``max|b|`` floored at
  ``NOISE`` times the largest gradient entry (a gradient that is zero in exact arithmetic,
  as a convolution's bias before a batch norm in training mode, holds only rounding);
* it is held to ``TOLERANCE``, or where PyTorch's own fp32 autograd is farther than that
  from the float64 one (an ill-conditioned network: a batch norm over few values of a
  nearly constant channel), to ``CUDA_ALLOWANCE`` times PyTorch's own error, the rule the
  executor applies to a GPU against the host: as right as PyTorch is.

Randomness cannot be shared between the two sides (dropout masks come from different
generators): compare modules with dropout off (``without_dropout``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch.utils._pytree import tree_leaves

from agents.executor import CUDA_ALLOWANCE, TOLERANCE, ExecutionReport, execute, max_relative_error
from agents.program import LossOf, build_program, initializer_gradients
from remat.devices import Device
from remat.graph import Graph, Mode
from remat.loss import LossKind
from remat.plan import Plan

NOISE = 1e-2


@dataclass(frozen=True)
class ModuleComparison:
    error: float  # worst relative error over the paired parameters, against float64
    torch_error: float  # the module's own fp32 autograd's, against float64
    paired: int  # parameters compared
    unpaired: tuple[str, ...]  # parameters with a PyTorch gradient and no tensor in the model
    loss: str  # the loss both sides differentiated
    report: ExecutionReport  # the executor's run (and its own gradient check)

    @property
    def matches(self) -> bool:
        return self.error <= self.tolerance and not self.unpaired and self.paired > 0

    @property
    def tolerance(self) -> float:
        return max(TOLERANCE, CUDA_ALLOWANCE * self.torch_error)


def without_dropout(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every dropout off: dropout modules and torchvision's stochastic
    depth at p = 0, and every float attribute named like a dropout probability (attention
    dropout is a float in ``torch.nn.MultiheadAttention`` and in Hugging Face's attention
    modules) at 0."""
    for sub in module.modules():
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) or type(sub).__name__ in (
            "StochasticDepth",
        ):
            sub.p = 0.0  # type: ignore[assignment]
        for name, value in vars(sub).items():
            if "dropout" in name and isinstance(value, float):
                setattr(sub, name, 0.0)
    return module


@torch.no_grad()
def perturb(module: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> torch.nn.Module:
    """Add ``scale`` times the parameter's own spread (or ``scale``) of seeded noise to every
    parameter, so that no two are equal (fresh norms are all ones, biases all zeros) and a
    gradient that vanishes at initialisation does not vanish here."""
    generator = torch.Generator().manual_seed(seed)
    for parameter in module.parameters():
        spread = float(parameter.std()) if parameter.numel() > 1 else 0.0
        noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
        parameter.add_(noise * scale * (spread or 1.0))
    return module


def compare_with_module(
    module: torch.nn.Module,
    args: Sequence[torch.Tensor],
    model: onnx.ModelProto,
    graph: Graph,
    plan: Plan,
    devices: Sequence[Device] | None = None,
    *,
    seed: int = 0,
) -> ModuleComparison:
    """Run ``plan`` on the executor with ``args`` as the model's inputs and compare its
    parameter gradients with ``module``'s autograd at ``args`` (see the module docstring).
    ``module`` must be in the mode it was exported in."""
    if graph.mode is not Mode.TRAINING:
        raise ValueError("gradients need a training graph")
    inputs = model_inputs(model, args)
    program = build_program(model, graph, inputs, seed)
    loss = program.loss
    labels = None
    if loss.labels is not None:  # the program's labels, given to the run and the module
        labels = program.fixed[loss.labels]
        inputs[loss.labels] = labels.numpy()
    report = execute(model, graph, plan, devices, inputs=inputs, seed=seed, warmup=0)
    expected = module_gradients(module, args, loss, labels)
    exact = module_gradients(copy.deepcopy(module).double(), _double(args), loss, labels)
    gradients = initializer_gradients(model, program, report.gradients)
    paired, unpaired = _pair(module, model, expected)
    missing = torch.zeros(0)  # a paired tensor the run did not train: an infinite error
    measured = {
        name: sum(
            (gradients.get(other, missing).T if transposed else gradients.get(other, missing)
             for other, transposed in held),
            start=torch.zeros(()),
        )
        for name, held in paired.items()
    }  # fmt: skip
    reference = {name: exact[name] for name in paired}
    floor = _noise(exact)
    return ModuleComparison(
        error=max_relative_error(measured, reference, floor) if paired else math.inf,
        torch_error=max_relative_error({n: expected[n] for n in paired}, reference, floor),
        paired=len(paired),
        unpaired=tuple(unpaired),
        loss=loss.kind.value,
        report=report,
    )


def _double(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [a.double() if a.is_floating_point() else a for a in args]


def _noise(gradients: Mapping[str, torch.Tensor]) -> float:
    return NOISE * max((float(g.abs().max()) for g in gradients.values() if g.numel()), default=0.0)


def model_inputs(model: onnx.ModelProto, args: Sequence[torch.Tensor]) -> dict[str, np.ndarray]:
    initializers = {t.name for t in model.graph.initializer}
    names = [v.name for v in model.graph.input if v.name not in initializers]
    if len(names) != len(args):
        raise ValueError(f"the model has {len(names)} inputs ({names}), got {len(args)} tensors")
    return {name: arg.detach().cpu().numpy() for name, arg in zip(names, args, strict=True)}


def module_gradients(
    module: torch.nn.Module, args: Sequence[torch.Tensor], loss: LossOf, labels: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The module's parameter gradients for ``loss`` on its outputs flattened in order
    (mean_square: every float output; the others: the first)."""
    parameters = dict(module.named_parameters())
    with torch.enable_grad(), _padding_rows_trained(module):
        leaves = [t for t in tree_leaves(module(*args)) if isinstance(t, torch.Tensor)]
        floats = [t for t in leaves if t.is_floating_point()]
        read = floats if loss.kind is LossKind.MEAN_SQUARE else floats[:1]
        value = torch.stack([loss.term(y, labels) for y in read]).sum()
        found = torch.autograd.grad(value, list(parameters.values()), allow_unused=True)
    pairs = zip(parameters, found, strict=True)
    return {name: grad.detach() for name, grad in pairs if grad is not None}


@contextmanager
def _padding_rows_trained(module: torch.nn.Module) -> Iterator[None]:
    """``module`` with no ``Embedding`` padding index while inside, restored on leaving.
    ``padding_idx`` changes only the gradient (the lookup's gradient skips that row), which
    the export's Gather cannot express: without it both sides differentiate the same
    function."""
    embeddings = [
        (sub, sub.padding_idx)
        for sub in module.modules()
        if isinstance(sub, torch.nn.Embedding) and sub.padding_idx is not None
    ]
    try:
        for sub, _ in embeddings:
            sub.padding_idx = None
        yield
    finally:
        for sub, index in embeddings:
            sub.padding_idx = index


def _pair(
    module: torch.nn.Module, model: onnx.ModelProto, expected: Mapping[str, torch.Tensor]
) -> tuple[dict[str, list[tuple[str, bool]]], list[str]]:
    """Module parameter -> the initializers holding it, each with whether it is stored
    transposed, for the parameters with a gradient. An initializer is a parameter's when it
    has its name, or its value (names the exporter changed), or for a matrix its transpose
    (the dynamo exporter stores a ``Linear``'s weight transposed for its MatMul); a tied
    weight (an embedding reused by a language model's head) may be held by several, whose
    gradients add up. Returns the pairs and the parameters no initializer holds."""
    initializers = {t.name: t for t in model.graph.initializer}
    values = dict(module.named_parameters())
    arrays: dict[str, np.ndarray] = {}
    pairs: dict[str, list[tuple[str, bool]]] = {n: [] for n in expected}
    taken = {n for n in expected if n in initializers}
    for name in expected:
        if name in initializers:
            pairs[name].append((name, False))
        value = values[name].detach().cpu().numpy()
        for other, tensor in initializers.items():
            if other in taken or math.prod(tensor.dims) != value.size:
                continue
            array = arrays.setdefault(other, numpy_helper.to_array(tensor))
            if array.shape == value.shape and np.array_equal(array, value):
                pairs[name].append((other, False))
            elif value.ndim == 2 and np.array_equal(array, value.T):
                pairs[name].append((other, True))
        taken.update(other for other, _ in pairs[name])
    unpaired = [name for name, held in pairs.items() if not held]
    return {name: held for name, held in pairs.items() if held}, unpaired
