"""The embedded default: ``remat serve`` on SQLite under a data directory, with its own
dispatcher thread (no PostgreSQL, no Redis), and ``remat submit`` as its client: the
README's main command, end to end over real HTTP."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest
from service import BIN, ROOT, job_body, remat_serve, sample_bytes, service_env, upload, wait_job

from remat.plan import plan_from_json
from remat.solvers.runner import BACKENDS, DEFAULT_BACKEND
from remat.strategies import BASELINES, MULTI_DEVICE, OPTIMAL, STRATEGIES

SIZE_LIMITED = "size-limited license: at most 2000 variables and 2000 constraints"


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    data = tmp_path_factory.mktemp("embedded")
    env = service_env(data_dir=str(data), heartbeat_s="0.5")  # the local agent's
    server, url = remat_serve(env, data / "serve.log")
    try:
        yield env, url, server
    finally:
        server.stop()


def test_remat_serve_prints_its_url_and_uses_sqlite(embedded):
    env, url, server = embedded
    assert f"Remat serving on {url}" in server.output()
    assert "embedded worker" in server.output()
    assert (ROOT.parent / env["REMAT_DATA_DIR"] / "remat.db").exists()  # SQLite, no server
    assert httpx.get(f"{url}/readyz").json() == {"status": "ready"}


def test_the_console_shows_lifecycle_lines_not_every_request(embedded):
    """By default neither uvicorn's access log nor the local agent's HTTP requests (a
    heartbeat every 0.5 s here) reach the console; the agent's own lines do."""
    _, url, server = embedded
    server.wait_for_output("remat-agent local: node")
    httpx.get(f"{url}/readyz")
    time.sleep(2.0)  # a few heartbeats
    output = server.output()
    assert "remat.agent registered as node" in output  # the agent's own lines show
    assert "HTTP Request" not in output and "/v1/agent/heartbeat" not in output
    assert "GET /readyz" not in output


def test_verbose_serve_logs_every_request(tmp_path):
    env = service_env(data_dir=str(tmp_path), heartbeat_s="0.5")
    server, url = remat_serve(env, tmp_path / "serve.log", ROOT, "--verbose")
    try:
        server.wait_for_output("remat-agent local: node")
        server.wait_for_output("HTTP Request: POST")  # the agent's, through httpx
        server.wait_for_output("/v1/agent/heartbeat")
        httpx.get(f"{url}/readyz")
        server.wait_for_output('"GET /readyz HTTP/1.1" 200')  # uvicorn's access log
    finally:
        server.stop()


def test_strategies_and_backends_are_listed(embedded):
    _, url, _ = embedded
    answer = httpx.get(f"{url}/v1/strategies", timeout=60)
    assert answer.status_code == 200, answer.text
    listed = answer.json()
    strategies = {s["name"]: s for s in listed["strategies"]}
    assert list(strategies) == ["auto", *STRATEGIES]
    assert strategies["auto"]["kind"] == "auto"
    for name in STRATEGIES:
        entry = strategies[name]
        if name in OPTIMAL:
            assert entry["kind"] == "exact" and entry["uses_solver"], entry
        elif name in BASELINES:
            assert entry["kind"] == "baseline" and not entry["uses_solver"], entry
        else:
            assert entry["kind"] == "heuristic", entry
        assert entry["places_over_devices"] == (name in MULTI_DEVICE)
        assert entry["description"] and "\n" not in entry["description"]
    assert listed["default_strategy"] in strategies
    backends = {b["name"]: b for b in listed["backends"]}
    assert list(backends) == list(BACKENDS) and listed["default_backend"] == DEFAULT_BACKEND
    assert backends["highs"] == {"name": "highs", "available": True, "detail": ""}
    gurobi = backends["gurobi"]  # the wheel's own license is size-limited
    assert not gurobi["available"] or gurobi["detail"] in ("", SIZE_LIMITED), gurobi

    # a job accepts every strategy and available backend the list names
    with httpx.Client(base_url=url, timeout=60) as client:
        model = upload(client, sample_bytes("chain")).json()
        for name in ("auto", "greedy_evict"):
            body = job_body(model["id"], strategy=name, batch=2, budgets={"cpu0": "100%"})
            assert client.post("/v1/jobs", json=body).status_code == 202, name

    # and the OpenAPI document describes the answer
    document = httpx.get(f"{url}/openapi.json").json()
    operation = document["paths"]["/v1/strategies"]["get"]
    schema = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/StrategiesOut"}
    fields = document["components"]["schemas"]["StrategyInfo"]["properties"]
    assert {"name", "kind", "places_over_devices", "description"} <= set(fields)
    assert "available" in document["components"]["schemas"]["BackendInfo"]["properties"]


