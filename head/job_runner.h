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
//   RUNNING ──(a worker hosting an actor drains: its actors and every other of the job leave after one step T, with
//     a checkpoint of T; head/job_drain.h)──▶ RESTARTING: a leave, no fault; the job resumes from T without the
//     draining workers ──▶ RUNNING
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
// The parts, one per concern (like Ray's GCS managers), each with its contract in its header:
//   head/actor_launcher.h        placement -> actors created on their workers; stopping them (the executor)
//   head/job_recovery.h          faults: which restart, from which checkpoint, which fail the job; Restore
//   head/step_aggregator.h       step reports -> step events, progress and the job's metric families
//   head/checkpoint_committer.h  checkpoint shards -> committed manifests
//   head/job_drain.h             workers leaving on notice: the step boundary every actor of a job leaves at
//   head/job_run.h               the runs they share (one table, one mutex)
// JobRunner itself is the job's state machine: it starts pending jobs, launches runs, reconciles them with the
// workers' heartbeats, ends jobs (retrying an end the store could not write), and routes reports and faults.
// Placement and `plan: auto` planning are in head/placement.h.
//
// Threads and ownership:
//   - the job-control thread (Start) runs ControlLoop: RetryPendingEnds, JobRecovery::HandleFaults, Reconcile,
//     CheckDrains, CheckRegroups, JobRecovery::RecoverJobs, StartPendingJobs, StepAggregator::ForgetEndedJobSeries, then `on_tick`.
//     It alone plans, places, launches and restarts runs.
//   - gRPC handlers call OnStepReport (aggregation, checkpoint gathering and the drain's bookkeeping under
//     JobRuns::mu, then recording, commits and a ready drain's hand-over, JobRecovery::Leave, without it), StopJob,
//     Actors and Kick; the detector thread calls OnWorkerDead, which only queues the fault (JobRecovery::Fault).
//   - the launcher's executor threads make the RPCs to workers; they touch no run.
//   - JobRuns::mu guards the runs (runs_.by_job, runs_.kicked) and the runner's own stopping_ and pending_ends_;
//     no RPC is made and no other component is called while holding it. The step aggregator's series mutex is
//     its own (taken before the job table's, never with JobRuns::mu).
// Errors: the public calls return none: a job that cannot run ends FAILED with the reason, and a failed bookkeeping write (the job table) is logged; an end the store refuses (UNAVAILABLE: a full disk) is
// retried on every look until it is written.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "head/actor_launcher.h"
#include "head/checkpoint_committer.h"
#include "head/job_drain.h"
#include "head/job_heal.h"
#include "head/job_manager.h"
#include "head/job_recovery.h"
#include "head/job_regroup.h"
#include "head/job_run.h"
#include "head/placement.h"  // PlaceActors, PlanAutoJob (moved there; callers keep including this header)
#include "head/registry.h"
#include "head/step_aggregator.h"

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
  // Drains (head/job_drain.h): where a job without checkpoint.dir gets one for its drain's checkpoint
  // (<drain_checkpoint_root>/<job id>; empty: such a job restarts from its start), and how long a drain may take
  // before the job restarts without the draining workers from its newest checkpoint (steps lost).
  std::string drain_checkpoint_root;
  int64_t drain_timeout_ms = 120000;
};

class JobRunner final : private RunControl {
 public:
  // `jobs`, `registry` and `clock` outlive the runner; `metrics` may be null (no /metrics).
  JobRunner(JobManager* jobs, WorkerRegistry* registry, MetricsServer* metrics, JobRunnerOptions options,
            const Clock* clock = RealClock::Get());
  ~JobRunner() override;  // Shutdown()
  JobRunner(const JobRunner&) = delete;
  JobRunner& operator=(const JobRunner&) = delete;

  // Rebuilds the runs of the jobs that were RUNNING or RESTARTING when an earlier head stopped (before Start).
  void Restore();
  // Starts the job-control thread; `on_tick` (may be null) runs on it after every look at the jobs.
  void Start(std::function<void()> on_tick);
  // Ends the control thread, then finishes the RPCs queued. Once; later calls do nothing.
  void Shutdown();
  // Wakes the control thread now (a job was submitted, a worker joined).
  void Kick();

