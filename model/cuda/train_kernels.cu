// Training arithmetic on a CUDA device: gradient accumulation and scaling, sums in double (the gradient
// norm), and the AdamW update with model/optimizer.cc's arithmetic (fp32 master weights and moments).
//
// Sum and SumSquares are deterministic: each block folds a fixed grid-stride share in double, and one block
// then adds the per-block sums in block order.
#include <cuda_runtime.h>

#include <algorithm>

#include "model/adamw_element.h"
#include "model/cuda/cuda_check.h"
#include "model/cuda/device_util.cuh"
#include "model/cuda/ops_cuda.h"

namespace geotrain::model::cuda {
namespace {

using namespace internal;  // NOLINT: this file is the internal namespace's user

constexpr int kWarpsPerBlock = kBlock / 32;
constexpr int kMaxPartials = 1024;

__global__ void AccumulateKernel(float* out, const float* in, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) out[i] += in[i];
}

__global__ void ScaleKernel(float* x, int64_t n, float factor) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) x[i] *= factor;
}

// The block's sum of its threads' values, valid in thread 0 (every thread of the block must call it).
__device__ double BlockSum(double value) {
  __shared__ double warp_sums[kWarpsPerBlock];
  value = WarpSum(value);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = value;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarpsPerBlock; ++w) total += warp_sums[w];
  }
  return total;
}

template <bool kSquares>
__global__ void PartialSumKernel(double* partials, const float* x, int64_t n) {
  double sum = 0.0;
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const double v = x[i];
    sum += kSquares ? v * v : v;
  }
  const double total = BlockSum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void FinalSumKernel(double* result, const double* partials, int count) {
  double sum = 0.0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partials[i];
  const double total = BlockSum(sum);
  if (threadIdx.x == 0) *result = total;
}

template <bool kSquares>
absl::StatusOr<double> Reduce(CudaContext& ctx, const float* x, int64_t n, const char* op) {
  UseDevice(ctx);
  WorkspaceLayout layout;
  const int partials_piece = layout.Add(kMaxPartials * sizeof(double));
  const int result_piece = layout.Add(sizeof(double));
  if (!layout.Acquire(ctx, op)) return ctx.Synchronize();
  double* partials = layout.Get<double>(partials_piece);
  double* result = layout.Get<double>(result_piece);
  const unsigned blocks = std::min<unsigned>(GridFor(ctx, n, kBlock), kMaxPartials);
  PartialSumKernel<kSquares><<<blocks, kBlock, 0, ctx.stream()>>>(partials, x, n);
  FinalSumKernel<<<1, kBlock, 0, ctx.stream()>>>(result, partials, static_cast<int>(blocks));
  CheckLaunch(ctx, op);
  double value = 0.0;
  CheckCuda(ctx, cudaMemcpyAsync(&value, result, sizeof(double), cudaMemcpyDeviceToHost, ctx.stream()), op);
  absl::Status status = ctx.Synchronize();
  if (!status.ok()) return status;
  return value;
}

// The CPU update, element by element: both run model/adamw_element.h.
__global__ void AdamWKernel(float* params, const float* grads, float* m, float* v, int64_t n, float decay, float beta1,
                            float beta2, float eps, float grad_scale, float step_size, float bc2_sqrt) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    AdamWElement(params, grads, m, v, i, decay, beta1, beta2, eps, grad_scale, step_size, bc2_sqrt);
  }
}

}  // namespace

void accumulate(CudaContext& ctx, float* out, const float* in, int64_t n) {
  Launch(ctx, "accumulate", AccumulateKernel, n, kBlock, out, in, n);
}

void scale(CudaContext& ctx, float* x, int64_t n, float factor) {
  Launch(ctx, "scale", ScaleKernel, n, kBlock, x, n, factor);
}

absl::StatusOr<double> Sum(CudaContext& ctx, const float* x, int64_t n) { return Reduce<false>(ctx, x, n, "Sum"); }

absl::StatusOr<double> SumSquares(CudaContext& ctx, const float* x, int64_t n) {
  return Reduce<true>(ctx, x, n, "SumSquares");
}

void adamw_update(CudaContext& ctx, float* params, const float* grads, float* m, float* v, int64_t n, float decay,
                  float beta1, float beta2, float eps, float grad_scale, float step_size, float bc2_sqrt) {
  Launch(ctx, "adamw_update", AdamWKernel, n, kBlock, params, grads, m, v, n, decay, beta1, beta2, eps, grad_scale,
         step_size, bc2_sqrt);
}

}  // namespace geotrain::model::cuda
