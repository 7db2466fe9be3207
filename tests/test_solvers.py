"""Solver backends and the subprocess runner, with real solvers in real subprocesses.

Gurobi runs on the tiny models under its free size-limited license. Nothing here imports a
solver library into the test process: ortools and highspy cannot share one.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.optimize import linprog

from remat.solvers import cpsat, runner
from remat.solvers.model import MILPModel, Progress, SolveOptions, SolveResult, SolveStatus

ALL = runner.BACKENDS
SOLVER_LIBS = ("ortools", "highspy", "pyscipopt", "gurobipy")
CANCEL_BOUND_S = 2.5  # the 2 s, plus scheduling slack


# ---------------------------------------------------------------------------------- models


def _model(c, A, row_lb, row_ub, lb, ub, integer, **kw) -> MILPModel:
    return MILPModel(
        c=np.asarray(c, dtype=float),
        A=sp.csr_array(np.asarray(A, dtype=float)),
        row_lb=np.asarray(row_lb, dtype=float),
        row_ub=np.asarray(row_ub, dtype=float),
        lb=np.asarray(lb, dtype=float),
        ub=np.asarray(ub, dtype=float),
        integer=np.asarray(integer, dtype=bool),
        **kw,
    )


def knapsack() -> MILPModel:
    """max 5a + 4b + 3c + 2.5y, 2a + 3b + c + y <= 4.5, y in [0, 1.5] continuous: a, c and
    y = 1.5 give 11.75; as a minimisation with offset 1: -10.75."""
    return _model(
        [-5, -4, -3, -2.5],
        [[2, 3, 1, 1]],
        [-np.inf],
        [4.5],
        [0, 0, 0, 0],
        [1, 1, 1, 1.5],
        [1, 1, 1, 0],
        offset=1.0,
    )


def quadratic() -> MILPModel:
    """Binaries, values 5 4 3 2, weights 2 3 1 1, capacity 4, pair penalties 4 x0 x2 and
    0.5 x1 x2: {0, 3} is the unique best (7; {1, 2} gives 6.5). Offset 0.5: -6.5. The start
    {1, 2} is feasible but not optimal."""
    return _model(
        [-5, -4, -3, -2],
        [[2, 3, 1, 1]],
        [-np.inf],
        [4],
        [0] * 4,
        [1] * 4,
        [1] * 4,
        quadratic=((0, 2, 4.0), (1, 2, 0.5)),
        offset=0.5,
        start=np.array([0.0, 1, 1, 0]),
    )


def infeasible() -> MILPModel:
    """2 x0 + 2 x1 = 3 over binaries: the LP relaxation is feasible, the parity is not."""
    return _model([1, 1, 1], [[2, 2, 0], [0, 1, 1]], [3, 0], [3, 2], [0] * 3, [1] * 3, [1] * 3)


def market_split(n: int = 40, m: int = 4, seed: int = 1) -> MILPModel:
    """Cornuejols-Dawande market split with integer slacks: sum_j a_ij x_j + p_i - q_i = d_i,
    min sum(p + q). Feasible at once (x = 0), notoriously hard to prove (LP bound 0)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 100, (m, n)).astype(float)
    d = np.floor(a.sum(axis=1) / 2)
    A = np.hstack([a, np.eye(m), -np.eye(m)])
    c = np.concatenate([np.zeros(n), np.ones(2 * m)])
    ub = np.concatenate([np.ones(n), np.full(2 * m, np.inf)])
    return _model(c, A, d, d, np.zeros(n + 2 * m), ub, np.ones(n + 2 * m))


def cardinality(n: int = 2500) -> MILPModel:
    """max sum x, sum x <= 3 over n binaries: trivial, but over Gurobi's free size limit."""
    return _model(-np.ones(n), np.ones((1, n)), [-np.inf], [3], np.zeros(n), np.ones(n), np.ones(n))


