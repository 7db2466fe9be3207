"""Inputs whose size changes from batch to batch (Mimose): a shape range.

An input's shape may give one dimension as a range ``LOW..HIGH`` instead of a value
(``input_ids=8x16..512``). Every ranged dimension of a job takes the same value, the job's
*size* ``s`` (a sequence length shared by ``input_ids`` and ``attention_mask``, an image
side): the plans of a family are keyed by it. Observed sizes with their counts (the
training data's histogram, ``16:120,128:40``) or their shares (its distribution,
``16:0.75,128:0.25``) say where the work should go.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from remat.errors import InvalidInputError

Dim = int | tuple[int, int]  # a value, or a range (low, high), both inclusive

_DIM = re.compile(r"(\d+)(?:\.\.(\d+))?")
_OBSERVED = re.compile(r"(\d+):(\d+|\d*\.\d+)")
SHARE_SCALE = 1_000_000  # a distribution's shares become counts out of this many
SHARE_TOLERANCE = 1e-6  # how far from 1 a distribution's shares may sum


@dataclass(frozen=True)
class InputRange:
    """One input's shape, with ranged dimensions."""

    name: str
    dims: tuple[Dim, ...]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [d for d in self.dims if isinstance(d, tuple)]

    def at(self, size: int) -> tuple[int, ...]:
        """The shape where every ranged dimension is ``size``."""
        return tuple(size if isinstance(d, tuple) else d for d in self.dims)


@dataclass(frozen=True)
class ShapeRange:
    """A job's inputs over sizes ``low..high``; ``observed``: (size, count) pairs."""

    inputs: tuple[InputRange, ...]
    low: int
    high: int
    observed: tuple[tuple[int, int], ...] = ()

    def shapes(self, size: int) -> dict[str, tuple[int, ...]]:
        """Every input's whole shape at ``size`` (which must be in the range)."""
        if not self.low <= size <= self.high:
            raise InvalidInputError(
                f"size {size} is outside the job's range {self.low}..{self.high}"
            )
        return {i.name: i.at(size) for i in self.inputs}

    def size_of(self, shapes: Mapping[str, Sequence[int]]) -> int:
        """The size of whole input shapes (e.g. ``input_ids=1x300`` from a client): the
        value of their ranged dimensions, which must agree with the fixed ones."""
        sizes: set[int] = set()
        for item in self.inputs:
            shape = shapes.get(item.name)
            if shape is None:
                continue
            if len(shape) != len(item.dims):
                raise InvalidInputError(
                    f"input {item.name!r}: expected {len(item.dims)} dimensions, got {len(shape)}"
                )
            for dim, value in zip(item.dims, shape, strict=True):
                if isinstance(dim, tuple):
                    sizes.add(int(value))
                elif dim != value:
                    raise InvalidInputError(
                        f"input {item.name!r}: dimension {value} where the job has {dim}"
                    )
        unknown = set(shapes) - {i.name for i in self.inputs}
        if unknown:
            raise InvalidInputError(f"unknown inputs: {', '.join(sorted(unknown))}")
        if len(sizes) != 1:
            raise InvalidInputError(
                "give the ranged dimension of at least one input, the same in every input"
            )
        return sizes.pop()


def parse_input_range(text: str) -> InputRange:
    """``"input_ids=8x16..512"`` -> ``InputRange("input_ids", (8, (16, 512)))``."""
    name, sep, dims = text.rpartition("=")
    name = name.strip()
    parts = re.split(r"[x,]", dims.strip().lower()) if sep else []
    matches = [_DIM.fullmatch(p) for p in parts]
    if not name or not parts or not all(matches):
        raise InvalidInputError(
            f"bad input shape {text!r}: expected NAME=DIMS, a dimension a value or a range "
            "LOW..HIGH, e.g. input_ids=8x16..512"
        )
    shape: list[Dim] = []
    for m in matches:
        assert m is not None
        low = int(m.group(1))
        high = int(m.group(2)) if m.group(2) is not None else None
        if low < 1:
            raise InvalidInputError(f"bad input shape {text!r}: dimensions must be positive")
        if high is not None and high < low:
            raise InvalidInputError(f"bad input shape {text!r}: range {low}..{high} is empty")
        shape.append(low if high is None or high == low else (low, high))
    return InputRange(name, tuple(shape))


