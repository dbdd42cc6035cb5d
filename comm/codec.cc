// Tensor codecs: encode and decode loops, the wire header and its validation (see codec.h).
//
// The element loops are written once as plain loops (inlined "bodies") and compiled three times: for
// AVX-512, for AVX2+F16C and for baseline x86-64; the best set this CPU supports is picked at start-up.
// This file is compiled with -O3 so that GCC vectorises the bodies. fp16 uses the F16C / AVX-512
// conversion instructions (round to nearest even) where present.
#include "comm/codec.h"

#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

static_assert(std::endian::native == std::endian::little, "geotrain's wire formats assume little endian");

namespace geotrain::comm {
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

struct Kernels {
  const char* name;
  void (*f32_to_bf16)(const float*, uint16_t*, size_t);
  void (*bf16_to_f32)(const uint16_t*, float*, size_t);
  void (*f32_to_f16)(const float*, uint16_t*, size_t);
  void (*f16_to_f32)(const uint16_t*, float*, size_t);
  bool (*int8_encode)(const float*, size_t, float*, int8_t*);
  void (*int8_decode)(const int8_t*, const float*, float*, size_t, size_t);
  void (*add_f32)(const float*, float*, size_t);
};

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
const Kernels* K() { return g_kernels.load(std::memory_order_relaxed); }

// ---------------------------------------------------------------------------------------------------
// CRC-32C.

struct Crc32cTable {
  uint32_t entries[8][256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      entries[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int t = 1; t < 8; ++t) entries[t][i] = (entries[t - 1][i] >> 8) ^ entries[0][entries[t - 1][i] & 0xFFu];
    }
  }
};
const Crc32cTable& CrcTable() {
  static const Crc32cTable* table = new Crc32cTable();
  return *table;
}

uint32_t Crc32cSoftware(const uint8_t* p, size_t n, uint32_t crc) {
  const Crc32cTable& t = CrcTable();
  while (n >= 8) {  // slicing by 8
    uint64_t word;
    std::memcpy(&word, p, 8);
    word ^= crc;
    crc = t.entries[7][word & 0xFF] ^ t.entries[6][(word >> 8) & 0xFF] ^ t.entries[5][(word >> 16) & 0xFF] ^
          t.entries[4][(word >> 24) & 0xFF] ^ t.entries[3][(word >> 32) & 0xFF] ^ t.entries[2][(word >> 40) & 0xFF] ^
          t.entries[1][(word >> 48) & 0xFF] ^ t.entries[0][word >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ t.entries[0][(crc ^ *p++) & 0xFFu];
  return crc;
}

#if defined(__x86_64__)
// The crc32 instruction has a latency of several cycles but a throughput of one per cycle, so three
// independent streams over consecutive lanes of kCrcLane bytes run about three times faster; their states are
// then combined: crc(A || B) = Shift(crc(A), |B|) ^ crc(B) on raw (non-inverted) states, where Shift appends
// |B| zero bytes, a linear map applied with four 256-entry tables.
constexpr size_t kCrcLane = 4096;

struct CrcShiftTable {
  uint32_t t[4][256];
  CrcShiftTable() {
    const Crc32cTable& table = CrcTable();
    uint32_t basis[32];
    for (int bit = 0; bit < 32; ++bit) {
      uint32_t c = 1u << bit;
      for (size_t i = 0; i < kCrcLane; ++i) c = (c >> 8) ^ table.entries[0][c & 0xFFu];
      basis[bit] = c;
    }
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t v = 0;
        for (int bit = 0; bit < 8; ++bit) {
          if (b & (1u << bit)) v ^= basis[8 * k + bit];
        }
        t[k][b] = v;
      }
    }
  }
  uint32_t Shift(uint32_t c) const {
    return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24];
  }
};

const CrcShiftTable& ShiftTable() {
  static const CrcShiftTable* table = new CrcShiftTable();
  return *table;
}

