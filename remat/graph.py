"""The graph types shared by every step: forward graphs and training graphs.

A graph is a list of nodes in topological order; a node's index is its stage in
frontier-advancing schedules (Checkmate section 4.6). Each node yields one value (several
ONNX outputs of one node count as one value, sizes summed).

Memory that no schedule can free is modelled as *fixed tensors*: parameters and the
model's inputs. A node lists the fixed tensors it reads; a device holds every fixed tensor
read by a node it runs (see ``remat.simulator`` for the accounting rule).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property


class Mode(StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"


class NodeKind(StrEnum):
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"


class FixedKind(StrEnum):
    PARAMETER = "parameter"  # an initializer, or a tensor folded from constants
    CONSTANT = "constant"  # folded from Constant nodes alone, or a position table: not trained
    INPUT = "input"
    HELD = "held"  # a value computed outside this graph (a part of a decomposed graph)


@dataclass(frozen=True)
class FixedTensor:
    """A tensor resident for the whole step: a parameter (an initializer, or a tensor
    folded from constants: some exporters make weights with constant subgraphs), a
    constant (a scalar folded from ``Constant`` nodes alone: scale factors, epsilons; a
    rotary embedding's cosines and sines; and a cross-entropy's labels), a model input, or
    (in a part of a decomposed graph) a value
    another part computed. ONNX does not say which tensors are trained: Remat trains the
    parameters (weights read where a gradient reaches them, not running statistics:
    ``remat.onnx_ingest``), and the model inputs are data (as in a PyTorch training step,
    where inputs do not require a gradient, and in Checkmate's fixed memory M_input + 2
    M_param, eq. 2); exporters write a module's scalar hyperparameters as ``Constant`` nodes."""

    name: str
    kind: FixedKind
    nbytes: int

    @property
    def has_gradient(self) -> bool:
        """Training keeps a gradient buffer for it (a parameter); a held value's gradient
        is a value, and a model input and a constant have none."""
        return self.kind is FixedKind.PARAMETER


@dataclass(frozen=True)
class Node:
    """One schedulable operation.

    ``deps`` are indices of earlier nodes whose values this node reads. ``fixed`` names the
    fixed tensors it reads. For a backward node, ``forward`` is the index of the forward
    node it differentiates; ``flops`` and ``bytes_moved`` feed the analytical cost model.
    ``input_bytes`` is the size of every tensor the op reads (values and fixed tensors).
    ``scratch_bytes`` is the memory its kernel itself holds while it runs beyond its inputs
    and output, where the op's shapes tell (``remat.ops.scratch_elements``: a fused
    attention's score matrix); the analytical cost model's workspace.
    """

    id: int
    name: str
    op: str
    kind: NodeKind
    deps: tuple[int, ...]
    output_bytes: int
    flops: float = 0.0
    input_bytes: int = 0
    fixed: tuple[str, ...] = ()
    forward: int | None = None
    scratch_bytes: int = 0
    attrs: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    @property
    def bytes_moved(self) -> int:
        return self.input_bytes + self.output_bytes


@dataclass(frozen=True)
class Fingerprint:
    """What a plan records of the graph it was made for: its number of nodes and a digest
    of its structure (each node's name, operator, kind, inputs, fixed tensors and forward
    node; the outputs; the fixed tensors' names and kinds). Sizes are left out: a plan
    holds for the same graph at other input sizes (a plan family replays plans across
    sizes), where the simulator judges its memory."""

    nodes: int
    digest: str

    def __str__(self) -> str:
        return f"{self.nodes} nodes, {self.digest}"


@dataclass(frozen=True)
class Graph:
    """A forward graph (``mode`` inference) or a training graph (``mode`` training).

    ``outputs`` are the nodes whose values are the result of the step: in inference the
    model's outputs (they must still be resident when the plan ends); in training none
    need to stay resident, because weight gradients accumulate into fixed
    gradient buffers (see ``remat.simulator``).
    """

    mode: Mode
    nodes: tuple[Node, ...]
    fixed: dict[str, FixedTensor]
    outputs: tuple[int, ...]

    def __post_init__(self) -> None:
        for index, node in enumerate(self.nodes):
            if node.id != index:
                raise ValueError(f"node {node.name!r} has id {node.id}, expected {index}")
            if any(d >= index or d < 0 for d in node.deps):
                raise ValueError(f"node {node.name!r} depends on a later node")

    def __len__(self) -> int:
        return len(self.nodes)

    @cached_property
    def fingerprint(self) -> Fingerprint:
        """The structure a plan's steps refer to (``Fingerprint``): two graphs with the
        same fingerprint run each other's plans."""
        structure = {
            "mode": self.mode.value,
            "nodes": [[n.name, n.op, n.kind.value, n.deps, n.fixed, n.forward] for n in self.nodes],
            "outputs": self.outputs,
            "fixed": sorted((t.name, t.kind.value) for t in self.fixed.values()),
        }
        text = json.dumps(structure, separators=(",", ":"))
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return Fingerprint(len(self.nodes), f"sha256:{digest}")

    @property
    def param_bytes(self) -> int:
        """Parameters and constants: the model's own tensors."""
        kinds = (FixedKind.PARAMETER, FixedKind.CONSTANT)
        return sum(t.nbytes for t in self.fixed.values() if t.kind in kinds)

    @property
    def input_bytes(self) -> int:
        return sum(t.nbytes for t in self.fixed.values() if t.kind is FixedKind.INPUT)

    @property
    def activation_bytes(self) -> int:
        return sum(n.output_bytes for n in self.nodes)

    def users(self) -> list[list[int]]:
        """USERS[i] of Checkmate section 4.4: the nodes that read node i's value."""
        result: list[list[int]] = [[] for _ in self.nodes]
        for node in self.nodes:
            for dep in node.deps:
                result[dep].append(node.id)
        return result

    def index(self, name: str) -> int:
        for node in self.nodes:
            if node.name == name:
                return node.id
        raise KeyError(name)

    def forward_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.kind is NodeKind.FORWARD]
