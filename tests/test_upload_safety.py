"""Uploads as an attacker sends them, against a real ``remat serve``: a model that points at
a file in the server's working directory, one that asks for gigabytes in a few bytes, one
that takes seconds to validate, a chunked body past the size limit, a client gone
mid-upload, part files left by a server that died."""

from __future__ import annotations

import fcntl
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from service import remat_serve, service_env, upload
from test_untrusted_models import SECRET, _constant_shape_model

LIMIT = 3_000_000  # bytes
BOUNDARY = "remat-test-boundary"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``remat serve`` started in a directory holding ``etc/secret``, with a part file left
    by a dead upload and one still held by a live one in its model store."""
    root = tmp_path_factory.mktemp("uploads")
    (root / "etc").mkdir()
    (root / "etc" / "secret").write_bytes(SECRET.tobytes())
    models = root / "data" / "models"
    models.mkdir(parents=True)
    (models / "abandoned.part").write_bytes(b"x" * 100)
    held = (models / "held.part").open("wb")
    fcntl.flock(held.fileno(), fcntl.LOCK_EX)
    env = service_env(data_dir=str(root / "data"), max_upload_bytes=str(LIMIT))
    process, url = remat_serve(env, root / "serve.log", root, "--no-agent")
    try:
        yield {"url": url, "models": models, "process": process}
    finally:
        process.stop()
        held.close()


def _parts(models: Path) -> set[str]:
    return {p.name for p in models.glob("*.part")}


def test_part_files_of_dead_uploads_are_removed_at_start_and_live_ones_kept(server: Any) -> None:
    assert _parts(server["models"]) == {"held.part"}


def test_a_model_reading_a_file_of_the_server_is_refused_and_the_file_not_shown(
    client: httpx.Client,
) -> None:
    before = client.get("/v1/models").json()["items"]
    response = upload(client, _constant_shape_model("etc/secret").SerializeToString())
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert "outside the model file" in response.json()["detail"]
    assert "3, 4" not in response.text and "(3" not in response.text
    assert client.get("/v1/models").json()["items"] == before


def _vm_hwm_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))


def test_a_few_bytes_asking_for_gigabytes_are_sized_not_allocated(
    client: httpx.Client, server: Any
) -> None:
    shape = numpy_helper.from_array(np.array([1 << 24], np.int64), "s")
    nodes = [
        helper.make_node("ConstantOfShape", ["s"], ["c"]),
        helper.make_node("Add", ["x", "c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n"])],
        [shape],
    )
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    pid = server["process"].popen.pid
    before = _vm_hwm_kib(pid)
    response = upload(client, data.SerializeToString())
    assert response.status_code == 201, response.text
    grown_mib = (_vm_hwm_kib(pid) - before) / 1024
    assert grown_mib < 300, f"the server's peak memory grew by {grown_mib:.0f} MiB"


def test_the_api_answers_while_a_large_model_is_validated(
    client: httpx.Client, server: Any
) -> None:
    count = 40_000  # a chain of Relu: seconds to validate, under a megabyte
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"]) for i in range(count)]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("t0", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info(f"t{count}", onnx.TensorProto.FLOAT, ["n"])],
    )
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    done = threading.Event()
    result: dict[str, httpx.Response] = {}

    def send() -> None:
        with httpx.Client(base_url=server["url"], timeout=120) as other:
            result["upload"] = upload(other, data.SerializeToString())
        done.set()

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.5)  # the bytes are in; validation has begun
    answered_meanwhile = 0
    while not done.is_set():
        health = client.get("/healthz")
        assert health.status_code == 200
        answered_meanwhile += not done.is_set()
    sender.join()
    assert result["upload"].status_code == 201, result["upload"].text
    assert result["upload"].json()["summary"]["nodes"] == count
    assert answered_meanwhile >= 1


def _open(url: str, length: int | None) -> socket.socket:
    """A connection that has sent the headers of an upload and its file part's headers."""
    where = urlsplit(url)
    sock = socket.create_connection((where.hostname, where.port))
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    sock.sendall(
        (
            f"POST /v1/models HTTP/1.1\r\nHost: {where.netloc}\r\n{framing}\r\n"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n\r\n"
        ).encode()
    )
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; '
        'filename="big.onnx"\r\nContent-Type: application/octet-stream\r\n\r\n'
    ).encode()
    sock.sendall(f"{len(head):x}\r\n".encode() + head + b"\r\n" if length is None else head)
    return sock


def test_a_chunked_upload_past_the_limit_is_refused_as_it_arrives(server: Any) -> None:
    total = 40 * LIMIT  # what a spooling server would read in full before refusing
    sock = _open(server["url"], None)
    sock.settimeout(30)
    piece = b"\0" * 65536
    sent = 0
    try:
        while sent < total and not select.select([sock], [], [], 0)[0]:
            sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            sent += len(piece)
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer = sock.recv(65536).decode(errors="replace")
    sock.close()
    assert answer.startswith("HTTP/1.1 413"), answer[:200]
    assert sent < total // 4, f"{sent} bytes sent before the refusal"
    assert _parts(server["models"]) == {"held.part"}


def test_a_client_gone_mid_upload_leaves_nothing_behind(server: Any) -> None:
    sock = _open(server["url"], 2_000_000)
    sock.sendall(b"\0" * 1_000_000)
    deadline = time.monotonic() + 30
    while len(_parts(server["models"])) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the upload's part file is being written
    assert len(_parts(server["models"])) == 2
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # reset
    sock.close()
    while len(_parts(server["models"])) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _parts(server["models"]) == {"held.part"}
