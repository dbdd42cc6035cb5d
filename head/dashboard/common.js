// What every dashboard page shares: JSON calls to the head (same origin, the session cookie), element building
// without innerHTML (nothing the head returns is ever parsed as HTML), formatting, the page header and polling.
"use strict";

const GT = {};

// GET or POST the dashboard's JSON; throws an Error with the head's message. A 401 means the session ended.
GT.api = async function (path, body) {
  const options = body === undefined
    ? { credentials: "same-origin" }
    : { method: "POST", credentials: "same-origin", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body) };
  const response = await fetch(path, options);
  if (response.status === 401) {
    window.location.assign("/login?reason=expired");
    throw new Error("not logged in");
  }
  const data = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(data.error || ("HTTP " + response.status));
  return data;
};

// An element: GT.el("td", {class: "num", title: "x"}, "text", child, ...). Strings become text nodes.
GT.el = function (tag, attributes, ...children) {
  const svg = ["svg", "g", "line", "path", "circle", "rect", "text", "polyline", "title"].includes(tag);
  const node = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [key, value] of Object.entries(attributes || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "onclick") node.addEventListener("click", value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.appendChild(typeof child === "object" ? child : document.createTextNode(String(child)));
  }
  return node;
};

GT.replace = function (id, ...children) {
  const node = document.getElementById(id);
  while (node.firstChild) node.removeChild(node.firstChild);
  for (const child of children.flat()) {
    if (child !== undefined && child !== null && child !== false) {
      node.appendChild(typeof child === "object" ? child : document.createTextNode(String(child)));
    }
  }
  return node;
};

GT.table = function (headers, rows, numeric) {
  numeric = numeric || [];
  return GT.el("table", {},
    GT.el("thead", {}, GT.el("tr", {}, headers.map((h, i) => GT.el("th", { class: numeric[i] ? "num" : null }, h)))),
    GT.el("tbody", {}, rows.map((row) => GT.el("tr", {},
      row.map((cell, i) => GT.el("td", { class: numeric[i] ? "num" : null }, cell))))));
};

// JSON int64s arrive as strings; enums by their proto names.
GT.num = (v) => (v === undefined || v === null || v === "" ? 0 : Number(v));
GT.stateName = (s) => String(s || "").replace(/^(JOB|WORKER|ACTOR)_/, "").replace(/^STATE_UNSPECIFIED$/, "?");
GT.state = (s) => GT.el("span", { class: "state " + GT.stateName(s) }, GT.stateName(s));
GT.steps = (job) => GT.num(((job.spec || {}).train || {}).steps);
GT.ended = (s) => ["JOB_SUCCEEDED", "JOB_FAILED", "JOB_CANCELLED"].includes(s);
GT.emulated = (title) => GT.el("span", { class: "emulated", title: title ||
  "timed compute: emulated GPUs' times, nothing computed, no real loss (docs/timed-compute.md)" }, "EMULATED");
GT.slowedTitle = "slowed CPU (worker --slowdown): its times are emulated, its numerics real (docs/timed-compute.md)";

GT.fmt = function (v, digits) {
  v = GT.num(v);
  if (!isFinite(v)) return "-";
  const d = digits === undefined ? (Math.abs(v) >= 100 ? 0 : Math.abs(v) >= 10 ? 1 : 3) : digits;
  return v.toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d });
};
GT.bytes = function (v) {
  v = GT.num(v);
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i++; }
  return GT.fmt(v, i === 0 ? 0 : 1) + " " + units[i];
};
GT.flops = function (v) {
  v = GT.num(v);
  const units = ["FLOP/s", "kFLOP/s", "MFLOP/s", "GFLOP/s", "TFLOP/s", "PFLOP/s"];
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i++; }
  return GT.fmt(v, 1) + " " + units[i];
};
GT.seconds = function (s) {
  s = GT.num(s);
  if (s <= 0) return "-";
  if (s < 1) return GT.fmt(s * 1000, 0) + " ms";
  if (s < 120) return GT.fmt(s, 2) + " s";
  if (s < 7200) return GT.fmt(s / 60, 1) + " min";
  return GT.fmt(s / 3600, 1) + " h";
};
GT.time = function (unixMs) {
  unixMs = GT.num(unixMs);
  if (!unixMs) return "-";
  const d = new Date(unixMs);
  const pad = (n) => String(n).padStart(2, "0");
  return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " + pad(d.getHours()) + ":" +
    pad(d.getMinutes()) + ":" + pad(d.getSeconds());
};
GT.age = function (unixMs) {
  unixMs = GT.num(unixMs);
  if (!unixMs) return "-";
  return GT.seconds(Math.max(0.001, (Date.now() - unixMs) / 1000)) + " ago";
};
GT.percent = (f) => GT.fmt(GT.num(f) * 100, 1) + " %";

// The page's header: the brand, the pages, the last update, and a log-out button (a POST, so no link can do it).
GT.header = function (current) {
  const pages = [["/", "Cluster"], ["/jobs", "Jobs"], ["/plan", "Plan"]];
  const header = GT.el("header", { class: "top" },
    GT.el("a", { class: "brand", href: "/" }, "geotrain"),
    GT.el("nav", {}, pages.map(([href, name]) => GT.el("a", { href, class: name === current ? "current" : null }, name))),
    GT.el("span", { class: "spacer" }),
    GT.el("span", { class: "status", id: "updated" }, ""),
    GT.el("form", { method: "post", action: "/logout" }, GT.el("button", { type: "submit" }, "Log out")));
  document.body.insertBefore(header, document.body.firstChild);
};

// Runs `refresh` now and every `ms` (never two at once); shows when it last succeeded, or its error.
GT.poll = function (refresh, ms) {
  let running = false;
  const tick = async () => {
    if (running) return;
    running = true;
    try {
      await refresh();
      GT.replace("updated", "updated " + new Date().toLocaleTimeString());
      GT.replace("error");
      document.getElementById("error").classList.add("hidden");
    } catch (e) {
      const box = GT.replace("error", "Could not update: " + e.message);
      box.classList.remove("hidden");
    } finally {
      running = false;
    }
  };
  tick();
  return setInterval(tick, ms);
};

GT.param = (name) => new URLSearchParams(window.location.search).get(name) || "";
