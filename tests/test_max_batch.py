"""The max-batch search (``remat.max_batch``) and the ``remat max-batch`` command."""

import json
import subprocess
import threading
from collections.abc import Iterator

import pytest
from cli_runs import finished, remat, start

from remat import samples
from remat.devices import Device, DeviceKind
from remat.errors import InvalidInputError
from remat.graph import NodeKind
from remat.loss import Loss, LossKind
from remat.max_batch import (
    CostBound,
    max_batch,
    one_extra_forward_ms,
    problems_by_batch,
    try_batch,
)
from remat.problem import build_problem
from remat.strategies import SolverSettings, run_strategy
from remat.strategies.auto import auto

CPU = Device("cpu0", DeviceKind.CPU)
GPU = Device("cuda0", DeviceKind.CUDA)
SLOW_STORAGE = Device(
    "cpu0", DeviceKind.CPU, {"storage_write_bandwidth": "1e6", "storage_read_bandwidth": "1e6"}
)
MiB = 2**20
VGG = samples.vgg16()
VGG_BUDGET = 64 * MiB


def builder(model, devices=(CPU,), budget=VGG_BUDGET, solver=None):
    budgets = {d.name: budget for d in devices}
    return problems_by_batch(model, devices=devices, budgets=budgets, solver=solver)


@pytest.fixture(scope="module")
def vgg_auto():
    """The default search (``auto`` under the default bound) on VGG, which two tests read."""
    return max_batch(builder(VGG))


def within_bound(result, problem, bound=None):
    limit = (bound or CostBound()).limit_ms(problem.graph, problem.costs)
    return result.feasible and result.simulation.total_ms <= limit * (1 + 1e-9)


@pytest.mark.parametrize("strategy", ["auto", "chen_greedy"])
def test_found_batch_fits_under_the_bound_and_the_next_does_not(strategy, request):
    build = builder(VGG)
    found = (
        request.getfixturevalue("vgg_auto") if strategy == "auto" else max_batch(build, strategy)
    )
    assert found.batch is not None and not found.capped and not found.interrupted
    assert found.best.batch == found.batch and found.best.fits

    def run(batch):
        problem = build(batch)
        if strategy == "auto":  # as the search asks it: no exact solve once within the bound
            limit = CostBound().limit_ms(problem.graph, problem.costs)
            return auto(problem, good_enough_ms=limit), problem
        return run_strategy(strategy, problem), problem

    result, problem = run(found.batch)
    assert within_bound(result, problem)
    assert result.simulation.peak_bytes["cpu0"] <= VGG_BUDGET
    assert result.simulation.total_ms == pytest.approx(found.best.predicted_ms)
    result, problem = run(found.batch + 1)
    assert not within_bound(result, problem)
    # doubling, then bisection: every try is recorded, each batch once, B + 1 among them
    batches = [t.batch for t in found.tries]
    assert batches[:3] == [1, 2, 4] and len(set(batches)) == len(batches)
    assert found.first_failure.batch == found.batch + 1


def test_default_bound_is_one_extra_forward_pass_eq_10():
    problem = build_problem(samples.chain(3), batch=2, devices=[CPU, GPU])
    graph, costs = problem.graph, problem.costs
    by_hand = 0.0
    for node in graph.nodes:
        fastest = min(costs.compute_ms[node.id])  # C_i on its fastest device
        by_hand += 2 * fastest if node.kind is NodeKind.FORWARD else fastest
    kinds = {n.kind for n in graph.nodes}
    assert kinds == {NodeKind.FORWARD, NodeKind.LOSS, NodeKind.BACKWARD}
    assert CostBound().limit_ms(graph, costs) == pytest.approx(by_hand, rel=1e-12)
    assert one_extra_forward_ms(graph, costs) == pytest.approx(by_hand, rel=1e-12)
    assert CostBound(0.25).limit_ms(graph, costs) == pytest.approx(1.25 * costs.ideal_ms())
    # a trial is judged against exactly this bound
    trial = try_batch(problem, 2)
    assert trial.fits and trial.bound_ms == pytest.approx(by_hand, rel=1e-12)


