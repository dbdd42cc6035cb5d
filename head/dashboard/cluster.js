// The cluster page: sites and their workers, the links between sites (configured, measured, carried), as tables and
// as a graph of sites; refreshed every 2 s.
"use strict";

// Unordered site pair key.
const pairKey = (a, b) => (a < b ? a + "|" + b : b + "|" + a);
const mbit = (bytesPerSecond) => GT.fmt(bytesPerSecond * 8 / 1e6, 1) + " Mbit/s";

// What the running jobs' newest steps carried across each link, in bytes per second per direction.
async function carriedRates(jobs) {
  const rates = new Map();  // pair key -> {"src>dst": bytes/s}
  const running = jobs.filter((j) => j.state === "JOB_RUNNING");
  for (const job of running) {
    const answer = await GT.api(`/api/events?id=${encodeURIComponent(job.job_id)}&tail=40`);
    const steps = answer.events.filter((e) => e.kind === "step" && e.step);
    if (steps.length === 0) continue;
    const step = steps[steps.length - 1].step;
    const seconds = GT.num(step.step_seconds);
    if (seconds <= 0) continue;
    for (const [pair, bytes] of Object.entries(step.wan_bytes_by_pair || {})) {
      const [src, dst] = pair.split(">");
      const key = pairKey(src, dst);
      const entry = rates.get(key) || {};
      entry[pair] = (entry[pair] || 0) + GT.num(bytes) / seconds;
      rates.set(key, entry);
    }
  }
  return rates;
}

function workerRows(status) {
  const actorsByWorker = new Map();
  for (const a of status.actors) {
    if (a.state === "ACTOR_DEAD") continue;
    if (!actorsByWorker.has(a.worker_id)) actorsByWorker.set(a.worker_id, []);
    actorsByWorker.get(a.worker_id).push(a);
  }
  return status.workers.map((w) => {
    const devices = w.devices.map((d) => GT.el("div", {},
      `${d.name} · ${GT.bytes(d.memory_bytes)} · ${GT.fmt(d.tflops, 1)} TFLOP/s`,
      d.kind === "DEVICE_KIND_EMULATED" && !d.timed_compute ? GT.el("span", { class: "muted small" }, " (emulated on CPU)") : null,
      d.timed_compute ? GT.emulated() : null,
      GT.num(d.slowdown) > 1 ? GT.emulated(GT.slowedTitle) : null));
    const actors = (actorsByWorker.get(w.worker_id) || []).map((a) => GT.el("div", { class: "mono" },
      GT.el("a", { href: "/job?id=" + encodeURIComponent(a.job_id) }, a.actor_id), " ", GT.stateName(a.state)));
    return [GT.el("span", { class: "mono" }, w.worker_id), w.site, GT.state(w.state), devices,
      GT.el("span", { title: GT.time(w.last_heartbeat_unix_ms) }, GT.age(w.last_heartbeat_unix_ms)),
      actors.length ? actors : GT.el("span", { class: "muted" }, "none"),
      GT.el("span", { class: "mono small" }, w.address), w.dead_reason || ""];
  });
}

function linkTable(status, info, rates) {
  const links = new Map();
  for (const c of info.configured_links) links.set(pairKey(c.a, c.b), { a: c.a, b: c.b, configured: c });
  for (const m of status.site_links) {
    const key = pairKey(m.a, m.b);
    links.set(key, Object.assign(links.get(key) || { a: m.a, b: m.b }, { measured: m }));
  }
  for (const key of rates.keys()) {
    if (!links.has(key)) links.set(key, { a: key.split("|")[0], b: key.split("|")[1] });
  }
  const rows = [...links.entries()].map(([key, l]) => {
    const carried = Object.entries(rates.get(key) || {}).map(([pair, rate]) => GT.el("div", {}, `${pair}: ${mbit(rate)}`));
    return [l.a, l.b,
      l.configured ? GT.fmt(l.configured.latency_ms, 1) + " ms" : "-",
      l.configured ? GT.fmt(l.configured.bandwidth_mbps, 0) + " Mbit/s" : "-",
      l.measured ? GT.fmt(l.measured.latency_ms, 2) + " ms" : "-",
      l.measured ? GT.fmt(l.measured.bandwidth_mbps, 0) + " Mbit/s" : "-",
      l.measured ? l.measured.samples : "-",
      l.measured && l.measured.goodput_mbps ? GT.fmt(l.measured.goodput_mbps, 1) + " Mbit/s" : "-",
      carried.length ? carried : GT.el("span", { class: "muted" }, "-")];
  });
  GT.replace("links", rows.length ? GT.table(["SITE A", "SITE B", "CONF LATENCY", "CONF BANDWIDTH", "MEAS LATENCY",
    "MEAS BANDWIDTH", "SAMPLES", "SEND GOODPUT", "CARRIED (running jobs)"], rows, [0, 0, 1, 1, 1, 1, 1, 1, 0])
    : GT.el("p", { class: "muted" }, "No links between sites (one site, or none measured yet)."));
  return links;
}

