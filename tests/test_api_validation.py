"""The API's validation of what clients send (issue #30), over real HTTP: bounded lists,
sizes and numbers (422, never 500, and no memory blow-up), capped and timed request
bodies (413, 408), ids that never reach the database malformed (NUL bytes on PostgreSQL),
422 details that do not echo the input, UTC offsets on SQLite, and a valid OpenAPI
document. One API on SQLite and one on PostgreSQL, each started once for the module."""

from __future__ import annotations

import base64
import json
import socket
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from service import (
    api_server,
    job_body,
    postgres_database,
    sample_bytes,
    service_env,
    upload,
)

from app.migrate import upgrade
from remat.devices import parse_device, parse_size
from remat.errors import InvalidInputError

BODY_TIMEOUT_S = 2  # REMAT_BODY_TIMEOUT_S of the test servers
COST_MODEL_BYTES = 1 << 20  # REMAT_MAX_COST_MODEL_BYTES of the test servers
MiB = 1 << 20


def _server(data: Path, database: str) -> tuple[Any, str, str]:
    """The API under uvicorn on ``database`` (migrated), jobs on the embedded dispatcher;
    with the chain sample uploaded. (process, url, model id)"""
    upgrade(database)
    env = service_env(
        data_dir=str(data),
        database_url=database,
        body_timeout_s=str(BODY_TIMEOUT_S),
        max_cost_model_bytes=str(COST_MODEL_BYTES),
    )
    server, url = api_server(env, data / "api.log")
    with httpx.Client(base_url=url, timeout=60) as client:
        response = upload(client, sample_bytes("unet"), "unet.onnx")
    assert response.status_code == 201, response.text
    return server, url, response.json()["id"]


@pytest.fixture(scope="module")
def sqlite_api(tmp_path_factory):
    data = tmp_path_factory.mktemp("sqlite")
    server, url, model_id = _server(data, f"sqlite:///{data / 'remat.db'}")
    try:
        yield {"url": url, "model_id": model_id, "pid": server.popen.pid}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def postgres_api(tmp_path_factory):
    data = tmp_path_factory.mktemp("postgres")
    with postgres_database() as database:
        server, url, model_id = _server(data, database)
        try:
            yield {"url": url, "model_id": model_id}
        finally:
            server.stop()


@pytest.fixture(scope="module")
def server(sqlite_api):
    """The server conftest's ``client`` talks to."""
    return sqlite_api


@pytest.fixture
def model_id(sqlite_api):
    return sqlite_api["model_id"]


def _problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:2000]
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["status"] == status and body["detail"]
    return body


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _device(name: str = "cpu0", **options: Any) -> dict[str, Any]:
    return {"name": name, "kind": "cpu", "options": options}


# --- bounded lists and sizes --------------------------------------------------------------


def test_two_thousand_devices_are_refused_without_a_memory_blow_up(client, model_id, sqlite_api):
    devices = [_device(f"cpu{i}") for i in range(2000)]
    before = _rss_bytes(sqlite_api["pid"])
    body = _problem(client.post("/v1/jobs", json=job_body(model_id, devices=devices)), 422)
    assert "body.devices" in body["detail"] and "64" in body["detail"]
    assert _rss_bytes(sqlite_api["pid"]) - before < 200 * MiB


def test_a_cost_model_above_the_servers_limit_is_refused_before_it_is_built(client, model_id):
    devices = [_device(f"cpu{i}") for i in range(64)]  # unet: 135 nodes x 64^2 pairs > 1 MiB
    body = job_body(model_id, devices=devices, budgets={})
    detail = _problem(client.post("/v1/jobs", json=body), 422)["detail"]
    assert "cost model" in detail and "64 devices" in detail


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ({"batch": 2**62}, "body.batch"),
        ({"batch": 2**31}, "body.batch"),
        ({"budgets": {"cpu0": "1" * 30}}, "at most"),  # bytes, far above any device
        ({"budgets": {"cpu0": "1" * 33}}, "body.budgets.cpu0"),  # longer than a size
        ({"budgets": {"cpu0": "nan%"}}, "percentage"),
        ({"budgets": {f"cpu{i}": "1GiB" for i in range(65)}}, "body.budgets"),
        ({"inputs": {"x": [1] * 9}}, "body.inputs.x"),
        ({"inputs": {"x": [2**31]}}, "body.inputs.x.0"),
        ({"inputs": {"x": [2**30, 2**30]}}, "2**40 elements"),
        ({"strategy": "Bad Strategy"}, "body.strategy"),
        ({"strategy": "no_such_strategy"}, "unknown strategy"),
        ({"model_id": "a" * 65}, "body.model_id"),
    ],
)
def test_out_of_range_job_fields_get_422(client, model_id, overrides, where):
    body = job_body(model_id) | overrides
    assert where in _problem(client.post("/v1/jobs", json=body), 422)["detail"]


