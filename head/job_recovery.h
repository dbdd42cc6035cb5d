// The job runner's fault and recovery policy: which failures restart a job, from which checkpoint, which fail it
// at once, and the runs a restarted head takes over.
//
//   - A fault of a run (a worker hosting one of its actors died, an actor reported an error, a heartbeat says an
//     actor died or is gone, an actor could not be created) moves it to RunPhase::kFault (Fault, any thread); the
//     control thread then (HandleFaults) fails the job when the fault is permanent (the job's own spec, data or
//     checkpoint: a restart would fail the same way) or fault_tolerance.max_restarts (3; < 0: unlimited) are used
//     up, else records the fault, moves the job to RESTARTING and stops the surviving actors.
//   - A recovering run (RecoverJobs, control thread) is placed and launched again from ResumePoint: the job's newest
//     complete checkpoint that verifies, else the one the spec resumes from, else the start; a placement that does
//     not fit waits for workers up to fault_tolerance.wait_for_workers_s (300 s), then fails the job.
//   - The first step past the resumed one ends the recovery (MeasureRecovery, RecordRecovery): its time and the
//     steps lost go in the fault's record and in geotrain_job_recovery_seconds / geotrain_job_steps_lost_total.
//   - A head restart (Restore): the jobs that were RUNNING or RESTARTING get their runs back from their records.
//   - A live regroup (TryRegroup, head/job_regroup.h): before restarting, a fault that leaves some data-parallel replica
//     whole lets those replicas train on without a restart; the others' actors leave. No restart is counted.
//   - A leave (Leave: a drain, head/job_drain.h, is ready or gave up): the job restarts the same way without the
//     draining workers, but it is no fault: no fault record, no restart counted against max_restarts; the job's
//     `leaves` and geotrain_job_leaves_total count it, and the first step after it logs the drain's cost.
//
// What it asks of the job's state machine (ending a job, launching a run) goes through RunControl, which JobRunner
// implements; actors are stopped through the ActorLauncher, counters through the StepAggregator.
// Threads: Fault, Leave, OnWorkerDead and MeasureRecovery on any thread (MeasureRecovery under JobRuns::mu, on the
// run it is given; the others take it); HandleFaults, RecoverJobs, ResumePoint and RecordRecovery on the control thread or
// a reporting handler's, never under JobRuns::mu (they call the job table, RunControl and the launcher); Restore
// before the control thread starts. Its fields are the shared components it was given; all run state is the
// JobRun's fault section (and a drain's hand-over flags), under JobRuns::mu.
// Errors: ResumePoint returns why a checkpoint the spec names cannot be resumed from; the rest end the job (FAILED,
// naming the fault and the limit) or log a failed bookkeeping write.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/clock.h"
#include "head/actor_launcher.h"
#include "head/job_manager.h"
#include "head/job_run.h"
#include "head/registry.h"
#include "head/step_aggregator.h"

namespace geotrain::head {

// What the recovery policy asks of the job's state machine (JobRunner).
class RunControl {
 public:
  virtual ~RunControl() = default;
  // Ends the job in `state` (terminal) with `message`, stopping its actors unless it succeeded.
  virtual void EndJob(const std::string& job_id, JobState state, const std::string& message) = 0;
  // Plans and places the job's run `attempt` on the workers alive now and launches it. UNAVAILABLE: the workers
  // cannot hold it now; ABORTED: an actor could not be created (the run is back to recovering, or has a fault).
  virtual absl::Status PlaceAndLaunch(const JobInfo& job, int64_t attempt, const std::string& resume_from) = 0;
};

class JobRecovery {
 public:
  // Every pointer outlives the recovery policy (JobRunner owns them all).
  JobRecovery(JobManager* jobs, WorkerRegistry* registry, JobRuns* runs, ActorLauncher* launcher,
              StepAggregator* metrics, RunControl* control, const Clock* clock);
  JobRecovery(const JobRecovery&) = delete;
  JobRecovery& operator=(const JobRecovery&) = delete;

  // Rebuilds the runs of the jobs that were RUNNING or RESTARTING when an earlier head stopped.
  void Restore();

