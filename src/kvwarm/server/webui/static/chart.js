// A small time-series line chart drawn on a <canvas>: no library, sized to its CSS box and
// the device's pixel ratio, colours from the page's CSS variables (light and dark).

const PAD = { left: 52, right: 10, top: 10, bottom: 22 };

function cssVar(name, fallback) {
  const value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return value || fallback;
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const step = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 2.5, 5, 10]) {
    if (m * step >= value) return m * step;
  }
  return 10 * step;
}

export class LineChart {
  /** series: [{name, colorVar}], fixedMax: a fixed top of the y axis (e.g. 100 for %) */
  constructor(canvas, series, { fixedMax = null, unit = "", capacity = 600, format = null } = {}) {
    this.canvas = canvas;
    this.series = series;
    this.fixedMax = fixedMax;
    this.unit = unit;
    this.capacity = capacity;
    this.format = format || ((v) => (v >= 10 || v === 0 ? v.toFixed(0) : String(Number(v.toPrecision(2)))));
    this.points = []; // [{t: ms, values: [..]}]
  }

  push(t, values) {
    this.points.push({ t, values });
    if (this.points.length > this.capacity) this.points.shift();
  }

  /** A short text for screen readers: the latest value of each series. */
  describe() {
    const last = this.points[this.points.length - 1];
    if (!last) return "no samples yet";
    return this.series
      .map((s, i) => `${s.name} ${Number.isFinite(last.values[i]) ? last.values[i].toFixed(1) : "n/a"}${this.unit}`)
      .join(", ");
  }

  draw() {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (width === 0 || height === 0) return; // hidden: drawn when shown
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const fg = cssVar("--muted", "#666");
    const grid = cssVar("--line", "#ddd");
    const plotW = width - PAD.left - PAD.right;
    const plotH = height - PAD.top - PAD.bottom;

    const values = this.points.flatMap((p) => p.values.filter(Number.isFinite));
    const top = this.fixedMax ?? niceMax(Math.max(0, ...values));
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = fg;
    ctx.strokeStyle = grid;
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i += 1) {
      const y = PAD.top + plotH - (plotH * i) / 4;
      ctx.beginPath();
      ctx.moveTo(PAD.left, y);
      ctx.lineTo(PAD.left + plotW, y);
      ctx.stroke();
      ctx.fillText(this.format((top * i) / 4), PAD.left - 6, y);
    }
    canvas.setAttribute("aria-label", `${canvas.dataset.title || "chart"}: ${this.describe()}`);
    if (this.points.length < 2) {
      ctx.textAlign = "center";
      ctx.fillText("collecting samples…", PAD.left + plotW / 2, PAD.top + plotH / 2);
      return;
    }
    const t0 = this.points[0].t;
    const span = Math.max(1, this.points[this.points.length - 1].t - t0);
    const x = (t) => PAD.left + (plotW * (t - t0)) / span;
    const y = (v) => PAD.top + plotH - (plotH * Math.min(v, top)) / top;

    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    ctx.fillText(`${Math.round(span / 1000)} s`, PAD.left, PAD.top + plotH + 6);
    ctx.textAlign = "right";
    ctx.fillText("now", PAD.left + plotW, PAD.top + plotH + 6);

    this.series.forEach((s, index) => {
      ctx.strokeStyle = cssVar(s.colorVar, "#06c");
      ctx.lineWidth = 2;
      ctx.beginPath();
      let drawing = false;
      for (const p of this.points) {
        const v = p.values[index];
        if (!Number.isFinite(v)) {
          drawing = false;
          continue;
        }
        if (drawing) ctx.lineTo(x(p.t), y(v));
        else ctx.moveTo(x(p.t), y(v));
        drawing = true;
      }
      ctx.stroke();
    });
  }
}
