"""The executor: runs a plan step by step (compute, copy, free, the transfers to host
memory of plan version 2: offload, prefetch, wait, and the paging to storage of version 3:
page_out, page_in, ended by a wait too) on the node's devices and reports what it measured
next to what the simulator predicted.

Time. The measured runs time the whole plan, from its first step until every device is
done; nothing between steps waits for a device (no CUDA synchronisation or events per
step, which cost about 25 us a step against kernels of 50 to 100 us). One more run times
each compute and copy step on its device, as the profiler times nodes, for the report's
per-step times.

Before anything runs, the plan's devices are bound to this node's devices (``DeviceError``
for one it lacks) and the plan is replayed by the simulator (``PlanRejectedError`` with its
violation): validity and peaks do not depend on times, so analytical costs suffice.

Memory. Each device holds, for the whole run, the fixed tensors the simulator's rule puts
there (``remat.simulator.held_fixed_bytes``: every parameter and input read by a node it
computes, and a gradient buffer for the fixed tensors of the backward nodes it computes),
plus the values resident on it. The measured peak of a CPU device is the executor's own
account of those bytes, taken from the tensors themselves after every step (two emulated
CPU devices share the host's memory, so the process's memory cannot tell them apart); of a
CUDA device it is the peak of the bytes requested from PyTorch's CUDA allocator above the
baseline before the run (``requested_bytes`` in ``torch.cuda.memory_stats``). That also
sees what the kernels allocate for themselves while they run (cuDNN workspaces, the
temporaries of a gradient), which a plan made from a profiled table counts (the table's
``workspace_bytes``) and the replay's analytical costs do not. The report's predicted
peak is the plan's own (``Plan.predicted``; the replay's for a plan without one); it also
keeps the executor's own account for every device (``accounted_peak_bytes``, which equals
the replay's peak for a correct run of a plan without transfers, less the workspace the
replay charges while a node runs, such as an attention's scores, which no tensor the
account sees holds) and, for CUDA, the
allocator's peak (``allocator_peak_bytes``: ``max_memory_allocated``, which adds the
allocator's rounding of every block and the slack of cached blocks it reuses without
splitting, up to 1 MiB each).

Transfers (plan version 2). Each device has a transfer lane to its host memory, beside the
compute lane (the steps, run in order on this thread): on a CPU device a thread of its own
(a one-worker thread pool per device, made for each run and shut down at its end, also on
failure), on a CUDA device a side stream with pinned host buffers. An ``offload`` copies the
value into fresh host memory on the lane; the device copy stays resident, readable and
counted until the ``wait`` for it, which blocks until the copy is complete and then
releases it. A ``prefetch`` copies the host copy back into fresh device memory on the lane;
the value is readable once the ``wait`` for it has returned. Transfers on one lane run one
at a time in plan order (one worker; one stream), and each starts after the compute steps
issued before it (CUDA: the side stream waits for the compute stream), as the simulator
assumes. On CUDA a transfer is followed by an event on the side stream, and a ``wait``
makes the compute stream wait for it; the device tensors a transfer reads or writes are
marked as used by the side stream (``record_stream``), so that the caching allocator does
not hand their memory out again before the transfer is done. A transfer step's time is
what issuing it took on the compute lane; a wait's is how long it blocked (CUDA: until the
compute stream passed the event). Transfers still running after the last step (an offload
never waited for) are waited for before the run's total time is taken.

Paging (plan version 3). Each device that pages also has a paging lane to the node's
storage, beside its lane to host memory and run by the same rules (one transfer at a time
in plan order, each after the compute steps issued before it): a thread of its own that
writes and reads the files (one worker, made for each run and shut down at its end, also
on failure), and on CUDA a side stream of its own for the copies between the device and
pinned host buffers, which that thread issues as it comes to each transfer. A run that
pages works in a directory of its own, made in the storage directory (``storage``, the
agent's ``--storage``; ``agents.storage``) and removed with its files when the run ends,
however it ends. A ``page_out`` writes the value's bytes as they lie in its storage (its
layout kept to rebuild it) to a file of its own on the lane (CUDA: once the side stream
has copied them into pinned host memory), fsyncs the file and drops it from the page cache
(``POSIX_FADV_DONTNEED``): the ``wait`` for it blocks until all that is done, so the
device copy is released only once the write has completed, and a later ``page_in`` reads
the disk rather than a copy left in memory. A ``page_in`` allocates the value's device
memory when the compute lane issues it and reads the file into it on the lane (CUDA: into
pinned host memory, then copied to the device on the side stream, followed by an event);
the value is readable once its ``wait`` has returned. A file that cannot be written or
read (a full disk: ENOSPC; EFBIG, EIO) fails the run at the ``wait`` for it (at the run's
end for a page-out never waited for) with ``StorageError``: one line naming the node, the
storage directory and the OS's reason.

Paged fixed tensors (plan version 5). A run that pages fixed tensors first writes each
of them (its value, made contiguous) to a file of its own in the run's directory, before
the run is timed, as the node's storage would hold a model's parameters; they are not
placed on any device. A ``fixed_in`` reads the file into fresh device memory on the
paging lane (as a ``page_in``: counted from its step), readable once its ``fixed_wait``
has returned; a ``fixed_free`` drops the device copy. A paged tensor's gradient buffer is
made, zeroed and counted, by the first computation of the first backward node that writes
it; a ``grad_out`` writes it to a file of its own on the paging lane (as a ``page_out``),
and its ``grad_wait`` releases it. The gradients written out are read back from their
files for the comparison with the reference, before the run's directory is removed.

Memory pools. Devices that share a pool (``pool`` in the plan's device options) hold one
set of resident values, one set of fixed tensors and gradient buffers (for every node any
of them computes) and one account, as the simulator does, and each reports the pool's
peak. Only a pool of devices of one kind runs: a CPU's and a GPU's tensors are apart in
PyTorch, so such a pool is refused.

Concurrent plans (version 4, PORT-M). A run of consecutive compute steps is one section:
each device runs its steps of it in plan order on a thread of its own (the section's
first device on the run's thread, the others on threads the run starts once), a step
waiting for the inputs another device computes in the section, and the step after the
section waits until every thread is done. Each such signal between threads costs the
host's thread hand-off, which the profiler measures and the simulator charges
(``remat.costs.CostModel.handoff_ms``). PyTorch's
kernels release the interpreter lock, so two CPU devices of a pool (each its own thread
count) compute at once. The account takes each allocation under a lock; a section only
allocates, so its peak is the plan-order peak. A failing step stops the section's other
threads at their next step and fails the run as a sequential one would.

Memory of transfers. An offloaded or paged-out value counts on its device until its wait
releases it, as in the simulator; a host copy or a file counts on no device. A prefetched
or paged-in value counts from its step itself (its memory is reserved when the compute
lane issues it, and allocated then too on CUDA, and for a page-in on a CPU), which is
simple and conservative: the simulator's own rule reserves it when the transfer starts,
later than the step where the lane is still busy with earlier transfers, which depends on
the transfers' timing. So plans are judged (``remat.strategies.common.problem.
evaluate_plan``) and checked here (``check_plan``) with that memory counted from its step
(``simulate(..., reserve_at_issue=True)``), the bound of every instant whatever the
timing, whose peak the account equals.

Numerics. In training, the parameter gradients summed over the devices' gradient
buffers are compared with plain end-to-end autograd on the host: the error of a tensor is
``max|a - b| / max|b|`` (see ``max_relative_error``), and they match when the worst is at
most 1e-4 (fp32). In inference the model outputs are compared with a plain forward run in
the same way. On the host both sides run nearly the same kernels in the same order, so their
rounding errors agree; CUDA kernels round differently, and on an ill-conditioned model
(U-Net's instance norms) plain fp32 autograd on the host is itself up to 1e-2 away from the
exact result. So when the plan uses a CUDA device, or the host's comparison fails, the
reference is the same plain run in float64 (``exact``), in two ways (``accuracy``): a
tensor's error measured against ``max|b|`` floored at ``CUDA_ALLOWANCE / TOLERANCE`` times
the host's fp32 rounding noise (the largest ``|fp32 - exact|`` over all tensors), at most
1e-4: within 1e-4 of the exact result relatively, or within ``CUDA_ALLOWANCE`` times the
noise fp32 itself makes; and, with a CUDA device, a plain relative error of at most 1e-4 or
``CUDA_ALLOWANCE`` times the host's fp32 error against it, whichever is larger
(``ExecutionReport.tolerance``). The floor keeps the check well conditioned where the exact
gradients are zero (constant weights before a softmax: fp32 autograd returns rounding
noise, a plan's kernels may return exact zeros or other noise, and a relative error of
noise against noise is about 1). The report says so (``gradients_vanish``): every exact
gradient is within fp32's noise, so a match says only that the run's are zero too.

Operators in training mode (a BatchNormalization with ``training_mode=1``, a Dropout with a
true ``training_mode``) run with training semantics in the plan and in both references
alike. A Dropout's mask is drawn from ``seed`` and the node's name alone
(``kernels.random_mask``): the plan's evaluations of the node (recomputations included, on
any device), the float64 run and the plain run all use the same mask, as a real
rematerialising trainer replays its random state; every repeat reuses it too.

Energy. Where the plan's devices have energy counters (``agents.energy_counters``: RAPL
for CPU packages, NVML for CUDA GPUs), the executor reads them before and after the
measured runs (every device synchronised first) and reports the energy per run
(``energy_mj``): each distinct counter's advance, summed, over the runs. It is the whole
draw, idle included, as the plan's prediction (``Predicted.energy_mj``) counts it, so the
two compare. A counter shared by several devices (emulated CPU devices on one socket's
RAPL, told apart by the counter's description) counts once. The window is the measured
runs' loop, so it also covers each run's setup and collection of results (placing fixed
tensors, copying gradients to the host), a little more than the timed part of a run. Where
a counter moves too rarely for the measured runs (``energy_counters.WINDOW_UPDATES`` of
its updates: NVML's, a second), more runs are made until the loop spans them; they count
among the measured runs. ``energy_note`` names the counters read and the devices they
cover, and the devices left uncounted with the reason (their energy is not in
``energy_mj``); without any counter there is no ``energy_mj`` and the note gives the
reasons. A counter that fails to read drops the measurement, not the execution. The
report's JSON carries both in ``measured`` (``remat.agent_protocol.Measured``), and the
plan's predicted energy in ``predicted``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, get_args

import numpy as np
import onnx
import torch

from agents.energy_counters import Counter, counter_of, updates_s
from agents.errors import DeviceError, DeviceOutOfMemory, PlanRejectedError, StorageError
from agents.in_place import in_place_steps
from agents.program import (
    Evaluator,
    GradientBuffers,
    Program,
    Value,
    build_program,
    value_bytes,
)
from agents.storage import describe, read_back, resolve_storage, scratch_directory, write_through
from agents.torch_devices import (
    Runtime,
    check_memory,
    copy_runtime,
    is_out_of_memory,
    measuring,
    runtime_of,
)
from remat.costs import analytical_costs
from remat.devices import Device
from remat.graph import Graph, Mode, NodeKind
from remat.plan import (
    Compute,
    Copy,
    FixedFree,
    FixedIn,
    FixedStep,
    FixedWait,
    Free,
    GradOut,
    GradWait,
    Offload,
    PageIn,
    PageOut,
    Plan,
    Prefetch,
    Step,
    Wait,
)
from remat.simulator import Key, Simulation, memory_spaces, simulate

TOLERANCE = 1e-4
# Against the float64 reference: how many times the host's own fp32 error is allowed.
CUDA_ALLOWANCE = 10.0
FP32_EPS = torch.finfo(torch.float32).eps
FP64_EPS = torch.finfo(torch.float64).eps


@dataclass(frozen=True)
class ExecutionReport:
    total_ms: float
    step_ms: list[float]
    peak_bytes: dict[str, int]
    predicted_total_ms: float | None
    predicted_peak_bytes: dict[str, int]
    gradients_match: bool | None  # None in inference mode
    max_rel_error: float | None  # gradients' worst relative error; None in inference
    # Every exact gradient is zero up to fp32's rounding noise; None in inference, or with
    # no gradients at all.
    gradients_vanish: bool | None = None
    # Inference: the model outputs against a plain forward run (not part of to_json).
    outputs_match: bool | None = None
    outputs_rel_error: float | None = None
    runs_ms: list[float] = field(default_factory=list)  # total of every measured run
    # The executor's own account of tensor bytes per device (= peak_bytes on CPU).
    accounted_peak_bytes: dict[str, int] = field(default_factory=dict)
    # CUDA devices: the allocator's peak, with its block rounding and slack.
    allocator_peak_bytes: dict[str, int] = field(default_factory=dict)
    tolerance: float = TOLERANCE  # what max_rel_error / outputs_rel_error were held to
    # Training: the run's parameter gradients, summed over devices, on the host
    # (not part of to_json; e.g. for a check against the framework the model came from).
    gradients: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    # Energy per measured run in mJ, total draw over the distinct counters read (module
    # docstring); None without any counter. The note: the counters, or why there are none.
    energy_mj: float | None = None
    energy_note: str = ""
    predicted_energy_mj: float | None = None  # the plan's

    def to_json(self) -> dict[str, Any]:
        """The report as agents send it (``remat.agent_protocol.ExecutionResult``)."""
        measured: dict[str, Any] = {
            "total_ms": self.total_ms,
            "peak_bytes": dict(self.peak_bytes),
            "step_ms": list(self.step_ms),
            "energy_note": self.energy_note,
        }
        if self.energy_mj is not None:
            measured["energy_mj"] = self.energy_mj
        return {
            "measured": measured,
            "predicted": {
                "total_ms": self.predicted_total_ms,
                "peak_bytes": dict(self.predicted_peak_bytes),
                "energy_mj": self.predicted_energy_mj,
            },
            "gradients_match": self.gradients_match,
            "max_rel_error": self.max_rel_error,
            "gradients_vanish": self.gradients_vanish,
        }


def execute(
    model: onnx.ModelProto,
    graph: Graph,
    plan: Plan,
    devices: Sequence[Device] | None = None,
    *,
    inputs: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    warmup: int = 1,
    repeats: int = 1,
    energy_counters: Mapping[str, Counter | None] | None = None,
    storage: str | Path | None = None,
) -> ExecutionReport:
    """Run ``plan`` (for ``graph``, built by remat from ``model``) on ``devices`` (the
    node's; None: the plan's own). ``warmup`` unmeasured runs come first; of ``repeats``
    measured runs the one with the median total is reported, and the last one's gradients
    (outputs) are checked. Those runs time the whole plan only (a CUDA device is not
    synchronised between steps); one more run times each step (synchronising, as the
    profiler does) for ``step_ms``. ``seed`` seeds the model
    inputs not given and the masks of training-mode Dropouts. The measured runs' energy is
    read where counters exist (module docstring); ``energy_counters``: per device name,
    the counter to read (None: none there), a device it does not name gets
    ``counter_for``'s. ``storage``: the node's storage directory, where a plan that pages
    writes its files (None: ``$REMAT_STORAGE``, else ``~/.cache/remat/storage``, see
    ``agents.storage.resolve_storage``); a plan that does not page never touches it."""
    runtimes = bind_devices(plan, devices)
    simulation = check_plan(plan, graph)
    directory = resolve_storage(storage) if plan.pages else None
    program = build_program(model, graph, inputs, seed)
    run = partial(_Run, program, plan, runtimes, storage=directory)
    with measuring():
        for _ in range(warmup):
            run().run()
        measured, energy_mj, energy_note = _metered(
            runtimes, energy_counters, lambda: _measured_runs(run, max(repeats, 1))
        )
        steps = run(timed_steps=True).run()
    chosen = sorted(measured, key=lambda r: r.total_ms)[(len(measured) - 1) // 2]
    report = ExecutionReport(
        total_ms=chosen.total_ms,
        step_ms=steps.step_ms,
        peak_bytes=chosen.peak_bytes,
        predicted_total_ms=plan.predicted.total_ms if plan.predicted is not None else None,
        predicted_peak_bytes=dict(
            simulation.peak_bytes if plan.predicted is None else plan.predicted.peak_bytes
        ),
        gradients_match=None,
        max_rel_error=None,
        runs_ms=[r.total_ms for r in measured],
        accounted_peak_bytes=chosen.accounted_peak_bytes,
        allocator_peak_bytes=chosen.allocator_peak_bytes,
        energy_mj=energy_mj,
        energy_note=energy_note,
        predicted_energy_mj=plan.predicted.energy_mj if plan.predicted is not None else None,
    )
    training = graph.mode is Mode.TRAINING
    uses_cuda = any(r.is_cuda for r in runtimes.values())
    # the last run's: the others dropped theirs (``_measured_runs``)
    measured_values = measured[-1].gradients if training else measured[-1].outputs
    check = accuracy(measured_values, program, training, uses_cuda)
    if training:
        return _with(
            report,
            gradients={name: g.cpu() for name, g in measured_values.items()},
            gradients_match=check.matches,
            max_rel_error=check.error,
            gradients_vanish=check.vanish,
            tolerance=check.tolerance,
        )
    return _with(
        report,
        outputs_match=check.matches,
        outputs_rel_error=check.error,
        tolerance=check.tolerance,
    )


def plain_run_ms(program: Program, plan: Plan, runtimes: Mapping[str, Runtime]) -> float:
    """The time of one run of ``plan`` as ``execute`` times its measured ones (the whole
    plan, no step timed; its values dropped), under ``measuring``'s conditions: what the
    profiler sets its node times against (``step_overhead_ms``)."""
    with measuring():
        return _Run(program, plan, runtimes).run().total_ms


def plain_runs_at_once(
    program: Program, plans: Mapping[str, Plan], runtimes: Mapping[str, Runtime]
) -> dict[str, float]:
    """One run of each device's plan (``plans`` by device name), all at once, each on a
    thread of its own, timed as ``plain_run_ms`` times one: what the profiler sets a
    pool's devices' times against when they compute together (``concurrent_slowdown``)."""

    def run(name: str) -> float:
        return _Run(program, plans[name], {name: runtimes[name]}).run().total_ms

    with measuring(), ThreadPoolExecutor(len(plans), thread_name_prefix="remat-at-once") as pool:
        futures = {name: pool.submit(run, name) for name in plans}
        return {name: future.result() for name, future in futures.items()}


def _measured_runs(run: Callable[[], _Run], repeats: int) -> list[_Result]:
    """``repeats`` runs; each but the last without its gradients and outputs, so that the
    runs do not hold every earlier run's values (a parameter's size each) while they run."""
    results = [run().run().without_values() for _ in range(repeats - 1)]
    return [*results, run().run()]


def _energy_counters(
    runtimes: Mapping[str, Runtime], given: Mapping[str, Counter | None] | None
) -> tuple[dict[str, tuple[Counter, list[str]]], dict[str, str]]:
    """The distinct counters of the devices (by description: devices sharing one count it
    once), each with the devices it covers; and the devices without one, with why."""
    distinct: dict[str, tuple[Counter, list[str]]] = {}
    missing: dict[str, str] = {}
    for name, runtime in runtimes.items():
        counter, reason = counter_of(runtime, given)
        if counter is None:
            missing[name] = reason
        else:
            distinct.setdefault(counter.description, (counter, []))[1].append(name)
    return distinct, missing


def _uncounted(missing: Mapping[str, str]) -> str:
    """The devices without a counter, grouped by reason (``cpu0, cpu1: why``)."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in missing.items():
        by_reason.setdefault(reason, []).append(name)
    return "; ".join(f"{', '.join(names)}: {reason}" for reason, names in by_reason.items())


