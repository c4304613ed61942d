// luban cluster dashboard: plain JS + inline SVG, no external resources.
"use strict";
const params = new URLSearchParams(location.search);
if (params.get("token")) {
  localStorage.setItem("luban-token", params.get("token"));
  history.replaceState(null, "", location.pathname + location.hash);
}
const token = () => localStorage.getItem("luban-token");
const SVGNS = "http://www.w3.org/2000/svg";

async function api(path) {
  const r = await fetch("/api" + path, { headers: { Authorization: "Bearer " + token() } });
  if (r.status === 401) { localStorage.removeItem("luban-token"); showLogin(); throw new Error("bad token"); }
  if (!r.ok) throw new Error(path + ": HTTP " + r.status);
  return r.json();
}

function el(tag, attrs = {}, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVGNS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function table(id, columns, rows) {
  const t = document.getElementById(id);
  t.replaceChildren();
  const head = el("tr");
  columns.forEach(([title]) => head.append(el("th", {}, title)));
  t.append(head);
  if (!rows.length) { const tr = el("tr"); tr.append(el("td", { colspan: columns.length }, "none")); t.append(tr); }
  rows.forEach(r => {
    const tr = el("tr");
    columns.forEach(([, f]) => { const v = f(r); const td = el("td"); td.append(v instanceof Node ? v : String(v)); tr.append(td); });
    t.append(tr);
  });
}

function jobLink(id) { return el("a", { href: "#job/" + id, class: "job-link" }, String(id)); }

function hhmm(t) { return new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }); }

// samples: [{...}]; xOf: sample -> x value (time in s, or step); series: [color, value(sample), css class]
function clock(span) {  // seconds shown when the chart spans less than 10 minutes
  return t => new Date(t * 1000).toLocaleTimeString([], span < 600 ? { hour: "2-digit", minute: "2-digit", second: "2-digit" }
                                                                 : { hour: "2-digit", minute: "2-digit" });
}

