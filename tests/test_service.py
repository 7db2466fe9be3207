"""The service against real parts: a PostgreSQL database made for this module, Redis as
the Celery broker, Celery worker processes and the API under uvicorn, all talking over
real connections (``tests/service.py`` starts them)."""

from __future__ import annotations

import signal
from typing import Any

import httpx
import psycopg
import pytest
import sqlalchemy
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from service import (
    api_server,
    celery_worker,
    job_body,
    postgres_database,
    redis_url,
    sample_bytes,
    service_env,
    upload,
    wait,
    wait_job,
)

from app.migrate import downgrade, upgrade
from app.tables import Base
from remat import samples
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.onnx_ingest import forward_graph, load_model
from remat.plan import plan_from_json
from remat.simulator import simulate
from remat.training import training_graph

UPLOAD_LIMIT = 3_000_000  # bytes: the U-Net sample (1.96 MB) fits, 3 MB of junk does not


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """PostgreSQL (migrated), a worker, the API; and a second API on a queue no worker
    reads (its jobs stay queued)."""
    logs = tmp_path_factory.mktemp("logs")
    data = tmp_path_factory.mktemp("data")
    with postgres_database() as database:
        upgrade(database)
        env = service_env(
            database_url=database,
            broker_url=redis_url(5),
            data_dir=str(data),
            max_upload_bytes=str(UPLOAD_LIMIT),
            broker_visibility_timeout_s="5",
            progress_interval_s="0.2",
            job_heartbeat_s="0.5",  # a killed worker's job is taken back within seconds
            job_stale_s="3",
        )
        idle_env = dict(env, REMAT_BROKER_URL=redis_url(6))
        worker = celery_worker(env, logs / "worker.log")
        server, url = api_server(env, logs / "api.log")
        idle, idle_url = api_server(idle_env, logs / "idle-api.log")
        stack = {"env": env, "url": url, "idle_url": idle_url, "worker": worker}
        stack |= {"database": database, "data": data, "logs": logs}
        try:
            yield stack
        finally:
            for process in (idle, server, stack["worker"]):
                process.stop()


@pytest.fixture(scope="module")
def server(stack):
    """The server conftest's ``client`` talks to."""
    return stack


@pytest.fixture(scope="module")
def unet_id(stack):
    with httpx.Client(base_url=stack["url"], timeout=60) as c:
        response = upload(c, sample_bytes("unet"), "unet.onnx")
        assert response.status_code in (200, 201), response.text
        return response.json()["id"]


def _problem_json(response: httpx.Response) -> dict:
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["status"] == response.status_code and body["detail"]
    return body


def test_a_job_end_to_end_gives_a_plan_the_simulator_accepts(client, unet_id):
    response = client.post("/v1/jobs", json=job_body(unet_id, strategy="checkmate_milp"))
    assert response.status_code == 202, response.text
    job = response.json()
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    done = wait_job(client, job["id"])
    assert done["status"] == "succeeded", done
    assert done["attempts"] == 1 and done["progress"]["incumbent_ms"] > 0
    document = client.get(f"/v1/jobs/{job['id']}/plan").json()
    plan = plan_from_json(document)
    graph = training_graph(forward_graph(load_model(sample_bytes("unet")), batch=4))
    costs = analytical_costs(graph, [Device("cpu0", DeviceKind.CPU)])
    simulation = simulate(plan, graph, costs, plan.budgets)
    assert simulation.valid
    assert simulation.total_ms == pytest.approx(done["progress"]["incumbent_ms"])
    schedule = client.get(f"/v1/jobs/{job['id']}/schedule").json()
    computes = sum(1 for s in document["steps"] if s["op"] == "compute")
    assert sum(len(cells) for cells in schedule["R"].values()) == computes
    assert schedule["peak_bytes"] == simulation.peak_bytes
    assert max(schedule["memory"]["cpu0"]) == simulation.peak_bytes["cpu0"]
    assert schedule["budgets"]["cpu0"] >= simulation.peak_bytes["cpu0"]
    _check_history_and_baselines(client, done, costs.ideal_ms())


