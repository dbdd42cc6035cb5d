// NCCL inside a site (CUDA builds only: target geotrain_comm_nccl). NcclCommunicator implements the
// Communicator interface (comm/communicator.h) on DEVICE memory: every span passed to it holds floats in
// memory of the communicator's own CUDA device (cudaMalloc or managed); host pointers are refused with
// INVALID_ARGUMENT. NcclHierarchicalAllReduce combines it with a host-memory communicator among site
// leaders (GrpcCommunicator with the WAN codec) into the hierarchical all-reduce of docs/comm.md.
//
//   // Rank 0 of the site makes the unique id (it embeds rank 0's bootstrap address); the head hands it
//   // to the others (comm/rendezvous.h). Or, all in one call:
//   auto nccl = CreateNcclCommunicatorWithRendezvous(head_stub, token, job_id, "nccl/site-a/stage0/attempt1",
//                                                    rank, size, /*device=*/0, absl::Seconds(120));
//   RETURN_IF_ERROR((*nccl)->AllReduceSum(absl::MakeSpan(device_grads, n), "grads"));
//
// Contract (differences from GrpcCommunicator's are marked *):
// - every rank makes the same calls with the same sizes and roots in the same order; * tags only name
//   calls in errors: NCCL matches calls by their order, so calls from several threads are serialised by
//   the communicator and must reach it in the same order on every rank (use one communicator per
//   concurrent stream of collectives);
// - * calls are synchronous: the caller's data must be ready (its producing stream synchronised) when it
//   calls, and the result is in place when the call returns OK. The work runs on the communicator's own
//   non-blocking CUDA stream (stream());
// - every call, Create included, has a deadline (`timeout` from its start). NCCL runs non-blocking
//   (ncclConfig.blocking = 0): enqueueing, completion on the stream and NCCL's asynchronous error are polled
//   against the deadline. On a timeout or an NCCL/CUDA error the communicator is aborted (ncclCommAbort),
//   the call returns DEADLINE_EXCEEDED or INTERNAL naming the NCCL error string, and every later call
//   returns FAILED_PRECONDITION with that first error: make a new communicator (with a new unique id);
// - a call refused before it reaches NCCL (bad sizes, host pointers) returns INVALID_ARGUMENT on this rank
//   only; its peers then fail with DEADLINE_EXCEEDED;
// - * Send completes when the peer has received (NCCL has no mailbox): two ranks that Send to each other
//   before their Recv deadlock until the deadline; use SendRecv, which groups both directions.
// Sums are fp32 in NCCL's order, so they may differ from a CPU sum in the last bits.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/communicator.h"
#include "internal.grpc.pb.h"

namespace geotrain::comm {

inline constexpr int kNcclUniqueIdBytes = NCCL_UNIQUE_ID_BYTES;  // 128

// A fresh NCCL unique id (ncclGetUniqueId), as kNcclUniqueIdBytes bytes. Call it in the process that will
// be rank 0 of the communicator.
absl::StatusOr<std::string> NewNcclUniqueId();

struct NcclSend {
  int peer;
  absl::Span<const float> data;  // device memory
};
struct NcclRecv {
  int peer;
  absl::Span<float> data;  // device memory
};

class NcclCommunicator : public Communicator {
 public:
  // Joins the communicator `unique_id` as `rank` of `size` on CUDA device `device`; returns when every rank
  // has joined, or fails by `timeout` or `join_deadline`, whichever comes first (DEADLINE_EXCEEDED names
  // the rank and the device). `timeout` is also each later call's deadline.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(int rank, int size, const std::string& unique_id,
                                                                  int device,
                                                                  absl::Duration timeout = absl::Seconds(120),
                                                                  absl::Time join_deadline = absl::InfiniteFuture());
  // Finalises the communicator (aborts it when that does not finish within a few seconds) and frees the
  // stream.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  // OK while usable; after an error, the error that aborted the communicator. Waits for a running call.
  absl::Status health() const;

  absl::Status AllReduceSum(absl::Span<float> data, std::string_view tag) override;
  absl::Status ReduceScatter(absl::Span<const float> input, absl::Span<float> output, std::string_view tag) override;
  absl::Status AllGather(absl::Span<const float> input, absl::Span<float> output, std::string_view tag) override;
  absl::Status Broadcast(absl::Span<float> data, int root, std::string_view tag) override;
  absl::Status Send(int peer, absl::Span<const float> data, std::string_view tag) override;
  absl::Status Recv(int peer, absl::Span<float> data, std::string_view tag) override;

  // In place: root's data <- sum over ranks of data; the other ranks' data is left unchanged.
  absl::Status Reduce(absl::Span<float> data, int root, std::string_view tag);
  // All sends and receives in one NCCL group (ncclGroupStart/End), so they cannot deadlock on each other.
  absl::Status SendRecv(absl::Span<const NcclSend> sends, absl::Span<const NcclRecv> receives, std::string_view tag);

  // Copies between the device and host memory on the communicator's stream, with the same deadline and
  // error handling (for staging through host memory; pinned host memory makes them fast).
  absl::Status CopyToHost(absl::Span<const float> device_data, float* host);
  absl::Status CopyFromHost(const float* host, absl::Span<float> device_data);

