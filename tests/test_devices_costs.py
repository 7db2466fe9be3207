import json

import numpy as np
import pytest

from remat.costs import (
    AnalyticalParams,
    CostSource,
    analytical_costs,
    cost_table_of,
    load_cost_table,
    profiled_costs,
)
from remat.devices import Device, DeviceKind, parse_device, parse_size
from remat.errors import InvalidInputError
from remat.training import training_graph

from graphs import chain

CPU = Device("cpu0", DeviceKind.CPU)
GPU = Device("cuda0", DeviceKind.CUDA)


def test_parse_device_with_options():
    d = parse_device("cpu1:cpu:threads=2,flops=1e9")
    assert (d.name, d.kind, d.threads, d.options["flops"]) == ("cpu1", DeviceKind.CPU, 2, "1e9")
    assert parse_device("cuda0:cuda").kind is DeviceKind.CUDA


def test_a_devices_memory_is_a_size_in_bytes():
    assert parse_device("cpu0:cpu:memory=256MiB").memory_bytes == 256 * 2**20
    assert parse_device("cpu0:cpu:threads=2,memory=1000").memory_bytes == 1000
    assert parse_device("cuda0:cuda").memory_bytes is None
    for bad in ("0", "50%", "lots", "2EiB"):
        with pytest.raises(InvalidInputError, match="memory must be a size in bytes above 0"):
            parse_device(f"cpu0:cpu:memory={bad}")


@pytest.mark.parametrize(
    "spec", ["cpu0", "cpu0:tpu", "0cpu:cpu", "cpu0:cpu:threads", "c:cpu:threads=x"]
)
def test_parse_device_rejects_bad_specs(spec):
    with pytest.raises(InvalidInputError):
        parse_device(spec)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("123", 123),
        ("2KiB", 2048),
        ("208MiB", 208 * 2**20),
        ("1.5GiB", int(1.5 * 2**30)),
        ("3MB", 3_000_000),
    ],
)
def test_parse_size_bytes(text, expected):
    assert parse_size(text).bytes == expected


def test_percent_scales_activation_part_of_peak():
    size = parse_size("50%")
    assert size.percent == 50
    assert size.resolve(fixed_bytes=1000, peak_bytes=3000) == 2000
    assert parse_size("100%").resolve(1000, 3000) == 3000


@pytest.mark.parametrize("text", ["", "12 parsecs", "-5MiB", "abc%", "0%"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(InvalidInputError):
        parse_size(text)


def test_analytical_cost_is_max_of_compute_and_memory_plus_launch():
    g = training_graph(chain(2, size=4_000_000))
    params = AnalyticalParams()
    costs = analytical_costs(g, [CPU, GPU], params)
    assert costs.source is CostSource.ANALYTICAL
    node = g.nodes[0]
    cpu = params.spec(CPU)
    expected = max(node.flops / cpu.flops_per_s, node.bytes_moved / cpu.bytes_per_s) + cpu.launch_s
    assert costs.compute_ms[0, 0] == pytest.approx(expected * 1e3)
    assert costs.compute_ms[0, 1] < costs.compute_ms[0, 0]  # the GPU is faster
    # copy = bytes / link + latency, both directions, zero on the diagonal
    assert costs.copy_ms[0, 0, 1] == pytest.approx((4_000_000 / 12e9 + 10e-6) * 1e3)
    assert costs.copy_ms[0, 0, 0] == 0
    assert costs.ideal_ms() == pytest.approx(costs.compute_ms.min(axis=1).sum())


def test_cpu_threads_and_overrides_change_speed():
    g = training_graph(chain(2, size=4_000_000))
    one = analytical_costs(g, [CPU]).compute_ms[0, 0]
    four = analytical_costs(g, [Device("c", DeviceKind.CPU, {"threads": "4"})]).compute_ms[0, 0]
    slow = analytical_costs(g, [Device("c", DeviceKind.CPU, {"bandwidth": "1e6"})])
    assert four < one < slow.compute_ms[0, 0]
    with pytest.raises(InvalidInputError):
        analytical_costs(g, [Device("c", DeviceKind.CPU, {"flops": "fast"})])


def test_cost_table_round_trip_is_profiled(tmp_path):
    g = training_graph(chain(3))
    analytical = analytical_costs(g, [CPU, GPU])
    table = cost_table_of(g, analytical).model_dump()
    table["source"] = "profiled"
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(table))
    profiled = profiled_costs(g, load_cost_table(path))
    assert profiled.source is CostSource.PROFILED
    np.testing.assert_allclose(profiled.compute_ms, analytical.compute_ms)
    np.testing.assert_allclose(profiled.copy_ms, analytical.copy_ms)
    assert list(profiled.output_bytes) == [n.output_bytes for n in g.nodes]
    assert "n0:grad" in table["nodes"] and "loss" in table["nodes"]


def test_cost_table_errors_name_what_is_missing(tmp_path):
    g = training_graph(chain(2))
    table = cost_table_of(g, analytical_costs(g, [CPU, GPU])).model_dump()
    del table["nodes"]["n1:grad"]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(table))
    with pytest.raises(InvalidInputError, match="n1:grad"):
        profiled_costs(g, load_cost_table(path))
    path.write_text("{not json")
    with pytest.raises(InvalidInputError, match=r"c\.json"):
        load_cost_table(path)
    path.write_text(json.dumps({"source": "guessed", "devices": [], "nodes": {}}))
    with pytest.raises(InvalidInputError, match="source"):
        load_cost_table(path)
    with pytest.raises(InvalidInputError, match=r"missing\.json"):
        load_cost_table(tmp_path / "missing.json")


def test_a_cost_table_is_refused_on_a_graph_it_was_not_measured_on():
    """A profile records its graph's digest; one without (older, or written by hand) is
    of a graph with exactly its node names."""
    g, longer = training_graph(chain(3)), training_graph(chain(4))
    table = cost_table_of(g, analytical_costs(g, [CPU]))
    assert table.measured_on(g) and not table.measured_on(longer)
    stamped = table.model_copy(update={"graph": g.fingerprint.digest})
    assert stamped.measured_on(g) and not stamped.measured_on(longer)
    renamed = table.model_copy(update={"graph": longer.fingerprint.digest})
    assert not renamed.measured_on(g)
    with pytest.raises(InvalidInputError, match=r"measured on another graph.*profile the model"):
        profiled_costs(g, renamed)


def test_a_restricted_cost_table_keeps_only_the_named_devices_in_their_order():
    g = training_graph(chain(3))
    table = cost_table_of(g, analytical_costs(g, [CPU, GPU]))
    spread = {"cpu0": 0.1, "cuda0": 0.2}
    table.nodes["n0"] = table.nodes["n0"].model_copy(update={"compute_spread_ms": spread})
    only_gpu = table.restricted(["cuda0"])
    assert [d.name for d in only_gpu.devices] == ["cuda0"]
    assert all(list(n.compute_ms) == ["cuda0"] for n in only_gpu.nodes.values())
    assert only_gpu.nodes["n0"].compute_spread_ms == {"cuda0": 0.2}
    assert all(pairs == {} for pairs in only_gpu.copy_ms.values())  # no copies left
    costs = profiled_costs(g, only_gpu)
    np.testing.assert_allclose(costs.compute_ms[:, 0], profiled_costs(g, table).compute_ms[:, 1])
    swapped = table.restricted(["cuda0", "cpu0"])
    assert [d.name for d in swapped.devices] == ["cuda0", "cpu0"]
    assert swapped.copy_ms == table.copy_ms
    with pytest.raises(InvalidInputError, match="no device 'tpu0'"):
        table.restricted(["tpu0"])
