// Model weights and training checkpoints on disk.
//
// Weights are safetensors with HuggingFace GPT-2 names and Conv1D (in, out) layout, wte with the real V
// rows, so `transformers.GPT2Model.from_pretrained` loads them. Loading accepts the `transformer.` prefix
// of GPT2LMHeadModel files, skips the attn.bias / attn.masked_bias buffers and the tied lm_head.weight.
//
// A training checkpoint is a directory <dir>/step_NNNNNNNN/ with
//   model.safetensors      the weights (as above)
//   optimizer.safetensors  AdamW moments as m.<name> and v.<name>, same layout as the weights
//   manifest.json          step, model shape, data position, and each file's size and CRC-32
// and <dir>/latest naming the newest one. Every file is written atomically (temporary file, fsync,
// rename) and the manifest last, so a crash never leaves a checkpoint that verifies but is incomplete.
// Loading verifies sizes, CRCs, names, shapes and dtypes before touching the model.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/data.h"
#include "model/gpt2.h"
#include "model/optimizer.h"
#include "model/safetensors.h"

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

struct CheckpointInfo {
  int64_t step = 0;  // optimizer steps taken
  DataPosition data_position;
  std::string directory;  // the step directory
};

// Saves model, optimizer and data position as <dir>/step_NNNNNNNN and points <dir>/latest at it.
absl::Status SaveCheckpoint(const std::string& dir, int64_t step, GPT2Stage& stage, AdamW& adam,
                            const DataPosition& data_position);
// Loads <dir>/latest (or the given step directory) into stage and adam after verifying it; returns the
// step and data position. NotFound when dir holds no checkpoint.
absl::StatusOr<CheckpointInfo> LoadCheckpoint(const std::string& dir, GPT2Stage& stage, AdamW& adam);

}  // namespace geotrain::model
