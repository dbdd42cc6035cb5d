// The plan search (see planner.h and docs/planner.md).
#include "scheduler/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "spec.pb.h"

namespace geotrain::scheduler {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Shapes and microbatch sizes whose lower bound exceeds this factor times the best step time found
// so far are not simulated (pure DP and pure pipeline shapes always are: the explanation compares
// with them).
constexpr double kPruneFactor = 1.25;
// More microbatches must predict a step shorter by more than this fraction to be preferred: each
// microbatch has fixed costs (kernel launches, messages, smaller GEMMs) that a calibration on a busy
// machine can measure as zero, so a near-tie is settled for the fewer, larger microbatches.
constexpr double kMicrobatchTie = 0.005;

int TotalMicrobatches(const Plan& p) {
  int m = 0;
  for (int x : p.microbatches) m += x;
  return m;
}

// Whether plan a (predicted step time ta) is better than plan b (tb): faster, with near-ties (within
// kMicrobatchTie) going to the plan with fewer microbatches.
bool Better(const Plan& a, double ta, const Plan& b, double tb) {
  const int ma = TotalMicrobatches(a), mb = TotalMicrobatches(b);
  if (ma > mb) return ta < tb * (1 - kMicrobatchTie);
  if (ma < mb) return ta * (1 - kMicrobatchTie) <= tb;  // b does not beat a by the margin
  return ta < tb;
}

// A tensor-parallel group of devices inside one site: the unit that holds one (replica, stage).
struct Unit {
  std::vector<int> devices;
  int site = 0;
  double flops = 0;  // effective FLOP/s of the slowest member (x tp gives the group's)
  double mem = 0;    // smallest member's memory
};

using Key = std::tuple<std::string, int, int, int, std::string>;  // subset, dp, pp, tp, layout

// Shares M microbatches among replicas in proportion to their speed (1 / bottleneck), at least one
// each, rounding by largest remainder.
std::vector<int> ShareMicrobatches(int M, const std::vector<double>& bottleneck, double speed_sum) {
  const int dp = static_cast<int>(bottleneck.size());
  std::vector<int> m(dp, 1);
  int assigned = dp;
  std::vector<std::pair<double, int>> remainder;
  for (int r = 0; r < dp; ++r) {
    const double share = (M - dp) * (1 / bottleneck[r]) / speed_sum;
    const int whole = static_cast<int>(std::floor(share));
    m[r] += whole;
    assigned += whole;
    remainder.push_back({share - whole, r});
  }
  std::stable_sort(remainder.begin(), remainder.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  for (int i = 0; assigned < M; ++i, ++assigned) ++m[remainder[i % dp].second];
  return m;
}

class Search {
 public:
  Search(const Cluster& cluster, const ModelCosts& model, const JobOptions& job, const PlannerOptions& options)
      : cluster_(cluster), model_(model), job_(job), options_(options) {
    const int L = model.num_layers();
    flops_.assign(L + 1, 0);
    params_.assign(L + 1, 0);
    acts_.assign(L + 1, 0);
    blocks_.assign(L + 1, 0);
    for (int l = 0; l < L; ++l) {
      flops_[l + 1] = flops_[l] + model.layers[l].forward_flops;
      params_[l + 1] = params_[l] + model.layers[l].parameters;
      acts_[l + 1] = acts_[l] + model.layers[l].activation_bytes;
      blocks_[l + 1] = blocks_[l] + (model.layers[l].tensor_parallel_comm ? 1 : 0);
    }
  }

  double EffectiveFlops(int device) const {
    const Device& d = cluster_.devices[device];
    return d.tflops * 1e12 * job_.EfficiencyOf(d.name);
  }

  // Step time if only compute mattered, on these devices: a lower bound for any plan using them.
  double ComputeBound(const std::vector<int>& devices) const {
    double f = 0;
    for (int d : devices) f += EffectiveFlops(d);
    return 3 * model_.TotalForwardFlops() * job_.global_batch / f;
  }

  // Searches every shape on `devices`; returns the best step time found.
  double Run(const std::vector<int>& devices, const std::string& subset_name);

  double best_time() const { return best_time_; }
  int64_t simulated() const { return simulated_; }
  std::map<Key, PlanCandidate>& best_by_key() { return best_by_key_; }
  std::map<Key, PlanCandidate>& rejected_by_key() { return rejected_by_key_; }
  // Shapes with a memory-feasible slicing for some microbatch size (even if pruned as too slow).
  const std::set<Key>& sliced_keys() const { return sliced_keys_; }

 private:
  std::vector<int> SiteChain(const std::vector<int>& devices) const;
  std::vector<Unit> MakeUnits(const std::vector<int>& devices, const std::vector<int>& chain, int tp) const;
  // Alpa-style inter-operator pass: slices layers into pp stages minimising the largest
  // per-microbatch stage time (compute + boundary transfer), memory-feasible for every stage. Empty
  // if none fits.
  std::vector<int> SliceStages(const std::vector<double>& stage_flops, const std::vector<double>& stage_mem,
                               const std::vector<double>& stage_tp_comm, const std::vector<double>& boundary_spb,
                               int tp, int dp, int b, int held_microbatches, Schedule schedule) const;
  void Consider(PlanCandidate candidate, const Key& key);
  // Seconds per raw byte from site a to site b with the codec the simulator would choose there.
  double SecondsPerByte(int a, int b, bool activations) const {
    const LinkSpec& link = cluster_.Link(a, b);
    const int codec = a == b ? -1 : ChooseCodec(job_, link, activations);
    return codec < 0 ? 1.0 / link.bandwidth_bytes_per_s : job_.codecs[codec].SecondsPerByte(link);
  }
  // A lower bound on the step time from cross-site gradient traffic alone: each stage's DP group
  // must move 2(S-1)/S of its gradients (all tp ranks) over its slowest ring hop between its S
  // sites, and the tied wte gradient must cross between the first and the last stage's sites.
  double CommunicationFloor(const std::vector<std::vector<const Unit*>>& unit_of, int tp,
                            const std::vector<int>& begin) const;
  // Whether a prediction would enter best_by_key_ or rejected_by_key_ (saves copying plans that
  // would not).
  bool Worth(const Key& key, const Plan& plan, const Prediction& p) const {
    if (!p.fits) return !best_by_key_.count(key);  // the last (smallest microbatch) rejection is kept
    auto it = best_by_key_.find(key);
    return it == best_by_key_.end() || Better(plan, p.step_time_s, it->second.plan, it->second.prediction.step_time_s);
  }

  const Cluster& cluster_;
  const ModelCosts& model_;
  const JobOptions& job_;
  const PlannerOptions& options_;
  std::vector<double> flops_, params_, acts_;
  std::vector<int> blocks_;
  std::map<Key, PlanCandidate> best_by_key_, rejected_by_key_;
  std::set<Key> sliced_keys_;
  std::map<Key, PlanCandidate> unsliced_;  // shapes with no feasible slicing yet, during one Run
  double best_time_ = kInf;
  int64_t simulated_ = 0;
};

std::vector<int> Search::SiteChain(const std::vector<int>& devices) const {
  std::vector<double> site_flops(cluster_.num_sites(), 0);
  for (int d : devices) site_flops[cluster_.devices[d].site] += EffectiveFlops(d);
  std::vector<int> chain;
  std::vector<bool> taken(cluster_.num_sites(), false);
  int current = static_cast<int>(std::max_element(site_flops.begin(), site_flops.end()) - site_flops.begin());
  while (current >= 0) {
    chain.push_back(current);
    taken[current] = true;
    int next = -1;
    for (int s = 0; s < cluster_.num_sites(); ++s) {
      if (taken[s] || site_flops[s] <= 0) continue;
      if (next < 0) {
        next = s;
        continue;
      }
      const LinkSpec &a = cluster_.Link(current, s), &b = cluster_.Link(current, next);
      if (a.latency_s < b.latency_s ||
          (a.latency_s == b.latency_s && a.bandwidth_bytes_per_s > b.bandwidth_bytes_per_s)) {
        next = s;
      }
    }
    current = next;
  }
  return chain;
}

std::vector<Unit> Search::MakeUnits(const std::vector<int>& devices, const std::vector<int>& chain, int tp) const {
  std::vector<Unit> units;
  for (int site : chain) {
    std::vector<int> here;
    for (int d : devices) {
      if (cluster_.devices[d].site == site) here.push_back(d);
    }
    std::stable_sort(here.begin(), here.end(), [&](int a, int b) {
      const Device &x = cluster_.devices[a], &y = cluster_.devices[b];
      if (EffectiveFlops(a) != EffectiveFlops(b)) return EffectiveFlops(a) > EffectiveFlops(b);
      return std::tie(x.worker, x.slot) < std::tie(y.worker, y.slot);
    });
    for (size_t i = 0; i + tp <= here.size(); i += tp) {
      Unit u;
      u.site = site;
      u.flops = kInf;
      u.mem = kInf;
      for (int k = 0; k < tp; ++k) {
        const int d = here[i + k];
        u.devices.push_back(d);
        u.flops = std::min(u.flops, EffectiveFlops(d));
        u.mem = std::min(u.mem, cluster_.devices[d].mem_bytes);
      }
      units.push_back(u);
    }
  }
  return units;
}

std::vector<int> Search::SliceStages(const std::vector<double>& stage_flops, const std::vector<double>& stage_mem,
                                     const std::vector<double>& stage_tp_comm, const std::vector<double>& boundary_spb,
                                     int tp, int dp, int b, int held_microbatches, Schedule schedule) const {
  const int L = model_.num_layers();
  const int pp = static_cast<int>(stage_flops.size());
  if (pp > L) return {};
  const double e = model_.bytes_per_element;
  const double state_per_param = StateBytesPerParameter(model_, job_, dp) / tp;
  const double buffer = 2.0 * b * model_.seq_len * model_.n_embd * e;
  // f[s][j]: best max stage time slicing layers [0, j) into stages 0..s-1.
  std::vector<std::vector<double>> f(pp + 1, std::vector<double>(L + 1, kInf));
  std::vector<std::vector<int>> from(pp + 1, std::vector<int>(L + 1, -1));
  f[0][0] = 0;
  for (int s = 0; s < pp; ++s) {
    const int held = schedule == Schedule::kGPipe ? held_microbatches : std::min(pp - s, held_microbatches);
    const double boundaries = (s > 0 ? 1 : 0) + (s + 1 < pp ? 1 : 0);
    const double usable = stage_mem[s] * (1 - job_.memory_headroom) - job_.fixed_memory_bytes - boundaries * buffer;
    // Stage s covers [i, j): it leaves room for the remaining pp - s - 1 stages.
    const int j_min = s + 1, j_max = L - (pp - s - 1);
    for (int j = j_min; j <= j_max; ++j) {
      if (s == pp - 1 && j != L) continue;
      for (int i = j - 1; i >= s; --i) {
        if (f[s][i] == kInf) continue;
        double params = params_[j] - params_[i];
        if (pp > 1 && j == L && i > 0) params += model_.tied_parameters;
        const double memory = params * state_per_param + (acts_[j] - acts_[i]) * b / tp * held;
        if (memory > usable) break;  // growing the stage further only adds memory
        double t = 3.0 * b * (flops_[j] - flops_[i]) / (tp * stage_flops[s]) +
                   2.0 * (blocks_[j] - blocks_[i]) * stage_tp_comm[s] + 3.0 * (j - i) * job_.layer_overhead_s;
        if (s + 1 < pp) t += b * model_.layers[j - 1].output_bytes * boundary_spb[s];
        const double v = std::max(f[s][i], t);
        if (v < f[s + 1][j]) {
          f[s + 1][j] = v;
          from[s + 1][j] = i;
        }
      }
    }
  }
  if (f[pp][L] == kInf) return {};
  std::vector<int> begin(pp + 1);
  begin[pp] = L;
  for (int s = pp, j = L; s > 0; --s) {
    j = from[s][j];
    begin[s - 1] = j;
  }
  return begin;
}

double Search::CommunicationFloor(const std::vector<std::vector<const Unit*>>& unit_of, int tp,
                                  const std::vector<int>& begin) const {
  const int dp = static_cast<int>(unit_of.size());
  const int pp = static_cast<int>(begin.size()) - 1;
  const int L = model_.num_layers();
  const double e = model_.bytes_per_element;
  double floor = 0;
  std::vector<char> present(cluster_.num_sites());
  for (int s = 0; s < pp && dp > 1; ++s) {
    std::fill(present.begin(), present.end(), 0);
    for (int r = 0; r < dp; ++r) present[unit_of[r][s]->site] = 1;
    std::vector<int> sites;
    for (int x = 0; x < cluster_.num_sites(); ++x) {
      if (present[x]) sites.push_back(x);
    }
    const int S = static_cast<int>(sites.size());
    if (S < 2) continue;
    double worst = 0;
    for (int i = 0; i < S; ++i) worst = std::max(worst, SecondsPerByte(sites[i], sites[(i + 1) % S], false));
    double params = params_[begin[s + 1]] - params_[begin[s]];
    if (pp > 1 && begin[s + 1] == L && begin[s] > 0) params += model_.tied_parameters;
    floor = std::max(floor, 2.0 * (S - 1) / S * params * e * worst);
    (void)tp;
  }
  if (pp > 1) {
    for (int r = 0; r < dp; ++r) {
      const int a = unit_of[r][0]->site, b = unit_of[r][pp - 1]->site;
      if (a != b) floor = std::max(floor, model_.tied_parameters * e * SecondsPerByte(a, b, false));
    }
  }
  return floor;
}

void Search::Consider(PlanCandidate candidate, const Key& key) {
  std::vector<char> used(cluster_.devices.size(), 0);
  for (const auto& replica : candidate.plan.devices) {
    for (const auto& stage : replica) {
      for (int d : stage) used[d] = 1;
    }
  }
  for (int d = 0; d < static_cast<int>(cluster_.devices.size()); ++d) {
    if (!used[d]) candidate.left_out.push_back(d);
  }
  if (!candidate.prediction.fits) {
    rejected_by_key_[key] = std::move(candidate);
    return;
  }
  best_time_ = std::min(best_time_, candidate.prediction.step_time_s);
  auto it = best_by_key_.find(key);
  if (it == best_by_key_.end() ||
      Better(candidate.plan, candidate.prediction.step_time_s, it->second.plan, it->second.prediction.step_time_s)) {
    best_by_key_[key] = std::move(candidate);
  }
}

double Search::Run(const std::vector<int>& devices, const std::string& subset_name) {
  double subset_best = kInf;
  const std::vector<int> chain = SiteChain(devices);
  const int G = job_.global_batch;
  const int L = model_.num_layers();
  for (int tp : options_.tp_degrees) {
    if (tp < 1 || (tp > 1 && (model_.n_head <= 0 || model_.n_head % tp != 0))) continue;  // heads split evenly
    std::vector<Unit> all_units = MakeUnits(devices, chain, tp);
    const int U = static_cast<int>(all_units.size());
    for (int pp = 1; pp <= std::min(U, L); ++pp) {
      const int dp = U / pp;
      if (dp < 1 || dp > G) continue;
      // Leave out the U - dp*pp slowest units (the last of equals in chain order).
      std::vector<int> order(U);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return all_units[a].flops > all_units[b].flops; });
      std::vector<bool> keep(U, false);
      for (int i = 0; i < dp * pp; ++i) keep[order[i]] = true;
      std::vector<const Unit*> units;
      for (int i = 0; i < U; ++i) {
        if (keep[i]) units.push_back(&all_units[i]);
      }
      // Compute alone on these units bounds every plan of this shape from below.
      double shape_flops = 0;
      for (const Unit* u : units) shape_flops += u->flops * tp;
      const bool reference_shape = tp == 1 && (pp == 1 || dp == 1);
      if (!reference_shape && 3 * model_.TotalForwardFlops() * G / shape_flops > kPruneFactor * best_time_) continue;
      for (const char* layout : {"pipeline-major", "stage-major"}) {
        const bool stage_major = std::string(layout) == "stage-major";
        if (stage_major && (dp == 1 || pp == 1)) continue;
        // unit_of[r][s]
        std::vector<std::vector<const Unit*>> unit_of(dp, std::vector<const Unit*>(pp));
        for (int r = 0; r < dp; ++r) {
          for (int s = 0; s < pp; ++s) unit_of[r][s] = units[stage_major ? s * dp + r : r * pp + s];
        }
        Plan base_plan;
        base_plan.dp = dp;
        base_plan.pp = pp;
        base_plan.tp = tp;
        base_plan.devices.assign(dp, std::vector<std::vector<int>>(pp));
        for (int r = 0; r < dp; ++r) {
          for (int s = 0; s < pp; ++s) base_plan.devices[r][s] = unit_of[r][s]->devices;
        }
        // Worst unit per stage and worst boundary per stage, over replicas (all replicas share the
        // slicing).
        std::vector<double> stage_flops(pp, kInf), stage_mem(pp, kInf), stage_tp_comm(pp, 0), boundary_spb(pp, 0);
        for (int s = 0; s < pp; ++s) {
          for (int r = 0; r < dp; ++r) {
            const Unit& u = *unit_of[r][s];
            stage_flops[s] = std::min(stage_flops[s], u.flops);
            stage_mem[s] = std::min(stage_mem[s], u.mem);
            if (s + 1 < pp) {
              const int a = u.site, c = unit_of[r][s + 1]->site;
              const LinkSpec& link = cluster_.Link(a, c);
              double spb = 1.0 / link.bandwidth_bytes_per_s;
              if (a != c) {
                const int codec = ChooseCodec(job_, link, true);
                if (codec >= 0) spb = job_.codecs[codec].SecondsPerByte(link);
              }
              boundary_spb[s] = std::max(boundary_spb[s], spb);
            }
          }
        }
        std::vector<std::vector<double>> hop_spb(dp, std::vector<double>(pp, 0));
        for (int r = 0; r < dp; ++r) {
          for (int s = 0; s + 1 < pp; ++s)
            hop_spb[r][s] = SecondsPerByte(unit_of[r][s]->site, unit_of[r][s + 1]->site, true);
        }
        const Key key{subset_name, dp, pp, tp, layout};
        // Microbatch sizes from the largest down: more microbatches shrink the bubble and balance
        // unequal replicas more finely until the per-layer fixed costs win; stop past max(8 pp, 64)
        // microbatches per replica once something fits.
        bool fitted = false;
        for (int b = G; b >= 1; --b) {
          if (G % b != 0) continue;
          const int M = G / b;
          if (M < dp) continue;
          if (fitted && M / dp > std::max(8 * pp, 64)) break;
          if (options_.runtime_plans && M % dp != 0) continue;  // the runtime splits evenly
          for (int s = 0; s < pp; ++s) {
            stage_tp_comm[s] = 0;
            if (tp > 1) {
              const int site = unit_of[0][s]->site;
              stage_tp_comm[s] = RingAllReduceSeconds(
                  static_cast<double>(b) * model_.seq_len * model_.n_embd * model_.bytes_per_element, tp,
                  cluster_.Link(site, site));
            }
          }
          const int held_estimate = (M + dp - 1) / dp;
          for (Schedule schedule : options_.schedules) {
            if (pp == 1 && schedule != options_.schedules.front()) continue;  // one stage: schedules agree
            std::vector<int> begin = options_.runtime_plans
                                         ? RuntimeStageBegin(model_, pp)
                                         : SliceStages(stage_flops, stage_mem, stage_tp_comm, boundary_spb, tp, dp, b,
                                                       held_estimate, schedule);
            Plan& plan = base_plan;
            plan.microbatch_size = b;
            plan.schedule = schedule;
            if (begin.empty()) {
              // No memory-feasible slicing: remember the smallest microbatch tried, with an even
              // slicing; shapes that never fit are simulated once at the end of the run for their
              // reason.
              if (best_by_key_.count(key) || sliced_keys_.count(key)) continue;
              plan.stage_begin.resize(pp + 1);
              for (int s = 0; s <= pp; ++s) plan.stage_begin[s] = static_cast<int>(static_cast<int64_t>(s) * L / pp);
              plan.microbatches.assign(dp, 0);
              for (int r = 0; r < dp; ++r) plan.microbatches[r] = M / dp + (r < M % dp ? 1 : 0);
              unsliced_[key] = PlanCandidate{plan, {}, layout, subset_name, {}};
              continue;
            }
            plan.stage_begin = begin;
            sliced_keys_.insert(key);
            // Per-microbatch bottleneck of each replica; microbatches shared in proportion to
            // speed.
            std::vector<double> bottleneck(dp, 0);
            std::vector<std::vector<double>> stage_time(dp, std::vector<double>(pp));
            std::vector<std::vector<double>> compute_time(dp, std::vector<double>(pp));
            double speed_sum = 0;
            for (int r = 0; r < dp; ++r) {
              for (int s = 0; s < pp; ++s) {
                stage_time[r][s] = 3.0 * b * (flops_[begin[s + 1]] - flops_[begin[s]]) / (tp * unit_of[r][s]->flops) +
                                   3.0 * (begin[s + 1] - begin[s]) * job_.layer_overhead_s;
                bottleneck[r] = std::max(bottleneck[r], stage_time[r][s]);
                compute_time[r][s] = stage_time[r][s];
                // The boundary link is a serial resource too (for the bound, not for the shares).
                if (s + 1 < pp) {
                  stage_time[r][s] =
                      std::max(stage_time[r][s], b * model_.layers[begin[s + 1] - 1].output_bytes * hop_spb[r][s]);
                }
              }
              speed_sum += 1 / bottleneck[r];
            }
            plan.microbatches =
                options_.runtime_plans ? std::vector<int>(dp, M / dp) : ShareMicrobatches(M, bottleneck, speed_sum);
            // Lower bound: stage j cannot start before microbatch 0 went forward through stages <
            // j, runs all its microbatches, and the last backward still has to go back through
            // stages < j.
            double lower_bound = 0;
            for (int r = 0; r < dp; ++r) {
              double before = 0;
              for (int s = 0; s < pp; ++s) {
                lower_bound = std::max(lower_bound, plan.microbatches[r] * stage_time[r][s] + before);
                before += stage_time[r][s];
              }
              // 1F1B keeps at most pp - j microbatches in flight at stage j, and each occupies its
              // slot from j's forward to j's backward: at least the round trip through the later
              // stages and links.
              if (schedule == Schedule::k1F1B) {
                double round_trip = 0;
                for (int j = pp - 2; j >= 0; --j) {
                  const int a = unit_of[r][j]->site, c = unit_of[r][j + 1]->site;
                  const double hop =
                      cluster_.Link(a, c).latency_s + b * model_.layers[begin[j + 1] - 1].output_bytes * hop_spb[r][j];
                  round_trip += 2 * hop + compute_time[r][j + 1];
                  lower_bound =
                      std::max(lower_bound, plan.microbatches[r] * (compute_time[r][j] + round_trip) / (pp - j));
                }
              }
            }
            if ((!reference_shape || best_by_key_.count(key)) &&
                std::max(lower_bound, CommunicationFloor(unit_of, tp, begin)) > kPruneFactor * best_time_) {
              continue;
            }
            absl::StatusOr<Prediction> p = Simulate(cluster_, model_, job_, plan);
            ++simulated_;
            if (!p.ok()) continue;
            if (p->fits) {
              subset_best = std::min(subset_best, p->step_time_s);
              fitted = true;
            }
            if (Worth(key, plan, *p)) Consider(PlanCandidate{plan, *std::move(p), layout, subset_name, {}}, key);
          }
        }
      }
    }
  }
  for (auto& [key, candidate] : unsliced_) {
    if (best_by_key_.count(key) || sliced_keys_.count(key)) continue;
    absl::StatusOr<Prediction> p = Simulate(cluster_, model_, job_, candidate.plan);
    ++simulated_;
    if (p.ok() && !p->fits) {
      candidate.prediction = *std::move(p);
      Consider(std::move(candidate), key);
    }
  }
  unsliced_.clear();
  return subset_best;
}

