// halfmoon's live cluster page: reads dashboard/state every 2 s and draws the worker
// tiles, the time series (on <canvas>, no library) and the Conductor's decisions.
// Text from the server only ever goes in through textContent, never as HTML.
"use strict";

const REFRESH_MS = 2000;
const KEY_STORE = "halfmoon-api-key";
const COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#b07aa1"];
const SLO_COLOR = "#c0392b";
// Each chart: its series columns [column, label], a unit, and the SLO it is held to.
const CHARTS = [
  { id: "rate", title: "Requests per second", unit: "/s",
    lines: [["requests_per_s", "finished"], ["rejected_per_s", "rejected"],
            ["errors_per_s", "failed"]] },
  { id: "ttft", title: "Time to first token", unit: "s", slo: "ttft_s",
    lines: [["ttft_p50_s", "p50"], ["ttft_p90_s", "p90"], ["ttft_p99_s", "p99"]] },
  { id: "tbt", title: "Time between tokens (inter-token gaps)", unit: "s", slo: "tbt_s",
    lines: [["itl_p50_s", "p50"], ["itl_p90_s", "p90"], ["itl_p99_s", "p99"]] },
  { id: "hit", title: "Prefix-cache hit ratio", unit: "ratio", max: 1,
    lines: [["prefix_hit_ratio", "cached / prompt tokens"]] },
  { id: "kv", title: "KV bytes moved between workers", unit: "B/s",
    lines: [["kv_bytes_per_s", "bytes/s"]] },
  { id: "tokens", title: "Generated tokens per second", unit: "/s",
    lines: [["tokens_per_s", "tokens/s"]] },
];

// -- small helpers --------------------------------------------------------------------------
function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-") || k === "title") node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

function fmtSeconds(s) {
  if (s == null) return "–";
  if (s < 1e-3) return `${(s * 1e6).toFixed(0)} µs`;
  if (s < 1) return `${(s * 1e3).toFixed(s < 0.01 ? 2 : 1)} ms`;
  if (s < 120) return `${s.toFixed(2)} s`;
  return `${(s / 60).toFixed(1)} min`;
}

function fmtNumber(v, unit) {
  if (v == null) return "–";
  if (unit === "s") return fmtSeconds(v);
  if (unit === "ratio") return `${(v * 100).toFixed(0)}%`;
  const scales = unit === "B/s" ? [[1 << 30, " GiB"], [1 << 20, " MiB"], [1 << 10, " KiB"]]
                                : [[1e9, "G"], [1e6, "M"], [1e3, "k"]];
  for (const [div, suffix] of scales) if (Math.abs(v) >= div) return (v / div).toFixed(1) + suffix;
  const digits = Math.abs(v) < 10 && v !== Math.round(v) ? 2 : 0;
  return v.toFixed(digits) + (unit === "B/s" ? " B" : "");
}

function fmtUptime(s) {
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = Math.floor(s % 60);
  return h ? `${h}h ${m}m` : m ? `${m}m ${sec}s` : `${sec}s`;
}

function badge(text, cls = text) {
  return el("span", { class: `badge ${cls}`, text });
}

function row(label, value) {
  return el("div", { class: "row" }, el("span", { text: label }), el("span", { text: value }));
}

function bar(used, capacity) {
  const fraction = capacity > 0 ? Math.min(1, used / capacity) : 0;
  const fill = el("span", { class: fraction > 0.9 ? "high" : "" });
  fill.style.width = `${(fraction * 100).toFixed(1)}%`;
  return el("div", { class: "bar", title: `${used} / ${capacity}` }, fill);
}

// -- tiles ----------------------------------------------------------------------------------
function storeRows(store) {
  // Tiers with occupancy figures (<tier>_blocks, <tier>_capacity_blocks) get a bar; every
  // other counter is listed as it came.
  const out = [];
  const shown = new Set();
  for (const tier of ["dram", "ssd"]) {
    const used = store[`${tier}_blocks`], cap = store[`${tier}_capacity_blocks`];
    if (used != null && cap) {
      out.push(row(`store ${tier}`, `${used} / ${cap} blocks`), bar(used, cap));
      shown.add(`${tier}_blocks`).add(`${tier}_capacity_blocks`);
    } else if (cap === 0) {  // a tier this worker does not have (no --store-ssd-mb)
      for (const k of Object.keys(store)) if (k.startsWith(`${tier}_`)) shown.add(k);
    }
  }
  const rest = Object.entries(store).filter(([k]) => !shown.has(k));
  if (rest.length) out.push(row("store", rest.map(([k, v]) => `${k.replace(/_/g, " ")} ${v}`).join(" · ")));
  return out;
}

