// Workers that leave on notice: the common step boundary of a job's actors (see job_drain.h).
#include "head/job_drain.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace geotrain::head {

int64_t NewestReportedStep(const JobRun& run) {
  int64_t newest = std::max(run.last_step, run.resumed_step);
  if (!run.steps.empty()) newest = std::max(newest, run.steps.rbegin()->first);
  return newest;
}

bool BeginDrain(JobRun& run, const std::string& worker_id, const std::string& checkpoint_dir, bool needs_checkpoint,
                int64_t now_ms) {
  RunDrain& drain = run.drain;
  const bool fresh = drain.workers.empty();
  drain.workers.insert(worker_id);
  if (!fresh) return false;
  drain.checkpoint_dir = checkpoint_dir;
  drain.needs_checkpoint = needs_checkpoint;
  drain.started_ms = now_ms;
  PickBoundary(run, drain);
  return true;
}

void PickBoundary(const JobRun& run, StepBoundary& boundary) {
  const int64_t target = NewestReportedStep(run) + kDrainMargin + boundary.picks;
  ++boundary.picks;
  boundary.bound.clear();
  boundary.confirmed = false;
  // The last step ends the job (with its own checkpoint): a target there or beyond is no boundary.
  boundary.ends_first = target >= run.spec.train().steps();
  boundary.target = boundary.ends_first ? 0 : target;
}

BoundaryNews ApplyBoundaryStep(const JobRun& run, StepBoundary& boundary, const std::string& actor_id, int64_t step,
                               int64_t knew) {
  BoundaryNews news;
  if (knew == boundary.target && step <= boundary.target) {
    boundary.bound.insert(actor_id);
  } else if (step >= boundary.target) {
    if (boundary.confirmed) {
      news.broken = true;
      return news;
    }
    news.repicked = true;
    news.passed_actor = actor_id;
    news.passed_step = step;
    news.old_target = boundary.target;
    PickBoundary(run, boundary);
    return news;
  }
  if (!boundary.confirmed && boundary.bound.size() == run.actors.size()) {
    boundary.confirmed = true;
    news.confirmed = true;
  }
  return news;
}

DrainNews ApplyDrainReport(JobRun& run, const StepReport& report) {
  DrainNews news;
  RunDrain& drain = run.drain;
  if (drain.workers.empty() || drain.ends_first || drain.target <= 0) return news;
  if (report.drained()) {
    if (report.drain_at_step() == drain.target) drain.left.insert(report.actor_id());
    return news;
  }
  if (report.drain_waiting() || report.step() <= 0 || !report.error().empty()) return news;
  // Timed compute has no weights to checkpoint (the job's record may not say so yet when the drain starts).
  if (report.figures().timed_compute()) drain.needs_checkpoint = false;
  return ApplyBoundaryStep(run, drain, report.actor_id(), report.step(), report.drain_at_step());
}

void FillDrainReply(const JobRun& run, ReportStepReply* reply) {
  const RunDrain& drain = run.drain;
  if (drain.workers.empty() || drain.target <= 0) return;
  reply->set_drain_at_step(drain.target);
  reply->set_drain_confirmed(drain.confirmed);
  reply->set_drain_checkpoint_dir(drain.checkpoint_dir);
}

bool DrainReady(const JobRun& run) {
  const RunDrain& drain = run.drain;
  return !drain.workers.empty() && drain.kept.empty() && drain.confirmed && !drain.handed_over &&
         drain.left.size() == run.actors.size() && (drain.committed || !drain.needs_checkpoint);
}

std::string DrainingWorkers(const RunDrain& drain) { return absl::StrJoin(drain.workers, ", "); }

std::string DrainSubject(const RunDrain& drain) {
  return drain.workers.size() == 1 ? absl::StrCat("worker ", DrainingWorkers(drain), " drains")
                                   : absl::StrCat("workers ", DrainingWorkers(drain), " drain");
}

}  // namespace geotrain::head
