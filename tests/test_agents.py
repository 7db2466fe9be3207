"""Real ``remat-agent`` processes against the real API: in the embedded mode (``remat
serve`` starts its own local agent), and with PostgreSQL, Redis, a Celery worker and
uvicorn. An agent registers, profiles a model for a job whose costs come from its node,
executes the job's plan, and the API reports measured against predicted. Faults: an agent
killed mid-task (its lease expires, another agent finishes), SIGTERM (the lease is given
back), a server that is not up yet, malformed payloads, unknown devices and ops.

Two CPU devices of different speed (threads 1 and 2) stand in for a heterogeneous node.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import time

import httpx
import psycopg
import pytest
from onnx import TensorProto, helper
from service import (
    BIN,
    Process,
    api_server,
    celery_worker,
    free_port,
    job_body,
    postgres_database,
    redis_url,
    service_env,
    upload,
    wait,
    wait_job,
    wait_ready,
)

from app.migrate import upgrade
from remat import samples
from remat.budgets import reference
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.graph import Mode
from remat.onnx_ingest import forward_graph
from remat.training import for_mode

pytest.importorskip("torch", reason="the agent's kernels need the [agent] extra (PyTorch)")

ENROLL = "agents-test-token"
AGENT_DEVICES = ["cpu0:cpu:threads=1", "cpu1:cpu:threads=2"]
MiB = 1 << 20


def small_vgg() -> bytes:
    return samples.vgg16(image=32, width=4).SerializeToString()


def node_job(model_id: str, node_id: str, **overrides) -> dict:
    body = {
        "model_id": model_id,
        "batch": 2,
        "devices": [{"name": "cpu0", "kind": "cpu"}, {"name": "cpu1", "kind": "cpu"}],
        "budgets": {"cpu0": "50%", "cpu1": "50%"},
        "strategy": "xengine",
        # 10 s: the warm start's multi-device heuristic gets half the limit to fit, and
        # with 5 s a busy CI machine once left it, and so the job, without a plan
        "solver": {"backend": "highs", "time_limit_s": 10},
        "costs": {"node_id": node_id},
    }
    return body | overrides


def online_node(client: httpx.Client, name: str) -> dict:
    found: dict = {}

    def online() -> bool:
        for node in client.get("/v1/nodes").json()["items"]:
            if node["name"] == name and node["status"] == "online":
                found.update(node)
        return bool(found)

    wait(online, 120, f"node {name} online")
    return found


def wait_execution(client: httpx.Client, job_id: str, execution_id: str) -> dict:
    found: dict = {}

    def finished() -> bool:
        for execution in client.get(f"/v1/jobs/{job_id}/executions").json():
            if execution["id"] == execution_id and execution["status"] in ("succeeded", "failed"):
                found.update(execution)
        return bool(found)

    wait(finished, 300, f"execution {execution_id}")
    return found


def profile_execute_and_compare(client: httpx.Client, node_id: str, model: bytes) -> dict:
    """The issue's flow: a job with costs from the node (profiled first), its plan executed
    on the node, measured against predicted."""
    model_id = upload(client, model).json()["id"]
    job = client.post("/v1/jobs", json=node_job(model_id, node_id))
    assert job.status_code == 202, job.text
    done = wait_job(client, job.json()["id"])
    assert done["status"] == "succeeded", done
    [profile] = client.get(
        "/v1/profiles", params={"node_id": node_id, "model_id": model_id}
    ).json()["items"]
    # profiled within the job's budget on each device (node by node where no pass fits)
    assert set(profile["spec"]["memory_bytes"]) == {"cpu0", "cpu1"}
    table = client.get(f"/v1/profiles/{profile['id']}").json()["table"]
    assert table["source"] == "profiled" and {d["name"] for d in table["devices"]} == {
        "cpu0",
        "cpu1",
    }
    asked = client.post(f"/v1/jobs/{done['id']}/executions", json={"node_id": node_id})
    assert asked.status_code == 202, asked.text
    execution = wait_execution(client, done["id"], asked.json()["id"])
    assert execution["status"] == "succeeded", execution
    measured, predicted = execution["measured"], execution["predicted"]
    for device, peak in predicted["peak_bytes"].items():
        assert abs(measured["peak_bytes"][device] - peak) <= max(0.01 * peak, MiB), (
            device,
            measured,
            predicted,
        )
    assert execution["gradients_match"] is True and execution["max_rel_error"] <= 1e-4
    assert measured["total_ms"] > 0 and predicted["total_ms"] > 0
    return execution


# --- the embedded mode --------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    data = tmp_path_factory.mktemp("agents-embedded")
    env = service_env(data_dir=str(data), heartbeat_s="1")
    port = free_port()
    args = [str(BIN / "remat"), "serve", "--port", str(port)]
    for device in AGENT_DEVICES:
        args += ["--agent-device", device]
    server = Process(args, env, data / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server)
        yield url, server, data
    finally:
        server.stop()


def test_remat_serve_starts_a_local_agent_that_profiles_and_executes(embedded):
    url, server, _ = embedded
    assert "agent enrollment token:" in server.output()
    with httpx.Client(base_url=url, timeout=60) as client:
        node = online_node(client, "local")
        assert [d["options"] for d in node["devices"]] == [{"threads": "1"}, {"threads": "2"}]
        profile_execute_and_compare(client, node["id"], small_vgg())


def test_the_local_agent_runs_a_family_of_sizes(embedded):
    """A job over ranges of sizes with the node's costs (profiled at the range's ends and
    middle), executed as training steps whose sizes change: each step with its size's
    plan, measured against predicted per size, the plan cache's hits marked."""
    url, _, data = embedded
    model = samples.transformer_block(layers=2, seq="S").SerializeToString()
    with httpx.Client(base_url=url, timeout=60) as client:
        node = online_node(client, "local")
        model_id = upload(client, model).json()["id"]
        body = job_body(
            model_id,
            strategy="greedy_evict",
            budgets={"cpu0": "75%"},
            ranges={"input": "2x16..128x32"},
            costs={"node_id": node["id"]},
            fuse_attention=False,  # the budget calibrated on the attention node by node
        )
        done = wait_job(client, client.post("/v1/jobs", json=body).json()["id"])
        assert done["status"] == "succeeded", done
        profiles = client.get(
            "/v1/profiles", params={"node_id": node["id"], "model_id": model_id}
        ).json()["items"]
        shapes = sorted(p["spec"]["model"]["inputs"]["input"][1] for p in profiles)
        assert shapes == [16, 72, 128]  # the range's ends and middle, in one task:
        with sqlite3.connect(data / "remat.db") as db:
            [(payload,)] = db.execute(
                "SELECT payload FROM agent_tasks WHERE kind = 'profile' AND payload LIKE ?",
                (f"%{model_id}%",),
            ).fetchall()
        assert sorted(json.loads(payload)["sizes"], key=int) == ["16", "72", "128"]
        # each size profiled within the job's budget at the largest size
        assert len({json.dumps(p["spec"]["memory_bytes"]) for p in profiles}) == 1
        sizes = [24, 50, 24, 128, 50]
        asked = client.post(
            f"/v1/jobs/{done['id']}/executions", json={"node_id": node["id"], "sizes": sizes}
        )
        assert asked.status_code == 202, asked.text
        execution = wait_execution(client, done["id"], asked.json()["id"])
        assert execution["status"] == "succeeded", execution
        steps = execution["sized"]
        assert [s["size"] for s in steps] == sizes
        assert [s["plan_cached"] for s in steps][2:] == [True, True, True]  # 128: stored
        for step in steps:
            for device, peak in step["predicted_peak_bytes"].items():
                assert abs(step["peak_bytes"][device] - peak) <= max(0.01 * peak, MiB), step
            assert step["total_ms"] > 0 and step["predicted_ms"] > 0
        predicted = execution["predicted"]
        assert predicted["total_ms"] == pytest.approx(sum(s["predicted_ms"] for s in steps))
        assert execution["gradients_match"] is True
        one_shape = client.post(
            f"/v1/jobs/{done['id']}/executions", json={"node_id": node["id"], "sizes": [300]}
        )
        assert one_shape.status_code == 422 and "outside the job's range" in one_shape.text


