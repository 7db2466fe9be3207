// A job: its inputs, the solver's incumbent and bound over time (polled with If-None-Match
// while it runs), and once planned the schedule (R and S per device), memory per device
// against its budget, the baselines on the same inputs, and agent executions measured
// against the prediction. Cancel and plan download.

import { api, ApiError, downloadJson, request } from "./api.js";
import { deviceColor, heatmap, legend, lineChart, responsive, swatch, transferLane } from "./charts.js";
import { facts, h, replace, table } from "./dom.js";
import { bytes, mj, ms, objectiveText, objectiveValue, percent, seconds, shortId } from "./format.js";
import { announce, clearError, report } from "./notify.js";
import { every } from "./poll.js";
import { FINISHED, heading, jobDuration, statusBadge, timeEl } from "./widgets.js";

const POLL_MS = 1000;
const EXECUTIONS_POLL_MS = 2000;
const STATUS_NEWS = {
  queued: "The job is queued.",
  running: "The job is running.",
  succeeded: "The job succeeded.",
  failed: "The job failed.",
  cancelled: "The job was cancelled.",
};
const INCUMBENT = "#0072b2";
const BOUND = "#c0450a";

function section(id, title, ...content) {
  return h("section", { id, "aria-labelledby": `${id}-title`, class: "card" },
    h("h2", { id: `${id}-title` }, title), ...content);
}

function note(text) {
  return h("p", { class: "muted" }, text);
}

// --- inputs --------------------------------------------------------------------------

function deviceText(device) {
  const options = Object.entries(device.options || {}).map(([k, v]) => `${k}=${v}`).join(", ");
  return `${device.name} (${device.kind}${options ? `, ${options}` : ""})`;
}

function costsText(costs, nodes) {
  if (costs === "analytical") return "analytical (FLOPs / bandwidth)";
  if (costs.profile_id) return `profile ${shortId(costs.profile_id)}`;
  const node = nodes.get(costs.node_id);
  return `measured on node ${node ? node.name : shortId(costs.node_id)}`;
}

function inputsFacts(job, model, nodes) {
  const { spec } = job;
  const given = [
    ...Object.entries(spec.inputs || {}).map(([name, dims]) => `${name}=${dims.join("×")}`),
    ...Object.entries(spec.ranges || {}).map(([name, dims]) => `${name}=${dims.replaceAll("x", "×")}`),
  ];
  const shape = given.length ? given.join(", ") : `batch ${spec.batch ?? "from the model"}`;
  const budgets = spec.devices.map((d) => `${d.name}: ${spec.budgets[d.name] ?? "none"}`).join(", ");
  const solver = `${spec.solver.backend}, time limit ${seconds(spec.solver.time_limit_s)}, ` +
    `gap ${percent(spec.solver.gap, 2)}, ${spec.solver.threads} thread${spec.solver.threads === 1 ? "" : "s"}, ` +
    (spec.solver.reuse_plans === false ? "searched afresh" : "from the model's earlier plans");
  return facts([
    ["Model", h("a", { href: `#/models/${job.model_id}` }, model ? model.filename : shortId(job.model_id))],
    ["Mode", `${spec.mode}, ${shape}`],
    ["Devices", spec.devices.map(deviceText).join("; ")],
    ["Budgets", budgets],
    ["Strategy", spec.strategy],
    ["Objective", objectiveText(spec.objective)],
    ["Solver", solver],
    ["Costs", costsText(spec.costs, nodes)],
    ["Created", timeEl(job.created_at)],
  ], { id: "job-inputs" });
}

// --- progress ------------------------------------------------------------------------

function progressFacts(job) {
  const p = job.progress;
  const value = objectiveValue(job.spec.objective);
  return facts([
    ["Incumbent", value(p.incumbent_ms)],
    ["Bound", value(p.bound_ms)],
    ["Gap", percent(p.gap, 2)],
    ["Elapsed", seconds(p.elapsed_s)],
    ["Solver status", job.solver_status || "—"],
    ["Duration", jobDuration(job)],
  ], { id: "progress-facts" });
}

