// Model weights and training checkpoints on disk.
//
// Weights are safetensors with HuggingFace GPT-2 names and Conv1D (in, out) layout, wte with the real V
// rows, so `transformers.GPT2Model.from_pretrained` loads them. Loading accepts the `transformer.` prefix
// of GPT2LMHeadModel files, skips the attn.bias / attn.masked_bias buffers and the tied lm_head.weight.
//
// A training checkpoint is a step directory <dir>/step_NNNNNNNN/ holding
//   model[-sK].safetensors      weights: full tensors (never tensor-parallel shards), one file per
//                               pipeline stage that wrote them, or one model.safetensors for the whole model
//   optimizer[-sK].safetensors  the AdamW moments of the same tensors, as m.<name> and v.<name>
//   model.safetensors.index.json  HF's index ({"weight_map": {name: file}}) when the weights span files
//   manifest.json               proto CheckpointManifest (spec.proto): step, model shape, data position,
//                               optimizer step, each file's size and CRC-32, which file holds each tensor
// and <dir>/latest naming the newest one. Every file is written atomically (temporary file, fsync,
// rename) and the manifest last, so a step directory with a manifest whose files verify is complete.
// The format does not depend on the plan that wrote it: a checkpoint of any (dp, pp, tp, placement)
// resumes under any other plan of the same model, and `train --local` and cluster jobs read each other's.
//
//   Writing, in a cluster (the training thread snapshots; a background thread writes; the head commits):
//     ASSIGN_OR_RETURN(CheckpointSnapshot snap, SnapshotStage(stage, adam, /*keep=*/tp_rank == 0));
//     ASSIGN_OR_RETURN(WrittenShard shard, WriteCheckpointShard(StepDirectory(dir, step), "-s0", snap));
//     RETURN_IF_ERROR(CommitCheckpoint(dir, manifest));  // once every shard of the step is in
//   Reading (any plan):
//     ASSIGN_OR_RETURN(CheckpointInfo info, LoadCheckpoint(dir_or_step_dir, stage, adam));
//
// Loading verifies sizes, CRCs, names, shapes and dtypes before touching the model. Thread-safety: the
// functions are independent; SnapshotStage must run on the thread that drives the stage.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/checkpoint_files.h"
#include "model/data.h"
#include "model/diloco.h"
#include "model/gpt2.h"
#include "model/optimizer.h"
#include "model/safetensors.h"
#include "spec.pb.h"

namespace geotrain::model {

// The stage's tensors (or gradients) under their HF names; on a TP rank > 1 collective (see
// GPT2Stage::ExportTensor). prefix is prepended to each name (e.g. "grad.").
absl::StatusOr<std::vector<NamedTensor>> ExportStageTensors(GPT2Stage& stage, bool grads,
                                                            const std::string& prefix = "");
// Sets every tensor the stage holds from a weights file; fails if one is missing or mis-shaped.
absl::Status LoadStageWeights(const std::string& path, GPT2Stage& stage);
absl::Status LoadStageWeights(const SafetensorsFile& file, const std::string& source, GPT2Stage& stage);
// Writes the stage's weights (tp = 1 or collective) to path atomically.
absl::Status SaveStageWeights(const std::string& path, GPT2Stage& stage);

// Takes a stage's weights and AdamW moments into host memory (see CheckpointSnapshot in
// model/checkpoint_files.h), and DiLoCo's outer state when `outer` is given. Collective on a tensor-parallel
// stage: every rank calls it in the same order; ranks with keep == false take part and return an empty snapshot.
absl::StatusOr<CheckpointSnapshot> SnapshotStage(GPT2Stage& stage, AdamW& adam, bool keep,
                                                 OuterOptimizer* outer = nullptr);

struct CheckpointInfo {
  int64_t step = 0;           // optimizer steps taken
  int diloco_groups = 0;      // the checkpoint's (CheckpointManifest::diloco_groups)
  bool outer_loaded = false;  // DiLoCo's outer state came from the checkpoint (else: the loaded weights, no momentum)
  DataPosition data_position;
  std::string directory;             // the step directory loaded
  std::vector<std::string> skipped;  // newer step directories that did not verify, and why
};

// Saves model, optimizer and data position as <dir>/step_NNNNNNNN (one shard: model.safetensors and
// optimizer.safetensors) and points <dir>/latest at it.
absl::Status SaveCheckpoint(const std::string& dir, int64_t step, GPT2Stage& stage, AdamW& adam,
                            const DataPosition& data_position);
// A DiLoCo simulation's: group 0 as above plus its outer state (diloco.safetensors), group g > 0 in
// model-g<g>.safetensors and optimizer-g<g>.safetensors; the manifest records the number of groups.
absl::Status SaveCheckpoint(const std::string& dir, int64_t step,
                            const std::vector<std::pair<GPT2Stage*, AdamW*>>& groups, OuterOptimizer* outer,
                            const DataPosition& data_position);
// Loads a checkpoint into stage and adam after verifying it: `path` is a step directory, or a checkpoint
// directory whose newest complete checkpoint is taken (newer corrupt or incomplete ones are skipped and
// listed in `skipped`). Only the tensors the stage holds are read (its layers, or its tensor-parallel part
// of them). NOT_FOUND when there is no checkpoint; INVALID_ARGUMENT for another model shape.
absl::StatusOr<CheckpointInfo> LoadCheckpoint(const std::string& path, GPT2Stage& stage, AdamW& adam);
// DiLoCo: the weights and moments of group `group` (group 0's when the checkpoint holds fewer groups, e.g. one
// of a synchronous job), and, when `outer` is given, its outer state: from the checkpoint's diloco files, or
// else the loaded weights with zero momentum.
struct CheckpointLoadOptions {
  int group = 0;
  OuterOptimizer* outer = nullptr;
};
absl::StatusOr<CheckpointInfo> LoadCheckpoint(const std::string& path, GPT2Stage& stage, AdamW& adam,
                                              const CheckpointLoadOptions& options);
// The tensors `names` of a host buffer in the stage's parameter layout, under HF names with `prefix`.
absl::StatusOr<std::vector<NamedTensor>> ExportBufferTensors(GPT2Stage& stage, const float* buffer,
                                                             const std::string& prefix);

}  // namespace geotrain::model
