// Job table: state machine, persistence across a reopen of the store, event log.
#include "head/job_manager.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "common/rpc.h"

namespace geotrain::head {
namespace {

using ::testing::HasSubstr;

class JobManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / ("geotrain_jobs_" + GenerateToken())).string();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
  FakeClock clock_;
};

// A watcher of one job is not woken by another job's events (it would poll the store in a busy loop): it returns
// with this job's next event.
TEST_F(JobManagerTest, AnotherJobsEventsDoNotWakeAWatcher) {
  auto store = HeadStore::Open(dir_);
  ASSERT_TRUE(store.ok()) << store.status();
  JobManager jobs(&clock_, store->get());
  ASSERT_TRUE(jobs.Restore().ok());
  JobSpec spec;
  const std::string a = jobs.Submit(spec, "")->job_id(), b = jobs.Submit(spec, "")->job_id();
  ASSERT_TRUE(jobs.Log(a, "a's first").ok());
  bool ended = false;
  const int64_t seen = jobs.WaitEvents(a, 0, 0, &ended)->back().seq();
  absl::StatusOr<std::vector<JobEvent>> woken;
  std::thread watcher([&] {
    bool watcher_ended = false;
    woken = jobs.WaitEvents(a, seen, 10000, &watcher_ended);
  });
  ASSERT_TRUE(jobs.Log(b, "b's").ok());
  absl::SleepFor(absl::Milliseconds(200));  // a watcher woken by b's event returns now, with nothing of a's
  ASSERT_TRUE(jobs.Log(a, "a's second").ok());
  watcher.join();
  ASSERT_TRUE(woken.ok()) << woken.status();
  ASSERT_EQ(woken->size(), 1u);
  EXPECT_EQ(woken->front().line(), "a's second");
}

TEST_F(JobManagerTest, StateMachine) {
  auto store = HeadStore::Open(dir_);
  ASSERT_TRUE(store.ok()) << store.status();
  JobManager jobs(&clock_, store->get());
  ASSERT_TRUE(jobs.Restore().ok());
  JobSpec spec;
  spec.set_name("first");
  auto job = jobs.Submit(spec, "a.yaml");
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->job_id(), "job-000001");
  EXPECT_EQ(job->state(), JOB_PENDING);
  EXPECT_EQ(job->spec().train().lr(), 6e-4);  // defaults applied

  EXPECT_EQ(jobs.Transition(job->job_id(), JOB_SUCCEEDED, "").status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(jobs.Transition(job->job_id(), JOB_RUNNING, "").ok());
  ASSERT_TRUE(jobs.Transition(job->job_id(), JOB_SUCCEEDED, "done").ok());
  auto again = jobs.Cancel(job->job_id());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(), HasSubstr("SUCCEEDED"));
  EXPECT_EQ(jobs.Get("job-999").status().code(), absl::StatusCode::kNotFound);
}

// The runner notes why a pending job waits; a job cancelled between the runner's look at it and the note keeps its
// message, and its event stream ends with its last state (a watch that stopped there missed nothing).
TEST_F(JobManagerTest, AWaitingNoteDoesNotFollowACancel) {
  auto store = HeadStore::Open(dir_);
  ASSERT_TRUE(store.ok()) << store.status();
  JobManager jobs(&clock_, store->get());
  auto job = jobs.Submit(JobSpec(), "a.yaml");
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(jobs.NoteWaiting(job->job_id(), "waiting for devices: none free").ok());
  ASSERT_TRUE(jobs.NoteWaiting(job->job_id(), "waiting for devices: none free").ok());  // unchanged: no second line
  EXPECT_EQ(jobs.Get(job->job_id())->message(), "waiting for devices: none free");
  ASSERT_TRUE(jobs.Cancel(job->job_id()).ok());
  ASSERT_TRUE(jobs.NoteWaiting(job->job_id(), "waiting for devices: still none").ok());
  EXPECT_EQ(jobs.Get(job->job_id())->message(), "cancelled by the user");
  bool ended = false;
  absl::StatusOr<std::vector<JobEvent>> events = jobs.WaitEvents(job->job_id(), 0, 0, &ended);
  ASSERT_TRUE(events.ok()) << events.status();
  EXPECT_TRUE(ended);
  ASSERT_EQ(events->size(), 3u);  // submitted, the one note, cancelled
  EXPECT_EQ((*events)[1].kind(), "log");
  EXPECT_EQ((*events)[1].line(), "waiting for devices: none free");
  EXPECT_EQ(events->back().kind(), "state");
  EXPECT_THAT(events->back().line(), HasSubstr("CANCELLED"));
  EXPECT_EQ(jobs.NoteWaiting("job-999", "x").code(), absl::StatusCode::kNotFound);
}

TEST_F(JobManagerTest, BadSpecIsRefusedWithTheSource) {
  auto store = HeadStore::Open(dir_);
  JobManager jobs(&clock_, store->get());
  JobSpec spec;
  spec.mutable_train()->set_steps(-3);
  auto job = jobs.Submit(spec, "bad.yaml");
  EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(job.status().message(), HasSubstr("bad.yaml"));
  EXPECT_THAT(job.status().message(), HasSubstr("train.steps"));
  EXPECT_TRUE(jobs.List().empty());
}

