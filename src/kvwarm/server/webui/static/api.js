// Talking to this server: keys (kept in sessionStorage, sent as a bearer token), JSON calls,
// OpenAI-shaped errors and server-sent events read from a fetch body.

const STORE = { api: "kvwarm.apiKey", admin: "kvwarm.adminKey" };

/** What /ui/config.json said: which keys this server wants. */
export const server = { apiKey: false, adminKey: false, version: "", cluster: false };

let askKey = async () => null;

/** fn(kind, reason) -> Promise<string|null>: asks the person for a key ("api" or "admin"). */
export function setKeyPrompt(fn) {
  askKey = fn;
}

export function storedKey(kind) {
  try {
    return sessionStorage.getItem(STORE[kind]) || null;
  } catch {
    return null; // storage disabled: the key lives only as long as this call
  }
}

export function storeKey(kind, value) {
  try {
    if (value) sessionStorage.setItem(STORE[kind], value);
    else sessionStorage.removeItem(STORE[kind]);
  } catch {
    /* storage disabled: nothing to keep */
  }
}

export function isAdminPath(path) {
  return path.startsWith("/cache/") || path.startsWith("/admin/") || path === "/cluster";
}

/** The kind of key a path needs first, or null when this server wants none. */
export function keyKindFor(path) {
  if (isAdminPath(path) && server.adminKey) return "admin";
  if (isAdminPath(path)) return server.apiKey ? "api" : null;
  return server.apiKey ? "api" : null;
}

function keyFor(path) {
  // The admin key is accepted everywhere the API key is; the API key only where no admin key
  // is configured.
  const admin = storedKey("admin");
  const api = storedKey("api");
  return isAdminPath(path) && server.adminKey ? admin : api || admin;
}

export class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
  }
}

export async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch {
    /* not JSON: keep the status line */
  }
  return new ApiError(response.status, message, code);
}

/** True when a key for `path` is needed and none is stored (so a call would only be a 401). */
export function missingKey(path) {
  const kind = keyKindFor(path);
  return kind !== null && keyFor(path) === null;
}

/**
 * fetch() with the stored key. A 401 asks for the key (when `interactive`) and retries; a
 * declined prompt or another 401 raises ApiError.
 */
export async function apiFetch(path, init = {}, { interactive = true } = {}) {
  for (let attempt = 0; attempt < 3; attempt += 1) {
    if (missingKey(path)) {
      if (!interactive) throw new ApiError(401, "a key is needed", "key_needed");
      const kind = keyKindFor(path);
      const entered = await askKey(kind, `This server needs ${kind === "admin" ? "its admin key" : "an API key"}.`);
      if (!entered) throw new ApiError(401, "no key given", "key_needed");
      storeKey(kind, entered);
    }
    const headers = new Headers(init.headers || {});
    const key = keyFor(path);
    if (key) headers.set("Authorization", `Bearer ${key}`);
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    const error = await errorOf(response);
    const kind = error.code === "invalid_admin_key" ? "admin" : "api";
    if (!interactive) throw error;
    const entered = await askKey(kind, error.message);
    if (!entered) throw error;
    storeKey(kind, entered);
  }
  throw new ApiError(401, "the key was refused three times");
}

export async function getJSON(path, options = {}) {
  const response = await apiFetch(path, {}, options);
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

export async function loadServerConfig() {
  const response = await fetch("/ui/config.json");
  if (!response.ok) throw await errorOf(response);
  Object.assign(server, await response.json());
}

/** Yields each event's `data` (a string) from a text/event-stream fetch response. */
export async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n?/g, "\n");
      let end = buffer.indexOf("\n\n");
      while (end >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
        end = buffer.indexOf("\n\n");
      }
    }
  } finally {
    reader.releaseLock();
  }
}
