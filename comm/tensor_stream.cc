// Tensor streams over gRPC: the raw-ByteBuffer chunk writer and parser, the server reactor that validates and
// assembles tensors into the mailbox, and the blocking client (see tensor_stream.h for the contract).
//
// The TensorStream method is served and called with grpc::ByteBuffer messages instead of generated protobuf
// types: the writer lays out a TensorChunk by hand (small fields, then the payload as a slice that points into
// the encoded tensor) and the parser walks the received slices, copying the payload straight into the
// tensor's buffer. The bytes on the wire are ordinary protobuf, so the generated stub also works (tests use
// it to send malformed chunks).
#include "comm/tensor_stream.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/server_callback.h>
#include <grpcpp/support/sync_stream.h>
#include <malloc.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/rpc.h"  // FromGrpc, ToGrpc
#include "common/status.h"
#include "tensor.grpc.pb.h"
#include "tensor.pb.h"

namespace geotrain::comm {
namespace {

constexpr char kStreamMethod[] = "/geotrain.TensorStream/Stream";
constexpr size_t kMaxHeaderBytes = 64 * 1024;
// Encode + CRC and copy + CRC work in blocks of this size so the second pass reads from L1/L2.
constexpr size_t kCacheBlockBytes = 64 * 1024;

// --- Protobuf wire helpers ----------------------------------------------------------------------------

void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Reads a message spread over several slices without copying it.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>* slices) : slices_(slices) {
    if (slices != nullptr) {
      for (const grpc::Slice& s : *slices) remaining_ += s.size();
    }
  }
  uint64_t remaining() const { return remaining_; }

  bool ReadByte(uint8_t* b) {
    if (remaining_ == 0) return false;
    Normalize();
    *b = (*slices_)[index_].begin()[offset_];
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
      const grpc::Slice& s = (*slices_)[index_];
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n, s.size() - offset_));
      std::memcpy(dst, s.begin() + offset_, take);
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
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n, (*slices_)[index_].size() - offset_));
      n -= take;
      Advance(take);
    }
    return true;
  }

 private:
  void Normalize() {
    while (offset_ == (*slices_)[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }
  void Advance(size_t n) {
    offset_ += n;
    remaining_ -= n;
  }
  const std::vector<grpc::Slice>* slices_;
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
  SliceReader payload_at{nullptr};
};

absl::Status ParseChunk(const std::vector<grpc::Slice>* slices, ParsedChunk* chunk) {
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

// gRPC reads the socket into 64 KiB buffers that it frees on another thread once the message is consumed.
// With glibc's default trim threshold (128 KiB) every such free can hand the pages back to the kernel
// (madvise/brk shrink, with TLB shoot-downs), so the next read page-faults fresh zeroed pages: on loopback
// that cost ~10x the transfer itself (docs/benchmarks/comm.md). Keeping up to kRetainFreedBytes of freed heap
// makes the buffers warm again. Setting a threshold turns off glibc's dynamic mmap threshold (which would
// otherwise rise to 32 MiB as large blocks are freed), so the mmap threshold is set to that ceiling too, or
// every allocation above 128 KiB elsewhere in the process would be mmap'ed and faulted in afresh.
// Process-wide; skipped when GLIBC_TUNABLES already sets either threshold.
constexpr int kRetainFreedBytes = 256 << 20;
constexpr int kMmapThresholdBytes = 32 << 20;

void RetainFreedMemory() {
#if defined(__GLIBC__)
  static std::once_flag once;
  std::call_once(once, [] {
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    if (tunables != nullptr &&
        (std::strstr(tunables, "trim_threshold") != nullptr || std::strstr(tunables, "mmap_threshold") != nullptr)) {
      return;
    }
    mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes);
    mallopt(M_TRIM_THRESHOLD, kRetainFreedBytes);
  });
#endif
}

void DestroySharedBytes(void* user_data) { delete static_cast<std::shared_ptr<uint8_t[]>*>(user_data); }

}  // namespace

std::string TensorKey::ToString() const {
  return absl::StrCat("{job=", job_id, " step=", step, " mb=", microbatch, " tensor=", tensor_id, " src=", src, "}");
}

// --- ReceivedTensor --------------------------------------------------------------------------------------

int64_t ReceivedTensor::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status ReceivedTensor::DecodeInto(absl::Span<float> out) const {
  DecodeOptions options;
  options.verify_checksum = false;  // verified on arrival
  return DecodeTensor(encoded.span(), out, options);
}

absl::Status ReceivedTensor::DecodeAddInto(absl::Span<float> accumulator) const {
  DecodeOptions options;
  options.verify_checksum = false;
  return DecodeTensorAdd(encoded.span(), accumulator, options);
}

absl::StatusOr<std::vector<float>> ReceivedTensor::Decode() const {
  std::vector<float> out(static_cast<size_t>(num_elements()));
  RETURN_IF_ERROR(DecodeInto(absl::MakeSpan(out)));
  return out;
}

// --- Server ----------------------------------------------------------------------------------------------

