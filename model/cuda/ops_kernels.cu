// The GPT-2 ops other than the GEMMs and attention, on a CUDA device: embedding, LayerNorm, bias, GELU,
// residual and softmax cross-entropy, with model/ops.h's contracts (which outputs are overwritten, which
// accumulate). All are memory-bound: the kernels read each input once where the op allows it, keep
// accesses coalesced (a warp or a block walks a row), and loop over rows so that any N fits the grid.
//
// Accumulation order: encoder_backward's dwte, layernorm_backward's dweight/dbias and bias_backward's dbias
// are summed with float atomics, so they are not bitwise reproducible run to run (they are within fp32
// rounding of the CPU's sums); every other output is deterministic.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "model/cuda/cuda_check.h"
#include "model/cuda/device_util.cuh"
#include "model/cuda/ops_cuda.h"

namespace geotrain::model::cuda {
namespace {

using namespace internal;  // NOLINT: this file is the internal namespace's user

constexpr int kWarpsPerBlock = kBlock / 32;

// ---- Embedding. ----

// One block per (b, t) row at a time; threads walk the C channels.
__global__ void EncoderForwardKernel(float* out, const int32_t* inp, const float* wte, const float* wpe, int64_t N,
                                     int T, int C) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const float* we = wte + static_cast<int64_t>(inp[row]) * C;
    const float* pe = wpe + (row % T) * C;
    float* o = out + row * C;
    for (int i = threadIdx.x; i < C; i += blockDim.x) o[i] = we[i] + pe[i];
  }
}

// dwte: every position adds its gradient to its token's row. Positions sharing a token collide, so the
// adds are atomic (order, hence the last bits, vary from run to run).
__global__ void EncoderBackwardTokensKernel(float* dwte, const float* dout, const int32_t* inp, int64_t N, int C) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    float* dw = dwte + static_cast<int64_t>(inp[row]) * C;
    const float* d = dout + row * C;
    for (int i = threadIdx.x; i < C; i += blockDim.x) atomicAdd(dw + i, d[i]);
  }
}

// dwpe(t, c) += sum over b of dout(b, t, c): each thread owns one (t, c), so no atomics; sums first, adds once.
__global__ void EncoderBackwardPositionsKernel(float* dwpe, const float* dout, int B, int T, int C) {
  const int64_t TC = static_cast<int64_t>(T) * C;
  for (int64_t i = GlobalThread(); i < TC; i += GridThreads()) {
    float sum = 0.0f;
    for (int b = 0; b < B; ++b) sum += dout[b * TC + i];
    dwpe[i] += sum;
  }
}

// ---- LayerNorm. ----

// One warp per row: the row is read three times (sum, squared deviations, output), the last two from L1/L2.
// Two passes for the variance, as the CPU does, so that large means do not cancel.
__global__ void LayerNormForwardKernel(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                                       const float* bias, int64_t N, int C) {
  const int lane = threadIdx.x % 32;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = first_row; row < N; row += row_stride) {
    const float* x = inp + row * C;
    float sum = 0.0f;
    for (int i = lane; i < C; i += 32) sum += x[i];
    const float m = WarpSum(sum) / C;
    float squares = 0.0f;
    for (int i = lane; i < C; i += 32) {
      const float d = x[i] - m;
      squares += d * d;
    }
    const float s = 1.0f / sqrtf(WarpSum(squares) / C + 1e-5f);
    float* o = out + row * C;
    for (int i = lane; i < C; i += 32) o[i] = (x[i] - m) * s * weight[i] + bias[i];
    if (lane == 0) {
      mean[row] = m;
      rstd[row] = s;
    }
  }
}

