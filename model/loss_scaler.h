// Dynamic loss scaling for fp16 training, as mixed-precision training does it: the loss gradient is multiplied
// by a scale S so that small gradients survive fp16's narrow range; a step whose gradients hold an infinity or a
// NaN (S was too large: fp16 overflowed) is skipped and S halved; after `growth_interval` clean steps in a row S
// is doubled. Applied gradients are divided by S (the optimizer's grad_scale), so the update is what fp32
// training would make of the same rounded values.
//
//   LossScaler scaler(LossScaleOptions{.enabled = precision == Precision::kFp16});
//   model.Backward(nullptr, microbatch_scale * scaler.scale());
//   const bool finite = std::isfinite(squared_norm);   // one decision: the norm all-reduced over the job first
//   if (scaler.Update(finite)) adam.Step(params, grads, lr, clip / scaler.scale_applied());
//
// Disabled (fp32, bf16), the scale is 1 and every step applies: bf16 has fp32's range. The state (scale, clean
// steps, skipped steps) is saved in checkpoints and restored on resume (model/checkpoint.h). Thread safety: one
// owner, like the optimizer.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "model/loss_scale_state.h"

namespace geotrain::model {

class LossScaler {
 public:
  explicit LossScaler(LossScaleOptions options = {});

  bool enabled() const { return options_.enabled; }
  // The scale for this step's backward passes (1 when disabled).
  float scale() const { return static_cast<float>(state_.scale); }
  // After the step's gradients are in: whether they are applied. A non-finite step (only when enabled) is skipped
  // and halves the scale (never below 2^-24, where fp16 has nothing left to scale); a finite one counts towards
  // growth. scale_applied() is the scale the step's gradients carry, to divide by.
  bool Update(bool finite);
  float scale_applied() const { return static_cast<float>(applied_); }

  const LossScaleState& state() const { return state_; }
  // A checkpoint's state; INVALID_ARGUMENT (DATA_LOSS from a file, by the caller) for a scale that is not a
  // positive finite number or negative counts.
  absl::Status Restore(const LossScaleState& state);

 private:
  LossScaleOptions options_;
  LossScaleState state_;
  double applied_ = 1;
};

}  // namespace geotrain::model