def parse_observed(text: str) -> tuple[tuple[int, int], ...]:
    """``"16:120,128:40"`` (size:count) -> ``((16, 120), (128, 40))``; shares
    (``"16:0.75,128:0.25"``) as ``observed_counts`` takes them."""
    pairs = [p.strip() for p in text.split(",") if p.strip()]
    matches = [_OBSERVED.fullmatch(p) for p in pairs]
    if not pairs or not all(matches):
        raise InvalidInputError(
            f"bad observed sizes {text!r}: expected SIZE:COUNT pairs, e.g. 16:120,128:40, or "
            "SIZE:SHARE pairs, e.g. 16:0.75,128:0.25"
        )
    return observed_counts(
        [
            (int(m.group(1)), float(m.group(2)) if "." in m.group(2) else int(m.group(2)))
            for m in matches
            if m is not None
        ]
    )


def observed_counts(pairs: Sequence[tuple[int, int | float]]) -> tuple[tuple[int, int], ...]:
    """Observed sizes as (size, count) pairs, from counts (ints, at least 1) as they are,
    or from a distribution's shares (floats in (0, 1] that sum to 1 within
    ``SHARE_TOLERANCE``) as counts out of ``SHARE_SCALE``. ``InvalidInputError`` for a
    size that is not positive or is given twice, counts and shares mixed, a count below 1
    or shares that do not sum to 1."""
    sizes = [size for size, _ in pairs]
    twice = sorted({size for size in sizes if sizes.count(size) > 1})
    if twice:
        raise InvalidInputError(f"observed size {twice[0]} is given more than once")
    if any(size < 1 for size in sizes):
        raise InvalidInputError("observed sizes must be positive")
    shares = [w for _, w in pairs if isinstance(w, float)]
    if not shares:
        if any(w < 1 for _, w in pairs):
            raise InvalidInputError("observed counts must be at least 1")
        return tuple((size, int(w)) for size, w in pairs)
    if len(shares) != len(pairs):
        raise InvalidInputError("observed sizes take counts or shares, not both")
    if any(not 0 < w <= 1 for w in shares):
        raise InvalidInputError("an observed share must be in (0, 1]")
    total = sum(shares)
    if abs(total - 1) > SHARE_TOLERANCE:
        raise InvalidInputError(
            f"the observed shares sum to {total:.6g}, not 1: give a distribution, or counts"
        )
    return tuple((size, max(1, round(w * SHARE_SCALE))) for size, w in pairs)


def shape_range(
    inputs: Iterable[InputRange], observed: Sequence[tuple[int, int]] = ()
) -> ShapeRange:
    """The job's range: every ranged dimension must span the same ``low..high`` (one
    size), and every observed size must lie in it."""
    items = tuple(inputs)
    spans = {span for item in items for span in item.ranges}
    if not spans:
        raise InvalidInputError("no input has a ranged dimension (LOW..HIGH)")
    if len(spans) > 1:
        listed = ", ".join(f"{a}..{b}" for a, b in sorted(spans))
        raise InvalidInputError(
            f"every ranged dimension takes the job's one size, so their ranges must agree; "
            f"got {listed}"
        )
    ((low, high),) = spans
    outside = [size for size, _ in observed if not low <= size <= high]
    if outside:
        raise InvalidInputError(
            f"observed sizes {', '.join(map(str, outside))} are outside the range {low}..{high}"
        )
    return ShapeRange(items, low, high, tuple(observed))


def check_ranged_dims_symbolic(
    ranged: ShapeRange, declared: Mapping[str, Sequence[int | str | None]]
) -> None:
    """A ranged dimension must be one the model leaves open (symbolic or unknown):
    ``declared`` gives each input's dimensions as the model states them (a value, a
    name, or None)."""
    for item in ranged.inputs:
        dims = declared.get(item.name)
        if dims is None:
            known = ", ".join(sorted(declared)) or "none"
            raise InvalidInputError(f"unknown input {item.name!r}; the model's inputs are: {known}")
        if len(dims) != len(item.dims):
            raise InvalidInputError(
                f"input {item.name!r}: the model declares {len(dims)} dimensions, "
                f"got {len(item.dims)}"
            )
        for axis, (given, stated) in enumerate(zip(item.dims, dims, strict=True)):
            if isinstance(given, tuple) and isinstance(stated, int):
                raise InvalidInputError(
                    f"input {item.name!r}: dimension {axis} is {stated} in the model, not "
                    f"symbolic, so it cannot range over {given[0]}..{given[1]}"
                )
