// Small SVG charts, no library: the schedule's R and S matrices as heatmaps of sparse
// cells (XEngine figure 3) and line charts (solver progress; memory per device with its
// budget, XEngine figure 4). Every drawn value is also in data-* attributes, so tests and
// scripts can read what a chart shows.

import { h, s } from "./dom.js";

// Okabe-Ito hues, darkened where needed for 3:1 contrast against the white background.
const DEVICE_COLORS = ["#0072b2", "#c0450a", "#00795a", "#a2367f", "#7a5c00", "#4b4fa8"];
const AXIS = "#4b5563";
const GRID = "#e5e7eb";
const FONT = 12;
// A white outline under labels keeps them readable where they cross a line.
const HALO = { stroke: "#ffffff", "stroke-width": 3, "paint-order": "stroke", "stroke-linejoin": "round" };

export function deviceColor(index) {
  return DEVICE_COLORS[index % DEVICE_COLORS.length];
}

/** Round numbers for axis ticks between 0 and ``max``. */
export function niceTicks(max, count = 4) {
  if (!(max > 0)) return { max: 1, ticks: [0, 1] };
  const raw = max / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * power).find((m) => m >= raw);
  const top = Math.ceil(max / step) * step;
  const ticks = [];
  for (let v = 0; v <= top + step / 2; v += step) ticks.push(v);
  return { max: top, ticks };
}

/** Round ticks covering [low, high] (not from zero). */
function bandTicks(low, high, count = 4) {
  const raw = (high - low) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * power).find((m) => m >= raw);
  const min = Math.floor(low / step) * step;
  const max = Math.ceil(high / step) * step;
  const ticks = [];
  for (let v = min; v <= max + step / 2; v += step) ticks.push(v);
  return { min, max, ticks };
}

/** Byte ticks on binary steps, so the labels are round MiB or KiB. */
function byteTicks(max, count = 4) {
  if (!(max > 0)) return { max: 1, ticks: [0, 1] };
  const unit = 1024 ** Math.max(0, Math.floor(Math.log(max) / Math.log(1024)));
  const { ticks } = niceTicks(max / unit, count);
  return { max: ticks[ticks.length - 1] * unit, ticks: ticks.map((t) => t * unit) };
}

/**
 * Draws ``draw(width)`` into ``container`` and again whenever its width changes, so text in
 * a chart stays at its real size on any screen. ``update()`` redraws now (after the data
 * ``draw`` reads has changed). Stops watching when ``signal`` aborts.
 */
export function responsive(container, draw, signal) {
  let drawn = 0;
  let frame = 0;
  const redraw = (force) => {
    const width = Math.round(container.clientWidth) || 640; // not laid out yet: a default
    if (!force && Math.abs(width - drawn) < 16) return;
    drawn = width;
    container.replaceChildren(draw(width));
  };
  // Deferred to the next frame: redrawing inside the observer's callback can loop. The
  // observer also reports the first layout of a container not yet on the page.
  const observer = new ResizeObserver(() => {
    cancelAnimationFrame(frame);
    frame = requestAnimationFrame(() => redraw(false));
  });
  observer.observe(container);
  signal.addEventListener("abort", () => observer.disconnect());
  if (container.isConnected && container.clientWidth > 0) redraw(true);
  return { update: () => redraw(true) };
}

function text(x, y, content, attrs = {}) {
  return s("text", { x, y, "font-size": FONT, fill: AXIS, ...attrs }, content);
}

// Above this many cells a heatmap draws each run of neighbouring nodes in a stage as one
// rect: a large graph's S can hold 100,000s of cells, more than a page should carry.
const MAX_RECTS = 20000;

/** [stage, first node, last node] per rect: single cells, or runs when there are many. */
function runs(cells) {
  if (cells.length <= MAX_RECTS) return cells.map(([stage, node]) => [stage, node, node]);
  const sorted = [...cells].sort((a, b) => a[0] - b[0] || a[1] - b[1]);
  const merged = [];
  for (const [stage, node] of sorted) {
    const run = merged[merged.length - 1];
    if (run && run[0] === stage && run[2] === node - 1) run[2] = node;
    else merged.push([stage, node, node]);
  }
  return merged;
}

/**
 * A stage x node grid with a mark per (stage, node) cell: R (computed in that stage) or S
 * (kept in memory entering it). ``cells`` are the API's sparse pairs.
 */
