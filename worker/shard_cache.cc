// The worker's shard cache: verified copies, resumed fetches, relays to site peers (see shard_cache.h).
#include "worker/shard_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/file_transfer.h"
#include "common/log.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"

namespace geotrain::worker {
namespace {

using SteadyClock = std::chrono::steady_clock;

int64_t MillisSince(SteadyClock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now() - start).count();
}

// The same shard: size and modification time as listed, and the CRC when both sides know it.
bool SameShard(const ShardInfo& a, const ShardInfo& b) {
  return a.path() == b.path() && a.bytes() == b.bytes() && a.mtime_ns() == b.mtime_ns() &&
         (a.crc32c().empty() || b.crc32c().empty() || a.crc32c() == b.crc32c());
}

// An exclusive lock on a file, released when it goes out of scope: one fetch of a shard at a time among the
// workers that share the cache directory.
class FileLock {
 public:
  explicit FileLock(const std::string& path) : fd_(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    if (fd_ >= 0) {
      while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
      }
    }
  }
  ~FileLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  bool ok() const { return fd_ >= 0; }

 private:
  int fd_;
};

absl::StatusOr<CachedShard> ReadRecord(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path));
  CachedShard record;
  if (!google::protobuf::util::JsonStringToMessage(text, &record).ok()) {
    return absl::DataLossError(absl::StrCat(path, " does not parse"));
  }
  return record;
}

absl::Status WriteRecord(const std::string& path, const ShardInfo& shard, bool complete) {
  CachedShard record;
  *record.mutable_shard() = shard;
  record.set_complete(complete);
  std::string text;
  (void)google::protobuf::util::MessageToJsonString(record, &text);
  return WriteFileAtomically(path, text + "\n", 0644);
}

bool Permanent(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::PERMISSION_DENIED:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
    case grpc::StatusCode::DATA_LOSS:
    case grpc::StatusCode::UNIMPLEMENTED:
      return true;
    default:
      return false;
  }
}

// Refuses a fetch of `needed` more bytes that the cache's disk has no room for.
absl::Status CheckCacheSpace(const std::string& dir, const std::string& what, uint64_t needed) {
  struct statvfs fs;
  if (::statvfs(dir.c_str(), &fs) == 0) {
    const uint64_t free_bytes = static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
    if (free_bytes < needed) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "%s: the cache disk is full: %d more bytes needed, %d free in %s; free space or start the worker with "
          "--cache-dir on a larger disk",
          what, needed, free_bytes, dir));
    }
  }
  return absl::OkStatus();
}