function workerTile(w) {
  const proc = w.process || {};
  const tile = el("div", { class: `tile role-${w.role}`, "data-testid": "worker-tile",
                           "data-worker": w.instance_id, "data-role": w.role,
                           "data-state": w.state },
    el("div", { class: "head" },
      el("span", { class: "name", text: w.instance_id }),
      el("span", { class: "role", "data-testid": "worker-role", text: w.role }),
      el("span", { "data-testid": "worker-state" }, badge(w.state))));
  if (w.registered) {
    tile.append(
      row("running · waiting", `${w.num_running} · ${w.num_waiting}`),
      ...(w.role === "decode" ? [] : [row("est. queue", fmtSeconds(w.est_queue_s))]),
      row("KV pool", `${w.kv_used_tokens} / ${w.kv_capacity_tokens} tokens`),
      bar(w.kv_used_tokens, w.kv_capacity_tokens),
      ...storeRows(w.store || {}),
      row("prefix index", `${w.index_blocks} blocks`),
      row("last heard", `${fmtSeconds(w.seen_s_ago)} ago`));
  } else {
    tile.append(row("Conductor", "not registered"));
  }
  if (proc.pid != null) tile.append(row("process", `pid ${proc.pid} · ${proc.num_restarts} restarts`));
  return tile;
}

function conductorTile(c, state) {
  const integrity = c.integrity || "";
  const health = !c.reachable ? (state.clustered ? "unreachable" : "in-process")
               : integrity.startsWith("broken") ? "broken" : "ok";
  const tile = el("div", { class: "tile role-conductor", "data-testid": "conductor-tile",
                           "data-state": health },
    el("div", { class: "head" },
      el("span", { class: "name", text: "Conductor" }),
      el("span", { class: "role", text: c.policy || "" }),
      badge(c.process && c.process.state === "restarting" ? "restarting" : health)));
  if (!c.reachable) {
    tile.append(row("", c.error || "no cluster behind this gateway"));
    return tile;
  }
  const slo = c.slo || {};
  const rejected = Object.entries(c.recent_rejections || {});
  const bal = c.balancing || {};
  tile.append(
    row("placed, not finished", `${c.num_placements}`),
    row("instances", `${c.num_instances} (${(c.draining || []).length} draining)`),
    row("SLO TTFT · TBT", `${fmtSeconds(slo.ttft_s)} · ${fmtSeconds(slo.tbt_s)}`),
    row("balancing", `${bal.mode || "–"} · threshold ${bal.threshold ?? "–"}`),
    row(`last ${c.num_recent_decisions} decisions`,
        rejected.length ? `rejected: ${rejected.map(([k, n]) => `${k} ${n}`).join(", ")}`
                        : "none rejected"),
    row("mean decision time", fmtSeconds(c.mean_decision_s)),
    row("integrity", integrity));
  return tile;
}

function gatewayTile(state) {
  const g = state.gateway;
  const tile = el("div", { class: "tile role-gateway", "data-testid": "gateway-tile" },
    el("div", { class: "head" }, el("span", { class: "name", text: "Gateway" }), badge("ok")),
    row("requests in flight", `${g.in_flight} / ${g.max_concurrent_requests}`),
    row("model", state.model),
    row("weights", g.weight_version === "default" ? "as started" : `version ${g.weight_version}`),
    row("up", fmtUptime(state.uptime_s)));
  if (g.paused) tile.append(row("generation", "paused"));
  const last = (state.replan || [])[0];
  if (last) {  // --replan: the latest round
    tile.append(row("re-planning", last.target ? `${last.split} → ${last.target}`
                                               : `${last.split} stays`));
  }
  return tile;
}

