// The head's rendezvous table: small values a job's actors exchange before they can talk directly. The
// motivating case is NCCL: ncclGetUniqueId must run in the process of the communicator's rank 0 (the id
// embeds that process's bootstrap address), so rank 0 publishes the id under a key and the other ranks
// fetch it, waiting until it is there (comm/rendezvous.h is the client).
//
//   RendezvousTable table(job_check);                 // job_check: is this job known and not ended?
//   table.Publish("job-3", "nccl/site-a/stage0", id);  // rank 0
//   auto id = table.Fetch("job-3", "nccl/site-a/stage0", absl::Seconds(30), cancelled);  // others
//   table.DropEndedJobs();                             // the head's detector thread, every tick
//
// Values live in memory only (a restarted head has failed its running jobs anyway). Keys are write-once:
// publishing the same value again is OK (a retried call), a different one is ALREADY_EXISTS, so a rank
// never sees two ids for one communicator; a communicator made again (after a failure) needs a new key.
// Bounds: values of at most kMaxValueBytes, keys of 1..kMaxKeyBytes, kMaxKeysPerJob keys per job, waits
// of at most kMaxWait.
//
// Thread-safety: every method may be called from any thread. Fetch blocks (on the table's condition, in
// slices so that it notices a cancelled call) until the key is published, the deadline passes, the job
// ends or Shutdown() is called.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace geotrain::head {

class RendezvousTable {
 public:
  static constexpr int64_t kMaxValueBytes = 4096;
  static constexpr int64_t kMaxKeyBytes = 256;
  static constexpr int kMaxKeysPerJob = 1024;
  static constexpr absl::Duration kMaxWait = absl::Seconds(60);

  // `job_check(job_id)` returns OK for a job that may rendezvous (known, not ended), otherwise the reason
  // (NOT_FOUND for an unknown job, FAILED_PRECONDITION for an ended one). It is called without the
  // table's lock held.
  explicit RendezvousTable(std::function<absl::Status(const std::string& job_id)> job_check);
  RendezvousTable(const RendezvousTable&) = delete;
  RendezvousTable& operator=(const RendezvousTable&) = delete;

  // INVALID_ARGUMENT for an empty job id, a bad key or an oversize value; RESOURCE_EXHAUSTED past
  // kMaxKeysPerJob; ALREADY_EXISTS when the key holds a different value; the job check's error.
  absl::Status Publish(const std::string& job_id, const std::string& key, std::string value);

  // The key's value, waiting up to `timeout` (0..kMaxWait, else INVALID_ARGUMENT) for it to be published.
  // DEADLINE_EXCEEDED names the key and the job; FAILED_PRECONDITION when the job ends meanwhile;
  // CANCELLED when `cancelled()` (polled every 100 ms; may be empty) turns true; UNAVAILABLE on Shutdown().
  absl::StatusOr<std::string> Fetch(const std::string& job_id, const std::string& key, absl::Duration timeout,
                                    const std::function<bool()>& cancelled = {});

  // Drops the keys of every job the job check refuses (ended or unknown) and wakes their waiters.
  void DropEndedJobs();
  // Wakes every waiter with UNAVAILABLE; later calls fail the same way.
  void Shutdown();

  int64_t JobCountForTest() const;

 private:
  static absl::Status CheckKey(const std::string& job_id, const std::string& key);

  const std::function<absl::Status(const std::string&)> job_check_;
  mutable absl::Mutex mu_;
  // job id -> key -> value. A job's entry exists from its first publish or fetch until it is dropped.
  std::map<std::string, std::map<std::string, std::string>> jobs_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace geotrain::head
