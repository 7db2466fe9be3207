"""Models whose weights lie in external data files, uploaded as a zip archive over real
HTTP to ``remat serve``: the server embeds the data read from the archive only and stores
one self-contained model (the same bytes, the same model, as uploading it embedded).
Every archive it must not take is refused with 422 problem+json, a detail that says why,
and nothing stored. The command line takes the model's directory or a zip as well as the
``.onnx`` file (``remat graph``, ``plan``; ``submit`` packs the data files into a zip)."""

from __future__ import annotations

import hashlib
import io
import json
import stat
import struct
import zipfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from service import problem, remat_serve, service_env, upload, wait_job

from app.cli import main as remat_main
from remat import samples
from remat.errors import ModelLoadError
from remat.onnx_external import archive_with_external_data, load_archive

LIMIT = 3_000_000  # REMAT_MAX_UPLOAD_BYTES of the test server
SECRET = b"server secret bytes, 64 of them..........................!!!!!!!"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``remat serve`` (embedded jobs, no agent) in a directory holding ``etc/secret``,
    which a location naming it must not reach."""
    root = tmp_path_factory.mktemp("external")
    (root / "etc").mkdir()
    (root / "etc" / "secret").write_bytes(SECRET)
    env = service_env(data_dir=str(root / "data"), max_upload_bytes=str(LIMIT))
    process, url = remat_serve(env, root / "serve.log", root, "--no-agent")
    try:
        yield {"url": url, "models": root / "data" / "models", "process": process}
    finally:
        process.stop()


# --- making models and archives ----------------------------------------------------------


def _save_external(model: onnx.ModelProto, directory: Path, name: str = "model.onnx") -> bytes:
    """Save ``model`` into ``directory`` as ``name`` with every initializer in one data
    file beside it (``name.data``); the model's self-contained bytes."""
    embedded = model.SerializeToString()
    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(
        onnx.load_from_string(embedded),  # onnx.save turns the model it gets external
        directory / name,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=f"{name}.data",
        size_threshold=0,
    )
    return embedded


