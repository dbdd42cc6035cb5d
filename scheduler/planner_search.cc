// The plan search over one device subset (Search, see planner_internal.h and docs/planner.md): units of TP
// groups along a chain of sites, both layouts, stage slicing by dynamic programming, microbatch sizes and
// schedules, each candidate simulated (cost_model.h) unless a lower bound prunes it.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "scheduler/planner_internal.h"

namespace geotrain::scheduler::internal {
namespace {

// Shapes and microbatch sizes whose lower bound exceeds this factor times the best step time found
// so far are not simulated (pure DP and pure pipeline shapes always are: the explanation compares
// with them).
constexpr double kPruneFactor = 1.25;

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

}  // namespace

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

bool Search::CoversRequiredSites(const Plan& plan) const {
  for (int site : options_.required_sites) {
    bool present = false;
    for (const auto& replica : plan.devices) {
      for (const auto& stage : replica) {
        for (int d : stage) present = present || cluster_.devices[d].site == site;
      }
    }
    if (!present) return false;
  }
  return true;
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
  // A plan that leaves out a required site is not a plan for this job (nor a bound for the search).
  if (!CoversRequiredSites(candidate.plan)) return;
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

// One shape (dp, pp, tp, layout) on the units Run kept for it, and what every microbatch size and schedule of it
// shares: the units of each (replica, stage), the plan's fixed part, and each stage's worst unit and boundary over
// the replicas (all replicas share the slicing).
struct Search::Shape {
  std::string subset_name;
  int dp = 1, pp = 1, tp = 1;
  const char* layout = "";
  bool reference_shape = false;  // pure DP or pure pipeline without TP: simulated even when a bound prunes it
  Key key;
  std::vector<std::vector<const Unit*>> unit_of;  // unit_of[r][s]
  Plan base_plan;                                 // dp, pp, tp and devices; each candidate fills in the rest
  std::vector<double> stage_flops, stage_mem, stage_tp_comm, boundary_spb;
  std::vector<std::vector<double>> hop_spb;  // [r][s]: seconds per byte from stage s to s + 1 of replica r
};

std::vector<const Unit*> Search::KeepUnits(const std::vector<Unit>& all_units, int kept) const {
  const int U = static_cast<int>(all_units.size());
  // Leave out the U - kept slowest units (the last of equals in chain order).
  std::vector<int> order(U);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return all_units[a].flops > all_units[b].flops; });
  std::vector<bool> keep(U, false);
  for (int i = 0; i < kept; ++i) keep[order[i]] = true;
  // A required site keeps its fastest unit, in place of the slowest kept unit of a site that keeps another (or
  // is not required): otherwise a site of slower devices would never be in a shape that leaves units out.
  for (int site : options_.required_sites) {
    auto kept_in = [&](int s) {
      int n = 0;
      for (int i = 0; i < U; ++i) n += keep[i] && all_units[i].site == s;
      return n;
    };
    if (kept_in(site) > 0) continue;
    int in = -1, out = -1;
    for (int i : order) {
      if (!keep[i] && all_units[i].site == site) {
        in = i;
        break;
      }
    }
    for (auto it = order.rbegin(); it != order.rend() && in >= 0; ++it) {
      const int s = all_units[*it].site;
      const bool required = std::count(options_.required_sites.begin(), options_.required_sites.end(), s) > 0;
      if (keep[*it] && (!required || kept_in(s) > 1)) {
        out = *it;
        break;
      }
    }
    if (in >= 0 && out >= 0) {
      keep[out] = false;
      keep[in] = true;
    }
  }
  std::vector<const Unit*> units;
  for (int i = 0; i < U; ++i) {
    if (keep[i]) units.push_back(&all_units[i]);
  }
  return units;
}

