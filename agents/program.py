"""A model bound to a graph for execution: what every graph node computes, and with which
tensors.

``build_program(model, graph)`` matches every forward node of ``graph`` (a forward graph or
the training graph ``remat`` built from the same model) to its ONNX operator (by its first
output name), materialises the fixed tensors (initializers, folded constants, and seeded
random model inputs) and decides which of them receive gradients. ``Program.compute`` then
evaluates any one node from the values of its dependencies, exactly the ones the graph
lists, so that an executor can run the nodes in any order a plan gives:

* a forward node's value is one tensor per ONNX output, and a training graph's MaxPool
  keeps its argmax after them, a fused attention its weights where its backward is the
  closed form (``remat.training.kept_bytes``), which only its backward node reads;
* the loss is the graph's (``remat.loss``: by default ``L = sum over model outputs y of
  0.5 * mean(y**2)``; or a cross-entropy of one output against labels, or the model's own
  scalar loss output); its value is ``dL/dy`` for each output of each node it reads (zeros
  for outputs it does not read), so its size is the graph's loss ``output_bytes``;
* a backward node's value is the gradient with respect to each float output its forward
  node reads of the nodes it reads (``remat.training.gradient_slots``, in ``deps`` order,
  zeros where none flows), so that it has the graph's ``output_bytes``; the gradients of
  parameters accumulate into gradient buffers instead. Its upstream gradient is the sum of
  its forward node's entries in the values of its upstream dependencies (the backward
  nodes of its users and/or the loss), zeros where none sends one. Inputs its gradient
  does not need (``remat.training.gradient_needs``) are not dependencies: the kernel gets
  zero-stride placeholders of the right shape for them.

A value's bytes are its tensors' whole storages, as the simulator counts them: a kernel
result that is a view into part of a larger buffer is copied (it would keep the whole
buffer), and one over the whole of another tensor's storage (the identity, a reshape, a
pass-through gradient) shares it, as in eager PyTorch, so that what a run allocates is at
most its account of values (``_owned``).

Every float parameter read at a differentiable position is trained
(``FixedTensor.has_gradient``; model inputs and constants are not).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

from agents import kernels
from agents.errors import TaskError, UnsupportedOpError
from agents.kernels import OpSpec, Tensor
from remat.graph import FixedKind, Graph, Node, NodeKind
from remat.loss import LossKind
from remat.onnx_fusion import DEFAULT_DOMAINS, FUSED_OPS, fused_node
from remat.onnx_ingest import reference_ops, tensors_read
from remat.onnx_noops import reading
from remat.training import gradient_slots

Value = tuple[Tensor, ...]
# A node's evaluation: (values, fixed tensors, gradient buffers, device) -> its value
Evaluator = Callable[
    [Mapping[int, Value], Mapping[str, Tensor], "GradientBuffers | None", torch.device], Value
]
# Constant inputs up to this many elements are also kept on the host inside the OpSpec, so
# that shapes, axes and pads are read without a device synchronisation.
_HOST_CONSTANT_ELEMENTS = 64


@dataclass(frozen=True)
class Source:
    """Where an ONNX input comes from: a node's output, a fixed tensor, or nothing."""

    node: int | None = None  # producing node
    output: int = 0  # index among that node's outputs
    fixed: str | None = None  # fixed tensor name

    @property
    def omitted(self) -> bool:
        return self.node is None and self.fixed is None


@dataclass(frozen=True)
class Upstream:
    """Where a forward node's gradients sit in an upstream value, the value of node
    ``node`` (a backward node or the loss): the position of each output's gradient there,
    None for an output it sends none for (``remat.training.gradient_slots``)."""

    node: int
    positions: tuple[int | None, ...]


