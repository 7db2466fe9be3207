"""A job's cost table: none (analytical), a stored profile, or a node's profile, which is
measured first when it does not exist yet: the job waits for the node's agent, which
profiles within the job's budgets (recomputing where checkpoint-all does not fit)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.orm import Session

from app.planning import build_problem
from app.profiles import find_profile, job_devices_on, model_ref, profile_key, request_profile
from app.schemas import JobSpec, NodeCosts, ProfileCosts
from app.tables import AgentTaskRow, ModelRow, NodeRow, ProfileRow, TaskStatus
from app.task_queue import sweep_expired
from remat.costs import CostTable
from remat.errors import InvalidInputError
from workers.context import WorkerContext

POLL_S = 0.5


class Cancelled(Exception):
    """The user cancelled the job while it waited."""


def job_costs(
    ctx: WorkerContext,
    spec: JobSpec,
    model: ModelRow,
    cancelled: Callable[[], bool],
    say: Callable[[str], None],
) -> CostTable | None:
    if isinstance(spec.costs, ProfileCosts):
        with ctx.db.session() as session:
            profile = session.get(ProfileRow, spec.costs.profile_id)
            if profile is None:
                raise InvalidInputError(f"profile {spec.costs.profile_id!r} no longer exists")
            return CostTable.model_validate(profile.table)
    if isinstance(spec.costs, NodeCosts):
        return _node_profile(ctx, spec, spec.costs.node_id, model, cancelled, say)
    return None


def _node_profile(
    ctx: WorkerContext,
    spec: JobSpec,
    node_id: str,
    model: ModelRow,
    cancelled: Callable[[], bool],
    say: Callable[[str], None],
) -> CostTable:
    """The node's profile for this job, measured by its agent first if needed."""
    ref = model_ref(spec, model)
    with ctx.db.session() as session:
        node = _node(session, node_id)
        name, devices = node.name, job_devices_on(node, spec)
        profile = find_profile(session, node_id, profile_key(ref, devices))
        if profile is not None:
            return CostTable.model_validate(profile.table)
    memory = profiling_memory(spec, ctx.store.path(model.sha256))  # outside: it takes a while
    with ctx.db.session() as session:
        task_id = request_profile(session, _node(session, node_id), ref, devices, memory).id
    say(f"waiting for node {name!r} to profile the model (task {task_id})")
    deadline = time.monotonic() + ctx.settings.profile_wait_s
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        if cancelled():
            raise Cancelled
        table = _profile_of(ctx, task_id, name, say)
        if table is not None:
            return table
    raise InvalidInputError(
        f"node {name!r} did not profile the model within {ctx.settings.profile_wait_s:g} s "
        "(is its agent running? see GET /v1/nodes)"
    )


def _node(session: Session, node_id: str) -> NodeRow:
    node = session.get(NodeRow, node_id)
    if node is None:
        raise InvalidInputError(f"node {node_id!r} no longer exists")
    return node


def profiling_memory(spec: JobSpec, path: Path) -> dict[str, int]:
    """The job's budgets in bytes (analytical costs resolve a percentage: bytes come from
    shape inference): profiling holds no more on each device."""
    budgets = build_problem(spec, path).budgets
    return {name: size for name, size in budgets.items() if size is not None}


def _profile_of(
    ctx: WorkerContext, task_id: str, node: str, say: Callable[[str], None]
) -> CostTable | None:
    with ctx.db.session() as session:
        sweep_expired(session, ctx.settings.task_max_attempts)
    with ctx.db.session() as session:
        task = session.get_one(AgentTaskRow, task_id)
        if task.status == TaskStatus.FAILED:
            raise InvalidInputError(f"profiling on node {node!r} failed: {task.error}")
        if task.status == TaskStatus.SUCCEEDED and task.result:
            profile = session.get_one(ProfileRow, task.result["profile_id"])
            return CostTable.model_validate(profile.table)
        if task.progress:
            done, total = task.progress.get("done", 0), task.progress.get("total", 0)
            say(f"node {node!r} is profiling the model: {done}/{total}")
    return None