def assert_feasible(model: MILPModel, x: np.ndarray, tol: float = 1e-6) -> None:
    activity = model.A @ x
    assert np.all(activity <= model.row_ub + tol) and np.all(activity >= model.row_lb - tol)
    assert np.all(x >= model.lb - tol) and np.all(x <= model.ub + tol)
    assert np.allclose(x[model.integer], np.round(x[model.integer]), atol=tol)


def assert_consistent(model: MILPModel, result: SolveResult) -> None:
    assert result.x is not None and result.objective is not None
    assert_feasible(model, result.x)
    assert model.objective(result.x) == pytest.approx(result.objective, abs=1e-6)
    if result.bound is not None:
        assert result.bound <= result.objective + 1e-9


# ----------------------------------------------------------------------- same optimum on all


@pytest.mark.parametrize("backend", ALL)
def test_knapsack_with_a_continuous_variable(backend: str) -> None:
    model = knapsack()
    result = runner.solve(model, backend, fallback=None)
    assert result.backend == backend
    assert result.objective == pytest.approx(-10.75, abs=1e-6)
    assert_consistent(model, result)
    if backend == "cpsat":
        # The continuous y is discretised: the optimum is found, but CP-SAT's bound only
        # holds for the discretised model, so it is not reported.
        assert result.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)
    else:
        assert result.status == SolveStatus.OPTIMAL
        assert result.bound == pytest.approx(-10.75, abs=1e-6)


@pytest.mark.parametrize("backend", ALL)
def test_quadratic_on_binaries_with_a_warm_start(backend: str) -> None:
    model = quadratic()
    result = runner.solve(model, backend, fallback=None)
    assert result.status == SolveStatus.OPTIMAL, result.message
    assert result.backend == backend
    assert result.objective == pytest.approx(-6.5, abs=1e-6)
    assert result.bound == pytest.approx(-6.5, abs=1e-6)
    assert np.allclose(result.x, [1, 0, 0, 1], atol=1e-6)
    assert_consistent(model, result)


PRESOLVE_SETTING = {  # each backend's setting once presolve=False, read in a fresh process
    "highs": (
        "import highspy\nfrom remat.solvers.highs import _set_options\n"
        "h = highspy.Highs()\n_set_options(h, OFF)\nprint(h.getOptionValue('presolve')[-1])",
        "off",
    ),
    "gurobi": (
        "import gurobipy as gp\nfrom remat.solvers.gurobi import _set_options\n"
        "env = gp.Env(params={'OutputFlag': 0})\nm = gp.Model(env=env)\n"
        "_set_options(m, OFF)\nprint(m.Params.Presolve)",
        "0",
    ),
    "scip": (
        "import pyscipopt\nfrom remat.solvers.scip import _set_options\n"
        "m = pyscipopt.Model()\n_set_options(m, OFF)\n"
        "print(m.getParam('presolving/maxrounds'))",
        "0",
    ),
    "cpsat": (
        "from ortools.sat.python import cp_model\nfrom remat.solvers.cpsat import _solver\n"
        "print(_solver(cp_model, OFF).parameters.cp_model_presolve)",
        "False",
    ),
}


@pytest.mark.parametrize("backend", ALL)
def test_presolve_off_reaches_the_backend_and_the_same_optimum(backend: str) -> None:
    result = runner.solve(knapsack(), backend, SolveOptions(presolve=False), fallback=None)
    assert result.objective == pytest.approx(-10.75, abs=1e-6)
    assert_consistent(knapsack(), result)
    code, expected = PRESOLVE_SETTING[backend]
    setup = "from remat.solvers.model import SolveOptions\nOFF = SolveOptions(presolve=False)\n"
    assert _python(setup + code).splitlines()[-1] == expected


def test_the_lp_relaxation_drops_integrality_and_the_start() -> None:
    relaxed = quadratic().lp_relaxation()
    assert not relaxed.integer.any() and relaxed.start is None
    result = runner.solve(infeasible().lp_relaxation(), "highs", fallback=None)
    assert result.status == SolveStatus.OPTIMAL  # x0 + x1 = 1.5, which no binaries meet
    assert result.objective == pytest.approx(1.5, abs=1e-6)