@pytest.mark.parametrize("number", ["Infinity", "NaN", "1e309"])
def test_non_finite_solver_numbers_get_422(client, model_id, number):
    for field in ("time_limit_s", "gap"):
        text = json.dumps(job_body(model_id)).replace('"time_limit_s": 5', f'"{field}": {number}')
        response = client.post(
            "/v1/jobs", content=text, headers={"content-type": "application/json"}
        )
        assert f"body.solver.{field}" in _problem(response, 422)["detail"]


def test_the_graph_of_a_batch_beyond_the_bound_gets_422(client, model_id):
    for batch in (2**62, 2**63, 2**64):
        response = client.get(f"/v1/models/{model_id}/graph", params={"batch": batch})
        assert "query.batch" in _problem(response, 422)["detail"]
    assert client.get(f"/v1/models/{model_id}/graph", params={"batch": 2}).status_code == 200


# --- device options -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ('{"flops": NaN}', "flops"),
        ('{"flops": "nan"}', "flops"),
        ('{"launch_us": 1e309}', "launch_us"),
        ('{"launch_us": "1e309"}', "launch_us"),
        ('{"flops": 1e30}', "flops"),
        ('{"bandwidth": -5}', "bandwidth"),
        ('{"launch_us": 0}', "launch_us"),
        ('{"threads": -1}', "threads"),
        ('{"threads": 100000}', "threads"),
        ('{"threads": "abc"}', "threads"),
        ('{"threads": true}', "threads"),
        ('{"colour": "red"}', "unknown device option"),
        ('{"host_bandwidth": 0}', "host_bandwidth"),  # a host link that moves nothing
        ('{"host_latency_us": -1}', "host_latency_us"),
    ],
)
def test_bad_device_options_get_422_naming_the_option(client, model_id, options, named):
    devices = f'[{{"name": "cpu0", "kind": "cpu", "options": {options}}}]'
    text = json.dumps(job_body(model_id)).replace('[{"name": "cpu0", "kind": "cpu"}]', devices)
    response = client.post("/v1/jobs", content=text, headers={"content-type": "application/json"})
    assert named in _problem(response, 422)["detail"]


def test_device_options_may_be_numbers(client, model_id):
    devices = [_device(threads=2, flops=2e11, launch_us=5)]
    body = job_body(model_id, devices=devices, strategy="checkpoint_all")
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    options = response.json()["spec"]["devices"][0]["options"]
    assert options["threads"] == "2" and float(options["flops"]) == 2e11


# --- request bodies -----------------------------------------------------------------------


def test_an_eleven_megabyte_json_body_gets_413_with_a_short_detail(client, model_id):
    text = json.dumps(job_body(model_id, strategy="x" * 11_000_000))
    response = client.post("/v1/jobs", content=text, headers={"content-type": "application/json"})
    body = _problem(response, 413)
    assert len(response.content) < 1000 and "10.0 MiB" in body["detail"]


def test_an_eleven_megabyte_chunked_body_gets_413(client, model_id):
    def chunks():  # no Content-Length: the server counts what arrives
        yield b'{"model_id": "' + model_id.encode() + b'", "strategy": "'
        for _ in range(11):
            yield b"x" * 1_000_000
        yield b'"}'

    response = client.post(
        "/v1/jobs", content=chunks(), headers={"content-type": "application/json"}
    )
    _problem(response, 413)


def test_422_details_do_not_echo_long_inputs(client, model_id):
    long = "q" * 100_000
    for body in (
        job_body(model_id, strategy=long),
        job_body(model_id, budgets={long: "1GiB"}),
        job_body(long),
        job_body(model_id, devices=[_device(**{long: "1"})]),
        job_body(model_id, inputs={long: [1]}),
    ):
        response = client.post("/v1/jobs", json=body)
        _problem(response, 422)
        assert len(response.content) < 4000 and "q" * 100 not in response.text
        for error in response.json().get("errors", []):
            assert set(error) == {"loc", "msg", "type"}  # no pydantic input or ctx