// Writes a chunk's `data` at `offset` of the open file `fd` (the cache file `bin`, in `dir`); `what` is the fetch,
// for errors. A full disk is RESOURCE_EXHAUSTED.
absl::Status WriteAt(int fd, const std::string& data, uint64_t offset, const std::string& what, const std::string& bin,
                     const std::string& dir) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::pwrite(fd, data.data() + done, data.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return errno == ENOSPC || errno == EDQUOT
                 ? absl::ResourceExhaustedError(
                       absl::StrCat(what, ": the cache disk is full (", dir,
                                    "); free space or start the worker with --cache-dir on a larger disk"))
                 : absl::InternalError(absl::StrCat(what, ": writing ", bin, ": ", std::strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

const char* ShardOriginName(ShardOrigin origin) {
  switch (origin) {
    case ShardOrigin::kHead:
      return "head";
    case ShardOrigin::kPeer:
      return "peer";
    case ShardOrigin::kCache:
      return "cache";
  }
  return "?";
}

ShardCache::ShardCache(ShardCacheOptions options) : options_(std::move(options)) {}

ShardCache::~ShardCache() {
  stop_relays_ = true;
  std::vector<std::thread> relays;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    relays.swap(relays_);
    changed_.SignalAll();
  }
  for (std::thread& t : relays) t.join();
}

std::string ShardCache::Node() const {
  const std::string id = options_.worker_id ? options_.worker_id() : std::string();
  return absl::StrCat("worker ", id.empty() ? "(unregistered)" : id, " (site ", options_.site, ")");
}

std::string ShardCache::KeyFor(const std::string& path_on_head) const {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a: a stable name for the head's path
  for (unsigned char c : path_on_head) hash = (hash ^ c) * 1099511628211ull;
  std::string base = std::filesystem::path(path_on_head).filename().string();
  for (char& c : base) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
  }
  return absl::StrFormat("%016x-%s", hash, base);
}

void ShardCache::Count(uint64_t bytes, ShardOrigin origin) {
  if (options_.metrics == nullptr || bytes == 0) return;
  options_.metrics
      ->Counters("geotrain_staged_bytes_total",
                 "Bytes of token shards made local on this worker, by site and source (head, peer, cache)")
      .Add({{"site", options_.site}, {"source", ShardOriginName(origin)}})
      .Increment(static_cast<double>(bytes));
}

absl::StatusOr<std::string> ShardCache::Get(const std::string& job_id, const ShardInfo& shard,
                                            const ShardServer& source, const ShardServer& head,
                                            const std::atomic<bool>* stop, const OnBytes& on_bytes) {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      Entry& entry = entries_[shard.path()];
      if (entry.path.empty()) entry.path = absl::StrCat(options_.dir, "/", KeyFor(shard.path()), ".bin");
      // A copy complete here is verified again (Fill reads its CRC-32C) each time a job stages it: a cached file
      // corrupted since is fetched again instead of failing the job.
      if (entry.state == State::kFetching) {
        // Another caller (an actor of another job, or a relay for a peer) is filling it: wait for it.
        changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
        if (stop != nullptr && *stop) return absl::CancelledError("staging stopped");
        continue;
      }
      entry.state = State::kFetching;
      entry.info = shard;
    }
    absl::Status status = Fill(job_id, shard, source, head, stop, on_bytes);
    Release(shard.path(), status);
    RETURN_IF_ERROR(status);
    absl::MutexLock lock(&mu_);
    return entries_[shard.path()].path;
  }
}

void ShardCache::Release(const std::string& path_on_head, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  Entry& entry = entries_[path_on_head];
  entry.state = status.ok() ? State::kComplete : State::kIdle;
  entry.error = status;
  changed_.SignalAll();
}

