// The runs of the head's jobs: one record per job that the runner has started (its current run: attempt, plan,
// actors, the steps in flight, the checkpoint shards not yet committed, the fault being recovered from), and the
// one table of them that every part of the job runner shares (JobRunner, job_runner.h, owns it).
//
//   absl::MutexLock lock(&runs->mu);
//   auto it = runs->by_job.find(job_id);
//   if (it != runs->by_job.end() && it->second.phase == RunPhase::kRunning) ...
//
// Ownership of a JobRun's fields: each section below names the part that writes it (the others may read it). A
// JobRun lives in JobRuns::by_job and is only touched under JobRuns::mu; functions that take a `JobRun&` are called
// with that lock held. No RPC is made and no other component (job table, registry, metrics) is called while
// holding it; only logging.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "control.pb.h"
#include "head/placement.h"

namespace geotrain::head {

// Where a run is in the job's state machine (JobRunner).
enum class RunPhase {
  kRunning,     // actors created (or being created) and training
  kFault,       // a fault was seen; the control thread stops the actors and decides (JobRecovery)
  kRecovering,  // actors stopped; waiting to be placed and launched again
  kEnded,
};

// One step of a run as its actors' reports add up (StepAggregator): the step's figures (the slowest actor's times,
// every actor's WAN bytes, the loss carriers' mean loss and the replicas' mean validation loss) and what the means
// are made of.
struct StepAggregate {
  StepFigures figures;             // loss_scale: fp16's, the largest reported (all equal); 0 until one is reported
  std::set<std::string> reported;  // the actors whose report of the step is in (a resent report counts once)
  bool have_loss = false;
  double loss_sum = 0, val_sum = 0;
  int loss_reports = 0, val_reports = 0;
  // The tokens each replica trained in the step, as its actors report them (time-paced DiLoCo: a faster group's
  // replicas train more); a replica none reported takes an even share of figures.tokens.
  std::map<int, int64_t> replica_tokens;
  // The step's tokens by the site that trained them: each replica's tokens, split evenly over its actors (stages and
  // tensor ranks), counted at each actor's site. Sums to figures.tokens.
  std::map<std::string, double> site_tokens;
  int lost_reports = 0;  // actors whose report of the step never came (StepAggregator::CompleteEarlier)
};

// One step T that every actor of a run stops after, agreed without a lock step (head/job_drain.h: a drain's; and a
// heal's, head/job_heal.h): T is picked ahead of the newest step reported; each actor's step report says which T it
// knew when it finished the step; once every actor knew T before it passed it, T is confirmed.
struct StepBoundary {
  int64_t target = 0;           // T: the actors stop after this step (0 while none is picked)
  bool ends_first = false;      // the job's last step comes before any target: it ends by itself
  int picks = 0;                // targets picked (the first, and each one an actor passed before it knew)
  std::set<std::string> bound;  // actors that knew T before they passed it: they stop there
  bool confirmed = false;       // every actor is bound: none trains past T
};

// A drain of a run (head/job_drain.h): its actors leave after one common step T, each with its checkpoint shard
// of T, and the job restarts without the draining workers from that checkpoint. Empty `workers`: no drain.
struct RunDrain : StepBoundary {
  std::set<std::string> workers;  // the draining workers with an actor of the run
  std::set<std::string> left;     // actors that stopped after T (their last report is in)
  bool committed = false;         // the checkpoint of T is committed (or the job needs none: timed compute)
  bool needs_checkpoint = true;
  bool handed_over = false;    // the run went to recovery for its restart without the workers (once)
  bool gave_up = false;        // handed over before every actor left (a timeout): they are stopped
  std::string checkpoint_dir;  // the job's checkpoint.dir, where the actors write T's checkpoint
  // A leave by regroup (head/job_regroup.h DrainKeeps): the replicas that train on after T without a restart, the
  // draining workers' replicas leaving. Empty: the job restarts without the draining workers from T's checkpoint.
  std::vector<int> kept;
  int64_t started_ms = 0;  // clock's monotonic milliseconds: the drain's cost is measured from here
};

// Replicas as failure domains (head/job_regroup.h): the membership a run trains in after live regroups, and the one
// forming. Epoch 0 is the run's first membership, every replica.
struct RunRegroup {
  int64_t epoch = 0;
  std::vector<int> replicas;             // the replicas of `epoch`, ascending (empty in epoch 0: every replica)
  bool confirmed = true;                 // every actor of it stands at one completed step (false while it forms)
  int64_t resume_step = 0;               // confirmed after a regroup: the step its actors train next
  std::map<std::string, int64_t> ready;  // forming: actor -> the step it completed, waiting in `epoch`
  std::string cause;                     // the fault it recovers from
  int64_t detected_ms = 0;               // monotonic: that fault's detection
  int64_t paused_from_ms = 0;            // the last complete step before the fault (0: the pause is measured)
  // An actor waits for a regroup that no known fault started (its step failed on a peer): since when (monotonic;
  // 0: none), and its failure. JobRunner::CheckRegroups turns it into a fault after kRegroupGraceMs.
  int64_t waiting_since_ms = 0;
  std::string waiting_cause;
  std::set<std::string> lost_actors;  // actors the fault named as lost (an actor's death or error)
  // A heal's membership (head/job_heal.h): the replicas that join it, the one whose actors stream them their state,
  // and every actor of the job with the joining ones' addresses (kept for the memberships after it).
  std::vector<int> joining;
  int donor = 0;
  std::vector<ActorPeer> peers;
  int64_t heal_looked_ms = 0;  // monotonic: when JobRunner::CheckHeals last tried to place the missing replicas
  // A heal takes its membership's epoch when it begins (head/job_heal.h): a heal given up has used it, and no later
  // membership or heal takes it again (its stopped actors' workers refuse that epoch's tensors).
  int64_t reserved_epoch = 0;
  // After a heal was given up, the next is not tried before heal_retry_ms (monotonic), each give-up doubling the wait.
  int64_t heal_retry_ms = 0;
  int64_t heal_backoff_ms = 0;
};
// The next membership epoch of a run: above every epoch used or reserved.
inline int64_t NextEpoch(const RunRegroup& g) { return std::max(g.epoch, g.reserved_epoch) + 1; }

// A heal of a degraded run (head/job_heal.h): the actors of replicas that left, created anew on free devices, join
// the run at a step boundary T with their state streamed from a live replica. Empty `replicas`: no heal.
struct RunHeal : StepBoundary {
  std::vector<int> replicas;           // the replicas that join, ascending
  std::vector<ActorPlacement> actors;  // their new actors
  int64_t epoch = 0;                   // the membership they join (the run's next)
  int donor = 0;                       // the replica whose actors stream their state to them
  std::set<std::string> ready;         // new actors set up, waiting for their state (StepReport.heal_ready)
  bool joined = false;                 // the membership with them began (JoinHeal)
  int64_t started_ms = 0;              // monotonic: when the heal was placed
  int64_t fault_detected_ms = 0;       // monotonic: the detection of the fault its replicas left for
  int64_t first_step = 0;              // joined: the first step the healed replicas train
  std::vector<ActorPeer> peers;        // every actor once they join, with their workers' addresses
};

// How a run's steps come (JobRunner::OnStepReport), for the healthy pause and the stall probe: a run with no complete
// step for longer than max(kStallProbeMinMs, 1.5 median step intervals) has its workers probed
// (JobRunner::ProbeStalledRuns; head/job_regroup.h StallProbeDue), so that a worker killed while its peers were only
// waiting to receive from it is found by its refused port rather than after its heartbeat timeout.
struct RunProgress {
  int64_t last_complete_ms = 0;      // monotonic: when the newest complete step was recorded (0: none in this run yet)
  std::deque<int64_t> intervals_ms;  // between the newest complete steps, at most kStallIntervals
  int64_t probed_ms = 0;             // the stall probe's last probe
};
inline constexpr int64_t kStallProbeMinMs = 1000;
inline constexpr size_t kStallIntervals = 9;

// A job's current run.
struct JobRun {
  // The state machine's (JobRunner: Launch, EndJob, StopJob, Reconcile; JobRecovery moves the phase on faults).
  JobSpec spec;  // with the current run's plan
  int64_t attempt = 0;
  RunPhase phase = RunPhase::kRunning;
  std::vector<ActorPlacement> actors;
  std::set<std::string> done;
  bool restored = false;  // taken over from the previous head (Restore), until its next launch
  std::map<std::string, std::string> actor_errors;  // actor -> the error it reported (this run)
  int64_t launched_ms = 0;
  std::map<std::string, int64_t> actor_seen_ms;     // actor -> when a heartbeat last listed it
  std::map<std::string, int64_t> finished_seen_ms;  // actor -> when a heartbeat first said it finished

