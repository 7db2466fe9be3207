"""Errors of the agent's compute side: each is a task that cannot succeed.

The HTTP loop reports a ``TaskError`` to the server as a failed task with ``str(exc)`` as
the message and keeps running; any other exception is a bug in the agent.
"""

from __future__ import annotations


class TaskError(Exception):
    """A task that cannot succeed; reported to the server as failed with str(exc)."""


class UnsupportedOpError(TaskError):
    """The kernel backend has no kernel (or no gradient) for an operator of the model."""


class PlanRejectedError(TaskError):
    """The simulator rejected the plan; the message carries its violation."""


class DeviceError(TaskError):
    """A device the task names is unknown, not on this node, or unusable (CUDA missing)."""


class DeviceOutOfMemory(TaskError):
    """A device ran out of memory; the message names the device and the step."""


class StorageError(TaskError):
    """The node's storage cannot be used for paging: a directory that is missing or not
    writable, or a file that could not be written or read back; the message names the
    directory and the OS's reason."""