def _metered(
    runtimes: Mapping[str, Runtime],
    given: Mapping[str, Counter | None] | None,
    work: Callable[[], list[_Result]],
) -> tuple[list[_Result], float | None, str]:
    """``work()``'s runs, their energy per run in mJ (None without any counter, or when a
    counter fails to read) and the note on it (module docstring)."""
    distinct, missing = _energy_counters(runtimes, given)
    if not distinct:
        return work(), None, "no energy counter: " + _uncounted(missing)

    def read() -> dict[str, float]:
        for runtime in runtimes.values():
            runtime.synchronize()
        return {description: c.joules() for description, (c, _) in distinct.items()}

    try:
        before = read()
    except Exception as error:  # optional: a counter must not fail the execution
        return work(), None, f"the energy counters cannot be read: {error}"
    start = time.perf_counter()
    results = work()
    # more runs where the counters move too rarely for these (NVML: every 100 ms)
    window = max(updates_s(counter) for counter, _ in distinct.values())
    while time.perf_counter() - start < window:
        results = [*(r.without_values() for r in results), *work()]
    try:
        after = read()
    except Exception as error:
        return results, None, f"the energy counters cannot be read: {error}"
    elapsed_ms = (time.perf_counter() - start) * 1e3
    joules = sum(after[d] - before[d] for d in distinct)
    counted = "; ".join(f"{d} ({', '.join(names)})" for d, (_, names) in distinct.items())
    note = f"{counted}: over {len(results)} run(s) in {elapsed_ms:.1f} ms"
    if missing:
        note += "; not counted: " + _uncounted(missing)
    return results, max(joules, 0.0) / len(results) * 1e3, note


