// The job's state machine: the control loop, pending jobs started, runs launched and reconciled with the workers'
// heartbeats, jobs ended, reports routed to the parts (see job_runner.h; placement and auto plans: placement.cc).
#include "head/job_runner.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "common/names.h"
#include "common/status.h"
#include "model/checkpoint_files.h"
#include "model/config.h"

namespace geotrain::head {

JobRunner::JobRunner(JobManager* jobs, WorkerRegistry* registry, MetricsServer* metrics, JobRunnerOptions options,
                     const Clock* clock)
    : jobs_(jobs),
      registry_(registry),
      options_(std::move(options)),
      clock_(clock),
      launcher_(registry, ActorLauncherOptions{.token = options_.token,
                                               .head_address = options_.head_address,
                                               .tls = options_.tls,
                                               .rpc_threads = options_.rpc_threads,
                                               .stop_deadline_ms = options_.stop_deadline_ms,
                                               .create_deadline_ms = options_.create_deadline_ms}),
      aggregator_(jobs, registry, metrics, clock, options_.ended_job_series_ms),
      committer_(jobs, clock),
      recovery_(jobs, registry, &runs_, &launcher_, &aggregator_, this, clock) {}

JobRunner::~JobRunner() { Shutdown(); }

void JobRunner::Restore() { recovery_.Restore(); }

void JobRunner::Start(std::function<void()> on_tick) {
  control_ = std::thread([this, on_tick = std::move(on_tick)] { ControlLoop(on_tick); });
}

void JobRunner::Shutdown() {
  {
    absl::MutexLock lock(&runs_.mu);
    if (stopping_) return;
    stopping_ = true;
  }
  if (control_.joinable()) control_.join();
  launcher_.Shutdown();  // finishes the RPCs queued
}

void JobRunner::Kick() {
  absl::MutexLock lock(&runs_.mu);
  runs_.kicked = true;
}

void JobRunner::OnWorkerDead(const WorkerInfo& worker) { recovery_.OnWorkerDead(worker); }

void JobRunner::ControlLoop(std::function<void()> on_tick) {
  while (true) {
    {
      absl::MutexLock lock(&runs_.mu);
      runs_.mu.AwaitWithTimeout(
          absl::Condition(
              +[](JobRunner* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->runs_.mu) { return r->stopping_ || r->runs_.kicked; },
              this),
          absl::Milliseconds(options_.control_period_ms));
      if (stopping_) return;
      runs_.kicked = false;
    }
    RetryPendingEnds();
    recovery_.HandleFaults();
    RecordAllSteps();  // a regroup's (those complete once the leaving actors are out)
    Reconcile();
    CheckDrains();
    CheckRegroups();
    CheckHeals();
    ProbeStalledRuns();
    recovery_.RecoverJobs();
    StartPendingJobs();
    aggregator_.ForgetEndedJobSeries();
    if (on_tick) on_tick();
  }
}

void JobRunner::RetryPendingEnds() {
  std::map<std::string, std::pair<JobState, std::string>> pending;
  {
    absl::MutexLock lock(&runs_.mu);
    pending.swap(pending_ends_);
  }
  for (const auto& [job_id, end] : pending) {
    absl::StatusOr<JobInfo> ended = jobs_->Transition(job_id, end.first, end.second);
    if (ended.ok() || ended.status().code() != absl::StatusCode::kUnavailable) continue;
    absl::MutexLock lock(&runs_.mu);
    pending_ends_.insert({job_id, end});
  }
}

HeldDevices JobRunner::HeldByOthers(const std::string& job_id) const {
  HeldDevices held;
  absl::MutexLock lock(&runs_.mu);
  for (const auto& [id, run] : runs_.by_job) {
    if (id == job_id || (run.phase != RunPhase::kRunning && run.phase != RunPhase::kFault)) continue;
    for (const ActorPlacement& p : run.actors) held[{p.actor.worker_id(), p.actor.device_index()}] = id;
    for (const ActorPlacement& p : run.heal.actors) held[{p.actor.worker_id(), p.actor.device_index()}] = id;
  }
  return held;
}

absl::Status JobRunner::PlaceAndLaunch(const JobInfo& job, int64_t attempt, const std::string& resume_from) {
  // Other jobs' actors keep their devices: this job plans and places on the free ones.
  const HeldDevices held = HeldByOthers(job.job_id());
  const std::vector<WorkerInfo> workers = registry_->Workers();
  const std::string& id = job.job_id();
  JobInfo planned = job;
  const ParallelSpec& submitted = job.has_submitted_parallel() ? job.submitted_parallel() : job.spec().parallel();
  if (submitted.plan() == "auto") {
    JobSpec to_plan = job.spec();
    *to_plan.mutable_parallel() = submitted;
    ASSIGN_OR_RETURN(AutoPlan plan, PlanAutoJob(to_plan, FreeDevices(workers, held), registry_->SiteLinks()));
    plan.parallel.set_pipeline_depth(submitted.pipeline_depth());  // the user's depth, if any, stands
    *planned.mutable_spec()->mutable_parallel() = plan.parallel;
    planned.set_predicted_step_seconds(plan.predicted_step_seconds);
    LogIfFailed(jobs_->SetPlan(id, plan.parallel, plan.predicted_step_seconds), id, "recording the plan");
    const ParallelSpec& p = plan.parallel;
    LogIfFailed(jobs_->Log(id, absl::StrFormat("planned%s: dp %d x pp %d x tp %d, %d microbatches, %s; "
                                               "predicted step %.3f s",
                                               attempt > 0 ? " again on the workers alive now" : "", p.dp(), p.pp(),
                                               p.tp(), p.microbatches(), p.schedule(), plan.predicted_step_seconds)),
                id, "logging");
    for (const std::string& line : plan.explanation) LogIfFailed(jobs_->Log(id, "  " + line), id, "logging");
  }
  ASSIGN_OR_RETURN(std::vector<ActorPlacement> placement, PlaceActors(planned, workers, held));
  // The precision for these devices (auto resolved), before any actor starts: one a device cannot run fails the job.
  ASSIGN_OR_RETURN(const PrecisionChoice precision, ChoosePrecision(planned.spec(), placement, workers));
  planned.mutable_spec()->mutable_train()->set_precision(std::string(model::PrecisionName(precision.precision)));
  const model::LossScaleOptions scaling = model::LossScaleFromSpec(planned.spec().train(), precision.precision);
  LogIfFailed(jobs_
                  ->Update(id,
                           [&](JobInfo& j) {
                             // A restart on other devices may resolve auto differently: the scale starts again then.
                             const std::string name(model::PrecisionName(precision.precision));
                             if (j.loss_scale() == 0 || j.precision() != name) {
                               j.set_loss_scale(scaling.enabled ? scaling.initial : 1);
                             }
                             j.set_precision(name);
                           })
                  .status(),
              id, "recording the precision");
  LogIfFailed(jobs_->Log(id, precision.explanation), id, "logging");
  // A 1F1B pipeline across a slow link runs deeper than pp (placement.h); the depth is for this placement only.
  absl::StatusOr<PipelineDepthChoice> depth =
      ChoosePipelineDepth(planned.spec(), placement, workers, registry_->SiteLinks());
  if (!depth.ok()) {
    LogIfFailed(jobs_->Log(id, absl::StrCat("pipeline depth left at pp: ", depth.status().message())), id, "logging");
  } else if (depth->depth > planned.spec().parallel().pp() && planned.spec().parallel().pipeline_depth() == 0) {
    planned.mutable_spec()->mutable_parallel()->set_pipeline_depth(depth->depth);
    LogIfFailed(jobs_->Log(id, depth->explanation), id, "logging");
  }
  return Launch(planned, std::move(placement), attempt, resume_from);
}

void JobRunner::StartPendingJobs() {
  for (const JobInfo& job : jobs_->List()) {
    if (job.state() != JOB_PENDING) continue;
    {
      absl::MutexLock lock(&runs_.mu);
      if (runs_.by_job.count(job.job_id())) continue;
    }
    if (!job.has_submitted_parallel()) {
      LogIfFailed(
          jobs_->Update(job.job_id(), [&](JobInfo& j) { *j.mutable_submitted_parallel() = job.spec().parallel(); })
              .status(),
          job.job_id(), "recording the submitted plan");
    }
    absl::StatusOr<std::string> resume_from = recovery_.ResumePoint(job.job_id(), job.spec());
    if (!resume_from.ok()) {
      LogIfFailed(
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
      LogIfFailed(jobs_->NoteWaiting(job.job_id(), absl::StrCat("waiting for devices: ", launched.message())),
                  job.job_id(), "recording why it waits");
    } else if (!launched.ok() && launched.code() != absl::StatusCode::kAborted) {  // kAborted: a fault now
      EndJob(job.job_id(), JOB_FAILED, std::string(launched.message()));
    }
  }
}

absl::Status JobRunner::BeginRun(const JobInfo& job, const std::vector<ActorPlacement>& placement, int64_t attempt,
                                 const std::string& resume_from, int64_t resumed_step) {
  {
    absl::MutexLock lock(&runs_.mu);
    JobRun& run = runs_.by_job[job.job_id()];
    run.spec = job.spec();
    run.attempt = attempt;
    run.actors = placement;
    run.done.clear();
    run.restored = false;
    run.actor_errors.clear();
    run.steps.clear();
    run.to_record.clear();  // recorded before the launch (Launch)
    run.shards.clear();     // an earlier run's shards never join this run's checkpoints
    run.phase = RunPhase::kRunning;
    run.resumed_step = resumed_step;
    run.resumed_from = resume_from;
    run.last_step = resumed_step;
    run.recovery_measured = attempt == 0;
    run.launched_ms = clock_->NowMillis();
    run.actor_seen_ms.clear();
    run.waiting_message.clear();
    run.drain = RunDrain{};      // a drain is of one run: the next is placed without the draining workers
    run.regroup = RunRegroup{};  // a new run has every replica of its plan
    run.heal = RunHeal{};        // a heal's joining actors are of the run before: their reports are refused (stop)
    run.progress = RunProgress{};
  }
  const int planned = std::max(1, job.spec().parallel().dp());
  aggregator_.SetReplicas(job.job_id(), planned);
  std::vector<ActorRecord> records;
  for (const ActorPlacement& p : placement) records.push_back(p.actor);
  LogIfFailed(jobs_->SetActors(job.job_id(), records), job.job_id(), "recording the actors");
  LogIfFailed(jobs_
                  ->Update(job.job_id(),
                           [&](JobInfo& j) {
                             j.set_attempt(attempt);
                             j.set_resumed_from(resume_from);
                             j.set_step(resumed_step);
                             j.clear_pending_shards();
                             j.clear_done_actors();
                             j.mutable_replicas()->set_present(planned);
                             j.mutable_replicas()->set_planned(planned);
                             j.set_epoch(0);
                             j.clear_present_replicas();
                           })
                  .status(),
              job.job_id(), "recording the run");
  if (attempt > 0) return absl::OkStatus();
  const std::string resuming =
      resume_from.empty() ? "" : absl::StrCat("; resuming from ", resume_from, " (step ", resumed_step, ")");
  return jobs_
      ->Transition(job.job_id(), JOB_RUNNING,
                   absl::StrCat("placed ", placement.size(), " actors; creating them", resuming))
      .status();
}

absl::Status JobRunner::Launch(const JobInfo& job, std::vector<ActorPlacement> placement, int64_t attempt,
                               const std::string& resume_from) {
  ActorLauncher::NameForRun(&placement, attempt);
  const WorkersById workers = ById(registry_->Workers());
  int64_t resumed_step = 0;
  if (!resume_from.empty()) {
    ASSIGN_OR_RETURN(CheckpointManifest manifest, model::VerifyCheckpoint(resume_from));
    resumed_step = manifest.step();
  }
  RecordSteps(job.job_id());  // the previous run's last complete steps, before this run's first
  RETURN_IF_ERROR(BeginRun(job, placement, attempt, resume_from, resumed_step));
  if (absl::Status s = launcher_.CreateActors(job.spec(), placement, workers, attempt, resume_from); !s.ok()) {
    // The actors that were made would wait for the missing one: stop them. A first run's failure is a fault
    // (restarted within fault_tolerance.max_restarts); a restart's is retried within wait_for_workers_s.
    launcher_.StopActors(placement, "another actor of the job could not be created", /*wait=*/false);
    if (attempt == 0) {
      recovery_.Fault(job.job_id(), attempt, std::string(s.message()));
    } else {
      absl::MutexLock lock(&runs_.mu);
      runs_.by_job[job.job_id()].phase = RunPhase::kRecovering;
    }
    return absl::AbortedError(s.message());
  }
  bool ended;
  {
    absl::MutexLock lock(&runs_.mu);
    ended = runs_.by_job[job.job_id()].phase == RunPhase::kEnded;
  }
  if (ended) {  // cancelled while its actors were being created
    launcher_.StopActors(placement, "the job ended while its actors were being created", /*wait=*/false);
    return absl::OkStatus();
  }
  std::string where;
  for (const ActorPlacement& p : placement) {
    absl::StrAppend(&where, where.empty() ? "" : ", ", "r", p.actor.replica(), "s", p.actor.stage(),
                    p.actor.tp_rank() ? absl::StrCat("t", p.actor.tp_rank()) : "", "@", p.site);
  }
  LogIfFailed(
      jobs_->Log(job.job_id(),
                 absl::StrCat("actors created", attempt > 0 ? absl::StrCat(" (run ", attempt, ")") : "", ": ", where)),
      job.job_id(), "logging");
  if (attempt > 0) {
    LogIfFailed(jobs_
                    ->Transition(job.job_id(), JOB_RUNNING,
                                 resume_from.empty() ? absl::StrCat("restarted (run ", attempt,
                                                                    ") from the beginning: no checkpoint yet")
                                                     : absl::StrCat("restarted (run ", attempt, ") from ", resume_from,
                                                                    " at step ", resumed_step))
                    .status(),
                job.job_id(), "moving to RUNNING");
  }
  return absl::OkStatus();
}

void JobRunner::EndJob(const std::string& job_id, JobState state, const std::string& message) {
  std::vector<ActorPlacement> actors;
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(job_id);
    if (it != runs_.by_job.end()) {
      if (it->second.phase == RunPhase::kEnded) return;
      it->second.phase = RunPhase::kEnded;
      actors = it->second.actors;
    }
  }
  absl::StatusOr<JobInfo> ended = jobs_->Transition(job_id, state, message);
  if (!ended.ok() && ended.status().code() == absl::StatusCode::kUnavailable) {
    // The state could not be written (a full disk): the job stays as it was recorded, and the end is
    // written when the store takes writes again.
    LogIfFailed(ended.status(), job_id, "ending the job (will retry)");
    absl::MutexLock lock(&runs_.mu);
    pending_ends_[job_id] = {state, message};
  } else if (!ended.ok() && ended.status().code() != absl::StatusCode::kFailedPrecondition) {
    LogIfFailed(ended.status(), job_id, "ending the job");
  }
  if (state != JOB_SUCCEEDED) launcher_.StopActors(actors, message, /*wait=*/false);
  RecordFinalActorStates(job_id, state, message);
  aggregator_.JobEnded(job_id);
}

void JobRunner::RecordFinalActorStates(const std::string& job_id, JobState state, const std::string& message) {
  // What each actor said last: its own error report, else its worker's heartbeat when that says it is dead.
  std::map<std::string, std::string> said;
  for (const ActorRecord& a : registry_->Actors()) {
    if (a.job_id() == job_id && a.state() == ACTOR_DEAD) said[a.actor_id()] = a.message();
  }
  {
    absl::MutexLock lock(&runs_.mu);
    if (auto it = runs_.by_job.find(job_id); it != runs_.by_job.end()) {
      for (const auto& [actor, error] : it->second.actor_errors) said[actor] = error;
    }
  }
  LogIfFailed(jobs_
                  ->Update(job_id,
                           [&](JobInfo& j) {
                             for (ActorRecord& a : *j.mutable_actors()) {
                               auto it = said.find(a.actor_id());
                               a.set_state(ACTOR_DEAD);
                               // Its own word when it has one; else what ended the job (a succeeded job's actors
                               // all reported their last step).
                               a.set_message(it != said.end()         ? it->second
                                             : state == JOB_SUCCEEDED ? "finished"
                                                                      : absl::StrCat("stopped: ", message));
                             }
                           })
                  .status(),
              job_id, "recording the actors' final states");
}

void JobRunner::Reconcile() {
  // The workers' own view of their actors (heartbeats): an actor that died fails its run; one that
  // finished counts as done if its last report was lost; one an alive worker stopped listing is lost.
  std::map<std::string, ActorRecord> reported;
  for (const ActorRecord& a : registry_->Actors()) reported[a.actor_id()] = a;
  const WorkersById workers = ById(registry_->Workers());
  const int64_t now = clock_->NowMillis();
  std::vector<std::tuple<std::string, int64_t, std::string, std::string>> faults;  // job, run, cause, lost actor
  std::vector<std::string> succeeded;
  {
    absl::MutexLock lock(&runs_.mu);
    for (auto& [job_id, run] : runs_.by_job) {
      if (run.phase != RunPhase::kRunning) continue;
      // Only a run this pass completes is ended here: one whose last report completed it is ended by
      // OnStepReport, after it records that report's step (ending it here could log SUCCEEDED first).
      bool completed_here = false;
      if (run.restored && AllActorsDone(run)) {
        QueueSteps(run, StepAggregator::CompleteEarlier(run, std::numeric_limits<int64_t>::max()));
        // Every actor's last report reached the previous head, which stopped before it ended the job.
        succeeded.push_back(job_id);
        continue;
      }
      for (const ActorPlacement& p : run.actors) {
        const std::string& id = p.actor.actor_id();
        if (run.done.count(id) || run.drain.left.count(id)) continue;  // its last report is in
        auto it = reported.find(id);
        if (it != reported.end()) {
          run.actor_seen_ms[id] = now;
          if (it->second.state() != ACTOR_DEAD) continue;
          if (it->second.message() == "finished") {
            // Its last report is probably on its way: wait for it, so that the last step is recorded.
            const int64_t first = run.finished_seen_ms.emplace(id, now).first->second;
            if (now - first >= options_.final_report_grace_ms) {
              run.done.insert(id);
              completed_here = AllActorsDone(run);
            }
          } else if (!absl::StartsWith(it->second.message(), "stopped")) {
            faults.push_back({job_id, run.attempt, absl::StrCat("actor ", id, " died: ", it->second.message()), id});
            break;
          }
          continue;
        }
        auto w = workers.find(p.actor.worker_id());
        const int64_t since = std::max(run.launched_ms, run.actor_seen_ms.count(id) ? run.actor_seen_ms[id] : 0);
        if (w != workers.end() && w->second.state() == WORKER_ALIVE && now - since > options_.actor_lost_after_ms) {
          faults.push_back(
              {job_id, run.attempt,
               absl::StrCat("actor ", id, " is gone from worker ", p.actor.worker_id(), " (the worker restarted?)"),
               id});
          break;
        }
      }
      if (completed_here) {
        QueueSteps(run, StepAggregator::CompleteEarlier(run, std::numeric_limits<int64_t>::max()));
        succeeded.push_back(job_id);
      }
    }
  }
  for (const auto& [job_id, attempt, cause, actor] : faults) recovery_.Fault(job_id, attempt, cause, false, actor);
  for (const std::string& job_id : succeeded) {
    RecordSteps(job_id);  // before the end: the last steps precede it in the job's record
    EndJob(job_id, JOB_SUCCEEDED, "every actor finished");
  }
}

void JobRunner::StopJob(const std::string& job_id, const std::string& reason) {
  std::vector<ActorPlacement> actors;
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(job_id);
    if (it == runs_.by_job.end()) return;
    it->second.phase = RunPhase::kEnded;
    actors = it->second.actors;
  }
  launcher_.StopActors(actors, reason, /*wait=*/false);
  RecordFinalActorStates(job_id, JOB_CANCELLED, reason);
  aggregator_.JobEnded(job_id);  // its liveness series go now; the others after their last scrape
}

