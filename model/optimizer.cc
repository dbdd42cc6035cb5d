// AdamW, clipping and the learning-rate schedule (see optimizer.h).
#include "model/optimizer.h"

#include <algorithm>
#include <cmath>

namespace geotrain::model {

AdamW::AdamW(int64_t num_params, std::vector<ParameterSegment> segments, AdamWOptions options)
    : options_(options), segments_(std::move(segments)), m_(num_params, 0.0f), v_(num_params, 0.0f) {}

void AdamW::Step(float* params, const float* grads, float lr, float grad_scale) {
  ++step_;
  const float b1 = options_.beta1, b2 = options_.beta2, eps = options_.eps;
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(b1), static_cast<double>(step_));
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(b2), static_cast<double>(step_));
  const float step_size = static_cast<float>(lr / bias_correction1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  for (const ParameterSegment& seg : segments_) {
    const float decay = seg.weight_decay ? 1.0f - lr * options_.weight_decay : 1.0f;
    float* p = params + seg.offset;
    const float* g = grads + seg.offset;
    float* m = m_.data() + seg.offset;
    float* v = v_.data() + seg.offset;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < seg.count; ++i) {
      const float grad = g[i] * grad_scale;
      const float param = p[i] * decay;
      const float mi = m[i] + (1.0f - b1) * (grad - m[i]);
      const float vi = b2 * v[i] + (1.0f - b2) * grad * grad;
      m[i] = mi;
      v[i] = vi;
      const float denom = std::sqrt(vi) / bc2_sqrt + eps;
      p[i] = param - step_size * mi / denom;
    }
  }
}

float ClipScale(double global_norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  const double coef = max_norm / (global_norm + 1e-6);
  return static_cast<float>(std::min(coef, 1.0));
}

double LearningRateSchedule::At(int step) const {
  if (step < warmup_steps) return max_lr * (step + 1) / warmup_steps;
  if (step >= total_steps) return min_lr;
  const int decay_steps = std::max(1, total_steps - warmup_steps);
  const double ratio = static_cast<double>(step - warmup_steps) / decay_steps;
  const double coeff = 0.5 * (1.0 + std::cos(M_PI * ratio));
  return min_lr + coeff * (max_lr - min_lr);
}

}  // namespace geotrain::model
