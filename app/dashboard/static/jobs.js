// The jobs page: every job with its status and gap-closing progress, filtered by status,
// refreshed by polling GET /v1/jobs.

import { api, request } from "./api.js";
import { h, replace, table } from "./dom.js";
import { shortId } from "./format.js";
import { every } from "./poll.js";
import {
  deviceNames, gapProgress, heading, JOB_STATUSES, jobDuration, statusBadge, timeEl,
} from "./widgets.js";

const POLL_MS = 2000;
const PAGE = 50;

function jobRow(job, models) {
  const model = models.get(job.model_id);
  return h("tr", { dataset: { jobId: job.id, status: job.status } },
    h("td", {}, h("a", { href: `#/jobs/${job.id}`, class: "mono" }, shortId(job.id))),
    h("td", {}, statusBadge(job.status, job.cancel_requested && job.status === "running" ? " (cancelling)" : "")),
    h("td", {}, gapProgress(job)),
    h("td", {}, job.spec.strategy),
    h("td", {}, h("a", { href: `#/models/${job.model_id}` }, model ? model.filename : shortId(job.model_id))),
    h("td", {}, deviceNames(job.spec)),
    h("td", {}, timeEl(job.created_at)),
    h("td", { class: "num" }, jobDuration(job)));
}

/** Re-renders rows, keeping keyboard focus on the same link if it was in the table. */
function renderRows(tbody, jobs, models) {
  const focused = tbody.contains(document.activeElement) ? document.activeElement.getAttribute("href") : null;
  replace(tbody, jobs.map((job) => jobRow(job, models)));
  if (focused) tbody.querySelector(`a[href="${CSS.escape(focused)}"]`)?.focus();
}

export async function jobsPage(view, { signal, query }) {
  document.title = "Jobs · Remat";
  let status = JOB_STATUSES.includes(query.get("status")) ? query.get("status") : "";
  let limit = PAGE;
  const filter = h("select", { id: "status-filter", name: "status" },
    h("option", { value: "" }, "All"),
    JOB_STATUSES.map((name) => h("option", { value: name }, name)));
  filter.value = status;
  const summary = h("p", { class: "muted", id: "jobs-summary", "aria-live": "polite" });
  const more = h("button", { type: "button", hidden: true }, "Show more jobs");
  const list = table("Jobs, newest first",
    ["Job", "Status", "Progress", "Strategy", "Model", "Devices", "Created", "Duration"], [],
    { id: "jobs-table" });
  const tbody = list.querySelector("tbody");
  const empty = h("p", { class: "empty", hidden: true },
    "No jobs here yet. Upload a model and plan a job on the ", h("a", { href: "#/models" }, "Models"), " page.");
  view.append(
    heading("Jobs"),
    h("div", { class: "toolbar" },
      h("label", { for: "status-filter" }, "Status"), filter, summary),
    list, empty, more);

  const models = new Map();
  let shown = "";
  let etag = null; // unchanged polls cost a 304 and no body
  let data = null;
  async function refresh() {
    const params = new URLSearchParams({ limit: String(limit) });
    if (status) params.set("status", status);
    const answer = await request(`/v1/jobs?${params}`, { signal, etag });
    if (answer.status !== 304) ({ data, etag } = answer);
    if (data.items.some((job) => !models.has(job.model_id))) {
      const page = await api("/v1/models?limit=200", { signal });
      for (const model of page.items) models.set(model.id, model);
    }
    // Durations of running jobs move on their own: compare everything but them.
    const fingerprint = JSON.stringify(data.items) + (data.items.some((j) => j.status === "running") ? Date.now() : "");
    if (fingerprint !== shown) {
      shown = fingerprint;
      renderRows(tbody, data.items, models);
    }
    empty.hidden = data.items.length > 0;
    list.hidden = data.items.length === 0;
    more.hidden = !data.next_cursor || limit >= 200;
    const count = `${data.items.length}${data.next_cursor ? "+" : ""} ${status || ""} job${data.items.length === 1 ? "" : "s"}`;
    if (summary.textContent !== count) summary.textContent = count;
  }

  let stop = every(POLL_MS, refresh, { signal, doing: "The jobs could not be loaded", source: "jobs" });
  const restart = () => {
    stop();
    shown = "";
    etag = null;
    stop = every(POLL_MS, refresh, { signal, doing: "The jobs could not be loaded", source: "jobs" });
  };
  filter.addEventListener("change", () => {
    status = filter.value;
    // The filter lives in the address (shareable) without re-rendering the page.
    history.replaceState(null, "", status ? `#/jobs?status=${status}` : "#/jobs");
    restart();
  });
  more.addEventListener("click", () => {
    limit = Math.min(limit * 2, 200);
    restart();
  });
}
