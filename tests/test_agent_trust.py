"""How far the API trusts agents, over real HTTP to a real uvicorn (SQLite, the embedded
dispatcher): a node name is registered again only with that node's token, ``local`` only
by ``remat serve``'s own agent; an execution's ``predicted`` is the plan's, whatever the
agent says; reported times, peaks and cost tables are finite, non-negative and bounded; a
node downloads only the models its own tasks name; lease tokens are stored hashed; the
API refuses to start with a weak enrollment token, and docker-compose ships none. Real
``remat-agent`` processes keep their node token and exit when their name is taken."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from service import (
    BIN,
    ROOT,
    Process,
    api_server,
    job_body,
    profiled_table,
    service_env,
    upload,
    wait,
    wait_job,
)

from app.migrate import upgrade
from remat import samples
from remat.graph import Mode
from remat.onnx_ingest import forward_graph
from remat.training import for_mode

ENROLL = "trust-test-enroll-token"
DEVICES = [
    {"name": "cpu0", "kind": "cpu", "options": {"threads": "1"}},
    {"name": "cpu1", "kind": "cpu", "options": {"threads": "2"}},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = tmp_path_factory.mktemp("trust")
    upgrade(f"sqlite:///{data / 'remat.db'}")
    env = service_env(data_dir=str(data), enroll_token=ENROLL)
    process, url = api_server(env, data / "api.log")
    try:
        yield {"url": url, "data": data, "env": env}
    finally:
        process.stop()


def register(client: httpx.Client, name: str, **extra: object) -> httpx.Response:
    body = {"enroll_token": ENROLL, "name": name, "devices": DEVICES, **extra}
    return client.post("/v1/agent/register", json=body)


def enrolled(client: httpx.Client, name: str) -> dict:
    response = register(client, name)
    assert response.status_code == 200, response.text
    return response.json()


def bearer(node: dict) -> dict[str, str]:
    return {"Authorization": f"Bearer {node['token']}"}


def lease(client: httpx.Client, node: dict) -> dict:
    response = client.post("/v1/agent/lease", json={"wait_s": 5}, headers=bearer(node))
    assert response.status_code == 200, response.text
    return response.json()


def detail(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return str(response.json()["detail"])


@pytest.fixture(scope="module")
def planned_job(server) -> dict:
    """A succeeded job on two CPU devices, with its plan's prediction."""
    with httpx.Client(base_url=server["url"], timeout=30) as client:
        model = upload(client, samples.chain(n=4).SerializeToString()).json()["id"]
        devices = [{"name": d["name"], "kind": "cpu"} for d in DEVICES]
        body = job_body(model, devices=devices, budgets={}, strategy="checkpoint_all", batch=2)
        job = client.post("/v1/jobs", json=body).json()
        assert wait_job(client, job["id"])["status"] == "succeeded"
        plan = client.get(f"/v1/jobs/{job['id']}/plan").json()
    return {"id": job["id"], "model_id": model, "predicted": plan["predicted"]}


def execution_task(client: httpx.Client, job: dict, node: dict) -> dict:
    asked = client.post(f"/v1/jobs/{job['id']}/executions", json={"node_id": node["node_id"]})
    assert asked.status_code == 202, asked.text
    return lease(client, node)


def measured(**changes: object) -> dict:
    return {"total_ms": 2.0, "peak_bytes": {"cpu0": 1000}, "step_ms": [1.0, 1.0]} | changes


# --- names ------------------------------------------------------------------------------


def test_a_taken_name_is_registered_again_only_with_its_nodes_token(client):
    first = enrolled(client, "owned")
    taken = register(client, "owned")
    assert "is taken" in detail(taken, 409)
    wrong = register(client, "owned", node_token="not-the-token")
    assert "is taken" in detail(wrong, 409)
    assert client.post("/v1/agent/heartbeat", json={}, headers=bearer(first)).status_code == 200
    again = register(client, "owned", node_token=first["token"])
    assert again.status_code == 200, again.text
    assert again.json()["node_id"] == first["node_id"]
    assert client.post("/v1/agent/heartbeat", json={}, headers=bearer(first)).status_code == 401