TEST_F(JobManagerTest, JobsAndEventsSurviveAReopen) {
  std::string id;
  {
    auto store = HeadStore::Open(dir_);
    JobManager jobs(&clock_, store->get());
    ASSERT_TRUE(jobs.Restore().ok());
    JobSpec spec;
    spec.set_name("kept");
    id = jobs.Submit(spec, "")->job_id();
    ASSERT_TRUE(jobs.Log(id, "hello").ok());
    ASSERT_TRUE(jobs.Cancel(id).ok());
  }
  auto store = HeadStore::Open(dir_);
  JobManager jobs(&clock_, store->get());
  ASSERT_TRUE(jobs.Restore().ok());
  auto job = jobs.Get(id);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->name(), "kept");
  EXPECT_EQ(job->state(), JOB_CANCELLED);
  bool ended = false;
  auto events = jobs.WaitEvents(id, 0, 10, &ended);
  ASSERT_TRUE(events.ok());
  ASSERT_EQ(events->size(), 3u);
  EXPECT_EQ((*events)[1].line(), "hello");
  EXPECT_EQ((*events)[2].state(), JOB_CANCELLED);
  EXPECT_TRUE(ended);
  // New jobs continue the numbering.
  JobSpec spec;
  EXPECT_EQ(jobs.Submit(spec, "")->job_id(), "job-000002");
}

// A step event carries the step's figures, which also become the job's progress.
TEST_F(JobManagerTest, StepEventsCarryTheirFigures) {
  auto store = HeadStore::Open(dir_);
  JobManager jobs(&clock_, store->get());
  ASSERT_TRUE(jobs.Restore().ok());
  JobSpec spec;
  const std::string id = jobs.Submit(spec, "")->job_id();
  StepFigures figures;
  figures.set_step(3);
  figures.set_loss(5.25);
  figures.set_tokens_per_second(1200);
  figures.set_step_seconds(0.5);
  figures.set_wan_bytes(4096);
  (*figures.mutable_wan_bytes_by_pair())["site-a>site-b"] = 4096;
  ASSERT_TRUE(jobs.UpdateProgress(id, figures, "step 3").ok());
  auto job = jobs.Get(id);
  EXPECT_EQ(job->step(), 3);
  EXPECT_EQ(job->loss(), 5.25);
  EXPECT_EQ(job->tokens_per_second(), 1200);
  EXPECT_EQ(job->measured_step_seconds(), 0.5);
  bool ended = false;
  auto events = jobs.WaitEvents(id, 0, 10, &ended);
  ASSERT_TRUE(events.ok());
  const JobEvent& step = events->back();
  EXPECT_EQ(step.kind(), "step");
  EXPECT_EQ(step.line(), "step 3");
  EXPECT_EQ(step.step().SerializeAsString(), figures.SerializeAsString());
  EXPECT_FALSE(events->front().has_step());
}

// A full disk: SQLite refuses to grow the database (max_page_count stands for the disk). A state change
// that cannot be written fails with the cause and the fix, changes nothing in memory or on disk (the state
// and its event go together), new jobs are refused, and all works again once the store takes writes.
TEST_F(JobManagerTest, AFullDiskChangesNothingAndSaysWhy) {
  auto store = HeadStore::Open(dir_);
  ASSERT_TRUE(store.ok()) << store.status();
  JobManager jobs(&clock_, store->get());
  ASSERT_TRUE(jobs.Restore().ok());
  JobSpec spec;
  spec.set_name("busy");
  const std::string id = jobs.Submit(spec, "")->job_id();
  ASSERT_TRUE(jobs.Transition(id, JOB_RUNNING, "").ok());
  // Fill the database up to its cap: no page can be added, and the free space in its pages is used up.
  ASSERT_TRUE((*store)->LimitSizeForTesting(1).ok());
  // Large lines first, then small ones, so that even a small record no longer fits.
  const std::string line(4 << 10, 'x');
  for (const size_t size : {size_t{4} << 10, size_t{512}, size_t{64}}) {
    int logged = 0;
    while (logged < 1000 && jobs.Log(id, std::string(size, 'x')).ok()) ++logged;
    ASSERT_LT(logged, 1000);
  }
  bool ended = false;
  const size_t events_before = jobs.WaitEvents(id, 0, 0, &ended)->size();
  auto done = jobs.Transition(id, JOB_SUCCEEDED, line);
  ASSERT_FALSE(done.ok());
  EXPECT_EQ(done.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(done.status().message(), HasSubstr("cannot write its state"));
  EXPECT_THAT(done.status().message(), HasSubstr("full"));
  EXPECT_FALSE(jobs.store_error().ok());
  EXPECT_EQ(jobs.Get(id)->state(), JOB_RUNNING);  // never reported in a state it is not in
  EXPECT_EQ(jobs.WaitEvents(id, 0, 0, &ended)->size(), events_before);
  auto refused = jobs.Submit(spec, "");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);

  // Space again: the same change goes through, with its event.
  ASSERT_TRUE((*store)->LimitSizeForTesting(1 << 20).ok());
  ASSERT_TRUE(jobs.Transition(id, JOB_SUCCEEDED, "done").ok());
  EXPECT_TRUE(jobs.store_error().ok());
  EXPECT_EQ(jobs.WaitEvents(id, 0, 0, &ended)->size(), events_before + 1);

  // What was written survives a reopen: the state and its event agree.
  store->reset();
  auto reopened = HeadStore::Open(dir_);
  JobManager again(&clock_, reopened->get());
  ASSERT_TRUE(again.Restore().ok());
  EXPECT_EQ(again.Get(id)->state(), JOB_SUCCEEDED);
  auto events = again.WaitEvents(id, 0, 0, &ended);
  EXPECT_EQ(events->back().state(), JOB_SUCCEEDED);
  EXPECT_EQ(events->size(), events_before + 1);
}

}  // namespace
}  // namespace geotrain::head