def _reference(program: Program, training: bool) -> dict[str, torch.Tensor]:
    if training:
        return program.reference_gradients()
    return program.model_output_values(program.forward_values())


@dataclass(frozen=True)
class Accuracy:
    error: float
    tolerance: float
    vanish: bool | None = None  # training: every exact value is within fp32's noise

    @property
    def matches(self) -> bool:
        return self.error <= self.tolerance


def accuracy(
    measured: Mapping[str, torch.Tensor], program: Program, training: bool, uses_cuda: bool
) -> Accuracy:
    """The error of the gradients (training) or model outputs (inference) of a run, and
    what it is held to; the run matches where any of these holds:

    - host only: against the plain fp32 run on the host, at most ``TOLERANCE``;
    - against the plain run in float64, each tensor's scale floored at ``noise_floor`` (so
      that ``CUDA_ALLOWANCE`` times fp32's own rounding noise is within tolerance), at
      most ``TOLERANCE``: well conditioned where every exact value is zero;
    - with a CUDA device: against the float64 run, at most ``TOLERANCE`` or
      ``CUDA_ALLOWANCE`` times the host fp32 run's relative error against it.

    The first that holds is reported (else the second). In training the float64 run is
    always made: it tells whether the gradients vanish (``gradients_vanish``)."""
    reference = _reference(program, training)
    exact = _reference(program.in_float64(), training) if training or uses_cuda else None
    vanish = gradients_vanish(reference, exact) if training and exact is not None else None
    if not uses_cuda:
        error = max_relative_error(measured, reference)
        if error <= TOLERANCE:
            return Accuracy(error, TOLERANCE, vanish)
    if exact is None:
        exact = _reference(program.in_float64(), training)
    floored = Accuracy(
        max_relative_error(measured, exact, noise_floor(reference, exact, vanish)),
        TOLERANCE,
        vanish,
    )
    if floored.matches or not uses_cuda:
        return floored
    host_error = max_relative_error(reference, exact)
    relative = Accuracy(
        max_relative_error(measured, exact),
        max(TOLERANCE, CUDA_ALLOWANCE * host_error),
        vanish,
    )
    return relative if relative.matches else floored


def _max_abs_difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The largest ``|a - b|`` over the tensors both have (of the same shape)."""
    worst = 0.0
    for name, t in b.items():
        other = a.get(name)
        if other is None or tuple(other.shape) != tuple(t.shape) or not t.numel():
            continue
        diff = (other.detach().double().cpu() - t.detach().double().cpu()).abs().max()
        worst = max(worst, float(diff))
    return worst


def noise_floor(
    reference: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor], vanish: bool | None
) -> float:
    """The smallest scale a tensor is measured against: ``CUDA_ALLOWANCE / TOLERANCE``
    times fp32's rounding noise, so that a deviation within ``CUDA_ALLOWANCE`` times that
    noise is within tolerance. The noise is the host fp32 run's largest absolute error
    against float64; where every exact value is itself float64 rounding noise (``vanish``,
    from ``gradients_vanish``) and the fp32 run happens to round to exactly zero, it is at least
    that float64 noise at fp32's precision (another fp32 computation of a zero need not
    round to zero)."""
    noise = _max_abs_difference(reference, exact)
    if vanish:
        largest = max(
            (float(t.detach().abs().max()) for t in exact.values() if t.numel()), default=0.0
        )
        noise = max(noise, largest * FP32_EPS / FP64_EPS)
    return CUDA_ALLOWANCE / TOLERANCE * noise


def gradients_vanish(
    reference: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor]
) -> bool | None:
    """Whether every exact (float64) gradient is zero up to fp32's rounding noise: no entry
    larger than the host fp32 run's largest error against it. None without gradients."""
    if not any(t.numel() for t in exact.values()):
        return None
    largest = max(float(t.detach().double().abs().max()) for t in exact.values() if t.numel())
    return largest <= _max_abs_difference(reference, exact)


