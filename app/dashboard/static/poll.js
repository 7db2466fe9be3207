// Polling tied to a page's lifetime: it stops when the page is left (its signal aborts) or
// when the task says it is done, skips ticks while the tab is hidden, and shows a failure
// without giving up (the next success clears it).

import { clearError, report } from "./notify.js";

/**
 * Runs ``task`` now and then every ``intervalMs`` until ``signal`` aborts or ``task``
 * resolves to false. Returns a function that stops it.
 */
export function every(intervalMs, task, { signal, doing, source }) {
  let timer = null;
  let stopped = false;
  const stop = () => {
    stopped = true;
    clearTimeout(timer);
  };
  signal.addEventListener("abort", stop);
  const tick = async () => {
    if (stopped) return;
    let again = true;
    if (!document.hidden) {
      try {
        again = (await task()) !== false;
        clearError(source);
      } catch (error) {
        report(error, doing, source);
      }
    }
    if (again && !stopped) timer = setTimeout(tick, intervalMs);
  };
  tick();
  return stop;
}
