// The job runner's fault and recovery policy (see job_recovery.h).
#include "head/job_recovery.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/names.h"
#include "common/status.h"
#include "head/job_regroup.h"
#include "model/checkpoint_files.h"

namespace geotrain::head {
namespace {

// The restart's figures in the job's last fault (where it resumed, the steps lost), and the steps lost counted.
void RecordRestart(JobManager* jobs, StepAggregator* metrics, const std::string& job_id, const std::string& resume_from,
                   int64_t fault_step, bool fault) {
  int64_t resumed_step = 0;
  if (!resume_from.empty()) {
    if (auto manifest = model::VerifyCheckpoint(resume_from); manifest.ok()) resumed_step = manifest->step();
  }
  const int64_t lost = std::max<int64_t>(0, fault_step - resumed_step);
  if (lost > 0) metrics->CountStepsLost(job_id, lost);
  if (!fault) return;
  LogIfFailed(jobs->Update(job_id,
                           [&](JobInfo& j) {
                             if (j.faults_size() == 0) return;
                             FaultRecord* f = j.mutable_faults(j.faults_size() - 1);
                             f->set_resumed_from(resume_from);
                             f->set_resumed_step(resumed_step);
                             f->set_steps_lost(lost);
                           })
                  .status(),
              job_id, "recording the restart");
}

}  // namespace

// A fault as the control thread takes it from the run (HandleFaults).
struct JobRecovery::PendingFault {
  std::string job_id, cause;
  std::vector<ActorPlacement> actors;
  int restarts = 0;
  int64_t step = 0, detected_unix_ms = 0, attempt = 0;
  bool permanent = false;
  bool no_regroup = false;      // restart even where the replicas left could train on
  bool leave = false;           // a drain's restart without its workers (Leave)
  bool all_left = false;        // a leave's: every actor left by itself (none to stop)
  std::string leaving_workers;  // a leave's workers, and when its drain began (unix ms)
  int64_t leave_started_unix_ms = 0;
};

JobRecovery::JobRecovery(JobManager* jobs, WorkerRegistry* registry, JobRuns* runs, ActorLauncher* launcher,
                         StepAggregator* metrics, RunControl* control, const Clock* clock)
    : jobs_(jobs),
      registry_(registry),
      runs_(runs),
      launcher_(launcher),
      metrics_(metrics),
      control_(control),
      clock_(clock) {}

void JobRecovery::Restore() {
  const WorkersById workers = ById(registry_->Workers());
  const int64_t now = clock_->NowMillis();
  std::vector<std::pair<std::string, std::string>> lines;
  const std::vector<JobInfo> jobs = jobs_->List();
  {
    absl::MutexLock lock(&runs_->mu);
    for (const JobInfo& job : jobs) {
      if (job.state() != JOB_RUNNING && job.state() != JOB_RESTARTING) continue;
      lines.push_back({job.job_id(), absl::StrCat("the head restarted: it takes the job over (run ", job.attempt(),
                                                  ", step ", job.step(), ")")});
      JobRun& run = runs_->by_job[job.job_id()];
      run.spec = job.spec();
      run.attempt = job.attempt();
      run.restarts = job.restarts();
      run.last_step = job.step();
      run.last_checkpoint_step = job.last_checkpoint_step();
      run.resumed_from = job.resumed_from();
      run.regroup.epoch = job.epoch();  // the membership its actors train in after live regroups
      run.regroup.replicas.assign(job.present_replicas().begin(), job.present_replicas().end());
      run.regroup.resume_step = job.regroup_resume_step();
      if (job.epoch() > 0 && job.regroup_resume_step() == 0) {  // it was forming: its actors report ready again
        run.regroup.confirmed = false;
        run.regroup.detected_ms = now;
      }
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
        run.phase = RunPhase::kRecovering;
        run.fault_cause = job.message();
        run.fault_detected_ms = now;
        run.fault_unix_ms = clock_->UnixMillis();
        run.fault_step = job.step();
        if (!job.leaving_workers().empty()) {  // a leave's restart: still no fault, its cost from the drain's start
          run.leaving = true;
          run.leaving_workers = job.leaving_workers();
          run.leave_started_unix_ms = job.leave_started_unix_ms();
          run.fault_detected_ms = now - std::max<int64_t>(0, run.fault_unix_ms - job.leave_started_unix_ms());
        }
      }
      GT_LOG(INFO) << "job " << job.job_id() << " (" << JobStateName(job.state()) << ", run " << run.attempt
                   << ", step " << run.last_step << ") taken over from the previous head";
    }
  }
  for (const auto& [job_id, line] : lines) LogIfFailed(jobs_->Log(job_id, line), job_id, "logging");
}

