// Training arithmetic around the model: AdamW over a stage's parameter buffer, global gradient-norm
// clipping and the warm-up + cosine learning-rate schedule.
//
//   AdamW adam(stage.num_params(), stage.segments(), {.weight_decay = 0.1f});
//   double norm = std::sqrt(stage.GradSquaredNormShare());   // sum the shares of all stages/ranks first
//   adam.Step(stage.params(), stage.grads(), schedule.At(step), ClipScale(norm, 1.0));
//
// The update follows torch.optim.AdamW exactly (decoupled decay applied first, bias corrections in
// the step size and in the denominator), so the parity tests can compare against PyTorch. The arithmetic
// is the backend's adamw_update (model/ops.h on the CPU); on a device, params, grads and the moments are
// device memory:
//
//   ASSIGN_OR_RETURN(std::unique_ptr<AdamW> adam, AdamW::Create(n, stage.segments(), {}, stage.backend()));
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/backend.h"
#include "model/gpt2.h"
#include "model/loss_scaler.h"

namespace geotrain::model {

struct AdamWOptions {
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // applied only to segments with weight_decay set
  // fp16 training's dynamic loss scale, which the optimizer keeps with its step count and moments (checkpoints
  // save it with them). Disabled by default: the scale is 1.
  LossScaleOptions loss_scale;
};

class AdamW {
 public:
  // On the CPU (moments in host memory).
  AdamW(int64_t num_params, std::vector<ParameterSegment> segments, AdamWOptions options);
  // On `backend` (not owned; must outlive the optimizer): the moments are allocated there, zeroed.
  static absl::StatusOr<std::unique_ptr<AdamW>> Create(int64_t num_params, std::vector<ParameterSegment> segments,
                                                       AdamWOptions options, Backend& backend);
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // One update of params from grads * grad_scale (grad_scale from ClipScale), both backend memory.
  // Increments step(). Queued on a device: its errors surface at the backend's next Synchronize (the
  // stage's next Forward).
  void Step(float* params, const float* grads, float lr, float grad_scale);

  int64_t step() const { return step_; }
  void set_step(int64_t step) { step_ = step; }
  int64_t num_params() const { return num_params_; }
  Backend& backend() const { return *backend_; }
  // First and second moments, (num_params) each, in backend memory (device pointers on a device).
  float* m() { return m_.as<float>(); }
  float* v() { return v_.as<float>(); }
  // The moments through host memory, for checkpoints: resize m and v to num_params and fill them; or set
  // the moments from them (num_params each).
  absl::Status CopyMomentsToHost(std::vector<float>* m, std::vector<float>* v);
  absl::Status CopyMomentsFromHost(const std::vector<float>& m, const std::vector<float>& v);
  const AdamWOptions& options() const { return options_; }
  // The loss scale of the gradients this optimizer applies (model/loss_scaler.h); the trainer decides each step
  // with it and divides the applied gradients by its scale_applied().
  LossScaler& loss_scaler() { return loss_scaler_; }
  const LossScaler& loss_scaler() const { return loss_scaler_; }

 private:
  AdamW(int64_t num_params, std::vector<ParameterSegment> segments, AdamWOptions options, Backend* backend);
  absl::Status AllocateMoments();

  AdamWOptions options_;
  std::vector<ParameterSegment> segments_;
  int64_t num_params_;
  Backend* backend_;
  DeviceBuffer m_, v_;
  int64_t step_ = 0;
  LossScaler loss_scaler_;
};

// Factor to multiply gradients with so that their global norm is at most max_norm (as
// torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), capped at 1). max_norm <= 0: no clipping.
float ClipScale(double global_norm, double max_norm);

// Linear warm-up over warmup_steps to max_lr, then cosine decay to min_lr at total_steps; times scale, capped at
// max_lr (DiLoCo's diloco.inner_lr_scale).
struct LearningRateSchedule {
  double max_lr = 6e-4;
  double min_lr = 6e-5;
  int warmup_steps = 0;
  int total_steps = 1;
  double scale = 1.0;
  // Rate for optimizer step `step` (0-based).
  double At(int step) const;
};

}  // namespace geotrain::model
