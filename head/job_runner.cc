// Job runner: actor creation, step aggregation, checkpoints, recovery and the end of jobs (placement and auto
// plans: placement.cc).
#include "head/job_runner.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "common/diloco_spec.h"
#include "common/log.h"
#include "common/names.h"
#include "common/spec.h"
#include "common/status.h"
#include "model/checkpoint_files.h"
#include "model/config.h"
#include "scheduler/planner.h"

namespace geotrain::head {
namespace {

// The families whose series belong to one job (label job_id): removed when it has ended (ForgetEndedJobSeries).
struct JobFamily {
  const char* name;
  const char* help;
};
constexpr JobFamily kRestarts{"geotrain_job_restarts_total", "Restarts of a job from its checkpoint after a fault"};
constexpr JobFamily kStepsLost{"geotrain_job_steps_lost_total", "Steps trained again after restarts, by job"};
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
constexpr JobFamily kJobGauges[] = {kPredictedStep, kMeasuredStep, kTokensPerSecond, kTrainLoss,
                                    kValLoss,       kBubble,       kTimedCompute,    kLossScale};
constexpr JobFamily kJobCounters[] = {kRestarts, kStepsLost, kSkippedSteps};

}  // namespace

JobRunner::JobRunner(JobManager* jobs, WorkerRegistry* registry, MetricsServer* metrics, JobRunnerOptions options,
                     const Clock* clock)
    : jobs_(jobs),
      registry_(registry),
      metrics_(metrics),
      options_(std::move(options)),
      clock_(clock),
      executor_(std::make_unique<Executor>(options_.rpc_threads, "head-rpc")) {}

JobRunner::~JobRunner() { Shutdown(); }

void JobRunner::Check(const absl::Status& status, const std::string& job_id, const char* what) {
  if (!status.ok()) GT_LOG(ERROR) << "job " << job_id << ": " << what << ": " << status;
}

void JobRunner::Start(std::function<void()> on_tick) {
  control_ = std::thread([this, on_tick = std::move(on_tick)] { ControlLoop(on_tick); });
}

void JobRunner::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (control_.joinable()) control_.join();
  executor_.reset();  // finishes the RPCs queued
}

void JobRunner::Kick() {
  absl::MutexLock lock(&mu_);
  kicked_ = true;
}

void JobRunner::ControlLoop(std::function<void()> on_tick) {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(
          absl::Condition(
              +[](JobRunner* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) { return r->stopping_ || r->kicked_; }, this),
          absl::Milliseconds(options_.control_period_ms));
      if (stopping_) return;
      kicked_ = false;
    }
    RetryPendingEnds();
    HandleFaults();
    Reconcile();
    RecoverJobs();
    StartPendingJobs();
    ForgetEndedJobSeries();
    if (on_tick) on_tick();
  }
}

void JobRunner::RetryPendingEnds() {
  std::map<std::string, std::pair<JobState, std::string>> pending;
  {
    absl::MutexLock lock(&mu_);
    pending.swap(pending_ends_);
  }
  for (const auto& [job_id, end] : pending) {
    absl::StatusOr<JobInfo> ended = jobs_->Transition(job_id, end.first, end.second);
    if (ended.ok() || ended.status().code() != absl::StatusCode::kUnavailable) continue;
    absl::MutexLock lock(&mu_);
    pending_ends_.insert({job_id, end});
  }
}

void JobRunner::Restore() {
  std::map<std::string, WorkerInfo> workers;
  for (const WorkerInfo& w : registry_->Workers()) workers[w.worker_id()] = w;
  const int64_t now = clock_->NowMillis();
  std::vector<std::pair<std::string, std::string>> lines;
  const std::vector<JobInfo> jobs = jobs_->List();
  absl::MutexLock lock(&mu_);
  for (const JobInfo& job : jobs) {
    if (job.state() != JOB_RUNNING && job.state() != JOB_RESTARTING) continue;
    lines.push_back({job.job_id(), absl::StrCat("the head restarted: it takes the job over (run ", job.attempt(),
                                                ", step ", job.step(), ")")});
    Run& run = runs_[job.job_id()];
    run.spec = job.spec();
    run.attempt = job.attempt();
    run.restarts = job.restarts();
    run.last_step = job.step();
    run.last_checkpoint_step = job.last_checkpoint_step();
    run.resumed_from = job.resumed_from();
    run.launched_ms = now;  // the workers get a grace period to list their actors again
    for (const ActorRecord& a : job.actors()) {
      ActorPlacement p;
      p.actor = a;
      auto w = workers.find(a.worker_id());
      if (w != workers.end()) p.site = w->second.site();
      run.actors.push_back(p);
    }
    for (const CheckpointShard& shard : job.pending_shards()) run.shards[shard.step()][shard.actor_id()] = shard;
    run.done.insert(job.done_actors().begin(), job.done_actors().end());
    run.restored = true;
    if (job.state() == JOB_RESTARTING) {
      run.phase = Phase::kRecovering;
      run.fault_cause = job.message();
      run.fault_detected_ms = now;
      run.fault_unix_ms = clock_->UnixMillis();
      run.fault_step = job.step();
    }
    GT_LOG(INFO) << "job " << job.job_id() << " (" << JobStateName(job.state()) << ", run " << run.attempt << ", step "
                 << run.last_step << ") taken over from the previous head";
  }
  // The job manager's lock is taken inside ours nowhere else either way round: logging here is safe.
  for (const auto& [job_id, line] : lines) Check(jobs_->Log(job_id, line), job_id, "logging");
}

void JobRunner::OnWorkerDead(const WorkerInfo& worker) {
  std::vector<std::pair<std::string, int64_t>> hit;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [job_id, run] : runs_) {
      if (run.phase != Phase::kRunning) continue;
      for (const ActorPlacement& p : run.actors) {
        if (p.actor.worker_id() == worker.worker_id() && !run.done.count(p.actor.actor_id())) {
          hit.push_back({job_id, run.attempt});
          break;
        }
      }
    }
  }
  for (const auto& [job_id, attempt] : hit) {
    Fault(
        job_id, attempt,
        absl::StrCat("worker ", worker.worker_id(), " at site ", worker.site(), " died (", worker.dead_reason(), ")"));
  }
}

void JobRunner::Fault(const std::string& job_id, int64_t attempt, const std::string& cause, bool permanent) {
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(job_id);
    if (it == runs_.end() || it->second.attempt != attempt || it->second.phase != Phase::kRunning) return;
    Run& run = it->second;
    run.phase = Phase::kFault;
    run.fault_cause = cause;
    run.fault_permanent = permanent;
    run.fault_detected_ms = clock_->NowMillis();
    run.fault_unix_ms = clock_->UnixMillis();
    run.fault_step = run.last_step;
    kicked_ = true;
  }
  GT_LOG(WARNING) << "job " << job_id << " (run " << attempt << "): fault: " << cause;
}

