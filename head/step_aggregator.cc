// The job runner's step aggregation and the job's metric families (see step_aggregator.h).
#include "head/step_aggregator.h"

#include <algorithm>
#include <deque>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "head/dashboard_figures.h"

namespace geotrain::head {
namespace {

// The families whose series belong to one job (label job_id): removed when it has ended (ForgetEndedJobSeries).
struct JobFamily {
  const char* name;
  const char* help;
};
constexpr JobFamily kRestarts{"geotrain_job_restarts_total", "Restarts of a job from its checkpoint after a fault"};
constexpr JobFamily kStepsLost{"geotrain_job_steps_lost_total", "Steps trained again after restarts, by job"};
constexpr JobFamily kLeaves{"geotrain_job_leaves_total",
                            "Restarts of a job without a worker that left on notice (a drain), by job"};
constexpr JobFamily kRegroups{"geotrain_job_regroups_total",
                              "Live regroups of a job: a fault left some replicas whole and they trained on without a "
                              "restart"};
constexpr JobFamily kHeals{"geotrain_job_heals_total",
                           "Heals of a job: replicas that left came back, their state streamed from a live peer"};
constexpr JobFamily kHealSeconds{"geotrain_job_heal_seconds",
                                 "The latest heal's cost: its fault's detection to the healed replicas' first "
                                 "complete step, by job"};
constexpr JobFamily kReplicas{"geotrain_job_replicas", "Data-parallel replicas of a job training now"};
constexpr JobFamily kHealthyPause{"geotrain_job_healthy_pause_seconds",
                                  "The longest gap between two complete steps of the replicas that stayed healthy "
                                  "around a fault (the latest regroup's), by job"};
constexpr JobFamily kPredictedStep{"geotrain_predicted_step_seconds", "The planner's predicted step time, by job"};
constexpr JobFamily kMeasuredStep{"geotrain_measured_step_seconds", "The latest measured step time, by job"};
constexpr JobFamily kStepDuration{"geotrain_step_duration_seconds", "Optimizer step time, by job"};
constexpr JobFamily kTokensPerSecond{"geotrain_tokens_per_second", "Training throughput, by job"};
constexpr JobFamily kTrainLoss{"geotrain_train_loss", "Training loss, by job"};
constexpr JobFamily kValLoss{"geotrain_val_loss", "Validation loss (mean over replicas), by job"};
constexpr JobFamily kBubble{"geotrain_pipeline_bubble_ratio", "Pipeline bubble share of step time, by job"};
constexpr JobFamily kTimedCompute{"geotrain_timed_compute",
                                  "1 when the job's step times are emulated (timed compute), by job"};
constexpr JobFamily kLossScale{"geotrain_loss_scale", "fp16's dynamic loss scale (1 in other precisions), by job"};
constexpr JobFamily kSkippedSteps{"geotrain_skipped_steps_total",
                                  "Steps skipped because fp16 gradients overflowed (inf or NaN), by job"};
constexpr JobFamily kProgress{"geotrain_job_progress_ratio", "Share of the job's steps done, by job"};
constexpr JobFamily kEta{"geotrain_job_eta_seconds",
                         "Time left at the median step time of the last steps (their steps left x median), by job"};
constexpr JobFamily kMedianStep{"geotrain_job_median_step_seconds",
                                "Median step time of the job's last steps (up to 101), by job"};
constexpr JobFamily kLastStep{"geotrain_job_last_step_timestamp_seconds",
                              "Unix time the job's newest step was recorded by the head, by job"};
constexpr JobFamily kStepPhase{"geotrain_step_phase_seconds",
                               "The newest step's time by phase (compute, comm_wait, bubble; the slowest actor's), "
                               "by job"};
constexpr JobFamily kSiteTokens{"geotrain_site_tokens_per_second",
                                "Tokens per second trained at each site (each replica's share over its actors), "
                                "by job and site"};
constexpr JobFamily kJobMfu{"geotrain_job_mfu_ratio",
                            "Model FLOP/s utilisation: achieved training FLOP/s over the peak of the job's devices "
                            "in its precision, by job"};
// The series that say a running job is alive, removed as soon as it ends (JobEnded).
constexpr JobFamily kLivenessGauges[] = {kLastStep, kMedianStep, kEta};
// Families with a label besides job_id: a job's series are found by listing them.
constexpr JobFamily kMultiLabelJobGauges[] = {kStepPhase, kSiteTokens};
constexpr JobFamily kJobGauges[] = {
    kPredictedStep, kMeasuredStep, kTokensPerSecond, kTrainLoss, kValLoss, kBubble,   kTimedCompute, kLossScale,
    kProgress,      kEta,          kMedianStep,      kLastStep,  kJobMfu,  kReplicas, kHealthyPause, kHealSeconds};
constexpr JobFamily kJobCounters[] = {kRestarts, kStepsLost, kSkippedSteps, kLeaves, kRegroups, kHeals};

// Step times the median and the ETA are taken over.
constexpr size_t kMedianWindow = 101;

double TokensPerSecond(const StepFigures& f) { return f.step_seconds() > 0 ? f.tokens() / f.step_seconds() : 0; }

std::map<std::string, double> SiteTokens(const std::vector<ActorPlacement>& actors, int64_t tokens,
                                         const std::map<int, int64_t>& replica_tokens) {
  std::map<int, int> actors_per_replica;
  for (const ActorPlacement& a : actors) ++actors_per_replica[a.actor.replica()];
  std::map<std::string, double> out;
  if (actors_per_replica.empty()) return out;
  const double even_share = static_cast<double>(tokens) / actors_per_replica.size();
  for (const ActorPlacement& a : actors) {
    const auto reported = replica_tokens.find(a.actor.replica());
    const double of_replica = reported != replica_tokens.end() ? static_cast<double>(reported->second) : even_share;
    out[a.site] += of_replica / actors_per_replica[a.actor.replica()];
  }
  return out;
}

// Removes every series of `family` whose job_id is `job_id`, whatever its other labels.
void RemoveJobSeries(prometheus::Family<prometheus::Gauge>& family, const std::string& job_id) {
  for (const prometheus::MetricFamily& collected : family.Collect()) {
    for (const prometheus::ClientMetric& metric : collected.metric) {
      prometheus::Labels labels;
      for (const prometheus::ClientMetric::Label& l : metric.label) labels[l.name] = l.value;
      if (labels["job_id"] == job_id) family.Remove(&family.Add(labels));
    }
  }
}

double Median(std::deque<double> values) {
  if (values.empty()) return 0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + mid, values.end());
  return values[mid];
}

// The step's line in the job's events.
std::string StepLine(const StepFigures& f, bool loss_known) {
  // After the phases: a checkpoint's time, DiLoCo's outer sync and time-paced inner steps, and a slowed device.
  std::string extra;
  if (f.checkpoint_seconds() > 0) absl::StrAppend(&extra, absl::StrFormat(", checkpoint %.3f", f.checkpoint_seconds()));
  if (f.outer_sync_seconds() > 0) absl::StrAppend(&extra, absl::StrFormat(", outer sync %.3f", f.outer_sync_seconds()));
  if (f.inner_steps() > 1) absl::StrAppend(&extra, ", inner steps ", f.inner_steps());
  if (f.slowdown() > 1) absl::StrAppend(&extra, absl::StrFormat(", EMULATED slowdown %gx", f.slowdown()));
  std::string wan;
  for (const auto& [pair, bytes] : f.wan_bytes_by_pair()) absl::StrAppend(&wan, " ", pair, " ", bytes);
  // Timed compute: the times are an emulated GPU's and there is no real loss; the line says so first.
  const std::string loss = f.timed_compute() ? "EMULATED (timed compute) loss n/a"
                           : loss_known      ? absl::StrFormat("loss %.6f", f.loss())
                                             : std::string("loss unknown");
  return absl::StrFormat(
      "step %d %s %.0f tokens/s step %.3f s (compute %.3f, comm wait %.3f, bubble %.3f%s) wan bytes %d%s%s", f.step(),
      loss, TokensPerSecond(f), f.step_seconds(), f.compute_seconds(), f.comm_wait_seconds(), f.bubble_seconds(), extra,
      f.wan_bytes(), wan.empty() ? "" : absl::StrCat(" (", wan.substr(1), ")"),
      f.val_loss() >= 0 ? absl::StrFormat(" val_loss %.6f", f.val_loss()) : "");
}

// What the job's series need besides the step's aggregate.
struct SeriesContext {
  int64_t step = 0;
  double loss_scale = 1;
  std::string wan_codec;
  double median_step_seconds = 0;  // over the job's last kMedianWindow steps
  double unix_seconds = 0;         // now
  double mfu = 0;                  // model FLOP/s utilisation (0: not known)
  bool ended = false;              // a late report of a job that ended: no liveness series (kLivenessGauges)
};

// Progress, ETA, the median step, the step's phases and the tokens by site (the caller holds the series lock).
void SetProgressSeries(MetricsServer& metrics, const prometheus::Labels& job, const JobInfo* info,
                       const StepAggregate& agg, const SeriesContext& context) {
  if (context.mfu > 0) metrics.Gauges(kJobMfu.name, kJobMfu.help).Add(job).Set(context.mfu);
  if (!context.ended) {
    metrics.Gauges(kLastStep.name, kLastStep.help).Add(job).Set(context.unix_seconds);
    metrics.Gauges(kMedianStep.name, kMedianStep.help).Add(job).Set(context.median_step_seconds);
  }
  if (info != nullptr && info->spec().train().steps() > 0) {
    const int64_t steps = info->spec().train().steps();
    metrics.Gauges(kProgress.name, kProgress.help).Add(job).Set(static_cast<double>(context.step) / steps);
    if (!context.ended) {
      metrics.Gauges(kEta.name, kEta.help)
          .Add(job)
          .Set(static_cast<double>(std::max<int64_t>(steps - context.step, 0)) * context.median_step_seconds);
    }
  }
  auto& phases = metrics.Gauges(kStepPhase.name, kStepPhase.help);
  const std::string& job_id = job.at("job_id");
  const StepFigures& f = agg.figures;
  phases.Add({{"job_id", job_id}, {"phase", "compute"}}).Set(f.compute_seconds());
  phases.Add({{"job_id", job_id}, {"phase", "comm_wait"}}).Set(f.comm_wait_seconds());
  phases.Add({{"job_id", job_id}, {"phase", "bubble"}}).Set(f.bubble_seconds());
  auto& sites = metrics.Gauges(kSiteTokens.name, kSiteTokens.help);
  for (const auto& [site, tokens] : agg.site_tokens) {
    sites.Add({{"job_id", job_id}, {"site", site}}).Set(f.step_seconds() > 0 ? tokens / f.step_seconds() : 0);
  }
}

void SetJobSeries(MetricsServer& metrics, JobManager& jobs, const std::string& job_id, const StepAggregate& agg,
                  const SeriesContext& context) {
  const prometheus::Labels job = {{"job_id", job_id}};
  absl::StatusOr<JobInfo> info = jobs.Get(job_id);
  if (info.ok() && info->predicted_step_seconds() > 0) {
    metrics.Gauges(kPredictedStep.name, kPredictedStep.help).Add(job).Set(info->predicted_step_seconds());
  }
  SetProgressSeries(metrics, job, info.ok() ? &*info : nullptr, agg, context);
  const StepFigures& f = agg.figures;
  metrics.Gauges(kTimedCompute.name, kTimedCompute.help).Add(job).Set(f.timed_compute() ? 1 : 0);
  metrics.Gauges(kMeasuredStep.name, kMeasuredStep.help).Add(job).Set(f.step_seconds());
  static const prometheus::Histogram::BucketBoundaries kBuckets = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                                   2.5,  5,     10,   30,  60,   120};
  prometheus::BuildHistogram()
      .Name(kStepDuration.name)
      .Help(kStepDuration.help)
      .Register(metrics.registry())
      .Add(job, kBuckets)
      .Observe(f.step_seconds());
  metrics.Gauges(kTokensPerSecond.name, kTokensPerSecond.help).Add(job).Set(TokensPerSecond(f));
  if (agg.have_loss) metrics.Gauges(kTrainLoss.name, kTrainLoss.help).Add(job).Set(f.loss());
  if (f.val_loss() >= 0) metrics.Gauges(kValLoss.name, kValLoss.help).Add(job).Set(f.val_loss());
  metrics.Gauges(kBubble.name, kBubble.help)
      .Add(job)
      .Set(f.step_seconds() > 0 ? f.bubble_seconds() / f.step_seconds() : 0);
  metrics.Gauges(kLossScale.name, kLossScale.help).Add(job).Set(context.loss_scale);
  // Created at the first step, so that a job that never skips shows 0.
  metrics.Counters(kSkippedSteps.name, kSkippedSteps.help).Add(job).Increment(f.skipped() ? 1 : 0);
  auto& wan_family = metrics.Counters("geotrain_wan_bytes_total", "Bytes sent between sites");
  for (const auto& [pair, bytes] : f.wan_bytes_by_pair()) {
    const size_t gt = pair.find('>');
    wan_family.Add({{"src_site", pair.substr(0, gt)}, {"dst_site", pair.substr(gt + 1)}, {"direction", "sent"}})
        .Increment(static_cast<double>(bytes));
  }
  if (f.compression_ratio() > 0) {
    metrics.Gauges("geotrain_codec_compression_ratio", "Raw over encoded bytes across sites, by codec")
        .Add({{"codec", context.wan_codec}})
        .Set(f.compression_ratio());
  }
}

