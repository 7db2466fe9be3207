"""``remat submit`` against a server that is still starting, or never starts: it waits a
bounded time (``--wait-for-server``) for ``/readyz``, says so once on stderr, and fails
with one line and exit status 2 if no server answers. The README's command starts
``remat serve`` in the background and runs ``remat submit`` right after it, with no sleep
between them: the last test does just that."""

from __future__ import annotations

import subprocess
import time

from service import BIN, Process, free_port, service_env, wait_ready

SUBMIT = ["--sample", "chain", "--batch", "2", "--budget", "cpu0=100%"]
SUBMIT += ["--strategy", "checkpoint_all", "--time-limit", "5"]


def _submit(url: str, *options: str) -> list[str]:
    return [str(BIN / "remat"), "submit", "--server", url, *SUBMIT, *options]


def test_no_server_fails_after_the_wait_with_one_line(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = service_env(data_dir=str(tmp_path))
    start = time.monotonic()
    done = subprocess.run(
        _submit(url, "--wait-for-server", "1.5"), env=env, capture_output=True, text=True
    )
    waited = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0] == f"waiting for the server at {url}..."
    assert len(lines) == 2, done.stderr  # the waiting line once, then the error
    assert lines[1].startswith(f"remat: error: no Remat server ready at {url} after 1.5 s")
    assert "remat serve" in lines[1]
    assert 1.5 <= waited < 30, waited
    assert done.stdout == ""


def test_no_wait_tries_once(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    env = service_env(data_dir=str(tmp_path))
    done = subprocess.run(
        _submit(url, "--wait-for-server", "0"), env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"remat: error: no Remat server ready at {url} (")


def test_submit_waits_for_a_server_started_after_it(tmp_path):
    """The README's order: the server starts in the background, submit at once."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = service_env(data_dir=str(tmp_path))
    submit = subprocess.Popen(
        _submit(url, "--wait-for-server", "90"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    waiting = f"waiting for the server at {url}..."
    assert submit.stderr is not None
    # submit is waiting before the server even starts (its imports may take seconds)
    assert submit.stderr.readline().rstrip("\n") == waiting
    assert submit.poll() is None
    serve = [str(BIN / "remat"), "serve", "--port", str(port), "--no-agent"]
    server = Process(serve, env, tmp_path / "serve.log")
    try:
        wait_ready(url, server)
        out, err = submit.communicate(timeout=180)
        assert submit.returncode == 0, err
        assert waiting not in err.splitlines()  # said once
        assert "succeeded" in out and "strategy:   checkpoint_all" in out
    finally:
        if submit.poll() is None:
            submit.kill()
            submit.wait()
        server.stop()