function graph(status, links, rates) {
  const names = new Set(status.sites.map((s) => s.name));
  for (const l of links.values()) { names.add(l.a); names.add(l.b); }
  const sites = [...names].sort().map((name) => {
    const s = status.sites.find((x) => x.name === name) || { alive_workers: 0, devices: 0 };
    return { name, text: `${s.alive_workers} workers, ${s.devices} dev` };
  });
  const edges = [...links.entries()].map(([key, l]) => {
    const text = [];
    if (l.configured) text.push(`conf ${GT.fmt(l.configured.latency_ms, 1)} ms, ${GT.fmt(l.configured.bandwidth_mbps, 0)} Mbit/s`);
    if (l.measured) text.push(`meas ${GT.fmt(l.measured.latency_ms, 1)} ms, ${GT.fmt(l.measured.bandwidth_mbps, 0)} Mbit/s`);
    const carried = Object.values(rates.get(key) || {}).reduce((x, y) => x + y, 0);
    if (carried > 0) text.push(`carried ${mbit(carried)}`);
    if (l.measured && l.measured.goodput_mbps) text.push(`goodput ${GT.fmt(l.measured.goodput_mbps, 1)} Mbit/s`);
    return { a: l.a, b: l.b, text };
  });
  Charts.siteGraph("graph", { sites, links: edges });
}

async function refresh() {
  const [cluster, jobs] = await Promise.all([GT.api("/api/cluster"), GT.api("/api/jobs")]);
  const { status, info } = cluster;
  const rates = await carriedRates(jobs.jobs);
  GT.replace("head", `head ${status.head_id}, up since ${GT.time(status.head_started_unix_ms)}`);
  const alive = status.workers.filter((w) => w.state === "WORKER_ALIVE").length;
  const devices = status.sites.reduce((n, s) => n + s.devices, 0);
  const tflops = status.sites.reduce((n, s) => n + s.tflops, 0);
  const byState = status.jobs_by_state || {};
  const card = (label, value, sub) => GT.el("div", { class: "card" }, GT.el("div", { class: "label" }, label),
    GT.el("div", { class: "value" }, value), sub ? GT.el("div", { class: "sub" }, sub) : null);
  GT.replace("cards", card("Workers alive", `${alive} / ${status.workers.length}`, `${status.sites.length} sites`),
    card("Devices", devices, GT.fmt(tflops, 1) + " TFLOP/s"),
    card("Jobs running", byState.RUNNING || 0, `${byState.PENDING || 0} pending, ${byState.SUCCEEDED || 0} succeeded`),
    card("Failed or cancelled", (byState.FAILED || 0) + (byState.CANCELLED || 0)));
  const timed = status.workers.some((w) => w.devices.some((d) => d.timed_compute));
  const slowed = status.workers.some((w) => w.devices.some((d) => GT.num(d.slowdown) > 1));
  const banner = GT.replace("emulated-banner", [
    timed ? [GT.emulated(), " Some workers run on timed compute: their devices' times are emulated GPUs', nothing is " +
      "computed."] : [],
    slowed ? [timed ? " " : null, GT.emulated(GT.slowedTitle), " Some workers' CPUs are slowed (worker --slowdown): " +
      "their step times are emulated, their losses real."] : []].flat());
  banner.classList.toggle("hidden", !timed && !slowed);
  GT.replace("sites", GT.table(["SITE", "ALIVE", "DEAD", "DEVICES", "TFLOP/S"], status.sites.map((s) =>
    [s.name, s.alive_workers, s.dead_workers, s.devices, GT.fmt(s.tflops, 1)]), [0, 1, 1, 1, 1]));
  const links = linkTable(status, info, rates);
  graph(status, links, rates);
  GT.replace("workers", GT.table(["WORKER", "SITE", "STATE", "DEVICES", "LAST HEARTBEAT", "ACTORS", "ADDRESS", ""],
    workerRows(status)));
}

document.addEventListener("DOMContentLoaded", () => {
  GT.header("Cluster");
  GT.poll(refresh, 2000);
});
