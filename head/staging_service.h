// The head's DataStaging service (proto/staging.proto): it serves the token shards a job's spec names (paths on the
// head's machine) to the workers that stage them, records each shard's CRC-32C when it first serves it, shows the
// workers' staging progress in the job's log, takes the checkpoint files the actors copy to it (into
// <checkpoint.dir>/step_N/, verified by CRC on arrival) and serves the files of a checkpoint a job resumes from.
//
//   HeadStagingService staging(token, state_dir, {.get_job = ..., .log = ...}, metrics);
//   builder.RegisterService(&staging);
//
// What it serves is limited to the jobs that have not ended: a shard must match one of the job's data patterns,
// a checkpoint file must belong to the job's checkpoint dir or to the checkpoint it resumes from.
//
// Threads: gRPC's sync server threads; the recorded checksums are guarded by mu_ (hashing a shard happens outside
// it, once per shard: a second caller waits for the first).
#pragma once

#include <functional>
#include <map>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "control.pb.h"
#include "staging.grpc.pb.h"

namespace geotrain::head {

class HeadStagingService final : public DataStaging::Service {
 public:
  struct Hooks {
    std::function<absl::StatusOr<JobInfo>(const std::string& job_id)> get_job;
    std::function<void(const std::string& job_id, const std::string& line)> log;
  };
  // `state_dir`: where the recorded checksums persist (staged_shards.json). `metrics` may be null.
  HeadStagingService(std::string token, std::string state_dir, Hooks hooks, MetricsServer* metrics);

  grpc::Status ListShards(grpc::ServerContext* context, const ListShardsRequest* request,
                          ListShardsReply* reply) override;
  grpc::Status FetchShard(grpc::ServerContext* context, const FetchShardRequest* request,
                          grpc::ServerWriter<ShardChunk>* writer) override;
  grpc::Status ReportStaging(grpc::ServerContext* context, const StagingProgress* request,
                             StagingProgressReply* reply) override;
  grpc::Status PutCheckpointFile(grpc::ServerContext* context, grpc::ServerReader<CheckpointFileChunk>* reader,
                                 PutCheckpointFileReply* reply) override;
  grpc::Status FetchCheckpointFile(grpc::ServerContext* context, const FetchCheckpointFileRequest* request,
                                   grpc::ServerWriter<FileChunk>* writer) override;

 private:
  // The job, if it has not ended (FAILED_PRECONDITION naming it otherwise).
  absl::StatusOr<JobInfo> LiveJob(const std::string& job_id, const std::string& what);
  // The shard as it is on disk now, with its CRC-32C (computed and recorded on first use).
  absl::StatusOr<ShardInfo> Describe(const std::string& path, bool with_checksum);
  void LoadRecords();
  void SaveRecords() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string token_;
  const std::string records_path_;
  const Hooks hooks_;
  MetricsServer* const metrics_;
  TokenAuth auth_;

  absl::Mutex mu_;
  absl::CondVar hashed_;
  std::map<std::string, ShardInfo> records_ ABSL_GUARDED_BY(mu_);  // by path: size, time and CRC-32C recorded
  std::set<std::string> hashing_ ABSL_GUARDED_BY(mu_);
};

// "3.2 of 12.0 GB": both amounts in the unit that suits the total; "12.0 GB".
std::string FormatBytesOf(uint64_t part, uint64_t total);
std::string FormatBytes(uint64_t bytes);

}  // namespace geotrain::head
