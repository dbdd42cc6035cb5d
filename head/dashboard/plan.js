// The planner page: a pasted job spec ranked into plans on the cluster as it is now, with the planner's
// explanation; the same spec can then be submitted (by the button only).
"use strict";

const kExample = [
  "# A job spec as for `geotrain job submit` (YAML or JSON). Paths are the head machine's, absolute.",
  "name: from-the-dashboard",
  "model: {preset: gpt2}",
  "train: {global_batch: 32, seq_len: 1024, steps: 1000}",
  "parallel: {plan: auto}",
  "",
].join("\n");

function specRequest() {
  return { spec_text: document.getElementById("spec").value, spec_source: "dashboard spec" };
}

function crossSite(plan) {
  return (plan.cross_site || []).map((t) => GT.el("div", { class: "small" },
    `${t.site_a} <-> ${t.site_b}: ${GT.bytes(t.bytes_per_step)}/step` +
    (t.gradient_codec || t.activation_codec ? ` (grad ${t.gradient_codec || "-"}, act ${t.activation_codec || "-"})` : "")));
}

async function plan() {
  const button = document.getElementById("plan-button");
  button.disabled = true;
  GT.replace("plans", "Planning...");
  try {
    const request = Object.assign(specRequest(), { max_plans: Number(document.getElementById("max-plans").value) || 5 });
    const reply = await GT.api("/api/plan", request);
    const rows = reply.plans.map((p) => [p.rank, GT.el("span", { class: "small" }, p.summary),
      GT.seconds(p.predicted_step_seconds),
      GT.fmt(p.predicted_tokens_per_second, 0), GT.percent(p.bubble_fraction), GT.percent(p.max_memory_fraction),
      p.devices, p.subset, crossSite(p)]);
    GT.replace("plans", rows.length ? GT.table(["RANK", "PLAN", "STEP", "TOKENS/S", "BUBBLE", "MEMORY", "DEVICES",
      "DEVICES USED", "ACROSS SITES"], rows, [1, 0, 1, 1, 1, 1, 1, 0, 0]) : "No plan fits.",
    GT.el("p", { class: "muted small" }, `${reply.plans_simulated} plans simulated in ` +
      `${GT.seconds(reply.planning_seconds)} on ${reply.alive_workers} workers, ${reply.devices} devices.`));
    GT.replace("explanation", GT.el("ul", { class: "explanation" }, reply.explanation.map((l) => GT.el("li", {}, l))));
    document.getElementById("error").classList.add("hidden");
  } catch (e) {
    GT.replace("plans", GT.el("span", { class: "banner error" }, e.message));
    GT.replace("explanation");
  } finally {
    button.disabled = false;
  }
}

async function submit() {
  try {
    const job = await GT.api("/api/submit", specRequest());
    GT.replace("submitted", "submitted ", GT.el("a", { href: "/job?id=" + encodeURIComponent(job.job_id) }, job.job_id));
  } catch (e) {
    GT.replace("submitted", GT.el("span", { class: "banner error" }, e.message));
  }
}

document.addEventListener("DOMContentLoaded", async () => {
  GT.header("Plan");
  // A link can carry a spec (`/plan?spec=...`) and plan it at once (`&plan=1`); nothing is ever submitted by a link.
  document.getElementById("spec").value = GT.param("spec") || kExample;
  let emulated = false;
  try {
    const { status } = await GT.api("/api/cluster");
    emulated = status.workers.some((w) => w.devices.some((d) => d.timed_compute || d.kind === "DEVICE_KIND_EMULATED"));
    GT.replace("updated", `${status.workers.length} workers`);
  } catch (e) {
    GT.replace("error", e.message).classList.remove("hidden");
  }
  if (emulated) {
    GT.replace("emulated-banner", GT.emulated("emulated devices"),
      " The cluster's devices are emulated: every prediction here is for the GPUs they stand in for.")
      .classList.remove("hidden");
  }
  document.getElementById("plan-button").addEventListener("click", plan);
  document.getElementById("submit-button").addEventListener("click", submit);
  if (GT.param("plan") === "1") plan();
});
