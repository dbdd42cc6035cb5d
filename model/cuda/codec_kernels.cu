// Codec pack and unpack on a CUDA device, bit for bit comm/codec.cc's raw payloads, so that a GPU can
// encode a gradient for the wire (or decode one) without a round trip through fp32 on the host.
//
// The arithmetic copies the CPU's scalar loops: bf16 by integer rounding on the float's bits; fp16 by
// comm's FloatToHalf (round to nearest even, overflow to infinity, subnormals through an exact float
// addition, every NaN becomes the quiet NaN 0x7E00 with its sign); int8 with scale = max|block| / 127 and
// q = round-half-even(x * (127 / max|block|)) clamped to +-127. Float operations use the _rn intrinsics so
// that nvcc cannot fuse them into FMAs (which round once instead of twice and would change the last bit).
//
// A block holding NaN or infinity has no valid int8 encoding (the CPU encoder refuses it): here its scale
// comes out NaN or infinite, which comm::DecodeTensor rejects.
#include <cuda_runtime.h>

#include <cstdint>

#include "model/cuda/cuda_check.h"
#include "model/cuda/device_util.cuh"
#include "model/cuda/ops_cuda.h"

namespace geotrain::model::cuda {
namespace {

using namespace internal;  // NOLINT: this file is the internal namespace's user

constexpr int kInt8BlockSize = 256;  // comm::kInt8BlockSize (a payload format constant)
static_assert(kInt8BlockSize == kBlock, "pack_int8 gives one thread per element of a block");

__device__ __forceinline__ uint16_t FloatToBf16(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(is_nan ? ((u >> 16) | 0x40u) : rounded);
}

__device__ __forceinline__ uint16_t FloatToHalf(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x47800000u) return sign | (a > 0x7F800000u ? 0x7E00u : 0x7C00u);  // >= 2^16, inf, NaN
  if (a < 0x38800000u) {  // below 2^-14: the float sum rounds to a multiple of 2^-24, the fp16 subnormal step
    const float shifted = __fadd_rn(__uint_as_float(a), 0.5f);
    return sign | static_cast<uint16_t>(__float_as_uint(shifted) - __float_as_uint(0.5f));
  }
  const uint32_t odd = (a >> 13) & 1u;
  a += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFu + odd;
  return sign | static_cast<uint16_t>(a >> 13);
}

__device__ __forceinline__ float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0) {
    const float magnitude = __fmul_rn(static_cast<float>(mantissa), 0x1p-24f);
    return __uint_as_float(__float_as_uint(magnitude) | sign);
  }
  if (exponent == 31) return __uint_as_float(sign | 0x7F800000u | (mantissa << 13));
  return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

__global__ void PackBf16Kernel(uint16_t* out, const float* in, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) out[i] = FloatToBf16(in[i]);
}

__global__ void UnpackBf16Kernel(float* out, const uint16_t* in, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads())
    out[i] = __uint_as_float(static_cast<uint32_t>(in[i]) << 16);
}

__global__ void PackFp16Kernel(uint16_t* out, const float* in, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) out[i] = FloatToHalf(in[i]);
}

__global__ void UnpackFp16Kernel(float* out, const uint16_t* in, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) out[i] = HalfToFloat(in[i]);
}

// One block of 256 threads per int8 block (grid-stride over blocks), one element per thread.
__global__ void PackInt8Kernel(float* scales, int8_t* q, const float* in, int64_t n, int64_t num_blocks) {
  __shared__ uint32_t warp_max[kBlock / 32];
  for (int64_t block = blockIdx.x; block < num_blocks; block += gridDim.x) {
    const int64_t i = block * kInt8BlockSize + threadIdx.x;
    const float x = i < n ? in[i] : 0.0f;
    // Largest |x| as bits: non-negative floats order like their bit patterns (as the CPU's max).
    const uint32_t bits = internal::WarpMaxBits(__float_as_uint(x) & 0x7FFFFFFFu);
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = bits;
    __syncthreads();
    uint32_t max_bits = warp_max[0];
#pragma unroll
    for (int w = 1; w < kBlock / 32; ++w) max_bits = max(max_bits, warp_max[w]);
    __syncthreads();  // warp_max is rewritten by the next block of elements
    const float max_abs = __uint_as_float(max_bits);
    const float inverse = max_abs > 0.0f ? __fdiv_rn(127.0f, max_abs) : 0.0f;
    if (threadIdx.x == 0) scales[block] = __fdiv_rn(max_abs, 127.0f);
    if (i < n) {
      // rintf rounds half to even, as the CPU's add-and-subtract of 1.5 * 2^23 does for |v| <= 127.5.
      const float v = rintf(__fmul_rn(x, inverse));
      // NaN only from 0 * inf, when max|block| < 127 / FLT_MAX makes the inverse overflow: the x86 CPU
      // loop converts it to 0x80000000, whose low byte is 0.
      q[i] = v != v ? 0 : static_cast<int8_t>(static_cast<int32_t>(fminf(fmaxf(v, -127.0f), 127.0f)));
    }
  }
}

__global__ void UnpackInt8Kernel(float* out, const float* scales, const int8_t* q, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    out[i] = __fmul_rn(static_cast<float>(q[i]), scales[i / kInt8BlockSize]);
  }
}

}  // namespace

void pack_bf16(CudaContext& ctx, uint16_t* out, const float* in, int64_t n) {
  Launch(ctx, "pack_bf16", PackBf16Kernel, n, kBlock, out, in, n);
}

void unpack_bf16(CudaContext& ctx, float* out, const uint16_t* in, int64_t n) {
  Launch(ctx, "unpack_bf16", UnpackBf16Kernel, n, kBlock, out, in, n);
}

void pack_fp16(CudaContext& ctx, uint16_t* out, const float* in, int64_t n) {
  Launch(ctx, "pack_fp16", PackFp16Kernel, n, kBlock, out, in, n);
}

void unpack_fp16(CudaContext& ctx, float* out, const uint16_t* in, int64_t n) {
  Launch(ctx, "unpack_fp16", UnpackFp16Kernel, n, kBlock, out, in, n);
}

void pack_int8(CudaContext& ctx, float* scales, int8_t* q, const float* in, int64_t n) {
  const int64_t num_blocks = (n + kInt8BlockSize - 1) / kInt8BlockSize;
  Launch(ctx, "pack_int8", PackInt8Kernel, num_blocks, 1, scales, q, in, n, num_blocks);
}

void unpack_int8(CudaContext& ctx, float* out, const float* scales, const int8_t* q, int64_t n) {
  Launch(ctx, "unpack_int8", UnpackInt8Kernel, n, kBlock, out, scales, q, n);
}

}  // namespace geotrain::model::cuda
