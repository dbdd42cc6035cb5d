// Internal to model/cuda/: device-side helpers shared by the kernels (warp reductions and the grid-stride
// index). Every reduction here is over a full warp (all 32 lanes active), which the kernels guarantee by
// keeping whole warps in their loops.
#pragma once

#include <cstdint>

#include "model/cuda/cuda_check.h"

namespace geotrain::model::cuda::internal {

constexpr int kBlock = 256;  // threads per block of the simple kernels

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ __forceinline__ double WarpSum(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Largest of the warp's 32 values: one instruction from sm_80 (Ampere) on, a shuffle tree on Turing (sm_75),
// which lacks __reduce_max_sync. The same result either way.
__device__ __forceinline__ uint32_t WarpMaxBits(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(kFullMask, v);
#else
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
#endif
}

// First index and stride of a 1-D grid-stride loop, in 64 bits (N*C may pass 2^31).
__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridThreads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// Queues kernel(args...) on ctx's stream with kBlock threads per block and a grid sized by GridFor for
// `items` work items of `items_per_block` each, then checks the launch under `op`. Nothing to do when
// items == 0 (a zero-sized grid is a launch error).
template <typename... Params, typename... Args>
void Launch(CudaContext& ctx, const char* op, void (*kernel)(Params...), int64_t items, int items_per_block,
            Args... args) {
  if (items == 0) return;
  UseDevice(ctx);
  kernel<<<GridFor(ctx, items, items_per_block), kBlock, 0, ctx.stream()>>>(args...);
  CheckLaunch(ctx, op);
}

}  // namespace geotrain::model::cuda::internal