// Adds one actor's figures of the step to its aggregate: the slowest actor's times, the loss carriers' mean loss,
// the replicas' mean validation loss, every actor's WAN bytes.
void AddFigures(const StepReport& report, StepAggregate& agg) {
  StepFigures& f = agg.figures;
  const StepFigures& r = report.figures();
  f.set_step(report.step());
  f.set_step_seconds(std::max(f.step_seconds(), r.step_seconds()));
  f.set_compute_seconds(std::max(f.compute_seconds(), r.compute_seconds()));
  f.set_comm_wait_seconds(std::max(f.comm_wait_seconds(), r.comm_wait_seconds()));
  f.set_bubble_seconds(std::max(f.bubble_seconds(), r.bubble_seconds()));
  f.set_checkpoint_seconds(std::max(f.checkpoint_seconds(), r.checkpoint_seconds()));
  f.set_outer_sync_seconds(std::max(f.outer_sync_seconds(), r.outer_sync_seconds()));
  f.set_slowdown(std::max(f.slowdown(), r.slowdown()));
  f.set_inner_steps(std::max(f.inner_steps(), r.inner_steps()));
  f.set_tokens(r.tokens());
  f.set_timed_compute(f.timed_compute() || r.timed_compute());
  // Every actor decides the same (its group's, with DiLoCo): the step counts as skipped if any skipped it.
  f.set_loss_scale(std::max(f.loss_scale(), r.loss_scale()));
  f.set_skipped(f.skipped() || r.skipped());
  if (report.carries_loss() && !r.timed_compute()) {
    agg.loss_sum += r.loss();
    f.set_loss(agg.loss_sum / ++agg.loss_reports);
    agg.have_loss = true;
  }
  if (r.val_loss() >= 0) agg.val_sum += r.val_loss(), ++agg.val_reports;
  f.set_val_loss(agg.val_reports > 0 ? agg.val_sum / agg.val_reports : -1);
  for (const auto& [pair, bytes] : r.wan_bytes_by_pair()) (*f.mutable_wan_bytes_by_pair())[pair] += bytes;
  f.set_wan_bytes(f.wan_bytes() + r.wan_bytes());
  if (r.compression_ratio() > 0) f.set_compression_ratio(r.compression_ratio());
}

}  // namespace