std::string DeviceTypeName(const Cluster& cluster, const std::vector<int>& devices) {
  std::set<std::string> names;
  for (int d : devices) names.insert(cluster.devices[d].name);
  return absl::StrJoin(names, "+");
}

std::string Gb(double bytes) { return absl::StrFormat("%.2f GB", bytes / 1e9); }

std::string ShapeName(const Plan& p) { return absl::StrFormat("dp=%d pp=%d tp=%d", p.dp, p.pp, p.tp); }

// Explains the winner in a few lines: degrees vs the alternatives, pipeline boundaries vs site
// boundaries, DP groups, devices left out, codecs.
std::vector<std::string> Explain(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                 const std::map<Key, PlanCandidate>& best_by_key,
                                 const std::map<std::string, double>& subset_best, const PlanCandidate& w) {
  std::vector<std::string> lines;
  const Plan& p = w.plan;
  const Prediction& pr = w.prediction;
  lines.push_back(
      absl::StrFormat("winner: %s, microbatch %d x %d per replica, %s, %s: %.3f s per step, %.0f tokens/s; "
                      "pipeline %.3f s "
                      "(bubble %.0f%%), exposed gradient all-reduce %.3f s, tied-embedding sync %.3f s; compute "
                      "alone would "
                      "take %.3f s",
                      ShapeName(p), p.microbatch_size, p.microbatches.front(), ScheduleName(p.schedule), w.layout,
                      pr.step_time_s, pr.tokens_per_s, pr.pipeline_time_s, 100 * pr.bubble_fraction, pr.dp_exposed_s,
                      pr.tied_sync_s, pr.compute_bound_s));
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
    std::map<int, std::vector<int>> by_site;
    for (int d : w.left_out) by_site[cluster.devices[d].site].push_back(d);
    std::vector<std::string> parts;
    for (const auto& [site, ds] : by_site) {
      parts.push_back(
          absl::StrFormat("%d x %s at %s", ds.size(), DeviceTypeName(cluster, ds), cluster.site_names[site]));
    }
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
    lines.push_back(absl::StrCat("left out: ", absl::StrJoin(parts, ", "), "; ", why));
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
  if (absl::Status s = cluster.Validate(); !s.ok()) return s;
  if (job.global_batch < 1 || job.seq_len < 1) {
    return absl::InvalidArgumentError("plan: global batch and sequence length must be positive");
  }
  if (model.seq_len != job.seq_len || model.num_layers() < 2) {
    return absl::InvalidArgumentError("plan: model costs were built for another sequence length");
  }
  if (!(job.efficiency > 0 && job.efficiency <= 1) || job.memory_headroom < 0 || job.memory_headroom >= 1) {
    return absl::InvalidArgumentError("plan: efficiency must be in (0, 1] and memory headroom in [0, 1)");
  }
  Search search(cluster, model, job, options);
  std::map<std::string, double> subset_best;
  std::map<std::string, std::vector<int>> subset_devices;
  auto evaluate = [&](const std::vector<int>& devices, const std::string& name) {
    if (devices.empty() || subset_best.count(name)) return;
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
  result.explanation = Explain(cluster, model, job, search.best_by_key(), subset_best, result.ranked.front());
  if (static_cast<int>(result.ranked.size()) > options.max_ranked) result.ranked.resize(options.max_ranked);
  if (static_cast<int>(result.rejected.size()) > options.max_rejected) result.rejected.resize(options.max_rejected);
  result.planning_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return result;
}

std::vector<int> RuntimeStageBegin(const ModelCosts& model, int pp) {
  const int blocks = model.num_layers() - 2;  // [embedding, h.0 .. h.L-1, head]
  if (pp < 1 || pp > blocks) return {};
  const int base = blocks / pp, extra = blocks % pp;
  std::vector<int> begin(pp + 1);
  begin[0] = 0;
  for (int s = 1; s < pp; ++s) begin[s] = 1 + s * base + std::min(s, extra);
  begin[pp] = model.num_layers();
  return begin;
}

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

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string JsonNumber(double x) { return std::isfinite(x) ? absl::StrFormat("%.6g", x) : "null"; }

}  // namespace

