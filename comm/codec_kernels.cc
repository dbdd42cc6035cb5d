// The codecs' element loops (see codec_kernels.h), compiled per instruction set and chosen at run time.
//
// The loops are written once as plain loops (inlined "bodies") and compiled three times: for AVX-512, for
// AVX2+F16C and for baseline x86-64. This file is compiled with -O3 so that GCC vectorises the bodies, and
// with -ffp-contract=off so that every set rounds the same way (comm/CMakeLists.txt). fp16 uses the F16C /
// AVX-512 conversion instructions (round to nearest even) where present.
#include "comm/codec_kernels.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <limits>
#include <string_view>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "comm/codec.h"

namespace geotrain::comm {
namespace internal {
namespace {

#define GT_INLINE inline __attribute__((always_inline))

// ---------------------------------------------------------------------------------------------------
// Element loop bodies (compiled once per instruction set by the wrappers below).

GT_INLINE uint32_t FloatBits(float f) { return std::bit_cast<uint32_t>(f); }
GT_INLINE float BitsFloat(uint32_t u) { return std::bit_cast<float>(u); }

GT_INLINE void F32ToBf16Body(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t u = FloatBits(in[i]);
    // Round to nearest even on the 16 dropped bits; NaN keeps its sign and becomes a quiet NaN.
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    out[i] = static_cast<uint16_t>(is_nan ? ((u >> 16) | 0x40u) : rounded);
  }
}

GT_INLINE void Bf16ToF32Body(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = BitsFloat(static_cast<uint32_t>(in[i]) << 16);
}

GT_INLINE void AddF32Body(const float* src, float* acc, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] += src[i];
}

// Largest |x| of a block as float bits; non-negative floats order like their bit patterns, so an
// integer max vectorises and NaN (bits above infinity's) shows up as a value >= 0x7F800000.
GT_INLINE uint32_t MaxAbsBitsBody(const float* in, size_t n) {
  uint32_t m = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t a = FloatBits(in[i]) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
  return m;
}

GT_INLINE void QuantizeInt8Body(const float* in, float inverse_scale, int8_t* q, size_t n) {
  // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer, ties to even (|value| <= 127.5).
  constexpr float kRound = 12582912.0f;
  for (size_t i = 0; i < n; ++i) {
    float v = (in[i] * inverse_scale + kRound) - kRound;
    v = v > 127.0f ? 127.0f : v;
    v = v < -127.0f ? -127.0f : v;
    q[i] = static_cast<int8_t>(static_cast<int32_t>(v));
  }
}

GT_INLINE void DequantizeInt8Body(const int8_t* q, float scale, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(q[i]) * scale;
}

// Scalar fp32 -> fp16, round to nearest even; overflow goes to infinity, NaN stays a quiet NaN.
inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x47800000u) {  // |f| >= 2^16 (always rounds to infinity), infinity or NaN
    return sign | (a > 0x7F800000u ? 0x7E00u : 0x7C00u);
  }
  if (a < 0x38800000u) {  // |f| < 2^-14: an fp16 subnormal or zero
    // Adding 0.5 aligns the value so that float addition rounds it to a multiple of 2^-24 (the fp16
    // subnormal step); the low mantissa bits are then the fp16 subnormal mantissa.
    const float shifted = BitsFloat(a) + 0.5f;
    return sign | static_cast<uint16_t>(FloatBits(shifted) - FloatBits(0.5f));
  }
  // Normal: rebias the exponent from 127 to 15, then round away the 13 low mantissa bits (to even);
  // a carry out of the mantissa correctly bumps the exponent, up to infinity.
  const uint32_t odd = (a >> 13) & 1u;
  a += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFu + odd;
  return sign | static_cast<uint16_t>(a >> 13);
}

inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return BitsFloat(FloatBits(magnitude) | sign);
  }
  if (exponent == 31) return BitsFloat(sign | 0x7F800000u | (mantissa << 13));
  return BitsFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

