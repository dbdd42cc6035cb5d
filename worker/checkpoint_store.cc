// Checkpoint files copied to the head and a replica, and fetched back for a resume (see checkpoint_store.h).
#include "worker/checkpoint_store.h"

#include <filesystem>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "comm/file_transfer.h"
#include "common/log.h"
#include "common/status.h"
#include "model/checkpoint_files.h"
#include "staging.grpc.pb.h"

namespace geotrain::worker {
namespace {

namespace fs = std::filesystem;

constexpr int kAttempts = 3;  // a copy broken off by a short outage is tried again from the start

// Sends one local file to a node's DataStaging.PutCheckpointFile.
absl::Status SendFile(DataStaging::Stub* stub, const std::string& token, const std::string& job_id, int64_t step,
                      const std::string& local_path, const CheckpointFile& file) {
  absl::Status status;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    grpc::ClientContext ctx;
    AttachToken(&ctx, token);
    SetDeadlineMillis(&ctx, 30 * 60 * 1000);
    PutCheckpointFileReply reply;
    std::unique_ptr<grpc::ClientWriter<CheckpointFileChunk>> writer = stub->PutCheckpointFile(&ctx, &reply);
    CheckpointFileChunk first;
    first.set_job_id(job_id);
    first.set_step(step);
    first.set_name(file.name());
    first.set_bytes(file.bytes());
    first.set_crc32(file.crc32());
    bool header_sent = false;
    absl::Status read = comm::ReadFileRange(local_path, 0, file.bytes(), comm::kFileChunkBytes,
                                            [&](absl::string_view data, uint64_t) -> absl::Status {
                                              CheckpointFileChunk chunk = header_sent ? CheckpointFileChunk() : first;
                                              chunk.set_data(std::string(data));
                                              header_sent = true;
                                              if (!writer->Write(chunk))
                                                return absl::UnavailableError("the receiver closed the stream");
                                              return absl::OkStatus();
                                            });
    if (read.ok() && !header_sent) writer->Write(first);  // an empty file
    if (!read.ok()) ctx.TryCancel();                      // the receiver must not keep a partial file
    writer->WritesDone();
    const grpc::Status finished = writer->Finish();
    if (!finished.ok()) {
      status = FromGrpc(finished);
    } else {
      status = read;
    }
    if (status.ok() || (finished.ok() && !read.ok()) || finished.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(500 * (attempt + 1)));
  }
  return status;
}

// Reads a whole file of a node's DataStaging.FetchCheckpointFile; `consume` takes each chunk.
absl::Status ReadRemoteFile(DataStaging::Stub* stub, const std::string& token,
                            const FetchCheckpointFileRequest& request,
                            const std::function<absl::Status(const FileChunk&)>& consume) {
  grpc::ClientContext ctx;
  AttachToken(&ctx, token);
  SetDeadlineMillis(&ctx, 30 * 60 * 1000);
  std::unique_ptr<grpc::ClientReader<FileChunk>> reader = stub->FetchCheckpointFile(&ctx, request);
  FileChunk chunk;
  absl::Status local;
  while (reader->Read(&chunk)) {
    local = consume(chunk);
    if (!local.ok()) {
      ctx.TryCancel();
      break;
    }
  }
  const grpc::Status finished = reader->Finish();
  RETURN_IF_ERROR(local);
  return FromGrpc(finished);
}

class GrpcCheckpointStore : public CheckpointStore {
 public:
  explicit GrpcCheckpointStore(GrpcCheckpointStoreOptions options) : options_(std::move(options)) {}

  std::string LocalStepDir(int64_t step) override {
    // One directory per actor: actors of a job on one node (or on nodes sharing a state dir) never touch each
    // other's files.
    return model::StepDirectory(
        absl::StrCat(options_.state_dir, "/checkpoints/local/", options_.job_id, "/", options_.actor_id), step);
  }

