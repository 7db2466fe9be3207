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

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from remat.devices import DeviceKind
from remat.graph import Mode

Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z][A-Za-z0-9_.-]*$", max_length=64)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AgentDevice(Strict):
    name: Name
    kind: DeviceKind
    options: dict[str, str] = Field(default_factory=dict)


class Registration(Strict):
    enroll_token: str = Field(min_length=1, max_length=512)
    name: Name  # one agent per name: registering a name again gives the node a new token
    devices: list[AgentDevice] = Field(min_length=1, max_length=64)
    version: str = Field(default="", max_length=64)


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


class ModelRef(Strict):
    """What the agent needs to rebuild the job's graph exactly as the server did."""

    model_id: str
    sha256: str
    mode: Mode
    batch: int | None = None
    inputs: dict[str, list[int]] | None = None


class ProfilePayload(Strict):
    model: ModelRef
    devices: list[str]  # names of the node's devices to profile
    repeats: int = Field(default=5, ge=1, le=1000)
    warmup: int = Field(default=2, ge=0, le=100)


class ExecutePayload(Strict):
    model: ModelRef
    job_id: str
    plan: dict[str, Any]  # the plan JSON (version 1)


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


class Measured(Strict):
    total_ms: float = Field(ge=0)
    peak_bytes: dict[str, int]
    step_ms: list[float] = Field(default_factory=list)


class PredictedCost(Strict):
    total_ms: float | None = None
    peak_bytes: dict[str, int] = Field(default_factory=dict)


class ExecutionResult(Strict):
    """What the executor measured for a plan, next to what the simulator predicted."""

    measured: Measured
    predicted: PredictedCost
    gradients_match: bool | None = None
    max_rel_error: float | None = None


class TaskReport(LeaseProof):
    status: Literal["succeeded", "failed"]
    result: dict[str, Any] | None = None  # a cost table (profile) or ExecutionResult
    error: str | None = Field(default=None, max_length=10_000)


class ReportAccepted(BaseModel):
    task_id: str
    status: str
    duplicate: bool = False  # the same report was already recorded
