// Staging one job's token shards onto a worker: the shards a data pattern names on the head are listed, then made
// local one after the other in the loader's walk order (worker/shard_cache.h), in the background, while training
// starts as soon as the first one is here. Progress goes to the head every few seconds (`job logs`: "staging 3.2
// of 12.0 GB, 80 MB/s") and when staging ends.
//
//   ASSIGN_OR_RETURN(std::shared_ptr<JobStaging> staging, JobStaging::Start(&cache, options));
//   ASSIGN_OR_RETURN(loader, model::DataLoader::Create(staging->Source(), B, T, replica, dp, V));
//
// Inside a site, one worker fetches from the head and its site peers fetch from it (SiteRelay), so that a shard
// crosses the WAN once per site.
//
// Thread-safety: Source()'s wait_for_shard may be called from any thread; the staging thread is joined by the
// destructor (the shared_ptr's last owner: the actors' loaders hold it).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "control.pb.h"
#include "model/data.h"
#include "worker/shard_cache.h"

namespace geotrain::worker {

// Where a worker fetches a job's shards from: the head when it is its site's relay (the data-loading actor's
// worker with the smallest id at the site), else that relay worker.
ShardServer SiteRelay(const JobSpec& spec, const std::vector<ActorPeer>& peers, const std::string& site,
                      const std::string& worker_id, const ShardServer& head);

class JobStaging {
 public:
  struct Options {
    std::string job_id;
    std::string pattern;  // data.train of the job's spec: paths on the head's machine
    std::string worker_id;
    std::string site;
    ShardServer source;  // SiteRelay's choice
    ShardServer head;
    std::string token;
    TlsFiles tls;
    int64_t report_every_ms = 2000;
  };

  // Lists the shards on the head (NOT_FOUND when none match, naming the pattern) and starts staging them.
  static absl::StatusOr<std::shared_ptr<JobStaging>> Start(ShardCache* cache, Options options);
  ~JobStaging();  // stops staging (a fetch broken off resumes next time) and joins
  JobStaging(const JobStaging&) = delete;
  JobStaging& operator=(const JobStaging&) = delete;

  // The shards as the loader wants them: token counts now, each path once it is local. The source holds a
  // reference to this staging.
  model::ShardSource Source();
  uint64_t total_bytes() const { return total_bytes_; }

 private:
  JobStaging(ShardCache* cache, Options options);
  void Run();
  void Report(bool done, const std::string& error);

  ShardCache* const cache_;
  const Options options_;
  std::vector<ShardInfo> shards_;
  uint64_t total_bytes_ = 0;
  std::unique_ptr<DataStaging::Stub> head_;
  std::atomic<bool> stop_{false};
  std::thread thread_;

  mutable absl::Mutex mu_;
  absl::CondVar staged_cv_;                              // a shard was staged, or staging failed
  std::vector<std::string> paths_ ABSL_GUARDED_BY(mu_);  // local paths of the shards staged so far, in order
  absl::Status error_ ABSL_GUARDED_BY(mu_);              // staging failed: every later wait gets it
  uint64_t staged_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t from_head_ ABSL_GUARDED_BY(mu_) = 0, from_peer_ ABSL_GUARDED_BY(mu_) = 0,
                      from_cache_ ABSL_GUARDED_BY(mu_) = 0;
  // Time spent on fetches that moved bytes (for the rate shown): the finished shards' and the current one's.
  double network_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point shard_start_ ABSL_GUARDED_BY(mu_);
  std::weak_ptr<JobStaging> self_;
};

}  // namespace geotrain::worker