// One TensorStream call: reads chunks, validates each tensor and assembles it (into a mailbox buffer, or decoded
// straight into a waiting RecvInto's buffer), acknowledges it, then reads the next tensor's chunks, until the
// client ends the call. Reactions run one at a time on gRPC's threads and hold mu_ throughout; Close() comes
// from TensorStreamServer::Shutdown on another thread.
class TensorStreamServer::Reactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Reactor(TensorStreamServer* owner, grpc::CallbackServerContext* context) : owner_(owner) {
    const auto& metadata = context->client_metadata();
    auto it = metadata.find(kTokenMetadataKey);
    const std::string_view presented =
        it == metadata.end() ? std::string_view() : std::string_view(it->second.data(), it->second.size());
    if (!owner_->Authorized(presented)) {
      owner_->CountRejected();
      Close(grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                         absl::StrCat("missing or wrong cluster token in '", kTokenMetadataKey,
                                      "'; use the token the head printed (GEOTRAIN_TOKEN)")));
      return;
    }
    StartRead(&request_);
    // Registered only now: until then nothing else knows of this reactor. Once registered, Shutdown may Close it.
    registered_ = owner_->AddReactor(this);
    if (!registered_) Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, "tensor stream endpoint is shutting down"));
  }

  ~Reactor() override { AbandonTensor(); }

  // Ends the call with `status` unless it has ended already (a pending read then fails).
  void Close(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    FinishOnce(status);
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (finished_) return;  // closed by Shutdown
    if (!ok) {              // the client ended the call or it was cancelled
      if (in_progress_) {
        AbandonTensor();
        owner_->CountRejected();
        FinishOnce(grpc::Status(grpc::StatusCode::DATA_LOSS,
                                absl::StrCat("stream ended inside tensor ", tensor_.key.ToString())));
      } else {
        FinishOnce(grpc::Status::OK);
      }
      return;
    }
    absl::Status s = HandleChunk();
    request_.Clear();
    if (!s.ok()) {
      AbandonTensor();  // before the status reaches the sender
      owner_->CountRejected();
      FinishOnce(ToGrpc(s));
      return;
    }
    if (ack_ready_) {
      ack_ready_ = false;
      StartWrite(&ack_);
    } else {
      StartRead(&request_);
    }
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (!ok) {
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "ack could not be written"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override {
    if (registered_) owner_->RemoveReactor(this);
    delete this;
  }

 private:
  void FinishOnce(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(status);
  }

  // Gives back what the tensor in progress holds: its mailbox reservation, or its claim on a RecvInto's buffer.
  void AbandonTensor() {
    if (reserved_ > 0) owner_->Release(reserved_);
    reserved_ = 0;
    if (destination_ != nullptr) owner_->Unclaim(destination_.get());
    destination_.reset();
  }

  absl::Status BeginTensor(const ParsedChunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const TensorStreamOptions& o = owner_->options_;
    const TensorHeader& h = chunk.header;
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
    ASSIGN_OR_RETURN(const uint64_t elements, ShapeElements(shape, o.max_rank));
    ASSIGN_OR_RETURN(const Codec codec, ParseCodec(h.codec()));
    if (h.total_bytes() > o.max_tensor_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("tensor of ", h.total_bytes(), " bytes exceeds the receiver's ",
                                                       "limit of ", o.max_tensor_bytes, " (max_tensor_bytes)"));
    }
    RETURN_IF_ERROR(CheckEncodedSize(codec, elements, h.total_bytes()));
    if (h.chunk_bytes() == 0 || h.chunk_bytes() > o.max_chunk_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk size ", h.chunk_bytes(), " outside (0, ", o.max_chunk_bytes, "]"));
    }
    if (chunk.offset != 0) return absl::InvalidArgumentError("first chunk of a tensor has a non-zero offset");
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
    // other codecs) into a mailbox buffer, reserved against max_mailbox_bytes before it is allocated.
    if (element_bytes_ > 0) destination_ = owner_->Claim(tensor_.key, elements_);
    if (destination_ == nullptr) {
      RETURN_IF_ERROR(owner_->Reserve(total_));
      reserved_ = total_;
      tensor_.encoded = Bytes(total_);
    }
    in_progress_ = true;
    return absl::OkStatus();
  }

  absl::Status HandleChunk() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<grpc::Slice> slices;
    if (!request_.Dump(&slices).ok()) return absl::InvalidArgumentError("chunk: unreadable message");
    ParsedChunk chunk;
    RETURN_IF_ERROR(ParseChunk(&slices, &chunk));
    if (!in_progress_) {
      if (!chunk.has_header) return absl::InvalidArgumentError("first chunk of a tensor has no header");
      RETURN_IF_ERROR(BeginTensor(chunk));
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
      RETURN_IF_ERROR(owner_->BeginWrite(destination_.get(), tensor_.key));
      const absl::Status decoded = DecodeChunk(&chunk.payload_at, expected_len);
      owner_->EndWrite(destination_.get());
      RETURN_IF_ERROR(decoded);
    } else {
      CopyChunk(&chunk.payload_at, expected_len);
    }
    if (!last) return absl::OkStatus();
    return FinishTensor(chunk.has_trailer ? &chunk.trailer : nullptr);
  }

  // Mailbox: copies a cache-sized block at a time into the tensor's buffer and takes the CRC of the bytes after
  // the codec header on the data just copied (still in cache).
  void CopyChunk(SliceReader* payload, uint64_t len) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const uint64_t end = received_ + len;
    while (received_ < end) {
      const uint64_t n = std::min<uint64_t>(end - received_, kCacheBlockBytes);
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
  absl::Status DecodeChunk(SliceReader* payload, uint64_t len) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const uint64_t end = received_ + len;
    if (received_ < kCodecHeaderBytes && received_ < end) {
      const uint64_t n = std::min<uint64_t>(end, kCodecHeaderBytes) - received_;
      payload->Copy(codec_header_ + received_, n);
      received_ += n;
    }
    const absl::Span<float> out = destination_->out;
    if (codec_.kind == CodecKind::kNone) {
      uint8_t* const base = reinterpret_cast<uint8_t*>(out.data()) - kCodecHeaderBytes;  // indexed from 40 on
      while (received_ < end) {
        const uint64_t n = std::min<uint64_t>(end - received_, kCacheBlockBytes);
        payload->Copy(base + received_, n);
        crc_ = Crc32c(base + received_, n, crc_);
        received_ += n;
      }
      return absl::OkStatus();
    }
    if (staging_.size() < kCodecHeaderBytes + kCacheBlockBytes + element_bytes_) {
      staging_.resize(kCodecHeaderBytes + kCacheBlockBytes + element_bytes_);
    }
    uint8_t* const block = staging_.data() + kCodecHeaderBytes;
    DecodeOptions options;
    options.verify_checksum = false;  // the CRC is taken here, over the whole payload
    while (received_ < end) {
      const uint64_t n = std::min<uint64_t>(end - received_, kCacheBlockBytes);
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
  absl::Status FinishTensor(const uint64_t* trailer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    in_progress_ = false;
    uint8_t* const codec_header = destination_ != nullptr ? codec_header_ : tensor_.encoded.data();
    if (trailer != nullptr) {
      std::memcpy(codec_header + kCodecHeaderBytes - 8, trailer, 8);
      expected_crc_ = static_cast<uint32_t>(*trailer);
    }
    if (crc_ != expected_crc_) {
      return absl::DataLossError(absl::StrCat("tensor ", tensor_.key.ToString(), " checksum mismatch"));
    }
    geotrain::TensorAck ack;
    KeyToProto(tensor_.key, ack.mutable_key());
    ack.set_bytes(total_);
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
      RETURN_IF_ERROR(owner_->CompleteClaim(destination_.get(), tensor_.key, total_));
      destination_.reset();
    } else {
      ASSIGN_OR_RETURN(const EncodedInfo info, InspectEncoded(tensor_.encoded.span(), /*verify_checksum=*/false));
      if (info.element_count != elements_ || info.codec.kind != codec_.kind || info.codec.zstd != codec_.zstd ||
          info.payload_crc != expected_crc_) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", tensor_.key.ToString(), ": codec header disagrees with the stream header"));
      }
      RETURN_IF_ERROR(owner_->Deliver(std::move(tensor_)));
      reserved_ = 0;  // the mailbox owns the reservation now
    }
    const std::string serialized = ack.SerializeAsString();
    grpc::Slice slice(serialized);
    ack_ = grpc::ByteBuffer(&slice, 1);
    ack_ready_ = true;
    return absl::OkStatus();
  }

  TensorStreamServer* const owner_;
  bool registered_ = false;  // in owner_'s reactor set (set in the constructor, read in OnDone)
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer ack_;
  bool ack_ready_ = false;
  // The tensor being received.
  bool in_progress_ = false;
  ReceivedTensor tensor_;  // key, shape and codec name; `encoded` holds the bytes on the mailbox path
  std::shared_ptr<Destination> destination_;      // or: the RecvInto buffer the chunks are decoded into
  uint8_t codec_header_[kCodecHeaderBytes] = {};  // the codec header as received (RecvInto path)
  std::vector<uint8_t> staging_;                  // fp16/bf16 blocks being decoded (RecvInto path)
  uint64_t carry_ = 0;                            // bytes of a partial element at the start of staging_'s block
  uint64_t decoded_ = 0;                          // elements written into destination_->out
  Codec codec_;
  size_t element_bytes_ = 0;  // of the element-wise codecs; 0 for the others
  uint64_t elements_ = 0;
  uint64_t total_ = 0;
  uint64_t chunk_bytes_ = 0;
  uint64_t received_ = 0;
  uint64_t reserved_ = 0;
  uint32_t expected_crc_ = 0;
  uint32_t crc_ = 0;
};