@dataclass(frozen=True)
class LossOf:
    """The training graph's loss (the loss node's attributes, see ``remat.loss``)."""

    kind: LossKind
    output: str | None = None
    axis: int = -1
    labels: str | None = None  # cross_entropy: the fixed tensor of labels

    @classmethod
    def of(cls, graph: Graph) -> LossOf:
        node = next((n for n in graph.nodes if n.kind is NodeKind.LOSS), None)
        if node is None:
            return cls(LossKind.MEAN_SQUARE)
        attrs = node.attrs
        output, axis, labels = (attrs.get(k) for k in ("loss_output", "loss_axis", "loss_labels"))
        return cls(
            LossKind(str(attrs.get("loss", LossKind.MEAN_SQUARE.value))),
            str(output) if output is not None else None,
            axis if isinstance(axis, int) else -1,
            str(labels) if labels is not None else None,
        )

    def value(
        self, name: str, y: Tensor, fixed: Mapping[str, Tensor], model_outputs: frozenset[str]
    ) -> Tensor | None:
        """Output ``name``'s term of the loss (None: it adds nothing)."""
        if not y.is_floating_point():
            return None
        if self.kind is LossKind.MEAN_SQUARE:
            return self.term(y) if name in model_outputs else None
        if name != self.output:
            return None
        return self.term(y, fixed[self.labels] if self.labels is not None else None)

    def term(self, y: Tensor, labels: Tensor | None = None) -> Tensor:
        """The loss of one output ``y`` it reads (a cross-entropy's with ``labels``)."""
        if self.kind is LossKind.MEAN_SQUARE:
            return 0.5 * (y * y).mean()
        if self.kind is LossKind.OUTPUT:
            return y.sum()
        assert labels is not None
        logits = y.movedim(self.axis, -1).reshape(-1, y.shape[self.axis])
        target = labels.reshape(-1).to(device=y.device, dtype=torch.int64)
        return torch.nn.functional.cross_entropy(logits, target)

    def gradient(
        self, name: str, y: Tensor, fixed: Mapping[str, Tensor], model_outputs: frozenset[str]
    ) -> Tensor:
        """``dL/dy`` for output ``name`` (zeros where the loss does not read it)."""
        if not y.is_floating_point():
            return torch.zeros_like(y)
        if self.kind is LossKind.MEAN_SQUARE:
            return y / y.numel() if name in model_outputs else torch.zeros_like(y)
        if name != self.output:
            return torch.zeros_like(y)
        if self.kind is LossKind.OUTPUT:
            return torch.ones_like(y)
        assert self.labels is not None
        classes = y.shape[self.axis]
        labels = fixed[self.labels].to(device=y.device, dtype=torch.int64).unsqueeze(self.axis)
        grad = torch.softmax(y, dim=self.axis)
        grad.scatter_add_(self.axis, labels, torch.full_like(labels, -1, dtype=y.dtype))
        return grad.div_(y.numel() // classes)


# Where one kernel argument comes from: a fixed tensor (its name), a node's output (node,
# output index), nothing (an omitted input), or a placeholder of (shape, dtype) for an input
# the gradient does not read.
_Fetch = tuple[str | None, int | None, int, tuple[tuple[int, ...], torch.dtype] | None]


@dataclass(frozen=True)
class _Call:
    """What evaluating one node looks up and does not change between evaluations, prepared
    at its first (``Program._call``). ``args``: the forward node's inputs by position.
    For a forward node, ``forward``: its kernel (``kernels.prepared_forward``). For a
    backward node: whether it reads its forward node's output; per output of that
    node, the (node, tensor index) entries of its upstream gradient with the output's
    (shape, dtype), zeros where there are none (None: no gradient, ``_upstream_of``);
    per tensor of its value (``remat.training.gradient_slots``), the argument positions
    whose gradients sum into it with its (shape, dtype); the positions that read a
    fixed tensor, with its name; and whether its rule makes each of their gradients a
    tensor of its own (``kernels.FRESH_GRADIENTS``)."""

    node: Node
    spec: OpSpec
    args: tuple[_Fetch, ...]
    forward: Callable[[kernels.Args], tuple[kernels.Outputs, kernels.Outputs | None]] | None = None
    reads_output: bool = False
    upstream: tuple[
        tuple[tuple[tuple[int, int], ...], tuple[int, ...], torch.dtype] | None, ...
    ] = ()
    slots: tuple[tuple[tuple[int, ...], tuple[int, ...], torch.dtype], ...] = ()
    fixed: tuple[tuple[int, str], ...] = ()
    fresh: bool = False  # its rule's gradients are tensors of their own (FRESH_GRADIENTS)


class GradientBuffers(dict[str, Tensor]):
    """A run's gradient buffers by fixed tensor, allocated before it without a fill (the
    simulator counts them from the plan's start). The first gradient written into a buffer
    takes its place where it owns its storage and matches it, else is copied into it;
    later ones are added. ``settle`` zeroes those never written, ``rewind`` starts over
    (the profiler's next pass). Concurrent sections write from several threads: a lock."""

    def __init__(self, buffers: Mapping[str, Tensor]) -> None:
        super().__init__(buffers)
        self.unwritten = set(buffers)
        self.lock = threading.Lock()

    @classmethod
    def allocate(
        cls, names: Sequence[str], like: Mapping[str, Tensor], device: torch.device
    ) -> GradientBuffers:
        return cls({name: torch.empty_like(like[name], device=device) for name in names})

    def add(self, name: str, grad: Tensor, shared: bool) -> None:
        """Write or add ``grad`` into ``name``'s buffer; ``shared``: its storage is also
        another tensor's (an input, the upstream gradient), so it is never taken."""
        with self.lock:
            buffer = self[name]
            if name not in self.unwritten:
                buffer.add_(grad)
                return
            self.unwritten.discard(name)
            # its storage its own and alike the buffer (inline: at every first write)
            if (
                not shared
                and grad.untyped_storage().nbytes() == grad.nbytes
                and grad.is_contiguous()
                and grad.shape == buffer.shape
                and grad.dtype == buffer.dtype
                and grad.device == buffer.device
            ):
                self[name] = grad.detach() if grad.requires_grad else grad
            else:
                buffer.copy_(grad)

    def take(self, name: str, grad: Tensor) -> None:
        """Write or add ``grad`` into ``name``'s buffer, where its rule made it for the
        buffer alone (``kernels.FRESH_GRADIENTS``: its own storage, the buffer's shape and
        type): taken at the first write with no check."""
        with self.lock:
            if name in self.unwritten:
                self.unwritten.discard(name)
                self[name] = grad.detach() if grad.requires_grad else grad
            else:
                self[name].add_(grad)

    def settle(self, names: Iterable[str] | None = None) -> None:
        """Zero the buffers (of ``names``; None: all) no gradient was written into."""
        with self.lock:
            for name in self.unwritten & set(self if names is None else names):
                self[name].zero_()
                self.unwritten.discard(name)

    def rewind(self) -> None:
        with self.lock:
            self.unwritten = set(self)


@dataclass
class Program:
    graph: Graph
    specs: dict[int, OpSpec]  # forward node -> its operator
    sources: dict[int, list[Source]]  # forward node -> its inputs by ONNX position
    upstream: dict[int, list[Upstream]]  # backward node -> where its upstream gradient is
    fixed: dict[str, Tensor]  # every fixed tensor's value, on the host
    trainable: frozenset[str]  # fixed tensors that receive gradients
    model_outputs: frozenset[str]
    types: dict[str, torch.dtype]  # element type of every activation tensor
    output_shapes: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    loss: LossOf = field(default_factory=lambda: LossOf(LossKind.MEAN_SQUARE))
    # What evaluating a node looks up and does not change between evaluations, kept at its
    # first: (shape, dtype) per forward node's output; per backward node, which of its
    # forward node's inputs want a gradient.
    _outputs: dict[int, list[tuple[tuple[int, ...], torch.dtype]]] = field(
        default_factory=dict, init=False, repr=False
    )
    _rules: dict[int, kernels.Prepared] = field(default_factory=dict, init=False, repr=False)
    _calls: dict[int, _Call] = field(default_factory=dict, init=False, repr=False)
    # zero-stride placeholders by (shape, dtype, device): read-only, so shared
    _placeholders: dict[tuple[tuple[int, ...], torch.dtype, torch.device], Tensor] = field(
        default_factory=dict, init=False, repr=False
    )
    # Forward node -> what its kernel saved for its gradient at its latest evaluation
    # (``kernels.forward_and_saved``), with the input tensor it was computed from: a backward
    # node reads it only where it gets that very tensor (not a recomputed or paged-in copy).
    _saved: dict[int, tuple[weakref.ref[Tensor], Value]] = field(
        default_factory=dict, init=False, repr=False
    )

    # --- layout --------------------------------------------------------------------------

    def forward_of(self, node: Node) -> Node:
        """The forward node a node computes with (itself unless it is a backward node)."""
        return self.graph.nodes[node.forward] if node.forward is not None else node

    def outputs_of(self, node: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each tensor of a forward node's value."""
        found = self._outputs.get(node)
        if found is None:
            names = self.graph.nodes[node].attrs["onnx_outputs"]
            assert isinstance(names, list)
            found = self._outputs[node] = [
                (shape, self.types.get(name, torch.float32))
                for name, shape in zip(names, self.output_shapes[node], strict=True)
            ]
        return found

    def gradient_buffers(self, nodes: Sequence[int]) -> list[str]:
        """The fixed tensors a device computing ``nodes`` keeps a gradient buffer for (the
        simulator's rule: those read by backward nodes, when they have a gradient)."""
        names: dict[str, None] = {}
        for index in nodes:
            node = self.graph.nodes[index]
            if node.kind is NodeKind.BACKWARD:
                names.update((t, None) for t in node.fixed if self.graph.fixed[t].has_gradient)
        return list(names)

    def held_fixed(self, nodes: Sequence[int]) -> list[str]:
        """The fixed tensors a device computing ``nodes`` holds."""
        names: dict[str, None] = {}
        for index in nodes:
            names.update((t, None) for t in self.graph.nodes[index].fixed)
        return list(names)

    # --- evaluation ----------------------------------------------------------------------

    def compute(
        self,
        index: int,
        values: Mapping[int, Value],
        fixed: Mapping[str, Tensor],
        grads: GradientBuffers | None,
        device: torch.device,
    ) -> Value:
        """Node ``index``'s value from its dependencies' ``values`` and the ``fixed``
        tensors on ``device``; a backward node adds its parameter gradients to
        ``grads`` (None: drop them, e.g. when a backward node is recomputed)."""
        return self.evaluator(index)(values, fixed, grads, device)

    def evaluator(self, index: int, in_place: bool = False) -> Evaluator:
        """``compute`` for node ``index``, with what it looks up by the node's kind made
        once: what the executor and the profiler call at every evaluation of the node.
        ``in_place``: a forward node's output written into its input, whose value nothing
        reads afterwards (``agents.in_place``)."""
        node = self.graph.nodes[index]
        if node.kind is NodeKind.LOSS:
            return partial(self._loss, node)
        call = self._calls.get(index) or self._call(index)
        if call.forward is not None:
            forward = kernels.prepared_forward(call.spec, True) if in_place else call.forward
            return partial(self._forward, index, call.args, forward)
        return partial(self._backward, call)

    def _forward(
        self,
        index: int,
        fetches: tuple[_Fetch, ...],
        forward: Callable[[kernels.Args], tuple[kernels.Outputs, kernels.Outputs | None]],
        values: Mapping[int, Value],
        fixed: Mapping[str, Tensor],
        grads: GradientBuffers | None,
        device: torch.device,
    ) -> Value:
        args = self._fetch(fetches, values, fixed, device)
        result, saved = forward(args)
        if saved is not None and args and args[0] is not None:
            self._saved[index] = (weakref.ref(args[0]), saved)
        return _owned(result)

    def _call(self, index: int) -> _Call:
        """Forward or backward node ``index``'s prepared call (``_Call``), made at its
        first evaluation."""
        node = self.graph.nodes[index]
        if node.kind is NodeKind.FORWARD:
            spec = self.specs[index]
            call = _Call(node, spec, self._fetches(index, None), kernels.prepared_forward(spec))
        else:
            f = self.forward_of(node)
            read = frozenset(node.deps)
            sources = self.sources[f.id]
            upstream = tuple(
                self._upstream_of(index, k, shape, dtype)
                for k, (shape, dtype) in enumerate(self.outputs_of(f.id))
            )
            positions: dict[tuple[int, int], list[int]] = {}
            for position, source in enumerate(sources):
                if source.node is not None:
                    positions.setdefault((source.node, source.output), []).append(position)
            slots = tuple(
                (tuple(positions.get((dep, k), ())), *self.outputs_of(dep)[k])
                for dep, k, _ in gradient_slots(f, self.graph.nodes)
            )
            fixed = tuple(
                (position, source.fixed)
                for position, source in enumerate(sources)
                if source.fixed is not None
            )
            fetches = self._fetches(f.id, read)
            spec = self.specs[f.id]
            fresh = spec.op_type in kernels.FRESH_GRADIENTS
            call = _Call(node, spec, fetches, None, f.id in read, upstream, slots, fixed, fresh)
        self._calls[index] = call
        return call

    def _upstream_of(
        self, index: int, k: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...], torch.dtype] | None:
        """Where backward node ``index``'s upstream gradient of its forward node's output
        ``k`` is, with the output's (shape, dtype); None (a zero gradient, ``VjpCall``)
        for an output that is not a float, or after the first that no node sends a
        gradient for (a BatchNormalization's running statistics): no zeros are made at
        every step for it. The first output's stays zeros: rules read it as ``call.g``."""
        if not dtype.is_floating_point:
            return None
        parts = tuple(
            (u.node, position)
            for u in self.upstream[index]
            if (position := u.positions[k]) is not None
        )
        if not parts and k > 0:
            return None
        return parts, shape, dtype

    def _fetches(self, forward: int, read: frozenset[int] | None) -> tuple[_Fetch, ...]:
        """Where each input of forward node ``forward`` comes from; an input computed by a
        node not in ``read`` (None: all are) becomes a placeholder of its shape."""
        fetches: list[_Fetch] = []
        for source in self.sources[forward]:
            hollow = None
            if source.node is not None and read is not None and source.node not in read:
                hollow = self.outputs_of(source.node)[source.output]
            fetches.append((source.fixed, source.node, source.output, hollow))
        return tuple(fetches)

    def _fetch(
        self,
        fetches: Sequence[_Fetch],
        values: Mapping[int, Value],
        fixed: Mapping[str, Tensor],
        device: torch.device,
    ) -> list[Tensor | None]:
        args: list[Tensor | None] = []
        for name, node, output, hollow in fetches:
            if name is not None:
                args.append(fixed[name])
            elif node is None:
                args.append(None)
            elif hollow is None:
                args.append(values[node][output])
            else:
                args.append(self._placeholder(*hollow, device))
        return args

    def _placeholder(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """A placeholder (``kernels.placeholder``), one per shape, type and device: it is
        only read."""
        key = (shape, dtype, device)
        found = self._placeholders.get(key)
        if found is None:
            found = self._placeholders[key] = kernels.placeholder(shape, dtype, device)
        return found

    def _loss(
        self,
        node: Node,
        values: Mapping[int, Value],
        fixed: Mapping[str, Tensor],
        grads: GradientBuffers | None,
        device: torch.device,
    ) -> Value:
        result = []
        for dep in node.deps:
            names = self.graph.nodes[dep].attrs["onnx_outputs"]
            assert isinstance(names, list)
            for name, y in zip(names, values[dep][: len(names)], strict=True):
                result.append(self.loss.gradient(name, y, fixed, self.model_outputs))
        return tuple(result)

    def _backward(
        self,
        call: _Call,
        values: Mapping[int, Value],
        fixed: Mapping[str, Tensor],
        grads: GradientBuffers | None,
        device: torch.device,
    ) -> Value:
        f = call.node.forward
        assert f is not None
        args = self._fetch(call.args, values, fixed, device)
        output = values[f] if call.reads_output else None
        upstream: list[Tensor | None] = []
        for up in call.upstream:
            if up is None:
                upstream.append(None)
            elif len(parts := up[0]) == 1:  # one part as it is, inline: the common case
                node, index = parts[0]
                upstream.append(values[node][index])
            else:
                upstream.append(_summed(values, *up, device))
        rule = self._rules.get(call.node.id)
        if rule is None:  # static: the arguments' presence, types and shapes do not change
            wanted = [
                self._wanted(call, position, arg, source)
                for position, (arg, source) in enumerate(zip(args, self.sources[f], strict=True))
            ]
            rule = self._rules[call.node.id] = kernels.prepared_vjp(call.spec, args, wanted)
        found = rule(args, output, upstream, self._saved_for(f, args))
        result = []
        for slot in call.slots:
            positions = slot[0]
            # one position's gradient as it is, inline: the common case, at every step
            if len(positions) == 1 and (grad := found[positions[0]]) is not None:
                result.append(grad)
            else:
                result.append(_slot(found, *slot, device))
        if grads is not None and call.fixed:
            self._accumulate(call, found, grads, (args, output or (), upstream))
        return _owned(result)

    def _saved_for(self, f: int, args: Sequence[Tensor | None]) -> Value | None:
        """What forward node ``f``'s kernel saved at its latest evaluation, where that was
        from the very input tensor the backward node gets."""
        entry = self._saved.get(f)
        if entry is None or not args or args[0] is None or entry[0]() is not args[0]:
            return None
        return entry[1]

    def _wanted(self, call: _Call, position: int, arg: Tensor | None, source: Source) -> bool:
        """Whether the backward computes the gradient at ``position``: a float input that
        is differentiable there, and whose gradient is a tensor of the node's value
        (``call.slots``: not an attention's mask computed from data alone) or goes to a
        trained tensor's buffer."""
        if arg is None or not arg.is_floating_point():
            return False
        if not kernels.differentiable(call.spec, position):
            return False
        if source.node is not None:
            return any(position in positions for positions, _, _ in call.slots)
        return source.fixed in self.trainable

    def _accumulate(
        self,
        call: _Call,
        found: Sequence[Tensor | None],
        grads: GradientBuffers,
        read: tuple[Sequence[Tensor | None], ...],
    ) -> None:
        """Each fixed input's gradient into its buffer. One written first whose storage is
        also another tensor's (``_shares_storage``: what the node ``read``, another of its
        gradients) is copied, not taken; the check is made only then, and not for a rule
        whose gradients are each a tensor of its own (``call.fresh``)."""
        for position, name in call.fixed:
            grad = found[position]
            if grad is None or name not in grads:
                continue
            if call.fresh:
                grads.take(name, grad)
                continue
            first = name in grads.unwritten
            grads.add(name, grad, first and _shares_storage(grad, found, read))

    # --- plain execution (the references) ------------------------------------------------

    def in_float64(self) -> Program:
        """This program with its floating-point fixed tensors in float64: its plain forward
        run and gradients are the exact reference fp32 results are measured against."""
        fixed = {n: t.double() if t.is_floating_point() else t for n, t in self.fixed.items()}
        return replace(self, fixed=fixed)

    def forward_values(self, device: torch.device | None = None) -> dict[int, Value]:
        """Every forward node's value, computed in node order on one device (host)."""
        device = device or torch.device("cpu")
        fixed = {name: t.to(device) for name, t in self.fixed.items()}
        values: dict[int, Value] = {}
        for node in self.graph.nodes:
            if node.kind is NodeKind.FORWARD:
                values[node.id] = self.compute(node.id, values, fixed, None, device)
        return values

    def reference_gradients(self) -> dict[str, Tensor]:
        """Plain end-to-end autograd on the host: the forward kernels in node order, the
        loss, and ``torch.autograd.grad`` for every trainable fixed tensor."""
        names = sorted(self.trainable)
        with torch.enable_grad():
            fixed = {
                name: t.detach().requires_grad_(name in self.trainable)
                for name, t in self.fixed.items()
            }
            outputs: dict[int, Value] = {}
            for node in self.graph.nodes:
                if node.kind is NodeKind.FORWARD:
                    fetches = (self._calls.get(node.id) or self._call(node.id)).args
                    args = self._fetch(fetches, outputs, fixed, torch.device("cpu"))
                    outputs[node.id] = kernels.run_forward(self.specs[node.id], args)
            loss = self._plain_loss(outputs, fixed)
            if not names or not loss.requires_grad:
                return {}
            found = torch.autograd.grad(loss, [fixed[n] for n in names], allow_unused=True)
        return {
            name: (grad if grad is not None else torch.zeros_like(self.fixed[name]))
            for name, grad in zip(names, found, strict=True)
        }

    def _plain_loss(self, outputs: Mapping[int, Value], fixed: Mapping[str, Tensor]) -> Tensor:
        terms = []
        for node in self.graph.forward_nodes():
            names = node.attrs["onnx_outputs"]
            assert isinstance(names, list)
            for name, y in zip(names, outputs[node.id][: len(names)], strict=True):
                term = self.loss.value(name, y, fixed, self.model_outputs)
                if term is not None:
                    terms.append(term)
        return torch.stack(terms).sum() if terms else torch.zeros(())

    def model_output_values(self, values: Mapping[int, Value]) -> dict[str, Tensor]:
        """The model's outputs by name, from forward values."""
        result = {}
        for index in self.graph.outputs:
            if index not in values:
                continue
            names = self.graph.nodes[index].attrs["onnx_outputs"]
            assert isinstance(names, list)
            for name, tensor in zip(names, values[index], strict=True):
                if name in self.model_outputs:
                    result[name] = tensor
        return result


def value_bytes(value: Value) -> int:
    """The bytes a value is counted for: its tensors' whole storages (``_owned``)."""
    total = 0
    for t in value:  # a loop: this runs at every step, and a generator costs more
        total += t.untyped_storage().nbytes()
    return total


def _summed(
    values: Mapping[int, Value],
    parts: Sequence[tuple[int, int]],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """The sum of the tensors at ``parts`` ((node, tensor index) in ``values``); zeros of
    ``shape`` where there are none (an output no upstream node sends a gradient for)."""
    if not parts:
        return torch.zeros(shape, dtype=dtype, device=device)
    node, index = parts[0]
    total = values[node][index]
    if len(parts) > 1:
        node, index = parts[1]
        total = total + values[node][index]  # a tensor of its own: the parts are values
        for node, index in parts[2:]:
            total.add_(values[node][index])  # into it, as autograd accumulates: no allocation
    return total


def _slot(
    found: Sequence[Tensor | None],
    positions: Sequence[int],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """One tensor of a backward node's value: the sum of the gradients ``found`` at
    ``positions`` (an input read at several positions gets each one's), zeros where none
    flows."""
    total: Tensor | None = None
    for position in positions:
        grad = found[position]
        if grad is not None:
            total = grad if total is None else total + grad
    if total is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    assert total.shape == shape, (total.shape, shape)
    return total


def _shares_storage(
    grad: Tensor, found: Sequence[Tensor | None], read: tuple[Sequence[Tensor | None], ...]
) -> bool:
    """Whether another tensor holds ``grad``'s storage: a view of it, the tensor it is a
    view of (the storage has another holder than ``grad``), or ``grad`` itself in another
    place: a tensor the node read (a pass-through gradient) or another position's
    gradient. Identity and one holder count, not a scan of every tensor's storage: this
    runs at a buffer's first write, at every backward step that reads a parameter."""
    # PyTorch's count of the storage's holders: ``grad`` and the storage object made here
    if torch._C._storage_Use_Count(grad.untyped_storage()._cdata) > 2:
        return True
    places = 0
    for t in found:
        if t is grad:
            places += 1
    if places > 1:
        return True
    for tensors in read:
        for t in tensors:
            if t is grad:
                return True
    return False


def _owned(result: Sequence[Tensor]) -> Value:
    """``result`` with no tensor a view into part of a larger buffer (a slice, a Gather of
    one row, a Split's part): such a tensor is copied, since it would keep the whole buffer
    allocated for its own bytes. A tensor over the whole of another's storage (the
    identity, a reshape or transpose of a whole tensor, a pass-through gradient) shares it,
    as eager PyTorch does: the account counts it as its own bytes, as the simulator does,
    so that what is allocated is at most the account."""
    owned = []
    for t in result:
        # a view of part of its storage (an empty view too, copied at no cost)
        if t.untyped_storage().nbytes() != t.nbytes:
            t = t.clone(memory_format=torch.contiguous_format)
        owned.append(t.detach() if t.requires_grad else t)
    return tuple(owned)


# --- building --------------------------------------------------------------------------------


def build_program(
    model: onnx.ModelProto,
    graph: Graph,
    inputs: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
) -> Program:
    """Bind ``graph`` (built by ``remat`` from ``model``) to ``model``'s operators.

    ``inputs`` gives model input values by name; the others are seeded random normals
    (integers: zeros, valid indices for any Gather). ``seed`` also seeds the operators'
    randomness (a training-mode Dropout's mask, one per node: ``kernels.random_mask``).
    UnsupportedOpError names the first operator without a kernel."""
    if any(t.kind is FixedKind.HELD for t in graph.fixed.values()):
        raise TaskError("the graph is a part of a decomposed graph (held values): not executable")
    protos = {o: p for p in model.graph.node for o in p.output if o}
    shapes = _tensor_shapes(graph)
    types = _tensor_types(model)
    forward = [n for n in graph.nodes if n.kind is NodeKind.FORWARD]
    loss = LossOf.of(graph)
    fixed = _fixed_values(model, graph, shapes, types, inputs or {}, seed, loss)
    opsets = {
        (o.domain if o.domain not in DEFAULT_DOMAINS else ""): o.version for o in model.opset_import
    }
    read = tensors_read(model) | ({loss.output} if loss.output is not None else set())
    specs: dict[int, OpSpec] = {}
    sources: dict[int, list[Source]] = {}
    producer: dict[str, tuple[int, int]] = {}
    for node in forward:
        outputs = _names(node, "onnx_outputs")
        if node.op in FUSED_OPS:
            proto: onnx.NodeProto | None = _fused(node)
        else:
            proto = protos.get(outputs[0]) if outputs else None
        if proto is None:
            raise TaskError(f"node {node.name!r} matches no operator of the model")
        proto = _reading_as_ingested(proto, node)
        consts = {
            position: fixed[name].numpy()
            for position, name in enumerate(proto.input)
            if name in fixed and fixed[name].numel() <= _HOST_CONSTANT_ELEMENTS
        }
        seed_of_node = kernels.node_seed(seed, node.name)
        spec = kernels.spec_of(proto, node.name, opsets, consts, seed_of_node)
        kept = [suffix for flag, suffix in _KEPT_OUTPUTS.items() if node.attrs.get(flag)]
        if kept:  # the second output is the backward's
            spec = replace(spec, outputs=(outputs[0], f"{outputs[0]}{kept[0]}"))
        else:
            unread = (k for k, name in enumerate(spec.outputs) if name and name not in read)
            spec = replace(spec, unread=frozenset(unread))
        kernels.check_supported(spec)
        specs[node.id] = spec
        sources[node.id] = [_source(name, producer, graph) for name in proto.input]
        producer.update((name, (node.id, k)) for k, name in enumerate(outputs))
    for name, tensor in fixed.items():
        types.setdefault(name, tensor.dtype)
    return Program(
        graph=graph,
        specs=specs,
        sources=sources,
        upstream=_upstream(graph),
        fixed=fixed,
        trainable=_trainable(graph, specs, sources, fixed),
        model_outputs=frozenset(o.name for o in model.graph.output),
        types=types,
        output_shapes={n.id: [tuple(s) for s in _shapes(n, "output_shapes")] for n in forward},
        loss=loss,
    )


# A training graph's flag for what a forward node keeps beside its output for its backward
# (``remat.training.kept_bytes``), and the name's suffix of that second output
_KEPT_OUTPUTS = {"keeps_argmax": kernels.KEPT_ARGMAX, "keeps_weights": kernels.KEPT_WEIGHTS}


def _fused(node: Node) -> onnx.NodeProto:
    """The operator ingestion made of several of the model's (``remat.onnx_fusion``)."""
    attributes = node.attrs.get("fused_attributes", {})
    assert isinstance(attributes, dict)
    outputs = _names(node, "onnx_outputs")
    return fused_node(node.op, _names(node, "onnx_inputs"), outputs, node.name, **attributes)


def _reading_as_ingested(proto: onnx.NodeProto, node: Node) -> onnx.NodeProto:
    """``proto`` reading what ``node`` reads: where ingestion bypassed an operator that
    computes nothing (``remat.onnx_noops``), a copy that reads its input instead."""
    read = iter(_names(node, "onnx_inputs"))  # the non-empty inputs, in order
    return reading(proto, [next(read, name) if name else name for name in proto.input])


def _names(node: Node, key: str) -> list[str]:
    names = node.attrs.get(key)
    if not isinstance(names, list):
        raise TaskError(f"node {node.name!r} has no {key}: build the graph with remat")
    return names


def _shapes(node: Node, key: str) -> list[tuple[int, ...]]:
    shapes = node.attrs.get(key)
    if not isinstance(shapes, list):
        raise TaskError(f"node {node.name!r} has no {key}: build the graph with remat")
    return shapes


def _source(name: str, producer: Mapping[str, tuple[int, int]], graph: Graph) -> Source:
    if not name:
        return Source()
    if name in producer:
        node, output = producer[name]
        return Source(node=node, output=output)
    if name in graph.fixed:
        return Source(fixed=name)
    raise TaskError(f"tensor {name!r} is neither a node output nor a fixed tensor of the graph")


def _tensor_shapes(graph: Graph) -> dict[str, tuple[int, ...]]:
    """Every tensor a forward node reads or writes, with the shape remat inferred."""
    shapes: dict[str, tuple[int, ...]] = {}
    for node in graph.forward_nodes():
        pairs = [
            *zip(_names(node, "onnx_inputs"), _shapes(node, "input_shapes"), strict=True),
            *zip(_names(node, "onnx_outputs"), _shapes(node, "output_shapes"), strict=True),
        ]
        shapes.update((name, tuple(int(d) for d in shape)) for name, shape in pairs)
    return shapes


def _tensor_types(model: onnx.ModelProto) -> dict[str, torch.dtype]:
    """Element types from ONNX type inference (they do not depend on the batch)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # inference is best effort here; unknown types default to float32
        inferred = model
    types: dict[str, torch.dtype] = {}
    graph = inferred.graph
    for value in (*graph.input, *graph.value_info, *graph.output):
        elem = value.type.tensor_type.elem_type
        if elem in kernels.DTYPES:
            types[value.name] = kernels.DTYPES[elem]
    for tensor in graph.initializer:
        if tensor.data_type in kernels.DTYPES:
            types[tensor.name] = kernels.DTYPES[tensor.data_type]
    return types


def _upstream(graph: Graph) -> dict[int, list[Upstream]]:
    """For each backward node, where its forward node's gradients sit in the values of the
    nodes upstream of it: the loss's value holds a gradient for every output of each node
    it reads; a backward node's, those of ``remat.training.gradient_slots``."""
    result: dict[int, list[Upstream]] = {}
    outputs = {n.id: n.attrs.get("onnx_outputs") for n in graph.forward_nodes()}
    counts = {i: len(names) if isinstance(names, list) else 0 for i, names in outputs.items()}
    layouts: dict[int, dict[tuple[int, int], int]] = {}  # by backward node: (dep, k) -> position
    for node in graph.nodes:
        if node.kind is not NodeKind.BACKWARD:
            continue
        f = node.forward
        assert f is not None
        slots = gradient_slots(graph.nodes[f], graph.nodes)
        layouts[node.id] = {(dep, k): position for position, (dep, k, _) in enumerate(slots)}
        entries = []
        for dep in node.deps:
            upper = graph.nodes[dep]
            if upper.kind is NodeKind.LOSS:
                offset = sum(counts[d] for d in upper.deps if d < f)
                entries.append(Upstream(dep, tuple(offset + k for k in range(counts[f]))))
            elif upper.kind is NodeKind.BACKWARD:
                layout = layouts[dep]
                entries.append(Upstream(dep, tuple(layout.get((f, k)) for k in range(counts[f]))))
        result[node.id] = entries
    return result


def _trainable(
    graph: Graph,
    specs: Mapping[int, OpSpec],
    sources: Mapping[int, list[Source]],
    fixed: Mapping[str, Tensor],
) -> frozenset[str]:
    """Float parameters that a backward node differentiates: read at a
    differentiable position of its forward node."""
    reachable: set[str] = set()
    for node in graph.nodes:
        if node.kind is not NodeKind.BACKWARD or node.forward is None:
            continue
        f = graph.nodes[node.forward]
        for position, source in enumerate(sources[f.id]):
            if source.fixed is not None and kernels.differentiable(specs[f.id], position):
                reachable.add(source.fixed)
    return frozenset(
        name
        for name in reachable
        if graph.fixed[name].has_gradient and fixed[name].is_floating_point()
    )


# --- fixed tensors ---------------------------------------------------------------------------


def _fixed_values(
    model: onnx.ModelProto,
    graph: Graph,
    shapes: Mapping[str, tuple[int, ...]],
    types: Mapping[str, torch.dtype],
    inputs: Mapping[str, np.ndarray],
    seed: int,
    loss: LossOf,
) -> dict[str, Tensor]:
    initializers = {t.name: t for t in model.graph.initializer}
    values: dict[str, Tensor] = {}
    folded: list[str] = []
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in graph.fixed.items():
        if name == loss.labels:
            values[name] = _labels(name, inputs, shapes, loss, generator)
        elif tensor.kind is FixedKind.INPUT:
            values[name] = _input_value(name, inputs, shapes, types, model, generator)
        elif name in initializers:
            values[name] = _tensor(numpy_helper.to_array(initializers[name]))
        else:
            folded.append(name)
    if folded:
        evaluated = _evaluate_constants(model, graph, folded, shapes)
        values.update((n, _tensor(evaluated[n])) for n in folded)
    return values


def _input_value(
    name: str,
    given: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, ...]],
    types: Mapping[str, torch.dtype],
    model: onnx.ModelProto,
    generator: torch.Generator,
) -> Tensor:
    if name in given:
        return _tensor(given[name])
    shape = shapes.get(name) or _declared_shape(model, name)
    dtype = types.get(name, torch.float32)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype)
    return torch.zeros(shape, dtype=dtype)


def _labels(
    name: str,
    given: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, ...]],
    loss: LossOf,
    generator: torch.Generator,
) -> Tensor:
    """A cross-entropy's labels: given with the inputs, else uniform over the classes."""
    assert loss.output is not None
    logits = shapes[loss.output]
    shape = logits[: loss.axis] + logits[loss.axis + 1 :]
    if name not in given:
        return torch.randint(0, logits[loss.axis], shape, generator=generator)
    labels = _tensor(given[name])
    if tuple(labels.shape) != shape or labels.is_floating_point() or labels.is_complex():
        raise TaskError(
            f"labels {name!r} must be integers of shape {shape}, got {labels.dtype} "
            f"of shape {tuple(labels.shape)}"
        )
    if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < logits[loss.axis]:
        raise TaskError(f"labels {name!r} must lie in [0, {logits[loss.axis]})")
    return labels.to(torch.int64)