std::vector<ActorRecord> JobRunner::Actors(const std::string& job_id) const {
  absl::MutexLock lock(&runs_.mu);
  std::vector<ActorRecord> out;
  auto it = runs_.by_job.find(job_id);
  if (it == runs_.by_job.end()) return out;
  for (const ActorPlacement& p : it->second.actors) out.push_back(p.actor);
  return out;
}

JobRunner::StepAdded JobRunner::AddStepReport(JobRun& run, const StepReport& report) {
  StepAdded out;
  std::optional<StepAggregate> complete = StepAggregator::Add(run, report);
  if (!complete) return out;
  out.recovery = recovery_.MeasureRecovery(run, report.step());
  QueueSteps(run, StepAggregator::CompleteEarlier(run, report.step()));
  run.to_record.push_back(*std::move(complete));
  const int64_t now = clock_->NowMillis();
  NoteCompleteStep(run.progress, now);
  RunRegroup& g = run.regroup;
  g.waiting_since_ms = 0;  // an actor still waiting probes again within 0.1 s
  if (g.paused_from_ms > 0 && g.confirmed) {
    out.healthy_pause = static_cast<double>(now - g.paused_from_ms) / 1000;
    g.paused_from_ms = 0;
  }
  if (run.heal.joined && g.confirmed && report.step() >= run.heal.first_step) {
    out.heal_seconds = static_cast<double>(now - run.heal.fault_detected_ms) / 1000;
    run.heal = RunHeal{};  // done: the healed replicas trained their first step
  }
  return out;
}

