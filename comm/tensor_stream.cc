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

class TensorStreamServer::Reactor : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  Reactor(TensorStreamServer* owner, grpc::CallbackServerContext* context) : owner_(owner) {
    const auto& metadata = context->client_metadata();
    auto it = metadata.find(kTokenMetadataKey);
    const std::string_view presented =
        it == metadata.end() ? std::string_view() : std::string_view(it->second.data(), it->second.size());
    if (!owner_->Authorized(presented)) {
      owner_->CountRejected();
      Finish(grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          absl::StrCat("missing or wrong cluster token in '", kTokenMetadataKey,
                                       "'; use the token the head printed (GEOTRAIN_TOKEN)")));
      return;
    }
    StartRead(&request_);
  }

  ~Reactor() override { ReleaseReservation(); }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed or the call was cancelled
      if (in_progress_) {
        ReleaseReservation();
        owner_->CountRejected();
        Finish(grpc::Status(grpc::StatusCode::DATA_LOSS,
                            absl::StrCat("stream ended inside tensor ", tensor_.key.ToString())));
      } else {
        Finish(grpc::Status::OK);
      }
      return;
    }
    absl::Status s = HandleChunk();
    request_.Clear();
    if (!s.ok()) {
      ReleaseReservation();  // before the status reaches the sender
      owner_->CountRejected();
      Finish(ToGrpc(s));
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
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "ack could not be written"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  void ReleaseReservation() {
    if (reserved_ > 0) owner_->Release(reserved_);
    reserved_ = 0;
  }

  absl::Status BeginTensor(const ParsedChunk& chunk) {
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
    ASSIGN_OR_RETURN(uint64_t elements, ShapeElements(shape, o.max_rank));
    ASSIGN_OR_RETURN(Codec codec, ParseCodec(h.codec()));
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
    RETURN_IF_ERROR(owner_->Reserve(h.total_bytes()));
    reserved_ = h.total_bytes();
    tensor_ = ReceivedTensor{};
    tensor_.key = KeyFromProto(k);
    tensor_.shape = std::move(shape);
    tensor_.codec = h.codec();
    tensor_.encoded = Bytes(h.total_bytes());
    codec_ = codec;
    elements_ = elements;
    chunk_bytes_ = h.chunk_bytes();
    expected_crc_ = h.checksum();
    crc_ = 0;
    received_ = 0;
    in_progress_ = true;
    return absl::OkStatus();
  }

  absl::Status HandleChunk() {
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
  absl::Status FinishTensor(const uint64_t* trailer) {
    in_progress_ = false;
    if (trailer != nullptr) {
      std::memcpy(tensor_.encoded.data() + kCodecHeaderBytes - 8, trailer, 8);
      expected_crc_ = static_cast<uint32_t>(*trailer);
    }
    if (crc_ != expected_crc_) {
      return absl::DataLossError(absl::StrCat("tensor ", tensor_.key.ToString(), " checksum mismatch"));
    }
    ASSIGN_OR_RETURN(EncodedInfo info, InspectEncoded(tensor_.encoded.span(), /*verify_checksum=*/false));
    if (info.element_count != elements_ || info.codec.kind != codec_.kind || info.codec.zstd != codec_.zstd ||
        info.payload_crc != expected_crc_) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", tensor_.key.ToString(), ": codec header disagrees with the stream header"));
    }
    geotrain::TensorAck ack;
    KeyToProto(tensor_.key, ack.mutable_key());
    ack.set_bytes(tensor_.encoded.size());
    RETURN_IF_ERROR(owner_->Deliver(std::move(tensor_)));
    reserved_ = 0;  // the mailbox owns the reservation now
    const std::string serialized = ack.SerializeAsString();
    grpc::Slice slice(serialized);
    ack_ = grpc::ByteBuffer(&slice, 1);
    ack_ready_ = true;
    return absl::OkStatus();
  }

  TensorStreamServer* owner_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer ack_;
  bool ack_ready_ = false;
  // The tensor being received.
  bool in_progress_ = false;
  ReceivedTensor tensor_;
  Codec codec_;
  uint64_t elements_ = 0;
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

void TensorStreamServer::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
}

TensorStreamServer::Stats TensorStreamServer::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s = stats_;
  s.mailbox_tensors = mailbox_.size();
  s.mailbox_bytes = reserved_bytes_;
  return s;
}

// --- Client ----------------------------------------------------------------------------------------------

TensorStreamClient::TensorStreamClient(std::string token, TensorStreamOptions options)
    : token_(std::move(token)), options_(options) {
  RetainFreedMemory();
}

TensorStreamClient::~TensorStreamClient() = default;

std::shared_ptr<grpc::Channel> TensorStreamClient::ChannelFor(const std::string& address) {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(address);
  if (it != channels_.end()) return it->second;
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
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  channels_[address] = channel;
  return channel;
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
  std::shared_ptr<grpc::Channel> channel = ChannelFor(peer_address);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  context.AddMetadata(kTokenMetadataKey, token_);
  grpc::internal::RpcMethod method(kStreamMethod, grpc::internal::RpcMethod::BIDI_STREAMING, channel);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel.get(), method,
                                                                                            &context));
  TensorHeader header;
  KeyToProto(key, header.mutable_key());
  header.set_dtype(TENSOR_DTYPE_F32);
  for (int64_t d : shape) header.add_shape(d);
  header.set_codec(codec.ToString());
  header.set_total_bytes(encoded.size());
  header.set_checksum(checksum);  // 0 when encoding while sending: the CRCs come with the last chunk
  header.set_chunk_bytes(options_.chunk_bytes);
  const std::string header_bytes = header.SerializeAsString();

  const uint64_t total = encoded.size();
  bool writes_ok = true;
  for (uint64_t offset = 0; offset < total;) {
    const uint64_t len = std::min<uint64_t>(options_.chunk_bytes, total - offset);
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
    grpc::ByteBuffer message(slices, 2);
    // One write outstanding at a time: Write blocks while HTTP/2 flow control holds the stream.
    writes_ok = last ? stream->Write(message, grpc::WriteOptions().set_last_message()) : stream->Write(message);
    if (!writes_ok) break;
    offset += len;
    absl::MutexLock lock(&mu_);
    stats_.bytes_written += len;
  }
  bool acked = false;
  if (writes_ok) {
    grpc::ByteBuffer ack_buffer;
    if (stream->Read(&ack_buffer)) {
      std::vector<grpc::Slice> ack_slices;
      std::string ack_bytes;
      if (ack_buffer.Dump(&ack_slices).ok()) {
        for (const grpc::Slice& s : ack_slices) ack_bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
      geotrain::TensorAck ack;
      acked = ack.ParseFromString(ack_bytes) && KeyFromProto(ack.key()) == key && ack.bytes() == total;
    }
  }
  // After a failed write the call is already over; Finish reports why (the receiver's status or the deadline).
  const grpc::Status status = stream->Finish();
  if (!status.ok()) return FromGrpc(status, context_text);
  if (!acked) return absl::UnavailableError(absl::StrCat(context_text, ": the receiver closed without acknowledging"));
  absl::MutexLock lock(&mu_);
  ++stats_.tensors_sent;
  stats_.bytes_sent += total;
  return absl::OkStatus();
}

TensorStreamClient::Stats TensorStreamClient::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace geotrain::comm
