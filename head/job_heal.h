// Healing a degraded job from a live peer: the replicas that left a live regroup (head/job_regroup.h) come back on
// free devices while the others train, their state streamed from a replica that stayed. No checkpoint is read and no
// step is lost.
//
//   1. The control thread (JobRunner::CheckHeals) finds a run whose confirmed membership lacks replicas of its plan
//      (MissingReplicas), places every missing replica's actors on free devices (PlaceHeal: none placed unless all
//      fit) and starts the heal (BeginHeal): membership epoch E + 1 of every replica, its donor the lowest replica
//      present. The new actors are created with that membership (CreateActorRequest.join); they set up (the stage,
//      its data, its collectives) while the others train on, and say so (StepReport.heal_ready, ApplyHealReady).
//   2. Once every new actor is ready, a step boundary T is picked as for a drain (job_drain.h PickBoundary): every
//      reply carries T, each actor's step report says which T it knew, and T is confirmed once every actor of the run
//      knew it before it passed it (ApplyHealStep). Those actors stop after T.
//   3. Once T is confirmed and every actor's report of T is in, the run's membership moves to E + 1 with the new
//      actors in it (JoinHeal): every reply names its replicas, the joining ones, the donor and the actors' list with
//      the new addresses. Each actor that stayed rebuilds its collectives for it; the donor's actors stream their
//      stage's weights, AdamW state, loss scale, step and data position to the joining actors over the exact
//      data-parallel communicator; every actor then says it is ready at T, and the membership is confirmed as for a
//      regroup (ApplyRegroupReport): all train T + 1.
//   A heal that cannot finish (a new actor not created, failed or not set up within kHealSetUpMs, its worker gone)
//   before the membership moved is given up (its actors stopped; the job trains on degraded and may heal again); once
//   the membership moved, a failure is a fault of the run like any other.
//
// Thread safety: pure functions of the run they are given, called under JobRuns::mu; they log nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "control.pb.h"
#include "head/job_drain.h"
#include "head/job_run.h"
#include "head/placement.h"

namespace geotrain::head {

// How long the new actors of a heal may take to set up (create their stage, open their data) before it is given up.
inline constexpr int64_t kHealSetUpMs = 120000;
// How often the head tries to place a degraded run's missing replicas; after a heal given up, the wait before the
// next (doubling with each give-up, up to the maximum).
inline constexpr int64_t kHealLookMs = 1000;
inline constexpr int64_t kHealRetryMs = 10000;
inline constexpr int64_t kHealRetryMaxMs = 300000;

// The replicas of the plan a heal would bring back: those not in the run's membership, when the run may heal now:
// running, its membership a confirmed regroup's with a step completed since it resumed, no drain or heal under way,
// a job that regroups live (RegroupEligible). Empty otherwise.
std::vector<int> MissingReplicas(const JobRun& run, const WorkersById& workers);

// Places the actors of `replicas` (the plan's stages and tensor ranks, each replica's share of the batch; their pins
// kept where they name a site or an alive worker: a pinned worker may be the one that died) on the free devices of
// `workers` less `held` and less every CUDA device (NCCL groups are not rebuilt live), as PlaceActors does
// (UNAVAILABLE when they do not all fit now). Their ids are the plan's, with the run ("-a<attempt>") and the heal
// ("-h<epoch>", an epoch never used again).
absl::StatusOr<std::vector<ActorPlacement>> PlaceHeal(const JobInfo& job, const std::vector<int>& replicas,
                                                      const std::vector<WorkerInfo>& workers, const HeldDevices& held,
                                                      int64_t attempt, int64_t epoch);

// Starts a heal of `replicas` with their new `actors` (placed, not yet created) at `now_ms`: its membership is the
// run's next epoch (reserved: a membership after a give-up takes a later one), its donor the lowest replica present.
void BeginHeal(JobRun& run, std::vector<int> replicas, std::vector<ActorPlacement> actors, int64_t now_ms);

// The membership the heal's new actors are created in (CreateActorRequest.join) and the run moves to (JoinHeal):
// every replica present and joining, the joining ones, the donor. Its actors' list is the caller's (it needs the
// workers' addresses).
Regroup HealMembership(const JobRun& run);

// Every actor of the run once the heal's replicas join: the run's actors and the new ones.
std::vector<ActorPlacement> HealedActors(const JobRun& run);

// What one report did to the run's heal, for the caller to act on and log outside the lock.
struct HealNews {
  bool picked = false;    // the last new actor is set up: the boundary T was picked
  bool joined = false;    // the membership moved to the heal's epoch (JoinHeal)
  BoundaryNews boundary;  // a step report's effect on T
};

// A new actor of the heal says it is set up (StepReport.heal_ready). Once every one is, T is picked.
HealNews ApplyHealReady(JobRun& run, const std::string& actor_id);

// A step report of an actor of the run (no error), while a heal's T is picked: binds it, or picks T again; then
// JoinHeal when T is confirmed and every report of T is in.
HealNews ApplyHealStep(JobRun& run, const StepReport& report, int64_t now_ms);

// Moves the run to the heal's membership when T is confirmed and every actor of the run reported T (run.last_step):
// the new actors join run.actors, and the regroup of the next epoch forms (not confirmed, none ready) with the
// joining replicas and `peers` (every actor, with the new ones' addresses). True when it moved.
bool JoinHeal(JobRun& run, int64_t now_ms);

// The heal's part of every reply to the run's reports: T and whether it is confirmed (nothing before T is picked).
void FillHealReply(const JobRun& run, ReportStepReply* reply);

// Whether `actor_id` is one of the heal's new actors.
bool InHeal(const JobRun& run, const std::string& actor_id);

}  // namespace geotrain::head