@pytest.mark.parametrize("backend", ALL)
def test_infeasible_is_proven(backend: str) -> None:
    result = runner.solve(infeasible(), backend, fallback=None)
    assert result.status == SolveStatus.INFEASIBLE, result.message
    assert result.x is None and result.backend == backend


# ------------------------------------------------------------- time limit, progress, cancel


@pytest.mark.parametrize("backend", ALL)
def test_time_limit_returns_incumbent_bound_and_progress(backend: str) -> None:
    model = market_split()
    events: list[Progress] = []
    incumbents: list[tuple[np.ndarray, float]] = []
    result = runner.solve(
        model,
        backend,
        SolveOptions(time_limit_s=1.0),
        events.append,
        None,
        on_incumbent=lambda x, objective: incumbents.append((x, objective)),
    )
    assert result.status in (SolveStatus.FEASIBLE, SolveStatus.OPTIMAL), result.message
    assert result.bound is not None and result.gap is not None
    assert_consistent(model, result)
    assert events, "no progress reported"
    # improving solutions stream while the solve runs, each a feasible point of its value
    assert incumbents, "no incumbent streamed"
    for x, objective in incumbents:
        assert_feasible(model, x)
        assert model.objective(x) == pytest.approx(objective, abs=1e-6)
    assert incumbents[-1][1] >= result.objective - 1e-6
    assert all(b.elapsed_s > a.elapsed_s for a, b in itertools.pairwise(events))
    for event in events:
        if event.objective is not None and event.bound is not None:
            assert event.bound <= event.objective + 1e-9


def test_highs_stopped_without_a_solution_still_bounds() -> None:
    """Market split as pure feasibility (no slacks), min sum x: no solution in a second,
    but the dual bound, at least the LP relaxation's, bounds every solution; the device
    cover's bound relies on it (``exact.cover.device_cover``)."""
    rng = np.random.default_rng(1)
    a = rng.integers(0, 100, (4, 40)).astype(float)
    d = np.floor(a.sum(axis=1) / 2)
    model = _model(np.ones(40), a, d, d, np.zeros(40), np.ones(40), np.ones(40))
    result = runner.solve(model, "highs", SolveOptions(time_limit_s=1.0))
    assert result.status == SolveStatus.UNKNOWN and result.x is None, result.message
    lp = linprog(model.c, A_eq=a, b_eq=d, bounds=(0, 1))
    assert result.bound is not None and result.bound >= lp.fun - 1e-6


def _solve_in_thread(model: MILPModel, backend: str, cancel: threading.Event, **kw):
    started = threading.Event()
    box: dict[str, SolveResult] = {}

    def target() -> None:
        box["result"] = runner.solve(
            model, backend, SolveOptions(time_limit_s=60), lambda _: started.set(), cancel, **kw
        )

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    assert started.wait(20), "the solve never reported progress"
    children = [p for p in multiprocessing.active_children() if p.name.startswith("remat-solve")]
    assert len(children) == 1
    return thread, box, children[0]


@pytest.mark.parametrize("backend", ALL)
def test_cancel_stops_the_child_within_two_seconds(backend: str) -> None:
    cancel = threading.Event()
    thread, box, child = _solve_in_thread(market_split(50), backend, cancel)
    time.sleep(0.5)  # well into the search
    cancelled_at = time.monotonic()
    cancel.set()
    thread.join(10)
    assert not thread.is_alive()
    assert time.monotonic() - cancelled_at <= CANCEL_BOUND_S
    result = box["result"]
    assert result.status in (SolveStatus.FEASIBLE, SolveStatus.UNKNOWN), result.message
    assert "cancelled" in result.message
    if result.status == SolveStatus.FEASIBLE:
        assert_consistent(market_split(50), result)
    assert not child.is_alive() and child.exitcode is not None


