// The head's persisted state: an SQLite database under --state-dir (WAL journal, synchronous=FULL, so a
// committed write survives kill -9 and power loss). It keeps the head's identity, the workers it has
// seen, the job table and each job's events, so that a restarted head still knows its jobs and accepts
// its workers back.
//
// Thread-safety: every method locks the store's own mutex; callers may use it from any thread.
#pragma once

#include <sqlite3.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "control.pb.h"

namespace geotrain::head {

class HeadStore {
 public:
  // Opens (creating if needed) <dir>/head.db. Fails with the path and the cause.
  static absl::StatusOr<std::unique_ptr<HeadStore>> Open(const std::string& dir);
  ~HeadStore();
  HeadStore(const HeadStore&) = delete;
  HeadStore& operator=(const HeadStore&) = delete;

  absl::StatusOr<std::string> GetMeta(const std::string& key);  // NotFound when absent
  absl::Status PutMeta(const std::string& key, const std::string& value);

  absl::Status PutWorker(const WorkerInfo& worker);
  absl::StatusOr<std::vector<WorkerInfo>> LoadWorkers();

  absl::Status PutJob(const JobInfo& job);
  absl::StatusOr<std::vector<JobInfo>> LoadJobs();

  absl::Status AppendEvent(const JobEvent& event);
  // The job's new record and its event, in one transaction: both are written, or neither.
  absl::Status PutJobWithEvent(const JobInfo& job, const JobEvent& event);
  // The job's events with seq > after_seq, in seq order: all of them, or (limit > 0) the first `limit`, or with
  // `newest` the last `limit`. The limit is SQL's, so a long job's history is not read to answer a few.
  absl::StatusOr<std::vector<JobEvent>> LoadEvents(const std::string& job_id, int64_t after_seq, int64_t limit = 0,
                                                   bool newest = false);
  absl::StatusOr<int64_t> MaxEventSeq();

  // Caps the database at `pages` pages (SQLite's max_page_count), so that tests see what a full disk does.
  absl::Status LimitSizeForTesting(int64_t pages);

 private:
  explicit HeadStore(sqlite3* db) : db_(db) {}
  absl::Status Exec(const char* sql) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PutBlob(const char* sql, const std::string& key, const std::string& blob);
  absl::Status PutBlobLocked(const char* sql, const std::string& key, const std::string& blob)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status AppendEventLocked(const JobEvent& event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  sqlite3* db_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain::head
