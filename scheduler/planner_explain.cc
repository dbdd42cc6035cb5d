// The planner's explanation of its winner (Explain, see planner_internal.h): a few lines a user reads to see
// why this plan, what the alternatives would cost, and where the WAN traffic goes.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "scheduler/planner_internal.h"

namespace geotrain::scheduler::internal {
namespace {

std::string DeviceTypeName(const Cluster& cluster, const std::vector<int>& devices) {
  std::set<std::string> names;
  for (int d : devices) names.insert(cluster.devices[d].name);
  return absl::StrJoin(names, "+");
}

// "2 x T4 at star, 1 x A40 at star" for a plan's left-out devices, by site and device type.
std::string LeftOutParts(const Cluster& cluster, const std::vector<int>& left_out) {
  std::map<std::pair<int, std::string>, std::vector<int>> by_site_and_type;
  for (int d : left_out) by_site_and_type[{cluster.devices[d].site, cluster.devices[d].name}].push_back(d);
  std::vector<std::string> parts;
  for (const auto& [where, ds] : by_site_and_type) {
    parts.push_back(
        absl::StrFormat("%d x %s at %s", ds.size(), DeviceTypeName(cluster, ds), cluster.site_names[where.first]));
  }
  return absl::StrJoin(parts, ", ");
}

std::string Gb(double bytes) { return absl::StrFormat("%.2f GB", bytes / 1e9); }

// " depth 6" when the 1F1B pipeline runs deeper than pp to cover a slow boundary's round trip.
std::string DepthNote(const Plan& p, const Prediction& pr) {
  if (p.schedule != Schedule::k1F1B || pr.pipeline_depth <= p.pp) return "";
  return absl::StrFormat(" depth %d (%d microbatches in flight cover the slowest boundary's round trip)",
                         pr.pipeline_depth, pr.pipeline_depth);
}

}  // namespace

std::string ShapeName(const Plan& p) { return absl::StrFormat("dp=%d pp=%d tp=%d", p.dp, p.pp, p.tp); }

std::vector<std::string> Explain(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                 const std::map<Key, PlanCandidate>& best_by_key,
                                 const std::map<std::string, double>& subset_best, const PlanCandidate& w) {
  std::vector<std::string> lines;
  const Plan& p = w.plan;
  const Prediction& pr = w.prediction;
  lines.push_back(
      absl::StrFormat("winner: %s, microbatch %d x %d per replica, %s%s, %s: %.3f s per step, %.0f tokens/s; "
                      "pipeline %.3f s "
                      "(bubble %.0f%%), exposed gradient all-reduce %.3f s, tied-embedding sync %.3f s; compute "
                      "alone would "
                      "take %.3f s",
                      ShapeName(p), p.microbatch_size, p.microbatches.front(), ScheduleName(p.schedule),
                      DepthNote(p, pr), w.layout, pr.step_time_s, pr.tokens_per_s, pr.pipeline_time_s,
                      100 * pr.bubble_fraction, pr.dp_exposed_s, pr.tied_sync_s, pr.compute_bound_s));
  // Alternatives: best pure DP, best pure pipeline, best with tensor parallelism, on any subset.
  auto best_where = [&](auto predicate) -> const PlanCandidate* {
    const PlanCandidate* best = nullptr;
    for (const auto& [key, c] : best_by_key) {
      if (!predicate(c.plan)) continue;
      if (!best || c.prediction.step_time_s < best->prediction.step_time_s) best = &c;
    }
    return best;
  };
  std::vector<std::string> versus;
  auto compare = [&](const char* what, const PlanCandidate* c) {
    if (c == nullptr) {
      versus.push_back(absl::StrCat(what, ": no plan fits"));
    } else if (c->plan.dp != p.dp || c->plan.pp != p.pp || c->plan.tp != p.tp) {
      versus.push_back(absl::StrFormat("%s (%s) %.3f s = %.2fx (exposed all-reduce %.3f s, bubble %.0f%%)", what,
                                       ShapeName(c->plan), c->prediction.step_time_s,
                                       c->prediction.step_time_s / pr.step_time_s, c->prediction.dp_exposed_s,
                                       100 * c->prediction.bubble_fraction));
    }
  };
  compare("pure data parallelism", best_where([](const Plan& x) { return x.pp == 1 && x.tp == 1; }));
  compare("pure pipeline", best_where([](const Plan& x) { return x.dp == 1 && x.tp == 1; }));
  compare("best with tp>1", best_where([](const Plan& x) { return x.tp > 1; }));
  compare("best with dp>1 and pp>1", best_where([](const Plan& x) { return x.dp > 1 && x.pp > 1; }));
  if (!versus.empty()) lines.push_back(absl::StrCat("alternatives: ", absl::StrJoin(versus, "; ")));
  // Pipeline boundaries of replica 0 and where the sites change.
  if (p.pp > 1) {
    std::vector<std::string> at;
    int crossing = 0;
    for (int s = 0; s + 1 < p.pp; ++s) {
      const int a = cluster.devices[p.devices[0][s][0]].site, b = cluster.devices[p.devices[0][s + 1][0]].site;
      const std::string after = model.layers[p.stage_begin[s + 1] - 1].name;
      if (a == b) {
        at.push_back(absl::StrCat("after ", after, " inside ", cluster.site_names[a]));
      } else {
        ++crossing;
        const LinkSpec& l = cluster.Link(a, b);
        at.push_back(absl::StrFormat("after %s on the %s-%s site boundary (%.1f ms, %.0f Mbit/s)", after,
                                     cluster.site_names[a], cluster.site_names[b], l.latency_s * 1e3,
                                     l.bandwidth_bytes_per_s * 8 / 1e6));
      }
    }
    std::vector<int> layers;
    for (int s = 0; s < p.pp; ++s) layers.push_back(p.stage_begin[s + 1] - p.stage_begin[s]);
    lines.push_back(
        absl::StrFormat("pipeline (replica 0): stages hold %s layers (embedding and head count as "
                        "one each); boundaries %s; %d of %d boundaries cross sites",
                        absl::StrJoin(layers, "/"), absl::StrJoin(at, ", "), crossing, p.pp - 1));
  }
  if (p.dp > 1) {
    int spanning = 0;
    for (int s = 0; s < p.pp; ++s) {
      std::set<int> sites;
      for (int r = 0; r < p.dp; ++r) sites.insert(cluster.devices[p.devices[r][s][0]].site);
      if (sites.size() > 1) ++spanning;
    }
    const bool equal =
        std::all_of(p.microbatches.begin(), p.microbatches.end(), [&](int m) { return m == p.microbatches.front(); });
    lines.push_back(absl::StrFormat(
        "data parallelism: %d of %d stage groups all-reduce across sites%s; replicas run %s "
        "microbatches%s",
        spanning, p.pp, spanning == 0 ? " (every DP group stays inside a site)" : "",
        absl::StrJoin(p.microbatches, "/"), equal ? " (equal shares)" : " (shares in proportion to replica speed)"));
  }
  // Devices left out.
  if (!w.left_out.empty()) {
    std::string why;
    auto all = subset_best.find("all devices");
    if (w.subset != "all devices" && all != subset_best.end()) {
      why = all->second < kInf ? absl::StrFormat("the best plan on all devices takes %.3f s (%.2fx); %s is faster",
                                                 all->second, all->second / pr.step_time_s, w.subset)
                               : absl::StrFormat("no plan on all devices fits; %s does", w.subset);
    } else {
      // Inside the searched set: the best plan that uses more devices, if any, was slower.
      const PlanCandidate* more = nullptr;
      for (const auto& [key, c] : best_by_key) {
        if (c.left_out.size() < w.left_out.size() &&
            (more == nullptr || c.prediction.step_time_s < more->prediction.step_time_s)) {
          more = &c;
        }
      }
      why = more != nullptr
                ? absl::StrFormat("the best plan using more devices (%s, %d devices, %s) takes %.3f s (%.2fx)",
                                  ShapeName(more->plan), cluster.devices.size() - more->left_out.size(), more->subset,
                                  more->prediction.step_time_s, more->prediction.step_time_s / pr.step_time_s)
                : absl::StrFormat("no plan that uses them fits in memory or fills the shape %s", ShapeName(p));
    }
    lines.push_back(absl::StrCat("left out: ", LeftOutParts(cluster, w.left_out), "; ", why));
  } else {
    lines.push_back("left out: none; every device speeds the job up");
  }
  for (const LinkTraffic& t : pr.cross_site) {
    const LinkSpec& l = cluster.Link(t.site_a, t.site_b);
    lines.push_back(
        absl::StrFormat("link %s-%s (%.1f ms, %.0f Mbit/s): %s per step (gradients %s%s, activations %s%s); a "
                        "codec is chosen "
                        "per link as the one with the least ratio/bandwidth + 2/codec throughput",
                        cluster.site_names[t.site_a], cluster.site_names[t.site_b], l.latency_s * 1e3,
                        l.bandwidth_bytes_per_s * 8 / 1e6, Gb(t.bytes), Gb(t.gradient_bytes),
                        t.gradient_codec.empty() ? "" : absl::StrCat(" ", t.gradient_codec), Gb(t.activation_bytes),
                        t.activation_codec.empty() ? "" : absl::StrCat(" ", t.activation_codec)));
  }
  (void)job;
  return lines;
}

}  // namespace geotrain::scheduler::internal

namespace geotrain::scheduler {

std::string DevicesUsedName(const Cluster& cluster, const PlanCandidate& candidate) {
  if (candidate.left_out.empty()) return "all devices";
  return absl::StrCat("without ", internal::LeftOutParts(cluster, candidate.left_out));
}

}  // namespace geotrain::scheduler
