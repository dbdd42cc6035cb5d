// SQLite-backed head state. Records are protobuf messages stored as blobs keyed by their id; a blob
// that fails to parse is reported as data loss with its key rather than silently skipped.
#include "head/store.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace geotrain::head {
namespace {

class Statement {
 public:
  Statement(sqlite3* db, const char* sql) { rc_ = sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr); }
  ~Statement() { sqlite3_finalize(stmt_); }
  bool ok() const { return rc_ == SQLITE_OK; }
  sqlite3_stmt* get() { return stmt_; }

 private:
  sqlite3_stmt* stmt_ = nullptr;
  int rc_;
};

absl::Status SqlError(sqlite3* db, const char* what) {
  return absl::InternalError(absl::StrCat("head state store: ", what, ": ", sqlite3_errmsg(db)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<HeadStore>> HeadStore::Open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create state dir '", dir, "': ", ec.message(), "; choose a writable --state-dir"));
  }
  ::chmod(dir.c_str(), 0700);
  const std::string path = absl::StrCat(dir, "/head.db");
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, nullptr) !=
      SQLITE_OK) {
    absl::Status s =
        absl::UnavailableError(absl::StrCat("cannot open '", path, "': ", db ? sqlite3_errmsg(db) : "out of memory"));
    sqlite3_close(db);
    return s;
  }
  sqlite3_busy_timeout(db, 5000);
  std::unique_ptr<HeadStore> store(new HeadStore(db));
  absl::MutexLock lock(&store->mu_);
  for (const char* sql : {
           "PRAGMA journal_mode=WAL",
           "PRAGMA synchronous=FULL",
           "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
           "CREATE TABLE IF NOT EXISTS workers (id TEXT PRIMARY KEY, record BLOB NOT NULL)",
           "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, record BLOB NOT NULL)",
           "CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY, job_id TEXT NOT NULL, "
           "record BLOB NOT NULL)",
           "CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, seq)",
       }) {
    if (absl::Status s = store->Exec(sql); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat(path, ": ", s.message(), "; the file may be corrupt or from another program"));
    }
  }
  return store;
}

HeadStore::~HeadStore() {
  absl::MutexLock lock(&mu_);
  sqlite3_close(db_);
}

