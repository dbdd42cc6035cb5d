// Runs jobs on the cluster: places a job's actors on workers, creates them, follows their step reports,
// commits their checkpoints, recovers from faults, and ends the job. It is the head's only path into the
// data plane, and it stays at step granularity: tensors flow between actors directly, never through the
// head.
//
//   PENDING ──(enough free devices: alive, not held by another job's actors; plan fits in memory)──▶
//     actors created ──▶ RUNNING. Pending jobs are tried in submission order each time the control thread
//     looks; one that does not fit waits with the reason (which jobs hold the devices), and a later job that
//     fits may start before it (backfill).
//   RUNNING ──(every actor reported its last step)──▶ SUCCEEDED
//   RUNNING ──(a fault: a worker hosting an actor died, an actor errored, a stream or collective failed)──▶
//     RESTARTING: every surviving actor is stopped at once; the job resumes from its newest complete
//     checkpoint (or its start) as a new run (attempt) on the workers alive now: the same ones when they
//     are back, spare ones, or, for `plan: auto`, a new plan ──▶ RUNNING
//   RESTARTING ──(fault_tolerance.max_restarts used up; or a manual plan still lacks devices after
//     fault_tolerance.wait_for_workers_s)──▶ FAILED, naming the fault or what is missing
//   any ──(job cancel)──▶ CANCELLED, every actor stopped
//
// Checkpoints: replica 0's actors write their stage's shard into <checkpoint.dir>/step_N/ in the
// background and report it; when every stage's shard of a step is in, the runner writes the manifest
// (model/checkpoint.h CommitCheckpoint) and keeps the newest checkpoint.keep. A failed shard abandons that
// checkpoint with a warning event; training goes on.
//
// A head restart: what a running job needs (plan, actors, run number, restarts, faults, shards not yet
// committed) is in the job record (JobManager, SQLite); Restore() rebuilds the runs, and actors that kept
// training report to the new head (their reports wait in their queues while it is away).
//
// Placement and `plan: auto` planning are in head/placement.h.
//
// Threads: one job-control thread (Start) plans, places, launches, restarts and reconciles; the RPCs to
// workers run on an executor (actors are created in parallel, stops are sent at once); gRPC handlers call
// OnStepReport, StopJob and Kick; the detector thread calls OnWorkerDead, which only queues the fault.
// One mutex guards the runs; no RPC is made while holding it.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "head/executor.h"
#include "head/job_manager.h"
#include "head/placement.h"  // PlaceActors, PlanAutoJob (moved there; callers keep including this header)
#include "head/registry.h"
#include "internal.grpc.pb.h"

namespace geotrain::head {

struct JobRunnerOptions {
  std::string token;
  std::string head_address;  // where actors report (empty: the worker's own head address)
  TlsFiles tls;
  int rpc_threads = 8;                 // the executor's threads
  int64_t control_period_ms = 250;     // how often the control thread looks at the jobs, at most
  int64_t actor_lost_after_ms = 8000;  // an alive worker that stops listing an actor: lost after this long
  // A heartbeat may say an actor finished before its last step report arrives (reports are sent in the
  // background): the job ends on the reports, or on the heartbeats only after this long without them.
  int64_t final_report_grace_ms = 10000;
  int64_t stop_deadline_ms = 3000;     // StopActor's deadline
  int64_t create_deadline_ms = 10000;  // CreateActor's deadline
  // A job's own series on /metrics (loss, tokens/s, step times, restarts: label job_id) are removed this long after
  // it ended, time enough for Prometheus to scrape the last values; its history stays in Prometheus.
  int64_t ended_job_series_ms = 60000;
};

class JobRunner {
 public:
  JobRunner(JobManager* jobs, WorkerRegistry* registry, MetricsServer* metrics, JobRunnerOptions options,
            const Clock* clock = RealClock::Get());
  ~JobRunner();  // Shutdown()
  JobRunner(const JobRunner&) = delete;
  JobRunner& operator=(const JobRunner&) = delete;

  // Rebuilds the runs of the jobs that were RUNNING or RESTARTING when an earlier head stopped.
  void Restore();
  // Starts the job-control thread; `on_tick` (may be null) runs on it after every look at the jobs.
  void Start(std::function<void()> on_tick);
  void Shutdown();
  // Wakes the control thread now (a job was submitted, a worker joined).
  void Kick();

  // A worker was declared dead: the jobs with actors on it have a fault (handled on the control thread).
  void OnWorkerDead(const WorkerInfo& worker);
  // Handles one actor's step report (gRPC handler threads); returns true when the actor should stop.
  bool OnStepReport(const StepReport& report);
  // Stops every actor of the job (after a cancel); the stops are sent in the background.
  void StopJob(const std::string& job_id, const std::string& reason);
  // Actors of running jobs as the head placed them (for status when workers have not reported yet).
  std::vector<ActorRecord> Actors(const std::string& job_id) const;