  absl::Status Publish(CheckpointShard* shard, const std::string& head_step_dir) override {
    const std::string local = LocalStepDir(shard->step());
    ASSIGN_OR_RETURN(auto head, Stub(options_.head_address));
    for (const CheckpointFile& file : shard->files()) {
      RETURN_IF_ERROR(
          WithContext(SendFile(head.get(), options_.token, options_.job_id, shard->step(),
                               absl::StrCat(local, "/", file.name()), file),
                      absl::StrCat("copying checkpoint file ", file.name(), " of step ", shard->step(), " from worker ",
                                   options_.worker_id, " to the head (", options_.head_address, ")")));
    }
    shard->set_dir(head_step_dir);
    if (!options_.replica.worker_id().empty()) {
      absl::Status replicated = Replicate(*shard, local);
      if (replicated.ok()) {
        shard->set_replica_worker(options_.replica.worker_id());
        shard->set_replica_address(ReplicaAddress());
      } else {
        GT_LOG(WARNING) << "checkpoint of step " << shard->step() << ": no replica on worker "
                        << options_.replica.worker_id() << ": " << replicated;
      }
    }
    std::error_code ec;
    for (const CheckpointFile& file : shard->files()) fs::remove(absl::StrCat(local, "/", file.name()), ec);
    fs::remove(local, ec);  // the head has the files now (the directory goes when empty)
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> FetchForResume(const std::string& head_step_dir, const std::vector<std::string>& tensors,
                                             int group) override {
    const std::string local = absl::StrCat(options_.state_dir, "/checkpoints/resume/", options_.job_id, "/",
                                           options_.actor_id, "/", fs::path(head_step_dir).filename().string());
    const std::string what = absl::StrCat("fetching checkpoint ", head_step_dir, " for worker ", options_.worker_id);
    ASSIGN_OR_RETURN(auto head, Stub(options_.head_address));
    FetchCheckpointFileRequest request;
    request.set_job_id(options_.job_id);
    request.set_step_dir(head_step_dir);
    request.set_name("manifest.json");
    std::string manifest_json;
    RETURN_IF_ERROR(WithContext(ReadRemoteFile(head.get(), options_.token, request,
                                               [&](const FileChunk& chunk) {
                                                 if (manifest_json.size() + chunk.data().size() > (64 << 20)) {
                                                   return absl::DataLossError("manifest.json is over 64 MiB");
                                                 }
                                                 manifest_json += chunk.data();
                                                 return absl::OkStatus();
                                               }),
                                what));
    ASSIGN_OR_RETURN(CheckpointManifest manifest,
                     model::ParseManifest(manifest_json, absl::StrCat(head_step_dir, "/manifest.json on the head")));
    // The files to fetch: the group's weights and moments of every model file (group 0's names, as the manifest's
    // tensors list them) holding one of `tensors`, and its DiLoCo outer state when there is one.
    std::set<std::string> sources, needed;
    if (manifest.tensors().empty()) {  // format 1: one model file
      for (const auto& [name, entry] : manifest.files()) needed.insert(name);
    } else {
      for (const std::string& tensor : tensors) {
        auto it = manifest.tensors().find(tensor);
        if (it == manifest.tensors().end()) {
          return absl::DataLossError(absl::StrCat(what, ": the checkpoint has no tensor ", tensor));
        }
        sources.insert(it->second);
      }
    }
    if (group >= manifest.diloco_groups()) group = 0;  // as model::LoadCheckpoint reads it
    for (const std::string& source : sources) {
      const std::string file = model::GroupFileFor(source, group);
      needed.insert(file);
      needed.insert(model::OptimizerFileFor(file));
      if (manifest.files().contains(model::DilocoFileFor(source))) needed.insert(model::DilocoFileFor(source));
    }
    // Older resume copies of this job are of no use any more.
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(fs::path(local).parent_path(), ec)) {
      if (e.path() != fs::path(local)) fs::remove_all(e.path(), ec);
    }
    CheckpointManifest partial = manifest;
    partial.clear_files();
    partial.clear_replicas();
    // The copy lists the files it holds, and the tensors in them. A DiLoCo copy is of one group, the one it
    // holds: its tensors name that group's files, which model::LoadCheckpoint then reads as group 0's.
    partial.clear_tensors();
    for (const auto& [tensor, file] : manifest.tensors()) {
      if (sources.contains(file)) (*partial.mutable_tensors())[tensor] = model::GroupFileFor(file, group);
    }
    if (partial.diloco_groups() > 1) partial.set_diloco_groups(1);
    for (const std::string& name : needed) {
      auto entry = manifest.files().find(name);
      if (entry == manifest.files().end() || !model::IsCheckpointFileName(name)) {
        return absl::DataLossError(absl::StrCat(what, ": the manifest lists no file ", name));
      }
      (*partial.mutable_files())[name] = entry->second;
      const std::string path = absl::StrCat(local, "/", name);
      if (comm::FileSize(path).value_or(~0ull) == entry->second.bytes() &&
          model::FileCrc32Hex(path).value_or("") == entry->second.crc32()) {
        continue;  // fetched before (a restart on the same worker)
      }
      request.set_name(name);
      absl::Status fetched = FetchFile(head.get(), request, path, entry->second);
      auto replica = manifest.replicas().find(name);
      if (!fetched.ok() && replica != manifest.replicas().end()) {
        const std::string address = replica->second.substr(replica->second.find('@') + 1);
        GT_LOG(WARNING) << what << ": " << name << " from the head failed (" << fetched << "); trying the replica on "
                        << replica->second;
        ASSIGN_OR_RETURN(auto replica_stub, Stub(address));
        FetchCheckpointFileRequest from_replica = request;
        from_replica.set_job_id(manifest.job());
        from_replica.set_step(manifest.step());
        fetched = FetchFile(replica_stub.get(), from_replica, path, entry->second);
      }
      RETURN_IF_ERROR(WithContext(fetched, absl::StrCat(what, ": ", name)));
    }
    RETURN_IF_ERROR(model::WriteManifest(local, partial));
    return local;
  }