def test_a_stalled_partial_body_gets_408_or_a_closed_connection(sqlite_api):
    host, port = sqlite_api["url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        head = "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        raw.sendall(f"{head}Content-Length: 1000\r\n\r\n".encode() + b'{"model_id": ')
        raw.settimeout(BODY_TIMEOUT_S * 15)  # a server that never answers fails here
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert b"application/problem+json" in answer or answer == b""


# --- ids and cursors, on PostgreSQL (which refuses NUL bytes in strings) ------------------


ID_PATHS = [
    ("GET", "/v1/models/{}"),
    ("GET", "/v1/models/{}/graph"),
    ("DELETE", "/v1/models/{}"),
    ("GET", "/v1/jobs/{}"),
    ("POST", "/v1/jobs/{}/cancel"),
    ("GET", "/v1/jobs/{}/plan"),
    ("GET", "/v1/jobs/{}/schedule"),
    ("GET", "/v1/jobs/{}/baselines"),
    ("GET", "/v1/jobs/{}/progress"),
    ("GET", "/v1/jobs/{}/events"),
    ("GET", "/v1/jobs/{}/executions"),
    ("POST", "/v1/jobs/{}/executions"),
    ("GET", "/v1/nodes/{}"),
    ("GET", "/v1/profiles/{}"),
]


@pytest.mark.parametrize(("method", "path"), ID_PATHS)
def test_a_nul_byte_in_a_path_id_gets_4xx_on_postgresql(postgres_api, method, path):
    with httpx.Client(base_url=postgres_api["url"], timeout=60) as client:
        for bad in ("abc%00def", "%00"):
            response = client.request(method, path.format(bad), json={"node_id": "n"})
            assert response.status_code in (404, 422), response.text
            _problem(response, response.status_code)
        response = client.request(method, path.format("a" * 65), json={"node_id": "n"})
        assert response.status_code in (404, 422), response.text


def test_a_nul_byte_in_a_query_id_body_id_or_cursor_gets_422_on_postgresql(postgres_api):
    model_id = postgres_api["model_id"]
    nul_cursor = base64.urlsafe_b64encode(b"2026-01-01T00:00:00+00:00|ab\x00cd").decode()
    with httpx.Client(base_url=postgres_api["url"], timeout=60) as client:
        for path, params in [
            ("/v1/jobs", {"model_id": "a\x00b"}),
            ("/v1/profiles", {"model_id": "a\x00b"}),
            ("/v1/profiles", {"node_id": "a\x00b"}),
            ("/v1/jobs", {"cursor": "a\x00b"}),
            ("/v1/jobs", {"cursor": nul_cursor}),
            ("/v1/models", {"cursor": nul_cursor}),
            ("/v1/nodes", {"cursor": nul_cursor}),
            ("/v1/profiles", {"cursor": nul_cursor}),
        ]:
            _problem(client.get(path, params=params), 422)
        for body in (
            job_body("a\x00b"),
            job_body(model_id, costs={"node_id": "a\x00b"}),
            job_body(model_id, costs={"profile_id": "a\x00b"}),
            job_body(model_id, devices=[_device(model="a\x00b")]),
        ):
            _problem(client.post("/v1/jobs", json=body), 422)
        job = client.post("/v1/jobs", json=job_body(model_id, strategy="checkpoint_all"))
        assert job.status_code == 202, job.text
        executions = f"/v1/jobs/{job.json()['id']}/executions"
        _problem(client.post(executions, json={"node_id": "a\x00b"}), 422)


# --- responses ----------------------------------------------------------------------------


def test_timestamps_from_sqlite_carry_their_utc_offset(client, model_id, postgres_api):
    job = client.post("/v1/jobs", json=job_body(model_id, strategy="checkpoint_all")).json()
    stamps = [
        client.get(f"/v1/models/{model_id}").json()["created_at"],
        client.get("/v1/models").json()["items"][0]["created_at"],
        client.get(f"/v1/jobs/{job['id']}").json()["created_at"],
        client.get("/v1/jobs").json()["items"][0]["created_at"],
    ]
    with httpx.Client(base_url=postgres_api["url"], timeout=60) as pg:
        on_postgres = pg.get(f"/v1/models/{postgres_api['model_id']}").json()["created_at"]
    for stamp in stamps:
        assert datetime.fromisoformat(stamp).utcoffset() == timedelta(0), stamp
        assert stamp[-6:] == on_postgres[-6:] or stamp[-1:] == on_postgres[-1:] == "Z"


def test_the_openapi_document_is_valid_and_documents_problems(client):
    from openapi_spec_validator import validate

    document = client.get("/openapi.json").json()
    validate(document)
    assert "prefixItems" not in json.dumps(document)  # tuples, which some tools reject
    assert "Problem" in document["components"]["schemas"]
    get_job = document["paths"]["/v1/jobs/{job_id}"]["get"]["responses"]
    for status in ("401", "404", "422"):
        assert "application/problem+json" in get_job[status]["content"], status
    upload_model = document["paths"]["/v1/models"]["post"]["responses"]
    assert {"413", "415"} <= set(upload_model)


def test_event_streams_still_end_with_their_job(client, model_id):
    job = client.post("/v1/jobs", json=job_body(model_id, strategy="checkpoint_all")).json()
    seen = ""
    with client.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
        for chunk in stream.iter_text():
            seen += chunk
            if "event: end" in seen:
                break
    assert "event: progress" in seen and "event: end" in seen


# --- the same bounds in the library (the CLI) ---------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "c:cpu:threads=0",
        "c:cpu:threads=1025",
        "c:cpu:flops=nan",
        "c:cpu:flops=-1",
        "c:cpu:launch_us=1e309",
        "c:cpu:bandwidth=inf",
        "c:cpu:colour=red",
        "c:cuda:model=a\x00b",
    ],
)
def test_parse_device_refuses_unknown_and_absurd_options(spec):
    with pytest.raises(InvalidInputError):
        parse_device(spec)


@pytest.mark.parametrize(
    "text", ["1" * 30, str(2**60 + 1), "1" * 400 + ".5", "1073741825GiB", "1001%", "nan%", "inf%"]
)
def test_parse_size_refuses_sizes_beyond_any_device(text):
    with pytest.raises(InvalidInputError):
        parse_size(text)
    assert parse_size(str(2**60)).bytes == 2**60
