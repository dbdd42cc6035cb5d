// Writes a stage actor's checkpoint shards on a background thread, so that training goes on while the
// files are written: the training thread only takes a snapshot in host memory (model/checkpoint.h
// SnapshotStage), and collects each finished shard to report it to the head, which commits the checkpoint
// when every stage's shard of the step is in.
//
//   CheckpointWriter writer;
//   writer.Write(shard_template, StepDirectory(dir, step), "-s1", std::move(snapshot));  // returns at once
//   for (CheckpointShard& done : writer.TakeFinished()) ...  // attach to the next step report
//   writer.WaitIdle();                                        // before the last report
//
// One write at a time: Write waits for the previous one to finish (the snapshot's memory is bounded to one
// in flight); the time it waited is returned so that it counts as the checkpoint's cost. A failed write
// (e.g. a full disk) becomes a shard with `error` set: the checkpoint is abandoned, training goes on.
// Thread-safety: all methods may be called from any thread.
#pragma once

#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "control.pb.h"
#include "model/checkpoint.h"

namespace geotrain::worker {

class CheckpointWriter {
 public:
  // `publish` (may be null) runs on the writer's thread after a shard's files are written: it copies them where the
  // head keeps the checkpoint (worker/checkpoint_store.h) and completes the shard; its error abandons the checkpoint.
  explicit CheckpointWriter(std::function<absl::Status(CheckpointShard*)> publish = nullptr);
  ~CheckpointWriter();  // finishes the write in flight, then joins
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Queues the write of `snapshot` as model<suffix>/optimizer<suffix> into `step_dir`; `shard` carries the
  // step, actor, stage and data position, and is completed with the files written (or the error). Returns
  // how long it waited for the previous write.
  absl::Duration Write(CheckpointShard shard, std::string step_dir, std::string suffix,
                       model::CheckpointSnapshot snapshot);
  // The shards finished since the last call.
  std::vector<CheckpointShard> TakeFinished();
  // Waits until no write is queued or in flight.
  void WaitIdle();

 private:
  struct Job {
    CheckpointShard shard;
    std::string step_dir, suffix;
    model::CheckpointSnapshot snapshot;
  };
  void Loop();

  const std::function<absl::Status(CheckpointShard*)> publish_;
  absl::Mutex mu_;
  bool has_job_ ABSL_GUARDED_BY(mu_) = false;  // queued or being written
  Job job_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<CheckpointShard> finished_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace geotrain::worker
