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
  PickDrainTarget(run);
  return true;
}

void PickDrainTarget(JobRun& run) {
  RunDrain& drain = run.drain;
  const int64_t target = NewestReportedStep(run) + kDrainMargin + drain.picks;
  ++drain.picks;
  drain.bound.clear();
  drain.confirmed = false;
  // The last step ends the job (with its own checkpoint): a target there or beyond is no drain.
  drain.ends_first = target >= run.spec.train().steps();
  drain.target = drain.ends_first ? 0 : target;
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
  const int64_t step = report.step();
  if (report.drain_at_step() == drain.target && step <= drain.target) {
    drain.bound.insert(report.actor_id());
  } else if (step >= drain.target) {
    if (drain.confirmed) {
      news.broken = true;
      return news;
    }
    news.repicked = true;
    news.passed_actor = report.actor_id();
    news.passed_step = step;
    news.old_target = drain.target;
    PickDrainTarget(run);
    return news;
  }
  if (!drain.confirmed && drain.bound.size() == run.actors.size()) {
    drain.confirmed = true;
    news.confirmed = true;
  }
  return news;
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
