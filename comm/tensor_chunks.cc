// Chunk parsing and validation of a tensor stream's receiving side (see tensor_chunks.h).
#include "comm/tensor_chunks.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tensor.pb.h"

namespace geotrain::comm {
namespace {

constexpr size_t kMaxHeaderBytes = 64 * 1024;
// The payload is copied and its CRC taken a block of this size at a time, so the second pass reads from L1/L2.
constexpr size_t kCacheBlockBytes = 64 * 1024;

// Reads a message spread over several slices without copying it.
class SliceReader {
 public:
  SliceReader() = default;
  explicit SliceReader(absl::Span<const absl::Span<const uint8_t>> slices) : slices_(slices) {
    for (absl::Span<const uint8_t> s : slices) remaining_ += s.size();
  }
  uint64_t remaining() const { return remaining_; }

  bool ReadByte(uint8_t* b) {
    if (remaining_ == 0) return false;
    Normalize();
    *b = slices_[index_][offset_];
    Advance(1);
    return true;
  }
  bool ReadVarint(uint64_t* v) {
    uint64_t result = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      result |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) {
        *v = result;
        return true;
      }
    }
    return false;  // more than 10 bytes
  }
  // Copies n bytes out (n <= remaining()).
  bool Copy(uint8_t* dst, uint64_t n) {
    if (n > remaining_) return false;
    while (n > 0) {
      Normalize();
      const absl::Span<const uint8_t> s = slices_[index_];
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n, s.size() - offset_));
      std::memcpy(dst, s.data() + offset_, take);
      dst += take;
      n -= take;
      Advance(take);
    }
    return true;
  }
  bool Skip(uint64_t n) {
    if (n > remaining_) return false;
    while (n > 0) {
      Normalize();
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n, slices_[index_].size() - offset_));
      n -= take;
      Advance(take);
    }
    return true;
  }

 private:
  void Normalize() {
    while (offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }
  void Advance(size_t n) {
    offset_ += n;
    remaining_ -= n;
  }
  absl::Span<const absl::Span<const uint8_t>> slices_;
  size_t index_ = 0;
  size_t offset_ = 0;
  uint64_t remaining_ = 0;
};

// A parsed chunk: small fields decoded, the payload located (a reader positioned at it) but not copied.
struct ParsedChunk {
  bool has_header = false;
  TensorHeader header;
  uint64_t offset = 0;
  bool last = false;
  bool has_payload = false;
  uint64_t payload_bytes = 0;
  bool has_trailer = false;  // field 5: the codec header's two CRCs, on the last chunk of a streamed encode
  uint64_t trailer = 0;
  SliceReader payload_at;
};

absl::Status ParseChunk(absl::Span<const absl::Span<const uint8_t>> slices, ParsedChunk* chunk) {
  SliceReader reader(slices);
  bool seen[6] = {false, false, false, false, false, false};
  while (reader.remaining() > 0) {
    uint64_t tag;
    if (!reader.ReadVarint(&tag)) return absl::InvalidArgumentError("chunk: truncated field tag");
    const uint64_t field = tag >> 3;
    const int wire_type = static_cast<int>(tag & 7);
    if (field >= 1 && field <= 5) {
      if (seen[field]) return absl::InvalidArgumentError(absl::StrCat("chunk: field ", field, " repeated"));
      seen[field] = true;
    }
    if (field == 2 || field == 3) {
      uint64_t v;
      if (wire_type != 0 || !reader.ReadVarint(&v)) return absl::InvalidArgumentError("chunk: bad offset/last field");
      if (field == 2) chunk->offset = v;
      if (field == 3) {
        if (v > 1) return absl::InvalidArgumentError("chunk: bad 'last' value");
        chunk->last = v == 1;
      }
      continue;
    }
    if (field == 5) {
      uint8_t bytes[8];
      if (wire_type != 1 || !reader.Copy(bytes, 8)) return absl::InvalidArgumentError("chunk: bad trailer field");
      std::memcpy(&chunk->trailer, bytes, 8);
      chunk->has_trailer = true;
      continue;
    }
    if (field == 1 || field == 4) {
      uint64_t len;
      if (wire_type != 2 || !reader.ReadVarint(&len) || len > reader.remaining()) {
        return absl::InvalidArgumentError(absl::StrCat("chunk: field ", field, " length exceeds the message"));
      }
      if (field == 1) {
        if (len > kMaxHeaderBytes) return absl::InvalidArgumentError("chunk: tensor header too large");
        std::string bytes(len, '\0');
        reader.Copy(reinterpret_cast<uint8_t*>(bytes.data()), len);
        if (!chunk->header.ParseFromString(bytes)) return absl::InvalidArgumentError("chunk: unparsable header");
        chunk->has_header = true;
      } else {
        chunk->has_payload = true;
        chunk->payload_bytes = len;
        chunk->payload_at = reader;
        reader.Skip(len);
      }
      continue;
    }
    // Unknown field: skip it by wire type (forward compatibility).
    uint64_t skip = 0;
    switch (wire_type) {
      case 0:
        if (!reader.ReadVarint(&skip)) return absl::InvalidArgumentError("chunk: truncated varint");
        skip = 0;
        break;
      case 1:
        skip = 8;
        break;
      case 2:
        if (!reader.ReadVarint(&skip)) return absl::InvalidArgumentError("chunk: truncated length");
        break;
      case 5:
        skip = 4;
        break;
      default:
        return absl::InvalidArgumentError(absl::StrCat("chunk: unsupported wire type ", wire_type));
    }
    if (!reader.Skip(skip)) return absl::InvalidArgumentError("chunk: unknown field exceeds the message");
  }
  return absl::OkStatus();
}

}  // namespace

