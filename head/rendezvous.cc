// The head's rendezvous table (see rendezvous.h).
#include "head/rendezvous.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace geotrain::head {

RendezvousTable::RendezvousTable(std::function<absl::Status(const std::string& job_id)> job_check)
    : job_check_(std::move(job_check)) {}

absl::Status RendezvousTable::CheckKey(const std::string& job_id, const std::string& key) {
  if (job_id.empty()) return absl::InvalidArgumentError("rendezvous: job_id is required");
  if (key.empty() || static_cast<int64_t>(key.size()) > kMaxKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous: the key must have 1 to ", kMaxKeyBytes, " bytes, not ", key.size()));
  }
  return absl::OkStatus();
}

absl::Status RendezvousTable::Publish(const std::string& job_id, const std::string& key, std::string value) {
  RETURN_IF_ERROR(CheckKey(job_id, key));
  if (static_cast<int64_t>(value.size()) > kMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous: the value of key '", key, "' has ", value.size(),
                                                   " bytes; at most ", kMaxValueBytes, " are allowed"));
  }
  RETURN_IF_ERROR(job_check_(job_id));
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("rendezvous: the head is shutting down");
  std::map<std::string, std::string>& keys = jobs_[job_id];
  auto it = keys.find(key);
  if (it != keys.end()) {
    if (it->second == value) return absl::OkStatus();  // a retried publish
    return absl::AlreadyExistsError(absl::StrCat("rendezvous: key '", key, "' of job ", job_id,
                                                 " already holds a different value; keys are write-once, "
                                                 "use a new key for a new communicator"));
  }
  if (static_cast<int>(keys.size()) >= kMaxKeysPerJob) {
    return absl::ResourceExhaustedError(
        absl::StrCat("rendezvous: job ", job_id, " already has ", kMaxKeysPerJob, " keys"));
  }
  keys.emplace(key, std::move(value));
  return absl::OkStatus();
}

absl::StatusOr<std::string> RendezvousTable::Fetch(const std::string& job_id, const std::string& key,
                                                   absl::Duration timeout, const std::function<bool()>& cancelled) {
  RETURN_IF_ERROR(CheckKey(job_id, key));
  if (timeout < absl::ZeroDuration() || timeout > kMaxWait) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous: the timeout must be 0 to ",
                                                   absl::ToInt64Milliseconds(kMaxWait), " ms, not ",
                                                   absl::ToInt64Milliseconds(timeout), " ms"));
  }
  RETURN_IF_ERROR(job_check_(job_id));
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  jobs_[job_id];  // the entry exists while the job may rendezvous; DropEndedJobs removes it
  auto settled = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    auto job = jobs_.find(job_id);
    return shutdown_ || job == jobs_.end() || job->second.count(key) > 0;
  };
  while (!settled()) {
    if (cancelled && cancelled()) return absl::CancelledError("rendezvous: the fetch was cancelled");
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    mu_.AwaitWithDeadline(absl::Condition(&settled), std::min(deadline, now + absl::Milliseconds(100)));
  }
  if (shutdown_) return absl::UnavailableError("rendezvous: the head is shutting down");
  auto job = jobs_.find(job_id);
  if (job == jobs_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("rendezvous: job ", job_id, " ended while waiting for key '", key, "'"));
  }
  auto it = job->second.find(key);
  if (it == job->second.end()) {
    return absl::DeadlineExceededError(absl::StrCat("rendezvous: key '", key, "' of job ", job_id,
                                                    " was not published within ", absl::ToInt64Milliseconds(timeout),
                                                    " ms"));
  }
  return it->second;
}

void RendezvousTable::DropEndedJobs() {
  std::vector<std::string> job_ids;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [job_id, keys] : jobs_) job_ids.push_back(job_id);
  }
  std::vector<std::string> ended;
  for (const std::string& job_id : job_ids) {
    if (!job_check_(job_id).ok()) ended.push_back(job_id);
  }
  if (ended.empty()) return;
  absl::MutexLock lock(&mu_);
  for (const std::string& job_id : ended) jobs_.erase(job_id);
}

void RendezvousTable::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
}

int64_t RendezvousTable::JobCountForTest() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(jobs_.size());
}

}  // namespace geotrain::head
