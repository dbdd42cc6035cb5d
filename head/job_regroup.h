// Replicas as failure domains: the policy that lets the data-parallel replicas untouched by a fault train on without a
// restart (a live regroup), while a replica that lost an actor (its worker died, its actor failed) leaves the job.
//
//   1. A fault of a running synchronous job (no DiLoCo) whose collectives all run on gRPC (JobRecovery::TryRegroup):
//      the replicas whose every actor is alive stay (RegroupKept), if any does. The run's membership moves to a new
//      epoch of those replicas (BeginRegroup): the job stays RUNNING (degraded: N of M replicas), the actors of the
//      others are stopped as leaving a job that goes on, and the kept ones are interrupted (InterruptActor): their
//      step in flight ends, its update never applied.
//   2. Each kept actor waits (StageActor::AwaitRegroup), learns the epoch and its replicas from the replies to its
//      probes (FillRegroupReply), rebuilds its collectives for them (its weights, optimizer and data position kept) and
//      says which step it completed (ApplyRegroupReport). Once every one of them did: the same step c for all, and
//      the regroup is confirmed, to train step c + 1 next (the failed step, trained again by the replicas left, each
//      update the mean over their tokens); different steps (a survivor applied an update another did not), and the job
//      restarts from its checkpoint as before, so no step ever mixes parameter versions.
//   3. An actor whose step failed on a peer before any fault was known waits the same way; the head gives the
//      detector kRegroupGraceMs to find a dead worker, then treats the wait as a fault itself (JobRunner::CheckRegroups).
//   A second fault regroups again when a step completed since the last regroup or it drops another replica; else the
//   job restarts (no loop of regroups without progress).
//
// Thread safety: pure functions of the run they are given, called under JobRuns::mu; they log nothing (the caller
// logs outside the lock).
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "control.pb.h"
#include "head/job_run.h"

namespace geotrain::head {

// How long an actor may wait for a regroup that no known fault started before the head treats its wait as the fault:
// the detector's bound for a dead worker (heartbeat timeout plus a probe), so that a death is known by then.
inline constexpr int64_t kRegroupGraceMs = 6000;
// How long a membership may take to form (every actor of it rebuilt and ready) before the job restarts instead: an
// actor that never reports (its worker hung) must not hold the others longer than a collective's deadline.
inline constexpr int64_t kRegroupFormMs = 60000;

// The replicas of the run's membership now, ascending.
std::vector<int> PresentReplicas(const JobRun& run);

// Whether the run can regroup at all: a synchronous job (no DiLoCo) of dp > 1 whose collectives all run on gRPC (no
// actor on a CUDA device of `workers`: NCCL's communicators are not rebuilt), with no drain under way. Else false,
// with `why` for the log.
bool RegroupEligible(const JobRun& run, const WorkersById& workers, std::string* why);

// A drain's leave by regroup: the present replicas none of whose actors is on a draining worker, when the job can
// regroup live (as RegroupEligible, a drain aside) and some replica leaves; else empty (the drain restarts the job).
std::vector<int> DrainKeeps(const JobRun& run, const WorkersById& workers);

// The replicas that train on after a fault that lost `lost` actors (and those on workers not alive in `workers`):
// the present replicas none of whose actors is lost, ascending. Empty: none is whole.
std::vector<int> RegroupKept(const JobRun& run, const WorkersById& workers, const std::set<std::string>& lost);

// Whether a regroup to `kept` may replace the membership now: a step completed since the last regroup, or `kept`
// drops another replica (so that regroups without progress end in a restart).
bool RegroupMakesProgress(const JobRun& run, const std::vector<int>& kept);

// Moves the run (in kFault, or running for a leave by regroup) to a new membership of `kept`: running again, the next
// epoch forming, its actors those of `kept`; a heal under way is given up. Returns the actors that leave (a given-up
// heal's new actors among them), and the steps in flight that are complete
// now (every actor that stays reported them; the leaving actors' reports no longer count), for the caller to record
// in step order.
struct RegroupBegun {
  std::vector<ActorPlacement> leaving;
  std::vector<StepAggregate> completed;
};
RegroupBegun BeginRegroup(JobRun& run, const std::vector<int>& kept, const std::string& cause, int64_t detected_ms);

// The stall probe (RunProgress). NoteCompleteStep: a step of the run completed at `now_ms`. StallProbeDue: whether the
// run's workers are due a probe at `now_ms` (a step completed in this run, none since max(kStallProbeMinMs, 1.5 median
// step intervals), none probed within kStallProbeMinMs); marks the probe when they are.
void NoteCompleteStep(RunProgress& progress, int64_t now_ms);
bool StallProbeDue(RunProgress& progress, int64_t now_ms);

// What one regroup report did, for the caller to log and act on outside the lock.
struct RegroupNews {
  bool confirmed = false;   // this report completed the membership: every actor at `step`
  bool diverged = false;    // the actors completed different steps: restart the job
  int64_t step = 0;         // confirmed: the step completed by every actor
  std::string steps;        // diverged: "r0s0 at 4, r1s0 at 3"
  bool first_wait = false;  // the first actor waiting with no regroup under way: its peers' workers are suspects
};
// Applies a report of the run (current attempt) that waits for a regroup: an actor ready in the forming membership,
// or, with no regroup under way, an actor whose step failed on a peer (the run's waiting_since_ms).
RegroupNews ApplyRegroupReport(JobRun& run, const StepReport& report, int64_t now_ms);

// The membership part of every reply to the run's reports (nothing in epoch 0).
void FillRegroupReply(const JobRun& run, ReportStepReply* reply);
// What every reply to the run's reports says of it: the membership and the drain (job_drain.h FillDrainReply). An
// actor takes both from each reply.
void FillRunReply(const JobRun& run, ReportStepReply* reply);

// Whether `actor_id` is one of the run's actors now (an actor of a replica that left is not).
bool InRun(const JobRun& run, const std::string& actor_id);

}  // namespace geotrain::head
