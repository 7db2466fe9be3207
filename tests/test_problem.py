"""``remat.problem``: one function from a model (or a graph) to a checked ``Problem``."""

import pytest

from remat import budgets as budgets_module
from remat import samples
from remat.budgets import fixed_bytes, reference
from remat.costs import CostSource, CostTable, analytical_costs, cost_table_of
from remat.devices import MAX_BYTES, Device, DeviceKind, Size, format_bytes
from remat.errors import InvalidInputError, RematError
from remat.graph import Mode
from remat.problem import build_problem, cost_model, model_graph, problem_from_graph
from remat.simulator import held_fixed_bytes
from remat.strategies import SolverSettings
from remat.training import training_graph

from graphs import chain

CPU = Device("cpu0", DeviceKind.CPU)
GPU = Device("cuda0", DeviceKind.CUDA)
CPU1 = Device("cpu1", DeviceKind.CPU, {"threads": "2"})


@pytest.fixture(scope="module")
def graph():
    return training_graph(chain(6))


def profile_table(graph, devices=(CPU, GPU)) -> CostTable:
    """A "profiled" table of ``graph`` on ``devices`` (analytical numbers, source profiled)."""
    table = cost_table_of(graph, analytical_costs(graph, list(devices)))
    return table.model_copy(update={"source": CostSource.PROFILED})


def test_a_model_and_its_file_give_the_same_problem(tmp_path):
    model = samples.chain(4)
    path = tmp_path / "chain.onnx"
    path.write_bytes(model.SerializeToString())
    budgets = {"cpu0": "80%"}
    from_model = build_problem(model, batch=2, devices=[CPU], budgets=budgets)
    from_file = build_problem(path, batch=2, devices=[CPU], budgets=budgets)
    assert from_model.graph == from_file.graph
    assert from_model.budgets == from_file.budgets
    assert from_model.graph.mode is Mode.TRAINING
    inference = build_problem(model, batch=2, mode=Mode.INFERENCE)
    assert inference.graph == model_graph(model, batch=2, mode=Mode.INFERENCE)
    assert inference.graph.mode is Mode.INFERENCE


def test_defaults_one_unlimited_cpu0_with_analytical_costs(graph):
    problem = problem_from_graph(graph)
    assert [d.name for d in problem.costs.devices] == ["cpu0"]
    assert problem.costs.source is CostSource.ANALYTICAL
    assert dict(problem.budgets) == {"cpu0": None}
    assert problem.solver == SolverSettings()


def test_budgets_in_bytes_text_sizes_and_none(graph):
    problem = problem_from_graph(
        graph, devices=[CPU, GPU, CPU1], budgets={"cpu0": 10**6, "cuda0": "1MiB", "cpu1": None}
    )
    assert dict(problem.budgets) == {"cpu0": 10**6, "cuda0": 2**20, "cpu1": None}


@pytest.mark.parametrize("bad", [-1, MAX_BYTES + 1, True])
def test_a_budget_that_is_not_a_byte_count_is_rejected(graph, bad):
    with pytest.raises(InvalidInputError, match=r"'cpu0'.*not a number of bytes"):
        problem_from_graph(graph, budgets={"cpu0": bad})


def test_percent_budgets_refer_to_the_checkpoint_all_peak(graph):
    ref = reference(graph, analytical_costs(graph, [CPU]))
    full = problem_from_graph(graph, budgets={"cpu0": "100%"})
    half = problem_from_graph(graph, budgets={"cpu0": "50%"})
    parsed = problem_from_graph(graph, budgets={"cpu0": Size(percent=50)})
    assert full.budgets["cpu0"] == ref.peak_bytes
    activations = ref.peak_bytes - ref.fixed_bytes
    assert half.budgets["cpu0"] == ref.fixed_bytes + round(activations / 2)
    assert parsed.budgets == half.budgets


def test_the_reference_is_computed_once_and_only_for_percentages(graph, monkeypatch):
    calls = []
    real = budgets_module.reference

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(budgets_module, "reference", counting)
    problem_from_graph(graph, devices=[CPU, GPU], budgets={"cpu0": "60%", "cuda0": "40%"})
    assert len(calls) == 1  # both percentages from one reference; the fixed check needs none
    problem_from_graph(graph, devices=[CPU, GPU], budgets={"cpu0": "1MiB", "cuda0": "1MiB"})
    assert len(calls) == 1  # bytes: the fixed-memory check needs no plan


def test_fixed_bytes_is_the_reference_fixed_memory(graph):
    ref = reference(graph, analytical_costs(graph, [CPU]))
    assert fixed_bytes(graph) == ref.fixed_bytes > 0


def test_a_budget_for_an_unknown_device_is_rejected(graph):
    with pytest.raises(InvalidInputError, match=r"unknown device 'gpu9' \(devices: cpu0\)"):
        problem_from_graph(graph, budgets={"gpu9": "50%"})
    with pytest.raises(InvalidInputError, match="unknown device 'cuda0'"):
        problem_from_graph(graph, devices=[CPU], budgets={"cuda0": "1GiB"})


