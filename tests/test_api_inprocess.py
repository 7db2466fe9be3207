"""The API in process: ``create_app`` on a fresh SQLite database behind FastAPI's
TestClient, with a dispatcher that only records jobs (``conftest.RecordingDispatcher``; a
test that needs a plan solves them with the workers' ``solve_job``). No server, no
subprocess, no PostgreSQL or Redis: uploads, jobs (submit, get, list, cancel, idempotency),
problem+json errors, cursor pagination and ETags, in seconds. The same API with real
processes: tests/test_service.py, tests/test_api_validation.py."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from conftest import InProcessApi
from fastapi.testclient import TestClient
from service import job_body, problem

from app.cli import main as remat_main
from app.profiles import model_ref, profile_key
from app.schemas import JobSpec
from app.tables import ModelRow
from remat import samples
from remat.agent_protocol import ModelRef
from remat.costs import analytical_costs
from remat.devices import Device, DeviceKind
from remat.onnx_ingest import forward_graph
from remat.plan import plan_from_json
from remat.simulator import simulate
from remat.training import training_graph

CHAIN = samples.chain(n=4).SerializeToString()


def upload(client: TestClient, data: bytes, name: str = "model.onnx") -> Any:
    return client.post("/v1/models", files={"file": (name, data, "application/octet-stream")})


def uploaded(client: TestClient, data: bytes = CHAIN) -> str:
    response = upload(client, data)
    assert response.status_code in (200, 201), response.text
    return str(response.json()["id"])


def submitted(client: TestClient, model_id: str, **overrides: Any) -> dict[str, Any]:
    response = client.post("/v1/jobs", json=quick_job(model_id, **overrides))
    assert response.status_code == 202, response.text
    return dict(response.json())


def quick_job(model_id: str, **overrides: Any) -> dict[str, Any]:
    """A job a heuristic plans in milliseconds."""
    quick = {"batch": 2, "strategy": "chen_sqrt", "budgets": {"cpu0": "90%"}}
    return job_body(model_id, **(quick | overrides))


# --- uploads ---------------------------------------------------------------------------------


def test_an_upload_is_validated_stored_and_deduplicated(api: InProcessApi) -> None:
    client = api.client
    first = upload(client, CHAIN, "chain.onnx")
    assert first.status_code == 201, first.text
    model = first.json()
    assert first.headers["location"] == f"/v1/models/{model['id']}"
    assert model["sha256"] == hashlib.sha256(CHAIN).hexdigest()
    assert model["filename"] == "chain.onnx" and model["size_bytes"] == len(CHAIN)
    assert model["summary"]["nodes"] == 5  # MatMul and four activations
    assert model["summary"]["operators"] == {"MatMul": 1, "Relu": 2, "Tanh": 2}

    again = upload(client, CHAIN, "other-name.onnx")
    assert again.status_code == 200 and again.json()["id"] == model["id"]
    assert client.get(f"/v1/models/{model['id']}").json() == model
    assert [m["id"] for m in client.get("/v1/models").json()["items"]] == [model["id"]]

    graph = client.get(f"/v1/models/{model['id']}/graph", params={"batch": 2}).json()
    assert len(graph["nodes"]) > model["summary"]["nodes"]  # training: backward nodes too


def test_an_upload_that_is_not_a_model_is_refused(api: InProcessApi) -> None:
    assert "not a usable ONNX model" in problem(upload(api.client, b"not onnx"), 422)["detail"]
    truncated = upload(api.client, samples.truncated_bytes())
    problem(truncated, 422)
    assert api.client.get("/v1/models").json()["items"] == []


def test_an_upload_with_control_flow_is_refused_naming_every_such_node(
    api: InProcessApi,
) -> None:
    """Two ``If`` nodes: one 422 whose detail names both, and nothing stored."""
    from onnx import TensorProto, helper

    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["z"])],
        "branch",
        [],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4])],
    )
    nodes = [
        helper.make_node("If", ["c"], [f"y{i}"], then_branch=branch, else_branch=branch, name=n)
        for i, n in enumerate(("gate_a", "gate_b"))
    ]
    nodes.append(helper.make_node("Add", ["y0", "y1"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "two_ifs",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    detail = problem(upload(api.client, model.SerializeToString()), 422)["detail"]
    assert "If x2" in detail and "gate_a" in detail and "gate_b" in detail
    assert api.client.get("/v1/models").json()["items"] == []


def test_an_upload_without_a_file_is_refused(api: InProcessApi) -> None:
    form = api.client.post("/v1/models", data={"file": "not a file"})
    assert "multipart/form-data" in problem(form, 415)["detail"]
    other = {"other": ("chain.onnx", CHAIN, "application/octet-stream")}
    assert "'file'" in problem(api.client.post("/v1/models", files=other), 422)["detail"]


@pytest.mark.parametrize("api", [{"max_upload_bytes": 1000}], indirect=True)
def test_an_upload_above_the_limit_is_refused(api: InProcessApi) -> None:
    problem(upload(api.client, CHAIN + b"\0" * 2_000_000), 413)
    assert api.client.get("/v1/models").json()["items"] == []


def test_a_model_used_by_a_job_cannot_be_deleted(api: InProcessApi) -> None:
    client = api.client
    used, unused = uploaded(client), uploaded(client, samples.chain(n=2).SerializeToString())
    submitted(client, used)
    assert "used by jobs" in problem(client.delete(f"/v1/models/{used}"), 409)["detail"]
    assert client.delete(f"/v1/models/{unused}").status_code == 204
    problem(client.get(f"/v1/models/{unused}"), 404)
    problem(client.delete(f"/v1/models/{unused}"), 404)


# --- jobs ----------------------------------------------------------------------------------


def test_a_job_is_committed_then_handed_to_the_dispatcher(api: InProcessApi) -> None:
    client = api.client
    model_id = uploaded(client)
    response = client.post("/v1/jobs", json=quick_job(model_id))
    assert response.status_code == 202, response.text
    job = response.json()
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["status"] == "queued" and job["model_id"] == model_id
    assert job["spec"]["strategy"] == "chen_sqrt" and job["attempts"] == 0
    assert api.dispatcher.enqueued == [job["id"]]
    fetched = client.get(f"/v1/jobs/{job['id']}").json()
    assert fetched["id"] == job["id"] and fetched["status"] == "queued"


def test_a_job_is_solved_and_its_plan_served(api: InProcessApi) -> None:
    client = api.client
    job = submitted(client, uploaded(client))
    api.dispatcher.run()
    done = client.get(f"/v1/jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    assert done["attempts"] == 1 and done["finished_at"] is not None
    plan = client.get(f"/v1/jobs/{job['id']}/plan")
    assert plan.status_code == 200 and plan.json()["steps"]
    schedule = client.get(f"/v1/jobs/{job['id']}/schedule").json()
    assert set(schedule["R"]) == {"cpu0"} and schedule["R"]["cpu0"]
    with client.stream("GET", f"/v1/jobs/{job['id']}/events") as events:
        text = "".join(events.iter_text())
    assert "event: progress" in text and text.rstrip().endswith('{"status": "succeeded"}')


def test_an_offloading_job_serves_a_version_2_plan(api: InProcessApi) -> None:
    client = api.client
    job = submitted(client, uploaded(client), strategy="offload_greedy", budgets={"cpu0": "60%"})
    api.dispatcher.run()
    done = client.get(f"/v1/jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    plan = client.get(f"/v1/jobs/{job['id']}/plan").json()
    assert plan["version"] == 2 and plan["strategy"] == "offload_greedy"
    ops = {step["op"] for step in plan["steps"]}
    assert {"offload", "prefetch", "wait"} <= ops
    assert plan["predicted"]["transfer_ms"] > 0
    assert plan["solver"]["bound"] <= plan["predicted"]["total_ms"]


def test_a_paging_job_serves_a_version_3_plan_and_its_lane(api: InProcessApi) -> None:
    """A storage as fast as memory: paging alone costs the ideal, so port pages."""
    client = api.client
    fast = {"storage_write_bandwidth": 1e15, "storage_read_bandwidth": 1e15}
    devices = [{"name": "cpu0", "kind": "cpu", "options": fast | {"storage_latency_us": 0}}]
    job = submitted(
        client, uploaded(client), strategy="port", devices=devices, budgets={"cpu0": "60%"}
    )
    api.dispatcher.run()
    done = client.get(f"/v1/jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    plan = client.get(f"/v1/jobs/{job['id']}/plan").json()
    assert plan["version"] == 3 and plan["strategy"] == "port"
    assert {"page_out", "page_in", "wait"} <= {step["op"] for step in plan["steps"]}
    schedule = client.get(f"/v1/jobs/{job['id']}/schedule").json()
    kinds = {span["kind"] for span in schedule["transfers"]["cpu0"]}
    assert kinds == {"page_out", "page_in"}
    slow = [{"name": "cpu0", "kind": "cpu", "options": {"storage_read_bandwidth": 0}}]
    refused = client.post("/v1/jobs", json=quick_job(uploaded(client), devices=slow))
    assert refused.status_code == 422
    assert "storage_read_bandwidth" in refused.json()["detail"]


def test_a_job_minimises_the_energy_it_asks_for(api: InProcessApi) -> None:
    client = api.client
    devices = [{"name": "cpu0", "kind": "cpu"}, {"name": "gpu0", "kind": "cuda"}]
    body = quick_job(
        uploaded(client),
        strategy="xengine",
        devices=devices,
        budgets={},
        objective={"kind": "energy", "power_caps_w": {"gpu0": 300}, "board_w": 5},
    )
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    api.dispatcher.run()
    done = client.get(f"/v1/jobs/{job_id}").json()
    assert done["status"] == "succeeded", done
    assert done["spec"]["objective"]["kind"] == "energy"
    plan = client.get(f"/v1/jobs/{job_id}/plan").json()
    energy = plan["predicted"]["energy_mj"]
    # the incumbent and the bound are the objective's, in mJ: the plan's energy, not its time
    assert done["progress"]["incumbent_ms"] == pytest.approx(energy)
    assert plan["solver"]["bound"] <= energy * (1 + 1e-6)
    schedule = client.get(f"/v1/jobs/{job_id}/schedule").json()
    assert schedule["energy_mj"] == pytest.approx(energy)
    assert schedule["predicted_ms"] == pytest.approx(plan["predicted"]["total_ms"])
    baselines = client.get(f"/v1/jobs/{job_id}/baselines").json()["items"]
    assert any(item["energy_mj"] for item in baselines)
    offloading = [b for b in baselines if b["strategy"] == "offload_greedy"]
    assert offloading and offloading[0]["note"].startswith("n/a")


@pytest.mark.parametrize(
    ("objective", "words"),
    [
        ({"kind": "weighted"}, "alpha is given with the weighted objective"),
        ({"kind": "energy", "alpha": 0.5}, "alpha is given with the weighted objective"),
        ({"kind": "joules"}, "body.objective.kind"),
        ({"power_caps_w": {"cpu0": -1}}, "body.objective.power_caps_w.cpu0"),
        ({"power_caps_w": {"gpu3": 100}}, "power cap for unknown device 'gpu3'"),
        ({"power_caps_w": {"cpu0": 5}}, "is below its idle power"),
        ({"board_cap_w": 1e12}, "body.objective.board_cap_w"),
        ({"kind": "energy", "time_cap_ms": 0}, "body.objective.time_cap_ms"),
    ],
)
def test_an_objective_no_plan_can_meet_is_refused(
    api: InProcessApi, objective: dict[str, Any], words: str
) -> None:
    body = quick_job(uploaded(api.client), objective=objective)
    assert words in problem(api.client.post("/v1/jobs", json=body), 422)["detail"]
    assert api.dispatcher.enqueued == []
    assert api.client.get("/v1/jobs").json()["items"] == []


def test_a_job_differentiates_the_loss_it_names(api: InProcessApi) -> None:
    client = api.client
    body = quick_job(uploaded(client)) | {"loss": {"kind": "cross_entropy", "axis": 1}}
    job = client.post("/v1/jobs", json=body)
    assert job.status_code == 202, job.text
    assert job.json()["spec"]["loss"] == {"kind": "cross_entropy", "output": None, "axis": 1}
    api.dispatcher.run()
    assert client.get(f"/v1/jobs/{job.json()['id']}").json()["status"] == "succeeded"
    plan = client.get(f"/v1/jobs/{job.json()['id']}/plan").json()
    assert plan["steps"]


def test_a_job_plans_attention_as_one_node_unless_asked_not_to(api: InProcessApi) -> None:
    client = api.client
    model = uploaded(client, samples.transformer_block(batch=2).SerializeToString())
    url = f"/v1/models/{model}/graph"
    fused, unfused = (
        client.get(url, params={"fuse_attention": fuse}).json() for fuse in (True, False)
    )
    ops = {n["op"] for n in fused["nodes"]}
    assert "ScaledDotProductAttention" in ops and "Softmax" not in ops
    assert "Softmax" in {n["op"] for n in unfused["nodes"]}
    quick = {"strategy": "checkpoint_all", "budgets": {}}
    jobs = [
        submitted(client, model, **quick),
        submitted(client, model, fuse_attention=False, **quick),
    ]
    assert [job["spec"]["fuse_attention"] for job in jobs] == [True, False]  # fused by default
    api.dispatcher.run()
    nodes = []
    for job in jobs:
        assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "succeeded"
        schedule = client.get(f"/v1/jobs/{job['id']}/schedule").json()
        nodes.append(len(schedule["nodes"]))
    assert nodes == [len(fused["nodes"]), len(unfused["nodes"])] and nodes[0] < nodes[1]
    # an agent rebuilds the fused job's graph from the reference the server sends it
    spec = JobSpec.model_validate(jobs[0]["spec"])
    sent = model_ref(spec, ModelRow(id=model, sha256="0")).model_dump_json()
    ref = ModelRef.model_validate_json(sent)
    rebuilt = ref.graph(samples.transformer_block(batch=2))
    assert [n.name for n in rebuilt.nodes] == [n["name"] for n in fused["nodes"]]
    # a profile of one graph is not found for the other
    unfused_ref = model_ref(JobSpec.model_validate(jobs[1]["spec"]), ModelRow(id=model, sha256="0"))
    assert profile_key(ref, []) != profile_key(unfused_ref, [])
    # a model without attention is the same graph either way: its profiles keep their key
    cnn = ModelRow(id=model, sha256="0", summary={"operators": {"Conv": 3, "Relu": 3}})
    cnn_ref = model_ref(spec, cnn)
    assert spec.fuse_attention and not cnn_ref.fuse_attention
    assert profile_key(cnn_ref, []) == profile_key(unfused_ref, [])


def test_a_queued_job_is_cancelled_at_once(api: InProcessApi) -> None:
    client = api.client
    job = submitted(client, uploaded(client))
    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled" and cancelled.json()["cancel_requested"]
    again = client.post(f"/v1/jobs/{job['id']}/cancel")  # finished: nothing changes
    assert again.status_code == 200 and again.json() == cancelled.json()
    api.dispatcher.run()  # a worker that gets the message anyway leaves it cancelled
    assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"
    problem(client.get(f"/v1/jobs/{job['id']}/plan"), 404)


def test_the_same_idempotency_key_gives_the_same_job(api: InProcessApi) -> None:
    client = api.client
    model_id = uploaded(client)
    key = {"Idempotency-Key": "submit-1"}
    first = client.post("/v1/jobs", json=quick_job(model_id), headers=key)
    second = client.post("/v1/jobs", json=quick_job(model_id), headers=key)
    assert first.status_code == second.status_code == 202
    assert first.json()["id"] == second.json()["id"]
    assert api.dispatcher.enqueued == [first.json()["id"]]
    other = client.post("/v1/jobs", json=quick_job(model_id, batch=3), headers=key)
    assert "Idempotency-Key" in problem(other, 422)["detail"]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"model_id": "nosuchmodel"}, "does not exist"),
        ({"budgets": {"gpu7": "50%"}}, "gpu7"),
        ({"strategy": "no_such_strategy"}, "strategy"),
        ({"solver": {"backend": "highs", "time_limit_s": 1e9}}, "time_limit_s"),
        ({"loss": {"kind": "cross_entropy", "output": "nope"}}, "does not have; its outputs"),
        ({"loss": {"kind": "output"}}, "not a scalar"),
        ({"loss": {"kind": "hinge"}}, "loss.kind"),
    ],
)
def test_a_job_the_server_cannot_run_is_refused(
    api: InProcessApi, overrides: dict[str, Any], words: str
) -> None:
    model_id = uploaded(api.client)
    body = quick_job(model_id) | overrides
    assert words in problem(api.client.post("/v1/jobs", json=body), 422)["detail"]
    assert api.dispatcher.enqueued == []
    assert api.client.get("/v1/jobs").json()["items"] == []


def test_jobs_are_listed_newest_first_and_filtered(api: InProcessApi) -> None:
    client = api.client
    chain, other = uploaded(client), uploaded(client, samples.chain(n=2).SerializeToString())
    first, second = submitted(client, chain), submitted(client, other)
    client.post(f"/v1/jobs/{first['id']}/cancel")
    listed = client.get("/v1/jobs").json()
    assert [j["id"] for j in listed["items"]] == [second["id"], first["id"]]
    assert listed["next_cursor"] is None

    def ids(**query: str) -> list[str]:
        return [j["id"] for j in client.get("/v1/jobs", params=query).json()["items"]]

    assert ids(status="cancelled") == [first["id"]]
    assert ids(status="queued") == [second["id"]]
    assert ids(model_id=other) == [second["id"]]
    assert ids(status="succeeded") == []
    problem(client.get("/v1/jobs", params={"status": "lost"}), 422)


# --- problem+json ------------------------------------------------------------------------------


def test_errors_are_problem_documents(api: InProcessApi) -> None:
    client = api.client
    missing = problem(client.get("/v1/jobs/nosuchjob"), 404)
    assert missing["title"] == "Not Found" and missing["instance"] == "/v1/jobs/nosuchjob"
    assert "nosuchjob" in missing["detail"]
    problem(client.get("/v1/no/such/route"), 404)
    problem(client.delete("/v1/jobs"), 405)

    malformed = problem(client.post("/v1/jobs", json={"model_id": "x", "batch": -1}), 422)
    errors = malformed["errors"]
    assert errors and all(set(e) == {"loc", "msg", "type"} for e in errors)  # never the input
    assert ["body", "batch"] in [e["loc"] for e in errors]
    unparsable = client.post(
        "/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "JSON" in problem(unparsable, 422)["detail"]


def test_a_malformed_id_never_reaches_the_database(api: InProcessApi) -> None:
    for path in ("/v1/jobs/bad%00id", "/v1/jobs/" + "x" * 65, "/v1/models/a%20b/graph"):
        problem(api.client.get(path), 422)


def test_once_an_api_key_exists_it_is_required(
    api: InProcessApi, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model_id = uploaded(api.client)
    monkeypatch.setenv("REMAT_DATA_DIR", str(api.settings.data_dir))
    assert remat_main(["api-key", "create", "tests"]) == 0
    key = capsys.readouterr().out.strip()
    assert "X-API-Key" in problem(api.client.get(f"/v1/models/{model_id}"), 401)["detail"]
    problem(api.client.get("/v1/jobs", headers={"X-API-Key": "rk_wrong"}), 401)
    assert api.client.get(f"/v1/models/{model_id}", headers={"X-API-Key": key}).status_code == 200
    assert api.client.get("/healthz").status_code == 200  # health needs no key


# --- pagination ----------------------------------------------------------------------------


def test_cursor_pagination_walks_every_model_once(api: InProcessApi) -> None:
    client = api.client
    ids = {uploaded(client, samples.chain(n=n).SerializeToString()) for n in range(1, 8)}
    everything = [m["id"] for m in client.get("/v1/models").json()["items"]]
    assert set(everything) == ids

    walked: list[str] = []
    cursor = None
    for _ in range(len(ids)):
        params: dict[str, Any] = {"limit": 3} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/models", params=params).json()
        assert len(page["items"]) <= 3
        walked += [m["id"] for m in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert walked == everything  # newest first, each once, in pages of 3 (3, 3, 1)
    problem(client.get("/v1/models", params={"cursor": "bm90LWEtY3Vyc29y"}), 422)
    for limit in (0, 201):
        problem(client.get("/v1/models", params={"limit": limit}), 422)


def test_job_pages_follow_their_cursor(api: InProcessApi) -> None:
    client = api.client
    model_id = uploaded(client)
    jobs = [submitted(client, model_id)["id"] for _ in range(5)]
    first = client.get("/v1/jobs", params={"limit": 2}).json()
    assert [j["id"] for j in first["items"]] == [jobs[4], jobs[3]]
    rest = client.get("/v1/jobs", params={"limit": 10, "cursor": first["next_cursor"]}).json()
    assert [j["id"] for j in rest["items"]] == [jobs[2], jobs[1], jobs[0]]
    assert rest["next_cursor"] is None


# --- ETags -----------------------------------------------------------------------------------


def test_a_job_has_an_etag_that_changes_with_it(api: InProcessApi) -> None:
    client = api.client
    job = submitted(client, uploaded(client))
    path = f"/v1/jobs/{job['id']}"
    first = client.get(path)
    etag = first.headers["etag"]
    assert etag.startswith('"') and etag.endswith('"')
    for tag in (etag, f"W/{etag}", '"other", ' + etag, "*"):
        unchanged = client.get(path, headers={"If-None-Match": tag})
        assert unchanged.status_code == 304 and unchanged.headers["etag"] == etag
        assert unchanged.content == b""
    assert client.get(path, headers={"If-None-Match": '"other"'}).status_code == 200

    client.post(f"{path}/cancel")
    changed = client.get(path, headers={"If-None-Match": etag})
    assert changed.status_code == 200 and changed.json()["status"] == "cancelled"
    assert changed.headers["etag"] != etag


def test_a_job_list_has_an_etag_that_changes_with_its_jobs(api: InProcessApi) -> None:
    client = api.client
    model_id = uploaded(client)
    submitted(client, model_id)
    etag = client.get("/v1/jobs").headers["etag"]
    assert client.get("/v1/jobs", headers={"If-None-Match": etag}).status_code == 304

    newer = submitted(client, model_id)
    listed = client.get("/v1/jobs", headers={"If-None-Match": etag})
    assert listed.status_code == 200 and listed.json()["items"][0]["id"] == newer["id"]
    etag = listed.headers["etag"]
    client.post(f"/v1/jobs/{newer['id']}/cancel")
    assert client.get("/v1/jobs", headers={"If-None-Match": etag}).status_code == 200


# --- jobs over ranges of input sizes -----------------------------------------------------

TRANSFORMER = samples.transformer_block(layers=2, seq="S").SerializeToString()
RANGED = {  # budgets calibrated on the attention node by node
    "fuse_attention": False,
    "ranges": {"input": "2x16..128x32"},
    "observed": [{"size": 24, "count": 50}, {"size": 100, "count": 5}],
}


def test_a_job_over_a_range_of_sizes_serves_a_plan_per_size(api: InProcessApi) -> None:
    client = api.client
    body = {**RANGED, "strategy": "greedy_evict", "budgets": {"cpu0": "75%"}}
    job = submitted(client, uploaded(client, TRANSFORMER), **body)
    api.dispatcher.run()
    done = client.get(f"/v1/jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    assert "a plan family over sizes 16..128" in done["message"]
    largest = client.get(f"/v1/jobs/{job['id']}/plan")
    assert largest.status_code == 200 and "x-remat-plan-cache" not in largest.headers
    stored = client.get(f"/v1/jobs/{job['id']}/plan", params={"input": "2x128x32"})
    assert stored.headers["x-remat-plan-cache"] == "hit"
    assert stored.json() == largest.json()  # the largest size's plan is the job's plan
    missed = client.get(f"/v1/jobs/{job['id']}/plan", params={"input": "2x50x32"})
    assert missed.status_code == 200 and missed.headers["x-remat-plan-cache"] == "miss"
    again = client.get(f"/v1/jobs/{job['id']}/plan", params={"input": "2x50x32"})
    assert again.headers["x-remat-plan-cache"] == "hit" and again.json() == missed.json()
    plan = plan_from_json(missed.json())
    graph = training_graph(
        forward_graph(
            samples.transformer_block(layers=2), inputs={"input": (2, 50, 32)}, fuse_attention=False
        )
    )
    costs = analytical_costs(graph, [Device("cpu0", DeviceKind.CPU)])
    verdict = simulate(plan, graph, costs)
    assert verdict.valid and verdict.peak_bytes["cpu0"] <= plan.budgets["cpu0"]
    assert plan.predicted.total_ms == pytest.approx(verdict.total_ms)  # at size 50
    family = client.get(f"/v1/jobs/{job['id']}/family").json()
    buckets = family["buckets"]
    assert (buckets[0]["low"], buckets[-1]["high"]) == (16, 128)
    sizes = {row["size"]: row for row in family["sizes"]}
    assert sizes[50]["hits"] == 1 and sizes[128]["hits"] == 1
    assert sizes[50]["predicted_ms"] == pytest.approx(verdict.total_ms)
    assert all(row["peak_bytes"] <= family["budget_bytes"] for row in family["sizes"])
    one_shape = submitted(client, uploaded(client))
    api.dispatcher.run()
    assert client.get(f"/v1/jobs/{one_shape['id']}/family").status_code == 404


@pytest.mark.parametrize(
    ("query", "detail"),
    [
        ({"input": "2x300x32"}, "outside the job's range 16..128"),
        ({"input": "2x50x31"}, "dimension 31 where the job has 32"),
        ({"other": "2x50x32"}, "unknown inputs: other"),
    ],
)
def test_sizes_a_family_cannot_serve_are_refused(api: InProcessApi, query, detail) -> None:
    client = api.client
    body = {**RANGED, "strategy": "greedy_evict", "budgets": {"cpu0": "90%"}}
    job = submitted(client, uploaded(client, TRANSFORMER), **body)
    api.dispatcher.run()
    answer = client.get(f"/v1/jobs/{job['id']}/plan", params=query)
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    assert detail in answer.json()["detail"]


def test_a_job_of_one_shape_takes_no_sizes(api: InProcessApi) -> None:
    client = api.client
    job = submitted(client, uploaded(client))
    api.dispatcher.run()
    answer = client.get(f"/v1/jobs/{job['id']}/plan", params={"input": "2x4"})
    assert answer.status_code == 422 and "has one input shape" in answer.json()["detail"]


@pytest.mark.parametrize(
    ("overrides", "detail"),
    [
        ({"ranges": {"input": "2x128..16x32"}}, "is empty"),
        ({"ranges": {"input": "2x16..128x32"}, "inputs": {"input": [2, 16, 32]}}, "both"),
        ({"observed": [{"size": 20, "count": 3}]}, "observed sizes need ranges"),
        ({**RANGED, "observed": [{"size": 500, "count": 1}]}, "outside the range"),
        (
            {**RANGED, "observed": [{"size": 20, "share": 0.5}, {"size": 40, "share": 0.4}]},
            "the observed shares sum to 0.9, not 1",
        ),
        ({**RANGED, "observed": [{"size": 20, "count": 2, "share": 0.5}]}, "a count or a share"),
        ({**RANGED, "observed": [{"size": 20, "count": 2}] * 2}, "given more than once"),
        ({**RANGED, "costs": {"profile_id": "0" * 32}}, "analytical"),
        ({"ranges": {"input": "2x16x16..32"}}, "dimension 2 is 32 in the model, not symbolic"),
    ],
)
def test_bad_ranges_are_refused_at_submit(api: InProcessApi, overrides, detail) -> None:
    client = api.client
    model_id = uploaded(client, TRANSFORMER)
    answer = client.post("/v1/jobs", json=quick_job(model_id, **overrides))
    assert answer.status_code == 422, answer.text
    assert detail in answer.text


def test_a_job_on_two_devices_sharing_a_pool_takes_the_pools_budget(api: InProcessApi) -> None:
    client = api.client
    devices = [
        {"name": "cpu0", "kind": "cpu", "options": {"pool": "ram"}},
        {"name": "gpu0", "kind": "cuda", "options": {"pool": "ram"}},
    ]
    job = submitted(
        client, uploaded(client), strategy="greedy_evict", devices=devices, budgets={"ram": "80%"}
    )
    api.dispatcher.run()
    done = client.get(f"/v1/jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    plan = client.get(f"/v1/jobs/{job['id']}/plan").json()
    budgets = {d["budget_bytes"] for d in plan["devices"]}
    assert len(budgets) == 1 and all(d["options"]["pool"] == "ram" for d in plan["devices"])
    body = quick_job(uploaded(client), devices=devices, budgets={"cpu0": "80%"})
    refused = client.post("/v1/jobs", json=body)
    assert refused.status_code == 422 and "shares pool 'ram'" in refused.json()["detail"]


@pytest.mark.alone
def test_auto_plans_two_cpus_sharing_a_pool_concurrently(api: InProcessApi) -> None:
    """The default strategy on a pool plans with PORT-M: the two CPUs compute at once, and
    the stored plan says so (version 4, concurrent), within the pool's budget."""
    client = api.client
    devices = [
        {"name": "cpu0", "kind": "cpu", "options": {"pool": "ram", "threads": "2"}},
        {"name": "cpu1", "kind": "cpu", "options": {"pool": "ram", "threads": "2"}},
    ]
    job = submitted(
        client,
        uploaded(client),
        strategy="auto",
        devices=devices,
        budgets={"ram": "70%"},
        # room for PORT-M's MILP after auto's earlier phases on a slow machine (it ends as
        # soon as the MILP is optimal)
        solver={"backend": "highs", "time_limit_s": 60},
    )
    api.dispatcher.run()
    done = client.get(f"/v1/jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    plan = client.get(f"/v1/jobs/{job['id']}/plan").json()
    assert plan["version"] == 4 and plan["concurrent"] is True and plan["strategy"] == "port_m"
    assert plan["predicted"]["peak_bytes"]["cpu0"] <= plan["devices"][0]["budget_bytes"]


REGIME = [
    {"name": "cpu0", "kind": "cpu", "options": {"threads": "12"}},
    {"name": "cuda0", "kind": "cuda", "options": {"flops": "2e12", "bandwidth": "60e9"}},
]


def test_a_job_starts_from_the_plans_of_earlier_jobs_of_its_model(api: InProcessApi) -> None:
    """XEngine on two devices with no time to search (0.05 s: its warm start alone) ends
    at the plan an earlier one-device job of the model stored, and says so; with
    ``reuse_plans`` off it ends above it."""
    client = api.client
    model_id = uploaded(client, samples.resnet18(batch=4).SerializeToString())
    budgets = {"cpu0": "55%", "cuda0": "55%"}
    regime: dict[str, Any] = {"devices": REGIME, "budgets": budgets}
    earlier = submitted(client, model_id, strategy="greedy_evict", **regime)
    api.dispatcher.run()
    quick = {"backend": "highs", "time_limit_s": 0.05}
    reused = submitted(client, model_id, strategy="xengine", solver=quick, **regime)
    fresh = submitted(
        client, model_id, strategy="xengine", solver=quick | {"reuse_plans": False}, **regime
    )
    api.dispatcher.run()
    plans = {}
    for name, job in {"earlier": earlier, "reused": reused, "fresh": fresh}.items():
        done = client.get(f"/v1/jobs/{job['id']}").json()
        assert done["status"] == "succeeded", done
        plans[name] = client.get(f"/v1/jobs/{job['id']}/plan").json()
    assert plans["reused"]["steps"] == plans["earlier"]["steps"]
    total = {name: plan["predicted"]["total_ms"] for name, plan in plans.items()}
    assert total["reused"] == pytest.approx(total["earlier"]) and total["fresh"] > total["earlier"]
    message = client.get(f"/v1/jobs/{reused['id']}").json()["message"]
    assert f"no plan cheaper than job {earlier['id']}'s was found" in message
