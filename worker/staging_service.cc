// A worker's DataStaging service: relays and replicas (see staging_service.h).
#include "worker/staging_service.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "comm/file_transfer.h"
#include "common/rpc_call.h"
#include "common/status.h"
#include "model/checkpoint_files.h"
#include "model/checkpoint_receive.h"
#include "worker/checkpoint_store.h"

namespace geotrain::worker {

WorkerStagingService::WorkerStagingService(ShardCache* cache, const std::string& token, std::string state_dir,
                                           ShardServer head, MetricsServer* metrics)
    : cache_(cache), auth_(token), state_dir_(std::move(state_dir)), head_(std::move(head)), metrics_(metrics) {}

grpc::Status WorkerStagingService::FetchShard(grpc::ServerContext* context, const FetchShardRequest* request,
                                              grpc::ServerWriter<ShardChunk>* writer) {
  RpcCall call(metrics_, auth_, context, "FetchShard");
  if (!call.authorized()) return call.status();
  absl::Status s = cache_->Serve(
      *request, head_, [writer](const ShardChunk& chunk) { return writer->Write(chunk); },
      [context] { return context->IsCancelled(); });
  if (!s.ok()) return call.Fail(s);
  return grpc::Status::OK;
}

grpc::Status WorkerStagingService::PutCheckpointFile(grpc::ServerContext* context,
                                                     grpc::ServerReader<CheckpointFileChunk>* reader,
                                                     PutCheckpointFileReply* reply) {
  RpcCall call(metrics_, auth_, context, "PutCheckpointFile");
  if (!call.authorized()) return call.status();
  std::string job_id;
  absl::StatusOr<std::string> path = model::ReceiveCheckpointFile(
      [reader](CheckpointFileChunk* chunk) { return reader->Read(chunk); },
      [&](const CheckpointFileChunk& first) -> absl::StatusOr<std::string> {
        if (first.job_id().empty() || !model::IsCheckpointFileName(first.job_id()) || first.step() <= 0) {
          return absl::InvalidArgumentError("PutCheckpointFile: a job id and a step are required");
        }
        job_id = first.job_id();
        return ReplicaStepDir(state_dir_, first.job_id(), first.step());
      });
  if (!path.ok()) return call.Fail(WithContext(path.status(), "keeping a checkpoint replica"));
  reply->set_path(*path);
  // Only the newest replicas of a job are kept.
  std::error_code ec;
  const std::filesystem::path job_dir = std::filesystem::path(*path).parent_path().parent_path();
  std::vector<std::filesystem::path> steps;
  for (const auto& e : std::filesystem::directory_iterator(job_dir, ec)) steps.push_back(e.path());
  std::sort(steps.rbegin(), steps.rend());  // step_NNNNNNNN: the name orders them
  for (size_t i = kReplicasKept; i < steps.size(); ++i) std::filesystem::remove_all(steps[i], ec);
  return grpc::Status::OK;
}

grpc::Status WorkerStagingService::FetchCheckpointFile(grpc::ServerContext* context,
                                                       const FetchCheckpointFileRequest* request,
                                                       grpc::ServerWriter<FileChunk>* writer) {
  RpcCall call(metrics_, auth_, context, "FetchCheckpointFile");
  if (!call.authorized()) return call.status();
  if (!model::IsCheckpointFileName(request->job_id()) || !model::IsCheckpointFileName(request->name()) ||
      request->step() <= 0) {
    return call.Fail(absl::InvalidArgumentError("FetchCheckpointFile: a job id, a step and a file name are required"));
  }
  const std::string path =
      absl::StrCat(ReplicaStepDir(state_dir_, request->job_id(), request->step()), "/", request->name());
  absl::Status s = comm::ServeFile(path, request->offset(), writer);
  if (!s.ok()) return call.Fail(WithContext(s, "serving a checkpoint replica"));
  return grpc::Status::OK;
}

}  // namespace geotrain::worker