void JobRunner::HandleFaults() {
  struct Pending {
    std::string job_id, cause;
    std::vector<ActorPlacement> actors;
    int restarts = 0;
    int64_t step = 0, detected_unix_ms = 0, attempt = 0;
    bool permanent = false;
  };
  std::vector<Pending> pending;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [job_id, run] : runs_) {
      if (run.phase != Phase::kFault) continue;
      pending.push_back({job_id, run.fault_cause, run.actors, run.restarts, run.fault_step, run.fault_unix_ms,
                         run.attempt, run.fault_permanent});
    }
  }
  for (Pending& p : pending) {
    absl::StatusOr<JobInfo> job = jobs_->Get(p.job_id);
    if (!job.ok()) continue;
    const FaultToleranceSpec& ft = job->spec().fault_tolerance();
    const int max_restarts = ft.has_max_restarts() ? ft.max_restarts() : 3;
    if (p.permanent) {
      EndJob(p.job_id, JOB_FAILED,
             absl::StrCat(p.cause, "; not restarted: the error is in the job (its spec, data or checkpoint) and a ",
                          "restart would fail the same way; fix it and submit the job again"));
      continue;
    }
    if (max_restarts >= 0 && p.restarts >= max_restarts) {
      EndJob(p.job_id, JOB_FAILED,
             max_restarts == 0
                 ? p.cause
                 : absl::StrCat(p.cause, "; no restart left (fault_tolerance.max_restarts ", max_restarts, ")"));
      continue;
    }
    FaultRecord fault;
    fault.set_cause(p.cause);
    fault.set_detected_unix_ms(p.detected_unix_ms);
    fault.set_step(p.step);
    fault.set_attempt(p.attempt + 1);
    Check(jobs_
              ->Update(p.job_id,
                       [&](JobInfo& j) {
                         *j.add_faults() = fault;
                         j.set_restarts(p.restarts + 1);
                       })
              .status(),
          p.job_id, "recording the fault");
    auto moved =
        jobs_->Transition(p.job_id, JOB_RESTARTING,
                          absl::StrCat(p.cause, "; restarting (", p.restarts + 1, " of ",
                                       max_restarts < 0 ? std::string("unlimited") : absl::StrCat(max_restarts), ")"));
    if (!moved.ok() && moved.status().code() == absl::StatusCode::kUnavailable) {
      Check(moved.status(), p.job_id, "moving to RESTARTING (will retry)");  // the fault stays to be handled
      continue;
    }
    if (!moved.ok()) {  // cancelled meanwhile
      Check(moved.status(), p.job_id, "moving to RESTARTING");
      absl::MutexLock lock(&mu_);
      if (auto it = runs_.find(p.job_id); it != runs_.end()) it->second.phase = Phase::kEnded;
      continue;
    }
    if (metrics_ != nullptr) {
      metrics_->Counters(kRestarts.name, kRestarts.help).Add({{"job_id", p.job_id}}).Increment();
    }
    // The surviving actors stop now (their receives end at once), before the next run is placed.
    StopActors(p.actors, absl::StrCat("the job is restarting: ", p.cause), /*wait=*/true);
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(p.job_id);
    if (it == runs_.end() || it->second.phase != Phase::kFault) continue;
    it->second.phase = Phase::kRecovering;
    it->second.restarts = p.restarts + 1;
    it->second.waiting_message.clear();
    kicked_ = true;
  }
}

absl::StatusOr<std::string> JobRunner::ResumePoint(const std::string& job_id, const JobSpec& spec) {
  const CheckpointSpec& c = spec.checkpoint();
  std::vector<std::string> skipped;
  absl::StatusOr<std::string> newest = absl::NotFoundError("no checkpoint dir");
  if (!c.dir().empty()) newest = model::FindNewestCheckpoint(c.dir(), &skipped);
  for (const std::string& why : skipped) {
    Check(jobs_->Log(job_id, absl::StrCat("skipped a checkpoint that does not verify: ", why)), job_id, "logging");
  }
  // The job's own newest checkpoint is the furthest point; one it was told to resume from comes next.
  if (newest.ok()) {
    absl::StatusOr<JobInfo> job = jobs_->Get(job_id);
    const bool own = job.ok() && (job->last_checkpoint_step() > 0 || c.resume() == "auto");
    if (own || c.resume_from().empty()) return *newest;
  }
  if (!c.resume_from().empty()) {
    std::vector<std::string> skipped_there;
    std::string from = c.resume_from();
    std::error_code ec;
    if (!std::filesystem::exists(from + "/manifest.json", ec)) {
      ASSIGN_OR_RETURN(from, model::FindNewestCheckpoint(c.resume_from(), &skipped_there));
    } else {
      RETURN_IF_ERROR(model::VerifyCheckpoint(from).status());
    }
    for (const std::string& why : skipped_there) {
      Check(jobs_->Log(job_id, absl::StrCat("skipped a checkpoint that does not verify: ", why)), job_id, "logging");
    }
    return from;
  }
  return std::string();
}

HeldDevices JobRunner::HeldByOthers(const std::string& job_id) const {
  HeldDevices held;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, run] : runs_) {
    if (id == job_id || (run.phase != Phase::kRunning && run.phase != Phase::kFault)) continue;
    for (const ActorPlacement& p : run.actors) held[{p.actor.worker_id(), p.actor.device_index()}] = id;
  }
  return held;
}