def _zip(members: dict[str, bytes] | dict[str | zipfile.ZipInfo, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _patched(archive: bytes, name: str, local_at: int, central_at: int, value: bytes) -> bytes:
    """``archive`` with ``value`` written into member ``name``'s local header at
    ``local_at`` and its central directory entry at ``central_at`` (what a hand-made
    archive can say that ``zipfile`` would not write)."""
    patched = bytearray(archive)
    with zipfile.ZipFile(io.BytesIO(archive)) as reading:
        local = reading.getinfo(name).header_offset
    central = patched.rindex(b"PK\x01\x02")
    while patched[central + 46 : central + 46 + len(name)] != name.encode():
        central = patched.rindex(b"PK\x01\x02", 0, central)
    patched[local + local_at : local + local_at + len(value)] = value
    patched[central + central_at : central + central_at + len(value)] = value
    return bytes(patched)


def _chain_files(tmp_path: Path, features: int = 16) -> tuple[onnx.ModelProto, bytes]:
    """The chain sample saved with external data: its ``.onnx`` parsed (to edit its
    references) and its data file's bytes."""
    _save_external(samples.chain(n=4, features=features), tmp_path / "chain")
    model = onnx.load(tmp_path / "chain" / "model.onnx", load_external_data=False)
    return model, (tmp_path / "chain" / "model.onnx.data").read_bytes()


def _set_reference(model: onnx.ModelProto, **entries: str) -> bytes:
    """The model with its one external initializer's ``external_data`` entries changed."""
    [tensor] = [t for t in model.graph.initializer if t.external_data]
    values = {e.key: e.value for e in tensor.external_data} | entries
    del tensor.external_data[:]
    for key, value in values.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return model.SerializeToString()


def _stored(server: Any, client: httpx.Client) -> tuple[list[Any], set[str]]:
    """What the server holds: its model rows and every file in its model store."""
    rows = client.get("/v1/models").json()["items"]
    return rows, {str(p.relative_to(server["models"])) for p in server["models"].rglob("*")}


def _refused(server: Any, client: httpx.Client, archive: bytes, *phrases: str) -> str:
    """Upload ``archive``: 422 problem+json whose detail holds each phrase, nothing
    stored. The detail."""
    before = _stored(server, client)
    body = problem(upload(client, archive, "model.zip"), 422)
    assert body["detail"].startswith("not a usable model archive: "), body["detail"]
    for phrase in phrases:
        assert phrase in body["detail"], body["detail"]
    assert "\n" not in body["detail"]
    assert _stored(server, client) == before
    return str(body["detail"])


# --- uploads that work -------------------------------------------------------------------


def test_a_zipped_model_with_external_data_is_stored_as_the_embedded_model(
    server: Any, client: httpx.Client, tmp_path: Path
) -> None:
    embedded = _save_external(samples.resnet18(), tmp_path / "resnet")
    files = {p.name: p.read_bytes() for p in (tmp_path / "resnet").iterdir()}
    assert set(files) == {"model.onnx", "model.onnx.data"}
    assert len(files["model.onnx"]) < len(embedded) // 10  # the weights are elsewhere

    zipped = upload(client, _zip(files), "resnet.zip")
    assert zipped.status_code == 201, zipped.text
    model = zipped.json()
    assert model["sha256"] == hashlib.sha256(embedded).hexdigest()
    assert model["size_bytes"] == len(embedded) and model["filename"] == "model.onnx"
    stored = server["models"] / model["sha256"][:2] / f"{model['sha256']}.onnx"
    assert stored.read_bytes() == embedded

    same = upload(client, embedded, "resnet18.onnx")
    assert same.status_code == 200 and same.json()["id"] == model["id"]
    graph = client.get(f"/v1/models/{model['id']}/graph", params={"batch": 2})
    assert graph.status_code == 200 and len(graph.json()["nodes"]) > model["summary"]["nodes"]


def test_an_archive_in_a_folder_with_data_in_a_subfolder_is_resolved_from_the_model(
    client: httpx.Client, tmp_path: Path
) -> None:
    model, data = _chain_files(tmp_path, features=12)
    onnx_bytes = _set_reference(model, location="weights/w.bin")
    archive = _zip({"export/": b"", "export/net.onnx": onnx_bytes, "export/weights/w.bin": data})
    response = upload(client, archive, "export.zip")
    assert response.status_code == 201, response.text
    assert response.json()["filename"] == "net.onnx"
    expected = samples.chain(n=4, features=12).SerializeToString()
    assert response.json()["sha256"] == hashlib.sha256(expected).hexdigest()


def test_a_zip_of_a_self_contained_model_is_that_model(client: httpx.Client) -> None:
    data = samples.chain(n=6, features=8).SerializeToString()
    first = upload(client, _zip({"c.onnx": data, "README.txt": b"notes"}), "c.zip")
    assert first.status_code == 201, first.text
    again = upload(client, data, "c.onnx")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]


# --- refusals -----------------------------------------------------------------------------


def test_an_archive_without_a_model_or_with_several_is_refused(
    server: Any, client: httpx.Client, tmp_path: Path
) -> None:
    model, data = _chain_files(tmp_path)
    onnx_bytes = model.SerializeToString()
    _refused(server, client, _zip({"model.onnx.data": data}), "holds no .onnx file")
    _refused(server, client, _zip({}), "holds no .onnx file")
    several = _zip({"a.onnx": onnx_bytes, "b/b.onnx": onnx_bytes, "model.onnx.data": data})
    _refused(server, client, several, "holds 2 .onnx files", "'a.onnx'", "'b/b.onnx'")


@pytest.mark.parametrize("name", ["/etc/model.onnx.data", "../model.onnx.data", "a/../../x"])
def test_members_with_absolute_paths_or_dot_dot_are_refused(
    server: Any, client: httpx.Client, tmp_path: Path, name: str
) -> None:
    model, data = _chain_files(tmp_path)
    archive = _zip({"model.onnx": model.SerializeToString(), "model.onnx.data": data, name: b"x"})
    _refused(server, client, archive, repr(name), "absolute path or '..'")


def test_a_symbolic_link_member_is_refused(
    server: Any, client: httpx.Client, tmp_path: Path
) -> None:
    model, _ = _chain_files(tmp_path)
    link = zipfile.ZipInfo("model.onnx.data")
    link.create_system = 3  # Unix: the mode is in the high bits of external_attr
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    members: dict[str | zipfile.ZipInfo, bytes] = {"model.onnx": model.SerializeToString()}
    members[link] = b"/etc/secret"
    archive = _zip(members)
    _refused(server, client, archive, "'model.onnx.data' is a symbolic link")


def test_an_encrypted_member_is_refused(server: Any, client: httpx.Client, tmp_path: Path) -> None:
    model, data = _chain_files(tmp_path)
    plain = _zip({"model.onnx": model.SerializeToString(), "model.onnx.data": data})
    flags = zipfile.ZipFile(io.BytesIO(plain)).getinfo("model.onnx.data").flag_bits
    archive = _patched(plain, "model.onnx.data", 6, 8, struct.pack("<H", flags | 0x1))
    _refused(server, client, archive, "'model.onnx.data' is encrypted")


def test_a_member_named_twice_is_refused(server: Any, client: httpx.Client, tmp_path: Path) -> None:
    model, data = _chain_files(tmp_path)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive, pytest.warns(UserWarning, match="Duplicate"):
        archive.writestr("model.onnx", model.SerializeToString())
        archive.writestr("model.onnx.data", data)
        archive.writestr("model.onnx.data", SECRET)
    _refused(server, client, buffer.getvalue(), "'model.onnx.data' appears twice")


@pytest.mark.parametrize(
    "location", ["etc/secret", "etc/missing", "../etc/secret", "/etc/passwd", "", "w.bin"]
)
def test_a_location_that_names_no_member_is_refused_alike_whether_the_file_exists(
    server: Any, client: httpx.Client, tmp_path: Path, location: str
) -> None:
    """The server's working directory holds ``etc/secret``: a location naming it reads
    as any other that names no member."""
    model, data = _chain_files(tmp_path)
    onnx_bytes = _set_reference(model, location=location)
    archive = _zip({"model.onnx": onnx_bytes, "model.onnx.data": data})
    detail = _refused(server, client, archive, "is not a file in the archive")
    assert detail.endswith(
        f"initializer 'matmul_W': external data location {location!r} is not a file in the archive"
    )
    assert "server secret" not in detail


@pytest.mark.parametrize(
    ("entries", "phrase"),
    [
        (
            {"offset": "1", "length": "1024"},
            "offset 1 and length 1024 lie outside 'model.onnx.data'",
        ),
        ({"offset": "0", "length": "4096"}, "offset 0 and length 4096 lie outside"),
        ({"offset": "99999999999999999999"}, "lie outside 'model.onnx.data' (1024 bytes)"),
        ({"offset": "-8"}, "external data offset '-8' is not a number"),
        ({"length": "8"}, "needs 1024 bytes, its external data holds 8"),
    ],
)
def test_offsets_and_lengths_outside_the_file_are_refused(
    server: Any, client: httpx.Client, tmp_path: Path, entries: dict[str, str], phrase: str
) -> None:
    model, data = _chain_files(tmp_path)
    assert len(data) == 1024  # 16 x 16 float32
    onnx_bytes = _set_reference(model, **entries)
    archive = _zip({"model.onnx": onnx_bytes, "model.onnx.data": data})
    _refused(server, client, archive, "initializer 'matmul_W'", phrase)


def test_an_archive_declaring_more_than_the_limit_is_refused_unread(
    server: Any, client: httpx.Client, tmp_path: Path
) -> None:
    model, _ = _chain_files(tmp_path)
    bomb = _zip({"model.onnx": model.SerializeToString(), "padding": bytes(LIMIT + 1)})
    assert len(bomb) < LIMIT // 100  # zeros deflate to almost nothing
    _refused(server, client, bomb, f"unpacks to {LIMIT + 1 + len(model.SerializeToString())}")


def test_a_member_that_inflates_past_its_declared_size_is_refused(
    server: Any, client: httpx.Client, tmp_path: Path
) -> None:
    """Sizes patched down in both headers: what decompresses is cut at the size declared
    (the archive is then corrupt), never read past it."""
    model, _ = _chain_files(tmp_path)
    honest = _zip({"model.onnx": model.SerializeToString(), "model.onnx.data": bytes(10 * LIMIT)})
    archive = _patched(honest, "model.onnx.data", 22, 24, struct.pack("<I", 1024))
    assert zipfile.ZipFile(io.BytesIO(archive)).getinfo("model.onnx.data").file_size == 1024
    _refused(server, client, archive, "not a readable zip archive")


def test_data_embedded_past_the_limit_is_refused(
    server: Any, client: httpx.Client, tmp_path: Path
) -> None:
    """Every initializer reading the same 1 MB: the archive is small, the model it would
    make is not."""
    weights = [numpy_helper.from_array(np.zeros((512, 512), np.float32), f"w{i}") for i in range(4)]
    nodes = [
        onnx.helper.make_node("MatMul", ["x" if i == 0 else f"y{i}", f"w{i}"], [f"y{i + 1}"])
        for i in range(4)
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 512])],
        [onnx.helper.make_tensor_value_info("y4", onnx.TensorProto.FLOAT, [1, 512])],
        weights,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    for tensor in model.graph.initializer:
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        entry = tensor.external_data.add()
        entry.key, entry.value = "location", "shared.bin"
    shared = bytes(512 * 512 * 4)
    archive = _zip({"m.onnx": model.SerializeToString(), "shared.bin": shared})
    _refused(server, client, archive, f"external data embedded is larger than the limit of {LIMIT}")