class TensorStreamServer::Service
    : public geotrain::TensorStream::WithRawCallbackMethod_Stream<geotrain::TensorStream::Service> {
 public:
  explicit Service(TensorStreamServer* owner) : owner_(owner) {}
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(grpc::CallbackServerContext* context) override {
    return new Reactor(owner_, context);
  }

 private:
  TensorStreamServer* owner_;
};

TensorStreamServer::TensorStreamServer(std::string token, TensorStreamOptions options)
    : token_(std::move(token)), options_(options), service_(std::make_unique<Service>(this)) {
  RetainFreedMemory();
}

TensorStreamServer::~TensorStreamServer() { Shutdown(); }

namespace {
template <typename Args>
void ApplyTransportOptions(const TensorStreamOptions& o, Args* args) {
  if (o.http2_window_bytes > 0) {
    args->SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, o.http2_window_bytes);
    // BDP probing would shrink the window back to its (tiny, on a fast link) estimate.
    args->SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  }
  if (o.http2_max_frame_bytes > 0) args->SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, o.http2_max_frame_bytes);
  if (o.tcp_read_chunk_bytes > 0) {
    args->SetInt(GRPC_ARG_TCP_READ_CHUNK_SIZE, o.tcp_read_chunk_bytes);
    args->SetInt(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, o.tcp_read_chunk_bytes);
  }
}
// ServerBuilder has AddChannelArgument rather than SetInt.
struct BuilderArgs {
  grpc::ServerBuilder* builder;
  void SetInt(const char* key, int value) { builder->AddChannelArgument(key, value); }
};
}  // namespace