absl::Status JobRunner::PlaceAndLaunch(const JobInfo& job, int64_t attempt, const std::string& resume_from) {
  // Other jobs' actors keep their devices: this job plans and places on the free ones.
  const HeldDevices held = HeldByOthers(job.job_id());
  const std::vector<WorkerInfo> workers = registry_->Workers();
  JobInfo planned = job;
  const ParallelSpec& submitted = job.has_submitted_parallel() ? job.submitted_parallel() : job.spec().parallel();
  if (submitted.plan() == "auto") {
    JobSpec to_plan = job.spec();
    *to_plan.mutable_parallel() = submitted;
    ASSIGN_OR_RETURN(AutoPlan plan, PlanAutoJob(to_plan, FreeDevices(workers, held), registry_->SiteLinks()));
    plan.parallel.set_pipeline_depth(submitted.pipeline_depth());  // the user's depth, if any, stands
    *planned.mutable_spec()->mutable_parallel() = plan.parallel;
    planned.set_predicted_step_seconds(plan.predicted_step_seconds);
    Check(jobs_->SetPlan(job.job_id(), plan.parallel, plan.predicted_step_seconds), job.job_id(), "recording the plan");
    const ParallelSpec& p = plan.parallel;
    Check(
        jobs_->Log(job.job_id(), absl::StrFormat("planned%s: dp %d x pp %d x tp %d, %d microbatches, %s; "
                                                 "predicted step %.3f s",
                                                 attempt > 0 ? " again on the workers alive now" : "", p.dp(), p.pp(),
                                                 p.tp(), p.microbatches(), p.schedule(), plan.predicted_step_seconds)),
        job.job_id(), "logging");
    for (const std::string& line : plan.explanation)
      Check(jobs_->Log(job.job_id(), "  " + line), job.job_id(), "logging");
  }
  ASSIGN_OR_RETURN(std::vector<ActorPlacement> placement, PlaceActors(planned, workers, held));
  // The precision for these devices (auto resolved), before any actor starts: one a device cannot run fails the job.
  ASSIGN_OR_RETURN(const PrecisionChoice precision, ChoosePrecision(planned.spec(), placement, workers));
  planned.mutable_spec()->mutable_train()->set_precision(std::string(model::PrecisionName(precision.precision)));
  const model::LossScaleOptions scaling = model::LossScaleFromSpec(planned.spec().train(), precision.precision);
  Check(jobs_
            ->Update(job.job_id(),
                     [&](JobInfo& j) {
                       // A restart on other devices may resolve auto differently: the scale starts again then.
                       const std::string name(model::PrecisionName(precision.precision));
                       if (j.loss_scale() == 0 || j.precision() != name) {
                         j.set_loss_scale(scaling.enabled ? scaling.initial : 1);
                       }
                       j.set_precision(name);
                     })
            .status(),
        job.job_id(), "recording the precision");
  Check(jobs_->Log(job.job_id(), precision.explanation), job.job_id(), "logging");
  // A 1F1B pipeline across a slow link runs deeper than pp (placement.h); the depth is for this placement only.
  absl::StatusOr<PipelineDepthChoice> depth =
      ChoosePipelineDepth(planned.spec(), placement, workers, registry_->SiteLinks());
  if (!depth.ok()) {
    Check(jobs_->Log(job.job_id(), absl::StrCat("pipeline depth left at pp: ", depth.status().message())), job.job_id(),
          "logging");
  } else if (depth->depth > planned.spec().parallel().pp() && planned.spec().parallel().pipeline_depth() == 0) {
    planned.mutable_spec()->mutable_parallel()->set_pipeline_depth(depth->depth);
    Check(jobs_->Log(job.job_id(), depth->explanation), job.job_id(), "logging");
  }
  return Launch(planned, std::move(placement), attempt, resume_from);
}

void JobRunner::StartPendingJobs() {
  for (const JobInfo& job : jobs_->List()) {
    if (job.state() != JOB_PENDING) continue;
    {
      absl::MutexLock lock(&mu_);
      if (runs_.count(job.job_id())) continue;
    }
    if (!job.has_submitted_parallel()) {
      Check(jobs_->Update(job.job_id(), [&](JobInfo& j) { *j.mutable_submitted_parallel() = job.spec().parallel(); })
                .status(),
            job.job_id(), "recording the submitted plan");
    }
    absl::StatusOr<std::string> resume_from = ResumePoint(job.job_id(), job.spec());
    if (!resume_from.ok()) {
      Check(
          jobs_
              ->Transition(job.job_id(), JOB_FAILED,
                           absl::StrCat("cannot resume from checkpoint.resume_from: ", resume_from.status().message()))
              .status(),
          job.job_id(), "failing the job");
      continue;
    }
    absl::StatusOr<JobInfo> current = jobs_->Get(job.job_id());
    if (!current.ok()) continue;
    absl::Status launched = PlaceAndLaunch(*current, 0, *resume_from);
    if (launched.code() == absl::StatusCode::kUnavailable) {
      // Not enough free devices: the job waits for workers to join or for other jobs to end (like Ray's pending
      // resources). Jobs are tried in submission order; a later job that fits may start first.
      // Unless it was cancelled meanwhile (NoteWaiting checks, under the job table's lock).
      Check(jobs_->NoteWaiting(job.job_id(), absl::StrCat("waiting for devices: ", launched.message())), job.job_id(),
            "recording why it waits");
    } else if (!launched.ok() && launched.code() != absl::StatusCode::kAborted) {  // kAborted: a fault now
      EndJob(job.job_id(), JOB_FAILED, std::string(launched.message()));
    }
  }
}

void JobRunner::RecoverJobs() {
  std::vector<std::string> recovering;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [job_id, run] : runs_) {
      if (run.phase == Phase::kRecovering) recovering.push_back(job_id);
    }
  }
  for (const std::string& job_id : recovering) {
    absl::StatusOr<JobInfo> job = jobs_->Get(job_id);
    if (!job.ok() || job->state() != JOB_RESTARTING) {
      absl::MutexLock lock(&mu_);
      if (auto it = runs_.find(job_id); it != runs_.end() && job.ok() && IsTerminal(job->state())) {
        it->second.phase = Phase::kEnded;
      }
      continue;
    }
    int64_t attempt, detected_ms, fault_step;
    std::string waiting;
    {
      absl::MutexLock lock(&mu_);
      const Run& run = runs_[job_id];
      attempt = run.attempt + 1;
      detected_ms = run.fault_detected_ms;
      fault_step = run.fault_step;
      waiting = run.waiting_message;
    }
    absl::StatusOr<std::string> resume_from = ResumePoint(job_id, job->spec());
    if (!resume_from.ok()) {
      EndJob(job_id, JOB_FAILED, absl::StrCat("cannot restart: ", resume_from.status().message()));
      continue;
    }
    absl::Status launched = PlaceAndLaunch(*job, attempt, *resume_from);
    if (launched.ok()) {
      int64_t resumed_step = 0;
      if (!resume_from->empty()) {
        if (auto manifest = model::VerifyCheckpoint(*resume_from); manifest.ok()) resumed_step = manifest->step();
      }
      const int64_t lost = std::max<int64_t>(0, fault_step - resumed_step);
      Check(jobs_
                ->Update(job_id,
                         [&](JobInfo& j) {
                           if (j.faults_size() == 0) return;
                           FaultRecord* f = j.mutable_faults(j.faults_size() - 1);
                           f->set_resumed_from(*resume_from);
                           f->set_resumed_step(resumed_step);
                           f->set_steps_lost(lost);
                         })
                .status(),
            job_id, "recording the restart");
      if (metrics_ != nullptr && lost > 0) {
        metrics_->Counters(kStepsLost.name, kStepsLost.help)
            .Add({{"job_id", job_id}})
            .Increment(static_cast<double>(lost));
      }
      continue;
    }
    const double waited_s = (clock_->NowMillis() - detected_ms) / 1000.0;
    const double limit_s = job->spec().fault_tolerance().wait_for_workers_s() > 0
                               ? job->spec().fault_tolerance().wait_for_workers_s()
                               : 300.0;
    if (launched.code() == absl::StatusCode::kAborted && waited_s <= limit_s) {
      // An actor could not be created (a worker went away meanwhile): try again on the next look.
      Check(jobs_->Log(job_id, absl::StrCat("restart attempt failed: ", launched.message(), "; trying again")), job_id,
            "logging");
    } else if (launched.code() != absl::StatusCode::kUnavailable && launched.code() != absl::StatusCode::kAborted) {
      EndJob(job_id, JOB_FAILED, absl::StrCat("cannot restart: ", launched.message()));
    } else if (waited_s > limit_s) {
      EndJob(job_id, JOB_FAILED,
             absl::StrFormat("cannot restart: %s after waiting %.0f s (fault_tolerance.wait_for_workers_s); start "
                             "or rejoin workers, or resubmit with a plan that fits the workers alive",
                             launched.message(), waited_s));
    } else {
      const std::string why = absl::StrCat("waiting for workers to restart: ", launched.message());
      if (why != waiting) {
        Check(jobs_->Log(job_id, why), job_id, "logging");
        absl::MutexLock lock(&mu_);
        runs_[job_id].waiting_message = why;
      }
    }
  }
}

