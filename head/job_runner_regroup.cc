// JobRunner's live regroups (head/job_regroup.h) and the stall probe: the actors' regroup and unreachable-peer reports,
// the regroups that do not form, the healthy replicas' pause, and the runs whose steps stalled. The rest of the runner
// is in job_runner.cc.
#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "head/job_regroup.h"
#include "head/job_runner.h"

namespace geotrain::head {
namespace {

// Why a worker that its job's actors reported is probed (the start of its dead reason when its port refuses).
constexpr char kPeersLostContact[] = "its job's actors lost contact with it";

}  // namespace

ReportStepReply JobRunner::OnRegroupReport(const StepReport& report) {
  ReportStepReply reply;
  RegroupNews news;
  std::vector<std::string> suspects;
  int64_t attempt = 0;
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(report.job_id());
    if (it == runs_.by_job.end() || it->second.phase == RunPhase::kEnded || report.attempt() != it->second.attempt) {
      reply.set_stop(true);  // as for a step report: an ended job, or an earlier run
      return reply;
    }
    JobRun& run = it->second;
    if (run.phase != RunPhase::kRunning) return reply;  // a fault is being handled
    if (InRun(run, report.actor_id())) news = ApplyRegroupReport(run, report, clock_->NowMillis());
    FillRunReply(run, &reply);  // an actor of a replica that left learns so from it
    attempt = run.attempt;
    if (news.first_wait) {
      for (const ActorPlacement& p : run.actors) suspects.push_back(p.actor.worker_id());
    }
  }
  // A killed worker's peers know first: the detector probes the run's workers now rather than after their heartbeat
  // timeout (a refused port is a dead process).
  if (!suspects.empty()) registry_->Suspect(suspects, kPeersLostContact);
  AfterRegroupReport(report.job_id(), attempt, news);
  return reply;
}

void JobRunner::AfterRegroupReport(const std::string& job_id, int64_t attempt, const RegroupNews& news) {
  if (news.diverged) {
    recovery_.Fault(job_id, attempt,
                    absl::StrCat("the replicas left by a fault completed different steps (", news.steps,
                                 "): a live regroup would mix parameter versions"),
                    /*permanent=*/false, /*lost_actor=*/"", /*no_regroup=*/true);
    return;
  }
  if (!news.confirmed) return;
  std::string replicas, leave;  // leave: a drain's leave by regroup, which ends here
  bool healed = false;          // the membership was a heal's: its replicas joined
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(job_id);
    if (it == runs_.by_job.end()) return;
    JobRun& run = it->second;
    replicas = absl::StrJoin(run.regroup.replicas, ", ");
    healed = !run.regroup.joining.empty();
    if (!run.drain.kept.empty()) {
      leave = DrainSubject(run.drain);
      run.drain = RunDrain{};  // done: the draining workers hold none of the run's actors now
    }
  }
  LogIfFailed(jobs_->Update(job_id, [&](JobInfo& j) { j.set_regroup_resume_step(news.step + 1); }).status(), job_id,
              "recording the regroup's confirmation");
  if (healed) {
    RecordHealed(job_id, news.step);
  } else {
    LogIfFailed(jobs_->Log(job_id, absl::StrCat("regrouped: replicas ", replicas, " rebuilt their groups at step ",
                                                news.step, " and train step ", news.step + 1, " next")),
                job_id, "logging");
  }
  if (!leave.empty()) {
    aggregator_.CountLeave(job_id);
    LogIfFailed(jobs_->Update(job_id, [](JobInfo& j) { j.set_leaves(j.leaves() + 1); }).status(), job_id,
                "counting the leave");
    LogIfFailed(jobs_->Log(job_id, absl::StrCat(leave, ": its replicas left after step ", news.step,
                                                "; the job goes on without a restart, no step lost")),
                job_id, "logging");
  }
}

