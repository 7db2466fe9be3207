"""The command line, run as a real process."""

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_runs import finished, remat, remat_all, start

from remat import samples


def test_graph_summary(vgg):
    result = remat("graph", str(vgg), "--batch", "2")
    assert result.returncode == 0, result.stderr
    assert "Conv" in result.stdout and "checkpoint-all peak" in result.stdout
    assert "mode: training" in result.stdout


def test_graph_json_lists_forward_loss_and_backward_nodes(vgg):
    common = ["graph", str(vgg), "--batch", "2", "--json"]
    result, inference_run = remat_all(common, [*common, "--mode", "inference"])
    graph = json.loads(result.stdout)
    kinds = {n["kind"] for n in graph["nodes"]}
    assert kinds == {"forward", "loss", "backward"}
    assert set(graph["nodes"][0]) == {"id", "name", "op", "kind", "deps", "output_bytes"}
    assert graph["param_bytes"] > 0 and graph["mode"] == "training"
    inference = json.loads(inference_run.stdout)
    assert {n["kind"] for n in inference["nodes"]} == {"forward"}


def test_attention_is_one_node_unless_asked_not_to(tmp_path):
    model = tmp_path / "block.onnx"
    model.write_bytes(samples.transformer_block(batch=2).SerializeToString())
    fused, unfused = remat_all(["graph", str(model)], ["graph", str(model), "--no-fuse-attention"])
    assert fused.returncode == 0 and unfused.returncode == 0, fused.stderr + unfused.stderr
    assert "ScaledDotProductAttention" in fused.stdout and "Softmax" not in fused.stdout
    assert "Softmax" in unfused.stdout

    def peak(output: str) -> int:
        [line] = [x for x in output.splitlines() if x.startswith("checkpoint-all peak")]
        return int(line.rsplit("(", 1)[1].split()[0])

    assert peak(fused.stdout) < peak(unfused.stdout)  # the weights are not held


def test_a_plan_made_with_attention_node_by_node_is_checked_so(tmp_path):
    """A plan made before fusing was the default fails the default check with a hint."""
    model, plan = tmp_path / "block.onnx", tmp_path / "plan.json"
    model.write_bytes(samples.transformer_block(batch=2).SerializeToString())
    made = remat("plan", str(model), "--no-fuse-attention", "--strategy", "checkpoint_all",
                 "-o", str(plan))  # fmt: skip
    assert made.returncode == 0, made.stderr
    fused, unfused = remat_all(
        ["check", str(model), str(plan)], ["check", str(model), str(plan), "--no-fuse-attention"]
    )
    assert fused.returncode == 1 and "invalid: the plan was made for another graph" in fused.stdout
    assert "checked with --no-fuse-attention" in fused.stdout
    assert unfused.returncode == 0 and unfused.stdout.startswith("valid")


def test_plan_then_check_round_trip(vgg, tmp_path):
    out = tmp_path / "plan.json"
    result = remat(
        "plan",
        str(vgg),
        "--batch",
        "8",
        "--device",
        "cpu0:cpu:threads=2",
        "--budget",
        "cpu0=80%",
        "--strategy",
        "chen_greedy",
        "-o",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "strategy:   chen_greedy" in result.stdout
    plan = json.loads(out.read_text())
    assert plan["version"] == 1 and plan["devices"][0]["name"] == "cpu0"
    assert plan["predicted"]["peak_bytes"]["cpu0"] <= plan["devices"][0]["budget_bytes"]
    # and without the first compute: the simulator names the step that breaks
    plan["steps"] = plan["steps"][1:]
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(plan))
    check, check_broken = remat_all(
        ["check", str(vgg), str(out), "--batch", "8"],
        ["check", str(vgg), str(broken), "--batch", "8"],
    )
    assert check.returncode == 0 and check.stdout.startswith("valid")
    assert check_broken.returncode == 1
    assert check_broken.stdout.startswith("invalid: step 0:")
    assert "not resident" in check_broken.stdout