absl::Status JobRunner::Launch(const JobInfo& job, std::vector<ActorPlacement> placement, int64_t attempt,
                               const std::string& resume_from) {
  // A restart's actors are new actors (their ids carry the run), so that a worker still finishing an
  // earlier run's actor takes the new one at once.
  if (attempt > 0) {
    for (ActorPlacement& p : placement) p.actor.set_actor_id(absl::StrCat(p.actor.actor_id(), "-a", attempt));
  }
  std::map<std::string, WorkerInfo> workers;
  for (const WorkerInfo& w : registry_->Workers()) workers[w.worker_id()] = w;
  CreateActorRequest request;
  *request.mutable_spec() = job.spec();
  request.set_head_address(options_.head_address);
  request.set_attempt(attempt);
  request.set_resume_from(resume_from);
  for (const ActorPlacement& p : placement) {
    const WorkerInfo& w = workers[p.actor.worker_id()];
    ActorPeer* peer = request.add_peers();
    peer->set_actor_id(p.actor.actor_id());
    peer->set_replica(p.actor.replica());
    peer->set_stage(p.actor.stage());
    peer->set_tp_rank(p.actor.tp_rank());
    peer->set_worker_id(w.worker_id());
    peer->set_site(w.site());
    peer->set_address(w.address());
    *peer->mutable_address_for_site() = w.address_for_site();
    const int d = p.actor.device_index();
    peer->set_device_kind(d >= 0 && d < w.devices_size() ? w.devices(d).kind() : DEVICE_KIND_UNSPECIFIED);
  }
  int64_t resumed_step = 0;
  if (!resume_from.empty()) {
    ASSIGN_OR_RETURN(CheckpointManifest manifest, model::VerifyCheckpoint(resume_from));
    resumed_step = manifest.step();
  }
  {
    absl::MutexLock lock(&mu_);
    Run& run = runs_[job.job_id()];
    run.spec = job.spec();
    run.attempt = attempt;
    run.actors = placement;
    run.done.clear();
    run.restored = false;
    run.actor_errors.clear();
    run.steps.clear();
    run.shards.clear();  // an earlier run's shards never join this run's checkpoints
    run.phase = Phase::kRunning;
    run.resumed_step = resumed_step;
    run.resumed_from = resume_from;
    run.last_step = resumed_step;
    run.recovery_measured = attempt == 0;
    run.launched_ms = clock_->NowMillis();
    run.actor_seen_ms.clear();
    run.waiting_message.clear();
  }
  std::vector<ActorRecord> records;
  for (const ActorPlacement& p : placement) records.push_back(p.actor);
  Check(jobs_->SetActors(job.job_id(), records), job.job_id(), "recording the actors");
  Check(jobs_
            ->Update(job.job_id(),
                     [&](JobInfo& j) {
                       j.set_attempt(attempt);
                       j.set_resumed_from(resume_from);
                       j.set_step(resumed_step);
                       j.clear_pending_shards();
                       j.clear_done_actors();
                     })
            .status(),
        job.job_id(), "recording the run");
  if (attempt == 0) {
    ASSIGN_OR_RETURN(JobInfo started,
                     jobs_->Transition(job.job_id(), JOB_RUNNING,
                                       absl::StrCat("placed ", placement.size(), " actors; creating them",
                                                    resume_from.empty() ? ""
                                                                        : absl::StrCat("; resuming from ", resume_from,
                                                                                       " (step ", resumed_step, ")"))));
    (void)started;
  }
  // Every actor at once: a slow worker costs one deadline, not one per actor.
  std::vector<absl::Status> created = executor_->Map(static_cast<int>(placement.size()), [&](int i) -> absl::Status {
    const ActorPlacement& p = placement[i];
    const WorkerInfo& w = workers[p.actor.worker_id()];
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, MakeChannel(w.address(), options_.tls));
    auto stub = internal::Worker::NewStub(channel);
    grpc::ClientContext ctx;
    AttachToken(&ctx, options_.token);
    SetDeadlineMillis(&ctx, options_.create_deadline_ms);
    CreateActorRequest one = request;
    *one.mutable_actor() = p.actor;
    CreateActorReply reply;
    grpc::Status s = stub->CreateActor(&ctx, one, &reply);
    if (!s.ok()) {
      return absl::UnavailableError(absl::StrCat("creating actor ", p.actor.actor_id(), " on worker ", w.worker_id(),
                                                 " (", w.address(), "): ", s.error_message()));
    }
    return absl::OkStatus();
  });
  for (const absl::Status& s : created) {
    if (s.ok()) continue;
    // The actors that were made would wait for the missing one: stop them. A first run's failure is a fault
    // (restarted within fault_tolerance.max_restarts); a restart's is retried within wait_for_workers_s.
    StopActors(placement, "another actor of the job could not be created", /*wait=*/false);
    if (attempt == 0) {
      Fault(job.job_id(), attempt, std::string(s.message()));
    } else {
      absl::MutexLock lock(&mu_);
      runs_[job.job_id()].phase = Phase::kRecovering;
    }
    return absl::AbortedError(s.message());
  }
  bool ended;
  {
    absl::MutexLock lock(&mu_);
    ended = runs_[job.job_id()].phase == Phase::kEnded;
  }
  if (ended) {  // cancelled while its actors were being created
    StopActors(placement, "the job ended while its actors were being created", /*wait=*/false);
    return absl::OkStatus();
  }
  std::string where;
  for (const ActorPlacement& p : placement) {
    absl::StrAppend(&where, where.empty() ? "" : ", ", "r", p.actor.replica(), "s", p.actor.stage(),
                    p.actor.tp_rank() ? absl::StrCat("t", p.actor.tp_rank()) : "", "@", p.site);
  }
  Check(jobs_->Log(job.job_id(), absl::StrCat("actors created", attempt > 0 ? absl::StrCat(" (run ", attempt, ")") : "",
                                              ": ", where)),
        job.job_id(), "logging");
  if (attempt > 0) {
    Check(jobs_
              ->Transition(
                  job.job_id(), JOB_RUNNING,
                  resume_from.empty()
                      ? absl::StrCat("restarted (run ", attempt, ") from the beginning: no checkpoint yet")
                      : absl::StrCat("restarted (run ", attempt, ") from ", resume_from, " at step ", resumed_step))
              .status(),
          job.job_id(), "moving to RUNNING");
  }
  return absl::OkStatus();
}

