// Nodes: the agents that registered, their devices, online status from heartbeats, and
// the cost profiles they measured. Polled, so a node going offline shows within seconds.

import { api } from "./api.js";
import { h, replace, table } from "./dom.js";
import { ago, shortId } from "./format.js";
import { every } from "./poll.js";
import { heading, statusBadge, timeEl } from "./widgets.js";

const POLL_MS = 5000;

function deviceText(device) {
  const options = Object.entries(device.options || {}).map(([k, v]) => `${k}=${v}`).join(", ");
  return `${device.name} (${device.kind}${options ? `, ${options}` : ""})`;
}

/** What a profile measured (its spec is the agent's profiling task). */
function profileText(profile) {
  const spec = profile.spec || {};
  const model = spec.model || {};
  const shape = model.inputs
    ? Object.entries(model.inputs).map(([name, dims]) => `${name}=${dims.join("×")}`).join(" ")
    : model.batch ? `batch ${model.batch}` : "";
  const devices = Array.isArray(spec.devices) ? `on ${spec.devices.join(", ")}` : "";
  return [model.mode, shape, devices].filter(Boolean).join(", ");
}

function profilesCell(profiles, models) {
  if (profiles.length === 0) return h("span", { class: "muted" }, "none");
  return h("ul", { class: "plain-list" }, profiles.map((p) => {
    const model = models.get(p.model_id);
    return h("li", { dataset: { profileId: p.id } },
      h("a", { href: `#/models/${p.model_id}` }, model ? model.filename : shortId(p.model_id)),
      ` ${profileText(p)} · `, timeEl(p.created_at));
  }));
}

function nodeRow(node, profiles, models) {
  return h("tr", { dataset: { nodeId: node.id, status: node.status } },
    h("th", { scope: "row" }, node.name),
    h("td", {}, statusBadge(node.status)),
    h("td", {}, h("ul", { class: "plain-list" }, node.devices.map((d) => h("li", {}, deviceText(d))))),
    h("td", {}, node.last_seen_at
      ? [timeEl(node.last_seen_at), h("br"), h("span", { class: "muted ago", dataset: { since: node.last_seen_at } }, ago(node.last_seen_at))]
      : "never"),
    h("td", {}, node.version || "—"),
    h("td", {}, profilesCell(profiles, models)));
}

export async function nodesPage(view, { signal }) {
  document.title = "Nodes · Remat";
  const body = h("div", {}, h("p", { class: "muted" }, "Loading…"));
  view.append(heading("Nodes"),
    h("p", { class: "muted" },
      "Compute nodes run remat-agent: they profile operators on their devices and execute plans. ",
      "A node is online while its heartbeats arrive."),
    body);
  const models = new Map();
  let shown = "";
  every(POLL_MS, async () => {
    const nodes = (await api("/v1/nodes?limit=200", { signal })).items;
    const profiles = (await api("/v1/profiles?limit=200", { signal })).items;
    if (profiles.some((p) => !models.has(p.model_id))) {
      for (const model of (await api("/v1/models?limit=200", { signal })).items) models.set(model.id, model);
    }
    const fingerprint = JSON.stringify([nodes, profiles, [...models.keys()]]);
    if (fingerprint === shown) {
      // Nothing changed but the clock: "12 s ago" moves on in place (focus and scroll stay).
      for (const span of body.querySelectorAll(".ago")) span.textContent = ago(span.dataset.since);
      return;
    }
    shown = fingerprint;
    if (nodes.length === 0) {
      replace(body, h("p", { class: "empty" },
        "No nodes yet. Start an agent with ",
        h("code", {}, "remat-agent --server URL --enroll-token TOKEN"),
        " (remat serve prints its token and starts one for this machine)."));
      return;
    }
    const focused = body.contains(document.activeElement) ? document.activeElement.getAttribute("href") : null;
    const byNode = (id) => profiles.filter((p) => p.node_id === id);
    replace(body, table("Nodes", ["Node", "Status", "Devices", "Last heartbeat", "Version", "Profiles"],
      nodes.map((node) => nodeRow(node, byNode(node.id), models)), { id: "nodes-table" }));
    if (focused) body.querySelector(`a[href="${CSS.escape(focused)}"]`)?.focus();
  }, { signal, doing: "The nodes could not be loaded", source: "nodes" });
}