__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(const uint8_t* p, size_t n, uint32_t crc) {
  uint64_t c = crc;
  if (n >= 3 * kCrcLane) {
    const CrcShiftTable& shift = ShiftTable();
    while (n >= 3 * kCrcLane) {
      uint64_t a = c, b = 0, d = 0;
      for (size_t i = 0; i < kCrcLane; i += 8) {
        uint64_t wa, wb, wd;
        std::memcpy(&wa, p + i, 8);
        std::memcpy(&wb, p + kCrcLane + i, 8);
        std::memcpy(&wd, p + 2 * kCrcLane + i, 8);
        a = _mm_crc32_u64(a, wa);
        b = _mm_crc32_u64(b, wb);
        d = _mm_crc32_u64(d, wd);
      }
      const uint32_t ab = shift.Shift(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b);
      c = shift.Shift(ab) ^ static_cast<uint32_t>(d);
      p += 3 * kCrcLane;
      n -= 3 * kCrcLane;
    }
  }
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
const bool g_have_sse42 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2") != 0;
}();
#endif

// ---------------------------------------------------------------------------------------------------
// Header.

struct Header {
  uint8_t kind = 0;
  uint8_t flags = 0;
  uint64_t count = 0;
  uint64_t payload_bytes = 0;
  uint64_t raw_bytes = 0;
  uint32_t payload_crc = 0;
};

constexpr uint8_t kVersion = 1;
constexpr uint8_t kFlagZstd = 1;

template <typename T>
void Put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

void WriteHeader(const Header& h, uint8_t* p) {
  Put<uint32_t>(p + 0, kCodecMagic);
  p[4] = kVersion;
  p[5] = h.kind;
  p[6] = h.flags;
  p[7] = 0;
  Put<uint64_t>(p + 8, h.count);
  Put<uint64_t>(p + 16, h.payload_bytes);
  Put<uint64_t>(p + 24, h.raw_bytes);
  Put<uint32_t>(p + 32, h.payload_crc);
  Put<uint32_t>(p + 36, Crc32c(p, 36));
}

// Raw payload bytes of `count` elements for the fixed-size kinds; top-k depends on k.
uint64_t FixedRawBytes(CodecKind kind, uint64_t count) {
  switch (kind) {
    case CodecKind::kNone:
      return count * 4;
    case CodecKind::kFp16:
    case CodecKind::kBf16:
      return count * 2;
    case CodecKind::kInt8:
      return (count + kInt8BlockSize - 1) / kInt8BlockSize * 4 + count;
    case CodecKind::kTopK:
      return 0;
  }
  return 0;
}