void JobRunner::RecordSteps(const std::string& job_id) {
  absl::MutexLock record_lock(&record_mu_);
  std::vector<StepAggregate> steps;
  std::string wan_codec;
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(job_id);
    if (it == runs_.by_job.end()) return;
    steps.swap(it->second.to_record);
    wan_codec = it->second.spec.comm().wan_codec();
  }
  for (const StepAggregate& step : steps) aggregator_.RecordStep(job_id, step, wan_codec);
}

void JobRunner::RecordAllSteps() {
  std::vector<std::string> jobs;
  {
    absl::MutexLock lock(&runs_.mu);
    for (const auto& [job_id, run] : runs_.by_job) {
      if (!run.to_record.empty()) jobs.push_back(job_id);
    }
  }
  for (const std::string& job_id : jobs) RecordSteps(job_id);
}

ReportStepReply JobRunner::OnStepReport(const StepReport& report) {
  if (report.regroup_waiting()) return OnRegroupReport(report);
  if (report.heal_ready() || !report.error().empty()) {
    if (std::optional<ReportStepReply> reply = OnHealReport(report)) return *reply;  // a heal's new actor's
  }
  if (!report.unreachable_peer().empty()) return OnUnreachableReport(report);
  ReportStepReply reply;
  bool finished = false, failed = false;
  bool newly_done = false;  // this report is its actor's last
  std::optional<JobRecovery::Recovery> recovery;
  CheckpointCommitter::Gathered gathered;
  DrainNews drain;
  bool draining = false;
  double healthy_pause = -1;  // the first complete step after a regroup: the healthy replicas' pause
  double heal_seconds = -1;   // the healed replicas' first complete step: the heal's cost
  HealNews heal;
  struct {
    std::vector<int> kept;
    std::vector<ActorPlacement> staying;
    int64_t epoch = 0;  // > 0: a drain's leave by regroup began with this report
    int planned = 0;
    std::string cause;
  } planned_regroup;
  JobSpec spec;
  int64_t attempt = 0;
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(report.job_id());
    if (it == runs_.by_job.end()) {  // unknown (e.g. a head restart without its state): stop
      reply.set_stop(true);
      return reply;
    }
    JobRun& run = it->second;
    // An earlier run's actor (stopped for a restart), or a job that ended: stop.
    if (run.phase == RunPhase::kEnded || report.attempt() != run.attempt) {
      reply.set_stop(true);
      return reply;
    }
    // A fault is being handled: the actors are being stopped. (A live regroup keeps some: a step report of theirs
    // missed here is recorded with the others' once a later step completes, StepAggregator::CompleteEarlier.)
    if (run.phase != RunPhase::kRunning) return reply;
    FillRunReply(run, &reply);
    // An actor of a replica that left a live regroup: the membership in the reply tells it to leave. Never `stop`:
    // its peers would take that as the whole job stopping.
    if (!InRun(run, report.actor_id())) return reply;
    // An actor at the drain's (or heal's) step asks whether to stop: the reply (FillRunReply above) tells it; nothing
    // else to do.
    if (report.drain_waiting() || report.heal_waiting()) return reply;

    spec = run.spec;
    attempt = run.attempt;
    if (!report.error().empty()) {
      failed = true;
      run.actor_errors[report.actor_id()] = report.error();
    } else if (report.step() > 0) {
      const StepAdded added = AddStepReport(run, report);
      recovery = added.recovery;
      healthy_pause = added.healthy_pause;
      heal_seconds = added.heal_seconds;
      heal = ApplyHealStep(run, report, clock_->NowMillis());
    }
    StepAggregator::ForgetStale(run, report.step());
    if (report.done()) newly_done = run.done.insert(report.actor_id()).second;
    finished = AllActorsDone(run);
    // The steps whose reports never all came (CompleteEarlier): the last step has no later one to complete them.
    if (finished) QueueSteps(run, StepAggregator::CompleteEarlier(run, std::numeric_limits<int64_t>::max()));
    gathered = CheckpointCommitter::Gather(run, report);
    draining = !run.drain.workers.empty();
    if (draining && !failed) drain = ApplyDrainReport(run, report);
    if (drain.confirmed && !run.drain.kept.empty()) {
      // A leave by regroup: every actor stops at T; the kept replicas' actors rebuild for the membership without the
      // draining workers' replicas (they learn it with the confirmation), the others leave.
      RegroupBegun begun =
          BeginRegroup(run, run.drain.kept, absl::StrCat(DrainSubject(run.drain), " (a leave)"), clock_->NowMillis());
      planned_regroup = {run.drain.kept, run.actors, run.regroup.epoch, run.spec.parallel().dp(),
                         DrainSubject(run.drain)};
      QueueSteps(run, std::move(begun.completed));
    }
    FillRunReply(run, &reply);
  }
  if (planned_regroup.epoch > 0) {
    recovery_.RecordRegroup(report.job_id(), planned_regroup.staying, planned_regroup.kept, planned_regroup.planned,
                            planned_regroup.epoch, planned_regroup.cause);
  }
  // What a restarted head needs to go on: the actors whose last report it has (whether or not their workers still
  // list them) and the shards of checkpoints not yet complete. One write for both.
  if (newly_done || gathered.persist) {
    LogIfFailed(jobs_
                    ->Update(report.job_id(),
                             [&](JobInfo& j) {
                               if (newly_done) j.add_done_actors(report.actor_id());
                               if (!gathered.persist) return;
                               j.clear_pending_shards();
                               for (const CheckpointShard& s : gathered.pending) *j.add_pending_shards() = s;
                             })
                    .status(),
                report.job_id(), "recording the actor's last report and checkpoint shards");
  }
  if (failed) {
    recovery_.Fault(report.job_id(), attempt, absl::StrCat("actor ", report.actor_id(), " failed: ", report.error()),
                    report.permanent(), report.actor_id());
    reply.set_stop(true);
    return reply;
  }
  committer_.Commit(report.job_id(), spec, gathered);
  RecordSteps(report.job_id());
  if (recovery) recovery_.RecordRecovery(report.job_id(), *recovery);
  if (healthy_pause >= 0) RecordRegroupPause(report.job_id(), report.step(), healthy_pause);
  if (heal_seconds >= 0) RecordHealSeconds(report.job_id(), report.step(), heal_seconds);
  AfterHealNews(report.job_id(), heal);
  if (draining) AfterDrainReport(report.job_id(), attempt, drain, gathered);
  if (finished) EndJob(report.job_id(), JOB_SUCCEEDED, absl::StrCat("finished ", report.step(), " steps"));
  return reply;
}

