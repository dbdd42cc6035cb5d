// The head's side of data staging and checkpoint gathering (see staging_service.h).
#include "head/staging_service.h"

#include <fnmatch.h>
#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "comm/file_transfer.h"
#include "common/log.h"
#include "common/names.h"
#include "common/rpc_call.h"
#include "common/status.h"
#include "model/checkpoint_files.h"
#include "model/checkpoint_receive.h"
#include "nlohmann/json.hpp"

namespace geotrain::head {
namespace {

namespace fs = std::filesystem;

bool Matches(const std::string& pattern, const std::string& path) {
  return !pattern.empty() && ::fnmatch(pattern.c_str(), path.c_str(), FNM_PATHNAME) == 0;
}

std::string Normal(const std::string& path) { return fs::path(path).lexically_normal().string(); }

}  // namespace

namespace {

// The decimal unit that suits `bytes`: its scale and name.
std::pair<double, const char*> UnitFor(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KB", "MB", "GB", "TB"};
  double scale = 1;
  int unit = 0;
  while (unit < 4 && static_cast<double>(bytes) >= scale * 1000) {
    scale *= 1000;
    ++unit;
  }
  return {scale, kUnits[unit]};
}

}  // namespace

std::string FormatBytes(uint64_t bytes) {
  const auto [scale, unit] = UnitFor(bytes);
  return absl::StrFormat("%.1f %s", bytes / scale, unit);
}

std::string FormatBytesOf(uint64_t part, uint64_t total) {
  const auto [scale, unit] = UnitFor(total);
  return absl::StrFormat("%.1f of %.1f %s", part / scale, total / scale, unit);
}

HeadStagingService::HeadStagingService(std::string token, std::string state_dir, Hooks hooks, MetricsServer* metrics)
    : token_(token),
      records_path_(absl::StrCat(state_dir, "/staged_shards.json")),
      hooks_(std::move(hooks)),
      metrics_(metrics),
      auth_(std::move(token)) {
  LoadRecords();
}

void HeadStagingService::LoadRecords() {
  absl::StatusOr<std::string> text = ReadSmallFile(records_path_);
  if (!text.ok()) return;  // none yet
  absl::MutexLock lock(&mu_);
  try {
    for (const auto& item : nlohmann::json::parse(*text)) {
      ShardInfo info;
      info.set_path(item.at("path").get<std::string>());
      info.set_bytes(item.at("bytes").get<uint64_t>());
      info.set_mtime_ns(item.at("mtime_ns").get<int64_t>());
      info.set_crc32c(item.at("crc32c").get<std::string>());
      records_[info.path()] = info;
    }
  } catch (const std::exception& e) {
    GT_LOG(WARNING) << records_path_ << ": " << e.what() << "; the shards' checksums are recorded again";
    records_.clear();
  }
}

void HeadStagingService::SaveRecords() {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [path, info] : records_) {
    out.push_back({{"path", path}, {"bytes", info.bytes()}, {"mtime_ns", info.mtime_ns()}, {"crc32c", info.crc32c()}});
  }
  if (absl::Status s = WriteFileAtomically(records_path_, out.dump(1) + "\n", 0644); !s.ok()) {
    GT_LOG(WARNING) << "recording the shards' checksums: " << s;
  }
}

absl::StatusOr<JobInfo> HeadStagingService::LiveJob(const std::string& job_id, const std::string& what) {
  ASSIGN_OR_RETURN(JobInfo job, hooks_.get_job(job_id));
  if (IsTerminal(job.state())) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": job ", job_id, " has ended (", JobStateName(job.state()), ")"));
  }
  return job;
}

absl::StatusOr<ShardInfo> HeadStagingService::Describe(const std::string& path, bool with_checksum) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::NotFoundError(absl::StrCat("shard ", path, " is not on the head's machine (", std::strerror(errno),
                                            "); data paths in a spec are paths there"));
  }
  ShardInfo info;
  info.set_path(path);
  info.set_bytes(static_cast<uint64_t>(st.st_size));
  info.set_mtime_ns(static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec);
  absl::MutexLock lock(&mu_);
  while (true) {
    auto it = records_.find(path);
    if (it != records_.end() && it->second.bytes() == info.bytes() && it->second.mtime_ns() == info.mtime_ns()) {
      info.set_crc32c(it->second.crc32c());
      return info;
    }
    if (!with_checksum) return info;
    if (!hashing_.count(path)) break;
    hashed_.Wait(&mu_);  // another fetch is hashing it
  }
  hashing_.insert(path);
  mu_.Unlock();
  absl::StatusOr<uint32_t> crc = comm::FileCrc32c(path, static_cast<int64_t>(info.bytes()));
  mu_.Lock();
  hashing_.erase(path);
  hashed_.SignalAll();
  RETURN_IF_ERROR(crc.status());
  info.set_crc32c(comm::Hex32(*crc));
  records_[path] = info;
  SaveRecords();
  return info;
}