def test_remat_submit_runs_a_sample_job_to_its_plan(embedded):
    env, url, _ = embedded
    command = [
        str(BIN / "remat"),
        "submit",
        "--sample",
        "unet",
        "--server",
        url,
        "--batch",
        "4",
        "--budget",
        "cpu0=50%",
        "--strategy",
        "checkmate_milp",
        "--time-limit",
        "5",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "succeeded" in done.stdout and "strategy:   checkmate_milp" in done.stdout
    assert "peak" in done.stdout and "budget" in done.stdout


def test_the_same_job_end_to_end_in_embedded_mode(embedded):
    _, url, _ = embedded
    with httpx.Client(base_url=url, timeout=60) as client:
        model = upload(client, sample_bytes("resnet18")).json()
        job = client.post("/v1/jobs", json=job_body(model["id"])).json()
        done = wait_job(client, job["id"])
        assert done["status"] == "succeeded", done
        plan = plan_from_json(client.get(f"/v1/jobs/{job['id']}/plan").json())
        assert plan.predicted is not None
        assert plan.predicted.peak_bytes["cpu0"] <= plan.budgets["cpu0"]
        schedule = client.get(f"/v1/jobs/{job['id']}/schedule").json()
        assert max(schedule["memory"]["cpu0"]) == plan.predicted.peak_bytes["cpu0"]


def test_a_long_solve_does_not_hold_up_a_short_job(embedded):
    """The embedded worker runs two jobs at once (``REMAT_EMBEDDED_JOBS``): a job queued
    behind a long solve finishes while that solve runs."""
    _, url, _ = embedded
    with httpx.Client(base_url=url, timeout=60) as client:
        model = upload(client, sample_bytes("resnet18")).json()
        long_body = job_body(
            model["id"],
            strategy="checkmate_milp",
            solver={"backend": "highs", "time_limit_s": 300, "gap": 0},
        )
        long = client.post("/v1/jobs", json=long_body).json()
        wait_job(client, long["id"], {"running"})
        quick = job_body(model["id"], strategy="checkpoint_all", budgets={"cpu0": "100%"})
        short = client.post("/v1/jobs", json=quick)
        try:
            assert wait_job(client, short.json()["id"])["status"] == "succeeded"
            assert client.get(f"/v1/jobs/{long['id']}").json()["status"] == "running"
        finally:
            client.post(f"/v1/jobs/{long['id']}/cancel")
        assert wait_job(client, long["id"])["status"] == "cancelled"


def test_submit_reports_a_server_error_in_plain_words(embedded):
    env, url, _ = embedded
    command = [
        str(BIN / "remat"),
        "submit",
        "--sample",
        "chain",
        "--server",
        url,
        "--batch",
        "2",
        "--budget",
        "gpu7=1GiB",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "unknown device 'gpu7'" in done.stderr


def test_api_keys_once_created_are_required(tmp_path):
    env = service_env(data_dir=str(tmp_path))
    created = subprocess.run(
        [str(BIN / "remat"), "api-key", "create", "ci"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    server, url = remat_serve(env, tmp_path / "serve.log")
    try:
        refused = httpx.get(f"{url}/v1/jobs")
        assert refused.status_code == 401
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert httpx.get(f"{url}/v1/jobs", headers={"X-API-Key": key}).status_code == 200
        assert httpx.get(f"{url}/v1/jobs", headers={"X-API-Key": "rk_wrong"}).status_code == 401
        assert httpx.get(f"{url}/healthz").status_code == 200  # health needs no key
    finally:
        server.stop()
