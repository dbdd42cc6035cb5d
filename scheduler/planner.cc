// PlanJob (see planner.h and docs/planner.md): which device subsets to search, in what order, and how the
// candidates found are ranked. The search of one subset is in planner_search.cc, the explanation of the winner
// in planner_explain.cc, the manual form, JSON and text output in planner_output.cc.
#include "scheduler/planner.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "scheduler/planner_internal.h"

namespace geotrain::scheduler {
namespace {

using internal::Better;
using internal::kInf;
using internal::TotalMicrobatches;

std::string best_subset_name(const std::map<std::string, double>& subset_best) {
  std::string name;
  double t = kInf;
  for (const auto& [n, time] : subset_best) {
    if (time < t) {
      t = time;
      name = n;
    }
  }
  return name;
}

}  // namespace

absl::StatusOr<PlanResult> PlanJob(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                   const PlannerOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(cluster.Validate());
  for (int site : options.required_sites) {
    if (site < 0 || site >= cluster.num_sites()) {
      return absl::InvalidArgumentError(absl::StrCat("plan: required site index ", site, " is not in the cluster"));
    }
  }
  if (job.global_batch < 1 || job.seq_len < 1) {
    return absl::InvalidArgumentError("plan: global batch and sequence length must be positive");
  }
  if (model.seq_len != job.seq_len || model.num_layers() < 2) {
    return absl::InvalidArgumentError("plan: model costs were built for another sequence length");
  }
  if (!(job.efficiency > 0 && job.efficiency <= 1) || job.memory_headroom < 0 || job.memory_headroom >= 1) {
    return absl::InvalidArgumentError("plan: efficiency must be in (0, 1] and memory headroom in [0, 1)");
  }
  internal::Search search(cluster, model, job, options);
  std::map<std::string, double> subset_best;
  std::map<std::string, std::vector<int>> subset_devices;
  auto evaluate = [&](const std::vector<int>& devices, const std::string& name) {
    if (devices.empty() || subset_best.count(name)) return;
    for (int site : options.required_sites) {  // a subset without a required site has no plan for the job
      if (std::none_of(devices.begin(), devices.end(), [&](int d) { return cluster.devices[d].site == site; })) return;
    }
    subset_devices[name] = devices;
    const int64_t before = search.simulated();
    const auto t0 = std::chrono::steady_clock::now();
    subset_best[name] = search.Run(devices, name);
    if (std::getenv("GEOTRAIN_PLAN_DEBUG") != nullptr) {
      std::fprintf(stderr, "subset %s: %zu devices, best %.3f s, %lld simulated, %.3f s\n", name.c_str(),
                   devices.size(), subset_best[name], static_cast<long long>(search.simulated() - before),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  };
  std::vector<int> all(cluster.devices.size());
  std::iota(all.begin(), all.end(), 0);
  // Single sites first: they are cheap and give a good step time early, which prunes the larger
  // searches.
  std::vector<std::vector<int>> site_devices(cluster.num_sites());
  for (int d : all) site_devices[cluster.devices[d].site].push_back(d);
  if (options.search_subsets && cluster.num_sites() > 1) {
    for (int site = 0; site < cluster.num_sites(); ++site) {
      evaluate(site_devices[site], absl::StrCat("site ", cluster.site_names[site]));
    }
  }
  evaluate(all, "all devices");
  if (options.search_subsets && cluster.num_sites() > 1) {
    auto best_subset = [&]() { return best_subset_name(subset_best); };
    auto worth = [&](const std::vector<int>& devices) {
      return !devices.empty() && search.ComputeBound(devices) < search.best_time();
    };
    // Grow from the best single site, adding next the site with the best link to the set (the set's
    //    slowest link to it), at sizes 2, 4, 8, ... sites.
    {
      int start = -1;
      double start_time = kInf;
      for (int site = 0; site < cluster.num_sites(); ++site) {
        auto it = subset_best.find(absl::StrCat("site ", cluster.site_names[site]));
        if (it != subset_best.end() && it->second < start_time) {
          start_time = it->second;
          start = site;
        }
      }
      if (start >= 0) {
        std::vector<int> members = {start};
        std::vector<bool> in(cluster.num_sites(), false);
        in[start] = true;
        std::vector<int> devices = site_devices[start];
        int next_size = 2;
        while (static_cast<int>(members.size()) < cluster.num_sites() - 1) {
          int pick = -1;
          double pick_bw = -1, pick_lat = kInf;
          for (int site = 0; site < cluster.num_sites(); ++site) {
            if (in[site]) continue;
            double bw = kInf, lat = 0;
            for (int m : members) {
              bw = std::min(bw, cluster.Link(m, site).bandwidth_bytes_per_s);
              lat = std::max(lat, cluster.Link(m, site).latency_s);
            }
            if (bw > pick_bw || (bw == pick_bw && lat < pick_lat)) {
              pick = site;
              pick_bw = bw;
              pick_lat = lat;
            }
          }
          members.push_back(pick);
          in[pick] = true;
          devices.insert(devices.end(), site_devices[pick].begin(), site_devices[pick].end());
          if (static_cast<int>(members.size()) == next_size) {
            next_size *= 2;
            std::vector<std::string> names;
            for (int m : members) names.push_back(cluster.site_names[m]);
            std::sort(devices.begin(), devices.end());
            if (worth(devices)) evaluate(devices, absl::StrCat("sites ", absl::StrJoin(names, "+")));
          }
        }
      }
    }
    // Greedily without one more site, from the best subset so far (a few rounds).
    for (int round = 0; round < 3; ++round) {
      const std::string current = best_subset();
      if (current.empty()) break;
      const double current_time = subset_best[current];
      const std::vector<int> base = subset_devices[current];
      std::set<int> sites;
      for (int d : base) sites.insert(cluster.devices[d].site);
      if (sites.size() < 2 || sites.size() > 8) break;
      bool improved = false;
      for (int site : sites) {
        std::vector<int> kept;
        for (int d : base) {
          if (cluster.devices[d].site != site) kept.push_back(d);
        }
        if (!worth(kept)) continue;
        const std::string name = absl::StrCat(current, " without site ", cluster.site_names[site]);
        evaluate(kept, name);
        improved = improved || subset_best[name] < current_time * (1 - 1e-9);
      }
      if (!improved) break;
    }
  }
  if (options.search_subsets) {
    // Without the slowest device types (cumulatively), on all devices and on the best subset.
    std::vector<std::string> bases = {"all devices"};
    if (const std::string best = best_subset_name(subset_best); best != "all devices") bases.push_back(best);
    for (const std::string& base_name : bases) {
      const std::vector<int> base = subset_devices[base_name];
      std::map<double, std::set<std::string>> by_speed;
      for (int d : base) by_speed[search.EffectiveFlops(d)].insert(cluster.devices[d].name);
      std::vector<std::string> dropped;
      for (auto it = by_speed.begin(); it != by_speed.end() && std::next(it) != by_speed.end(); ++it) {
        dropped.insert(dropped.end(), it->second.begin(), it->second.end());
        std::vector<int> kept;
        for (int d : base) {
          if (search.EffectiveFlops(d) > it->first) kept.push_back(d);
        }
        if (kept.empty() || search.ComputeBound(kept) >= search.best_time()) break;
        evaluate(kept, absl::StrCat(base_name == "all devices" ? "" : base_name + ", ", "without ",
                                    absl::StrJoin(dropped, ", ")));
      }
    }
  }
  PlanResult result;
  std::vector<PlanCandidate> ranked;
  for (auto& [key, c] : search.best_by_key()) ranked.push_back(c);
  std::sort(ranked.begin(), ranked.end(), [](const PlanCandidate& a, const PlanCandidate& b) {
    if (a.prediction.step_time_s != b.prediction.step_time_s)
      return a.prediction.step_time_s < b.prediction.step_time_s;
    return TotalMicrobatches(a.plan) < TotalMicrobatches(b.plan);
  });
  // The same shape on the same devices can come from several subsets or layouts: keep the best (near-ties
  // to fewer microbatches, as within a key).
  std::map<std::tuple<int, int, int, std::vector<int>>, size_t> seen;
  for (PlanCandidate& c : ranked) {
    auto [it, added] = seen.emplace(std::make_tuple(c.plan.dp, c.plan.pp, c.plan.tp, c.left_out), result.ranked.size());
    if (added) {
      result.ranked.push_back(std::move(c));
    } else {
      PlanCandidate& kept = result.ranked[it->second];
      if (Better(c.plan, c.prediction.step_time_s, kept.plan, kept.prediction.step_time_s)) kept = std::move(c);
    }
  }
  std::stable_sort(result.ranked.begin(), result.ranked.end(), [](const PlanCandidate& a, const PlanCandidate& b) {
    return a.prediction.step_time_s < b.prediction.step_time_s;
  });
  for (auto& [key, c] : search.rejected_by_key()) {
    if (!search.best_by_key().count(key) && !search.sliced_keys().count(key)) result.rejected.push_back(c);
  }
  std::sort(result.rejected.begin(), result.rejected.end(), [](const PlanCandidate& a, const PlanCandidate& b) {
    return a.prediction.max_memory_fraction < b.prediction.max_memory_fraction;
  });
  result.plans_simulated = search.simulated();
  if (result.ranked.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("plan: no plan fits in memory; closest: ",
                     result.rejected.empty() ? std::string("none") : result.rejected.front().prediction.reject_reason,
                     "; use a smaller global batch or sequence length, a smaller model, or devices "
                     "with more memory"));
  }
  result.explanation = internal::Explain(cluster, model, job, search.best_by_key(), subset_best, result.ranked.front());
  if (static_cast<int>(result.ranked.size()) > options.max_ranked) result.ranked.resize(options.max_ranked);
  if (static_cast<int>(result.rejected.size()) > options.max_rejected) result.rejected.resize(options.max_rejected);
  result.planning_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return result;
}

std::vector<int> RuntimeStageBegin(const ModelCosts& model, int pp) {
  const int blocks = model.num_layers() - 2;  // [embedding, h.0 .. h.L-1, head]
  if (pp < 1 || pp > blocks) return {};
  std::vector<int> begin(pp + 1);
  begin[0] = 0;
  for (int s = 1; s < pp; ++s) begin[s] = 1 + SplitStageBlocks(blocks, s, pp).first;  // layer 0 is the embedding
  begin[pp] = model.num_layers();
  return begin;
}

}  // namespace geotrain::scheduler