# --- PostgreSQL, Redis, Celery ------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("agents-logs")
    data = tmp_path_factory.mktemp("agents-data")
    with postgres_database() as database:
        upgrade(database)
        env = service_env(
            database_url=database,
            broker_url=redis_url(7),
            data_dir=str(data),
            enroll_token=ENROLL,
            heartbeat_s="1",
            lease_s="6",  # five missed heartbeats: an agent busy profiling on a busy machine
        )
        worker = celery_worker(env, logs / "worker.log")
        server, url = api_server(env, logs / "api.log")
        try:
            yield {"env": env, "url": url, "database": database, "logs": logs}
        finally:
            server.stop()
            worker.stop()


def start_agent(
    stack: dict,
    name: str,
    log: str,
    server: str | None = None,
    devices: list[str] = AGENT_DEVICES,
) -> Process:
    args = [str(BIN / "remat-agent"), "--server", server or stack["url"], "--name", name]
    args += ["--cache-dir", str(stack["logs"] / f"cache-{name}"), "--lease-wait", "2"]
    for device in devices:
        args += ["--device", device]
    env = dict(stack["env"], REMAT_ENROLL_TOKEN=ENROLL)
    return Process(args, env, stack["logs"] / log)


@pytest.fixture(scope="module")
def server(stack):
    """The server conftest's ``client`` talks to."""
    return stack


