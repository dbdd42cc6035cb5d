// int4 and sparse payloads with their error feedback (see codec_lowbit.h; the layout is codec.h's).
//
// Compiled like codec.cc (-O3, no FMA contraction: comm/CMakeLists.txt), so that the rounding of a value is the same
// in the encoder's residual, in the decoder and on every machine. Both codecs work a block at a time from
// input + residual computed into a block-sized buffer, so no tensor-sized scratch is needed.
#include "comm/codec_lowbit.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>

#include "absl/strings/str_cat.h"

namespace geotrain::comm::internal {
namespace {

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// Round to nearest, ties to even, for |x| <= 2^22: adding and subtracting 1.5 * 2^23 (as int8's quantiser does).
int32_t RoundToInt(float x) {
  constexpr float kRound = 12582912.0f;
  return static_cast<int32_t>((x + kRound) - kRound);
}

// The value an int4 code stands for: what the decoder writes and what the encoder's residual subtracts.
float Int4Value(int32_t q, float scale) { return static_cast<float>(q) * scale; }

// The value a sparse code c of `levels` (2^bits) levels stands for: the middle of its level, (2c + 1 - L) / L of the
// block's scale (mid-rise: the kept values are the block's largest, so no level is spent on zero).
float SparseValue(uint32_t code, uint32_t levels, float half_step) {
  return static_cast<float>(2 * static_cast<int32_t>(code) + 1 - static_cast<int32_t>(levels)) * half_step;
}

// Little-endian bit streams: bit b of the stream is bit b % 8 of byte b / 8. PutBits needs the bytes zeroed first.
void PutBits(uint8_t* out, uint64_t bit, uint32_t value, int width) {
  while (width > 0) {
    const int shift = static_cast<int>(bit % 8);
    const int take = std::min(width, 8 - shift);
    out[bit / 8] |= static_cast<uint8_t>((value & ((1u << take) - 1)) << shift);
    value >>= take;
    bit += static_cast<uint64_t>(take);
    width -= take;
  }
}

uint32_t GetBits(const uint8_t* in, uint64_t bit, int width) {
  uint32_t value = 0;
  int done = 0;
  while (done < width) {
    const int shift = static_cast<int>(bit % 8);
    const int take = std::min(width - done, 8 - shift);
    value |= ((static_cast<uint32_t>(in[bit / 8]) >> shift) & ((1u << take) - 1)) << done;
    bit += static_cast<uint64_t>(take);
    done += take;
  }
  return value;
}

// Whether the bits of a region of `used_bits` bits past its last whole byte are zero.
bool PaddingZero(const uint8_t* region, uint64_t used_bits) {
  if (used_bits % 8 == 0) return true;
  return (region[used_bits / 8] >> (used_bits % 8)) == 0;
}

// The parsed preamble of a sparse payload and where its parts start.
struct SparseLayout {
  uint64_t blocks = 0, last_length = 0, kept_full = 0, kept_last = 0, kept = 0;
  int bits = 0;
  const uint8_t* scales = nullptr;
  const uint8_t* indices = nullptr;
  const uint8_t* codes = nullptr;
  uint64_t KeptIn(uint64_t block) const { return block + 1 == blocks ? kept_last : kept_full; }
  uint64_t LengthOf(uint64_t block) const { return block + 1 == blocks ? last_length : kSparseBlockSize; }
};

SparseLayout ReadSparseLayout(const uint8_t* raw, uint64_t count) {
  SparseLayout l;
  l.blocks = CeilDiv(count, kSparseBlockSize);
  l.last_length = l.blocks == 0 ? 0 : count - (l.blocks - 1) * kSparseBlockSize;
  l.kept_full = Get<uint32_t>(raw);
  l.kept_last = Get<uint32_t>(raw + 4);
  l.bits = raw[8];
  l.kept = l.blocks == 0 ? 0 : (l.blocks - 1) * l.kept_full + l.kept_last;
  l.scales = raw + kSparsePreambleBytes;
  l.indices = l.scales + 4 * l.blocks;
  l.codes = l.indices + CeilDiv(l.kept * kSparseIndexBits, 8);
  return l;
}

// The kept positions of one block of `acc` (ascending): the k largest magnitudes, ties in index order.
void ChooseKept(const float* acc, size_t length, size_t k, std::array<float, kSparseBlockSize>* magnitudes,
                std::vector<uint32_t>* kept) {
  kept->clear();
  if (k >= length) {
    for (size_t i = 0; i < length; ++i) kept->push_back(static_cast<uint32_t>(i));
    return;
  }
  for (size_t i = 0; i < length; ++i) (*magnitudes)[i] = std::fabs(acc[i]);
  std::nth_element(magnitudes->begin(), magnitudes->begin() + static_cast<ptrdiff_t>(k - 1),
                   magnitudes->begin() + static_cast<ptrdiff_t>(length), std::greater<float>());
  const float threshold = (*magnitudes)[k - 1];
  size_t above = 0;
  for (size_t i = 0; i < length; ++i) above += std::fabs(acc[i]) > threshold ? 1 : 0;
  size_t ties_left = k - above;
  for (size_t i = 0; i < length && kept->size() < k; ++i) {
    const float a = std::fabs(acc[i]);
    bool take = a > threshold;
    if (!take && a == threshold && ties_left > 0) {
      take = true;
      --ties_left;
    }
    if (take) kept->push_back(static_cast<uint32_t>(i));
  }
}

}  // namespace

bool AccumulatedFinite(absl::Span<const float> input, const std::vector<float>* residual) {
  // The largest magnitude's bits, without a branch per element: NaN and infinity have the largest (exponent all ones).
  uint32_t max_bits = 0;
  for (size_t i = 0; i < input.size(); ++i) {
    const float v = residual != nullptr ? input[i] + (*residual)[i] : input[i];
    const uint32_t a = std::bit_cast<uint32_t>(v) & 0x7FFFFFFFu;
    max_bits = a > max_bits ? a : max_bits;
  }
  return max_bits < 0x7F800000u;
}

absl::Status EncodeInt4(absl::Span<const float> input, std::vector<float>* residual, uint8_t* raw) {
  const size_t n = input.size();
  if (residual != nullptr && residual->size() != n) residual->assign(n, 0.0f);
  if (!AccumulatedFinite(input, residual)) {
    return absl::InvalidArgumentError(
        "int4 codec input (plus its residual) holds NaN or infinity; the residual is unchanged");
  }
  const uint64_t blocks = CeilDiv(n, kCodecInt4BlockSize);
  uint8_t* codes = raw + 4 * blocks;
  if (n > 0) std::memset(codes, 0, CeilDiv(n, 2));
  std::array<float, kCodecInt4BlockSize> acc;
  for (uint64_t b = 0; b < blocks; ++b) {
    const size_t begin = b * kCodecInt4BlockSize, length = std::min<size_t>(kCodecInt4BlockSize, n - begin);
    float max_abs = 0.0f;
    for (size_t i = 0; i < length; ++i) {
      acc[i] = residual != nullptr ? input[begin + i] + (*residual)[begin + i] : input[begin + i];
      max_abs = std::max(max_abs, std::fabs(acc[i]));
    }
    const float scale = max_abs / 7.0f;
    // A block of tiny values would make the inverse overflow (and 0 x inf is NaN): the largest float instead.
    const float inverse = max_abs > 0.0f ? std::min(7.0f / max_abs, std::numeric_limits<float>::max()) : 0.0f;
    Put<float>(raw + 4 * b, scale);
    for (size_t i = 0; i < length; ++i) {
      const int32_t q = std::clamp(RoundToInt(acc[i] * inverse), -7, 7);
      const size_t e = begin + i;
      codes[e / 2] |= static_cast<uint8_t>((static_cast<uint32_t>(q) & 0xFu) << (4 * (e & 1)));
      if (residual != nullptr) (*residual)[e] = acc[i] - Int4Value(q, scale);
    }
  }
  return absl::OkStatus();
}

absl::Status CheckInt4(const uint8_t* raw, uint64_t count) {
  const uint64_t blocks = CeilDiv(count, kCodecInt4BlockSize);
  for (uint64_t b = 0; b < blocks; ++b) {
    const float scale = Get<float>(raw + 4 * b);
    if (!(scale >= 0.0f) || !std::isfinite(scale)) {
      return absl::DataLossError(absl::StrCat("int4 block ", b, " has an invalid scale"));
    }
  }
  const uint8_t* codes = raw + 4 * blocks;
  for (uint64_t j = 0; j < CeilDiv(count, 2); ++j) {
    if ((codes[j] & 0xFu) == 0x8u || (codes[j] >> 4) == 0x8u) {
      return absl::DataLossError(absl::StrCat("int4 element ", 2 * j + ((codes[j] & 0xFu) == 0x8u ? 0 : 1),
                                              " has code -8 (the encoder writes -7..7)"));
    }
  }
  if (count % 2 == 1 && (codes[count / 2] >> 4) != 0) {
    return absl::DataLossError("int4 payload of an odd count has a non-zero padding nibble");
  }
  return absl::OkStatus();
}

void DecodeInt4Range(const uint8_t* raw, uint64_t count, size_t begin, size_t n, float* out) {
  const uint64_t blocks = CeilDiv(count, kCodecInt4BlockSize);
  const uint8_t* codes = raw + 4 * blocks;
  for (size_t offset = 0; offset < n; offset += kCodecInt4BlockSize) {
    const size_t length = std::min<size_t>(kCodecInt4BlockSize, n - offset);
    const float scale = Get<float>(raw + 4 * ((begin + offset) / kCodecInt4BlockSize));
    for (size_t i = 0; i < length; ++i) {
      const size_t e = begin + offset + i;
      const uint32_t nibble = (codes[e / 2] >> (4 * (e & 1))) & 0xFu;
      out[offset + i] = Int4Value(static_cast<int32_t>(nibble ^ 0x8u) - 8, scale);
    }
  }
}

absl::Status EncodeSparse(const CodecSpec& codec, absl::Span<const float> input, std::vector<float>* residual,
                          uint8_t* raw) {
  if (residual == nullptr) {
    return absl::InvalidArgumentError("sparse needs a residual vector for error feedback (gradients only)");
  }
  if (!(codec.sparse_fraction > 0.0 && codec.sparse_fraction <= 1.0) || codec.sparse_bits < 2 ||
      codec.sparse_bits > 8) {
    return absl::InvalidArgumentError(absl::StrCat("sparse needs a fraction in (0, 1] and 2 to 8 bits, got ",
                                                   codec.sparse_fraction, " and ", codec.sparse_bits));
  }
  const size_t n = input.size();
  if (residual->size() != n) residual->assign(n, 0.0f);
  if (!AccumulatedFinite(input, residual)) {
    return absl::InvalidArgumentError(
        "sparse codec input (plus its residual) holds NaN or infinity; the residual is unchanged");
  }
  float* r = residual->data();
  SparseLayout l;
  l.blocks = CeilDiv(n, kSparseBlockSize);
  l.last_length = l.blocks == 0 ? 0 : n - (l.blocks - 1) * kSparseBlockSize;
  l.kept_full = SparseKeptPerBlock(codec.sparse_fraction, kSparseBlockSize);
  l.kept_last = SparseKeptPerBlock(codec.sparse_fraction, l.last_length);
  l.kept = l.blocks == 0 ? 0 : (l.blocks - 1) * l.kept_full + l.kept_last;
  Put<uint32_t>(raw, static_cast<uint32_t>(l.kept_full));
  Put<uint32_t>(raw + 4, static_cast<uint32_t>(l.kept_last));
  raw[8] = static_cast<uint8_t>(codec.sparse_bits);
  raw[9] = raw[10] = raw[11] = 0;
  uint8_t* indices = raw + kSparsePreambleBytes + 4 * l.blocks;
  const uint64_t index_bytes = CeilDiv(l.kept * kSparseIndexBits, 8);
  uint8_t* codes = indices + index_bytes;
  std::memset(indices, 0, index_bytes + CeilDiv(l.kept * static_cast<uint64_t>(codec.sparse_bits), 8));
  const uint32_t levels = 1u << codec.sparse_bits;
  std::array<float, kSparseBlockSize> acc, magnitudes;
  std::vector<uint32_t> kept;
  uint64_t index_bit = 0, code_bit = 0;
  for (uint64_t b = 0; b < l.blocks; ++b) {
    const size_t begin = b * kSparseBlockSize, length = l.LengthOf(b);
    for (size_t i = 0; i < length; ++i) acc[i] = input[begin + i] + r[begin + i];
    ChooseKept(acc.data(), length, l.KeptIn(b), &magnitudes, &kept);
    float scale = 0.0f;
    for (uint32_t i : kept) scale = std::max(scale, std::fabs(acc[i]));
    const float half_step = scale / static_cast<float>(levels);
    const float half_levels = static_cast<float>(levels / 2);
    const float inverse = scale > 0.0f ? std::min(half_levels / scale, std::numeric_limits<float>::max()) : 0.0f;
    Put<float>(raw + kSparsePreambleBytes + 4 * b, scale);
    for (size_t i = 0; i < length; ++i) r[begin + i] = acc[i];  // dropped: everything stays behind
    for (uint32_t i : kept) {
      const float level = std::floor(acc[i] * inverse + half_levels);
      const uint32_t code = static_cast<uint32_t>(std::clamp(level, 0.0f, static_cast<float>(levels - 1)));
      PutBits(indices, index_bit, i, kSparseIndexBits);
      PutBits(codes, code_bit, code, codec.sparse_bits);
      index_bit += kSparseIndexBits;
      code_bit += static_cast<uint64_t>(codec.sparse_bits);
      r[begin + i] = acc[i] - SparseValue(code, levels, half_step);  // kept: what its rounding left out
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSparse(const uint8_t* raw, uint64_t raw_bytes, uint64_t count) {
  if (raw_bytes < kSparsePreambleBytes) {
    return absl::DataLossError(absl::StrCat("sparse payload of ", raw_bytes, " bytes is shorter than its preamble"));
  }
  if (raw[9] != 0 || raw[10] != 0 || raw[11] != 0) return absl::DataLossError("sparse preamble has reserved bits set");
  if (raw[8] < 2 || raw[8] > 8) return absl::DataLossError(absl::StrCat("sparse values of ", raw[8], " bits"));
  // The counts first: the layout's offsets follow from them.
  const uint64_t blocks = CeilDiv(count, kSparseBlockSize);
  const uint64_t last_length = blocks == 0 ? 0 : count - (blocks - 1) * kSparseBlockSize;
  const uint32_t kept_full = Get<uint32_t>(raw), kept_last = Get<uint32_t>(raw + 4);
  if (kept_full > kSparseBlockSize || kept_last > last_length) {
    return absl::DataLossError(absl::StrCat("sparse keeps ", kept_full, " per block and ", kept_last,
                                            " in the last, more than the blocks of ", count, " elements hold"));
  }
  const uint64_t kept = blocks == 0 ? 0 : (blocks - 1) * kept_full + kept_last;
  if (raw_bytes != SparsePayloadBytes(blocks, kept, raw[8])) {
    return absl::DataLossError(absl::StrCat("sparse payload of ", raw_bytes, " bytes does not match ", kept,
                                            " kept values of ", count, " elements (",
                                            SparsePayloadBytes(blocks, kept, raw[8]), ")"));
  }
  const SparseLayout l = ReadSparseLayout(raw, count);  // every part inside the payload now
  for (uint64_t b = 0; b < l.blocks; ++b) {
    const float scale = Get<float>(l.scales + 4 * b);
    if (!(scale >= 0.0f) || !std::isfinite(scale)) {
      return absl::DataLossError(absl::StrCat("sparse block ", b, " has an invalid scale"));
    }
  }
  uint64_t bit = 0;
  for (uint64_t b = 0; b < l.blocks; ++b) {
    const uint64_t length = l.LengthOf(b);
    for (uint64_t j = 0; j < l.KeptIn(b); ++j, bit += kSparseIndexBits) {
      const uint32_t index = GetBits(l.indices, bit, kSparseIndexBits);
      if (index >= length || (j > 0 && index <= GetBits(l.indices, bit - kSparseIndexBits, kSparseIndexBits))) {
        return absl::DataLossError(absl::StrCat("sparse index ", index, " at position ", j, " of block ", b,
                                                " is out of its block or not increasing"));
      }
    }
  }
  if (!PaddingZero(l.indices, l.kept * kSparseIndexBits) ||
      !PaddingZero(l.codes, l.kept * static_cast<uint64_t>(l.bits))) {
    return absl::DataLossError("sparse payload has non-zero padding bits");
  }
  return absl::OkStatus();
}

void DecodeSparse(const uint8_t* raw, uint64_t count, float* out, bool accumulate) {
  const SparseLayout l = ReadSparseLayout(raw, count);
  if (!accumulate && count > 0) std::fill(out, out + count, 0.0f);
  const uint32_t levels = 1u << l.bits;
  uint64_t index_bit = 0, code_bit = 0;
  for (uint64_t b = 0; b < l.blocks; ++b) {
    const float half_step = Get<float>(l.scales + 4 * b) / static_cast<float>(levels);
    float* block = out + b * kSparseBlockSize;
    for (uint64_t j = 0; j < l.KeptIn(b); ++j) {
      const uint32_t index = GetBits(l.indices, index_bit, kSparseIndexBits);
      const uint32_t code = GetBits(l.codes, code_bit, l.bits);
      index_bit += kSparseIndexBits;
      code_bit += static_cast<uint64_t>(l.bits);
      block[index] += SparseValue(code, levels, half_step);
    }
  }
}

}  // namespace geotrain::comm::internal