def _state(pid: int) -> str:
    """The process state letter from /proc (T: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def _until(condition, seconds: float = 2.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states in /proc")
def test_a_held_solve_is_suspended_and_resumes_where_it_was() -> None:
    """While ``hold`` is set the child is stopped (state T) and streams nothing; cleared, it
    runs on and returns its incumbent when cancelled."""
    hold, cancel = threading.Event(), threading.Event()
    events: list[Progress] = []
    box: dict[str, SolveResult] = {}

    def target() -> None:
        options = SolveOptions(time_limit_s=60)
        box["result"] = runner.solve(
            market_split(50), "highs", options, events.append, cancel, hold=hold
        )

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    assert _until(lambda: bool(events), 20), "the solve never reported progress"
    (child,) = [p for p in multiprocessing.active_children() if p.name.startswith("remat-solve")]
    hold.set()
    assert _until(lambda: _state(child.pid) == "T"), "the held child was not stopped"
    time.sleep(0.3)  # what it sent before it stopped has arrived
    seen = len(events)
    time.sleep(1.5)  # three progress intervals
    assert len(events) == seen and _state(child.pid) == "T"
    hold.clear()
    assert _until(lambda: _state(child.pid) != "T"), "the released child did not resume"
    assert _until(lambda: len(events) > seen), "the resumed child reported nothing"
    cancel.set()
    thread.join(10)
    result = box["result"]
    assert result.status == SolveStatus.FEASIBLE and "cancelled" in result.message
    assert_consistent(market_split(50), result)


def test_cancel_stops_a_held_solve_within_two_seconds() -> None:
    """A held child is resumed to stop: it returns its incumbent itself, not killed."""
    hold, cancel = threading.Event(), threading.Event()
    thread, box, child = _solve_in_thread(market_split(50), "highs", cancel, hold=hold)
    time.sleep(0.5)
    hold.set()
    time.sleep(0.5)
    cancelled_at = time.monotonic()
    cancel.set()
    thread.join(10)
    assert time.monotonic() - cancelled_at <= CANCEL_BOUND_S
    result = box["result"]
    assert result.status == SolveStatus.FEASIBLE and "cancelled" in result.message
    assert "terminated" not in result.message
    assert not child.is_alive()


BIG = 1_000_000  # variables: an incumbent of 8 MB, far over a pipe's 64 KiB


def _sends_progress_then_a_big_incumbent(conn) -> None:  # a spawned child: module level
    conn.send(("started",))
    conn.send(("progress", Progress(0.0, 1.0, None, None)))
    x = np.arange(BIG, dtype=float)
    conn.send(("incumbent", x, 1.0))
    done = SolveResult(SolveStatus.FEASIBLE, x, 1.0, None, None, 0.0, "done", "highs")
    conn.send(("result", done))
    conn.close()


def test_a_child_held_while_it_sends_an_incumbent_is_resumed_to_finish_it() -> None:
    """U-Net's incumbents are about 1 MB: a child suspended by ``hold`` in the middle of
    sending one left the parent waiting in ``recv`` for the rest, for ever (the 10 s bench
    hung on VGG16 at 50% on cpu+cuda). Here the hold comes while the child is blocked on a
    full pipe with an 8 MB incumbent: the parent resumes it to read the message whole."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_sends_progress_then_a_big_incumbent, args=(sender,), daemon=True)
    child.start()
    sender.close()
    hold = threading.Event()
    got: list[np.ndarray] = []

    def on_progress(_: Progress) -> None:
        hold.set()  # the child is writing the incumbent meanwhile, and blocks on the pipe
        time.sleep(0.5)

    def on_incumbent(x: np.ndarray, _: float) -> None:
        got.append(x)
        hold.clear()

    listeners = runner._Listeners(on_progress, on_incumbent)
    box: dict[str, runner._Outcome] = {}
    supervise = runner._supervise
    args = (child, receiver, ctx.Event(), "highs", SolveOptions(time_limit_s=60))
    rest = (listeners, runner._Flags(None, hold), 1.0, runner._Seen(time.monotonic()))
    thread = threading.Thread(target=lambda: box.setdefault("out", supervise(*args, *rest)))
    thread.start()
    try:
        thread.join(20)
        assert not thread.is_alive(), "the parent waits for the rest of a held child's message"
    finally:
        child.kill()  # a stuck child must not outlive the test (its EOF frees the thread)
        thread.join(5)
    result = box["out"].result
    assert result is not None and result.message == "done"
    assert len(got) == 1 and np.array_equal(got[0], np.arange(BIG, dtype=float))