def _with(report: ExecutionReport, **changes: Any) -> ExecutionReport:
    return ExecutionReport(**{**report.__dict__, **changes})


def bind_devices(plan: Plan, devices: Sequence[Device] | None) -> dict[str, Runtime]:
    """The plan's devices bound to this node's (by name; kinds must agree). A CPU device
    runs with the plan's thread count (what was profiled and planned), else the node's; the
    node's ``memory`` option holds whatever the plan says."""
    node = {d.name: d for d in devices} if devices is not None else None
    bound: dict[str, Runtime] = {}
    for planned in plan.devices:
        options = dict(planned.options)
        if node is not None:
            local = node.get(planned.name)
            if local is None:
                known = ", ".join(sorted(node)) or "none"
                raise DeviceError(
                    f"the plan names device {planned.name!r}, which this node does not have "
                    f"(its devices: {known})"
                )
            if local.kind is not planned.kind:
                raise DeviceError(
                    f"device {planned.name!r} is {local.kind.value} on this node, "
                    f"{planned.kind.value} in the plan"
                )
            options = {**local.options, **options}
            if local.memory_bytes is not None:
                options["memory"] = str(local.memory_bytes)
        bound[planned.name] = runtime_of(Device(planned.name, planned.kind, options))
    for index, step in enumerate(plan.steps):
        for name in _step_devices(step):
            if name not in bound:
                raise DeviceError(f"plan step {index} names unknown device {name!r}")
    return bound


def _step_devices(step: Step) -> tuple[str, ...]:
    return (step.src, step.dst) if isinstance(step, Copy) else (step.device,)


def check_plan(plan: Plan, graph: Graph) -> Simulation:
    """The simulator's replay of ``plan`` under its own budgets; PlanRejectedError with the
    violation if it rejects it. Transfers to host memory (plan version 2) and paging to
    storage (version 3) are checked like every other step: the executor runs them. A
    memory pool of devices of two kinds is refused."""
    devices = [Device(d.name, d.kind, dict(d.options)) for d in plan.devices]
    for pool in sorted({d.memory_space for d in devices}):
        kinds = sorted({d.kind.value for d in devices if d.memory_space == pool})
        if len(kinds) > 1:
            raise PlanRejectedError(
                f"memory pool {pool!r} has {' and '.join(kinds)} devices: the executor holds a "
                "pool's tensors on one kind of device (a CPU's and a GPU's tensors are apart "
                "in PyTorch)"
            )
    simulation = simulate(
        plan, graph, analytical_costs(graph, devices).pooled(), reserve_at_issue=True
    )
    if simulation.violation is not None:
        raise PlanRejectedError(f"the simulator rejects the plan: {simulation.violation}")
    return simulation


def max_relative_error(
    measured: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    floor: float = 0.0,
) -> float:
    """The worst ``max|a - b| / max|b|`` over the reference's tensors, ``max|b|`` floored at
    ``1e-3`` of the largest reference entry overall: a gradient that is zero in exact
    arithmetic (a key bias before a softmax, a conv bias before an instance norm) holds
    rounding noise, not a scale, while a wrong tensor is still off by about its own size.
    ``floor``: a further absolute floor (``noise_floor``), for when every entry of the
    reference may be noise. A missing tensor, a shape mismatch, or any difference from a
    reference that is exactly zero everywhere with no floor is an infinite error."""
    expected = {name: t.detach().double().cpu() for name, t in reference.items()}
    scales = {name: float(t.abs().max()) if t.numel() else 0.0 for name, t in expected.items()}
    floor = max(floor, 1e-3 * max(scales.values(), default=0.0))
    worst = 0.0
    for name, b in expected.items():
        got = measured.get(name)
        if got is None or tuple(got.shape) != tuple(b.shape):
            return float("inf")
        if not b.numel():
            continue
        diff = float((got.detach().double().cpu() - b).abs().max())
        scale = max(scales[name], floor)
        worst = max(worst, diff / scale if scale > 0 else (float("inf") if diff else 0.0))
    return worst


@dataclass
class _Transfer:
    """A transfer in flight on a lane."""

    offload: bool  # out of the device (an offload, a page-out); else in (prefetch, page-in)
    # the lane thread's work: CPU, the host copy; paging, the file written or read (CUDA: a
    # page-in's event after its copy to the device, with its pinned buffers)
    future: Future[Any] | None = None
    event: Any = None  # CUDA: a torch.cuda.Event recorded on the side stream after the copy
    copy: Value = ()  # CUDA: the copy; a page-in: the device bytes it reads into
    reserved: int = 0  # a prefetch or a page-in: the bytes accounted when it was issued
    layouts: tuple[_Layout, ...] = ()  # a page-in: how its value lies in the bytes read


class _Lane:
    """A device's transfer lane to its host memory: a thread (CPU) or a side stream
    (CUDA) that runs the device's transfers one at a time in plan order, the transfers in
    flight (by node) and the host copies."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.host: dict[int, Value] = {}
        self.in_flight: dict[int, _Transfer] = {}
        self.pool: ThreadPoolExecutor | None = None
        self.stream: Any = None
        if runtime.is_cuda:
            self.stream = torch.cuda.Stream(device=runtime.torch_device)
        else:
            self.pool = _started(
                ThreadPoolExecutor(1, thread_name_prefix=f"remat-{runtime.name}-lane")
            )

    def offload(self, node: int, value: Value) -> None:
        """Start copying ``value`` (resident on the device) into fresh host memory."""
        if self.pool is not None:
            self.in_flight[node] = _Transfer(True, future=self.pool.submit(_cloned, value))
            return
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(self.runtime.torch_device))  # its producer
        with torch.cuda.stream(side):
            host = tuple(
                _empty_like(t, torch.device("cpu"), pinned=True).copy_(t, non_blocking=True)
                for t in value
            )
        for t in value:
            t.record_stream(side)  # its memory is not reused before the copy has read it
        self.in_flight[node] = _Transfer(True, event=_recorded(side), copy=host)

    def prefetch(self, node: int, reserved: int) -> None:
        """Start copying ``node``'s host copy into fresh device memory."""
        host = self.host[node]
        if self.pool is not None:
            future = self.pool.submit(_cloned, host)
            self.in_flight[node] = _Transfer(False, future=future, reserved=reserved)
            return
        side = self.stream
        # Allocated on the compute stream, here (where it is accounted); the side stream
        # waits for the compute stream, so the memory's earlier users are done with it.
        device = tuple(_empty_like(t, self.runtime.torch_device) for t in host)
        side.wait_stream(torch.cuda.current_stream(self.runtime.torch_device))
        with torch.cuda.stream(side):
            for target, source in zip(device, host, strict=True):
                target.copy_(source, non_blocking=True)
        for target in device:
            target.record_stream(side)
        self.in_flight[node] = _Transfer(
            False, event=_recorded(side), copy=device, reserved=reserved
        )

    def wait(self, node: int) -> tuple[_Transfer, Value]:
        """Block the compute lane until ``node``'s transfer is complete: the transfer and
        its copy (an offload's is kept as the host copy)."""
        transfer = self.in_flight.pop(node)
        if transfer.future is not None:
            copy = transfer.future.result()
        else:
            compute = torch.cuda.current_stream(self.runtime.torch_device)
            compute.wait_event(transfer.event)
            # Each step is timed to its end on the compute stream (``Runtime.timed``
            # synchronises it before the next one): the wait's time is its own.
            compute.synchronize()
            copy = transfer.copy
        if transfer.offload:
            self.host[node] = copy
        return transfer, copy

    def drain(self) -> None:
        """Wait for the CPU transfers still in flight (an offload never waited for); CUDA
        ones are waited for by synchronising the device."""
        for transfer in self.in_flight.values():
            if transfer.future is not None:
                transfer.future.result()

    def close(self) -> None:
        """Stop the lane's thread (after the transfer it may be running); drop its copies.
        CUDA: the allocators keep memory that a transfer still uses (``record_stream``, and
        the pinned host allocator's events) until it is done."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.in_flight.clear()
        self.host.clear()


@dataclass(frozen=True)
class _Layout:
    """How a tensor lies in its storage: what rebuilds it around the same bytes read back."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int  # its storage's, all of it: what value_bytes counts

    @classmethod
    def of(cls, t: torch.Tensor) -> _Layout:
        return cls(
            t.dtype,
            tuple(t.size()),
            tuple(t.stride()),
            int(t.storage_offset()),
            t.untyped_storage().nbytes(),
        )

    def around(self, raw: torch.Tensor) -> torch.Tensor:
        """The tensor over ``raw``'s bytes (a uint8 tensor of ``nbytes``)."""
        tensor = torch.empty(0, dtype=self.dtype, device=raw.device)
        return tensor.set_(raw.untyped_storage(), self.offset, self.size, self.stride)