void JobRunner::StopActors(const std::vector<ActorPlacement>& actors, const std::string& reason, bool wait) {
  std::map<std::string, WorkerInfo> workers;
  for (const WorkerInfo& w : registry_->Workers()) workers[w.worker_id()] = w;
  auto targets = std::make_shared<std::vector<std::pair<WorkerInfo, std::string>>>();
  for (const ActorPlacement& p : actors) {
    auto it = workers.find(p.actor.worker_id());
    if (it == workers.end() || it->second.state() != WORKER_ALIVE) continue;
    targets->push_back({it->second, p.actor.actor_id()});
  }
  auto stop_one = [targets, reason, options = options_](int i) -> absl::Status {
    const auto& [worker, actor_id] = (*targets)[i];
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, MakeChannel(worker.address(), options.tls));
    auto stub = internal::Worker::NewStub(channel);
    grpc::ClientContext ctx;
    AttachToken(&ctx, options.token);
    SetDeadlineMillis(&ctx, options.stop_deadline_ms);
    StopActorRequest request;
    request.set_actor_id(actor_id);
    request.set_reason(reason);
    StopActorReply reply;
    grpc::Status s = stub->StopActor(&ctx, request, &reply);
    // NOT_FOUND: the worker restarted and the actor is gone, which is what a stop wants.
    if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) {
      GT_LOG(WARNING) << "stopping actor " << actor_id << " on worker " << worker.worker_id() << ": "
                      << s.error_message();
    }
    return absl::OkStatus();
  };
  if (wait) {
    executor_->Map(static_cast<int>(targets->size()), stop_one);
  } else {
    for (int i = 0; i < static_cast<int>(targets->size()); ++i) executor_->Submit([stop_one, i] { (void)stop_one(i); });
  }
}

void JobRunner::EndJob(const std::string& job_id, JobState state, const std::string& message) {
  std::vector<ActorPlacement> actors;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(job_id);
    if (it != runs_.end()) {
      if (it->second.phase == Phase::kEnded) return;
      it->second.phase = Phase::kEnded;
      actors = it->second.actors;
    }
  }
  absl::StatusOr<JobInfo> ended = jobs_->Transition(job_id, state, message);
  if (!ended.ok() && ended.status().code() == absl::StatusCode::kUnavailable) {
    // The state could not be written (a full disk): the job stays as it was recorded, and the end is
    // written when the store takes writes again.
    Check(ended.status(), job_id, "ending the job (will retry)");
    absl::MutexLock lock(&mu_);
    pending_ends_[job_id] = {state, message};
  } else if (!ended.ok() && ended.status().code() != absl::StatusCode::kFailedPrecondition) {
    Check(ended.status(), job_id, "ending the job");
  }
  if (state != JOB_SUCCEEDED) StopActors(actors, message, /*wait=*/false);
  RecordFinalActorStates(job_id, state, message);
  absl::MutexLock lock(&series_mu_);
  ended_at_ms_.emplace(job_id, clock_->NowMillis());
}

void JobRunner::RecordFinalActorStates(const std::string& job_id, JobState state, const std::string& message) {
  // What each actor said last: its own error report, else its worker's heartbeat when that says it is dead.
  std::map<std::string, std::string> said;
  for (const ActorRecord& a : registry_->Actors()) {
    if (a.job_id() == job_id && a.state() == ACTOR_DEAD) said[a.actor_id()] = a.message();
  }
  {
    absl::MutexLock lock(&mu_);
    if (auto it = runs_.find(job_id); it != runs_.end()) {
      for (const auto& [actor, error] : it->second.actor_errors) said[actor] = error;
    }
  }
  Check(jobs_
            ->Update(job_id,
                     [&](JobInfo& j) {
                       for (ActorRecord& a : *j.mutable_actors()) {
                         auto it = said.find(a.actor_id());
                         a.set_state(ACTOR_DEAD);
                         // Its own word when it has one; else what ended the job (a succeeded job's actors all
                         // reported their last step).
                         a.set_message(it != said.end()         ? it->second
                                       : state == JOB_SUCCEEDED ? "finished"
                                                                : absl::StrCat("stopped: ", message));
                       }
                     })
            .status(),
        job_id, "recording the actors' final states");
}

void JobRunner::ForgetEndedJobSeries() {
  if (metrics_ == nullptr) return;
  absl::MutexLock lock(&series_mu_);
  const int64_t now = clock_->NowMillis();
  for (auto it = ended_at_ms_.begin(); it != ended_at_ms_.end();) {
    if (now - it->second < options_.ended_job_series_ms) {
      ++it;
      continue;
    }
    const prometheus::Labels labels = {{"job_id", it->first}};
    auto remove = [&labels](auto& family) {
      if (family.Has(labels)) family.Remove(&family.Add(labels));
    };
    for (const JobFamily& f : kJobGauges) remove(metrics_->Gauges(f.name, f.help));
    for (const JobFamily& f : kJobCounters) remove(metrics_->Counters(f.name, f.help));
    auto& steps =
        prometheus::BuildHistogram().Name(kStepDuration.name).Help(kStepDuration.help).Register(metrics_->registry());
    if (steps.Has(labels)) steps.Remove(&steps.Add(labels, prometheus::Histogram::BucketBoundaries{}));
    series_removed_.insert(it->first);
    it = ended_at_ms_.erase(it);
  }
}