function progressChart(points, width, value) {
  const series = (key) => points.filter((p) => p[key] !== null && p[key] !== undefined)
    .map((p) => [p.elapsed_s, p[key]]);
  // A value holds until the solver reports the next one: steps, drawn on to the last report.
  const end = Math.max(...points.map((p) => p.elapsed_s));
  return lineChart({
    width,
    label: `Incumbent and bound over time: ${points.length} points`,
    xLabel: "elapsed (s)",
    xFormat: (v) => `${v.toFixed(1)} s`,
    yFormat: (v) => value(v),
    className: "line-chart progress-chart",
    zeroBased: false,
    series: [
      { name: "incumbent", points: series("incumbent_ms"), color: INCUMBENT, step: true, dots: true, extendTo: end },
      { name: "bound", points: series("bound_ms"), color: BOUND, dash: "5 4", step: true, dots: true, extendTo: end },
    ],
  });
}

// --- schedule and memory ---------------------------------------------------------------

function scheduleView(schedule, signal) {
  const readout = h("p", { class: "hover-readout", id: "heatmap-readout" },
    "Point at a cell to see its stage and node.");
  const figures = schedule.devices.map((device, index) => {
    const color = deviceColor(index);
    const cell = (matrix) => {
      const box = h("div", { class: "chart-box" });
      const cells = schedule[matrix][device] || [];
      responsive(box, (width) => heatmap({
        cells, stages: schedule.stages, names: schedule.nodes, color, matrix, device, width,
      }), signal);
      return h("figure", { class: "heatmap-figure" }, box,
        h("figcaption", {}, `${matrix}: ${matrix === "R" ? "computed" : "kept"} (${cells.length} cells)`));
    };
    return h("div", { class: "device-block", dataset: { device } },
      h("h3", {}, swatch(color), ` ${device}`),
      h("div", { class: "pair" }, cell("R"), cell("S")));
  });
  const view = h("div", {},
    note(`Rows are stages (${schedule.stages}), columns are the training graph's nodes ` +
      `(${schedule.nodes.length}). R marks where a node is computed in a stage, S where its ` +
      "output is kept in memory entering it (XEngine figure 3)."),
    readout, h("div", { class: "devices-grid" }, figures));
  view.addEventListener("mouseover", (event) => {
    const rect = event.target.closest("rect[data-node]");
    if (!rect) return;
    const svg = rect.closest("svg");
    const { stage, node, last, name } = rect.dataset;
    const nodes = node === last ? `node ${node} ${name}` : `nodes ${node}–${last} from ${name}`;
    readout.textContent = `${svg.dataset.matrix} on ${svg.dataset.device}: stage ${stage}, ${nodes}`;
  });
  return view;
}

function peakStep(values) {
  let best = 0;
  values.forEach((v, i) => {
    if (v > values[best]) best = i;
  });
  return best;
}

function memoryView(schedule, signal) {
  const charts = schedule.devices.map((device, index) => {
    const color = deviceColor(index);
    const values = schedule.memory[device] || [];
    const peak = schedule.peak_bytes[device] ?? Math.max(0, ...values);
    const budget = schedule.budgets[device];
    const at = peakStep(values);
    const box = h("div", { class: "chart-box" });
    responsive(box, (width) => lineChart({
      width,
      label: `Memory on ${device} over ${values.length} steps: peak ${bytes(peak)}` +
        (budget ? `, budget ${bytes(budget)}` : ", no budget"),
      xLabel: "step",
      yFormat: bytes,
      yBytes: true,
      className: "line-chart memory-chart",
      dataset: { device, peak: String(peak), budget: budget === null ? "" : String(budget) },
      series: [{
        name: `${device} memory`, points: values.map((v, i) => [i, v]), color, step: true,
        dataset: { role: "memory", peak: String(peak) },
      }],
      lines: budget ? [{ value: budget, label: `budget ${bytes(budget)}`, color: "#b91c1c", dataset: { role: "budget" } }] : [],
      markers: [{ x: at, y: values[at] ?? 0, label: `peak ${bytes(peak)}`, color, dataset: { role: "peak" } }],
    }), signal);
    const used = budget ? ` (${percent(peak / budget)} of the budget ${bytes(budget)})` : " (no budget)";
    const spans = (schedule.transfers || {})[device] || [];
    const lane = h("div", { class: "chart-box" });
    if (spans.length) {
      responsive(lane, (width) => transferLane({
        spans, steps: values.length, names: schedule.nodes, color, device, width,
      }), signal);
    }
    return h("figure", { class: "memory-figure", dataset: { device } },
      h("figcaption", {}, swatch(color), ` ${device}: `,
        h("strong", { class: "peak-label", dataset: { peak: String(peak) } }, `peak ${bytes(peak)}`), used),
      box, spans.length ? lane : null);
  });
  const offloads = Object.values(schedule.transfers || {}).some((spans) => spans.length);
  return h("div", {},
    note("Bytes resident on each device after every step of the plan, against its budget " +
      "(XEngine figure 4)." + (offloads ? " Below a chart, the device's transfers to and " +
        "from host memory, which run beside its compute: each from the step that issues " +
        "it to the step that waits for it." : "")),
    h("div", { class: "memory-grid" }, charts));
}

