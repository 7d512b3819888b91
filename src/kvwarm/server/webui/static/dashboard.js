// The cache dashboard: polls /cache/stats, /cache/slots and /cache/rows and redraws. Counts
// come straight from the server; the two rates and the time saved are derived here. Behind
// `kvwarm cluster` it polls /cluster instead (the replicas and what their caches hold;
// /cache/* is per replica there).

import { ApiError, getJSON, missingKey, server } from "./api.js";
import { LineChart } from "./chart.js";
import { renderCluster } from "./cluster.js";
import { el, fmtAgo, fmtBytes, fmtInt, fmtMs, fmtPercent, table } from "./format.js";

const POLL_MS = 2000;
const ROW_LIMIT = 200;

/**
 * Hit rate from the cache's request outcomes (each request counts one): requests that reused
 * KV, a row's or a slot's live KV, over all those served (hits and misses; a request that
 * failed before it was seated, `admission_failures`, was not served and is in neither; a
 * prewarm or keep-alive re-warm is the server's upkeep and counts no outcome).
 */
export function lookupHitRate(counters) {
  const hits =
    (counters.hits_exact || 0) +
    (counters.hits_resume || 0) +
    (counters.hits_longest_prefix || 0) +
    (counters.hits_live || 0);
  const total = hits + (counters.misses || 0);
  return total > 0 ? hits / total : Number.NaN;
}

/**
 * Prompt tokens served from the cache, and prefill time they saved: each model's cached tokens
 * times the time its prefilled tokens took on average (an estimate: prefill_ms also holds the
 * restores, so it leans high on a very warm server). The tokens prefilled are those the model
 * ran (`prefilled_tokens`), not `prompt_tokens - cached_tokens`, which also holds prompts
 * never prefilled (a request cancelled while queued or mid-prefill). `models`: /cache/stats's
 * `model_totals` (each model's counts over the server's lifetime, every load of it: the
 * figures stay when a model unloads), or any list of objects with the same counts.
 */
export function savings(models) {
  let prompt = 0;
  let cached = 0;
  let savedMs = 0;
  for (const m of models) {
    prompt += m.prompt_tokens;
    cached += m.cached_tokens;
    const prefilled = m.prefilled_tokens ?? m.prompt_tokens - m.cached_tokens;
    if (prefilled > 0) savedMs += (m.cached_tokens * m.prefill_ms) / prefilled;
  }
  return { tokenRate: prompt > 0 ? cached / prompt : Number.NaN, savedMs };
}

/**
 * Per-tier sizes, in the server's tier order: /cache/stats's `tiers` (every configured tier:
 * rows, chunks, bytes stored, logical bytes, dedup ratio, quota and effective quota, tokens,
 * hits (rows opened: what LFU eviction counts), restores with their bytes and seconds, TTL
 * classes).
 */
export function tierLevels(tierStats) {
  return new Map(Object.entries(tierStats || {}));
}

export class Dashboard {
  constructor(root) {
    this.root = root;
    this.status = root.querySelector("#dash-status");
    this.tiersBody = root.querySelector("#tiers tbody");
    this.kindsBody = root.querySelector("#memory-kinds tbody");
    this.slots = root.querySelector("#slots");
    this.rows = root.querySelector("#rows");
    this.rowsNote = root.querySelector("#rows-note");
    this.cluster = root.querySelector("#cluster");
    this.isCluster = null; // unknown until /cluster answers (404: a plain server)
    const hits = root.querySelector("#chart-hits");
    const saved = root.querySelector("#chart-saved");
    hits.dataset.title = "Hit rate over time";
    saved.dataset.title = "Prefill time saved over time";
    this.hitChart = new LineChart(hits, [
      { name: "requests", colorVar: "--accent" },
      { name: "prompt tokens", colorVar: "--cached" },
    ], { fixedMax: 100, unit: " %" });
    this.savedChart = new LineChart(saved, [{ name: "saved", colorVar: "--cached" }], {
      unit: " s",
      format: (s) => (s === 0 ? "0" : s >= 1 ? `${Number(s.toPrecision(3))} s` : `${Number((s * 1000).toPrecision(2))} ms`),
    });
    this.visible = false;
    this.declined = false; // a key prompt was declined or refused: ask again only when the tab is shown
    this.timer = null;
    this.busy = false;
    window.addEventListener("resize", () => this.redrawCharts());
  }

  show(visible) {
    if (visible && !this.visible) this.declined = false;
    this.visible = visible;
    if (visible) {
      this.redrawCharts();
      this.poll();
    }
  }

  start() {
    this.poll();
  }

