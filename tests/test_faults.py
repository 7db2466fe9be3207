"""No job is stuck or lost: jobs whose plan cannot be stored fail with the reason, a cancel
that lands before the plan is stored wins, a job held by a live worker is not claimed
twice, and the sweeper takes back jobs whose worker died or whose broker message was lost.

The first tests run ``solve_job``, the claim, the embedded dispatcher's pick and the
sweeper against real SQLite and PostgreSQL databases (and a real Redis broker), changing
only what a strategy returns or when a cancel lands. The last ones kill a Celery worker
mid-solve and restart a Redis server with queued jobs, with real processes throughout
(``tests/service.py``), the heartbeat and sweep intervals set small.
"""

from __future__ import annotations

import hashlib
import math
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis
from service import (
    Process,
    api_server,
    celery_worker,
    free_port,
    job_body,
    postgres_database,
    redis_url,
    sample_bytes,
    service_env,
    upload,
    wait,
    wait_job,
)
from sqlalchemy import func, select, update

from app.migrate import upgrade
from app.planning import summarize
from app.schemas import JobSpec
from app.settings import Settings
from app.tables import JobRow, JobStatus, ModelRow, PlanRow, now
from remat.strategies import Problem, StrategyResult, run_strategy
from workers import solve
from workers.context import WorkerContext
from workers.dispatch import CeleryDispatcher
from workers.embedded import EmbeddedDispatcher
from workers.sweeper import Sweeper

# small intervals, so that the fault tests take seconds (production: 5 s, 30 s, 10 s, 30 s);
# a worker is stale after twelve missed heartbeats, which a busy CI machine may delay
FAST = {
    "job_heartbeat_s": "0.5",
    "job_stale_s": "6",
    "sweep_interval_s": "1",
    "queued_grace_s": "2",
}


# --- solve_job, the claim and the sweeper against real databases --------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def ctx(request, tmp_path) -> Iterator[WorkerContext]:
    """A migrated database of each kind and a model store; the worker's context."""
    with ExitStack() as stack:
        if request.param == "sqlite":
            url = f"sqlite:///{tmp_path / 'remat.db'}"
        else:
            url = stack.enter_context(postgres_database())
        upgrade(url)
        context = WorkerContext.of(Settings(data_dir=tmp_path, database_url=url, max_attempts=2))
        try:
            yield context
        finally:
            context.db.dispose()


def _job(ctx: WorkerContext) -> str:
    """A committed job on the chain sample with a fast heuristic strategy."""
    data = sample_bytes("chain")
    digest = hashlib.sha256(data).hexdigest()
    ctx.store.path(digest).parent.mkdir(parents=True, exist_ok=True)
    ctx.store.path(digest).write_bytes(data)
    with ctx.db.session() as session:
        model = session.scalar(select(ModelRow).where(ModelRow.sha256 == digest))
        if model is None:
            summary = summarize(ctx.store.path(digest)).model_dump()
            model = ModelRow(sha256=digest, filename="chain.onnx", size_bytes=len(data))
            model.summary = summary
            session.add(model)
            session.flush()
        spec = JobSpec.model_validate(
            job_body(model.id, strategy="chen_sqrt", batch=2, budgets={"cpu0": "90%"})
        )
        job = JobRow(model_id=model.id, spec=spec.model_dump(mode="json"))
        session.add(job)
    return job.id


def _row(ctx: WorkerContext, job_id: str) -> JobRow:
    with ctx.db.session() as session:
        return session.get_one(JobRow, job_id)


def _plans(ctx: WorkerContext, job_id: str) -> int:
    with ctx.db.session() as session:
        return session.scalar(select(func.count()).where(PlanRow.job_id == job_id)) or 0


def test_a_job_solves_and_stores_its_plan_once(ctx):
    job_id = _job(ctx)
    solve.solve_job(ctx, job_id)
    solve.solve_job(ctx, job_id)  # a second delivery of a finished job changes nothing
    job = _row(ctx, job_id)
    assert job.status == JobStatus.SUCCEEDED and job.attempts == 1, job.error
    assert _plans(ctx, job_id) == 1


def test_a_plan_with_a_number_that_is_not_finite_fails_the_job_with_the_reason(ctx, monkeypatch):
    """PostgreSQL refuses NaN in JSON (the job stayed running); SQLite stored it and then
    could not serve it. Either way the job must fail, saying why, and store nothing."""

    def nan_plan(strategy: str, problem: Problem) -> StrategyResult:
        result = run_strategy(strategy, problem)
        assert result.plan is not None and result.plan.predicted is not None
        predicted = replace(result.plan.predicted, total_ms=math.nan)
        return replace(result, plan=replace(result.plan, predicted=predicted))

    monkeypatch.setattr(solve, "run_strategy", nan_plan)
    job_id = _job(ctx)
    solve.solve_job(ctx, job_id)
    job = _row(ctx, job_id)
    assert job.status == JobStatus.FAILED, (job.status, job.error)
    assert "not finite" in (job.error or "") and "plan" in (job.error or "")
    assert _plans(ctx, job_id) == 0


