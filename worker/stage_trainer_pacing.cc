// DiLoCo's time pacing of a stage actor's steps (diloco.sync time; see stage_trainer.h): the inner steps each group
// takes, planned from the groups' measured step times, and the tokens each step trains.
#include <algorithm>
#include <chrono>

#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/stage_trainer.h"

namespace geotrain::worker {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

int StageTrainer::InnerStepsOf(int group, int64_t step) const {
  if (pacing_->plan_from == 0 || step < pacing_->plan_from) return 1;
  return model::PacedInnerSteps(pacing_->planned[static_cast<size_t>(group)], pacing_->plan_length,
                                static_cast<int>(step - pacing_->plan_from));
}

int StageTrainer::PacedInnerSteps(int64_t step) {
  if (!pacing_) return 1;
  if (const int64_t start = outer_schedule_.PeriodStart(step); pacing_->period_start != start) {
    // A period with no plan (the first, or one resumed from a checkpoint): one inner step a step until PaceWarmUp.
    pacing_->period_start = start;
    pacing_->first_step = step;
    pacing_->plan_from = 0;
    pacing_->counts.assign(static_cast<size_t>(collectives_->diloco_groups), 0);
  }
  return InnerStepsOf(collectives_->diloco_group, step);
}

int64_t StageTrainer::PaceStep(int64_t step) {
  // The present replicas' rows of the global batch (all of it unless a live regroup left replicas out).
  const int64_t global = static_cast<int64_t>(ranks_.present.size()) * ranks_.replica_batch * ranks_.seq_len;
  if (!pacing_) return global;
  int64_t tokens = 0;
  for (int h = 0; h < collectives_->diloco_groups; ++h) {
    const int inner = InnerStepsOf(h, step);
    pacing_->counts[static_cast<size_t>(h)] += inner;
    if (!pacing_->group_replicas.empty()) {
      tokens += inner * static_cast<int64_t>(pacing_->group_replicas[static_cast<size_t>(h)]) * ranks_.replica_batch *
                ranks_.seq_len;
    }
  }
  return pacing_->group_replicas.empty() ? global : tokens;  // none known yet: every group took one inner step
}

absl::StatusOr<std::vector<double>> StageTrainer::GatherPace() {
  // Stage 0's tensor rank 0 of every replica adds its median inner-step seconds since the last gathering (robust to a
  // slow first step or a pause) over its group's replicas, and one replica count, to its group's slots; the replica's
  // other stages and tensor ranks take its sums, so that every actor of the job plans alike. Only stage 0's tensor
  // rank 0 crosses the sites (a data-parallel group holds one stage and rank: all of it takes part, or none); the sum
  // completes when the last group arrives, so its time is this group's wait for the others.
  const int groups = collectives_->diloco_groups, g = collectives_->diloco_group;
  std::vector<float> sums(2 * static_cast<size_t>(groups), 0.0f);
  if (std::vector<double>& s = pacing_->seconds; !s.empty()) {
    const size_t mid = (s.size() - 1) / 2;  // the lower median: of a warm-up's two steps, not the first, slower one
    std::nth_element(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(mid), s.end());
    sums[g] = static_cast<float>(s[mid] / collectives_->inner_replicas);
  }
  sums[groups + g] = 1;
  const bool speaks = ranks_.stage == 0 && ranks_.tp_rank == 0;
  const auto t0 = Clock::now();
  if (speaks && collectives_->dp_scalars->size() > 1) {
    RETURN_IF_ERROR(collectives_->dp_scalars->AllReduceSum(absl::MakeSpan(sums), "pace"));
  }
  if (collectives_->replica->size() > 1) {
    if (!speaks) std::fill(sums.begin(), sums.end(), 0.0f);
    RETURN_IF_ERROR(collectives_->replica->AllReduceSum(absl::MakeSpan(sums), "pace-replica"));
  }
  stats_.outer_sync_seconds += SecondsSince(t0);
  pacing_->group_replicas.assign(sums.begin() + groups, sums.end());
  pacing_->seconds.clear();
  return std::vector<double>(sums.begin(), sums.begin() + groups);
}

void StageTrainer::PlanPacing(int64_t from, int64_t step, const std::vector<double>& seconds) {
  const int64_t end = pacing_->period_start + outer_schedule_.PeriodLength(pacing_->period_start) - 1;
  pacing_->plan_from = from;
  pacing_->plan_length = static_cast<int>(end - from + 1);
  pacing_->planned = model::PlanPacedPeriod(seconds, pacing_->plan_length);
  if (ranks_.stage == 0 && ranks_.tp_rank == 0 && collectives_->diloco_leader) {
    GT_LOG(INFO) << "diloco.sync time after step " << step << ": group " << collectives_->diloco_group << " of "
                 << collectives_->diloco_groups << "; the groups' median inner steps " << absl::StrJoin(seconds, ", ")
                 << " s; their inner steps over steps " << from << "-" << end << ": "
                 << absl::StrJoin(pacing_->planned, ", ");
  }
}

absl::Status StageTrainer::PaceWarmUp(int64_t step) {
  // A period without a plan is paced from its second step on (the first is the slowest to measure): the groups' times
  // of those two steps plan the rest of it, so a fast site does not wait a whole period.
  if (!pacing_ || pacing_->plan_from != 0 || step != pacing_->first_step + 1) return absl::OkStatus();
  if (step >= pacing_->period_start + outer_schedule_.PeriodLength(pacing_->period_start) - 1) {
    return absl::OkStatus();  // the period ends here: its outer step plans the next
  }
  ASSIGN_OR_RETURN(const std::vector<double> seconds, GatherPace());
  PlanPacing(step + 1, step, seconds);
  return absl::OkStatus();
}

absl::Status StageTrainer::PaceOuterStep(int64_t step) {
  ASSIGN_OR_RETURN(const std::vector<double> seconds, GatherPace());
  // The outer average weights each group by the tokens it trained over the period: its inner steps times its replicas.
  const size_t g = static_cast<size_t>(collectives_->diloco_group);
  double tokens = 0;
  for (size_t h = 0; h < pacing_->counts.size(); ++h) tokens += pacing_->counts[h] * pacing_->group_replicas[h];
  outer_weight_ = static_cast<float>(pacing_->counts[g] * pacing_->group_replicas[g] / tokens);
  // The next period's plan, from the times since the last gathering.
  if (step < outer_schedule_.total_steps) {
    pacing_->period_start = step + 1;
    pacing_->first_step = step + 1;
    pacing_->counts.assign(pacing_->counts.size(), 0);
    PlanPacing(step + 1, step, seconds);
  }
  return absl::OkStatus();
}

}  // namespace geotrain::worker