// --- baselines -------------------------------------------------------------------------

function overheadText(overhead) {
  if (overhead === null || overhead === undefined) return "—";
  return `${overhead >= 0 ? "+" : ""}${(overhead * 100).toFixed(1)}%`;
}

function baselinesView(baselines, job, schedule) {
  const devices = job.spec.devices.map((d) => d.name);
  const own = schedule?.predicted_ms ?? job.progress.incumbent_ms;
  const ownRow = h("tr", { class: "this-job", dataset: { strategy: job.spec.strategy } },
    h("th", { scope: "row" }, `${job.spec.strategy} (this job)`),
    h("td", { class: "num" }, ms(own)),
    h("td", { class: "num" }, own && baselines.ideal_ms ? overheadText(own / baselines.ideal_ms - 1) : "—"),
    h("td", { class: "num" }, mj(schedule?.energy_mj)),
    devices.map((d) => h("td", { class: "num" }, bytes(schedule?.peak_bytes[d]))),
    h("td", {}, "yes"),
    h("td", {}, job.solver_status || ""));
  const rows = baselines.items.map((item) => h("tr", { dataset: { strategy: item.strategy } },
    h("th", { scope: "row" }, item.strategy),
    h("td", { class: "num" }, ms(item.predicted_ms)),
    h("td", { class: "num" }, overheadText(item.overhead)),
    h("td", { class: "num" }, mj(item.energy_mj)),
    devices.map((d) => h("td", { class: "num" }, bytes(item.peak_bytes?.[d]))),
    h("td", {}, item.valid === null ? "—" : item.valid ? "yes" : "no (over budget)"),
    h("td", { class: "wrap" }, item.note || "")));
  return h("div", {},
    note(`Each baseline on the same graph, costs and budgets. Ideal (no recomputation, ` +
      `unlimited memory): ${ms(baselines.ideal_ms)}.`),
    table("Baselines on the same inputs",
      ["Strategy", "Predicted time", "Over ideal", "Predicted energy", ...devices.map((d) => `Peak ${d}`), "Fits budgets", "Note"],
      [ownRow, ...rows], { id: "baselines-table" }));
}

// --- sizes (a job over ranges of input sizes) ---------------------------------------------

const PREDICTED = "#6b7280";
const PLANNED = "#0072b2";

/** A plan family: predicted peak and time over the size range against the budget, and the
 * buckets with their representatives. */
function familyView(family, signal) {
  const planned = family.sizes.map((row) => [row.size, row.peak_bytes]);
  const predicted = family.buckets.map((b) => [b.high, b.predicted_peak_bytes]);
  const budget = family.budget_bytes;
  const peakBox = h("div", { class: "chart-box" });
  responsive(peakBox, (width) => lineChart({
    width,
    label: `Peak memory on ${family.device} over sizes ${family.low} to ${family.high}` +
      (budget ? `, budget ${bytes(budget)}` : ""),
    xLabel: "input size",
    yFormat: bytes,
    yBytes: true,
    className: "line-chart family-peak-chart",
    dataset: { sizes: String(family.sizes.length), buckets: String(family.buckets.length) },
    series: [
      { name: "checkpoint-all, predicted", points: predicted, color: PREDICTED, dash: "4 3", dots: true, dataset: { role: "predicted" } },
      { name: "the plans", points: planned, color: PLANNED, dots: true, dataset: { role: "planned" } },
    ],
    lines: budget ? [{ value: budget, label: `budget ${bytes(budget)}`, color: "#b91c1c", dataset: { role: "budget" } }] : [],
  }), signal);
  const timeBox = h("div", { class: "chart-box" });
  responsive(timeBox, (width) => lineChart({
    width,
    label: `Predicted time per step over sizes ${family.low} to ${family.high}`,
    xLabel: "input size",
    yFormat: ms,
    className: "line-chart family-time-chart",
    series: [{ name: "predicted time", points: family.sizes.map((r) => [r.size, r.predicted_ms]), color: PLANNED, dots: true }],
  }), signal);
  const rows = family.sizes.map((row) => h("tr", { dataset: { size: String(row.size) } },
    h("th", { scope: "row", class: "num" }, String(row.size)),
    h("td", {}, row.origin),
    h("td", { class: "num" }, ms(row.predicted_ms)),
    h("td", { class: "num" }, bytes(row.peak_bytes)),
    h("td", { class: "num" }, String(row.hits))));
  const buckets = family.buckets.map((b) => `${b.low}–${b.high}`).join(", ");
  return h("div", {},
    note(`Sizes ${family.low} to ${family.high} on ${family.device}, in buckets ${buckets}; ` +
      "each bucket's largest size planned by the job's strategy, other sizes when first asked " +
      "for (GET /v1/jobs/{id}/plan with the inputs' shapes). Dashed: checkpoint-all's peak " +
      "as the size estimator predicts it."),
    h("div", { class: "memory-grid" }, peakBox, timeBox),
    table("Sizes planned", ["Size", "Plan", "Predicted time", "Peak", "Cache hits"], rows,
      { id: "family-table" }));
}