_HELD_ORPHAN = """
import multiprocessing, sys, threading, time
sys.path.insert(0, "tests")
from test_solvers import market_split
from remat.solvers import runner
from remat.solvers.model import SolveOptions

hold, heard = threading.Event(), threading.Event()

def solve():
    options = SolveOptions(time_limit_s=120)
    runner.solve(market_split(50), "highs", options, lambda _: heard.set(), hold=hold)

threading.Thread(target=solve, daemon=True).start()
heard.wait(60)
hold.set()
(child,) = multiprocessing.active_children()
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_held_child_dies_with_its_killed_parent() -> None:
    """A suspended child cannot notice that its parent is gone: the kernel kills it."""
    root = Path(__file__).resolve().parents[1]
    parent = subprocess.Popen(
        [sys.executable, "-c", _HELD_ORPHAN], stdout=subprocess.PIPE, text=True, cwd=root
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert _until(lambda: _state(pid) == "T"), "the held child was not stopped"
    finally:
        parent.kill()
        parent.wait(10)
    gone = _until(lambda: not Path(f"/proc/{pid}").exists() or _state(pid) == "Z", 5)
    if not gone:
        os.kill(pid, signal.SIGKILL)  # not left behind, stopped, by a failing run
    assert gone, "the held child outlived its killed parent"


def test_cancel_before_start_spawns_nothing() -> None:
    cancel = threading.Event()
    cancel.set()
    result = runner.solve(knapsack(), "highs", cancel=cancel)
    assert result.status == SolveStatus.UNKNOWN and "cancelled" in result.message


def test_hard_time_limit_is_enforced_from_outside() -> None:
    # A negative grace puts the outside deadline before the solver's own 30 s limit.
    result = runner.solve(market_split(50), "highs", SolveOptions(time_limit_s=30), grace_s=-28.5)
    assert result.status in (SolveStatus.FEASIBLE, SolveStatus.UNKNOWN)
    assert "stopped at its time limit" in result.message


def test_killed_child_is_an_error_that_keeps_the_incumbent() -> None:
    thread, box, child = _solve_in_thread(market_split(50), "highs", threading.Event())
    os.kill(child.pid, signal.SIGKILL)
    thread.join(10)
    result = box["result"]
    assert result.status == SolveStatus.ERROR
    assert "died" in result.message and "-9" in result.message
    if result.x is not None:  # the incumbent streamed before the crash
        assert_feasible(market_split(50), result.x)


def test_solver_exception_is_an_error_not_a_raise() -> None:
    broken = replace(knapsack(), c=np.ones(7))  # 7 costs for 4 columns
    result = runner.solve(broken, "highs", fallback=None)
    assert result.status == SolveStatus.ERROR
    assert result.message


# ------------------------------------------------------------------------- Gurobi fallback


def test_gurobi_over_the_size_limit_falls_back_to_highs() -> None:
    result = runner.solve(cardinality(), "gurobi", SolveOptions(time_limit_s=20))
    assert result.status == SolveStatus.OPTIMAL
    assert result.backend == "highs"
    assert result.objective == pytest.approx(-3)
    assert "license" in result.message and "solved with highs" in result.message


def test_gurobi_over_the_size_limit_without_fallback_is_an_error() -> None:
    result = runner.solve(cardinality(), "gurobi", fallback=None)
    assert result.status == SolveStatus.ERROR
    assert "license" in result.message and result.backend == "gurobi"


def test_unknown_backend_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown solver backend"):
        runner.solve(knapsack(), "cplex")


# --------------------------------------------------------------------------- isolation


def test_runner_keeps_solver_libraries_out_of_this_process() -> None:
    before = set(sys.modules)
    for backend in ("highs", "cpsat"):  # the pair that cannot share a process
        assert runner.solve(quadratic(), backend).status == SolveStatus.OPTIMAL
    added = {name.split(".")[0] for name in set(sys.modules) - before}
    assert not added & set(SOLVER_LIBS)


def test_backend_modules_import_no_solver_library() -> None:
    """The runner imports every backend module of its table (``runner.SOLVERS``); none of
    them imports its solver library before its ``solve`` runs in a solve's child."""
    modules = sorted({solve.__module__ for solve in runner.SOLVERS.values()})
    assert len(modules) == len(runner.BACKENDS) and tuple(runner.SOLVERS) == runner.BACKENDS
    code = (
        "import sys\n"
        "import remat.solvers.runner\n"
        f"assert all(name in sys.modules for name in {modules!r})\n"
        f"print(sorted(n for n in sys.modules if n.split('.')[0] in {SOLVER_LIBS!r}))\n"
    )
    assert _python(code) == "[]"


