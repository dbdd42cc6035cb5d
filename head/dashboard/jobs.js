// The jobs page: every job with its state, queue position and reason, progress, tokens/s and ETA; cancel.
"use strict";

async function cancel(jobId) {
  if (!window.confirm(`Cancel ${jobId}? Its actors are stopped.`)) return;
  try {
    await GT.api("/api/cancel", { job_id: jobId });
  } catch (e) {
    window.alert("Could not cancel " + jobId + ": " + e.message);
  }
}

function progress(job) {
  const steps = GT.steps(job);
  const step = GT.num(job.step);
  const fraction = steps > 0 ? Math.min(1, step / steps) : 0;
  const bar = GT.el("span", {});
  bar.style.width = (fraction * 100).toFixed(1) + "%";
  return [GT.el("span", { class: "progress" }, bar), ` ${step} / ${steps}`];
}

function eta(job) {
  const steps = GT.steps(job);
  const left = steps - GT.num(job.step);
  if (job.state !== "JOB_RUNNING" || left <= 0 || GT.num(job.measured_step_seconds) <= 0) return "-";
  return GT.seconds(left * GT.num(job.measured_step_seconds));
}

async function refresh() {
  const answer = await GT.api("/api/jobs");
  let queued = 0;
  const rows = answer.jobs.map((job) => {
    const queue = job.state === "JOB_PENDING" ? "#" + (++queued) : "";
    const tokens = GT.num(job.tokens_per_second) > 0 ? GT.fmt(job.tokens_per_second, 0) : "-";
    return [
      GT.el("a", { href: "/job?id=" + encodeURIComponent(job.job_id), class: "mono" }, job.job_id),
      job.name,
      [GT.state(job.state), job.timed_compute ? GT.emulated() : null],
      queue,
      GT.el("span", { class: "small" }, job.message),
      progress(job),
      [tokens, job.timed_compute && tokens !== "-" ? GT.el("span", { class: "muted small" }, " (emulated)") : null],
      eta(job),
      GT.time(job.submitted_unix_ms),
      GT.ended(job.state) ? "" : GT.el("button", { class: "danger", onclick: () => cancel(job.job_id) }, "Cancel"),
    ];
  });
  GT.replace("jobs", rows.length
    ? GT.table(["JOB", "NAME", "STATE", "QUEUE", "REASON", "PROGRESS", "TOKENS/S", "ETA", "SUBMITTED", ""], rows,
      [0, 0, 0, 0, 0, 0, 1, 1, 0, 0])
    : GT.el("p", { class: "muted" }, "No jobs yet: submit one with `geotrain job submit`, or from the Plan page."));
}

document.addEventListener("DOMContentLoaded", () => {
  GT.header("Jobs");
  GT.poll(refresh, 2000);
});
