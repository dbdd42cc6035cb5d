// Heals of a degraded run (head/job_heal.h) on a DP3 x PP2 run that lost replica 1, report by report: when a heal may
// start, where its actors go and what they are called, the step boundary picked once they are set up, the membership
// it moves to only once every report of that step is in, and a heal given up by a regroup.
#include "head/job_heal.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "head/job_regroup.h"
#include "head/step_aggregator.h"

namespace geotrain::head {
namespace {

constexpr int kSteps = 40;

// Replica r's stage s is actor "r<r>s<s>" on worker "w-<r>"; replica 1 left a regroup confirmed at step 7, and step 9
// is complete since.
JobRun DegradedRun() {
  JobRun run;
  run.spec.mutable_model()->set_preset("gpt2-tiny-test");
  run.spec.mutable_train()->set_steps(kSteps);
  run.spec.mutable_train()->set_global_batch(12);
  run.spec.mutable_train()->set_seq_len(16);
  ParallelSpec* p = run.spec.mutable_parallel();
  p->set_plan("manual");
  p->set_dp(3);
  p->set_pp(2);
  p->set_tp(1);
  p->set_microbatches(2);
  for (int r = 0; r < 3; ++r) {
    for (int s = 0; s < 2; ++s) {
      ActorPlacement a;
      a.actor.set_actor_id(absl::StrCat("r", r, "s", s));
      a.actor.set_worker_id(absl::StrCat("w-", r));
      a.actor.set_replica(r);
      a.actor.set_stage(s);
      run.actors.push_back(a);
    }
  }
  run.phase = RunPhase::kFault;
  BeginRegroup(run, {0, 2}, "worker w-1 died", 1000);
  run.regroup.confirmed = true;
  run.regroup.resume_step = 8;
  run.last_step = 9;
  return run;
}

// Workers w-0..w-<n-1> with one CPU device each, and a spare "w-spare" with two; w-1 dead.
std::vector<WorkerInfo> Workers(int n) {
  std::vector<WorkerInfo> out;
  for (int i = 0; i < n; ++i) {
    WorkerInfo& w = out.emplace_back();
    w.set_worker_id(absl::StrCat("w-", i));
    w.set_site("site-a");
    w.set_state(i == 1 ? WORKER_DEAD : WORKER_ALIVE);
    w.add_devices()->set_kind(DEVICE_KIND_CPU);
  }
  WorkerInfo& spare = out.emplace_back();
  spare.set_worker_id("w-spare");
  spare.set_site("site-b");
  spare.set_state(WORKER_ALIVE);
  for (int d = 0; d < 2; ++d) {
    Device* device = spare.add_devices();
    device->set_kind(DEVICE_KIND_CPU);
    device->set_index(d);
  }
  return out;
}

StepReport StepOf(const std::string& actor, int64_t step, int64_t knew) {
  StepReport r;
  r.set_actor_id(actor);
  r.set_step(step);
  r.set_heal_at_step(knew);
  return r;
}

// The run's actors report `step`, each knowing `knew` as the heal's step; the step completes.
void ReportAll(JobRun& run, int64_t step, int64_t knew) {
  for (const ActorPlacement& p : std::vector<ActorPlacement>(run.actors)) {
    const StepReport r = StepOf(p.actor.actor_id(), step, knew);
    StepAggregator::Add(run, r);
    ApplyHealStep(run, r, 5000);
  }
}

TEST(JobHealTest, ADegradedRunHealsItsMissingReplicaOntoFreeDevicesUnderNewIds) {
  JobRun run = DegradedRun();
  const WorkersById workers = ById(Workers(3));
  EXPECT_EQ(MissingReplicas(run, workers), (std::vector<int>{1}));
  JobInfo job;
  job.set_job_id("job-7");
  *job.mutable_spec() = run.spec;
  HeldDevices held;
  for (const ActorPlacement& p : run.actors) held[{p.actor.worker_id(), p.actor.device_index()}] = "job-7";
  absl::StatusOr<std::vector<ActorPlacement>> placed = PlaceHeal(job, {1}, Workers(3), held, /*attempt=*/2, 2);
  ASSERT_TRUE(placed.ok()) << placed.status();
  ASSERT_EQ(placed->size(), 2u);
  for (int s = 0; s < 2; ++s) {
    const ActorRecord& a = (*placed)[static_cast<size_t>(s)].actor;
    EXPECT_EQ(a.actor_id(), absl::StrCat("job-7-r1s", s, "t0-a2-h2"));
    EXPECT_EQ(a.replica(), 1);
    EXPECT_EQ(a.stage(), s);
    EXPECT_EQ(a.worker_id(), "w-spare");  // the only free devices: w-0 and w-2 hold the run's, w-1 is dead
  }
  // Two replicas missing and room for one: nothing is placed (all or none).
  EXPECT_FALSE(PlaceHeal(job, {1, 2}, Workers(3), held, 2, 2).ok());
}

TEST(JobHealTest, NoHealWhileTheRegroupFormsBeforeAStepOrWhenTheSpecSaysNo) {
  const WorkersById workers = ById(Workers(3));
  JobRun forming = DegradedRun();
  forming.regroup.confirmed = false;
  EXPECT_TRUE(MissingReplicas(forming, workers).empty());
  JobRun no_step = DegradedRun();
  no_step.last_step = 7;
  EXPECT_TRUE(MissingReplicas(no_step, workers).empty());
  JobRun off = DegradedRun();
  off.spec.mutable_fault_tolerance()->set_heal(false);
  EXPECT_TRUE(MissingReplicas(off, workers).empty());
  JobRun whole = DegradedRun();
  whole.regroup = RunRegroup{};
  EXPECT_TRUE(MissingReplicas(whole, workers).empty());
}

TEST(JobHealTest, TheReplicasJoinAtAConfirmedStepOnceEveryReportOfItIsIn) {
  JobRun run = DegradedRun();
  std::vector<ActorPlacement> joining(2);
  for (int s = 0; s < 2; ++s) {
    joining[s].actor.set_actor_id(absl::StrCat("h1s", s));
    joining[s].actor.set_replica(1);
    joining[s].actor.set_stage(s);
    joining[s].actor.set_worker_id("w-spare");
  }
  BeginHeal(run, {1}, joining, 2000);
  const Regroup m = HealMembership(run);
  EXPECT_EQ(m.epoch(), 2);
  EXPECT_EQ(std::vector<int>(m.replicas().begin(), m.replicas().end()), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(m.donor(), 0);
  EXPECT_EQ(HealedActors(run).size(), 6u);
  // Nothing is picked until every new actor is set up; then T = the newest step + the margin.
  EXPECT_FALSE(ApplyHealReady(run, "h1s0").picked);
  EXPECT_FALSE(ApplyHealReady(run, "someone-else").picked);
  const HealNews picked = ApplyHealReady(run, "h1s1");
  ASSERT_TRUE(picked.picked);
  EXPECT_EQ(run.heal.target, 9 + kDrainMargin);
  ReportStepReply reply;
  FillRunReply(run, &reply);
  EXPECT_EQ(reply.heal_at_step(), 11);
  EXPECT_FALSE(reply.heal_confirmed());
  // Step 10, every actor knowing T: confirmed, but no membership until step 11's reports are in.
  ReportAll(run, 10, 11);
  EXPECT_TRUE(run.heal.confirmed);
  EXPECT_FALSE(run.heal.joined);
  EXPECT_EQ(run.regroup.epoch, 1);
  // An actor that waits at T for the membership is no failure.
  StepReport waiting;
  waiting.set_actor_id("r0s0");
  waiting.set_regroup_waiting(true);
  waiting.set_epoch(1);
  waiting.set_completed_step(11);
  EXPECT_FALSE(ApplyRegroupReport(run, waiting, 5100).first_wait);
  ReportAll(run, 11, 11);
  ASSERT_TRUE(run.heal.joined);
  EXPECT_EQ(run.actors.size(), 6u);
  EXPECT_TRUE(InRun(run, "h1s0"));
  EXPECT_EQ(run.regroup.epoch, 2);
  EXPECT_FALSE(run.regroup.confirmed);
  EXPECT_EQ(run.regroup.joining, (std::vector<int>{1}));
  reply.Clear();
  FillRunReply(run, &reply);
  EXPECT_EQ(reply.regroup().epoch(), 2);
  EXPECT_EQ(std::vector<int>(reply.regroup().joining().begin(), reply.regroup().joining().end()),
            (std::vector<int>{1}));
  // Every actor, the new ones included, ready at 11: confirmed, to train 12.
  RegroupNews news;
  for (const ActorPlacement& p : run.actors) {
    StepReport ready = waiting;
    ready.set_actor_id(p.actor.actor_id());
    ready.set_epoch(2);
    news = ApplyRegroupReport(run, ready, 6000);
  }
  EXPECT_TRUE(news.confirmed);
  EXPECT_EQ(news.step, 11);
  EXPECT_EQ(run.regroup.resume_step, 12);
}

TEST(JobHealTest, AnActorThatPassedTheStepUnawareMovesItAndARegroupGivesTheHealUp) {
  JobRun run = DegradedRun();
  std::vector<ActorPlacement> joining(2);
  for (int s = 0; s < 2; ++s) joining[s].actor.set_actor_id(absl::StrCat("h1s", s));
  BeginHeal(run, {1}, joining, 2000);
  ApplyHealReady(run, "h1s0");
  ApplyHealReady(run, "h1s1");
  ASSERT_EQ(run.heal.target, 11);
  StepAggregator::Add(run, StepOf("r0s0", 11, 0));
  const HealNews moved = ApplyHealStep(run, StepOf("r0s0", 11, 0), 3000);
  EXPECT_TRUE(moved.boundary.repicked);
  EXPECT_EQ(run.heal.target, 11 + kDrainMargin + 1);  // after the newest step reported, one more step of margin
  // A fault before the membership moved: the heal's new actors leave with the lost replica's.
  const RegroupBegun begun = BeginRegroup(run, {0}, "worker w-2 died", 4000);
  EXPECT_EQ(begun.leaving.size(), 4u);  // r2s0, r2s1, h1s0, h1s1
  EXPECT_TRUE(run.heal.replicas.empty());
}

TEST(JobHealTest, AHealGivenUpUsesUpItsEpochAndTheActorsListGoesWithAFormingMembershipOnly) {
  JobRun run = DegradedRun();
  ASSERT_EQ(run.regroup.epoch, 1);
  BeginHeal(run, {1}, std::vector<ActorPlacement>(2), 2000);
  EXPECT_EQ(run.heal.epoch, 2);
  run.heal = RunHeal{};  // given up before it joined
  // The next heal, and any membership after it, take a later epoch: the given-up actors' workers refuse epoch 2.
  BeginHeal(run, {1}, std::vector<ActorPlacement>(2), 3000);
  EXPECT_EQ(run.heal.epoch, 3);
  BeginRegroup(run, {0, 2}, "a heal given up: its worker died", 4000);
  EXPECT_EQ(run.regroup.epoch, 4);
  run.regroup.peers.resize(6);
  ReportStepReply forming;
  FillRunReply(run, &forming);
  EXPECT_EQ(forming.regroup().peers_size(), 6);
  run.regroup.confirmed = true;
  ReportStepReply confirmed;
  FillRunReply(run, &confirmed);
  EXPECT_EQ(confirmed.regroup().peers_size(), 0);
}

}  // namespace
}  // namespace geotrain::head
