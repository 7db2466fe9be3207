// Models: the list, uploading an ONNX file or a .zip of one with its external data (drag
// and drop or the file picker, with the upload's progress), one model's graph summary,
// and the form that submits a job for it.

import { api, uploadModel } from "./api.js";
import { facts, h, replace, table } from "./dom.js";
import { bytes, shortId } from "./format.js";
import { announce, clearError, report } from "./notify.js";
import { heading, timeEl } from "./widgets.js";

// The strategies and solver backends come from the server (GET /v1/strategies), so the
// form offers exactly what this server runs; a name it does not know would be refused with
// a 422 that names the known ones, which the page shows.

const KIND_LABELS = {
  auto: "cheapest baseline that fits",
  baseline: "baseline",
  heuristic: "heuristic, no solver",
  exact: "optimal",
};

/** A strategy's option label: its name, its kind, and whether it places over devices. */
function strategyLabel(strategy) {
  const kind = KIND_LABELS[strategy.kind] || strategy.kind;
  return `${strategy.name} (${kind}${strategy.places_over_devices ? ", several devices" : ""})`;
}

/** A backend's option label: unavailable ones say why (they stay listed, disabled). */
function backendLabel(backend) {
  if (!backend.available) return `${backend.name} (not available: ${backend.detail})`;
  return backend.detail ? `${backend.name} (${backend.detail})` : backend.name;
}

// --- the list and the upload ---------------------------------------------------------

function modelRow(model) {
  return h("tr", { dataset: { modelId: model.id } },
    h("td", {}, h("a", { href: `#/models/${model.id}` }, model.filename)),
    h("td", { class: "num", dataset: { nodes: String(model.summary.nodes) } }, String(model.summary.nodes)),
    h("td", { class: "num" }, String(Object.keys(model.summary.operators).length)),
    h("td", { class: "num" }, bytes(model.summary.param_bytes)),
    h("td", { class: "num" }, bytes(model.size_bytes)),
    h("td", {}, timeEl(model.created_at)),
    h("td", {}, h("a", { href: `#/models/${model.id}?plan`, "aria-label": `Plan a job for ${model.filename}` }, "Plan a job")));
}

function uploadPanel(onUploaded) {
  // A .zip holds a model with its external data files; the server embeds them.
  const input = h("input", { id: "model-file", name: "file", type: "file", accept: ".onnx,.zip" });
  const bar = h("progress", { id: "upload-progress", max: "100", value: "0", "aria-labelledby": "upload-label" });
  const percentText = h("span", { id: "upload-percent" }, "0%");
  const label = h("span", { id: "upload-label" }, "Upload");
  const state = h("div", { class: "upload-state", hidden: true }, label, bar, percentText);
  const result = h("p", { id: "upload-result", class: "muted" });
  const zone = h("div", { class: "dropzone", id: "dropzone" },
    h("p", {}, h("strong", {}, "Drop an ONNX file here"),
      " (or a .zip of one with its external data files) or choose one:"),
    h("label", { for: "model-file" }, "ONNX model file"), input);

  async function send(file) {
    if (!file) return;
    state.hidden = false;
    label.textContent = `Uploading ${file.name}`;
    bar.value = 0;
    percentText.textContent = "0%";
    result.textContent = "";
    try {
      const { model, created } = await uploadModel(file, (fraction) => {
        bar.value = Math.round(fraction * 100);
        percentText.textContent = `${Math.round(fraction * 100)}%`;
      });
      clearError("upload");
      label.textContent = `Uploaded ${file.name}`;
      replace(result,
        `${created ? "Uploaded" : "Already uploaded"}: ${model.filename}, ${model.summary.nodes} nodes. `,
        h("a", { href: `#/models/${model.id}?plan` }, "Plan a job for it"), ".");
      announce(`${model.filename} uploaded: ${model.summary.nodes} nodes.`);
      await onUploaded(model);
    } catch (error) {
      label.textContent = `Upload of ${file.name} failed`;
      report(error, `${file.name} could not be uploaded`, "upload");
    } finally {
      input.value = ""; // choosing the same file again uploads again
    }
  }

  input.addEventListener("change", () => send(input.files[0]));
  zone.addEventListener("dragover", (event) => {
    event.preventDefault(); // allow dropping
    zone.classList.add("dragging");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("dragging"));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    zone.classList.remove("dragging");
    send(event.dataTransfer.files[0]);
  });
  return h("section", { class: "card", "aria-labelledby": "upload-title" },
    h("h2", { id: "upload-title" }, "Upload a model"), zone, state, result);
}

