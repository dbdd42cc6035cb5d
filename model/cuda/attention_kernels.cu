// Fused causal self-attention on a CUDA device, forward and backward, in fp32 (model/ops.h's contract:
// qkv (B,T,3C) per token [q | k | v], NH heads of hs = C/NH channels, lse (B,NH,T) kept for backward).
// The T x T scores are never stored: the forward keeps a running max and sum per query row (flash-style
// online softmax) and the backward recomputes each probability from lse.
//
// Work split. A block owns 32 rows of one (b, h) and walks tiles of 32 rows of the other side through
// shared memory. A row belongs to a group of kGroup = 4 adjacent threads that split its channels by
// float4 slots (thread g holds slots g, g+4, g+8, ...; see Channel): at any instant the group reads 4
// consecutive float4 of a tile row (64 bytes, no bank conflicts; the warp's other rows read the same
// addresses, a broadcast), so one 128-bit shared load feeds 4 FMAs. Dot products end with two shuffles
// inside the group. Head sizes up to 128 are compiled as 32, 64 or 128 (zero-padded).
//
//   forward:   block = 32 queries; tiles of keys and values, 0 .. last query of the block.
//   backward:  two passes, so that every output element has exactly one writer (no atomics, no zeroing,
//              deterministic, and dqkv is overwritten as the contract says):
//     1. block = 32 queries: delta = dout . out per query (kept in the workspace) and
//        dq = scale * sum_k p (dp - delta) k over tiles of keys;
//     2. block = 32 keys: dk = scale * sum_q p (dp - delta) q and dv = sum_q p dout over tiles of queries
//        (only queries at or after the block's first key).
//   with p = exp(scale q.k - lse) and dp = dout . v. Exponentials are exp2 of log2e-scaled scores.
//
// Blocks are launched heaviest first (forward and pass 1: the last queries see the most keys; pass 2: the
// first keys see the most queries), which shortens the grid's tail.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "model/cuda/cuda_check.h"
#include "model/cuda/device_util.cuh"
#include "model/cuda/ops_cuda.h"

