"""The web dashboard in a real browser: headless Chromium (Debian's ``chromium`` package)
driven by Playwright against ``remat serve`` started here (embedded SQLite and worker).
The pages are used as a person would: upload a model, submit a job from the form, watch
it finish, read the schedule and memory charts (checked against the API's numbers),
cancel a running job, see API errors in plain words, move with the keyboard, and fit
wide and narrow screens. Every test fails on a console error or an uncaught exception.

Screenshots of each page go to ``$REMAT_TEST_OUTPUT/dashboard`` (default
``test-output/dashboard`` under the repository root)."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, expect, sync_playwright
from service import (
    BIN,
    ROOT,
    Process,
    free_port,
    job_body,
    profiled_table,
    sample_bytes,
    service_env,
    upload,
    wait_job,
    wait_ready,
)

from remat import samples

CHROMIUM = Path(os.environ.get("REMAT_CHROMIUM", "/usr/bin/chromium"))
# This machine's network is closed: nothing in the browser may try to reach out.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
OUTPUT = Path(os.environ.get("REMAT_TEST_OUTPUT", ROOT / "test-output")) / "dashboard"
ENROLL = "dashboard-enroll"
WAIT_MS = 60_000  # a job's solve on this 2-core machine, with room
TWO_CPUS = [
    {"name": "cpu0", "kind": "cpu", "options": {}},
    {"name": "cpu1", "kind": "cpu", "options": {}},
]


@dataclass
class Server:
    url: str
    env: dict[str, str]
    process: Process
    client: httpx.Client
    found: dict[str, Any] = field(default_factory=dict)  # what earlier tests made

    def need(self, key: str) -> Any:
        """What an earlier test in this file made: the tests build on each other in order."""
        if key not in self.found:
            pytest.fail(f"{key!r} comes from an earlier test: run the whole file")
        return self.found[key]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("dashboard")
    env = service_env(data_dir=str(data), enroll_token=ENROLL, progress_interval_s="0.25")
    port = free_port()
    # no local agent: the executions test plays a node's agent itself
    command = [str(BIN / "remat"), "serve", "--port", str(port), "--no-agent"]
    process = Process(command, env, data / "serve.log")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process)
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield Server(url, env, process, client)
    finally:
        process.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(
            f"no Chromium at {CHROMIUM}: the dashboard tests need Debian's browser "
            "(apt-get install -y chromium; .ci/run installs it), or REMAT_CHROMIUM=PATH"
        )
    OUTPUT.mkdir(parents=True, exist_ok=True)
    print(f"dashboard screenshots: {OUTPUT}")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@dataclass
class Ui:
    """A browser tab on the server, with what its console said."""

    page: Page
    url: str
    errors: list[str] = field(default_factory=list)
    allowed: list[str] = field(default_factory=list)  # errors a test provokes on purpose

    def go(self, route: str) -> None:
        self.page.goto(f"{self.url}/{route}")

    def shot(self, name: str) -> None:
        self.page.screenshot(path=OUTPUT / f"{name}.png", full_page=True)

    def unexpected_errors(self) -> list[str]:
        return [e for e in self.errors if not any(a in e for a in self.allowed)]


def _watch(page: Page, url: str) -> Ui:
    ui = Ui(page, url)

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            ui.errors.append(f"console: {message.text}")

    page.on("console", on_console)
    page.on("pageerror", lambda error: ui.errors.append(f"uncaught: {error}"))
    return ui


@pytest.fixture
def ui(browser: Browser, server: Server) -> Iterator[Ui]:
    context = browser.new_context(viewport={"width": 1280, "height": 800}, accept_downloads=True)
    context.set_default_timeout(15_000)
    watched = _watch(context.new_page(), server.url)
    try:
        yield watched
        assert watched.unexpected_errors() == [], "the browser console reported errors"
    finally:
        context.close()


# A file dropped on an element, as a browser delivers a drag from the desktop.
DROP = """(zone, [name, data]) => {
    const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
    const transfer = new DataTransfer();
    transfer.items.add(new File([bytes], name));
    const options = {dataTransfer: transfer, bubbles: true, cancelable: true};
    zone.dispatchEvent(new DragEvent("drop", options));
}"""

# WCAG 2 contrast of every rendered text against its nearest opaque background: 4.5:1,
# or 3:1 for large text. Charts (SVG) and disabled controls are left out.
LOW_CONTRAST = """() => {
    const rgba = (css) => {
        const m = css.match(/rgba?\\(([^)]+)\\)/);
        if (!m) return null;
        const [r, g, b, a = 1] = m[1].split(/[\\s,/]+/).filter(Boolean).map(Number);
        return {r, g, b, a};
    };
    const luminance = ({r, g, b}) => {
        const f = (v) => (v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
        return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
    };
    const background = (element) => {
        for (let e = element; e; e = e.parentElement) {
            const c = rgba(getComputedStyle(e).backgroundColor);
            if (c && c.a > 0.5) return c;
        }
        return {r: 255, g: 255, b: 255, a: 1};
    };
    const failures = [];
    const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
    while (walker.nextNode()) {
        const text = walker.currentNode.textContent.trim();
        const element = walker.currentNode.parentElement;
        if (!text || element.closest("svg, noscript, option, button:disabled")) continue;
        if (element.getClientRects().length === 0) continue;  // not rendered
        const style = getComputedStyle(element);
        const [high, low] = [luminance(rgba(style.color)), luminance(background(element))]
            .sort((a, b) => b - a);
        const ratio = (high + 0.05) / (low + 0.05);
        const size = parseFloat(style.fontSize);
        const large = size >= 24 || (Number(style.fontWeight) >= 700 && size >= 18.66);
        if (ratio < (large ? 3 : 4.5)) failures.push(`${text.slice(0, 40)}: ${ratio.toFixed(2)}`);
    }
    return failures;
}"""


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _job(server: Server, job_id: str) -> dict[str, Any]:
    return server.client.get(f"/v1/jobs/{job_id}").json()


# --- models ---------------------------------------------------------------------------


def test_upload_a_model_with_the_file_picker_and_see_its_summary(ui, server, tmp_path):
    onnx = tmp_path / "transformer.onnx"
    onnx.write_bytes(sample_bytes("transformer"))
    ui.go("#/models")
    expect(ui.page.get_by_role("heading", name="Models", level=1)).to_be_visible()
    ui.page.get_by_label("ONNX model file").set_input_files(onnx)

    expect(ui.page.locator("#upload-result")).to_contain_text("transformer.onnx")
    assert ui.page.locator("#upload-progress").get_attribute("value") == "100"
    expect(ui.page.locator("#upload-percent")).to_have_text("100%")
    [model] = server.client.get("/v1/models").json()["items"]
    nodes = model["summary"]["nodes"]
    expect(ui.page.locator("#upload-result")).to_contain_text(f"{nodes} nodes")
    row = ui.page.locator(f'#models-table tr[data-model-id="{model["id"]}"]')
    expect(row.get_by_role("link", name="transformer.onnx", exact=True)).to_be_visible()
    expect(row.locator("td[data-nodes]")).to_have_text(str(nodes))
    server.found["model"] = model

    # the drop zone takes a file dragged onto it, the same way
    ui.page.locator("#dropzone").evaluate(DROP, ["chain.onnx", b64encode(sample_bytes("chain"))])
    expect(ui.page.locator("#upload-result")).to_contain_text("Uploaded: chain.onnx")
    expect(ui.page.locator("#upload-percent")).to_have_text("100%")
    expect(ui.page.get_by_role("link", name="chain.onnx", exact=True)).to_be_visible()
    ui.shot("models")


def test_a_model_page_shows_its_graph_summary(ui, server):
    model = server.need("model")
    ui.go(f"#/models/{model['id']}")
    expect(ui.page.locator("#model-nodes")).to_have_text(str(model["summary"]["nodes"]))
    for op, count in model["summary"]["operators"].items():
        cell = ui.page.get_by_role("cell", name=op, exact=True)  # Add, not MatMulAdd
        expect(ui.page.locator("#operators-table tr", has=cell)).to_contain_text(str(count))
    graph = server.client.get(f"/v1/models/{model['id']}/graph", params={"batch": 4}).json()
    summary = ui.page.locator("#graph-summary")
    expect(summary).to_have_attribute("data-nodes", str(len(graph["nodes"])))
    ui.shot("model")


def _options(page: Page, select: str) -> list[dict[str, Any]]:
    return page.locator(f"{select} option").evaluate_all(
        "(options) => options.map((o) => ({value: o.value, label: o.textContent,"
        " disabled: o.disabled, selected: o.selected}))"
    )


def _said(description: str) -> re.Pattern[str]:
    """A description as the form shows it (capitalised, a full stop added)."""
    return re.compile(re.escape(description.rstrip(".")), re.IGNORECASE)


def test_the_job_forms_strategies_and_solvers_come_from_the_api(ui, server):
    model = server.need("model")
    catalog = server.client.get("/v1/strategies").json()
    ui.go(f"#/models/{model['id']}?plan")
    page = ui.page
    expect(page.locator("#job-strategy")).to_have_value(catalog["default_strategy"])
    strategies = _options(page, "#job-strategy")
    assert [o["value"] for o in strategies] == [s["name"] for s in catalog["strategies"]]
    assert strategies[0]["value"] == "auto"
    xengine = next(o for o in strategies if o["value"] == "xengine")
    assert "several devices" in xengine["label"]
    backends = _options(page, "#job-backend")
    assert [o["value"] for o in backends] == [b["name"] for b in catalog["backends"]]
    assert [o["disabled"] for o in backends] == [not b["available"] for b in catalog["backends"]]
    expect(page.locator("#job-backend")).to_have_value(catalog["default_backend"])
    described = next(s for s in catalog["strategies"] if s["name"] == "xengine")
    expect(page.locator("#job-strategy-help")).to_contain_text(_said(described["description"]))
    page.get_by_label("Strategy").select_option("greedy_evict")
    evict = next(s for s in catalog["strategies"] if s["name"] == "greedy_evict")
    expect(page.locator("#job-strategy-help")).to_contain_text(_said(evict["description"]))

    # nothing is hard-coded: a server with other strategies and backends gets other options
    other = {
        "strategies": [
            {
                "name": "from_the_api",
                "kind": "heuristic",
                "places_over_devices": True,
                "uses_solver": False,
                "description": "a strategy only this answer knows",
            },
            *catalog["strategies"][:2],
        ],
        "default_strategy": "from_the_api",
        "backends": [
            {"name": "highs", "available": False, "detail": "highspy is not installed"},
            {"name": "cpsat", "available": True, "detail": ""},
        ],
        "default_backend": "highs",
    }
    page.route(
        "**/v1/strategies",
        lambda route: route.fulfill(status=200, json=other, headers={"Cache-Control": "no-store"}),
    )
    page.reload()
    expect(page.locator("#job-strategy")).to_have_value("from_the_api")
    assert [o["value"] for o in _options(page, "#job-strategy")] == [
        "from_the_api",
        *(s["name"] for s in catalog["strategies"][:2]),
    ]
    expect(page.locator("#job-strategy-help")).to_have_text(
        "from_the_api: A strategy only this answer knows."
    )
    backends = _options(page, "#job-backend")
    assert [(o["value"], o["disabled"]) for o in backends] == [("highs", True), ("cpsat", False)]
    assert "not available: highspy is not installed" in backends[0]["label"]
    expect(page.locator("#job-backend")).to_have_value("cpsat")  # the default is unavailable
    ui.shot("job-form")


# --- a job from the form to its plan ------------------------------------------------------


def test_submit_a_job_from_the_form_and_watch_it_finish(ui, server):
    model = server.need("model")
    page = ui.page
    polls: list[tuple[str, str | None]] = []
    page.on("request", lambda r: polls.append((r.url, r.headers.get("if-none-match"))))
    ui.go("#/models")
    page.get_by_role("link", name="Plan a job for transformer.onnx").click()
    expect(page.locator("#plan-title")).to_be_focused()  # the link lands on the form
    page.get_by_label("Memory budget").fill("40%")
    page.get_by_label("Attention").select_option("unfused")
    page.get_by_role("button", name="Add a device").click()
    page.locator(".device-budget").nth(1).fill("40%")
    page.get_by_label("Strategy").select_option("xengine")
    page.get_by_label("Time limit (s)").fill("7")
    page.get_by_label("Stop at gap (%)").fill("0")  # run to the time limit: long enough to watch
    page.get_by_label("Earlier plans").select_option("fresh")  # not ended by an earlier plan
    page.get_by_role("button", name="Submit job").click()

    page.wait_for_url("**/#/jobs/*")
    job_id = page.url.rsplit("/", 1)[1]
    spec = _job(server, job_id)["spec"]
    assert spec["model_id"] == model["id"] and spec["strategy"] == "xengine"
    assert [d["name"] for d in spec["devices"]] == ["cpu0", "cpu1"]
    assert spec["budgets"] == {"cpu0": "40%", "cpu1": "40%"}
    assert spec["solver"]["time_limit_s"] == 7 and spec["solver"]["gap"] == 0
    assert spec["fuse_attention"] is False and spec["solver"]["reuse_plans"] is False
    expect(page.locator("#job-inputs")).to_contain_text("searched afresh")
    expect(page.locator("#job-status [data-status]")).to_have_text("running", timeout=WAIT_MS)
    page.wait_for_timeout(1000)  # a poll or two
    conditional = [tag for url, tag in polls if url.endswith(f"/v1/jobs/{job_id}") and tag]
    assert conditional, "the job page polls without If-None-Match"

    # the list refreshes itself: the same row goes from running to succeeded
    page.get_by_role("link", name="Jobs", exact=True).click()
    row = page.locator(f'#jobs-table tr[data-job-id="{job_id}"]')
    expect(row).to_have_attribute("data-status", "running")
    expect(row.locator("progress")).to_be_visible()
    expect(row).to_have_attribute("data-status", "succeeded", timeout=WAIT_MS)
    ui.shot("jobs")
    listed = [tag for url, tag in polls if "/v1/jobs?" in url]
    assert any(listed), "the jobs list polls without If-None-Match"
    assert _job(server, job_id)["status"] == "succeeded"

    row.get_by_role("link", name=job_id[:8]).click()
    expect(page.locator("#job-status [data-status]")).to_have_text("succeeded")
    history = server.client.get(f"/v1/jobs/{job_id}/progress").json()["points"]
    assert history, "the solver reported no progress"
    progress = page.locator("#progress .chart-box")
    expect(progress).to_have_attribute("data-points", str(len(history)))
    expect(progress.locator("path[data-series=incumbent]")).to_have_count(1)
    server.found["job"] = job_id


def test_the_heatmaps_and_memory_charts_carry_the_plans_data(ui, server):
    job_id = server.need("job")
    schedule = server.client.get(f"/v1/jobs/{job_id}/schedule").json()
    assert set(schedule["devices"]) == {"cpu0", "cpu1"}
    page = ui.page
    ui.go(f"#/jobs/{job_id}")
    for device in schedule["devices"]:
        for matrix in ("R", "S"):
            cells = schedule[matrix][device]
            heatmap = page.locator(f'svg.heatmap[data-device="{device}"][data-matrix="{matrix}"]')
            expect(heatmap).to_have_attribute("data-cells", str(len(cells)))
            expect(heatmap.locator("rect[data-node]")).to_have_count(len(cells))
            assert f"{len(cells)} cells" in (heatmap.get_attribute("aria-label") or "")
            if cells:  # a cell's tooltip names its node, and so does the readout on hover
                stage, node = cells[-1]
                cell = heatmap.locator(f'rect[data-stage="{stage}"][data-node="{node}"]')
                name = schedule["nodes"][node]
                assert name in cell.locator("title").text_content()
                cell.hover()
                expect(page.locator("#heatmap-readout")).to_contain_text(f"node {node} {name}")

        peak, budget = schedule["peak_bytes"][device], schedule["budgets"][device]
        assert max(schedule["memory"][device]) == peak
        chart = page.locator(f'svg.memory-chart[data-device="{device}"]')
        expect(chart).to_have_attribute("data-peak", str(peak))
        figure = page.locator(f'figure.memory-figure[data-device="{device}"]')
        expect(figure.locator(".peak-label")).to_have_attribute("data-peak", str(peak))
        expect(figure.locator(".peak-label")).to_contain_text("peak ")
        memory = chart.locator("path[data-role=memory]")
        expect(memory).to_have_attribute("data-points", str(len(schedule["memory"][device])))
        # the budget line and the peak marker sit where the chart's own y axis puts them
        height = float(chart.get_attribute("data-plot-height"))
        y_max = float(chart.get_attribute("data-y-max"))

        def y(value: float, height: float = height, y_max: float = y_max) -> float:
            return height - value / y_max * height

        line = chart.locator("line[data-role=budget]")
        assert int(line.get_attribute("data-value")) == budget
        assert float(line.get_attribute("y1")) == pytest.approx(y(budget), abs=0.01)
        assert float(chart.locator("circle[data-role=peak]").get_attribute("cy")) == (
            pytest.approx(y(peak), abs=0.01)
        )
        assert peak <= budget
    ui.shot("job")


def test_an_offloading_plan_shows_each_devices_transfer_lane(ui, server):
    body = job_body(
        server.need("model")["id"],
        strategy="offload_greedy",
        budgets={"cpu0": "60%"},
        fuse_attention=False,  # the budget calibrated on the attention node by node
    )
    job = server.client.post("/v1/jobs", json=body)
    assert job.status_code == 202, job.text
    done = wait_job(server.client, job.json()["id"])
    assert done["status"] == "succeeded", done
    schedule = server.client.get(f"/v1/jobs/{done['id']}/schedule").json()
    spans = schedule["transfers"]["cpu0"]
    assert {span["kind"] for span in spans} == {"offload", "prefetch"}
    ui.go(f"#/jobs/{done['id']}")
    lane = ui.page.locator('svg.transfer-lane[data-device="cpu0"]')
    expect(lane).to_have_attribute("data-transfers", str(len(spans)))
    expect(lane.locator("rect[data-kind]")).to_have_count(len(spans))
    first = spans[0]
    bar = lane.locator(f'rect[data-kind="{first["kind"]}"][data-node="{first["node"]}"]')
    expect(bar).to_have_attribute("data-issued", str(first["issued"]))
    expect(bar).to_have_attribute("data-done", str(first["done"]))
    assert schedule["nodes"][first["node"]] in (bar.locator("title").text_content() or "")
    ui.shot("job-offload")


def test_a_job_over_sizes_shows_its_family(ui, server):
    model = samples.transformer_block(layers=2, seq="S").SerializeToString()
    uploaded = upload(server.client, model, "transformer-s.onnx")
    assert uploaded.status_code in (200, 201), uploaded.text
    body = job_body(
        uploaded.json()["id"],
        strategy="greedy_evict",
        budgets={"cpu0": "75%"},
        ranges={"input": "2x16..128x32"},
        fuse_attention=False,  # the budget calibrated on the attention node by node
    )
    job = server.client.post("/v1/jobs", json=body)
    assert job.status_code == 202, job.text
    done = wait_job(server.client, job.json()["id"])
    assert done["status"] == "succeeded", done
    path = f"/v1/jobs/{done['id']}/plan"
    assert server.client.get(path, params={"input": "2x50x32"}).status_code == 200
    family = server.client.get(f"/v1/jobs/{done['id']}/family").json()
    ui.go(f"#/jobs/{done['id']}")
    expect(ui.page.locator("#family")).to_be_visible()
    chart = ui.page.locator("svg.family-peak-chart")
    expect(chart).to_have_attribute("data-sizes", str(len(family["sizes"])))
    expect(chart).to_have_attribute("data-buckets", str(len(family["buckets"])))
    expect(chart.locator('line[data-role="budget"]')).to_have_count(1)
    expect(ui.page.locator("#family-table tbody tr")).to_have_count(len(family["sizes"]))
    planned = ui.page.locator('#family-table tr[data-size="50"]')
    expect(planned).to_contain_text(re.compile("input_aware|the plan for"))
    ui.shot("job-family")
    server.found["family"] = done["id"]


def test_a_job_of_one_shape_has_no_sizes_section(ui, server):
    ui.go(f"#/jobs/{server.need('job')}")
    expect(ui.page.locator("#memory")).to_be_visible()
    expect(ui.page.locator("#family")).to_be_hidden()


def test_the_plan_downloads_as_the_apis_json(ui, server):
    job_id = server.need("job")
    ui.go(f"#/jobs/{job_id}")
    with ui.page.expect_download() as download:
        ui.page.get_by_role("button", name="Download plan JSON").click()
    assert download.value.suggested_filename == f"plan-{job_id}.json"
    saved = json.loads(Path(download.value.path()).read_text())
    assert saved == server.client.get(f"/v1/jobs/{job_id}/plan").json()


def test_the_baselines_table_compares_the_same_inputs(ui, server):
    job_id = server.need("job")
    baselines = server.client.get(f"/v1/jobs/{job_id}/baselines").json()
    ui.go(f"#/jobs/{job_id}")
    table = ui.page.locator("#baselines-table")
    expect(table.locator("tbody tr")).to_have_count(len(baselines["items"]) + 1)
    expect(table.locator("tr.this-job")).to_contain_text("xengine (this job)")
    expect(table.locator("tr.this-job")).to_contain_text(re.compile(r"\d m?J"))
    for item in baselines["items"]:
        expect(table.locator(f'tr[data-strategy="{item["strategy"]}"]')).to_be_visible()
    expect(ui.page.locator("#job-inputs")).to_contain_text("Objective")


def test_an_execution_shows_measured_against_predicted(ui, server):
    job_id = server.need("job")
    client = server.client
    body = {"enroll_token": ENROLL, "name": "bench-node", "devices": TWO_CPUS}
    enrolled = client.post("/v1/agent/register", json=body).json()
    agent = {"Authorization": f"Bearer {enrolled['token']}"}
    ui.go(f"#/jobs/{job_id}")
    ui.page.get_by_label("Run this plan on node").select_option(label="bench-node (online)")
    ui.page.get_by_role("button", name="Execute").click()
    expect(ui.page.locator("#status")).to_contain_text("Execution queued on bench-node")

    # this test is the node's agent: it leases the task and reports what it "measured"
    task = client.post("/v1/agent/lease", json={"wait_s": 10}, headers=agent, timeout=40).json()
    predicted = task["payload"]["plan"]["predicted"]
    result = {
        "measured": {
            "total_ms": predicted["total_ms"] * 1.25,
            "peak_bytes": {d: p + 4096 for d, p in predicted["peak_bytes"].items()},
            "energy_mj": 12.5,
            "energy_note": "fake socket (cpu0, cpu1): over 1 run(s)",
        },
        "predicted": {"total_ms": predicted["total_ms"], "peak_bytes": predicted["peak_bytes"]},
        "gradients_match": True,
        "max_rel_error": 1e-6,
    }
    report = {"lease_token": task["lease_token"], "status": "succeeded", "result": result}
    reported = client.post(f"/v1/agent/tasks/{task['id']}/report", json=report, headers=agent)
    assert reported.status_code == 200, reported.text

    row = ui.page.locator(f'#executions-table tr[data-execution-id="{task["id"]}"]')
    expect(row).to_have_attribute("data-status", "succeeded", timeout=10_000)
    assert float(row.get_attribute("data-measured-ms")) == result["measured"]["total_ms"]
    assert float(row.get_attribute("data-predicted-ms")) == predicted["total_ms"]
    expect(row).to_contain_text("1.25×")
    expect(row).to_contain_text("/ 12.50 mJ")  # measured energy beside the prediction
    expect(row).to_contain_text("match")
    ui.shot("job-executions")
    server.found["node"] = enrolled["node_id"]
    server.found["agent"] = agent


def test_an_execution_over_sizes_shows_each_step(ui, server):
    job_id, client = server.need("family"), server.client
    node_id, agent = server.need("node"), server.need("agent")
    sizes = [24, 50, 24]
    asked = client.post(f"/v1/jobs/{job_id}/executions", json={"node_id": node_id, "sizes": sizes})
    assert asked.status_code == 202, asked.text
    # this test is the node's agent: every step "measured" 10% over its plan's prediction
    task = client.post("/v1/agent/lease", json={"wait_s": 10}, headers=agent, timeout=40).json()
    plans = task["payload"]["sized"]["plans"]
    steps = [
        {
            "size": size,
            "total_ms": plans[str(size)]["predicted"]["total_ms"] * 1.1,
            "peak_bytes": plans[str(size)]["predicted"]["peak_bytes"],
        }
        for size in sizes
    ]
    peaks = {"cpu0": max(step["peak_bytes"]["cpu0"] for step in steps)}
    result = {
        "measured": {"total_ms": sum(step["total_ms"] for step in steps), "peak_bytes": peaks},
        "sized": steps,
    }
    report = {"lease_token": task["lease_token"], "status": "succeeded", "result": result}
    reported = client.post(f"/v1/agent/tasks/{task['id']}/report", json=report, headers=agent)
    assert reported.status_code == 200, reported.text
    ui.go(f"#/jobs/{job_id}")
    table = ui.page.locator(f'.sized-steps[data-execution-id="{task["id"]}"]')
    expect(table.locator("tbody tr")).to_have_count(len(sizes), timeout=10_000)
    expect(table.locator('tbody tr[data-size="24"]').first).to_contain_text("1.10×")
    expect(table.locator("tbody tr").nth(2)).to_contain_text("yes")  # 24 again: cached
    ui.shot("job-sized-execution")


def test_a_job_with_costs_measured_on_a_node(ui, server):
    """The form's costs from a node: the job waits for the node's profile (this test, as the
    agent, reports a cost table), is solved with it, and the profile is on the Nodes page."""
    client, node_id, agent = server.client, server.need("node"), server.need("agent")
    [chain] = [m for m in client.get("/v1/models").json()["items"] if m["filename"] == "chain.onnx"]
    page = ui.page
    ui.go(f"#/models/{chain['id']}?plan")
    page.get_by_label("Memory budget").fill("")
    page.get_by_role("button", name="Add a device").click()
    page.locator(".device-budget").nth(1).fill("")
    page.get_by_label("Costs").select_option(node_id)
    expect(page.get_by_label("Costs")).to_contain_text("measured on node bench-node")
    page.get_by_role("button", name="Submit job").click()
    page.wait_for_url("**/#/jobs/*")
    job_id = page.url.rsplit("/", 1)[1]
    expect(page.locator("#job-inputs")).to_contain_text("measured on node bench-node")

    task = client.post("/v1/agent/lease", json={"wait_s": 10}, headers=agent, timeout=40).json()
    assert task["kind"] == "profile" and task["payload"]["devices"] == ["cpu0", "cpu1"]
    graph = client.get(f"/v1/models/{chain['id']}/graph", params={"batch": 4}).json()
    table = profiled_table([n["name"] for n in graph["nodes"]])
    report = {"lease_token": task["lease_token"], "status": "succeeded", "result": table}
    reported = client.post(f"/v1/agent/tasks/{task['id']}/report", json=report, headers=agent)
    assert reported.status_code == 200, reported.text
    expect(page.locator("#job-status [data-status]")).to_have_text("succeeded", timeout=WAIT_MS)
    assert _job(server, job_id)["status"] == "succeeded"

    [profile] = client.get("/v1/profiles", params={"node_id": node_id}).json()["items"]
    page.get_by_role("link", name="Nodes", exact=True).click()
    listed = page.locator(f'#nodes-table li[data-profile-id="{profile["id"]}"]')
    expect(listed).to_contain_text("chain.onnx")
    expect(listed).to_contain_text("training, batch 4, on cpu0, cpu1")


def test_the_nodes_page_lists_agents_and_their_devices(ui, server):
    node = server.client.get(f"/v1/nodes/{server.need('node')}").json()
    ui.go("#/nodes")
    row = ui.page.locator(f'#nodes-table tr[data-node-id="{node["id"]}"]')
    expect(row).to_contain_text("bench-node")
    expect(row).to_have_attribute("data-status", node["status"])
    for device in node["devices"]:
        expect(row).to_contain_text(f"{device['name']} ({device['kind']})")
    expect(row).to_contain_text("ago")
    ui.shot("nodes")


# --- cancel and errors --------------------------------------------------------------------


def test_cancel_a_running_job_from_its_page(ui, server):
    client = server.client
    spec = {
        "model_id": server.need("model")["id"],
        "batch": 4,
        "devices": TWO_CPUS,
        "budgets": {"cpu0": "40%", "cpu1": "40%"},
        "strategy": "xengine",
        "solver": {"backend": "highs", "time_limit_s": 60, "gap": 0},  # a minute unless stopped
    }
    job_id = client.post("/v1/jobs", json=spec).json()["id"]
    wait_job(client, job_id, {"running"})
    ui.go(f"#/jobs/{job_id}")
    expect(ui.page.locator("#job-status [data-status]")).to_have_text("running")
    ui.page.get_by_role("button", name="Cancel job").click()
    expect(ui.page.locator("#job-status [data-status]")).to_have_text("cancelled", timeout=WAIT_MS)
    expect(ui.page.get_by_role("button", name="Cancel job")).to_be_hidden()
    expect(ui.page.locator("#status")).to_have_text("The job was cancelled.")
    expect(ui.page.locator("#schedule")).to_contain_text("without a plan")
    ui.shot("job-cancelled")
    done = _job(server, job_id)
    assert done["status"] == "cancelled" and done["cancel_requested"]
    ran = datetime.fromisoformat(done["finished_at"]) - datetime.fromisoformat(done["started_at"])
    assert ran.total_seconds() < 30  # stopped, not run to its time limit


def test_an_api_error_is_shown_in_plain_words(ui, server):
    ui.allowed.append("status of 422")  # the browser logs the refused request itself
    model = server.need("model")
    ui.go(f"#/models/{model['id']}")
    jobs_before = len(server.client.get("/v1/jobs").json()["items"])
    ui.page.get_by_label("Memory budget").fill("abc")
    ui.page.get_by_role("button", name="Submit job").click()
    alert = ui.page.get_by_role("alert")
    expect(alert).to_be_visible()
    expect(alert).to_contain_text("The job was not submitted")
    expect(alert).to_contain_text("size 'abc': expected bytes, KiB, MiB, GiB, KB, MB, GB or %")
    assert ui.page.url.endswith(f"#/models/{model['id']}")  # still on the form
    assert len(server.client.get("/v1/jobs").json()["items"]) == jobs_before
    ui.shot("error")


def test_the_form_submits_an_energy_objective_and_says_what_no_plan_can_meet(ui, server):
    ui.allowed.append("status of 422")
    model = server.need("model")
    page = ui.page
    ui.go(f"#/models/{model['id']}")
    page.locator("#job-strategy").select_option("chen_sqrt")  # a quick job
    page.get_by_label("Minimise").select_option("weighted")
    page.get_by_label("Alpha (ms per mJ)").fill("0.02")
    page.get_by_label("Power caps (W)").fill("cpu0=5")  # below the CPU's idle power
    page.get_by_role("button", name="Submit job").click()
    expect(page.get_by_role("alert")).to_contain_text("below its idle power")
    page.get_by_label("Power caps (W)").fill("cpu0=500")
    page.get_by_role("button", name="Submit job").click()
    page.wait_for_url("**/#/jobs/*")
    job_id = page.url.rsplit("/", 1)[1]
    spec = _job(server, job_id)["spec"]
    assert spec["objective"]["kind"] == "weighted" and spec["objective"]["alpha"] == 0.02
    assert spec["objective"]["power_caps_w"] == {"cpu0": 500.0}
    expect(page.locator("#job-inputs")).to_contain_text("time + 0.02 ms/mJ × energy")
    expect(page.locator("#job-inputs")).to_contain_text("cpu0 ≤ 500 W")


def test_an_unreachable_server_and_a_missing_job_are_said_plainly(ui, server):
    ui.allowed += ["status of 404", "net::ERR_FAILED"]
    ui.go("#/jobs/0123456789abcdef")
    expect(ui.page.get_by_role("alert")).to_contain_text("job '0123456789abcdef' does not exist")
    ui.page.route("**/v1/jobs?*", lambda route: route.abort())
    ui.go("#/jobs")
    expect(ui.page.get_by_role("alert")).to_contain_text("The server cannot be reached")


def test_the_jobs_list_filters_by_status(ui, server):
    cancelled = server.client.get("/v1/jobs", params={"status": "cancelled"}).json()["items"]
    assert cancelled
    ui.go("#/jobs")
    ui.page.get_by_label("Status").select_option("cancelled")
    expect(ui.page).to_have_url(re.compile(r"#/jobs\?status=cancelled$"))
    rows = ui.page.locator("#jobs-table tbody tr")
    expect(rows).to_have_count(len(cancelled))
    assert set(rows.evaluate_all("rows => rows.map(r => r.dataset.status)")) == {"cancelled"}
    ui.page.reload()  # the filter is in the address
    expect(ui.page.get_by_label("Status")).to_have_value("cancelled")
    expect(rows).to_have_count(len(cancelled))


def test_leaving_a_page_stops_its_polling(ui, server):
    requests: list[str] = []
    ui.page.on("request", lambda r: requests.append(r.url))
    ui.go("#/jobs")
    expect(ui.page.locator("#jobs-table tbody tr").first).to_be_visible()
    ui.page.wait_for_timeout(2500)
    assert sum("/v1/jobs?" in url for url in requests) >= 2, "the jobs list does not poll"
    ui.page.get_by_role("link", name="Nodes", exact=True).click()
    expect(ui.page.locator("#nodes-table")).to_be_visible()
    left = len(requests)
    ui.page.wait_for_timeout(2500)
    assert not [url for url in requests[left:] if "/v1/jobs" in url]


# --- keyboard and screens -----------------------------------------------------------------


def test_keyboard_reaches_the_navigation_and_enter_follows_it(ui, server):
    page = ui.page
    ui.go("#/jobs")
    expect(page.get_by_role("heading", name="Jobs", level=1)).to_be_visible()
    models = page.get_by_role("link", name="Models", exact=True)
    for _ in range(10):
        page.keyboard.press("Tab")
        if models.evaluate("link => link === document.activeElement"):
            break
    expect(models).to_be_focused()
    outline = models.evaluate("link => getComputedStyle(link).outlineStyle")
    assert outline != "none", "the focused link shows no focus ring"
    page.keyboard.press("Enter")
    page.wait_for_url("**/#/models")
    expect(page.get_by_role("heading", name="Models", level=1)).to_be_focused()
    expect(models).to_have_attribute("aria-current", "page")
    # the form's controls are labelled: each is reachable by its label
    page.get_by_role("link", name="Plan a job for transformer.onnx").press("Enter")
    for label in ("Device name", "Kind", "Memory budget", "Strategy", "Solver", "Time limit (s)"):
        expect(page.get_by_label(label, exact=True).first).to_be_editable()


@pytest.mark.parametrize("width", [1280, 400])
def test_every_page_fits_the_screen(browser, server, width):
    context = browser.new_context(viewport={"width": width, "height": 800})
    ui = _watch(context.new_page(), server.url)
    pages = {
        "jobs": ("#/jobs", "#jobs-table"),
        "job": (f"#/jobs/{server.need('job')}", "svg.memory-chart"),
        "models": ("#/models", "#models-table"),
        "model": (f"#/models/{server.need('model')['id']}", "#graph-summary"),
        "nodes": ("#/nodes", "#nodes-table"),
    }
    try:
        for name, (route, ready) in pages.items():
            ui.go(route)
            expect(ui.page.locator(ready).first).to_be_visible()
            overflow = ui.page.evaluate(
                "document.documentElement.scrollWidth - document.documentElement.clientWidth"
            )
            assert overflow <= 0, f"{name} at {width} px is {overflow} px wider than the screen"
            assert ui.page.evaluate(LOW_CONTRAST) == [], f"{name}: text below WCAG AA contrast"
            ui.shot(f"{name}-{width}px")
        assert ui.unexpected_errors() == []
    finally:
        context.close()


def test_an_api_key_is_asked_for_and_sent(ui, server):
    """Last: once a key exists, every /v1 call needs it."""
    ui.allowed.append("status of 401")
    created = subprocess.run(
        [str(BIN / "remat"), "api-key", "create", "dashboard"],
        env=server.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    key = created.stdout.strip()
    ui.go("#/jobs")
    expect(ui.page.get_by_role("alert")).to_contain_text("This server needs an API key")
    row = ui.page.locator(f'#jobs-table tr[data-job-id="{server.need("job")}"]')
    ui.page.get_by_label("API key").fill(key)
    ui.page.get_by_role("button", name="Save").click()
    expect(row).to_be_visible()
    expect(ui.page.get_by_role("alert")).to_be_hidden()
    # Counted from here: a refresh the page issued before the key was saved may still be
    # answered 401 while the key is typed.
    refused = len(ui.errors)
    ui.page.reload()  # the key is kept in the browser
    expect(row).to_be_visible()
    assert ui.errors[refused:] == []  # with the key, nothing is refused
