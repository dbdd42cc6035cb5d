// CRC-32C (see crc32c.h): slicing-by-8 in software, three interleaved crc32-instruction streams with SSE4.2.
#include "comm/crc32c.h"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace geotrain::comm {
namespace {

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

}  // namespace

uint32_t Crc32c(const void* data, size_t size, uint32_t crc) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (g_have_sse42) return ~Crc32cHardware(p, size, crc);
#endif
  return ~Crc32cSoftware(p, size, crc);
}

}  // namespace geotrain::comm