TensorKey KeyFromProto(const geotrain::TensorKey& k) {
  return TensorKey{k.job_id(), k.step(), k.microbatch(), k.tensor_id(), k.src()};
}

absl::StatusOr<uint64_t> ShapeElements(absl::Span<const int64_t> shape, int max_rank) {
  if (static_cast<int>(shape.size()) > max_rank) {
    return absl::InvalidArgumentError(absl::StrCat("shape has ", shape.size(), " dimensions, at most ", max_rank));
  }
  uint64_t product = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("shape has a negative dimension ", d));
    if (d != 0 && product > kMaxCodecElements / static_cast<uint64_t>(d)) {
      return absl::InvalidArgumentError("shape's element count is too large");
    }
    product *= static_cast<uint64_t>(d);
  }
  return product;
}

TensorChunkAssembler::TensorChunkAssembler(const TensorStreamOptions& options,
                                           std::function<absl::Status(uint64_t)> reserve)
    : options_(options), reserve_(std::move(reserve)) {}

ReceivedTensor TensorChunkAssembler::TakeComplete() {
  has_complete_ = false;
  return std::move(tensor_);
}

absl::Status TensorChunkAssembler::BeginTensor(const TensorHeader& h, uint64_t offset) {
  const TensorStreamOptions& o = options_;
  const geotrain::TensorKey& k = h.key();
  if (k.job_id().size() > o.max_name_bytes || k.tensor_id().size() > o.max_name_bytes ||
      k.src().size() > o.max_name_bytes) {
    return absl::InvalidArgumentError("tensor key names are too long");
  }
  if (k.tensor_id().empty()) return absl::InvalidArgumentError("tensor header has an empty tensor id");
  if (h.dtype() != TENSOR_DTYPE_F32) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported tensor dtype ", h.dtype()));
  }
  std::vector<int64_t> shape(h.shape().begin(), h.shape().end());
  absl::StatusOr<uint64_t> elements = ShapeElements(shape, o.max_rank);
  if (!elements.ok()) return elements.status();
  absl::StatusOr<Codec> codec = ParseCodec(h.codec());
  if (!codec.ok()) return codec.status();
  if (h.total_bytes() > o.max_tensor_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("tensor of ", h.total_bytes(), " bytes exceeds the receiver's ",
                                                     "limit of ", o.max_tensor_bytes, " (max_tensor_bytes)"));
  }
  if (absl::Status s = CheckEncodedSize(*codec, *elements, h.total_bytes()); !s.ok()) return s;
  if (h.chunk_bytes() == 0 || h.chunk_bytes() > o.max_chunk_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk size ", h.chunk_bytes(), " outside (0, ", o.max_chunk_bytes, "]"));
  }
  if (offset != 0) return absl::InvalidArgumentError("first chunk of a tensor has a non-zero offset");
  if (absl::Status s = reserve_(h.total_bytes()); !s.ok()) return s;
  tensor_ = ReceivedTensor{};
  tensor_.key = KeyFromProto(k);
  tensor_.shape = std::move(shape);
  tensor_.codec = h.codec();
  tensor_.encoded = Bytes(h.total_bytes());
  codec_ = *codec;
  elements_ = *elements;
  chunk_bytes_ = h.chunk_bytes();
  expected_crc_ = h.checksum();
  crc_ = 0;
  received_ = 0;
  in_progress_ = true;
  return absl::OkStatus();
}