 private:
  absl::StatusOr<std::unique_ptr<DataStaging::Stub>> Stub(const std::string& address) {
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, MakeChannel(address, options_.tls));
    return DataStaging::NewStub(channel);
  }

  std::string ReplicaAddress() const {
    const auto it = options_.replica.address_for_site().find(options_.site);
    return it != options_.replica.address_for_site().end() ? it->second : options_.replica.address();
  }

  absl::Status Replicate(const CheckpointShard& shard, const std::string& local) {
    ASSIGN_OR_RETURN(auto replica, Stub(ReplicaAddress()));
    for (const CheckpointFile& file : shard.files()) {
      RETURN_IF_ERROR(SendFile(replica.get(), options_.token, options_.job_id, shard.step(),
                               absl::StrCat(local, "/", file.name()), file));
    }
    return absl::OkStatus();
  }

  absl::Status FetchFile(DataStaging::Stub* stub, const FetchCheckpointFileRequest& request, const std::string& path,
                         const CheckpointFileEntry& entry) {
    ASSIGN_OR_RETURN(std::unique_ptr<model::IncomingCheckpointFile> file,
                     model::IncomingCheckpointFile::Create(path, entry.bytes(), entry.crc32()));
    RETURN_IF_ERROR(ReadRemoteFile(stub, options_.token, request,
                                   [&](const FileChunk& chunk) { return file->Append(chunk.data()); }));
    return file->Finish();
  }

  const GrpcCheckpointStoreOptions options_;
};

}  // namespace

ActorPeer ReplicaWorker(const std::vector<ActorPeer>& peers, const std::string& site) {
  const ActorPeer* best = nullptr;
  for (const ActorPeer& p : peers) {
    if (p.site() != site && (best == nullptr || p.worker_id() < best->worker_id())) best = &p;
  }
  return best != nullptr ? *best : ActorPeer();
}

std::unique_ptr<CheckpointStore> MakeGrpcCheckpointStore(GrpcCheckpointStoreOptions options) {
  return std::make_unique<GrpcCheckpointStore>(std::move(options));
}

std::string ReplicaStepDir(const std::string& state_dir, const std::string& job_id, int64_t step) {
  return model::StepDirectory(absl::StrCat(state_dir, "/checkpoints/replicas/", job_id), step);
}

}  // namespace geotrain::worker
