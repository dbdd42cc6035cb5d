// Collectives behind one interface: all-reduce (sum), reduce-scatter, all-gather, broadcast and
// point-to-point send/recv among `size()` ranks, plus a bucketed gradient all-reduce that overlaps with
// backward. GrpcCommunicator implements them over tensor streams (comm/tensor_stream.h): a ring for any
// ranks and sites, and a hierarchical all-reduce (reduce inside each site to a leader, all-reduce among the
// site leaders through the WAN codec, broadcast inside each site: each of S leaders sends 2(S-1)/S of the tensor
// across sites, where a flat ring over all n ranks sends 2(n-1)/n of it over each of its hops across sites). Two ranks all-reduce a tensor of up to
// 32 MiB by one exchange: each sends the other its whole tensor, one message and one round trip where a ring of
// two takes two, the same bytes (what a pipeline's step end pays across a WAN: the tied embedding and the gradient norm).
//
//   GrpcCommunicator comm(rank, peers, &stream_server, &stream_client, options);
//   RETURN_IF_ERROR(comm.AllReduceSum(absl::MakeSpan(grads), "grads"));
//
//   BucketedAllReduce buckets(&comm);            // in the backward pass, as each bucket's grads are done:
//   auto done = buckets.Start(bucket_id, span);  // runs on a background thread
//   ...                                          // backward continues
//   RETURN_IF_ERROR(buckets.WaitAll());          // before the optimizer step
//
// Contract shared by all collectives:
// - every rank calls the same collectives with the same tag, sizes and root in the same order; calls with
//   different tags may run concurrently on different threads (a tag's calls are numbered, and the number and
//   tag are part of every tensor key, so concurrent collectives never mix their tensors);
// - every call has a deadline (options.timeout from its start): a rank that does not take part makes the others
//   fail with DEADLINE_EXCEEDED, never hang;
// - a send whose connection is lost or refused is retried with backoff until that deadline, so a link that
//   flaps for a few seconds costs time, not the collective; a tensor delivered twice (its acknowledgement
//   was lost) is taken once;
// - the link between two ranks uses options.wan_codec when their sites differ, else options.lan_codec;
// - after an error the destination (data, output) is unspecified: receives decode straight into it as chunks
//   arrive, so a tensor that fails its checks at its end may have been partly written;
// - results are identical on every rank, bit for bit, for every codec (a lossy codec's error is shared:
//   the final values of each chunk are encoded once by their owner and forwarded unchanged);
// - codecs with error feedback (top-k, int4, sparse: CodecSpec::error_feedback) keep one residual per (tag,
//   position in the algorithm) inside the communicator, so use a stable tag per gradient bucket.
// Thread safety: the methods are thread-safe under the tag rule above.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/codec.h"
#include "comm/tensor_stream.h"

namespace geotrain::comm {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data <- sum over ranks of data.
  virtual absl::Status AllReduceSum(absl::Span<float> data, std::string_view tag) = 0;
  // input.size() == size() * output.size(); output <- sum over ranks of input[rank * m, (rank + 1) * m).
  virtual absl::Status ReduceScatter(absl::Span<const float> input, absl::Span<float> output, std::string_view tag) = 0;
  // output.size() == size() * input.size(); output[r * m, (r + 1) * m) <- rank r's input.
  virtual absl::Status AllGather(absl::Span<const float> input, absl::Span<float> output, std::string_view tag) = 0;
  // data <- root's data.
  virtual absl::Status Broadcast(absl::Span<float> data, int root, std::string_view tag) = 0;
  // Point to point; a Send to `peer` with a tag matches that peer's Recv from this rank with the same tag, in
  // order. Send returns once the peer's endpoint holds the tensor (not when the peer called Recv).
  virtual absl::Status Send(int peer, absl::Span<const float> data, std::string_view tag) = 0;
  virtual absl::Status Recv(int peer, absl::Span<float> data, std::string_view tag) = 0;
};

struct PeerInfo {
  std::string name;     // unique, used as the sender in tensor keys (e.g. "rank3" or an actor id)
  std::string address;  // host:port of the peer's TensorStream endpoint
  std::string site;
};

enum class AllReduceAlgorithm { kRing, kHierarchical };