namespace geotrain::model::cuda {
namespace {

using namespace internal;  // NOLINT: this file is the internal namespace's user

constexpr int kGroup = 4;                 // threads per row
constexpr int kRows = 32;                 // rows a block owns
constexpr int kTile = 32;                 // rows of the other side per shared-memory tile
constexpr int kThreads = kRows * kGroup;  // 128
constexpr int kMaxHeadSize = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMaxGridY = 65535;

static_assert(kGroup == 4, "GroupSum's shuffles assume groups of 4 adjacent lanes");

// The head channel held in register c (0 .. HS/kGroup-1) by thread g of a row's group: float4 slot
// g + kGroup * (c / 4), element c % 4. Over g and c this visits every channel of HS exactly once.
__device__ __forceinline__ int Channel(int g, int c) { return 4 * (g + kGroup * (c / 4)) + c % 4; }

// Sum over the 4 threads of a row's group (all lanes of the warp take part).
__device__ __forceinline__ float GroupSum(float v) {
  v += __shfl_xor_sync(kFullMask, v, 1);
  v += __shfl_xor_sync(kFullMask, v, 2);
  return v;
}

// Where a head's slice of row t starts in a (T, row_stride) tensor of one batch element; in qkv, part
// 0 = q, 1 = k, 2 = v (part_stride C); dout and out have one part.
struct HeadRows {
  const float* base;    // the tensor at (b, t = 0), channel h*hs
  int64_t row_stride;   // 3C for qkv, C for dout
  int64_t part_stride;  // C for qkv
  __device__ const float* Row(int t, int part) const { return base + t * row_stride + part * part_stride; }
};

__device__ __forceinline__ HeadRows QkvRows(const float* qkv, int b, int h, int T, int C, int hs) {
  return {qkv + static_cast<int64_t>(b) * T * 3 * C + h * hs, 3 * static_cast<int64_t>(C), C};
}

// Loads this thread's channels (g, g+4, ...) of a row into registers, zero past hs.
template <int HS>
__device__ __forceinline__ void LoadChannels(float (&dst)[HS / kGroup], const float* row, int hs, int g, float factor) {
#pragma unroll
  for (int i = 0; i < HS / kGroup; ++i) {
    const int d = Channel(g, i);
    dst[i] = d < hs ? row[d] * factor : 0.0f;
  }
}

// Fills tile[j][d] with part `part` of rows first + j (zero past T or hs). Every thread of the block calls it.
template <int HS>
__device__ __forceinline__ void LoadTile(float (*tile)[HS], const HeadRows& rows, int part, int first, int T, int hs) {
  for (int idx = threadIdx.x; idx < kTile * HS; idx += kThreads) {
    const int j = idx / HS, d = idx % HS;
    const int t = first + j;
    tile[j][d] = (t < T && d < hs) ? rows.Row(t, part)[d] : 0.0f;
  }
}

// Dot product of this thread's channels with a tile row (16-byte aligned), summed over the group.
template <int HS>
__device__ __forceinline__ float TileDot(const float (&x)[HS / kGroup], const float* tile_row, int g) {
  static_assert(HS % (4 * kGroup) == 0, "channels go by float4 slots");
  const float4* slots = reinterpret_cast<const float4*>(tile_row);
  float partial = 0.0f;
#pragma unroll
  for (int i = 0; i < HS / (4 * kGroup); ++i) {
    const float4 y = slots[g + kGroup * i];
    partial += x[4 * i] * y.x + x[4 * i + 1] * y.y + x[4 * i + 2] * y.z + x[4 * i + 3] * y.w;
  }
  return GroupSum(partial);
}

// acc += a * (this thread's channels of a tile row).
template <int HS>
__device__ __forceinline__ void TileAxpy(float (&acc)[HS / kGroup], float a, const float* tile_row, int g) {
  const float4* slots = reinterpret_cast<const float4*>(tile_row);
#pragma unroll
  for (int i = 0; i < HS / (4 * kGroup); ++i) {
    const float4 y = slots[g + kGroup * i];
    acc[4 * i] += a * y.x;
    acc[4 * i + 1] += a * y.y;
    acc[4 * i + 2] += a * y.z;
    acc[4 * i + 3] += a * y.w;
  }
}

template <int HS>
__global__ void __launch_bounds__(kThreads)
    AttentionForwardKernel(float* out, float* lse, const float* qkv, int B, int T, int C, int NH) {
  constexpr int D = HS / kGroup;
  __shared__ __align__(16) float tile_k[kTile][HS];
  __shared__ __align__(16) float tile_v[kTile][HS];
  const int hs = C / NH;
  const float scale_log2 = kLog2e / sqrtf(static_cast<float>(hs));
  const int g = threadIdx.x % kGroup;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kRows;
  const int t = q0 + threadIdx.x / kGroup;
  const bool active = t < T;
  const int tq = active ? t : T - 1;  // rows past T compute on a real row and write nothing
  const int last_key = min(q0 + kRows, T) - 1;
  for (int bh = blockIdx.y; bh < B * NH; bh += gridDim.y) {
    const int b = bh / NH, h = bh % NH;
    const HeadRows rows = QkvRows(qkv, b, h, T, C, hs);
    float q[D], acc[D];
    LoadChannels<HS>(q, rows.Row(tq, 0), hs, g, scale_log2);  // scores come out in log2 units
#pragma unroll
    for (int i = 0; i < D; ++i) acc[i] = 0.0f;
    float row_max = -INFINITY, row_sum = 0.0f;
    for (int k0 = 0; k0 <= last_key; k0 += kTile) {
      __syncthreads();  // the previous tile (or head) is no longer read
      LoadTile<HS>(tile_k, rows, 1, k0, T, hs);
      LoadTile<HS>(tile_v, rows, 2, k0, T, hs);
      __syncthreads();
      float score[kTile];
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < kTile; ++j) {
        const float s = TileDot<HS>(q, tile_k[j], g);
        score[j] = k0 + j <= tq ? s : -INFINITY;  // causal mask (also hides keys past T)
        tile_max = fmaxf(tile_max, score[j]);
      }
      // Key 0 is in the first tile and visible to every row, so new_max is finite from then on and no
      // exp2(-inf - -inf) arises; the first correction is exp2(-inf) = 0 on zero sums.
      const float new_max = fmaxf(row_max, tile_max);
      const float correction = exp2f(row_max - new_max);
      row_sum *= correction;
#pragma unroll
      for (int i = 0; i < D; ++i) acc[i] *= correction;
#pragma unroll
      for (int j = 0; j < kTile; ++j) {
        const float p = exp2f(score[j] - new_max);
        row_sum += p;
        TileAxpy<HS>(acc, p, tile_v[j], g);
      }
      row_max = new_max;
    }
    if (active) {
      const float inverse = 1.0f / row_sum;
      float* o = out + (static_cast<int64_t>(b) * T + t) * C + h * hs;
#pragma unroll
      for (int i = 0; i < D; ++i) {
        const int d = Channel(g, i);
        if (d < hs) o[d] = acc[i] * inverse;
      }
      if (g == 0) lse[static_cast<int64_t>(bh) * T + t] = (row_max + log2f(row_sum)) * kLn2;
    }
  }
}

// Pass 1: delta and dq for a block of queries.
template <int HS>
__global__ void __launch_bounds__(kThreads)
    AttentionBackwardQueryKernel(float* dqkv, float* delta, const float* dout, const float* qkv, const float* out,
                                 const float* lse, int B, int T, int C, int NH) {
  constexpr int D = HS / kGroup;
  __shared__ __align__(16) float tile_k[kTile][HS];
  __shared__ __align__(16) float tile_v[kTile][HS];
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  const float scale_log2 = scale * kLog2e;
  const int g = threadIdx.x % kGroup;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kRows;
  const int t = q0 + threadIdx.x / kGroup;
  const bool active = t < T;
  const int tq = active ? t : T - 1;
  const int last_key = min(q0 + kRows, T) - 1;
  for (int bh = blockIdx.y; bh < B * NH; bh += gridDim.y) {
    const int b = bh / NH, h = bh % NH;
    const HeadRows rows = QkvRows(qkv, b, h, T, C, hs);
    const int64_t token = static_cast<int64_t>(b) * T + tq;
    float q[D], d_out[D], dq[D];
    LoadChannels<HS>(q, rows.Row(tq, 0), hs, g, 1.0f);
    LoadChannels<HS>(d_out, dout + token * C + h * hs, hs, g, 1.0f);
    LoadChannels<HS>(dq, out + token * C + h * hs, hs, g, 1.0f);  // out, briefly, for delta
    float row_delta = 0.0f;
#pragma unroll
    for (int i = 0; i < D; ++i) row_delta += d_out[i] * dq[i];
    row_delta = GroupSum(row_delta);
#pragma unroll
    for (int i = 0; i < D; ++i) dq[i] = 0.0f;
    const float row_lse2 = lse[static_cast<int64_t>(bh) * T + tq] * kLog2e;
    if (active && g == 0) delta[static_cast<int64_t>(bh) * T + t] = row_delta;
    for (int k0 = 0; k0 <= last_key; k0 += kTile) {
      __syncthreads();
      LoadTile<HS>(tile_k, rows, 1, k0, T, hs);
      LoadTile<HS>(tile_v, rows, 2, k0, T, hs);
      __syncthreads();
#pragma unroll 8
      for (int j = 0; j < kTile; ++j) {
        const float s = TileDot<HS>(q, tile_k[j], g);
        const float dp = TileDot<HS>(d_out, tile_v[j], g);
        const float p = k0 + j <= tq ? exp2f(s * scale_log2 - row_lse2) : 0.0f;
        const float ds = p * (dp - row_delta);
        TileAxpy<HS>(dq, ds, tile_k[j], g);
      }
    }
    if (active) {
      float* dst = dqkv + (static_cast<int64_t>(b) * T + t) * 3 * C + h * hs;
#pragma unroll
      for (int i = 0; i < D; ++i) {
        const int d = Channel(g, i);
        if (d < hs) dst[d] = dq[i] * scale;
      }
    }
  }
}

// Pass 2: dk and dv for a block of keys, over the queries that see them.
template <int HS>
__global__ void __launch_bounds__(kThreads)
    AttentionBackwardKeyKernel(float* dqkv, const float* delta, const float* dout, const float* qkv, const float* lse,
                               int B, int T, int C, int NH) {
  constexpr int D = HS / kGroup;
  __shared__ __align__(16) float tile_q[kTile][HS];
  __shared__ __align__(16) float tile_dout[kTile][HS];
  __shared__ float tile_lse2[kTile];
  __shared__ float tile_delta[kTile];
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf(static_cast<float>(hs));
  const float scale_log2 = scale * kLog2e;
  const int g = threadIdx.x % kGroup;
  const int k0 = blockIdx.x * kRows;
  const int t = k0 + threadIdx.x / kGroup;
  const bool active = t < T;
  const int tk = active ? t : T - 1;
  for (int bh = blockIdx.y; bh < B * NH; bh += gridDim.y) {
    const int b = bh / NH, h = bh % NH;
    const HeadRows rows = QkvRows(qkv, b, h, T, C, hs);
    const HeadRows dout_rows{dout + static_cast<int64_t>(b) * T * C + h * hs, C, 0};
    float k[D], v[D], dk[D], dv[D];
    LoadChannels<HS>(k, rows.Row(tk, 1), hs, g, 1.0f);
    LoadChannels<HS>(v, rows.Row(tk, 2), hs, g, 1.0f);
#pragma unroll
    for (int i = 0; i < D; ++i) dk[i] = dv[i] = 0.0f;
    for (int first = k0; first < T; first += kTile) {  // queries before k0 see none of this block's keys
      __syncthreads();
      LoadTile<HS>(tile_q, rows, 0, first, T, hs);
      LoadTile<HS>(tile_dout, dout_rows, 0, first, T, hs);
      if (threadIdx.x < kTile) {
        const int query = first + threadIdx.x;
        const bool valid = query < T;
        tile_lse2[threadIdx.x] = valid ? lse[static_cast<int64_t>(bh) * T + query] * kLog2e : 0.0f;
        tile_delta[threadIdx.x] = valid ? delta[static_cast<int64_t>(bh) * T + query] : 0.0f;
      }
      __syncthreads();
#pragma unroll 8
      for (int i = 0; i < kTile; ++i) {
        const int query = first + i;
        const float s = TileDot<HS>(k, tile_q[i], g);
        const float dp = TileDot<HS>(v, tile_dout[i], g);
        const float p = (query >= tk && query < T) ? exp2f(s * scale_log2 - tile_lse2[i]) : 0.0f;
        const float ds = p * (dp - tile_delta[i]);
        TileAxpy<HS>(dv, p, tile_dout[i], g);
        TileAxpy<HS>(dk, ds, tile_q[i], g);
      }
    }
    if (active) {
      float* dst = dqkv + (static_cast<int64_t>(b) * T + t) * 3 * C + h * hs;
#pragma unroll
      for (int c = 0; c < D; ++c) {
        const int d = Channel(g, c);
        if (d < hs) {
          dst[C + d] = dk[c] * scale;
          dst[2 * C + d] = dv[c];
        }
      }
    }
  }
}

// Head sizes are compiled as 32, 64 or 128; 0 means unsupported.
int PaddedHeadSize(int hs) {
  if (hs <= 32) return 32;
  if (hs <= 64) return 64;
  if (hs <= kMaxHeadSize) return 128;
  return 0;
}

// Checks the shape; false (with the error recorded) when the kernels cannot run it.
bool CheckShape(CudaContext& ctx, int C, int NH, const char* op) {
  if (NH <= 0 || C % NH != 0 || PaddedHeadSize(C / NH) == 0) {
    ctx.RecordError(absl::InvalidArgumentError(
        absl::StrCat(op, ": C=", C, " and NH=", NH, " give a head size other than 1..", kMaxHeadSize,
                     " (C must be a multiple of NH); the CUDA attention supports head sizes up to 128")));
    return false;
  }
  return true;
}

dim3 AttentionGrid(int B, int T, int NH) {
  return dim3(static_cast<unsigned>((T + kRows - 1) / kRows), static_cast<unsigned>(std::min(B * NH, kMaxGridY)));
}

}  // namespace

