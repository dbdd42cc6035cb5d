// The step aggregator: a step is recorded once every actor reported it, and its series (progress, ETA, median
// step, phases, tokens by site) carry the figures the reports add up to, until the job's series are forgotten.
#include "head/step_aggregator.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "common/rpc.h"

namespace geotrain::head {
namespace {

// The value of `family`'s series with exactly `labels`, or -1 when there is none.
double Gauge(MetricsServer& metrics, const std::string& family, const prometheus::Labels& labels) {
  for (const prometheus::MetricFamily& f : metrics.registry().Collect()) {
    if (f.name != family) continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      prometheus::Labels got;
      for (const auto& l : m.label) got[l.name] = l.value;
      if (got == labels) return m.gauge.value;
    }
  }
  return -1;
}

ActorPlacement Actor(const std::string& id, int replica, int stage, const std::string& site) {
  ActorPlacement a;
  a.actor.set_actor_id(id);
  a.actor.set_replica(replica);
  a.actor.set_stage(stage);
  a.site = site;
  return a;
}

StepReport Report(const std::string& actor, int64_t step, double seconds, double compute, double wait) {
  StepReport r;
  r.set_actor_id(actor);
  r.set_step(step);
  StepFigures& f = *r.mutable_figures();
  f.set_step_seconds(seconds);
  f.set_compute_seconds(compute);
  f.set_comm_wait_seconds(wait);
  f.set_tokens(1200);
  f.set_val_loss(-1);
  return r;
}

TEST(StepAggregatorTest, SeriesOfACompleteStepAndTheirRemoval) {
  const std::string dir = (std::filesystem::temp_directory_path() / ("geotrain_agg_" + GenerateToken())).string();
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
    ASSERT_TRUE(jobs.Transition(job->job_id(), JOB_RUNNING, "").ok());
    MetricsServer metrics;
    StepAggregator aggregator(&jobs, /*registry=*/nullptr, &metrics, &clock, /*ended_job_series_ms=*/1000);

    // Two replicas: replica 0 is two pipeline stages, one at each site; replica 1 is one actor at site b.
    JobRun run;
    run.actors = {Actor("a0", 0, 0, "a"), Actor("a1", 0, 1, "b"), Actor("b0", 1, 0, "b")};
    const double seconds[] = {2, 4, 3};  // step times of steps 1..3: the median is 3
    for (int64_t step = 1; step <= 3; ++step) {
      EXPECT_FALSE(StepAggregator::Add(run, Report("a0", step, seconds[step - 1], 1.0, 0.5)));
      EXPECT_FALSE(StepAggregator::Add(run, Report("a1", step, seconds[step - 1] - 1, 1.5, 0.25)));
      auto complete = StepAggregator::Add(run, Report("b0", step, 1, 0.5, 0.75));
      ASSERT_TRUE(complete) << "the third actor completes step " << step;
      EXPECT_DOUBLE_EQ(complete->site_tokens["a"], 300);  // replica 0's 600 tokens over its two actors
      EXPECT_DOUBLE_EQ(complete->site_tokens["b"], 900);  // the other 300 of replica 0, and replica 1's 600
      aggregator.RecordStep(job->job_id(), *complete, "none");
    }
    const prometheus::Labels labels = {{"job_id", job->job_id()}};
    EXPECT_DOUBLE_EQ(Gauge(metrics, "geotrain_job_progress_ratio", labels), 0.3);
    EXPECT_DOUBLE_EQ(Gauge(metrics, "geotrain_tokens_per_second", labels), 400);
    EXPECT_DOUBLE_EQ(Gauge(metrics, "geotrain_job_median_step_seconds", labels), 3);
    EXPECT_DOUBLE_EQ(Gauge(metrics, "geotrain_job_eta_seconds", labels), 7 * 3);
    EXPECT_DOUBLE_EQ(Gauge(metrics, "geotrain_job_last_step_timestamp_seconds", labels), clock.UnixMillis() / 1000.0);
    // The slowest actor's phases of the newest step (3 s: a0).
    EXPECT_DOUBLE_EQ(Gauge(metrics, "geotrain_step_phase_seconds", {{"job_id", job->job_id()}, {"phase", "compute"}}),
                     1.5);
    EXPECT_DOUBLE_EQ(Gauge(metrics, "geotrain_step_phase_seconds", {{"job_id", job->job_id()}, {"phase", "comm_wait"}}),
                     0.75);
    EXPECT_DOUBLE_EQ(Gauge(metrics, "geotrain_site_tokens_per_second", {{"job_id", job->job_id()}, {"site", "a"}}),
                     100);
    EXPECT_DOUBLE_EQ(Gauge(metrics, "geotrain_site_tokens_per_second", {{"job_id", job->job_id()}, {"site", "b"}}),
                     300);

    aggregator.JobEnded(job->job_id());
    // An ended job's liveness series go at once (no stalled-job alert for it); the others a while later.
    EXPECT_EQ(Gauge(metrics, "geotrain_job_last_step_timestamp_seconds", labels), -1);
    EXPECT_EQ(Gauge(metrics, "geotrain_job_median_step_seconds", labels), -1);
    EXPECT_DOUBLE_EQ(Gauge(metrics, "geotrain_job_progress_ratio", labels), 0.3);
    clock.AdvanceMillis(1000);
    aggregator.ForgetEndedJobSeries();
    EXPECT_EQ(Gauge(metrics, "geotrain_job_progress_ratio", labels), -1);
    EXPECT_EQ(Gauge(metrics, "geotrain_step_phase_seconds", {{"job_id", job->job_id()}, {"phase", "compute"}}), -1);
    EXPECT_EQ(Gauge(metrics, "geotrain_site_tokens_per_second", {{"job_id", job->job_id()}, {"site", "b"}}), -1);
  }
  std::filesystem::remove_all(dir);
}