  schedule() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.poll(), POLL_MS);
  }

  async poll() {
    if (this.busy) return;
    this.busy = true;
    try {
      if (document.hidden) return; // a background tab costs the server nothing
      // In the background, never prompt: only poll when a key is at hand (or none is needed).
      if (!this.visible && missingKey("/cache/stats")) return;
      // Once the person declined a key (or gave a refused one), polling goes on without
      // asking again every 2 s: the status says to use the Keys button.
      const options = { interactive: this.visible && !this.declined };
      // Only `kvwarm cluster` answers /cluster (/ui/config.json says so): a plain server's
      // 404 would be a console error on every page.
      if (server.cluster && this.isCluster !== false && (await this.pollCluster(options))) return;
      const [stats, slots, rows] = await Promise.all([
        getJSON("/cache/stats", options),
        getJSON("/cache/slots", options),
        this.visible ? getJSON(`/cache/rows?limit=${ROW_LIMIT}`, options) : Promise.resolve(null),
      ]);
      this.render(stats, slots.data, rows ? rows.data : null);
      this.setStatus(`Updated ${new Date().toLocaleTimeString()}; every ${POLL_MS / 1000} s.`);
    } catch (error) {
      const unauthorized = error instanceof ApiError && error.status === 401;
      if (unauthorized) this.declined = true;
      const message = unauthorized ? `${error.message} (use the Keys button)` : error.message;
      this.setStatus(`${new Date().toLocaleTimeString()}: cannot read the cache: ${message}`, true);
    } finally {
      this.busy = false;
      this.schedule();
    }
  }

  /** Draws /cluster and says true behind `kvwarm cluster`; false (for good) elsewhere. */
  async pollCluster(options) {
    try {
      const view = await getJSON("/cluster", options);
      this.isCluster = true;
      renderCluster(this.cluster, view);
      this.setStatus(`Updated ${new Date().toLocaleTimeString()}; every ${POLL_MS / 1000} s.`);
      return true;
    } catch (error) {
      if (error instanceof ApiError && error.status === 404) {
        this.isCluster = false;
        return false;
      }
      throw error;
    }
  }

  setStatus(text, isError = false) {
    this.status.textContent = text;
    this.status.classList.toggle("error", isError);
  }

  render(stats, models, rows) {
    const c = stats.counters;
    // Over the server's lifetime (every load of each model), not the loaded models alone.
    const { tokenRate, savedMs } = savings(stats.model_totals ? Object.values(stats.model_totals) : models);
    const hitRate = lookupHitRate(c);
    setStat("stat-rows", stats.rows, fmtInt);
    setStat("stat-tokens", stats.tokens, fmtInt);
    setStat("stat-bytes", stats.bytes, fmtBytes);
    setStat("stat-logical", stats.logical_bytes, (n) => `${fmtBytes(n)} (${(stats.dedup_ratio || 0).toFixed(2)}x dedup)`);
    setStat("stat-hit-rate", hitRate, fmtPercent);
    setStat("stat-token-rate", tokenRate, fmtPercent);
    setStat("stat-saved", savedMs, fmtMs);
    setStat("stat-dropped", c.saves_dropped || 0, fmtInt);
    setStat("stat-failures", c.save_failures || 0, fmtInt);
    setStat("stat-evictions", c.evictions || 0, (n) => `${fmtInt(n)} (${fmtBytes(c.evicted_bytes || 0)})`);

    const now = Date.now();
    this.hitChart.push(now, [hitRate * 100, tokenRate * 100]);
    this.savedChart.push(now, [savedMs / 1000]);
    this.redrawCharts();
    this.renderTiers(stats.tiers || {});
    this.renderKinds(stats.memory_kinds || {});
    this.renderSlots(models);
    if (rows) this.renderRows(rows, stats.rows);
  }

  redrawCharts() {
    if (!this.visible) return;
    this.hitChart.draw();
    this.savedChart.draw();
  }

  renderTiers(tierStats) {
    const rows = [];
    for (const [name, level] of tierLevels(tierStats)) {
      // The quota the tier can use: the configured one, capped by the room on its filesystem.
      const configured = level.quota_bytes || 0;
      const quota = level.effective_quota_bytes ?? configured;
      const used = level.bytes || 0;
      const meter = el("meter", { min: "0", max: String(quota || 1), value: String(used), "aria-label": `${name} quota use` });
      const capped = quota !== configured;
      const restores = level.restores || 0;
      const ttl = Object.entries(level.ttl_classes || {}).map(([k, n]) => `${k} ${n}`).join(", ");
      rows.push(
        el(
          "tr",
          { data: { tier: name } },
          el("th", { scope: "row", text: name }),
          el("td", { class: "num", text: fmtInt(level.rows || 0) }),
          el("td", { class: "num", text: fmtInt(level.tokens || 0) }),
          el("td", { class: "num", text: fmtInt(level.hits || 0) }),
          el(
            "td",
            { class: "num restores", data: { value: String(restores) } },
            fmtInt(restores),
            restores ? el("span", { class: "sub hint", text: `${fmtBytes(level.restored_bytes || 0)}, ${fmtRestoreMs((level.restore_seconds * 1000) / restores)}` }) : null,
          ),
          el("td", { class: "num", text: fmtInt(level.chunks || 0) }),
          el("td", { class: "num", text: fmtBytes(used) }),
          el("td", { class: "num", text: fmtBytes(level.logical_bytes || 0) }),
          el("td", { class: "num", text: used ? `${(level.dedup_ratio || 0).toFixed(2)}x` : "–" }),
          el("td", { text: ttl || "–" }),
          el(
            "td",
            {
              class: "num quota",
              data: { value: String(quota), configured: String(configured) },
              title: capped ? `configured ${fmtBytes(configured)}; the free space on its filesystem allows ${fmtBytes(quota)}` : undefined,
            },
            fmtBytes(quota),
            capped ? el("span", { class: "sub hint", text: `of ${fmtBytes(configured)}` }) : null,
          ),
          el("td", {}, meter, ` ${quota ? fmtPercent(used / quota) : "–"}`),
        ),
      );
    }
    this.tiersBody.replaceChildren(...rows);
  }

  /** Stored against logical bytes per memory kind: what deduplication saves on each model. */
  renderKinds(kinds) {
    const rows = Object.entries(kinds).map(([kind, level]) =>
      el(
        "tr",
        { data: { kind } },
        el("th", { scope: "row", text: kind }),
        el("td", { class: "num", text: fmtInt(level.rows || 0) }),
        el("td", { class: "num", text: fmtInt(level.tokens || 0) }),
        el("td", { class: "num", text: fmtInt(level.chunks || 0) }),
        el("td", { class: "num", text: fmtBytes(level.bytes || 0) }),
        el("td", { class: "num", text: fmtBytes(level.logical_bytes || 0) }),
        el("td", { class: "num", text: level.bytes ? `${(level.dedup_ratio || 0).toFixed(2)}x` : "–" }),
      ),
    );
    this.kindsBody.replaceChildren(...rows);
  }

  renderSlots(models) {
    const parts = [];
    for (const m of models) {
      const cells = m.slots.map((s) => [
        [String(s.seq)],
        [s.phase],
        [`${fmtInt(s.n_tokens)}${s.canonical !== s.n_tokens ? ` (${fmtInt(s.canonical)} aligned)` : ""}`, "num"],
        [s.phase === "idle" ? "–" : `${fmtInt(s.prompt_tokens)} prompt · ${fmtInt(s.cached_tokens)} cached · ${fmtInt(s.generated)} generated · ${s.cache_hit}`],
        [s.phase !== "idle" ? "now" : s.n_tokens ? fmtAgo(s.last_used) : "–"],
      ]);
      const caption = `${m.id}: ${m.state}, ${m.active}/${m.n_parallel} busy, ${m.queued} queued, ${fmtInt(m.requests)} requests`;
      parts.push(table(caption, [["Slot"], ["Phase"], ["Holds (tokens)", "num"], ["Request"], ["Last used"]], cells, "no slots"));
    }
    this.slots.replaceChildren(...(parts.length ? parts : [el("p", { class: "hint", text: "No model is ready yet." })]));
  }

  renderRows(rows, total) {
    this.rowsNote.textContent = rows.length < total ? `(the ${rows.length} most recently used of ${fmtInt(total)})` : "";
    const byTier = new Map();
    for (const r of rows) {
      if (!byTier.has(r.tier)) byTier.set(r.tier, []);
      byTier.get(r.tier).push(r);
    }
    const now = Date.now();
    const parts = [...byTier].map(([tier, list]) =>
      table(
        `${tier} (${list.length})`,
        [["Key"], ["Tokens", "num"], ["Hits", "num"], ["KV bytes", "num"], ["Only its own", "num"], ["TTL class"], ["Saved as"], ["Last used"]],
        list.map((r) => [
          [r.key.slice(0, 12)],
          [fmtInt(r.n_tokens), "num"],
          [fmtInt(r.hits), "num"],
          [fmtBytes(r.bytes), "num"],
          [fmtBytes(r.exclusive_bytes), "num"],
          [r.ttl_class],
          [r.reason],
          [fmtAgo(r.last_used, now)],
        ]),
      ),
    );
    this.rows.replaceChildren(...(parts.length ? parts : [el("p", { class: "hint", text: "No rows yet: chat a little." })]));
  }
}

/** A restore's time: they often take under a millisecond, which fmtMs rounds to 0. */
function fmtRestoreMs(ms) {
  return ms < 10 ? `${ms.toFixed(2)} ms` : fmtMs(ms);
}

function setStat(id, value, format) {
  const node = document.getElementById(id);
  node.textContent = format(value);
  node.dataset.value = Number.isFinite(value) ? String(value) : "";
}
