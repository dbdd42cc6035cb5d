// One job, live: its figures every step (loss, step time and its parts, tokens/s and MFU, WAN bytes by link,
// predicted against measured step time), its plan and the head's planning lines, restarts and faults, checkpoints,
// actors and event log. Polls the job every 1.5 s and its events after the last one received.
"use strict";

const jobId = GT.param("id");
const events = [];           // every event received, in seq order
const steps = new Map();     // step -> StepFigures (a restart from a checkpoint repeats steps: the newest wins)
let lastSeq = 0;

async function fetchEvents() {
  for (let more = true; more;) {
    const answer = await GT.api(`/api/events?id=${encodeURIComponent(jobId)}&after=${lastSeq}`);
    for (const e of answer.events) {
      events.push(e);
      lastSeq = Math.max(lastSeq, GT.num(e.seq));
      if (e.kind === "step" && e.step) steps.set(GT.num(e.step.step), e.step);
    }
    more = answer.more;
  }
}

// The largest factor a device of the job's steps was slowed by (worker --slowdown; 1: none): such steps' times are
// emulated, their losses real.
const slowdown = () => [...steps.values()].reduce((most, f) => Math.max(most, GT.num(f.slowdown)), 1);
const slowedNote = (factor) => `slowed ${factor}x (worker --slowdown): a CPU made slower, so step times, tokens/s ` +
  "and MFU are emulated; the loss is real (docs/timed-compute.md)";

const series = (pick) => [...steps.entries()].sort((a, b) => a[0] - b[0])
  .map(([step, f]) => [step, pick(f)]).filter((p) => p[1] !== null && isFinite(p[1]));

// `emulated`: false, true (timed compute), or the badge's own explanation.
function card(label, value, sub, emulated) {
  const badge = emulated ? GT.emulated(typeof emulated === "string" ? emulated : undefined) : null;
  return GT.el("div", { class: "card" }, GT.el("div", { class: "label" }, label, badge),
    GT.el("div", { class: "value" }, value), sub ? GT.el("div", { class: "sub" }, sub) : null);
}

function renderCards(job, efficiency) {
  const total = GT.steps(job);
  const valSteps = series((f) => (GT.num(f.val_loss) >= 0 && f.val_loss !== undefined ? GT.num(f.val_loss) : null));
  const timed = job.timed_compute;
  const slowed = slowdown() > 1 && slowedNote(slowdown());
  const timedOrSlowed = timed || slowed;
  const left = total - GT.num(job.step);
  const eta = job.state === "JOB_RUNNING" && left > 0 ? GT.seconds(left * GT.num(job.measured_step_seconds)) : "-";
  const mfu = GT.num(efficiency.mfu);
  GT.replace("cards",
    card("Step", `${job.step} / ${total}`, `ETA ${eta}`),
    card("Loss", timed ? "not real" : GT.fmt(job.loss, 4),
      valSteps.length ? `validation ${GT.fmt(valSteps[valSteps.length - 1][1], 4)}` : "no validation yet", timed),
    card("Tokens/s", GT.fmt(job.tokens_per_second, 0), `${GT.seconds(job.measured_step_seconds)} per step`, timedOrSlowed),
    card("MFU", mfu > 0 ? GT.percent(mfu) : "-", `${GT.flops(efficiency.achieved_flops)} of ${GT.flops(efficiency.peak_flops)}` +
      ` (${efficiency.devices} devices, ${efficiency.precision})`, timedOrSlowed || (efficiency.emulated_devices &&
      "emulated devices: the peak is the emulated GPUs'; without timed compute the work ran on this machine's CPU")),
    card("Step time", GT.seconds(job.measured_step_seconds),
      GT.num(job.predicted_step_seconds) > 0 ? `predicted ${GT.seconds(job.predicted_step_seconds)}` : "no prediction",
      timedOrSlowed),
    card("Restarts", job.restarts, `run ${job.attempt}`),
    card("Checkpoint", GT.num(job.last_checkpoint_step) > 0 ? `step ${job.last_checkpoint_step}` : "none",
      job.resumed_from ? "resumed from " + job.resumed_from.split("/").pop() : ""));
}

