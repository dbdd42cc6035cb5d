// Checkpoint files without the model: writing a shard from a host snapshot, committing a step directory
// (manifest, HF index, `latest`), verifying one, finding the newest complete one and pruning old ones.
// The head uses these to commit and choose checkpoints; it needs no GPT-2 code for it. The format is
// described in model/checkpoint.h.
//
//   ASSIGN_OR_RETURN(std::string step_dir, FindNewestCheckpoint("ckpt/run1", &skipped));
//   ASSIGN_OR_RETURN(CheckpointManifest manifest, VerifyCheckpoint(step_dir));
//
// Thread-safety: the functions are independent and keep no state.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/loss_scale_state.h"
#include "model/safetensors.h"
#include "spec.pb.h"

namespace geotrain::model {

inline constexpr char kCheckpointFormat[] = "geotrain-checkpoint-2";

// The optimizer file that goes with a model file: "model-s1.safetensors" -> "optimizer-s1.safetensors".
std::string OptimizerFileFor(const std::string& model_file);
// DiLoCo checkpoints: the model file of group g ("model-s1.safetensors", 2 -> "model-g2-s1.safetensors"; group 0:
// the file itself), and the file of the outer optimizer's state beside a model file ("diloco-s1.safetensors").
std::string GroupFileFor(const std::string& model_file, int group);
// The suffix of a shard's files (model<suffix>.safetensors, ...): "-g<group>" for a DiLoCo group > 0, then
// "-s<stage>" when the model is pipelined (pp > 1); "" for group 0 of an unpipelined model.
std::string ShardSuffix(int group, int pp, int stage);
std::string DilocoFileFor(const std::string& model_file);

// A stage's weights and AdamW moments copied to host memory (model/checkpoint.h SnapshotStage), so that
// they can be written while training goes on.
// The optimizer file's metadata keys of the loss scale state.
inline constexpr char kLossScaleKey[] = "loss_scale";
inline constexpr char kLossScaleCleanStepsKey[] = "loss_scale_clean_steps";
inline constexpr char kLossScaleSkippedKey[] = "loss_scale_skipped";

struct CheckpointSnapshot {
  std::vector<NamedTensor> weights;  // HF names, full tensors
  std::vector<NamedTensor> moments;  // m.<name> and v.<name>
  std::vector<NamedTensor> outer;    // DiLoCo's outer state: outer.<name> and outer_m.<name>; empty otherwise
  int64_t optimizer_step = 0;
  // fp16's loss scale (with its clean and skipped steps), kept in the optimizer file's metadata; absent when the
  // run does not scale its loss.
  std::optional<LossScaleState> loss_scale;
};

// What WriteCheckpointShard wrote: each file's name (in the step directory), size and CRC-32 (8 hex
// digits), and the tensors of the model file.
struct WrittenShard {
  struct File {
    std::string name;
    uint64_t bytes = 0;
    std::string crc32;
  };
  std::vector<File> files;  // the model file, the optimizer file, and the DiLoCo file when there is one
  std::string model_file;
  std::vector<std::string> tensors;
};

// <dir>/step_NNNNNNNN.
std::string StepDirectory(const std::string& dir, int64_t step);
// Writes model<suffix>.safetensors and optimizer<suffix>.safetensors (and diloco<suffix>.safetensors when the
// snapshot has an outer state) into `step_dir` (created if needed), each atomically. Errors (e.g. a full disk) name the file; nothing is left half-written under its name.
absl::StatusOr<WrittenShard> WriteCheckpointShard(const std::string& step_dir, const std::string& suffix,
                                                  const CheckpointSnapshot& snapshot);
// Completes the checkpoint of manifest.step() under `dir`: writes the HF index when the weights span several
// files, then manifest.json (format and files must be filled in), then points <dir>/latest at it.
absl::Status CommitCheckpoint(const std::string& dir, const CheckpointManifest& manifest);

// Reads and verifies a step directory: the manifest parses, names a known format, and every file it lists
// exists with its recorded size and CRC. DATA_LOSS naming the file otherwise; NOT_FOUND without a manifest.
absl::StatusOr<CheckpointManifest> VerifyCheckpoint(const std::string& step_dir);
// The newest step directory under `dir` that verifies. Each newer one that does not is skipped, with the
// reason appended to `skipped` (may be null). NOT_FOUND when there is none (saying why, if some were skipped).
absl::StatusOr<std::string> FindNewestCheckpoint(const std::string& dir, std::vector<std::string>* skipped);
// Deletes all but the newest `keep` complete checkpoints under `dir`, and the incomplete step directories
// older than the newest complete one (abandoned writes). keep < 0 keeps every complete one.
absl::Status PruneCheckpoints(const std::string& dir, int keep);

// How many complete checkpoints checkpoint.keep asks to keep (0 or absent: 3; -1: all).
int CheckpointsKept(const CheckpointSpec& spec);

// Reads and parses <step_dir>/manifest.json without verifying the files (a checkpoint being fetched file by file).
absl::StatusOr<CheckpointManifest> ReadManifest(const std::string& step_dir);
absl::StatusOr<CheckpointManifest> ParseManifest(const std::string& json, const std::string& source);
// Writes <step_dir>/manifest.json atomically (a partial copy of a checkpoint lists only the files it holds).
absl::Status WriteManifest(const std::string& step_dir, const CheckpointManifest& manifest);

// A plain file name of a step directory ("model-s1.safetensors", "manifest.json"): no directory part, no "..".
bool IsCheckpointFileName(const std::string& name);
// CRC-32 (8 hex digits) of a whole file, as manifests record it.
absl::StatusOr<std::string> FileCrc32Hex(const std::string& path);

// A checkpoint file that arrives in chunks (copied from the node that wrote it): written to <path>.part, it takes its
// name only when its size and CRC-32 match what the sender declared, so a reader never sees a partial file.
//
//   ASSIGN_OR_RETURN(auto file, IncomingCheckpointFile::Create(step_dir + "/model-s1.safetensors", bytes, crc));
//   RETURN_IF_ERROR(file->Append(chunk)); ...  RETURN_IF_ERROR(file->Finish());
//
// Errors (a full disk, a size or CRC mismatch: DATA_LOSS) name the file. One thread at a time.
class IncomingCheckpointFile {
 public:
  // Creates the directory of `path` if needed.
  static absl::StatusOr<std::unique_ptr<IncomingCheckpointFile>> Create(std::string path, uint64_t bytes,
                                                                        std::string crc32);
  ~IncomingCheckpointFile();  // removes the partial file unless Finish succeeded
  IncomingCheckpointFile(const IncomingCheckpointFile&) = delete;
  IncomingCheckpointFile& operator=(const IncomingCheckpointFile&) = delete;

  absl::Status Append(std::string_view data);
  absl::Status Finish();
  uint64_t received() const { return received_; }

 private:
  IncomingCheckpointFile(std::string path, uint64_t bytes, std::string crc32, int fd);
  const std::string path_, part_, crc32_;
  const uint64_t bytes_;
  int fd_;
  uint64_t received_ = 0;
  uint32_t crc_ = 0;
  bool finished_ = false;
};

}  // namespace geotrain::model