// --- executions ------------------------------------------------------------------------

function ratio(measured, predicted) {
  if (!measured || !predicted) return "—";
  return `${(measured / predicted).toFixed(2)}×`;
}

/** The gradient check: match or differ, and whether the model's gradients vanish (all
 * zero in exact arithmetic: a match then says only that the run's are zero too). */
function gradientsText(e) {
  if (e.gradients_match === null || e.gradients_match === undefined) return "—";
  const verdict = e.gradients_match ? "match" : "differ";
  return e.gradients_vanish ? `${verdict} (all zero: the gradients vanish)` : verdict;
}

function executionsTable(executions, job, nodes) {
  const devices = job.spec.devices.map((d) => d.name);
  const rows = executions.map((e) => {
    const m = e.measured || {};
    const p = e.predicted || {};
    const node = nodes.get(e.node_id);
    const values = { predictedMs: String(p.total_ms ?? ""), measuredMs: String(m.total_ms ?? "") };
    return h("tr", { dataset: { executionId: e.id, status: e.status, ...values } },
      h("td", {}, node ? node.name : shortId(e.node_id)),
      h("td", {}, statusBadge(e.status)),
      h("td", { class: "num" }, ms(p.total_ms)),
      h("td", { class: "num" }, ms(m.total_ms)),
      h("td", { class: "num" }, ratio(m.total_ms, p.total_ms)),
      devices.map((d) => h("td", { class: "num" },
        `${bytes(p.peak_bytes?.[d])} / ${bytes(m.peak_bytes?.[d])}`)),
      h("td", { class: "num", title: m.energy_note || "" },
        `${mj(p.energy_mj)} / ${m.energy_mj === undefined || m.energy_mj === null ? "not measured" : mj(m.energy_mj)}`),
      h("td", {}, gradientsText(e)),
      h("td", {}, e.error || ""));
  });
  const main = table("Executions: predicted against measured",
    ["Node", "Status", "Predicted time", "Measured time", "Measured / predicted",
      ...devices.map((d) => `Peak ${d} predicted / measured`), "Energy predicted / measured", "Gradients", "Error"],
    rows, { id: "executions-table" });
  return h("div", {}, main, executions.filter((e) => e.sized).map((e) => sizedSteps(e, devices)));
}

/** An execution over input sizes (a plan family's): each step's size against its plan's
 * prediction, and whether the plan came from a cache. */
function sizedSteps(execution, devices) {
  const rows = execution.sized.map((step, index) => h("tr", { dataset: { size: String(step.size) } },
    h("th", { scope: "row", class: "num" }, String(index + 1)),
    h("td", { class: "num" }, String(step.size)),
    h("td", { class: "num" }, ms(step.predicted_ms)),
    h("td", { class: "num" }, ms(step.total_ms)),
    h("td", { class: "num" }, ratio(step.total_ms, step.predicted_ms)),
    devices.map((d) => h("td", { class: "num" },
      `${bytes(step.predicted_peak_bytes?.[d])} / ${bytes(step.peak_bytes?.[d])}`)),
    h("td", {}, step.plan_cached ? "yes" : "no")));
  return h("div", { class: "sized-steps", dataset: { executionId: execution.id } },
    note(`Execution ${shortId(execution.id)}: ${execution.sized.length} steps of changing input size.`),
    table(`Steps of execution ${shortId(execution.id)}`,
      ["Step", "Size", "Predicted time", "Measured time", "Measured / predicted",
        ...devices.map((d) => `Peak ${d} predicted / measured`), "Plan cached"], rows));
}

