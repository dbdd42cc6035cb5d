// Job specs in the planner's terms (see spec_planning.h).
#include "scheduler/spec_planning.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "model/precision.h"
#include "spec.pb.h"

namespace geotrain::scheduler {

absl::StatusOr<SpecPlanning> PlanningForSpec(const JobSpec& spec) {
  SpecPlanning planning;
  ASSIGN_OR_RETURN(planning.config, GPT2Config::FromSpec(spec.model()));
  planning.model = ModelCosts::FromConfig(planning.config, spec.train().seq_len());
  planning.job.global_batch = spec.train().global_batch();
  planning.job.seq_len = spec.train().seq_len();
  planning.job.precision = spec.train().precision();
  planning.job.finite_only_codec = !model::FiniteOnlyCodec(spec.comm()).empty();
  planning.job.sequential_sync = true;  // the runtime ends a step as the validated model says (docs/planner.md)
  if (spec.comm().grad_bucket_mb() > 0) planning.job.grad_bucket_bytes = spec.comm().grad_bucket_mb() * (1 << 20);
  if (!spec.comm().wan_codec().empty()) {
    absl::StatusOr<Codec> codec = ParseCodec(spec.comm().wan_codec());
    if (!codec.ok()) return WithContext(codec.status(), "comm.wan_codec");
    if (codec->name != "none") planning.job.codecs.push_back(*codec);
    planning.job.codec_on_every_link = true;  // as the runtime sends
  }
  planning.options.runtime_plans = true;  // the runtime's stage split and equal replica shares: the plan that runs
  return planning;
}

absl::StatusOr<Plan> RuntimePlanShape(const JobSpec& spec, const ModelCosts& model) {
  const ParallelSpec& parallel = spec.parallel();
  if (parallel.dp() < 1 || parallel.pp() < 1 || parallel.tp() < 1 || parallel.microbatches() < 1) {
    return absl::InvalidArgumentError("parallel: dp, pp, tp and microbatches must be positive");
  }
  Plan plan;
  plan.dp = parallel.dp();
  plan.pp = parallel.pp();
  plan.tp = parallel.tp();
  plan.schedule = parallel.schedule() == "gpipe" ? Schedule::kGPipe : Schedule::k1F1B;
  plan.pipeline_depth = parallel.pipeline_depth();  // 0: the simulator's (the head's) choice
  plan.microbatch_size = spec.train().global_batch() / (plan.dp * parallel.microbatches());
  plan.microbatches.assign(plan.dp, parallel.microbatches());
  plan.stage_begin = RuntimeStageBegin(model, plan.pp);
  if (plan.stage_begin.empty()) {
    return absl::InvalidArgumentError("parallel.pp exceeds the model's blocks");
  }
  return plan;
}

absl::StatusOr<double> SpecStageMemoryBytes(const JobSpec& spec, int stage) {
  ASSIGN_OR_RETURN(const SpecPlanning planning, PlanningForSpec(spec));
  ASSIGN_OR_RETURN(const Plan plan, RuntimePlanShape(spec, planning.model));
  if (stage < 0 || stage >= plan.pp) {
    return absl::InvalidArgumentError(absl::StrCat("stage ", stage, " is outside the plan's ", plan.pp, " stages"));
  }
  return StageMemoryBytes(planning.model, planning.job, plan.stage_begin[stage], plan.stage_begin[stage + 1], stage,
                          plan.pp, plan.tp, plan.dp, plan.microbatch_size, plan.microbatches.front(), plan.schedule);
}

}  // namespace geotrain::scheduler