struct CommunicatorOptions {
  std::string job_id;
  Codec lan_codec;  // inside a site (default none)
  Codec wan_codec;  // between sites (default none)
  AllReduceAlgorithm all_reduce = AllReduceAlgorithm::kRing;
  absl::Duration timeout = absl::Seconds(120);  // deadline of each collective, from its start
  // Called (from the sending thread) when a send to a peer fails UNAVAILABLE and is about to be retried, with the
  // peer's name: its process may be gone, which whoever detects failures can check at once. May be null.
  std::function<void(const std::string& peer_name)> on_peer_unavailable;
};

class GrpcCommunicator : public Communicator {
 public:
  // `peers[r]` describes rank r; `server` is this rank's endpoint (its mailbox; registered on a running
  // grpc::Server at peers[rank].address) and `client` sends to the others. Both must outlive this object.
  // Bad arguments (rank out of range, duplicate or empty names) make every call return INVALID_ARGUMENT.
  GrpcCommunicator(int rank, std::vector<PeerInfo> peers, TensorStreamServer* server, TensorStreamClient* client,
                   CommunicatorOptions options);

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(peers_.size()); }

  // Uses options.all_reduce; two ranks and at most kPairMaxElements: PairAllReduce.
  absl::Status AllReduceSum(absl::Span<float> data, std::string_view tag) override;
  // size() == 2: both ranks send each other the whole tensor (encoded once; with a lossy codec each keeps its
  // own decoded copy) and add, so both hold the same two operands' sum (a + b == b + a, bit for bit).
  // AllReduceSum uses it up to kPairMaxElements: on loopback a larger exchange is slower than the ring's two
  // half-size rounds (bench/comm/allreduce_bench.cc --ranks 2: 200 MB 0.54 s vs 0.33 s), and there one round
  // trip more is small next to the bytes. scheduler/cost_model.h's kPairAllReduceMaxBytes is the same bound.
  static constexpr size_t kPairMaxElements = size_t{8} << 20;  // 32 MiB of fp32
  absl::Status PairAllReduce(absl::Span<float> data, std::string_view tag);
  absl::Status RingAllReduce(absl::Span<float> data, std::string_view tag);
  // Sites in order of their lowest rank, which leads the site; two leaders and at most kPairMaxElements: the
  // leaders' all-reduce is one pair exchange, else a ring.
  absl::Status HierarchicalAllReduce(absl::Span<float> data, std::string_view tag);

  absl::Status ReduceScatter(absl::Span<const float> input, absl::Span<float> output, std::string_view tag) override;
  absl::Status AllGather(absl::Span<const float> input, absl::Span<float> output, std::string_view tag) override;
  absl::Status Broadcast(absl::Span<float> data, int root, std::string_view tag) override;
  absl::Status Send(int peer, absl::Span<const float> data, std::string_view tag) override;
  absl::Status Recv(int peer, absl::Span<float> data, std::string_view tag) override;

  // The codec of the link between ranks a and b.
  const Codec& LinkCodec(int a, int b) const;
  const std::vector<PeerInfo>& peers() const { return peers_; }

 private:
  struct Call;  // one collective invocation: its key prefix and deadline

  Call Begin(std::string_view op, std::string_view tag);
  // The pair exchange with `peer` under `part` of `call`: both send each other their whole tensor and add
  // (PairAllReduce, and the hierarchical all-reduce's two site leaders).
  absl::Status PairExchange(const Call& call, int peer, const std::string& part, absl::Span<float> data);
  TensorKey MakeKey(const Call& call, const std::string& part, int src) const;
  std::vector<float>* Residual(const std::string& key);

  // Ring phases over `group` (ranks in ring order, containing rank_) on `data` split into group.size()
  // balanced chunks; position p ends the reduce-scatter holding chunk p fully reduced.
  absl::Status RingReduceScatter(const Call& call, const std::vector<int>& group, absl::Span<float> data);
  absl::Status RingAllGather(const Call& call, const std::vector<int>& group, absl::Span<float> data,
                             const Codec& codec);
  // The codec for the all-gather phase of a ring: the WAN codec if the ring crosses sites, else the LAN codec.
  const Codec& GatherCodec(const std::vector<int>& group) const;
  // Sends `data` to `peer` under `part` of `call`: prepared once (OutgoingTensor: top-k's error feedback kept under
  // `residual_key`), then sent with retries (SendOutgoing).
  absl::Status SendTo(const Call& call, const std::string& part, int peer, absl::Span<const float> data,
                      const Codec& codec, const std::string& residual_key);
  // Runs `send` again with backoff (50 ms doubling to 1 s) while it fails UNAVAILABLE (a connection lost or
  // refused: a link that flaps), until the call's deadline or until the job's receives are cancelled here.
  absl::Status SendWithRetries(const Call& call, int peer, const std::function<absl::Status()>& send);
  // Sends `tensor` (prepared once) with retries, as SendWithRetries.
  absl::Status SendOutgoing(const Call& call, const std::string& part, int peer, const OutgoingTensor& tensor);
  // Sends an encoded tensor (forwarded, or the same bytes to several ranks) with retries.
  absl::Status SendEncodedTo(const Call& call, const std::string& part, int peer, const Codec& codec,
                             const Bytes& encoded, int64_t elements);
  absl::StatusOr<ReceivedTensor> RecvFrom(const Call& call, const std::string& part, int peer);
  // The same tensor decoded into `out` (TensorStreamServer::RecvInto: an element-wise codec's chunks are decoded as
  // they arrive); for receives whose destination is known and whose result is not forwarded or added.
  absl::Status RecvFromInto(const Call& call, const std::string& part, int peer, absl::Span<float> out);

  const int rank_;
  const std::vector<PeerInfo> peers_;
  TensorStreamServer* const server_;
  TensorStreamClient* const client_;
  const CommunicatorOptions options_;
  absl::Status config_status_;  // what is wrong with the constructor's arguments, returned by every call

  absl::Mutex mu_;
  std::map<std::string, int64_t> sequence_ ABSL_GUARDED_BY(mu_);              // per (op, tag)
  std::map<std::string, std::vector<float>> residuals_ ABSL_GUARDED_BY(mu_);  // node-based: stable addresses
};