function lineChart(svg, samples, series, yMax, yLabel, xOf = s => s.t, xLabel = null, xTitle = "time") {
  const W = 600, H = 220, L = 48, R = 12, T = 10, B = 36;
  svg.replaceChildren();
  const xs = samples.map(xOf), x0 = xs.length ? Math.min(...xs) : 0, x1 = xs.length ? Math.max(...xs) : 1;
  xLabel = xLabel || clock(x1 - x0);
  const x = v => L + (W - L - R) * (x1 > x0 ? (v - x0) / (x1 - x0) : 1);
  const y = v => H - B - (H - T - B) * Math.min(1, Math.max(0, v) / (yMax || 1));
  for (let i = 0; i <= 4; i++) {
    const v = yMax * i / 4;
    svg.append(el("svg:line", { x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#e3e6eb" }));
    svg.append(el("svg:text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, yLabel(v)));
  }
  for (let i = 0; i <= 4; i++) {  // five ticks along x, readable labels, and the axis' name
    const v = x0 + (x1 - x0) * i / 4;
    svg.append(el("svg:line", { x1: x(v), x2: x(v), y1: H - B, y2: H - B + 4, stroke: "#9aa3b1" }));
    svg.append(el("svg:text", { x: x(v), y: H - B + 16, "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle" },
      xLabel(v)));
  }
  svg.append(el("svg:text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", class: "axis-title" }, xTitle));
  for (const [color, value, cls, dash] of series) {
    const pts = samples.filter(s => Number.isFinite(value(s)));
    const points = pts.map(s => x(xOf(s)).toFixed(1) + "," + y(value(s)).toFixed(1)).join(" ");
    const attrs = { points, fill: "none", stroke: color, "stroke-width": 2, class: cls };
    if (dash) attrs["stroke-dasharray"] = "6 4";
    svg.append(el("svg:polyline", attrs));
  }
}

const PALETTE = ["#3f7fbf", "#2f8f5b", "#d08a1e", "#7a4fb5", "#b23b3b", "#4aa3a3", "#9aa3b1"];

function usageBars(svg, legend, days) {
  const W = 600, H = 220, L = 48, R = 12, T = 10, B = 36;
  svg.replaceChildren(); legend.replaceChildren();
  const users = [...new Set(days.flatMap(d => Object.keys(d.users)))].sort();
  const totals = days.map(d => Object.values(d.users).reduce((a, b) => a + b, 0));
  const max = Math.max(1e-9, ...totals), bw = (W - L - R) / Math.max(1, days.length);
  for (let i = 0; i <= 4; i++) {
    const v = max * i / 4, yy = H - B - (H - T - B) * i / 4;
    svg.append(el("svg:line", { x1: L, x2: W - R, y1: yy, y2: yy, stroke: "#e3e6eb" }));
    svg.append(el("svg:text", { x: L - 6, y: yy + 4, "text-anchor": "end" }, v >= 10 ? v.toFixed(0) : v === 0 ? "0" : v.toPrecision(2)));
  }
  days.forEach((d, i) => {
    let base = H - B;
    users.forEach((u, k) => {
      const h = (H - T - B) * (d.users[u] || 0) / max;
      if (h > 0) svg.append(el("svg:rect", { x: L + i * bw + 4, y: base - h, width: bw - 8, height: h,
        fill: PALETTE[k % PALETTE.length], class: "usage-bar", "data-user": u }));
      base -= h;
    });
    svg.append(el("svg:text", { x: L + i * bw + bw / 2, y: H - B + 16, "text-anchor": "middle" }, d.day.slice(5)));
  });
  svg.append(el("svg:text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, "day (MM-DD), node-hours"));
  users.forEach((u, k) => { const s = el("span"); s.append(el("i", { style: "background:" + PALETTE[k % PALETTE.length] }), u); legend.append(s); });
}

function quotaBars(svg, quotas) {
  const rowH = 22, W = 900, L = 260, max = Math.max(1, ...quotas.map(q => Math.max(q.nodes, q.used)));
  svg.setAttribute("viewBox", `0 0 ${W} ${Math.max(1, quotas.length) * rowH + 8}`);
  svg.setAttribute("height", Math.max(1, quotas.length) * rowH + 8);
  svg.replaceChildren();
  quotas.forEach((q, i) => {
    const yy = 4 + i * rowH, w = (W - L - 80) / max;
    svg.append(el("svg:text", { x: L - 8, y: yy + 14, "text-anchor": "end" }, `${q.owner} · ${q.node_group} · ${q.priority_name}`));
    svg.append(el("svg:rect", { x: L, y: yy + 3, width: q.nodes * w, height: 14, fill: "#e3e6eb" }));
    svg.append(el("svg:rect", { x: L, y: yy + 3, width: q.used * w, height: 14, fill: q.used >= q.nodes ? "#d08a1e" : "#3f7fbf", class: "used" }));
    svg.append(el("svg:text", { x: L + Math.max(q.nodes, q.used) * w + 6, y: yy + 14 }, `${q.used} / ${q.nodes} nodes`));
  });
}

async function refresh() {
  try {
    // live jobs: bounded by --max-queued per user, asked for up to the API's maximum (10000) so the queue
    // and its counts are whole; finished attempts: the newest 100 by id, of which the 30 that ended last
    const [who, nodes, jobs, quota, samples] = await Promise.all([
      api("/whoami"), api("/nodes"), api("/jobs?state=queued,starting,running,suspending&limit=10000"), api("/quota"),
      api("/samples?since=" + (Date.now() / 1000 - 6 * 3600))]);
    if (location.hash.startsWith("#job/")) return;
    document.getElementById("who").textContent = who.user + (who.admin ? " (admin)" : "") + (who.group ? " · group " + who.group : "");
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    const up = nodes.filter(n => n.state === "up").length, held = nodes.filter(n => n.job).length;
    // in service: up, or held by a job (a node drained under its job, by an admin or in Slurm, runs it on)
    const inService = nodes.filter(n => n.state === "up" || n.job).length;
    const running = nodes.filter(n => n.job && n.job.state === "running").length;
    const queued = jobs.filter(j => j.state === "queued");
    const cards = document.getElementById("cards");
    cards.replaceChildren();
    [["nodes up", up + " / " + nodes.length], ["nodes held", held],
     ["occupancy", inService ? Math.round(100 * held / inService) + "%" : "-"],
     ["utilisation", inService ? Math.round(100 * running / inService) + "%" : "-"], ["running jobs", jobs.filter(j => j.state === "running").length],
     ["queued jobs", queued.length]].forEach(([k, v]) => { const c = el("div", { class: "card" }); c.append(el("b", {}, String(v)), k); cards.append(c); });
    lineChart(document.getElementById("occupancy"), samples, [["#3f7fbf", s => s.held / Math.max(1, s.nodes), "occupancy"],
      ["#2f8f5b", s => s.running / Math.max(1, s.nodes), "utilisation"]], 1, v => Math.round(v * 100) + "%");
    lineChart(document.getElementById("queue-chart"), samples, [["#d08a1e", s => s.queued, "queued"]],
      Math.max(4, ...samples.map(s => s.queued)), v => String(Math.round(v)));
    const grid = document.getElementById("nodes");
    grid.replaceChildren();
    nodes.forEach(n => {
      const box = el("div", { class: "node " + (n.job ? n.job.state : n.state === "up" ? "free" : "drain"), "data-node": n.name });
      box.append(el("b", {}, n.name), `${n.node_group} · ${n.labels.zone || "-"} · ${n.gpus} GPU`);
      box.append(el("div", {}, n.job ? `job ${n.job.id} ${n.job.user} ${n.job.name} (${n.job.state})` : n.state === "up" ? "free" : n.state));
      if (n.why) box.append(el("div", {}, n.why));  // why the executor starts no job there (slurm: drained (...))
      grid.append(box);
    });
    queued.sort((a, b) => b.priority - a.priority || a.place - b.place);
    table("queue", [["job", j => jobLink(j.id)], ["user", j => j.user], ["name", j => j.name], ["priority", j => j.priority_name],
      ["nodes", j => j.nnodes], ["restarts", j => j.restart_count], ["why waiting", j => j.reason]], queued);
    table("running", [["job", j => jobLink(j.id)], ["user", j => j.user], ["name", j => j.name], ["priority", j => j.priority_name],
      ["state", j => j.state], ["nodes", j => j.nodes.join(",")], ["since", j => new Date(j.started_at * 1000).toLocaleTimeString()]],
      jobs.filter(j => j.state !== "queued"));
    quotaBars(document.getElementById("quota"), quota);
    const [finished, daily] = await Promise.all([api("/jobs?all=true&state=succeeded,failed,stopped,suspended&limit=100"),
                                                 api("/usage/daily?days=7")]);
    table("finished", [["job", j => jobLink(j.id)], ["user", j => j.user], ["name", j => j.name], ["state", j => j.state],
      ["exit", j => j.exit_code === null ? "-" : j.exit_code], ["node-hours", j => j.node_hours.toFixed(2)],
      ["ended", j => j.ended_at ? hhmm(j.ended_at) : "-"], ["how it ended", j => j.reason]],
      finished.sort((a, b) => (b.ended_at || 0) - (a.ended_at || 0)).slice(0, 30));
    usageBars(document.getElementById("usage"), document.getElementById("usage-legend"), daily);
    document.getElementById("error").textContent = "";
    document.body.dataset.ready = "1";
  } catch (err) {
    document.getElementById("error").textContent = String(err);
  }
}

async function jobPage(id) {
  try {
    const [job, events, metrics, logs] = await Promise.all([api("/jobs/" + id), api("/jobs/" + id + "/events"),
      api("/jobs/" + id + "/metrics"), api("/jobs/" + id + "/logs?rank=0")]);
    document.getElementById("job-title").textContent = `Job ${job.id}: ${job.name} (${job.user})`;
    const summary = document.getElementById("job-summary");
    summary.replaceChildren();
    [["state", job.state + (job.held ? " (held)" : "")], ["priority", job.priority_name], ["nodes", job.nodes.join(",") || job.nnodes],
     ["attempt", job.restart_count + 1], ["exit", job.exit_code === null ? "-" : job.exit_code],
     ["node-hours", job.node_hours.toFixed(2)], ["reason", job.reason]].forEach(([k, v]) => summary.append(el("span", {}, `${k}: ${v}`)));
    const pts = metrics.points, step = p => p.step;
    const maxOf = f => Math.max(1e-9, ...pts.map(f).filter(Number.isFinite));
    lineChart(document.getElementById("chart-loss"), pts, [["#3f7fbf", p => p.loss, "loss"], ["#d08a1e", p => p.val_loss, "val-loss"]],
      maxOf(p => Math.max(p.loss || 0, p.val_loss || 0)) * 1.05, v => v.toFixed(2), step, v => String(Math.round(v)), "step");
    const perStep = pts.length ? pts[pts.length - 1].tokens / pts[pts.length - 1].step : 0;
    const predicted = metrics.plan && metrics.plan.step_time_s ? perStep / metrics.plan.step_time_s : NaN;
    const measuredMax = maxOf(p => p.tokens_per_s), onScale = predicted <= 3 * measuredMax;  // else: a note, not a flat line
    const tps = document.getElementById("chart-tps");
    const fmt = v => v >= 1e6 ? (v / 1e6).toFixed(1) + "M" : v >= 1000 ? (v / 1000).toFixed(1) + "k" : v.toFixed(0);
    lineChart(tps, pts, [["#2f8f5b", p => p.tokens_per_s, "tokens-per-s"],
      ...(onScale ? [["#9aa3b1", () => predicted, "predicted", true]] : [])],
      Math.max(measuredMax, onScale ? predicted : 0) * 1.15, fmt, step, v => String(Math.round(v)), "step");
    if (Number.isFinite(predicted) && !onScale)
      tps.append(el("svg:text", { x: 560, y: 24, "text-anchor": "end", class: "predicted" },
        `planner's prediction: ${fmt(predicted)} tokens/s (off this scale)`));
    const mfuMax = maxOf(p => p.mfu) * 1.1;
    lineChart(document.getElementById("chart-mfu"), pts, [["#7a4fb5", p => p.mfu, "mfu"]], mfuMax,
      v => (100 * v).toFixed(mfuMax < 0.02 ? 2 : mfuMax < 0.2 ? 1 : 0) + "%", step, v => String(Math.round(v)), "step");
    table("job-events", [["time", e => hhmm(e.t)], ["attempt", e => e.job_id], ["event", e => e.kind], ["what", e => e.message]], events);
    const log = document.getElementById("job-log");
    const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.textContent = logs.text.slice(-20000) || "(no output yet)";
    if (atBottom) log.scrollTop = log.scrollHeight;  // follow the log unless the reader scrolled up
    document.getElementById("job-error").textContent = metrics.dir ? "" : "this job has not reported a luban training run (no curves)";
    document.body.dataset.ready = "1";
  } catch (err) {
    document.getElementById("job-error").textContent = String(err);
  }
}

function route() {
  const m = location.hash.match(/^#job\/(\d+)$/);
  document.getElementById("board").hidden = !!m;
  document.getElementById("jobpage").hidden = !m;
  document.body.dataset.ready = "";
  m ? jobPage(m[1]) : refresh();
}

function showLogin() {
  document.getElementById("board").hidden = true;
  document.getElementById("jobpage").hidden = true;
  document.getElementById("login").hidden = false;
}

document.getElementById("save").onclick = () => {
  localStorage.setItem("luban-token", document.getElementById("token").value.trim());
  location.reload();
};
if (!token()) {
  showLogin();
} else {
  window.addEventListener("hashchange", route);
  route();
  setInterval(() => { const m = location.hash.match(/^#job\/(\d+)$/); m ? jobPage(m[1]) : refresh(); }, 2000);
}