def _db(stack: dict) -> psycopg.Connection:
    return psycopg.connect(stack["database"].replace("+psycopg", ""), autocommit=True)


def test_an_agent_profiles_and_executes_with_celery_and_postgresql(stack, client):
    agent = start_agent(stack, "worker-node", "agent-main.log")
    try:
        node = online_node(client, "worker-node")
        profile_execute_and_compare(
            client, node["id"], samples.resnet18(image=32, width=4).SerializeToString()
        )
    finally:
        agent.stop()


def test_a_device_smaller_than_checkpoint_all_is_profiled_under_a_plan(stack, client):
    """A node whose device may hold less than checkpoint-all needs (its ``memory``
    option): the job's profile recomputes within the job's budget (Mimose's collector), the
    job is planned on it, and its plan runs within the option; a checkpoint-all plan does
    not, and fails saying so."""
    model = samples.resnet18(image=32, width=4)
    graph = for_mode(forward_graph(model, batch=2), Mode.TRAINING)
    ref = reference(graph, analytical_costs(graph, [Device("cpu0", DeviceKind.CPU)]))
    memory = ref.fixed_bytes + (ref.peak_bytes - ref.fixed_bytes) * 7 // 10
    agent = start_agent(
        stack, "small-node", "agent-small.log", devices=[f"cpu0:cpu:threads=1,memory={memory}"]
    )
    try:
        node = online_node(client, "small-node")
        model_id = upload(client, model.SerializeToString()).json()["id"]
        body = job_body(model_id, batch=2, strategy="greedy_evict", costs={"node_id": node["id"]})
        done = wait_job(client, client.post("/v1/jobs", json=body).json()["id"])
        assert done["status"] == "succeeded", done
        with _db(stack) as db:
            [(payload,)] = db.execute(
                "SELECT payload FROM agent_tasks WHERE node_id = %s AND kind = 'profile'",
                (node["id"],),
            ).fetchall()
        budget = ref.fixed_bytes + round((ref.peak_bytes - ref.fixed_bytes) * 0.5)
        assert payload["memory_bytes"] == {"cpu0": budget}  # the job's 50%, in bytes
        execution = client.post(f"/v1/jobs/{done['id']}/executions", json={"node_id": node["id"]})
        ran = wait_execution(client, done["id"], execution.json()["id"])
        assert ran["status"] == "succeeded", ran
        assert ran["measured"]["peak_bytes"]["cpu0"] <= budget
        everything = body | {"strategy": "checkpoint_all", "budgets": {}, "costs": "analytical"}
        unplanned = wait_job(client, client.post("/v1/jobs", json=everything).json()["id"])
        execution = client.post(
            f"/v1/jobs/{unplanned['id']}/executions", json={"node_id": node["id"]}
        )
        failed = wait_execution(client, unplanned["id"], execution.json()["id"])
        assert failed["status"] == "failed"
        assert f"above the {memory} bytes the device may use" in failed["error"], failed
    finally:
        agent.stop()


