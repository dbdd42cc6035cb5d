// Tensor streams: peer-to-peer transfer of encoded tensors over gRPC (service geotrain.TensorStream in
// proto/tensor.proto), with a receiving mailbox keyed by (job, step, microbatch, tensor id, sender).
//
//   // Receiving side (a worker hosts it next to its own services):
//   TensorStreamServer streams(token);
//   grpc::ServerBuilder builder;  builder.AddListeningPort(...);  streams.Register(&builder);
//   std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
//   absl::StatusOr<ReceivedTensor> t = streams.Recv(key, absl::Now() + absl::Seconds(30));
//   std::vector<float> values = t->Decode().value();
//
//   // Sending side:
//   TensorStreamClient client(token);
//   absl::Status s = client.Send("10.0.0.2:7000", key, shape, values, codec, absl::Now() + absl::Seconds(30));
//
// Protocol: Send opens one bidirectional stream, writes the tensor in chunks (options.chunk_bytes of payload
// each, the first carrying the TensorHeader) and waits for the receiver's ack, which comes once the tensor is
// complete, validated and in the mailbox. Send returns OK only after that ack. For the element-wise codecs (none,
// fp16, bf16 without zstd) Send encodes each chunk just before writing it; the codec header's two CRCs are then
// zeros in the first chunk and come in the last chunk's trailer (TensorChunk field 5, fixed64), the stream
// header's checksum being 0. The receiver accepts both forms (docs/comm.md).
// Back-pressure: the sender has one write outstanding at a time and gRPC's HTTP/2 flow control holds it
// when the receiver does not read; the receiver reads one chunk at a time and holds at most
// options.max_mailbox_bytes of complete or partly received tensors (beyond that a Send is refused with
// RESOURCE_EXHAUSTED rather than buffered).
// Validation: every header field and size is checked before anything is allocated: token, key field sizes,
// dtype, shape (rank, non-negative dims, product without overflow), codec name, total size against the codec's
// size for that element count and options.max_tensor_bytes, chunk size, contiguous offsets, the last flag,
// the trailer (only on the last chunk, only with a zero header checksum), the payload CRC-32C, and the codec
// header (its CRC, element count = shape product, codec kind and flags match).
// A malformed stream is finished with INVALID_ARGUMENT (DATA_LOSS for checksum mismatches) and nothing of it
// reaches the mailbox.
// Copies: sender: one encode pass (fp32 -> codec bytes, a memcpy for "none"), chunk by chunk where the codec
// allows; the chunks reference the encoded buffer through grpc::Slice without copying. Receiver: one copy from gRPC's slices into the tensor's
// buffer (the CRC is computed on the same pass over cache-hot data), and one decode pass in Recv's caller.
// Memory: the first TensorStreamServer or TensorStreamClient raises glibc's malloc trim threshold for the
// process (mallopt M_TRIM_THRESHOLD = 256 MiB, and M_MMAP_THRESHOLD = 32 MiB, glibc's own dynamic ceiling,
// unless GLIBC_TUNABLES sets either) so that gRPC's receive buffers stay resident between reads instead of
// being returned to the kernel and page-faulted back in on every read, which cut loopback throughput ~10x
// (docs/benchmarks/comm.md). Freed heap up to that size is kept by the process rather than returned.
// Threading: all methods are thread-safe. Server callbacks run on gRPC's threads and never block; Recv blocks
// the caller until the tensor arrives or the deadline passes (DEADLINE_EXCEEDED).
// Ownership: TensorStreamServer must outlive the grpc::Server it was registered on (shut the server down
// first). TensorStreamClient keeps one channel per peer address for its lifetime.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/codec.h"
#include "common/token.h"

namespace grpc {
class ServerBuilder;
class Channel;
}  // namespace grpc

namespace geotrain::comm {

// The cluster token's key and check are common/token.h's (kTokenMetadataKey, TokenMatches): one rule for
// every service.
using ::geotrain::kTokenMetadataKey;
using ::geotrain::TokenMatches;

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
  uint64_t max_mailbox_bytes = uint64_t{16} << 30;
  size_t max_name_bytes = 512;  // job id, tensor id, sender
  int max_rank = 8;             // dimensions of a shape
  // HTTP/2 transport tuning, applied by Register() to the server builder and by the client to its channels
  // (0 leaves gRPC's default); see docs/benchmarks/comm.md.
  // 0: gRPC's own flow control, whose BDP probing grows the window to the link's bandwidth-delay product
  // (a WAN needs it: a fixed window caps one stream at window / RTT). > 0: a fixed stream lookahead of this
  // many bytes with BDP probing off.
  int http2_window_bytes = 0;
  int http2_max_frame_bytes = 0;
  int tcp_read_chunk_bytes = 0;
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

class TensorStreamServer {
 public:
  explicit TensorStreamServer(std::string token, TensorStreamOptions options = {});
  ~TensorStreamServer();
  TensorStreamServer(const TensorStreamServer&) = delete;
  TensorStreamServer& operator=(const TensorStreamServer&) = delete;

