// DOM building and number formatting. Text always goes in through textContent, never as HTML,
// so nothing a model or a server says can become markup.

/** el("td", {class: "num", text: "3", data: {key: "x"}}, child...) */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "text") node.textContent = String(value);
    else if (name === "class") node.className = value;
    else if (name === "data") Object.assign(node.dataset, value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

const intFormat = new Intl.NumberFormat("en");

export function fmtInt(n) {
  return Number.isFinite(n) ? intFormat.format(Math.round(n)) : "–";
}

export function fmtBytes(n) {
  if (!Number.isFinite(n)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = n;
  let unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
}

export function fmtMs(ms) {
  if (!Number.isFinite(ms)) return "–";
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`;
}

export function fmtPercent(fraction) {
  return Number.isFinite(fraction) ? `${(fraction * 100).toFixed(1)} %` : "–";
}

/** How long ago a unix time (seconds) was, coarsely. */
export function fmtAgo(unixSeconds, nowMs = Date.now()) {
  const s = Math.max(0, nowMs / 1000 - unixSeconds);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
  return `${(s / 86400).toFixed(1)} d ago`;
}

/** Replace a container's children with a table (or a note when there are no rows). */
export function table(caption, headers, rows, empty = "none") {
  if (rows.length === 0) return el("p", { class: "hint", text: `${caption}: ${empty}` });
  const head = el("tr", {}, ...headers.map(([label, cls]) => el("th", { scope: "col", class: cls, text: label })));
  const body = el("tbody");
  for (const cells of rows) {
    body.append(el("tr", {}, ...cells.map(([value, cls]) => el("td", { class: cls, text: value }))));
  }
  // Focusable, so a keyboard can scroll a table wider than a phone.
  const box = el("div", { class: "scroll", tabindex: "0", role: "region", "aria-label": caption });
  box.append(el("table", {}, el("caption", { text: caption }), el("thead", {}, head), body));
  return box;
}