void TensorStreamServer::Register(grpc::ServerBuilder* builder) {
  BuilderArgs args{builder};
  ApplyTransportOptions(options_, &args);
  builder->RegisterService(service_.get());
}

bool TensorStreamServer::Authorized(std::string_view presented) const { return TokenMatches(presented, token_); }

absl::Status TensorStreamServer::Reserve(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("tensor stream endpoint is shutting down");
  if (reserved_bytes_ + bytes > options_.max_mailbox_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("receiver mailbox full: ", reserved_bytes_, " bytes held, ", bytes,
                                                     " more would pass max_mailbox_bytes=", options_.max_mailbox_bytes,
                                                     "; the receiver is not calling Recv"));
  }
  reserved_bytes_ += bytes;
  return absl::OkStatus();
}

void TensorStreamServer::Release(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  reserved_bytes_ -= std::min(bytes, reserved_bytes_);
}

absl::Status TensorStreamServer::Deliver(ReceivedTensor tensor) {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("tensor stream endpoint is shutting down");
  if (cancelled_jobs_.contains(tensor.key.job_id)) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", tensor.key.job_id, " was stopped on the receiver; its tensors are no longer taken"));
  }
  const uint64_t bytes = tensor.encoded.size();
  auto [it, inserted] = mailbox_.try_emplace(tensor.key, std::move(tensor));
  if (!inserted) {
    return absl::AlreadyExistsError(
        absl::StrCat("tensor ", it->first.ToString(), " is already waiting in the receiver's mailbox"));
  }
  ++stats_.tensors_received;
  stats_.bytes_received += bytes;
  return absl::OkStatus();
}

void TensorStreamServer::CountRejected() {
  absl::MutexLock lock(&mu_);
  ++stats_.streams_rejected;
}

absl::StatusOr<ReceivedTensor> TensorStreamServer::Recv(const TensorKey& key, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto ready = [&]() { return shutdown_ || mailbox_.contains(key) || cancelled_jobs_.contains(key.job_id); };
  if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("no tensor ", key.ToString(), " arrived before the deadline"));
  }
  if (cancelled_jobs_.contains(key.job_id)) {
    return absl::CancelledError(absl::StrCat("receives of job ", key.job_id, " were cancelled (the job is stopping)"));
  }
  auto node = mailbox_.extract(key);
  if (node.empty()) return absl::CancelledError("tensor stream endpoint shut down");
  reserved_bytes_ -= std::min<uint64_t>(node.mapped().encoded.size(), reserved_bytes_);
  return std::move(node.mapped());
}

void TensorStreamServer::CancelJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  cancelled_jobs_.insert(job_id);
}

bool TensorStreamServer::JobCancelled(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  return cancelled_jobs_.contains(job_id);
}

size_t TensorStreamServer::DiscardJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  size_t dropped = 0;
  for (auto it = mailbox_.begin(); it != mailbox_.end();) {
    if (it->first.job_id == job_id) {
      reserved_bytes_ -= std::min<uint64_t>(it->second.encoded.size(), reserved_bytes_);
      mailbox_.erase(it++);
      ++dropped;
    } else {
      ++it;
    }
  }
  return dropped;
}

absl::Status TensorStreamServer::RecvInto(const TensorKey& key, absl::Span<float> out, absl::Time deadline) {
  auto destination = std::make_shared<Destination>();
  destination->out = out;
  Destination* const d = destination.get();
  ReceivedTensor tensor;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return absl::CancelledError("tensor stream endpoint shut down");
    if (!destinations_.try_emplace(key, destination).second) {
      return absl::FailedPreconditionError(
          absl::StrCat("another RecvInto is already waiting for tensor ", key.ToString()));
    }
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return shutdown_ || d->done || (!d->claimed && mailbox_.contains(key)) ||
             (!d->claimed && cancelled_jobs_.contains(key.job_id));
    };
    mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
    const bool in_mailbox = !d->done && !d->claimed && mailbox_.contains(key);
    if (!d->done && !in_mailbox) {
      // Giving up: a reactor writing into `out` finishes its block first, and writes nothing after.
      d->withdrawn = true;
      auto idle = [d]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !d->writing; };
      mu_.Await(absl::Condition(&idle));
      destinations_.erase(key);
      if (shutdown_) return absl::CancelledError("tensor stream endpoint shut down");
      if (cancelled_jobs_.contains(key.job_id)) {
        return absl::CancelledError(
            absl::StrCat("receives of job ", key.job_id, " were cancelled (the job is stopping)"));
      }
      return absl::DeadlineExceededError(absl::StrCat("no tensor ", key.ToString(), " arrived before the deadline"));
    }
    destinations_.erase(key);
    if (d->done) return absl::OkStatus();
    auto node = mailbox_.extract(key);
    reserved_bytes_ -= std::min<uint64_t>(node.mapped().encoded.size(), reserved_bytes_);
    tensor = std::move(node.mapped());
  }
  if (tensor.num_elements() != static_cast<int64_t>(out.size())) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", key.ToString(), " has ", tensor.num_elements(),
                                                   " elements, the receive buffer ", out.size()));
  }
  return tensor.DecodeInto(out);
}

