"""Small hand-made forward graphs for unit tests of pure logic."""

from __future__ import annotations

from remat.graph import FixedKind, FixedTensor, Graph, Mode, Node, NodeKind


def forward(deps: list[tuple[int, ...]], sizes: list[int] | None = None, op: str = "Relu") -> Graph:
    """A forward graph: node i reads ``deps[i]``; nodes without deps read the input x;
    every sink is a model output; each node has a 100-byte weight w{i}."""
    sizes = sizes or [1000] * len(deps)
    fixed = {"x": FixedTensor("x", FixedKind.INPUT, 400)}
    nodes = []
    for i, d in enumerate(deps):
        fixed[f"w{i}"] = FixedTensor(f"w{i}", FixedKind.PARAMETER, 100)
        reads = (("x",) if not d else ()) + (f"w{i}",)
        nodes.append(
            Node(
                i,
                f"n{i}",
                op,
                NodeKind.FORWARD,
                tuple(d),
                sizes[i],
                flops=float(sizes[i]) * 1000,
                input_bytes=sum(sizes[j] for j in d) + 100,
                fixed=reads,
            )
        )
    users = {j for d in deps for j in d}
    outputs = tuple(i for i in range(len(deps)) if i not in users)
    return Graph(Mode.INFERENCE, tuple(nodes), fixed, outputs)


def chain(n: int, size: int = 1000) -> Graph:
    return forward([(i - 1,) if i else () for i in range(n)], [size] * n)


def diamond() -> Graph:
    """0 -> (1, 2) -> 3."""
    return forward([(), (0,), (0,), (1, 2)])