absl::StatusOr<Header> ReadHeader(absl::Span<const uint8_t> in) {
  if (in.size() < kCodecHeaderBytes) {
    return absl::DataLossError(
        absl::StrCat("encoded tensor truncated: ", in.size(), " bytes, the header alone is ", kCodecHeaderBytes));
  }
  const uint8_t* p = in.data();
  if (Get<uint32_t>(p) != kCodecMagic) {
    return absl::DataLossError("encoded tensor has a wrong magic number (not a geotrain codec buffer)");
  }
  if (Get<uint32_t>(p + 36) != Crc32c(p, 36)) {
    return absl::DataLossError("encoded tensor header checksum mismatch (corrupted header)");
  }
  if (p[4] != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("encoded tensor has codec format version ", p[4],
                                                   ", this build reads version ", kVersion, "; upgrade the peer"));
  }
  Header h;
  h.kind = p[5];
  h.flags = p[6];
  h.count = Get<uint64_t>(p + 8);
  h.payload_bytes = Get<uint64_t>(p + 16);
  h.raw_bytes = Get<uint64_t>(p + 24);
  h.payload_crc = Get<uint32_t>(p + 32);
  if (h.kind > static_cast<uint8_t>(CodecKind::kTopK)) {
    return absl::InvalidArgumentError(absl::StrCat("encoded tensor has unknown codec kind ", h.kind));
  }
  if ((h.flags & ~kFlagZstd) != 0 || p[7] != 0) {
    return absl::InvalidArgumentError(absl::StrCat("encoded tensor has unknown flags ", h.flags));
  }
  if (h.count > kMaxCodecElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("encoded tensor claims ", h.count, " elements, above the limit ", kMaxCodecElements));
  }
  if (h.payload_bytes != in.size() - kCodecHeaderBytes) {
    return absl::DataLossError(absl::StrCat("encoded tensor payload is ", in.size() - kCodecHeaderBytes,
                                            " bytes but its header says ", h.payload_bytes));
  }
  const CodecKind kind = static_cast<CodecKind>(h.kind);
  if (kind == CodecKind::kTopK) {
    if (h.count > std::numeric_limits<uint32_t>::max()) {
      return absl::InvalidArgumentError("top-k tensor has more than 2^32 elements");
    }
    if (h.raw_bytes < 8 || (h.raw_bytes - 8) % 8 != 0 || (h.raw_bytes - 8) / 8 > h.count) {
      return absl::DataLossError(
          absl::StrCat("top-k payload of ", h.raw_bytes, " bytes does not fit ", h.count, " elements"));
    }
  } else if (h.raw_bytes != FixedRawBytes(kind, h.count)) {
    return absl::DataLossError(absl::StrCat("payload of ", h.raw_bytes, " bytes does not match ", h.count,
                                            " elements of this codec (", FixedRawBytes(kind, h.count), ")"));
  }
  if ((h.flags & kFlagZstd) == 0 && h.raw_bytes != h.payload_bytes) {
    return absl::DataLossError("uncompressed payload size differs from its raw size");
  }
  return h;
}

// Thread-local scratch, reused between calls to avoid allocating per tensor.
std::vector<uint8_t>& Scratch(int which) {
  thread_local std::vector<uint8_t> buffers[2];
  return buffers[which];
}