std::shared_ptr<TensorStreamServer::Destination> TensorStreamServer::Claim(const TensorKey& key, uint64_t elements) {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return nullptr;
  auto it = destinations_.find(key);
  if (it == destinations_.end()) return nullptr;
  Destination* d = it->second.get();
  if (d->claimed || d->withdrawn || d->done || d->out.size() != elements || cancelled_jobs_.contains(key.job_id)) {
    return nullptr;
  }
  d->claimed = true;
  return it->second;
}

absl::Status TensorStreamServer::BeginWrite(Destination* destination, const TensorKey& key) {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("tensor stream endpoint is shutting down");
  if (destination->withdrawn) {
    return absl::DeadlineExceededError(
        absl::StrCat("the receiver stopped waiting for tensor ", key.ToString(), " (its deadline passed)"));
  }
  destination->writing = true;
  return absl::OkStatus();
}

void TensorStreamServer::EndWrite(Destination* destination) {
  absl::MutexLock lock(&mu_);
  destination->writing = false;
}

absl::Status TensorStreamServer::CompleteClaim(Destination* destination, const TensorKey& key,
                                               uint64_t delivered_bytes) {
  absl::MutexLock lock(&mu_);
  destination->claimed = false;
  if (shutdown_) return absl::UnavailableError("tensor stream endpoint is shutting down");
  if (destination->withdrawn) {
    return absl::DeadlineExceededError(
        absl::StrCat("the receiver stopped waiting for tensor ", key.ToString(), " (its deadline passed)"));
  }
  destination->done = true;
  ++stats_.tensors_received;
  ++stats_.tensors_decoded_on_arrival;
  stats_.bytes_received += delivered_bytes;
  return absl::OkStatus();
}

void TensorStreamServer::Unclaim(Destination* destination) {
  absl::MutexLock lock(&mu_);
  destination->claimed = false;
  destination->writing = false;
}

bool TensorStreamServer::AddReactor(Reactor* reactor) {
  absl::MutexLock lock(&reactors_mu_);
  {
    absl::MutexLock state_lock(&mu_);
    if (shutdown_) return false;
  }
  reactors_.insert(reactor);
  return true;
}

void TensorStreamServer::RemoveReactor(Reactor* reactor) {
  absl::MutexLock lock(&reactors_mu_);
  reactors_.erase(reactor);
}

void TensorStreamServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
  }
  // Clients keep streams open between tensors; end them, or the grpc::Server's Shutdown would wait for them.
  // A reactor stays registered (alive) until its OnDone, which waits for reactors_mu_.
  absl::MutexLock lock(&reactors_mu_);
  for (Reactor* reactor : reactors_) {
    reactor->Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, "tensor stream endpoint is shutting down"));
  }
}

TensorStreamServer::Stats TensorStreamServer::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s = stats_;
  s.mailbox_tensors = mailbox_.size();
  s.mailbox_bytes = reserved_bytes_;
  s.receivers_waiting = destinations_.size();
  return s;
}

// --- Client ----------------------------------------------------------------------------------------------

// One TensorStream call to a peer, kept open across Sends and used by one Send at a time. It has a completion queue
// of its own (gRPC's asynchronous API), so that a Send can encode the next chunk while the previous one is being
// written, have the last chunk's write and the ack's read outstanding together, and wait with its own deadline.
class TensorStreamClient::Stream {
 public:
  enum class Wait { kOk, kFailed, kTimedOut };

  explicit Stream(std::shared_ptr<grpc::Channel> channel) : channel_(std::move(channel)) {}
  ~Stream() { Close(); }

