// The dashboard's cluster panel: GET /cluster (`kvwarm cluster` only; a plain server answers
// 404 and the panel stays hidden). One row per engine replica: where it runs, its load, what
// its cache holds as it reports it and as the router's index of its cache events has it.

import { fmtAgo, fmtInt, fmtMs, table } from "./format.js";

const HEADERS = [
  ["Replica"],
  ["Node"],
  ["Process"],
  ["Health"],
  ["In flight / slots", "num"],
  ["Queued", "num"],
  ["TTFT"],
  ["Rows it reports"],
  ["Rows indexed"],
  ["Chunks indexed", "num"],
  ["Live", "num"],
  ["Events applied", "num"],
  ["Reported"],
];

/** A replica id's last part ("SERVE_REPLICA::kvwarm#engine#ab12cd" -> "ab12cd"). */
export function shortId(id) {
  const parts = String(id).split("#");
  return parts[parts.length - 1];
}

function perTier(tiers, field) {
  const names = Object.keys(tiers || {});
  if (names.length === 0) return "–";
  return names.map((t) => `${t} ${fmtInt((tiers[t] || {})[field] || 0)}`).join(", ");
}

/** The table's cells for GET /cluster's `replicas`, each [text, class]. */
export function replicaCells(replicas, nowMs = Date.now()) {
  return (replicas || []).map((r) => {
    const s = r.stats || {};
    const indexed = (r.indexed || {}).tiers || {};
    const chunks = Object.values(indexed).reduce((n, t) => n + (t.chunks || 0), 0);
    let health = r.health || "?";
    if (r.resync_wanted) health += " (resyncing)";
    return [
      [shortId(r.id)],
      [r.node ? String(r.node).slice(0, 12) : "–"],
      [s.pid ? String(s.pid) : "–"],
      [health],
      [`${fmtInt(s.in_flight || 0)} / ${fmtInt(s.slots || 1)}`, "num"],
      [fmtInt(s.queued || 0), "num"],
      [Number.isFinite(s.ttft_ms) ? fmtMs(s.ttft_ms) : "–"],
      [perTier(s.cache, "rows")],
      [perTier(indexed, "rows")],
      [fmtInt(chunks), "num"],
      [fmtInt((r.indexed || {}).live || 0), "num"],
      [`${fmtInt(r.seq || 0)}${r.resyncs ? ` (${fmtInt(r.resyncs)} resyncs)` : ""}`, "num"],
      [Number.isFinite(r.reported_at) ? fmtAgo(r.reported_at, nowMs) : "–"],
    ];
  });
}

/** A one-line summary of the router's index. */
export function indexNote(view) {
  const i = view.index || {};
  return `routing: ${view.routing || "?"}; index: ${fmtInt(i.rows || 0)} rows in ${fmtInt(i.copies || 0)} copies, ${fmtInt(i.chunks || 0)} chunks, ${fmtInt(i.links || 0)} links`;
}

export function renderCluster(root, view) {
  root.hidden = false;
  root.querySelector("#cluster-note").textContent = indexNote(view);
  const running = (view.replicas || []).filter((r) => r.health === "running").length;
  const caption = `${running} running replica${running === 1 ? "" : "s"}`;
  root.querySelector("#replicas").replaceChildren(table(caption, HEADERS, replicaCells(view.replicas), "no replica reported yet"));
}
