"""The API's request and response bodies (Pydantic). Field names are the API's.

A response body is read from its table's row (``Out.model_validate(row,
from_attributes=True)``): a field named as the row's column needs no code; what the API
shapes differently (a job's progress, nested) the row offers under the API's name.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    Field,
    PositiveInt,
    StringConstraints,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from remat.agent_protocol import MAX_SIZED_STEPS, AgentDevice, LossSpec, Name, Strict
from remat.devices import DeviceKind
from remat.energy import MAX_POWER_W
from remat.graph import Mode
from remat.objective import MAX_ALPHA, MAX_TIME_CAP_MS, Objective, ObjectiveKind
from remat.solvers.runner import BACKENDS, DEFAULT_BACKEND

T = TypeVar("T")
Backend = Literal[BACKENDS]  # type: ignore[valid-type]

# Bounds on what a client sends: far above any real job, far below what would exhaust the
# server (a job's lists, sizes and strings are all bounded; ids are the server's own).
ID_PATTERN = r"^[A-Za-z0-9_-]+$"
ID_MAX = 64
Id = Annotated[str, StringConstraints(min_length=1, max_length=ID_MAX, pattern=ID_PATTERN)]
MAX_DEVICES = 64
MAX_BATCH = 2**31 - 1
MAX_INPUTS = 64  # inputs given by name
MAX_RANK = 8  # dimensions of one input
MAX_DIM = 2**31 - 1
MAX_INPUT_ELEMENTS = 2**40  # elements of one input (the product of its dimensions)
InputName = Annotated[
    str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")
]
Dims = Annotated[list[Annotated[int, Field(ge=1, le=MAX_DIM)]], Field(max_length=MAX_RANK)]
SizeText = Annotated[str, StringConstraints(min_length=1, max_length=32)]  # "208MiB", "65%"
# "8x16..512": an input's dimensions, one or more of them a range (remat.shape_range)
RangeText = Annotated[str, StringConstraints(min_length=1, max_length=200)]
MAX_OBSERVED = 10_000  # observed (size, count) pairs
Strategy = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_]*$")
]


class DeviceSpec(AgentDevice):
    """A device of a job (the same fields as an agent's device)."""


class SolverSpec(Strict):
    backend: Backend = DEFAULT_BACKEND
    time_limit_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    gap: float = Field(default=1e-4, ge=0, lt=1, allow_inf_nan=False)
    threads: int = Field(default=1, ge=1, le=256)
    reuse_plans: bool = True
    """Start the exact strategies' search from the plans of this model's earlier jobs
    made for the same graph (those the simulator accepts at this job's budgets and
    costs): the plan is never dearer than any of them."""


Watts = Annotated[float, Field(gt=0, le=MAX_POWER_W, allow_inf_nan=False)]


class ObjectiveSpec(Strict):
    """What the plan minimises (``remat.objective``): time, energy, or time + alpha x energy
    (XEngine eq. 17), with power caps per device and for the board (eq. 18-19), and a
    runtime cap (POET's deadline: no plan slower than ``time_cap_ms``)."""

    kind: ObjectiveKind = ObjectiveKind.TIME
    alpha: float | None = Field(default=None, gt=0, le=MAX_ALPHA, allow_inf_nan=False)
    power_caps_w: dict[Name, Watts] = Field(default_factory=dict, max_length=MAX_DEVICES)
    board_cap_w: Watts | None = None
    board_w: float = Field(default=0.0, ge=0, le=MAX_POWER_W, allow_inf_nan=False)
    time_cap_ms: float | None = Field(default=None, gt=0, le=MAX_TIME_CAP_MS, allow_inf_nan=False)

    @model_validator(mode="after")
    def _alpha_with_weighted(self) -> ObjectiveSpec:
        if (self.kind is ObjectiveKind.WEIGHTED) != (self.alpha is not None):
            raise ValueError("alpha is given with the weighted objective, and only with it")
        return self

    def to_objective(self) -> Objective:
        return Objective(
            self.kind,
            self.alpha or 0.0,
            dict(self.power_caps_w),
            self.board_cap_w,
            self.board_w,
            self.time_cap_ms,
        )


class ProfileCosts(Strict):
    profile_id: Id


class NodeCosts(Strict):
    node_id: Id


class ObservedSize(Strict):
    """A size the training data has, with how often: a count, or its share of a
    distribution (every size's shares summing to 1); where a family's work goes."""

    size: int = Field(ge=1, le=MAX_DIM)
    count: PositiveInt | None = None
    share: float | None = Field(default=None, gt=0, le=1)

    @model_validator(mode="after")
    def _count_or_share(self) -> ObservedSize:
        if (self.count is None) == (self.share is None):
            raise ValueError("an observed size takes a count or a share (one of them)")
        return self

    def weight(self) -> int | float:
        """The count, or the share (``remat.shape_range.observed_counts``)."""
        return self.count if self.count is not None else float(self.share or 0)


class JobSpec(Strict):
    """What ``POST /v1/jobs`` takes; stored with the job as given (defaults filled in)."""

    model_id: Id
    mode: Mode = Mode.TRAINING
    batch: int | None = Field(default=None, ge=1, le=MAX_BATCH)
    inputs: dict[InputName, Dims] | None = Field(default=None, max_length=MAX_INPUTS)
    # inputs whose size changes: a plan family over the sizes (remat.family)
    ranges: dict[InputName, RangeText] | None = Field(default=None, max_length=MAX_INPUTS)
    observed: list[ObservedSize] | None = Field(default=None, max_length=MAX_OBSERVED)
    loss: LossSpec = Field(default_factory=LossSpec)  # training: what is differentiated
    # each attention chain planned and run as one node (remat.onnx_fusion); jobs stored
    # before this was the default hold false (migration 0006)
    fuse_attention: bool = True
    devices: list[DeviceSpec] = Field(
        default_factory=lambda: [DeviceSpec(name="cpu0", kind=DeviceKind.CPU)],
        min_length=1,
        max_length=MAX_DEVICES,
    )
    # "208MiB", "65%", bytes
    budgets: dict[Name, SizeText] = Field(default_factory=dict, max_length=MAX_DEVICES)
    strategy: Strategy = "xengine"
    solver: SolverSpec = Field(default_factory=SolverSpec)
    costs: Literal["analytical"] | ProfileCosts | NodeCosts = "analytical"
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)

    @field_validator("inputs")
    @classmethod
    def _inputs_in_bounds(cls, inputs: dict[str, list[int]] | None) -> dict[str, list[int]] | None:
        for dims in (inputs or {}).values():
            if math.prod(dims) > MAX_INPUT_ELEMENTS:
                raise ValueError("an input's dimensions multiply to more than 2**40 elements")
        return inputs

    @model_validator(mode="after")
    def _ranges_apart_from_inputs(self) -> JobSpec:
        both = sorted(set(self.ranges or {}) & set(self.inputs or {}))
        if both:
            raise ValueError(f"inputs {', '.join(both)} are given both as shapes and as ranges")
        if self.observed and not self.ranges:
            raise ValueError("observed sizes need ranges")
        if self.ranges and self.objective != ObjectiveSpec():
            raise ValueError("a job over ranges of sizes plans for time, without power caps")
        if self.ranges and isinstance(self.costs, ProfileCosts):
            raise ValueError(
                "a job over ranges of sizes takes analytical costs or a node's (profiled at "
                "a few sizes): a stored profile is of one input shape"
            )
        return self


