// Synchronous training or DiLoCo (model/diloco.h)? For `parallel: {plan: auto, allow_diloco: true}` jobs
// the planner predicts both and keeps the faster, with the reasons in words.
//
//   ASSIGN_OR_RETURN(PlanResult sync, PlanJob(cluster, model, job, options));
//   ASSIGN_OR_RETURN(DilocoChoice choice, ChooseSyncOrDiloco(cluster, model, job, options, sync, diloco_block));
//   if (choice.diloco_chosen) { ... run choice.diloco.plan with parallel.sync: diloco ... }
//
// The DiLoCo prediction: every replica inside one site (the runtime groups replicas by the site of their
// first stage: synchronous inside a group, outer steps across groups). Its inner step is the simulator's
// step time of the plan on the cluster with free links between sites (the gradient all-reduce then costs
// only its intra-site part). Every inner_steps steps the groups' pseudo-gradients (all parameters, through
// diloco.codec) go round a ring of one leader per site: RingAllReduceSeconds over the slowest link between
// the sites used. With one fragment that exchange blocks; with F fragments each of the F exchanges of
// 1/F of the parameters runs beside the next inner step, and only what outlasts that step shows.
//   step = inner step + exposed outer exchange time / inner_steps
//   WAN bytes per step = 2 (S - 1) x parameters x 4 x codec ratio / inner_steps     (S sites)
// Sites of unequal speed: each site's group is simulated alone (its replicas on the free cluster). Count pacing
// steps at the slowest group's inner step; with diloco.sync time a group k times as fast takes floor(k H) inner
// steps per outer period (model/diloco.h PlanPacedPeriod), so a period trains sum_g n_g B_g sequences, not H B
// (B_g: group g's sequences per inner step). The gain is their ratio; with sync time a job step trains that many
// times the tokens, so the choice compares the time per global batch of tokens (step / gain) with the synchronous
// plan's step, while the prediction of the job's step (what the head compares with the measured) stays the step. The explanation offers time
// pacing when it would gain 5% or more, and the other pseudo-gradient codecs (int8, int4, sparse) with their bytes
// and step time (their loss cost is measured, not predicted: docs/diloco.md).
// Thread safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "scheduler/cluster.h"
#include "scheduler/cost_model.h"
#include "scheduler/planner.h"
#include "spec.pb.h"

namespace geotrain::scheduler {

struct DilocoChoice {
  bool diloco_chosen = false;
  bool diloco_possible = false;  // a plan with replicas in two sites or more, each inside one site
  std::string why_not;           // when not possible: why
  PlanCandidate sync;            // the best synchronous plan (sync.ranked.front())
  double sync_step_s = 0, sync_wan_bytes_per_step = 0;
  PlanCandidate diloco;  // the DiLoCo plan; its prediction is the inner step's (free links between sites)
  int diloco_sites = 0;
  double inner_step_s = 0;
  double outer_exchange_s = 0;  // one exchange of every parameter across the sites
  double diloco_step_s = 0;     // inner step + exposed exchange time / inner_steps
  double diloco_wan_bytes_per_step = 0;
  std::vector<double> group_step_s;      // each site group's inner step alone, in the order of the sites' indices
  double time_paced_gain = 1;            // tokens per second with diloco.sync time over count pacing
  bool time_paced = false;               // the block's sync is time
  double diloco_batch_s = 0;             // per global batch of tokens: diloco_step_s, or with sync time over the gain
  std::vector<std::string> explanation;  // both predictions and the choice
};

// `sync` is PlanJob's result for the same inputs; `diloco` the job's diloco block with its defaults
// (EffectiveDiloco). DiLoCo is chosen when its predicted step is shorter. Errors: a bad diloco.codec.
absl::StatusOr<DilocoChoice> ChooseSyncOrDiloco(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                                const PlannerOptions& options, const PlanResult& sync,
                                                const DilocoSpec& diloco);

}  // namespace geotrain::scheduler