def _tensor(array: np.ndarray) -> Tensor:
    """A tensor owning a writable copy (arrays from onnx.reference may be read-only)."""
    return torch.from_numpy(np.array(array, copy=True, order="C"))


def _declared_shape(model: onnx.ModelProto, name: str) -> tuple[int, ...]:
    for value in model.graph.input:
        if value.name == name:
            dims = value.type.tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                return tuple(d.dim_value for d in dims)
    raise TaskError(f"model input {name!r} has no known shape: pass its value")


def _evaluate_constants(
    model: onnx.ModelProto,
    graph: Graph,
    names: Sequence[str],
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, np.ndarray]:
    """Values of folded constants (outputs of operators remat folded: Constant,
    ConstantOfShape, shape arithmetic, ...), with ``onnx.reference`` on the operators they
    depend on; ``Shape``/``Size`` of an activation become constants of its known shape."""
    from onnx.reference import ReferenceEvaluator  # slow import, rarely needed

    activations = {o for n in graph.forward_nodes() for o in _names(n, "onnx_outputs")}
    activations |= {n for n, t in graph.fixed.items() if t.kind is FixedKind.INPUT}
    producers = {o: (i, p) for i, p in enumerate(model.graph.node) for o in p.output if o}
    initializers = {t.name: t for t in model.graph.initializer}
    needed: dict[int, onnx.NodeProto] = {}
    used_initializers: set[str] = set()
    stack = list(names)
    while stack:
        name = stack.pop()
        if name in initializers:
            used_initializers.add(name)
            continue
        if name not in producers:
            raise TaskError(f"cannot evaluate constant {name!r}: no operator produces it")
        index, proto = producers[name]
        if index in needed:
            continue
        if proto.op_type in ("Shape", "Size") and proto.input[0] in activations:
            needed[index] = _shape_constant(proto, shapes)
            continue
        needed[index] = proto
        stack.extend(i for i in proto.input if i)
    nodes = [needed[i] for i in sorted(needed)]
    sub = helper.make_graph(
        nodes,
        "constants",
        [],
        [helper.make_empty_tensor_value_info(n) for n in names],
        initializer=[initializers[n] for n in sorted(used_initializers)],
    )
    sub_model = helper.make_model(sub, opset_imports=list(model.opset_import))
    sub_model.ir_version = model.ir_version
    sub_model.functions.extend(model.functions)
    try:
        results = ReferenceEvaluator(sub_model, new_ops=list(reference_ops())).run(None, {})
    except Exception as error:  # any failure of the reference implementation
        raise TaskError(f"cannot evaluate the model's constant tensors: {error}") from error
    return {name: np.asarray(value) for name, value in zip(names, results, strict=True)}


