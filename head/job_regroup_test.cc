// Live regroups of a run (head/job_regroup.h) on a DP3 x PP2 run, report by report: which replicas a fault leaves
// whole, the membership it moves to, its confirmation once every actor left waits at one completed step, a
// divergence, the first wait that no known fault explains, and when a regroup makes no progress.
#include "head/job_regroup.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "head/step_aggregator.h"

namespace geotrain::head {
namespace {

// Replica r's stage s is actor "r<r>s<s>" on worker "w-<r>" (one worker per replica), all alive on CPUs.
JobRun RunOf(int dp) {
  JobRun run;
  run.spec.mutable_parallel()->set_dp(dp);
  run.spec.mutable_parallel()->set_pp(2);
  for (int r = 0; r < dp; ++r) {
    for (int s = 0; s < 2; ++s) {
      ActorPlacement p;
      p.actor.set_actor_id(absl::StrCat("r", r, "s", s));
      p.actor.set_worker_id(absl::StrCat("w-", r));
      p.actor.set_replica(r);
      p.actor.set_stage(s);
      run.actors.push_back(p);
    }
  }
  run.phase = RunPhase::kFault;
  return run;
}

WorkersById Workers(int n, int dead = -1) {
  WorkersById out;
  for (int i = 0; i < n; ++i) {
    WorkerInfo& w = out[absl::StrCat("w-", i)];
    w.set_worker_id(absl::StrCat("w-", i));
    w.set_state(i == dead ? WORKER_DEAD : WORKER_ALIVE);
    w.add_devices()->set_kind(DEVICE_KIND_CPU);
  }
  return out;
}

StepReport Waiting(const std::string& actor, int64_t epoch, int64_t completed) {
  StepReport r;
  r.set_actor_id(actor);
  r.set_regroup_waiting(true);
  r.set_epoch(epoch);
  r.set_completed_step(completed);
  r.set_regroup_cause("sending to a peer: connection refused");
  return r;
}

TEST(JobRegroupTest, AWorkersDeathKeepsTheOtherReplicasWhichConfirmAtOneStep) {
  JobRun run = RunOf(3);
  std::string why;
  ASSERT_TRUE(RegroupEligible(run, Workers(3), &why)) << why;
  const std::vector<int> kept = RegroupKept(run, Workers(3, /*dead=*/1), {});
  EXPECT_EQ(kept, (std::vector<int>{0, 2}));
  ASSERT_TRUE(RegroupMakesProgress(run, kept));
  run.progress.last_complete_ms = 900;
  const std::vector<ActorPlacement> leaving = BeginRegroup(run, kept, "worker w-1 died", 1000).leaving;
  ASSERT_EQ(leaving.size(), 2u);
  EXPECT_EQ(leaving[0].actor.actor_id(), "r1s0");
  EXPECT_EQ(run.actors.size(), 4u);
  EXPECT_FALSE(InRun(run, "r1s1"));
  EXPECT_EQ(run.phase, RunPhase::kRunning);
  EXPECT_EQ(run.regroup.epoch, 1);
  EXPECT_EQ(run.regroup.paused_from_ms, 900);  // the pause runs from the last complete step
  ReportStepReply reply;
  FillRegroupReply(run, &reply);
  EXPECT_EQ(reply.regroup().epoch(), 1);
  EXPECT_EQ(std::vector<int>(reply.regroup().replicas().begin(), reply.regroup().replicas().end()), kept);
  EXPECT_FALSE(reply.regroup().confirmed());
  // Reports still in the old membership do not count; each actor left, rebuilt, at step 7.
  EXPECT_FALSE(ApplyRegroupReport(run, Waiting("r0s0", 0, 7), 1100).confirmed);
  for (const char* actor : {"r0s0", "r0s1", "r2s0"}) {
    const RegroupNews news = ApplyRegroupReport(run, Waiting(actor, 1, 7), 1200);
    EXPECT_FALSE(news.confirmed || news.diverged) << actor;
  }
  const RegroupNews news = ApplyRegroupReport(run, Waiting("r2s1", 1, 7), 1300);
  EXPECT_TRUE(news.confirmed);
  EXPECT_EQ(news.step, 7);
  FillRegroupReply(run, &reply);
  EXPECT_TRUE(reply.regroup().confirmed());
  EXPECT_EQ(reply.regroup().resume_step(), 8);
  // The same replicas again only after a step completed since; dropping another one is progress.
  run.phase = RunPhase::kFault;
  run.last_step = 7;
  EXPECT_FALSE(RegroupMakesProgress(run, {0, 2}));
  EXPECT_TRUE(RegroupMakesProgress(run, {0}));
  run.last_step = 8;
  EXPECT_TRUE(RegroupMakesProgress(run, {0, 2}));
}

// A probe sent before its actor saw the confirmation is no new failure; one from an actor that completed the resumed
// step and failed again is.
TEST(JobRegroupTest, AProbeAfterTheConfirmationIsNoNewFailure) {
  JobRun run = RunOf(2);
  BeginRegroup(run, {0}, "worker w-1 died", 0);
  ApplyRegroupReport(run, Waiting("r0s0", 1, 5), 10);
  ASSERT_TRUE(ApplyRegroupReport(run, Waiting("r0s1", 1, 5), 20).confirmed);
  EXPECT_FALSE(ApplyRegroupReport(run, Waiting("r0s0", 1, 5), 30).first_wait);
  EXPECT_EQ(run.regroup.waiting_since_ms, 0);
  EXPECT_TRUE(ApplyRegroupReport(run, Waiting("r0s0", 1, 6), 40).first_wait);
  EXPECT_EQ(run.regroup.waiting_since_ms, 40);
}

// A drain of the worker of replica 1: replicas 0 and 2 train on (a leave by regroup); none when every replica has an
// actor there, or when the job cannot regroup.
TEST(JobRegroupTest, ADrainKeepsTheReplicasWithNoActorOnTheDrainingWorkers) {
  JobRun run = RunOf(3);
  run.drain.workers = {"w-1"};
  EXPECT_EQ(DrainKeeps(run, Workers(3)), (std::vector<int>{0, 2}));
  run.drain.workers = {"w-0", "w-1", "w-2"};
  EXPECT_TRUE(DrainKeeps(run, Workers(3)).empty());
  JobRun off = RunOf(3);
  off.drain.workers = {"w-1"};
  off.spec.mutable_fault_tolerance()->set_regroup(false);
  EXPECT_TRUE(DrainKeeps(off, Workers(3)).empty());
  JobRun other = RunOf(3);
  other.drain.workers = {"w-9"};  // holds none of the run's actors
  EXPECT_TRUE(DrainKeeps(other, Workers(3)).empty());
}

// A leave by regroup can be confirmed by the last leaving actor's report while another leaving actor's report of an
// earlier step is still on its way: that step is complete once the leaving actors no longer count, and BeginRegroup
// hands it back to be recorded (it would be missing from the job's steps otherwise; the actor's late report is not
// the run's any more).
TEST(JobRegroupTest, AStepOnlyALeavingActorHadNotReportedCompletesWhenTheRegroupBegins) {
  JobRun run = RunOf(2);
  run.phase = RunPhase::kRunning;
  auto report = [&](const std::string& actor, int64_t step) {
    StepReport r;
    r.set_actor_id(actor);
    r.set_step(step);
    r.mutable_figures()->set_step(step);
    r.mutable_figures()->set_tokens(100);
    return StepAggregator::Add(run, r);
  };
  for (const char* actor : {"r0s0", "r0s1", "r1s1"}) EXPECT_FALSE(report(actor, 9).has_value());
  EXPECT_FALSE(report("r0s0", 10).has_value());
  RegroupBegun begun = BeginRegroup(run, {0}, "worker w-1 drains (a leave)", 1000);
  EXPECT_EQ(begun.leaving.size(), 2u);
  ASSERT_EQ(begun.completed.size(), 1u) << "step 9: every actor that stays reported it";
  EXPECT_EQ(begun.completed[0].figures.step(), 9);
  EXPECT_EQ(run.last_step, 9);
  EXPECT_TRUE(run.steps.count(10)) << "step 10 waits for r0s1";
  EXPECT_TRUE(report("r0s1", 10).has_value());
}

TEST(JobRegroupTest, ActorsThatCompletedDifferentStepsDiverge) {
  JobRun run = RunOf(2);
  BeginRegroup(run, RegroupKept(run, Workers(2), {"r1s1"}), "actor r1s1 failed", 0);
  EXPECT_EQ(run.regroup.replicas, (std::vector<int>{0}));
  ApplyRegroupReport(run, Waiting("r0s0", 1, 5), 10);
  const RegroupNews news = ApplyRegroupReport(run, Waiting("r0s1", 1, 4), 20);
  EXPECT_FALSE(news.confirmed);
  EXPECT_TRUE(news.diverged);
  EXPECT_EQ(news.steps, "r0s0 at 5, r0s1 at 4");
}

TEST(JobRegroupTest, AWaitWithNoFaultKnownIsNotedOnceAndNamesTheActor) {
  JobRun run = RunOf(2);
  run.phase = RunPhase::kRunning;
  RegroupNews news = ApplyRegroupReport(run, Waiting("r0s1", 0, 3), 500);
  EXPECT_TRUE(news.first_wait);
  EXPECT_EQ(run.regroup.waiting_since_ms, 500);
  EXPECT_EQ(run.regroup.waiting_cause, "actor r0s1: sending to a peer: connection refused");
  news = ApplyRegroupReport(run, Waiting("r0s0", 0, 3), 700);
  EXPECT_FALSE(news.first_wait);
  EXPECT_EQ(run.regroup.waiting_since_ms, 500);
}

TEST(JobRegroupTest, NoReplicaWholeOrAJobThatCannotRegroup) {
  JobRun run = RunOf(2);
  EXPECT_TRUE(RegroupKept(run, Workers(2), {"r0s0", "r1s1"}).empty());
  std::string why;
  JobRun single = RunOf(1);
  EXPECT_FALSE(RegroupEligible(single, Workers(1), &why));
  JobRun off = RunOf(2);
  off.spec.mutable_fault_tolerance()->set_regroup(false);
  EXPECT_FALSE(RegroupEligible(off, Workers(2), &why));
  EXPECT_EQ(why, "fault_tolerance.regroup is false");
  JobRun diloco = RunOf(2);
  diloco.spec.mutable_diloco()->set_inner_steps(4);
  EXPECT_FALSE(RegroupEligible(diloco, Workers(2), &why));
  WorkersById gpus = Workers(2);
  gpus["w-1"].mutable_devices(0)->set_kind(DEVICE_KIND_CUDA);
  EXPECT_FALSE(RegroupEligible(RunOf(2), gpus, &why));
  EXPECT_NE(why.find("NCCL"), std::string::npos);
}

// The stall probe: after a run's first complete step, a stall longer than max(1 s, 1.5 median step intervals) has its
// workers probed, at most once a second; one long step (a pause) does not move the bound.
TEST(JobRegroupTest, AStalledRunIsProbedAfterOneAndAHalfMedianStepIntervalsAtMostOnceASecond) {
  RunProgress progress;
  EXPECT_FALSE(StallProbeDue(progress, 100000)) << "no step yet: the run may still be loading";
  for (int64_t t = 9000; t <= 10000; t += 200) NoteCompleteStep(progress, t);
  EXPECT_FALSE(StallProbeDue(progress, 10999));
  EXPECT_TRUE(StallProbeDue(progress, 11000)) << "the 1 s floor";
  EXPECT_FALSE(StallProbeDue(progress, 11500)) << "probed within the last second";
  EXPECT_TRUE(StallProbeDue(progress, 12000));
  RunProgress slow;
  for (int64_t t = 0; t <= 8000; t += 2000) NoteCompleteStep(slow, t);
  NoteCompleteStep(slow, 20000);  // one long step (a regroup's pause)
  EXPECT_FALSE(StallProbeDue(slow, 22999));
  EXPECT_TRUE(StallProbeDue(slow, 23000)) << "1.5 median step intervals of 2 s";
}

}  // namespace
}  // namespace geotrain::head