 private:
  NcclCommunicator(int rank, int size, int device, absl::Duration timeout, ncclComm_t comm, cudaStream_t stream);

  // Checks that `data` lies in this communicator's device memory.
  absl::Status CheckDevice(std::string_view op, const void* data) const;
  // Runs `enqueue` (NCCL or CUDA calls on stream_) and waits until the stream has completed it, polling
  // NCCL's asynchronous error, by the deadline; aborts the communicator on failure.
  absl::Status Run(std::string_view op, std::string_view tag, int64_t elements,
                   const std::function<absl::Status()>& enqueue);
  absl::Status AbortLocked(absl::Status cause) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int rank_;
  const int size_;
  const int device_;
  const absl::Duration timeout_;
  cudaStream_t stream_;

  mutable absl::Mutex mu_;                // serialises calls: NCCL matches them by order
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_);  // null once aborted
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

// Rank 0 makes a unique id and publishes it through the head's rendezvous under `key` (write-once: put an
// attempt number in it when a communicator is made again); the other ranks fetch it; then every rank
// joins. `timeout` bounds the rendezvous and the join together, and each later call.
absl::StatusOr<std::unique_ptr<NcclCommunicator>> CreateNcclCommunicatorWithRendezvous(
    geotrain::internal::HeadControl::StubInterface* head, const std::string& token, const std::string& job_id,
    const std::string& key, int rank, int size, int device, absl::Duration timeout = absl::Seconds(120));

// The hierarchical all-reduce for GPUs in several sites: reduce inside the site with NCCL to the site's
// leader (NCCL rank 0), all-reduce among the site leaders through a host-memory communicator (e.g. a
// GrpcCommunicator with the WAN codec, which gives every leader the same bits), broadcast inside the site
// with NCCL. The leader stages through pinned host memory allocated once; tensors larger than it go in
// chunks (the leaders' tag is "<tag>/<chunk>" then, so a top-k residual follows each chunk across steps).
// Every rank of every site calls AllReduceSum with the same sizes and tags in the same order.
// Not thread-safe: one caller at a time (the NCCL communicator serialises anyway).
class NcclHierarchicalAllReduce {
 public:
  // `site` is this rank's site communicator; `leaders` is the leaders' communicator on the site leader
  // (site->rank() == 0) and null on the other ranks. Both must outlive this object.
  static absl::StatusOr<std::unique_ptr<NcclHierarchicalAllReduce>> Create(NcclCommunicator* site,
                                                                           Communicator* leaders,
                                                                           int64_t max_chunk_elements = 16 << 20);
  ~NcclHierarchicalAllReduce();
  NcclHierarchicalAllReduce(const NcclHierarchicalAllReduce&) = delete;
  NcclHierarchicalAllReduce& operator=(const NcclHierarchicalAllReduce&) = delete;

  // device_data <- sum over every rank of every site. A leader's WAN error is returned on the leader; its
  // site's other ranks then fail at the broadcast's deadline.
  absl::Status AllReduceSum(absl::Span<float> device_data, std::string_view tag);

 private:
  NcclHierarchicalAllReduce(NcclCommunicator* site, Communicator* leaders, float* staging, int64_t chunk_elements);

  NcclCommunicator* const site_;
  Communicator* const leaders_;
  float* const staging_;  // pinned, chunk_elements_ floats; null on non-leaders
  const int64_t chunk_elements_;
};

// GradientBuckets' buckets (comm/communicator.h) in the memory of CUDA device `device`, so that a CUDA
// stage's data-parallel gradients never leave the GPU on their way to NCCL: each piece is copied into its
// bucket on `stream`, the stream backward runs on, so the copy follows the kernels that produced the
// piece; a complete bucket's all-reduce waits for a CUDA event recorded after its copies, on the
// all-reduce thread, while the caller goes on queueing backward work (this is the overlap). The sums are
// copied back on `stream` once every all-reduce has finished.
// Thread safety: Allocate, Copy, Fence and Check on the GradientBuckets caller's thread; the fences'
// waits on its all-reduce thread (each waits on its own event).
class DeviceBucketMemory : public BucketMemory {
 public:
  DeviceBucketMemory(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~DeviceBucketMemory() override;  // frees the buckets and events; the stream must be idle
  DeviceBucketMemory(const DeviceBucketMemory&) = delete;
  DeviceBucketMemory& operator=(const DeviceBucketMemory&) = delete;

  // Bucket i's memory is the i-th allocation; its event is made with it.
  absl::StatusOr<float*> Allocate(int64_t elements) override;
  void Copy(float* dst, const float* src, int64_t n) override;
  BucketFence Fence(int bucket) override;
  absl::Status Check() override;

 private:
  const int device_;
  const cudaStream_t stream_;
  std::vector<void*> buffers_;
  std::vector<cudaEvent_t> events_;        // per bucket
  cudaError_t first_error_ = cudaSuccess;  // of the queued copies and event records
};

}  // namespace geotrain::comm