// One warp per row for dinp; dweight and dbias are summed per block in shared memory (2*C floats) and added
// to global memory once per block, so global atomics are (blocks x 2C), not (N x 2C).
__global__ void LayerNormBackwardKernel(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                        const float* weight, const float* mean, const float* rstd, int64_t N, int C) {
  extern __shared__ float shared[];
  float* block_dweight = shared;
  float* block_dbias = shared + C;
  for (int i = threadIdx.x; i < 2 * C; i += blockDim.x) shared[i] = 0.0f;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = first_row; row < N; row += row_stride) {
    const float* d = dout + row * C;
    const float* x = inp + row * C;
    const float m = mean[row], s = rstd[row];
    float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
    for (int i = lane; i < C; i += 32) {
      const float norm = (x[i] - m) * s;
      const float dnorm = weight[i] * d[i];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean = WarpSum(dnorm_mean) / C;
    dnorm_norm_mean = WarpSum(dnorm_norm_mean) / C;
    float* di = dinp + row * C;
    for (int i = lane; i < C; i += 32) {
      const float norm = (x[i] - m) * s;
      const float dnorm = weight[i] * d[i];
      atomicAdd(block_dbias + i, d[i]);
      atomicAdd(block_dweight + i, norm * d[i]);
      di[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    atomicAdd(dweight + i, block_dweight[i]);
    atomicAdd(dbias + i, block_dbias[i]);
  }
}

// ---- Bias. ----

__global__ void AddBiasKernel(float* out, const float* bias, int64_t N, int OC) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    float* o = out + row * OC;
    for (int i = threadIdx.x; i < OC; i += blockDim.x) o[i] += bias[i];
  }
}

// Column sums: a block owns 32 columns (one coalesced 128-byte segment per row and warp) and a slice of
// the rows; its 8 warps interleave rows, then fold their partial sums in shared memory. Slices of rows
// (gridDim.y > 1) meet in an atomic add.
constexpr int kBiasColumns = 32;
constexpr int kBiasRowPhases = 8;
__global__ void BiasBackwardKernel(float* dbias, const float* dout, int64_t N, int OC) {
  __shared__ float partial[kBiasRowPhases][kBiasColumns + 1];
  const int col = blockIdx.x * kBiasColumns + threadIdx.x;
  float sum = 0.0f;
  if (col < OC) {
    const int64_t row_stride = static_cast<int64_t>(gridDim.y) * kBiasRowPhases;
    for (int64_t n = static_cast<int64_t>(blockIdx.y) * kBiasRowPhases + threadIdx.y; n < N; n += row_stride) {
      sum += dout[n * OC + col];
    }
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < OC) {
    for (int k = 1; k < kBiasRowPhases; ++k) sum += partial[k][threadIdx.x];
    if (gridDim.y == 1) {
      dbias[col] += sum;
    } else {
      atomicAdd(dbias + col, sum);
    }
  }
}

// ---- GELU and residual. ----

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

__global__ void GeluForwardKernel(float* out, const float* inp, int64_t N) {
  for (int64_t i = GlobalThread(); i < N; i += GridThreads()) {
    const float x = inp[i];
    const float cube = 0.044715f * x * x * x;
    out[i] = 0.5f * x * (1.0f + tanhf(kGeluScale * (x + cube)));
  }
}

// dinp may alias dout: each element is read before it is written, by the same thread.
__global__ void GeluBackwardKernel(float* dinp, const float* inp, const float* dout, int64_t N) {
  for (int64_t i = GlobalThread(); i < N; i += GridThreads()) {
    const float x = inp[i];
    const float cube = 0.044715f * x * x * x;
    const float tanh_out = tanhf(kGeluScale * (x + cube));
    const float sech2 = 1.0f - tanh_out * tanh_out;
    const float local_grad =
        0.5f * (1.0f + tanh_out) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = local_grad * dout[i];
  }
}

__global__ void ResidualForwardKernel(float* out, const float* a, const float* b, int64_t N) {
  for (int64_t i = GlobalThread(); i < N; i += GridThreads()) out[i] = a[i] + b[i];
}

// ---- Cross-entropy. ----