  // Starts the call. The metadata (the token) goes out with the first write, so this never blocks.
  void Open(const std::string& token) {
    context_.AddMetadata(kTokenMetadataKey, token);
    context_.set_initial_metadata_corked(true);
    grpc::internal::RpcMethod method(kStreamMethod, grpc::internal::RpcMethod::BIDI_STREAMING, channel_);
    // Allocated in the call's arena: freed with the call, not deleted here.
    call_ = grpc::internal::ClientAsyncReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
        channel_.get(), &queue_, method, &context_, /*start=*/true, /*tag=*/nullptr);
  }
  bool opened() const { return call_ != nullptr; }

  // At most one write and one read outstanding. gRPC references `message`'s slices until the write completes.
  void StartWrite(grpc::ByteBuffer message) {
    outgoing_ = std::move(message);
    write_pending_ = true;
    call_->Write(outgoing_, &write_pending_);
  }
  void StartRead(grpc::ByteBuffer* message) {
    read_pending_ = true;
    call_->Read(message, &read_pending_);
  }
  bool write_pending() const { return write_pending_; }
  bool write_ok() const { return write_ok_; }

  // Waits until the outstanding write (if `write`) and read (if `read`) have completed, or `deadline`. kFailed: one
  // of them failed, which means the call is over (Finish says why).
  Wait Await(bool write, bool read, absl::Time deadline) {
    while ((write && write_pending_) || (read && read_pending_)) {
      if (!Next(deadline)) return Wait::kTimedOut;
    }
    return (write && !write_ok_) || (read && !read_ok_) ? Wait::kFailed : Wait::kOk;
  }

  // Ends the call (cancelling it first if `cancel`) and returns its status.
  grpc::Status Finish(bool cancel) {
    if (cancel) context_.TryCancel();
    while (write_pending_ || read_pending_) Next(absl::InfiniteFuture());
    grpc::Status status;
    bool finish_pending = true;
    call_->Finish(&status, &finish_pending);
    while (finish_pending) Next(absl::InfiniteFuture());
    finished_ = true;
    return status;
  }

  bool used = false;  // has carried a tensor

 private:
  // Takes one completion off the queue; false at `deadline`. The tags are the operations' "pending" flags,
  // cleared here.
  bool Next(absl::Time deadline) {
    void* tag = nullptr;
    bool ok = false;
    const auto result = queue_.AsyncNext(&tag, &ok, absl::ToChronoTime(deadline));
    if (result != grpc::CompletionQueue::GOT_EVENT) return false;
    *static_cast<bool*>(tag) = false;
    if (tag == &write_pending_) {
      write_ok_ = ok;
      outgoing_.Clear();  // drops this message's references to the tensor's buffer
    }
    if (tag == &read_pending_) read_ok_ = ok;
    return true;
  }
  // Ends the call without waiting for the peer, then drains the queue.
  void Close() {
    if (call_ != nullptr && !finished_) Finish(/*cancel=*/true);
    queue_.Shutdown();
    void* tag;
    bool ok;
    while (queue_.Next(&tag, &ok)) {
    }
  }

  std::shared_ptr<grpc::Channel> channel_;
  grpc::CompletionQueue queue_;
  grpc::ClientContext context_;  // destroyed (releasing the call) before queue_
  grpc::ClientAsyncReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>* call_ = nullptr;
  grpc::ByteBuffer outgoing_;
  bool write_pending_ = false, read_pending_ = false;
  bool write_ok_ = false, read_ok_ = false;
  bool finished_ = false;
};

TensorStreamClient::TensorStreamClient(std::string token, TensorStreamOptions options)
    : token_(std::move(token)), options_(options) {
  RetainFreedMemory();
}

TensorStreamClient::~TensorStreamClient() {
  std::vector<std::unique_ptr<Stream>> idle;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [address, peer] : peers_) {
      for (auto& stream : peer.idle) idle.push_back(std::move(stream));
    }
  }
  idle.clear();  // each cancels its call
}

std::unique_ptr<TensorStreamClient::Stream> TensorStreamClient::TakeStream(const std::string& address) {
  absl::MutexLock lock(&mu_);
  Peer& peer = peers_[address];
  if (!peer.idle.empty()) {
    std::unique_ptr<Stream> stream = std::move(peer.idle.back());
    peer.idle.pop_back();
    return stream;
  }
  if (peer.channel == nullptr) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    // A separate connection per client object (not shared through gRPC's global subchannel pool), so that
    // benchmarks and tests with several endpoints in one process behave like separate processes.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    // After a link outage the connection comes back within a second of the link (gRPC's default backoff
    // grows to two minutes): senders retry until their deadline (comm/communicator.h).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    ApplyTransportOptions(options_, &args);
    peer.channel = grpc::CreateCustomChannel(
        address, options_.channel_credentials ? options_.channel_credentials : grpc::InsecureChannelCredentials(),
        args);
  }
  ++stats_.streams_opened;
  return std::make_unique<Stream>(peer.channel);
}

void TensorStreamClient::ReturnStream(const std::string& address, std::unique_ptr<Stream> stream) {
  absl::MutexLock lock(&mu_);
  std::vector<std::unique_ptr<Stream>>& idle = peers_[address].idle;
  if (idle.size() < kMaxIdleStreamsPerPeer) {
    idle.push_back(std::move(stream));
    return;
  }
  // Full: `stream` cancels its call as it goes out of scope.
}

// Encodes an element-wise codec a chunk at a time into the tensor's buffer, just before the chunk is written,
// so the encode of one chunk overlaps the receiver's work on the previous one (and the bytes are still in cache
// when gRPC copies them into the socket). The codec header's two CRCs are not known until the end: the buffer
// holds zeros in their place (never changed afterwards, since gRPC may still reference it) and Trailer()
// returns them for the last chunk.
class TensorStreamClient::ChunkEncoder {
 public:
  ChunkEncoder(const Codec& codec, absl::Span<const float> data, Bytes* buffer)
      : codec_(codec), data_(data), element_bytes_(EncodedElementBytes(codec)), buffer_(buffer) {
    WriteCodecHeader(codec, data.size(), 0, buffer->data());
    std::memset(buffer->data() + kCodecHeaderBytes - 8, 0, 8);
  }
  // Makes bytes [0, end) of the buffer ready.
  void EncodeThrough(uint64_t end) {
    if (end <= kCodecHeaderBytes) return;
    const uint64_t target =
        std::min<uint64_t>(data_.size(), (end - kCodecHeaderBytes + element_bytes_ - 1) / element_bytes_);
    // A cache-sized block at a time, so that the CRC reads what the encode has just written.
    while (done_ < target) {
      const uint64_t n = std::min<uint64_t>(target - done_, kCacheBlockBytes / element_bytes_);
      uint8_t* out = buffer_->data() + kCodecHeaderBytes + done_ * element_bytes_;
      EncodeElements(codec_, data_.subspan(done_, n), out);
      crc_ = Crc32c(out, n * element_bytes_, crc_);
      done_ += n;
    }
  }
  // Bytes 32..39 of the finished codec header: the payload CRC, then the header CRC (little endian).
  uint64_t Trailer() const {
    uint8_t header[kCodecHeaderBytes];
    WriteCodecHeader(codec_, data_.size(), crc_, header);
    uint64_t trailer;
    std::memcpy(&trailer, header + kCodecHeaderBytes - 8, 8);
    return trailer;
  }