function renderCharts(job, efficiency) {
  const timed = job.timed_compute;
  const emulated = timed ? " (EMULATED)" : slowdown() > 1 ? ` (EMULATED: slowed ${slowdown()}x)` : "";
  Charts.line("loss-chart", {
    series: timed ? [] : [
      { name: "training", points: series((f) => GT.num(f.loss)) },
      { name: "validation", points: series((f) => (f.val_loss !== undefined && GT.num(f.val_loss) >= 0 ? GT.num(f.val_loss) : null)) },
    ],
    yLabel: "loss", markers: true,
    empty: timed ? "EMULATED: timed compute computes nothing, so there is no real loss" : "no steps yet",
  });
  Charts.line("time-chart", {
    series: [
      { name: "step", points: series((f) => GT.num(f.step_seconds)) },
      { name: "compute", points: series((f) => GT.num(f.compute_seconds)) },
      { name: "comm wait", points: series((f) => GT.num(f.comm_wait_seconds)) },
      { name: "bubble", points: series((f) => GT.num(f.bubble_seconds)) },
    ],
    yLabel: "seconds" + emulated, zero: true,
  });
  Charts.line("throughput-chart", {
    series: [{ name: "tokens/s", points: series((f) => GT.num(f.tokens_per_second)) }],
    yLabel: "tokens/s" + emulated, zero: true,
  });
  const peak = GT.num(efficiency.peak_flops), perToken = GT.num(efficiency.flops_per_token);
  Charts.line("mfu-chart", {
    series: peak > 0 && perToken > 0
      ? [{ name: "MFU %", points: series((f) => 100 * GT.num(f.tokens_per_second) * perToken / peak) }] : [],
    yLabel: (timed || efficiency.emulated_devices ? "MFU % (EMULATED devices' peak)" : "MFU %" + emulated) +
      ` in ${efficiency.precision}`, zero: true,
    empty: "MFU: no devices or no steps yet",
  });
  const predicted = GT.num(job.predicted_step_seconds);
  Charts.line("predicted-chart", {
    series: [{ name: "measured", points: series((f) => GT.num(f.step_seconds)) }],
    references: predicted > 0 ? [{ name: "predicted (planner)", value: predicted }] : [],
    yLabel: "seconds" + emulated, zero: true,
  });
  const pairs = new Set();
  for (const f of steps.values()) Object.keys(f.wan_bytes_by_pair || {}).forEach((p) => pairs.add(p));
  Charts.line("wan-chart", {
    series: [...pairs].sort().map((pair) => ({ name: pair, points: series((f) => GT.num((f.wan_bytes_by_pair || {})[pair])) })),
    yLabel: "bytes per step", zero: true, empty: "nothing crossed sites yet",
  });
}

// The head's planning lines: what it planned and why (auto plans), the precision, the pipeline depth.
function planningLines() {
  const out = [];
  let inPlan = false;
  for (const e of events) {
    if (e.kind !== "log") continue;
    const line = e.line || "";
    if (line.startsWith("planned")) { inPlan = true; out.push(line); continue; }
    if (inPlan && line.startsWith("  ")) { out.push(line.trim()); continue; }
    inPlan = false;
    if (line.startsWith("precision") || line.startsWith("pipeline depth") || line.includes("1F1B depth")) out.push(line);
  }
  return out;
}

function renderPlan(job) {
  const p = job.spec.parallel || {};
  const submitted = job.submitted_parallel || {};
  const placement = (p.placement || []).map((x) =>
    `r${x.replica}s${x.stage}${x.tp_rank ? "t" + x.tp_rank : ""}@${x.site || x.worker}`).join(", ");
  const rows = [
    ["plan", submitted.plan === "auto" ? "auto (the planner chose the plan below)" : (p.plan || "manual")],
    ["dp x pp x tp", `${p.dp} x ${p.pp} x ${p.tp}`],
    ["microbatches, schedule", `${p.microbatches}, ${p.schedule}` + (GT.num(p.pipeline_depth) ? `, depth ${p.pipeline_depth}` : "")],
    ["sync", p.sync || "synchronous"],
    ["placement", placement || "any"],
    ["precision", job.precision || "-"],
    ["WAN codec", (job.spec.comm && job.spec.comm.wan_codec) || "none"],
    ["predicted step", GT.num(job.predicted_step_seconds) > 0 ? GT.seconds(job.predicted_step_seconds) : "-"],
  ];
  const lines = planningLines();
  GT.replace("plan", GT.table(["", ""], rows),
    GT.el("h2", {}, "The head's explanation"),
    lines.length ? GT.el("ul", { class: "explanation small" }, lines.map((l) => GT.el("li", {}, l)))
      : GT.el("p", { class: "muted small" }, "No planning lines yet."));
}