StepAggregator::StepAggregator(JobManager* jobs, const WorkerRegistry* registry, MetricsServer* metrics,
                               const Clock* clock, int64_t ended_job_series_ms)
    : jobs_(jobs), registry_(registry), metrics_(metrics), clock_(clock), ended_job_series_ms_(ended_job_series_ms) {}

std::optional<StepAggregate> StepAggregator::Add(JobRun& run, const StepReport& report) {
  // A step recorded already: a report sent again after its reply was lost (or to a head that restarted after it
  // recorded the step).
  if (report.step() <= run.last_step) return std::nullopt;
  StepAggregate& agg = run.steps[report.step()];
  // A report the reporter sent again (its reply was lost) is in already.
  if (!agg.reported.insert(report.actor_id()).second) return std::nullopt;
  // A report without figures comes from a worker of an older version: it counts for the step's completion only.
  if (report.has_figures()) {
    AddFigures(report, agg);
    for (const ActorPlacement& a : run.actors) {
      if (a.actor.actor_id() == report.actor_id() && report.figures().replica_tokens() > 0) {
        agg.replica_tokens[a.actor.replica()] = report.figures().replica_tokens();
      }
    }
  }
  if (agg.reported.size() != run.actors.size()) return std::nullopt;
  return Complete(run, report.step());
}

