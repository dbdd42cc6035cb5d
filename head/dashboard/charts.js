// Charts drawn as plain SVG (no charting library, nothing fetched): line charts over steps, optionally stacked, with
// reference lines, and the graph of sites and their links. Uses GT.el from common.js.
"use strict";

const Charts = {};
Charts.colors = ["#2457c5", "#d9822b", "#1f8a4c", "#c53030", "#7b3fbf", "#0f8b8d", "#8a6d3b", "#5f6b7d"];

// "Nice" tick values covering [lo, hi].
Charts.ticks = function (lo, hi, count) {
  if (!(hi > lo)) { hi = lo + 1; }
  const raw = (hi - lo) / count;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
};

Charts.label = function (v) {
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toPrecision(3) + "G";
  if (a >= 1e6) return (v / 1e6).toPrecision(3) + "M";
  if (a >= 1e4) return (v / 1e3).toPrecision(3) + "k";
  return String(Number(v.toPrecision(4)));
};

// Draws into the element `id`: {series: [{name, points: [[step, value], ...]}], yLabel, stacked, references:
// [{name, value}], empty: "what to say without points", markers: draw a dot per point (≤ 400 points)}. The SVG
// carries data-points (the first series' count) so that tests and people can check what was drawn.
Charts.line = function (id, spec) {
  const W = 640, H = 250, left = 56, right = 12, top = 24, bottom = 46;
  const series = (spec.series || []).filter((s) => s.points.length > 0);
  const svg = GT.el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": spec.yLabel || "",
    "data-points": series.length ? series[0].points.length : 0 });
  if (series.length === 0) {
    svg.appendChild(GT.el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" },
      spec.empty || "no steps yet"));
    GT.replace(id, svg);
    return;
  }
  // Stacked: each series drawn on top of the ones before it, step by step.
  const drawn = series.map((s) => ({ name: s.name, points: s.points.map((p) => [p[0], p[1]]) }));
  if (spec.stacked) {
    const base = new Map();
    for (const s of drawn) {
      s.points = s.points.map(([x, y]) => {
        const b = base.get(x) || 0;
        base.set(x, b + y);
        return [x, b + y, b];
      });
    }
  }
  const xs = drawn.flatMap((s) => s.points.map((p) => p[0]));
  const ys = drawn.flatMap((s) => s.points.map((p) => p[1])).concat((spec.references || []).map((r) => r.value));
  const xMin = Math.min(...xs), xMax = Math.max(...xs);
  let yMin = spec.stacked || spec.zero ? 0 : Math.min(...ys), yMax = Math.max(...ys);
  if (yMax === yMin) { yMax += Math.abs(yMax) * 0.1 || 1; yMin -= spec.stacked || spec.zero ? 0 : Math.abs(yMin) * 0.1; }
  const pad = (yMax - yMin) * 0.05;
  yMax += pad;
  if (!(spec.stacked || spec.zero)) yMin -= pad;
  const sx = (x) => left + (xMax === xMin ? (W - left - right) / 2 : (x - xMin) / (xMax - xMin) * (W - left - right));
  const sy = (y) => top + (1 - (y - yMin) / (yMax - yMin)) * (H - top - bottom);

  const grid = GT.el("g", { class: "grid" });
  const axis = GT.el("g", { class: "axis" });
  for (const t of Charts.ticks(yMin, yMax, 5)) {
    grid.appendChild(GT.el("line", { x1: left, x2: W - right, y1: sy(t), y2: sy(t) }));
    axis.appendChild(GT.el("text", { x: left - 6, y: sy(t) + 4, "text-anchor": "end" }, Charts.label(t)));
  }
  const xTicks = Charts.ticks(xMin, xMax, 6).filter((t) => Number.isInteger(t));
  for (const t of xTicks) axis.appendChild(GT.el("text", { x: sx(t), y: H - bottom + 16, "text-anchor": "middle" }, t));
  axis.appendChild(GT.el("line", { x1: left, x2: W - right, y1: H - bottom, y2: H - bottom }));
  axis.appendChild(GT.el("line", { x1: left, x2: left, y1: top, y2: H - bottom }));
  axis.appendChild(GT.el("text", { x: W - right, y: H - bottom + 30, "text-anchor": "end" }, "step"));
  svg.append(grid, axis);

  drawn.forEach((s, i) => {
    const color = Charts.colors[i % Charts.colors.length];
    const line = s.points.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + " " + sy(p[1]).toFixed(1)).join(" ");
    if (spec.stacked) {
      const under = s.points.slice().reverse().map((p) => "L" + sx(p[0]).toFixed(1) + " " + sy(p[2]).toFixed(1));
      svg.appendChild(GT.el("path", { d: line + " " + under.join(" ") + " Z", fill: color, "fill-opacity": 0.35,
        stroke: "none" }));
    }
    svg.appendChild(GT.el("path", { d: line, fill: "none", stroke: color, "stroke-width": 1.8, class: "series" }));
    if (spec.markers && s.points.length <= 400) {
      const dots = GT.el("g", { class: "points", "data-series": s.name });
      for (const p of s.points) {
        dots.appendChild(GT.el("circle", { class: "point", cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1), r: 2.6,
          fill: color, "data-step": p[0] }, GT.el("title", {}, `step ${p[0]}: ${Charts.label(p[1])}`)));
      }
      svg.appendChild(dots);
    }
  });
  (spec.references || []).forEach((r) => {
    svg.appendChild(GT.el("line", { x1: left, x2: W - right, y1: sy(r.value), y2: sy(r.value), stroke: "#c53030",
      "stroke-dasharray": "5 4", "stroke-width": 1.4 }));
  });
  // The legend, under the axis.
  const legend = GT.el("g", { class: "legend" });
  let x = left;
  const entries = drawn.map((s, i) => [s.name, Charts.colors[i % Charts.colors.length], false])
    .concat((spec.references || []).map((r) => [r.name, "#c53030", true]));
  for (const [name, color, dashed] of entries) {
    legend.appendChild(GT.el("line", { x1: x, x2: x + 16, y1: H - 8, y2: H - 8, stroke: color, "stroke-width": 3,
      "stroke-dasharray": dashed ? "4 3" : null }));
    legend.appendChild(GT.el("text", { x: x + 20, y: H - 4 }, name));
    x += 28 + name.length * 6.2;
  }
  svg.appendChild(legend);
  if (spec.yLabel) svg.appendChild(GT.el("text", { x: left, y: 14, "text-anchor": "start" }, spec.yLabel));
  GT.replace(id, svg);
};