  // A worker was declared dead: the jobs with actors on it have a fault (handled on the control thread).
  void OnWorkerDead(const WorkerInfo& worker);
  // Handles one actor's step report (gRPC handler threads); the reply says whether the actor should stop, and a
  // drain's step boundary (head/job_drain.h).
  ReportStepReply OnStepReport(const StepReport& report);
  // Stops every actor of the job (after a cancel); the stops are sent in the background.
  void StopJob(const std::string& job_id, const std::string& reason);
  // Actors of running jobs as the head placed them (for status when workers have not reported yet).
  std::vector<ActorRecord> Actors(const std::string& job_id) const;

 private:
  void ControlLoop(std::function<void()> on_tick);
  // The control thread's steps (with JobRecovery's HandleFaults and RecoverJobs).
  // Writes the ends of jobs whose final state could not be written before (the store was failing).
  void RetryPendingEnds();
  void StartPendingJobs();
  // Compares the runs with the workers' heartbeats: an actor that died is a fault, one that finished counts as
  // done once its last report is overdue, one an alive worker stopped listing is lost.
  void Reconcile();
  // Starts the drains of the running jobs with an actor on a draining worker (registry), and hands the drains that
  // took longer than drain_timeout_ms over to recovery (the job restarts without the workers all the same).
  void CheckDrains();
  // Starts (or widens) the drain of run `attempt` of the job for `worker_id`, giving a job without checkpoint.dir
  // one for it, and logs it.
  void StartDrain(const std::string& job_id, int64_t attempt, const std::string& worker_id);
  // A report's consequences for the run's drain, after its checkpoints were committed: logs `news`, marks the
  // drain's checkpoint committed, and hands a ready drain (or a broken one) over to recovery.
  void AfterDrainReport(const std::string& job_id, int64_t attempt, const DrainNews& news,
                        const CheckpointCommitter::Gathered& gathered);
  // Live regroups (head/job_regroup.h): an actor's wait that no known fault explains after kRegroupGraceMs becomes a
  // fault; a membership that has not formed within kRegroupFormMs restarts the job.
  void CheckRegroups();
  // The stall probe (RunProgress): the workers of a run whose steps stalled are probed now (WorkerRegistry::Suspect).
  void ProbeStalledRuns();
  // One actor's report of a step, added to the run's aggregate; the steps it completes (and earlier ones whose other
  // reports never came: StepAggregator::CompleteEarlier) go to run.to_record. A complete step may end a recovery
  // (returned, to record) or a live regroup's pause (healthy_pause >= 0).
  struct StepAdded {
    std::optional<JobRecovery::Recovery> recovery;
    double healthy_pause = -1;
    double heal_seconds = -1;  // the healed replicas' first step: their fault's detection to it
  };
  StepAdded AddStepReport(JobRun& run, const StepReport& report) ABSL_EXCLUSIVE_LOCKS_REQUIRED(runs_.mu);
  // Records the job's complete steps (JobRun::to_record) in the order they completed, one thread at a time.
  void RecordSteps(const std::string& job_id) ABSL_LOCKS_EXCLUDED(runs_.mu);
  void RecordAllSteps() ABSL_LOCKS_EXCLUDED(runs_.mu);
  // A report that waits for a regroup (OnStepReport's part): applied to the run's regroup, the reply with its
  // membership.
  ReportStepReply OnRegroupReport(const StepReport& report);
  // A report that a peer actor's worker could not be reached: that worker is probed at once (WorkerRegistry::Suspect).
  ReportStepReply OnUnreachableReport(const StepReport& report);
  // A report's consequences for the run's regroup, outside the lock: logs `news`; a divergence restarts the job.
  void AfterRegroupReport(const std::string& job_id, int64_t attempt, const RegroupNews& news);
  // The first complete step after a regroup: the healthy replicas' pause, logged and in its gauge.
  void RecordRegroupPause(const std::string& job_id, int64_t step, double pause_seconds);
  // Heals (head/job_heal.h). CheckHeals: starts the heal of each degraded run whose missing replicas fit on the free
  // devices (LaunchHeal creates their actors), and gives up the heals that cannot finish.
  void CheckHeals();
  void LaunchHeal(const std::string& job_id, int64_t attempt, const std::vector<ActorPlacement>& actors,
                  const JobSpec& spec, const Regroup& join, const std::vector<ActorPeer>& peers);
  // Gives up the run's heal that has not joined yet (`why` for the log): its new actors are stopped; when the others
  // stop at its confirmed step, a membership of them alone lets them go on. The next heal waits (doubling). False
  // when there was none to give up (it joined, or a fault is being handled).
  bool GiveUpHeal(const std::string& job_id, int64_t attempt, const std::string& why);
  // A report of a heal's new actor before it joined: set up (StepReport.heal_ready), or failed (the heal is given
  // up). Nothing when the report is not such an actor's error (the caller handles it).
  std::optional<ReportStepReply> OnHealReport(const StepReport& report);
  // A report's consequences for the run's heal, outside the lock: logs T when picked, records the membership moved.
  void AfterHealNews(const std::string& job_id, const HealNews& news);
  // A heal's membership confirmed (every actor at T, the state streamed): logged, counted, the job whole again.
  void RecordHealed(const std::string& job_id, int64_t step);
  // The healed replicas' first complete step: the heal's cost, logged and in its histogram.
  void RecordHealSeconds(const std::string& job_id, int64_t step, double seconds);