grpc::Status HeadStagingService::ListShards(grpc::ServerContext* context, const ListShardsRequest* request,
                                            ListShardsReply* reply) {
  RpcCall call(metrics_, auth_, context, "ListShards");
  if (!call.authorized()) return call.status();
  absl::StatusOr<JobInfo> job = LiveJob(request->job_id(), "ListShards");
  if (!job.ok()) return call.Fail(job.status());
  const DataSpec& data = job->spec().data();
  if (request->pattern().empty() || (request->pattern() != data.train() && request->pattern() != data.val())) {
    return call.Fail(absl::PermissionDeniedError(
        absl::StrCat("ListShards: '", request->pattern(), "' is not a data pattern of job ", request->job_id())));
  }
  glob_t g;
  std::memset(&g, 0, sizeof(g));
  std::vector<std::string> paths;
  if (::glob(request->pattern().c_str(), 0, nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) paths.push_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
  std::sort(paths.begin(), paths.end());
  for (const std::string& path : paths) {
    absl::StatusOr<ShardInfo> info = Describe(path, /*with_checksum=*/false);
    if (info.ok()) *reply->add_shards() = *info;
  }
  return grpc::Status::OK;
}

grpc::Status HeadStagingService::FetchShard(grpc::ServerContext* context, const FetchShardRequest* request,
                                            grpc::ServerWriter<ShardChunk>* writer) {
  RpcCall call(metrics_, auth_, context, "FetchShard");
  if (!call.authorized()) return call.status();
  const std::string what = absl::StrCat("shard ", request->path(), " for worker ", request->requester());
  absl::StatusOr<JobInfo> job = LiveJob(request->job_id(), what);
  if (!job.ok()) return call.Fail(job.status());
  if (!Matches(job->spec().data().train(), request->path()) && !Matches(job->spec().data().val(), request->path())) {
    return call.Fail(absl::PermissionDeniedError(
        absl::StrCat(what, ": not a shard of job ", request->job_id(), "'s data patterns")));
  }
  absl::StatusOr<ShardInfo> info = Describe(request->path(), /*with_checksum=*/true);
  if (!info.ok()) return call.Fail(info.status());
  if ((request->bytes() != 0 && request->bytes() != info->bytes()) ||
      (request->mtime_ns() != 0 && request->mtime_ns() != info->mtime_ns())) {
    return call.Fail(absl::FailedPreconditionError(
        absl::StrCat(what, ": the shard changed on the head since it was listed (", info->bytes(), " bytes now, ",
                     request->bytes(), " then); restart the job to stage the new data")));
  }
  if (request->offset() > info->bytes()) {
    return call.Fail(absl::OutOfRangeError(absl::StrCat(what, ": offset ", request->offset(), " is past its end")));
  }
  ShardChunk header;
  *header.mutable_shard() = *info;
  if (!writer->Write(header)) return grpc::Status::OK;  // the worker went away
  uint64_t sent = 0;
  absl::Status s = comm::ReadFileRange(request->path(), request->offset(), info->bytes(), comm::kFileChunkBytes,
                                       [&](absl::string_view data, uint64_t offset) -> absl::Status {
                                         if (context->IsCancelled()) return absl::CancelledError("cancelled");
                                         ShardChunk chunk;
                                         chunk.set_offset(offset);
                                         chunk.set_data(std::string(data));
                                         if (!writer->Write(chunk)) return absl::CancelledError("the worker went away");
                                         sent += data.size();
                                         return absl::OkStatus();
                                       });
  if (metrics_ != nullptr && sent > 0) {
    metrics_->Counters("geotrain_staging_served_bytes_total", "Bytes of token shards the head served, by site")
        .Add({{"site", request->requester_site()}})
        .Increment(static_cast<double>(sent));
  }
  if (!s.ok() && s.code() != absl::StatusCode::kCancelled) return call.Fail(WithContext(s, what));
  return grpc::Status::OK;
}

grpc::Status HeadStagingService::ReportStaging(grpc::ServerContext* context, const StagingProgress* request,
                                               StagingProgressReply*) {
  RpcCall call(metrics_, auth_, context, "ReportStaging");
  if (!call.authorized()) return call.status();
  absl::StatusOr<JobInfo> job = hooks_.get_job(request->job_id());
  if (!job.ok()) return call.Fail(job.status());
  if (IsTerminal(job->state())) return grpc::Status::OK;
  const std::string where = absl::StrCat("worker ", request->worker_id(), " (", request->site(), ", from ",
                                         request->source() == "head" ? "the head" : request->source(), ")");
  std::string line;
  if (!request->error().empty()) {
    line = absl::StrCat("staging failed on ", where, ": ", request->error());
  } else if (request->done()) {
    const uint64_t total = request->total_bytes();
    line = absl::StrFormat("staged %s on %s: %s from the head, %s from site peers, %s from its cache",
                           FormatBytes(request->staged_bytes()), where, FormatBytes(request->from_head_bytes()),
                           FormatBytes(request->from_peer_bytes()), FormatBytes(request->from_cache_bytes()));
  } else {
    line =
        absl::StrFormat("staging %s, %.0f MB/s on %s", FormatBytesOf(request->staged_bytes(), request->total_bytes()),
                        request->bytes_per_second() / 1e6, where);
  }
  hooks_.log(request->job_id(), line);
  return grpc::Status::OK;
}

grpc::Status HeadStagingService::PutCheckpointFile(grpc::ServerContext* context,
                                                   grpc::ServerReader<CheckpointFileChunk>* reader,
                                                   PutCheckpointFileReply* reply) {
  RpcCall call(metrics_, auth_, context, "PutCheckpointFile");
  if (!call.authorized()) return call.status();
  auto step_dir_for = [this](const CheckpointFileChunk& first) -> absl::StatusOr<std::string> {
    ASSIGN_OR_RETURN(JobInfo job, LiveJob(first.job_id(), "PutCheckpointFile"));
    if (job.spec().checkpoint().dir().empty() || first.step() <= 0) {
      return absl::FailedPreconditionError(absl::StrCat("PutCheckpointFile: job ", first.job_id(),
                                                        " has no checkpoint.dir (or step ", first.step(),
                                                        " is not a step)"));
    }
    return model::StepDirectory(job.spec().checkpoint().dir(), first.step());
  };
  absl::StatusOr<std::string> path =
      model::ReceiveCheckpointFile([reader](CheckpointFileChunk* chunk) { return reader->Read(chunk); }, step_dir_for);
  if (!path.ok()) return call.Fail(WithContext(path.status(), "the head refused a checkpoint file"));
  reply->set_path(*path);
  return grpc::Status::OK;
}

grpc::Status HeadStagingService::FetchCheckpointFile(grpc::ServerContext* context,
                                                     const FetchCheckpointFileRequest* request,
                                                     grpc::ServerWriter<FileChunk>* writer) {
  RpcCall call(metrics_, auth_, context, "FetchCheckpointFile");
  if (!call.authorized()) return call.status();
  absl::StatusOr<JobInfo> job = LiveJob(request->job_id(), "FetchCheckpointFile");
  if (!job.ok()) return call.Fail(job.status());
  const std::string step_dir = Normal(request->step_dir());
  const std::string parent = fs::path(step_dir).parent_path().string();
  const CheckpointSpec& c = job->spec().checkpoint();
  const bool allowed =
      (!job->resumed_from().empty() && step_dir == Normal(job->resumed_from())) ||
      (!c.dir().empty() && parent == Normal(c.dir())) ||
      (!c.resume_from().empty() && (step_dir == Normal(c.resume_from()) || parent == Normal(c.resume_from())));
  if (!allowed || !model::IsCheckpointFileName(request->name())) {
    return call.Fail(
        absl::PermissionDeniedError(absl::StrCat("FetchCheckpointFile: ", request->step_dir(), "/", request->name(),
                                                 " is not a checkpoint job ", request->job_id(), " may resume from")));
  }
  absl::Status s = comm::ServeFile(absl::StrCat(step_dir, "/", request->name()), request->offset(), writer);
  if (!s.ok()) return call.Fail(WithContext(s, "the head serving a checkpoint file"));
  return grpc::Status::OK;
}

}  // namespace geotrain::head