def _shape_constant(proto: onnx.NodeProto, shapes: Mapping[str, tuple[int, ...]]) -> onnx.NodeProto:
    source = proto.input[0]
    if source not in shapes:
        raise TaskError(f"cannot evaluate {proto.op_type} of {source!r}: its shape is unknown")
    dims = list(shapes[source])
    if proto.op_type == "Size":
        value = np.array(int(np.prod(dims)), dtype=np.int64)
    else:
        attrs = {a.name: helper.get_attribute_value(a) for a in proto.attribute}
        value = np.array(dims, dtype=np.int64)[attrs.get("start", 0) : attrs.get("end", len(dims))]
    return helper.make_node(
        "Constant", [], [proto.output[0]], value=numpy_helper.from_array(value, proto.output[0])
    )


# --- gradients of the model's own initializers ---------------------------------------------


def initializer_gradients(
    model: onnx.ModelProto, program: Program, grads: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """The gradients of ``model``'s initializers, from ``grads`` (the trained fixed tensors'
    gradients of a run of ``program``): an initializer the graph reads has its own; a weight
    folded from initializers by a constant subgraph (a recurrent layer's gates packed and
    reordered by the exporter, a weight transposed or reshaped before use) passes its
    gradient back to them through that subgraph, evaluated with the kernels under autograd.
    Initializers whose path to a folded weight holds an operator without a kernel get
    nothing from it."""
    initializers = {t.name: t for t in model.graph.initializer}
    result = {name: g for name, g in grads.items() if name in initializers}
    folded = [n for n in grads if n not in initializers]
    producers = {o: p for p in model.graph.node for o in p.output if o}
    depends = _depends_on_initializers(folded, producers, initializers)
    nodes = [p for p in model.graph.node if any(o in depends for o in p.output)]
    if not nodes:
        return result
    leaves = {
        name: _tensor(numpy_helper.to_array(initializers[name])).requires_grad_(True)
        for name in depends
        if name in initializers and initializers[name].data_type in _FLOAT_TYPES
    }
    others = sorted(
        {i for p in nodes for i in p.input if i and i not in depends and i not in initializers}
    )
    opsets = {(o.domain if o.domain not in DEFAULT_DOMAINS else ""): o.version
              for o in model.opset_import}  # fmt: skip
    shapes = _tensor_shapes(program.graph)
    read = {i for p in nodes for i in p.input if i in initializers}
    values = {n: _tensor(numpy_helper.to_array(initializers[n])) for n in read} | leaves
    try:
        if others:
            evaluated = _evaluate_constants(model, program.graph, others, shapes)
            values |= {n: _tensor(v) for n, v in evaluated.items()}
        with torch.enable_grad():
            for proto in nodes:
                consts = {
                    k: values[i].detach().numpy()
                    for k, i in enumerate(proto.input)
                    if i and values[i].numel() <= _HOST_CONSTANT_ELEMENTS
                }
                spec = kernels.spec_of(proto, proto.name, opsets, consts)
                outputs = kernels.run_forward(spec, [values[i] if i else None for i in proto.input])
                values.update(zip([o for o in proto.output if o], outputs, strict=False))
            targets = [n for n in folded if n in values and values[n].requires_grad]
            if not targets:
                return result
            pulled = torch.autograd.grad(
                [values[n] for n in targets],
                list(leaves.values()),
                grad_outputs=[grads[n].to(values[n].dtype) for n in targets],
                allow_unused=True,
            )
    except (TaskError, UnsupportedOpError):
        return result
    for name, grad in zip(leaves, pulled, strict=True):
        if grad is not None:
            result[name] = result[name] + grad if name in result else grad.detach()
    return result


_FLOAT_TYPES = frozenset(
    (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
     onnx.TensorProto.BFLOAT16)
)  # fmt: skip


def _depends_on_initializers(
    names: Sequence[str],
    producers: Mapping[str, onnx.NodeProto],
    initializers: Mapping[str, onnx.TensorProto],
) -> set[str]:
    """The tensors on a path from a float initializer to one of ``names`` (both ends
    included), not through a Shape or Size (whose values do not depend on their input's)."""
    memo: dict[str, bool] = {}

    def reaches(name: str) -> bool:
        if name in memo:
            return memo[name]
        memo[name] = False  # a cycle (an invalid model) reaches nothing
        if name in initializers:
            memo[name] = initializers[name].data_type in _FLOAT_TYPES
        elif name in producers and producers[name].op_type not in ("Shape", "Size"):
            found = [reaches(i) for i in producers[name].input if i]
            memo[name] = any(found)
        return memo[name]

    for name in names:
        reaches(name)
    return {name for name, reached in memo.items() if reached}
