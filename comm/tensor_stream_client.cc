// The sending end of tensor streams over gRPC: OutgoingTensor, the streams kept open per peer (gRPC's asynchronous
// API, one completion queue per stream), the raw chunk writer and the element-wise encoder that runs while chunks
// are written (see tensor_stream_client.h for the contract).
//
// The TensorStream method is called with grpc::ByteBuffer messages instead of generated protobuf types: the writer
// lays out a TensorChunk by hand (small fields, then the payload as a slice that points into the encoded tensor),
// so the payload is never copied. The bytes on the wire are ordinary protobuf.
#include "comm/tensor_stream_client.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/sync_stream.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/tensor_chunks.h"
#include "comm/tensor_stream_transport.h"
#include "common/rpc.h"  // FromGrpc, SetReconnectBackoff
#include "common/status.h"
#include "common/token.h"
#include "tensor.grpc.pb.h"
#include "tensor.pb.h"

namespace geotrain::comm {
namespace {

constexpr char kStreamMethod[] = "/geotrain.TensorStream/Stream";

// Protobuf's base-128 varint, for the hand-laid TensorChunk fields.
void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Releases a chunk slice's reference to the encoded tensor once gRPC is done with it.
void DestroySharedBytes(void* user_data) { delete static_cast<std::shared_ptr<uint8_t[]>*>(user_data); }

}  // namespace

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
    args.SetMaxReceiveMessageSize(64 << 10);  // acks only
    args.SetMaxSendMessageSize(-1);
    // A separate connection per client object (not shared through gRPC's global subchannel pool), so that
    // benchmarks and tests with several endpoints in one process behave like separate processes.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    // After a link outage the connection comes back within a second of the link: senders retry until their
    // deadline (comm/communicator.h).
    SetReconnectBackoff(&args, /*initial_backoff_ms=*/200, /*max_backoff_ms=*/1000);
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
      const uint64_t n = std::min<uint64_t>(target - done_, kStreamCacheBlockBytes / element_bytes_);
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

absl::StatusOr<OutgoingTensor> OutgoingTensor::Prepare(const Codec& codec, absl::Span<const float> data,
                                                       std::vector<float>* residual) {
  const size_t element_bytes = EncodedElementBytes(codec);
  Bytes encoded;
  if (element_bytes == 0) {  // int8, top-k, zstd: the whole tensor is encoded before the first chunk
    RETURN_IF_ERROR(EncodeTensor(codec, data, &encoded, residual));
  }
  return OutgoingTensor(codec, data, element_bytes, std::move(encoded));
}

absl::StatusOr<Bytes> OutgoingTensor::Encoded() const {
  if (!encoded_while_sent()) return encoded_;
  Bytes encoded;
  RETURN_IF_ERROR(EncodeTensor(codec_, data_, &encoded));
  return encoded;
}

absl::Status TensorStreamClient::Send(const std::string& peer_address, const TensorKey& key,
                                      absl::Span<const int64_t> shape, absl::Span<const float> data, const Codec& codec,
                                      absl::Time deadline, std::vector<float>* residual) {
  ASSIGN_OR_RETURN(OutgoingTensor tensor, OutgoingTensor::Prepare(codec, data, residual));
  return Send(peer_address, key, shape, tensor, deadline);
}

absl::Status TensorStreamClient::Send(const std::string& peer_address, const TensorKey& key,
                                      absl::Span<const int64_t> shape, const OutgoingTensor& tensor,
                                      absl::Time deadline) {
  if (!tensor.encoded_while_sent()) {
    return SendEncoded(peer_address, key, shape, tensor.codec(), tensor.encoded_, deadline);
  }
  const absl::Span<const float> data = tensor.data_;
  ASSIGN_OR_RETURN(uint64_t elements, ShapeElements(shape, options_.max_rank));
  if (elements != data.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sending tensor ", key.ToString(), ": shape has ", elements, " elements, the data ", data.size()));
  }
  Bytes buffer(kCodecHeaderBytes + data.size() * tensor.element_bytes_);
  ChunkEncoder encoder(tensor.codec(), data, &buffer);
  return SendChunks(peer_address, key, shape, tensor.codec(), buffer, /*checksum=*/0, &encoder, deadline);
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
    const absl::Time started = absl::Now();
    const Outcome outcome = WriteTensor(stream.get(), key, header_bytes, chunk_bytes, encoded, encoder, deadline);
    if (outcome == Outcome::kAcknowledged) {
      {
        absl::MutexLock lock(&mu_);
        ++stats_.tensors_sent;
        stats_.bytes_sent += total;
      }
      if (options_.on_acknowledged) options_.on_acknowledged(peer_address, total, absl::Now() - started);
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
