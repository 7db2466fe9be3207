"""Exception types of the domain library. The CLI turns each into a one-line message."""


class RematError(Exception):
    """Base class of every error the library raises on purpose."""


class ModelLoadError(RematError):
    """The file is missing, not ONNX, truncated, or rejected by onnx.checker."""


class ShapeError(RematError):
    """A shape cannot be inferred, or a symbolic dimension has no value."""


class EmptyModelError(RematError):
    """The model has no operators left to schedule."""


class InvalidInputError(RematError):
    """A user-supplied value (device spec, size, cost table, plan file) is malformed."""


class StrategyError(RematError):
    """A strategy cannot be applied to this graph (e.g. Griewank on a non-linear graph)."""


class ScheduleError(RematError):
    """A schedule violates its own constraints and cannot be compiled into a plan."""