function renderFaults(job) {
  const rows = (job.faults || []).map((f) => [GT.time(f.detected_unix_ms), f.cause, f.step, f.resumed_from || "the beginning",
    f.steps_lost, GT.num(f.recovery_seconds) > 0 ? GT.seconds(f.recovery_seconds) : "recovering", f.attempt]);
  GT.replace("faults", rows.length
    ? GT.table(["DETECTED", "CAUSE", "STEP", "RESUMED FROM", "STEPS LOST", "RECOVERY", "RUN"], rows, [0, 0, 1, 0, 1, 1, 1])
    : GT.el("p", { class: "muted" }, `No faults; ${job.restarts} restarts.`));
}

function renderCheckpoints(job) {
  const c = job.spec.checkpoint || {};
  const lines = events.filter((e) => e.kind === "log" && /checkpoint/i.test(e.line || ""))
    .map((e) => [GT.time(e.unix_ms), e.line]);
  GT.replace("checkpoints",
    GT.el("p", {}, c.dir ? `Every ${c.every_steps || "-"} steps into ${c.dir}; newest complete: ` +
      (GT.num(job.last_checkpoint_step) > 0 ? `step ${job.last_checkpoint_step}` : "none yet") : "No checkpoints configured."),
    lines.length ? GT.table(["TIME", "EVENT"], lines) : null);
}

function renderActors(job) {
  GT.replace("actors", GT.table(["ACTOR", "WORKER", "REPLICA", "STAGE", "TP", "DEVICE", "STATE", "MESSAGE"],
    (job.actors || []).map((a) => [GT.el("span", { class: "mono" }, a.actor_id), a.worker_id, a.replica, a.stage,
      a.tp_rank, a.device_index, GT.state(a.state), a.message]), [0, 0, 1, 1, 1, 1, 0, 0]));
}

function renderEvents() {
  const box = document.getElementById("events");
  const atBottom = box.scrollTop + box.clientHeight >= box.scrollHeight - 4;
  GT.replace("events", events.slice(-400).map((e) => GT.el("div", {}, `${GT.time(e.unix_ms)}  ${e.line}`)));
  if (atBottom) box.scrollTop = box.scrollHeight;
}

async function refresh() {
  const { job, efficiency } = await GT.api(`/api/job?id=${encodeURIComponent(jobId)}`);
  await fetchEvents();
  document.title = `geotrain: ${job.job_id}`;
  GT.replace("job-id", job.job_id);
  GT.replace("job-name", job.name);
  const slowed = !job.timed_compute && slowdown() > 1 ? slowedNote(slowdown()) : "";
  GT.replace("job-state", GT.state(job.state), job.timed_compute || slowed ? GT.emulated(slowed || undefined) : null);
  GT.replace("job-message", job.message);
  const banner = GT.replace("emulated-banner", job.timed_compute ? [GT.emulated(), " This job runs on timed compute: its " +
    "step times, tokens/s and MFU are emulated GPUs', and its loss is not real."]
    : slowed ? [GT.emulated(slowed), ` A device of this job is slowed ${slowdown()}x (worker --slowdown): its step ` +
      "times, tokens/s and MFU are emulated, and its loss is real."] : []);
  banner.classList.toggle("hidden", !job.timed_compute && !slowed);
  document.getElementById("cancel").classList.toggle("hidden", GT.ended(job.state));
  renderCards(job, efficiency);
  renderCharts(job, efficiency);
  renderPlan(job);
  renderFaults(job);
  renderCheckpoints(job);
  renderActors(job);
  renderEvents();
}

document.addEventListener("DOMContentLoaded", () => {
  GT.header("Jobs");
  if (!jobId) {
    GT.replace("job-id", "No job given: open a job from the Jobs page.");
    return;
  }
  document.getElementById("cancel").addEventListener("click", async () => {
    if (!window.confirm(`Cancel ${jobId}? Its actors are stopped.`)) return;
    try {
      await GT.api("/api/cancel", { job_id: jobId });
    } catch (e) {
      window.alert("Could not cancel: " + e.message);
    }
  });
  GT.poll(refresh, 1500);
});
