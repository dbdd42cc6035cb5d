// The head's job table and each job's state machine:
//
//   PENDING ──▶ RUNNING ──▶ SUCCEEDED | FAILED | CANCELLED
//      │          ▲   │
//      │          │   ▼
//      │        RESTARTING ──▶ FAILED | CANCELLED      (a fault; the job resumes from its checkpoint)
//      └──────────────────▶ FAILED | CANCELLED
//
// Terminal states are final. Every change is persisted (HeadStore) before it is visible; a state change
// and its event in the job's log (which WatchJob streams) are written in one transaction. A failed write is
// retried; if it still fails the call returns UNAVAILABLE with the cause and the fix, and nothing changes in
// memory: the head never reports a job in a state it is not in. The job runner (head/job_runner.h) moves jobs along.
//
// Thread-safety: all methods may be called from any thread; WaitEvents blocks on a condition variable
// that every new event signals.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/names.h"
#include "control.pb.h"
#include "head/store.h"

namespace geotrain::head {

class JobManager {
 public:
  JobManager(const Clock* clock, HeadStore* store);

  // Loads jobs and the event sequence from the store.
  absl::Status Restore();

  // Validates and records a new job in PENDING. `source` names the spec file in errors.
  absl::StatusOr<JobInfo> Submit(JobSpec spec, const std::string& source);
  absl::StatusOr<JobInfo> Get(const std::string& job_id) const;
  std::vector<JobInfo> List() const;
  // Cancels a job that has not ended; cancelling an ended job is FAILED_PRECONDITION with its state.
  absl::StatusOr<JobInfo> Cancel(const std::string& job_id);
  // Moves a job to `to`; refuses transitions the state machine does not allow.
  absl::StatusOr<JobInfo> Transition(const std::string& job_id, JobState to, const std::string& message);
  // Replaces the job's plan (after the planner chose one for `plan: auto`) and records the predicted
  // step time; persisted.
  absl::Status SetPlan(const std::string& job_id, const ParallelSpec& parallel, double predicted_step_seconds);
  // Changes the job's record with `mutate` and persists it (anything but the job id and the state, which
  // only Transition changes). Returns the updated record.
  absl::StatusOr<JobInfo> Update(const std::string& job_id, const std::function<void(JobInfo&)>& mutate);
  // Records the job's actors (placement) and its progress after a step; both persisted.
  absl::Status SetActors(const std::string& job_id, const std::vector<ActorRecord>& actors);
  // A step event carries `figures` (its step, loss, tokens/s and step time become the job's progress).
  absl::Status UpdateProgress(const std::string& job_id, const StepFigures& figures, const std::string& line);
  // Appends a log line to the job's event stream.
  absl::Status Log(const std::string& job_id, const std::string& line);
  // A pending job's reason to wait (`why`) becomes its message, and a log line when it changed; in one step with the
  // check that the job is still pending, so that a job cancelled meanwhile keeps its message and gets no line after
  // its last state. Nothing to do otherwise.
  absl::Status NoteWaiting(const std::string& job_id, const std::string& why);

  // Events of `job_id` with seq > after_seq (at most `limit` of them when > 0: the first, or with `newest` the
  // last; HeadStore::LoadEvents); waits up to timeout_ms for at least one when there are none and the job has not
  // ended. `ended` tells whether the job is in a terminal state.
  absl::StatusOr<std::vector<JobEvent>> WaitEvents(const std::string& job_id, int64_t after_seq, int64_t timeout_ms,
                                                   bool* ended, int64_t limit = 0, bool newest = false);

  std::map<JobState, int> CountByState() const;

  // The last failure to write the state (OK once a write succeeds again), for metrics and status.
  absl::Status store_error() const;

 private:
  JobEvent MakeEventLocked(const JobInfo& job, const std::string& kind, const std::string& line,
                           const StepFigures* figures = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs a store write with retries (50 ms, 250 ms); UNAVAILABLE naming the cause and the fix when every try
  // failed (e.g. a full disk). Nothing in memory changes unless it succeeded.
  absl::Status Persist(const std::function<absl::Status()>& write) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Persists `updated` and a new event about it (with `figures` on step events) in one transaction, then makes
  // both visible.
  absl::StatusOr<JobInfo> CommitLocked(JobInfo updated, const std::string& kind, const std::string& line,
                                       const StepFigures* figures = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock* clock_;
  HeadStore* store_;

  mutable absl::Mutex mu_;
  std::map<std::string, JobInfo> jobs_ ABSL_GUARDED_BY(mu_);
  int64_t next_job_number_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t last_seq_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, int64_t> last_seq_of_job_ ABSL_GUARDED_BY(mu_);  // each job's newest event logged by this head
  absl::Status store_error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain::head