export function heatmap({ cells, stages, names, color, matrix, device, width }) {
  const columns = Math.max(names.length, 1);
  const rows = Math.max(stages, 1);
  const margin = { left: 44, right: 8, top: 8, bottom: 36 };
  const side = Math.max(160, Math.min(width, 520)) - margin.left - margin.right;
  const cellW = side / columns;
  const cellH = (side * Math.min(rows / columns, 2)) / rows;
  const plotH = cellH * rows;
  const verb = matrix === "R" ? "computed" : "kept in memory";
  const svg = s("svg", {
    class: "heatmap",
    viewBox: `0 0 ${side + margin.left + margin.right} ${plotH + margin.top + margin.bottom}`,
    role: "img",
    "aria-label": `${matrix} on ${device}: ${cells.length} cells where a node is ${verb}, ` +
      `over ${rows} stages and ${columns} nodes`,
    dataset: { device, matrix, cells: String(cells.length), stages: String(rows) },
  });
  const plot = s("g", { transform: `translate(${margin.left},${margin.top})` });
  plot.append(s("rect", {
    class: "plot-area", width: side, height: plotH, fill: "#f7f8fa", stroke: "#c7ccd4",
  }));
  const marks = s("g", { class: "cells", fill: color, "shape-rendering": "crispEdges" });
  for (const [stage, node, last] of runs(cells)) {
    const name = names[node] ?? `#${node}`;
    const span = last - node + 1;
    const what = span === 1
      ? `node ${node}: ${name}`
      : `nodes ${node}–${last}: ${name} … ${names[last] ?? `#${last}`}`;
    marks.append(s("rect", {
      x: node * cellW, y: stage * cellH, width: Math.max(cellW * span, 0.6), height: Math.max(cellH, 0.6),
      dataset: { stage: String(stage), node: String(node), last: String(last), name },
    }, s("title", {}, `stage ${stage}, ${what} (${verb} on ${device})`)));
  }
  plot.append(marks);
  plot.append(
    text(0, plotH + 14, "0", { "text-anchor": "start" }),
    text(side, plotH + 14, String(columns - 1), { "text-anchor": "end" }),
    text(side / 2, plotH + 30, "node", { "text-anchor": "middle" }),
    text(-6, FONT, "0", { "text-anchor": "end" }),
    text(-6, plotH, String(rows - 1), { "text-anchor": "end" }),
    text(-30, plotH / 2, "stage", {
      "text-anchor": "middle", transform: `rotate(-90 -30 ${plotH / 2})`,
    }));
  svg.append(plot);
  return svg;
}

function pathOf(points, x, y, step) {
  let d = "";
  let previous = null;
  for (const [px, py] of points) {
    if (previous === null) d += `M${x(px).toFixed(1)},${y(py).toFixed(1)}`;
    else if (step) d += `H${x(px).toFixed(1)}V${y(py).toFixed(1)}`;
    else d += `L${x(px).toFixed(1)},${y(py).toFixed(1)}`;
    previous = py;
  }
  return d;
}

/**
 * A line chart. ``series``: [{name, points: [[x, y]], color, dash, step, dots, extendTo,
 * dataset}] (``extendTo``: hold the last value up to this x);
 * ``lines``: horizontal reference lines [{value, label, color, dataset}];
 * ``markers``: labelled points [{x, y, label, color, dataset}].
 */
export function lineChart({
  series, lines = [], markers = [], width, height = 240, label, xLabel,
  xFormat = String, yFormat = String, yBytes = false, zeroBased = true, className = "line-chart",
  dataset = {},
}) {
  const margin = { left: 72, right: 16, top: 16, bottom: 44 };
  const plotW = Math.max(120, width - margin.left - margin.right);
  const plotH = height - margin.top - margin.bottom;
  const xs = series.flatMap((one) => one.points.map((p) => p[0]));
  const ys = [...series.flatMap((one) => one.points.map((p) => p[1])), ...lines.map((l) => l.value)];
  const xMax = Math.max(...xs, 1);
  const rawYMax = Math.max(...ys, 0) * 1.05;
  let { max: yMax, ticks } = yBytes ? byteTicks(rawYMax) : niceTicks(rawYMax);
  let yMin = 0;
  if (!zeroBased && ys.length) {
    // Values far from zero (a solver's bound and incumbent): show the band they move in.
    const low = Math.min(...ys);
    const high = Math.max(...ys);
    const pad = Math.max((high - low) * 0.1, Math.abs(high) * 0.02, 1e-9);
    ({ min: yMin, max: yMax, ticks } = bandTicks(low - pad, high + pad));
  }
  const x = (v) => (v / xMax) * plotW;
  const y = (v) => plotH - ((v - yMin) / (yMax - yMin)) * plotH;
  const svg = s("svg", {
    class: className,
    viewBox: `0 0 ${plotW + margin.left + margin.right} ${height}`,
    role: "img",
    "aria-label": label,
    dataset: {
      ...dataset, yMin: String(yMin), yMax: String(yMax), plotHeight: String(plotH), plotTop: String(margin.top),
    },
  });
  const plot = s("g", { transform: `translate(${margin.left},${margin.top})` });
  for (const tick of ticks) {
    plot.append(
      s("line", { x1: 0, x2: plotW, y1: y(tick), y2: y(tick), stroke: GRID }),
      text(-8, y(tick) + 4, yFormat(tick), { "text-anchor": "end" }));
  }
  plot.append(
    s("line", { x1: 0, x2: 0, y1: 0, y2: plotH, stroke: AXIS }),
    s("line", { x1: 0, x2: plotW, y1: plotH, y2: plotH, stroke: AXIS }),
    text(0, plotH + 16, xFormat(0), { "text-anchor": "start" }),
    text(plotW, plotH + 16, xFormat(xMax), { "text-anchor": "end" }),
    text(plotW / 2, plotH + 34, xLabel, { "text-anchor": "middle" }));
  for (const one of series) {
    const last = one.points[one.points.length - 1];
    const drawn = one.extendTo !== undefined && last ? [...one.points, [one.extendTo, last[1]]] : one.points;
    plot.append(s("path", {
      d: pathOf(drawn, x, y, one.step), fill: "none", stroke: one.color, "stroke-width": 2,
      "stroke-dasharray": one.dash || null, "stroke-linejoin": "round",
      dataset: { series: one.name, points: String(one.points.length), ...(one.dataset || {}) },
    }, s("title", {}, one.name)));
    if (one.dots) {
      // the reported points themselves: visible even while there is only one
      plot.append(s("g", { fill: one.color, "aria-hidden": "true" },
        one.points.map(([px, py]) => s("circle", { cx: x(px), cy: y(py), r: 3 }))));
    }
  }
  for (const line of lines) {
    const ly = y(line.value);
    plot.append(
      s("line", {
        x1: 0, x2: plotW, y1: ly, y2: ly, stroke: line.color, "stroke-width": 2,
        "stroke-dasharray": "6 4", dataset: { value: String(line.value), ...(line.dataset || {}) },
      }),
      // below the line at its left end: a peak's label sits above the curve, and memory
      // is low at the start of a step sequence
      text(6, ly + 16, line.label, { "text-anchor": "start", fill: line.color, "font-weight": "600", ...HALO }));
  }
  for (const marker of markers) {
    const mx = x(marker.x);
    const my = y(marker.y);
    const anchor = mx > plotW * 0.7 ? "end" : "start";
    plot.append(
      s("circle", { cx: mx, cy: my, r: 4, fill: marker.color, dataset: marker.dataset || {} }),
      text(mx + (anchor === "end" ? -8 : 8), Math.max(my - 8, 12), marker.label, {
        "text-anchor": anchor, fill: "#111827", "font-weight": "600", ...HALO,
      }));
  }
  svg.append(plot);
  return svg;
}

