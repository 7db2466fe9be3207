"""MILP/MIQP formulations of rematerialization: Checkmate's MILP (one device, section 4) and
XEngine's MIQP (several devices, section 3.2, energy in 5.1). Each builder returns a
backend-neutral ``MILPModel`` (``remat.solvers.model``) with ``decode`` (solution ->
schedule) and ``encode`` (schedule -> full assignment, e.g. a warm start)."""

from typing import Protocol

import numpy as np

from remat.formulations.checkmate import (
    CheckmateModel,
    build_checkmate,
    single_device_fixed_bytes,
)
from remat.formulations.xengine import XEngineModel, build_xengine
from remat.schedule import Schedule
from remat.solvers.model import MILPModel


class Formulation(Protocol):
    """A built model, its LP relaxation and the maps between its variables and schedules
    (Checkmate's, XEngine's)."""

    @property
    def model(self) -> MILPModel: ...

    def lp_relaxation(self) -> MILPModel: ...

    def encode(self, schedule: Schedule) -> np.ndarray: ...

    def decode(self, x: np.ndarray) -> Schedule: ...


__all__ = [
    "CheckmateModel",
    "Formulation",
    "XEngineModel",
    "build_checkmate",
    "build_xengine",
    "single_device_fixed_bytes",
]
