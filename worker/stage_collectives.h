// The collectives a stage actor trains with, set up once per actor from its ranks (worker/actor_ranks.h):
//
//   pipeline        point to point with the neighbouring stages: activations forward, their gradients back
//                   (comm::ActivationCodec of the spec's codecs: top-k, int4 and sparse, which keep
//                   error feedback, are for gradients only, so activations cross without them);
//   dp_all_reduce   a gradient bucket's sum across replicas (gRPC on host memory: a ring, or the hierarchical
//                   all-reduce when the group spans sites and a site holds several of its replicas, so that
//                   each site's sum crosses the WAN once; or NCCL on device memory inside a site with gRPC
//                   among site leaders: worker/collectives.h decides);
//   tied            the tied-embedding gradient sum over every copy of wte (the first and last stage of each
//                   replica of the data-parallel group, or of the DiLoCo group; of this replica alone when
//                   the data-parallel all-reduce runs on NCCL);
//   tp              the tensor-parallel all-reduces of the stage (gRPC through the activation codecs, as
//                   they sum activations; or NCCL on device memory);
//   replica         the global gradient norm over the replica's stages and ranks (exact, never lossy);
//   dp_scalars      the loss average across replicas (exact), and time-paced DiLoCo's step times;
//   DiLoCo (the spec's diloco block on): dp_all_reduce sums only over this actor's group (the replicas whose
//   first stage shares its site); `outer` carries the groups' pseudo-gradients between the group leaders
//   across sites (diloco.codec), and `group` hands the result to the rest of the group (model/diloco.h).
//
// A CollectivesFactory makes them; the worker uses GrpcCollectivesFactory (tensor streams through the
// worker's mailbox, NCCL where the build has it), and tests inject their own factory (e.g. one that wraps
// the gRPC one to make a peer fail) so a stage actor can run in one process.
//
// Thread-safety: a StageCollectives is used by its actor's threads under the communicators' own contract
// (comm/communicator.h): one caller per tag at a time. BytesSent may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "comm/tensor_stream.h"
#include "internal.grpc.pb.h"
#include "model/backend.h"
#include "model/tp_comm.h"
#include "worker/actor_ranks.h"
#include "worker/link_metrics.h"

namespace geotrain::worker {

// Traffic classes, counted apart so that each step's bytes can be attributed to site pairs.
enum class TrafficClass { kPipeline, kDataParallel, kOther, kOuter, kTied };

// Where an all-reduce sends its bytes across sites, for attributing them to a site pair: the world rank this actor
// sends to in the ring that crosses sites (a hierarchical all-reduce's leaders' ring; for one of its members, that
// member's own leader, inside the site), and that ring's size (it sends 2(size-1)/size of the tensor).
struct AllReduceRoute {
  int successor_rank = -1;
  int ring_size = 1;
};

class StageCollectives {
 public:
  virtual ~StageCollectives() = default;