void JobRunner::RecordRegroupPause(const std::string& job_id, int64_t step, double pause_seconds) {
  aggregator_.SetHealthyPause(job_id, pause_seconds);
  LogIfFailed(
      jobs_->Log(job_id, absl::StrFormat("training again without a restart: step %d complete; the replicas that "
                                         "stayed healthy paused %.1f s between two complete steps; no step lost",
                                         step, pause_seconds)),
      job_id, "logging");
}

void JobRunner::CheckRegroups() {
  const int64_t now = clock_->NowMillis();
  std::vector<std::tuple<std::string, int64_t, std::string, bool>> faults;  // job, run, cause, no regroup
  std::vector<std::string> succeeded;
  {
    absl::MutexLock lock(&runs_.mu);
    for (auto& [job_id, run] : runs_.by_job) {
      if (run.phase != RunPhase::kRunning) continue;
      const RunRegroup& g = run.regroup;
      if (!g.confirmed && AllActorsDone(run)) {
        QueueSteps(run, StepAggregator::CompleteEarlier(run, std::numeric_limits<int64_t>::max()));
        succeeded.push_back(job_id);  // the fault came after the last step of the replicas that stay
      } else if (!g.confirmed && now - g.detected_ms > kRegroupFormMs) {
        faults.push_back(
            {job_id, run.attempt,
             absl::StrCat("the replicas left by a fault did not all rebuild their groups within ",
                          kRegroupFormMs / 1000, " s (", g.ready.size(), " of ", run.actors.size(), " actors did)"),
             true});
      } else if (g.confirmed && g.waiting_since_ms > 0 && now - g.waiting_since_ms >= kRegroupGraceMs) {
        faults.push_back({job_id, run.attempt, g.waiting_cause, false});
      }
    }
  }
  for (const auto& [job_id, attempt, cause, no_regroup] : faults) {
    recovery_.Fault(job_id, attempt, cause, /*permanent=*/false, /*lost_actor=*/"", no_regroup);
  }
  for (const std::string& job_id : succeeded) {
    RecordSteps(job_id);
    EndJob(job_id, JOB_SUCCEEDED, "every actor that stayed finished");
  }
}

void JobRunner::ProbeStalledRuns() {
  const int64_t now = clock_->NowMillis();
  std::vector<std::pair<std::vector<std::string>, std::string>> suspects;  // a run's workers, why
  {
    absl::MutexLock lock(&runs_.mu);
    for (auto& [job_id, run] : runs_.by_job) {
      if (run.phase != RunPhase::kRunning || !StallProbeDue(run.progress, now)) continue;
      std::vector<std::string> workers;
      for (const ActorPlacement& p : run.actors) {
        if (!run.drain.left.count(p.actor.actor_id())) workers.push_back(p.actor.worker_id());  // left on notice
      }
      suspects.push_back(
          {std::move(workers), absl::StrFormat("its job's steps stalled (none complete for %.1f s)",
                                               static_cast<double>(now - run.progress.last_complete_ms) / 1000)});
    }
  }
  // A worker killed while its peers only waited to receive from it: none of their sends was refused, so no peer
  // reported it; a refused port on this probe is its dead process, found before its heartbeat timeout.
  for (const auto& [workers, why] : suspects) registry_->Suspect(workers, why);
}

ReportStepReply JobRunner::OnUnreachableReport(const StepReport& report) {
  // A killed worker's peers know first: the detector probes its worker now rather than after its heartbeat timeout
  // (a refused port is a dead process).
  std::vector<std::string> suspects;
  ReportStepReply reply;
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(report.job_id());
    if (it != runs_.by_job.end() && it->second.attempt == report.attempt()) {
      for (const ActorPlacement& p : it->second.actors) {
        if (p.actor.actor_id() == report.unreachable_peer()) suspects.push_back(p.actor.worker_id());
      }
      FillRunReply(it->second, &reply);  // every reply says where the drain and the membership stand
    }
  }
  if (!suspects.empty()) registry_->Suspect(suspects, kPeersLostContact);
  return reply;
}

}  // namespace geotrain::head
