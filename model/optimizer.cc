// AdamW, clipping and the learning-rate schedule (see optimizer.h).
#include "model/optimizer.h"

#include <algorithm>
#include <cmath>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace geotrain::model {

AdamW::AdamW(int64_t num_params, std::vector<ParameterSegment> segments, AdamWOptions options, Backend* backend)
    : options_(options),
      segments_(std::move(segments)),
      num_params_(num_params),
      backend_(backend),
      loss_scaler_(options.loss_scale) {}

AdamW::AdamW(int64_t num_params, std::vector<ParameterSegment> segments, AdamWOptions options)
    : AdamW(num_params, std::move(segments), options, CpuBackendInstance()) {
  // Host memory: fails only as operator new does.
  if (absl::Status s = AllocateMoments(); !s.ok()) throw std::bad_alloc();
}

absl::StatusOr<std::unique_ptr<AdamW>> AdamW::Create(int64_t num_params, std::vector<ParameterSegment> segments,
                                                     AdamWOptions options, Backend& backend) {
  std::unique_ptr<AdamW> adam(new AdamW(num_params, std::move(segments), options, &backend));
  if (absl::Status s = adam->AllocateMoments(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("AdamW moments on ", backend.name(), ": ", s.message()));
  }
  return adam;
}

absl::Status AdamW::AllocateMoments() {
  const size_t bytes = sizeof(float) * num_params_;
  ASSIGN_OR_RETURN(DeviceBuffer m, DeviceBuffer::Allocate(*backend_, bytes));
  ASSIGN_OR_RETURN(DeviceBuffer v, DeviceBuffer::Allocate(*backend_, bytes));
  m_ = std::move(m);
  v_ = std::move(v);
  return absl::OkStatus();
}

void AdamW::Step(float* params, const float* grads, float lr, float grad_scale) {
  ++step_;
  const float b1 = options_.beta1, b2 = options_.beta2, eps = options_.eps;
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(b1), static_cast<double>(step_));
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(b2), static_cast<double>(step_));
  const float step_size = static_cast<float>(lr / bias_correction1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  for (const ParameterSegment& seg : segments_) {
    const float decay = seg.weight_decay ? 1.0f - lr * options_.weight_decay : 1.0f;
    backend_->adamw_update(params + seg.offset, grads + seg.offset, m() + seg.offset, v() + seg.offset, seg.count,
                           decay, b1, b2, eps, grad_scale, step_size, bc2_sqrt);
  }
}

absl::Status AdamW::CopyMomentsToHost(std::vector<float>* m, std::vector<float>* v) {
  m->resize(num_params_);
  v->resize(num_params_);
  const size_t bytes = sizeof(float) * num_params_;
  RETURN_IF_ERROR(backend_->CopyToHost(m->data(), this->m(), bytes));
  return backend_->CopyToHost(v->data(), this->v(), bytes);
}

absl::Status AdamW::CopyMomentsFromHost(const std::vector<float>& m, const std::vector<float>& v) {
  if (static_cast<int64_t>(m.size()) != num_params_ || static_cast<int64_t>(v.size()) != num_params_) {
    return absl::InvalidArgumentError(absl::StrCat("AdamW moments of ", m.size(), " and ", v.size(),
                                                   " floats given for ", num_params_, " parameters"));
  }
  const size_t bytes = sizeof(float) * num_params_;
  RETURN_IF_ERROR(backend_->CopyToDevice(this->m(), m.data(), bytes));
  return backend_->CopyToDevice(this->v(), v.data(), bytes);
}

float ClipScale(double global_norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  const double coef = max_norm / (global_norm + 1e-6);
  return static_cast<float>(std::min(coef, 1.0));
}

double LearningRateSchedule::At(int step) const {
  double lr = min_lr;
  if (step < warmup_steps) {
    lr = max_lr * (step + 1) / warmup_steps;
  } else if (step < total_steps) {
    const int decay_steps = std::max(1, total_steps - warmup_steps);
    const double ratio = static_cast<double>(step - warmup_steps) / decay_steps;
    const double coeff = 0.5 * (1.0 + std::cos(M_PI * ratio));
    lr = min_lr + coeff * (max_lr - min_lr);
  }
  return scale == 1.0 ? lr : std::min(max_lr, scale * lr);
}

}  // namespace geotrain::model
