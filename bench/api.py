"""The API under polling load: latency of ``GET /v1/jobs/{id}`` while clients poll jobs
and submit new ones, on loopback.

What clients of the service do most is poll their jobs. This benchmark uploads a small
sample model, submits a few jobs with a fast heuristic strategy, waits for them to finish,
then runs two scenarios of ``--duration`` seconds each:

- ``GET``: ``--pollers`` concurrent pollers at an aggregate ``--rate`` of plain GETs;
- ``GET If-None-Match``: the same, each poller sending the ``ETag`` of its first GET
  (the job has not changed, so the answer is ``304 Not Modified`` without a body);

with ``--submit-rate`` job submissions a second alongside each (their jobs are solved by
the server meanwhile, as in real use). The load is open-loop: each poller sends on a fixed
schedule and skips the slots it missed, so an overloaded server shows as an achieved rate
below the target. Latency is from sending a request to reading its whole response.

Target: polling p99 under 50 ms at 200 requests/s, and 304s cheaper than full GETs.

By default the benchmark starts its own server (``remat serve`` in embedded mode: SQLite
and the in-process dispatcher, under a temporary data directory); ``--server URL`` uses a
running one instead.

``--drain N`` adds a run in the production shape (the API under uvicorn, PostgreSQL,
Redis, Celery workers, all started here): N jobs are submitted while no worker runs, then
``--workers`` Celery workers (2 threads each) start, and the pollers poll the queued jobs
at ``--rate`` until every job has finished. It reports the drain time (from starting the
workers, and from the first job's start to the last one's end), the jobs' outcomes and
plans (one each), and the latency of the API during the drain. It needs PostgreSQL
(``--postgres``, an admin connection; a new database is made and dropped) and Redis
(``--broker``, a database it empties first). ``--no-polling`` runs only the drain.

Each run prints a markdown table and appends its rows to ``bench/results/api.csv``
(``bench/results.py``; ``bench/report.py`` renders them).

    .venv/bin/python bench/api.py [--server URL] [--duration 10] [--rate 200]
        [--submit-rate 2] [--pollers 8] [--jobs 4] [--sample chain] [--batch 8]
        [--budget 75%] [--api-key KEY] [--drain 200] [--workers 2] [--no-polling]
        [--postgres DSN] [--broker redis://127.0.0.1:6379/14] [--run LABEL]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis
from results import Writer, add_run_argument

from remat import samples

TARGET_P99_MS = 50.0
READY_TIMEOUT_S = 60.0
FINISH_TIMEOUT_S = 60.0
FINISHED = ("succeeded", "failed", "cancelled")
ROOT = Path(__file__).resolve().parents[1]
DRAIN_TIMEOUT_S = 600.0
DRAIN_SERVER = "uvicorn+postgresql+redis+celery"  # the drain run's stack, in the results


@dataclass
class Stats:
    """What one scenario measured: a latency per request and the status codes seen."""

    name: str
    expected: frozenset[int]
    latencies_ms: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    errors: int = 0
    seconds: float = 0.0

    def record(self, started: float, status: int | None) -> None:
        self.latencies_ms.append((time.perf_counter() - started) * 1000)
        self.statuses[str(status) if status is not None else "exception"] += 1
        if status not in self.expected:
            self.errors += 1

    @property
    def requests(self) -> int:
        return len(self.latencies_ms)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# --- the server -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def remat_command() -> str:
    """The ``remat`` script of this interpreter's environment (``.venv/bin/remat``)."""
    beside = Path(sys.executable).parent / "remat"
    found = str(beside) if beside.exists() else shutil.which("remat")
    if found is None:
        raise SystemExit("cannot find the remat command; install the project first")
    return found