absl::Status ShardCache::Fill(const std::string& job_id, const ShardInfo& shard, const ShardServer& source,
                              const ShardServer& head, const std::atomic<bool>* stop, const OnBytes& on_bytes) {
  std::error_code ec;
  std::filesystem::create_directories(options_.dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat("staging shard ", shard.path(), " on ", Node(),
                                                    ": cannot create the cache dir ", options_.dir, ": ", ec.message(),
                                                    "; start the worker with a writable --cache-dir"));
  }
  const std::string key = absl::StrCat(options_.dir, "/", KeyFor(shard.path()));
  const std::string bin = key + ".bin", record_path = key + ".json";
  FileLock lock(key + ".lock");
  if (!lock.ok()) {
    return absl::PermissionDeniedError(absl::StrCat("staging shard ", shard.path(), " on ", Node(), ": cannot lock ",
                                                    key, ".lock: ", std::strerror(errno)));
  }
  ShardInfo known = shard;  // what we know of it: the head's CRC once seen
  uint64_t have = 0;
  if (absl::StatusOr<CachedShard> record = ReadRecord(record_path); record.ok() && SameShard(record->shard(), shard)) {
    if (known.crc32c().empty()) known.set_crc32c(record->shard().crc32c());
    const uint64_t size = comm::FileSize(bin).value_or(0);
    if (record->complete() && size == shard.bytes()) {
      absl::StatusOr<uint32_t> crc = comm::FileCrc32c(bin);
      if (crc.ok() && comm::Hex32(*crc) == known.crc32c()) {
        {
          absl::MutexLock l(&mu_);
          Entry& entry = entries_[shard.path()];
          entry.info = known;
          entry.bytes_done = size;
          changed_.SignalAll();
        }
        Count(size, ShardOrigin::kCache);
        if (on_bytes) on_bytes(size, ShardOrigin::kCache);
        return absl::OkStatus();
      }
      GT_LOG(WARNING) << "the cached copy of shard " << shard.path() << " on " << Node() << " is corrupt (CRC-32C "
                      << (crc.ok() ? comm::Hex32(*crc) : std::string(crc.status().message())) << ", the head recorded "
                      << known.crc32c() << "): fetching it again";
    } else if (!record->complete()) {
      have = std::min<uint64_t>(size, shard.bytes());  // a fetch broken off: resume
    }
  }
  if (have == 0) std::filesystem::resize_file(bin, 0, ec);  // also creates nothing; the fetch creates the file
  RETURN_IF_ERROR(WriteRecord(record_path, known, /*complete=*/false));
  {
    absl::MutexLock l(&mu_);
    Entry& entry = entries_[shard.path()];
    entry.info = known;
    entry.bytes_done = have;
  }

  for (int round = 0; round < 2; ++round) {
    absl::Status fetched = FetchFrom(job_id, known, source, stop, on_bytes);
    if (!fetched.ok() && source.origin != ShardOrigin::kHead && !(stop != nullptr && *stop) &&
        fetched.code() != absl::StatusCode::kResourceExhausted) {
      GT_LOG(WARNING) << "staging shard " << shard.path() << " from " << source.name << " failed (" << fetched
                      << "); fetching it from " << head.name;
      fetched = FetchFrom(job_id, known, head, stop, on_bytes);
    }
    RETURN_IF_ERROR(fetched);
    {
      absl::MutexLock l(&mu_);
      known = entries_[shard.path()].info;  // with the CRC the server sent
    }
    ASSIGN_OR_RETURN(uint32_t crc, comm::FileCrc32c(bin));
    if (comm::Hex32(crc) == known.crc32c()) {
      RETURN_IF_ERROR(WriteRecord(record_path, known, /*complete=*/true));
      return absl::OkStatus();
    }
    GT_LOG(WARNING) << "shard " << shard.path() << " fetched by " << Node() << " has CRC-32C " << comm::Hex32(crc)
                    << ", the head recorded " << known.crc32c() << ": fetching it again from " << head.name;
    std::filesystem::resize_file(bin, 0, ec);
    absl::MutexLock l(&mu_);
    entries_[shard.path()].bytes_done = 0;
  }
  return absl::DataLossError(absl::StrCat("staging shard ", shard.path(), " on ", Node(),
                                          ": checksum mismatch twice (the copy's CRC-32C differs from the ",
                                          known.crc32c(), " the head recorded); the shard may be changing on the ",
                                          "head, or a disk or link corrupts data"));
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> ShardCache::ChannelTo(const std::string& address) {
  absl::MutexLock lock(&mu_);
  if (auto it = channels_.find(address); it != channels_.end()) return it->second;
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, MakeChannel(address, options_.tls));
  channels_[address] = channel;
  return channel;
}