// The all-reduce a bucket goes through: a Communicator's AllReduceSum, or e.g. the NCCL hierarchical
// all-reduce (comm/nccl_communicator.h).
using AllReduceFn = std::function<absl::Status(absl::Span<float> data, std::string_view tag)>;
// Something a bucket's all-reduce must wait for before it reads the bucket (e.g. a CUDA event recorded
// after the copies into it); null when the bucket is ready as soon as it is started.
using BucketFence = std::function<absl::Status()>;

// Gradient all-reduce in buckets, overlapped with backward: Start() queues a bucket and returns at once; a
// background thread waits for the bucket's fence, then all-reduces the buckets one at a time in Start
// order (tag "<prefix>/<bucket_id>", so a top-k residual follows each bucket across steps). The bucket's
// memory must stay valid and untouched until its future is ready. Every rank must Start the same buckets
// in the same order. Once a bucket fails, the buckets queued after it until the next WaitAll fail with
// the same error without a collective (a rank that went on would call collectives its peers are not
// in, and wait for each one's deadline); the destructor fails the queued buckets the same way.
class BucketedAllReduce {
 public:
  explicit BucketedAllReduce(Communicator* communicator, std::string tag_prefix = "grad-bucket");
  explicit BucketedAllReduce(AllReduceFn all_reduce, std::string tag_prefix = "grad-bucket");
  ~BucketedAllReduce();  // finishes the queued buckets, then stops the thread
  BucketedAllReduce(const BucketedAllReduce&) = delete;
  BucketedAllReduce& operator=(const BucketedAllReduce&) = delete;

  std::shared_future<absl::Status> Start(int bucket_id, absl::Span<float> bucket, BucketFence fence = nullptr);
  // Waits for every bucket started so far; returns the first error among them.
  absl::Status WaitAll();

 private:
  struct Item {
    int bucket_id;
    absl::Span<float> data;
    BucketFence fence;
    std::promise<absl::Status> done;
  };
  void Loop();

