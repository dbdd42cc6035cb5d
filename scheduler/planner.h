// The planner: searches DP x PP x TP degrees, stage slicing, placement of replicas and stages on
// sites, microbatch size and schedule, codec per cross-site link, and which devices to leave out,
// scoring every candidate with the simulator (cost_model.h). It returns the ranked plans, the
// rejected ones with their reasons, and a few lines that explain the winner.
//
//   absl::StatusOr<PlanResult> result = PlanJob(cluster, ModelCosts::FromConfig(config, 1024),
//   job); const PlanCandidate& best = result->ranked.front(); ManualPlan manual =
//   ToManualPlan(cluster, model, best.plan);   // for `parallel: {plan: auto}` jobs
//
// The search (docs/planner.md): for each device subset (each site alone; all devices; growing from
// the best site; greedily without whole sites; without the slowest device types) and each TP degree
// (TP groups inside a site), units (TP groups) are ordered along a chain of sites (nearest site
// next); for each PP degree the fastest dp x pp units are laid out either pipeline-major (a
// replica's stages on consecutive units: pipelines inside sites, DP across) or stage-major (a
// stage's replicas on consecutive units: DP groups inside sites, pipeline boundaries on site
// boundaries); layers are sliced into stages by dynamic programming (min over slicings of the max
// stage time incl. its boundary transfer, memory-feasible only); microbatches are shared among
// replicas in proportion to their speed; both schedules are simulated.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "scheduler/cluster.h"
#include "scheduler/cost_model.h"

namespace geotrain {
class ParallelSpec;  // proto/spec.proto
}

namespace geotrain::scheduler {

struct PlannerOptions {
  std::vector<int> tp_degrees = {1, 2, 4, 8};
  std::vector<Schedule> schedules = {Schedule::k1F1B, Schedule::kGPipe};
  bool search_subsets = true;  // try leaving out slow device types and whole sites
  // Only plans geotrain's runtime runs exactly as planned: the runtime's stage slicing
  // (RuntimeStageBegin) instead of the dynamic-programming one, and the same microbatch count on
  // every replica. `parallel: {plan: auto}` jobs and the validation (docs/planner.md) use it, so
  // that the predicted plan is the one that runs.
  bool runtime_plans = false;
  // Sites (indices into Cluster::site_names) every plan must use, with at least one device each; empty: any.
  std::vector<int> required_sites;
  int max_ranked = 10;  // plans kept in PlanResult::ranked (distinct shapes)
  int max_rejected = 10;
};

struct PlanCandidate {
  Plan plan;
  Prediction prediction;
  std::string layout;         // "pipeline-major" or "stage-major"
  std::string subset;         // the device subset searched: "all devices", "without site X", "without T4", ...
  std::vector<int> left_out;  // device indices not used by this plan
};

// The devices a plan uses, in words: "all devices", or "without 2 x T4 at star, 1 x A40 at star" (its left_out).
std::string DevicesUsedName(const Cluster& cluster, const PlanCandidate& candidate);

struct PlanResult {
  std::vector<PlanCandidate> ranked;     // fitting plans, fastest first, one per (subset, dp, pp, tp, layout)
  std::vector<PlanCandidate> rejected;   // shapes with no memory-feasible slicing, with the reason
  std::vector<std::string> explanation;  // a few lines on the winner
  int64_t plans_simulated = 0;
  double planning_seconds = 0;
};

// Plans `job` on `cluster`. Errors: invalid cluster or job (batch, seq_len, codecs), or no plan
// fits in memory at all (the error gives the closest candidate's reason). Deterministic (the same
// inputs give the same ranking; only planning_seconds varies). Thread-safe: a call keeps its whole
// search to itself and reads its arguments only, so calls may run at once on different threads; one
// call runs on the caller's thread. With GEOTRAIN_PLAN_DEBUG set, prints each device subset's search
// time, plans simulated and best step time to stderr.
absl::StatusOr<PlanResult> PlanJob(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                   const PlannerOptions& options = {});

// The runtime's stage slicing (SplitStageBlocks in model/config.h, which model::StageOptions::Split uses):
// blocks split as evenly as possible with the earlier stages taking the extra ones, the embedding on the
// first stage and the head on the last. Returns pp + 1 indices into ModelCosts::layers; empty when pp
// exceeds the number of blocks.
std::vector<int> RuntimeStageBegin(const ModelCosts& model, int pp);

// A chosen plan in the manual form a job spec takes (`parallel: {plan: manual, ...}`).
struct ManualPlacement {
  int replica = 0, stage = 0, tp_rank = 0;
  int device = 0;  // index into Cluster::devices
  int site = 0, worker = 0, slot = 0;
  std::string site_name;
};
struct ManualPlan {
  int dp = 1, pp = 1, tp = 1;
  int microbatch_size = 1;
  std::vector<int> microbatches;  // per replica
  Schedule schedule = Schedule::k1F1B;
  std::vector<int> stage_begin;  // layer index (0 embedding, 1..L blocks, L+1 head) where each stage starts
  std::vector<std::string> stage_first_layer;
  std::vector<ManualPlacement> placement;  // one per (replica, stage, tp_rank), in that order
  // Codec per pair of sites that the plan's traffic crosses (the simulator's choice, see
  // ChooseCodec).
  struct LinkCodec {
    std::string site_a, site_b;
    std::string gradient_codec, activation_codec;
  };
  std::vector<LinkCodec> link_codecs;
};
ManualPlan ToManualPlan(const Cluster& cluster, const ModelCosts& model, const JobOptions& job, const Plan& plan);
// The same without link_codecs (left empty: the job's codecs are not known here).
ManualPlan ToManualPlan(const Cluster& cluster, const ModelCosts& model, const Plan& plan);
// Fills a job spec's parallel section (plan: manual; microbatches: replica 0's count; placement by
// site).
void FillParallelSpec(const ManualPlan& manual, ParallelSpec* spec);

// One candidate (plan and prediction) as a JSON object, as in PlanResultToJson's "ranked" list.
std::string PlanCandidateToJson(const Cluster& cluster, const ModelCosts& model, const PlanCandidate& candidate);

// The result as JSON (one object: ranked, rejected, explanation, timings) and as text for a
// terminal.
std::string PlanResultToJson(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                             const PlanResult& result, int top);
std::string FormatPlanResult(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                             const PlanResult& result, int top);

}  // namespace geotrain::scheduler