std::vector<StepAggregate> StepAggregator::CompleteAfterLeave(JobRun& run) {
  std::vector<int64_t> done;
  for (const auto& [step, agg] : run.steps) {
    if (agg.reported.size() == run.actors.size()) done.push_back(step);  // the leaving actors' ids are out
  }
  std::vector<StepAggregate> out;
  for (int64_t step : done) out.push_back(Complete(run, step));
  return out;
}

std::vector<StepAggregate> StepAggregator::CompleteEarlier(JobRun& run, int64_t step) {
  std::vector<StepAggregate> out;
  while (!run.steps.empty() && run.steps.begin()->first < step) {
    const int64_t earlier = run.steps.begin()->first;
    const int missing =
        static_cast<int>(run.actors.size()) - static_cast<int>(run.steps.begin()->second.reported.size());
    out.push_back(Complete(run, earlier));
    out.back().lost_reports = std::max(missing, 0);
  }
  return out;
}

StepAggregate StepAggregator::Complete(JobRun& run, int64_t step) {
  StepAggregate complete = std::move(run.steps[step]);
  if (complete.figures.loss_scale() <= 0) complete.figures.set_loss_scale(1);  // none reported: not fp16
  complete.figures.set_tokens_per_second(TokensPerSecond(complete.figures));
  complete.site_tokens = SiteTokens(run.actors, complete.figures.tokens(), complete.replica_tokens);
  run.steps.erase(step);
  run.last_step = std::max(run.last_step, step);
  return complete;
}

