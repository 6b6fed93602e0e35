// kvtier dashboard: polls the router's /dashboard/data feed and draws the fleet with plain SVG.
// Self-contained (no libraries, no network beyond the router). Every rendered figure also
// carries its raw value in a data-value attribute (the browser test reads them).
"use strict";

const FEED = "/dashboard/data";
const MAX_POINTS = 900;
const TIER_COLORS = { l0: "var(--l0)", l1: "var(--l1)", l2: "var(--l2)", computed: "var(--computed)" };
const PALETTE = ["#1e88e5", "#2e7d32", "#ef6c00", "#8e24aa", "#00897b", "#6d4c41", "#c62828"];
const SVG = "http://www.w3.org/2000/svg";
let points = [];
let lastOk = 0;

const $ = (id) => document.getElementById(id);

function fmtInt(v) { return v == null ? "–" : Math.round(v).toLocaleString("en-US"); }
function fmtPct(v) { return v == null ? "–" : (100 * v).toFixed(1) + "%"; }
function fmtMs(v) { return v == null ? "–" : v.toFixed(1) + " ms"; }
function fmtBytes(v) {
  if (v == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return (i ? v.toFixed(1) : String(Math.round(v))) + " " + units[i];
}
function fmtTime(t) { return new Date(t * 1000).toTimeString().slice(0, 8); }

function setValue(el, value, text) {
  el.textContent = text;
  el.dataset.value = value == null ? "" : String(value);
}

function el(tag, attrs, children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children || []) node.append(c);
  return node;
}

// ---- KPIs and fleet map ------------------------------------------------------------------

const KPI_FORMAT = {
  requests: fmtInt, errors: fmtInt, prompt_tokens: fmtInt, cached_tokens: fmtInt,
  ttft_p50_ms: fmtMs, ttft_p90_ms: fmtMs, cached_share: fmtPct, routing_accuracy: fmtPct,
};

function renderKpis(totals) {
  for (const node of document.querySelectorAll("[data-kpi]")) {
    const key = node.dataset.kpi;
    setValue(node, totals[key], KPI_FORMAT[key](totals[key]));
  }
}

function bar(label, used, capacity, color) {
  const share = capacity ? Math.min(1, used / capacity) : 0;
  const text = capacity ? fmtBytes(used) + " / " + fmtBytes(capacity) : "–";
  return el("div", { class: "bar" }, [
    el("span", {}, [label]),
    el("span", { class: "track" }, [el("span", { class: "fill", style: `display:block;width:${(100 * share).toFixed(1)}%;background:${color}` })]),
    el("span", { "data-field": label.toLowerCase() + "_occupancy", "data-value": String(share) }, [text]),
  ]);
}

function field(name, value, text) {
  const dd = el("dd", { "data-field": name, "data-value": value == null ? "" : String(value) }, [text]);
  return [el("dt", {}, [name.replace(/_/g, " ")]), dd];
}

function renderFleet(doc) {
  const root = $("fleet");
  root.replaceChildren();
  for (const r of doc.replicas) {
    const up = r.healthy;
    const holder = doc.l2 && doc.l2.lease_holder === r.name;
    const dl = el("dl", {}, [
      ...field("in_flight", r.in_flight, fmtInt(r.in_flight)),
      ...field("routed", r.routed, fmtInt(r.routed)),
      ...field("running", r.running, fmtInt(r.running)),
      ...field("waiting", r.waiting, fmtInt(r.waiting)),
      ...field("prompt_tokens", r.prompt_tokens, fmtInt(r.prompt_tokens)),
      ...field("cached_share", r.cached_share, fmtPct(r.cached_share)),
    ]);
    const mix = el("div", { class: "mix", title: "prompt tokens by tier (L0, L1, L2, computed)" });
    const tokens = r.tokens || {};
    const total = Object.values(tokens).reduce((a, b) => a + b, 0);
    for (const tier of ["l0", "l1", "l2", "computed"]) {
      const share = total ? (tokens[tier] || 0) / total : 0;
      mix.append(el("span", { "data-tier": tier, "data-value": String(tokens[tier] || 0), style: `width:${(100 * share).toFixed(2)}%;background:${TIER_COLORS[tier]}` }));
    }
    const l0 = r.l0_usage == null ? null : r.l0_usage;
    root.append(el("div", { class: "replica" + (up ? "" : " down"), "data-replica": r.name }, [
      el("span", { class: "badge", "data-field": "healthy", "data-value": String(up), "data-state": r.state }, [r.state]),
      el("div", { class: "name" }, [r.name + (holder ? "  ★ L2 janitor" : "") + (r.scraped ? "" : "  (metrics unreachable)")]),
      dl,
      bar("L0", l0 == null ? 0 : l0, l0 == null ? 0 : 1, "var(--l0)"),
      bar("L1", r.l1_used_bytes || 0, r.l1_capacity_bytes || 0, "var(--l1)"),
      mix,
    ]));
    if (l0 != null) root.lastChild.querySelector("[data-field=l0_occupancy]").textContent = fmtPct(l0) + " of engine cache";
  }
}