class _PagingLane:
    """A device's paging lane to the node's storage (plan version 3): a thread of its own
    that writes and reads the files, one transfer at a time in plan order, and on CUDA a
    side stream for the copies between the device and pinned host buffers; the transfers
    in flight (by node) and the layouts of the values paged out, whose bytes are in a file
    per value in the run's directory. Paged fixed tensors and gradient buffers travel on it
    too, by key (``remat.simulator.Key``), to and from the files the run names."""

    def __init__(self, runtime: Runtime, directory: Path) -> None:
        self.runtime = runtime
        self.directory = directory
        self.paged: dict[int, tuple[_Layout, ...]] = {}
        self.in_flight: dict[Key, _Transfer] = {}
        self.pool = _started(
            ThreadPoolExecutor(1, thread_name_prefix=f"remat-{runtime.name}-paging-lane")
        )
        self.stream: Any = None
        if runtime.is_cuda:
            self.stream = torch.cuda.Stream(device=runtime.torch_device)

    def _file(self, node: int) -> Path:
        return self.directory / f"{self.runtime.name}-{node}"

    def page_out(self, node: int, value: Value) -> None:
        """Start writing ``value`` (resident on the device) to its file, fsync'd."""
        self.paged[node] = tuple(_Layout.of(t) for t in value)
        self.send(node, self._file(node), value)

    def send(self, key: Key, path: Path, value: Value) -> None:
        """Start writing ``value`` (resident on the device) to ``path``, fsync'd."""
        raws = tuple(_raw(t) for t in value)
        if self.stream is None:
            future = self.pool.submit(write_through, path, _views(raws))
            self.in_flight[key] = _Transfer(True, future=future)
            return
        side = self.stream
        side.wait_stream(torch.cuda.current_stream(self.runtime.torch_device))  # its producer
        for t in value:
            t.record_stream(side)  # its memory is not reused before the copy has read it
        future = self.pool.submit(_copy_then_write, side, path, raws)
        self.in_flight[key] = _Transfer(True, future=future)

    def reserved(self, node: int) -> int:
        """The bytes ``node``'s value holds on the device once paged back in."""
        return sum(layout.nbytes for layout in self.paged[node])

    def page_in(self, node: int, reserved: int) -> None:
        """Start reading ``node``'s file back into fresh device memory, allocated here."""
        self.bring(node, self._file(node), self.paged[node], reserved)

    def bring(self, key: Key, path: Path, layouts: tuple[_Layout, ...], reserved: int) -> None:
        """Start reading ``path`` (a value that lies as ``layouts`` say) into fresh device
        memory, allocated here."""
        device = self.runtime.torch_device
        raws = tuple(
            torch.empty(layout.nbytes, dtype=torch.uint8, device=device) for layout in layouts
        )
        future: Future[Any]
        if self.stream is None:
            future = self.pool.submit(read_back, path, _views(raws))
        else:
            side = self.stream
            # Allocated on the compute stream, here (where it is accounted); the side
            # stream waits for the compute stream, so the memory's earlier users are done.
            side.wait_stream(torch.cuda.current_stream(device))
            for r in raws:
                r.record_stream(side)
            future = self.pool.submit(_read_then_copy, side, path, raws)
        self.in_flight[key] = _Transfer(
            False, future=future, copy=raws, reserved=reserved, layouts=layouts
        )

    def wait(self, node: Key) -> tuple[_Transfer, Value]:
        """Block the compute lane until ``node``'s transfer is complete (a page-out's file
        written and fsync'd; a page-in's value on the device): the transfer and, for a
        page-in, the value. The ``OSError`` of a file that failed propagates."""
        transfer = self.in_flight.pop(node)
        assert transfer.future is not None
        done = transfer.future.result()
        if transfer.offload:
            return transfer, ()
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.runtime.torch_device)
            compute.wait_event(done[0])
            compute.synchronize()  # the wait's time is its own, as on the host lane
        return transfer, tuple(
            layout.around(raw) for layout, raw in zip(transfer.layouts, transfer.copy, strict=True)
        )

    def drain(self) -> tuple[Key, bool, OSError] | None:
        """Wait for the transfers still in flight (a page-out never waited for): the first
        that failed (node, whether out, its error), or None."""
        for node, transfer in self.in_flight.items():
            assert transfer.future is not None
            try:
                transfer.future.result()
            except OSError as error:
                return node, transfer.offload, error
        return None

    def close(self) -> None:
        """Stop the lane's thread (after the file it may be writing or reading); the run
        removes the files (``agents.storage.scratch_directory``)."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.in_flight.clear()
        self.paged.clear()


def _started(pool: ThreadPoolExecutor) -> ThreadPoolExecutor:
    """``pool`` with its thread running: a lane is made before the run is timed, and its
    thread's start (on the first task) would otherwise fall on the run's first transfer."""
    pool.submit(int).result()
    return pool


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over all of ``t``'s storage: its bytes as they lie."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _views(raws: Value) -> list[memoryview]:
    """The bytes of host uint8 tensors (``_raw``'s, or pinned buffers), to write or fill."""
    return [r.numpy().data for r in raws]


def _copy_then_write(side: Any, path: Path, device: Value) -> None:
    """CUDA page-out, on the lane's thread: the device bytes copied into pinned buffers on
    the side stream, then, once the copy is done, written through to the file."""
    with torch.cuda.device(side.device), torch.cuda.stream(side):
        host = tuple(
            torch.empty(r.numel(), dtype=torch.uint8, pin_memory=True).copy_(r, non_blocking=True)
            for r in device
        )
        copied = _recorded(side)
    copied.synchronize()
    write_through(path, _views(host))


def _read_then_copy(side: Any, path: Path, device: Value) -> tuple[Any, Value]:
    """CUDA page-in, on the lane's thread: the file into pinned buffers, then copied into
    the device memory on the side stream; an event after the copies, and the buffers (kept
    until the wait)."""
    host = tuple(torch.empty(r.numel(), dtype=torch.uint8, pin_memory=True) for r in device)
    read_back(path, _views(host))
    with torch.cuda.device(side.device), torch.cuda.stream(side):
        for target, source in zip(device, host, strict=True):
            target.copy_(source, non_blocking=True)
    return _recorded(side), host


def _cloned(value: Value) -> Value:
    """A copy of ``value`` in fresh memory, made on one thread (numpy's memcpy where the
    type allows, not torch's parallel copy): a lane's copy must leave the compute's
    threads their cores."""
    return tuple(_copied(t) for t in value)


def _copied(t: torch.Tensor) -> torch.Tensor:
    try:
        return torch.from_numpy(t.detach().numpy().copy())
    except (TypeError, RuntimeError):  # a type numpy lacks (bfloat16)
        return t.clone()


def _empty_like(t: torch.Tensor, device: torch.device, pinned: bool = False) -> torch.Tensor:
    """An empty tensor of ``t``'s shape, strides and type on ``device`` (a value's tensors
    own their storage, so the storage is as large as ``t``'s)."""
    return torch.empty_strided(
        t.size(), t.stride(), dtype=t.dtype, device=device, pin_memory=pinned
    )


def _recorded(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


@dataclass
class _Result:
    total_ms: float
    step_ms: list[float]
    peak_bytes: dict[str, int]
    gradients: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    accounted_peak_bytes: dict[str, int]
    allocator_peak_bytes: dict[str, int]

    def without_values(self) -> _Result:
        return replace(self, gradients={}, outputs={})


class _Account:
    """One memory space's bytes in a run: its fixed tensors', its resident values' and
    the most both held at once (a CPU device's measured peak)."""

    __slots__ = ("fixed", "live", "lock", "peak")

    def __init__(self, lock: threading.Lock) -> None:
        self.fixed = self.live = self.peak = 0
        self.lock = lock  # the run's: a concurrent section's devices allocate from threads

    def allocate(self, nbytes: int, runtime: Runtime) -> None:
        """``nbytes`` more, allocated by ``runtime``'s device (only allocations can raise
        the peak, checked against the memory it may use)."""
        with self.lock:
            self.live += nbytes
            used = self.fixed + self.live
            if used > self.peak:
                self.peak = used
                check_memory(runtime, used)


class _Run:
    """One execution of the plan with its own fixed tensors, buffers and accounting."""

    def __init__(
        self,
        program: Program,
        plan: Plan,
        runtimes: Mapping[str, Runtime],
        timed_steps: bool = False,
        storage: Path | None = None,
    ) -> None:
        self.program = program
        self.plan = plan
        self.runtimes = runtimes
        # each compute and copy step timed on its device (CUDA: synchronised, with events);
        # else their step times are 0 and only the run's total counts
        self.timed_steps = timed_steps
        self.storage = storage  # the node's storage directory, where the plan pages
        computed: dict[str, list[int]] = {name: [] for name in runtimes}
        transferring: set[str] = set()
        paging: set[str] = set()
        for step in plan.steps:
            if isinstance(step, Compute):
                computed[step.device].append(step.node)
            elif isinstance(step, Offload | Prefetch):
                transferring.add(step.device)
            elif isinstance(step, PageOut | PageIn | FixedStep):
                paging.add(step.device)
        self.computed = computed
        self.transferring = sorted(transferring)  # the devices whose host lanes it uses
        self.paging = sorted(paging)  # the devices whose paging lanes it uses
        # Where each device's memory is counted: its pool (one set of tensors, one fixed
        # memory and one account for all its devices, as the simulator's), else itself.
        pools = memory_spaces(plan)
        self.space = {name: pools.get(name, name) for name in runtimes}
        self.resident: dict[str, dict[int, Value]] = {}
        # each resident value's bytes as accounted when it came, so that freeing it
        # recounts nothing (``value_bytes``)
        self.sizes: dict[str, dict[int, int]] = {}
        self._share_resident()
        lock = threading.Lock()  # the accounts, allocated from a section's threads
        self.accounts = {space: _Account(lock) for space in self.space.values()}
        # each step kind's method but compute's (``_prepared_compute``), by the step's type
        self.perform: dict[type, Callable[[Any], float]] = {
            Copy: self._copy,
            Free: self._free,
            Offload: self._offload,
            Prefetch: self._prefetch,
            PageOut: self._page_out,
            PageIn: self._page_in,
            Wait: self._wait,
            **dict.fromkeys(get_args(FixedStep), self._fixed_step),
        }
        self.fixed: dict[str, dict[str, torch.Tensor]] = {}
        self.buffers: dict[str, GradientBuffers] = {}
        # per memory space: its fixed tensors and gradient buffers
        self.fixed_on: dict[str, tuple[dict[str, torch.Tensor], GradientBuffers]] = {}
        self.baseline: dict[str, tuple[int, int]] = {}  # CUDA: (requested, allocated) bytes
        self.lanes: dict[str, _Lane] = {}  # of the devices that transfer, made per run
        self.section_threads: ThreadPoolExecutor | None = None  # a concurrent plan's
        self.pagers: dict[str, _PagingLane] = {}  # of the devices that page, made per run
        self.directory: Path | None = None  # the run's own, in the storage directory
        self.paged_fixed = plan.paged_fixed  # fixed tensors in storage (version 5)
        # their files (written before the run is timed), and each pool's gradients
        # written out: (file, layout)
        self.fixed_files: dict[str, tuple[Path, tuple[_Layout, ...]]] = {}
        self.grad_files: dict[tuple[str, str], tuple[Path, tuple[_Layout, ...]]] = {}

    def run(self) -> _Result:
        """The run, in a directory of its own in the storage directory where it pages
        (removed with its files when the run ends, also on failure, after the lanes)."""
        if not self.paging:
            return self._run()
        assert self.storage is not None, "a plan that pages needs the storage directory"
        with scratch_directory(self.storage, "run-") as directory:
            self.directory = directory
            return self._run()

    def _run(self) -> _Result:
        try:
            self._place_fixed()
            for name in self.transferring:
                self._lane(name)
            for name in self.paging:
                self._pager(name)
            if self.plan.concurrent and len(self.runtimes) > 1:
                self._section_threads()
            self._store_fixed()
            prepared = self._prepared()
            start = time.perf_counter()
            step_ms = self._steps(prepared)
            for lane in self.lanes.values():
                lane.drain()
            for pager in self.pagers.values():
                if (failed := pager.drain()) is not None:
                    raise self._storage_failed(*failed)
            for runtime in self.runtimes.values():
                runtime.synchronize()
            total_ms = (time.perf_counter() - start) * 1e3
            peaks = {name: self._peak(name) for name in self.runtimes}
            allocator = {
                name: torch.cuda.max_memory_allocated(runtime.torch_device) - self.baseline[name][1]
                for name, runtime in self.runtimes.items()
                if runtime.is_cuda
            }
            return _Result(
                total_ms,
                step_ms,
                peaks,
                self._gradients(),
                self._outputs(),
                {name: self.accounts[space].peak for name, space in self.space.items()},
                allocator,
            )
        finally:
            self._release()
            threads, self.section_threads = self.section_threads, None
            if threads is not None:
                threads.shutdown()

    # --- setup and teardown --------------------------------------------------------------

    def _share_resident(self) -> None:
        """Empty resident values and their sizes, one dict each per memory space, shared
        by a pool's devices."""
        spaces: dict[str, dict[int, Value]] = {}
        self.resident = {name: spaces.setdefault(s, {}) for name, s in self.space.items()}
        sizes: dict[str, dict[int, int]] = {}
        self.sizes = {name: sizes.setdefault(s, {}) for name, s in self.space.items()}

    def _place_fixed(self) -> None:
        placed: set[str] = set()
        for name in self.runtimes:
            space = self.space[name]
            if space in placed:  # a pool's: its first device placed them for all
                self.fixed[name], self.buffers[name] = self.fixed_on[space]
                continue
            placed.add(space)
            try:
                self._place_fixed_on(name)
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not is_out_of_memory(error):
                    raise
                first = _first_line(error)
                self._release()
                raise DeviceOutOfMemory(
                    f"out of memory on device {name!r} placing its parameters, inputs and "
                    f"gradient buffers: {first}"
                ) from error

    def _place_fixed_on(self, name: str) -> None:
        runtime = self.runtimes[name]
        device = runtime.torch_device
        if runtime.is_cuda:
            runtime.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline[name] = (
                _requested_bytes(device, "current"),
                torch.cuda.memory_allocated(device),
            )
        space = self.space[name]
        computed = [
            node for other, s in self.space.items() if s == space for node in self.computed[other]
        ]
        held = [t for t in self.program.held_fixed(computed) if t not in self.paged_fixed]
        # Emulated CPU devices share the host's tensors; each is accounted per device.
        self.fixed[name] = {t: self.program.fixed[t].to(device) for t in held}
        buffers = [t for t in self.program.gradient_buffers(computed) if t not in self.paged_fixed]
        self.buffers[name] = GradientBuffers.allocate(buffers, self.program.fixed, device)
        self.fixed_on[space] = (self.fixed[name], self.buffers[name])
        account = self.accounts[space]
        account.fixed = account.peak = sum(
            value_bytes((t,)) for t in (*self.fixed[name].values(), *self.buffers[name].values())
        )
        check_memory(runtime, account.fixed)

    def _store_fixed(self) -> None:
        """Write each paged fixed tensor to its file in the run's directory."""
        for index, name in enumerate(sorted(self.paged_fixed)):
            assert self.directory is not None
            value = self.program.fixed[name].contiguous().clone()
            path = self.directory / f"fixed-{index}"
            write_through(path, _views((_raw(value),)))
            self.fixed_files[name] = (path, (_Layout.of(value),))

    def _release(self) -> None:
        lanes, self.lanes = self.lanes, {}
        pagers, self.pagers = self.pagers, {}
        for lane in lanes.values():
            lane.close()
        for pager in pagers.values():
            pager.close()
        self._share_resident()
        self.fixed, self.buffers, self.fixed_on = {}, {}, {}
        if any(r.is_cuda for r in self.runtimes.values()):
            torch.cuda.empty_cache()

    def _peak(self, name: str) -> int:
        runtime = self.runtimes[name]
        if runtime.is_cuda:
            return _requested_bytes(runtime.torch_device, "peak") - self.baseline[name][0]
        return self.accounts[self.space[name]].peak

    # --- steps ---------------------------------------------------------------------------

    def _prepared(self) -> list[Callable[[], float]]:
        """The plan's steps resolved before the run is timed, each to a call with what it
        uses bound (its device's values, fixed tensors and account): the run looks nothing
        up by step kind, device or node. A backward node adds its parameter gradients at
        its first compute step in plan order only (a recomputed one must not add them
        twice)."""
        prepared: list[Callable[[], float]] = []
        accumulated: set[int] = set()
        current: str | None = None  # the device made current by the step before
        cpus = [name for name, runtime in self.runtimes.items() if not runtime.is_cuda]
        in_place = in_place_steps(
            self.plan, self.program.graph, self.program.sources, self.space, cpus
        )
        for index, step in enumerate(self.plan.steps):
            if isinstance(step, Compute):
                node = self.program.graph.nodes[step.node]
                grads = None
                if node.kind is NodeKind.BACKWARD and step.node not in accumulated:
                    accumulated.add(step.node)
                    grads = self.buffers[step.device]
                # a one-thread-at-a-time plan switches devices only where they change
                switch = self.plan.concurrent or step.device != current
                prepared.append(self._prepared_compute(step, grads, switch, index in in_place))
                current = step.device
                continue
            if isinstance(step, Free) and not self.timed_steps:
                prepared.append(self._prepared_free(step))
                continue
            perform = self.perform.get(type(step))
            if perform is None:  # the simulator accepted it: a newer step kind this agent lacks
                raise PlanRejectedError(f"step {index}: unsupported step kind {step.op!r}")
            prepared.append(partial(perform, step))
            if not isinstance(step, Free):
                current = None  # a copy or transfer may make another device current
        return prepared

    def _steps(self, prepared: Sequence[Callable[[], float]]) -> list[float]:
        """Every step's time, in plan order; a concurrent plan's sections at once."""
        if not self.plan.concurrent:
            times: list[float] = []
            try:
                for run in prepared:
                    times.append(run())
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not is_out_of_memory(error):
                    raise
                index = len(times)  # the step that failed
                raise self._oom(index, self.plan.steps[index], error) from error
            return times
        times = []
        section: list[tuple[int, Compute]] = []
        for index, step in enumerate(self.plan.steps):
            if isinstance(step, Compute):
                section.append((index, step))
                continue
            times += self._section(section, prepared)
            section = []
            times.append(self._step(index, prepared))
        return times + self._section(section, prepared)

    def _section(
        self, steps: list[tuple[int, Compute]], prepared: Sequence[Callable[[], float]]
    ) -> list[float]:
        """A section of a concurrent plan: each device's steps in plan order on a thread of
        its own, each after the inputs that other devices compute in the section."""
        by_device: dict[str, list[tuple[int, Compute]]] = {}
        for index, step in steps:
            by_device.setdefault(step.device, []).append((index, step))
        if len(by_device) < 2:
            return [self._step(index, prepared) for index, _ in steps]
        done = {step.node: threading.Event() for _, step in steps}
        failed = threading.Event()
        times: dict[int, float] = {}

        def run(own: list[tuple[int, Compute]]) -> None:
            try:
                for index, step in own:
                    for dep in self.program.graph.nodes[step.node].deps:
                        if (event := done.get(dep)) is not None:
                            while not event.wait(0.05):
                                if failed.is_set():
                                    return
                    if failed.is_set():
                        return
                    times[index] = self._step(index, prepared)
                    done[step.node].set()
            except BaseException:
                failed.set()
                raise

        first, *others = by_device.values()
        threads = self._section_threads()
        futures = [threads.submit(run, own) for own in others]
        try:
            run(first)  # the first device's share on this thread
        finally:
            wait(futures)
        for future in futures:
            future.result()
        return [times[index] for index, _ in steps]

    def _section_threads(self) -> ThreadPoolExecutor:
        """The run's threads for the devices of a section beyond the first, started once:
        a thread started per section would cost more than a short section's work."""
        if self.section_threads is None:
            self.section_threads = ThreadPoolExecutor(
                len(self.runtimes) - 1, thread_name_prefix="remat-section"
            )
        return self.section_threads

    def _step(self, index: int, prepared: Sequence[Callable[[], float]]) -> float:
        try:
            return prepared[index]()
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not is_out_of_memory(error):
                raise
            raise self._oom(index, self.plan.steps[index], error) from error

    def _keep(self, device: str, node: int, value: Value, reserved: int = 0) -> None:
        """``value`` resident on ``device`` as ``node``'s, and accounted there (less the
        ``reserved`` bytes a prefetch counted when it was issued)."""
        self.resident[device][node] = value
        nbytes = self.sizes[device][node] = value_bytes(value)
        self._allocated(device, nbytes - reserved)

    def _allocated(self, device: str, nbytes: int) -> None:
        """Account ``nbytes`` more on ``device``: a new resident value, or a prefetch's
        reservation."""
        self.accounts[self.space[device]].allocate(nbytes, self.runtimes[device])

    def _oom(self, index: int, step: Step, error: Exception) -> DeviceOutOfMemory:
        device = step.dst if isinstance(step, Copy) else step.device
        if isinstance(step, FixedStep):
            what = f"fixed tensor {step.tensor!r}"
        else:
            what = f"node {self.program.graph.nodes[step.node].name!r}"
        first = _first_line(error)
        # nothing released here: on a section's thread the other devices are still at
        # their steps; the run releases everything as it ends (``_run``)
        return DeviceOutOfMemory(
            f"out of memory on device {device!r} at step {index} ({step.op} of {what}): {first}"
        )

    def _prepared_compute(
        self, step: Compute, grads: GradientBuffers | None, switch: bool, in_place: bool
    ) -> Callable[[], float]:
        """``step`` as a call: its node's value from the values resident on its device,
        added there and to its account (``grads``: the buffers its parameter gradients go
        to, None: dropped; ``switch``: make its device current first; ``in_place``: into
        its input's storage, ``agents.in_place``)."""
        runtime = self.runtimes[step.device]
        node, device = step.node, runtime.torch_device
        evaluate = self.program.evaluator(step.node, in_place)
        resident, fixed = self.resident[step.device], self.fixed[step.device]
        sizes, account = self.sizes[step.device], self.accounts[self.space[step.device]]
        if self.timed_steps or (grads is not None and self.paged_fixed):
            return partial(self._compute, step, grads, evaluate)

        def run() -> float:
            if switch:
                runtime.activate()
            value = resident[node] = evaluate(resident, fixed, grads, device)
            nbytes = sizes[node] = value_bytes(value)
            account.allocate(nbytes, runtime)
            return 0.0

        return run

    def _compute(self, step: Compute, grads: GradientBuffers | None, evaluate: Evaluator) -> float:
        """``step`` timed on its device (``evaluate``: its node's evaluation), or making
        the buffers of paged fixed tensors that its gradients go to first
        (``_new_buffers``)."""
        runtime = self.runtimes[step.device]
        if grads is not None and self.paged_fixed:
            self._new_buffers(step, grads)
        resident = self.resident[step.device]
        value, ms = self._timed(
            runtime,
            evaluate,
            resident,
            self.fixed[step.device],
            grads,
            runtime.torch_device,
        )
        self._keep(step.device, step.node, value)
        return ms

    def _new_buffers(self, step: Compute, grads: dict[str, torch.Tensor]) -> None:
        """The gradient buffers of paged fixed tensors that ``step`` writes first: made,
        zeroed and counted on its device."""
        for name in self.program.gradient_buffers([step.node]):
            if name in self.paged_fixed and name not in grads:
                device = self.runtimes[step.device].torch_device
                grads[name] = torch.zeros_like(self.program.fixed[name], device=device)
                self._allocated(step.device, value_bytes((grads[name],)))

    def _copy(self, step: Copy) -> float:
        src, dst = self.runtimes[step.src], self.runtimes[step.dst]
        value = self.resident[step.src][step.node]
        copied, ms = self._timed(
            copy_runtime(src, dst), lambda: tuple(t.to(dst.torch_device, copy=True) for t in value)
        )
        if src.is_cuda and dst.is_cuda:
            dst.synchronize()
        self._keep(step.dst, step.node, copied)
        return ms

    def _timed(
        self, runtime: Runtime, work: Callable[..., Value], *args: Any
    ) -> tuple[Value, float]:
        """``work(*args)`` on ``runtime``'s device, and its milliseconds where steps are
        timed (else 0: no synchronisation or events between steps, and no closure made at
        the untimed runs' every step)."""
        if self.timed_steps:
            return runtime.timed(partial(work, *args))
        runtime.activate()
        return work(*args), 0.0

    def _prepared_free(self, step: Free) -> Callable[[], float]:
        """Untimed ``step`` as a call: its value released and its bytes accounted."""
        node, resident, sizes = step.node, self.resident[step.device], self.sizes[step.device]
        account = self.accounts[self.space[step.device]]

        def run() -> float:
            del resident[node]
            account.live -= sizes.pop(node)
            return 0.0

        return run

    def _free(self, step: Free) -> float:
        start = time.perf_counter()
        self._drop(step.device, step.node)
        return (time.perf_counter() - start) * 1e3

    def _drop(self, device: str, node: int) -> None:
        """Release ``node``'s value on ``device`` and its bytes from the account."""
        del self.resident[device][node]
        self.accounts[self.space[device]].live -= self.sizes[device].pop(node)

    def _lane(self, device: str) -> _Lane:
        lane = self.lanes.get(device)
        if lane is None:
            lane = self.lanes[device] = _Lane(self.runtimes[device])
        return lane

    def _offload(self, step: Offload) -> float:
        start = time.perf_counter()
        self._lane(step.device).offload(step.node, self.resident[step.device][step.node])
        return (time.perf_counter() - start) * 1e3

    def _prefetch(self, step: Prefetch) -> float:
        start = time.perf_counter()
        lane = self._lane(step.device)
        reserved = value_bytes(lane.host[step.node])
        self._allocated(step.device, reserved)  # from the issue on: conservative
        lane.prefetch(step.node, reserved)
        return (time.perf_counter() - start) * 1e3

    def _pager(self, device: str) -> _PagingLane:
        pager = self.pagers.get(device)
        if pager is None:
            assert self.directory is not None
            pager = self.pagers[device] = _PagingLane(self.runtimes[device], self.directory)
        return pager

    def _page_out(self, step: PageOut) -> float:
        start = time.perf_counter()
        self._pager(step.device).page_out(step.node, self.resident[step.device][step.node])
        return (time.perf_counter() - start) * 1e3

    def _page_in(self, step: PageIn) -> float:
        start = time.perf_counter()
        pager = self._pager(step.device)
        reserved = pager.reserved(step.node)
        self._allocated(step.device, reserved)  # from the issue on, as a prefetch
        pager.page_in(step.node, reserved)
        return (time.perf_counter() - start) * 1e3

    def _fixed_step(self, step: FixedStep) -> float:
        """A step that pages a fixed tensor or its gradient buffer (version 5)."""
        start = time.perf_counter()
        pager = self._pager(step.device)
        name, fixed, buffers = step.tensor, self.fixed[step.device], self.buffers[step.device]
        if isinstance(step, FixedIn):
            path, layouts = self.fixed_files[name]
            reserved = sum(layout.nbytes for layout in layouts)
            self._allocated(step.device, reserved)  # from the issue on, as a page-in
            pager.bring(("param", name), path, layouts, reserved)
        elif isinstance(step, FixedWait | GradWait):
            key = ("param" if isinstance(step, FixedWait) else "grad", name)
            try:
                transfer, value = pager.wait(key)
            except OSError as error:
                raise self._storage_failed(key, isinstance(step, GradWait), error) from error
            if isinstance(step, FixedWait):
                fixed[name] = value[0]
                self._allocated(step.device, value_bytes(value) - transfer.reserved)
            else:
                self.accounts[self.space[step.device]].live -= value_bytes((buffers.pop(name),))
        elif isinstance(step, FixedFree):
            self.accounts[self.space[step.device]].live -= value_bytes((fixed.pop(name),))
        else:
            assert isinstance(step, GradOut)
            space = self.space[step.device]
            assert self.directory is not None
            path = self.directory / f"grad-{len(self.grad_files)}"
            buffers.settle([name])
            self.grad_files[space, name] = (path, (_Layout.of(buffers[name]),))
            pager.send(("grad", name), path, (buffers[name],))
        return (time.perf_counter() - start) * 1e3

    def _storage_failed(self, key: Key, out: bool, error: OSError) -> StorageError:
        """The one-line error of a file that could not be written or read back."""
        if isinstance(key, tuple):
            kind, name = key
            what = f"fixed tensor {name!r}" if kind == "param" else f"the gradient of {name!r}"
        else:
            what = f"node {key} ({self.program.graph.nodes[key].name})"
        where = f"out to {self.storage}" if out else f"in from {self.storage}"
        return StorageError(f"paging {what} {where} failed: {describe(error)}")

    def _wait(self, step: Wait) -> float:
        start = time.perf_counter()
        lane = self.lanes.get(step.device)
        if lane is not None and step.node in lane.in_flight:
            transfer, copy = lane.wait(step.node)
        else:  # the simulator accepted it: on the paging lane
            pager = self._pager(step.device)
            out = pager.in_flight[step.node].offload
            try:
                transfer, copy = pager.wait(step.node)
            except OSError as error:
                raise self._storage_failed(step.node, out, error) from error
        if transfer.offload:  # the device copy is released
            self._drop(step.device, step.node)
        else:  # readable now; accounted when it was issued
            self._keep(step.device, step.node, copy, transfer.reserved)
        return (time.perf_counter() - start) * 1e3

    # --- results -------------------------------------------------------------------------

    def _gradients(self) -> dict[str, torch.Tensor]:
        """The gradients summed over the devices' buffers and the files written out."""
        total: dict[str, torch.Tensor] = {}
        for buffers in self.buffers.values():
            buffers.settle()
        hosts = [
            (name, buffer.to("cpu"))
            for buffers in {id(b): b for b in self.buffers.values()}.values()  # a pool's once
            for name, buffer in buffers.items()
        ]
        for (_, name), (path, (layout,)) in self.grad_files.items():
            raw = torch.empty(layout.nbytes, dtype=torch.uint8)
            read_back(path, _views((raw,)))
            hosts.append((name, layout.around(raw)))
        for name, host in hosts:
            if name in self.program.trainable:
                total[name] = total[name] + host if name in total else host
        return total

    def _outputs(self) -> dict[str, torch.Tensor]:
        values: dict[int, Value] = {}
        for resident in self.resident.values():
            for node, value in resident.items():
                values.setdefault(node, tuple(t.to("cpu") for t in value))
        return self.program.model_output_values(values)


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _requested_bytes(device: torch.device, which: str) -> int:
    """The bytes tensors and kernels requested from the CUDA allocator (``current`` or
    ``peak``), without the allocator's block rounding; its allocated bytes on a PyTorch
    that does not count them; 0 before the allocator's first allocation (no statistics)."""
    stats = torch.cuda.memory_stats(device)
    for key in (f"requested_bytes.all.{which}", f"allocated_bytes.all.{which}"):
        if key in stats:
            return int(stats[key])
    return 0
