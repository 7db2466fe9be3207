"""The API's request and response bodies (Pydantic). Field names are the API's."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import BaseModel, Field

from agents.protocol import AgentDevice, Strict
from remat.devices import DeviceKind
from remat.graph import Mode
from remat.solvers.runner import BACKENDS, DEFAULT_BACKEND

T = TypeVar("T")
Backend = Literal[BACKENDS]  # type: ignore[valid-type]


class DeviceSpec(AgentDevice):
    """A device of a job (the same fields as an agent's device)."""


class SolverSpec(Strict):
    backend: Backend = DEFAULT_BACKEND  # type: ignore[valid-type]
    time_limit_s: float = Field(default=60.0, gt=0)
    gap: float = Field(default=1e-4, ge=0, lt=1)
    threads: int = Field(default=1, ge=1, le=256)


class ProfileCosts(Strict):
    profile_id: str


class NodeCosts(Strict):
    node_id: str


class JobSpec(Strict):
    """What ``POST /v1/jobs`` takes; stored with the job as given (defaults filled in)."""

    model_id: str
    mode: Mode = Mode.TRAINING
    batch: int | None = Field(default=None, ge=1)
    inputs: dict[str, list[Annotated[int, Field(ge=1)]]] | None = None
    devices: list[DeviceSpec] = Field(
        default_factory=lambda: [DeviceSpec(name="cpu0", kind=DeviceKind.CPU)], min_length=1
    )
    budgets: dict[str, str] = Field(default_factory=dict)  # "208MiB", "65%", bytes
    strategy: str = "xengine"
    solver: SolverSpec = Field(default_factory=SolverSpec)
    costs: Literal["analytical"] | ProfileCosts | NodeCosts = "analytical"


class ModelSummary(BaseModel):
    nodes: int
    operators: dict[str, int]
    inputs: dict[str, list[int | str]]
    param_bytes: int
    input_bytes: int
    activation_bytes: int


class ModelOut(BaseModel):
    id: str
    sha256: str
    filename: str
    size_bytes: int
    created_at: datetime
    summary: ModelSummary


class Progress(BaseModel):
    incumbent_ms: float | None = None
    bound_ms: float | None = None
    gap: float | None = None
    elapsed_s: float | None = None


class JobOut(BaseModel):
    id: str
    model_id: str
    status: str
    cancel_requested: bool
    spec: JobSpec
    progress: Progress
    solver_status: str | None
    message: str | None
    error: str | None
    attempts: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = None


class ScheduleOut(BaseModel):
    """R and S per device as sparse (stage, node) pairs, and bytes resident on each device
    after each step with its budget (XEngine figures 3 and 4)."""

    devices: list[str]
    nodes: list[str]
    stages: int
    R: dict[str, list[tuple[int, int]]]
    S: dict[str, list[tuple[int, int]]]
    memory: dict[str, list[int]]
    budgets: dict[str, int | None]
    peak_bytes: dict[str, int]


class ProgressPoint(BaseModel):
    elapsed_s: float
    incumbent_ms: float | None
    bound_ms: float | None
    gap: float | None


class ProgressHistory(BaseModel):
    """A job's solver progress over time (its current attempt), oldest first."""

    points: list[ProgressPoint]


class BaselineOut(BaseModel):
    strategy: str
    predicted_ms: float | None  # None: no plan within the budgets
    overhead: float | None  # predicted / ideal - 1
    peak_bytes: dict[str, int]
    valid: bool | None  # the simulator's verdict on its plan
    note: str
    need_bytes: int | None  # when infeasible: the budget it would need


class BaselinesOut(BaseModel):
    """The baselines on a job's own inputs (budgets, devices, costs), beside its plan."""

    ideal_ms: float  # every node once on its fastest device, no copies
    items: list[BaselineOut]


class NodeOut(BaseModel):
    id: str
    name: str
    status: Literal["online", "offline"]  # from heartbeats
    devices: list[DeviceSpec]
    version: str | None
    last_seen_at: datetime | None
    created_at: datetime


class ProfileOut(BaseModel):
    id: str
    model_id: str
    node_id: str | None
    spec: dict[str, object] | None  # what was measured: model, mode, shapes, devices
    created_at: datetime
    table: dict[str, object] | None = None  # only on GET /v1/profiles/{id}


class ExecutionRequest(Strict):
    node_id: str


class ExecutionOut(BaseModel):
    """An agent's execution of a job's plan: measured against predicted."""

    id: str
    job_id: str
    node_id: str | None
    status: str  # queued, leased (running), succeeded, failed
    attempts: int
    measured: dict[str, object] | None = None  # total_ms, peak_bytes per device, step_ms
    predicted: dict[str, object] | None = None  # total_ms, peak_bytes per device
    gradients_match: bool | None = None
    max_rel_error: float | None = None
    error: str | None = None
    created_at: datetime
    finished_at: datetime | None