def test_plan_json_default_strategy_picks_a_feasible_baseline(vgg):
    result = remat("plan", str(vgg), "--batch", "8", "--budget", "cpu0=80%", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["predicted"]["peak_bytes"]["cpu0"] <= plan["devices"][0]["budget_bytes"]


def test_infeasible_budget_states_what_is_needed(vgg):
    result = remat(
        "plan", str(vgg), "--batch", "2", "--budget", "cpu0=10%", "--strategy", "checkpoint_all"
    )
    assert result.returncode == 2
    assert "infeasible" in result.stderr and "needs at least" in result.stderr


def test_an_exact_plan_says_how_long_the_search_took_beside_its_solver(vgg):
    """The solver's seconds are the full model's solve, one part of the search (the warm
    start, the covers, the restrictions beside it): the summary gives both."""
    found = remat(
        "plan", str(vgg), "--batch", "2", "--budget", "cpu0=60%", "--strategy", "checkmate_milp",
        "--time-limit", "3",
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    searched = re.search(r"^search: +([0-9.]+) s in all$", found.stdout, re.MULTILINE)
    assert searched is not None, found.stdout
    solver = re.search(r"^solver: .*?(?:, ([0-9.]+) s in the solver)?$", found.stdout, re.MULTILINE)
    assert solver is not None, found.stdout
    if solver.group(1) is not None:
        assert float(solver.group(1)) <= float(searched.group(1)) + 0.1


def test_default_strategy_plans_by_eviction_or_fixed_paging_and_says_what_it_tried(tmp_path):
    model = tmp_path / "block.onnx"
    model.write_bytes(samples.transformer_block(batch=2).SerializeToString())
    # baselines all fail at 50% (attention node by node): greedy eviction (auto's second
    # phase) finds a plan
    unfused = ["--no-fuse-attention", "--time-limit", "2"]
    found = remat("plan", str(model), "--budget", "cpu0=50%", *unfused)
    assert found.returncode == 0, found.stderr
    assert "strategy:" in found.stdout and "predicted:" in found.stdout
    # above the floor, no plan found: what auto tried, never "infeasible"
    tried = remat("plan", str(model), "--budget", "cpu0=40%", *unfused)
    assert tried.returncode == 2 and "infeasible" not in tried.stderr
    assert "no plan found by auto at this budget (tried: baselines on cpu0" in tried.stderr
    assert "the least any of them needed is" in tried.stderr
    # below the memory floor with every fixed tensor resident: auto pages some of them
    # (it stops once it has that plan, 1-2 s on a quiet machine: the longer limit is for a
    # busy one)
    patient = ["--no-fuse-attention", "--time-limit", "30"]
    paged = remat("plan", str(model), "--budget", "cpu0=30%", *patient)
    assert paged.returncode == 0, paged.stderr
    assert "fixed tensors paged" in paged.stdout and "to and from storage" in paged.stdout


def test_budget_below_one_nodes_fixed_tensors_is_rejected_before_planning(vgg):
    result = remat("plan", str(vgg), "--batch", "2", "--budget", "cpu0=1KiB")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no plan can fit, even paging the others to storage" in result.stderr


def _vgg16(path: Path) -> None:
    path.write_bytes(samples.vgg16().SerializeToString())


def _chain(path: Path) -> None:
    path.write_bytes(samples.chain().SerializeToString())


BAD_INPUTS = [
    (None, ["graph", "/nonexistent/model.onnx"], "model.onnx"),
    (lambda p: p.write_bytes(b"definitely not onnx"), ["graph", "{p}"], ""),
    (lambda p: p.write_bytes(samples.truncated_bytes()), ["graph", "{p}", "--batch", "2"], ""),
    (_vgg16, ["graph", "{p}"], "--batch"),
    (_vgg16, ["plan", "{p}", "--batch", "2", "--device", "gpu0:tpu"], "tpu"),
    (_vgg16, ["plan", "{p}", "--batch", "2", "--budget", "cpu0=lots"], "lots"),
    (_vgg16, ["plan", "{p}", "--batch", "2", "--budget", "gpu7=1GiB"], "gpu7"),
    (_chain, ["graph", "{p}", "--input", "nonsense"], "nonsense"),
    (_chain, ["plan", "{p}", "--batch", "2", "--objective", "weighted"], "needs alpha"),
    (_chain, ["plan", "{p}", "--batch", "2", "--power-cap", "cpu0=3"], "below its idle power"),
    (_chain, ["plan", "{p}", "--batch", "2", "--power-cap", "cpu0=many"], "'many' is not watts"),
    (_chain, ["plan", "{p}", "--batch", "2", "--storage-bandwidth", "fast"], "'fast'"),
    (
        _chain,
        [
            "plan",
            "{p}",
            "--batch",
            "2",
            "--device",
            "cpu0:cpu:pool=ram",
            "--device",
            "gpu0:cuda:pool=ram",
            "--budget",
            "cpu0=1MiB",
        ],
        "shares pool 'ram'",
    ),
]


@pytest.fixture(scope="module")
def bad_input_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[subprocess.Popen[str]]]:
    """The process of each of ``BAD_INPUTS``, all started by the first test that reads one,
    side by side; those no test read (deselected) are stopped at the end."""
    processes = []
    for make, args, _ in BAD_INPUTS:
        path = tmp_path_factory.mktemp("bad") / "m.onnx"
        if make is not None:
            make(path)
        processes.append(start(*(a.format(p=path) for a in args)))
    yield processes
    for process in processes:
        if process.returncode is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize(("make", "args", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_exit_2_no_traceback(bad_input_runs, make, args, message):
    result = finished(bad_input_runs[BAD_INPUTS.index((make, args, message))])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("remat: error:")
    assert message in lines[0]


def test_plan_for_energy_prints_the_plans_energy_and_objective(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(samples.ZOO["transformer"](batch=2).SerializeToString())
    devices = ["--device", "cpu0:cpu:threads=2", "--device", "gpu0:cuda:idle_w=30"]
    args = ["plan", str(path), *devices, "--strategy", "xengine", "--time-limit", "10"]
    by_energy = remat(*args, "--objective", "energy", "--json")
    by_time = remat(*args, "--json")
    assert by_energy.returncode == 0 and by_time.returncode == 0, by_energy.stderr
    energy, time = json.loads(by_energy.stdout), json.loads(by_time.stdout)
    assert energy["predicted"]["energy_mj"] <= time["predicted"]["energy_mj"] * (1 + 1e-6)
    assert "mJ" in by_energy.stderr  # the solver's progress is in the objective's unit
    text = remat(*args, "--objective", "weighted", "--alpha", "0.01", "--board-power", "5")
    assert text.returncode == 0, text.stderr
    assert "objective:  time + 0.01 ms/mJ x energy" in text.stdout
    assert "mJ (power model)" in text.stdout


def test_port_pages_over_the_storage_bandwidth_given(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(samples.chain().SerializeToString())
    args = ["plan", str(path), "--batch", "2", "--budget", "cpu0=60%", "--strategy", "port"]
    poet = ["--objective", "energy", "--time-cap", "1000"]  # POET's: energy within 1 s
    result = remat(*args, *poet, "--storage-bandwidth", "20GB/s", "--time-limit", "2", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["strategy"] == "port"
    assert plan["devices"][0]["options"]["storage_read_bandwidth"] == "2e+10"
    assert plan["predicted"]["peak_bytes"]["cpu0"] <= plan["devices"][0]["budget_bytes"]
    assert plan["predicted"]["total_ms"] <= 1000
    assert plan["solver"]["objective"] == pytest.approx(plan["predicted"]["energy_mj"])


def test_griewank_on_a_non_linear_graph_is_a_clear_error(tmp_path):
    path = tmp_path / "resnet.onnx"
    path.write_bytes(samples.resnet18().SerializeToString())
    result = remat("plan", str(path), "--batch", "2", "--strategy", "griewank")
    assert result.returncode == 2 and "linear" in result.stderr


def test_demo_prints_a_comparison_table():
    result = remat("demo", "--model", "chain", "--batch", "2", "--time-limit", "1")
    assert result.returncode == 0, result.stderr
    for strategy in (
        "checkpoint_all",
        "chen_sqrt",
        "chen_greedy",
        "griewank",
        "ap_sqrt",
        "linearized_greedy",
        "checkmate_milp",
        "checkmate_lp_rounding",
        "xengine",
    ):
        assert strategy in result.stdout
    assert "overhead" in result.stdout and "valid" in result.stdout
    assert "NO" not in result.stdout.split()


def test_plan_with_a_profiled_cost_table(vgg, tmp_path):
    from remat.costs import analytical_costs, cost_table_of
    from remat.devices import Device, DeviceKind
    from remat.onnx_ingest import load_forward_graph
    from remat.training import training_graph

    graph = training_graph(load_forward_graph(vgg, batch=8))
    devices = [Device("cpu0", DeviceKind.CPU), Device("cuda0", DeviceKind.CUDA)]
    table = cost_table_of(graph, analytical_costs(graph, devices)).model_dump(mode="json")
    table["source"] = "profiled"
    for entry in table["nodes"].values():
        entry["compute_ms"]["cuda0"] = entry["compute_ms"]["cpu0"] * 100  # a slow "GPU"
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(table))
    common = ["plan", str(vgg), "--batch", "8", "--costs", str(path)]
    result, summary, unknown = remat_all(
        [*common, "--json"], common, [*common, "--device", "x:cpu"]
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert {s["device"] for s in plan["steps"] if s["op"] == "compute"} == {"cpu0"}
    assert "costs:      profiled" in summary.stdout
    assert unknown.returncode == 2 and "'x' is not in the cost table" in unknown.stderr


def test_only_the_named_devices_of_a_cost_table_are_used(vgg, tmp_path):
    """``--device cpu0:cpu`` with a table that also has a (fast) cuda0: the plan is on cpu0
    alone, under its budget (cuda0 was used, with no budget)."""
    from remat.costs import analytical_costs, cost_table_of
    from remat.devices import Device, DeviceKind
    from remat.onnx_ingest import load_forward_graph
    from remat.training import training_graph

    graph = training_graph(load_forward_graph(vgg, batch=8))
    devices = [Device("cpu0", DeviceKind.CPU), Device("cuda0", DeviceKind.CUDA)]
    table = cost_table_of(graph, analytical_costs(graph, devices)).model_dump(mode="json")
    table["source"] = "profiled"
    for entry in table["nodes"].values():
        entry["compute_ms"]["cuda0"] = entry["compute_ms"]["cpu0"] / 100  # a fast GPU
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(table))
    common = ["plan", str(vgg), "--batch", "8", "--costs", str(path), "--json"]
    both_run, result, other = remat_all(
        [*common, "--strategy", "checkpoint_all"],
        [*common, "--device", "cpu0:cpu", "--budget", "cpu0=80%"],
        [*common, "--device", "cpu0:cpu", "--budget", "cuda0=1GiB"],
    )
    both = json.loads(both_run.stdout)
    assert {s["device"] for s in both["steps"] if s["op"] == "compute"} == {"cuda0"}
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert [d["name"] for d in plan["devices"]] == ["cpu0"]
    assert {s["device"] for s in plan["steps"] if s["op"] == "compute"} == {"cpu0"}
    assert plan["predicted"]["peak_bytes"]["cpu0"] <= plan["devices"][0]["budget_bytes"]
    assert other.returncode == 2 and "budget for unknown device 'cuda0'" in other.stderr


def test_verbose_logs_each_phase_of_the_search(vgg):
    """``-v`` shows what an exact search did: its warm start and its full solve (logged as
    it starts, also at a 1 s limit)."""
    args = ["plan", str(vgg), "--batch", "8", "--budget", "cpu0=80%", "--strategy", "xengine"]
    quiet, verbose = remat_all([*args, "--time-limit", "1"], [*args, "--time-limit", "1", "-v"])
    assert quiet.returncode == verbose.returncode == 0, verbose.stderr
    assert "warm start" not in quiet.stderr
    assert "warm start: " in verbose.stderr and "full solve" in verbose.stderr


def test_family_plans_buckets_and_a_size_on_the_spot(tmp_path):
    model = tmp_path / "transformer.onnx"
    model.write_bytes(samples.transformer_block(layers=2, seq="S").SerializeToString())
    common = ["family", str(model), "--no-fuse-attention", "--device", "cuda0:cuda"]
    common += ["--budget", "cuda0=75%"]
    result, bad, fixed, shares = remat_all(
        [*common, "--input", "input=2x16..128x32", "--strategy", "greedy_evict", "--size", "50"],
        [*common, "--input", "input=2x16..8x32"],
        [*common, "--input", "input=2x16x16..64"],
        [*common, "--input", "input=2x16..128x32", "--observed", "16:0.6,128:0.3"],
    )
    assert result.returncode == 0, result.stderr
    assert "sizes 16..128 on cuda0" in result.stdout
    assert "size 50:" in result.stdout and "greedy_evict at 128" in result.stdout
    assert bad.returncode == 2 and "range 16..8 is empty" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    assert fixed.returncode == 2 and "is 32 in the model, not symbolic" in fixed.stderr
    assert shares.returncode == 2 and "the observed shares sum to 0.9, not 1" in shares.stderr
    assert len(shares.stderr.strip().splitlines()) == 1


REGIME = ["--device", "cpu0:cpu:threads=12", "--device", "cuda0:cuda:flops=2e12,bandwidth=60e9",
          "--budget", "cpu0=55%", "--budget", "cuda0=55%"]  # fmt: skip


def test_a_plan_starts_from_a_plan_made_before_for_its_graph(tmp_path):
    """XEngine on two devices with no time to search (0.05 s) ends at the one-device plan
    it is started from, and says so (its warm start alone is dearer:
    tests/test_known_plans.py); a plan of another graph, or of a device the job does not
    have, is refused."""
    resnet, chain, plan = tmp_path / "resnet.onnx", tmp_path / "chain.onnx", tmp_path / "p.json"
    resnet.write_bytes(samples.resnet18(batch=4).SerializeToString())
    chain.write_bytes(samples.chain().SerializeToString())
    made = remat("plan", str(resnet), *REGIME, "--strategy", "greedy_evict", "-o", str(plan))
    assert made.returncode == 0, made.stderr
    earlier = json.loads(plan.read_text())
    started, other, device = remat_all(
        ["plan", str(resnet), *REGIME, "--strategy", "xengine", "--time-limit", "0.05",
         "--start-from", str(plan)],
        ["plan", str(chain), "--batch", "2", "--start-from", str(plan)],
        ["plan", str(resnet), "--device", "cuda0:cuda", "--start-from", str(plan)],
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert f"predicted:  {earlier['predicted']['total_ms']:.3f} ms" in started.stdout
    assert f"no plan cheaper than {plan}'s was found" in started.stdout
    assert other.returncode == 2 and "the plan was made for another graph" in other.stderr
    assert device.returncode == 2 and "runs on cpu0, not among the devices cuda0" in device.stderr