uint8_t* ScratchBytes(int which, size_t n) {
  std::vector<uint8_t>& buffer = Scratch(which);
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// Returns the raw (decompressed) payload, decompressing into scratch if needed.
absl::StatusOr<const uint8_t*> RawPayload(const Header& h, absl::Span<const uint8_t> in) {
  const uint8_t* payload = in.data() + kCodecHeaderBytes;
  if ((h.flags & kFlagZstd) == 0) return payload;
  const unsigned long long frame = ZSTD_getFrameContentSize(payload, h.payload_bytes);
  if (frame == ZSTD_CONTENTSIZE_ERROR || frame == ZSTD_CONTENTSIZE_UNKNOWN || frame != h.raw_bytes) {
    return absl::DataLossError(absl::StrCat("zstd frame does not declare the expected ", h.raw_bytes, " bytes"));
  }
  uint8_t* raw = ScratchBytes(0, h.raw_bytes + 1);
  // One context per thread, freed when the thread ends (gRPC's threads come and go).
  thread_local const std::unique_ptr<ZSTD_DCtx, size_t (*)(ZSTD_DCtx*)> context(ZSTD_createDCtx(), ZSTD_freeDCtx);
  ZSTD_DCtx* dctx = context.get();
  const size_t got = ZSTD_decompressDCtx(dctx, raw, h.raw_bytes, payload, h.payload_bytes);
  if (ZSTD_isError(got) || got != h.raw_bytes) {
    return absl::DataLossError(
        absl::StrCat("zstd payload is corrupted: ", ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short output"));
  }
  return raw;
}

absl::Status CheckTopK(const uint8_t* raw, const Header& h, uint64_t* k_out) {
  const uint64_t k = Get<uint64_t>(raw);
  if (k * 8 + 8 != h.raw_bytes) return absl::DataLossError("top-k count does not match its payload size");
  const uint8_t* indices = raw + 8;
  uint64_t previous = 0;
  for (uint64_t j = 0; j < k; ++j) {
    const uint32_t index = Get<uint32_t>(indices + 4 * j);
    if (index >= h.count || (j > 0 && index <= previous)) {
      return absl::DataLossError(
          absl::StrCat("top-k index ", index, " at position ", j, " is out of range or not increasing"));
    }
    previous = index;
  }
  *k_out = k;
  return absl::OkStatus();
}

absl::Status CheckInt8Scales(const uint8_t* raw, uint64_t count) {
  const uint64_t blocks = (count + kInt8BlockSize - 1) / kInt8BlockSize;
  for (uint64_t b = 0; b < blocks; ++b) {
    const float scale = Get<float>(raw + 4 * b);
    if (!(scale >= 0.0f) || !std::isfinite(scale)) {
      return absl::DataLossError(absl::StrCat("int8 block ", b, " has an invalid scale"));
    }
  }
  return absl::OkStatus();
}

// Decodes elements [begin, begin + n) of a validated fixed-size raw payload.
void DecodeRange(CodecKind kind, const uint8_t* raw, uint64_t count, size_t begin, size_t n, float* out) {
  if (n == 0) return;  // an empty output may be a null pointer, which memcpy must not get even for 0 bytes
  const Kernels* k = K();
  switch (kind) {
    case CodecKind::kNone:
      std::memcpy(out, raw + 4 * begin, 4 * n);
      break;
    case CodecKind::kFp16:
      k->f16_to_f32(reinterpret_cast<const uint16_t*>(raw) + begin, out, n);
      break;
    case CodecKind::kBf16:
      k->bf16_to_f32(reinterpret_cast<const uint16_t*>(raw) + begin, out, n);
      break;
    case CodecKind::kInt8: {
      const uint64_t blocks = (count + kInt8BlockSize - 1) / kInt8BlockSize;
      const float* scales = reinterpret_cast<const float*>(raw);
      k->int8_decode(reinterpret_cast<const int8_t*>(raw + 4 * blocks), scales, out, begin, n);
      break;
    }
    case CodecKind::kTopK:
      break;
  }
}

absl::Status DecodeImpl(absl::Span<const uint8_t> encoded, absl::Span<float> output, const DecodeOptions& options,
                        bool accumulate) {
  auto header = ReadHeader(encoded);
  if (!header.ok()) return header.status();
  const Header& h = *header;
  if (h.count != output.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("encoded tensor has ", h.count, " elements, the destination ", output.size()));
  }
  if (options.verify_checksum && Crc32c(encoded.data() + kCodecHeaderBytes, h.payload_bytes) != h.payload_crc) {
    return absl::DataLossError("encoded tensor payload checksum mismatch (corrupted in transit)");
  }
  auto raw_or = RawPayload(h, encoded);
  if (!raw_or.ok()) return raw_or.status();
  const uint8_t* raw = *raw_or;
  const CodecKind kind = static_cast<CodecKind>(h.kind);
  if (kind == CodecKind::kTopK) {
    uint64_t k = 0;
    if (absl::Status s = CheckTopK(raw, h, &k); !s.ok()) return s;
    if (!accumulate) std::fill(output.begin(), output.end(), 0.0f);
    const uint8_t* indices = raw + 8;
    const uint8_t* values = raw + 8 + 4 * k;
    for (uint64_t j = 0; j < k; ++j) {
      output[Get<uint32_t>(indices + 4 * j)] += Get<float>(values + 4 * j);
    }
    return absl::OkStatus();
  }
  if (kind == CodecKind::kInt8) {
    if (absl::Status s = CheckInt8Scales(raw, h.count); !s.ok()) return s;
  }
  if (!accumulate) {
    DecodeRange(kind, raw, h.count, 0, output.size(), output.data());
    return absl::OkStatus();
  }
  // Decode a cache-sized block at a time into scratch, then add (a multiple of the int8 block size).
  constexpr size_t kBlock = 16 * 1024;
  float* tmp = reinterpret_cast<float*>(ScratchBytes(1, kBlock * sizeof(float)));
  for (size_t begin = 0; begin < output.size(); begin += kBlock) {
    const size_t n = std::min(kBlock, output.size() - begin);
    DecodeRange(kind, raw, h.count, begin, n, tmp);
    K()->add_f32(tmp, output.data() + begin, n);
  }
  return absl::OkStatus();
}

// Writes the top-k raw payload; updates the residual (error feedback).
absl::Status EncodeTopK(const Codec& codec, absl::Span<const float> input, std::vector<float>* residual,
                        std::vector<uint8_t>* raw) {
  const size_t n = input.size();
  if (residual == nullptr) {
    return absl::InvalidArgumentError("top-k needs a residual vector for error feedback (gradients only)");
  }
  if (n > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError("top-k supports tensors of at most 2^32 elements");
  }
  if (residual->size() != n) residual->assign(n, 0.0f);
  float* acc = residual->data();
  uint32_t max_bits = 0;
  for (size_t i = 0; i < n; ++i) {
    acc[i] += input[i];
    const uint32_t a = FloatBits(acc[i]) & 0x7FFFFFFFu;
    max_bits = a > max_bits ? a : max_bits;
  }
  if (max_bits >= 0x7F800000u) {
    return absl::InvalidArgumentError("top-k input (plus residual) holds NaN or infinity");
  }
  size_t k = n == 0 ? 0 : static_cast<size_t>(std::ceil(codec.topk_fraction * static_cast<double>(n)));
  k = std::clamp<size_t>(k, n == 0 ? 0 : 1, n);
  raw->resize(8 + 8 * k);
  Put<uint64_t>(raw->data(), k);
  if (k == 0) return absl::OkStatus();
  // Threshold = k-th largest magnitude; take everything above it, then ties in index order up to k.
  thread_local std::vector<float> magnitudes;
  magnitudes.resize(n);
  for (size_t i = 0; i < n; ++i) magnitudes[i] = std::fabs(acc[i]);
  std::nth_element(magnitudes.begin(), magnitudes.begin() + static_cast<ptrdiff_t>(k - 1), magnitudes.end(),
                   std::greater<float>());
  const float threshold = magnitudes[k - 1];
  size_t above = 0;
  for (size_t i = 0; i < n; ++i) above += std::fabs(acc[i]) > threshold ? 1 : 0;
  size_t ties_left = k - above;
  uint8_t* indices = raw->data() + 8;
  uint8_t* values = raw->data() + 8 + 4 * k;
  size_t j = 0;
  for (size_t i = 0; i < n && j < k; ++i) {
    const float a = std::fabs(acc[i]);
    bool take = a > threshold;
    if (!take && a == threshold && ties_left > 0) {
      take = true;
      --ties_left;
    }
    if (take) {
      Put<uint32_t>(indices + 4 * j, static_cast<uint32_t>(i));
      Put<float>(values + 4 * j, acc[i]);
      acc[i] = 0.0f;  // sent: nothing left over for this element
      ++j;
    }
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Public API.

std::string Codec::ToString() const {
  std::string base;
  switch (kind) {
    case CodecKind::kNone:
      base = "none";
      break;
    case CodecKind::kFp16:
      base = "fp16";
      break;
    case CodecKind::kBf16:
      base = "bf16";
      break;
    case CodecKind::kInt8:
      base = "int8";
      break;
    case CodecKind::kTopK:
      base = absl::StrCat("topk:", topk_fraction);
      break;
  }
  if (zstd) absl::StrAppend(&base, zstd_level == 1 ? "+zstd" : absl::StrCat("+zstd:", zstd_level));
  return base;
}

absl::StatusOr<Codec> ParseCodec(std::string_view text_view) {
  // Debian's Abseil has its own string_view type: work on std::string here.
  const std::string text(text_view);
  std::string lowered = absl::AsciiStrToLower(text);
  absl::StripAsciiWhitespace(&lowered);
  const std::string accepted = "accepted: none | fp16 | bf16 | int8 | topk:F (0<F<=1), optionally +zstd or +zstd:L";
  std::vector<std::string> parts = absl::StrSplit(lowered, '+');
  if (parts.empty() || parts.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat("bad codec '", text, "'; ", accepted));
  }
  Codec codec;
  const std::string& base = parts[0];
  if (base == "none" || base == "fp32") {
    codec.kind = CodecKind::kNone;
  } else if (base == "fp16") {
    codec.kind = CodecKind::kFp16;
  } else if (base == "bf16") {
    codec.kind = CodecKind::kBf16;
  } else if (base == "int8") {
    codec.kind = CodecKind::kInt8;
  } else if (base.rfind("topk:", 0) == 0) {
    codec.kind = CodecKind::kTopK;
    double fraction = 0;
    if (!absl::SimpleAtod(base.substr(5), &fraction) || !(fraction > 0.0) || fraction > 1.0) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad top-k fraction in codec '", text, "': give a number in (0, 1], e.g. topk:0.01"));
    }
    codec.topk_fraction = fraction;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown codec '", base, "' in '", text, "'; ", accepted));
  }
  if (parts.size() == 2) {
    const std::string& extra = parts[1];
    if (extra == "zstd") {
      codec.zstd = true;
    } else if (extra.rfind("zstd:", 0) == 0) {
      int level = 0;
      if (!absl::SimpleAtoi(extra.substr(5), &level) || level < 1 || level > 19) {
        return absl::InvalidArgumentError(absl::StrCat("bad zstd level in codec '", text, "': use 1..19"));
      }
      codec.zstd = true;
      codec.zstd_level = level;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown codec suffix '+", extra, "' in '", text, "'; ", accepted));
    }
  }
  return codec;
}

namespace {

// Recycles large buffers: a fresh multi-megabyte allocation is mmap'ed and every page is faulted in and
// zeroed by the kernel on first touch, which costs more than encoding it. Tensors of the same size recur
// every step, so buffers are kept per size class (64 KiB granularity) up to a total cap.
class BufferPool {
 public:
  static constexpr size_t kMinPooled = size_t{1} << 20;
  static constexpr size_t kGranularity = size_t{64} << 10;
  static constexpr size_t kMaxCachedBytes = size_t{1} << 30;
  static constexpr size_t kMaxPerClass = 8;

  static BufferPool& Get() {
    static BufferPool* pool = new BufferPool();
    return *pool;
  }
  static size_t ClassOf(size_t size) { return (size + kGranularity - 1) / kGranularity * kGranularity; }

  uint8_t* Take(size_t capacity) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(capacity);
      if (it != free_.end() && !it->second.empty()) {
        uint8_t* p = it->second.back();
        it->second.pop_back();
        cached_ -= capacity;
        return p;
      }
    }
    return new uint8_t[capacity];
  }
  void Give(uint8_t* p, size_t capacity) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<uint8_t*>& list = free_[capacity];
      if (cached_ + capacity <= kMaxCachedBytes && list.size() < kMaxPerClass) {
        list.push_back(p);
        cached_ += capacity;
        return;
      }
    }
    delete[] p;
  }

 private:
  std::mutex mu_;
  std::map<size_t, std::vector<uint8_t*>> free_;
  size_t cached_ = 0;
};

}  // namespace