export async function modelsPage(view, { signal }) {
  document.title = "Models · Remat";
  const body = h("div", {}, h("p", { class: "muted" }, "Loading…"));
  async function refresh() {
    const page = await api("/v1/models?limit=200", { signal });
    if (page.items.length === 0) {
      replace(body, h("p", { class: "empty" }, "No models yet: upload an ONNX file above."));
      return;
    }
    replace(body, table("Models, newest first",
      ["Model", "Nodes", "Operator types", "Parameters", "File size", "Uploaded", ""],
      page.items.map(modelRow), { id: "models-table" }));
  }
  view.append(heading("Models"), uploadPanel(refresh),
    h("section", { class: "card", "aria-labelledby": "models-title" },
      h("h2", { id: "models-title" }, "Uploaded models"), body));
  try {
    await refresh();
  } catch (error) {
    replace(body, h("p", { class: "muted" }, "The models could not be loaded."));
    report(error, "The models could not be loaded");
  }
}

// --- one model ------------------------------------------------------------------------

function summaryView(model) {
  const s = model.summary;
  const inputs = Object.entries(s.inputs).map(([name, dims]) => `${name}: ${dims.join(" × ")}`).join("; ");
  const operators = Object.entries(s.operators).sort((a, b) => b[1] - a[1]);
  return h("div", {},
    facts([
      ["Nodes", h("span", { id: "model-nodes" }, String(s.nodes))],
      ["Inputs", inputs || "—"],
      ["Parameters", bytes(s.param_bytes)],
      ["Input bytes", bytes(s.input_bytes)],
      ["Activations", `${bytes(s.activation_bytes)} (forward outputs, at the model's shapes)`],
      ["File", `${bytes(model.size_bytes)}, sha256 ${model.sha256.slice(0, 16)}…`],
      ["Uploaded", timeEl(model.created_at)],
    ]),
    h("h3", {}, "Operators"),
    table("Operators by type", ["Operator", "Count"],
      operators.map(([op, n]) => h("tr", {}, h("td", {}, op), h("td", { class: "num" }, String(n)))),
      { id: "operators-table" }));
}

/** The training (or inference) graph at a batch: node counts and the largest outputs. */
function graphView(graph) {
  const kinds = {};
  for (const node of graph.nodes) kinds[node.kind] = (kinds[node.kind] || 0) + 1;
  const total = graph.nodes.reduce((sum, n) => sum + (n.output_bytes || 0), 0);
  const largest = [...graph.nodes].sort((a, b) => b.output_bytes - a.output_bytes).slice(0, 5);
  return h("div", { id: "graph-summary", dataset: { nodes: String(graph.nodes.length) } },
    facts([
      ["Nodes", `${graph.nodes.length} (${Object.entries(kinds).map(([k, n]) => `${n} ${k}`).join(", ")})`],
      ["All outputs", bytes(total)],
      ["Parameters", bytes(graph.param_bytes)],
    ]),
    table("Largest outputs", ["Node", "Operator", "Kind", "Output"],
      largest.map((n) => h("tr", {}, h("td", {}, n.name), h("td", {}, n.op), h("td", {}, n.kind),
        h("td", { class: "num" }, bytes(n.output_bytes))))));
}

function needsBatch(model) {
  return Object.values(model.summary.inputs).some((dims) => dims.some((d) => typeof d === "string"));
}

function field(id, labelText, control, help) {
  return h("div", { class: "field" },
    h("label", { for: id }, labelText), control, help ? h("p", { class: "help", id: `${id}-help` }, help) : null);
}

function select(id, options, value, attrs = {}) {
  const element = h("select", { id, name: id, ...attrs },
    options.map((o) => (Array.isArray(o) ? h("option", { value: o[0] }, o[1]) : h("option", { value: o }, o))));
  element.value = value;
  return element;
}

let deviceCounter = 0;

function deviceRow(name, kind, budget, onRemove) {
  const n = deviceCounter++;
  const row = h("div", { class: "device-row", dataset: { row: String(n) } },
    field(`device-name-${n}`, "Device name",
      h("input", { id: `device-name-${n}`, class: "device-name", value: name, required: true, autocomplete: "off", spellcheck: "false" })),
    field(`device-kind-${n}`, "Kind", select(`device-kind-${n}`, ["cpu", "cuda"], kind, { class: "device-kind" })),
    field(`device-threads-${n}`, "Threads",
      h("input", { id: `device-threads-${n}`, class: "device-threads", type: "number", min: "1", step: "1", placeholder: "all" })),
    field(`device-budget-${n}`, "Memory budget",
      h("input", { id: `device-budget-${n}`, class: "device-budget", value: budget, placeholder: "none", autocomplete: "off", "aria-describedby": "budget-help" })),
    h("button", { type: "button", class: "link-button remove-device", "aria-label": `Remove device ${name}` }, "Remove"));
  row.querySelector(".remove-device").addEventListener("click", () => onRemove(row));
  return row;
}

