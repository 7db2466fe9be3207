"""The time-energy trade-off of plans on a CPU and a GPU (XEngine section 5.1, eq. 17),
analytical costs and ``remat.energy``'s power model.

For each model and regime, ``xengine`` plans at ``--budget`` of the checkpoint-all peak on
both devices under a range of objectives: time; time + alpha x energy for each ``--alphas``
(ms per mJ); energy; and time under a power cap on the GPU (eq. 18) at the middle of its
operators' draws. Each row gives the plan's time and energy, the solver's gap on its own
objective, where the nodes ran, and whether the point is on the Pareto front of the
model's points (no other plan has both less time and less energy). Regimes:

* ``server``: the defaults: a GPU of 10 TFLOP/s and 900 GB/s drawing 50 W idle and up to
  250 W more, an 8-thread CPU drawing 10 W idle and 6 W a thread;
* ``edge``: a board's GPU of 2 TFLOP/s and 100 GB/s, 20 us launches, 5 W idle and 40 W more,
  an 8-thread CPU drawing 3 W idle and 12 W more.

Prints a markdown table, appends a row per point to ``bench/results/energy.csv``
(``bench/report.py`` renders them) and draws the curves, time and energy each as a ratio
to the model's least, into ``docs/energy_pareto.svg``.

    .venv/bin/python bench/energy.py [--models transformer,resnet18] [--regimes server,edge]
        [--budget 50] [--alphas 0.001,0.01,0.1,1] [--time-limit 20] [--run LABEL]
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass

import numpy as np
from results import ROOT, Writer, add_run_argument
from solvers import bench_graph

from remat.devices import Device, DeviceKind
from remat.graph import Graph
from remat.objective import Objective, ObjectiveKind
from remat.plan import Compute
from remat.problem import problem_from_graph
from remat.solvers.model import SolveOptions
from remat.strategies import SolverSettings, run_strategy

REGIMES: dict[str, tuple[Device, Device]] = {
    "server": (
        Device("cpu0", DeviceKind.CPU, {"threads": "8"}),
        Device("gpu0", DeviceKind.CUDA),
    ),
    "edge": (
        Device("cpu0", DeviceKind.CPU, {"threads": "8", "idle_w": "3", "busy_w": "12"}),
        Device(
            "gpu0",
            DeviceKind.CUDA,
            {
                "flops": "2e12",
                "bandwidth": "1e11",
                "launch_us": "20",
                "idle_w": "5",
                "busy_w": "40",
            },
        ),
    ),
}
FIGURE = ROOT / "docs" / "energy_pareto.svg"


@dataclass(frozen=True)
class Point:
    model: str
    regime: str
    label: str
    time_ms: float
    energy_mj: float


def objectives(
    graph: Graph, devices: tuple[Device, Device], alphas: list[float]
) -> list[Objective]:
    """Time, each weighted sum, energy, and time under a GPU cap at the middle of its draws."""
    plain = problem_from_graph(graph, devices=list(devices))
    energy = plain.costs.energy_model()
    draws = energy.draw_w(plain.costs.compute_ms)[:, 1]
    cap = energy.idle_w[1] + float(np.median(draws))
    return [
        Objective(),
        *(Objective(ObjectiveKind.WEIGHTED, alpha=a) for a in alphas),
        Objective(ObjectiveKind.ENERGY),
        Objective(caps_w={"gpu0": round(cap, 1)}),
    ]


def label(objective: Objective) -> str:
    if objective.capped:
        return f"time, gpu0 <= {objective.caps_w['gpu0']:g} W"
    if objective.kind is ObjectiveKind.WEIGHTED:
        return f"time + {objective.alpha:g} energy"
    return str(objective.kind)


def pareto(points: list[Point]) -> set[int]:
    """The indices of the points no other point beats on both time and energy."""
    return {
        i
        for i, p in enumerate(points)
        if not any(
            q.time_ms <= p.time_ms
            and q.energy_mj <= p.energy_mj
            and (q.time_ms, q.energy_mj) != (p.time_ms, p.energy_mj)
            for q in points
        )
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="transformer,resnet18")
    parser.add_argument("--regimes", default="server,edge")
    parser.add_argument("--budget", type=float, default=50.0)
    parser.add_argument("--alphas", default="0.001,0.01,0.1,1")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--time-limit", type=float, default=20.0)
    add_run_argument(parser)
    args = parser.parse_args()
    out = Writer("energy", args.run)
    alphas = [float(a) for a in args.alphas.split(",")]
    solver = SolverSettings(options=SolveOptions(time_limit_s=args.time_limit))
    budget = f"{args.budget:g}%"
    curves: dict[tuple[str, str], list[Point]] = {}
    print("| model (nodes) | regime | objective | time ms | energy mJ | gap | on cpu0 / gpu0 |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        graph = bench_graph(name, args.batch)
        for regime in args.regimes.split(","):
            devices = REGIMES[regime]
            points, rows = [], []
            for objective in objectives(graph, devices, alphas):
                problem = problem_from_graph(
                    graph,
                    devices=list(devices),
                    budgets={d.name: budget for d in devices},
                    solver=solver,
                    objective=objective,
                )
                result = run_strategy("xengine", problem)
                if result.plan is None or result.simulation is None:
                    print(
                        f"| {name} | {regime} | {label(objective)} | - | - | - | {result.message} |"
                    )
                    continue
                sim, info = result.simulation, result.plan.solver
                where = Counter(s.device for s in result.plan.steps if isinstance(s, Compute))
                points.append(Point(name, regime, label(objective), sim.total_ms, sim.energy_mj))
                rows.append(
                    {
                        "model": name,
                        "budget": budget,
                        "devices": "cpu0+gpu0",
                        "backend": "highs",
                        "objective": problem.objective.value(sim.total_ms, sim.energy_mj),
                        "gap": None if info is None else info.gap,
                        "seconds": None if info is None else info.seconds,
                        "regime": regime,
                        "goal": label(objective),
                        "time_ms": sim.total_ms,
                        "energy_mj": sim.energy_mj,
                        "computes_cpu0": where["cpu0"],
                        "computes_gpu0": where["gpu0"],
                        "nodes": len(graph),
                        "batch": args.batch,
                        "time_limit_s": args.time_limit,
                    }
                )
            front = pareto(points)
            for i, (row, point) in enumerate(zip(rows, points, strict=True)):
                row["pareto"] = i in front
                gap = "-" if row["gap"] is None else f"{row['gap']:.1%}"
                mark = " *" if i in front else ""
                print(
                    f"| {name} ({len(graph)}) | {regime} | {point.label}{mark} | "
                    f"{point.time_ms:.4g} | {point.energy_mj:.4g} | {gap} | "
                    f"{row['computes_cpu0']} / {row['computes_gpu0']} |",
                    flush=True,
                )
            out.add_all(rows)
            curves[(name, regime)] = points
    FIGURE.write_text(figure(curves))
    print(f"wrote {FIGURE.relative_to(ROOT)} (* marks the Pareto front)")


PALETTE = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9")


def figure(curves: dict[tuple[str, str], list[Point]]) -> str:
    """An SVG scatter of every curve: time and energy as ratios to the curve's least, the
    Pareto front joined by a line."""
    width, height, pad = 640, 420, 56
    scaled = {
        key: [
            (
                p.time_ms / min(q.time_ms for q in points),
                p.energy_mj / min(q.energy_mj for q in points),
            )
            for p in points
        ]
        for key, points in curves.items()
        if points
    }
    xs = [x for pts in scaled.values() for x, _ in pts] or [1.0]
    ys = [y for pts in scaled.values() for _, y in pts] or [1.0]
    x_hi, y_hi = max(max(xs), 1.01), max(max(ys), 1.01)

    def at(x: float, y: float) -> tuple[float, float]:
        return (
            pad + (x - 1) / (x_hi - 1) * (width - 2 * pad),
            height - pad - (y - 1) / (y_hi - 1) * (height - 2 * pad),
        )

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        _line(pad, height - pad, width - pad, height - pad),
        _line(pad, pad, pad, height - pad),
        f'<text x="{width / 2}" y="{height - 16}" text-anchor="middle">time / least time '
        f"(1 to {x_hi:.3f})</text>",
        f'<text x="16" y="{height / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {height / 2})">energy / least energy (1 to {y_hi:.3f})</text>',
    ]
    for index, (key, pts) in enumerate(scaled.items()):
        color = PALETTE[index % len(PALETTE)]
        points = curves[key]
        front = sorted((pts[i] for i in pareto(points)), key=lambda p: p[0])
        line = " ".join(f"{a:.1f},{b:.1f}" for a, b in (at(x, y) for x, y in front))
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}"/>')
        for x, y in pts:
            cx, cy = at(x, y)
            parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="{color}"/>')
        parts.append(
            f'<text x="{width - pad - 150}" y="{pad + 16 * index}" fill="{color}">'
            f"{key[0]}, {key[1]}</text>"
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _line(x1: float, y1: float, x2: float, y2: float) -> str:
    return f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="black"/>'


if __name__ == "__main__":
    main()
