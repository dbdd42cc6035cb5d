// A worker's DataStaging service (proto/staging.proto): the shards of its cache to its site's peers (relayed from
// the head while they arrive, so that a shard crosses the WAN once per site), and the checkpoint replicas it keeps
// for workers at other sites (`checkpoint.replicate`). Listing shards and staging progress are the head's.
//
// Threads: gRPC's sync server threads; the cache is thread-safe; replica files are written under distinct names.
#pragma once

#include <functional>
#include <string>

#include "common/metrics.h"
#include "common/rpc.h"
#include "staging.grpc.pb.h"
#include "worker/shard_cache.h"

namespace geotrain::worker {

class WorkerStagingService final : public DataStaging::Service {
 public:
  // `cache` outlives the service; `head` says where the cache fetches what a peer asks for and it lacks;
  // replicas live under `state_dir` (worker/checkpoint_store.h ReplicaStepDir). `metrics` may be null.
  WorkerStagingService(ShardCache* cache, const std::string& token, std::string state_dir, ShardServer head,
                       MetricsServer* metrics);

  grpc::Status FetchShard(grpc::ServerContext* context, const FetchShardRequest* request,
                          grpc::ServerWriter<ShardChunk>* writer) override;
  grpc::Status PutCheckpointFile(grpc::ServerContext* context, grpc::ServerReader<CheckpointFileChunk>* reader,
                                 PutCheckpointFileReply* reply) override;
  grpc::Status FetchCheckpointFile(grpc::ServerContext* context, const FetchCheckpointFileRequest* request,
                                   grpc::ServerWriter<FileChunk>* writer) override;

  // How many replica checkpoints a worker keeps per job (the newest).
  static constexpr int kReplicasKept = 3;

 private:
  ShardCache* const cache_;
  TokenAuth auth_;
  const std::string state_dir_;
  const ShardServer head_;
  MetricsServer* const metrics_;
};

}  // namespace geotrain::worker
