// The types both sides of a tensor stream share, with no gRPC: a tensor's key, the streams' options and limits, a
// tensor as received, and the sink an assembler delivers into (with a waiting receiver's buffer). tensor_stream_server.h
// and tensor_stream_client.h (the gRPC ends) and tensor_chunks.h (the chunk assembler) build on this header, and
// none of their headers includes another.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/codec.h"

namespace grpc {
class ChannelCredentials;
}  // namespace grpc

namespace geotrain::comm {

struct TensorKey {
  std::string job_id;
  int64_t step = 0;
  int32_t microbatch = 0;
  std::string tensor_id;
  std::string src;  // the sender's name; receivers wait on (..., src)

  bool operator==(const TensorKey& other) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const TensorKey& k) {
    return H::combine(std::move(h), k.job_id, k.step, k.microbatch, k.tensor_id, k.src);
  }
  std::string ToString() const;
};

struct TensorStreamOptions {
  size_t chunk_bytes = size_t{1} << 20;  // payload bytes per chunk when sending (1 KiB .. max_chunk_bytes)
  // Receiving limits.
  size_t max_chunk_bytes = (size_t{4} << 20) - (size_t{64} << 10);  // below gRPC's default 4 MiB message cap
  uint64_t max_tensor_bytes = uint64_t{4} << 30;
  // Memory budgets of the mailbox: tensors complete or being received, counted from their header until a
  // Recv takes them (or they are dropped). Over any of them a Send is refused with RESOURCE_EXHAUSTED naming the
  // budget; the receiver lives on. A peer is the sender named in the key (TensorKey::src).
  uint64_t max_mailbox_bytes = uint64_t{16} << 30;  // all jobs and peers together
  uint64_t max_job_bytes = uint64_t{8} << 30;       // per job id
  uint64_t max_peer_bytes = uint64_t{4} << 30;      // per sender
  // A tensor nobody took from the mailbox for this long is dropped (its job has no receiver here, or it gave up).
  absl::Duration orphan_timeout = absl::Minutes(10);
  // Open streams at once (all peers); one more is refused with RESOURCE_EXHAUSTED when it opens. Register() also
  // caps gRPC's concurrent streams per connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS) at this.
  int max_streams = 1024;
  size_t max_name_bytes = 512;  // job id, tensor id, sender
  int max_rank = 8;             // dimensions of a shape
  // HTTP/2 transport tuning, applied by Register() to the server builder and by the client to its channels
  // (0 leaves gRPC's default); see docs/results/2026-12-02-comm.md.
  // 0: gRPC's own flow control, whose BDP probing grows the window to the link's bandwidth-delay product
  // (a WAN needs it: a fixed window caps one stream at window / RTT). > 0: a fixed stream lookahead of this
  // many bytes with BDP probing off.
  int http2_window_bytes = 0;
  int http2_max_frame_bytes = 0;
  int tcp_read_chunk_bytes = 0;
  // The client's channel credentials: TLS when the workers' servers serve it (common/rpc.h MakeChannelCredentials);
  // null: plaintext.
  std::shared_ptr<grpc::ChannelCredentials> channel_credentials;
  // The client calls this after each acknowledged Send with the peer's address, the encoded bytes and the time from
  // the first chunk's write to the ack (encoding overlapped with the writes included): the link's goodput as this
  // sender sees it (worker/link_metrics.h). Runs on the sending thread, so it must be thread-safe and cheap. Null:
  // nothing is called.
  std::function<void(const std::string& peer_address, uint64_t bytes, absl::Duration took)> on_acknowledged;
};

// A tensor as received: validated, checksum verified, still encoded.
struct ReceivedTensor {
  TensorKey key;
  std::vector<int64_t> shape;
  std::string codec;  // as the sender named it
  Bytes encoded;      // codec bytes (comm/codec.h), complete

  int64_t num_elements() const;
  // Decodes into `out` (size must be num_elements()); the payload CRC was verified on arrival.
  absl::Status DecodeInto(absl::Span<float> out) const;
  absl::Status DecodeAddInto(absl::Span<float> accumulator) const;
  absl::StatusOr<std::vector<float>> Decode() const;
};

// A waiting receiver's buffer (RecvInto) that an assembler may decode a tensor into. `out` is set before the
// destination is shared and never changes; the flags are the sink's state, guarded by the sink's own lock (the
// assembler never reads them).
struct TensorDestination {
  absl::Span<float> out;
  bool claimed = false;    // an assembler is receiving the tensor into `out`
  bool writing = false;    // that assembler is writing into `out` now (outside the sink's lock)
  bool withdrawn = false;  // the receiver stopped waiting: nothing may be written into `out` any more
  bool done = false;       // the tensor is in `out` and passed every check
};

// Where an assembler's tensors go (TensorStreamServer, per stream). Called from the assembler's thread.
class TensorSink {
 public:
  virtual ~TensorSink() = default;
  // Mailbox path: Reserve(key, bytes) comes once per tensor after its header passed and before its buffer is
  // allocated; its error ends the stream. Release gives the reservation back (the tensor failed); Deliver takes
  // a complete, valid tensor over together with its reservation of tensor.encoded.size() bytes (also when it
  // refuses the tensor: it then releases the reservation itself).
  virtual absl::Status Reserve(const TensorKey& key, uint64_t bytes) = 0;
  virtual void Release(const TensorKey& key, uint64_t bytes) = 0;
  virtual absl::Status Deliver(ReceivedTensor tensor) = 0;
  // Decode-on-arrival path: the waiting receiver's buffer for `key` if it takes exactly `elements` floats and
  // nobody else holds it (null: use the mailbox). Each write into d->out is bracketed by BeginWrite (which fails
  // once the receiver gave up: the tensor is then refused) and EndWrite. The claim ends with CompleteClaim (the
  // tensor is complete and valid, `bytes` encoded bytes) or Unclaim (it failed; the receiver waits on).
  virtual std::shared_ptr<TensorDestination> Claim(const TensorKey& key, uint64_t elements) = 0;
  virtual absl::Status BeginWrite(TensorDestination* d, const TensorKey& key) = 0;
  virtual void EndWrite(TensorDestination* d) = 0;
  virtual absl::Status CompleteClaim(TensorDestination* d, const TensorKey& key, uint64_t bytes) = 0;
  virtual void Unclaim(TensorDestination* d) = 0;
};

}  // namespace geotrain::comm