def test_zero_overhead_is_the_checkpoint_all_max_batch_where_no_transfer_hides(vgg_auto):
    """Without a transfer that hides behind compute (storage too slow to page), no plan
    past checkpoint-all's batch costs the ideal: recomputation is never free. With the
    default SSD, auto pages behind VGG's compute on the CPU, and zero overhead goes past
    it."""
    build = builder(VGG, devices=(SLOW_STORAGE,))
    default = vgg_auto
    # doubling capped at 48, past checkpoint-all's 42: at 64 auto's plans are well over the
    # ideal and its exact solve would take its 10 s; the bisection below 48 is the point
    tight = max_batch(build, bound=CostBound(0.0), cap=48)
    assert not tight.capped
    checkpoint_all = max_batch(build, "checkpoint_all")
    assert tight.batch <= default.batch
    assert tight.batch == checkpoint_all.batch
    assert tight.best.overhead == pytest.approx(0.0, abs=1e-9)
    # recomputation buys batch size at this budget: the default bound finds more
    assert default.batch > tight.batch
    paged = max_batch(builder(VGG), bound=CostBound(0.0), cap=48)
    assert paged.batch is not None and paged.batch > checkpoint_all.batch
    assert paged.best.overhead == pytest.approx(0.0, abs=1e-9)


def test_the_cap_stops_the_doubling():
    found = max_batch(builder(samples.chain(3), budget=2**40), cap=24)
    assert found.batch == 24 and found.capped
    assert [t.batch for t in found.tries] == [1, 2, 4, 8, 16, 24]


def test_a_cancelled_search_stops_with_what_it_has():
    cancel = threading.Event()
    cancel.set()
    found = max_batch(builder(VGG, solver=SolverSettings(cancel=cancel)))
    assert found.interrupted and found.batch == 1 and len(found.tries) == 1


def test_problems_by_batch_needs_budgets_in_bytes():
    with pytest.raises(InvalidInputError, match=r"bytes.*percentage"):
        problems_by_batch(VGG, budgets={"cpu0": "50%"})
    with pytest.raises(InvalidInputError, match="a budget for at least one device"):
        problems_by_batch(VGG, budgets={"cpu0": None})
    build = problems_by_batch(VGG, devices=[CPU, GPU], budgets={"cpu0": "64MiB"})
    problem = build(2)
    assert dict(problem.budgets) == {"cpu0": 64 * MiB, "cuda0": None}


def test_budgets_below_the_fixed_memory_are_a_batch_that_does_not_fit():
    build = builder(VGG, budget=MiB)  # below VGG's parameters
    trial = try_batch(build(1), 1)
    assert not trial.fits and trial.needed_bytes["cpu0"] > MiB


# --- the command ------------------------------------------------------------------------


def test_cli_finds_writes_and_checks_the_plan(vgg, tmp_path):
    out = tmp_path / "plan.json"
    fast = ["--strategy", "chen_greedy"]  # the strategy matters not here; auto is slower
    args = ["--budget", "cpu0=64MiB", *fast, "--json", "-o", str(out)]
    result_run = start("max-batch", str(vgg), *args)
    text_run = start("max-batch", str(vgg), "--budget", "cpu0=64MiB", *fast, "--max-overhead", "0")
    expected = max_batch(builder(VGG), "chen_greedy")
    result = finished(result_run)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["max_batch"] == expected.batch
    assert document["bound"]["kind"] == "one_extra_forward"
    assert document["predicted_ms"] <= document["bound_ms"]
    assert document["peak_bytes"]["cpu0"] <= document["budget_bytes"]["cpu0"] == VGG_BUDGET
    assert [t["batch"] for t in document["tries"]] == [t.batch for t in expected.tries]
    # one progress line per try on stderr
    progress = [line for line in result.stderr.splitlines() if line.startswith("batch")]
    assert len(progress) == len(document["tries"])
    assert "too big" in result.stderr and "<= bound" in result.stderr
    check = remat("check", str(vgg), str(out), "--batch", str(document["max_batch"]))
    assert check.returncode == 0 and check.stdout.startswith("valid"), check.stdout
    text = finished(text_run)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("max batch:  ")
    assert int(text.stdout.split()[2]) <= document["max_batch"]
    assert "at most 0.0% above the ideal" in text.stdout and "cpu0:       peak" in text.stdout