void JobRunner::CheckDrains() {
  std::set<std::string> draining;
  for (const WorkerInfo& w : registry_->Workers()) {
    if (w.draining() && w.state() == WORKER_ALIVE) draining.insert(w.worker_id());
  }
  std::vector<std::tuple<std::string, int64_t, std::string>> starts;  // job, attempt, worker
  struct GiveUp {
    std::string job_id, subject, workers;
    int64_t attempt, target, started_ms;
  };
  std::vector<GiveUp> give_ups;
  const int64_t now = clock_->NowMillis();
  {
    absl::MutexLock lock(&runs_.mu);
    for (const auto& [job_id, run] : runs_.by_job) {
      if (run.phase != RunPhase::kRunning) continue;
      const RunDrain& d = run.drain;
      if (!d.workers.empty() && !d.handed_over && !d.ends_first && now - d.started_ms > options_.drain_timeout_ms) {
        give_ups.push_back({job_id, DrainSubject(d), DrainingWorkers(d), run.attempt, d.target, d.started_ms});
        continue;
      }
      for (const ActorPlacement& p : run.actors) {
        const std::string& worker = p.actor.worker_id();
        if (draining.count(worker) && !run.done.count(p.actor.actor_id()) && !d.workers.count(worker)) {
          starts.push_back({job_id, run.attempt, worker});
        }
      }
    }
  }
  for (const auto& [job_id, attempt, worker] : starts) StartDrain(job_id, attempt, worker);
  for (const GiveUp& g : give_ups) {
    recovery_.Leave(g.job_id, g.attempt,
                    absl::StrFormat("%s: the actors did not all leave at step %d within %.0f s; restarting without "
                                    "%s from the newest checkpoint",
                                    g.subject, g.target, options_.drain_timeout_ms / 1000.0, g.workers),
                    g.workers, g.started_ms, /*stop_actors=*/true);
  }
}

