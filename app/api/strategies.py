"""``/v1/strategies``: what a job may name as its ``strategy`` and its solver ``backend``,
so that clients (the dashboard's job form) need not hard-code either list.

The strategies are ``remat.strategies.REGISTRY``'s, plus ``auto``. The solver backends are
``remat.solvers.runner.BACKENDS``; whether each is available on this server is found once
per process, without importing any solver library into it: a package that is
not installed is unavailable, and Gurobi's license is tried in a short-lived subprocess
(``gurobipy`` installs a size-limited license by itself).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from app.api.deps import require_key
from app.planning import AUTO
from remat.solvers.runner import BACKENDS, DEFAULT_BACKEND, PACKAGES
from remat.strategies import REGISTRY
from remat.strategies.auto import DESCRIPTION as AUTO_DESCRIPTION

router = APIRouter(prefix="/v1", tags=["strategies"], dependencies=[Depends(require_key)])

StrategyKind = Literal["auto", "baseline", "heuristic", "exact"]
DEFAULT_STRATEGY = "xengine"  # app.schemas.JobSpec's default
PROBE_TIMEOUT_S = 30.0


class StrategyInfo(BaseModel):
    name: str
    kind: StrategyKind = Field(
        description="auto: the baselines, greedy eviction, offloading where a device has "
        "memory apart from its host, and a short exact solve; "
        "baseline: Checkmate's Table 1 heuristics; heuristic: other heuristics; "
        "exact: a MILP/MIQP solved towards a proven optimum"
    )
    places_over_devices: bool = Field(
        description="places operators over the job's devices itself (run once for all); "
        "otherwise planned on each device alone and the cheapest taken"
    )
    uses_solver: bool = Field(description="uses the job's solver backend")
    description: str


class BackendInfo(BaseModel):
    name: str
    available: bool = Field(description="whether this server can solve with it")
    detail: str = Field(description="why not, or a limit it has (e.g. Gurobi's license)")


class StrategiesOut(BaseModel):
    """The strategies and solver backends a job may name on this server."""

    strategies: list[StrategyInfo]
    default_strategy: str
    backends: list[BackendInfo]
    default_backend: str


def strategy_registry() -> list[tuple[str, StrategyKind, bool, str]]:
    """(name, kind, places_over_devices, description) of every registered strategy, ``auto``
    first, from ``remat.strategies.REGISTRY``."""
    entries: list[tuple[str, StrategyKind, bool, str]] = [(AUTO, "auto", False, AUTO_DESCRIPTION)]
    for info in REGISTRY.values():
        entries.append((info.name, info.kind, info.places_over_devices, info.description))
    return entries


@router.get("/strategies", response_model=StrategiesOut)
def list_strategies() -> StrategiesOut:
    """The strategies (``auto`` first) and the solver backends, with whether each backend
    is available here; ``default_*`` are what a job gets when it names none."""
    strategies = [
        StrategyInfo(
            name=name,
            kind=kind,
            places_over_devices=multi,
            uses_solver=kind == "exact",
            description=text,
        )
        for name, kind, multi, text in strategy_registry()
    ]
    return StrategiesOut(
        strategies=strategies,
        default_strategy=DEFAULT_STRATEGY,
        backends=backends(),
        default_backend=DEFAULT_BACKEND,
    )


# --- solver backends ------------------------------------------------------------------------

_found: list[BackendInfo] | None = None
_lock = threading.Lock()


def backends() -> list[BackendInfo]:
    """Every backend of ``BACKENDS`` with its availability, found on the first call."""
    global _found
    with _lock:
        if _found is None:
            _found = [_backend(name) for name in BACKENDS]
        return list(_found)


def _backend(name: str) -> BackendInfo:
    package = PACKAGES.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        return BackendInfo(name=name, available=False, detail=f"{package} is not installed")
    if name == "gurobi":
        return _gurobi()
    return BackendInfo(name=name, available=True, detail="")


# In a child: start an environment (a missing license fails here), then solve a model one
# variable over the size-limited license's 2000 (which refuses it with error 10010).
_GUROBI_PROBE = """
import json, gurobipy as gp
try:
    env = gp.Env(empty=True)
    env.setParam("OutputFlag", 0)
    env.start()
except gp.GurobiError as exc:
    print(json.dumps({"available": False, "detail": f"no Gurobi license ({exc})"}))
    raise SystemExit from None
with env, gp.Model(env=env) as m:
    m.addVars(2001)
    try:
        m.optimize()
        detail = ""
    except gp.GurobiError as exc:
        if exc.errno != 10010:
            raise
        detail = "size-limited license: at most 2000 variables and 2000 constraints"
print(json.dumps({"available": True, "detail": detail}))
"""


def _gurobi() -> BackendInfo:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _GUROBI_PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
        found = json.loads(done.stdout.strip().splitlines()[-1])
        return BackendInfo(
            name="gurobi", available=bool(found["available"]), detail=found["detail"]
        )
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, KeyError):
        return BackendInfo(name="gurobi", available=False, detail="gurobipy does not start here")