// A running (max, sum of exp(x - max)) pair: one pass over the row instead of two.
// (A plain aggregate: __shared__ arrays of it must not have constructors.)
struct SoftmaxState {
  float max;
  float sum;
};

__device__ __forceinline__ SoftmaxState Combine(SoftmaxState a, SoftmaxState b) {
  // A side that saw nothing (max -inf, sum 0) contributes nothing; testing for it avoids exp(-inf - -inf).
  // (A NaN sum is not 0, so NaN logits still poison the row's loss, as on the CPU.)
  if (a.max == -INFINITY && a.sum == 0.0f) return b;
  if (b.max == -INFINITY && b.sum == 0.0f) return a;
  SoftmaxState r;
  r.max = fmaxf(a.max, b.max);
  r.sum = a.sum * expf(a.max - r.max) + b.sum * expf(b.max - r.max);
  return r;
}

// One block per row: each thread folds its strided share of the V real columns into a SoftmaxState, then
// warps and the block combine them.
__global__ void CrossEntropyForwardKernel(float* losses, float* lse, const float* logits, const int32_t* targets,
                                          int64_t N, int V, int Vp) {
  __shared__ SoftmaxState warp_states[kWarpsPerBlock];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const float* l = logits + row * Vp;
    SoftmaxState state = {-INFINITY, 0.0f};
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
      const float x = l[i];
      if (x > state.max) {
        state.sum = state.sum * expf(state.max - x) + 1.0f;
        state.max = x;
      } else if (x != -INFINITY) {  // a -inf logit adds 0; skipping it avoids exp(-inf - -inf) = NaN
        state.sum += expf(x - state.max);
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      SoftmaxState other;
      other.max = __shfl_xor_sync(kFullMask, state.max, offset);
      other.sum = __shfl_xor_sync(kFullMask, state.sum, offset);
      state = Combine(state, other);
    }
    if (lane == 0) warp_states[warp] = state;
    __syncthreads();
    if (threadIdx.x == 0) {
      SoftmaxState total = warp_states[0];
      for (int w = 1; w < kWarpsPerBlock; ++w) total = Combine(total, warp_states[w]);
      const float log_sum_exp = total.max + logf(total.sum);
      const int32_t target = targets[row];
      lse[row] = log_sum_exp;
      // A target outside [0, V) is a caller's bug (the CPU would read out of bounds): make it a NaN loss.
      losses[row] = (target >= 0 && target < V) ? log_sum_exp - l[target] : NAN;
    }
    __syncthreads();  // warp_states is reused by the next row
  }
}

// dlogits = dloss * (softmax - onehot(target)) in place over the V real columns; padded columns set to 0.
__global__ void CrossEntropyBackwardKernel(float* logits, const float* lse, const int32_t* targets, float dloss,
                                           int64_t N, int V, int Vp) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    float* l = logits + row * Vp;
    const float m = lse[row];
    const int32_t target = targets[row];
    for (int i = threadIdx.x; i < Vp; i += blockDim.x) {
      float g = 0.0f;
      if (i < V) {
        g = expf(l[i] - m) * dloss;
        if (i == target) g -= dloss;
      }
      l[i] = g;
    }
  }
}

}  // namespace

void encoder_forward(CudaContext& ctx, float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T,
                     int C) {
  const int64_t N = static_cast<int64_t>(B) * T;
  if (C == 0) return;
  Launch(ctx, "encoder_forward", EncoderForwardKernel, N, 1, out, inp, wte, wpe, N, T, C);
}

void encoder_backward(CudaContext& ctx, float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T,
                      int C) {
  const int64_t N = static_cast<int64_t>(B) * T;
  if (C == 0) return;
  Launch(ctx, "encoder_backward (dwte)", EncoderBackwardTokensKernel, N, 1, dwte, dout, inp, N, C);
  const int64_t TC = static_cast<int64_t>(T) * C;
  Launch(ctx, "encoder_backward (dwpe)", EncoderBackwardPositionsKernel, TC, kBlock, dwpe, dout, B, T, C);
}

