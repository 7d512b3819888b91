// Entry point: reads which keys the server wants, wires the key dialog, switches the views.

import { loadServerConfig, server, setKeyPrompt, storeKey, storedKey } from "./api.js";
import { Chat } from "./chat.js";
import { Dashboard } from "./dashboard.js";
import { ModelsView } from "./models.js";

const LABELS = { api: "API key", admin: "Admin key" };

/** The key dialog: askers for the same kind share one prompt; other kinds wait their turn. */
class KeyDialog {
  constructor() {
    this.dialog = document.getElementById("key-dialog");
    this.form = document.getElementById("key-form");
    this.input = document.getElementById("key-input");
    this.label = document.getElementById("key-label");
    this.reason = document.getElementById("key-reason");
    this.waiting = new Map(); // kind -> Promise of the entered key (or null)
    this.queue = Promise.resolve();
    this.resolve = null;
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.close(this.input.value.trim() || null);
    });
    document.getElementById("key-cancel").addEventListener("click", () => this.close(null));
    document.getElementById("key-forget").addEventListener("click", () => {
      storeKey("api", null);
      storeKey("admin", null);
      this.close(null);
    });
    this.dialog.addEventListener("cancel", () => this.close(null)); // Escape
  }

  ask(kind, reason) {
    const known = this.waiting.get(kind);
    if (known) return known;
    const answer = this.queue.then(() => this.show(kind, reason));
    this.queue = answer;
    this.waiting.set(kind, answer);
    answer.then(() => this.waiting.delete(kind));
    return answer;
  }

  show(kind, reason) {
    this.label.textContent = LABELS[kind];
    this.reason.textContent = reason;
    this.input.value = "";
    this.opener = document.activeElement;
    this.dialog.showModal();
    this.input.focus();
    return new Promise((resolve) => {
      this.resolve = resolve;
    });
  }

  close(value) {
    if (this.dialog.open) this.dialog.close();
    const resolve = this.resolve;
    this.resolve = null;
    if (this.opener && typeof this.opener.focus === "function") this.opener.focus();
    if (resolve) resolve(value);
  }
}

const VIEWS = ["chat", "models", "cache"];

function setupViews(dashboard, models, chat) {
  let current = null;
  const select = (name) => {
    const back = current !== null && current !== name && name === "chat";
    current = name;
    for (const view of VIEWS) {
      const on = view === name;
      document.getElementById(`tab-${view}`).setAttribute("aria-pressed", String(on));
      document.getElementById(`view-${view}`).hidden = !on;
    }
    dashboard.show(name === "cache");
    models.show(name === "models");
    if (back) chat.loadModels(); // a model may have been loaded or unloaded meanwhile
    if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
  };
  const fromHash = () => (VIEWS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "chat");
  for (const view of VIEWS) document.getElementById(`tab-${view}`).addEventListener("click", () => select(view));
  window.addEventListener("hashchange", () => select(fromHash()));
  select(fromHash());
}

async function main() {
  const keys = new KeyDialog();
  setKeyPrompt((kind, reason) => keys.ask(kind, reason));
  // Each key this server wants, in turn (Cancel skips one): with both set, the dashboard and
  // the Load/Unload buttons need the admin key, which the API key prompt alone cannot set.
  document.getElementById("key-button").addEventListener("click", async () => {
    const kinds = [server.apiKey && "api", server.adminKey && "admin"].filter(Boolean);
    for (const kind of kinds.length ? kinds : ["api"]) {
      const reason =
        kind === "admin"
          ? "Set the admin key this page sends for the cache dashboard and model loading (it also works for chat)."
          : "Set the API key this page sends.";
      const entered = await keys.ask(kind, reason);
      if (entered) storeKey(kind, entered);
    }
  });

  const chat = new Chat(document.getElementById("view-chat"));
  const dashboard = new Dashboard(document.getElementById("view-cache"));
  const models = new ModelsView(document.getElementById("view-models"));
  try {
    await loadServerConfig();
  } catch (error) {
    chat.setStatus(`Cannot reach the server: ${error.message}`, true);
    return;
  }
  if (server.apiKey && !storedKey("api") && !storedKey("admin")) {
    const entered = await keys.ask("api", "This server needs an API key.");
    if (entered) storeKey("api", entered);
  }
  setupViews(dashboard, models, chat);
  await chat.loadModels();
  dashboard.start();
  document.body.dataset.ready = "true";
}

main().catch((error) => {
  const status = document.getElementById("chat-status");
  status.textContent = `The page failed to start: ${error.message}`;
  status.classList.add("error");
});