GT_INLINE void F32ToF16Scalar(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = FloatToHalf(in[i]);
}
GT_INLINE void F16ToF32Scalar(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

GT_INLINE bool Int8EncodeBody(const float* in, size_t n, float* scales, int8_t* q) {
  bool finite = true;
  for (size_t begin = 0, block = 0; begin < n; begin += kInt8BlockSize, ++block) {
    const size_t len = std::min(kInt8BlockSize, n - begin);
    const uint32_t max_bits = MaxAbsBitsBody(in + begin, len);
    if (max_bits >= 0x7F800000u) {
      finite = false;
      break;
    }
    const float max_abs = BitsFloat(max_bits);
    const float scale = max_abs / 127.0f;
    // A block of tiny values (max below ~3.7e-37) would make the inverse overflow to infinity, and 0 x inf is
    // NaN, whose conversion to an integer is undefined; the largest float quantizes such a block to zeros.
    const float inverse = max_abs > 0.0f ? std::min(127.0f / max_abs, std::numeric_limits<float>::max()) : 0.0f;
    std::memcpy(scales + block, &scale, sizeof(float));
    QuantizeInt8Body(in + begin, inverse, q + begin, len);
  }
  return finite;
}

// Decodes elements [begin, begin + n) of an int8 payload; begin is a multiple of kInt8BlockSize.
GT_INLINE void Int8DecodeBody(const int8_t* q, const float* scales, float* out, size_t begin, size_t n) {
  for (size_t offset = 0; offset < n; offset += kInt8BlockSize) {
    const size_t len = std::min(kInt8BlockSize, n - offset);
    float scale;
    std::memcpy(&scale, scales + (begin + offset) / kInt8BlockSize, sizeof(float));
    DequantizeInt8Body(q + begin + offset, scale, out + offset, len);
  }
}

// Baseline x86-64 (SSE2) versions.
namespace scalar {
void F32ToBf16(const float* in, uint16_t* out, size_t n) { F32ToBf16Body(in, out, n); }
void Bf16ToF32(const uint16_t* in, float* out, size_t n) { Bf16ToF32Body(in, out, n); }
void F32ToF16(const float* in, uint16_t* out, size_t n) { F32ToF16Scalar(in, out, n); }
void F16ToF32(const uint16_t* in, float* out, size_t n) { F16ToF32Scalar(in, out, n); }
bool Int8Encode(const float* in, size_t n, float* s, int8_t* q) { return Int8EncodeBody(in, n, s, q); }
void Int8Decode(const int8_t* q, const float* s, float* out, size_t b, size_t n) { Int8DecodeBody(q, s, out, b, n); }
void AddF32(const float* src, float* acc, size_t n) { AddF32Body(src, acc, n); }
constexpr Kernels kKernels = {"scalar", F32ToBf16, Bf16ToF32, F32ToF16, F16ToF32, Int8Encode, Int8Decode, AddF32};
}  // namespace scalar

#if defined(__x86_64__)
#define GT_AVX2 __attribute__((target("avx2,fma,f16c,bmi,bmi2,popcnt")))
namespace avx2 {
GT_AVX2 void F32ToBf16(const float* in, uint16_t* out, size_t n) { F32ToBf16Body(in, out, n); }
GT_AVX2 void Bf16ToF32(const uint16_t* in, float* out, size_t n) { Bf16ToF32Body(in, out, n); }
GT_AVX2 void F32ToF16(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  F32ToF16Scalar(in + i, out + i, n - i);
}
GT_AVX2 void F16ToF32(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  F16ToF32Scalar(in + i, out + i, n - i);
}
GT_AVX2 bool Int8Encode(const float* in, size_t n, float* s, int8_t* q) { return Int8EncodeBody(in, n, s, q); }
GT_AVX2 void Int8Decode(const int8_t* q, const float* s, float* out, size_t b, size_t n) {
  Int8DecodeBody(q, s, out, b, n);
}
GT_AVX2 void AddF32(const float* src, float* acc, size_t n) { AddF32Body(src, acc, n); }
constexpr Kernels kKernels = {"avx2", F32ToBf16, Bf16ToF32, F32ToF16, F16ToF32, Int8Encode, Int8Decode, AddF32};
}  // namespace avx2

#define GT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,popcnt")))
namespace avx512 {
GT_AVX512 void F32ToBf16(const float* in, uint16_t* out, size_t n) { F32ToBf16Body(in, out, n); }
GT_AVX512 void Bf16ToF32(const uint16_t* in, float* out, size_t n) { Bf16ToF32Body(in, out, n); }
GT_AVX512 void F32ToF16(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
  }
  F32ToF16Scalar(in + i, out + i, n - i);
}
GT_AVX512 void F16ToF32(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(h));
  }
  F16ToF32Scalar(in + i, out + i, n - i);
}
GT_AVX512 bool Int8Encode(const float* in, size_t n, float* s, int8_t* q) { return Int8EncodeBody(in, n, s, q); }
GT_AVX512 void Int8Decode(const int8_t* q, const float* s, float* out, size_t b, size_t n) {
  Int8DecodeBody(q, s, out, b, n);
}
GT_AVX512 void AddF32(const float* src, float* acc, size_t n) { AddF32Body(src, acc, n); }
constexpr Kernels kKernels = {"avx512", F32ToBf16, Bf16ToF32, F32ToF16, F16ToF32, Int8Encode, Int8Decode, AddF32};
}  // namespace avx512
#endif

#if defined(__x86_64__)
// F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports does not know "f16c".
bool HasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

const Kernels* DetectKernels() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && HasF16c() && __builtin_cpu_supports("fma")) {
    return &avx512::kKernels;
  }
  if (__builtin_cpu_supports("avx2") && HasF16c() && __builtin_cpu_supports("fma")) {
    return &avx2::kKernels;
  }
#endif
  return &scalar::kKernels;
}

std::atomic<const Kernels*> g_kernels{DetectKernels()};

}  // namespace

const Kernels* CodecKernels() { return g_kernels.load(std::memory_order_relaxed); }

}  // namespace internal

std::string_view CodecIsa() { return internal::CodecKernels()->name; }

void ForceScalarCodecs(bool force) {
  internal::g_kernels.store(force ? &internal::scalar::kKernels : internal::DetectKernels());
}

}  // namespace geotrain::comm