absl::Status TensorChunkAssembler::AddChunk(absl::Span<const absl::Span<const uint8_t>> message) {
  has_complete_ = false;
  ParsedChunk chunk;
  if (absl::Status s = ParseChunk(message, &chunk); !s.ok()) return s;
  if (!in_progress_) {
    if (!chunk.has_header) return absl::InvalidArgumentError("first chunk of a tensor has no header");
    if (absl::Status s = BeginTensor(chunk.header, chunk.offset); !s.ok()) return s;
  } else if (chunk.has_header) {
    return absl::InvalidArgumentError("chunk carries a header in the middle of a tensor");
  }
  const uint64_t total = tensor_.encoded.size();
  const uint64_t expected_len = std::min<uint64_t>(chunk_bytes_, total - received_);
  if (chunk.offset != received_) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk offset ", chunk.offset, " is not contiguous (expected ", received_, ")"));
  }
  if (chunk.payload_bytes != expected_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk carries ", chunk.payload_bytes, " bytes, expected ", expected_len));
  }
  const bool last = received_ + expected_len == total;
  if (chunk.last != last) return absl::InvalidArgumentError("chunk 'last' flag disagrees with the sizes");
  if (chunk.has_trailer && !last) return absl::InvalidArgumentError("chunk carries a trailer before the last chunk");
  if (chunk.has_trailer && expected_crc_ != 0) {
    return absl::InvalidArgumentError("chunk carries a trailer but the stream header has a checksum");
  }
  // Copy a cache-sized block at a time and take the CRC of the bytes after the codec header on the data just
  // copied (still in cache).
  const uint64_t end = received_ + expected_len;
  while (received_ < end) {
    const uint64_t n = std::min<uint64_t>(end - received_, kCacheBlockBytes);
    uint8_t* dst = tensor_.encoded.data() + received_;
    chunk.payload_at.Copy(dst, n);
    const uint64_t crc_begin = std::max<uint64_t>(received_, kCodecHeaderBytes);
    if (received_ + n > crc_begin) crc_ = Crc32c(tensor_.encoded.data() + crc_begin, received_ + n - crc_begin, crc_);
    received_ += n;
  }
  if (!last) return absl::OkStatus();
  return FinishTensor(chunk.has_trailer ? &chunk.trailer : nullptr);
}

// `trailer`: the last 8 bytes of the codec header (payload CRC, header CRC) when the sender encoded while
// sending; the first chunk carried zeros in their place. Both CRCs are checked below before delivery.
absl::Status TensorChunkAssembler::FinishTensor(const uint64_t* trailer) {
  in_progress_ = false;
  if (trailer != nullptr) {
    std::memcpy(tensor_.encoded.data() + kCodecHeaderBytes - 8, trailer, 8);
    expected_crc_ = static_cast<uint32_t>(*trailer);
  }
  if (crc_ != expected_crc_) {
    return absl::DataLossError(absl::StrCat("tensor ", tensor_.key.ToString(), " checksum mismatch"));
  }
  absl::StatusOr<EncodedInfo> info = InspectEncoded(tensor_.encoded.span(), /*verify_checksum=*/false);
  if (!info.ok()) return info.status();
  if (info->element_count != elements_ || info->codec.kind != codec_.kind || info->codec.zstd != codec_.zstd ||
      info->payload_crc != expected_crc_) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", tensor_.key.ToString(), ": codec header disagrees with the stream header"));
  }
  has_complete_ = true;
  return absl::OkStatus();
}

}  // namespace geotrain::comm
