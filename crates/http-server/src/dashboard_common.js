// Shared by the gateway's and the worker's status pages (each page's script starts
// with it): the poll loop, number formatting and the SVG line charts. A page defines
// `render(data)` and calls `poll()`; its HTML has the `live-dot`/`live-text` status and,
// per chart `c-NAME`, a legend `l-NAME`.
"use strict";
const DATA_URL = location.pathname.replace(/\/+$/, "") + "/data";
const MAX_WINDOW_S = 300, MIN_WINDOW_S = 60;
// The charts span the data they have: from a minute up to five.
function windowOf(samples, nowMs) {
  const oldest = samples.length ? samples[0].t_ms : nowMs;
  return Math.min(MAX_WINDOW_S, Math.max(MIN_WINDOW_S, Math.ceil((nowMs - oldest) / 1000))) * 1000;
}
function tickLabel(s) { return s === 0 ? "now" : s % 60 === 0 ? `-${s / 60}m` : `-${s}s`; }
const COLORS = ["var(--c1)", "var(--c2)", "var(--c3)", "var(--c4)"];
const $ = (id) => document.getElementById(id);

function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
function fmt(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (digits === undefined) digits = v >= 100 ? 0 : v >= 10 ? 1 : 2;
  return Number(v).toFixed(digits);
}
// A round step for four grid lines that cover `v`.
function niceStep(v) {
  const raw = v > 0 ? v / 4 : 0.25;
  const p = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}

// One line chart: `series` is [{name, values: [[t_ms, v|null]...]}]; nulls are skipped
// (the line joins the seconds that had data).
function drawChart(id, series, nowMs, windowMs) {
  const svg = $(id), W = Math.max(300, Math.round(svg.clientWidth || 600)), H = 150, L = 44, R = 10, T = 8, B = 18;
  let max = 0;
  for (const s of series) for (const [, v] of s.values) if (v !== null && v > max) max = v;
  const step = niceStep(max);
  max = step * 4;
  const x = (t) => L + (W - L - R) * (1 - (nowMs - t) / windowMs);
  const y = (v) => T + (H - T - B) * (1 - v / max);
  let out = "";
  for (let i = 0; i <= 4; i++) {
    const v = step * i, yy = y(v);
    out += `<line class="grid" x1="${L}" x2="${W - R}" y1="${yy}" y2="${yy}"/>`;
    out += `<text class="axis" x="${L - 5}" y="${yy + 3}" text-anchor="end">${fmt(v, Number.isInteger(step) ? 0 : step >= 1 ? 1 : 2)}</text>`;
  }
  const span = windowMs / 1000, tick = [10, 15, 30, 60, 120].find((st) => span / st <= 6) || 60;
  for (let s = 0; s <= span; s += tick) {
    const anchor = s === 0 ? "end" : s + tick > span ? "start" : "middle";
    out += `<text class="axis" x="${x(nowMs - s * 1000)}" y="${H - 4}" text-anchor="${anchor}">${tickLabel(s)}</text>`;
  }
  let most = 0;
  series.forEach((s, i) => {
    const pts = s.values.filter(([t, v]) => v !== null && nowMs - t <= windowMs)
      .map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`);
    most = Math.max(most, pts.length);
    // A lone point still shows: a polyline needs two.
    const drawn = pts.length === 1 ? [pts[0], pts[0].replace(/^([\d.]+)/, (m) => (parseFloat(m) + 2).toFixed(1))] : pts;
    out += `<polyline data-series="${esc(s.name)}" data-points="${pts.length}" stroke="${COLORS[i % COLORS.length]}" points="${drawn.join(" ")}"/>`;
  });
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.innerHTML = out;
  svg.setAttribute("data-points", String(most));
  $("l" + id.slice(1)).innerHTML = series.map((s, i) => `<span style="--sw:${COLORS[i % COLORS.length]}">${esc(s.name)}</span>`).join("");
}

async function poll() {
  try {
    const res = await fetch(DATA_URL, {cache: "no-store"});
    if (!res.ok) throw new Error("HTTP " + res.status);
    render(await res.json());
    $("live-dot").className = "dot on";
    $("live-text").textContent = "live · " + new Date().toLocaleTimeString([], {hour12: false});
  } catch (e) {
    $("live-dot").className = "dot off";
    $("live-text").textContent = "no data: " + e.message;
  }
  setTimeout(poll, 1000);
}