void StepAggregator::ForgetStale(JobRun& run, int64_t step) {
  while (!run.steps.empty() && run.steps.begin()->first + 100 < step) run.steps.erase(run.steps.begin());
}

void StepAggregator::RecordStep(const std::string& job_id, const StepAggregate& agg, const std::string& wan_codec) {
  StepFigures figures = agg.figures;
  // A step whose loss-carrying report never came (CompleteEarlier): its line says so, and the job keeps the loss it
  // had rather than a 0.
  const bool loss_known = agg.have_loss || agg.lost_reports == 0;
  if (!loss_known) {
    if (absl::StatusOr<JobInfo> job = jobs_->Get(job_id); job.ok()) figures.set_loss(job->loss());
  }
  std::string line = StepLine(figures, loss_known);
  if (agg.lost_reports > 0) {
    absl::StrAppend(&line, "; the reports of ", agg.lost_reports, " actor(s) never came: figures partial");
  }
  LogIfFailed(jobs_->UpdateProgress(job_id, figures, line), job_id, "recording progress");
  if (metrics_ == nullptr) return;
  absl::MutexLock series_lock(&series_mu_);
  if (series_removed_.count(job_id) > 0) return;  // a report that came after the job's series were removed
  std::deque<double>& recent = recent_step_seconds_[job_id];
  recent.push_back(figures.step_seconds());
  if (recent.size() > kMedianWindow) recent.pop_front();
  double mfu = 0;
  if (registry_ != nullptr) {
    if (absl::StatusOr<JobInfo> job = jobs_->Get(job_id); job.ok())
      mfu = JobEfficiencyOf(*job, registry_->Workers()).mfu();
  }
  const SeriesContext context{.step = figures.step(),
                              .loss_scale = figures.loss_scale(),
                              .wan_codec = wan_codec,
                              .median_step_seconds = Median(recent),
                              .unix_seconds = clock_->UnixMillis() / 1000.0,
                              .mfu = mfu,
                              .ended = ended_at_ms_.count(job_id) > 0};
  SetJobSeries(*metrics_, *jobs_, job_id, agg, context);
}

void StepAggregator::CountRestart(const std::string& job_id) {
  if (metrics_ == nullptr) return;
  metrics_->Counters(kRestarts.name, kRestarts.help).Add({{"job_id", job_id}}).Increment();
}

void StepAggregator::CountLeave(const std::string& job_id) {
  if (metrics_ == nullptr) return;
  metrics_->Counters(kLeaves.name, kLeaves.help).Add({{"job_id", job_id}}).Increment();
}