  // A worker was declared dead: the running jobs with an unfinished actor on it have a fault.
  void OnWorkerDead(const WorkerInfo& worker);
  // Records a fault of the job's run `attempt` and wakes the control thread; ignored when that run is not the
  // current one or is not running (it already has a fault, or ended). `permanent`: a restart would fail the same
  // way (an actor's set-up error in the job's spec, data or checkpoint), so the job fails at once.
  // `lost_actor` (may be empty): the actor the fault lost (it died or failed), whose replica cannot train on.
  // `no_regroup`: restart, even where the replicas left could train on (a regroup that diverged).
  void Fault(const std::string& job_id, int64_t attempt, const std::string& cause, bool permanent = false,
             const std::string& lost_actor = "", bool no_regroup = false);
  // The job's run `attempt` restarts without `workers` (a drain): as a fault's restart, under `cause`, with the cost
  // measured from `started_ms` (the drain's start, monotonic). `stop_actors`: some actors have not left (the drain
  // gave up), so they are stopped first. Ignored when that run is not the current one or is not running.
  void Leave(const std::string& job_id, int64_t attempt, const std::string& cause, const std::string& workers,
             int64_t started_ms, bool stop_actors);

  // The control thread's steps: decide on the faults seen, then launch the recovering runs again.
  void HandleFaults();
  void RecoverJobs();

  // Where the job's next run starts: its newest complete checkpoint, else what the spec resumes from, else ""
  // (the start). Logs the checkpoints skipped because they do not verify.
  absl::StatusOr<std::string> ResumePoint(const std::string& job_id, const JobSpec& spec);

  // Records a live regroup to `kept` (membership `epoch` of a job of `planned` replicas, `staying` its actors now)
  // in the job (actors, replicas, regroups, its message naming `cause`) and its metrics. Returns "N of M replicas
  // train on (...) without a restart", for log lines. Not under JobRuns::mu.
  std::string RecordRegroup(const std::string& job_id, const std::vector<ActorPlacement>& staying,
                            const std::vector<int>& kept, int planned, int64_t epoch, const std::string& cause);

  // The recovery a complete step ends: its seconds since the fault was detected and the steps lost.
  struct Recovery {
    double seconds = 0;
    int64_t steps_lost = 0;
    bool leave = false;   // after a drain: seconds since the drain started
    std::string workers;  // a leave's: the workers it left
  };
  // Under JobRuns::mu, when every actor of `run` reported `step`: the first step past the resumed one after a
  // restart ends the recovery (once).
  std::optional<Recovery> MeasureRecovery(JobRun& run, int64_t step) const;
  // Records an ended recovery in the job's last fault, its events and the recovery histogram.
  void RecordRecovery(const std::string& job_id, const Recovery& recovery);

 private:
  // Fails the job or moves it to RESTARTING for its fault (HandleFaults, one job).
  struct PendingFault;
  void HandleFault(const PendingFault& fault);
  // A leave's part of HandleFault: RESTARTING under its cause, the leave counted, any actor left stopped.
  void HandleLeave(const PendingFault& fault);
  // A live regroup instead of a restart (head/job_regroup.h), when the job allows one and some replica is whole: the
  // job stays RUNNING with those replicas. False: restart as usual.
  bool TryRegroup(const PendingFault& fault);
  // Their common parts: the job to RESTARTING with `message` (false: not now, the fault stays to be handled; or the job
  // was cancelled meanwhile, and its run ends), and the run to recovering with `restarts` used.
  bool MoveToRestarting(const PendingFault& fault, const std::string& message);
  // Under JobRuns::mu: moves the run `attempt` of the job to kFault with `cause`, detected now, and wakes the control
  // thread; null (nothing done) when that run is not the current one or is not running.
  JobRun* MarkFault(const std::string& job_id, int64_t attempt, const std::string& cause)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(runs_->mu);
  void Recovering(const PendingFault& fault, int restarts);
  // Launches one recovering job again, or decides that it waits or fails (RecoverJobs, one job).
  void RecoverJob(const std::string& job_id);

  JobManager* jobs_;
  WorkerRegistry* registry_;
  JobRuns* runs_;
  ActorLauncher* launcher_;
  StepAggregator* metrics_;
  RunControl* control_;
  const Clock* clock_;
};

}  // namespace geotrain::head
