"""MILP/MIQP formulations of rematerialization: Checkmate's MILP (one device, section 4) and
XEngine's MIQP (several devices, section 3.2, energy in 5.1). Each builder returns a
backend-neutral ``MILPModel`` (``remat.solvers.model``) with ``decode`` (solution ->
schedule) and ``encode`` (schedule -> full assignment, e.g. a warm start)."""

from remat.formulations.checkmate import (
    CheckmateModel,
    build_checkmate,
    single_device_fixed_bytes,
)
from remat.formulations.xengine import PowerCaps, XEngineModel, build_xengine

__all__ = [
    "CheckmateModel",
    "PowerCaps",
    "XEngineModel",
    "build_checkmate",
    "build_xengine",
    "single_device_fixed_bytes",
]
