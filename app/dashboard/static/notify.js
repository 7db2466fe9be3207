// The page's two message regions: errors in the alert region (role="alert", read out at
// once), confirmations in the status region (role="status", read out politely).

import { h, replace } from "./dom.js";
import { isAbort } from "./api.js";

let shownSource = null;

/**
 * Shows an error in plain words. ``source`` names who showed it (a poller, a form) so that
 * the same source's next success can clear it without hiding someone else's error.
 */
export function showError(message, source = "page") {
  const box = document.getElementById("alert");
  shownSource = source;
  replace(box,
    h("p", {}, message),
    h("button", { type: "button", class: "link-button", onclick: () => clearError() }, "Dismiss"));
  box.hidden = false;
}

export function clearError(source) {
  if (source && source !== shownSource) return;
  const box = document.getElementById("alert");
  box.hidden = true;
  box.replaceChildren();
  shownSource = null;
}

/** Shows ``error`` (an ApiError or any Error) prefixed with what was being done. */
export function report(error, doing, source = "page") {
  if (isAbort(error)) return; // the user left the page: nothing failed
  showError(doing ? `${doing}: ${error.message}` : error.message, source);
}

export function announce(message) {
  document.getElementById("status").textContent = message;
}