std::string PlanCandidateToJson(const Cluster& cluster, const ModelCosts& model, const PlanCandidate& c) {
  const Plan& p = c.plan;
  const Prediction& pr = c.prediction;
  std::vector<std::string> stages;
  for (int s = 0; s < p.pp; ++s) {
    stages.push_back(absl::StrCat("{\"first_layer\":", JsonString(model.layers[p.stage_begin[s]].name),
                                  ",\"last_layer\":", JsonString(model.layers[p.stage_begin[s + 1] - 1].name),
                                  ",\"forward_s\":", JsonNumber(pr.stage_forward_s[s]),
                                  ",\"backward_s\":", JsonNumber(pr.stage_backward_s[s]),
                                  ",\"allreduce_s\":", JsonNumber(pr.stage_allreduce_s[s]), "}"));
  }
  std::vector<std::string> links;
  for (const LinkTraffic& t : pr.cross_site) {
    links.push_back(absl::StrCat(
        "{\"a\":", JsonString(cluster.site_names[t.site_a]), ",\"b\":", JsonString(cluster.site_names[t.site_b]),
        ",\"bytes_per_step\":", JsonNumber(t.bytes), ",\"gradient_bytes\":", JsonNumber(t.gradient_bytes),
        ",\"activation_bytes\":", JsonNumber(t.activation_bytes), ",\"gradient_codec\":", JsonString(t.gradient_codec),
        ",\"activation_codec\":", JsonString(t.activation_codec), "}"));
  }
  std::vector<std::string> memory, placement;
  for (int d = 0; d < static_cast<int>(pr.device_memory_bytes.size()); ++d) {
    if (pr.device_memory_bytes[d] <= 0) continue;
    memory.push_back(absl::StrCat(
        "{\"device\":", d, ",\"site\":", JsonString(cluster.site_names[cluster.devices[d].site]),
        ",\"name\":", JsonString(cluster.devices[d].name), ",\"bytes\":", JsonNumber(pr.device_memory_bytes[d]), "}"));
  }
  for (int r = 0; r < p.dp; ++r) {
    for (int s = 0; s < p.pp; ++s) {
      for (int k = 0; k < p.tp; ++k) {
        const Device& d = cluster.devices[p.devices[r][s][k]];
        placement.push_back(absl::StrCat(
            "{\"replica\":", r, ",\"stage\":", s, ",\"tp_rank\":", k, ",\"device\":", p.devices[r][s][k],
            ",\"site\":", JsonString(cluster.site_names[d.site]), ",\"worker\":", d.worker, ",\"slot\":", d.slot, "}"));
      }
    }
  }
  return absl::StrCat(
      "{\"dp\":", p.dp, ",\"pp\":", p.pp, ",\"tp\":", p.tp, ",\"microbatch_size\":", p.microbatch_size,
      ",\"microbatches\":[", absl::StrJoin(p.microbatches, ","),
      "],\"schedule\":", JsonString(ScheduleName(p.schedule)), ",\"layout\":", JsonString(c.layout),
      ",\"subset\":", JsonString(c.subset), ",\"fits\":", pr.fits ? "true" : "false",
      ",\"reject_reason\":", JsonString(pr.reject_reason), ",\"step_time_s\":", JsonNumber(pr.step_time_s),
      ",\"tokens_per_s\":", JsonNumber(pr.tokens_per_s), ",\"pipeline_time_s\":", JsonNumber(pr.pipeline_time_s),
      ",\"dp_exposed_s\":", JsonNumber(pr.dp_exposed_s), ",\"tied_sync_s\":", JsonNumber(pr.tied_sync_s),
      ",\"scalar_sync_s\":", JsonNumber(pr.scalar_sync_s), ",\"bubble_fraction\":", JsonNumber(pr.bubble_fraction),
      ",\"compute_bound_s\":", JsonNumber(pr.compute_bound_s),
      ",\"max_memory_fraction\":", JsonNumber(pr.max_memory_fraction), ",\"left_out_devices\":[",
      absl::StrJoin(c.left_out, ","), "],\"stages\":[", absl::StrJoin(stages, ","), "],\"cross_site_links\":[",
      absl::StrJoin(links, ","), "],\"device_memory\":[", absl::StrJoin(memory, ","), "],\"placement\":[",
      absl::StrJoin(placement, ","), "]}");
}

std::string PlanResultToJson(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                             const PlanResult& result, int top) {
  std::vector<std::string> ranked, rejected, explanation;
  for (int i = 0; i < std::min<int>(top, result.ranked.size()); ++i) {
    ranked.push_back(PlanCandidateToJson(cluster, model, result.ranked[i]));
  }
  for (const PlanCandidate& c : result.rejected) rejected.push_back(PlanCandidateToJson(cluster, model, c));
  for (const std::string& line : result.explanation) explanation.push_back(JsonString(line));
  return absl::StrCat(
      "{\"global_batch\":", job.global_batch, ",\"seq_len\":", job.seq_len, ",\"devices\":", cluster.devices.size(),
      ",\"sites\":", cluster.num_sites(), ",\"plans_simulated\":", result.plans_simulated,
      ",\"planning_seconds\":", JsonNumber(result.planning_seconds), ",\"ranked\":[", absl::StrJoin(ranked, ","),
      "],\"rejected\":[", absl::StrJoin(rejected, ","), "],\"explanation\":[", absl::StrJoin(explanation, ","), "]}\n");
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
                          c.subset);
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