/** The job the form describes, as POST /v1/jobs takes it. */
function jobBody(form, model) {
  const devices = [];
  const budgets = {};
  for (const row of form.querySelectorAll(".device-row")) {
    const name = row.querySelector(".device-name").value.trim();
    const kind = row.querySelector(".device-kind").value;
    const threads = row.querySelector(".device-threads").value.trim();
    const budget = row.querySelector(".device-budget").value.trim();
    devices.push({ name, kind, options: threads ? { threads } : {} });
    if (budget) budgets[name] = budget;
  }
  const value = (id) => form.querySelector(`#${id}`).value.trim();
  const costs = value("job-costs");
  const body = {
    model_id: model.id,
    mode: value("job-mode"),
    devices,
    budgets,
    strategy: value("job-strategy"),
    solver: {
      backend: value("job-backend"),
      time_limit_s: Number(value("job-time-limit")),
      gap: Number(value("job-gap")) / 100,
      threads: Number(value("job-threads")),
      reuse_plans: value("job-reuse") === "reuse",
    },
    costs: costs === "analytical" ? "analytical" : { node_id: costs },
  };
  body.fuse_attention = value("job-attention") === "fused";
  if (value("job-batch")) body.batch = Number(value("job-batch"));
  const objective = { kind: value("job-objective") };
  if (objective.kind === "weighted") objective.alpha = Number(value("job-alpha"));
  const caps = value("job-power-caps");
  if (caps) {
    objective.power_caps_w = Object.fromEntries(caps.split(",").map((item) => {
      const [name, watts] = item.split("=").map((part) => part.trim());
      return [name, Number(watts)];
    }));
  }
  if (objective.kind !== "time" || caps) body.objective = objective;
  return body;
}

/** What the plan minimises and the power it may draw (XEngine eq. 17-19). */
function objectiveFields() {
  const kind = select("job-objective", [
    ["time", "time (default)"], ["energy", "energy"], ["weighted", "time + alpha × energy"],
  ], "time");
  const alpha = h("input", { id: "job-alpha", type: "number", min: "0", step: "any", value: "0.01", disabled: true });
  kind.addEventListener("change", () => { alpha.disabled = kind.value !== "weighted"; });
  return h("fieldset", {},
    h("legend", {}, "Objective"),
    h("div", { class: "field-row" },
      field("job-objective", "Minimise", kind),
      field("job-alpha", "Alpha (ms per mJ)", alpha),
      field("job-power-caps", "Power caps (W)", h("input", {
        id: "job-power-caps", placeholder: "none, or gpu0=150,cpu0=60", autocomplete: "off", spellcheck: "false",
      }))),
    h("p", { class: "help" },
      "Energy is measured by the node's profile where its devices have counters, else a power model's. ",
      "A power cap keeps every operator off a device where it would draw more."));
}