  // The step aggregator's (StepAggregator::Add).
  std::map<int64_t, StepAggregate> steps;
  int64_t last_step = 0;  // the newest step every actor of this run reported
  // Complete steps not recorded yet, in the order they completed (JobRunner::RecordSteps records them in that order,
  // one thread at a time, so that a step never comes after the next one in the job's record).
  std::vector<StepAggregate> to_record;
  RunProgress progress;
  int64_t resumed_step = 0;  // the step this run started after
  std::string resumed_from;

  // The checkpoint committer's (CheckpointCommitter::Collect).
  std::map<int64_t, std::map<std::string, CheckpointShard>> shards;  // step -> actor -> shard
  int64_t last_checkpoint_step = 0;

  // The fault and recovery policy's (JobRecovery): the fault being recovered from.
  int restarts = 0;
  std::string fault_cause;
  bool fault_permanent = false;   // the job itself is at fault: it fails without a restart
  bool fault_no_regroup = false;  // restart even where a live regroup could go on (one diverged)
  int64_t fault_detected_ms = 0;  // clock's monotonic milliseconds
  int64_t fault_unix_ms = 0;
  int64_t fault_step = 0;
  bool recovery_measured = true;  // false until the first step after a restart completes
  std::string waiting_message;    // last "waiting for workers" line logged
  // The restart being recovered from is a drain's (a leave, not a fault): no fault record, no restart counted; its
  // cost is measured from the drain's start (fault_detected_ms).
  bool leaving = false;
  std::string leaving_workers;        // the workers it left, for the log ("w-3, w-4")
  int64_t leave_started_unix_ms = 0;  // when the drain began (persisted in JobInfo with leaving_workers)

