"""The agent protocol's bodies (Pydantic), shared by the server (``app/``) and the agent.

The agent talks to the API over HTTP only. Its calls, all under ``/v1/agent``:

| call                            | body -> answer                                     |
|---------------------------------|----------------------------------------------------|
| ``POST register``               | ``Registration`` -> ``Enrolled`` (its own token)   |
| ``POST heartbeat``              | ``{}`` -> ``Heartbeat``                            |
| ``POST lease``                  | ``LeaseRequest`` -> ``Task`` or 204 (none in time) |
| ``POST tasks/{id}/renew``       | ``LeaseProof`` -> ``Lease``                        |
| ``POST tasks/{id}/progress``    | ``TaskProgress`` -> ``Lease`` (renews too)         |
| ``POST tasks/{id}/report``      | ``TaskReport`` -> ``ReportAccepted``               |
| ``POST tasks/{id}/release``     | ``LeaseProof`` -> 204 (back to the queue)          |
| ``GET models/{id}``             | the model's ONNX bytes                             |

Every call but ``register`` carries ``Authorization: Bearer <node token>``. A call about a
task whose lease the agent no longer holds (expired and taken by another agent) is
refused with 409; a report repeated with the same lease is accepted once.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

import onnx
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    WithJsonSchema,
    field_validator,
)

from remat.devices import DeviceKind, check_option
from remat.errors import InvalidInputError
from remat.graph import Graph, Mode
from remat.loss import MEAN_SQUARE, Loss, LossKind

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z][A-Za-z0-9_.-]*$", max_length=64)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _option_text(value: object) -> object:
    """A number as its text (the library reads options as text); anything else as given
    (a boolean is then refused as not a string)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value) if isinstance(value, float) else str(value)
    return value


OptionValue = Annotated[
    str,
    BeforeValidator(_option_text),
    StringConstraints(max_length=128),
    WithJsonSchema({"anyOf": [{"type": "string", "maxLength": 128}, {"type": "number"}]}),
]


class AgentDevice(Strict):
    name: Name
    kind: DeviceKind
    # threads, index, flops, bandwidth, launch_us (numbers, in range) and model (text):
    # remat.devices.check_option; numbers are kept as their text
    options: dict[Annotated[str, StringConstraints(max_length=32)], OptionValue] = Field(
        default_factory=dict, max_length=16
    )

    @field_validator("options")
    @classmethod
    def _known_options(cls, options: dict[str, str]) -> dict[str, str]:
        for key, value in options.items():
            try:
                check_option(key, value)
            except InvalidInputError as exc:
                raise ValueError(str(exc)) from None
        return options


LOCAL_NODE = "local"  # reserved for ``remat serve``'s own agent (its per-run secret)


class Registration(Strict):
    enroll_token: str = Field(min_length=1, max_length=512)
    name: Name  # one agent per name: registering a name again gives the node a new token
    devices: list[AgentDevice] = Field(min_length=1, max_length=64)
    version: str = Field(default="", max_length=64)
    # The node's current token: needed to register a name that is already taken (the same
    # agent after a restart); without it (or with another) the server answers 409.
    node_token: str | None = Field(default=None, max_length=512)


class Enrolled(BaseModel):
    node_id: str
    token: str
    heartbeat_s: float
    lease_s: float


class Heartbeat(BaseModel):
    heartbeat_s: float


class TaskKind(StrEnum):
    PROFILE = "profile"
    EXECUTE = "execute"


class LeaseRequest(Strict):
    wait_s: float = Field(default=20.0, ge=0, le=60)  # long-poll this long for a task


class LossSpec(Strict):
    """The training loss (``remat.loss``): its kind, the model output it reads
    (cross_entropy, output; default the model's only output) and the class axis of a
    cross-entropy's logits."""

    kind: LossKind = LossKind.MEAN_SQUARE
    output: str | None = Field(
        default=None, min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$"
    )
    axis: int = Field(default=-1, ge=-32, le=31)

    def to_loss(self) -> Loss:
        return Loss(self.kind, self.output, self.axis)


class ModelRef(Strict):
    """What the agent needs to rebuild the job's graph exactly as the server did
    (``graph``)."""

    model_id: str
    sha256: str
    mode: Mode
    batch: int | None = None
    inputs: dict[str, list[int]] | None = None
    loss: LossSpec | None = None  # None: the default loss
    # absent in what servers sent before attention was fused: those graphs are unfused
    fuse_attention: bool = False

    def graph(self, model: onnx.ModelProto) -> Graph:
        """The job's graph of ``model`` (the file this reference names, loaded)."""
        from remat.problem import model_graph  # the strategies' imports, only when used

        loss = self.loss.to_loss() if self.loss is not None else MEAN_SQUARE
        return model_graph(
            model,
            batch=self.batch,
            inputs=self.inputs,
            mode=self.mode,
            loss=loss,
            fuse_attention=self.fuse_attention,
        )


MAX_PROFILED_SIZES = 16