  comm::Communicator* pipeline = nullptr;
  comm::Communicator* dp_scalars = nullptr;
  comm::Communicator* replica = nullptr;
  comm::Communicator* tied = nullptr;  // null unless pp > 1 and first or last stage
  // tied sums the copies of every replica of the group (then dp_all_reduce leaves wte out), not just this one's.
  bool tied_over_replicas = false;
  AllReduceRoute tied_route;
  model::TensorParallelComm* tp = nullptr;  // null when tp == 1
  // Tensor parallelism with data parallelism across sites, all on gRPC: each tp rank sums only its 1/tp slice of
  // the replicated tensors' gradients (the embeddings, LayerNorms, the projections' biases: identical on every
  // rank) over the data-parallel and tied all-reduces, and `tp_exact` hands each rank the others' slices after
  // them. So each crosses the WAN once, not once per tp rank. Decided alike by every actor of the job
  // (SplitReplicatedTensors); off inside one site, where the gather would cost more than it saves, with NCCL data
  // parallelism, and with DiLoCo (its groups share a site; its outer exchange sends the replicated tensors' part
  // from tp rank 0 alone and hands it to the other ranks through `tp_exact`).
  bool split_replicated = false;
  comm::Communicator* tp_exact = nullptr;  // this replica's TP group on host memory, never lossy; null when tp == 1
  comm::AllReduceFn dp_all_reduce;         // null when dp == 1
  comm::BucketMemory* dp_bucket_memory = nullptr;  // where the buckets live; null: host memory
  bool dp_on_device = false;  // buckets on the GPU, fed from device gradients (NCCL inside the site)
  bool tp_nccl = false;       // tensor-parallel all-reduces on NCCL
  AllReduceRoute dp_route;
  // The replicas whose gradients dp_all_reduce sums: dp, or with DiLoCo the size of this actor's group.
  int inner_replicas = 1;
  // DiLoCo: `outer` (group leaders only; null elsewhere and with one group) is this stage of every group's
  // leader, ring order by group, with diloco.codec across sites (outer_route). `group` is this stage in the replicas of this actor's group, leader (rank 0) first; null
  // when the group has one replica. outer_weight: this group's share of the batch (its replicas / dp).
  comm::Communicator* outer = nullptr;
  comm::Communicator* group = nullptr;
  AllReduceRoute outer_route;
  float outer_weight = 1;
  // DiLoCo: this actor's group (0 without DiLoCo or with dp 1), the number of groups, and whether this replica
  // is its group's lowest (its leader, which writes the group's checkpoint shards).
  int diloco_group = 0;
  int diloco_groups = 1;
  bool diloco_leader = true;
  std::vector<std::string> notes;  // why groups of CUDA stages stay on gRPC, for the actor's log

  // Encoded bytes acknowledged by peers so far, per traffic class; kDataParallel and kTied count only the bytes
  // sent to actors at other sites (a hierarchical all-reduce's leader also sends inside its site).
  virtual uint64_t BytesSent(TrafficClass traffic) const = 0;
  // Ends every receive of this run of the job at once (CANCELLED), now and later: after a send failed,
  // so that the actor stops waiting for peers and reports the failure. Any thread.
  // `stopped`: the job is stopping (a peer refused a send because it stopped), not failing
  // (TensorStreamServer::CancelJob's word to this side's senders).
  virtual void CancelReceives(bool stopped = false) = 0;
};

class CollectivesFactory {
 public:
  virtual ~CollectivesFactory() = default;
  // `backend` is the stage's device (NCCL groups run on it). Every tensor the collectives exchange is
  // keyed by ranks.comm_job_id. Errors: a codec the spec names is unknown, NCCL set-up failed.
  virtual absl::StatusOr<std::unique_ptr<StageCollectives>> Create(const ActorRanks& ranks, const JobSpec& spec,
                                                                   const std::vector<ActorPeer>& actors,
                                                                   model::Backend* backend, int device_index) = 0;
};

// Collectives over the worker's tensor streams and, in CUDA builds, NCCL.
class GrpcCollectivesFactory : public CollectivesFactory {
 public:
  // `mailbox` receives this worker's tensors; `head` (may be null: then NCCL groups cannot form) serves the
  // NCCL rendezvous; `timeout` is the deadline of each receive and collective. Not owned; they must outlive
  // the collectives made. `credentials` (null: plaintext) secure the tensor streams to peers: TLS when the
  // workers serve it. `links` (null: none) records each acknowledged send's bytes and time per peer worker.
  GrpcCollectivesFactory(comm::TensorStreamServer* mailbox, std::string token,
                         internal::HeadControl::StubInterface* head, absl::Duration timeout,
                         std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr, LinkMetrics* links = nullptr);
  // Told (from a sending thread) the actor id of a peer a send could not reach and retries: its process may be gone
  // (comm::CommunicatorOptions::on_peer_unavailable). Before the first Create.
  void set_on_peer_unavailable(std::function<void(const std::string& actor_id)> f) {
    on_peer_unavailable_ = std::move(f);
  }

  absl::StatusOr<std::unique_ptr<StageCollectives>> Create(const ActorRanks& ranks, const JobSpec& spec,
                                                           const std::vector<ActorPeer>& actors,
                                                           model::Backend* backend, int device_index) override;

 private:
  comm::TensorStreamServer* const mailbox_;
  const std::string token_;
  internal::HeadControl::StubInterface* const head_;
  const absl::Duration timeout_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  LinkMetrics* const links_;
  std::function<void(const std::string& actor_id)> on_peer_unavailable_;
};

}  // namespace geotrain::worker
