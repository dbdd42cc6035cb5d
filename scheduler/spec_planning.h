// A job spec (proto/spec.proto JobSpec) in the planner's terms: the one place that says how a spec is planned
// and how much memory its actors need, so that the head (`parallel: {plan: auto}` jobs, and the memory check
// of every placement) and `geotrain plan --job` plan the same job the same way.
//
//   ASSIGN_OR_RETURN(SpecPlanning planning, PlanningForSpec(spec));
//   ASSIGN_OR_RETURN(PlanResult result, PlanJob(cluster, planning.model, planning.job, planning.options));
//
// What a spec sets: the model, the global batch, the sequence length and the WAN codec (`comm.wan_codec`,
// parsed as the runtime parses it, `+zstd` included; "none" allows no codec). What the runtime sets: its
// step end (JobOptions::sequential_sync, the model the validation calibrated, docs/planner.md) and only plans
// it runs as planned (PlannerOptions::runtime_plans: its stage split, equal microbatch counts). Every other
// option keeps its JobOptions / PlannerOptions default.
// Thread safety: pure functions.
#pragma once

#include "absl/status/statusor.h"
#include "model/config.h"
#include "scheduler/cost_model.h"
#include "scheduler/planner.h"

namespace geotrain {
class JobSpec;  // proto/spec.proto
}

namespace geotrain::scheduler {

struct SpecPlanning {
  GPT2Config config;
  ModelCosts model;  // at the spec's sequence length
  JobOptions job;
  PlannerOptions options;
};

// The planner's inputs for `spec`. Errors: a bad model section or WAN codec (the message names it).
absl::StatusOr<SpecPlanning> PlanningForSpec(const JobSpec& spec);

// The spec's manual plan as the runtime runs it, without devices (Plan::devices left empty): its degrees and
// schedule, microbatch size global_batch / (dp x microbatches), that many microbatches on every replica, and
// the runtime's stage split (RuntimeStageBegin). Errors: non-positive degrees, pp above the model's blocks.
absl::StatusOr<Plan> RuntimePlanShape(const JobSpec& spec, const ModelCosts& model);

// Bytes the actor of stage `stage` of the spec's manual plan needs, as the simulator counts them
// (StageMemoryBytes: state, the activations the schedule holds, boundary buffers, fixed memory), and the usable
// bytes of a device of `device_bytes` (UsableMemoryBytes). Errors: as PlanningForSpec and RuntimePlanShape.
absl::StatusOr<double> SpecStageMemoryBytes(const JobSpec& spec, int stage);

}  // namespace geotrain::scheduler
