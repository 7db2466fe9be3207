"""Every node's output bytes and compute time as functions of the input size (Mimose,
section 4.3): degree-2 polynomials in the size ``s``, fitted by least squares to the
problems at a few sizes (shape inference for bytes; the cost model, analytical or
profiled, for time), one polynomial per node (and device, for time).

Activations grow at most quadratically with the size in the networks Mimose studied
(attention's ``seq x seq`` scores; everything else linearly), so three sizes determine a
node's bytes exactly where that holds. ``size_model_error`` checks the fit against shape
inference at a size it was not fitted on. Shape inference is exact, so a plan for a size
uses its bytes; the polynomials are for time (``table_at_size``: a cost table for a size
from tables profiled at a few) and for predicting memory over the whole range without
building a graph per size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from remat.costs import CostTable
from remat.errors import InvalidInputError
from remat.graph import Graph
from remat.strategies.common.problem import Problem

DEGREE = 2


@dataclass(frozen=True)
class SizeModel:
    """``bytes_coef[k, i]``: the coefficient of ``s**k`` in node i's output bytes;
    ``ms_coef[k, i, d]`` likewise for its compute time on device d."""

    sizes: tuple[int, ...]
    names: tuple[str, ...]
    bytes_coef: np.ndarray
    ms_coef: np.ndarray

    def output_bytes(self, size: float) -> np.ndarray:
        """Predicted output bytes of every node at ``size`` (never negative)."""
        predicted = _evaluated(self.bytes_coef, size)
        return np.maximum(np.rint(predicted), 0).astype(np.int64)

    def compute_ms(self, size: float) -> np.ndarray:
        """Predicted compute time [node, device] at ``size`` (never negative)."""
        return np.maximum(_evaluated(self.ms_coef, size), 0.0)


@dataclass(frozen=True)
class SizeModelError:
    """How far the model is from a problem built at ``size``: the largest and the
    byte-weighted relative error of output bytes, and the same for compute time."""

    size: int
    bytes_max: float
    bytes_weighted: float
    ms_max: float
    ms_weighted: float


def fit_size_model(problems: Mapping[int, Problem]) -> SizeModel:
    """The polynomials through the problems at each size (at least two sizes; degree 2
    from three). Every problem must have the same nodes, in the same order."""
    sizes = sorted(problems)
    if len(sizes) < 2:
        raise InvalidInputError("fitting sizes needs problems at two sizes at least")
    first = problems[sizes[0]]
    names = tuple(node.name for node in first.graph.nodes)
    for size in sizes[1:]:
        other = tuple(node.name for node in problems[size].graph.nodes)
        if other != names:
            raise InvalidInputError(
                f"the graph at size {size} has other nodes than at size {sizes[0]}: the model's "
                "structure depends on the size, so one family of plans cannot cover it"
            )
    out = np.stack([problems[s].costs.output_bytes.astype(float) for s in sizes])
    ms = np.stack([problems[s].costs.compute_ms for s in sizes])  # [k, n, d]
    return SizeModel(tuple(sizes), names, _polynomials(sizes, out), _polynomials(sizes, ms))


def _polynomials(sizes: Sequence[int], values: np.ndarray) -> np.ndarray:
    """Least-squares coefficients ``[k, ...]`` (of ``s**k``) of the polynomials in the size
    through ``values[i, ...]`` at ``sizes[i]``, one per trailing index: degree 2 from three
    sizes, less from fewer."""
    degree = min(DEGREE, len(sizes) - 1)
    # Scaled sizes keep the normal equations well conditioned; coefficients are rescaled.
    scale = float(max(sizes))
    vandermonde = np.vander(np.array(sizes, dtype=float) / scale, degree + 1, increasing=True)
    flat = np.linalg.lstsq(vandermonde, values.reshape(len(sizes), -1), rcond=None)[0]
    rescale = scale ** -np.arange(degree + 1, dtype=float)
    return (flat * rescale[:, None]).reshape(degree + 1, *values.shape[1:])


def _evaluated(coef: np.ndarray, size: float) -> np.ndarray:
    """The polynomials ``coef`` (``_polynomials``) at ``size``."""
    powers = np.array([float(size) ** k for k in range(coef.shape[0])])
    return np.tensordot(powers, coef, axes=1)


def size_model_error(model: SizeModel, size: int, problem: Problem) -> SizeModelError:
    """The model's error at ``size`` against ``problem`` (built at that size)."""
    actual_bytes = problem.costs.output_bytes.astype(float)
    actual_ms = problem.costs.compute_ms
    if actual_bytes.shape[0] != len(model.names):
        raise InvalidInputError(f"the problem at size {size} has other nodes than the model")
    bytes_max, bytes_weighted = _relative(model.output_bytes(size).astype(float), actual_bytes)
    ms_max, ms_weighted = _relative(model.compute_ms(size), actual_ms)
    return SizeModelError(size, bytes_max, bytes_weighted, ms_max, ms_weighted)


def _relative(predicted: np.ndarray, actual: np.ndarray) -> tuple[float, float]:
    """The largest relative error over nonzero actual values, and the total absolute error
    over the total (the error weighted by size)."""
    error = np.abs(predicted - actual)
    nonzero = actual > 0
    largest = float((error[nonzero] / actual[nonzero]).max(initial=0.0))
    total = float(actual.sum())
    return largest, float(error.sum()) / total if total > 0 else 0.0


def table_at_size(tables: Mapping[int, CostTable], size: int, graph: Graph) -> CostTable:
    """A cost table for ``graph`` (built at ``size``) from tables profiled at other sizes:
    each node's time on each device, and each copy's, on the polynomial through the
    profiled ones (degree 2 from three sizes); its output bytes from ``graph`` (shape
    inference, exact); the host links and devices of the largest size's table."""
    sizes = sorted(tables)
    if not sizes:
        raise InvalidInputError("no profiled sizes to estimate a cost table from")
    largest = tables[sizes[-1]]
    devices = [d.name for d in largest.devices]
    entries = []
    for node in graph.nodes:
        found = [e for s in sizes if (e := tables[s].nodes.get(node.name)) is not None]
        if len(found) != len(sizes):
            raise InvalidInputError(f"a profiled table has no entry for node {node.name!r}")
        entries.append(found)
    times = np.array([[[e.compute_ms[d] for d in devices] for e in row] for row in entries])
    fitted_ms = np.maximum(_evaluated(_polynomials(sizes, times.swapaxes(0, 1)), size), 0.0)
    pairs = [
        (node.name, pair) for node in graph.nodes for pair in largest.copy_ms.get(node.name, {})
    ]
    copy_values = np.array(
        [
            [tables[s].copy_ms.get(n, {}).get(p, largest.copy_ms[n][p]) for n, p in pairs]
            for s in sizes
        ]
    ).reshape(len(sizes), len(pairs))
    fitted_copies = np.maximum(_evaluated(_polynomials(sizes, copy_values), size), 0.0)
    nodes = {
        node.name: {
            "compute_ms": dict(zip(devices, map(float, row), strict=True)),
            "output_bytes": node.output_bytes,
        }
        for node, row in zip(graph.nodes, fitted_ms, strict=True)
    }
    copies: dict[str, dict[str, float]] = {}
    for (name, pair), ms in zip(pairs, fitted_copies, strict=True):
        copies.setdefault(name, {})[pair] = float(ms)
    return CostTable.model_validate(
        {
            "source": largest.source,
            "devices": [d.model_dump() for d in largest.devices],
            "nodes": nodes,
            "copy_ms": copies,
            "host_links": {k: v.model_dump() for k, v in largest.host_links.items()},
        }
    )