def test_the_name_local_is_reserved_for_remat_serves_agent(client):
    """The API without ``remat serve`` has no local secret: nobody registers ``local``."""
    refused = register(client, "local")
    assert "reserved" in detail(refused, 403)


# --- what agents report -----------------------------------------------------------------


def test_an_execution_stores_the_plans_prediction_not_the_agents(client, planned_job):
    node = enrolled(client, "boaster")
    task = execution_task(client, planned_job, node)
    result = {
        "measured": measured(),
        "predicted": {"total_ms": 1e-6, "peak_bytes": {"cpu0": 1}},  # flattering itself
        "gradients_match": True,
        "max_rel_error": 1e-7,
    }
    report = {"lease_token": task["lease_token"], "status": "succeeded", "result": result}
    path = f"/v1/agent/tasks/{task['id']}/report"
    assert client.post(path, json=report, headers=bearer(node)).status_code == 200
    [execution] = [
        e
        for e in client.get(f"/v1/jobs/{planned_job['id']}/executions").json()
        if e["id"] == task["id"]
    ]
    expected = planned_job["predicted"]
    assert execution["predicted"] == {
        "total_ms": expected["total_ms"],
        "peak_bytes": expected["peak_bytes"],
        "energy_mj": expected["energy_mj"],
    }
    assert execution["measured"]["total_ms"] == 2.0


@pytest.mark.parametrize(
    "bad",
    [
        {"measured": measured(peak_bytes={"cpu0": -1})},
        {"measured": measured(total_ms=1e300)},
        {"measured": measured(step_ms=[-1.0])},
        {"measured": measured(), "max_rel_error": -1.0},
    ],
    ids=["negative-peak", "huge-time", "negative-step", "negative-error"],
)
def test_impossible_measurements_are_refused_and_the_lease_stays(client, planned_job, bad):
    node = enrolled(client, f"liar-{uuid.uuid4().hex[:8]}")
    task = execution_task(client, planned_job, node)
    path = f"/v1/agent/tasks/{task['id']}/report"
    result = {"predicted": {"total_ms": 1.0}} | bad  # an old agent's, to be ignored
    report = {"lease_token": task["lease_token"], "status": "succeeded", "result": result}
    assert "not an execution result" in detail(
        client.post(path, json=report, headers=bearer(node)), 422
    )
    renewed = client.post(
        f"/v1/agent/tasks/{task['id']}/renew",
        json={"lease_token": task["lease_token"]},
        headers=bearer(node),
    )
    assert renewed.status_code == 200


def test_a_nan_execution_time_is_refused(client, planned_job):
    """NaN is not JSON, but Python's encoder writes it and the API must not take it."""
    node = enrolled(client, "nan-executor")
    task = execution_task(client, planned_job, node)
    result = {
        "measured": {"total_ms": float("nan"), "peak_bytes": {"cpu0": 1}},
        "predicted": {"total_ms": 1.0},
    }
    text = json.dumps({"lease_token": task["lease_token"], "status": "succeeded", "result": result})
    response = client.post(
        f"/v1/agent/tasks/{task['id']}/report",
        content=text,
        headers=bearer(node) | {"content-type": "application/json"},
    )
    assert response.status_code == 422, response.text