def test_a_cancel_that_lands_before_the_plan_is_stored_wins(ctx, monkeypatch):
    """The cancel arrives after the worker last read the flag (while the baselines run,
    just before the plan is stored): the job ends cancelled, without a plan."""
    baselines = solve.baselines

    def cancel_meanwhile(problem: Problem) -> Any:
        with ctx.db.session() as session:
            session.execute(update(JobRow).values(cancel_requested=True))
        return baselines(problem)

    monkeypatch.setattr(solve, "baselines", cancel_meanwhile)
    job_id = _job(ctx)
    solve.solve_job(ctx, job_id)
    job = _row(ctx, job_id)
    assert job.status == JobStatus.CANCELLED and job.cancel_requested
    assert _plans(ctx, job_id) == 0


def test_a_claim_leaves_alone_a_job_whose_worker_heartbeats(ctx):
    """A duplicate message for a running job must not start it again while its worker
    lives; once its heartbeat is stale, a claim takes it (one more attempt)."""
    job_id = _job(ctx)
    first = solve._claim(ctx, job_id)
    assert first is not None and first.attempt == 1
    assert solve._claim(ctx, job_id) is None
    assert _row(ctx, job_id).attempts == 1
    _age_heartbeat(ctx, job_id)
    second = solve._claim(ctx, job_id)
    assert second is not None and second.attempt == 2
    _age_heartbeat(ctx, job_id)
    assert solve._claim(ctx, job_id) is None  # max_attempts=2: given up
    job = _row(ctx, job_id)
    assert job.status == JobStatus.FAILED and "gave up after 2 attempts" in (job.error or "")


def test_an_attempt_that_lost_its_lease_stores_nothing(ctx):
    job_id = _job(ctx)
    claim = solve._claim(ctx, job_id)
    assert claim is not None
    _age_heartbeat(ctx, job_id)
    assert solve._claim(ctx, job_id) is not None  # taken over by a second attempt
    solve._finish(ctx, job_id, claim.attempt, JobStatus.FAILED, error="from the first")
    job = _row(ctx, job_id)
    assert job.status == JobStatus.RUNNING and job.attempts == 2 and job.error is None


def test_the_heartbeat_keeps_a_job_alive_and_its_etag_unchanged(ctx):
    job_id = _job(ctx)
    claim = solve._claim(ctx, job_id)
    assert claim is not None
    before = _row(ctx, job_id)
    lease = solve.Lease(ctx.db, job_id, claim.attempt, 0.05)
    try:
        wait(lambda: _row(ctx, job_id).heartbeat_at != before.heartbeat_at, 10, "a heartbeat")
    finally:
        lease.stop()
    after = _row(ctx, job_id)
    assert after.updated_at == before.updated_at and not lease.lost.is_set()


def test_the_embedded_dispatcher_takes_a_stale_running_job_but_not_a_live_one(ctx):
    """A running job of a server that died is picked up once its heartbeat is stale; one
    that a live thread (of this or another server) holds is not."""
    job_id = _job(ctx)
    assert solve._claim(ctx, job_id) is not None
    dispatcher = EmbeddedDispatcher(ctx)
    assert dispatcher._take() is None
    _age_heartbeat(ctx, job_id)
    assert dispatcher._take() == job_id


def test_the_sweeper_takes_back_stale_jobs_and_resends_lost_messages(ctx):
    """Against a real Redis broker (no worker reads it): a running job without heartbeat
    is queued and sent again; a queued job whose message is gone is sent again, one whose
    message is in the queue is not; a stale job out of attempts fails with the reason."""
    settings = Settings(
        data_dir=ctx.settings.data_dir,
        database_url=ctx.db.url,
        broker_url=redis_url(13),
        max_attempts=2,
        **{k: float(v) for k, v in FAST.items()},
    )
    broker = CeleryDispatcher(settings)
    sweeper = Sweeper(settings, ctx.db, broker)
    stale, spent, lost, waiting = (_job(ctx) for _ in range(4))
    for job_id in (stale, spent):
        assert solve._claim(ctx, job_id) is not None
    _age_heartbeat(ctx, spent)
    assert solve._claim(ctx, spent) is not None  # its second attempt
    broker.enqueue(waiting)
    for job_id in (stale, spent, lost, waiting):
        _age_heartbeat(ctx, job_id)
    swept = sweeper.sweep()
    assert swept.requeued == [stale] and swept.given_up == [spent] and swept.resent == [lost]
    assert {stale, lost, waiting} <= broker.pending()
    assert _row(ctx, stale).status == JobStatus.QUEUED and _row(ctx, stale).attempts == 1
    assert _row(ctx, spent).status == JobStatus.FAILED
    assert "gave up after 2 attempts" in (_row(ctx, spent).error or "")
    again = sweeper.sweep()  # nothing more to do: the sent messages are in the queue
    assert again.requeued == again.given_up == again.resent == []
    broker.celery.close()