def _check_history_and_baselines(client: httpx.Client, done: dict, ideal_ms: float) -> None:
    """The progress history ends at the final result; the baselines ran on the same
    inputs and the optimal plan is no worse than any of them."""
    points = client.get(f"/v1/jobs/{done['id']}/progress").json()["points"]
    assert points, "a solved job has a progress history"
    assert [p["elapsed_s"] for p in points] == sorted(p["elapsed_s"] for p in points)
    assert points[-1]["incumbent_ms"] == pytest.approx(done["progress"]["incumbent_ms"])
    assert points[-1]["bound_ms"] == pytest.approx(done["progress"]["bound_ms"])
    compared = client.get(f"/v1/jobs/{done['id']}/baselines").json()
    assert compared["ideal_ms"] == pytest.approx(ideal_ms)
    assert {b["strategy"] for b in compared["items"]} >= {"checkpoint_all", "chen_sqrt"}
    feasible = [b for b in compared["items"] if b["predicted_ms"] is not None]
    assert feasible and all(b["valid"] for b in feasible)
    best = min(b["predicted_ms"] for b in feasible)
    assert ideal_ms <= done["progress"]["incumbent_ms"] <= best * (1 + 1e-9)


def test_get_job_has_an_etag_and_if_none_match_gives_304(client, unet_id):
    job = client.post("/v1/jobs", json=job_body(unet_id, strategy="auto")).json()
    wait_job(client, job["id"])
    first = client.get(f"/v1/jobs/{job['id']}")
    etag = first.headers["etag"]
    again = client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    other = client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": '"other"'})
    assert other.status_code == 200 and other.json() == first.json()
    weak = client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": f'"x", W/{etag}'})
    star = client.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": "*"})
    assert weak.status_code == 304 and star.status_code == 304


def test_a_jobs_etag_changes_when_the_job_does(stack, unet_id):
    with httpx.Client(base_url=stack["idle_url"], timeout=60) as idle:  # no worker: queued
        job = idle.post("/v1/jobs", json=job_body(unet_id)).json()
        before = idle.get(f"/v1/jobs/{job['id']}").headers["etag"]
        idle.post(f"/v1/jobs/{job['id']}/cancel")
        after = idle.get(f"/v1/jobs/{job['id']}", headers={"If-None-Match": before})
    assert after.status_code == 200 and after.json()["status"] == "cancelled"
    assert after.headers["etag"] != before


def test_the_job_list_has_an_etag_that_changes_with_its_jobs(stack, unet_id):
    with httpx.Client(base_url=stack["idle_url"], timeout=60) as idle:  # no worker: queued
        queued = {"status": "queued"}
        first = idle.get("/v1/jobs", params=queued)
        etag = first.headers["etag"]
        unchanged = idle.get("/v1/jobs", params=queued, headers={"If-None-Match": etag})
        assert unchanged.status_code == 304 and unchanged.content == b""
        job = idle.post("/v1/jobs", json=job_body(unet_id)).json()
        added = idle.get("/v1/jobs", params=queued, headers={"If-None-Match": etag})
        assert added.status_code == 200 and added.json()["items"][0]["id"] == job["id"]
        idle.post(f"/v1/jobs/{job['id']}/cancel")
        gone = idle.get("/v1/jobs", params=queued, headers={"If-None-Match": added.headers["etag"]})
        assert gone.status_code == 200
        assert job["id"] not in {j["id"] for j in gone.json()["items"]}


def test_server_sent_events_end_with_the_final_status(client, unet_id):
    job = client.post("/v1/jobs", json=job_body(unet_id, strategy="auto")).json()
    events = []
    with client.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("event:"):
                events.append(line.split(":", 1)[1].strip())
    assert events[0] == "progress" and events[-1] == "end"
    assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "succeeded"


def test_cancel_a_queued_job(stack, unet_id):
    with httpx.Client(base_url=stack["idle_url"], timeout=60) as idle:
        job = idle.post("/v1/jobs", json=job_body(unet_id)).json()
        assert idle.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"
        cancelled = idle.post(f"/v1/jobs/{job['id']}/cancel").json()
        assert cancelled["status"] == "cancelled"
        assert idle.get(f"/v1/jobs/{job['id']}/plan").status_code == 404


