// Codec names (see codec_spec.h).
#include "common/codec_spec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace geotrain {
namespace {

// The shortest text that reads back as the same double (so that a sparse codec's name gives its fraction exactly).
std::string ShortestDouble(double value) {
  char text[32];
  const std::to_chars_result result = std::to_chars(text, text + sizeof(text), value);
  return std::string(text, result.ptr);
}

// "sparse", "sparse:F" or "sparse:F:B" (base already lower case).
absl::Status ParseSparse(const std::string& base, const std::string& text, CodecSpec* codec) {
  codec->kind = CodecKind::kSparse;
  codec->sparse_fraction = kSparseDefaultFraction;
  codec->sparse_bits = kSparseDefaultBits;
  const std::vector<std::string> fields = absl::StrSplit(base, ':');
  if (fields.size() > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad sparse codec '", text, "': give sparse, sparse:F or sparse:F:B, e.g. sparse:0.02:2"));
  }
  if (fields.size() >= 2) {
    double fraction = 0;
    if (!absl::SimpleAtod(fields[1], &fraction) || !(fraction > 0.0) || fraction > 1.0) {
      return absl::InvalidArgumentError(absl::StrCat("bad sparse fraction in codec '", text,
                                                     "': give the share of each block kept in (0, 1], e.g. "
                                                     "sparse:0.02:2"));
    }
    codec->sparse_fraction = fraction;
  }
  if (fields.size() == 3) {
    int bits = 0;
    if (!absl::SimpleAtoi(fields[2], &bits) || bits < 2 || bits > 8) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad sparse bits in codec '", text, "': give the bits of each kept value, 2 to 8, e.g. sparse:0.02:2"));
    }
    codec->sparse_bits = bits;
  }
  return absl::OkStatus();
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

}  // namespace

std::string CodecSpec::ToString() const {
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
    case CodecKind::kInt4:
      base = "int4";
      break;
    case CodecKind::kSparse:
      base = absl::StrCat("sparse:", ShortestDouble(sparse_fraction), ":", sparse_bits);
      break;
  }
  if (zstd) absl::StrAppend(&base, zstd_level == 1 ? "+zstd" : absl::StrCat("+zstd:", zstd_level));
  return base;
}

absl::StatusOr<CodecSpec> ParseCodecSpec(std::string_view text_view) {
  // Debian's Abseil has its own string_view type: work on std::string here.
  const std::string text(text_view);
  std::string lowered = absl::AsciiStrToLower(text);
  absl::StripAsciiWhitespace(&lowered);
  const std::string accepted =
      "accepted: none | fp16 | bf16 | int8 | topk:F (0<F<=1) | int4 | sparse[:F[:B]] (0<F<=1, B 2..8), optionally "
      "+zstd or +zstd:L";
  std::vector<std::string> parts = absl::StrSplit(lowered, '+');
  if (parts.empty() || parts.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat("bad codec '", text, "'; ", accepted));
  }
  CodecSpec codec;
  const std::string& base = parts[0];
  if (base == "none" || base == "fp32") {
    codec.kind = CodecKind::kNone;
  } else if (base == "fp16") {
    codec.kind = CodecKind::kFp16;
  } else if (base == "bf16") {
    codec.kind = CodecKind::kBf16;
  } else if (base == "int8") {
    codec.kind = CodecKind::kInt8;
  } else if (base == "int4") {
    codec.kind = CodecKind::kInt4;
  } else if (base == "sparse" || base.rfind("sparse:", 0) == 0) {
    if (absl::Status s = ParseSparse(base, text, &codec); !s.ok()) return s;
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

uint64_t SparseKeptPerBlock(double fraction, uint64_t block_length) {
  if (block_length == 0) return 0;
  const double wanted = std::ceil(fraction * static_cast<double>(block_length));
  if (!(wanted >= 1.0)) return 1;  // NaN or a fraction too small to keep one
  return std::min<uint64_t>(block_length, static_cast<uint64_t>(std::min(wanted, 1e18)));
}

uint64_t SparsePayloadBytes(uint64_t blocks, uint64_t kept, int bits) {
  return kSparsePreambleBytes + 4 * blocks + CeilDiv(kept * kSparseIndexBits, 8) +
         CeilDiv(kept * static_cast<uint64_t>(bits), 8);
}

uint64_t CodecRawPayloadBytes(const CodecSpec& codec, uint64_t count) {
  switch (codec.kind) {
    case CodecKind::kNone:
      return count * 4;
    case CodecKind::kFp16:
    case CodecKind::kBf16:
      return count * 2;
    case CodecKind::kInt8:
      return CeilDiv(count, kCodecInt8BlockSize) * 4 + count;
    case CodecKind::kTopK:
      return 8 + 8 * count;  // the bound: every element kept
    case CodecKind::kInt4:
      return CeilDiv(count, kCodecInt4BlockSize) * 4 + CeilDiv(count, 2);
    case CodecKind::kSparse: {
      const uint64_t blocks = CeilDiv(count, kSparseBlockSize);
      const uint64_t last = blocks == 0 ? 0 : count - (blocks - 1) * kSparseBlockSize;
      const uint64_t kept = blocks == 0 ? 0
                                        : (blocks - 1) * SparseKeptPerBlock(codec.sparse_fraction, kSparseBlockSize) +
                                              SparseKeptPerBlock(codec.sparse_fraction, last);
      return SparsePayloadBytes(blocks, kept, codec.sparse_bits);
    }
  }
  return 0;
}

}  // namespace geotrain
