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
#include <optional>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "model/precision.h"
#include "scheduler/planner_internal.h"

namespace geotrain::scheduler {
namespace {

using internal::Better;
using internal::kInf;
using internal::TotalMicrobatches;

// PlanJob's checks of its inputs; errors name what is wrong.
absl::Status CheckPlanInputs(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                             const PlannerOptions& options) {
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
  return absl::OkStatus();
}

}  // namespace

namespace internal {

SubsetSearch::SubsetSearch(const Cluster& cluster, const PlannerOptions& options, Search* search)
    : cluster_(cluster), options_(options), search_(*search), all_(cluster.devices.size()) {
  std::iota(all_.begin(), all_.end(), 0);
  site_devices_.resize(cluster.num_sites());
  for (int d : all_) site_devices_[cluster.devices[d].site].push_back(d);
}

std::optional<double> SubsetSearch::Evaluate(const std::vector<int>& devices, const std::string& name) {
  if (devices.empty()) return std::nullopt;
  if (auto searched = subset_best_.find(name); searched != subset_best_.end()) return searched->second;
  for (int site : options_.required_sites) {  // a subset without a required site has no plan for the job
    if (std::none_of(devices.begin(), devices.end(), [&](int d) { return cluster_.devices[d].site == site; })) {
      return std::nullopt;
    }
  }
  subset_devices_[name] = devices;
  const int64_t before = search_.simulated();
  const auto t0 = std::chrono::steady_clock::now();
  const double best = search_.Run(devices, name);
  subset_best_[name] = best;
  if (std::getenv("GEOTRAIN_PLAN_DEBUG") != nullptr) {
    std::fprintf(stderr, "subset %s: %zu devices, best %.3f s, %lld simulated, %.3f s\n", name.c_str(), devices.size(),
                 best, static_cast<long long>(search_.simulated() - before),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

const std::string* SubsetSearch::BestSubset() const {
  const std::string* name = nullptr;
  double time = kInf;
  for (const auto& [n, t] : subset_best_) {
    if (t < time) {
      time = t;
      name = &n;
    }
  }
  return name;
}

void SubsetSearch::SingleSitesThenAll() {
  if (options_.search_subsets && cluster_.num_sites() > 1) {
    for (int site = 0; site < cluster_.num_sites(); ++site) {
      Evaluate(site_devices_[site], absl::StrCat("site ", cluster_.site_names[site]));
    }
  }
  Evaluate(all_, "all devices");
}

void SubsetSearch::GrowFromBestSite() {
  int start = -1;
  double start_time = kInf;
  for (int site = 0; site < cluster_.num_sites(); ++site) {
    auto it = subset_best_.find(absl::StrCat("site ", cluster_.site_names[site]));
    if (it != subset_best_.end() && it->second < start_time) {
      start_time = it->second;
      start = site;
    }
  }
  if (start < 0) return;
  std::vector<int> members = {start};
  std::vector<bool> in(cluster_.num_sites(), false);
  in[start] = true;
  std::vector<int> devices = site_devices_[start];
  int next_size = 2;
  while (static_cast<int>(members.size()) < cluster_.num_sites() - 1) {
    int pick = -1;
    double pick_bw = -1, pick_lat = kInf;
    for (int site = 0; site < cluster_.num_sites(); ++site) {
      if (in[site]) continue;
      double bw = kInf, lat = 0;
      for (int m : members) {
        bw = std::min(bw, cluster_.Link(m, site).bandwidth_bytes_per_s);
        lat = std::max(lat, cluster_.Link(m, site).latency_s);
      }
      if (bw > pick_bw || (bw == pick_bw && lat < pick_lat)) {
        pick = site;
        pick_bw = bw;
        pick_lat = lat;
      }
    }
    members.push_back(pick);
    in[pick] = true;
    devices.insert(devices.end(), site_devices_[pick].begin(), site_devices_[pick].end());
    if (static_cast<int>(members.size()) == next_size) {
      next_size *= 2;
      std::vector<std::string> names;
      for (int m : members) names.push_back(cluster_.site_names[m]);
      std::sort(devices.begin(), devices.end());
      if (Worth(devices)) Evaluate(devices, absl::StrCat("sites ", absl::StrJoin(names, "+")));
    }
  }
}

void SubsetSearch::WithoutSites() {
  for (int round = 0; round < 3; ++round) {
    const std::string* best = BestSubset();
    if (best == nullptr) break;
    const std::string current = *best;  // the subset's name
    const double current_time = subset_best_.at(current);
    const std::vector<int> base = subset_devices_.at(current);  // Evaluate sets both maps together
    std::set<int> sites;
    for (int d : base) sites.insert(cluster_.devices[d].site);
    if (sites.size() < 2 || sites.size() > 8) break;
    bool improved = false;
    for (int site : sites) {
      std::vector<int> kept;
      for (int d : base) {
        if (cluster_.devices[d].site != site) kept.push_back(d);
      }
      if (!Worth(kept)) continue;
      const std::string name = absl::StrCat(current, " without site ", cluster_.site_names[site]);
      // Not searched (it lacks a required site): neither an improvement nor a subset to go on from.
      const std::optional<double> time = Evaluate(kept, name);
      improved = improved || (time.has_value() && *time < current_time * (1 - 1e-9));
    }
    if (!improved) break;
  }
}

void SubsetSearch::WithoutSlowestDeviceTypes() {
  std::vector<std::string> bases = {"all devices"};
  if (const std::string* best = BestSubset(); best != nullptr && *best != "all devices") bases.push_back(*best);
  for (const std::string& base_name : bases) {
    auto searched = subset_devices_.find(base_name);
    if (searched == subset_devices_.end()) continue;  // never searched (no devices): nothing to leave out
    const std::vector<int> base = searched->second;
    std::map<double, std::set<std::string>> by_speed;
    for (int d : base) by_speed[search_.EffectiveFlops(d)].insert(cluster_.devices[d].name);
    std::vector<std::string> dropped;
    for (auto it = by_speed.begin(); it != by_speed.end() && std::next(it) != by_speed.end(); ++it) {
      dropped.insert(dropped.end(), it->second.begin(), it->second.end());
      std::vector<int> kept;
      for (int d : base) {
        if (search_.EffectiveFlops(d) > it->first) kept.push_back(d);
      }
      if (kept.empty() || search_.ComputeBound(kept) >= search_.best_time()) break;
      Evaluate(kept, absl::StrCat(base_name == "all devices" ? "" : base_name + ", ", "without ",
                                  absl::StrJoin(dropped, ", ")));
    }
  }
}

void SubsetSearch::WithoutGpusWithoutBf16() {
  std::vector<std::string> bases = {"all devices"};
  if (const std::string* best = BestSubset(); best != nullptr && *best != "all devices") bases.push_back(*best);
  for (const std::string& base_name : bases) {
    auto searched = subset_devices_.find(base_name);
    if (searched == subset_devices_.end()) continue;
    std::vector<int> kept;
    std::set<std::string> dropped;
    for (int d : searched->second) {
      const int cc = cluster_.devices[d].compute_capability;
      if (cc == 0 || model::PrecisionSupported(model::Precision::kBf16, cc)) {
        kept.push_back(d);
      } else {
        dropped.insert(cluster_.devices[d].name);
      }
    }
    if (dropped.empty() || !Worth(kept)) continue;
    Evaluate(kept, absl::StrCat(base_name == "all devices" ? "" : base_name + ", ", "without ",
                                absl::StrJoin(dropped, ", "), " (no bf16: fp32 with this codec)"));
  }
}

}  // namespace internal

namespace {

// The search's candidates ranked into result->ranked (fastest first, one per shape on the same devices) and its
// shapes that never fit into result->rejected (closest to fitting first).
void RankCandidates(internal::Search& search, PlanResult* result) {
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
    auto [it, added] =
        seen.emplace(std::make_tuple(c.plan.dp, c.plan.pp, c.plan.tp, c.left_out), result->ranked.size());
    if (added) {
      result->ranked.push_back(std::move(c));
    } else {
      PlanCandidate& kept = result->ranked[it->second];
      if (Better(c.plan, c.prediction.step_time_s, kept.plan, kept.prediction.step_time_s)) kept = std::move(c);
    }
  }
  std::stable_sort(result->ranked.begin(), result->ranked.end(), [](const PlanCandidate& a, const PlanCandidate& b) {
    return a.prediction.step_time_s < b.prediction.step_time_s;
  });
  for (auto& [key, c] : search.rejected_by_key()) {
    if (!search.best_by_key().count(key) && !search.sliced_keys().count(key)) result->rejected.push_back(c);
  }
  std::sort(result->rejected.begin(), result->rejected.end(), [](const PlanCandidate& a, const PlanCandidate& b) {
    return a.prediction.max_memory_fraction < b.prediction.max_memory_fraction;
  });
}

}  // namespace

absl::StatusOr<PlanResult> PlanJob(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                   const PlannerOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(CheckPlanInputs(cluster, model, job, options));
  internal::Search search(cluster, model, job, options);
  internal::SubsetSearch subsets(cluster, options, &search);
  subsets.SingleSitesThenAll();
  if (options.search_subsets && cluster.num_sites() > 1) {
    subsets.GrowFromBestSite();
    subsets.WithoutSites();
  }
  if (options.search_subsets) subsets.WithoutSlowestDeviceTypes();
  if (options.search_subsets && (job.precision.empty() || job.precision == "auto") && job.finite_only_codec) {
    subsets.WithoutGpusWithoutBf16();
  }
  PlanResult result;
  RankCandidates(search, &result);
  result.plans_simulated = search.simulated();
  if (result.ranked.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("plan: no plan fits in memory; closest: ",
                     result.rejected.empty() ? std::string("none") : result.rejected.front().prediction.reject_reason,
                     "; use a smaller global batch or sequence length, a smaller model, or devices "
                     "with more memory"));
  }
  result.explanation =
      internal::Explain(cluster, model, job, search.best_by_key(), subsets.subset_best(), result.ranked.front());
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
