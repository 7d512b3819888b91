// The chat view: streams /v1/chat/completions and shows, per turn, how much of the prompt the
// cache restored (cached) and how much was computed (prefilled), and the time to first token
// as this page measured it. A turn may carry an image (a model with a projector reads it): it
// goes in the request body as a data: URI (the page's CSP allows no data: images, so the
// transcript names it rather than showing it) and stays in the conversation, so each later
// turn resends it and the cache, keyed by its pixels, restores it.

import { apiFetch, errorOf, getJSON, sseData } from "./api.js";
import { el, fmtInt, fmtMs } from "./format.js";

export class Chat {
  constructor(root) {
    this.root = root;
    this.model = root.querySelector("#model");
    this.maxTokens = root.querySelector("#max-tokens");
    this.temperature = root.querySelector("#temperature");
    this.system = root.querySelector("#system");
    this.transcript = root.querySelector("#transcript");
    this.prompt = root.querySelector("#prompt");
    this.attach = root.querySelector("#attach");
    this.attached = root.querySelector("#attached");
    this.send = root.querySelector("#send");
    this.stop = root.querySelector("#stop");
    this.status = root.querySelector("#chat-status");
    this.messages = [];
    this.turns = 0;
    this.abort = null;

    root.querySelector("#composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.submit();
    });
    this.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.submit();
      }
    });
    this.stop.addEventListener("click", () => this.abort?.abort());
    this.attach.addEventListener("change", () => {
      const file = this.attach.files?.[0];
      this.attached.textContent = file ? `${file.name}, ${fmtInt(file.size)} bytes` : "";
    });
    root.querySelector("#new-chat").addEventListener("click", () => this.reset());
    root.querySelector("#chat-settings").addEventListener("submit", (event) => event.preventDefault());
  }

  setStatus(text, isError = false) {
    this.status.textContent = text;
    this.status.classList.toggle("error", isError);
  }

  async loadModels() {
    try {
      const body = await getJSON("/v1/models");
      const current = this.model.value;
      this.model.replaceChildren(
        ...body.data.map((m) => el("option", { value: m.id, text: m.status && m.status !== "ready" ? `${m.id} (${m.status})` : m.id })),
      );
      if (body.data.some((m) => m.id === current)) this.model.value = current;
      const loading = body.data.filter((m) => m.status === "loading").map((m) => m.id);
      if (loading.length) {
        this.setStatus(`Loading ${loading.join(", ")}…`);
        clearTimeout(this.modelTimer);
        this.modelTimer = setTimeout(() => this.loadModels(), 2000);
      } else {
        this.setStatus(body.data.length ? "" : "This server has no models.", !body.data.length);
      }
    } catch (error) {
      this.setStatus(`Could not list models: ${error.message}`, true);
    }
  }

  reset() {
    this.abort?.abort();
    this.messages = [];
    this.turns = 0;
    this.transcript.replaceChildren();
    this.setStatus("New chat.");
    this.prompt.focus();
  }

  requestBody() {
    const system = this.system.value.trim();
    const messages = system ? [{ role: "system", content: system }, ...this.messages] : [...this.messages];
    const body = {
      model: this.model.value || undefined,
      messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    const maxTokens = Number.parseInt(this.maxTokens.value, 10);
    if (Number.isFinite(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
    const temperature = Number.parseFloat(this.temperature.value);
    if (Number.isFinite(temperature) && temperature >= 0) body.temperature = temperature;
    return body;
  }

  async submit() {
    const text = this.prompt.value.trim();
    const file = this.attach.files?.[0];
    if ((!text && !file) || this.abort) return;
    let content = text;
    if (file) {
      let url;
      try {
        url = await dataUri(file);
      } catch (error) {
        this.setStatus(`Could not read ${file.name}: ${error.message}`, true);
        return;
      }
      content = [{ type: "text", text }, { type: "image_url", image_url: { url } }];
      this.attach.value = "";
      this.attached.textContent = "";
    }
    this.prompt.value = "";
    this.messages.push({ role: "user", content });
    this.turns += 1;
    const shown = [el("p", { class: "who", text: "You" }), el("p", { class: "text", text })];
    if (file) shown.push(el("p", { class: "image", text: `Image: ${file.name}` }));
    this.transcript.append(el("li", { class: "msg user" }, ...shown));
    const turn = new Turn(this.turns);
    this.transcript.append(turn.node);
    turn.node.scrollIntoView({ block: "nearest" });

    this.abort = new AbortController();
    this.send.disabled = true;
    this.stop.disabled = false;
    this.setStatus(`Turn ${this.turns}: waiting for the first token…`);
    try {
      const reply = await this.stream(turn, this.abort.signal);
      this.messages.push({ role: "assistant", content: reply });
      this.setStatus(turn.summary());
    } catch (error) {
      const stopped = error.name === "AbortError";
      turn.fail(stopped ? "stopped" : error.message);
      this.messages.pop(); // a failed turn is not part of the conversation
      this.setStatus(stopped ? "Stopped." : `Turn failed: ${error.message}`, !stopped);
    } finally {
      this.abort = null;
      this.send.disabled = false;
      this.stop.disabled = true;
      this.prompt.focus();
    }
  }

  async stream(turn, signal) {
    const started = performance.now();
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(this.requestBody()),
      signal,
    });
    if (!response.ok) throw await errorOf(response);
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) turn.addText(delta, performance.now() - started);
      if (chunk.usage) turn.setUsage(chunk.usage, chunk.timings);
    }
    turn.finish(performance.now() - started);
    return turn.text;
  }
}

/** Why the rest of the prompt was prefilled: the server's ``timings.cache_reason.reason``
 * (kvwarm.cache.explain.MissReason) in words. */