void attention_forward(CudaContext& ctx, float* out, float* lse, const float* qkv, int B, int T, int C, int NH) {
  if (B == 0 || T == 0 || C == 0) return;
  UseDevice(ctx);
  if (!CheckShape(ctx, C, NH, "attention_forward")) return;
  const dim3 grid = AttentionGrid(B, T, NH);
  switch (PaddedHeadSize(C / NH)) {
    case 32:
      AttentionForwardKernel<32><<<grid, kThreads, 0, ctx.stream()>>>(out, lse, qkv, B, T, C, NH);
      break;
    case 64:
      AttentionForwardKernel<64><<<grid, kThreads, 0, ctx.stream()>>>(out, lse, qkv, B, T, C, NH);
      break;
    default:
      AttentionForwardKernel<128><<<grid, kThreads, 0, ctx.stream()>>>(out, lse, qkv, B, T, C, NH);
      break;
  }
  CheckLaunch(ctx, "attention_forward");
}

void attention_backward(CudaContext& ctx, float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int B, int T, int C, int NH) {
  if (B == 0 || T == 0 || C == 0) return;
  UseDevice(ctx);
  if (!CheckShape(ctx, C, NH, "attention_backward")) return;
  WorkspaceLayout layout;
  const int delta_piece = layout.Add(static_cast<size_t>(B) * NH * T * sizeof(float));
  if (!layout.Acquire(ctx, "attention_backward")) return;
  float* delta = layout.Get<float>(delta_piece);
  const dim3 grid = AttentionGrid(B, T, NH);
  switch (PaddedHeadSize(C / NH)) {
    case 32:
      AttentionBackwardQueryKernel<32>
          <<<grid, kThreads, 0, ctx.stream()>>>(dqkv, delta, dout, qkv, out, lse, B, T, C, NH);
      AttentionBackwardKeyKernel<32><<<grid, kThreads, 0, ctx.stream()>>>(dqkv, delta, dout, qkv, lse, B, T, C, NH);
      break;
    case 64:
      AttentionBackwardQueryKernel<64>
          <<<grid, kThreads, 0, ctx.stream()>>>(dqkv, delta, dout, qkv, out, lse, B, T, C, NH);
      AttentionBackwardKeyKernel<64><<<grid, kThreads, 0, ctx.stream()>>>(dqkv, delta, dout, qkv, lse, B, T, C, NH);
      break;
    default:
      AttentionBackwardQueryKernel<128>
          <<<grid, kThreads, 0, ctx.stream()>>>(dqkv, delta, dout, qkv, out, lse, B, T, C, NH);
      AttentionBackwardKeyKernel<128><<<grid, kThreads, 0, ctx.stream()>>>(dqkv, delta, dout, qkv, lse, B, T, C, NH);
      break;
  }
  CheckLaunch(ctx, "attention_backward");
}

}  // namespace geotrain::model::cuda
