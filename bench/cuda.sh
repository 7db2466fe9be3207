#!/usr/bin/env bash
# The CUDA checks, in one run on a machine with an NVIDIA GPU: the GPU tests, then the
# agreement and overhead benches on cuda0 (bench/agent.py on the GPU alone, with
# offload_dynprog, and beside the CPU; bench/eager.py --device cuda), and a probe of how
# often NVML's energy counter moves.
# Each part has its own time limit, so that one that hangs leaves the others their time;
# each writes its log to $OUT (default bench/results/cuda), with the result rows the
# benches appended and the profiled cost tables of cuda0 (results.tgz: bench/results/*.csv,
# tables/MODEL.json). Infeasible budgets are reported and left out (VGG16 and ResNet-18 at
# 50% on cuda0 once cuDNN's workspaces count).
#
#     OUT=/tmp/cuda bash bench/cuda.sh [python]
#
# The python (default python3) needs torch with CUDA and the project's dependencies; the
# repository is put on PYTHONPATH, so it need not be installed.
set -u
cd "$(dirname "$0")/.."
PY=${1:-python3}
OUT=${OUT:-bench/results/cuda}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

part() {  # part NAME SECONDS COMMAND...: the command's output in $OUT/NAME.log
    local name=$1 seconds=$2
    shift 2
    echo "== $name (up to ${seconds} s): $*"
    local start=$SECONDS
    timeout -k 5 "$seconds" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s"
    tail -n 25 "$OUT/$name.log"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'
} >"$OUT/machine.log" 2>&1
cat "$OUT/machine.log"

part tests 110 "$PY" -m pytest -p no:cacheprovider -n 6 -rs \
    tests/test_executor.py tests/test_kernels.py tests/test_profiler.py \
    tests/test_energy_counters.py tests/test_offload_execution.py tests/test_coarsen.py \
    -k "cuda or gpu or nvml or measured_where or workspace"
part agent_cuda 150 "$PY" bench/agent.py --devices cuda0:cuda --budgets 100,75,50 --repeats 3 \
    --time-limit 3 --save-tables "$OUT/tables" --run cuda
part eager_cuda 60 "$PY" bench/eager.py --device cuda --models small_cnn,transformer_encoder \
    --processes 1 --repeats 20 --rounds 2 --run cuda
part offload_cuda 60 "$PY" bench/agent.py --devices cuda0:cuda --strategy offload_dynprog \
    --budgets 90,75 --repeats 3 --run cuda
part cpu_cuda 50 "$PY" bench/agent.py --devices cpu0:cpu:threads=8 cuda0:cuda \
    --models resnet18 --budgets 100,75 --repeats 3 --time-limit 5 --run cuda
# How often NVML's energy counter moves, idle and under a queue of matrix products.
part nvml_period 20 "$PY" - <<'PROBE'
import statistics, time
import pynvml, torch
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
def watch(seconds):
    read = lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    start, last, first = time.perf_counter(), read(), read()
    stamps, reads = [start], 0
    while time.perf_counter() - start < seconds:
        value, reads = read(), reads + 1
        if value != last:
            stamps.append(time.perf_counter())
            last = value
    gaps = [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:])]
    watts = (last - first) / 1e3 / (time.perf_counter() - start)
    gap = statistics.median(gaps) if gaps else float("nan")
    print(f"{len(stamps) - 1} changes in {seconds} s over {reads} reads, median gap {gap:.1f} ms, {watts:.0f} W")
watch(1.0)
a = torch.randn(8192, 8192, device="cuda")
for _ in range(400):
    a = (a @ a).clamp_(-1, 1)
watch(1.0)
torch.cuda.synchronize()
PROBE
tar czf "$OUT/results.tgz" bench/results/*.csv -C "$OUT" tables