@contextmanager
def embedded_server() -> Iterator[str]:
    """``remat serve`` on a free loopback port with a temporary data directory (SQLite,
    embedded dispatcher); yields its URL once ``/readyz`` answers."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="remat-bench-") as data_dir:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REMAT_")}
        env["REMAT_DATA_DIR"] = data_dir
        log_path = Path(data_dir) / "server.log"
        command = [remat_command(), "serve", "--host", "127.0.0.1", "--port", str(port)]
        with log_path.open("wb") as log:
            server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, server, log_path)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def wait_ready(url: str, server: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}):\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server was not ready in {READY_TIMEOUT_S:g} s:\n{log_path.read_text()}")


# --- setup ------------------------------------------------------------------------------


def job_body(model_id: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model_id": model_id,
        "batch": args.batch,
        "devices": [{"name": "cpu0", "kind": "cpu"}],
        "budgets": {"cpu0": args.budget},
        "strategy": "chen_sqrt",
    }


def expect(response: httpx.Response, *codes: int) -> dict[str, Any]:
    if response.status_code not in codes:
        raise SystemExit(
            f"{response.request.method} {response.request.url.path}: "
            f"{response.status_code} {response.text}"
        )
    return response.json()  # type: ignore[no-any-return]


def upload_model(client: httpx.Client, sample: str) -> str:
    data = samples.ZOO[sample]().SerializeToString()
    files = {"file": (f"{sample}.onnx", data, "application/octet-stream")}
    return str(expect(client.post("/v1/models", files=files), 200, 201)["id"])


def submit_jobs(client: httpx.Client, model_id: str, args: argparse.Namespace) -> list[str]:
    body = job_body(model_id, args)
    return [str(expect(client.post("/v1/jobs", json=body), 202)["id"]) for _ in range(args.jobs)]


def wait_finished(client: httpx.Client, job_ids: list[str]) -> dict[str, str]:
    """Each job's final status (the ETag scenario needs jobs that no longer change)."""
    deadline = time.monotonic() + FINISH_TIMEOUT_S
    statuses: dict[str, str] = {}
    while time.monotonic() < deadline:
        statuses = {j: expect(client.get(f"/v1/jobs/{j}"), 200)["status"] for j in job_ids}
        if all(s in FINISHED for s in statuses.values()):
            return statuses
        time.sleep(0.2)
    raise SystemExit(f"jobs not finished after {FINISH_TIMEOUT_S:g} s: {statuses}")


# --- load -------------------------------------------------------------------------------

Request = Callable[[], Awaitable[httpx.Response]]


async def paced(
    request: Request,
    stats: Stats,
    interval: float,
    offset: float,
    end: float,
    stop: asyncio.Event | None = None,
) -> None:
    """Send ``request`` every ``interval`` seconds from ``offset`` until ``end`` (perf_counter
    times) or ``stop``, one at a time; slots missed while a request was in flight are
    skipped."""
    slot = time.perf_counter() + offset
    while slot < end and not (stop is not None and stop.is_set()):
        delay = slot - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        started = time.perf_counter()
        try:
            status: int | None = (await request()).status_code
        except httpx.HTTPError:
            status = None
        stats.record(started, status)
        slot += interval
        if slot < time.perf_counter():
            slot += math.ceil((time.perf_counter() - slot) / interval) * interval


async def etag_of(client: httpx.AsyncClient, job_id: str) -> str:
    response = await client.get(f"/v1/jobs/{job_id}")
    response.raise_for_status()
    return response.headers["ETag"]


def poll_request(client: httpx.AsyncClient, job_id: str, etag: str | None) -> Request:
    """A GET of one job, with ``If-None-Match: etag`` unless ``etag`` is None."""
    path = f"/v1/jobs/{job_id}"
    headers = {"If-None-Match": etag} if etag is not None else {}
    return lambda: client.get(path, headers=headers)


def submit_request(client: httpx.AsyncClient, body: dict[str, Any]) -> Request:
    return lambda: client.post("/v1/jobs", json=body)


async def polling(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    job_ids: list[str],
    model_id: str,
    conditional: bool,
) -> list[Stats]:
    """One scenario: ``args.pollers`` pollers, each on one of ``job_ids``, at ``args.rate``
    requests/s in all, and a submitter at ``args.submit_rate``, for ``args.duration`` s."""
    if conditional:  # a 200 too: the job changed since its first GET
        poll = Stats("GET If-None-Match", frozenset({200, 304}))
    else:
        poll = Stats("GET", frozenset({200}))
    submit = Stats(f"POST (during {poll.name})", frozenset({202}))
    requests = []
    for i in range(args.pollers):
        job_id = job_ids[i % len(job_ids)]
        etag = await etag_of(client, job_id) if conditional else None
        requests.append(poll_request(client, job_id, etag))
    interval = args.pollers / args.rate
    started = time.perf_counter()
    end = started + args.duration
    tasks = [
        paced(request, poll, interval, interval * i / args.pollers, end)
        for i, request in enumerate(requests)
    ]
    if args.submit_rate > 0:
        submitting = submit_request(client, job_body(model_id, args))
        tasks.append(paced(submitting, submit, 1 / args.submit_rate, 0.0, end))
    await asyncio.gather(*tasks)
    poll.seconds = submit.seconds = time.perf_counter() - started
    return [poll, submit] if args.submit_rate > 0 else [poll]


