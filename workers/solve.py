"""``solve_job``: one job from its committed row to a stored plan. Celery's task and the
embedded dispatcher both call it; it is safe to run twice for the same job (a duplicate
message, or redelivery after a worker died): an attempt counter caps retries and a job
gets one plan at most.

A claimed job is leased to its attempt: a heartbeat thread writes ``heartbeat_at`` every
``REMAT_JOB_HEARTBEAT_S``, and every write about the job's outcome lands only while the job
is still running under the same attempt (a compare-and-set on ``status`` and ``attempts``).
A job whose heartbeat stopped for ``REMAT_JOB_STALE_S`` is taken back by the sweeper
(``workers/sweeper.py``) or claimed again; a claim leaves a job alone that another worker
holds with a fresh heartbeat. An attempt that lost its lease stops its solve and writes
nothing.

The strategy's solves run in their own subprocesses (``remat.solvers.runner``); this
thread only relays progress (at most once per ``progress_interval_s``) and the
cancellation flag, which it reads from the job row.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, update
from sqlalchemy.exc import SQLAlchemyError

from app.database import Database
from app.families import family_result, family_row, family_summary
from app.planning import at_size, build_problem, family_problems, job_range, solver_settings
from app.schemas import BaselinesOut, JobSpec, ScheduleOut, TransferOut
from app.services.jobs import earlier_plans
from app.tables import JobRow, JobStatus, ModelRow, PlanRow, ProgressRow, now, utc
from remat.comparison import baselines
from remat.costs import CostTable
from remat.errors import RematError
from remat.family import PlanFamily, fitted_sizes, plan_family
from remat.plan import Plan, plan_to_json
from remat.plan_view import stage_matrices, transfer_spans
from remat.shape_range import ShapeRange
from remat.solvers.model import Progress
from remat.strategies import AUTO, OPTIMAL, Problem, StrategyResult, run_strategy
from remat.strategies.common.known import noted_if_known
from workers.context import WorkerContext
from workers.costs import Cancelled, job_costs, node_profiles

log = logging.getLogger("remat.worker")
CANCEL_POLL_S = 0.5  # the cancel flag is read at most this often (stops within 2 s)


@dataclass(frozen=True)
class _Claim:
    spec: JobSpec
    model: ModelRow
    model_path: Path
    attempt: int  # the job's attempt counter as this claim set it: the lease's fence


class NotFinite(ValueError):
    """A document holds a number JSON cannot represent (NaN or an infinity)."""


def solve_job(ctx: WorkerContext, job_id: str) -> None:
    claim = _claim(ctx, job_id)
    if claim is None:
        return
    lease = Lease(ctx.db, job_id, claim.attempt, ctx.settings.job_heartbeat_s)
    try:
        _solve(ctx, job_id, claim, lease)
    finally:
        lease.stop()


def _solve(ctx: WorkerContext, job_id: str, claim: _Claim, lease: Lease) -> None:
    attempt = claim.attempt
    cancel = CancelFlag(ctx.db, job_id, lease)
    progress = ProgressWriter(ctx.db, job_id, attempt, ctx.settings.progress_interval_s)
    try:
        say = MessageWriter(ctx.db, job_id, attempt)
        settings = replace(solver_settings(claim.spec), on_progress=progress, cancel=cancel)
        ranged = job_range(claim.spec)
        family: PlanFamily | None = None
        tables: dict[int, CostTable] | None = None
        if ranged is None:
            table = job_costs(ctx, claim.spec, claim.model, cancel.is_set, say)
            problem = build_problem(claim.spec, claim.model_path, settings, table)
            earlier = _earlier_plans(ctx, claim, problem, say)
            problem = problem.starting_from(earlier.values())
            result = noted_if_known(run_strategy(claim.spec.strategy, problem), earlier)
        else:
            tables = _sized_tables(ctx, claim, ranged, cancel.is_set, say)
            problem_at = family_problems(claim.spec, claim.model_path, ranged, settings, tables)
            problem = problem_at(ranged.high)
            device = problem.costs.devices[0].name
            family = plan_family(problem_at, ranged, device, claim.spec.strategy, progress=say)
            result = family_result(family, claim.spec.strategy)
    except Cancelled:
        message = "cancelled while waiting for a profile"
        _finish(ctx, job_id, attempt, JobStatus.CANCELLED, message=message)
        return
    except RematError as exc:
        _finish(ctx, job_id, attempt, JobStatus.FAILED, error=str(exc))
        return
    except Exception as exc:
        log.exception("job %s failed", job_id)
        _finish(ctx, job_id, attempt, JobStatus.FAILED, error=_internal(exc))
        return
    if cancel.is_set():
        _finish(ctx, job_id, attempt, JobStatus.CANCELLED, message="cancelled while solving")
    elif result.plan is None or result.simulation is None or not result.simulation.valid:
        _finish(ctx, job_id, attempt, JobStatus.FAILED, error=result.message or "no plan found")
    else:
        try:
            compared = BaselinesOut.model_validate(baselines(problem), from_attributes=True)
            elapsed = progress.elapsed()
            sized = None if family is None else (family, tables)
            _store_plan(ctx, job_id, attempt, problem, result, compared, elapsed, sized)
        except Exception as exc:
            log.exception("job %s: storing its plan failed", job_id)
            _finish(ctx, job_id, attempt, JobStatus.FAILED, error=_internal(exc))


def _earlier_plans(
    ctx: WorkerContext, claim: _Claim, problem: Problem, say: Callable[[str], None]
) -> dict[str, Plan]:
    """The plans of the model's earlier jobs for the problem's graph, by job, which the
    exact strategies (and ``auto``'s exact phase) start from; none where the job asks to
    search afresh or names a strategy that does not search."""
    if not claim.spec.solver.reuse_plans or claim.spec.strategy not in (AUTO, *OPTIMAL):
        return {}
    with ctx.db.session() as session:
        plans = earlier_plans(session, claim.model.id, problem.graph.fingerprint)
    if plans:
        say(f"starting from {len(plans)} plan(s) of earlier jobs of this model")
    return plans


def _sized_tables(
    ctx: WorkerContext,
    claim: _Claim,
    ranged: ShapeRange,
    cancelled: Callable[[], bool],
    say: Callable[[str], None],
) -> dict[int, CostTable] | None:
    """A job over ranges of sizes with a node's costs: the node's profile at each size
    the family's estimator is fitted at (those not stored measured by its agent in one
    task, within the budget the job's is at the largest size, as the family is planned);
    None for analytical costs."""
    if claim.spec.costs == "analytical":
        return None
    specs = {size: at_size(claim.spec, ranged, size) for size in fitted_sizes(ranged)}
    return node_profiles(ctx, specs, claim.model, cancelled, say)


def _internal(exc: Exception) -> str:
    return f"internal error: {type(exc).__name__}: {exc}"


def worker_name() -> str:
    """Who holds a running job: host, process and thread (for operators)."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.current_thread().name}"[:255]


def _held(job_id: str, attempt: int) -> ColumnElement[bool]:
    """The job is still running under this attempt (its lease was not taken back)."""
    return and_(JobRow.id == job_id, JobRow.status == JobStatus.RUNNING, JobRow.attempts == attempt)


def _claim(ctx: WorkerContext, job_id: str) -> _Claim | None:
    """Mark the job running (one more attempt), or None when there is nothing to do: it
    is gone, finished, cancelled, out of attempts (then it is failed), or running under
    another worker whose heartbeat is fresh (a duplicate message). The update is a
    compare-and-set on the status and attempts read, so that two claims never both win
    (SQLite has no row locks)."""
    stale_before = now() - timedelta(seconds=ctx.settings.job_stale_s)
    with ctx.db.session() as session:
        job = session.get(JobRow, job_id, with_for_update=True)
        if job is None or JobStatus(job.status).finished:
            return None
        if job.status == JobStatus.RUNNING and _alive(job, stale_before):
            return None
        read = and_(
            JobRow.id == job_id, JobRow.status == job.status, JobRow.attempts == job.attempts
        )
        if job.cancel_requested:
            values: dict[str, Any] = {"status": JobStatus.CANCELLED, "finished_at": now()}
        elif job.attempts >= ctx.settings.max_attempts:
            error = f"gave up after {job.attempts} attempts (its worker stopped mid-solve)"
            values = {"status": JobStatus.FAILED, "finished_at": now(), "error": error}
        else:
            values = {
                "status": JobStatus.RUNNING,
                "attempts": job.attempts + 1,
                "started_at": job.started_at or now(),
                "heartbeat_at": now(),
                "worker": worker_name(),
                "message": None,  # an earlier attempt's (e.g. why it was queued again)
            }
        taken = session.execute(
            update(JobRow).where(read).values(**values).execution_options(synchronize_session=False)
        )
        if taken.rowcount != 1 or values["status"] != JobStatus.RUNNING:  # type: ignore[attr-defined]
            return None
        session.execute(delete(ProgressRow).where(ProgressRow.job_id == job_id))
        model = session.get_one(ModelRow, job.model_id)
        spec = JobSpec.model_validate(job.spec)
        return _Claim(spec, model, ctx.store.path(model.sha256), job.attempts + 1)


def _alive(job: JobRow, stale_before: datetime) -> bool:
    """A running job's holder reported after ``stale_before`` (rows from before heartbeats
    count from their last change)."""
    return utc(job.heartbeat_at or job.updated_at) >= stale_before


def _finish(
    ctx: WorkerContext,
    job_id: str,
    attempt: int,
    status: JobStatus,
    error: str | None = None,
    message: str | None = None,
) -> None:
    """The attempt's outcome, only while the attempt still holds the job."""
    with ctx.db.session() as session:
        session.execute(
            update(JobRow)
            .where(_held(job_id, attempt))
            .values(status=status, error=error, message=message, finished_at=now())
            .execution_options(synchronize_session=False)
        )


def strict_json(value: Any, what: str) -> Any:
    """``value`` as plain JSON (what the database's JSON columns store), refusing NaN and
    the infinities: PostgreSQL rejects them and SQLite would keep a document that cannot
    be served."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except ValueError:
        raise NotFinite(
            f"the {what} could not be stored: it holds a number that is not finite (NaN or "
            "infinity), which usually comes from non-finite inputs (device options, costs)"
        ) from None


def _store_plan(
    ctx: WorkerContext,
    job_id: str,
    attempt: int,
    problem: Problem,
    result: StrategyResult,
    compared: BaselinesOut,
    elapsed_s: float,
    sized: tuple[PlanFamily, dict[int, CostTable] | None] | None = None,
) -> None:
    """The plan, its schedule view, the baselines, the final progress and (a job over
    ranges of sizes) its family's plans, once, in one transaction with the job's success:
    a job that finished meanwhile (another delivery of the same job) keeps what it has,
    and a cancel that landed first wins. A plan that cannot be stored fails the job with
    the reason."""
    assert result.plan is not None and result.simulation is not None
    plan, simulation = result.plan, result.simulation
    incumbent = problem.objective.value(simulation.total_ms, simulation.energy_mj)
    matrices = stage_matrices(plan)
    schedule = ScheduleOut(
        devices=[d.name for d in plan.devices],
        nodes=[n.name for n in problem.graph.nodes],
        stages=matrices.stages,
        R=_pairs(matrices.R),
        S=_pairs(matrices.S),
        memory=simulation.timeline,
        budgets=plan.budgets,
        peak_bytes=simulation.peak_bytes,
        transfers={
            device: [TransferOut.model_validate(span, from_attributes=True) for span in spans]
            for device, spans in transfer_spans(plan).items()
            if spans
        },
        predicted_ms=simulation.total_ms,
        energy_mj=simulation.energy_mj,
    )
    try:
        row = PlanRow(
            job_id=job_id,
            document=strict_json(plan_to_json(plan), "plan"),
            graph_digest=None if plan.graph is None else plan.graph.digest,
            schedule=strict_json(schedule.model_dump(), "schedule"),
            baselines=strict_json(compared.model_dump(), "baselines"),
            family=None if sized is None else strict_json(family_summary(*sized), "family"),
        )
        rows = [] if sized is None else [family_row(job_id, p) for p in sized[0].cache.values()]
    except NotFinite as exc:
        _finish(ctx, job_id, attempt, JobStatus.FAILED, error=str(exc))
        return
    values: dict[str, Any] = {
        "status": JobStatus.SUCCEEDED,
        "finished_at": now(),
        "message": result.message or None,
        # in the objective's unit, as the solver's bound (ms for time, the default)
        "incumbent_ms": incumbent,
    }
    final = None
    if plan.solver is not None:
        solver = plan.solver
        values |= {"solver_status": solver.status, "bound_ms": solver.bound}
        values |= {"gap": solver.gap, "elapsed_s": elapsed_s}
        final = Progress(elapsed_s, incumbent, solver.bound, solver.gap)
    try:
        with ctx.db.session() as session:
            session.get(JobRow, job_id, with_for_update=True)  # PostgreSQL: a cancel waits
            stored = session.execute(
                update(JobRow)
                .where(_held(job_id, attempt), JobRow.cancel_requested.is_(False))
                .values(**values)
                .execution_options(synchronize_session=False)
            )
            if stored.rowcount == 1:  # type: ignore[attr-defined]
                session.add(row)
                session.add_all(rows)
                if final is not None:
                    session.add(_point(job_id, final))  # the history ends where the solve did
                return
    except SQLAlchemyError as exc:
        log.exception("job %s: the database refused its plan", job_id)
        orig = getattr(exc, "orig", None)  # the driver's error, for DBAPIError
        reason = str(orig or exc).splitlines()[0]
        error = f"the plan could not be stored: {reason}"
        _finish(ctx, job_id, attempt, JobStatus.FAILED, error=error)
        return
    # not stored: finished or taken back meanwhile (nothing to do), or cancelled just now
    _finish(ctx, job_id, attempt, JobStatus.CANCELLED, message="cancelled while solving")


def _pairs(cells: dict[str, list[tuple[int, int]]]) -> dict[str, list[list[int]]]:
    """(stage, node) cells as the API's pairs (lists)."""
    return {device: [list(cell) for cell in pairs] for device, pairs in cells.items()}


class Lease:
    """This attempt's hold on the job: a thread that writes ``heartbeat_at`` every
    ``interval_s`` while the job runs under the attempt. ``lost`` is set once it does not
    (the job finished, or the sweeper took it back after missed heartbeats): the solve
    stops (``CancelFlag``). A heartbeat does not move ``updated_at``: the job's ETag
    changes only when the job does."""

    def __init__(self, db: Database, job_id: str, attempt: int, interval_s: float) -> None:
        self.db, self.job_id, self.attempt, self.interval_s = db, job_id, attempt, interval_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        name = f"remat-heartbeat-{job_id[:8]}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with self.db.session() as session:
                    beat = session.execute(
                        update(JobRow)
                        .where(_held(self.job_id, self.attempt))
                        .values(heartbeat_at=now(), updated_at=JobRow.updated_at)
                        .execution_options(synchronize_session=False)
                    )
            except SQLAlchemyError:  # the next beat may get through; the sweeper waits
                log.warning("job %s: heartbeat failed", self.job_id, exc_info=True)
                continue
            if beat.rowcount != 1:  # type: ignore[attr-defined]
                self.lost.set()  # finished, or taken back: nothing left to solve
                if not self._finished_here():
                    log.warning(
                        "job %s: attempt %d lost its lease (taken back after missed "
                        "heartbeats); it stops and writes nothing",
                        self.job_id,
                        self.attempt,
                    )
                return

    def _finished_here(self) -> bool:
        """The job finished under this attempt (its outcome was just written)."""
        try:
            with self.db.session() as session:
                job = session.get(JobRow, self.job_id)
        except SQLAlchemyError:
            return False
        return job is not None and job.attempts == self.attempt and job.finished_at is not None


class CancelFlag:
    """``is_set()``: the job's ``cancel_requested``, read from the database at most every
    ``CANCEL_POLL_S`` (the solver polls it often); also set once the attempt lost its
    lease (the job is no longer this attempt's to solve)."""

    def __init__(self, db: Database, job_id: str, lease: Lease | None = None) -> None:
        self.db, self.job_id, self.lease = db, job_id, lease
        self._set = False
        self._checked = 0.0
        self._lock = threading.Lock()

    def is_set(self) -> bool:
        if self.lease is not None and self.lease.lost.is_set():
            return True
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

    def __init__(self, db: Database, job_id: str, attempt: int, interval_s: float) -> None:
        self.db, self.job_id, self.attempt, self.interval_s = db, job_id, attempt, interval_s
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
            if job is None or job.status != JobStatus.RUNNING or job.attempts != self.attempt:
                return
            progress = replace(progress, elapsed_s=self.elapsed())
            job.incumbent_ms, job.bound_ms = progress.objective, progress.bound
            job.gap, job.elapsed_s = progress.gap, progress.elapsed_s
            session.add(_point(self.job_id, progress))


class MessageWriter:
    """A line for the job's ``message`` while it waits (e.g. for a node's profile)."""

    def __init__(self, db: Database, job_id: str, attempt: int) -> None:
        self.db, self.job_id, self.attempt = db, job_id, attempt
        self._last: str | None = None

    def __call__(self, message: str) -> None:
        if message == self._last:
            return
        self._last = message
        with self.db.session() as session:
            job = session.get(JobRow, self.job_id)
            if job is not None and job.status == JobStatus.RUNNING and job.attempts == self.attempt:
                job.message = message