def _slow_to_profile() -> bytes:
    """A model whose profile takes seconds (about 5 s on 2 cores), so that a signal sent
    once profiling is under way lands mid-task: a 32x32 U-Net took 1.6 s, and on a
    faster machine its task was done before SIGTERM arrived."""
    return samples.unet(image=64, width=16).SerializeToString()


def test_an_agent_killed_mid_task_loses_its_lease_and_another_finishes(stack, client):
    """SIGKILL while profiling: no release, no report. The lease expires (6 s) and a new
    agent process for the node takes the task (attempt 2) and the job completes."""
    first = start_agent(stack, "fragile", "agent-killed.log")
    node = online_node(client, "fragile")
    model_id = upload(client, _slow_to_profile()).json()["id"]
    # checkpoint-all: the job ends once the profile is in, with no solve to wait for
    body = node_job(model_id, node["id"], strategy="checkpoint_all", budgets={})
    job = client.post("/v1/jobs", json=body).json()
    wait(lambda: "profiling" in (client.get(f"/v1/jobs/{job['id']}").json()["message"] or ""),
         120, "profiling under way")  # fmt: skip
    first.kill(signal.SIGKILL)
    second = start_agent(stack, "fragile", "agent-second.log")
    try:
        assert wait_job(client, job["id"])["status"] == "succeeded"
    finally:
        second.stop()
    with _db(stack) as db:
        attempts = db.execute(
            "SELECT attempts, status FROM agent_tasks WHERE node_id = %s AND kind = 'profile'",
            (node["id"],),
        ).fetchall()
    assert attempts == [(2, "succeeded")]


def test_sigterm_gives_the_lease_back(stack, client):
    agent = start_agent(stack, "leaving", "agent-sigterm.log")
    node = online_node(client, "leaving")
    model_id = upload(client, _slow_to_profile()).json()["id"]
    job = client.post("/v1/jobs", json=node_job(model_id, node["id"])).json()
    wait(lambda: "profiling" in (client.get(f"/v1/jobs/{job['id']}").json()["message"] or ""),
         120, "profiling under way")  # fmt: skip
    agent.popen.send_signal(signal.SIGTERM)
    assert agent.popen.wait(timeout=15) == 0
    assert "lease given back" in agent.output()
    with _db(stack) as db:
        rows = db.execute(
            "SELECT attempts, status, lease_token FROM agent_tasks WHERE node_id = %s",
            (node["id"],),
        ).fetchall()
    assert rows == [(0, "queued", None)]
    assert client.post(f"/v1/jobs/{job['id']}/cancel").json()["cancel_requested"] is True
    agent.stop()