def _age_heartbeat(ctx: WorkerContext, job_id: str) -> None:
    """As if the job's holder (or the API that sent it) went quiet a minute ago."""
    with ctx.db.session() as session:
        session.execute(
            update(JobRow)
            .where(JobRow.id == job_id)
            .values(heartbeat_at=now() - timedelta(minutes=1))
        )


# --- real processes: a worker killed mid-solve, a Redis restart -------------------------


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    with postgres_database() as url:
        upgrade(url)
        yield url


def _plan_count(database: str, job_id: str) -> int:
    with psycopg.connect(database.replace("+psycopg", "")) as db:
        return db.execute("SELECT count(*) FROM plans WHERE job_id = %s", (job_id,)).fetchone()[0]


def test_a_job_whose_worker_was_killed_completes_once_another_worker_runs(database, tmp_path):
    """SIGKILL the worker mid-solve: the visibility timeout (7200 s) would hold the job's
    message for two hours; the sweeper sends it again as soon as its heartbeat is stale,
    and the next worker completes it, with one plan."""
    env = service_env(
        database_url=database,
        broker_url=redis_url(12),
        data_dir=str(tmp_path / "data"),
        **FAST,
    )
    processes: list[Process] = []
    try:
        server, url = api_server(env, tmp_path / "api.log")
        processes.append(server)
        victim = celery_worker(env, tmp_path / "victim.log")
        processes.append(victim)
        with httpx.Client(base_url=url, timeout=60) as client:
            model = upload(client, sample_bytes("resnet18"), "resnet18.onnx").json()
            body = job_body(model["id"], solver={"backend": "highs", "time_limit_s": 3})
            job = client.post("/v1/jobs", json=body).json()
            wait_job(client, job["id"], {"running"})
            victim.kill(signal.SIGKILL)
            processes.append(celery_worker(env, tmp_path / "worker.log"))
            done = wait_job(client, job["id"])
        assert done["status"] == "succeeded", done
        assert done["attempts"] == 2
        assert _plan_count(database, job["id"]) == 1
    finally:
        for process in processes:
            process.stop()


class RedisServer:
    """A Redis server of this test's own on a free port, without persistence: what a
    restart loses is lost."""

    def __init__(self, log: Path) -> None:
        self.port, self.log = free_port(), log
        self.start()

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        self.process = Process(args, service_env(), self.log)
        client = redis.Redis(port=self.port)
        wait(lambda: _answers(client), 30, "redis-server")

    def kill(self) -> None:
        self.process.kill(signal.SIGKILL)
        self.process.stop()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def test_queued_jobs_survive_a_redis_restart(database, tmp_path):
    """Jobs queued while no worker runs; Redis restarts and loses their messages; once a
    worker starts, every job completes, each with one plan."""
    broker = RedisServer(tmp_path / "redis.log")
    env = service_env(
        database_url=database,
        broker_url=broker.url,
        data_dir=str(tmp_path / "data"),
        **FAST,
    )
    processes: list[Process] = []
    try:
        server, url = api_server(env, tmp_path / "api.log")
        processes.append(server)
        with httpx.Client(base_url=url, timeout=60) as client:
            model = upload(client, sample_bytes("chain"), "chain.onnx").json()
            body = job_body(model["id"], strategy="chen_sqrt", batch=2, budgets={"cpu0": "90%"})
            ids = [client.post("/v1/jobs", json=body).json()["id"] for _ in range(6)]
            assert redis.Redis(port=broker.port).llen("celery") == len(ids)
            broker.kill()
            broker.start()
            assert redis.Redis(port=broker.port).llen("celery") == 0  # the messages are gone
            processes.append(celery_worker(env, tmp_path / "worker.log"))
            done = [wait_job(client, job_id) for job_id in ids]
        assert [j["status"] for j in done] == ["succeeded"] * len(ids), done
        assert [j["attempts"] for j in done] == [1] * len(ids)
        assert [_plan_count(database, job_id) for job_id in ids] == [1] * len(ids)
    finally:
        for process in processes:
            process.stop()
        broker.kill()