function renderTiles(state) {
  const tiles = [gatewayTile(state), conductorTile(state.conductor, state)];
  for (const w of state.workers) tiles.push(workerTile(w));
  document.getElementById("tiles").replaceChildren(...tiles);
}

// -- charts ---------------------------------------------------------------------------------
function chartBox(spec) {
  let box = document.getElementById(`chart-${spec.id}`);
  if (box) return box;
  const legend = el("div", { class: "legend" });
  spec.lines.forEach(([, label], i) => {
    const swatch = el("i");
    swatch.style.background = COLORS[i % COLORS.length];
    legend.append(el("span", {}, swatch, label));
  });
  if (spec.slo) legend.append(el("span", {}, el("i", { class: "dashed" }), "SLO"));
  box = el("div", { class: "chart", id: `chart-${spec.id}`, "data-testid": `chart-${spec.id}`,
                    "data-points": "0" },
    el("h3", { text: spec.title }), el("canvas"), legend);
  document.getElementById("charts").append(box);
  return box;
}

function drawChart(spec, series, slo) {
  const box = chartBox(spec);
  const canvas = box.querySelector("canvas");
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = Math.round(w * dpr);
  canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const ts = series.t_s || [];
  const lines = spec.lines.map(([col]) => series[col] || []);
  const values = lines.flat().filter((v) => v != null);
  box.setAttribute("data-points", String(values.length));
  const sloValue = spec.slo && slo ? slo[spec.slo] : null;
  let top = spec.max ?? Math.max(...values, 0) * 1.15;
  // The SLO line shows when it is near the data; far above, the legend says where it is.
  if (sloValue != null && (top === 0 || sloValue <= top * 4)) top = Math.max(top, sloValue * 1.1);
  if (!(top > 0)) top = 1;
  const pad = { l: 58, r: 8, t: 8, b: 20 };
  const span = Math.max(60, ts.length ? -ts[0] + series.bucket_s : 60);
  const x = (t) => pad.l + (w - pad.l - pad.r) * (1 + t / span);
  const y = (v) => h - pad.b - (h - pad.t - pad.b) * (v / top);
  drawAxes(ctx, spec, w, h, pad, top, span, x, y);
  if (sloValue != null && sloValue <= top) {
    ctx.save();
    ctx.strokeStyle = SLO_COLOR;
    ctx.setLineDash([6, 4]);
    ctx.beginPath(); ctx.moveTo(pad.l, y(sloValue)); ctx.lineTo(w - pad.r, y(sloValue)); ctx.stroke();
    ctx.fillStyle = SLO_COLOR;
    ctx.fillText(`SLO ${fmtNumber(sloValue, spec.unit)}`, pad.l + 4, y(sloValue) - 4);
    ctx.restore();
  } else if (sloValue != null) {
    ctx.fillStyle = SLO_COLOR;
    ctx.fillText(`SLO ${fmtNumber(sloValue, spec.unit)} (above)`, pad.l + 4, pad.t + 10);
  }
  // Each bucket's value sits at the bucket's middle; a gap (null) breaks the line.
  const mid = (series.bucket_s || 0) / 2;
  lines.forEach((vals, i) => {
    ctx.strokeStyle = ctx.fillStyle = COLORS[i % COLORS.length];
    ctx.lineWidth = 1.8;
    ctx.beginPath();
    let open = false;
    vals.forEach((v, j) => {
      if (v == null) { open = false; return; }
      const px = x(Math.min(0, ts[j] + mid)), py = y(v);
      if (open) ctx.lineTo(px, py); else ctx.moveTo(px, py);
      open = true;
      if ((j === 0 || vals[j - 1] == null) && (j + 1 >= vals.length || vals[j + 1] == null)) {
        ctx.fillRect(px - 2, py - 2, 4, 4);  // a lone point
      }
    });
    ctx.stroke();
  });
}