  // Adds the TensorStream service to `builder` (which the caller owns, builds and starts).
  void Register(grpc::ServerBuilder* builder);

  // Waits until the tensor with exactly this key has arrived, then removes it from the mailbox and returns
  // it. DEADLINE_EXCEEDED at `deadline`; CANCELLED after Shutdown().
  absl::StatusOr<ReceivedTensor> Recv(const TensorKey& key, absl::Time deadline);

  // Drops every tensor of `job_id` waiting in the mailbox (when a job ends, fails or is cancelled, or after a
  // collective failed part-way); returns how many were dropped.
  size_t DiscardJob(const std::string& job_id);

  // Stops the receives of `job_id` (a key's job id exactly, e.g. one run of a job): every Recv waiting for
  // one of its tensors returns CANCELLED at once, later ones too, and its tensors are refused
  // (FAILED_PRECONDITION to the sender). For a job that is stopping: its actors learn it without waiting for
  // their receive deadlines. The mailbox shares it between every actor of the job on this endpoint.
  void CancelJob(const std::string& job_id);
  // Whether CancelJob(job_id) was called.
  bool JobCancelled(const std::string& job_id) const;

  // Wakes every Recv with CANCELLED and refuses new tensors (UNAVAILABLE). Call before shutting the
  // grpc::Server down when other threads may be waiting.
  void Shutdown();

  struct Stats {
    uint64_t tensors_received = 0;
    uint64_t bytes_received = 0;  // encoded bytes of complete tensors
    uint64_t streams_rejected = 0;
    uint64_t mailbox_tensors = 0;
    uint64_t mailbox_bytes = 0;  // complete plus reserved for tensors being received
  };
  Stats stats() const;

  const TensorStreamOptions& options() const { return options_; }

 private:
  class Service;
  class Reactor;
  friend class Reactor;

  // Called by reactors.
  bool Authorized(std::string_view presented) const;
  absl::Status Reserve(uint64_t bytes);
  void Release(uint64_t bytes);
  // Takes over the reservation of `tensor.encoded.size()` bytes.
  absl::Status Deliver(ReceivedTensor tensor);
  void CountRejected();

  const std::string token_;
  const TensorStreamOptions options_;
  std::unique_ptr<Service> service_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<TensorKey, ReceivedTensor> mailbox_ ABSL_GUARDED_BY(mu_);
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<std::string> cancelled_jobs_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

class TensorStreamClient {
 public:
  explicit TensorStreamClient(std::string token, TensorStreamOptions options = {});
  ~TensorStreamClient();
  TensorStreamClient(const TensorStreamClient&) = delete;
  TensorStreamClient& operator=(const TensorStreamClient&) = delete;

  // Encodes `data` with `codec` and sends it (see SendEncoded). `residual` is the top-k error feedback.
  absl::Status Send(const std::string& peer_address, const TensorKey& key, absl::Span<const int64_t> shape,
                    absl::Span<const float> data, const Codec& codec, absl::Time deadline,
                    std::vector<float>* residual = nullptr);

  // Sends an already encoded tensor (e.g. forwarding one received in a ring without re-encoding). Returns
  // once the receiver has acknowledged it; the receiver's status otherwise (UNAUTHENTICATED,
  // INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ALREADY_EXISTS for a key already waiting), or DEADLINE_EXCEEDED.
  // `encoded` is shared (not copied) with gRPC until the call ends.
  // `codec` must be the codec `encoded` was made with (its name goes into the header).
  absl::Status SendEncoded(const std::string& peer_address, const TensorKey& key, absl::Span<const int64_t> shape,
                           const Codec& codec, const Bytes& encoded, absl::Time deadline);

  struct Stats {
    uint64_t tensors_sent = 0;
    uint64_t bytes_sent = 0;     // encoded bytes acknowledged
    uint64_t bytes_written = 0;  // chunk payload bytes gRPC has accepted (acknowledged or not)
  };
  Stats stats() const;

 private:
  class ChunkEncoder;
  std::shared_ptr<grpc::Channel> ChannelFor(const std::string& address);
  // Writes `encoded` in chunks and waits for the ack. With `encoder`, each chunk is encoded into `encoded` just
  // before it is written and the codec header's CRCs go with the last chunk (`checksum` is then 0).
  absl::Status SendChunks(const std::string& peer_address, const TensorKey& key, absl::Span<const int64_t> shape,
                          const Codec& codec, const Bytes& encoded, uint32_t checksum, ChunkEncoder* encoder,
                          absl::Time deadline);

  const std::string token_;
  const TensorStreamOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain::comm