 private:
  const Codec codec_;
  const absl::Span<const float> data_;
  const size_t element_bytes_;
  Bytes* buffer_;
  uint64_t done_ = 0;  // elements encoded
  uint32_t crc_ = 0;
};

absl::Status TensorStreamClient::Send(const std::string& peer_address, const TensorKey& key,
                                      absl::Span<const int64_t> shape, absl::Span<const float> data, const Codec& codec,
                                      absl::Time deadline, std::vector<float>* residual) {
  const size_t element_bytes = EncodedElementBytes(codec);
  if (element_bytes == 0) {  // int8, top-k, zstd: the whole tensor is encoded before the first chunk
    Bytes encoded;
    RETURN_IF_ERROR(EncodeTensor(codec, data, &encoded, residual));
    return SendEncoded(peer_address, key, shape, codec, encoded, deadline);
  }
  ASSIGN_OR_RETURN(uint64_t elements, ShapeElements(shape, options_.max_rank));
  if (elements != data.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sending tensor ", key.ToString(), ": shape has ", elements, " elements, the data ", data.size()));
  }
  Bytes buffer(kCodecHeaderBytes + data.size() * element_bytes);
  ChunkEncoder encoder(codec, data, &buffer);
  return SendChunks(peer_address, key, shape, codec, buffer, /*checksum=*/0, &encoder, deadline);
}

absl::Status TensorStreamClient::SendEncoded(const std::string& peer_address, const TensorKey& key,
                                             absl::Span<const int64_t> shape, const Codec& codec, const Bytes& encoded,
                                             absl::Time deadline) {
  ASSIGN_OR_RETURN(EncodedInfo info, InspectEncoded(encoded.span(), /*verify_checksum=*/false));
  ASSIGN_OR_RETURN(uint64_t elements, ShapeElements(shape, options_.max_rank));
  if (elements != info.element_count || info.codec.kind != codec.kind || info.codec.zstd != codec.zstd) {
    return absl::InvalidArgumentError(absl::StrCat("sending tensor ", key.ToString(), " to ", peer_address,
                                                   ": encoded tensor does not match shape or codec"));
  }
  return SendChunks(peer_address, key, shape, codec, encoded, info.payload_crc, /*encoder=*/nullptr, deadline);
}

absl::Status TensorStreamClient::SendChunks(const std::string& peer_address, const TensorKey& key,
                                            absl::Span<const int64_t> shape, const Codec& codec, const Bytes& encoded,
                                            uint32_t checksum, ChunkEncoder* encoder, absl::Time deadline) {
  const std::string context_text = absl::StrCat("sending tensor ", key.ToString(), " to ", peer_address);
  if (options_.chunk_bytes < 1024 || options_.chunk_bytes > options_.max_chunk_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes ", options_.chunk_bytes, " outside [1024, ", options_.max_chunk_bytes, "]"));
  }
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError(absl::StrCat(context_text, ": the deadline passed before the send began"));
  }
  // Chunks of equal size, at most options_.chunk_bytes (so a 1 MiB tensor and its 40-byte codec header go as two
  // halves rather than 1 MiB and 40 bytes).
  const uint64_t total = encoded.size();
  const uint64_t pieces = std::max<uint64_t>(1, (total + options_.chunk_bytes - 1) / options_.chunk_bytes);
  const uint64_t chunk_bytes = (total + pieces - 1) / pieces;
  TensorHeader header;
  KeyToProto(key, header.mutable_key());
  header.set_dtype(TENSOR_DTYPE_F32);
  for (int64_t d : shape) header.add_shape(d);
  header.set_codec(codec.ToString());
  header.set_total_bytes(total);
  header.set_checksum(checksum);  // 0 when encoding while sending: the CRCs come with the last chunk
  header.set_chunk_bytes(chunk_bytes);
  const std::string header_bytes = header.SerializeAsString();

  for (int attempt = 1;; ++attempt) {
    std::unique_ptr<Stream> stream = TakeStream(peer_address);
    const bool reused = stream->used;
    if (!stream->opened()) stream->Open(token_);
    const Outcome outcome = WriteTensor(stream.get(), key, header_bytes, chunk_bytes, encoded, encoder, deadline);
    if (outcome == Outcome::kAcknowledged) {
      {
        absl::MutexLock lock(&mu_);
        ++stats_.tensors_sent;
        stats_.bytes_sent += total;
      }
      stream->used = true;
      ReturnStream(peer_address, std::move(stream));
      return absl::OkStatus();
    }
    if (outcome == Outcome::kTimedOut) {
      (void)stream->Finish(/*cancel=*/true);
      return absl::DeadlineExceededError(absl::StrCat(context_text, ": no acknowledgement before the deadline"));
    }
    if (outcome == Outcome::kBadAck) {
      (void)stream->Finish(/*cancel=*/true);
      return absl::InternalError(absl::StrCat(context_text, ": the receiver acknowledged another tensor"));
    }
    // The call is over (a write or the read failed); its status says why.
    const grpc::Status status = stream->Finish(/*cancel=*/false);
    // A pooled stream the receiver had closed (it restarted, or shut down a stream idle since the last Send):
    // nothing of this tensor was delivered (its first chunk could not be written, or the call ended cleanly
    // without an ack), so send it again on a new stream. The other idle streams to this peer are likely closed too.
    if (reused && (outcome == Outcome::kNotStarted || status.ok()) && attempt < 3) {
      absl::MutexLock lock(&mu_);
      peers_[peer_address].idle.clear();
      continue;
    }
    if (!status.ok()) return FromGrpc(status, context_text);
    return absl::UnavailableError(absl::StrCat(context_text, ": the receiver closed without acknowledging"));
  }
}

