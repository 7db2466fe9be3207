"""``remat serve`` and its local agent end together, however the server ends: SIGTERM
(with an event stream open, which must not hold the exit up), SIGINT and SIGKILL, each
sent to the server's process alone, as a service manager or an out-of-memory kill does.
Real processes: ``remat serve`` on SQLite with its ``remat-agent`` child."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
from service import BIN, Process, free_port, job_body, service_env, upload, wait, wait_ready

from remat import samples

pytest.importorskip("torch", reason="the local agent needs the [agent] extra (PyTorch)")

ENROLL = "lifecycle-enroll-token"
GONE_S = 10.0  # generous: the server and its agent are gone in about a second


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def serve(tmp_path: Path) -> tuple[Process, str, int]:
    """``remat serve`` with its local agent online; the agent's pid."""
    port = free_port()
    env = service_env(data_dir=str(tmp_path), enroll_token=ENROLL, heartbeat_s="1")
    args = [str(BIN / "remat"), "serve", "--port", str(port), "--agent-device", "cpu0:cpu"]
    server = Process(args, env, tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, server)
    server.wait_for_output("remat-agent local: node")
    [agent] = [p for p in children(server.popen.pid) if alive(p)]
    return server, url, agent


def cleanup(server: Process, agent: int) -> None:
    """Whatever a failed test left running."""
    server.kill()
    server.stop()
    if alive(agent):
        os.kill(agent, signal.SIGKILL)


def test_sigterm_with_an_event_stream_open_ends_server_and_agent_at_once(tmp_path):
    server, url, agent = serve(tmp_path)
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            # A job that waits for a profile from a node that never sends one: its event
            # stream stays open until the server stops.
            devices = [{"name": "cpu0", "kind": "cpu"}]
            body = {"enroll_token": ENROLL, "name": "silent", "devices": devices}
            silent = client.post("/v1/agent/register", json=body).json()
            model = upload(client, samples.chain(n=3).SerializeToString()).json()["id"]
            job = client.post(
                "/v1/jobs", json=job_body(model, costs={"node_id": silent["node_id"]})
            ).json()
        events: list[str] = []
        started, ended = threading.Event(), threading.Event()

        def listen() -> None:
            try:
                with httpx.stream("GET", f"{url}/v1/jobs/{job['id']}/events", timeout=60) as r:
                    for line in r.iter_lines():
                        events.append(line)
                        started.set()
            except httpx.HTTPError:
                pass
            finally:
                ended.set()

        threading.Thread(target=listen, daemon=True).start()
        assert started.wait(30), events
        os.kill(server.popen.pid, signal.SIGTERM)  # the server alone, not its group
        server.popen.wait(timeout=GONE_S)
        wait(lambda: not alive(agent), GONE_S, "the local agent gone")
        assert ended.wait(GONE_S)
        assert "local stopped" in server.output()  # the agent stopped cleanly
    finally:
        cleanup(server, agent)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_the_local_agent_ends_with_the_server(tmp_path, sig):
    server, _, agent = serve(tmp_path)
    try:
        os.kill(server.popen.pid, sig)
        server.popen.wait(timeout=GONE_S)
        wait(lambda: not alive(agent), GONE_S, "the local agent gone")
    finally:
        cleanup(server, agent)