void JobRunner::Reconcile() {
  // The workers' own view of their actors (heartbeats): an actor that died fails its run; one that
  // finished counts as done if its last report was lost; one an alive worker stopped listing is lost.
  std::map<std::string, ActorRecord> reported;
  for (const ActorRecord& a : registry_->Actors()) reported[a.actor_id()] = a;
  std::map<std::string, WorkerInfo> workers;
  for (const WorkerInfo& w : registry_->Workers()) workers[w.worker_id()] = w;
  const int64_t now = clock_->NowMillis();
  std::vector<std::tuple<std::string, int64_t, std::string>> faults;
  std::vector<std::string> succeeded;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [job_id, run] : runs_) {
      if (run.phase != Phase::kRunning) continue;
      // Only a run this pass completes is ended here: one whose last report completed it is ended by
      // OnStepReport, after it records that report's step (ending it here could log SUCCEEDED first).
      bool completed_here = false;
      if (run.restored && !run.actors.empty() && run.done.size() == run.actors.size()) {
        // Every actor's last report reached the previous head, which stopped before it ended the job.
        succeeded.push_back(job_id);
        continue;
      }
      for (const ActorPlacement& p : run.actors) {
        const std::string& id = p.actor.actor_id();
        if (run.done.count(id)) continue;
        auto it = reported.find(id);
        if (it != reported.end()) {
          run.actor_seen_ms[id] = now;
          if (it->second.state() != ACTOR_DEAD) continue;
          if (it->second.message() == "finished") {
            // Its last report is probably on its way: wait for it, so that the last step is recorded.
            const int64_t first = run.finished_seen_ms.emplace(id, now).first->second;
            if (now - first >= options_.final_report_grace_ms) {
              run.done.insert(id);
              completed_here = run.done.size() == run.actors.size();
            }
          } else if (!absl::StartsWith(it->second.message(), "stopped")) {
            faults.push_back({job_id, run.attempt, absl::StrCat("actor ", id, " died: ", it->second.message())});
            break;
          }
          continue;
        }
        auto w = workers.find(p.actor.worker_id());
        const int64_t since = std::max(run.launched_ms, run.actor_seen_ms.count(id) ? run.actor_seen_ms[id] : 0);
        if (w != workers.end() && w->second.state() == WORKER_ALIVE && now - since > options_.actor_lost_after_ms) {
          faults.push_back(
              {job_id, run.attempt,
               absl::StrCat("actor ", id, " is gone from worker ", p.actor.worker_id(), " (the worker restarted?)")});
          break;
        }
      }
      if (completed_here) succeeded.push_back(job_id);
    }
  }
  for (const auto& [job_id, attempt, cause] : faults) Fault(job_id, attempt, cause);
  for (const std::string& job_id : succeeded) EndJob(job_id, JOB_SUCCEEDED, "every actor finished");
}

void JobRunner::StopJob(const std::string& job_id, const std::string& reason) {
  std::vector<ActorPlacement> actors;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(job_id);
    if (it == runs_.end()) return;
    it->second.phase = Phase::kEnded;
    actors = it->second.actors;
  }
  StopActors(actors, reason, /*wait=*/false);
  RecordFinalActorStates(job_id, JOB_CANCELLED, reason);
}

std::vector<ActorRecord> JobRunner::Actors(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  std::vector<ActorRecord> out;
  auto it = runs_.find(job_id);
  if (it == runs_.end()) return out;
  for (const ActorPlacement& p : it->second.actors) out.push_back(p.actor);
  return out;
}

bool JobRunner::OnStepReport(const StepReport& report) {
  bool finished = false, failed = false;
  StepAggregate complete;
  bool step_complete = false;
  double recovery_seconds = -1;
  int64_t steps_lost = 0;
  std::vector<std::pair<int64_t, std::map<std::string, CheckpointShard>>> ready;
  std::vector<CheckpointShard> failed_shards, pending_shards;
  bool persist_shards = false;
  bool newly_done = false;  // this report is its actor's last
  JobSpec spec;
  int64_t attempt = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(report.job_id());
    if (it == runs_.end()) return true;  // unknown (e.g. a head restart without its state): stop
    Run& run = it->second;
    // An earlier run's actor (stopped for a restart), or a job that ended: stop.
    if (run.phase == Phase::kEnded || report.attempt() != run.attempt) return true;
    if (run.phase != Phase::kRunning) return false;  // a fault is being handled: the actors are being stopped
    spec = run.spec;
    attempt = run.attempt;
    const int actors = static_cast<int>(run.actors.size());
    if (!report.error().empty()) {
      failed = true;
      run.actor_errors[report.actor_id()] = report.error();
    } else if (report.step() > 0) {
      StepAggregate& agg = run.steps[report.step()];
      ++agg.reports;
      agg.step_seconds = std::max(agg.step_seconds, report.step_seconds());
      agg.compute = std::max(agg.compute, report.compute_seconds());
      agg.wait = std::max(agg.wait, report.comm_wait_seconds());
      agg.bubble = std::max(agg.bubble, report.bubble_seconds());
      agg.checkpoint = std::max(agg.checkpoint, report.checkpoint_seconds());
      agg.tokens = report.tokens();
      agg.timed_compute = agg.timed_compute || report.timed_compute();
      // Every actor decides the same (its group's, with DiLoCo): the step counts as skipped if any skipped it.
      agg.loss_scale = std::max(agg.loss_scale, report.loss_scale());
      agg.skipped = agg.skipped || report.skipped();
      if (report.carries_loss() && !report.timed_compute()) {
        agg.loss_sum += report.loss();
        agg.loss = agg.loss_sum / ++agg.loss_reports;
        agg.have_loss = true;
      }
      if (report.val_loss() >= 0) agg.val_sum += report.val_loss(), ++agg.val_reports;
      for (const auto& [pair, bytes] : report.wan_bytes()) agg.wan_bytes[pair] += bytes;
      if (report.compression_ratio() > 0) agg.compression_ratio = report.compression_ratio();
      if (agg.reports == actors) {
        complete = agg;
        step_complete = true;
        run.steps.erase(report.step());
        run.last_step = std::max(run.last_step, report.step());
        if (!run.recovery_measured && report.step() > run.resumed_step) {
          run.recovery_measured = true;
          recovery_seconds = (clock_->NowMillis() - run.fault_detected_ms) / 1000.0;
          steps_lost = std::max<int64_t>(0, run.fault_step - run.resumed_step);
        }
      }
      // Steps some report of which was lost (e.g. sent to a head that restarted) never complete: forget them.
      while (!run.steps.empty() && run.steps.begin()->first + 100 < report.step()) run.steps.erase(run.steps.begin());
      if (report.done()) newly_done = run.done.insert(report.actor_id()).second;
      finished = static_cast<int>(run.done.size()) == actors;
    }
    // Checkpoint shards (any report may carry them, also an error report's predecessors).
    for (const CheckpointShard& shard : report.checkpoints()) {
      // One shard per stage, or with DiLoCo per stage and group.
      const int writers = shard.writers() > 0 ? shard.writers() : run.spec.parallel().pp();
      if (!shard.error().empty()) {
        failed_shards.push_back(shard);
        run.shards.erase(shard.step());
        continue;
      }
      if (shard.step() <= run.last_checkpoint_step) continue;
      auto& shards = run.shards[shard.step()];
      shards[shard.actor_id()] = shard;
      if (static_cast<int>(shards.size()) == writers) {
        ready.push_back({shard.step(), shards});
        run.shards.erase(shard.step());
        run.last_checkpoint_step = std::max(run.last_checkpoint_step, shard.step());
      }
    }
    if (report.checkpoints_size() > 0) {
      persist_shards = true;
      for (const auto& [step, shards] : run.shards) {
        for (const auto& [actor, shard] : shards) pending_shards.push_back(shard);
      }
    }
  }
  // What a restarted head needs to go on: the actors whose last report it has (whether or not their workers still
  // list them) and the shards of checkpoints not yet complete. One write for both.
  if (newly_done || persist_shards) {
    Check(jobs_
              ->Update(report.job_id(),
                       [&](JobInfo& j) {
                         if (newly_done) j.add_done_actors(report.actor_id());
                         if (!persist_shards) return;
                         j.clear_pending_shards();
                         for (const CheckpointShard& s : pending_shards) *j.add_pending_shards() = s;
                       })
              .status(),
          report.job_id(), "recording the actor's last report and checkpoint shards");
  }
  if (failed) {
    Fault(report.job_id(), attempt, absl::StrCat("actor ", report.actor_id(), " failed: ", report.error()),
          report.permanent());
    return true;
  }
  for (const CheckpointShard& shard : failed_shards) {
    Check(jobs_->Log(report.job_id(), absl::StrCat("warning: checkpoint of step ", shard.step(), " abandoned: actor ",
                                                   shard.actor_id(), " could not write its shard: ", shard.error(),
                                                   "; training goes on, the next checkpoint is tried at its interval")),
          report.job_id(), "logging");
  }
  for (const auto& [step, shards] : ready) CommitCheckpoint(report.job_id(), spec, step, shards);
  if (step_complete) RecordStep(report.job_id(), report.step(), complete);
  if (recovery_seconds >= 0) RecordRecovery(report.job_id(), recovery_seconds, steps_lost);
  if (finished) EndJob(report.job_id(), JOB_SUCCEEDED, absl::StrCat("finished ", report.step(), " steps"));
  return false;
}