Search::Shape Search::MakeShape(const std::vector<const Unit*>& units, const std::string& subset_name, int dp, int pp,
                                int tp, const char* layout, bool reference_shape) const {
  const bool stage_major = std::string(layout) == "stage-major";
  Shape shape;
  shape.subset_name = subset_name;
  shape.dp = dp;
  shape.pp = pp;
  shape.tp = tp;
  shape.layout = layout;
  shape.reference_shape = reference_shape;
  shape.key = Key{subset_name, dp, pp, tp, layout};
  shape.unit_of.assign(dp, std::vector<const Unit*>(pp));
  for (int r = 0; r < dp; ++r) {
    for (int s = 0; s < pp; ++s) shape.unit_of[r][s] = units[stage_major ? s * dp + r : r * pp + s];
  }
  Plan& base_plan = shape.base_plan;
  base_plan.dp = dp;
  base_plan.pp = pp;
  base_plan.tp = tp;
  base_plan.devices.assign(dp, std::vector<std::vector<int>>(pp));
  for (int r = 0; r < dp; ++r) {
    for (int s = 0; s < pp; ++s) base_plan.devices[r][s] = shape.unit_of[r][s]->devices;
  }
  // Worst unit per stage and worst boundary per stage, over replicas (all replicas share the
  // slicing).
  shape.stage_flops.assign(pp, kInf);
  shape.stage_mem.assign(pp, kInf);
  shape.stage_tp_comm.assign(pp, 0);
  shape.boundary_spb.assign(pp, 0);
  for (int s = 0; s < pp; ++s) {
    for (int r = 0; r < dp; ++r) {
      const Unit& u = *shape.unit_of[r][s];
      shape.stage_flops[s] = std::min(shape.stage_flops[s], u.flops);
      shape.stage_mem[s] = std::min(shape.stage_mem[s], u.mem);
      if (s + 1 < pp) {
        const int a = u.site, c = shape.unit_of[r][s + 1]->site;
        const LinkSpec& link = cluster_.Link(a, c);
        double spb = 1.0 / link.bandwidth_bytes_per_s;
        if (a != c) {
          const int codec = ChooseCodec(job_, link, true);
          if (codec >= 0) spb = job_.codecs[codec].SecondsPerByte(link);
        }
        shape.boundary_spb[s] = std::max(shape.boundary_spb[s], spb);
      }
    }
  }
  shape.hop_spb.assign(dp, std::vector<double>(pp, 0));
  for (int r = 0; r < dp; ++r) {
    for (int s = 0; s + 1 < pp; ++s)
      shape.hop_spb[r][s] = SecondsPerByte(shape.unit_of[r][s]->site, shape.unit_of[r][s + 1]->site, true);
  }
  return shape;
}

void Search::SearchMicrobatchSizes(Shape& shape, double* subset_best) {
  const int G = job_.global_batch;
  const int dp = shape.dp, pp = shape.pp, tp = shape.tp;
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
      shape.stage_tp_comm[s] = 0;
      if (tp > 1) {
        const int site = shape.unit_of[0][s]->site;
        shape.stage_tp_comm[s] =
            RingAllReduceSeconds(static_cast<double>(b) * model_.seq_len * model_.n_embd * model_.bytes_per_element, tp,
                                 cluster_.Link(site, site));
      }
    }
    const int held_estimate = (M + dp - 1) / dp;
    for (Schedule schedule : options_.schedules) {
      if (pp == 1 && schedule != options_.schedules.front()) continue;  // one stage: schedules agree
      TrySchedule(shape, b, held_estimate, schedule, &fitted, subset_best);
    }
  }
}

double Search::PipelineLowerBound(const Shape& shape, const Plan& plan,
                                  const std::vector<std::vector<double>>& stage_time,
                                  const std::vector<std::vector<double>>& compute_time) const {
  const int pp = shape.pp;
  const int b = plan.microbatch_size;
  const std::vector<int>& begin = plan.stage_begin;
  // Lower bound: stage j cannot start before microbatch 0 went forward through stages <
  // j, runs all its microbatches, and the last backward still has to go back through
  // stages < j.
  double lower_bound = 0;
  for (int r = 0; r < shape.dp; ++r) {
    double before = 0;
    for (int s = 0; s < pp; ++s) {
      lower_bound = std::max(lower_bound, plan.microbatches[r] * stage_time[r][s] + before);
      before += stage_time[r][s];
    }
    // 1F1B keeps at most min(depth - j, m) microbatches in flight at stage j, and each occupies
    // its slot from j's forward to j's backward: at least the round trip through the later
    // stages and links. Simulate chooses one depth for the job, at most max(pp, largest share).
    if (plan.schedule == Schedule::k1F1B) {
      const int deepest = std::max(pp, *std::max_element(plan.microbatches.begin(), plan.microbatches.end()));
      double round_trip = 0;
      for (int j = pp - 2; j >= 0; --j) {
        const int a = shape.unit_of[r][j]->site, c = shape.unit_of[r][j + 1]->site;
        const double hop =
            cluster_.Link(a, c).latency_s + b * model_.layers[begin[j + 1] - 1].output_bytes * shape.hop_spb[r][j];
        round_trip += 2 * hop + compute_time[r][j + 1];
        lower_bound = std::max(lower_bound, plan.microbatches[r] * (compute_time[r][j] + round_trip) /
                                                std::max(1, std::min(deepest - j, plan.microbatches[r])));
      }
    }
  }
  return lower_bound;
}