def test_cli_differentiates_the_loss_it_is_given(vgg, tmp_path):
    """``--loss cross_entropy``: the problems carry the loss node and its labels, the plan
    checks against the cross-entropy graph; a loss the model cannot have is one line."""
    out = tmp_path / "plan.json"
    loss = ["--loss", "cross_entropy"]
    result_run = start(
        "max-batch", str(vgg), "--budget", "cpu0=64MiB", *loss, "--json", "-o", str(out)
    )
    bad_run = start("max-batch", str(vgg), "--budget", "cpu0=64MiB", "--loss", "output")
    result = finished(result_run)
    assert result.returncode == 0, result.stderr
    batch = json.loads(result.stdout)["max_batch"]
    problem = problems_by_batch(
        VGG, devices=[CPU], budgets={"cpu0": VGG_BUDGET}, loss=Loss(LossKind.CROSS_ENTROPY)
    )(batch)
    (node,) = [n for n in problem.graph.nodes if n.kind is NodeKind.LOSS]
    assert node.attrs["loss"] == "cross_entropy"
    check = remat("check", str(vgg), str(out), "--batch", str(batch), *loss)
    assert check.returncode == 0 and check.stdout.startswith("valid"), check.stdout
    bad = finished(bad_run)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "output" in bad.stderr


def test_two_devices_with_xengine_fit_at_least_the_best_single_device(tmp_path):
    chain = tmp_path / "chain.onnx"
    chain.write_bytes(samples.chain(5, features=64).SerializeToString())
    common = ["--time-limit", "2", "--max", "64", "--json"]
    single = remat(
        "max-batch", str(chain), "--device", "cuda0:cuda", "--budget", "cuda0=40000", *common
    )
    assert single.returncode == 0, single.stderr
    pair = remat(
        "max-batch",
        str(chain),
        "--device",
        "cuda0:cuda",
        "--device",
        "cuda1:cuda",
        "--budget",
        "cuda0=40000",
        "--budget",
        "cuda1=40000",
        "--strategy",
        "xengine",
        *common,
    )
    assert pair.returncode == 0, pair.stderr
    one, two = json.loads(single.stdout), json.loads(pair.stdout)
    assert two["strategy"] == "xengine"
    assert two["max_batch"] >= one["max_batch"]
    assert all(two["peak_bytes"][d] <= 40000 for d in two["peak_bytes"])


REJECTED = {  # max-batch's arguments after the model: each a quick error
    "percentage": ["--budget", "cpu0=50%"],
    "no budget": [],
    "tpu": ["--budget", "cpu0=64MiB", "--device", "gpu0:tpu"],
    "gpu7": ["--budget", "gpu7=1GiB"],
    "batch 1": ["--budget", "cpu0=1MiB"],
}


@pytest.fixture(scope="module")
def rejected(vgg, tmp_path_factory) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The process of each of ``REJECTED`` on VGG, and of a model without a batch
    dimension ("fixed"), all started by the first test that reads one, side by side; those
    no test read (deselected) are stopped at the end."""
    fixed = tmp_path_factory.mktemp("fixed") / "fixed.onnx"
    fixed.write_bytes(samples.chain(3, batch=4).SerializeToString())
    runs = {name: start("max-batch", str(vgg), *args) for name, args in REJECTED.items()}
    runs["fixed"] = start("max-batch", str(fixed), "--budget", "cpu0=1MiB")
    yield runs
    for process in runs.values():
        if process.returncode is None:
            process.kill()
            process.communicate()


def test_percentage_budget_is_rejected(rejected):
    result = finished(rejected["percentage"])
    assert result.returncode == 2
    assert result.stderr.startswith("remat: error: ") and "Traceback" not in result.stderr
    assert "bytes" in result.stderr and "percentage" in result.stderr


@pytest.mark.parametrize(
    ("name", "message"),
    [("no budget", "a budget for at least one device"), ("tpu", "tpu"), ("gpu7", "gpu7")],
)
def test_bad_input_is_exit_2(rejected, name, message):
    result = finished(rejected[name])
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith("remat: error: ") and message in result.stderr


def test_a_model_without_a_batch_dimension_is_rejected(rejected):
    result = finished(rejected["fixed"])
    assert result.returncode == 2 and "no symbolic batch dimension" in result.stderr


def test_batch_1_not_fitting_exits_1_with_what_it_needs(rejected):
    result = finished(rejected["batch 1"])
    assert result.returncode == 1
    assert result.stdout == ""
    assert "even batch 1 does not fit" in result.stderr and "needs at least" in result.stderr
