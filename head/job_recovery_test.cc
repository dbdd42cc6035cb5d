// The recovery policy across a head restart: a job that was restarting for a leave (a drain) when the head stopped is
// taken over as a leave, not a fault: no fault record, its cost measured from the drain's start, and the persisted
// leave cleared once the job trains again.
#include "head/job_recovery.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "common/rpc.h"

namespace geotrain::head {
namespace {

class NoControl : public RunControl {
 public:
  void EndJob(const std::string&, JobState, const std::string&) override {}
  absl::Status PlaceAndLaunch(const JobInfo&, int64_t, const std::string&) override {
    return absl::UnavailableError("no workers in this test");
  }
};

TEST(JobRecoveryTest, ARestartForALeaveStaysALeaveAcrossAHeadRestart) {
  const std::string dir = (std::filesystem::temp_directory_path() / ("geotrain_recovery_" + GenerateToken())).string();
  FakeClock clock;
  clock.AdvanceMillis(1'700'000'000'000);
  {
    auto store = HeadStore::Open(dir);
    ASSERT_TRUE(store.ok()) << store.status();
    JobManager jobs(&clock, store->get());
    JobSpec spec;
    spec.mutable_train()->set_steps(10);
    auto job = jobs.Submit(spec, "a.yaml");
    ASSERT_TRUE(job.ok()) << job.status();
    const std::string id = job->job_id();
    ASSERT_TRUE(jobs.Transition(id, JOB_RUNNING, "").ok());
    ASSERT_TRUE(jobs.Transition(id, JOB_RESTARTING, "worker w-3 drains").ok());
    // What HandleLeave persisted before the head stopped: the drain began 5 s before the restarted head looks.
    ASSERT_TRUE(jobs.Update(id,
                            [&](JobInfo& j) {
                              j.set_step(4);
                              j.set_leaves(1);
                              j.set_leaving_workers("w-3");
                              j.set_leave_started_unix_ms(clock.UnixMillis() - 5000);
                            })
                    .ok());

    WorkerRegistry registry(&clock, {}, "head-1");
    JobRuns runs;
    ActorLauncher launcher(&registry, {});
    MetricsServer metrics;
    StepAggregator aggregator(&jobs, &registry, &metrics, &clock, 1000);
    NoControl control;
    JobRecovery recovery(&jobs, &registry, &runs, &launcher, &aggregator, &control, &clock);
    recovery.Restore();
    std::optional<JobRecovery::Recovery> ended;
    {
      absl::MutexLock lock(&runs.mu);
      JobRun& run = runs.by_job[id];
      EXPECT_EQ(run.phase, RunPhase::kRecovering);
      EXPECT_TRUE(run.leaving);
      EXPECT_EQ(run.leaving_workers, "w-3");
      run.resumed_step = 4;  // as the relaunch (JobRunner::PlaceAndLaunch) sets them
      run.recovery_measured = false;
      clock.AdvanceMillis(2000);  // the restarted run's first step, 2 s later
      ended = recovery.MeasureRecovery(run, 5);
    }
    ASSERT_TRUE(ended.has_value());
    EXPECT_TRUE(ended->leave);
    EXPECT_EQ(ended->workers, "w-3");
    EXPECT_DOUBLE_EQ(ended->seconds, 7.0);  // from the drain's start, not from the head's restart
    EXPECT_EQ(ended->steps_lost, 0);
    recovery.RecordRecovery(id, *ended);
    auto after = jobs.Get(id);
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(after->faults_size(), 0);  // a leave is no fault
    EXPECT_EQ(after->leaves(), 1);
    EXPECT_TRUE(after->leaving_workers().empty());
    EXPECT_EQ(after->leave_started_unix_ms(), 0);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace geotrain::head