Bytes::Bytes(size_t size) : size_(size), capacity_(size) {
  if (size == 0) return;
  if (size < BufferPool::kMinPooled) {
    data_ = std::shared_ptr<uint8_t[]>(new uint8_t[size]);
    return;
  }
  capacity_ = BufferPool::ClassOf(size);
  const size_t capacity = capacity_;
  data_ = std::shared_ptr<uint8_t[]>(BufferPool::Get().Take(capacity),
                                     [capacity](uint8_t* p) { BufferPool::Get().Give(p, capacity); });
}

void Bytes::Shrink(size_t size) { size_ = std::min(size, capacity_); }

uint32_t Crc32c(const void* data, size_t size, uint32_t crc) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (g_have_sse42) return ~Crc32cHardware(p, size, crc);
#endif
  return ~Crc32cSoftware(p, size, crc);
}

std::string_view CodecIsa() { return K()->name; }

void ForceScalarCodecs(bool force) { g_kernels.store(force ? &scalar::kKernels : DetectKernels()); }

absl::Status EncodeTensor(const Codec& codec, absl::Span<const float> input, Bytes* out, std::vector<float>* residual) {
  const uint64_t count = input.size();
  if (count > kMaxCodecElements) {
    return absl::InvalidArgumentError(absl::StrCat("tensor of ", count, " elements is above the codec limit"));
  }
  if (codec.kind == CodecKind::kTopK && !(codec.topk_fraction > 0.0 && codec.topk_fraction <= 1.0)) {
    return absl::InvalidArgumentError("top-k fraction must be in (0, 1]");
  }
  const Kernels* k = K();
  // Where the raw payload goes: straight after the header when not compressing, else scratch.
  std::vector<uint8_t> topk_raw;
  uint64_t raw_bytes = 0;
  uint8_t* raw = nullptr;
  Bytes result;
  if (codec.kind == CodecKind::kTopK) {
    if (absl::Status s = EncodeTopK(codec, input, residual, &topk_raw); !s.ok()) return s;
    raw_bytes = topk_raw.size();
    if (!codec.zstd) {
      result = Bytes(kCodecHeaderBytes + raw_bytes);
      raw = result.data() + kCodecHeaderBytes;
      std::memcpy(raw, topk_raw.data(), raw_bytes);
    } else {
      raw = topk_raw.data();
    }
  } else {
    raw_bytes = FixedRawBytes(codec.kind, count);
    if (!codec.zstd) {
      result = Bytes(kCodecHeaderBytes + raw_bytes);
      raw = result.data() + kCodecHeaderBytes;
    } else {
      raw = ScratchBytes(1, raw_bytes + 1);
    }
    switch (codec.kind) {
      case CodecKind::kNone:
        if (count > 0) std::memcpy(raw, input.data(), raw_bytes);
        break;
      case CodecKind::kFp16:
        k->f32_to_f16(input.data(), reinterpret_cast<uint16_t*>(raw), count);
        break;
      case CodecKind::kBf16:
        k->f32_to_bf16(input.data(), reinterpret_cast<uint16_t*>(raw), count);
        break;
      case CodecKind::kInt8: {
        const uint64_t blocks = (count + kInt8BlockSize - 1) / kInt8BlockSize;
        if (!k->int8_encode(input.data(), count, reinterpret_cast<float*>(raw),
                            reinterpret_cast<int8_t*>(raw + 4 * blocks))) {
          return absl::InvalidArgumentError("int8 codec input holds NaN or infinity");
        }
        break;
      }
      case CodecKind::kTopK:
        break;
    }
  }
  Header h;
  h.kind = static_cast<uint8_t>(codec.kind);
  h.count = count;
  h.raw_bytes = raw_bytes;
  if (codec.zstd) {
    h.flags = kFlagZstd;
    const size_t bound = ZSTD_compressBound(raw_bytes);
    result = Bytes(kCodecHeaderBytes + bound);
    thread_local const std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> context(ZSTD_createCCtx(), ZSTD_freeCCtx);
    ZSTD_CCtx* cctx = context.get();
    const size_t compressed =
        ZSTD_compressCCtx(cctx, result.data() + kCodecHeaderBytes, bound, raw, raw_bytes, codec.zstd_level);
    if (ZSTD_isError(compressed)) {
      return absl::InternalError(absl::StrCat("zstd compression failed: ", ZSTD_getErrorName(compressed)));
    }
    result.Shrink(kCodecHeaderBytes + compressed);
    h.payload_bytes = compressed;
  } else {
    h.payload_bytes = raw_bytes;
  }
  h.payload_crc = Crc32c(result.data() + kCodecHeaderBytes, h.payload_bytes);
  WriteHeader(h, result.data());
  *out = std::move(result);
  return absl::OkStatus();
}

