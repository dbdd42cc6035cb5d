// Checkpoints on nodes that share no filesystem. A stage actor writes its shard into a directory on its own node;
// the shard's files are then copied to the head, which keeps them under checkpoint.dir with the manifest it
// commits (verified by CRC on arrival), and, with `checkpoint.replicate`, to a worker at another site. A resume
// fetches the files the stage needs from the head (or the replica the manifest names) into the worker's state dir.
//
//   CheckpointStore* store = services.checkpoints;                  // null: checkpoint.dir is shared (tests)
//   std::string local = store->LocalStepDir(step);                  // write the shard here
//   RETURN_IF_ERROR(store->Publish(&shard, StepDirectory(spec.checkpoint().dir(), step)));  // writer thread
//   ASSIGN_OR_RETURN(std::string dir, store->FetchForResume(resume_from, stage.TensorNames(), diloco_group));
//
// Thread-safety: Publish runs on the checkpoint writer's thread while the actor's thread may call FetchForResume or
// LocalStepDir; the implementation keeps no shared mutable state.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/rpc.h"
#include "control.pb.h"

namespace geotrain::worker {

class CheckpointStore {
 public:
  virtual ~CheckpointStore() = default;
  // Where the actor writes its shard of `step` on its own node.
  virtual std::string LocalStepDir(int64_t step) = 0;
  // Copies the files of `shard` (written in LocalStepDir(shard->step())) to the head's `head_step_dir`, and to the
  // replica worker when the job replicates; sets shard->dir and the replica fields. The local copy is removed once
  // the head has it. An error names the file and the node that refused it.
  virtual absl::Status Publish(CheckpointShard* shard, const std::string& head_step_dir) = 0;
  // A local directory holding the manifest of the checkpoint at `head_step_dir` (a step directory on the head) and
  // the files a stage holding `tensors` (HF names) reads, each verified by its CRC: their weights and moments
  // (DiLoCo group `group`'s, or group 0's when the checkpoint holds fewer groups) and DiLoCo's outer state
  // when the checkpoint has it.
  virtual absl::StatusOr<std::string> FetchForResume(const std::string& head_step_dir,
                                                     const std::vector<std::string>& tensors, int group = 0) = 0;
};

// The replica target of `checkpoint.replicate`: the job's worker with the smallest id at another site than
// `site` ({} when every actor is at this site).
ActorPeer ReplicaWorker(const std::vector<ActorPeer>& peers, const std::string& site);

struct GrpcCheckpointStoreOptions {
  std::string state_dir;  // the worker's: local shards, replicas and resume copies live below it
  std::string job_id;
  std::string actor_id;  // the actor's files live in directories of their own
  std::string worker_id;
  std::string site;
  std::string head_address;
  std::string token;
  TlsFiles tls;
  ActorPeer replica;  // empty worker_id: no replica
};

// Over DataStaging (proto/staging.proto) to the head and the replica worker.
std::unique_ptr<CheckpointStore> MakeGrpcCheckpointStore(GrpcCheckpointStoreOptions options);

// Where a worker keeps the checkpoint replicas it holds: <state_dir>/checkpoints/replicas/<job>/step_N.
std::string ReplicaStepDir(const std::string& state_dir, const std::string& job_id, int64_t step);

}  // namespace geotrain::worker
