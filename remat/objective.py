"""What a plan minimises, and the power it may draw (XEngine section 5.1).

Objectives (``Objective.kind``):

* ``time`` (the default): the plan's time, compute and copies (eq. 1's sum of c R and W);
* ``energy``: the plan's energy E (``remat.energy``: nodes' dynamic energy, copies, and
  idle and board power over the whole run);
* ``weighted``: eq. 17, time + alpha * E, with alpha in ms per mJ.

Power caps (eq. 18-19), on any objective. Plans run one step at a time, so while node i runs
on device d the machine draws the idle power of every device, the board's, and i's dynamic
power p_{d,i} = q_{d,i} / c_{d,i}. Eq. 18 caps a device's draw (its idle power and p_{d,i});
eq. 19 caps the machine's (the board's, every idle power and p_{d,i}). A placement over a
cap is forbidden: the plan may not compute i on d.

A runtime cap (POET's mu^deadline, eq. 2 of PORT's section 4.2: energy, or any objective,
with the plan's time at most ``time_cap_ms``) is kept by judging: a plan over it is
refused; ``port`` plans under it (POET's objective, in its ILP).

Every objective is linear in the steps of a plan: a compute of i on d costs
w_t c_{d,i} + w_e (q_{d,i} + P_s c_{d,i}), a copy w_t w + w_e (LINK_W + P_s) w, with P_s the
static power. ``objective_costs`` is the cost model whose times are those costs, so every
strategy minimises the objective as it minimises time; a forbidden placement costs more
than any plan that avoids it. ``remat.strategies.run_strategy`` searches on those costs and
judges the plan it returns on the true ones (time, energy, caps). Offloading overlaps
transfers with compute and so is priced in time only: under the other objectives and under
caps, plans do not offload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np

from remat.costs import CostModel
from remat.energy import LINK_W, MAX_POWER_W
from remat.errors import InvalidInputError
from remat.graph import Graph
from remat.plan import Compute, Plan

MAX_ALPHA = 1e6  # ms per mJ: beyond it, time no longer counts next to energy
MAX_TIME_CAP_MS = 1e9  # about 11 days: beyond any training step


class ObjectiveKind(StrEnum):
    TIME = "time"
    ENERGY = "energy"
    WEIGHTED = "weighted"


@dataclass(frozen=True)
class Objective:
    """What a plan minimises and the power caps it keeps (W): per device (eq. 18) and for
    the board (eq. 19), with the board's own draw ``board_w`` (Q_Board)."""

    kind: ObjectiveKind = ObjectiveKind.TIME
    alpha: float = 0.0
    caps_w: Mapping[str, float] = field(default_factory=dict)
    board_cap_w: float | None = None
    board_w: float = 0.0
    time_cap_ms: float | None = None  # POET's runtime cap: the plan's time at most this

    def __post_init__(self) -> None:
        if self.kind is ObjectiveKind.WEIGHTED and not 0 < self.alpha <= MAX_ALPHA:
            raise InvalidInputError(
                f"the weighted objective needs alpha in (0, {MAX_ALPHA:g}] ms per mJ "
                f"(eq. 17: time + alpha * energy); got {self.alpha:g}"
            )
        if self.kind is not ObjectiveKind.WEIGHTED and self.alpha:
            raise InvalidInputError(
                f"alpha weighs energy in the weighted objective only, not {self.kind}"
            )
        for name, watts in [*self.caps_w.items(), ("the board", self.board_cap_w)]:
            if watts is not None and not 0 < watts <= MAX_POWER_W:
                raise InvalidInputError(
                    f"power cap of {name}: {watts:g} W is not in (0, {MAX_POWER_W:g}] W"
                )
        if not 0 <= self.board_w <= MAX_POWER_W:
            raise InvalidInputError(
                f"board power {self.board_w:g} W is not in [0, {MAX_POWER_W:g}] W"
            )
        if self.time_cap_ms is not None and not 0 < self.time_cap_ms <= MAX_TIME_CAP_MS:
            raise InvalidInputError(
                f"runtime cap {self.time_cap_ms:g} ms is not in (0, {MAX_TIME_CAP_MS:g}] ms"
            )

    @property
    def capped(self) -> bool:
        return bool(self.caps_w) or self.board_cap_w is not None

    @property
    def time_only(self) -> bool:
        """Time, uncapped: strategies search on the cost model as it is."""
        return self.kind is ObjectiveKind.TIME and not self.capped and self.time_cap_ms is None

    @property
    def weights(self) -> tuple[float, float]:
        """(w_t, w_e): the objective is w_t * time + w_e * energy."""
        if self.kind is ObjectiveKind.TIME:
            return 1.0, 0.0
        if self.kind is ObjectiveKind.ENERGY:
            return 0.0, 1.0
        return 1.0, self.alpha

    @property
    def unit(self) -> str:
        return {"time": "ms", "energy": "mJ", "weighted": "ms + alpha mJ"}[self.kind]

    def value(self, total_ms: float, energy_mj: float) -> float:
        w_t, w_e = self.weights
        return w_t * total_ms + w_e * energy_mj

    def describe(self) -> str:
        text = {
            "time": "time",
            "energy": "energy",
            "weighted": f"time + {self.alpha:g} ms/mJ x energy",
        }[self.kind]
        caps = [f"{name} <= {w:g} W" for name, w in self.caps_w.items()]
        if self.board_cap_w is not None:
            caps.append(f"board <= {self.board_cap_w:g} W")
        text += f" (power caps: {', '.join(caps)})" if caps else ""
        return text + (f", time <= {self.time_cap_ms:g} ms" if self.time_cap_ms else "")