// --- the page --------------------------------------------------------------------------

export async function jobPage(view, { signal }, id) {
  document.title = `Job ${shortId(id)} · Remat`;
  const title = heading(`Job ${shortId(id)} `);
  const status = h("span", { id: "job-status" });
  title.append(status);
  const message = h("p", { id: "job-message", class: "muted" });
  const cancel = h("button", { type: "button", id: "cancel-job", class: "danger", hidden: true }, "Cancel job");
  const download = h("button", { type: "button", id: "download-plan", hidden: true }, "Download plan JSON");
  const inputs = h("div", {}, note("Loading…"));
  const progressText = h("div", {});
  const progressBox = h("div", { class: "chart-box" });
  const progressNote = h("p", { class: "muted" });
  const schedule = h("div", {}, note("The schedule appears once the job has a plan."));
  const memory = h("div", {}, note("Memory per device appears once the job has a plan."));
  const baselines = h("div", {}, note("Baselines appear once the job has a plan."));
  const sizes = h("div", {}, note("The sizes appear once the job has a plan."));
  const familySection = section("family", "Sizes: predicted peak and time over the range", sizes);
  familySection.hidden = true; // a job over ranges of input sizes only
  const executions = h("div", {}, note("No executions yet."));
  const executeForm = h("form", { id: "execute-form", class: "inline-form", hidden: true });
  view.append(
    h("p", { class: "breadcrumb" }, h("a", { href: "#/jobs" }, "← All jobs")),
    title, message,
    h("div", { class: "actions" }, cancel, download),
    h("div", { class: "job-grid" },
      section("inputs", "Inputs", inputs),
      section("progress", "Solver progress", progressText,
        legend([{ label: "incumbent (best plan found)", color: INCUMBENT },
          { label: "bound (no plan can be faster)", color: BOUND, dashed: true }]),
        progressBox, progressNote)),
    section("schedule", "Schedule: R and S per device", schedule),
    section("memory", "Memory per device", memory),
    familySection,
    section("baselines", "Baselines on the same inputs", baselines),
    section("executions", "Predicted against measured", executeForm, executions));

  let job = null;
  let etag = null;
  let points = [];
  let historyAvailable = true;
  let scheduleData = null;
  let model = null;
  const nodes = new Map(); // by id: names for the costs and the executions
  const loadNodes = async () => {
    for (const node of (await api("/v1/nodes?limit=200", { signal })).items) nodes.set(node.id, node);
  };

  const progressView = responsive(progressBox, (width) => {
    const shown = points;
    progressBox.dataset.points = String(shown.length);
    if (shown.length > 0) return progressChart(shown, width, objectiveValue(job?.spec.objective));
    return note(job && job.status === "queued" ? "Waiting for a worker." : "No progress reported yet.");
  }, signal);
  const drawProgress = () => progressView.update();

  async function loadHistory() {
    try {
      points = (await api(`/v1/jobs/${id}/progress`, { signal })).points;
      progressNote.textContent = "";
    } catch (error) {
      if (!(error instanceof ApiError && error.status === 404)) throw error;
      historyAvailable = false;
      progressNote.textContent = "The progress history is not available from this server; " +
        "the chart shows what this page saw while it was open.";
    }
  }

  let announced = null;
  function render() {
    if (announced !== null && announced !== job.status) announce(STATUS_NEWS[job.status] || "");
    announced = job.status;
    replace(status, statusBadge(job.status, job.cancel_requested && !FINISHED.has(job.status) ? " (cancelling)" : ""));
    message.textContent = [job.message, job.error].filter(Boolean).join(" — ");
    message.className = job.error ? "error-text" : "muted";
    cancel.hidden = FINISHED.has(job.status);
    cancel.disabled = job.cancel_requested;
    cancel.textContent = job.cancel_requested ? "Cancelling…" : "Cancel job";
    download.hidden = job.status !== "succeeded";
    familySection.hidden = !(job.spec.ranges && Object.keys(job.spec.ranges).length);
    replace(inputs, inputsFacts(job, model, nodes));
    replace(progressText, progressFacts(job));
    // The history so far, then each point polled while the page is open.
    const last = points.length ? points[points.length - 1].elapsed_s : -1;
    if (job.progress.elapsed_s !== null && job.progress.elapsed_s > last) points.push({ ...job.progress });
    drawProgress();
  }

  async function loadResults() {
    if (historyAvailable) await loadHistory();
    drawProgress();
    if (job.status !== "succeeded") {
      const why = `This job ${job.status} without a plan.`;
      for (const box of [schedule, memory, baselines]) replace(box, note(why));
      return;
    }
    if (!familySection.hidden) {
      replace(sizes, familyView(await api(`/v1/jobs/${id}/family`, { signal }), signal));
    }
    scheduleData = await api(`/v1/jobs/${id}/schedule`, { signal });
    replace(schedule, scheduleView(scheduleData, signal));
    replace(memory, memoryView(scheduleData, signal));
    try {
      replace(baselines, baselinesView(await api(`/v1/jobs/${id}/baselines`, { signal }), job, scheduleData));
    } catch (error) {
      if (!(error instanceof ApiError && error.status === 404)) throw error;
      replace(baselines, note(`Baselines are not available for this job: ${error.message}`));
    }
    await setUpExecutions();
  }

  // executions: a form to ask a node's agent to run the plan, and what came back
  let stopExecutions = () => {};
  async function refreshExecutions() {
    const list = await api(`/v1/jobs/${id}/executions`, { signal });
    replace(executions, list.length ? executionsTable(list, job, nodes) : note("No executions yet."));
    return list.some((e) => e.status === "queued" || e.status === "leased");
  }
  function watchExecutions() {
    stopExecutions();
    stopExecutions = every(EXECUTIONS_POLL_MS, refreshExecutions,
      { signal, doing: "The executions could not be loaded", source: "executions" });
  }
  async function setUpExecutions() {
    await loadNodes(); // nodes that registered while the job ran
    const select = h("select", { id: "execute-node", name: "node_id", required: true },
      [...nodes.values()].map((n) => h("option", { value: n.id }, `${n.name} (${n.status})`)));
    replace(executeForm,
      h("label", { for: "execute-node" }, "Run this plan on node"), select,
      h("button", { type: "submit" }, "Execute"));
    executeForm.hidden = nodes.size === 0;
    executeForm.onsubmit = async (event) => {
      event.preventDefault();
      try {
        await api(`/v1/jobs/${id}/executions`, { method: "POST", body: { node_id: select.value }, signal });
        clearError("execute");
        announce(`Execution queued on ${nodes.get(select.value)?.name ?? "the node"}.`);
        watchExecutions();
      } catch (error) {
        report(error, "The execution could not be queued", "execute");
      }
    };
    if (nodes.size === 0) replace(executions, note("No nodes have registered: start a remat-agent to measure this plan."));
    else watchExecutions();
  }

  cancel.addEventListener("click", async () => {
    cancel.disabled = true;
    try {
      job = await api(`/v1/jobs/${id}/cancel`, { method: "POST", signal });
      etag = null;
      clearError("cancel");
      announce(job.status === "cancelled" ? "The job is cancelled." : "Cancelling: the solver stops within seconds.");
      render();
    } catch (error) {
      cancel.disabled = false;
      report(error, "The job could not be cancelled", "cancel");
    }
  });
  download.addEventListener("click", async () => {
    try {
      await downloadJson(`/v1/jobs/${id}/plan`, `plan-${id}.json`);
    } catch (error) {
      report(error, "The plan could not be downloaded", "download");
    }
  });

  const first = await request(`/v1/jobs/${id}`, { signal });
  job = first.data;
  etag = first.etag;
  try {
    model = await api(`/v1/models/${job.model_id}`, { signal });
  } catch (error) {
    if (!(error instanceof ApiError && error.status === 404)) throw error; // deleted: show its id
  }
  await loadNodes();
  await loadHistory();
  render();
  if (FINISHED.has(job.status)) {
    await loadResults();
    return;
  }
  every(POLL_MS, async () => {
    const answer = await request(`/v1/jobs/${id}`, { signal, etag });
    if (answer.status !== 304) {
      job = answer.data;
      etag = answer.etag;
      render();
    }
    if (!FINISHED.has(job.status)) return true;
    await loadResults();
    return false;
  }, { signal, doing: "The job could not be refreshed", source: "job" });
}
