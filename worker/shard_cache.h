// A worker's cache of staged token shards (--cache-dir): the head serves the shards a job's spec names (paths on
// its machine, proto/staging.proto); a worker fetches each shard it needs once into its cache, and serves its
// cache to its site's peers, so that a shard crosses the WAN once per site.
//
//   ShardCache cache(options);                        // one per worker; shared by its jobs and actors
//   ASSIGN_OR_RETURN(std::string path, cache.Get(job_id, shard, /*source=*/relay, /*head=*/head, stop, on_bytes));
//   // the worker's DataStaging.FetchShard: relays while the shard arrives
//   cache.Serve(request, head, write_chunk, cancelled);
//
// A cached shard is <dir>/<key>.bin with its record <key>.json (proto CachedShard: the head's path, size,
// modification time and CRC-32C; complete or not). A copy is used when its size and time match the head's
// listing and its CRC-32C matches the one the head recorded when it first served the shard; a corrupt copy is
// fetched again. A fetch broken off (a link outage, a restarted worker) resumes from the bytes already on disk.
// Fetches from a site peer fall back to the head when the peer fails. A full disk, a missing shard and a
// checksum mismatch fail with an error naming the shard and the worker.
//
// Several workers on one machine may share the directory: a shard is fetched under an exclusive file lock.
// Thread-safety: every method may be called from any thread; concurrent Gets and Serves of one shard share one
// fetch.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "staging.grpc.pb.h"

namespace geotrain::worker {

// Where a shard's bytes came from, for progress and geotrain_staged_bytes_total{site,source}.
enum class ShardOrigin { kHead, kPeer, kCache };
const char* ShardOriginName(ShardOrigin origin);

// A node serving DataStaging.FetchShard: the head, or a worker of this site that relays it.
struct ShardServer {
  std::string address;
  std::string name;  // "the head" or "worker <id>", for messages
  ShardOrigin origin = ShardOrigin::kHead;
};

struct ShardCacheOptions {
  std::string dir;  // created if needed
  std::string site;
  std::string token;
  TlsFiles tls;
  MetricsServer* metrics = nullptr;  // may be null
  // This worker's id for messages (it may change when the worker registers): called when an error is made.
  std::function<std::string()> worker_id;
  // A fetch that makes no progress is retried (resuming) for this long before it fails.
  int64_t retry_for_ms = 120000;
  size_t chunk_bytes = size_t{1} << 20;  // what a relay sends per message
};

class ShardCache {
 public:
  explicit ShardCache(ShardCacheOptions options);
  ~ShardCache();  // waits for the relays' background fetches
  ShardCache(const ShardCache&) = delete;
  ShardCache& operator=(const ShardCache&) = delete;

  // Called as bytes of a shard become local: how many, and from where.
  using OnBytes = std::function<void(uint64_t bytes, ShardOrigin origin)>;

  // The local path of a verified copy of `shard` (as the head listed it), fetched from `source` when the cache
  // holds none or a corrupt one (from `head` when `source` fails). A cached copy is verified by its CRC-32C on
  // every call. Blocks until the copy is complete, or `stop` is set (CANCELLED).
  absl::StatusOr<std::string> Get(const std::string& job_id, const ShardInfo& shard, const ShardServer& source,
                                  const ShardServer& head, const std::atomic<bool>* stop, const OnBytes& on_bytes);

  // Serves `request` (a site peer's FetchShard) from the cache: starts fetching the shard from `head` if it is not
  // here, and streams it from request.offset while it arrives. `write` sends one message (false: the peer went
  // away); `cancelled` is polled while waiting for bytes.
  absl::Status Serve(const FetchShardRequest& request, const ShardServer& head,
                     const std::function<bool(const ShardChunk&)>& write, const std::function<bool()>& cancelled);

  const std::string& dir() const { return options_.dir; }

 private:
  enum class State { kIdle, kFetching, kComplete };
  struct Entry {
    State state = State::kIdle;
    ShardInfo info;           // as the head describes it (the CRC once known)
    uint64_t bytes_done = 0;  // bytes on disk from the start of the file
    absl::Status error;       // of the last fetch that failed
    std::string path;         // <dir>/<key>.bin
  };

  // Makes the shard complete in the cache (on the calling thread): the cached copy if it verifies, else a fetch.
  absl::Status Fill(const std::string& job_id, const ShardInfo& shard, const ShardServer& source,
                    const ShardServer& head, const std::atomic<bool>* stop, const OnBytes& on_bytes);
  // The channel to a shard server, kept for the cache's lifetime: over a long link a new connection would start every
  // shard with HTTP/2's initial window and grow it again over several round trips (bench/nodes/staging_bench).
  absl::StatusOr<std::shared_ptr<grpc::Channel>> ChannelTo(const std::string& address);
  // One source until done, a permanent error, or no progress for retry_for_ms.
  absl::Status FetchFrom(const std::string& job_id, const ShardInfo& shard, const ShardServer& server,
                         const std::atomic<bool>* stop, const OnBytes& on_bytes);
  // Where FetchFrom writes a shard: the open cache file, its path, and the fetch's name for errors.
  struct FetchTarget {
    int fd = -1;
    std::string bin;
    std::string what;
  };
  // What one FetchShard call did.
  struct FetchAttempt {
    bool progressed = false;   // bytes were written
    bool restart = false;      // the bytes kept belong to another version of the file: truncate, start over
    absl::Status local_error;  // this side's: the shard changed on the head, a broken server, a full disk
    grpc::Status finished;     // the call's own status
  };
  // One FetchShard call to `stub` from byte `have` of `shard` into `target`, until the stream ends, an error, or
  // `stop`; the entry's bytes_done and CRC follow it. *last_progress: when bytes last arrived.
  FetchAttempt FetchOnce(const std::string& job_id, const ShardInfo& shard, const ShardServer& server,
                         DataStaging::Stub& stub, const FetchTarget& target, uint64_t have,
                         const std::atomic<bool>* stop, const OnBytes& on_bytes,
                         std::chrono::steady_clock::time_point* last_progress);
  // Ends a fill: the entry is complete, or idle again with the error.
  void Release(const std::string& path_on_head, const absl::Status& status);
  std::string KeyFor(const std::string& path_on_head) const;
  std::string Node() const;
  void Count(uint64_t bytes, ShardOrigin origin);

  const ShardCacheOptions options_;
  mutable absl::Mutex mu_;
  absl::CondVar changed_;                                      // an entry's state or bytes_done changed
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);  // by the path on the head
  std::vector<std::thread> relays_ ABSL_GUARDED_BY(mu_);       // background fetches started by Serve
  // By address: the head and this site's relays (a few per worker).
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stop_relays_{false};
};

}  // namespace geotrain::worker