def test_cancel_a_running_job_stops_its_solve(client, stack):
    model = upload(client, sample_bytes("resnet18"), "resnet18.onnx").json()
    body = job_body(
        model["id"],
        strategy="xengine",
        budgets={"cpu0": "25%", "cuda0": "25%"},
        devices=[
            {"name": "cpu0", "kind": "cpu", "options": {"threads": "12"}},
            {"name": "cuda0", "kind": "cuda", "options": {"flops": "2e12"}},
        ],
        solver={"backend": "highs", "time_limit_s": 300},
    )
    job = client.post("/v1/jobs", json=body).json()
    wait_job(client, job["id"], {"running"})
    wait(
        lambda: client.get(f"/v1/jobs/{job['id']}").json()["progress"]["incumbent_ms"] is not None,
        60,
        "progress",
    )
    history = client.get(f"/v1/jobs/{job['id']}/progress").json()["points"]
    assert history and history[-1]["incumbent_ms"] is not None  # live, while it runs
    assert client.get(f"/v1/jobs/{job['id']}/baselines").status_code == 404  # no plan yet
    flagged = client.post(f"/v1/jobs/{job['id']}/cancel").json()
    assert flagged["cancel_requested"]
    done = wait_job(client, job["id"])
    assert done["status"] == "cancelled"
    assert done["progress"]["elapsed_s"] < 300  # stopped long before its time limit
    # the worker survived: it still solves
    model_id = upload(client, sample_bytes("chain"), "chain.onnx").json()["id"]
    after = client.post("/v1/jobs", json=job_body(model_id, batch=2)).json()
    assert wait_job(client, after["id"])["status"] == "succeeded"


def test_a_worker_killed_mid_solve_is_redelivered_and_the_job_completes_once(client, stack):
    """Late acks: the message of a job whose worker died goes back to the queue after the
    broker's visibility timeout (5 s here) and another worker completes it, once."""
    stack["worker"].kill(signal.SIGKILL)  # the module's worker: this test brings its own
    victim = celery_worker(stack["env"], stack["logs"] / "victim.log")
    stack["worker"] = victim  # stopped by the fixture if this test fails before the kill
    model = upload(client, sample_bytes("resnet18"), "resnet18.onnx").json()
    # At 60% a baseline fits at once: on a loaded machine 3 s may end before any heuristic
    # or solve finds a plan at a tighter budget, and this test is about redelivery.
    body = job_body(
        model["id"],
        strategy="checkmate_milp",
        budgets={"cpu0": "60%"},
        solver={"backend": "highs", "time_limit_s": 3},
    )
    job = client.post("/v1/jobs", json=body).json()
    wait_job(client, job["id"], {"running"})
    victim.kill(signal.SIGKILL)
    stack["worker"] = celery_worker(stack["env"], stack["logs"] / "worker2.log")
    done = wait_job(client, job["id"])
    assert done["status"] == "succeeded", done
    assert done["attempts"] == 2
    with psycopg.connect(stack["database"].replace("+psycopg", "")) as db:
        plans = db.execute("SELECT count(*) FROM plans WHERE job_id = %s", (job["id"],))
        assert plans.fetchone()[0] == 1


def test_idempotency_key(client, unet_id):
    body = job_body(unet_id, strategy="auto")
    key = {"Idempotency-Key": "test-idempotency-1"}
    first = client.post("/v1/jobs", json=body, headers=key)
    second = client.post("/v1/jobs", json=body, headers=key)
    assert first.status_code == second.status_code == 202
    assert first.json()["id"] == second.json()["id"]
    other = client.post("/v1/jobs", json=dict(body, strategy="checkpoint_all"), headers=key)
    assert other.status_code == 422
    assert "Idempotency-Key" in _problem_json(other)["detail"]