  // RunControl (JobRecovery calls these too).
  // Chooses the plan and the placement for the job's next run, and launches it. UNAVAILABLE when the
  // workers alive now cannot hold it (the caller decides whether to wait).
  absl::Status PlaceAndLaunch(const JobInfo& job, int64_t attempt, const std::string& resume_from) override;
  void EndJob(const std::string& job_id, JobState state, const std::string& message) override;

  // The devices the actors of every other running job hold.
  HeldDevices HeldByOthers(const std::string& job_id) const;
  // Starts run `attempt` of the job on `placement`: records it, creates its actors, and moves the job to RUNNING.
  absl::Status Launch(const JobInfo& job, std::vector<ActorPlacement> placement, int64_t attempt,
                      const std::string& resume_from);
  // Launch's first phase: the run's record here and in the job table (the first run moves the job to RUNNING).
  absl::Status BeginRun(const JobInfo& job, const std::vector<ActorPlacement>& placement, int64_t attempt,
                        const std::string& resume_from, int64_t resumed_step);
  // The job's actors as they ended, in its record (`job status` shows them once the workers forget them):
  // their workers' last reports where those say they are dead, else what ended the job.
  void RecordFinalActorStates(const std::string& job_id, JobState state, const std::string& message);

  JobManager* jobs_;
  WorkerRegistry* registry_;
  const JobRunnerOptions options_;
  const Clock* clock_;

  // The parts (each thread-safe as its header says); recovery_ calls back into this runner (RunControl).
  JobRuns runs_;
  ActorLauncher launcher_;
  StepAggregator aggregator_;
  CheckpointCommitter committer_;
  JobRecovery recovery_;

  bool stopping_ ABSL_GUARDED_BY(runs_.mu) = false;
  // Held while a job's complete steps are taken from its run and recorded (RecordSteps), so that two report threads
  // never record them out of order. Taken before runs_.mu, never while holding it.
  absl::Mutex record_mu_ ABSL_ACQUIRED_BEFORE(runs_.mu);
  // Ends the store refused (UNAVAILABLE), retried by the control thread: job id -> (state, message).
  std::map<std::string, std::pair<JobState, std::string>> pending_ends_ ABSL_GUARDED_BY(runs_.mu);
  std::thread control_;  // the job-control thread (Start, Shutdown)
};

}  // namespace geotrain::head
