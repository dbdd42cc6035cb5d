// The receiving end of tensor streams (tensor_stream.h has the protocol): TensorStreamServer serves the
// geotrain.TensorStream service, checks each stream's token, validates and assembles the tensors each stream
// carries (tensor_chunks.h) and holds them in a mailbox until Recv or RecvInto takes them.
//
//   TensorStreamServer streams(token);
//   grpc::ServerBuilder builder;  builder.AddListeningPort(...);  streams.Register(&builder);
//   std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
//   RETURN_IF_ERROR(streams.RecvInto(key, absl::MakeSpan(values), absl::Now() + absl::Seconds(30)));
//   ...  streams.Shutdown();  server->Shutdown();
//
// Delivery: a tensor goes to the mailbox (Recv, or RecvInto called after it arrived), or, when a RecvInto for its
// key is already waiting and the codec is element-wise, straight into RecvInto's buffer: each chunk is decoded
// there as it arrives, so no reassembly buffer and no decode pass after the last byte.
// Limits (docs/architecture.md, "Limits"): the mailbox holds at most options.max_mailbox_bytes of complete or
// partly received tensors, max_job_bytes per job and max_peer_bytes per sender (beyond them a Send is refused
// with RESOURCE_EXHAUSTED naming the budget, rather than buffered); a tensor left in the mailbox for
// options.orphan_timeout is dropped; at most options.max_streams streams are open at once; a chunk message is at
// most gRPC's receive cap (4 MiB unless the server sets more) and its payload at most max_chunk_bytes.
// Validation: every header field and size is checked before anything is allocated or written: token, key field
// sizes, dtype, shape (rank, non-negative dims, product without overflow), codec name, total size against the
// codec's size for that element count and options.max_tensor_bytes, chunk size, contiguous offsets, the last
// flag, the trailer (only on the last chunk, only with a zero header checksum), the payload CRC-32C, and the
// codec header (its CRC, element count = shape product, codec kind and flags match). A malformed tensor is
// refused with INVALID_ARGUMENT (DATA_LOSS for checksum mismatches), which ends its stream; nothing of it reaches
// the mailbox, and a RecvInto whose buffer it was being decoded into does not return it (it keeps waiting).
// Threading: all methods are thread-safe. Server callbacks run on gRPC's threads and never block; Recv and
// RecvInto block the caller until the tensor arrives or the deadline passes (DEADLINE_EXCEEDED).
// Ownership: TensorStreamServer must outlive the grpc::Server it was registered on; call its Shutdown() before
// the grpc::Server's (it ends the streams that clients keep open, which the server's Shutdown would otherwise
// wait for).
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "comm/tensor_types.h"

namespace grpc {
class ServerBuilder;
}  // namespace grpc

namespace geotrain::comm {

// A receiver refuses the tensors of a job it has stopped (TensorStreamServer::CancelJob) with this error: FAILED_PRECONDITION,
// naming the job. The job is ending, not failing: a sender that gets it ends its own part as stopped, not as a fault
// (the stop that reached the receiver is on its way to the sender too). IsJobStoppedOnReceiver recognises the error
// after it crossed gRPC (code and message travel; FromGrpc's context prefix is allowed).
absl::Status JobStoppedOnReceiverError(const std::string& job_id);
bool IsJobStoppedOnReceiver(const absl::Status& status);
// The error a receiver answers for a job whose receives it cancelled as failed (CancelJob, not stopped: a peer
// failed there, or the job regroups live), and its recogniser: the sender's peer is gone, not the job.
absl::Status JobFailedOnReceiverError(const std::string& job_id);
bool IsJobFailedOnReceiver(const absl::Status& status);

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

  // Waits for the tensor with exactly this key and decodes it into `out`, whose size must equal the tensor's
  // element count (INVALID_ARGUMENT otherwise). If the tensor is already in the mailbox, it is taken and
  // decoded as with Recv + DecodeInto. Otherwise, if its codec is element-wise (none, fp16, bf16 without zstd)
  // and its element count equals out.size(), the receiving stream decodes each chunk straight into `out` as it
  // arrives; other tensors go through the mailbox and are decoded here. OK means every check of a Recv passed
  // (sizes, payload CRC, codec header) before return. On any error the contents of `out` are unspecified (a
  // tensor that failed its checks may have been partly written to it); a tensor that fails its checks is
  // refused to its sender and this call keeps waiting for a valid one until the deadline.
  // DEADLINE_EXCEEDED at `deadline`, CANCELLED after Shutdown(); a tensor whose chunks are still being written
  // into `out` then is refused to its sender (DEADLINE_EXCEEDED), and no byte is written to `out` after return.
  // At most one RecvInto may wait for a given key (FAILED_PRECONDITION otherwise); do not wait for one key with
  // both Recv and RecvInto (the tensor would go to RecvInto).
  absl::Status RecvInto(const TensorKey& key, absl::Span<float> out, absl::Time deadline);

  // Drops every tensor of `job_id` waiting in the mailbox (when a job ends, fails or is cancelled, or after a
  // collective failed part-way); returns how many were dropped.
  size_t DiscardJob(const std::string& job_id);

