// The dashboard's entry point: a hash router over the pages, the API-key field, and the
// lifetime of each page (leaving a page aborts its requests and stops its polling).

import { apiKey, setApiKey } from "./api.js";
import { h } from "./dom.js";
import { jobPage } from "./job.js";
import { jobsPage } from "./jobs.js";
import { modelPage, modelsPage } from "./models.js";
import { nodesPage } from "./nodes.js";
import { announce, clearError, report } from "./notify.js";

const ROUTES = [
  { pattern: /^\/jobs$/, page: jobsPage, nav: "jobs" },
  { pattern: /^\/jobs\/([\w-]+)$/, page: jobPage, nav: "jobs" },
  { pattern: /^\/models$/, page: modelsPage, nav: "models" },
  { pattern: /^\/models\/([\w-]+)$/, page: modelPage, nav: "models" },
  { pattern: /^\/nodes$/, page: nodesPage, nav: "nodes" },
];

let leave = null; // aborts the current page
let firstRender = true;

function parse(hash) {
  const raw = decodeURIComponent(hash.replace(/^#/, ""));
  const [path, query = ""] = raw.split("?");
  return { path: path.replace(/\/+$/, "") || "/", query: new URLSearchParams(query) };
}

function markNav(section) {
  for (const link of document.querySelectorAll("[data-nav]")) {
    if (link.dataset.nav === section) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
}

function notFound(view, path) {
  document.title = "Not found · Remat";
  view.append(
    h("h1", { tabindex: "-1" }, "Page not found"),
    h("p", {}, `There is no page at “${path}”. `, h("a", { href: "#/jobs" }, "Go to the jobs"), "."));
}

async function render() {
  const { path, query } = parse(location.hash);
  if (path === "/") {
    location.replace("#/jobs"); // fires hashchange, which renders the jobs
    return;
  }
  if (leave) leave.abort();
  const controller = new AbortController();
  leave = controller;
  clearError();
  announce("");
  const view = document.getElementById("view");
  view.replaceChildren();
  const route = ROUTES.find((r) => r.pattern.test(path));
  markNav(route ? route.nav : null);
  const moveFocus = !firstRender;
  firstRender = false;
  if (!route) {
    notFound(view, path);
  } else {
    const params = path.match(route.pattern).slice(1);
    try {
      await route.page(view, { signal: controller.signal, query }, ...params);
    } catch (error) {
      report(error, "This page could not be shown");
    }
  }
  // After a navigation, start reading (and tabbing) at the new page's heading, or where
  // the page asks (a link to a model's job form).
  const heading = view.querySelector("[data-autofocus]") || view.querySelector("h1");
  const asked = heading && heading.dataset.autofocus !== undefined;
  if (heading && (moveFocus || asked) && !controller.signal.aborted) heading.focus();
}

function setUpApiKey() {
  const form = document.getElementById("api-key-form");
  const input = document.getElementById("api-key");
  input.value = apiKey();
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey(input.value.trim());
    announce(input.value.trim() ? "API key saved in this browser." : "API key removed.");
    render(); // load the page again with the new key
  });
}

function setUpSkipLink() {
  // "#view" would be read as a route: move focus ourselves.
  document.querySelector(".skip-link").addEventListener("click", (event) => {
    event.preventDefault();
    document.getElementById("view").focus();
  });
}

setUpApiKey();
setUpSkipLink();
window.addEventListener("hashchange", render);
render();
