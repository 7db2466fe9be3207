"""The agent protocol's server side over real HTTP, on PostgreSQL (leases claimed with
``FOR UPDATE SKIP LOCKED``) and on SQLite: enrollment, heartbeats, node status, leases
that expire and are capped, stale and repeated reports, release, executions and the
checks on what agents report. The agent here is this test, speaking the protocol; the
real agent process is tested in ``test_agents.py``."""

from __future__ import annotations

import hashlib
import time
from datetime import datetime

import httpx
import psycopg
import pytest
import sqlalchemy
from service import (
    api_server,
    job_body,
    postgres_database,
    profiled_table,
    service_env,
    upload,
    wait,
    wait_job,
)
from sqlalchemy import select, update

from app.migrate import upgrade
from app.tables import ProfileRow
from remat import samples

ENROLL = "enroll-secret-for-tests"  # 16 characters at least, or the API refuses it
LEASE_S = 1.5
DEVICES = [
    {"name": "cpu0", "kind": "cpu", "options": {"threads": "1"}},
    {"name": "cpu1", "kind": "cpu", "options": {"threads": "2"}},
]


@pytest.fixture(scope="module", params=["postgresql", "sqlite"])
def server(request, tmp_path_factory):
    """The API with its embedded dispatcher (jobs get plans), agents enrolled with
    ``ENROLL``, leases of ``LEASE_S`` and two attempts per task."""
    data = tmp_path_factory.mktemp(f"protocol-{request.param}")
    settings = {
        "data_dir": str(data),
        "enroll_token": ENROLL,
        "lease_s": str(LEASE_S),
        "task_max_attempts": "2",
        "heartbeat_s": "0.5",
        "offline_after_s": "2",
    }
    if request.param == "postgresql":
        with postgres_database() as database:
            upgrade(database)
            yield from _serve(settings | {"database_url": database}, data, database)
    else:
        upgrade(f"sqlite:///{data / 'remat.db'}")
        yield from _serve(settings, data, None)


def _serve(settings, data, database):
    """``database``: PostgreSQL's URL, None on SQLite (``store``: the URL either way)."""
    process, url = api_server(service_env(**settings), data / "api.log")
    store = database or f"sqlite:///{data / 'remat.db'}"
    try:
        yield {"url": url, "database": database, "store": store}
    finally:
        process.stop()