const REASON_TEXT = {
  none: "the whole prompt came from the cache",
  last_token: "the last prompt token was decoded for its logits",
  new_tokens: "the rest of the prompt was never cached",
  no_prefix: "no cached row or slot shares a prefix with the prompt",
  aligned_trim: "deterministic mode reuses only a prefix aligned to n_batch",
  memory_floor: "the model's memory cannot resume there (no checkpoint at or below)",
  evicted: "the row that shared more was evicted",
  expired: "the row that shared more expired",
  unreadable: "the row that shared more failed to read and was dropped",
  other_namespace: "a row shares more under another adapter set or context",
  save_dropped: "the save that would have served it was dropped",
  save_in_flight: "the save that would have served it is still being written",
  restore_failed: "the row could not be restored",
  prompt_logprobs: "prompt logprobs need every position's logits",
  inside_span: "the reusable prefix ended inside an image or audio, decoded whole",
  media_differs: "the prompt's image or audio differs from what was cached there",
};

/** One line under the cache bar: why the rest was prefilled, with its numbers. */
export function reasonText(r) {
  if (!r) return null;
  const words = REASON_TEXT[r.reason] ?? r.reason;
  const bits = [];
  if (r.found_tokens) bits.push(`${fmtInt(r.found_tokens)} tokens found`);
  if (r.tier) bits.push(`tier ${r.tier}`);
  if (r.detail) bits.push(r.detail);
  if (r.age_s !== undefined && r.age_s !== null) bits.push(`${fmtMs(r.age_s * 1000)} ago`);
  return bits.length ? `${words} (${bits.join(", ")})` : words;
}

/** One assistant turn in the transcript, with its cache bar. */
class Turn {
  constructor(index) {
    this.index = index;
    this.text = "";
    this.ttftMs = null;
    this.totalMs = null;
    this.usage = null;
    this.timings = null;
    this.textNode = el("p", { class: "text", text: "…" });
    this.meta = el("div", { class: "turn-meta" });
    this.node = el(
      "li",
      { class: "msg assistant turn", data: { turn: String(index) } },
      el("p", { class: "who", text: `Assistant · turn ${index}` }),
      this.textNode,
      this.meta,
    );
  }

  addText(delta, elapsedMs) {
    if (this.ttftMs === null) this.ttftMs = elapsedMs;
    this.text += delta;
    this.textNode.textContent = this.text;
  }

  setUsage(usage, timings) {
    this.usage = usage;
    this.timings = timings || null;
  }

  fail(message) {
    this.node.classList.add("error");
    this.textNode.textContent = this.text ? `${this.text}\n[${message}]` : `[${message}]`;
  }

  summary() {
    const u = this.usage;
    if (!u) return `Turn ${this.index}: done (the server sent no usage).`;
    const cached = u.prompt_tokens_details?.cached_tokens ?? 0;
    return `Turn ${this.index}: ${fmtInt(cached)} of ${fmtInt(u.prompt_tokens)} prompt tokens from the cache, first token after ${fmtMs(this.ttftMs ?? this.totalMs)}.`;
  }

  finish(totalMs) {
    this.totalMs = totalMs;
    if (!this.text) this.textNode.textContent = "(no text)";
    const u = this.usage;
    if (!u) {
      this.meta.replaceChildren(el("p", { text: `total ${fmtMs(totalMs)}` }));
      return;
    }
    const prompt = u.prompt_tokens;
    const cached = u.prompt_tokens_details?.cached_tokens ?? 0;
    const prefilled = Math.max(0, prompt - cached);
    Object.assign(this.node.dataset, {
      promptTokens: String(prompt),
      cachedTokens: String(cached),
      prefilledTokens: String(prefilled),
      ttftMs: String(Math.round(this.ttftMs ?? totalMs)),
    });
    const bar = el("div", { class: "bar", role: "img", "aria-label": `${cached} cached and ${prefilled} prefilled prompt tokens` });
    const cachedPart = el("span", { class: "cached" });
    const prefilledPart = el("span", { class: "prefilled" });
    // CSSOM, not a style attribute: the Content-Security-Policy forbids inline styles.
    cachedPart.style.width = `${prompt ? (100 * cached) / prompt : 0}%`;
    prefilledPart.style.width = `${prompt ? (100 * prefilled) / prompt : 0}%`;
    bar.append(cachedPart, prefilledPart);
    const t = this.timings;
    const legend = el(
      "ul",
      { class: "legend" },
      el("li", {}, el("span", { class: "swatch cached" }), el("span", { class: "n-cached", text: `${fmtInt(cached)} cached` })),
      el("li", {}, el("span", { class: "swatch prefilled" }), el("span", { class: "n-prefilled", text: `${fmtInt(prefilled)} prefilled` })),
      el("li", { text: `time to first token ${fmtMs(this.ttftMs ?? totalMs)}` }),
      t ? el("li", { text: `prefill ${fmtMs(t.prefill_ms)} (${t.cache_hit})` }) : null,
      el("li", { text: `${fmtInt(u.completion_tokens)} tokens in ${fmtMs(totalMs)}` }),
    );
    const why = reasonText(t?.cache_reason);
    if (why) this.node.dataset.cacheReason = t.cache_reason.reason;
    const reason = why ? el("p", { class: "reason", text: `Prefilled because: ${why}` }) : null;
    this.meta.replaceChildren(...[bar, reason, legend].filter(Boolean));
  }
}

// A file as a base64 data: URI (for the request body only).
function dataUri(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(String(reader.result));
    reader.onerror = () => reject(reader.error ?? new Error("unreadable"));
    reader.readAsDataURL(file);
  });
}