class ProfilePayload(Strict):
    model: ModelRef
    devices: list[str]  # names of the node's devices to profile
    repeats: int = Field(default=5, ge=1, le=1000)
    warmup: int = Field(default=2, ge=0, le=100)
    # Per device, the most bytes profiling may hold there (the job's budget): where
    # checkpoint-all needs more, the agent profiles under a plan that recomputes.
    memory_bytes: dict[str, Annotated[int, Field(ge=1, le=MAX_BYTES)]] | None = None
    # A job over ranges of sizes: the model's inputs at each size to profile (keys: sizes
    # as text), measured in turn in this one task, each within ``memory_bytes``; the result
    # is then a ``SizedProfile``.
    sizes: dict[str, dict[str, list[int]]] | None = Field(
        default=None, min_length=1, max_length=MAX_PROFILED_SIZES
    )


class SizedProfile(Strict):
    """A profiling task's result over several sizes: a cost table per size (as text)."""

    tables: dict[str, dict[str, Any]]


MAX_SIZED_STEPS = 1000


class SizedRun(Strict):
    """A family's execution (a job over ranges of input sizes): training steps whose
    inputs change size, in order, each run with its size's plan. ``inputs`` and ``plans``
    by size (as text: JSON keys); ``cached``: the sizes whose plan the server had stored
    before it was asked."""

    sizes: list[Annotated[int, Field(ge=1)]] = Field(min_length=1, max_length=MAX_SIZED_STEPS)
    inputs: dict[str, dict[str, list[int]]]
    plans: dict[str, dict[str, Any]]
    cached: list[int] = Field(default_factory=list)


class ExecutePayload(Strict):
    model: ModelRef
    job_id: str
    plan: dict[str, Any]  # the plan JSON
    sized: SizedRun | None = None  # a family's steps; ``plan`` is then the largest size's


class Task(BaseModel):
    id: str
    kind: TaskKind
    attempt: int
    lease_token: str
    lease_expires_at: datetime
    payload: dict[str, Any]  # ProfilePayload or ExecutePayload, by kind


class LeaseProof(Strict):
    lease_token: str = Field(min_length=1, max_length=64)


class Lease(BaseModel):
    lease_expires_at: datetime


class TaskProgress(LeaseProof):
    done: int = Field(ge=0)
    total: int = Field(ge=0)
    message: str = Field(default="", max_length=500)


MAX_MS = 1e9  # about 11.6 days: no time an agent reports is longer
MAX_BYTES = 1 << 50  # 1 PiB: no device's peak is larger
MAX_STEPS = 10_000_000
# What agents report: finite, non-negative, bounded (a NaN or 1e300 would poison plans,
# comparisons and the dashboard).
Ms = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False)]
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]


Mj = Annotated[float, Field(ge=0, le=1e15, allow_inf_nan=False)]


class Measured(Strict):
    total_ms: Ms
    peak_bytes: dict[Name, Bytes] = Field(max_length=64)
    step_ms: list[Ms] = Field(default_factory=list, max_length=MAX_STEPS)
    # per run, read from the devices' energy counters (idle included), where they exist
    energy_mj: Mj | None = None
    energy_note: str = Field(default="", max_length=2000)  # the counters read, or why none


class PredictedCost(Strict):
    total_ms: Ms | None = None
    peak_bytes: dict[str, Bytes] = Field(default_factory=dict)
    energy_mj: Mj | None = None


class SizedStep(Strict):
    """One step of a family's execution: its size, what it measured, what its plan
    predicted (the server's copy), and whether its plan came from a cache (stored by the
    server before, or used by an earlier step of this run)."""

    size: int = Field(ge=1)
    total_ms: Ms
    peak_bytes: dict[Name, Bytes] = Field(max_length=64)
    predicted_ms: Ms | None = None
    predicted_peak_bytes: dict[str, Bytes] = Field(default_factory=dict)
    plan_cached: bool = False


class ExecutionResult(Strict):
    """What the executor measured for a plan, next to what the simulator predicted. The
    server fills ``predicted`` from the plan it sent (what an agent says it is, is
    ignored); agents may leave it out."""

    measured: Measured
    predicted: PredictedCost = Field(default_factory=PredictedCost)
    gradients_match: bool | None = None
    max_rel_error: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    # Every exact gradient is zero up to fp32 rounding (a match then says only that the
    # run's are zero too); None in inference, and from agents that predate the field.
    gradients_vanish: bool | None = None
    # a family's execution: each step (``measured`` sums their times, takes their peaks)
    sized: list[SizedStep] | None = Field(default=None, max_length=MAX_SIZED_STEPS)


class TaskReport(LeaseProof):
    status: Literal["succeeded", "failed"]
    result: dict[str, Any] | None = None  # a cost table (profile) or ExecutionResult
    error: str | None = Field(default=None, max_length=10_000)


class ReportAccepted(BaseModel):
    task_id: str
    status: str
    duplicate: bool = False  # the same report was already recorded
