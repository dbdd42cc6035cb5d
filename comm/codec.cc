// Tensor codecs: the wire header and its validation, encoding and decoding (see codec.h). Codec names are
// parsed in common/codec_spec.cc, the element loops are in codec_kernels.cc, the checksum in crc32c.cc and the
// buffers in buffer_pool.cc.
#include "comm/codec.h"

#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "comm/codec_kernels.h"
#include "comm/codec_lowbit.h"
#include "common/status.h"

static_assert(std::endian::native == std::endian::little, "geotrain's wire formats assume little endian");

namespace geotrain::comm {
namespace {

using internal::Get;
using internal::Kernels;
using internal::Put;
const Kernels* K() { return internal::CodecKernels(); }

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

// Raw payload bytes of `count` elements for the kinds whose size the kind and count fix (not top-k and sparse,
// whose sizes depend on how much they keep).
uint64_t FixedRawBytes(CodecKind kind, uint64_t count) {
  if (kind == CodecKind::kTopK || kind == CodecKind::kSparse) return 0;
  return CodecRawPayloadBytes(CodecSpec{.kind = kind}, count);
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
  if (h.kind > static_cast<uint8_t>(CodecKind::kSparse)) {
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
  } else if (kind == CodecKind::kSparse) {
    // The exact size follows from the kept counts in the payload (CheckSparse); here its bounds.
    const uint64_t blocks = (h.count + kSparseBlockSize - 1) / kSparseBlockSize;
    if (h.raw_bytes < kSparsePreambleBytes + 4 * blocks || h.raw_bytes > SparsePayloadBytes(blocks, h.count, 8)) {
      return absl::DataLossError(
          absl::StrCat("sparse payload of ", h.raw_bytes, " bytes does not fit ", h.count, " elements"));
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
  // ReadHeader checked raw_bytes >= 8 and (raw_bytes - 8) % 8 == 0; compared by division, as k * 8 may wrap.
  if (k != (h.raw_bytes - 8) / 8) {
    return absl::DataLossError(absl::StrCat("top-k count ", k, " does not match its payload of ", h.raw_bytes,
                                            " bytes (8 + 8 per kept element)"));
  }
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
    case CodecKind::kInt4:
      internal::DecodeInt4Range(raw, count, begin, n, out);
      break;
    case CodecKind::kTopK:
    case CodecKind::kSparse:
      break;
  }
}

absl::Status DecodeImpl(absl::Span<const uint8_t> encoded, absl::Span<float> output, const DecodeOptions& options,
                        bool accumulate) {
  ASSIGN_OR_RETURN(auto header, ReadHeader(encoded));
  const Header& h = header;
  if (h.count != output.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("encoded tensor has ", h.count, " elements, the destination ", output.size()));
  }
  if (options.verify_checksum && Crc32c(encoded.data() + kCodecHeaderBytes, h.payload_bytes) != h.payload_crc) {
    return absl::DataLossError("encoded tensor payload checksum mismatch (corrupted in transit)");
  }
  ASSIGN_OR_RETURN(auto raw_or, RawPayload(h, encoded));
  const uint8_t* raw = raw_or;
  const CodecKind kind = static_cast<CodecKind>(h.kind);
  if (kind == CodecKind::kTopK) {
    uint64_t k = 0;
    RETURN_IF_ERROR(CheckTopK(raw, h, &k));
    if (!accumulate) std::fill(output.begin(), output.end(), 0.0f);
    const uint8_t* indices = raw + 8;
    const uint8_t* values = raw + 8 + 4 * k;
    for (uint64_t j = 0; j < k; ++j) {
      output[Get<uint32_t>(indices + 4 * j)] += Get<float>(values + 4 * j);
    }
    return absl::OkStatus();
  }
  if (kind == CodecKind::kSparse) {
    RETURN_IF_ERROR(internal::CheckSparse(raw, h.raw_bytes, h.count));
    internal::DecodeSparse(raw, h.count, output.data(), accumulate);
    return absl::OkStatus();
  }
  if (kind == CodecKind::kInt8) {
    RETURN_IF_ERROR(CheckInt8Scales(raw, h.count));
  }
  if (kind == CodecKind::kInt4) {
    RETURN_IF_ERROR(internal::CheckInt4(raw, h.count));
  }
  if (!accumulate) {
    DecodeRange(kind, raw, h.count, 0, output.size(), output.data());
    return absl::OkStatus();
  }
  // Decode a cache-sized block at a time into scratch, then add (a multiple of the int8 and int4 block sizes).
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
  // Checked before the residual takes the input, so that a refused tensor leaves it as it was (int4 and sparse alike).
  if (!internal::AccumulatedFinite(input, residual)) {
    return absl::InvalidArgumentError(
        "top-k codec input (plus its residual) holds NaN or infinity; the residual is unchanged");
  }
  float* acc = residual->data();
  for (size_t i = 0; i < n; ++i) acc[i] += input[i];
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
    RETURN_IF_ERROR(EncodeTopK(codec, input, residual, &topk_raw));
    raw_bytes = topk_raw.size();
    if (!codec.zstd) {
      result = Bytes(kCodecHeaderBytes + raw_bytes);
      raw = result.data() + kCodecHeaderBytes;
      std::memcpy(raw, topk_raw.data(), raw_bytes);
    } else {
      raw = topk_raw.data();
    }
  } else {
    raw_bytes = CodecRawPayloadBytes(codec, count);
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
      case CodecKind::kInt4:
        RETURN_IF_ERROR(internal::EncodeInt4(input, residual, raw));
        break;
      case CodecKind::kSparse:
        RETURN_IF_ERROR(internal::EncodeSparse(codec, input, residual, raw));
        break;
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
    case CodecKind::kInt4:
    case CodecKind::kSparse:
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
    case CodecKind::kInt4:
    case CodecKind::kSparse:
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
  // Exact for every kind but top-k, whose bound keeps every element (common/codec_spec.h).
  const uint64_t raw_max = CodecRawPayloadBytes(codec, element_count);
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
  ASSIGN_OR_RETURN(auto header, ReadHeader(encoded));
  if (verify_checksum && Crc32c(encoded.data() + kCodecHeaderBytes, header.payload_bytes) != header.payload_crc) {
    return absl::DataLossError("encoded tensor payload checksum mismatch (corrupted in transit)");
  }
  EncodedInfo info;
  info.codec.kind = static_cast<CodecKind>(header.kind);
  info.codec.zstd = (header.flags & kFlagZstd) != 0;
  info.element_count = header.count;
  info.payload_bytes = header.payload_bytes;
  info.raw_payload_bytes = header.raw_bytes;
  info.payload_crc = header.payload_crc;
  return info;
}

absl::Status DecodeTensor(absl::Span<const uint8_t> encoded, absl::Span<float> output, const DecodeOptions& options) {
  return DecodeImpl(encoded, output, options, /*accumulate=*/false);
}

absl::Status DecodeTensorAdd(absl::Span<const uint8_t> encoded, absl::Span<float> accumulator,
                             const DecodeOptions& options) {
  return DecodeImpl(encoded, accumulator, options, /*accumulate=*/true);
}

absl::Status CodecRoundTrip::Apply(const std::string& stream, absl::Span<float> data) {
  if (codec_.lossless()) return absl::OkStatus();
  std::vector<float>* residual = codec_.error_feedback() ? &residuals_[stream] : nullptr;
  RETURN_IF_ERROR(EncodeTensor(codec_, data, &encoded_, residual));
  return DecodeTensor(encoded_.span(), data);
}

}  // namespace geotrain::comm