void StepAggregator::CountRegroup(const std::string& job_id, int present) {
  if (metrics_ == nullptr) return;
  metrics_->Counters(kRegroups.name, kRegroups.help).Add({{"job_id", job_id}}).Increment();
  SetReplicas(job_id, present);
}

void StepAggregator::CountHeal(const std::string& job_id, int present) {
  if (metrics_ == nullptr) return;
  metrics_->Counters(kHeals.name, kHeals.help).Add({{"job_id", job_id}}).Increment();
  SetReplicas(job_id, present);
}

void StepAggregator::SetHealSeconds(const std::string& job_id, double seconds) {
  if (metrics_ == nullptr) return;
  metrics_->Gauges(kHealSeconds.name, kHealSeconds.help).Add({{"job_id", job_id}}).Set(seconds);
}

void StepAggregator::SetReplicas(const std::string& job_id, int present) {
  if (metrics_ == nullptr) return;
  metrics_->Gauges(kReplicas.name, kReplicas.help).Add({{"job_id", job_id}}).Set(present);
}

void StepAggregator::SetHealthyPause(const std::string& job_id, double seconds) {
  if (metrics_ == nullptr) return;
  metrics_->Gauges(kHealthyPause.name, kHealthyPause.help).Add({{"job_id", job_id}}).Set(seconds);
}

void StepAggregator::CountStepsLost(const std::string& job_id, int64_t steps) {
  if (metrics_ == nullptr) return;
  metrics_->Counters(kStepsLost.name, kStepsLost.help).Add({{"job_id", job_id}}).Increment(static_cast<double>(steps));
}

void StepAggregator::ObserveRecovery(double seconds) {
  if (metrics_ == nullptr) return;
  static const prometheus::Histogram::BucketBoundaries kBuckets = {1, 2, 5, 10, 15, 20, 30, 45, 60, 120, 300, 600};
  prometheus::BuildHistogram()
      .Name("geotrain_job_recovery_seconds")
      .Help("Time from a fault's detection to the first step done after the restart")
      .Register(metrics_->registry())
      .Add({}, kBuckets)
      .Observe(seconds);
}

void StepAggregator::JobEnded(const std::string& job_id) {
  absl::MutexLock lock(&series_mu_);
  ended_at_ms_.emplace(job_id, clock_->NowMillis());
  if (metrics_ == nullptr) return;
  // A job that ended takes no more steps: its liveness series go now, so that the stalled-job alert
  // (time() - last step > 5 x median) cannot fire for it; the others stay for Prometheus's last scrape.
  const prometheus::Labels labels = {{"job_id", job_id}};
  for (const JobFamily& f : kLivenessGauges) {
    auto& family = metrics_->Gauges(f.name, f.help);
    if (family.Has(labels)) family.Remove(&family.Add(labels));
  }
}

void StepAggregator::ForgetEndedJobSeries() {
  if (metrics_ == nullptr) return;
  absl::MutexLock lock(&series_mu_);
  const int64_t now = clock_->NowMillis();
  for (auto it = ended_at_ms_.begin(); it != ended_at_ms_.end();) {
    if (now - it->second < ended_job_series_ms_) {
      ++it;
      continue;
    }
    const prometheus::Labels labels = {{"job_id", it->first}};
    auto remove = [&labels](auto& family) {
      if (family.Has(labels)) family.Remove(&family.Add(labels));
    };
    for (const JobFamily& f : kJobGauges) remove(metrics_->Gauges(f.name, f.help));
    for (const JobFamily& f : kMultiLabelJobGauges) RemoveJobSeries(metrics_->Gauges(f.name, f.help), it->first);
    recent_step_seconds_.erase(it->first);
    for (const JobFamily& f : kJobCounters) remove(metrics_->Counters(f.name, f.help));
    auto& steps =
        prometheus::BuildHistogram().Name(kStepDuration.name).Help(kStepDuration.help).Register(metrics_->registry());
    if (steps.Has(labels)) steps.Remove(&steps.Add(labels, prometheus::Histogram::BucketBoundaries{}));
    series_removed_.insert(it->first);
    it = ended_at_ms_.erase(it);
  }
}

}  // namespace geotrain::head
