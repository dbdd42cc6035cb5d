// The drain's step boundary (head/job_drain.h) on a run of four actors, report by report: the target after the
// newest step reported, the bindings that confirm it, a later target when an actor passed it before it knew, the
// job that ends first, and when the run may restart without the draining worker.
#include "head/job_drain.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace geotrain::head {
namespace {

constexpr int kActors = 4;

JobRun RunOf(int64_t steps) {
  JobRun run;
  run.spec.mutable_train()->set_steps(steps);
  for (int i = 0; i < kActors; ++i) {
    ActorPlacement p;
    p.actor.set_actor_id(absl::StrCat("a", i));
    p.actor.set_worker_id(i < 2 ? "w-1" : "w-2");
    run.actors.push_back(p);
  }
  return run;
}

// Actor `i`'s report of `step`, knowing the target `known` (0: none) when it finished it.
StepReport Report(int i, int64_t step, int64_t known) {
  StepReport r;
  r.set_actor_id(absl::StrCat("a", i));
  r.set_step(step);
  r.set_drain_at_step(known);
  return r;
}

TEST(JobDrainTest, TargetIsTheNewestStepReportedPlusTheMargin) {
  JobRun run = RunOf(100);
  run.last_step = 10;
  run.steps[12].reported.insert("a0");  // an actor is ahead: it reported step 12
  EXPECT_EQ(NewestReportedStep(run), 12);
  EXPECT_TRUE(BeginDrain(run, "w-2", "/ckpt", true, 5000));
  EXPECT_EQ(run.drain.target, 12 + kDrainMargin);
  EXPECT_FALSE(run.drain.ends_first);
  EXPECT_EQ(run.drain.started_ms, 5000);
  ReportStepReply reply;
  FillDrainReply(run, &reply);
  EXPECT_EQ(reply.drain_at_step(), 14);
  EXPECT_FALSE(reply.drain_confirmed());
  EXPECT_EQ(reply.drain_checkpoint_dir(), "/ckpt");
  // A second draining worker joins the same drain.
  EXPECT_FALSE(BeginDrain(run, "w-1", "/ckpt", true, 6000));
  EXPECT_EQ(run.drain.target, 14);
  EXPECT_EQ(DrainingWorkers(run.drain), "w-1, w-2");
  EXPECT_EQ(DrainSubject(run.drain), "workers w-1, w-2 drain");
}

TEST(JobDrainTest, EveryActorBoundConfirmsAndTheRunIsReadyOnceAllLeftAndTheCheckpointIsIn) {
  JobRun run = RunOf(100);
  run.last_step = 10;
  BeginDrain(run, "w-2", "/ckpt", true, 0);
  const int64_t t = run.drain.target;
  // Two actors learn T with step 11's reply, two with step 12's: all before T.
  EXPECT_FALSE(ApplyDrainReport(run, Report(0, 11, 0)).confirmed);
  for (int i = 0; i < 2; ++i) EXPECT_FALSE(ApplyDrainReport(run, Report(i, 12, t)).confirmed);
  EXPECT_FALSE(ApplyDrainReport(run, Report(2, 12, t)).confirmed);
  // The last one knew T only when it finished T itself: it stops there too.
  DrainNews news = ApplyDrainReport(run, Report(3, t, t));
  EXPECT_TRUE(news.confirmed);
  EXPECT_FALSE(news.repicked);
  ReportStepReply reply;
  FillDrainReply(run, &reply);
  EXPECT_TRUE(reply.drain_confirmed());
  // A probe changes nothing; the last reports (drained) come in, the checkpoint is committed.
  StepReport probe = Report(0, 0, t);
  probe.set_drain_waiting(true);
  ApplyDrainReport(run, probe);
  for (int i = 0; i < kActors; ++i) {
    EXPECT_FALSE(DrainReady(run));
    StepReport last = Report(i, 0, t);
    last.set_drained(true);
    ApplyDrainReport(run, last);
  }
  EXPECT_FALSE(DrainReady(run));  // the checkpoint of T is not committed yet
  run.drain.committed = true;
  EXPECT_TRUE(DrainReady(run));
  run.drain.handed_over = true;
  EXPECT_FALSE(DrainReady(run));
}

TEST(JobDrainTest, AnActorThatPassedTheTargetUnawareMovesItLaterAndBindingsStartOver) {
  JobRun run = RunOf(100);
  run.last_step = 10;
  BeginDrain(run, "w-2", "/ckpt", true, 0);
  const int64_t first = run.drain.target;  // 12
  ApplyDrainReport(run, Report(0, 11, first));
  ApplyDrainReport(run, Report(1, 11, first));
  // Actor 2 finished T without knowing it: the actors cannot all stop there any more.
  run.steps[first].reported.insert("a2");
  DrainNews news = ApplyDrainReport(run, Report(2, first, 0));
  EXPECT_TRUE(news.repicked);
  EXPECT_EQ(news.passed_actor, "a2");
  EXPECT_EQ(news.old_target, first);
  EXPECT_EQ(run.drain.target, first + kDrainMargin + 1);  // one step more margin each time
  EXPECT_TRUE(run.drain.bound.empty());
  // Reports under the old target bind nobody; under the new one they do.
  ApplyDrainReport(run, Report(0, 12, first));
  EXPECT_TRUE(run.drain.bound.empty());
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(ApplyDrainReport(run, Report(i, 13, run.drain.target)).confirmed);
  EXPECT_TRUE(ApplyDrainReport(run, Report(3, 14, run.drain.target)).confirmed);
  // Once confirmed, an actor past the target breaks the drain (the job restarts the usual way).
  EXPECT_TRUE(ApplyDrainReport(run, Report(3, run.drain.target + 1, 0)).broken);
}

TEST(JobDrainTest, AJobWhoseLastStepComesFirstEndsByItself) {
  JobRun run = RunOf(12);
  run.last_step = 10;
  BeginDrain(run, "w-2", "/ckpt", true, 0);
  EXPECT_TRUE(run.drain.ends_first);  // 10 + 2 is the last step: the job ends there anyway
  EXPECT_EQ(run.drain.target, 0);
  ReportStepReply reply;
  FillDrainReply(run, &reply);
  EXPECT_EQ(reply.drain_at_step(), 0);
  EXPECT_FALSE(ApplyDrainReport(run, Report(0, 11, 0)).repicked);
  EXPECT_FALSE(DrainReady(run));
}

TEST(JobDrainTest, ATimedComputeJobIsReadyWhenEveryActorLeft) {
  JobRun run = RunOf(100);
  BeginDrain(run, "w-1", "/ckpt", /*needs_checkpoint=*/true, 0);
  const int64_t t = run.drain.target;
  EXPECT_EQ(t, kDrainMargin);  // nothing reported yet: after the step the run resumed from (0)
  for (int i = 0; i < kActors; ++i) {
    StepReport r = Report(i, 1, t);
    r.mutable_figures()->set_timed_compute(true);  // no weights: no checkpoint to wait for
    ApplyDrainReport(run, r);
  }
  EXPECT_TRUE(run.drain.confirmed);
  for (int i = 0; i < kActors; ++i) {
    StepReport last = Report(i, 0, t);
    last.set_drained(true);
    ApplyDrainReport(run, last);
  }
  EXPECT_TRUE(DrainReady(run));
}

}  // namespace
}  // namespace geotrain::head
