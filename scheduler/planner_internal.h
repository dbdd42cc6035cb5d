// Internal to the planner's files (planner.cc, planner_search.cc, planner_explain.cc, planner_output.cc) and its
// tests: the search over one device subset, the choice of subsets, the ranking rule, and the explanation. Callers use
// planner.h.
//
// planner.cc runs PlanJob: it picks the device subsets (SubsetSearch), calls Search::Run on each, ranks the
// candidates and asks Explain for the winner's lines. planner_search.cc searches the shapes of one subset.
// planner_output.cc turns a result into the manual form, JSON and text.
// Thread safety: a Search is used by one thread (one PlanJob call); the free functions are pure.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "scheduler/planner.h"

namespace geotrain::scheduler::internal {

constexpr double kInf = std::numeric_limits<double>::infinity();

// More microbatches must predict a step shorter by more than this fraction to be preferred: each
// microbatch has fixed costs (kernel launches, messages, smaller GEMMs) that a calibration on a busy
// machine can measure as zero, so a near-tie is settled for the fewer, larger microbatches.
constexpr double kMicrobatchTie = 0.005;

// The number of microbatches of a plan over all replicas.
int TotalMicrobatches(const Plan& p);

// Whether plan a (predicted step time ta) is better than plan b (tb): faster, with near-ties (within
// kMicrobatchTie) going to the plan with fewer microbatches.
bool Better(const Plan& a, double ta, const Plan& b, double tb);

// A tensor-parallel group of devices inside one site: the unit that holds one (replica, stage).
struct Unit {
  std::vector<int> devices;
  int site = 0;
  double flops = 0;  // effective FLOP/s of the slowest member (x tp gives the group's)
  double mem = 0;    // smallest member's memory
};

using Key = std::tuple<std::string, int, int, int, std::string>;  // subset, dp, pp, tp, layout

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
  // Whether `plan` has a device in every site of PlannerOptions::required_sites.
  bool CoversRequiredSites(const Plan& plan) const;

  double best_time() const { return best_time_; }
  int64_t simulated() const { return simulated_; }
  std::map<Key, PlanCandidate>& best_by_key() { return best_by_key_; }
  std::map<Key, PlanCandidate>& rejected_by_key() { return rejected_by_key_; }
  // Shapes with a memory-feasible slicing for some microbatch size (even if pruned as too slow).
  const std::set<Key>& sliced_keys() const { return sliced_keys_; }

 private:
  struct Shape;  // one shape (dp, pp, tp, layout) of a Run, defined in planner_search.cc

  std::vector<int> SiteChain(const std::vector<int>& devices) const;
  std::vector<Unit> MakeUnits(const std::vector<int>& devices, const std::vector<int>& chain, int tp) const;
  // The `kept` fastest of all_units (pointers into it), with a unit of every required site where it has one.
  std::vector<const Unit*> KeepUnits(const std::vector<Unit>& all_units, int kept) const;
  // Lays out dp x pp of `units` (layout: "pipeline-major" or "stage-major") and works out what every candidate of
  // that shape shares.
  Shape MakeShape(const std::vector<const Unit*>& units, const std::string& subset_name, int dp, int pp, int tp,
                  const char* layout, bool reference_shape) const;
  // Searches the shape's microbatch sizes and schedules; lowers *subset_best to every fitting step time found.
  void SearchMicrobatchSizes(Shape& shape, double* subset_best);
  // One candidate of the shape: slices it, shares its microbatches, and simulates it unless a lower bound prunes
  // it. Sets *fitted when it fits.
  void TrySchedule(Shape& shape, int b, int held_estimate, Schedule schedule, bool* fitted, double* subset_best);
  // A lower bound on the pipeline time of `plan` (the shape's, sliced and shared) from its stage times with and
  // without their boundary transfers.
  double PipelineLowerBound(const Shape& shape, const Plan& plan, const std::vector<std::vector<double>>& stage_time,
                            const std::vector<std::vector<double>>& compute_time) const;
  // Simulates, for their reason, the shapes of the run that never had a memory-feasible slicing.
  void SimulateUnsliced();
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

// The device subsets PlanJob searches, in its order, and the best step time found on each (planner.cc). Each phase
// below is one family of subsets; later phases start from what the earlier ones found. It refers to its arguments,
// which must outlive it, and is used by one thread.
class SubsetSearch {
 public:
  SubsetSearch(const Cluster& cluster, const PlannerOptions& options, Search* search);

  // Single sites first: they are cheap and give a good step time early, which prunes the larger
  // searches. Then all devices.
  void SingleSitesThenAll();
  // Grow from the best single site, adding next the site with the best link to the set (the set's
  // slowest link to it), at sizes 2, 4, 8, ... sites.
  void GrowFromBestSite();
  // Greedily without one more site, from the best subset so far (a few rounds).
  void WithoutSites();
  // Without the slowest device types (cumulatively), on all devices and on the best subset.
  void WithoutSlowestDeviceTypes();
  // Without the GPUs that have no bf16, on all devices and on the best subset: for a job whose precision auto trains
  // in fp32 where one of them takes part (a codec refuses fp16's infinities: model::AutoPrecision), the others alone
  // train in bf16 on their tensor cores.
  void WithoutGpusWithoutBf16();

  // The best step time of each subset searched, by name (kInf where no plan fits). A subset that was not searched
  // (empty, or without a required site) has no entry.
  const std::map<std::string, double>& subset_best() const { return subset_best_; }

 private:
  // Searches `devices` under `name`, once per name, and returns its best step time; nullopt, with nothing recorded,
  // for a subset that is empty or lacks a required site (it has no plan for the job).
  std::optional<double> Evaluate(const std::vector<int>& devices, const std::string& name);
  // The searched subset with the fastest plan; null when none has a plan.
  const std::string* BestSubset() const;
  // Whether a subset can still beat the best plan found: its compute alone is faster.
  bool Worth(const std::vector<int>& devices) const {
    return !devices.empty() && search_.ComputeBound(devices) < search_.best_time();
  }

  const Cluster& cluster_;
  const PlannerOptions& options_;
  Search& search_;
  std::vector<int> all_;
  std::vector<std::vector<int>> site_devices_;
  std::map<std::string, double> subset_best_;  // set together with subset_devices_, by Evaluate only
  std::map<std::string, std::vector<int>> subset_devices_;
};

// "dp=2 pp=4 tp=1".
std::string ShapeName(const Plan& p);

// Explains the winner `w` in a few lines: degrees vs the alternatives (the best of each kind in
// `best_by_key`), pipeline boundaries vs site boundaries, DP groups, devices left out (with `subset_best`, the
// best step time of each device subset searched), codecs.
std::vector<std::string> Explain(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                 const std::map<Key, PlanCandidate>& best_by_key,
                                 const std::map<std::string, double>& subset_best, const PlanCandidate& w);

}  // namespace geotrain::scheduler::internal