absl::Status ShardCache::FetchFrom(const std::string& job_id, const ShardInfo& shard, const ShardServer& server,
                                   const std::atomic<bool>* stop, const OnBytes& on_bytes) {
  const std::string bin = absl::StrCat(options_.dir, "/", KeyFor(shard.path()), ".bin");
  const std::string what = absl::StrCat("staging shard ", shard.path(), " on ", Node(), " from ", server.name);
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, ChannelTo(server.address));
  std::unique_ptr<DataStaging::Stub> stub = DataStaging::NewStub(channel);
  const int fd = ::open(bin.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return absl::PermissionDeniedError(absl::StrCat(what, ": cannot open ", bin, ": ", std::strerror(errno)));
  struct CloseFd {
    int fd;
    ~CloseFd() { ::close(fd); }
  } close_fd{fd};
  const FetchTarget target{.fd = fd, .bin = bin, .what = what};
  auto last_progress = SteadyClock::now();
  int64_t backoff_ms = 200;
  absl::Status last_error = absl::UnavailableError("not tried");
  while (true) {
    if (stop != nullptr && *stop) return absl::CancelledError(absl::StrCat(what, ": staging stopped"));
    uint64_t have;
    std::string crc;
    {
      absl::MutexLock l(&mu_);
      have = entries_[shard.path()].bytes_done;
      crc = entries_[shard.path()].info.crc32c();
    }
    if (have == shard.bytes() && !crc.empty()) {
      if (::fdatasync(fd) != 0) return absl::InternalError(absl::StrCat(what, ": fdatasync: ", std::strerror(errno)));
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(CheckCacheSpace(options_.dir, what, shard.bytes() - have));
    const FetchAttempt attempt = FetchOnce(job_id, shard, server, *stub, target, have, stop, on_bytes, &last_progress);
    RETURN_IF_ERROR(attempt.local_error);
    if (attempt.restart) {
      if (::ftruncate(fd, 0) != 0) return absl::InternalError(absl::StrCat(what, ": truncating ", bin));
      continue;
    }
    const grpc::Status& finished = attempt.finished;
    if (!finished.ok() && Permanent(finished.error_code())) return FromGrpc(finished, what);
    if (!finished.ok()) last_error = FromGrpc(finished, what);
    if (attempt.progressed) {
      backoff_ms = 200;
      continue;  // a break after progress: resume at once
    }
    if (MillisSince(last_progress) > options_.retry_for_ms) {
      return absl::UnavailableError(
          absl::StrCat(last_error.message(), " (no progress for ", options_.retry_for_ms / 1000, " s)"));
    }
    for (int64_t slept = 0; slept < backoff_ms; slept += 50) {
      if (stop != nullptr && *stop) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    backoff_ms = std::min<int64_t>(backoff_ms * 2, 2000);
  }
}

ShardCache::FetchAttempt ShardCache::FetchOnce(const std::string& job_id, const ShardInfo& shard,
                                               const ShardServer& server, DataStaging::Stub& stub,
                                               const FetchTarget& target, uint64_t have, const std::atomic<bool>* stop,
                                               const OnBytes& on_bytes,
                                               std::chrono::steady_clock::time_point* last_progress) {
  const std::string& what = target.what;
  grpc::ClientContext ctx;
  AttachToken(&ctx, options_.token);
  FetchShardRequest request;
  request.set_job_id(job_id);
  request.set_path(shard.path());
  request.set_offset(have);
  request.set_bytes(shard.bytes());
  request.set_mtime_ns(shard.mtime_ns());
  request.set_requester(options_.worker_id ? options_.worker_id() : std::string());
  request.set_requester_site(options_.site);
  std::unique_ptr<grpc::ClientReader<ShardChunk>> reader = stub.FetchShard(&ctx, request);
  ShardChunk chunk;
  FetchAttempt attempt;
  while (reader->Read(&chunk)) {
    if (stop != nullptr && *stop) {
      ctx.TryCancel();
      break;
    }
    if (chunk.has_shard()) {
      const ShardInfo& sent = chunk.shard();
      if (sent.bytes() != shard.bytes() || sent.mtime_ns() != shard.mtime_ns()) {
        attempt.local_error = absl::FailedPreconditionError(
            absl::StrCat(what, ": the shard changed on the head (", sent.bytes(), " bytes now, ", shard.bytes(),
                         " when listed); restart the job to stage the new data"));
        ctx.TryCancel();
        break;
      }
      absl::MutexLock l(&mu_);
      Entry& entry = entries_[shard.path()];
      if (!entry.info.crc32c().empty() && entry.info.crc32c() != sent.crc32c() && have > 0) {
        // The bytes kept from an earlier fetch belong to another version of the file: start over.
        entry.bytes_done = 0;
        attempt.restart = true;
      }
      entry.info.set_crc32c(sent.crc32c());
      if (attempt.restart) {
        ctx.TryCancel();
        break;
      }
    }
    if (chunk.data().empty()) continue;
    if (chunk.offset() != have || have + chunk.data().size() > shard.bytes()) {
      attempt.local_error = absl::DataLossError(absl::StrCat(what, ": bytes at offset ", chunk.offset(), " where ",
                                                             have, " was expected; the server is broken"));
      ctx.TryCancel();
      break;
    }
    attempt.local_error = WriteAt(target.fd, chunk.data(), have, what, target.bin, options_.dir);
    if (!attempt.local_error.ok()) {
      ctx.TryCancel();
      break;
    }
    have += chunk.data().size();
    attempt.progressed = true;
    *last_progress = SteadyClock::now();
    {
      absl::MutexLock l(&mu_);
      entries_[shard.path()].bytes_done = have;
      changed_.SignalAll();
    }
    Count(chunk.data().size(), server.origin);
    if (on_bytes) on_bytes(chunk.data().size(), server.origin);
  }
  attempt.finished = reader->Finish();
  return attempt;
}

absl::Status ShardCache::Serve(const FetchShardRequest& request, const ShardServer& head,
                               const std::function<bool(const ShardChunk&)>& write,
                               const std::function<bool()>& cancelled) {
  ShardInfo shard;
  shard.set_path(request.path());
  shard.set_bytes(request.bytes());
  shard.set_mtime_ns(request.mtime_ns());
  const std::string what = absl::StrCat(Node(), " relaying shard ", request.path(), " to worker ", request.requester());
  if (request.offset() > request.bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": offset ", request.offset(), " is past the end"));
  }
  uint64_t sent = request.offset();
  bool header_sent = false, started = false;
  while (true) {
    if (cancelled()) return absl::CancelledError(absl::StrCat(what, ": the peer went away"));
    State state;
    uint64_t done;
    ShardInfo info;
    std::string path;
    absl::Status error;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return absl::UnavailableError(absl::StrCat(what, ": the worker is shutting down"));
      Entry& entry = entries_[shard.path()];
      if (entry.path.empty()) entry.path = absl::StrCat(options_.dir, "/", KeyFor(shard.path()), ".bin");
      if (entry.state == State::kComplete && !SameShard(entry.info, shard)) entry.state = State::kIdle;
      if (entry.state == State::kIdle) {
        // The fetch this relay followed failed (or was stopped): so does the relay.
        if (started || header_sent) {
          return entry.error.ok() ? absl::UnavailableError(absl::StrCat(what, ": the fetch from the head stopped"))
                                  : entry.error;
        }
        // Not here and nobody fetching it: fetch it from the head in the background, and follow it.
        started = true;
        entry.state = State::kFetching;
        entry.info = shard;
        entry.error = absl::OkStatus();
        relays_.emplace_back([this, request, shard, head] {
          absl::Status status = Fill(request.job_id(), shard, head, head, &stop_relays_, nullptr);
          if (!status.ok()) GT_LOG(WARNING) << "relay fetch failed: " << status;
          Release(shard.path(), status);
        });
      }
      if (entry.state == State::kFetching && entry.bytes_done <= sent && (header_sent || entry.info.crc32c().empty())) {
        changed_.WaitWithTimeout(&mu_, absl::Milliseconds(200));
      }
      state = entry.state;
      done = entry.bytes_done;
      info = entry.info;
      path = entry.path;
      error = entry.error;
    }
    if (!header_sent && !info.crc32c().empty()) {
      ShardChunk header;
      *header.mutable_shard() = info;
      if (!write(header)) return absl::CancelledError(absl::StrCat(what, ": the peer went away"));
      header_sent = true;
    }
    if (header_sent && done > sent) {
      RETURN_IF_ERROR(
          comm::ReadFileRange(path, sent, done, options_.chunk_bytes, [&](absl::string_view data, uint64_t offset) {
            ShardChunk chunk;
            chunk.set_offset(offset);
            chunk.set_data(std::string(data));
            if (!write(chunk)) return absl::CancelledError(absl::StrCat(what, ": the peer went away"));
            return absl::OkStatus();
          }));
      sent = done;
    }
    if (state == State::kComplete && header_sent && sent >= info.bytes()) return absl::OkStatus();
  }
}

}  // namespace geotrain::worker