void Search::TrySchedule(Shape& shape, int b, int held_estimate, Schedule schedule, bool* fitted, double* subset_best) {
  const int G = job_.global_batch;
  const int L = model_.num_layers();
  const int dp = shape.dp, pp = shape.pp, tp = shape.tp;
  const int M = G / b;
  const Key& key = shape.key;
  std::vector<int> begin = options_.runtime_plans ? RuntimeStageBegin(model_, pp)
                                                  : SliceStages(shape.stage_flops, shape.stage_mem, shape.stage_tp_comm,
                                                                shape.boundary_spb, tp, dp, b, held_estimate, schedule);
  Plan& plan = shape.base_plan;
  plan.microbatch_size = b;
  plan.schedule = schedule;
  if (begin.empty()) {
    // No memory-feasible slicing: remember the smallest microbatch tried, with an even
    // slicing; shapes that never fit are simulated once at the end of the run for their
    // reason.
    if (best_by_key_.count(key) || sliced_keys_.count(key)) return;
    plan.stage_begin.resize(pp + 1);
    for (int s = 0; s <= pp; ++s) plan.stage_begin[s] = static_cast<int>(static_cast<int64_t>(s) * L / pp);
    plan.microbatches.assign(dp, 0);
    for (int r = 0; r < dp; ++r) plan.microbatches[r] = M / dp + (r < M % dp ? 1 : 0);
    unsliced_[key] = PlanCandidate{plan, {}, shape.layout, shape.subset_name, {}};
    return;
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
      stage_time[r][s] = 3.0 * b * (flops_[begin[s + 1]] - flops_[begin[s]]) / (tp * shape.unit_of[r][s]->flops) +
                         3.0 * (begin[s + 1] - begin[s]) * job_.layer_overhead_s;
      bottleneck[r] = std::max(bottleneck[r], stage_time[r][s]);
      compute_time[r][s] = stage_time[r][s];
      // The boundary link is a serial resource too (for the bound, not for the shares).
      if (s + 1 < pp) {
        stage_time[r][s] =
            std::max(stage_time[r][s], b * model_.layers[begin[s + 1] - 1].output_bytes * shape.hop_spb[r][s]);
      }
    }
    speed_sum += 1 / bottleneck[r];
  }
  plan.microbatches =
      options_.runtime_plans ? std::vector<int>(dp, M / dp) : ShareMicrobatches(M, bottleneck, speed_sum);
  const double lower_bound = PipelineLowerBound(shape, plan, stage_time, compute_time);
  if ((!shape.reference_shape || best_by_key_.count(key)) &&
      std::max(lower_bound, CommunicationFloor(shape.unit_of, tp, begin)) > kPruneFactor * best_time_) {
    return;
  }
  absl::StatusOr<Prediction> p = Simulate(cluster_, model_, job_, plan);
  ++simulated_;
  if (!p.ok()) return;
  if (p->fits && CoversRequiredSites(plan)) {
    *subset_best = std::min(*subset_best, p->step_time_s);
    *fitted = true;
  }
  if (Worth(key, plan, *p)) Consider(PlanCandidate{plan, *std::move(p), shape.layout, shape.subset_name, {}}, key);
}

void Search::SimulateUnsliced() {
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
      const std::vector<const Unit*> units = KeepUnits(all_units, dp * pp);
      // Compute alone on these units bounds every plan of this shape from below.
      double shape_flops = 0;
      for (const Unit* u : units) shape_flops += u->flops * tp;
      const bool reference_shape = tp == 1 && (pp == 1 || dp == 1);
      if (!reference_shape && 3 * model_.TotalForwardFlops() * G / shape_flops > kPruneFactor * best_time_) continue;
      for (const char* layout : {"pipeline-major", "stage-major"}) {
        const bool stage_major = std::string(layout) == "stage-major";
        if (stage_major && (dp == 1 || pp == 1)) continue;
        Shape shape = MakeShape(units, subset_name, dp, pp, tp, layout, reference_shape);
        SearchMicrobatchSizes(shape, &subset_best);
      }
    }
  }
  SimulateUnsliced();
  return subset_best;
}

}  // namespace geotrain::scheduler::internal