TensorStreamClient::Outcome TensorStreamClient::WriteTensor(Stream* stream, const TensorKey& key,
                                                            const std::string& header_bytes, uint64_t chunk_bytes,
                                                            const Bytes& encoded, ChunkEncoder* encoder,
                                                            absl::Time deadline) {
  const uint64_t total = encoded.size();
  uint64_t in_flight = 0;         // payload bytes of the write outstanding
  uint64_t in_flight_offset = 0;  // and their offset (a failed first chunk: nothing of the tensor was sent)
  grpc::ByteBuffer ack_buffer;
  // The write of chunk k is outstanding while chunk k + 1 is encoded: one write outstanding at a time (flow
  // control holds it when the receiver does not read), and one chunk encoded ahead.
  auto finish_write = [&]() -> std::optional<Outcome> {
    switch (stream->Await(/*write=*/true, /*read=*/false, deadline)) {
      case Stream::Wait::kTimedOut:
        return Outcome::kTimedOut;
      case Stream::Wait::kFailed:
        return in_flight_offset == 0 ? Outcome::kNotStarted : Outcome::kFailed;
      case Stream::Wait::kOk:
        break;
    }
    absl::MutexLock lock(&mu_);
    stats_.bytes_written += in_flight;
    return std::nullopt;
  };
  for (uint64_t offset = 0; offset < total;) {
    const uint64_t len = std::min<uint64_t>(chunk_bytes, total - offset);
    const bool last = offset + len == total;
    if (encoder != nullptr) encoder->EncodeThrough(offset + len);
    std::string prefix;
    prefix.reserve(header_bytes.size() + 48);
    if (offset == 0) {
      prefix.push_back(0x0A);  // field 1, length-delimited
      PutVarint(&prefix, header_bytes.size());
      prefix.append(header_bytes);
    }
    prefix.push_back(0x10);  // field 2, varint
    PutVarint(&prefix, offset);
    if (last) {
      prefix.push_back(0x18);  // field 3, varint
      prefix.push_back(1);
      if (encoder != nullptr) {
        prefix.push_back(0x29);  // field 5, fixed64
        const uint64_t trailer = encoder->Trailer();
        prefix.append(reinterpret_cast<const char*>(&trailer), 8);
      }
    }
    prefix.push_back(0x22);  // field 4, length-delimited
    PutVarint(&prefix, len);
    grpc::Slice slices[2] = {grpc::Slice(prefix),
                             grpc::Slice(const_cast<uint8_t*>(encoded.data()) + offset, len, &DestroySharedBytes,
                                         new std::shared_ptr<uint8_t[]>(encoded.shared()))};
    if (stream->write_pending()) {
      if (std::optional<Outcome> failed = finish_write(); failed.has_value()) return *failed;
    }
    stream->StartWrite(grpc::ByteBuffer(slices, 2));
    in_flight = len;
    in_flight_offset = offset;
    if (last) stream->StartRead(&ack_buffer);  // the ack may come before the last write completes
    offset += len;
  }
  switch (stream->Await(/*write=*/true, /*read=*/true, deadline)) {
    case Stream::Wait::kTimedOut:
      return Outcome::kTimedOut;
    case Stream::Wait::kFailed:
      return in_flight_offset == 0 && !stream->write_ok() ? Outcome::kNotStarted : Outcome::kFailed;
    case Stream::Wait::kOk:
      break;
  }
  {
    absl::MutexLock lock(&mu_);
    stats_.bytes_written += in_flight;
  }
  std::vector<grpc::Slice> ack_slices;
  std::string ack_bytes;
  if (ack_buffer.Dump(&ack_slices).ok()) {
    for (const grpc::Slice& s : ack_slices) ack_bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  geotrain::TensorAck ack;
  if (!ack.ParseFromString(ack_bytes) || KeyFromProto(ack.key()) != key || ack.bytes() != total) {
    return Outcome::kBadAck;
  }
  return Outcome::kAcknowledged;
}

TensorStreamClient::Stats TensorStreamClient::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace geotrain::comm