// ---- charts -------------------------------------------------------------------------------

function tick(v, ymax) {
  return v.toFixed(ymax >= 10 ? 0 : ymax >= 1 ? 1 : 2);
}

function chart(svg, series, opts) {
  const w = svg.clientWidth || 600, h = svg.clientHeight || 210;
  const pad = { l: 58, r: 10, t: 8, b: 22 };
  const yFormat = opts.yFormat || ((v) => tick(v, ymax));
  svg.replaceChildren();
  if (!series.length) return;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  const all = series.flatMap((s) => s.values.filter((p) => p[1] != null));
  const ts = points.map((p) => p.t);
  if (!ts.length) return;
  const t0 = ts[0], t1 = Math.max(ts[ts.length - 1], t0 + 1);
  let ymax = Math.max(1e-9, ...all.map((p) => p[1]), ...(opts.hlines || []).map((l) => l.value || 0));
  if (opts.stacked) {
    const sums = points.map((_, i) => series.reduce((a, s) => a + (s.values[i][1] || 0), 0));
    ymax = Math.max(1e-9, ...sums);
  }
  ymax *= 1.08;
  const x = (t) => pad.l + ((t - t0) / (t1 - t0)) * (w - pad.l - pad.r);
  const y = (v) => h - pad.b - (v / ymax) * (h - pad.t - pad.b);
  for (let i = 0; i <= 4; i += 1) {
    const v = (ymax * i) / 4;
    svg.append(el("svg:line", { class: "grid", x1: pad.l, x2: w - pad.r, y1: y(v), y2: y(v) }));
    svg.append(el("svg:text", { x: pad.l - 4, y: y(v) + 4, "text-anchor": "end" }, [yFormat(v)]));
  }
  for (let i = 0; i <= 3; i += 1) {
    const t = t0 + ((t1 - t0) * i) / 3;
    svg.append(el("svg:text", { x: x(t), y: h - 6, "text-anchor": i === 0 ? "start" : i === 3 ? "end" : "middle" }, [fmtTime(t)]));
  }
  const base = points.map(() => 0);
  for (const s of series) {
    const pts = [];
    s.values.forEach(([t, v], i) => {
      if (v == null) return;
      const top = opts.stacked ? base[i] + v : v;
      pts.push([x(t), y(top), y(base[i])]);
      if (opts.stacked) base[i] = top;
    });
    if (!pts.length) continue;
    if (opts.stacked) {
      const d = "M" + pts.map((p) => `${p[0].toFixed(1)},${p[1].toFixed(1)}`).join("L") + "L" + pts.slice().reverse().map((p) => `${p[0].toFixed(1)},${p[2].toFixed(1)}`).join("L") + "Z";
      svg.append(el("svg:path", { d, fill: s.color, "fill-opacity": "0.85", stroke: "none", "data-series": s.name }));
    } else if (s.bars) {
      const bw = Math.max(2, (w - pad.l - pad.r) / Math.max(points.length, 1) - 1);
      for (const p of pts) svg.append(el("svg:rect", { x: p[0] - bw / 2, y: p[1], width: bw, height: Math.max(0, h - pad.b - p[1]), fill: s.color, "data-series": s.name }));
    } else {
      const d = "M" + pts.map((p) => `${p[0].toFixed(1)},${p[1].toFixed(1)}`).join("L");
      svg.append(el("svg:path", { d, fill: "none", stroke: s.color, "stroke-width": 2, "data-series": s.name }));
    }
  }
  for (const line of opts.hlines || []) {
    if (line.value == null) continue;
    svg.append(el("svg:line", { x1: pad.l, x2: w - pad.r, y1: y(line.value), y2: y(line.value), stroke: line.color, "stroke-dasharray": "5 4", "data-series": line.name }));
  }
}

function legend(id, entries) {
  $(id).replaceChildren(...entries.map(([name, color, text]) => el("span", { "data-legend": name }, [el("i", { style: `background:${color}` }), text])));
}

function series(key, sub) {
  return points.map((p) => [p.t, sub === undefined ? (p[key] ?? null) : (p[key] ? (p[key][sub] ?? 0) : null)]);
}