/**
 * A device's transfer lane to host memory under its memory chart, on the same step axis
 * (the line chart's margins): one row of offloads and one of prefetches, each transfer a
 * bar from the step that issues it to the step of the wait that ends it.
 * ``spans``: [{node, kind, issued, done, tensor}] (``tensor``: a paged fixed tensor's, with
 * ``node`` null); ``steps``: the plan's step count.
 */
export function transferLane({ spans, steps, names, color, device, width }) {
  const margin = { left: 72, right: 16, top: 4, bottom: 4 };
  const plotW = Math.max(120, width - margin.left - margin.right);
  const row = 14;
  const present = new Set(spans.map((one) => one.kind));
  const kinds = ["offload", "prefetch", "page_out", "page_in", "fixed_in", "grad_out"].filter(
    (kind, index) => index < 2 || present.has(kind));
  const height = margin.top + margin.bottom + row * kinds.length;
  const x = (v) => (v / Math.max(steps - 1, 1)) * plotW;
  const svg = s("svg", {
    class: "transfer-lane",
    viewBox: `0 0 ${plotW + margin.left + margin.right} ${height}`,
    role: "img",
    "aria-label": `Transfers of ${device} to and from host memory and storage: ${spans.length}`,
    dataset: { device, transfers: String(spans.length) },
  });
  kinds.forEach((kind, index) => {
    const top = margin.top + index * row;
    svg.append(text(margin.left - 8, top + row - 3, kind, { "text-anchor": "end" }));
    for (const span of spans.filter((one) => one.kind === kind)) {
      const x0 = margin.left + x(span.issued);
      const what = span.tensor != null
        ? `fixed tensor ${span.tensor}`
        : `node ${span.node} ${names[span.node] ?? ""}`;
      const leaving = kind === "offload" || kind === "page_out" || kind === "grad_out";
      svg.append(s("rect", {
        x: x0, y: top + 2, width: Math.max(x(span.done) - x(span.issued), 2), height: row - 4,
        fill: color, "fill-opacity": leaving ? 0.85 : 0.45,
        dataset: {
          node: String(span.node ?? ""), tensor: span.tensor ?? "", kind,
          issued: String(span.issued), done: String(span.done),
        },
      }, s("title", {}, `${kind} of ${what}: steps ${span.issued}–${span.done}`)));
    }
  });
  return svg;
}

/** A coloured swatch for legends and headings (SVG: no inline style under the CSP). */
export function swatch(color, dashed = false) {
  return s("svg", { class: "swatch", width: 18, height: 12, viewBox: "0 0 18 12", "aria-hidden": "true" },
    dashed
      ? s("line", { x1: 1, x2: 17, y1: 6, y2: 6, stroke: color, "stroke-width": 2, "stroke-dasharray": "4 3" })
      : s("rect", { x: 1, y: 1, width: 16, height: 10, rx: 2, fill: color }));
}

/** A legend: swatches with text, as an HTML list so it wraps and reads as text. */
export function legend(entries) {
  return h("ul", { class: "legend" },
    entries.map(({ label, color, dashed }) => h("li", {}, swatch(color, dashed), label)));
}
