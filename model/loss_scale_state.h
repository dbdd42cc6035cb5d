// fp16's dynamic loss scale (model/loss_scaler.h) as plain values: its options, and its state as checkpoints keep
// it (model/checkpoint_files.h), with no dependency, so that the checkpoint files' library and the head carry them
// without the model.
#pragma once

#include <cstdint>

namespace geotrain::model {

struct LossScaleOptions {
  bool enabled = false;
  double initial = 65536;      // 2^16
  int growth_interval = 2000;  // clean steps before the scale doubles
};

struct LossScaleState {
  double scale = 1;
  int64_t clean_steps = 0;  // since the last skip or growth
  int64_t skipped = 0;      // steps skipped so far
};

}  // namespace geotrain::model
