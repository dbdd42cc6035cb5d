// The job runner's step aggregator and the job's metrics: adds up the actors' step reports of a run (the slowest
// actor's times, the loss carriers' mean loss, the WAN bytes of every actor), and when every actor has reported a
// step, records it: the job's `step` event and progress (JobManager::UpdateProgress, what `job logs --follow`
// shows) and the job's series on /metrics. It owns the families whose series belong to one job (label job_id: loss,
// tokens/s, step times, bubble, restarts, leaves, steps lost...) and removes a job's series a while after it ended, time
// enough for Prometheus to scrape their last values.
//
//   {  // under JobRuns::mu, the run of the report
//     StepAggregator::ForgetStale(run, report.step());
//     if (report.step() > 0) complete = StepAggregator::Add(run, report);
//   }
//   if (complete) aggregator.RecordStep(job_id, *complete, spec.comm().wan_codec());
//
// Threads: Add and ForgetStale run on the reporting gRPC handler's thread under JobRuns::mu and touch only the run
// they are given (JobRun's aggregator section). The others run without JobRuns::mu: RecordStep and JobEnded on
// handler threads or the control thread, ForgetEndedJobSeries on the control thread, the counters on the control
// thread. Series are added (RecordStep) and removed (ForgetEndedJobSeries) under the aggregator's own mutex, so
// that a late report cannot bring back an ended job's series; the job table is called under it (lock order: this
// mutex, then JobManager's), never JobRuns::mu.
// Errors: none; a failed progress write is logged (the job goes on). With no metrics server, only the job table
// is written.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "head/job_manager.h"
#include "head/job_run.h"
#include "head/registry.h"

namespace geotrain::head {

class StepAggregator {
 public:
  // `jobs` and `registry` outlive the aggregator (`registry`, whose devices give the MFU's peak, may be null: no MFU
  // series); `metrics` may be null (no /metrics); `clock` times the ended jobs' series, which leave /metrics
  // `ended_job_series_ms` after their job ended.
  StepAggregator(JobManager* jobs, const WorkerRegistry* registry, MetricsServer* metrics, const Clock* clock,
                 int64_t ended_job_series_ms);
  StepAggregator(const StepAggregator&) = delete;
  StepAggregator& operator=(const StepAggregator&) = delete;

  // Adds one actor's report of step report.step() (> 0, no error) to the run's aggregate. When it is the last of
  // the run's actors to report that step, returns the step's aggregate, forgets it and moves run.last_step on. A
  // report of a step at or before run.last_step (recorded already) is ignored.
  static std::optional<StepAggregate> Add(JobRun& run, const StepReport& report);
  // After actors left the run (a live regroup, which took their ids out of the aggregates): the steps every actor
  // left has reported, complete now (in order), as Add returns them. Their figures keep what the leaving ones
  // reported.
  static std::vector<StepAggregate> CompleteAfterLeave(JobRun& run);
  // After Add completed `step`: the steps before it still waiting never get their missing reports. Every actor reports
  // its steps in order, so each finished them; a missing report was lost (taken by a head that stopped before the
  // step completed, or dropped from a full queue). Completes them now, in order, with the reports they have
  // (StepAggregate::lost_reports says how many are missing; their figures are partial).
  static std::vector<StepAggregate> CompleteEarlier(JobRun& run, int64_t step);
  // Forgets the steps more than 100 behind `step` (a step whose later steps never complete either).
  static void ForgetStale(JobRun& run, int64_t step);

  // Records a complete step (agg.figures.step()): the job's step event and progress, and its series. `wan_codec`
  // (the job's comm.wan_codec) labels the compression ratio.
  void RecordStep(const std::string& job_id, const StepAggregate& agg, const std::string& wan_codec);

  // The job's counters and the recovery histogram (no-ops without metrics).
  void CountRestart(const std::string& job_id);
  void CountLeave(const std::string& job_id);  // geotrain_job_leaves_total: a restart without a draining worker
  void CountStepsLost(const std::string& job_id, int64_t steps);
  // A live regroup (head/job_regroup.h): geotrain_job_regroups_total, and geotrain_job_replicas to `present`.
  void CountRegroup(const std::string& job_id, int present);
  void SetReplicas(const std::string& job_id, int present);  // geotrain_job_replicas
  // geotrain_job_healthy_pause_seconds: the gap between the healthy replicas' last step before a fault and their
  // first after the regroup.
  void SetHealthyPause(const std::string& job_id, double seconds);
  // A heal (head/job_heal.h): geotrain_job_heals_total and geotrain_job_replicas to `present`; and
  // geotrain_job_heal_seconds, its fault's detection to the healed replicas' first complete step.
  void CountHeal(const std::string& job_id, int present);
  void SetHealSeconds(const std::string& job_id, double seconds);
  void ObserveRecovery(double seconds);

  // The job ended now: its series are removed ended_job_series_ms from now.
  void JobEnded(const std::string& job_id);
  // Removes the series of the jobs that ended ended_job_series_ms ago or more (control thread).
  void ForgetEndedJobSeries();

 private:
  // Takes the run's aggregate of `step` as complete: its derived figures, forgotten, run.last_step moved on.
  static StepAggregate Complete(JobRun& run, int64_t step);
  JobManager* jobs_;
  const WorkerRegistry* registry_;  // may be null
  MetricsServer* metrics_;          // may be null
  const Clock* clock_;
  const int64_t ended_job_series_ms_;

  absl::Mutex series_mu_;
  std::map<std::string, int64_t> ended_at_ms_ ABSL_GUARDED_BY(series_mu_);  // clock_->NowMillis() at the end
  std::set<std::string> series_removed_ ABSL_GUARDED_BY(series_mu_);
  std::map<std::string, std::deque<double>> recent_step_seconds_ ABSL_GUARDED_BY(series_mu_);  // the last steps' times
};

}  // namespace geotrain::head
