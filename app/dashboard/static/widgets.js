// Pieces several pages show: status badges, the gap-closing progress bar, times.

import { h } from "./dom.js";
import { dateTime, parseTime, percent, seconds, shortId } from "./format.js";

export const JOB_STATUSES = ["queued", "running", "succeeded", "failed", "cancelled"];
export const FINISHED = new Set(["succeeded", "failed", "cancelled"]);

export function statusBadge(status, extra = "") {
  return h("span", { class: `badge badge-${status}`, dataset: { status } }, status, extra);
}

/** A <time> with the machine-readable instant and local text. */
export function timeEl(iso) {
  const date = parseTime(iso);
  return date ? h("time", { datetime: date.toISOString() }, dateTime(iso)) : "—";
}

/**
 * How far the solver has closed the gap between its incumbent and its bound, as a bar:
 * full once proven optimal (or for heuristics, which have no gap, once done).
 */
export function gapProgress(job) {
  const { gap } = job.progress;
  let value = null;
  let note;
  if (job.status === "queued") [value, note] = [0, "queued"];
  else if (gap !== null && gap !== undefined) [value, note] = [Math.min(1, Math.max(0, 1 - gap)), `gap ${percent(gap)}`];
  else if (job.status === "succeeded") [value, note] = [1, "done"];
  else if (job.status === "running") note = job.message || "solving";
  else [value, note] = [0, "no progress"];
  const bar = h("progress", {
    max: "1",
    value: value === null ? null : String(value),
    "aria-label": `Gap closed for job ${shortId(job.id)}`,
  });
  return h("div", { class: "gap-progress", dataset: { gap: gap ?? "" } }, bar, h("span", { class: "muted" }, note));
}

/** Seconds from start to finish (or to now while running). */
export function jobSeconds(job, now = Date.now()) {
  const start = parseTime(job.started_at);
  if (!start) return null;
  const end = parseTime(job.finished_at);
  return ((end ? end.getTime() : now) - start.getTime()) / 1000;
}

export function jobDuration(job) {
  return seconds(jobSeconds(job));
}

export function deviceNames(spec) {
  return spec.devices.map((d) => d.name).join(", ");
}

/** A page heading that can take focus after a navigation. */
export function heading(text, ...rest) {
  return h("h1", { tabindex: "-1" }, text, ...rest);
}