def test_pagination_of_models_and_jobs(client):
    ids = [upload(client, samples.chain(n=n).SerializeToString()).json()["id"] for n in (3, 4, 5)]
    seen, cursor = [], None
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/models", params=params).json()
        assert len(page["items"]) <= 2
        seen += [m["id"] for m in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) and set(ids) <= set(seen)
    for model_id in ids:
        body = job_body(model_id, strategy="auto", batch=2, budgets={})
        assert client.post("/v1/jobs", json=body).status_code == 202
    jobs = client.get("/v1/jobs", params={"model_id": ids[0]}).json()["items"]
    assert len(jobs) == 1 and jobs[0]["model_id"] == ids[0]
    assert wait_job(client, jobs[0]["id"])["status"] == "succeeded"
    succeeded = client.get("/v1/jobs", params={"status": "succeeded", "limit": 200}).json()
    assert all(j["status"] == "succeeded" for j in succeeded["items"])
    assert jobs[0]["id"] in {j["id"] for j in succeeded["items"]}
    bad = client.get("/v1/jobs", params={"cursor": "not-a-cursor"})
    assert bad.status_code == 422 and _problem_json(bad)


def test_the_same_bytes_give_the_same_model(client, unet_id):
    again = upload(client, sample_bytes("unet"), "renamed.onnx")
    assert again.status_code == 200 and again.json()["id"] == unet_id


@pytest.mark.parametrize(
    ("content", "status", "words"),
    [
        (b"this is not onnx at all", 422, "not a usable ONNX model"),
        (samples.truncated_bytes(), 422, "not a usable ONNX model"),
        (b"\0" * (UPLOAD_LIMIT + 1), 413, "exceeds the limit"),
    ],
    ids=["not-onnx", "truncated", "over-the-limit"],
)
def test_bad_uploads_are_refused_and_store_nothing(client, stack, content, status, words):
    before = client.get("/v1/models", params={"limit": 200}).json()["items"]
    files_before = sorted(p.name for p in (stack["data"] / "models").rglob("*"))
    response = upload(client, content)
    assert response.status_code == status
    assert words in _problem_json(response)["detail"]
    assert client.get("/v1/models", params={"limit": 200}).json()["items"] == before
    assert sorted(p.name for p in (stack["data"] / "models").rglob("*")) == files_before


def test_an_upload_that_is_not_multipart_is_refused(client):
    response = client.post(
        "/v1/models",
        content=sample_bytes("chain"),
        headers={"content-type": "application/octet-stream"},
    )
    assert response.status_code == 415
    assert "multipart/form-data" in _problem_json(response)["detail"]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"budgets": {"gpu9": "50%"}}, "unknown device 'gpu9'"),
        ({"budgets": {"cpu0": "1KiB"}}, "no plan can fit, even paging"),
        ({"model_id": "0" * 32}, "does not exist"),
        ({"strategy": "magic"}, "unknown strategy"),
        ({"devices": [{"name": "cpu0", "kind": "tpu"}]}, "devices.0.kind"),
        ({"solver": {"backend": "highs", "time_limit_s": -1}}, "time_limit_s"),
        ({"costs": {"node_id": "0" * 32}}, "costs.node_id"),
        ({"costs": {"profile_id": "0" * 32}}, "costs.profile_id"),
    ],
    ids=[
        "unknown-device",
        "budget-too-small",
        "unknown-model",
        "strategy",
        "kind",
        "limit",
        "unknown-node",
        "unknown-profile",
    ],
)
def test_bad_job_specs_get_clear_errors(client, unet_id, change, words):
    response = client.post("/v1/jobs", json=job_body(unet_id) | change)
    assert response.status_code == 422
    assert words in _problem_json(response)["detail"]


def test_a_model_in_use_cannot_be_deleted_and_an_unused_one_can(client, unet_id):
    refused = client.delete(f"/v1/models/{unet_id}")
    assert refused.status_code == 409 and _problem_json(refused)
    unused = upload(client, samples.chain(n=7).SerializeToString()).json()["id"]
    assert client.delete(f"/v1/models/{unused}").status_code == 204
    assert client.get(f"/v1/models/{unused}").status_code == 404