void JobRunner::StartDrain(const std::string& job_id, int64_t attempt, const std::string& worker_id) {
  absl::StatusOr<JobInfo> job = jobs_->Get(job_id);
  if (!job.ok()) return;
  std::string dir = job->spec().checkpoint().dir();
  const bool timed = job->timed_compute();
  if (dir.empty() && !timed && !options_.drain_checkpoint_root.empty()) {
    // A job without checkpoint.dir: the drain's checkpoint goes under the head's state dir, and stays its dir (the
    // staging service takes its files there, the restart resumes from there).
    dir = absl::StrCat(options_.drain_checkpoint_root, "/", job_id);
    absl::StatusOr<JobInfo> updated =
        jobs_->Update(job_id, [&](JobInfo& j) { j.mutable_spec()->mutable_checkpoint()->set_dir(dir); });
    if (!updated.ok()) {
      LogIfFailed(updated.status(), job_id, "giving the job a checkpoint dir for its drain");
      return;  // tried again on the next look
    }
    LogIfFailed(jobs_->Log(job_id, absl::StrCat("the job has no checkpoint.dir: its drain's checkpoint goes to ", dir,
                                                " (its checkpoint.dir from now on)")),
                job_id, "logging");
  }
  bool fresh = false, ends_first = false;
  int64_t target = 0;
  std::string workers;
  std::vector<int> kept;  // a leave by regroup: the replicas that train on
  const WorkersById by_id = ById(registry_->Workers());
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(job_id);
    if (it == runs_.by_job.end() || it->second.attempt != attempt || it->second.phase != RunPhase::kRunning) return;
    JobRun& run = it->second;
    if (!dir.empty()) run.spec.mutable_checkpoint()->set_dir(dir);  // the committer writes the manifest there
    const bool needs_checkpoint = !timed && !dir.empty();
    fresh = BeginDrain(run, worker_id, dir, needs_checkpoint, clock_->NowMillis());
    // Other replicas with no actor on a draining worker train on after T without a restart: no checkpoint needed.
    run.drain.kept = DrainKeeps(run, by_id);
    run.drain.needs_checkpoint = run.drain.kept.empty() && needs_checkpoint;
    kept = run.drain.kept;
    ends_first = run.drain.ends_first;
    target = run.drain.target;
    workers = DrainingWorkers(run.drain);
  }
  std::string line;
  if (!kept.empty() && !ends_first) {
    line = absl::StrCat(
        fresh ? absl::StrCat("worker ", worker_id, " drains") : absl::StrCat("workers ", workers, " drain"),
        ": the replicas with an actor there leave after step ", target, "; replicas ", absl::StrJoin(kept, ", "),
        " train on without a restart");
  } else if (!fresh) {
    line = absl::StrCat("worker ", worker_id, " drains too: the job restarts without ", workers);
  } else if (ends_first) {
    line = absl::StrCat("worker ", worker_id, " drains: the job ends at step ", job->spec().train().steps(),
                        " before its actors could leave; they leave with it");
  } else {
    line = absl::StrCat(
        "worker ", worker_id, " drains: its actors leave at step ", target,
        timed         ? "; the job restarts without it from step 1 (timed compute has no weights)"
        : dir.empty() ? "; the job restarts without it from its start (no checkpoint dir)"
                      : absl::StrCat(" with a checkpoint of it; the job restarts without ", worker_id, " from there"));
  }
  LogIfFailed(jobs_->Log(job_id, line), job_id, "logging");
}