def test_an_agent_waits_for_a_server_that_is_not_up_yet_and_survives_its_restart(stack, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = start_agent(stack, "early", "agent-early.log", server=url)
    try:
        wait(lambda: "retrying" in agent.output(), 60, "the agent retrying")
        assert agent.popen.poll() is None
        env = dict(stack["env"])
        late = Process(
            [str(BIN / "uvicorn"), "--factory", "app.main:create_app", "--port", str(port)],
            env,
            tmp_path / "late-api.log",
        )
        try:
            wait_ready(url, late)
            with httpx.Client(base_url=url, timeout=30) as late_client:
                online_node(late_client, "early")
        finally:
            late.stop()
        # The server restarts: the agent rides it out and goes on with heartbeats.
        restarted = Process(late.popen.args, env, tmp_path / "restarted-api.log")  # type: ignore[arg-type]
        try:
            wait_ready(url, restarted)
            with httpx.Client(base_url=url, timeout=30) as again:
                seen = online_node(again, "early")["last_seen_at"]
                wait(
                    lambda: online_node(again, "early")["last_seen_at"] != seen,
                    30,
                    "a heartbeat after the restart",
                )
            assert agent.popen.poll() is None
        finally:
            restarted.stop()
    finally:
        agent.stop()


def test_bad_tasks_fail_clearly_and_the_agent_keeps_running(stack, client):
    """A malformed payload, a plan naming a device the node lacks, and a model with an op
    the kernels lack: each task fails with a message that says why; the agent then still
    completes a good task."""
    agent = start_agent(stack, "sturdy", "agent-bad.log")
    try:
        node = online_node(client, "sturdy")
        model = client.get("/v1/models").json()["items"][0]
        ref = {"model_id": model["id"], "sha256": model["sha256"], "mode": "training", "batch": 2}
        plan = {"version": 1, "strategy": "x", "devices": [{"name": "gpu7", "kind": "cuda"}],
                "steps": [{"stage": 0, "op": "compute", "node": 0, "device": "gpu7"}]}  # fmt: skip
        unsupported = upload(client, _model_with_unsupported_op()).json()
        bad = {
            "malformed": {"model": ref, "devices": "cpu0"},
            "unknown-device": {"model": ref, "devices": ["cpu0", "tpu3"]},
            "unsupported-op": {
                "model": {
                    "model_id": unsupported["id"],
                    "sha256": unsupported["sha256"],
                    "mode": "training",
                    "batch": 2,
                },
                "devices": ["cpu0"],
            },
        }
        ids = {
            name: _insert_task(stack, node["id"], "profile", payload)
            for name, payload in bad.items()
        }
        ids["plan-device"] = _insert_task(
            stack, node["id"], "execute", {"model": ref, "job_id": "none", "plan": plan}
        )
        errors = _wait_tasks(stack, list(ids.values()))
        assert "malformed task payload" in errors[ids["malformed"]]
        assert "tpu3" in errors[ids["unknown-device"]]
        assert "gpu7" in errors[ids["plan-device"]]
        assert "Hardmax" in errors[ids["unsupported-op"]], errors
        assert agent.popen.poll() is None
        good = _insert_task(stack, node["id"], "profile", {"model": ref, "devices": ["cpu0"]})
        assert _wait_tasks(stack, [good], status="succeeded")
    finally:
        agent.stop()


def _model_with_unsupported_op() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Hardmax", ["h"], ["y"])],
        "unsupported",
        [x],
        [y],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _insert_task(stack: dict, node_id: str, kind: str, payload: dict) -> str:
    task_id = f"{time.time_ns():032x}"[-32:]
    with _db(stack) as db:
        db.execute(
            "INSERT INTO agent_tasks (id, kind, node_id, payload, status, attempts, created_at,"
            " updated_at) VALUES (%s, %s, %s, %s, 'queued', 0, now(), now())",
            (task_id, kind, node_id, json.dumps(payload)),
        )
    return task_id


def _wait_tasks(stack: dict, ids: list[str], status: str = "failed") -> dict[str, str]:
    found: dict[str, str] = {}

    def finished() -> bool:
        with _db(stack) as db:
            rows = db.execute(
                "SELECT id, status, error FROM agent_tasks WHERE id = ANY(%s)", (ids,)
            ).fetchall()
        found.clear()
        found.update({r[0]: r[2] or "" for r in rows if r[1] == status})
        return len(found) == len(ids)

    wait(finished, 180, f"tasks {status}")
    return found