function jobForm(model, nodes, catalog) {
  const strategySelect = select("job-strategy",
    catalog.strategies.map((s) => [s.name, strategyLabel(s)]), catalog.default_strategy,
    { "aria-describedby": "job-strategy-help" });
  const describe = () => {
    const chosen = catalog.strategies.find((s) => s.name === strategySelect.value);
    if (!chosen) return "";
    const text = chosen.description.replace(/\.?$/, ".");
    return `${chosen.name}: ${text.charAt(0).toUpperCase()}${text.slice(1)}`;
  };
  const strategyHelp = h("p", { class: "help", id: "job-strategy-help", "aria-live": "polite" }, describe());
  strategySelect.addEventListener("change", () => { strategyHelp.textContent = describe(); });
  const backendSelect = select("job-backend",
    catalog.backends.map((b) => [b.name, backendLabel(b)]), catalog.default_backend);
  for (const option of backendSelect.options) {
    const backend = catalog.backends.find((b) => b.name === option.value);
    option.disabled = !backend.available;
  }
  if (backendSelect.selectedOptions[0]?.disabled) {
    const usable = catalog.backends.find((b) => b.available);
    if (usable) backendSelect.value = usable.name;
  }
  const list = h("div", { class: "device-list" });
  const remove = (row) => {
    if (list.children.length > 1) row.remove();
    else announce("A job needs at least one device.");
  };
  const add = (name, budget) => list.append(deviceRow(name, "cpu", budget, remove));
  add("cpu0", "50%");
  const form = h("form", { id: "job-form", class: "job-form", novalidate: true },
    h("fieldset", {},
      h("legend", {}, "Devices and memory budgets"),
      list,
      h("button", { type: "button", id: "add-device", onclick: () => add(`cpu${list.children.length}`, "50%") }, "Add a device"),
      h("p", { class: "help", id: "budget-help" },
        "A budget is bytes (218103808), a size (208MiB, 1.5GiB) or a percentage (65%), where 100% ",
        "holds every activation and any percentage leaves room for parameters and inputs. Empty: no limit.")),
    h("fieldset", {},
      h("legend", {}, "Training or inference"),
      h("div", { class: "field-row" },
        field("job-mode", "Mode", select("job-mode", ["training", "inference"], "training")),
        field("job-batch", "Batch size", h("input", {
          id: "job-batch", type: "number", min: "1", step: "1", value: needsBatch(model) ? "4" : "",
          placeholder: "the model's", required: needsBatch(model),
        })),
        field("job-attention", "Attention", select("job-attention", [
          ["fused", "one node (as scaled_dot_product_attention)"],
          ["unfused", "node by node"],
        ], "fused")))),
    h("fieldset", {},
      h("legend", {}, "Strategy and solver"),
      h("div", { class: "field-row" },
        field("job-strategy", "Strategy", strategySelect),
        field("job-backend", "Solver", backendSelect),
        field("job-time-limit", "Time limit (s)", h("input", { id: "job-time-limit", type: "number", min: "1", step: "any", value: "30" })),
        field("job-gap", "Stop at gap (%)", h("input", { id: "job-gap", type: "number", min: "0", max: "99", step: "any", value: "0.01" })),
        field("job-threads", "Solver threads", h("input", { id: "job-threads", type: "number", min: "1", step: "1", value: "1" })),
        field("job-reuse", "Earlier plans", select("job-reuse", [
          ["reuse", "start from this model's earlier plans"],
          ["fresh", "search afresh"],
        ], "reuse")),
        field("job-costs", "Costs", select("job-costs", [
          ["analytical", "analytical (FLOPs / bandwidth)"],
          ...nodes.map((n) => [n.id, `measured on node ${n.name} (${n.status})`]),
        ], "analytical"))),
      strategyHelp),
    objectiveFields(),
    h("button", { type: "submit", class: "primary", id: "submit-job" }, "Submit job"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const button = form.querySelector("#submit-job");
    button.disabled = true;
    try {
      const job = await api("/v1/jobs", { method: "POST", body: jobBody(form, model) });
      clearError("submit");
      announce(`Job ${shortId(job.id)} submitted.`);
      location.hash = `#/jobs/${job.id}`;
    } catch (error) {
      report(error, "The job was not submitted", "submit");
    } finally {
      button.disabled = false;
    }
  });
  return form;
}

export async function modelPage(view, { signal, query }, id) {
  const model = await api(`/v1/models/${id}`, { signal });
  const [nodes, catalog] = await Promise.all([
    api("/v1/nodes?limit=200", { signal }).then((page) => page.items), // costs measured there
    api("/v1/strategies", { signal }), // what the job form offers
  ]);
  document.title = `${model.filename} · Models · Remat`;
  const graphBox = h("div", {}, h("p", { class: "muted" }, "Loading the graph…"));
  const batch = h("input", { id: "graph-batch", type: "number", min: "1", step: "1", value: needsBatch(model) ? "4" : "" });
  const mode = select("graph-mode", ["training", "inference"], "training");
  const graphForm = h("form", { class: "inline-form", id: "graph-form" },
    field("graph-mode", "Mode", mode), field("graph-batch", "Batch size", batch),
    h("button", { type: "submit" }, "Show graph"));
  async function loadGraph() {
    const params = new URLSearchParams({ mode: mode.value });
    if (batch.value) params.set("batch", batch.value);
    try {
      replace(graphBox, graphView(await api(`/v1/models/${id}/graph?${params}`, { signal })));
      clearError("graph");
    } catch (error) {
      replace(graphBox, h("p", { class: "muted" }, "No graph to show."));
      report(error, "The graph could not be built", "graph");
    }
  }
  graphForm.addEventListener("submit", (event) => {
    event.preventDefault();
    loadGraph();
  });
  view.append(
    h("p", { class: "breadcrumb" }, h("a", { href: "#/models" }, "← All models")),
    heading(model.filename),
    h("div", { class: "job-grid" },
      h("section", { class: "card", "aria-labelledby": "summary-title" },
        h("h2", { id: "summary-title" }, "Summary"), summaryView(model)),
      h("section", { class: "card", "aria-labelledby": "graph-title" },
        h("h2", { id: "graph-title" }, "Graph"), graphForm, graphBox)),
    h("section", { class: "card", id: "plan", "aria-labelledby": "plan-title" },
      h("h2", { id: "plan-title", tabindex: "-1" }, "Plan a job"), jobForm(model, nodes, catalog)));
  if (query.has("plan")) view.querySelector("#plan-title").dataset.autofocus = "";
  await loadGraph();
}