def register(client: httpx.Client, name: str, devices=DEVICES, node_token=None) -> dict:
    body = {"enroll_token": ENROLL, "name": name, "devices": devices, "node_token": node_token}
    response = client.post("/v1/agent/register", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def bearer(enrolled: dict) -> dict[str, str]:
    return {"Authorization": f"Bearer {enrolled['token']}"}


@pytest.fixture
def planned_job(client) -> str:
    """A succeeded job (two CPU devices, analytical costs) whose plan agents can run."""
    model = upload(client, samples.chain(n=4).SerializeToString()).json()["id"]
    devices = [{"name": d["name"], "kind": "cpu"} for d in DEVICES]
    body = job_body(model, devices=devices, budgets={}, strategy="checkpoint_all", batch=2)
    job = client.post("/v1/jobs", json=body)
    assert job.status_code == 202, job.text
    assert wait_job(client, job.json()["id"])["status"] == "succeeded"
    return job.json()["id"]


def _problem(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    return response.json()["detail"]


def _execution_result(peak: int = 1000) -> dict:
    return {
        "measured": {"total_ms": 2.0, "peak_bytes": {"cpu0": peak}, "step_ms": [1.0, 1.0]},
        "predicted": {"total_ms": 1.9, "peak_bytes": {"cpu0": peak}},
        "gradients_match": True,
        "max_rel_error": 1e-7,
        "gradients_vanish": False,
    }


def test_enrollment_needs_the_token_and_stores_the_agents_token_hashed(client, server):
    wrong = client.post(
        "/v1/agent/register", json={"enroll_token": "nope", "name": "n1", "devices": DEVICES}
    )
    assert "wrong enrollment token" in _problem(wrong, 401)
    enrolled = register(client, "hashed-node")
    assert enrolled["heartbeat_s"] == 0.5 and enrolled["lease_s"] == LEASE_S
    assert _problem(client.post("/v1/agent/heartbeat", json={}), 401)
    bad = client.post("/v1/agent/heartbeat", json={}, headers={"Authorization": "Bearer x"})
    assert "unknown agent token" in _problem(bad, 401)
    if server["database"]:
        with psycopg.connect(server["database"].replace("+psycopg", "")) as db:
            stored = db.execute(
                "SELECT token_sha256 FROM nodes WHERE id = %s", (enrolled["node_id"],)
            ).fetchone()[0]
        assert stored == hashlib.sha256(enrolled["token"].encode()).hexdigest()
        assert enrolled["token"] not in stored


def test_nodes_are_online_while_they_send_heartbeats(client):
    enrolled = register(client, "beating")
    node = client.get(f"/v1/nodes/{enrolled['node_id']}").json()
    assert node["status"] == "online" and [d["name"] for d in node["devices"]] == ["cpu0", "cpu1"]
    assert node["devices"][1]["options"] == {"threads": "2"}
    wait(
        lambda: client.get(f"/v1/nodes/{enrolled['node_id']}").json()["status"] == "offline",
        10,
        "node offline",
    )
    assert client.post("/v1/agent/heartbeat", json={}, headers=bearer(enrolled)).status_code == 200
    node = client.get(f"/v1/nodes/{enrolled['node_id']}").json()
    assert node["status"] == "online"
    assert enrolled["node_id"] in [n["id"] for n in client.get("/v1/nodes").json()["items"]]


def test_registering_a_name_again_keeps_the_node_and_replaces_its_token(client):
    first = register(client, "again")
    second = register(client, "again", node_token=first["token"])  # the node's own agent
    assert first["node_id"] == second["node_id"] and first["token"] != second["token"]
    old = client.post("/v1/agent/heartbeat", json={}, headers=bearer(first))
    assert old.status_code == 401


def test_an_execution_is_leased_reported_once_and_listed(client, planned_job):
    enrolled = register(client, "executor")
    asked = client.post(f"/v1/jobs/{planned_job}/executions", json={"node_id": enrolled["node_id"]})
    assert asked.status_code == 202, asked.text
    task = _lease(client, enrolled)
    assert task["kind"] == "execute" and task["attempt"] == 1
    assert task["payload"]["job_id"] == planned_job
    assert task["payload"]["plan"]["devices"][0]["name"] == "cpu0"
    assert _lease(client, enrolled, wait_s=0) is None  # nothing else queued for it
    path = f"/v1/agent/tasks/{task['id']}"
    stale = client.post(
        f"{path}/report",
        json={"lease_token": "0" * 32, "status": "succeeded", "result": _execution_result()},
        headers=bearer(enrolled),
    )
    assert "not current" in _problem(stale, 409)
    report = {"lease_token": task["lease_token"], "status": "succeeded"}
    report["result"] = _execution_result()
    report["result"]["measured"] |= {"energy_mj": 3.5, "energy_note": "RAPL package-0"}
    first = client.post(f"{path}/report", json=report, headers=bearer(enrolled))
    again = client.post(f"{path}/report", json=report, headers=bearer(enrolled))
    assert first.json()["duplicate"] is False and again.json()["duplicate"] is True
    [execution] = client.get(f"/v1/jobs/{planned_job}/executions").json()
    assert execution["status"] == "succeeded" and execution["node_id"] == enrolled["node_id"]
    assert execution["measured"]["peak_bytes"] == {"cpu0": 1000}
    assert execution["measured"]["energy_mj"] == 3.5
    # the prediction is the server's copy of the plan's, energy included
    assert execution["predicted"]["energy_mj"] == pytest.approx(
        task["payload"]["plan"]["predicted"]["energy_mj"]
    )
    assert execution["gradients_match"] is True and execution["max_rel_error"] == 1e-7
    assert execution["gradients_vanish"] is False


def test_an_expired_lease_returns_the_task_and_attempts_are_capped(client, planned_job):
    enrolled = register(client, "forgetful")
    client.post(f"/v1/jobs/{planned_job}/executions", json={"node_id": enrolled["node_id"]})
    first = _lease(client, enrolled)
    time.sleep(LEASE_S + 0.5)  # the agent died: no renewal
    second = _lease(client, enrolled)
    assert second["id"] == first["id"] and second["attempt"] == 2
    late = client.post(
        f"/v1/agent/tasks/{first['id']}/report",
        json={"lease_token": first["lease_token"], "status": "failed", "error": "late"},
        headers=bearer(enrolled),
    )
    assert _problem(late, 409)  # the first attempt's report is stale
    renewed = client.post(
        f"/v1/agent/tasks/{second['id']}/renew",
        json={"lease_token": second["lease_token"]},
        headers=bearer(enrolled),
    )
    assert renewed.status_code == 200
    assert datetime.fromisoformat(renewed.json()["lease_expires_at"]) > datetime.fromisoformat(
        second["lease_expires_at"]
    )
    time.sleep(LEASE_S + 0.5)
    assert _lease(client, enrolled, wait_s=0) is None  # two attempts spent: failed
    executions = client.get(f"/v1/jobs/{planned_job}/executions").json()
    failed = next(e for e in executions if e["id"] == first["id"])
    assert failed["status"] == "failed" and "lease expired" in failed["error"]


def test_a_released_lease_goes_back_without_spending_an_attempt(client, planned_job):
    enrolled = register(client, "polite")
    client.post(f"/v1/jobs/{planned_job}/executions", json={"node_id": enrolled["node_id"]})
    first = _lease(client, enrolled)
    released = client.post(
        f"/v1/agent/tasks/{first['id']}/release",
        json={"lease_token": first["lease_token"]},
        headers=bearer(enrolled),
    )
    assert released.status_code == 204
    again = _lease(client, enrolled)
    assert again["id"] == first["id"] and again["attempt"] == 1


def test_bad_reports_are_refused_and_the_lease_stays(client, planned_job):
    enrolled = register(client, "sloppy")
    client.post(f"/v1/jobs/{planned_job}/executions", json={"node_id": enrolled["node_id"]})
    task = _lease(client, enrolled)
    path = f"/v1/agent/tasks/{task['id']}/report"
    junk = {"lease_token": task["lease_token"], "status": "succeeded", "result": {"x": 1}}
    assert "not an execution result" in _problem(
        client.post(path, json=junk, headers=bearer(enrolled)), 422
    )
    malformed = client.post(path, json={"status": "done"}, headers=bearer(enrolled))
    assert _problem(malformed, 422)
    for energy in (-1.0, "lots"):
        result = _execution_result()
        result["measured"]["energy_mj"] = energy
        bad = {"lease_token": task["lease_token"], "status": "succeeded", "result": result}
        detail = _problem(client.post(path, json=bad, headers=bearer(enrolled)), 422)
        assert "energy_mj" in detail
    failed = {"lease_token": task["lease_token"], "status": "failed", "error": "no kernel"}
    assert client.post(path, json=failed, headers=bearer(enrolled)).status_code == 200
    [execution] = [
        e for e in client.get(f"/v1/jobs/{planned_job}/executions").json() if e["id"] == task["id"]
    ]
    assert execution["status"] == "failed" and execution["error"] == "no kernel"


def test_a_profile_report_is_checked_against_the_graph(server, client):
    """A job with costs from a node waits for a profile task; a cost table missing nodes,
    with nodes the graph lacks (an agent whose remat fuses fewer operators), or recording
    another graph's digest, is refused; a complete one becomes the node's profile and the
    job is solved with it. A stored profile whose nodes are not the graph's (measured
    before ingestion fused more operators) is measured again for the next job."""
    enrolled = register(client, "profiler")
    model = upload(client, samples.chain(n=3).SerializeToString()).json()["id"]
    devices = [{"name": "cpu0", "kind": "cpu"}, {"name": "cpu1", "kind": "cpu"}]
    body = job_body(
        model,
        batch=2,
        devices=devices,
        budgets={},
        strategy="xengine",
        costs={"node_id": enrolled["node_id"]},
    )
    stale = client.post("/v1/jobs", json=body).json()
    task = _lease(client, enrolled)
    assert task["kind"] == "profile" and task["payload"]["devices"] == ["cpu0", "cpu1"]
    graph = client.get(f"/v1/models/{model}/graph", params={"batch": 2}).json()
    names = [n["name"] for n in graph["nodes"]]

    def report(task: dict, table: dict) -> httpx.Response:
        result = {"lease_token": task["lease_token"], "status": "succeeded", "result": table}
        path = f"/v1/agent/tasks/{task['id']}/report"
        return client.post(path, json=result, headers=bearer(enrolled))

    assert "no entry for node" in _problem(report(task, profiled_table(names[:-1])), 422)
    unfused = profiled_table([*names, "gelu/Erf"])
    assert "update the agent" in _problem(report(task, unfused), 422)
    other = profiled_table(names) | {"graph": "sha256:0123456789abcdef"}
    assert "measured on another graph" in _problem(report(task, other), 422)
    accepted = report(task, profiled_table(names))
    assert accepted.status_code == 200, accepted.text
    assert wait_job(client, stale["id"])["status"] == "succeeded"
    engine = sqlalchemy.create_engine(server["store"])
    with engine.begin() as db:  # as a profile stored before ingestion fused more
        mine = ProfileRow.node_id == enrolled["node_id"]
        [(key, table)] = db.execute(select(ProfileRow.id, ProfileRow.table).where(mine)).all()
        table["nodes"]["gelu/Erf"] = table["nodes"][names[0]]
        db.execute(update(ProfileRow).where(ProfileRow.id == key).values(table=table))
    engine.dispose()
    job = client.post("/v1/jobs", json=body).json()
    again = _lease(client, enrolled)
    assert again is not None and again["kind"] == "profile"
    assert report(again, profiled_table(names)).status_code == 200
    done = wait_job(client, job["id"])
    assert done["status"] == "succeeded", done
    plan = client.get(f"/v1/jobs/{job['id']}/plan").json()
    # cpu1 is ten times faster in this table: the optimum computes everything there
    assert {s["device"] for s in plan["steps"] if s["op"] == "compute"} == {"cpu1"}
    profiles = client.get("/v1/profiles", params={"node_id": enrolled["node_id"]}).json()
    tables = [client.get(f"/v1/profiles/{p['id']}").json()["table"] for p in profiles["items"]]
    assert sorted(len(t["nodes"]) for t in tables) == [len(names), len(names) + 1]
    assert all(t["source"] == "profiled" for t in tables)


def test_executions_need_a_plan_and_a_node_with_the_plans_devices(client, planned_job):
    gpu_node = register(client, "gpu-only", [{"name": "cuda0", "kind": "cuda", "options": {}}])
    missing = client.post(
        f"/v1/jobs/{planned_job}/executions", json={"node_id": gpu_node["node_id"]}
    )
    assert "has no cpu device 'cpu0'" in _problem(missing, 422)
    unknown = client.post(f"/v1/jobs/{planned_job}/executions", json={"node_id": "0" * 32})
    assert "does not exist" in _problem(unknown, 422)
    model = upload(client, samples.chain(n=5).SerializeToString()).json()["id"]
    body = job_body(model, budgets={"cpu0": "1KiB"})
    assert client.post("/v1/jobs", json=body).status_code == 422  # never gets a plan
    lacking = job_body(model, costs={"node_id": gpu_node["node_id"]}, budgets={})
    assert "has no cpu device 'cpu0'" in _problem(client.post("/v1/jobs", json=lacking), 422)


def _lease(client: httpx.Client, enrolled: dict, wait_s: float = 5) -> dict | None:
    response = client.post(
        "/v1/agent/lease", json={"wait_s": wait_s}, headers=bearer(enrolled), timeout=wait_s + 30
    )
    assert response.status_code in (200, 204), response.text
    return response.json() if response.status_code == 200 else None