 private:
  struct StepAggregate {
    int reports = 0;
    double step_seconds = 0, compute = 0, wait = 0, bubble = 0, loss = 0, checkpoint = 0;
    bool have_loss = false;
    bool timed_compute = false;  // some actor ran on timed compute: times emulated, no real loss
    // The mean over the loss carriers' reports (one per replica when each reports its own: DiLoCo), and
    // over the replicas' validation losses (steps that evaluated).
    double loss_sum = 0, val_sum = 0;
    int loss_reports = 0, val_reports = 0;
    int64_t tokens = 0;
    std::map<std::string, int64_t> wan_bytes;
    double compression_ratio = 0;
    double loss_scale = 0;  // fp16's, the largest reported (all equal); 0: none reported
    bool skipped = false;   // fp16: the step's gradients overflowed and it was skipped
  };
  enum class Phase {
    kRunning,     // actors created (or being created) and training
    kFault,       // a fault was seen; the control thread stops the actors and decides
    kRecovering,  // actors stopped; waiting to be placed and launched again
    kEnded,
  };
  struct Run {
    JobSpec spec;  // with the current run's plan
    int64_t attempt = 0;
    int restarts = 0;
    Phase phase = Phase::kRunning;
    std::vector<ActorPlacement> actors;
    std::set<std::string> done;
    bool restored = false;  // taken over from the previous head (Restore), until its next launch
    std::map<std::string, std::string> actor_errors;  // actor -> the error it reported (this run)
    std::map<int64_t, StepAggregate> steps;
    std::map<int64_t, std::map<std::string, CheckpointShard>> shards;  // step -> actor -> shard
    int64_t last_step = 0;     // the newest step every actor of this run reported
    int64_t resumed_step = 0;  // the step this run started after
    int64_t last_checkpoint_step = 0;
    std::string resumed_from;
    // The fault being recovered from.
    std::string fault_cause;
    bool fault_permanent = false;   // the job itself is at fault: it fails without a restart
    int64_t fault_detected_ms = 0;  // clock's monotonic milliseconds
    int64_t fault_unix_ms = 0;
    int64_t fault_step = 0;
    bool recovery_measured = true;  // false until the first step after a restart completes
    std::string waiting_message;    // last "waiting for workers" line logged
    int64_t launched_ms = 0;
    std::map<std::string, int64_t> actor_seen_ms;     // actor -> when a heartbeat last listed it
    std::map<std::string, int64_t> finished_seen_ms;  // actor -> when a heartbeat first said it finished
  };

  void ControlLoop(std::function<void()> on_tick);
  // The control thread's steps.
  void HandleFaults();
  // Writes the ends of jobs whose final state could not be written before (the store was failing).
  void RetryPendingEnds();
  void RecoverJobs();
  void StartPendingJobs();
  void Reconcile();
  // Chooses the plan and the placement for the job's next run, and launches it. UNAVAILABLE when the
  // workers alive now cannot hold it (the caller decides whether to wait).
  absl::Status PlaceAndLaunch(const JobInfo& job, int64_t attempt, const std::string& resume_from);
  // The devices the actors of every other running job hold.
  HeldDevices HeldByOthers(const std::string& job_id) const;
  // Where the job's next run starts: its newest complete checkpoint, else what the spec resumes from, else
  // nothing. Logs the checkpoints skipped.
  absl::StatusOr<std::string> ResumePoint(const std::string& job_id, const JobSpec& spec);
  absl::Status Launch(const JobInfo& job, std::vector<ActorPlacement> placement, int64_t attempt,
                      const std::string& resume_from);
  // Records a fault of the job's current run (any thread); ignored when the run already has one or ended.
  // `permanent`: a restart would fail the same way (an actor's set-up error in the job's spec, data or checkpoint),
  // so the job fails at once.
  void Fault(const std::string& job_id, int64_t attempt, const std::string& cause, bool permanent = false);
  void EndJob(const std::string& job_id, JobState state, const std::string& message);
  // Sends StopActor to every actor at once; waits for the answers when `wait`.
  void StopActors(const std::vector<ActorPlacement>& actors, const std::string& reason, bool wait);
  void CommitCheckpoint(const std::string& job_id, const JobSpec& spec, int64_t step,
                        const std::map<std::string, CheckpointShard>& shards);
  void RecordStep(const std::string& job_id, int64_t step, const StepAggregate& agg);
  // The job's actors as they ended, in its record (`job status` shows them once the workers forget them):
  // their workers' last reports where those say they are dead, else what ended the job.
  void RecordFinalActorStates(const std::string& job_id, JobState state, const std::string& message);
  void RecordRecovery(const std::string& job_id, double seconds, int64_t steps_lost);
  // Removes the per-job series of the jobs that ended options_.ended_job_series_ms ago or more (control thread).
  void ForgetEndedJobSeries();
  // Logs a failed bookkeeping call (the job table's persistence); such a failure never stops a job.
  void Check(const absl::Status& status, const std::string& job_id, const char* what);

  JobManager* jobs_;
  WorkerRegistry* registry_;
  MetricsServer* metrics_;  // may be null
  const JobRunnerOptions options_;
  const Clock* clock_;
  std::unique_ptr<Executor> executor_;

  mutable absl::Mutex mu_;
  std::map<std::string, Run> runs_ ABSL_GUARDED_BY(mu_);
  bool kicked_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, std::pair<JobState, std::string>> pending_ends_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Per-job series are added (RecordStep, on a report's thread) and removed under series_mu_ (taken before mu_), so
  // that a late report cannot bring back a removed job's series.
  absl::Mutex series_mu_;
  std::map<std::string, int64_t> ended_at_ms_ ABSL_GUARDED_BY(series_mu_);  // clock_->NowMillis() at the end
  std::set<std::string> series_removed_ ABSL_GUARDED_BY(series_mu_);
  std::thread control_;
};

}  // namespace geotrain::head
