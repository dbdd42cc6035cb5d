// The planner's output (see planner.h): a chosen plan in the manual form a job spec takes, and a plan result
// as JSON (`geotrain plan --json`) and as text for a terminal.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/json.h"
#include "scheduler/planner.h"
#include "scheduler/planner_internal.h"
#include "spec.pb.h"

namespace geotrain::scheduler {

using internal::ShapeName;

ManualPlan ToManualPlan(const Cluster& cluster, const ModelCosts& model, const JobOptions& job, const Plan& plan) {
  ManualPlan m;
  m.dp = plan.dp;
  m.pp = plan.pp;
  m.tp = plan.tp;
  m.microbatch_size = plan.microbatch_size;
  m.microbatches = plan.microbatches;
  m.schedule = plan.schedule;
  m.stage_begin.assign(plan.stage_begin.begin(), plan.stage_begin.end() - 1);
  for (int begin : m.stage_begin) m.stage_first_layer.push_back(model.layers[begin].name);
  for (int r = 0; r < plan.dp; ++r) {
    for (int s = 0; s < plan.pp; ++s) {
      for (int k = 0; k < plan.tp; ++k) {
        const int d = plan.devices[r][s][k];
        const Device& dev = cluster.devices[d];
        m.placement.push_back(
            ManualPlacement{r, s, k, d, dev.site, dev.worker, dev.slot, cluster.site_names[dev.site]});
      }
    }
  }
  std::set<std::pair<int, int>> pairs;
  for (int r = 0; r < plan.dp; ++r) {
    for (int s = 0; s < plan.pp; ++s) {
      const int a = cluster.devices[plan.devices[r][s][0]].site;
      if (s + 1 < plan.pp) {
        const int b = cluster.devices[plan.devices[r][s + 1][0]].site;
        if (a != b) pairs.insert(std::minmax(a, b));
      }
      for (int q = r + 1; q < plan.dp; ++q) {
        const int b = cluster.devices[plan.devices[q][s][0]].site;
        if (a != b) pairs.insert(std::minmax(a, b));
      }
    }
  }
  auto name = [&](int c) { return c < 0 ? std::string("none") : job.codecs[c].name; };
  for (const auto& [a, b] : pairs) {
    const LinkSpec& link = cluster.Link(a, b);
    const int g = plan.gradient_codec.empty() ? ChooseCodec(job, link, false) : plan.gradient_codec[a][b];
    const int x = plan.activation_codec.empty() ? ChooseCodec(job, link, true) : plan.activation_codec[a][b];
    m.link_codecs.push_back({cluster.site_names[a], cluster.site_names[b], name(g), name(x)});
  }
  return m;
}

ManualPlan ToManualPlan(const Cluster& cluster, const ModelCosts& model, const Plan& plan) {
  JobOptions no_codecs;
  ManualPlan m = ToManualPlan(cluster, model, no_codecs, plan);
  m.link_codecs.clear();
  return m;
}

void FillParallelSpec(const ManualPlan& manual, ParallelSpec* spec) {
  spec->Clear();
  spec->set_plan("manual");
  spec->set_dp(manual.dp);
  spec->set_pp(manual.pp);
  spec->set_tp(manual.tp);
  spec->set_microbatches(manual.microbatches.empty() ? 1 : manual.microbatches.front());
  spec->set_schedule(ScheduleName(manual.schedule));
  for (const ManualPlacement& p : manual.placement) {
    PlacementSpec* out = spec->add_placement();
    out->set_replica(p.replica);
    out->set_stage(p.stage);
    out->set_tp_rank(p.tp_rank);
    out->set_site(p.site_name);
  }
}

namespace {

// A figure with 6 significant digits (integral ones as integers), null when not finite.
Json JsonNumber(double x) { return JsonFigure(x, 6); }

Json CandidateJson(const Cluster& cluster, const ModelCosts& model, const PlanCandidate& c) {
  const Plan& p = c.plan;
  const Prediction& pr = c.prediction;
  Json stages = Json::array();
  for (int s = 0; s < p.pp; ++s) {
    stages.push_back({{"first_layer", model.layers[p.stage_begin[s]].name},
                      {"last_layer", model.layers[p.stage_begin[s + 1] - 1].name},
                      {"forward_s", JsonNumber(pr.stage_forward_s[s])},
                      {"backward_s", JsonNumber(pr.stage_backward_s[s])},
                      {"allreduce_s", JsonNumber(pr.stage_allreduce_s[s])}});
  }
  Json links = Json::array();
  for (const LinkTraffic& t : pr.cross_site) {
    links.push_back({{"a", cluster.site_names[t.site_a]},
                     {"b", cluster.site_names[t.site_b]},
                     {"bytes_per_step", JsonNumber(t.bytes)},
                     {"gradient_bytes", JsonNumber(t.gradient_bytes)},
                     {"activation_bytes", JsonNumber(t.activation_bytes)},
                     {"gradient_codec", t.gradient_codec},
                     {"activation_codec", t.activation_codec}});
  }
  Json memory = Json::array(), placement = Json::array();
  for (int d = 0; d < static_cast<int>(pr.device_memory_bytes.size()); ++d) {
    if (pr.device_memory_bytes[d] <= 0) continue;
    memory.push_back({{"device", d},
                      {"site", cluster.site_names[cluster.devices[d].site]},
                      {"name", cluster.devices[d].name},
                      {"bytes", JsonNumber(pr.device_memory_bytes[d])}});
  }
  for (int r = 0; r < p.dp; ++r) {
    for (int s = 0; s < p.pp; ++s) {
      for (int k = 0; k < p.tp; ++k) {
        const Device& d = cluster.devices[p.devices[r][s][k]];
        placement.push_back({{"replica", r},
                             {"stage", s},
                             {"tp_rank", k},
                             {"device", p.devices[r][s][k]},
                             {"site", cluster.site_names[d.site]},
                             {"worker", d.worker},
                             {"slot", d.slot}});
      }
    }
  }
  return Json{{"dp", p.dp},
              {"pp", p.pp},
              {"tp", p.tp},
              {"microbatch_size", p.microbatch_size},
              {"microbatches", p.microbatches},
              {"schedule", ScheduleName(p.schedule)},
              {"pipeline_depth", pr.pipeline_depth},
              {"layout", c.layout},
              {"subset", c.subset},
              {"devices_used", DevicesUsedName(cluster, c)},
              {"fits", pr.fits},
              {"precision", pr.precision},
              {"reject_reason", pr.reject_reason},
              {"step_time_s", JsonNumber(pr.step_time_s)},
              {"tokens_per_s", JsonNumber(pr.tokens_per_s)},
              {"pipeline_time_s", JsonNumber(pr.pipeline_time_s)},
              {"dp_exposed_s", JsonNumber(pr.dp_exposed_s)},
              {"tied_sync_s", JsonNumber(pr.tied_sync_s)},
              {"scalar_sync_s", JsonNumber(pr.scalar_sync_s)},
              {"bubble_fraction", JsonNumber(pr.bubble_fraction)},
              {"compute_bound_s", JsonNumber(pr.compute_bound_s)},
              {"max_memory_fraction", JsonNumber(pr.max_memory_fraction)},
              {"left_out_devices", c.left_out},
              {"stages", std::move(stages)},
              {"cross_site_links", std::move(links)},
              {"device_memory", std::move(memory)},
              {"placement", std::move(placement)}};
}

}  // namespace

std::string PlanCandidateToJson(const Cluster& cluster, const ModelCosts& model, const PlanCandidate& c) {
  return DumpJson(CandidateJson(cluster, model, c));
}

std::string PlanResultToJson(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                             const PlanResult& result, int top) {
  Json ranked = Json::array(), rejected = Json::array();
  for (int i = 0; i < std::min<int>(top, result.ranked.size()); ++i) {
    ranked.push_back(CandidateJson(cluster, model, result.ranked[i]));
  }
  for (const PlanCandidate& c : result.rejected) rejected.push_back(CandidateJson(cluster, model, c));
  const Json json{{"global_batch", job.global_batch},
                  {"seq_len", job.seq_len},
                  {"devices", cluster.devices.size()},
                  {"sites", cluster.num_sites()},
                  {"plans_simulated", result.plans_simulated},
                  {"planning_seconds", JsonNumber(result.planning_seconds)},
                  {"ranked", std::move(ranked)},
                  {"rejected", std::move(rejected)},
                  {"explanation", result.explanation}};
  return DumpJson(json) + "\n";
}

std::string FormatPlanResult(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                             const PlanResult& result, int top) {
  std::string out =
      absl::StrFormat("%d devices in %d site%s, global batch %d x %d tokens; %d plans simulated in %.3f s\n\n",
                      cluster.devices.size(), cluster.num_sites(), cluster.num_sites() == 1 ? "" : "s",
                      job.global_batch, job.seq_len, result.plans_simulated, result.planning_seconds);
  absl::StrAppendFormat(&out, "%-4s %9s %10s %3s %3s %3s %4s %-11s %-6s %6s %8s %10s  %-14s %s\n", "rank", "step_s",
                        "tokens/s", "dp", "pp", "tp", "mb", "m/replica", "sched", "bubble", "mem_GB", "wan_GB",
                        "layout", "devices");
  for (int i = 0; i < std::min<int>(top, result.ranked.size()); ++i) {
    const PlanCandidate& c = result.ranked[i];
    const Prediction& pr = c.prediction;
    double wan = 0, mem = 0;
    for (const LinkTraffic& t : pr.cross_site) wan += t.bytes;
    for (double m : pr.device_memory_bytes) mem = std::max(mem, m);
    std::string m = absl::StrJoin(c.plan.microbatches, "/");
    if (m.size() > 11) m = absl::StrCat(c.plan.microbatches.front(), "..", c.plan.microbatches.back());
    absl::StrAppendFormat(&out, "%-4d %9.4f %10.0f %3d %3d %3d %4d %-11s %-6s %5.0f%% %8.2f %10.3f  %-14s %s\n", i + 1,
                          pr.step_time_s, pr.tokens_per_s, c.plan.dp, c.plan.pp, c.plan.tp, c.plan.microbatch_size, m,
                          ScheduleName(c.plan.schedule), 100 * pr.bubble_fraction, mem / 1e9, wan / 1e9, c.layout,
                          DevicesUsedName(cluster, c));
  }
  out += "\nwhy this plan:\n";
  for (const std::string& line : result.explanation) absl::StrAppend(&out, "  - ", line, "\n");
  if (!result.rejected.empty()) {
    out += "\nrejected (do not fit in memory):\n";
    for (const PlanCandidate& c : result.rejected) {
      absl::StrAppend(&out, "  - ", ShapeName(c.plan), " ", c.layout, " (", c.subset, "): ", c.prediction.reject_reason,
                      "\n");
    }
  }
  (void)model;
  return out;
}

}  // namespace geotrain::scheduler
