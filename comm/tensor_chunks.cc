// Chunk parsing, validation and assembly of a tensor stream's receiving side (see tensor_chunks.h).
#include "comm/tensor_chunks.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "tensor.pb.h"

namespace geotrain::comm {
namespace {

constexpr size_t kMaxHeaderBytes = 64 * 1024;

// Reads a message spread over several slices without copying it.
}  // namespace

class ChunkReader {
 public:
  ChunkReader() = default;
  explicit ChunkReader(absl::Span<const absl::Span<const uint8_t>> slices) : slices_(slices) {
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

namespace {

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
  ChunkReader payload_at;
};

absl::Status ParseChunk(absl::Span<const absl::Span<const uint8_t>> slices, ParsedChunk* chunk) {
  ChunkReader reader(slices);
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

void KeyToProto(const TensorKey& k, geotrain::TensorKey* out) {
  out->set_job_id(k.job_id);
  out->set_step(k.step);
  out->set_microbatch(k.microbatch);
  out->set_tensor_id(k.tensor_id);
  out->set_src(k.src);
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

TensorChunkAssembler::TensorChunkAssembler(const TensorStreamOptions& options, TensorSink* sink)
    : options_(options), sink_(sink) {}

TensorChunkAssembler::~TensorChunkAssembler() { Abandon(); }

void TensorChunkAssembler::Abandon() {
  if (reserved_ > 0) sink_->Release(tensor_.key, reserved_);
  reserved_ = 0;
  if (destination_ != nullptr) sink_->Unclaim(destination_.get());
  destination_.reset();
  in_progress_ = false;
}

absl::Status TensorChunkAssembler::BeginTensor(const TensorHeader& h, uint64_t offset) {
  const TensorStreamOptions& o = options_;
  const geotrain::TensorKey& k = h.key();
  if (k.job_id().size() > o.max_name_bytes || k.tensor_id().size() > o.max_name_bytes ||
      k.src().size() > o.max_name_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor key names are too long (max_name_bytes=", o.max_name_bytes, ")"));
  }
  if (k.tensor_id().empty()) return absl::InvalidArgumentError("tensor header has an empty tensor id");
  if (h.dtype() != TENSOR_DTYPE_F32) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported tensor dtype ", h.dtype()));
  }
  std::vector<int64_t> shape(h.shape().begin(), h.shape().end());
  ASSIGN_OR_RETURN(const uint64_t elements, ShapeElements(shape, o.max_rank));
  ASSIGN_OR_RETURN(const Codec codec, ParseCodec(h.codec()));
  if (h.total_bytes() > o.max_tensor_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("tensor of ", h.total_bytes(), " bytes exceeds the receiver's ",
                                                     "limit of ", o.max_tensor_bytes, " (max_tensor_bytes)"));
  }
  RETURN_IF_ERROR(CheckEncodedSize(codec, elements, h.total_bytes()));
  if (h.chunk_bytes() == 0 || h.chunk_bytes() > o.max_chunk_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk size ", h.chunk_bytes(), " outside (0, ", o.max_chunk_bytes, "] (max_chunk_bytes)"));
  }
  if (offset != 0) return absl::InvalidArgumentError("first chunk of a tensor has a non-zero offset");
  tensor_ = ReceivedTensor{};
  tensor_.key = KeyFromProto(k);
  tensor_.shape = std::move(shape);
  tensor_.codec = h.codec();
  codec_ = codec;
  element_bytes_ = codec.zstd ? 0 : EncodedElementBytes(codec);
  elements_ = elements;
  total_ = h.total_bytes();
  chunk_bytes_ = h.chunk_bytes();
  expected_crc_ = h.checksum();
  crc_ = 0;
  received_ = 0;
  decoded_ = 0;
  carry_ = 0;
  // Element-wise codecs go straight into a waiting RecvInto's buffer if there is one; otherwise (and for the
  // other codecs) into a mailbox buffer, reserved before it is allocated.
  if (element_bytes_ > 0) destination_ = sink_->Claim(tensor_.key, elements_);
  if (destination_ == nullptr) {
    RETURN_IF_ERROR(sink_->Reserve(tensor_.key, total_));
    reserved_ = total_;
    tensor_.encoded = Bytes(total_);
  }
  in_progress_ = true;
  return absl::OkStatus();
}

absl::StatusOr<bool> TensorChunkAssembler::AddChunk(absl::Span<const absl::Span<const uint8_t>> message) {
  ParsedChunk chunk;
  RETURN_IF_ERROR(ParseChunk(message, &chunk));
  if (!in_progress_) {
    if (!chunk.has_header) return absl::InvalidArgumentError("first chunk of a tensor has no header");
    RETURN_IF_ERROR(BeginTensor(chunk.header, chunk.offset));
  } else if (chunk.has_header) {
    return absl::InvalidArgumentError("chunk carries a header in the middle of a tensor");
  }
  const uint64_t expected_len = std::min<uint64_t>(chunk_bytes_, total_ - received_);
  if (chunk.offset != received_) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk offset ", chunk.offset, " is not contiguous (expected ", received_, ")"));
  }
  if (chunk.payload_bytes != expected_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk carries ", chunk.payload_bytes, " bytes, expected ", expected_len));
  }
  const bool last = received_ + expected_len == total_;
  if (chunk.last != last) return absl::InvalidArgumentError("chunk 'last' flag disagrees with the sizes");
  if (chunk.has_trailer && !last) return absl::InvalidArgumentError("chunk carries a trailer before the last chunk");
  if (chunk.has_trailer && expected_crc_ != 0) {
    return absl::InvalidArgumentError("chunk carries a trailer but the stream header has a checksum");
  }
  if (destination_ != nullptr) {
    RETURN_IF_ERROR(sink_->BeginWrite(destination_.get(), tensor_.key));
    const absl::Status decoded = DecodeChunk(&chunk.payload_at, expected_len);
    sink_->EndWrite(destination_.get());
    RETURN_IF_ERROR(decoded);
  } else {
    CopyChunk(&chunk.payload_at, expected_len);
  }
  if (!last) return false;
  RETURN_IF_ERROR(FinishTensor(chunk.has_trailer ? &chunk.trailer : nullptr));
  return true;
}

// Mailbox: copies a cache-sized block at a time into the tensor's buffer and takes the CRC of the bytes after
// the codec header on the data just copied (still in cache).
void TensorChunkAssembler::CopyChunk(ChunkReader* payload, uint64_t len) {
  const uint64_t end = received_ + len;
  while (received_ < end) {
    const uint64_t n = std::min<uint64_t>(end - received_, kStreamCacheBlockBytes);
    uint8_t* dst = tensor_.encoded.data() + received_;
    payload->Copy(dst, n);
    const uint64_t crc_begin = std::max<uint64_t>(received_, kCodecHeaderBytes);
    if (received_ + n > crc_begin) crc_ = Crc32c(tensor_.encoded.data() + crc_begin, received_ + n - crc_begin, crc_);
    received_ += n;
  }
}

// RecvInto's buffer: keeps the codec header (checked at the end) and decodes the payload into place, a
// cache-sized block at a time, with the CRC on the same block. "none" is fp32 little endian on the wire, so
// its bytes are copied straight into place; fp16 and bf16 blocks are staged behind a codec header of their own
// and decoded by the codec (a partial element at a block's end waits for the next block).
absl::Status TensorChunkAssembler::DecodeChunk(ChunkReader* payload, uint64_t len) {
  const uint64_t end = received_ + len;
  if (received_ < kCodecHeaderBytes && received_ < end) {
    const uint64_t n = std::min<uint64_t>(end, kCodecHeaderBytes) - received_;
    payload->Copy(codec_header_ + received_, n);
    received_ += n;
  }
  const absl::Span<float> out = destination_->out;
  if (codec_.kind == CodecKind::kNone) {
    // Payload byte `received_` lands at output byte `received_ - kCodecHeaderBytes` (the header is done here).
    uint8_t* const out_bytes = reinterpret_cast<uint8_t*>(out.data());
    while (received_ < end) {
      const uint64_t n = std::min<uint64_t>(end - received_, kStreamCacheBlockBytes);
      uint8_t* const dst = out_bytes + (received_ - kCodecHeaderBytes);
      payload->Copy(dst, n);
      crc_ = Crc32c(dst, n, crc_);
      received_ += n;
    }
    return absl::OkStatus();
  }
  if (staging_.size() < kCodecHeaderBytes + kStreamCacheBlockBytes + element_bytes_) {
    staging_.resize(kCodecHeaderBytes + kStreamCacheBlockBytes + element_bytes_);
  }
  uint8_t* const block = staging_.data() + kCodecHeaderBytes;
  DecodeOptions options;
  options.verify_checksum = false;  // the CRC is taken here, over the whole payload
  while (received_ < end) {
    const uint64_t n = std::min<uint64_t>(end - received_, kStreamCacheBlockBytes);
    payload->Copy(block + carry_, n);
    crc_ = Crc32c(block + carry_, n, crc_);
    received_ += n;
    const uint64_t bytes = carry_ + n;
    const uint64_t whole = bytes / element_bytes_;
    if (decoded_ + whole > out.size()) return absl::InternalError("tensor stream: decoded past the buffer");
    WriteCodecHeader(codec_, whole, 0, staging_.data());
    RETURN_IF_ERROR(DecodeTensor(absl::MakeConstSpan(staging_.data(), kCodecHeaderBytes + whole * element_bytes_),
                                 out.subspan(decoded_, whole), options));
    decoded_ += whole;
    carry_ = bytes - whole * element_bytes_;
    std::memmove(block, block + whole * element_bytes_, carry_);
  }
  return absl::OkStatus();
}

// `trailer`: the last 8 bytes of the codec header (payload CRC, header CRC) when the sender encoded while
// sending; the first chunk carried zeros in their place. Both CRCs are checked below before delivery.
absl::Status TensorChunkAssembler::FinishTensor(const uint64_t* trailer) {
  uint8_t* const codec_header = destination_ != nullptr ? codec_header_ : tensor_.encoded.data();
  if (trailer != nullptr) {
    std::memcpy(codec_header + kCodecHeaderBytes - 8, trailer, 8);
    expected_crc_ = static_cast<uint32_t>(*trailer);
  }
  if (crc_ != expected_crc_) {
    return absl::DataLossError(absl::StrCat("tensor ", tensor_.key.ToString(), " checksum mismatch"));
  }
  if (destination_ != nullptr) {
    // The header of a whole-tensor encode with this payload, byte for byte: magic, version, kind, flags,
    // element count, sizes, payload CRC and header CRC all as expected.
    uint8_t expected[kCodecHeaderBytes];
    WriteCodecHeader(codec_, elements_, crc_, expected);
    if (codec_.kind != CodecKind::kNone && (carry_ != 0 || decoded_ != elements_)) {
      return absl::InternalError("tensor stream: payload not fully decoded");
    }
    if (std::memcmp(codec_header, expected, kCodecHeaderBytes) != 0) {
      uint32_t stored_header_crc;
      std::memcpy(&stored_header_crc, codec_header + kCodecHeaderBytes - 4, 4);
      if (Crc32c(codec_header, kCodecHeaderBytes - 4) != stored_header_crc) {
        return absl::DataLossError(absl::StrCat("tensor ", tensor_.key.ToString(), ": codec header corrupted"));
      }
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", tensor_.key.ToString(), ": codec header disagrees with the stream header"));
    }
    RETURN_IF_ERROR(sink_->CompleteClaim(destination_.get(), tensor_.key, total_));
    destination_.reset();
    delivered_key_ = tensor_.key;
  } else {
    ASSIGN_OR_RETURN(const EncodedInfo info, InspectEncoded(tensor_.encoded.span(), /*verify_checksum=*/false));
    if (info.element_count != elements_ || info.codec.kind != codec_.kind || info.codec.zstd != codec_.zstd ||
        info.payload_crc != expected_crc_) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", tensor_.key.ToString(), ": codec header disagrees with the stream header"));
    }
    delivered_key_ = tensor_.key;
    reserved_ = 0;  // Deliver takes the reservation over, whether or not it accepts the tensor
    RETURN_IF_ERROR(sink_->Deliver(std::move(tensor_)));
  }
  delivered_bytes_ = total_;
  in_progress_ = false;
  return absl::OkStatus();
}

}  // namespace geotrain::comm