size_t EncodedElementBytes(const Codec& codec) {
  if (codec.zstd) return 0;
  switch (codec.kind) {
    case CodecKind::kNone:
      return 4;
    case CodecKind::kFp16:
    case CodecKind::kBf16:
      return 2;
    case CodecKind::kInt8:
    case CodecKind::kTopK:
      return 0;
  }
  return 0;
}

void EncodeElements(const Codec& codec, absl::Span<const float> input, uint8_t* out) {
  const Kernels* k = K();
  switch (codec.kind) {
    case CodecKind::kNone:
      if (!input.empty()) std::memcpy(out, input.data(), input.size() * 4);
      break;
    case CodecKind::kFp16:
      k->f32_to_f16(input.data(), reinterpret_cast<uint16_t*>(out), input.size());
      break;
    case CodecKind::kBf16:
      k->f32_to_bf16(input.data(), reinterpret_cast<uint16_t*>(out), input.size());
      break;
    case CodecKind::kInt8:
    case CodecKind::kTopK:
      break;  // not element-wise: EncodedElementBytes is 0
  }
}

void WriteCodecHeader(const Codec& codec, uint64_t element_count, uint32_t payload_crc, uint8_t* out) {
  Header h;
  h.kind = static_cast<uint8_t>(codec.kind);
  h.count = element_count;
  h.raw_bytes = FixedRawBytes(codec.kind, element_count);
  h.payload_bytes = h.raw_bytes;
  h.payload_crc = payload_crc;
  WriteHeader(h, out);
}