// The sites as a ring of nodes and the links between them as labelled edges: {sites: [{name, text}], links:
// [{a, b, text}]}.
Charts.siteGraph = function (id, graph) {
  const W = 640, H = 320, cx = W / 2, cy = H / 2 - 8, radius = graph.sites.length > 1 ? 100 : 0;
  const svg = GT.el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "sites and links",
    "data-sites": graph.sites.length, "data-links": graph.links.length });
  const where = new Map();
  graph.sites.forEach((s, i) => {
    const angle = -Math.PI / 2 + (2 * Math.PI * i) / Math.max(1, graph.sites.length);
    where.set(s.name, [cx + radius * 1.6 * Math.cos(angle), cy + radius * Math.sin(angle)]);
  });
  for (const l of graph.links) {
    const a = where.get(l.a), b = where.get(l.b);
    if (!a || !b) continue;
    // The label sits beside the edge's middle, on the side away from the ring's centre.
    const mx = (a[0] + b[0]) / 2, my = (a[1] + b[1]) / 2;
    const length = Math.hypot(b[0] - a[0], b[1] - a[1]) || 1;
    let nx = -(b[1] - a[1]) / length, ny = (b[0] - a[0]) / length;
    if (nx * (mx - cx) + ny * (my - cy) < 0 || (Math.abs(mx - cx) < 1 && Math.abs(my - cy) < 1 && nx < 0)) {
      nx = -nx;
      ny = -ny;
    }
    const lx = mx + nx * 10, ly = my + ny * 10;
    const anchor = Math.abs(nx) < 0.3 ? "middle" : nx > 0 ? "start" : "end";
    const g = GT.el("g", { class: "link", "data-link": l.a + "|" + l.b });
    g.appendChild(GT.el("line", { x1: a[0], y1: a[1], x2: b[0], y2: b[1] }));
    l.text.forEach((line, k) => g.appendChild(GT.el("text", { x: lx, y: ly + 4 + (k - (l.text.length - 1) / 2) * 14,
      "text-anchor": anchor }, line)));
    svg.appendChild(g);
  }
  for (const s of graph.sites) {
    const [x, y] = where.get(s.name);
    const g = GT.el("g", { class: "site", "data-site": s.name });
    g.appendChild(GT.el("circle", { cx: x, cy: y, r: 30 }));
    g.appendChild(GT.el("text", { x, y: y + 4, "text-anchor": "middle", "font-weight": 600 }, s.name));
    g.appendChild(GT.el("text", { x, y: y + 46, "text-anchor": "middle", class: "sub" }, s.text));
    svg.appendChild(g);
  }
  if (graph.sites.length === 0) {
    svg.appendChild(GT.el("text", { x: cx, y: cy, "text-anchor": "middle", class: "empty" }, "no workers yet"));
  }
  GT.replace(id, svg);
};