void JobRunner::AfterDrainReport(const std::string& job_id, int64_t attempt, const DrainNews& news,
                                 const CheckpointCommitter::Gathered& gathered) {
  int64_t target = 0;
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(job_id);
    if (it == runs_.by_job.end() || it->second.attempt != attempt) return;
    target = it->second.drain.target;
  }
  if (news.repicked) {
    LogIfFailed(
        jobs_->Log(job_id, absl::StrCat("actor ", news.passed_actor, " finished step ", news.passed_step,
                                        " before it learned of the drain's step ", news.old_target, ": ",
                                        target > 0 ? absl::StrCat("the actors leave at step ", target, " instead")
                                                   : std::string("the job ends before they could leave"))),
        job_id, "logging");
  }
  if (news.confirmed) {
    LogIfFailed(jobs_->Log(job_id, absl::StrCat("every actor knew step ", target, " in time: they leave after it")),
                job_id, "logging");
  }
  bool committed = false;
  for (const auto& [step, shards] : gathered.ready) {
    if (step != target) continue;
    // CommitCheckpoint wrote the manifest (the job's newest checkpoint moved on), or it failed (logged).
    absl::StatusOr<JobInfo> job = jobs_->Get(job_id);
    committed = job.ok() && job->last_checkpoint_step() >= target;
  }
  std::string subject, workers;
  bool ready = false, needs_checkpoint = true;
  int64_t started_ms = 0;
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(job_id);
    if (it == runs_.by_job.end() || it->second.attempt != attempt || it->second.phase != RunPhase::kRunning) return;
    RunDrain& d = it->second.drain;
    d.committed = d.committed || committed;
    ready = DrainReady(it->second) || (news.broken && !d.handed_over);
    if (ready) d.handed_over = true;  // one report hands it over
    subject = DrainSubject(d);
    workers = DrainingWorkers(d);
    needs_checkpoint = d.needs_checkpoint;
    started_ms = d.started_ms;
  }
  if (!ready) return;
  if (news.broken) {
    recovery_.Leave(
        job_id, attempt,
        absl::StrCat(subject, ": actor ", news.passed_actor, " passed step ", target,
                     " after every actor knew it; restarting without ", workers, " from the newest checkpoint"),
        workers, started_ms, /*stop_actors=*/true);
    return;
  }
  recovery_.Leave(
      job_id, attempt,
      needs_checkpoint
          ? absl::StrCat(subject, ": checkpoint at step ", target, " committed; restarting without ", workers)
          : absl::StrCat(subject, ": every actor left at step ", target, "; restarting without ", workers),
      workers, started_ms, /*stop_actors=*/false);
}

}  // namespace geotrain::head