  // The drain's (JobRunner with head/job_drain.h; cleared by each launch).
  RunDrain drain;

  // Live regroups' (JobRecovery::TryRegroup starts one, JobRunner applies the actors' reports; cleared by each launch).
  RunRegroup regroup;
  // A heal's (JobRunner with head/job_heal.h; cleared by each launch and when it ends).
  RunHeal heal;
};

// Queues complete steps for JobRunner::RecordSteps, after those queued before.
inline void QueueSteps(JobRun& run, std::vector<StepAggregate> steps) {
  for (StepAggregate& step : steps) run.to_record.push_back(std::move(step));
}

// Whether every actor of the run sent its last report (`done` may hold ids of actors no longer in the run).
inline bool AllActorsDone(const JobRun& run) {
  if (run.actors.empty()) return false;
  for (const ActorPlacement& p : run.actors) {
    if (!run.done.count(p.actor.actor_id())) return false;
  }
  return true;
}

// The runs, shared by the runner's parts. Any thread; every field under `mu`.
struct JobRuns {
  mutable absl::Mutex mu;
  std::map<std::string, JobRun> by_job ABSL_GUARDED_BY(mu);  // job id -> its current run
  // The control thread should look at the jobs now rather than at its next period (a fault, a kick).
  bool kicked ABSL_GUARDED_BY(mu) = false;
};

// The registry's workers by id.
using WorkersById = std::map<std::string, WorkerInfo>;
inline WorkersById ById(const std::vector<WorkerInfo>& workers) {
  WorkersById out;
  for (const WorkerInfo& w : workers) out[w.worker_id()] = w;
  return out;
}

// Logs a failed bookkeeping call (the job table's persistence); such a failure never stops a job.
inline void LogIfFailed(const absl::Status& status, const std::string& job_id, const char* what) {
  if (!status.ok()) GT_LOG(ERROR) << "job " << job_id << ": " << what << ": " << status;
}

}  // namespace geotrain::head
