// Background delivery of an actor's step reports (see step_reporter.h).
#include "worker/step_reporter.h"

#include <algorithm>

#include "common/log.h"

namespace geotrain::worker {
namespace {

bool Decisive(const StepReport& r) { return r.done() || !r.error().empty() || r.checkpoints_size() > 0; }

// Errors that retrying cannot fix (a wrong token, a report the head refuses): the report is dropped.
bool Permanent(const absl::Status& s) {
  return s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kUnauthenticated ||
         s.code() == absl::StatusCode::kPermissionDenied || s.code() == absl::StatusCode::kUnimplemented;
}

}  // namespace

StepReporter::StepReporter(HeadClient* head, std::string actor_id, std::function<void()> on_stop,
                           std::function<void(const ReportStepReply&)> on_reply)
    : head_(head),
      actor_id_(std::move(actor_id)),
      on_stop_(std::move(on_stop)),
      on_reply_(std::move(on_reply)),
      thread_([this] { Loop(); }) {}

StepReporter::~StepReporter() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void StepReporter::Enqueue(StepReport report) {
  absl::MutexLock lock(&mu_);
  if (head_ == nullptr) return;
  queue_.push_back(std::move(report));
  if (queue_.size() <= kMaxQueued) return;
  // Drop the oldest plain step report (never the one being sent, never a decisive one).
  for (auto it = queue_.begin() + (sending_ ? 1 : 0); it != queue_.end(); ++it) {
    if (!Decisive(*it)) {
      queue_.erase(it);
      ++dropped_;
      return;
    }
  }
}

void StepReporter::Close() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
}

bool StepReporter::Drain(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(
      absl::Condition(
          +[](StepReporter* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) { return r->queue_.empty(); }, this),
      timeout);
  return queue_.empty();
}

size_t StepReporter::queued() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

int64_t StepReporter::dropped() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

void StepReporter::Loop() {
  absl::Duration backoff = absl::Milliseconds(200);
  int failures = 0;
  while (true) {
    StepReport report;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](StepReporter* r)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) { return r->stopping_ || r->closed_ || !r->queue_.empty(); },
          this));
      if (stopping_ || queue_.empty()) return;  // stopped, or closed with everything delivered
      report = queue_.front();
      sending_ = true;
    }
    absl::StatusOr<ReportStepReply> reply = head_->ReportStep(report, absl::Seconds(5));
    if (reply.ok() && on_reply_) on_reply_(*reply);  // before the report leaves the queue (Drain)
    bool stop = false;
    {
      absl::MutexLock lock(&mu_);
      sending_ = false;
      if (!reply.ok() && Permanent(reply.status())) {
        GT_LOG(ERROR) << "actor " << actor_id_ << ": the head refuses the report of step " << report.step() << ": "
                      << reply.status().message() << "; dropping it";
        queue_.pop_front();
        ++dropped_;
        continue;
      }
      if (reply.ok()) {
        queue_.pop_front();
        stop = reply->stop() && !stop_signalled_;
        stop_signalled_ = stop_signalled_ || reply->stop();
      }
    }
    if (reply.ok()) {
      if (failures > 0) {
        GT_LOG(INFO) << "actor " << actor_id_ << ": the head takes reports again after " << failures
                     << " failed attempt(s)";
      }
      failures = 0;
      backoff = absl::Milliseconds(200);
      if (stop && on_stop_) on_stop_();
      continue;
    }
    ++failures;
    if (failures == 1 || failures % 10 == 0) {
      GT_LOG(WARNING) << "actor " << actor_id_ << ": cannot report step " << report.step() << " to the head (attempt "
                      << failures << "): " << reply.status().message() << "; " << queued()
                      << " report(s) queued; retrying";
    }
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), backoff);
    if (stopping_) return;
    backoff = std::min(backoff * 2, absl::Seconds(5));
  }
}

}  // namespace geotrain::worker