void layernorm_forward(CudaContext& ctx, float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int C) {
  if (C == 0) return;
  Launch(ctx, "layernorm_forward", LayerNormForwardKernel, N, kWarpsPerBlock, out, mean, rstd, inp, weight, bias, N, C);
}

void layernorm_backward(CudaContext& ctx, float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd, int64_t N, int C) {
  if (N == 0 || C == 0) return;
  UseDevice(ctx);
  const size_t shared_bytes = 2 * static_cast<size_t>(C) * sizeof(float);
  if (shared_bytes > 48 * 1024) {
    // Above the default limit the kernel must opt in (up to the device's maximum, ~227 KiB: C <= ~29000).
    CheckCuda(ctx,
              cudaFuncSetAttribute(LayerNormBackwardKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(shared_bytes)),
              "layernorm_backward");
  }
  // Two blocks per SM: enough rows in flight, and few global atomics on dweight/dbias.
  const int64_t blocks = std::min<int64_t>((N + kWarpsPerBlock - 1) / kWarpsPerBlock, 2 * SmCount(ctx));
  LayerNormBackwardKernel<<<static_cast<unsigned>(blocks), kBlock, shared_bytes, ctx.stream()>>>(
      dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  CheckLaunch(ctx, "layernorm_backward");
}

void add_bias(CudaContext& ctx, float* out, const float* bias, int64_t N, int OC) {
  if (OC == 0) return;
  Launch(ctx, "add_bias", AddBiasKernel, N, 1, out, bias, N, OC);
}

void bias_backward(CudaContext& ctx, float* dbias, const float* dout, int64_t N, int OC) {
  if (N == 0 || OC == 0) return;
  UseDevice(ctx);
  const int64_t column_blocks = (OC + kBiasColumns - 1) / kBiasColumns;
  // Split the rows so that the grid has about 4 blocks per SM, within gridDim.y's limit of 65535.
  const int64_t wanted = std::max<int64_t>(1, 4 * SmCount(ctx) / column_blocks);
  const int64_t row_slices =
      std::clamp<int64_t>(wanted, 1, std::min<int64_t>(65535, (N + kBiasRowPhases - 1) / kBiasRowPhases));
  const dim3 grid(static_cast<unsigned>(column_blocks), static_cast<unsigned>(row_slices));
  BiasBackwardKernel<<<grid, dim3(kBiasColumns, kBiasRowPhases), 0, ctx.stream()>>>(dbias, dout, N, OC);
  CheckLaunch(ctx, "bias_backward");
}

void gelu_forward(CudaContext& ctx, float* out, const float* inp, int64_t N) {
  Launch(ctx, "gelu_forward", GeluForwardKernel, N, kBlock, out, inp, N);
}

void gelu_backward(CudaContext& ctx, float* dinp, const float* inp, const float* dout, int64_t N) {
  Launch(ctx, "gelu_backward", GeluBackwardKernel, N, kBlock, dinp, inp, dout, N);
}

void residual_forward(CudaContext& ctx, float* out, const float* a, const float* b, int64_t N) {
  Launch(ctx, "residual_forward", ResidualForwardKernel, N, kBlock, out, a, b, N);
}

void crossentropy_forward(CudaContext& ctx, float* losses, float* lse, const float* logits, const int32_t* targets,
                          int64_t N, int V, int Vp) {
  Launch(ctx, "crossentropy_forward", CrossEntropyForwardKernel, N, 1, losses, lse, logits, targets, N, V, Vp);
}

void crossentropy_backward_inplace(CudaContext& ctx, float* logits, const float* lse, const int32_t* targets,
                                   float dloss, int64_t N, int V, int Vp) {
  if (Vp == 0) return;
  Launch(ctx, "crossentropy_backward_inplace", CrossEntropyBackwardKernel, N, 1, logits, lse, targets, dloss, N, V, Vp);
}

}  // namespace geotrain::model::cuda