// Time-paced DiLoCo: the faster group's replica trains three inner steps' tokens to the slower one's one; the site
// split follows the replicas' reported tokens, and the step keeps the largest wait, slowdown and inner steps.
TEST(StepAggregatorTest, SitesGetTheTokensTheirReplicasReport) {
  JobRun run;
  run.actors = {Actor("a0", 0, 0, "a"), Actor("b0", 1, 0, "b")};
  StepReport fast = Report("a0", 5, 1, 0.9, 0.1), slow = Report("b0", 5, 1, 0.3, 0.7);
  fast.mutable_figures()->set_tokens(1200);
  fast.mutable_figures()->set_replica_tokens(900);
  fast.mutable_figures()->set_inner_steps(3);
  fast.mutable_figures()->set_outer_sync_seconds(0.05);
  slow.mutable_figures()->set_tokens(1200);
  slow.mutable_figures()->set_replica_tokens(300);
  slow.mutable_figures()->set_inner_steps(1);
  slow.mutable_figures()->set_slowdown(3);
  slow.mutable_figures()->set_outer_sync_seconds(0.01);
  EXPECT_FALSE(StepAggregator::Add(run, fast));
  auto complete = StepAggregator::Add(run, slow);
  ASSERT_TRUE(complete);
  EXPECT_DOUBLE_EQ(complete->site_tokens["a"], 900);
  EXPECT_DOUBLE_EQ(complete->site_tokens["b"], 300);
  EXPECT_EQ(complete->figures.inner_steps(), 3);
  EXPECT_DOUBLE_EQ(complete->figures.slowdown(), 3);
  EXPECT_DOUBLE_EQ(complete->figures.outer_sync_seconds(), 0.05);
}

// A head that restarted lost the reports the previous one had taken of a step that it did not complete: once a later
// step completes (every actor reports its steps in order, so each finished the earlier ones), the earlier steps
// complete with the reports they have, in order, saying how many were lost.
TEST(StepAggregatorTest, StepsBeforeACompleteOneCompleteWithTheReportsTheyHave) {
  JobRun run;
  run.actors = {Actor("a0", 0, 0, "a"), Actor("a1", 1, 0, "a")};
  EXPECT_FALSE(StepAggregator::Add(run, Report("a1", 31, 1, 0.5, 0.5)));  // a0's report went to the head that stopped
  EXPECT_FALSE(StepAggregator::Add(run, Report("a0", 32, 1, 0.5, 0.5)));
  ASSERT_TRUE(StepAggregator::Add(run, Report("a1", 32, 1, 0.5, 0.5)));
  EXPECT_FALSE(StepAggregator::Add(run, Report("a0", 33, 1, 0.5, 0.5)));
  const std::vector<StepAggregate> earlier = StepAggregator::CompleteEarlier(run, 32);
  ASSERT_EQ(earlier.size(), 1u);
  EXPECT_EQ(earlier[0].figures.step(), 31);
  EXPECT_EQ(earlier[0].lost_reports, 1);
  EXPECT_EQ(run.last_step, 32);
  EXPECT_TRUE(run.steps.count(33)) << "a later step waits for its reports";
  EXPECT_TRUE(StepAggregator::CompleteEarlier(run, 32).empty());
  // a0's report of step 32 again (its reply was lost): recorded already, it starts no new aggregate.
  EXPECT_FALSE(StepAggregator::Add(run, Report("a0", 32, 1, 0.5, 0.5)));
  EXPECT_FALSE(run.steps.count(32));
}

}  // namespace
}  // namespace geotrain::head
