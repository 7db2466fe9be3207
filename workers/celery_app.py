"""The Celery app: Redis as broker, the database as the store of results (no result
backend). docs/architecture.md, "Celery": late acks and a prefetch of one, so that a job whose
worker died is redelivered; a visibility timeout above the longest solve, so that a
running job is not (and were it redelivered, its claim leaves a job alone whose worker
still heartbeats); no ``revoke(terminate=True)``: cancellation is a flag in the job row.
Recovery does not wait for the visibility timeout: the API's sweeper
(``workers/sweeper.py``) sends a job again within ``REMAT_JOB_STALE_S`` of its worker's
last heartbeat, and a queued job whose message was lost with the broker.

Run a worker with ``celery -A workers.celery_app worker --pool threads --concurrency 2``:
solves run in their own subprocesses, so threads suffice (and a prefork child, being
daemonic, could not start them).
"""

from __future__ import annotations

from celery import Celery

from app.settings import Settings
from workers.context import WorkerContext
from workers.solve import solve_job

SOLVE_TASK = "remat.solve_job"
HANG_MARGIN_S = 600  # past the longest allowed solve, a task is stopped as hung


def make_celery(settings: Settings) -> Celery:
    app = Celery("remat", broker=settings.broker_url)
    # kombu sweeps the unacked messages of dead workers back to the queue every
    # interval x throttle seconds (100 s by default); one scan per 10 s interval is cheap
    # and puts a message back within 10 s of its visibility timeout.
    transport = {
        "visibility_timeout": settings.broker_visibility_timeout_s,
        "unacked_restore_throttle": 1,
    }
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        task_time_limit=settings.max_time_limit_s + HANG_MARGIN_S,
        worker_hijack_root_logger=False,
    )
    return app


settings = Settings()
app = make_celery(settings)
_context: WorkerContext | None = None


@app.task(name=SOLVE_TASK)
def solve(job_id: str) -> None:
    global _context
    if _context is None:  # one engine per worker process, made on first use
        _context = WorkerContext.of(settings)
    solve_job(_context, job_id)
