"""A job's cost table: none (analytical), a stored profile, or a node's profile, which is
measured first when it does not exist yet: the job waits for the node's agent, which
profiles within the job's budgets (recomputing where checkpoint-all does not fit). A job
over ranges of sizes gets the node's profiles at a few sizes, those not stored yet
measured in one task."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

from sqlalchemy.orm import Session

from app.planning import build_problem, job_graph
from app.profiles import (
    find_profile,
    job_devices_on,
    model_ref,
    profile_key,
    request_profile,
    request_sized_profile,
)
from app.schemas import JobSpec, NodeCosts, ProfileCosts
from app.tables import AgentTaskRow, ModelRow, NodeRow, ProfileRow, TaskStatus
from app.task_queue import sweep_expired
from remat.costs import CostTable
from remat.errors import InvalidInputError
from workers.context import WorkerContext

POLL_S = 0.5

Say = Callable[[str], None]


class Cancelled(Exception):
    """The user cancelled the job while it waited."""


def job_costs(
    ctx: WorkerContext,
    spec: JobSpec,
    model: ModelRow,
    cancelled: Callable[[], bool],
    say: Say,
) -> CostTable | None:
    if isinstance(spec.costs, ProfileCosts):
        with ctx.db.session() as session:
            profile = session.get(ProfileRow, spec.costs.profile_id)
            if profile is None:
                raise InvalidInputError(f"profile {spec.costs.profile_id!r} no longer exists")
            return CostTable.model_validate(profile.table)
    if isinstance(spec.costs, NodeCosts):
        return node_profiles(ctx, {0: spec}, model, cancelled, say)[0]
    return None


def node_profiles(
    ctx: WorkerContext,
    specs: Mapping[int, JobSpec],
    model: ModelRow,
    cancelled: Callable[[], bool],
    say: Say,
) -> dict[int, CostTable]:
    """The node's profiles for the jobs of one shape ``specs`` (a job; or a ranged job at
    a few sizes), each measured by its agent first if not stored, or stored for another
    graph of the model (``CostTable.measured_on``: one ingestion built before it fused
    more): one task for the one shape, or one for every size missing, within the budgets
    of the largest (a ranged job's budget is its largest size's)."""
    largest = specs[max(specs)]
    assert isinstance(largest.costs, NodeCosts)
    node_id = largest.costs.node_id
    refs = {size: model_ref(spec, model) for size, spec in specs.items()}
    tables: dict[int, CostTable] = {}
    with ctx.db.session() as session:
        node = _node(session, node_id)
        name, devices = node.name, job_devices_on(node, largest)
        for size, ref in refs.items():
            profile = find_profile(session, node_id, profile_key(ref, devices))
            if profile is not None:
                tables[size] = CostTable.model_validate(profile.table)
    path = ctx.store.path(model.sha256)
    for size, table in list(tables.items()):  # outside: building a graph takes a while
        if not table.measured_on(job_graph(specs[size], path)):
            say("a stored profile is of another graph of the model (built otherwise then)")
            del tables[size]
    missing = {size: ref for size, ref in refs.items() if size not in tables}
    if not missing:
        return tables
    memory = profiling_memory(largest, path)  # outside: it takes a while
    with ctx.db.session() as session:
        node = _node(session, node_id)
        if len(specs) == 1:
            task = request_profile(session, node, refs[max(refs)], devices, memory)
        else:
            task = request_sized_profile(session, node, missing, devices, memory)
        task_id = task.id
    say(f"waiting for node {name!r} to profile the model (task {task_id})")
    measured = _await_profiles(ctx, task_id, name, cancelled, say)
    if len(specs) == 1:
        return {max(specs): measured[""]}
    return tables | {size: measured[str(size)] for size in missing}


def _node(session: Session, node_id: str) -> NodeRow:
    node = session.get(NodeRow, node_id)
    if node is None:
        raise InvalidInputError(f"node {node_id!r} no longer exists")
    return node


def profiling_memory(spec: JobSpec, path: Path) -> dict[str, int]:
    """The job's budget on each device in bytes (analytical costs resolve a percentage:
    bytes come from shape inference), which profiling holds no more than there: in passes
    under a plan that fits, or node by node on a device that holds only part of the model
    (``remat.profiling_plan``)."""
    budgets = build_problem(spec, path).budgets
    return {name: size for name, size in budgets.items() if size is not None}


def _await_profiles(
    ctx: WorkerContext, task_id: str, node: str, cancelled: Callable[[], bool], say: Say
) -> dict[str, CostTable]:
    deadline = time.monotonic() + ctx.settings.profile_wait_s
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        if cancelled():
            raise Cancelled
        tables = _profiles_of(ctx, task_id, node, say)
        if tables is not None:
            return tables
    raise InvalidInputError(
        f"node {node!r} did not profile the model within {ctx.settings.profile_wait_s:g} s "
        "(is its agent running? see GET /v1/nodes)"
    )


def _profiles_of(
    ctx: WorkerContext, task_id: str, node: str, say: Say
) -> dict[str, CostTable] | None:
    """The task's tables once it succeeded (by size as text; "" for one shape)."""
    with ctx.db.session() as session:
        sweep_expired(session, ctx.settings.task_max_attempts)
    with ctx.db.session() as session:
        task = session.get_one(AgentTaskRow, task_id)
        if task.status == TaskStatus.FAILED:
            raise InvalidInputError(f"profiling on node {node!r} failed: {task.error}")
        if task.status == TaskStatus.SUCCEEDED and task.result:
            ids = task.result.get("profile_ids") or {"": task.result["profile_id"]}
            return {
                size: CostTable.model_validate(session.get_one(ProfileRow, id_).table)
                for size, id_ in ids.items()
            }
        if task.progress:
            done, total = task.progress.get("done", 0), task.progress.get("total", 0)
            where = f" at {task.progress['message']}" if task.progress.get("message") else ""
            say(f"node {node!r} is profiling the model{where}: {done}/{total}")
    return None
