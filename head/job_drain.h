// Workers that leave on notice (a drain: `geotrain worker drain ID`, or SIGTERM to a worker): the policy that makes
// every actor of a job leave after one common step T, each with its checkpoint shard of T, so that the job restarts
// without the draining workers from that checkpoint (resuming at T + 1) and loses no step. Where other data-parallel
// replicas have no actor on the draining workers (and the job can regroup live), they train on after T without a
// restart instead, and the draining workers' replicas leave (head/job_regroup.h DrainKeeps; docs/reliability.md).
//
// Per run (JobRun::drain, under JobRuns::mu):
//   1. BeginDrain (the control thread, JobRunner::CheckDrains): T = the newest step any actor of the run reported +
//      kDrainMargin. A job whose last step comes first ends by itself (ends_first); its actors leave with it.
//   2. Every reply to the run's reports carries T (FillDrainReply). An actor's step report says which T it knew when
//      it finished the step (StepReport.drain_at_step): knowing T at a step <= T binds it to stop after T. An actor
//      that finished a step >= T without knowing T passed it: a later T is picked (one step more margin each time)
//      and every binding starts over (ApplyDrainReport).
//   3. An actor that finishes T writes its checkpoint shard of T and waits, probing the head, until the drain is
//      confirmed (every actor is bound) or T moves on (then it trains on). The actors of a synchronous job wait on
//      each other every step, so an actor waiting at T holds every other at T + 1 at the latest, and one that passed
//      T means every actor finished T: the wait ends either way, and once every actor is bound none can pass T.
//   4. Confirmed, the actors stop and send their last report (drained, with their shard). Once every actor has left
//      and the checkpoint of T is committed (DrainReady), the job restarts without the draining workers
//      (JobRecovery::Leave), from T.
//
//   {  // under JobRuns::mu, the run of the report
//     DrainNews news = ApplyDrainReport(run, report);
//     FillDrainReply(run, &reply);
//   }
//
// Thread safety: pure functions of the run they are given, called under JobRuns::mu; they log nothing (the caller
// logs the news outside the lock).
#pragma once

#include <cstdint>
#include <string>

#include "control.pb.h"
#include "head/job_run.h"

namespace geotrain::head {

// Steps between the newest one reported and the first target: time for every actor to learn of it (a reply to a
// report) before it finishes that step. Each target an actor passed adds one.
inline constexpr int64_t kDrainMargin = 2;

// The newest step any actor of the run reported (complete or not); the step it resumed after when none.
int64_t NewestReportedStep(const JobRun& run);

// Starts the run's drain for `worker_id` (its actors write T's checkpoint into `checkpoint_dir`; a timed-compute job
// `needs_checkpoint` none: it has no weights) and picks T. Returns false, adding the worker, when the run drains
// already. `now_ms`: the clock's monotonic milliseconds.
bool BeginDrain(JobRun& run, const std::string& worker_id, const std::string& checkpoint_dir, bool needs_checkpoint,
                int64_t now_ms);

// Picks a step boundary's target (again): the newest step reported + kDrainMargin + the targets picked before (0 and
// ends_first when that is not before the job's last step); every binding starts over. A drain's and a heal's.
void PickBoundary(const JobRun& run, StepBoundary& boundary);

// What one report did to a step boundary (a drain's or a heal's), for the caller to log and act on outside the lock.
struct BoundaryNews {
  bool repicked = false;  // passed_actor finished passed_step >= old_target without knowing it
  std::string passed_actor;
  int64_t passed_step = 0, old_target = 0;
  bool confirmed = false;  // this report bound the last actor
  bool broken = false;     // an actor passed a confirmed target (a protocol break): restart the job the usual way
};
using DrainNews = BoundaryNews;
// Applies one actor's step report (`step` > 0, no error), which knew `knew` as the target when it finished the step,
// to `boundary` (a target picked): binds the actor, or picks a later target when it passed this one without knowing.
BoundaryNews ApplyBoundaryStep(const JobRun& run, StepBoundary& boundary, const std::string& actor_id, int64_t step,
                               int64_t knew);
// Applies one report of the run (current attempt, no error) to its drain: bindings, actors that left, a new target.
DrainNews ApplyDrainReport(JobRun& run, const StepReport& report);

// The drain's part of the reply to a report of the run: the target, whether it is confirmed, the checkpoint dir.
void FillDrainReply(const JobRun& run, ReportStepReply* reply);

// The run can restart without the draining workers: confirmed, every actor left, the checkpoint of T committed (or
// none needed), and not handed over yet. Never for a leave by regroup (RunDrain::kept): that job goes on.
bool DrainReady(const JobRun& run);

// The draining workers, for log lines: "w-3" or "w-3, w-4"; and as a subject: "worker w-3 drains" or "workers w-3,
// w-4 drain".
std::string DrainingWorkers(const RunDrain& drain);
std::string DrainSubject(const RunDrain& drain);

}  // namespace geotrain::head