void JobRunner::CommitCheckpoint(const std::string& job_id, const JobSpec& spec, int64_t step,
                                 const std::map<std::string, CheckpointShard>& shards) {
  absl::StatusOr<GPT2Config> config = GPT2Config::FromSpec(spec.model());
  if (!config.ok()) return;
  CheckpointManifest manifest;
  manifest.set_format(model::kCheckpointFormat);
  manifest.set_step(step);
  manifest.mutable_model()->set_n_layer(config->n_layer);
  manifest.mutable_model()->set_n_head(config->n_head);
  manifest.mutable_model()->set_n_embd(config->n_embd);
  manifest.mutable_model()->set_block_size(config->block_size);
  manifest.mutable_model()->set_vocab_size(config->vocab_size);
  manifest.set_job(job_id);
  manifest.set_plan(
      absl::StrFormat("dp %d x pp %d x tp %d", spec.parallel().dp(), spec.parallel().pp(), spec.parallel().tp()));
  manifest.set_created_unix_ms(clock_->UnixMillis());
  // Group and stage order: the first stage's data position and optimizer step; a tied tensor (wte) from the
  // first stage that holds it. The tensors map names group 0's files; DiLoCo groups > 0 hold the same tensors
  // in files of their own (model::GroupFileFor).
  std::vector<const CheckpointShard*> by_stage;
  int groups = 0;
  for (const auto& [actor, shard] : shards) {
    by_stage.push_back(&shard);
    groups = std::max(groups, shard.group() + 1);
  }
  std::sort(by_stage.begin(), by_stage.end(), [](const CheckpointShard* a, const CheckpointShard* b) {
    return std::pair(a->group(), a->stage()) < std::pair(b->group(), b->stage());
  });
  if (DilocoOn(spec)) manifest.set_diloco_groups(groups);
  double snapshot = 0, write = 0;
  for (const CheckpointShard* shard : by_stage) {
    if (shard == by_stage.front()) {
      *manifest.mutable_data_position() = shard->data_position();
      manifest.set_optimizer_step(shard->optimizer_step());
    }
    for (const CheckpointFile& f : shard->files()) {
      CheckpointFileEntry& entry = (*manifest.mutable_files())[f.name()];
      entry.set_bytes(f.bytes());
      entry.set_crc32(f.crc32());
      if (!shard->replica_worker().empty()) {  // checkpoint.replicate: a copy at another site
        (*manifest.mutable_replicas())[f.name()] = absl::StrCat(shard->replica_worker(), "@", shard->replica_address());
      }
    }
    if (shard->group() == 0) {
      for (const std::string& t : shard->tensors()) manifest.mutable_tensors()->insert({t, shard->model_file()});
    }
    snapshot = std::max(snapshot, shard->snapshot_seconds());
    write = std::max(write, shard->write_seconds());
  }
  const std::string& dir = spec.checkpoint().dir();
  if (absl::Status s = model::CommitCheckpoint(dir, manifest); !s.ok()) {
    Check(jobs_->Log(job_id, absl::StrCat("warning: checkpoint of step ", step, " not committed: ", s.message(),
                                          "; training goes on")),
          job_id, "logging");
    return;
  }
  Check(jobs_->Update(job_id, [&](JobInfo& j) { j.set_last_checkpoint_step(std::max(j.last_checkpoint_step(), step)); })
            .status(),
        job_id, "recording the checkpoint");
  Check(jobs_->Log(job_id, absl::StrFormat("checkpoint of step %d complete: %s (snapshot %.3f s on the training "
                                           "thread, written in the background in %.3f s)",
                                           step, model::StepDirectory(dir, step), snapshot, write)),
        job_id, "logging");
  if (absl::Status s = model::PruneCheckpoints(dir, model::CheckpointsKept(spec.checkpoint())); !s.ok()) {
    Check(jobs_->Log(job_id, absl::StrCat("warning: ", s.message())), job_id, "logging");
  }
}

