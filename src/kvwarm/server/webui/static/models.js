// The models view: every model the server knows (/v1/models), whether it is loaded, pinned and
// when it unloads, what it holds in memory with its share of the cache (/cache/stats), and a
// Load or Unload button for each (/admin/models/load, /admin/models/unload: the admin key when
// one is set). LoRA adapters served as models are listed with their model, without buttons:
// they come and go with it.

import { ApiError, apiFetch, errorOf, getJSON, missingKey } from "./api.js";
import { el, fmtBytes } from "./format.js";

const POLL_MS = 2000;

/** A model's memory: weights, context (KV and buffers) and its share of the in-memory cache. */
export function memoryOf(model, stats) {
  const meta = model.meta || {};
  const own = stats?.memory?.models?.[model.id];
  const weights = meta.weights_bytes ?? Number.NaN;
  const context = meta.context_bytes ?? Number.NaN;
  const cache = own ? own.cache_bytes : Number.NaN;
  const part = (n) => (Number.isFinite(n) ? n : 0);
  const total = Number.isFinite(weights) ? weights + part(context) + part(cache) : Number.NaN;
  return { weights, context, cache, total };
}

/** When a model unloads, in words: "pinned", "never", "in use", "in 4 min", or "–". */
export function unloadsWhen(model, nowMs = Date.now()) {
  if (model.status !== "ready") return "–";
  if (model.pinned) return "pinned";
  if (model.keep_alive_s === null || model.keep_alive_s === undefined) return "never";
  if (model.expires_at === null || model.expires_at === undefined) return "after use";
  const s = Math.max(0, model.expires_at - nowMs / 1000);
  if (s < 60) return `in ${Math.round(s)} s`;
  if (s < 3600) return `in ${Math.round(s / 60)} min`;
  return `in ${(s / 3600).toFixed(1)} h`;
}

export class ModelsView {
  constructor(root) {
    this.root = root;
    this.status = root.querySelector("#models-status");
    this.body = root.querySelector("#models-table tbody");
    this.visible = false;
    this.timer = null;
    this.busy = false;
    this.again = false; // a poll was asked for while one ran
    this.pending = new Set(); // model ids with a load or unload under way
    this.noteUntil = 0; // an action's outcome stays in the status line until then (ms)
  }

  show(visible) {
    this.visible = visible;
    if (visible) this.poll();
  }

  schedule() {
    clearTimeout(this.timer);
    if (this.visible) this.timer = setTimeout(() => this.poll(), POLL_MS);
  }

  async poll() {
    if (this.busy) {
      this.again = true;
      return;
    }
    this.busy = true;
    try {
      if (document.hidden) return;
      const models = await getJSON("/v1/models");
      // The cache share needs /cache/stats (an admin path): read when a key is at hand.
      let stats = null;
      if (!missingKey("/cache/stats")) {
        try {
          stats = await getJSON("/cache/stats", { interactive: false });
        } catch {
          stats = null; // no engine yet, or not allowed: the share shows as unknown
        }
      }
      this.render(models.data, stats);
      if (!this.pending.size && Date.now() > this.noteUntil) {
        this.setStatus(`Updated ${new Date().toLocaleTimeString()}; every ${POLL_MS / 1000} s.`);
      }
    } catch (error) {
      this.setStatus(`Cannot list the models: ${error.message}`, true);
    } finally {
      this.busy = false;
      if (this.again) {
        this.again = false;
        this.poll();
      } else {
        this.schedule();
      }
    }
  }

  setStatus(text, isError = false) {
    this.status.textContent = text;
    this.status.classList.toggle("error", isError);
  }

  render(models, stats) {
    const now = Date.now();
    const rows = [];
    for (const m of models) {
      if (m.alias_of) continue; // an alias is its model: one row
      const adapter = m.source === "lora";
      const mem = memoryOf(m, stats);
      const actions = el("td", { class: "actions-cell" });
      if (!adapter) actions.append(this.button(m));
      rows.push(
        el(
          "tr",
          { data: { model: m.id, status: m.status } },
          el("th", { scope: "row", text: adapter ? `${m.id} (LoRA of ${m.parent})` : m.id }),
          el("td", { class: "state", text: m.status, title: m.error }), // why it failed (a worker that died, a load)
          el("td", { text: adapter ? "–" : unloadsWhen(m, now) }),
          el("td", { class: "num", text: fmtBytes(mem.weights) }),
          el("td", { class: "num", text: fmtBytes(mem.context) }),
          el("td", { class: "num cache", text: fmtBytes(mem.cache), data: { value: Number.isFinite(mem.cache) ? String(mem.cache) : "" } }),
          el("td", { class: "num", text: fmtBytes(mem.total) }),
          actions,
        ),
      );
    }
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "8", class: "hint", text: "This server has no models." })));
    this.body.replaceChildren(...rows);
  }

  button(model) {
    const loaded = model.status === "ready";
    const label = loaded ? "Unload" : "Load";
    const busy = this.pending.has(model.id) || ["loading", "unloading"].includes(model.status);
    const button = el("button", { type: "button", text: label, "aria-label": `${label} ${model.id}`, disabled: busy });
    button.addEventListener("click", () => this.act(model.id, loaded));
    return button;
  }

  async act(id, unload) {
    this.pending.add(id);
    this.setStatus(`${unload ? "Unloading" : "Loading"} ${id}…`);
    try {
      const path = unload ? "/admin/models/unload" : "/admin/models/load";
      const body = unload ? { model: id } : { name: id };
      const response = await apiFetch(path, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
      });
      if (!response.ok) throw await errorOf(response);
      const item = await response.json();
      this.setStatus(`${id} is ${item.status}.`);
    } catch (error) {
      const hint = error instanceof ApiError && error.status === 401 ? " (use the Keys button)" : "";
      this.setStatus(`Could not ${unload ? "unload" : "load"} ${id}: ${error.message}${hint}`, true);
    } finally {
      this.pending.delete(id);
      this.noteUntil = Date.now() + 5000;
      this.poll();
    }
  }
}