function drawAxes(ctx, spec, w, h, pad, top, span, x, y) {
  ctx.font = "11px system-ui, sans-serif";
  ctx.strokeStyle = "#e3e6ec";
  ctx.fillStyle = "#6b7385";
  ctx.lineWidth = 1;
  for (let k = 0; k <= 4; k++) {
    const v = (top * k) / 4;
    ctx.beginPath(); ctx.moveTo(pad.l, y(v)); ctx.lineTo(w - pad.r, y(v)); ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(fmtNumber(v, spec.unit), pad.l - 5, y(v) + 4);
  }
  const step = span > 300 ? 120 : span > 120 ? 60 : 15;
  for (let t = 0; t <= span; t += step) {
    ctx.textAlign = t === 0 ? "right" : "center";
    ctx.fillText(t === 0 ? "now" : `-${t >= 60 ? `${t / 60}m` : `${t}s`}`, x(-t), h - 5);
  }
  ctx.textAlign = "left";
}

function renderCharts(state) {
  const series = state.series;
  document.getElementById("window").textContent =
    `(the gateway's ${series.bucket_s}s buckets, up to ${series.window_s / 60} min)`;
  for (const spec of CHARTS) drawChart(spec, series, state.slo);
}

// -- decisions ------------------------------------------------------------------------------
const toggled = new Map();  // request id -> open (what the user chose; the newest opens itself)

function decisionRows(d, newest) {
  const open = toggled.has(d.request_id) ? toggled.get(d.request_id) : newest;
  const outcome = d.accepted ? badge("accepted") : badge(`rejected: ${d.reject_code || "?"}`, "rejected");
  const placement = d.accepted ? `${d.prefill} → ${d.decode}` : "–";
  const why = d.accepted ? d.why : d.reject_reason || d.why;
  const main = el("tr", { class: "decision", "data-testid": "decision-row",
                          "data-request": d.request_id, "data-accepted": String(d.accepted) },
    el("td", { text: new Date(d.at_s * 1000).toLocaleTimeString() }),
    el("td", { class: "mono", text: d.request_id }),
    el("td", {}, outcome),
    el("td", { class: "mono", text: placement }),
    el("td", { text: d.cached_tokens == null ? "–" : `${d.cached_tokens} tokens` }),
    el("td", { text: fmtSeconds(d.est_ttft_s) }),
    el("td", { text: fmtSeconds(d.est_tbt_s) }),
    el("td", { text: fmtSeconds(d.decision_s) }),
    el("td", { "data-testid": "decision-why", text: why }));
  const detail = el("tr", { class: "detail", hidden: !open },
    el("td", { colSpan: 9 }, el("pre", { "data-testid": "decision-explain", text: d.explain })));
  main.addEventListener("click", () => {
    toggled.set(d.request_id, detail.hidden);
    detail.hidden = !detail.hidden;
  });
  return [main, detail];
}

function renderDecisions(decisions) {
  const rows = decisions.flatMap((d, i) => decisionRows(d, i === 0));
  document.getElementById("decisions").replaceChildren(...rows);
  document.getElementById("nodecisions").hidden = decisions.length > 0;
}

// -- the loop -------------------------------------------------------------------------------
function setStatus(text, cls) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = `status ${cls}`;
}

function render(state) {
  document.getElementById("model").textContent = state.model;
  const up = state.workers.filter((w) => w.state === "healthy").length;
  document.getElementById("summary").textContent =
    `${up} of ${state.workers.length} workers healthy · up ${fmtUptime(state.uptime_s)}`;
  renderTiles(state);
  renderCharts(state);
  renderDecisions(state.decisions);
}

async function refresh() {
  const key = sessionStorage.getItem(KEY_STORE);
  const headers = key ? { Authorization: `Bearer ${key}` } : {};
  try {
    const r = await fetch("dashboard/state", { headers, cache: "no-store" });
    if (r.status === 401) {
      document.getElementById("keyform").hidden = false;
      setStatus(key ? "API key refused" : "API key needed", "bad");
      return;
    }
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    document.getElementById("keyform").hidden = true;
    render(await r.json());
    setStatus(`live · ${new Date().toLocaleTimeString()}`, "ok");
  } catch (err) {
    setStatus(`gateway unreachable (${err.message})`, "bad");
  }
}

async function loop() {
  await refresh();
  setTimeout(loop, REFRESH_MS);
}

document.getElementById("keyform").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORE, document.getElementById("key").value.trim());
  refresh();
});
loop();
