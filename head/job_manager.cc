// Job table: submission, the state machine, persistence and the event log.
#include "head/job_manager.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/status.h"

namespace geotrain::head {

namespace {
bool Allowed(JobState from, JobState to) {
  if (from == JOB_PENDING) return to == JOB_RUNNING || to == JOB_FAILED || to == JOB_CANCELLED;
  if (from == JOB_RUNNING) {
    return to == JOB_SUCCEEDED || to == JOB_FAILED || to == JOB_CANCELLED || to == JOB_RESTARTING;
  }
  if (from == JOB_RESTARTING) return to == JOB_RUNNING || to == JOB_FAILED || to == JOB_CANCELLED;
  return false;
}
}  // namespace

JobManager::JobManager(const Clock* clock, HeadStore* store) : clock_(clock), store_(store) {}

absl::Status JobManager::Restore() {
  auto jobs = store_->LoadJobs();
  if (!jobs.ok()) return jobs.status();
  auto seq = store_->MaxEventSeq();
  if (!seq.ok()) return seq.status();
  absl::MutexLock lock(&mu_);
  for (JobInfo& job : *jobs) {
    int64_t number = 0;
    if (std::sscanf(job.job_id().c_str(), "job-%ld", &number) == 1 && number >= next_job_number_) {
      next_job_number_ = number + 1;
    }
    jobs_[job.job_id()] = std::move(job);
  }
  last_seq_ = *seq;
  return absl::OkStatus();
}

JobEvent JobManager::MakeEventLocked(const JobInfo& job, const std::string& kind, const std::string& line,
                                     const StepFigures* figures) {
  JobEvent event;
  event.set_seq(last_seq_ + 1);
  event.set_unix_ms(clock_->UnixMillis());
  event.set_job_id(job.job_id());
  event.set_state(job.state());
  event.set_kind(kind);
  event.set_line(line);
  if (figures != nullptr) *event.mutable_step() = *figures;
  return event;
}

absl::Status JobManager::Persist(const std::function<absl::Status()>& write) {
  absl::Status status;
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (attempt > 0) absl::SleepFor(absl::Milliseconds(attempt == 1 ? 50 : 250));  // a busy or briefly full disk
    status = write();
    if (status.ok()) {
      store_error_ = absl::OkStatus();
      return status;
    }
  }
  store_error_ = status;
  GT_LOG(ERROR) << "the head cannot write its state: " << status;
  return absl::UnavailableError(absl::StrCat(
      "the head cannot write its state (", status.message(),
      "); free space in its --state-dir or fix its permissions. Until then it takes no new job, and every job keeps "
      "the state it had"));
}

absl::StatusOr<JobInfo> JobManager::CommitLocked(JobInfo updated, const std::string& kind, const std::string& line,
                                                 const StepFigures* figures) {
  const JobEvent event = MakeEventLocked(updated, kind, line, figures);
  RETURN_IF_ERROR(Persist([&] { return store_->PutJobWithEvent(updated, event); }));
  last_seq_of_job_[updated.job_id()] = ++last_seq_;
  JobInfo& stored = jobs_[updated.job_id()];
  stored = std::move(updated);
  return stored;
}

absl::StatusOr<JobInfo> JobManager::Submit(JobSpec spec, const std::string& source) {
  ApplyJobDefaults(&spec);
  if (absl::Status s = ValidateJobSpec(spec); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source.empty() ? "" : absl::StrCat(source, ": "), s.message()));
  }
  absl::MutexLock lock(&mu_);
  char id[32];
  std::snprintf(id, sizeof(id), "job-%06ld", static_cast<long>(next_job_number_));
  JobInfo job;
  job.set_job_id(id);
  job.set_name(spec.name());
  job.set_state(JOB_PENDING);
  *job.mutable_spec() = std::move(spec);
  job.set_submitted_unix_ms(clock_->UnixMillis());
  job.set_updated_unix_ms(job.submitted_unix_ms());
  job.set_message("waiting for workers");
  ASSIGN_OR_RETURN(job, CommitLocked(job, "state", absl::StrCat("submitted ", job.name(), ": PENDING")));
  ++next_job_number_;
  GT_LOG(INFO) << "job " << job.job_id() << " (" << job.name() << ") submitted";
  return job;
}

absl::StatusOr<JobInfo> JobManager::Get(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("no job '", job_id, "'; `geotrain job list` shows the jobs"));
  }
  return it->second;
}

std::vector<JobInfo> JobManager::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<JobInfo> out;
  for (const auto& [id, job] : jobs_) out.push_back(job);
  return out;
}