def stored_spec(spec: dict[str, Any]) -> JobSpec:
    """A stored job's spec. One stored before the current bounds (which it may break) comes
    back as stored, unvalidated, rather than failing the answer that holds it."""
    try:
        return JobSpec.model_validate(spec)
    except ValidationError:
        return JobSpec.model_construct(**spec)


class FamilyBucketOut(BaseModel):
    low: int
    high: int  # the representative, planned by the job's strategy
    predicted_peak_bytes: int  # checkpoint-all's at ``high``, by the size estimator


class FamilySizeOut(BaseModel):
    size: int
    origin: str  # the strategy at a representative, input_aware, or a representative's plan
    predicted_ms: float
    peak_bytes: int
    hits: int  # times served from the cache


class FamilyOut(BaseModel):
    """A job over ranges of sizes: its buckets and every size planned so far."""

    device: str
    low: int
    high: int
    budget_bytes: int | None
    buckets: list[FamilyBucketOut]
    sizes: list[FamilySizeOut]


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

    @field_validator("spec", mode="wrap")
    @classmethod
    def _stored_spec(cls, spec: Any, handler: ValidatorFunctionWrapHandler) -> JobSpec:
        if isinstance(spec, dict):
            return stored_spec(spec)
        checked: JobSpec = handler(spec)
        return checked


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = None


# (stage, node); a list rather than a tuple: OpenAPI tools read 3.1's prefixItems unevenly
Pair = Annotated[list[int], Field(min_length=2, max_length=2)]


class TransferOut(BaseModel):
    """A transfer to (offload) or from (prefetch) host memory, or to (page_out) or from
    (page_in) storage, or a paged fixed tensor's read (fixed_in) or its gradient's write
    (grad_out): the steps that issue it and that wait for it. ``node`` is null for the
    last two, which name the ``tensor``."""

    node: int | None
    kind: Literal["offload", "prefetch", "page_out", "page_in", "fixed_in", "grad_out"]
    issued: int
    done: int
    tensor: str | None = None


class ScheduleOut(BaseModel):
    """R and S per device as sparse (stage, node) pairs, and bytes resident on each device
    after each step with its budget (XEngine figures 3 and 4); the transfers on each
    device's lanes to host memory and storage (plans of version 2 and 3)."""

    devices: list[str]
    nodes: list[str]
    stages: int
    R: dict[str, list[Pair]]
    S: dict[str, list[Pair]]
    memory: dict[str, list[int]]
    budgets: dict[str, int | None]
    peak_bytes: dict[str, int]
    transfers: dict[str, list[TransferOut]] = Field(default_factory=dict)
    predicted_ms: float | None = None  # the plan's time; None in plans stored before it
    energy_mj: float | None = None  # the plan's energy (remat.energy)


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
    energy_mj: float | None = None  # predicted energy (remat.energy)


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
    node_id: Id
    # a job over ranges of sizes: steps of these input sizes in turn, each with its plan
    sizes: list[Annotated[int, Field(ge=1, le=MAX_DIM)]] | None = Field(
        default=None, min_length=1, max_length=MAX_SIZED_STEPS
    )


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
    gradients_vanish: bool | None = None  # every true gradient is below fp32 rounding noise
    # a family's execution: per step, its size, measured and predicted time and peak, and
    # whether its plan came from a cache
    sized: list[dict[str, object]] | None = None
    error: str | None = None
    created_at: datetime
    finished_at: datetime | None