async def run_load(
    url: str, args: argparse.Namespace, job_ids: list[str], model_id: str
) -> list[Stats]:
    limits = httpx.Limits(
        max_connections=args.pollers + 2, max_keepalive_connections=args.pollers + 2
    )
    async with httpx.AsyncClient(
        base_url=url, headers=auth(args), limits=limits, timeout=30
    ) as client:
        plain = await polling(client, args, job_ids, model_id, conditional=False)
        return plain + await polling(client, args, job_ids, model_id, conditional=True)


# --- the drain: queued jobs, then workers (production shape) ----------------------------


@dataclass
class Drain:
    """What the drain run measured."""

    jobs: int
    workers: int
    submit: Stats
    poll: Stats
    seconds: float = 0.0  # from starting the workers until every job finished
    busy_s: float = 0.0  # from the first job's start to the last one's end (database times)
    statuses: Counter[str] = field(default_factory=Counter)
    attempts: Counter[int] = field(default_factory=Counter)
    plans: int = 0


class Service:
    """A subprocess of the production stack (the API or a Celery worker), its output in a
    log file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        with log.open("wb") as out:
            self.popen = subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@contextmanager
def postgres_database(admin: str) -> Iterator[str]:
    """A new database on the server ``admin`` connects to; its SQLAlchemy URL; dropped."""
    name = f"remat_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')
        info = connection.info
        url = f"postgresql+psycopg://{info.user}@{info.host}:{info.port}/{name}"
    try:
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def production_api(args: argparse.Namespace) -> Iterator[tuple[str, dict[str, str], Path]]:
    """The API under uvicorn on a new PostgreSQL database (migrated) and an emptied Redis
    database, no worker yet; its URL, the environment for workers, and the log folder."""
    from app.migrate import upgrade

    redis.Redis.from_url(args.broker).flushdb()
    with (
        postgres_database(args.postgres) as database,
        tempfile.TemporaryDirectory(prefix="remat-bench-") as data_dir,
    ):
        upgrade(database)
        env = {k: v for k, v in os.environ.items() if not k.startswith("REMAT_")}
        env |= {"REMAT_DATABASE_URL": database, "REMAT_BROKER_URL": args.broker}
        env["REMAT_DATA_DIR"] = data_dir
        port = free_port()
        uvicorn = str(Path(sys.executable).parent / "uvicorn")
        command = [uvicorn, "--factory", "app.main:create_app", "--port", str(port)]
        command += ["--log-level", "warning"]
        logs = Path(data_dir)
        server = Service(command, env, logs / "api.log")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, server.popen, server.log)
            yield url, env, logs
        finally:
            server.stop()


def start_workers(count: int, env: dict[str, str], logs: Path) -> list[Service]:
    celery = str(Path(sys.executable).parent / "celery")
    command = [celery, "-A", "workers.celery_app", "worker", "--pool", "threads"]
    command += ["--concurrency", "2", "--loglevel", "WARNING", "--without-gossip"]
    command += ["--without-mingle"]
    return [
        Service([*command, "-n", f"bench{i}@%h"], env, logs / f"worker{i}.log")
        for i in range(count)
    ]


def job_counts(database: str) -> dict[str, int]:
    with psycopg.connect(database.replace("+psycopg", "")) as connection:
        rows = connection.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall()
    return {status: count for status, count in rows}


async def drain_run(url: str, env: dict[str, str], logs: Path, args: argparse.Namespace) -> Drain:
    """Submit ``args.drain`` jobs with no worker, then start the workers and poll the jobs
    until all have finished."""
    database = env["REMAT_DATABASE_URL"]
    limits = httpx.Limits(max_connections=args.pollers + 2, max_keepalive_connections=args.pollers)
    async with httpx.AsyncClient(
        base_url=url, headers=auth(args), limits=limits, timeout=30
    ) as client:
        with httpx.Client(base_url=url, headers=auth(args), timeout=60) as sync:
            model_id = upload_model(sync, args.sample)
        drain = Drain(
            args.drain,
            args.workers,
            Stats(f"POST /v1/jobs ({args.drain} queued, no worker)", frozenset({202})),
            Stats(f"GET during the drain ({args.workers} workers)", frozenset({200})),
        )
        body = job_body(model_id, args)
        job_ids = []
        for _ in range(args.drain):
            started = time.perf_counter()
            response = await client.post("/v1/jobs", json=body)
            drain.submit.record(started, response.status_code)
            job_ids.append(response.json()["id"])
        drain.submit.seconds = sum(drain.submit.latencies_ms) / 1000
        assert job_counts(database) == {"queued": args.drain}, job_counts(database)
        stop = asyncio.Event()
        interval = args.pollers / args.rate
        rng = random.Random(0)
        pollers = [
            paced(
                poll_request(client, rng.choice(job_ids), None),
                drain.poll,
                interval,
                interval * i / args.pollers,
                math.inf,
                stop,
            )
            for i in range(args.pollers)
        ]
        started = time.perf_counter()
        workers = start_workers(args.workers, env, logs)
        try:
            polling = asyncio.gather(*pollers)
            while True:  # the database read off the event loop: it must not delay the polls
                counts = await asyncio.to_thread(job_counts, database)
                if sum(counts.get(s, 0) for s in FINISHED) == args.drain:
                    break
                if time.perf_counter() - started > DRAIN_TIMEOUT_S:
                    raise SystemExit(f"not drained in {DRAIN_TIMEOUT_S:g} s: {counts}")
                await asyncio.sleep(0.1)
            drain.seconds = time.perf_counter() - started
            stop.set()
            await polling
            drain.poll.seconds = drain.seconds
        finally:
            for worker in workers:
                worker.stop()
    with psycopg.connect(database.replace("+psycopg", "")) as connection:
        rows = connection.execute("SELECT status, attempts FROM jobs").fetchall()
        first, last = connection.execute(
            "SELECT min(started_at), max(finished_at) FROM jobs"
        ).fetchall()[0]
        plans, planned = connection.execute(
            "SELECT count(*), count(DISTINCT job_id) FROM plans"
        ).fetchall()[0]
    drain.statuses = Counter(status for status, _ in rows)
    drain.attempts = Counter(attempts for _, attempts in rows)
    drain.busy_s = (last - first).total_seconds()
    if plans != planned:
        raise SystemExit(f"{plans} plans for {planned} jobs: a job was planned twice")
    drain.plans = plans
    return drain


def drain_table(drain: Drain) -> str:
    lines = [
        "| jobs | workers (x2 threads) | drain s | jobs/s | first start to last end s "
        "| outcomes | attempts | plans |",
        "|---:|---:|---:|---:|---:|---|---|---:|",
        f"| {drain.jobs} | {drain.workers} | {drain.seconds:.1f} "
        f"| {drain.jobs / drain.seconds:.1f} | {drain.busy_s:.1f} "
        f"| {_counts(drain.statuses)} | {_counts(drain.attempts)} | {drain.plans} |",
    ]
    return "\n".join(lines)


def _counts(counter: Counter[Any]) -> str:
    return ", ".join(f"{key}×{n}" for key, n in sorted(counter.items()))


def write_results(
    url: str, results: list[Stats], drain: Drain | None, args: argparse.Namespace
) -> Path:
    """Append this run's rows to ``bench/results/api.csv`` (one per scenario; the drain's
    counts on its polling row)."""
    out = Writer("api", args.run)
    common = {"model": args.sample, "budget": args.budget, "devices": "cpu0"}
    rows = []
    drained = [(DRAIN_SERVER, s) for s in ([drain.submit, drain.poll] if drain else [])]
    for server, s in [(url, s) for s in results] + drained:
        rows.append(
            common
            | {
                "seconds": f"{s.seconds:.1f}",
                "server": server,
                "scenario": s.name,
                "requests": s.requests,
                "errors": s.errors,
                "achieved_rps": f"{s.requests / s.seconds:.1f}" if s.seconds else "",
                "p50_ms": f"{percentile(s.latencies_ms, 0.5):.1f}",
                "p99_ms": f"{percentile(s.latencies_ms, 0.99):.1f}",
            }
        )
    if drain is not None:
        row = {"jobs": drain.jobs, "workers": drain.workers, "drain_s": f"{drain.seconds:.1f}"}
        row["jobs_per_s"] = f"{drain.jobs / drain.seconds:.1f}"
        rows[-1] |= row
    out.add_all(rows)
    return out.path


# --- report -----------------------------------------------------------------------------


def table(results: list[Stats]) -> str:
    lines = [
        "| scenario | requests | errors | achieved req/s | p50 ms | p99 ms | status codes |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in results:
        codes = ", ".join(f"{code}×{n}" for code, n in sorted(s.statuses.items()))
        lines.append(
            f"| {s.name} | {s.requests} | {s.errors} | {s.requests / s.seconds:.1f} "
            f"| {percentile(s.latencies_ms, 0.5):.1f} | {percentile(s.latencies_ms, 0.99):.1f} "
            f"| {codes} |"
        )
    return "\n".join(lines)


def verdict(results: list[Stats], rate: float) -> str:
    polls = [s for s in results if s.name.startswith("GET")]
    worst = max(percentile(s.latencies_ms, 0.99) for s in polls)
    slowest = min(s.requests / s.seconds for s in polls)
    ok = worst < TARGET_P99_MS and slowest >= 0.95 * rate
    return (
        f"target: polling p99 < {TARGET_P99_MS:g} ms at {rate:g} req/s: "
        f"{'met' if ok else 'NOT met'} (worst p99 {worst:.1f} ms, lowest rate {slowest:.1f} req/s)"
    )


# --- main -------------------------------------------------------------------------------


def auth(args: argparse.Namespace) -> dict[str, str]:
    return {"X-API-Key": args.api_key} if args.api_key else {}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", help="a running server's URL (default: start one)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per scenario")
    parser.add_argument("--rate", type=float, default=200.0, help="polling requests/s in all")
    parser.add_argument("--submit-rate", type=float, default=2.0, help="job submissions/s")
    parser.add_argument("--pollers", type=int, default=8, help="concurrent pollers")
    parser.add_argument("--jobs", type=int, default=4, help="jobs submitted to be polled")
    parser.add_argument("--sample", default="chain", choices=sorted(samples.ZOO))
    parser.add_argument("--batch", type=int, default=8, help="the jobs' batch size")
    # chen_sqrt on the 9-node chain needs about 70% of the checkpoint-all peak
    parser.add_argument("--budget", default="75%", help="the jobs' budget on cpu0")
    parser.add_argument("--api-key", help="X-API-Key for a server that requires one")
    parser.add_argument("--drain", type=int, default=0, help="jobs queued before workers start")
    parser.add_argument("--workers", type=int, default=2, help="Celery workers for --drain")
    parser.add_argument("--no-polling", action="store_true", help="only the --drain run")
    parser.add_argument(
        "--postgres",
        default="host=127.0.0.1 port=5432 user=postgres dbname=postgres",
        help="admin connection for --drain's database",
    )
    parser.add_argument(
        "--broker", default="redis://127.0.0.1:6379/14", help="--drain's Redis (emptied)"
    )
    add_run_argument(parser)
    args = parser.parse_args()
    if args.duration <= 0 or args.rate <= 0 or args.pollers < 1 or args.jobs < 1:
        parser.error("--duration and --rate must be positive, --pollers and --jobs at least 1")
    if args.submit_rate < 0:
        parser.error("--submit-rate must not be negative")
    if args.drain < 0 or args.workers < 1:
        parser.error("--drain must not be negative, --workers at least 1")
    if args.no_polling and not args.drain:
        parser.error("--no-polling needs --drain")
    return args


def bench(url: str, args: argparse.Namespace) -> list[Stats]:
    with httpx.Client(base_url=url, headers=auth(args), timeout=60) as client:
        model_id = upload_model(client, args.sample)
        job_ids = submit_jobs(client, model_id, args)
        finished = wait_finished(client, job_ids)
    cpu, wall = time.process_time(), time.perf_counter()
    results = asyncio.run(run_load(url, args, job_ids, model_id))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(
        f"server {url}; {args.pollers} pollers at {args.rate:g} req/s in all and "
        f"{args.submit_rate:g} submissions/s, {args.duration:g} s per scenario; "
        f"polled jobs: {dict(Counter(finished.values()))}; "
        f"this client used {cpu / wall:.0%} of a CPU ({os.cpu_count()} CPUs)\n"
    )
    print(table(results))
    print()
    print(verdict(results, args.rate))
    return results


def bench_drain(args: argparse.Namespace) -> Drain:
    with production_api(args) as (url, env, logs):
        drain = asyncio.run(drain_run(url, env, logs, args))
    print(
        f"\ndrain: API under uvicorn ({url}), PostgreSQL, Redis {args.broker}; "
        f"{args.drain} {args.sample} jobs (chen_sqrt) queued with no worker, then "
        f"{args.workers} Celery workers of 2 threads; {args.pollers} pollers at "
        f"{args.rate:g} req/s on the queued jobs until all finished\n"
    )
    print(drain_table(drain))
    print()
    print(table([drain.submit, drain.poll]))
    return drain


def main() -> int:
    args = parse_args()
    results: list[Stats] = []
    url = args.server.rstrip("/") if args.server else "embedded (remat serve)"
    if not args.no_polling:
        if args.server:
            results = bench(url, args)
        else:
            with embedded_server() as embedded:
                results = bench(embedded, args)
    drain = bench_drain(args) if args.drain else None
    print(f"\nrows appended to {write_results(url, results, drain, args).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