absl::StatusOr<JobInfo> JobManager::Transition(const std::string& job_id, JobState to, const std::string& message) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("no job '", job_id, "'; `geotrain job list` shows the jobs"));
  }
  const JobInfo& job = it->second;
  if (!Allowed(job.state(), to)) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " is ", JobStateName(job.state()), "; it cannot become ", JobStateName(to)));
  }
  JobInfo updated = job;
  updated.set_state(to);
  updated.set_message(message);
  updated.set_updated_unix_ms(clock_->UnixMillis());
  // The state and its event are written together; only then does anyone see the new state.
  ASSIGN_OR_RETURN(JobInfo stored, CommitLocked(std::move(updated), "state",
                                                absl::StrCat(JobStateName(to), message.empty() ? "" : ": ", message)));
  GT_LOG(INFO) << "job " << job_id << " is now " << JobStateName(to) << (message.empty() ? "" : ": ") << message;
  return stored;
}

absl::StatusOr<JobInfo> JobManager::Cancel(const std::string& job_id) {
  return Transition(job_id, JOB_CANCELLED, "cancelled by the user");
}

absl::Status JobManager::SetPlan(const std::string& job_id, const ParallelSpec& parallel,
                                 double predicted_step_seconds) {
  return Update(job_id,
                [&](JobInfo& j) {
                  *j.mutable_spec()->mutable_parallel() = parallel;
                  j.set_predicted_step_seconds(predicted_step_seconds);
                })
      .status();
}

absl::StatusOr<JobInfo> JobManager::Update(const std::string& job_id, const std::function<void(JobInfo&)>& mutate) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  JobInfo updated = it->second;
  mutate(updated);
  updated.set_job_id(job_id);
  updated.set_state(it->second.state());  // states change only through Transition
  updated.set_updated_unix_ms(clock_->UnixMillis());
  RETURN_IF_ERROR(Persist([&] { return store_->PutJob(updated); }));
  it->second = std::move(updated);
  return it->second;
}

absl::Status JobManager::SetActors(const std::string& job_id, const std::vector<ActorRecord>& actors) {
  return Update(job_id,
                [&](JobInfo& j) {
                  j.clear_actors();
                  for (const ActorRecord& a : actors) *j.add_actors() = a;
                })
      .status();
}

absl::Status JobManager::UpdateProgress(const std::string& job_id, const StepFigures& figures,
                                        const std::string& line) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  JobInfo updated = it->second;
  updated.set_step(figures.step());
  updated.set_loss(figures.loss());
  updated.set_timed_compute(figures.timed_compute());
  updated.set_tokens_per_second(figures.tokens_per_second());
  updated.set_measured_step_seconds(figures.step_seconds());
  updated.set_loss_scale(figures.loss_scale());
  if (figures.skipped()) updated.set_skipped_steps(updated.skipped_steps() + 1);
  updated.set_updated_unix_ms(clock_->UnixMillis());
  return CommitLocked(std::move(updated), "step", line, &figures).status();
}

absl::Status JobManager::Log(const std::string& job_id, const std::string& line) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  const JobEvent event = MakeEventLocked(it->second, "log", line);
  RETURN_IF_ERROR(Persist([&] { return store_->AppendEvent(event); }));
  last_seq_of_job_[job_id] = ++last_seq_;
  return absl::OkStatus();
}

absl::Status JobManager::NoteWaiting(const std::string& job_id, const std::string& why) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  if (it->second.state() != JOB_PENDING || it->second.message() == why) return absl::OkStatus();
  JobInfo updated = it->second;
  updated.set_message(why);
  updated.set_updated_unix_ms(clock_->UnixMillis());
  return CommitLocked(std::move(updated), "log", why).status();
}

absl::Status JobManager::store_error() const {
  absl::MutexLock lock(&mu_);
  return store_error_;
}

absl::StatusOr<std::vector<JobEvent>> JobManager::WaitEvents(const std::string& job_id, int64_t after_seq,
                                                             int64_t timeout_ms, bool* ended, int64_t limit,
                                                             bool newest) {
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) {
      return absl::NotFoundError(absl::StrCat("no job '", job_id, "'; `geotrain job list` shows the jobs"));
    }
    // The job's newest event this head logged (a job none was logged for since the head started: the newest of all),
    // so that another job's events do not wake a watcher of this one; the store decides what belongs to this job.
    auto has_news = [this, after_seq, &job_id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      const auto own = last_seq_of_job_.find(job_id);
      return (own != last_seq_of_job_.end() ? own->second : last_seq_) > after_seq || IsTerminal(jobs_[job_id].state());
    };
    mu_.AwaitWithTimeout(absl::Condition(&has_news), absl::Milliseconds(timeout_ms));
    *ended = IsTerminal(it->second.state());
  }
  return store_->LoadEvents(job_id, after_seq, limit, newest);
}

std::map<JobState, int> JobManager::CountByState() const {
  absl::MutexLock lock(&mu_);
  std::map<JobState, int> out;
  for (JobState s : {JOB_PENDING, JOB_RUNNING, JOB_RESTARTING, JOB_SUCCEEDED, JOB_FAILED, JOB_CANCELLED}) out[s] = 0;
  for (const auto& [id, job] : jobs_) ++out[job.state()];
  return out;
}

}  // namespace geotrain::head