@pytest.mark.parametrize(
    "corrupt",
    [
        b"PK\x03\x04" + b"\x00" * 200,  # a header, then nothing that holds together
        "truncated",
        "bad crc",
    ],
)
def test_corrupt_archives_are_refused(
    server: Any, client: httpx.Client, tmp_path: Path, corrupt: bytes | str
) -> None:
    model, data = _chain_files(tmp_path)
    good = _zip({"model.onnx": model.SerializeToString(), "model.onnx.data": data})
    if corrupt == "truncated":
        archive = good[: len(good) // 2]
    elif corrupt == "bad crc":
        stored = io.BytesIO()
        with zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as out:
            out.writestr("model.onnx", model.SerializeToString())
            out.writestr("model.onnx.data", data)
        flipped = bytearray(stored.getvalue())
        flipped[stored.getvalue().index(data) + 10] ^= 0xFF
        archive = bytes(flipped)
    else:
        assert isinstance(corrupt, bytes)
        archive = corrupt
    _refused(server, client, archive, "not a readable zip archive")


def test_an_archive_whose_model_is_not_onnx_is_refused(server: Any, client: httpx.Client) -> None:
    _refused(server, client, _zip({"model.onnx": b"\xff" * 64}), "'model.onnx' is not an ONNX")


# --- the command line ----------------------------------------------------------------------


def _graph_json(capsys: pytest.CaptureFixture[str], model: Path) -> Any:
    assert remat_main(["graph", str(model), "--batch", "2", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_graph_and_plan_take_a_directory_or_a_zip(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    embedded = _save_external(samples.resnet18(), tmp_path / "resnet")
    (tmp_path / "embedded.onnx").write_bytes(embedded)
    (tmp_path / "resnet.zip").write_bytes(
        _zip({p.name: p.read_bytes() for p in (tmp_path / "resnet").iterdir()})
    )
    expected = _graph_json(capsys, tmp_path / "embedded.onnx")
    assert _graph_json(capsys, tmp_path / "resnet") == expected
    assert _graph_json(capsys, tmp_path / "resnet.zip") == expected
    assert _graph_json(capsys, tmp_path / "resnet" / "model.onnx") == expected
    plan = ["--batch", "2", "--strategy", "checkpoint_all", "--json"]
    assert remat_main(["plan", str(tmp_path / "resnet.zip"), *plan]) == 0
    from_zip = json.loads(capsys.readouterr().out)
    assert remat_main(["plan", str(tmp_path / "embedded.onnx"), *plan]) == 0
    assert from_zip == json.loads(capsys.readouterr().out)


def _one_line_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert remat_main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("remat: error: "), err
    return err


def test_cli_refusals_are_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, data = _chain_files(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no .onnx file in" in _one_line_error(capsys, "graph", str(empty), "--batch", "2")
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.onnx").write_bytes(model.SerializeToString())
    (two / "b.onnx").write_bytes(model.SerializeToString())
    assert "holds 2 .onnx files (a.onnx, b.onnx)" in _one_line_error(capsys, "graph", str(two))
    escaping = tmp_path / "escaping.zip"
    escaping.write_bytes(_zip({"model.onnx": model.SerializeToString(), "../x": data}))
    error = _one_line_error(capsys, "plan", str(escaping), "--batch", "2")
    assert "absolute path or '..'" in error
    missing = tmp_path / "missing.zip"
    missing.write_bytes(_zip({"model.onnx": model.SerializeToString()}))
    error = _one_line_error(capsys, "graph", str(missing), "--batch", "2")
    assert "'model.onnx.data' is not a file in the archive" in error


def test_submit_packs_the_data_files_into_a_zip(
    server: Any, client: httpx.Client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    embedded = _save_external(samples.chain(n=5, features=24), tmp_path / "net", "net.onnx")
    (tmp_path / "net" / "unrelated.bin").write_bytes(SECRET)  # named by no tensor: not sent
    archive = archive_with_external_data(tmp_path / "net" / "net.onnx")
    assert archive is not None
    assert zipfile.ZipFile(io.BytesIO(archive)).namelist() == ["net.onnx", "net.onnx.data"]
    assert load_archive(io.BytesIO(archive)).model.SerializeToString() == embedded

    options = ["--batch", "2", "--budget", "cpu0=100%", "--strategy", "checkpoint_all"]
    for model in (tmp_path / "net", tmp_path / "net" / "net.onnx"):
        code = remat_main(["submit", "--server", server["url"], str(model), *options])
        out = capsys.readouterr().out
        assert code == 0, out
        assert "(net.onnx, 6 nodes)" in out and "strategy:   checkpoint_all" in out
    sha256 = hashlib.sha256(embedded).hexdigest()
    [row] = [m for m in client.get("/v1/models").json()["items"] if m["sha256"] == sha256]
    assert row["filename"] == "net.onnx"
    jobs = client.get("/v1/jobs", params={"model_id": row["id"]}).json()["items"]
    assert [wait_job(client, j["id"])["status"] for j in jobs] == ["succeeded"] * 2


def test_submit_refuses_a_location_outside_the_model_directory(
    server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, data = _chain_files(tmp_path)
    (tmp_path / "secret").write_bytes(data)
    (tmp_path / "chain" / "model.onnx").write_bytes(_set_reference(model, location="../secret"))
    with pytest.raises(ModelLoadError, match="is not a file inside the model's directory"):
        archive_with_external_data(tmp_path / "chain" / "model.onnx")
    submit = ["submit", "--server", server["url"], str(tmp_path / "chain"), "--batch", "2"]
    error = _one_line_error(capsys, *submit)
    assert "initializer 'matmul_W': external data location '../secret' is not a file" in error
