"""Models as an attacker writes them: external data that points elsewhere, a few bytes that
ask for gigabytes, more nodes than anything real. Ingestion refuses each with a plain
ModelLoadError or ShapeError, reads no file outside the model's own directory, and says
nothing about whether a path exists."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from remat.errors import ModelLoadError, ShapeError
from remat.onnx_ingest import MAX_NODES, count_nodes, load_forward_graph, load_model

F32 = TensorProto.FLOAT
SECRET = np.array([3, 4], np.int64)  # read as a Reshape's shape, it would show in the graph


def _vi(name: str, shape: list[int | str], dtype: int = F32) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:  # type: ignore[no-untyped-def]
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _external(name: str, location: str, dims: list[int]) -> TensorProto:
    tensor = TensorProto(name=name, data_type=TensorProto.INT64, dims=dims)
    tensor.data_location = TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", location
    return tensor


def _constant_shape_model(location: str) -> onnx.ModelProto:
    """Reshape(x, shape) where ``shape`` is a Constant node whose tensor lives in
    ``location``: folding it would read that file."""
    constant = helper.make_node(
        "Constant", [], ["shape"], value=_external("v", location, [2]), name="c"
    )
    reshape = helper.make_node("Reshape", ["x", "shape"], ["y"], name="r")
    return _model([constant, reshape], [_vi("x", [12])], [_vi("y", ["a", "b"])])


@pytest.fixture
def secret_in_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding ``etc/secret`` (what a relative location would hit)."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "secret").write_bytes(SECRET.tobytes())
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_constant_with_external_data_is_refused_not_read(secret_in_cwd: Path) -> None:
    data = _constant_shape_model("etc/secret").SerializeToString()
    with pytest.raises(ModelLoadError, match="outside the model file") as caught:
        load_forward_graph(data)
    assert "(3, 4)" not in str(caught.value)


def test_external_data_in_an_attribute_is_refused_even_beside_the_model(tmp_path: Path) -> None:
    (tmp_path / "shape.bin").write_bytes(SECRET.tobytes())
    path = tmp_path / "m.onnx"
    onnx.save(_constant_shape_model("shape.bin"), path)
    with pytest.raises(ModelLoadError, match="only initializers may"):
        load_model(path, external_data_dir=tmp_path)


def test_a_model_file_with_external_initializers_is_refused_without_a_directory(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.onnx"
    weights = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    matmul = helper.make_node("MatMul", ["x", "W"], ["y"])
    onnx.save(
        _model([matmul], [_vi("x", [2, 4])], [_vi("y", ["a"])], [weights]),
        path,
        save_as_external_data=True,
        location="w.bin",
        size_threshold=0,
    )
    with pytest.raises(ModelLoadError, match="initializer 'W' keeps its data outside"):
        load_model(path)
    assert load_forward_graph(path, external_data_dir=tmp_path).fixed["W"].nbytes == 64


@pytest.mark.parametrize(
    "location",
    ["../secret", "/etc/passwd", "a/../../secret", "C:\\secret", "..\\secret", "", "link/x"],
)
def test_initializer_locations_outside_the_directory_are_refused(
    tmp_path: Path, location: str
) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (tmp_path / "secret").write_bytes(b"x" * 64)
    (model_dir / "link").symlink_to(tmp_path)  # inside by name, outside once followed
    shape = _external("shape", location, [2])
    reshape = helper.make_node("Reshape", ["x", "shape"], ["y"])
    model = _model([reshape], [_vi("x", [12])], [_vi("y", ["a"])], [shape])
    with pytest.raises(ModelLoadError, match="is not a file inside the model's directory"):
        load_forward_graph(model.SerializeToString(), external_data_dir=model_dir)


def test_a_refusal_reads_the_same_whether_the_path_exists_or_not(tmp_path: Path) -> None:
    (tmp_path / "exists").write_bytes(b"x" * 64)
    messages = []
    for name in ("exists", "missing"):
        with pytest.raises(ModelLoadError) as caught:
            load_model(_constant_shape_model(f"../{name}").SerializeToString())
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


def _rss_mib_after(code: str) -> tuple[str, float]:
    """Run ``code`` in a fresh interpreter; its output and peak resident memory (VmHWM:
    ``ru_maxrss`` would carry the forking parent's size across exec)."""
    peak = "[int(s.split()[1]) for s in open('/proc/self/status') if s.startswith('VmHWM')][0]"
    script = f"{code}\nprint({peak})"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    *lines, peak_kib = done.stdout.strip().splitlines()
    return "\n".join(lines), int(peak_kib) / 1024


def test_constant_of_shape_of_a_huge_size_allocates_nothing_large() -> None:
    """A 2^24-element ConstantOfShape: ONNX's data propagation alone took 2.4 GB."""
    shape = numpy_helper.from_array(np.array([1 << 24], np.int64), "s")
    nodes = [
        helper.make_node("ConstantOfShape", ["s"], ["c"]),
        helper.make_node("Add", ["x", "c"], ["y"]),
    ]
    data = _model(nodes, [_vi("x", [1])], [_vi("y", ["a"])], [shape]).SerializeToString()
    code = (
        "from remat.onnx_ingest import load_forward_graph\n"
        f"g = load_forward_graph({data!r})\n"
        "print(g.nodes[0].output_bytes)"
    )
    output, peak = _rss_mib_after(code)
    assert output == str(4 << 24)  # sized, never built
    assert peak < 400, f"peak {peak:.0f} MiB"


@pytest.mark.parametrize("op", ["ConstantOfShape", "Range"])
def test_a_folded_constant_too_large_to_compute_is_refused(op: str) -> None:
    """The value is needed (a Reshape's shape depends on it) but would take gigabytes."""
    if op == "ConstantOfShape":
        inits = [numpy_helper.from_array(np.array([1 << 28], np.int64), "s")]
        make = [helper.make_node("ConstantOfShape", ["s"], ["big"])]
    else:
        inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
                 (("a", 0), ("b", 1 << 28), ("d", 1))]  # fmt: skip
        make = [helper.make_node("Range", ["a", "b", "d"], ["big"])]
    nodes = [
        *make,
        helper.make_node("ReduceMax", ["big"], ["m"], keepdims=1),
        helper.make_node("Cast", ["m"], ["shape"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ShapeError, match="would take"):
        load_forward_graph(
            _model(nodes, [_vi("x", [1])], [_vi("y", ["a"])], inits, 13).SerializeToString()
        )
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200


def test_more_nodes_than_the_limit_are_refused_before_ingestion() -> None:
    count = MAX_NODES + 1
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"]) for i in range(count)]
    model = _model(nodes, [_vi("t0", [1])], [_vi(f"t{count}", ["a"])])
    assert count_nodes(model) == count
    with pytest.raises(ModelLoadError, match=f"has {count} nodes; at most {MAX_NODES}"):
        load_model(model.SerializeToString())


def test_nodes_in_subgraphs_count() -> None:
    inner = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["z"]) for _ in range(3)], "body", [], [_vi("z", [1])]
    )
    node = helper.make_node("If", ["cond"], ["y"], then_branch=inner, else_branch=inner)
    model = _model([node], [_vi("cond", [], TensorProto.BOOL)], [_vi("y", ["a"])])
    assert count_nodes(model) == 7


def test_the_cli_reads_no_external_data_from_a_node_attribute(secret_in_cwd: Path) -> None:
    """``remat graph`` passes the model's directory, where attribute tensors may still not
    keep their data (the relative location would be read from the working directory)."""
    path = secret_in_cwd / "m.onnx"
    onnx.save(_constant_shape_model("etc/secret"), path)
    remat = Path(sys.executable).parent / "remat"
    done = subprocess.run(
        [str(remat), "graph", str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout
    assert "only initializers may" in done.stderr