  // Stops the receives of `job_id` (a key's job id exactly, e.g. one run of a job): every Recv waiting for
  // one of its tensors returns CANCELLED at once, later ones too, and its tensors are refused
  // (JobStoppedOnReceiverError to the sender). For a job that is stopping: its actors learn it without waiting for
  // their receive deadlines. The mailbox shares it between every actor of the job on this endpoint. The endpoint
  // remembers the kMaxCancelledJobs most recently cancelled job ids (a worker lives through many jobs and
  // restarts); an older one's late tensors are taken into the mailbox again, where the orphan timeout drops them.
  // `stopped`: the job is stopping (refused tensors say so, JobStoppedOnReceiverError, and their senders stop too);
  // false: this side failed (a send of the job failed part-way), which its senders hear as an error.
  void CancelJob(const std::string& job_id, bool stopped = true);
  static constexpr size_t kMaxCancelledJobs = 4096;
  // Whether CancelJob(job_id) was called (among the last kMaxCancelledJobs cancelled).
  bool JobCancelled(const std::string& job_id) const;

  // Wakes every Recv and RecvInto with CANCELLED, refuses new tensors (UNAVAILABLE) and ends every open
  // stream (UNAVAILABLE). Call before shutting the grpc::Server down: clients keep their streams open between
  // tensors, and the grpc::Server's Shutdown() waits for open streams.
  void Shutdown();

  struct Stats {
    uint64_t tensors_received = 0;
    uint64_t tensors_decoded_on_arrival = 0;  // of which decoded chunk by chunk into a waiting RecvInto's buffer
    uint64_t bytes_received = 0;              // encoded bytes of complete tensors
    uint64_t streams_rejected = 0;
    uint64_t mailbox_tensors = 0;
    uint64_t mailbox_bytes = 0;      // complete plus reserved for tensors being received
    uint64_t receivers_waiting = 0;  // RecvInto calls waiting for their tensor
    uint64_t over_budget = 0;        // tensors refused for a memory budget (mailbox, job or peer)
    uint64_t orphans_dropped = 0;    // tensors dropped after options.orphan_timeout in the mailbox
    uint64_t streams_open = 0;
  };
  Stats stats() const;

  const TensorStreamOptions& options() const { return options_; }

 private:
  class Service;
  class Reactor;
  friend class Reactor;
  // Called by reactors.
  bool Authorized(std::string_view presented) const;
  absl::Status Reserve(const TensorKey& key, uint64_t bytes);
  void Release(const TensorKey& key, uint64_t bytes);
  void ReleaseLocked(const TensorKey& key, uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes over the reservation of `tensor.encoded.size()` bytes.
  absl::Status Deliver(ReceivedTensor tensor);
  void CountRejected();
  // The waiting RecvInto's buffer for `key` if it takes `elements` elements and no other reactor holds it.
  std::shared_ptr<TensorDestination> Claim(const TensorKey& key, uint64_t elements);
  // Brackets each write into a claimed destination; BeginWrite fails once RecvInto gave up or on Shutdown.
  absl::Status BeginWrite(TensorDestination* destination, const TensorKey& key);
  void EndWrite(TensorDestination* destination);
  // Ends a claim: with the tensor complete and valid (`delivered_bytes` encoded bytes), or without (the
  // destination waits for another sender).
  absl::Status CompleteClaim(TensorDestination* destination, const TensorKey& key, uint64_t delivered_bytes);
  void Unclaim(TensorDestination* destination);
  // Open streams, so that Shutdown can end them. AddReactor fails after Shutdown (UNAVAILABLE) and beyond
  // options.max_streams (RESOURCE_EXHAUSTED).
  absl::Status AddReactor(Reactor* reactor);
  void RemoveReactor(Reactor* reactor);

  const std::string token_;
  const TensorStreamOptions options_;
  std::unique_ptr<Service> service_;

  // Lock order: reactors_mu_, then a reactor's own mutex, then mu_.
  absl::Mutex reactors_mu_;
  absl::flat_hash_set<Reactor*> reactors_ ABSL_GUARDED_BY(reactors_mu_);

  mutable absl::Mutex mu_;
  struct Waiting {
    ReceivedTensor tensor;
    absl::Time arrived;
  };
  // Removes `it`'s tensor from the mailbox and gives back its reservation.
  ReceivedTensor TakeLocked(absl::flat_hash_map<TensorKey, Waiting>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops tensors older than options.orphan_timeout, every quarter of it, until Shutdown.
  void DropOrphansLoop();

  absl::flat_hash_map<TensorKey, Waiting> mailbox_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<TensorKey, std::shared_ptr<TensorDestination>> destinations_ ABSL_GUARDED_BY(mu_);
  uint64_t reserved_bytes_ ABSL_GUARDED_BY(mu_) = 0;                            // complete plus reserved, all jobs
  absl::flat_hash_map<std::string, uint64_t> job_bytes_ ABSL_GUARDED_BY(mu_);   // the same by job id
  absl::flat_hash_map<std::string, uint64_t> peer_bytes_ ABSL_GUARDED_BY(mu_);  // and by sender
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  // Cancelled job -> whether it was a stop (CancelJob's `stopped`; the first call's word stands).
  absl::flat_hash_map<std::string, bool> cancelled_jobs_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> cancelled_order_ ABSL_GUARDED_BY(mu_);  // cancelled_jobs_, oldest first
  Stats stats_ ABSL_GUARDED_BY(mu_);
  std::thread janitor_;  // DropOrphansLoop; joined by the destructor
};

}  // namespace geotrain::comm