function renderCharts(doc) {
  const latest = points.length ? points[points.length - 1] : {};
  const tiers = ["l0", "l1", "l2", "computed"];
  chart($("chart-tiers"), tiers.map((t) => ({ name: t, color: TIER_COLORS[t], values: series("tokens_per_s", t) })), { stacked: true });
  const served = (doc.totals.tokens || {});
  legend("legend-tiers", tiers.map((t) => [t, TIER_COLORS[t], `${t.toUpperCase()} ${fmtInt(served[t])} tokens`]));

  chart($("chart-ttft"), [
    { name: "p50", color: PALETTE[0], values: series("ttft_p50_ms") },
    { name: "p90", color: PALETTE[2], values: series("ttft_p90_ms") },
  ], {});
  legend("legend-ttft", [["p50", PALETTE[0], "p50 " + fmtMs(latest.ttft_p50_ms)], ["p90", PALETTE[2], "p90 " + fmtMs(latest.ttft_p90_ms)]]);
  $("ttft-window").textContent = String(doc.ttft_window_s);

  const reasons = Object.keys(doc.decisions).sort();
  chart($("chart-decisions"), reasons.map((r, i) => ({ name: r, color: PALETTE[i % PALETTE.length], values: series("decisions_per_s", r) })), {});
  legend("legend-decisions", reasons.map((r, i) => [r, PALETTE[i % PALETTE.length], `${r} ${fmtInt(doc.decisions[r])}`]));
  const totals = $("decision-totals");
  setValue(totals, reasons.reduce((a, r) => a + doc.decisions[r], 0), reasons.map((r) => `${r} ${fmtInt(doc.decisions[r])}`).join(" · ") || "none yet");

  const l2 = doc.l2;
  const summary = $("l2-summary");
  if (!l2) {
    setValue(summary, null, "no shared L2 capacity reported");
    chart($("chart-l2"), [], {});
    legend("legend-l2", []);
    return;
  }
  setValue(summary, l2.used_bytes, `${fmtBytes(l2.used_bytes)} of ${fmtBytes(l2.capacity_bytes)} · ${fmtInt(l2.blocks)} blocks · ${fmtInt(l2.evicted_blocks)} evicted · janitor ${l2.lease_holder || "none"}`);
  const evictions = points.map((p) => [p.t, p.l2_evicted_blocks ?? null]);
  const maxEv = Math.max(1, ...evictions.map((e) => e[1] || 0));
  chart($("chart-l2"), [
    { name: "evicted", color: "var(--warn)", bars: true, values: evictions.map(([t, v]) => [t, v == null ? null : (v / maxEv) * l2.capacity_bytes * 0.25]) },
    { name: "used", color: PALETTE[3], values: series("l2_used_bytes") },
  ], { yFormat: fmtBytes, hlines: [
    { name: "capacity", value: l2.capacity_bytes, color: "var(--fg)" },
    { name: "high", value: l2.high_bytes, color: "var(--bad)" },
    { name: "low", value: l2.low_bytes, color: "var(--l0)" },
  ] });
  legend("legend-l2", [["used", PALETTE[3], "used " + fmtBytes(l2.used_bytes)], ["capacity", "var(--fg)", "capacity"], ["high", "var(--bad)", "high watermark"], ["low", "var(--l0)", "low watermark"], ["evicted", "var(--warn)", `evictions (scaled, max ${fmtInt(maxEv)} blocks/sample)`]]);
}

// ---- polling ------------------------------------------------------------------------------

function ingest(doc) {
  const seen = new Set(points.map((p) => p.t));
  for (const p of doc.series) if (!seen.has(p.t)) points.push(p);
  points.sort((a, b) => a.t - b.t);
  if (points.length > MAX_POINTS) points = points.slice(points.length - MAX_POINTS);
}

function render(doc) {
  $("strategy").textContent = doc.strategy;
  setValue($("updated"), doc.time, fmtTime(doc.time));
  renderKpis(doc.totals);
  renderFleet(doc);
  renderCharts(doc);
  document.body.dataset.time = String(doc.time);
}

async function poll(path) {
  try {
    const resp = await fetch(path, { cache: "no-store" });
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const doc = await resp.json();
    ingest(doc);
    render(doc);
    lastOk = Date.now();
    $("status").textContent = "live";
    $("status").className = "status ok";
    return doc;
  } catch (err) {
    $("status").textContent = err instanceof TypeError && /fetch/i.test(err.message) ? "router unreachable" : "error";
    $("status").className = "status stale";
    $("status").dataset.error = String(err && err.stack || err);
    return null;
  }
}

async function main() {
  const doc = await poll(FEED);
  const every = 1000 * ((doc && doc.interval_s) || 1);
  setInterval(() => poll(FEED + "/latest"), every);
  setInterval(() => { if (Date.now() - lastOk > 5 * every) $("status").className = "status stale"; }, every);
}

main();