def test_a_profile_with_impossible_times_is_refused(client):
    node = enrolled(client, "bad-profiler")
    model = upload(client, samples.chain(n=3).SerializeToString()).json()["id"]
    devices = [{"name": "cpu0", "kind": "cpu"}, {"name": "cpu1", "kind": "cpu"}]
    body = job_body(model, batch=2, devices=devices, budgets={}, strategy="checkpoint_all")
    client.post("/v1/jobs", json=body | {"costs": {"node_id": node["node_id"]}})
    task = lease(client, node)
    assert task["kind"] == "profile"
    graph = client.get(f"/v1/models/{model}/graph", params={"batch": 2}).json()
    names = [n["name"] for n in graph["nodes"]]
    path = f"/v1/agent/tasks/{task['id']}/report"
    for value in (1e300, -1.0):
        table = profiled_table(names)
        table["nodes"][names[0]]["compute_ms"]["cpu0"] = value
        report = {"lease_token": task["lease_token"], "status": "succeeded", "result": table}
        refused = client.post(path, json=report, headers=bearer(node))
        assert "compute_ms" in detail(refused, 422)
    table = profiled_table(names)
    table["copy_ms"][names[0]]["cpu0->cpu1"] = float("inf")
    table["nodes"][names[1]]["compute_ms"]["cpu1"] = float("nan")
    report = {"lease_token": task["lease_token"], "status": "succeeded", "result": table}
    raw = json.dumps(report)  # writes Infinity and NaN, which Python's JSON reader takes
    for where in ("compute_ms", "copy_ms"):
        refused = client.post(
            path, content=raw, headers=bearer(node) | {"content-type": "application/json"}
        )
        assert where in detail(refused, 422)
        table["nodes"][names[1]]["compute_ms"]["cpu1"] = 1.0
        raw = json.dumps(report)
    report = {
        "lease_token": task["lease_token"],
        "status": "succeeded",
        "result": profiled_table(names),
    }
    assert client.post(path, json=report, headers=bearer(node)).status_code == 200


def test_a_profile_over_sizes_must_give_each_size_its_table(client):
    """A ranged job's profiles are one task over its sizes: a plain table, tables for
    other sizes, or a size's table that misses a node are refused (422) and the lease
    stays; tables for every size are stored as a profile each, and the job is planned."""
    node = enrolled(client, "sized-profiler")
    onnx_model = samples.transformer_block(layers=1, seq="S")
    model = upload(client, onnx_model.SerializeToString()).json()["id"]
    body = job_body(
        model,
        strategy="greedy_evict",
        budgets={"cpu0": "75%"},
        ranges={"input": "2x16..128x32"},
        costs={"node_id": node["node_id"]},
    )
    job = client.post("/v1/jobs", json=body).json()
    task = lease(client, node)
    assert task["kind"] == "profile" and sorted(task["payload"]["sizes"]) == ["128", "16", "72"]
    graph = for_mode(forward_graph(onnx_model, inputs={"input": [2, 16, 32]}), Mode.TRAINING)
    names = [n.name for n in graph.nodes]
    path = f"/v1/agent/tasks/{task['id']}/report"

    def report(result: object) -> httpx.Response:
        body = {"lease_token": task["lease_token"], "status": "succeeded", "result": result}
        return client.post(path, json=body, headers=bearer(node))

    assert "not a profile over sizes" in detail(report(profiled_table(names)), 422)
    two = {"16": profiled_table(names), "72": profiled_table(names)}
    assert "the task asked for ['128', '16', '72']" in detail(report({"tables": two}), 422)
    short = profiled_table(names[1:])
    assert names[0] in detail(report({"tables": two | {"128": short}}), 422)
    assert report({"tables": two | {"128": profiled_table(names)}}).status_code == 200
    assert wait_job(client, job["id"])["status"] == "succeeded"
    profiles = client.get("/v1/profiles", params={"model_id": model}).json()["items"]
    assert sorted(p["spec"]["model"]["inputs"]["input"][1] for p in profiles) == [16, 72, 128]


# --- models and leases ------------------------------------------------------------------


def test_a_node_downloads_only_the_models_its_own_tasks_name(client, planned_job):
    worker, other = enrolled(client, "downloader"), enrolled(client, "snoop")
    task = execution_task(client, planned_job, worker)
    model = f"/v1/agent/models/{planned_job['model_id']}"
    assert client.get(model, headers=bearer(worker)).status_code == 200
    assert "not in any of this node's tasks" in detail(
        client.get(model, headers=bearer(other)), 404
    )
    unrelated = upload(client, samples.chain(n=6).SerializeToString()).json()["id"]
    assert client.get(f"/v1/agent/models/{unrelated}", headers=bearer(worker)).status_code == 404
    report = {"lease_token": task["lease_token"], "status": "failed", "error": "done with it"}
    client.post(f"/v1/agent/tasks/{task['id']}/report", json=report, headers=bearer(worker))
    assert client.get(model, headers=bearer(worker)).status_code == 404  # no task left