def _python(code: str) -> str:
    """What ``code`` prints, run by this interpreter in a fresh process at the repository's
    root (so that no solver library it imports enters this process)."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    return out.stdout.strip()


# ---------------------------------------------------------------- CP-SAT integer scaling


def test_rounded_rows_accept_only_feasible_points() -> None:
    rng = np.random.default_rng(7)
    exact_rows = 0
    for _ in range(300):
        n = int(rng.integers(1, 5))
        cols = np.arange(n)
        if rng.random() < 0.5:  # arbitrary reals: rounded conservatively
            vals = rng.normal(size=n) * 10.0 ** rng.integers(-3, 3)
        else:  # decimals: scaled exactly
            vals = rng.integers(-50, 50, size=n) / 10.0 ** rng.integers(0, 4)
        k_lo = rng.integers(-5, 3, size=n)
        k_hi = k_lo + rng.integers(0, 6, size=n)
        points = rng.integers(k_lo, k_hi + 1, size=(300, n))
        activity = points @ vals
        lo, hi = np.quantile(activity, [0.2, 0.8])
        rows, exact = cpsat.scale_row(cols, vals, k_lo, k_hi, lo, hi)
        accepted = np.ones(len(points), dtype=bool)
        for row in rows:
            act = points[:, row.cols] @ row.coefs
            accepted &= (row.lo is None or act >= row.lo) & (row.hi is None or act <= row.hi)
        assert np.all((activity[accepted] >= lo - 1e-9) & (activity[accepted] <= hi + 1e-9))
        if exact:
            exact_rows += 1
            assert np.array_equal(accepted, (activity >= lo - 1e-9) & (activity <= hi + 1e-9))
    assert 100 < exact_rows < 200


def test_decimal_rows_scale_exactly() -> None:
    rows, exact = cpsat.scale_row(
        np.arange(3), np.array([0.35, 1.5, -2.0]), np.zeros(3), np.full(3, 4), -np.inf, 3.75
    )
    assert exact and len(rows) == 1
    assert rows[0].coefs.tolist() == [35, 150, -200] and rows[0].hi == 375 and rows[0].lo is None


def test_memory_accumulator_is_on_a_lattice() -> None:
    # U1 = U0 + 1024 R (Checkmate's memory recurrence): U0 fixed by U0 = 512 R0.
    model = _model(
        [0, 0, 0, 0],
        [[1, 0, -512, 0], [-1, 1, 0, -1024]],
        [0, 0],
        [0, 0],
        [0, 0, 0, 0],
        [np.inf, np.inf, 1, 1],
        [0, 0, 1, 1],
    )
    lattice = cpsat.implied_lattice(model)
    assert lattice.on.tolist() == [True] * 4
    assert lattice.step.tolist() == [512, 512, 1, 1] and not lattice.offset.any()
    assert cpsat.scale(model).exact


def test_a_fractional_fixed_memory_offsets_the_lattice() -> None:
    """Checkmate's U[t,0] = fixed bytes / unit + whole units (10.42 + 2 S1 + 3 S2 here):
    its lattice has offset 0.42 and step 1, so the budget U <= 13.5 is exact, where
    micro-unit steps left the equality row empty (every CP-SAT solve of such a model was
    "infeasible")."""
    fixed = 10.4208984375  # needs 10 decimals, a binary fraction: 10 + 431/1024
    model = _model([0, -1, -2], [[1, -2, -3]], [fixed], [fixed], [0, 0, 0], [13.5, 1, 1], [0, 1, 1])
    lattice = cpsat.implied_lattice(model)
    assert lattice.on.tolist() == [True, True, True]
    assert lattice.step[0] == 1.0 and lattice.offset[0] == pytest.approx(fixed - 10)
    scaled = cpsat.scale(model)
    assert scaled.exact
    assert all(row.lo is None or row.hi is None or row.lo <= row.hi for row in scaled.rows)
    result = runner.solve(model, "cpsat", fallback=None)
    assert result.status is SolveStatus.OPTIMAL and result.objective == pytest.approx(-2)
    assert result.x.tolist() == pytest.approx([fixed + 3, 0, 1])


@pytest.mark.parametrize("seed", range(20))
def test_cpsat_on_memory_lattices_matches_highs(seed: int) -> None:
    """Random memory recurrences in the shape of Checkmate's (U0 = fixed + sizes @ S,
    U1 = U0 + sizes @ R, both under a budget) with fractional fixed parts and sizes in
    1/8ths: CP-SAT's integer model is exact, so its optimum (or its infeasibility proof)
    is HiGHS's."""
    rng = np.random.default_rng(seed)
    n = 4
    sizes = rng.integers(1, 24, size=(2, n)) / 8
    fixed = float(rng.integers(0, 4096)) / 1024
    budget = fixed + float(rng.uniform(0.5, 3.5))
    # columns: U0, U1, S[0..n), R[0..n)
    A = np.zeros((3, 2 + 2 * n))
    A[0, 0], A[0, 2 : 2 + n] = 1, -sizes[0]
    A[1, 1], A[1, 0], A[1, 2 + n :] = 1, -1, -sizes[1]
    A[2, 2 + n :] = 1  # at least two R
    c = np.concatenate([[0, 0], -rng.uniform(0.1, 1, n), rng.uniform(0.1, 1, n)])
    model = _model(
        c,
        A,
        [fixed, 0, 2],
        [fixed, 0, np.inf],
        [0] * (2 + 2 * n),
        [budget, budget] + [1] * (2 * n),
        [False, False] + [True] * (2 * n),
    )
    assert cpsat.scale(model).exact
    highs = runner.solve(model, "highs", fallback=None)
    cp = runner.solve(model, "cpsat", fallback=None)
    assert cp.status is highs.status
    if highs.status is SolveStatus.OPTIMAL:
        assert cp.objective == pytest.approx(highs.objective, abs=1e-6)


def test_binary_fraction_coefficients_scale_exactly() -> None:
    """XEngine's fixed-tensor sizes in units of a power-of-two GCD (431/1024 of a unit):
    not decimal within 9 digits, exact as binary fractions."""
    rows, exact = cpsat.scale_row(
        np.arange(2), np.array([431 / 1024, 1.0]), np.zeros(2), np.full(2, 4), -np.inf, 2.5
    )
    assert exact and len(rows) == 1
    assert rows[0].coefs.tolist() == [431, 1024] and rows[0].hi == 2560


def test_rounded_objective_keeps_the_bound_valid() -> None:
    # Costs 1/3 and 2/7 are not decimal: CP-SAT optimises a rounded objective and the
    # rounding error comes off the bound.
    model = _model([-1 / 3, -2 / 7, 1 / 3], [[1, 1, 1]], [-np.inf], [2], [0] * 3, [1] * 3, [1] * 3)
    result = runner.solve(model, "cpsat", fallback=None)
    assert result.objective == pytest.approx(-1 / 3 - 2 / 7)
    assert result.bound is not None and result.bound <= result.objective
    assert result.objective - result.bound < 1e-6