  const AllReduceFn all_reduce_;
  const std::string tag_prefix_;
  absl::Mutex mu_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_future<absl::Status>> pending_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);  // the first error since the last WaitAll
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Where GradientBuckets keeps its buckets and how it copies gradient pieces in and out. The default keeps
// them in host memory and copies at once; DeviceBucketMemory (comm/nccl_communicator.h) keeps them in GPU
// memory and queues the copies on the stream that computes the gradients.
class BucketMemory {
 public:
  virtual ~BucketMemory() = default;
  // Memory for `elements` floats, owned by this object until it is destroyed.
  virtual absl::StatusOr<float*> Allocate(int64_t elements) = 0;
  // dst <- src, n floats, ordered after the work that produced src.
  virtual void Copy(float* dst, const float* src, int64_t n) = 0;
  // Called once bucket `bucket` has had all its copies issued: what its all-reduce must wait for.
  virtual BucketFence Fence(int bucket) = 0;
  // Called by Finish before it copies the sums back: an error of the queued copies, if any.
  virtual absl::Status Check() { return absl::OkStatus(); }
};

// A stage's gradient all-reduce, bucketed and overlapped with backward. The gradient pieces come in
// groups, in the order backward finishes them (the last block's first, then earlier blocks, then the
// embeddings and final LayerNorm); consecutive groups are packed into buckets of about `bucket_bytes`
// (a group is never split; an empty group, such as a middle stage's non-layer group, has no bucket). GroupReady(g) copies group g into its bucket; once every group of a bucket is
// in, the bucket's all-reduce starts on BucketedAllReduce's thread while the caller's backward goes on.
// Finish() waits for every bucket and copies the sums back into the pieces.
//
//   GradientBuckets buckets(&dp_comm, {layer_spans(L-1), ..., layer_spans(0), embedding_spans}, 25 << 20);
//   RETURN_IF_ERROR(buckets.status());
//   stage.set_layer_gradients_ready([&](int l) { if (l >= 0) buckets.GroupReady(L - 1 - l); });
//   ... last microbatch's backward ...
//   buckets.GroupReady(L);             // the embeddings, after the tied-embedding sum
//   RETURN_IF_ERROR(buckets.Finish());  // before the optimizer step
//
// Every rank must have the same groups (same sizes) and the same bucket_bytes, so that buckets match.
// A group's pieces must not change between its GroupReady and Finish. The buffers are allocated once.
// Thread safety: one thread calls GroupReady and Finish; the all-reduces run on the internal thread.
class GradientBuckets {
 public:
  // Buckets in host memory, summed by `communicator`.
  GradientBuckets(Communicator* communicator, std::vector<std::vector<absl::Span<float>>> groups, int64_t bucket_bytes,
                  std::string tag_prefix = "grad-bucket");
  // Buckets in `memory` (which must outlive this object), summed by `all_reduce`.
  GradientBuckets(AllReduceFn all_reduce, BucketMemory* memory, std::vector<std::vector<absl::Span<float>>> groups,
                  int64_t bucket_bytes, std::string tag_prefix = "grad-bucket");

  // Whether the buckets could be allocated; every other call fails with this error otherwise.
  const absl::Status& status() const { return status_; }
  int num_buckets() const { return static_cast<int>(buckets_.size()); }
  // Elements all-reduced per step (the sum of every group's sizes).
  int64_t elements() const { return elements_; }
  // Marks group g as final for this step; starts its bucket's all-reduce when the bucket is complete.
  // A group reported twice in a step is an error returned by Finish.
  void GroupReady(int group);
  // Waits for every bucket, writes the sums back into the groups' pieces and resets for the next step.
  // FAILED_PRECONDITION if some group never became ready (nothing is written back then).
  absl::Status Finish();

 private:
  struct Bucket {
    int first_group = 0, end_group = 0;  // groups [first_group, end_group)
    int64_t elements = 0;
    float* data = nullptr;  // in memory_
    int groups_ready = 0;
  };
  std::unique_ptr<BucketMemory> own_memory_;  // the host memory, when no memory was given
  BucketMemory* memory_;
  std::vector<std::vector<absl::Span<float>>> groups_;
  std::vector<int> bucket_of_group_;
  std::vector<int64_t> offset_in_bucket_;  // per group
  std::vector<bool> ready_;
  std::vector<Bucket> buckets_;
  int64_t elements_ = 0;
  absl::Status status_;
  absl::Status misuse_;
  BucketedAllReduce all_reduce_;  // last: its thread stops before the buckets go away
};

}  // namespace geotrain::comm
