// Numbers, sizes and times as people read them.

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  let value = Number(n);
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  const digits = unit === 0 || value >= 100 ? 0 : value >= 10 ? 1 : 2;
  return `${value.toFixed(digits)} ${UNITS[unit]}`;
}

export function ms(x) {
  if (x === null || x === undefined) return "—";
  if (x >= 1000) return `${(x / 1000).toFixed(2)} s`;
  return `${x >= 100 ? x.toFixed(1) : x >= 1 ? x.toFixed(2) : x.toPrecision(3)} ms`;
}

export function mj(x) {
  if (x === null || x === undefined) return "—";
  if (x >= 1000) return `${(x / 1000).toFixed(2)} J`;
  return `${x >= 100 ? x.toFixed(1) : x >= 1 ? x.toFixed(2) : x.toPrecision(3)} mJ`;
}

/** A job's objective (time, energy, or time + alpha x energy) and power caps, in words. */
export function objectiveText(objective) {
  const o = objective || { kind: "time" };
  const text = o.kind === "weighted" ? `time + ${o.alpha} ms/mJ × energy` : o.kind;
  const caps = Object.entries(o.power_caps_w || {}).map(([d, w]) => `${d} ≤ ${w} W`);
  if (o.board_cap_w !== null && o.board_cap_w !== undefined) caps.push(`board ≤ ${o.board_cap_w} W`);
  return caps.length ? `${text}; power caps: ${caps.join(", ")}` : text;
}

/** A value of a job's objective: ms (time), mJ (energy), or the weighted sum's number. */
export function objectiveValue(objective) {
  const kind = (objective || {}).kind || "time";
  if (kind === "energy") return mj;
  if (kind === "weighted") return (x) => (x === null || x === undefined ? "—" : x.toPrecision(4));
  return ms;
}

export function percent(fraction, digits = 1) {
  if (fraction === null || fraction === undefined) return "—";
  return `${(fraction * 100).toFixed(digits)}%`;
}

export function seconds(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return "—";
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  const minutes = Math.floor(s / 60);
  if (minutes < 60) return `${minutes} min ${Math.round(s % 60)} s`;
  return `${Math.floor(minutes / 60)} h ${minutes % 60} min`;
}

/** The API's timestamps are UTC; SQLite drops the zone, so a bare one is read as UTC. */
export function parseTime(iso) {
  if (!iso) return null;
  const zoned = /(Z|[+-]\d\d:?\d\d)$/.test(iso) ? iso : `${iso}Z`;
  const date = new Date(zoned);
  return Number.isNaN(date.getTime()) ? null : date;
}

export function dateTime(iso) {
  const date = parseTime(iso);
  if (!date) return "—";
  const pad = (n) => String(n).padStart(2, "0");
  return `${date.getFullYear()}-${pad(date.getMonth() + 1)}-${pad(date.getDate())} ` +
    `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
}

/** "12 s ago", for heartbeats. */
export function ago(iso, now = Date.now()) {
  const date = parseTime(iso);
  if (!date) return "never";
  return `${seconds(Math.max(0, (now - date.getTime()) / 1000))} ago`;
}

export function shortId(id) {
  return id ? id.slice(0, 8) : "—";
}