def test_unknown_budget_device_is_found_before_the_model_is_loaded(tmp_path):
    missing = tmp_path / "no-such-model.onnx"
    with pytest.raises(InvalidInputError, match="unknown device 'gpu9'"):
        build_problem(missing, budgets={"gpu9": "1GiB"})


@pytest.mark.parametrize("devices", [[CPU, CPU], [CPU, GPU, Device("cpu0", DeviceKind.CUDA)]])
def test_device_names_must_be_unique(graph, devices):
    with pytest.raises(InvalidInputError, match="device names must be unique"):
        problem_from_graph(graph, devices=devices)


def test_no_devices_is_an_error(graph):
    with pytest.raises(InvalidInputError, match="no devices"):
        problem_from_graph(graph, devices=[])


def test_budgets_below_what_one_node_needs_of_fixed_tensors_are_rejected(graph):
    fixed = fixed_bytes(graph)
    need = max(held_fixed_bytes(graph, [node.id]) for node in graph.nodes)
    assert need < fixed
    with pytest.raises(InvalidInputError, match="no plan can fit, even paging the others"):
        problem_from_graph(graph, budgets={"cpu0": need - 1})
    # two devices: together they must hold it
    with pytest.raises(InvalidInputError, match=f"below the {format_bytes(need)} that node"):
        problem_from_graph(graph, devices=[CPU, GPU], budgets={"cpu0": 1, "cuda0": 1})
    # below the whole fixed memory, above one node's: plans may page the rest (version 5)
    assert problem_from_graph(graph, budgets={"cpu0": need}).budgets["cpu0"] == need
    split = {"cpu0": fixed // 2, "cuda0": fixed - fixed // 2}
    assert problem_from_graph(graph, devices=[CPU, GPU], budgets=split).budgets == split
    # an unlimited device can hold it all
    lone = problem_from_graph(graph, devices=[CPU, GPU], budgets={"cpu0": 100})
    assert dict(lone.budgets) == {"cpu0": 100, "cuda0": None}
    # max-batch: such a batch does not fit (the strategy says what it needs), no error
    unchecked = problem_from_graph(graph, budgets={"cpu0": 100}, check_fixed=False)
    assert unchecked.budgets["cpu0"] == 100


def test_a_table_is_restricted_to_the_named_devices(graph):
    table = profile_table(graph, (CPU, GPU, CPU1))
    problem = problem_from_graph(graph, devices=[CPU1, CPU], table=table, budgets={"cpu0": "80%"})
    assert [d.name for d in problem.costs.devices] == ["cpu1", "cpu0"]
    assert problem.costs.source is CostSource.PROFILED
    assert set(problem.budgets) == {"cpu1", "cpu0"}
    assert problem.costs.copy_ms.shape == (len(graph), 2, 2)
    # without named devices: every device of the table
    everything = problem_from_graph(graph, table=table)
    assert [d.name for d in everything.costs.devices] == ["cpu0", "cuda0", "cpu1"]
    # a budget for a device of the table that is not named is an error, not ignored
    with pytest.raises(InvalidInputError, match="unknown device 'cuda0'"):
        problem_from_graph(graph, devices=[CPU], table=table, budgets={"cuda0": "1GiB"})


def test_a_device_missing_from_the_table_is_rejected(graph):
    table = profile_table(graph)
    with pytest.raises(InvalidInputError, match=r"'x' is not in the cost table \(it has: cpu0"):
        problem_from_graph(graph, devices=[Device("x", DeviceKind.CPU)], table=table)
    with pytest.raises(InvalidInputError, match="'x' is not in the cost table"):
        cost_model(graph, [Device("x", DeviceKind.CPU)], table)


def test_the_analytical_cost_model_uses_the_devices_given(graph):
    costs = cost_model(graph, [GPU, CPU1])
    assert [d.name for d in costs.devices] == ["cuda0", "cpu1"]
    assert costs.devices[1].threads == 2


def test_an_oversize_graph_is_rejected_before_its_costs_are_built(graph):
    huge = training_graph(chain(3, size=MAX_BYTES // 2))
    with pytest.raises(InvalidInputError, match="beyond any device"):
        problem_from_graph(huge)


def test_a_cost_model_above_the_limit_is_rejected(graph):
    need = len(graph) * (2 * 2 + 2) * 8
    with pytest.raises(InvalidInputError, match="cost model, above this server's limit"):
        problem_from_graph(graph, devices=[CPU, GPU], max_cost_bytes=need - 1)
    assert problem_from_graph(graph, devices=[CPU, GPU], max_cost_bytes=need).costs is not None


def test_an_oversize_batch_of_a_model_is_rejected():
    with pytest.raises(RematError, match="more than any device holds"):
        build_problem(samples.chain(2), batch=2**56)


def test_solver_settings_are_kept(graph):
    settings = SolverSettings(backend="highs")
    assert problem_from_graph(graph, solver=settings).solver is settings
