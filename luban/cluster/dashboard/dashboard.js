// luban cluster dashboard: plain JS + inline SVG, no external resources.
"use strict";
const params = new URLSearchParams(location.search);
if (params.get("token")) {
  localStorage.setItem("luban-token", params.get("token"));
  history.replaceState(null, "", location.pathname);
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
  rows.forEach(r => { const tr = el("tr"); columns.forEach(([, f]) => tr.append(el("td", {}, String(f(r))))); t.append(tr); });
}

function lineChart(svg, samples, series, yMax, yLabel) {
  const W = 600, H = 220, L = 44, R = 10, T = 10, B = 28;
  svg.replaceChildren();
  const t0 = samples.length ? samples[0].t : 0, t1 = samples.length ? samples[samples.length - 1].t : 1;
  const x = t => L + (W - L - R) * (t1 > t0 ? (t - t0) / (t1 - t0) : 1);
  const y = v => H - B - (H - T - B) * Math.min(1, v / (yMax || 1));
  for (let i = 0; i <= 4; i++) {
    const v = yMax * i / 4;
    svg.append(el("svg:line", { x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#e3e6eb" }));
    svg.append(el("svg:text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, yLabel(v)));
  }
  [[t0, "start"], [t1, "end"]].forEach(([t, a]) => svg.append(el("svg:text", { x: x(t), y: H - 8, "text-anchor": a },
    new Date(t * 1000).toLocaleTimeString())));
  for (const [color, value, cls] of series) {
    const points = samples.map(s => x(s.t).toFixed(1) + "," + y(value(s)).toFixed(1)).join(" ");
    svg.append(el("svg:polyline", { points, fill: "none", stroke: color, "stroke-width": 2, class: cls }));
  }
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
    const [who, nodes, jobs, quota, samples] = await Promise.all([
      api("/whoami"), api("/nodes"), api("/jobs?state=queued,starting,running,suspending"), api("/quota"),
      api("/samples?since=" + (Date.now() / 1000 - 6 * 3600))]);
    document.getElementById("who").textContent = who.user + (who.admin ? " (admin)" : "") + (who.group ? " · group " + who.group : "");
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    const up = nodes.filter(n => n.state === "up").length, held = nodes.filter(n => n.job).length;
    const running = nodes.filter(n => n.job && n.job.state === "running").length;
    const queued = jobs.filter(j => j.state === "queued");
    const cards = document.getElementById("cards");
    cards.replaceChildren();
    [["nodes up", up + " / " + nodes.length], ["nodes held", held], ["occupancy", up ? Math.round(100 * held / up) + "%" : "-"],
     ["utilisation", up ? Math.round(100 * running / up) + "%" : "-"], ["running jobs", jobs.filter(j => j.state === "running").length],
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
      grid.append(box);
    });
    queued.sort((a, b) => b.priority - a.priority || a.place - b.place);
    table("queue", [["job", j => j.id], ["user", j => j.user], ["name", j => j.name], ["priority", j => j.priority_name],
      ["nodes", j => j.nnodes], ["restarts", j => j.restart_count], ["why waiting", j => j.reason]], queued);
    table("running", [["job", j => j.id], ["user", j => j.user], ["name", j => j.name], ["priority", j => j.priority_name],
      ["state", j => j.state], ["nodes", j => j.nodes.join(",")], ["since", j => new Date(j.started_at * 1000).toLocaleTimeString()]],
      jobs.filter(j => j.state !== "queued"));
    quotaBars(document.getElementById("quota"), quota);
    document.getElementById("error").textContent = "";
    document.body.dataset.ready = "1";
  } catch (err) {
    document.getElementById("error").textContent = String(err);
  }
}

function showLogin() {
  document.getElementById("board").hidden = true;
  document.getElementById("login").hidden = false;
}

document.getElementById("save").onclick = () => {
  localStorage.setItem("luban-token", document.getElementById("token").value.trim());
  location.reload();
};
if (!token()) {
  showLogin();
} else {
  document.getElementById("board").hidden = false;
  refresh();
  setInterval(refresh, 2000);
}