absl::Status HeadStore::Exec(const char* sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    absl::Status s = absl::InternalError(absl::StrCat("head state store: ", sql, ": ", err ? err : "?"));
    sqlite3_free(err);
    return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> HeadStore::GetMeta(const std::string& key) {
  absl::MutexLock lock(&mu_);
  Statement st(db_, "SELECT value FROM meta WHERE key = ?");
  if (!st.ok()) return SqlError(db_, "prepare");
  sqlite3_bind_text(st.get(), 1, key.c_str(), -1, SQLITE_TRANSIENT);
  if (sqlite3_step(st.get()) != SQLITE_ROW) return absl::NotFoundError(key);
  return std::string(reinterpret_cast<const char*>(sqlite3_column_text(st.get(), 0)));
}

absl::Status HeadStore::PutMeta(const std::string& key, const std::string& value) {
  absl::MutexLock lock(&mu_);
  Statement st(db_, "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)");
  if (!st.ok()) return SqlError(db_, "prepare");
  sqlite3_bind_text(st.get(), 1, key.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_text(st.get(), 2, value.c_str(), -1, SQLITE_TRANSIENT);
  if (sqlite3_step(st.get()) != SQLITE_DONE) return SqlError(db_, "write meta");
  return absl::OkStatus();
}

absl::Status HeadStore::PutBlob(const char* sql, const std::string& key, const std::string& blob) {
  absl::MutexLock lock(&mu_);
  return PutBlobLocked(sql, key, blob);
}

absl::Status HeadStore::PutBlobLocked(const char* sql, const std::string& key, const std::string& blob) {
  Statement st(db_, sql);
  if (!st.ok()) return SqlError(db_, "prepare");
  sqlite3_bind_text(st.get(), 1, key.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_blob(st.get(), 2, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
  if (sqlite3_step(st.get()) != SQLITE_DONE) return SqlError(db_, "write");
  return absl::OkStatus();
}

absl::Status HeadStore::PutWorker(const WorkerInfo& worker) {
  return PutBlob("INSERT OR REPLACE INTO workers (id, record) VALUES (?, ?)", worker.worker_id(),
                 worker.SerializeAsString());
}

absl::Status HeadStore::PutJob(const JobInfo& job) {
  return PutBlob("INSERT OR REPLACE INTO jobs (id, record) VALUES (?, ?)", job.job_id(), job.SerializeAsString());
}

namespace {
template <typename T>
absl::StatusOr<std::vector<T>> LoadAll(sqlite3* db, const char* sql, const char* table) {
  Statement st(db, sql);
  if (!st.ok()) return SqlError(db, "prepare");
  std::vector<T> out;
  while (sqlite3_step(st.get()) == SQLITE_ROW) {
    T record;
    const void* blob = sqlite3_column_blob(st.get(), 1);
    const int size = sqlite3_column_bytes(st.get(), 1);
    if (!record.ParseFromArray(blob, size)) {
      return absl::DataLossError(absl::StrCat("head state store: ", table, " record '",
                                              reinterpret_cast<const char*>(sqlite3_column_text(st.get(), 0)),
                                              "' does not parse"));
    }
    out.push_back(std::move(record));
  }
  return out;
}
}  // namespace

absl::StatusOr<std::vector<WorkerInfo>> HeadStore::LoadWorkers() {
  absl::MutexLock lock(&mu_);
  return LoadAll<WorkerInfo>(db_, "SELECT id, record FROM workers", "workers");
}

absl::StatusOr<std::vector<JobInfo>> HeadStore::LoadJobs() {
  absl::MutexLock lock(&mu_);
  return LoadAll<JobInfo>(db_, "SELECT id, record FROM jobs ORDER BY id", "jobs");
}

absl::Status HeadStore::AppendEvent(const JobEvent& event) {
  absl::MutexLock lock(&mu_);
  return AppendEventLocked(event);
}

absl::Status HeadStore::PutJobWithEvent(const JobInfo& job, const JobEvent& event) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(Exec("BEGIN IMMEDIATE"));
  absl::Status s =
      PutBlobLocked("INSERT OR REPLACE INTO jobs (id, record) VALUES (?, ?)", job.job_id(), job.SerializeAsString());
  if (s.ok()) s = AppendEventLocked(event);
  if (s.ok()) s = Exec("COMMIT");
  if (!s.ok()) (void)Exec("ROLLBACK");  // nothing of the pair stays; a failed rollback leaves SQLite's own recovery
  return s;
}

absl::Status HeadStore::LimitSizeForTesting(int64_t pages) {
  absl::MutexLock lock(&mu_);
  return Exec(absl::StrCat("PRAGMA max_page_count = ", pages).c_str());
}

absl::Status HeadStore::AppendEventLocked(const JobEvent& event) {
  Statement st(db_, "INSERT INTO events (seq, job_id, record) VALUES (?, ?, ?)");
  if (!st.ok()) return SqlError(db_, "prepare");
  const std::string blob = event.SerializeAsString();
  sqlite3_bind_int64(st.get(), 1, event.seq());
  sqlite3_bind_text(st.get(), 2, event.job_id().c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_blob(st.get(), 3, blob.data(), static_cast<int>(blob.size()), SQLITE_TRANSIENT);
  if (sqlite3_step(st.get()) != SQLITE_DONE) return SqlError(db_, "append event");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<JobEvent>> HeadStore::LoadEvents(const std::string& job_id, int64_t after_seq, int64_t limit,
                                                            bool newest) {
  absl::MutexLock lock(&mu_);
  Statement st(db_, newest ? "SELECT seq, record FROM events WHERE job_id = ? AND seq > ? ORDER BY seq DESC LIMIT ?"
                           : "SELECT seq, record FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?");
  if (!st.ok()) return SqlError(db_, "prepare");
  sqlite3_bind_text(st.get(), 1, job_id.c_str(), -1, SQLITE_TRANSIENT);
  sqlite3_bind_int64(st.get(), 2, after_seq);
  sqlite3_bind_int64(st.get(), 3, limit > 0 ? limit : -1);  // SQLite: a negative LIMIT is none
  std::vector<JobEvent> out;
  while (sqlite3_step(st.get()) == SQLITE_ROW) {
    JobEvent e;
    if (!e.ParseFromArray(sqlite3_column_blob(st.get(), 1), sqlite3_column_bytes(st.get(), 1))) {
      return absl::DataLossError(absl::StrCat("head state store: event ", sqlite3_column_int64(st.get(), 0), " of job ",
                                              job_id, " does not parse"));
    }
    out.push_back(std::move(e));
  }
  if (newest) std::reverse(out.begin(), out.end());
  return out;
}

absl::StatusOr<int64_t> HeadStore::MaxEventSeq() {
  absl::MutexLock lock(&mu_);
  Statement st(db_, "SELECT COALESCE(MAX(seq), 0) FROM events");
  if (!st.ok() || sqlite3_step(st.get()) != SQLITE_ROW) return SqlError(db_, "max seq");
  return sqlite3_column_int64(st.get(), 0);
}

}  // namespace geotrain::head