absl::Status CheckEncodedSize(const Codec& codec, uint64_t element_count, uint64_t encoded_bytes) {
  if (element_count > kMaxCodecElements) {
    return absl::InvalidArgumentError(absl::StrCat(element_count, " elements is above the codec limit"));
  }
  uint64_t raw_max = codec.kind == CodecKind::kTopK ? 8 + 8 * element_count : FixedRawBytes(codec.kind, element_count);
  if (!codec.zstd && codec.kind != CodecKind::kTopK) {
    if (encoded_bytes != kCodecHeaderBytes + raw_max) {
      return absl::InvalidArgumentError(absl::StrCat("a ", codec.ToString(), " tensor of ", element_count,
                                                     " elements is ", kCodecHeaderBytes + raw_max, " bytes, not ",
                                                     encoded_bytes));
    }
    return absl::OkStatus();
  }
  const uint64_t bound = kCodecHeaderBytes + (codec.zstd ? ZSTD_compressBound(raw_max) : raw_max);
  if (encoded_bytes < kCodecHeaderBytes + (codec.zstd ? 1 : 8) || encoded_bytes > bound) {
    return absl::InvalidArgumentError(absl::StrCat("a ", codec.ToString(), " tensor of ", element_count,
                                                   " elements cannot be ", encoded_bytes, " bytes (at most ", bound,
                                                   ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<EncodedInfo> InspectEncoded(absl::Span<const uint8_t> encoded, bool verify_checksum) {
  auto header = ReadHeader(encoded);
  if (!header.ok()) return header.status();
  if (verify_checksum && Crc32c(encoded.data() + kCodecHeaderBytes, header->payload_bytes) != header->payload_crc) {
    return absl::DataLossError("encoded tensor payload checksum mismatch (corrupted in transit)");
  }
  EncodedInfo info;
  info.codec.kind = static_cast<CodecKind>(header->kind);
  info.codec.zstd = (header->flags & kFlagZstd) != 0;
  info.element_count = header->count;
  info.payload_bytes = header->payload_bytes;
  info.raw_payload_bytes = header->raw_bytes;
  info.payload_crc = header->payload_crc;
  return info;
}

absl::Status DecodeTensor(absl::Span<const uint8_t> encoded, absl::Span<float> output, const DecodeOptions& options) {
  return DecodeImpl(encoded, output, options, /*accumulate=*/false);
}

absl::Status DecodeTensorAdd(absl::Span<const uint8_t> encoded, absl::Span<float> accumulator,
                             const DecodeOptions& options) {
  return DecodeImpl(encoded, accumulator, options, /*accumulate=*/true);
}

}  // namespace geotrain::comm
