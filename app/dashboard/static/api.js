// The /v1 API as the pages use it: the API key on every request, problem+json errors turned
// into plain sentences, conditional GETs for polling, uploads with progress.

const KEY_STORAGE = "remat.apiKey";
let sessionKey = apiKey();

export function apiKey() {
  try {
    return localStorage.getItem(KEY_STORAGE) || "";
  } catch {
    return ""; // storage disabled: work without a key
  }
}

export function setApiKey(key) {
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  } catch {
    // storage disabled: the key lasts until the page is closed
  }
  sessionKey = key;
}

function headers(extra = {}) {
  const all = { Accept: "application/json", ...extra };
  if (sessionKey) all["X-API-Key"] = sessionKey;
  return all;
}

/** An API failure, its message already in plain words. */
export class ApiError extends Error {
  constructor(message, status = 0, problem = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.problem = problem;
  }
}

const UNREACHABLE = "The server cannot be reached. Check that Remat is running and try again.";

function problemMessage(status, problem) {
  if (status === 401) {
    return sessionKey
      ? "The server did not accept this API key. Enter a valid key in the “API key” field at the top."
      : "This server needs an API key. Enter it in the “API key” field at the top.";
  }
  const detail = problem && typeof problem.detail === "string" ? problem.detail : "";
  if (status >= 500) return `The server had a problem${detail ? `: ${detail}` : "."}`;
  return detail || (problem && problem.title) || `The server answered ${status}.`;
}

async function failure(response) {
  let problem = null;
  try {
    problem = await response.json();
  } catch {
    // not JSON (a proxy's error page): the status alone says enough
  }
  return new ApiError(problemMessage(response.status, problem), response.status, problem);
}

/**
 * One request. Resolves to {status, data, etag}; a 304 has data null. Throws ApiError for
 * any other non-2xx answer or an unreachable server; an aborted request throws AbortError.
 */
export async function request(path, { method = "GET", body, etag, signal, extraHeaders } = {}) {
  const init = { method, signal, cache: "no-store", headers: headers(extraHeaders) };
  if (etag) init.headers["If-None-Match"] = etag;
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(UNREACHABLE);
  }
  if (response.status === 304) return { status: 304, data: null, etag };
  if (!response.ok) throw await failure(response);
  const data = response.status === 204 ? null : await response.json();
  return { status: response.status, data, etag: response.headers.get("ETag") };
}

/** The body of a GET (or of the method given). */
export async function api(path, options = {}) {
  return (await request(path, options)).data;
}

/** POST /v1/models with the file, reporting progress as a fraction (fetch cannot). */
export function uploadModel(file, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", "/v1/models");
    for (const [name, value] of Object.entries(headers())) xhr.setRequestHeader(name, value);
    xhr.upload.addEventListener("progress", (event) => {
      if (event.lengthComputable) onProgress(event.loaded / event.total);
    });
    xhr.addEventListener("load", () => {
      let data = null;
      try {
        data = JSON.parse(xhr.responseText);
      } catch {
        // handled below by the status
      }
      if (xhr.status >= 200 && xhr.status < 300) {
        onProgress(1);
        resolve({ model: data, created: xhr.status === 201 });
      } else {
        reject(new ApiError(problemMessage(xhr.status, data), xhr.status, data));
      }
    });
    xhr.addEventListener("error", () => reject(new ApiError(UNREACHABLE)));
    const form = new FormData();
    form.append("file", file, file.name);
    xhr.send(form);
  });
}

/** Downloads a JSON document from the API (with the key) as a file. */
export async function downloadJson(path, filename) {
  const data = await api(path);
  const blob = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
  const url = URL.createObjectURL(blob);
  const link = document.createElement("a");
  link.href = url;
  link.download = filename;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

export function isAbort(error) {
  return error && error.name === "AbortError";
}
