"""``solve_job``: one job from its committed row to a stored plan. Celery's task and the
embedded dispatcher both call it; it is safe to run twice for the same job (redelivery
after a worker died): an attempt counter caps retries and a job gets one plan at most.

The strategy's solves run in their own subprocesses (``remat.solvers.runner``); this
thread only relays progress (at most once per ``progress_interval_s``) and the
cancellation flag, which it reads from the job row.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from sqlalchemy import delete

from app.database import Database
from app.planning import build_problem, solver_settings
from app.schemas import BaselinesOut, JobSpec, ScheduleOut
from app.tables import JobRow, JobStatus, ModelRow, PlanRow, ProgressRow, now
from remat.comparison import baselines
from remat.errors import RematError
from remat.max_batch import plan_with
from remat.plan import plan_to_json
from remat.plan_view import stage_matrices
from remat.solvers.model import Progress
from remat.strategies.base import Problem, StrategyResult
from workers.context import WorkerContext
from workers.costs import Cancelled, job_costs

log = logging.getLogger("remat.worker")
CANCEL_POLL_S = 0.5  # the cancel flag is read at most this often (stops within 2 s)


@dataclass(frozen=True)
class _Claim:
    spec: JobSpec
    model: ModelRow
    model_path: Path


def solve_job(ctx: WorkerContext, job_id: str) -> None:
    claim = _claim(ctx, job_id)
    if claim is None:
        return
    cancel = CancelFlag(ctx.db, job_id)
    progress = ProgressWriter(ctx.db, job_id, ctx.settings.progress_interval_s)
    try:
        say = MessageWriter(ctx.db, job_id)
        table = job_costs(ctx, claim.spec, claim.model, cancel.is_set, say)
        settings = replace(solver_settings(claim.spec), on_progress=progress, cancel=cancel)
        problem = build_problem(claim.spec, claim.model_path, settings, table)
        result = plan_with(claim.spec.strategy, problem)
    except Cancelled:
        _finish(ctx, job_id, JobStatus.CANCELLED, message="cancelled while waiting for a profile")
        return
    except RematError as exc:
        _finish(ctx, job_id, JobStatus.FAILED, error=str(exc))
        return
    except Exception as exc:
        log.exception("job %s failed", job_id)
        _finish(ctx, job_id, JobStatus.FAILED, error=f"internal error: {type(exc).__name__}: {exc}")
        return
    if cancel.is_set():
        _finish(ctx, job_id, JobStatus.CANCELLED, message="cancelled while solving")
    elif result.plan is None or result.simulation is None or not result.simulation.valid:
        _finish(ctx, job_id, JobStatus.FAILED, error=result.message or "no plan found")
    else:
        compared = BaselinesOut.model_validate(baselines(problem), from_attributes=True)
        _store_plan(ctx, job_id, problem, result, compared, progress.elapsed())


def _claim(ctx: WorkerContext, job_id: str) -> _Claim | None:
    """Mark the job running (one more attempt), or None when there is nothing to do: it
    is gone, finished, cancelled, or out of attempts (then it is failed)."""
    with ctx.db.session() as session:
        job = session.get(JobRow, job_id, with_for_update=True)
        if job is None or JobStatus(job.status).finished:
            return None
        if job.cancel_requested:
            job.status, job.finished_at = JobStatus.CANCELLED, now()
            return None
        if job.attempts >= ctx.settings.max_attempts:
            job.status, job.finished_at = JobStatus.FAILED, now()
            job.error = f"gave up after {job.attempts} attempts (its worker stopped mid-solve)"
            return None
        job.attempts += 1
        job.status = JobStatus.RUNNING
        session.execute(delete(ProgressRow).where(ProgressRow.job_id == job_id))
        job.started_at = job.started_at or now()
        model = session.get_one(ModelRow, job.model_id)
        return _Claim(JobSpec.model_validate(job.spec), model, ctx.store.path(model.sha256))


def _finish(
    ctx: WorkerContext,
    job_id: str,
    status: JobStatus,
    error: str | None = None,
    message: str | None = None,
) -> None:
    with ctx.db.session() as session:
        job = session.get(JobRow, job_id, with_for_update=True)
        if job is None or JobStatus(job.status).finished:
            return
        job.status, job.error, job.message, job.finished_at = status, error, message, now()


def _store_plan(
    ctx: WorkerContext,
    job_id: str,
    problem: Problem,
    result: StrategyResult,
    compared: BaselinesOut,
    elapsed_s: float,
) -> None:
    """The plan, its schedule view, the baselines and the final progress, once: a job that
    finished in the meantime (another delivery of the same job) keeps what it has."""
    assert result.plan is not None and result.simulation is not None
    plan, simulation = result.plan, result.simulation
    matrices = stage_matrices(plan)
    schedule = ScheduleOut(
        devices=[d.name for d in plan.devices],
        nodes=[n.name for n in problem.graph.nodes],
        stages=matrices.stages,
        R=matrices.R,
        S=matrices.S,
        memory=simulation.timeline,
        budgets=plan.budgets,
        peak_bytes=simulation.peak_bytes,
    )
    with ctx.db.session() as session:
        job = session.get(JobRow, job_id, with_for_update=True)
        if job is None or JobStatus(job.status).finished or session.get(PlanRow, job_id):
            return
        session.add(
            PlanRow(
                job_id=job_id,
                document=plan_to_json(plan),
                schedule=schedule.model_dump(),
                baselines=compared.model_dump(),
            )
        )
        job.status, job.finished_at, job.message = (
            JobStatus.SUCCEEDED,
            now(),
            result.message or None,
        )
        job.incumbent_ms = simulation.total_ms
        if plan.solver is not None:
            job.solver_status = plan.solver.status
            job.bound_ms, job.gap, job.elapsed_s = plan.solver.bound, plan.solver.gap, elapsed_s
            final = Progress(elapsed_s, job.incumbent_ms, job.bound_ms, job.gap)
            session.add(_point(job_id, final))  # the history ends where the solve did


class CancelFlag:
    """``is_set()``: the job's ``cancel_requested``, read from the database at most every
    ``CANCEL_POLL_S`` (the solver polls it often)."""

    def __init__(self, db: Database, job_id: str) -> None:
        self.db, self.job_id = db, job_id
        self._set = False
        self._checked = 0.0
        self._lock = threading.Lock()

    def is_set(self) -> bool:
        with self._lock:
            if not self._set and time.monotonic() - self._checked >= CANCEL_POLL_S:
                self._checked = time.monotonic()
                with self.db.session() as session:
                    job = session.get(JobRow, self.job_id)
                    self._set = job is None or job.cancel_requested
            return self._set


def _point(job_id: str, progress: Progress) -> ProgressRow:
    return ProgressRow(
        job_id=job_id,
        elapsed_s=progress.elapsed_s,
        incumbent_ms=progress.objective,
        bound_ms=progress.bound,
        gap=progress.gap,
    )


class ProgressWriter:
    """The solver's progress events into the job row and its history, at most once per
    ``interval_s``. Times are the attempt's (since this writer was made), which also
    counts the wait for a profile and building the problem; the full solve and the solves
    beside it report from their own threads."""

    def __init__(self, db: Database, job_id: str, interval_s: float) -> None:
        self.db, self.job_id, self.interval_s = db, job_id, interval_s
        self._start = time.monotonic()
        self._last = float("-inf")
        self._lock = threading.Lock()

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def __call__(self, progress: Progress) -> None:
        with self._lock:
            if time.monotonic() - self._last >= self.interval_s:
                self._last = time.monotonic()
                self._write(progress)

    def _write(self, progress: Progress) -> None:
        with self.db.session() as session:
            job = session.get(JobRow, self.job_id)
            if job is None or job.status != JobStatus.RUNNING:
                return
            progress = replace(progress, elapsed_s=self.elapsed())
            job.incumbent_ms, job.bound_ms = progress.objective, progress.bound
            job.gap, job.elapsed_s = progress.gap, progress.elapsed_s
            session.add(_point(self.job_id, progress))


class MessageWriter:
    """A line for the job's ``message`` while it waits (e.g. for a node's profile)."""

    def __init__(self, db: Database, job_id: str) -> None:
        self.db, self.job_id = db, job_id
        self._last: str | None = None

    def __call__(self, message: str) -> None:
        if message == self._last:
            return
        self._last = message
        with self.db.session() as session:
            job = session.get(JobRow, self.job_id)
            if job is not None and job.status == JobStatus.RUNNING:
                job.message = message
