// One AdamW update of element i, shared by the CPU loop (model/ops.cc adamw_update) and the CUDA kernel
// (model/cuda/train_kernels.cu), so both run the same arithmetic in the same order. See model/ops.h
// adamw_update for the meaning of the arguments.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define GEOTRAIN_HOST_DEVICE __host__ __device__
#else
#define GEOTRAIN_HOST_DEVICE
#endif

namespace geotrain::model {

GEOTRAIN_HOST_DEVICE inline void AdamWElement(float* params, const float* grads, float* m, float* v, int64_t i,
                                              float decay, float beta1, float beta2, float eps, float grad_scale,
                                              float step_size, float bc2_sqrt) {
  const float grad = grads[i] * grad_scale;
  const float param = params[i] * decay;
  const float mi = m[i] + (1.0f - beta1) * (grad - m[i]);
  const float vi = beta2 * v[i] + (1.0f - beta2) * grad * grad;
  m[i] = mi;
  v[i] = vi;
  const float denom = sqrtf(vi) / bc2_sqrt + eps;
  params[i] = param - step_size * mi / denom;
}

}  // namespace geotrain::model

#undef GEOTRAIN_HOST_DEVICE