void JobRecovery::OnWorkerDead(const WorkerInfo& worker) {
  std::vector<std::pair<std::string, int64_t>> hit;
  {
    absl::MutexLock lock(&runs_->mu);
    for (auto& [job_id, run] : runs_->by_job) {
      if (run.phase != RunPhase::kRunning) continue;
      for (const ActorPlacement& p : run.actors) {
        // An actor that left for a drain is not lost with its worker (which exits once its actors are gone).
        if (p.actor.worker_id() == worker.worker_id() && !run.done.count(p.actor.actor_id()) &&
            !run.drain.left.count(p.actor.actor_id())) {
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

JobRun* JobRecovery::MarkFault(const std::string& job_id, int64_t attempt, const std::string& cause) {
  auto it = runs_->by_job.find(job_id);
  if (it == runs_->by_job.end() || it->second.attempt != attempt || it->second.phase != RunPhase::kRunning) {
    return nullptr;
  }
  JobRun& run = it->second;
  run.phase = RunPhase::kFault;
  run.fault_cause = cause;
  run.fault_permanent = false;
  run.fault_no_regroup = false;
  run.fault_detected_ms = clock_->NowMillis();
  run.fault_unix_ms = clock_->UnixMillis();
  run.fault_step = run.last_step;
  run.leaving = false;
  runs_->kicked = true;
  return &run;
}

void JobRecovery::Fault(const std::string& job_id, int64_t attempt, const std::string& cause, bool permanent,
                        const std::string& lost_actor, bool no_regroup) {
  {
    absl::MutexLock lock(&runs_->mu);
    JobRun* run = MarkFault(job_id, attempt, cause);
    if (run == nullptr) return;
    run->fault_permanent = permanent;
    run->fault_no_regroup = no_regroup;
    if (!lost_actor.empty()) run->regroup.lost_actors.insert(lost_actor);
  }
  GT_LOG(WARNING) << "job " << job_id << " (run " << attempt << "): fault: " << cause;
}

void JobRecovery::Leave(const std::string& job_id, int64_t attempt, const std::string& cause,
                        const std::string& workers, int64_t started_ms, bool stop_actors) {
  {
    absl::MutexLock lock(&runs_->mu);
    JobRun* found = MarkFault(job_id, attempt, cause);
    if (found == nullptr) return;
    JobRun& run = *found;
    run.fault_detected_ms = started_ms;  // a leave's cost counts from the drain's start
    run.leaving = true;
    run.leaving_workers = workers;
    run.leave_started_unix_ms = clock_->UnixMillis() - (clock_->NowMillis() - started_ms);
    run.drain.handed_over = true;
    run.drain.gave_up = stop_actors;  // HandleLeave stops the actors then
  }
  GT_LOG(INFO) << "job " << job_id << " (run " << attempt << "): leaves " << workers << ": " << cause;
}

void JobRecovery::HandleFaults() {
  std::vector<PendingFault> pending;
  {
    absl::MutexLock lock(&runs_->mu);
    for (auto& [job_id, run] : runs_->by_job) {
      if (run.phase != RunPhase::kFault) continue;
      pending.push_back({job_id, run.fault_cause, run.actors, run.restarts, run.fault_step, run.fault_unix_ms,
                         run.attempt, run.fault_permanent, run.fault_no_regroup, run.leaving,
                         run.leaving && !run.drain.gave_up, run.leaving_workers, run.leave_started_unix_ms});
    }
  }
  for (const PendingFault& p : pending) HandleFault(p);
}

void JobRecovery::HandleFault(const PendingFault& p) {
  if (p.leave) {
    HandleLeave(p);
    return;
  }
  absl::StatusOr<JobInfo> job = jobs_->Get(p.job_id);
  if (!job.ok()) return;
  const FaultToleranceSpec& ft = job->spec().fault_tolerance();
  const int max_restarts = ft.has_max_restarts() ? ft.max_restarts() : 3;
  if (p.permanent) {
    control_->EndJob(p.job_id, JOB_FAILED,
                     absl::StrCat(p.cause, "; not restarted: the error is in the job (its spec, data or checkpoint) ",
                                  "and a restart would fail the same way; fix it and submit the job again"));
    return;
  }
  if (!p.no_regroup && TryRegroup(p)) return;
  if (max_restarts >= 0 && p.restarts >= max_restarts) {
    control_->EndJob(p.job_id, JOB_FAILED,
                     max_restarts == 0 ? p.cause
                                       : absl::StrCat(p.cause, "; no restart left (fault_tolerance.max_restarts ",
                                                      max_restarts, ")"));
    return;
  }
  FaultRecord fault;
  fault.set_cause(p.cause);
  fault.set_detected_unix_ms(p.detected_unix_ms);
  fault.set_step(p.step);
  fault.set_attempt(p.attempt + 1);
  LogIfFailed(jobs_
                  ->Update(p.job_id,
                           [&](JobInfo& j) {
                             *j.add_faults() = fault;
                             j.set_restarts(p.restarts + 1);
                             j.clear_leaving_workers();  // a fault during a leave's restart: a fault's restart now
                             j.clear_leave_started_unix_ms();
                           })
                  .status(),
              p.job_id, "recording the fault");
  if (!MoveToRestarting(p,
                        absl::StrCat(p.cause, "; restarting (", p.restarts + 1, " of ",
                                     max_restarts < 0 ? std::string("unlimited") : absl::StrCat(max_restarts), ")"))) {
    return;
  }
  metrics_->CountRestart(p.job_id);
  // The surviving actors stop now (their receives end at once), before the next run is placed.
  launcher_->StopActors(p.actors, absl::StrCat("the job is restarting: ", p.cause), /*wait=*/true);
  Recovering(p, /*restarts=*/p.restarts + 1);
}

bool JobRecovery::TryRegroup(const PendingFault& p) {
  const WorkersById workers = ById(registry_->Workers());
  std::vector<ActorPlacement> leaving, staying;
  std::vector<int> kept;
  int planned = 0;
  int64_t epoch = 0;
  std::string why;
  {
    absl::MutexLock lock(&runs_->mu);
    auto it = runs_->by_job.find(p.job_id);
    if (it == runs_->by_job.end() || it->second.phase != RunPhase::kFault || it->second.attempt != p.attempt) {
      return false;
    }
    JobRun& run = it->second;
    if (!RegroupEligible(run, workers, &why)) {
      GT_LOG(INFO) << "job " << p.job_id << ": no live regroup (" << why << "): restarting";
      return false;
    }
    std::set<std::string> lost = run.regroup.lost_actors;
    for (const auto& [actor, error] : run.actor_errors) lost.insert(actor);
    kept = RegroupKept(run, workers, lost);
    if (kept.empty() || !RegroupMakesProgress(run, kept)) return false;
    planned = run.spec.parallel().dp();
    RegroupBegun begun = BeginRegroup(run, kept, p.cause, run.fault_detected_ms);
    leaving = std::move(begun.leaving);
    // Recorded by the control thread after HandleFaults (JobRunner::RecordAllSteps), in order with the others.
    QueueSteps(run, std::move(begun.completed));
    staying = run.actors;
    epoch = run.regroup.epoch;
    runs_->kicked = true;
  }
  const std::string degraded = RecordRegroup(p.job_id, staying, kept, planned, epoch, p.cause);
  std::set<int> left_replicas;
  for (const ActorPlacement& a : leaving) left_replicas.insert(a.actor.replica());
  LogIfFailed(jobs_->Log(p.job_id, absl::StrCat("fault: ", p.cause, "; ", degraded, ": replica",
                                                left_replicas.size() == 1 ? " " : "s ",
                                                absl::StrJoin(left_replicas, ", "), " left (membership ", epoch, ")")),
              p.job_id, "logging");
  GT_LOG(WARNING) << "job " << p.job_id << " (run " << p.attempt << "): " << p.cause << "; " << degraded;
  // The survivors' step in flight ends (its receives cancelled); the leaving actors still alive stop, their peers told
  // that they failed, not that the job stopped.
  launcher_->InterruptActors(staying, epoch);
  launcher_->StopActors(leaving, absl::StrCat("the job goes on without this replica: ", p.cause), /*wait=*/false,
                        /*job_goes_on=*/true);
  return true;
}

std::string JobRecovery::RecordRegroup(const std::string& job_id, const std::vector<ActorPlacement>& staying,
                                       const std::vector<int>& kept, int planned, int64_t epoch,
                                       const std::string& cause) {
  const std::string degraded = absl::StrCat(kept.size(), " of ", planned, " replicas train on (",
                                            absl::StrJoin(kept, ", "), ") without a restart");
  std::vector<ActorRecord> records;
  for (const ActorPlacement& a : staying) records.push_back(a.actor);
  LogIfFailed(jobs_->SetActors(job_id, records), job_id, "recording the actors left");
  LogIfFailed(jobs_
                  ->Update(job_id,
                           [&](JobInfo& j) {
                             j.mutable_replicas()->set_present(static_cast<int>(kept.size()));
                             j.mutable_replicas()->set_planned(planned);
                             j.set_regroups(j.regroups() + 1);
                             j.set_epoch(epoch);
                             j.set_regroup_resume_step(0);  // forming
                             j.clear_present_replicas();
                             for (int r : kept) j.add_present_replicas(r);
                             j.set_message(absl::StrCat("RUNNING, degraded: ", degraded, "; after: ", cause));
                             // A leaving actor's last report no longer counts (a restarted head restores these).
                             std::set<std::string> staying_ids;
                             for (const ActorRecord& a : records) staying_ids.insert(a.actor_id());
                             std::vector<std::string> done(j.done_actors().begin(), j.done_actors().end());
                             j.clear_done_actors();
                             for (const std::string& id : done) {
                               if (staying_ids.count(id)) j.add_done_actors(id);
                             }
                           })
                  .status(),
              job_id, "recording the regroup");
  metrics_->CountRegroup(job_id, static_cast<int>(kept.size()));
  return degraded;
}

bool JobRecovery::MoveToRestarting(const PendingFault& p, const std::string& message) {
  auto moved = jobs_->Transition(p.job_id, JOB_RESTARTING, message);
  if (!moved.ok() && moved.status().code() == absl::StatusCode::kUnavailable) {
    LogIfFailed(moved.status(), p.job_id, "moving to RESTARTING (will retry)");  // the fault stays to be handled
    return false;
  }
  if (!moved.ok()) {  // cancelled meanwhile
    LogIfFailed(moved.status(), p.job_id, "moving to RESTARTING");
    absl::MutexLock lock(&runs_->mu);
    if (auto it = runs_->by_job.find(p.job_id); it != runs_->by_job.end()) it->second.phase = RunPhase::kEnded;
    return false;
  }
  return true;
}

void JobRecovery::Recovering(const PendingFault& p, int restarts) {
  absl::MutexLock lock(&runs_->mu);
  auto it = runs_->by_job.find(p.job_id);
  if (it == runs_->by_job.end() || it->second.phase != RunPhase::kFault) return;
  it->second.phase = RunPhase::kRecovering;
  it->second.restarts = restarts;
  it->second.waiting_message.clear();
  runs_->kicked = true;
}

void JobRecovery::HandleLeave(const PendingFault& p) {
  if (!MoveToRestarting(p, p.cause)) return;
  LogIfFailed(jobs_
                  ->Update(p.job_id,
                           [&](JobInfo& j) {
                             j.set_leaves(j.leaves() + 1);
                             j.set_leaving_workers(p.leaving_workers);
                             j.set_leave_started_unix_ms(p.leave_started_unix_ms);
                           })
                  .status(),
              p.job_id, "recording the leave");
  metrics_->CountLeave(p.job_id);
  // Actors that left stopped by themselves; those of a drain that gave up are stopped now.
  if (!p.all_left) launcher_->StopActors(p.actors, absl::StrCat("the job is restarting: ", p.cause), /*wait=*/true);
  Recovering(p, /*restarts=*/p.restarts);  // a leave uses no restart
}

absl::StatusOr<std::string> JobRecovery::ResumePoint(const std::string& job_id, const JobSpec& spec) {
  const CheckpointSpec& c = spec.checkpoint();
  std::vector<std::string> skipped;
  absl::StatusOr<std::string> newest = absl::NotFoundError("no checkpoint dir");
  if (!c.dir().empty()) newest = model::FindNewestCheckpoint(c.dir(), &skipped);
  for (const std::string& why : skipped) {
    LogIfFailed(jobs_->Log(job_id, absl::StrCat("skipped a checkpoint that does not verify: ", why)), job_id,
                "logging");
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
      LogIfFailed(jobs_->Log(job_id, absl::StrCat("skipped a checkpoint that does not verify: ", why)), job_id,
                  "logging");
    }
    return from;
  }
  return std::string();
}

void JobRecovery::RecoverJobs() {
  std::vector<std::string> recovering;
  {
    absl::MutexLock lock(&runs_->mu);
    for (auto& [job_id, run] : runs_->by_job) {
      if (run.phase == RunPhase::kRecovering) recovering.push_back(job_id);
    }
  }
  for (const std::string& job_id : recovering) RecoverJob(job_id);
}

void JobRecovery::RecoverJob(const std::string& job_id) {
  absl::StatusOr<JobInfo> job = jobs_->Get(job_id);
  if (!job.ok() || job->state() != JOB_RESTARTING) {
    absl::MutexLock lock(&runs_->mu);
    if (auto it = runs_->by_job.find(job_id); it != runs_->by_job.end() && job.ok() && IsTerminal(job->state())) {
      it->second.phase = RunPhase::kEnded;
    }
    return;
  }
  int64_t attempt, detected_ms, fault_step;
  std::string waiting;
  bool leaving;
  {
    absl::MutexLock lock(&runs_->mu);
    const JobRun& run = runs_->by_job[job_id];
    attempt = run.attempt + 1;
    detected_ms = run.fault_detected_ms;
    fault_step = run.fault_step;
    waiting = run.waiting_message;
    leaving = run.leaving;
  }
  absl::StatusOr<std::string> resume_from = ResumePoint(job_id, job->spec());
  if (!resume_from.ok()) {
    control_->EndJob(job_id, JOB_FAILED, absl::StrCat("cannot restart: ", resume_from.status().message()));
    return;
  }
  absl::Status launched = control_->PlaceAndLaunch(*job, attempt, *resume_from);
  if (launched.ok()) {
    // A leave has no fault record of its own; the steps it lost (a drain that gave up) are counted all the same.
    RecordRestart(jobs_, metrics_, job_id, *resume_from, fault_step, /*fault=*/!leaving);
    return;
  }
  const double waited_s = (clock_->NowMillis() - detected_ms) / 1000.0;
  const double limit_s = job->spec().fault_tolerance().wait_for_workers_s() > 0
                             ? job->spec().fault_tolerance().wait_for_workers_s()
                             : 300.0;
  if (launched.code() == absl::StatusCode::kAborted && waited_s <= limit_s) {
    // An actor could not be created (a worker went away meanwhile): try again on the next look.
    LogIfFailed(jobs_->Log(job_id, absl::StrCat("restart attempt failed: ", launched.message(), "; trying again")),
                job_id, "logging");
  } else if (launched.code() != absl::StatusCode::kUnavailable && launched.code() != absl::StatusCode::kAborted) {
    control_->EndJob(job_id, JOB_FAILED, absl::StrCat("cannot restart: ", launched.message()));
  } else if (waited_s > limit_s) {
    control_->EndJob(job_id, JOB_FAILED,
                     absl::StrFormat("cannot restart: %s after waiting %.0f s (fault_tolerance.wait_for_workers_s); "
                                     "start or rejoin workers, or resubmit with a plan that fits the workers alive",
                                     launched.message(), waited_s));
  } else {
    const std::string why = absl::StrCat("waiting for workers to restart: ", launched.message());
    if (why != waiting) {
      LogIfFailed(jobs_->Log(job_id, why), job_id, "logging");
      absl::MutexLock lock(&runs_->mu);
      runs_->by_job[job_id].waiting_message = why;
    }
  }
}

std::optional<JobRecovery::Recovery> JobRecovery::MeasureRecovery(JobRun& run, int64_t step) const {
  if (run.recovery_measured || step <= run.resumed_step) return std::nullopt;
  run.recovery_measured = true;
  Recovery recovery{(clock_->NowMillis() - run.fault_detected_ms) / 1000.0,
                    std::max<int64_t>(0, run.fault_step - run.resumed_step), run.leaving, run.leaving_workers};
  run.leaving = false;
  return recovery;
}

void JobRecovery::RecordRecovery(const std::string& job_id, const Recovery& recovery) {
  if (recovery.leave) {  // not a fault: its cost in the job's log (docs/reliability.md has the measured figures)
    LogIfFailed(jobs_
                    ->Update(job_id,
                             [](JobInfo& j) {
                               j.clear_leaving_workers();
                               j.clear_leave_started_unix_ms();
                             })
                    .status(),
                job_id, "recording the end of the leave");
    LogIfFailed(jobs_->Log(job_id, absl::StrFormat("training again without %s %.1f s after the drain began; %s",
                                                   recovery.workers, recovery.seconds,
                                                   recovery.steps_lost == 0
                                                       ? std::string("no step lost")
                                                       : absl::StrCat(recovery.steps_lost, " step(s) lost"))),
                job_id, "logging");
    return;
  }
  LogIfFailed(jobs_
                  ->Update(job_id,
                           [&](JobInfo& j) {
                             if (j.faults_size() > 0) {
                               j.mutable_faults(j.faults_size() - 1)->set_recovery_seconds(recovery.seconds);
                             }
                           })
                  .status(),
              job_id, "recording the recovery");
  LogIfFailed(jobs_->Log(job_id, absl::StrFormat("recovered: training again %.1f s after the fault was detected; %d "
                                                 "step(s) lost",
                                                 recovery.seconds, recovery.steps_lost)),
              job_id, "logging");
  metrics_->ObserveRecovery(recovery.seconds);
}

}  // namespace geotrain::head