def test_graph_and_health(client, unet_id):
    graph = client.get(f"/v1/models/{unet_id}/graph", params={"batch": 2}).json()
    assert graph["mode"] == "training" and len(graph["nodes"]) > 0
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}
    assert client.get("/docs").status_code == 200


def test_migrations_go_up_and_down():
    with postgres_database() as database:
        upgrade(database)
        with psycopg.connect(database.replace("+psycopg", "")) as db:
            tables = {
                r[0]
                for r in db.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            }
        assert {
            "models",
            "jobs",
            "plans",
            "job_progress",
            "profiles",
            "nodes",
            "agent_tasks",
        } <= tables
        assert _schema_drift(database) == []
        downgrade(database)
        with psycopg.connect(database.replace("+psycopg", "")) as db:
            left = {
                r[0]
                for r in db.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
            }
        assert left <= {"alembic_version"}
        upgrade(database)  # and up again


def test_jobs_stored_before_attention_was_fused_stay_unfused():
    """A spec stored without ``fuse_attention`` (before the field) meant unfused; once
    fusing is the default, migration 0006 writes that down, and leaves other specs alone."""
    with postgres_database() as database:
        upgrade(database, "0005")
        with psycopg.connect(database.replace("+psycopg", "")) as db:
            stored = {
                "old": '{"model_id": "m1"}',
                "fused": '{"model_id": "m1", "fuse_attention": true}',
            }
            _stored_jobs(db, stored)
        upgrade(database)
        with psycopg.connect(database.replace("+psycopg", "")) as db:
            specs = dict(db.execute("SELECT id, spec FROM jobs").fetchall())
    assert specs == {
        "old": {"model_id": "m1", "fuse_attention": False},
        "fused": {"model_id": "m1", "fuse_attention": True},
    }


def test_plans_stored_before_the_graph_digest_column_get_it_from_their_document():
    """Migration 0007 fills ``plans.graph_digest`` from each stored plan's ``graph`` record,
    so later jobs start from plans stored before it; a plan without one stays empty."""
    with postgres_database() as database:
        upgrade(database, "0006")
        with psycopg.connect(database.replace("+psycopg", "")) as db:
            documents = {
                "recorded": '{"steps": [], "graph": {"nodes": 3, "digest": "sha256:0123abcd"}}',
                "older": '{"steps": []}',
            }
            _stored_jobs(db, dict.fromkeys(documents, "{}"))
            for job_id, document in documents.items():
                db.execute(
                    "INSERT INTO plans (job_id, document, schedule, created_at) "
                    "VALUES (%s, %s, '{}', now())",
                    (job_id, document),
                )
        upgrade(database)
        with psycopg.connect(database.replace("+psycopg", "")) as db:
            digests = dict(db.execute("SELECT job_id, graph_digest FROM plans").fetchall())
    assert digests == {"recorded": "sha256:0123abcd", "older": None}


def _stored_jobs(db: psycopg.Connection[Any], specs: dict[str, str]) -> None:
    """Model ``m1`` and a succeeded job of it for each id of ``specs`` (its spec's JSON),
    written as an earlier version of Remat stored them."""
    db.execute(
        "INSERT INTO models (id, sha256, filename, size_bytes, summary, created_at) "
        "VALUES ('m1', 'f00', 'model.onnx', 1, '{}', now())"
    )
    for job_id, spec in specs.items():
        db.execute(
            "INSERT INTO jobs (id, model_id, spec, status, cancel_requested, attempts, "
            "created_at, updated_at) VALUES (%s, 'm1', %s, 'succeeded', false, 1, now(), now())",
            (job_id, spec),
        )


def _schema_drift(database: str) -> list[object]:
    """What ``alembic revision --autogenerate`` would write: the migrations' schema
    against ``app/tables.py``."""
    engine = sqlalchemy.create_engine(database)
    try:
        with engine.connect() as connection:
            return compare_metadata(MigrationContext.configure(connection), Base.metadata)
    finally:
        engine.dispose()