void JobRunner::RecordRecovery(const std::string& job_id, double seconds, int64_t steps_lost) {
  Check(jobs_
            ->Update(job_id,
                     [&](JobInfo& j) {
                       if (j.faults_size() > 0) j.mutable_faults(j.faults_size() - 1)->set_recovery_seconds(seconds);
                     })
            .status(),
        job_id, "recording the recovery");
  Check(jobs_->Log(job_id, absl::StrFormat("recovered: training again %.1f s after the fault was detected; %d "
                                           "step(s) lost",
                                           seconds, steps_lost)),
        job_id, "logging");
  if (metrics_ == nullptr) return;
  static const prometheus::Histogram::BucketBoundaries kBuckets = {1, 2, 5, 10, 15, 20, 30, 45, 60, 120, 300, 600};
  prometheus::BuildHistogram()
      .Name("geotrain_job_recovery_seconds")
      .Help("Time from a fault's detection to the first step done after the restart")
      .Register(metrics_->registry())
      .Add({}, kBuckets)
      .Observe(seconds);
}

void JobRunner::RecordStep(const std::string& job_id, int64_t step, const StepAggregate& agg) {
  const double tokens_per_second = agg.step_seconds > 0 ? agg.tokens / agg.step_seconds : 0;
  std::string wan;
  int64_t wan_total = 0;
  for (const auto& [pair, bytes] : agg.wan_bytes) {
    absl::StrAppend(&wan, " ", pair, " ", bytes);
    wan_total += bytes;
  }
  // Timed compute: the times are an emulated GPU's and there is no real loss; the line says so first.
  const std::string loss =
      agg.timed_compute ? "EMULATED (timed compute) loss n/a" : absl::StrFormat("loss %.6f", agg.loss);
  const std::string line = absl::StrFormat(
      "step %d %s %.0f tokens/s step %.3f s (compute %.3f, comm wait %.3f, bubble %.3f%s) wan bytes %d%s%s", step, loss,
      tokens_per_second, agg.step_seconds, agg.compute, agg.wait, agg.bubble,
      agg.checkpoint > 0 ? absl::StrFormat(", checkpoint %.3f", agg.checkpoint) : "", wan_total,
      wan.empty() ? "" : absl::StrCat(" (", wan.substr(1), ")"),
      agg.val_reports > 0 ? absl::StrFormat(" val_loss %.6f", agg.val_sum / agg.val_reports) : "");
  StepFigures figures;
  figures.set_step(step);
  figures.set_loss(agg.loss);
  figures.set_tokens_per_second(tokens_per_second);
  figures.set_step_seconds(agg.step_seconds);
  figures.set_compute_seconds(agg.compute);
  figures.set_comm_wait_seconds(agg.wait);
  figures.set_bubble_seconds(agg.bubble);
  figures.set_checkpoint_seconds(agg.checkpoint);
  figures.set_wan_bytes(wan_total);
  figures.mutable_wan_bytes_by_pair()->insert(agg.wan_bytes.begin(), agg.wan_bytes.end());
  figures.set_compression_ratio(agg.compression_ratio);
  figures.set_tokens(agg.tokens);
  figures.set_val_loss(agg.val_reports > 0 ? agg.val_sum / agg.val_reports : -1);
  figures.set_timed_compute(agg.timed_compute);
  figures.set_loss_scale(agg.loss_scale > 0 ? agg.loss_scale : 1);
  figures.set_skipped(agg.skipped);
  Check(jobs_->UpdateProgress(job_id, figures, line), job_id, "recording progress");
  if (metrics_ == nullptr) return;
  absl::MutexLock series_lock(&series_mu_);
  if (series_removed_.count(job_id) > 0) return;  // a report that came after the job's series were removed
  if (auto job = jobs_->Get(job_id); job.ok() && job->predicted_step_seconds() > 0) {
    metrics_->Gauges(kPredictedStep.name, kPredictedStep.help)
        .Add({{"job_id", job_id}})
        .Set(job->predicted_step_seconds());
  }
  metrics_->Gauges(kTimedCompute.name, kTimedCompute.help).Add({{"job_id", job_id}}).Set(agg.timed_compute ? 1 : 0);
  metrics_->Gauges(kMeasuredStep.name, kMeasuredStep.help).Add({{"job_id", job_id}}).Set(agg.step_seconds);
  static const prometheus::Histogram::BucketBoundaries kBuckets = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                                   2.5,  5,     10,   30,  60,   120};
  prometheus::BuildHistogram()
      .Name(kStepDuration.name)
      .Help(kStepDuration.help)
      .Register(metrics_->registry())
      .Add({{"job_id", job_id}}, kBuckets)
      .Observe(agg.step_seconds);
  metrics_->Gauges(kTokensPerSecond.name, kTokensPerSecond.help).Add({{"job_id", job_id}}).Set(tokens_per_second);
  if (agg.have_loss) metrics_->Gauges(kTrainLoss.name, kTrainLoss.help).Add({{"job_id", job_id}}).Set(agg.loss);
  if (agg.val_reports > 0) {
    metrics_->Gauges(kValLoss.name, kValLoss.help).Add({{"job_id", job_id}}).Set(agg.val_sum / agg.val_reports);
  }
  metrics_->Gauges(kBubble.name, kBubble.help)
      .Add({{"job_id", job_id}})
      .Set(agg.step_seconds > 0 ? agg.bubble / agg.step_seconds : 0);
  metrics_->Gauges(kLossScale.name, kLossScale.help).Add({{"job_id", job_id}}).Set(figures.loss_scale());
  // Created at the first step, so that a job that never skips shows 0.
  metrics_->Counters(kSkippedSteps.name, kSkippedSteps.help).Add({{"job_id", job_id}}).Increment(agg.skipped ? 1 : 0);
  auto& wan_family = metrics_->Counters("geotrain_wan_bytes_total", "Bytes sent between sites");
  for (const auto& [pair, bytes] : agg.wan_bytes) {
    const size_t gt = pair.find('>');
    wan_family.Add({{"src_site", pair.substr(0, gt)}, {"dst_site", pair.substr(gt + 1)}, {"direction", "sent"}})
        .Increment(static_cast<double>(bytes));
  }
  if (agg.compression_ratio > 0) {
    std::string codec;
    {
      absl::MutexLock lock(&mu_);
      auto it = runs_.find(job_id);
      if (it != runs_.end()) codec = it->second.spec.comm().wan_codec();
    }
    metrics_->Gauges("geotrain_codec_compression_ratio", "Raw over encoded bytes across sites, by codec")
        .Add({{"codec", codec}})
        .Set(agg.compression_ratio);
  }
}

}  // namespace geotrain::head
