// The sending end of tensor streams (tensor_stream.h has the protocol): TensorStreamClient keeps streams to each
// peer open and sends tensors on them chunk by chunk, returning once the receiver acknowledged the tensor;
// OutgoingTensor is the one place that decides how a codec goes on the wire (encoded while sent, or whole first).
//
//   TensorStreamClient client(token);
//   RETURN_IF_ERROR(client.Send("10.0.0.2:7000", key, shape, values, codec, absl::Now() + absl::Seconds(30)));
//   // Sent again after a failure, encoded once (top-k's error feedback sees the tensor once):
//   ASSIGN_OR_RETURN(OutgoingTensor tensor, OutgoingTensor::Prepare(codec, values, &residual));
//   absl::Status s = client.Send(address, key, shape, tensor, deadline);
//
// Threading: all methods are thread-safe. Send blocks its caller (every wait bounded by its deadline: a late Send
// cancels its stream's call).
// Ownership: TensorStreamClient keeps one channel per peer address and up to kMaxIdleStreamsPerPeer idle streams
// per peer for its lifetime; it must outlive every Send it runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/codec.h"
#include "comm/tensor_types.h"

namespace grpc {
class Channel;
}  // namespace grpc

namespace geotrain::comm {

// Idle streams a TensorStreamClient keeps open per peer for later Sends (more concurrent Sends open more
// streams, closed after use).
inline constexpr size_t kMaxIdleStreamsPerPeer = 8;

// A tensor ready to be sent with a codec, as many times as needed (a communicator sends again after a link
// failure). It decides how the codec goes on the wire: an element-wise codec (EncodedElementBytes > 0: none,
// fp16, bf16 without zstd) is encoded chunk by chunk while each Send writes it, the same bytes every time, so the
// object holds only a view of the data; the others (int8, top-k, zstd) are encoded whole, once, by Prepare (top-k
// with its error feedback, which must see the tensor once).
// `data` must outlive the object and stay unchanged until its last Send or Encoded. Copies share the encoded
// bytes; the const methods may be called from several threads at once.
class OutgoingTensor {
 public:
  // Encodes now unless the codec is element-wise. Errors are EncodeTensor's (`residual` as there: top-k's error
  // feedback, required for top-k, updated here).
  static absl::StatusOr<OutgoingTensor> Prepare(const Codec& codec, absl::Span<const float> data,
                                                std::vector<float>* residual = nullptr);

  const Codec& codec() const { return codec_; }
  // The element count.
  size_t size() const { return data_.size(); }
  // Whether Send encodes it chunk by chunk as it writes (an element-wise codec), rather than sending Prepare's bytes.
  bool encoded_while_sent() const { return element_bytes_ > 0; }
  // The whole encoded tensor as its receiver gets it (what it decodes): Prepare's bytes, or, for an element-wise
  // codec, encoded now (EncodeTensor's bytes, the same a Send streams).
  absl::StatusOr<Bytes> Encoded() const;

 private:
  friend class TensorStreamClient;
  OutgoingTensor(const Codec& codec, absl::Span<const float> data, size_t element_bytes, Bytes encoded)
      : codec_(codec), data_(data), element_bytes_(element_bytes), encoded_(std::move(encoded)) {}

  Codec codec_;
  absl::Span<const float> data_;
  size_t element_bytes_ = 0;  // EncodedElementBytes(codec_): > 0 for the element-wise codecs
  Bytes encoded_;             // the whole-tensor codecs' bytes (empty for the element-wise ones)
};

class TensorStreamClient {
 public:
  explicit TensorStreamClient(std::string token, TensorStreamOptions options = {});
  ~TensorStreamClient();
  TensorStreamClient(const TensorStreamClient&) = delete;
  TensorStreamClient& operator=(const TensorStreamClient&) = delete;

  // Encodes `data` with `codec` and sends it: OutgoingTensor::Prepare, then Send of that. `residual` is the top-k
  // error feedback.
  absl::Status Send(const std::string& peer_address, const TensorKey& key, absl::Span<const int64_t> shape,
                    absl::Span<const float> data, const Codec& codec, absl::Time deadline,
                    std::vector<float>* residual = nullptr);

  // Sends a prepared tensor: chunk by chunk as it encodes for an element-wise codec (INVALID_ARGUMENT when `shape`
  // does not hold its element count), else its encoded bytes through SendEncoded. Statuses as SendEncoded's. May be
  // called again with the same `tensor` (a retry) and puts the same bytes on the wire.
  absl::Status Send(const std::string& peer_address, const TensorKey& key, absl::Span<const int64_t> shape,
                    const OutgoingTensor& tensor, absl::Time deadline);

  // Sends an already encoded tensor (e.g. forwarding one received in a ring without re-encoding). Returns
  // once the receiver has acknowledged it; the receiver's status otherwise (UNAUTHENTICATED,
  // INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ALREADY_EXISTS for a key already waiting), or DEADLINE_EXCEEDED.
  // `encoded` is shared (not copied) with gRPC until the call ends.
  // `codec` must be the codec `encoded` was made with (its name goes into the header).
  absl::Status SendEncoded(const std::string& peer_address, const TensorKey& key, absl::Span<const int64_t> shape,
                           const Codec& codec, const Bytes& encoded, absl::Time deadline);

  struct Stats {
    uint64_t tensors_sent = 0;
    uint64_t bytes_sent = 0;      // encoded bytes acknowledged
    uint64_t bytes_written = 0;   // chunk payload bytes gRPC has accepted (acknowledged or not)
    uint64_t streams_opened = 0;  // streams opened (a Send reuses an idle one when it can)
  };
  Stats stats() const;

 private:
  class ChunkEncoder;
  class Stream;
  struct Peer {
    std::shared_ptr<grpc::Channel> channel;
    std::vector<std::unique_ptr<Stream>> idle;
  };
  // How a tensor's trip over one stream ended. kNotStarted: its first chunk could not be written.
  enum class Outcome { kAcknowledged, kNotStarted, kFailed, kTimedOut, kBadAck };

  // An idle stream to `address`, or a new one (not yet opened: Stream::Open).
  std::unique_ptr<Stream> TakeStream(const std::string& address);
  // After a tensor went through `stream`: back to the pool, or closed when the pool is full.
  void ReturnStream(const std::string& address, std::unique_ptr<Stream> stream);
  // Writes `encoded` in chunks on `stream` and reads the ack, until `deadline`. With `encoder`, each chunk is
  // encoded into `encoded` while the previous one is being written, and the codec header's CRCs go with the last
  // chunk.
  Outcome WriteTensor(Stream* stream, const TensorKey& key, const std::string& header_bytes, uint64_t chunk_bytes,
                      const Bytes& encoded, ChunkEncoder* encoder, absl::Time deadline);
  // Sends over a pooled or new stream, once more on a new stream if a pooled one turns out to be closed.
  absl::Status SendChunks(const std::string& peer_address, const TensorKey& key, absl::Span<const int64_t> shape,
                          const Codec& codec, const Bytes& encoded, uint32_t checksum, ChunkEncoder* encoder,
                          absl::Time deadline);
  const std::string token_;
  const TensorStreamOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Peer> peers_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain::comm