def with_board(costs: CostModel, objective: Objective) -> CostModel:
    """``costs`` whose energy counts the board's power (``objective.board_w``)."""
    if not objective.board_w:
        return costs
    return replace(costs, energy=replace(costs.energy_model(), board_w=objective.board_w))


def check_objective(graph: Graph, costs: CostModel, objective: Objective) -> None:
    """InvalidInputError for an objective these costs cannot serve: energy or caps without
    energy costs (a profile whose devices have no counters), a cap for a device not in the
    problem, a cap below a device's idle power, and caps that leave a node no device."""
    unknown = sorted(set(objective.caps_w) - {d.name for d in costs.devices})
    if unknown:
        names = ", ".join(d.name for d in costs.devices)
        raise InvalidInputError(f"power cap for unknown device {unknown[0]!r} (devices: {names})")
    energy = costs.energy_model()
    wants_energy = objective.kind is not ObjectiveKind.TIME or objective.capped
    if wants_energy and costs.source == "profiled" and not any(energy.measured):
        raise InvalidInputError(
            f"the {objective.kind} objective{' with power caps' if objective.capped else ''} "
            "needs energy costs, and the profile has none (its devices had no energy "
            "counters): use analytical costs, or a profile measured where counters exist"
        )
    for d, device in enumerate(costs.devices):
        cap = objective.caps_w.get(device.name)
        if cap is not None and cap < energy.idle_w[d]:
            raise InvalidInputError(
                f"power cap of {device.name} ({cap:g} W) is below its idle power "
                f"({energy.idle_w[d]:g} W)"
            )
    idle = energy.static_w  # the costs count the board (``with_board``)
    if objective.board_cap_w is not None and objective.board_cap_w < idle:
        raise InvalidInputError(
            f"board power cap ({objective.board_cap_w:g} W) is below the machine's idle "
            f"power ({idle:g} W: every device's and the board's)"
        )
    allowed = ~forbidden(costs, objective)
    stuck = np.flatnonzero(~allowed.any(axis=1))
    if stuck.size:
        i = int(stuck[0])
        draws = ", ".join(
            f"{_total_w(costs, objective, i, d):.1f} W on {dev.name}"
            for d, dev in enumerate(costs.devices)
        )
        raise InvalidInputError(
            f"power caps leave node {graph.nodes[i].name!r} no device: it draws {draws} "
            f"({objective.describe()}); {stuck.size} node(s) have none"
        )


def _total_w(costs: CostModel, objective: Objective, i: int, d: int) -> float:
    """The draw of the device computing node i (its idle power and i's), or of the machine
    where only the board is capped."""
    energy = costs.energy_model()
    draw = float(energy.draw_w(costs.compute_ms)[i, d])
    if costs.devices[d].name in objective.caps_w:
        return energy.idle_w[d] + draw
    return energy.static_w + draw


def forbidden(costs: CostModel, objective: Objective) -> np.ndarray:
    """forbidden[i, d]: computing node i on device d draws more than a cap (eq. 18-19)."""
    energy = costs.energy_model()
    draw = energy.draw_w(costs.compute_ms)
    over = np.zeros(draw.shape, dtype=bool)
    for d, device in enumerate(costs.devices):
        cap = objective.caps_w.get(device.name)
        if cap is not None:
            over[:, d] |= energy.idle_w[d] + draw[:, d] > cap
    if objective.board_cap_w is not None:
        over |= energy.static_w + draw > objective.board_cap_w
    return over


def objective_costs(costs: CostModel, objective: Objective) -> CostModel:
    """The cost model whose times are the objective's costs (the module docstring)."""
    w_t, w_e = objective.weights
    energy = costs.energy_model()
    static = energy.static_w
    compute = w_t * costs.compute_ms + w_e * (energy.q_mj + static * costs.compute_ms)
    copy = (w_t + w_e * (LINK_W + static)) * costs.copy_ms
    over = forbidden(costs, objective)
    if over.any():
        allowed = np.where(over, 0.0, compute)
        worst = float(allowed.max(axis=1).sum() + copy.max(axis=(1, 2)).sum())
        compute = np.where(over, 10.0 * worst + 1.0, compute)
    return replace(costs, compute_ms=compute, copy_ms=copy)


def power_violation(plan: Plan, costs: CostModel, objective: Objective) -> str | None:
    """The first compute step of ``plan`` over a cap, described; None where there is none."""
    if not objective.capped:
        return None
    over = forbidden(costs, objective)
    for index, step in enumerate(plan.steps):
        if isinstance(step, Compute):
            d = costs.device_index(step.device)
            if over[step.node, d]:
                return (
                    f"step {index}: node {step.node} on {step.device} draws "
                    f"{_total_w(costs, objective, step.node, d):.1f} W, over its power cap "
                    f"({objective.describe()})"
                )
    return None