def test_lease_tokens_are_stored_hashed(client, server, planned_job):
    node = enrolled(client, "hashed-lease")
    task = execution_task(client, planned_job, node)
    with sqlite3.connect(server["data"] / "remat.db") as db:
        [(stored,)] = db.execute("SELECT lease_token FROM agent_tasks WHERE id = ?", (task["id"],))
    assert stored == hashlib.sha256(task["lease_token"].encode()).hexdigest()
    release = client.post(
        f"/v1/agent/tasks/{task['id']}/release",
        json={"lease_token": task["lease_token"]},
        headers=bearer(node),
    )
    assert release.status_code == 204  # the agent's side of the protocol is unchanged
    forged = client.post(
        f"/v1/agent/tasks/{lease(client, node)['id']}/renew",
        json={"lease_token": stored},  # what a reader of the database has
        headers=bearer(node),
    )
    assert forged.status_code == 409


# --- the enrollment token ---------------------------------------------------------------


@pytest.mark.parametrize("token", ["change-me", "short-secret"])
def test_the_api_refuses_to_start_with_a_weak_enrollment_token(tmp_path, token):
    env = service_env(data_dir=str(tmp_path), enroll_token=token)
    args = [str(BIN / "uvicorn"), "--factory", "app.main:create_app", "--port", "0"]
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    [line] = [x for x in done.stderr.splitlines() if "REMAT_ENROLL_TOKEN" in x]
    assert line.startswith("remat: error: REMAT_ENROLL_TOKEN")
    assert "Traceback" not in done.stderr


def test_docker_compose_ships_no_enrollment_token():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    values = [compose["x-remat-env"]["REMAT_ENROLL_TOKEN"]]
    values.append(compose["services"]["agent"]["environment"]["REMAT_ENROLL_TOKEN"])
    for value in values:
        assert value.startswith("${REMAT_ENROLL_TOKEN:?"), value
    assert "change-me" not in (ROOT / "docker-compose.yml").read_text()


# --- real agent processes ---------------------------------------------------------------


def agent(server: dict, name: str, cache: Path, log: Path) -> Process:
    args = [str(BIN / "remat-agent"), "--server", server["url"], "--name", name]
    args += ["--cache-dir", str(cache), "--device", "cpu0:cpu:threads=1", "--lease-wait", "1"]
    return Process(args, dict(server["env"], REMAT_ENROLL_TOKEN=ENROLL), log)


def test_an_agent_keeps_its_name_across_restarts_and_a_second_one_is_turned_away(
    client, server, tmp_path
):
    pytest.importorskip("torch", reason="remat-agent needs the [agent] extra (PyTorch)")
    first = agent(server, "twin", tmp_path / "cache-a", tmp_path / "a1.log")
    try:
        first.wait_for_output("remat-agent twin: node")
        node_id = first.output().split("remat-agent twin: node ")[1].split()[0]
        token_file = tmp_path / "cache-a" / "node-twin.token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        second = agent(server, "twin", tmp_path / "cache-b", tmp_path / "b.log")
        assert second.popen.wait(timeout=120) == 1
        assert "is taken" in second.output()
        assert first.popen.poll() is None
    finally:
        first.stop()
    restarted = agent(server, "twin", tmp_path / "cache-a", tmp_path / "a2.log")
    try:
        restarted.wait_for_output(f"remat-agent twin: node {node_id}")

        def online() -> bool:
            node = client.get(f"/v1/nodes/{node_id}").json()
            return bool(node["status"] == "online")

        wait(online, 30, "the restarted agent online")
    finally:
        restarted.stop()
