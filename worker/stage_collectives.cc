// Setting up a stage actor's collectives over tensor streams and NCCL (see stage_collectives.h).
#include "worker/stage_collectives.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "comm/codec.h"
#include "common/diloco_spec.h"
#include "common/status.h"
#include "model/diloco.h"
#include "worker/collectives.h"

#ifdef GEOTRAIN_HAVE_CUDA
#include "comm/nccl_communicator.h"
#include "model/cuda/ops_cuda.h"
#include "model/cuda_backend.h"
#endif

namespace geotrain::worker {
namespace {

#ifdef GEOTRAIN_HAVE_CUDA
constexpr bool kNcclBuilt = true;
#else
constexpr bool kNcclBuilt = false;
#endif

// model::TensorParallelComm over a communicator of the stage's tensor-parallel group (host memory).
class CommunicatorTensorParallel : public model::TensorParallelComm {
 public:
  explicit CommunicatorTensorParallel(comm::Communicator* comm) : comm_(comm) {}
  absl::Status AllReduceSum(float* data, int64_t n) override {
    return comm_->AllReduceSum(absl::MakeSpan(data, static_cast<size_t>(n)), "tp");
  }
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }

 private:
  comm::Communicator* comm_;
};

#ifdef GEOTRAIN_HAVE_CUDA
// model::TensorParallelComm over NCCL, for a CUDA stage whose tensor-parallel group shares a site: the
// stage hands it device pointers. NCCL runs on its own stream, so the stage's queued work is waited for
// first; the sum is in place when the call returns.
class NcclTensorParallel : public model::TensorParallelComm {
 public:
  NcclTensorParallel(std::unique_ptr<comm::NcclCommunicator> comm, model::Backend* backend)
      : comm_(std::move(comm)), backend_(backend) {}
  absl::Status AllReduceSum(float* data, int64_t n) override {
    RETURN_IF_ERROR(backend_->Synchronize());
    return comm_->AllReduceSum(absl::MakeSpan(data, static_cast<size_t>(n)), "tp");
  }
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  bool accepts_device_memory() const override { return true; }

 private:
  std::unique_ptr<comm::NcclCommunicator> comm_;
  model::Backend* backend_;
};
#endif

// `options` that also add to *counter the bytes each acknowledged send delivered to an actor at another site than
// this one's (a hierarchical all-reduce's leader sends both inside its site and across).
comm::TensorStreamOptions CountedAcrossSites(comm::TensorStreamOptions options, const ActorRanks& ranks,
                                             std::shared_ptr<std::atomic<uint64_t>> counter) {
  std::map<std::string, std::string> site_at;  // address -> site
  for (const comm::PeerInfo& p : ranks.peers) site_at[p.address] = p.site;
  options.on_acknowledged = [base = options.on_acknowledged, site_at = std::move(site_at), my_site = ranks.site,
                             counter = std::move(counter)](const std::string& address, uint64_t bytes,
                                                           absl::Duration took) {
    if (base) base(address, bytes, took);
    if (auto it = site_at.find(address); it != site_at.end() && it->second != my_site) {
      counter->fetch_add(bytes, std::memory_order_relaxed);
    }
  };
  return options;
}

// How a gRPC group of `members` (world ranks, one of them this actor) all-reduces. Across sites, with a site that
// holds several members: hierarchically, so that each site's sum crosses the WAN once (2(S-1)/S of it from each of
// S leaders) where a flat ring sends 2(n-1)/n over each of its hops across sites, in the leaders' rounds of WAN
// latency (one for two leaders up to 32 MiB, else 2(S-1)) instead of 2(n-1); scheduler/cost_model.cc
// (DataParallelAllReduce) predicts the same choice. Else a ring.
struct GroupRoute {
  comm::AllReduceAlgorithm algorithm = comm::AllReduceAlgorithm::kRing;
  AllReduceRoute traffic;
};

GroupRoute RouteOf(const std::vector<int>& members, const ActorRanks& ranks) {
  std::vector<int> leaders;  // each site's lowest member, sites in order of their lowest member
  bool shared_site = false;
  const auto site_of = [&](int rank) -> const std::string& { return ranks.peers[rank].site; };
  for (int m : members) {
    if (std::none_of(leaders.begin(), leaders.end(), [&](int l) { return site_of(l) == site_of(m); })) {
      leaders.push_back(m);
    } else {
      shared_site = true;
    }
  }
  GroupRoute route;
  const bool hierarchical = leaders.size() > 1 && shared_site;
  if (hierarchical) route.algorithm = comm::AllReduceAlgorithm::kHierarchical;
  const std::vector<int>& ring = hierarchical ? leaders : members;
  route.traffic.ring_size = static_cast<int>(ring.size());
  if (const auto me = std::find(ring.begin(), ring.end(), ranks.my_rank); me != ring.end()) {
    route.traffic.successor_rank = ring[(me - ring.begin() + 1) % ring.size()];
  } else {
    route.traffic.successor_rank =
        *std::find_if(leaders.begin(), leaders.end(), [&](int l) { return site_of(l) == site_of(ranks.my_rank); });
  }
  return route;
}

// The groups an actor is not in are judged as their members judge them: an all-CUDA group's members run a CUDA
// build, which has NCCL, whether this worker's build has it or not (a mixed fleet must still agree).
constexpr bool kNcclBuiltWhereCudaRuns = true;

// StageCollectives::split_replicated: tensor parallelism, data parallelism on gRPC in every group of the job, and a
// data-parallel group (some stage, some tp rank) whose replicas are in more than one site. A function of the actor
// list alone, so that the members of every data-parallel, tied and tensor-parallel group agree.
absl::StatusOr<bool> SplitReplicatedTensors(const std::vector<ActorPeer>& actors, const ActorRanks& ranks,
                                            bool diloco) {
  if (ranks.tp == 1 || ranks.present.size() == 1 || diloco) return false;
  bool across_sites = false;
  for (int s = 0; s < ranks.pp; ++s) {
    for (int t = 0; t < ranks.tp; ++t) {
      ASSIGN_OR_RETURN(CollectivePlan plan, PlanCollectives(actors, ranks.dp, ranks.pp, ranks.tp, ranks.replica, s, t,
                                                            kNcclBuiltWhereCudaRuns));
      if (plan.dp.use) return false;
      const std::string& site = ranks.peers[ranks.WorldRank(ranks.lead_replica(), s, t)].site;
      for (int r : ranks.present) across_sites = across_sites || ranks.peers[ranks.WorldRank(r, s, t)].site != site;
    }
  }
  return across_sites;
}

// Owns the clients, communicators and NCCL objects behind the StageCollectives pointers. One client per
// traffic class, so that each step's bytes can be attributed.
class GrpcStageCollectives : public StageCollectives {
 public:
  // The data-parallel and tied-embedding clients count the bytes they send to other sites (CountedAcrossSites).
  GrpcStageCollectives(const std::string& token, const comm::TensorStreamOptions& stream_options,
                       const ActorRanks& ranks, comm::TensorStreamServer* mailbox, std::string comm_job_id)
      : pipeline_client_(token, stream_options),
        dp_client_(token, CountedAcrossSites(stream_options, ranks, dp_wan_bytes_)),
        other_client_(token, stream_options),
        outer_client_(token, stream_options),
        tied_client_(token, CountedAcrossSites(stream_options, ranks, tied_wan_bytes_)),
        mailbox_(mailbox),
        comm_job_id_(std::move(comm_job_id)) {}

  void CancelReceives(bool stopped) override { mailbox_->CancelJob(comm_job_id_, stopped); }

  uint64_t BytesSent(TrafficClass traffic) const override {
    switch (traffic) {
      case TrafficClass::kPipeline:
        return pipeline_client_.stats().bytes_sent;
      case TrafficClass::kDataParallel:
        return dp_wan_bytes_->load(std::memory_order_relaxed);
      case TrafficClass::kTied:
        return tied_wan_bytes_->load(std::memory_order_relaxed);
      case TrafficClass::kOther:
        return other_client_.stats().bytes_sent;
      case TrafficClass::kOuter:
        return outer_client_.stats().bytes_sent;
    }
    return 0;
  }

  // The bytes dp_client_ and tied_client_ sent to other sites (declared before the clients, which count into them).
  const std::shared_ptr<std::atomic<uint64_t>> dp_wan_bytes_ = std::make_shared<std::atomic<uint64_t>>(0),
                                               tied_wan_bytes_ = std::make_shared<std::atomic<uint64_t>>(0);
  comm::TensorStreamClient pipeline_client_, dp_client_, other_client_, outer_client_, tied_client_;
  comm::TensorStreamServer* const mailbox_;
  const std::string comm_job_id_;
  std::unique_ptr<comm::GrpcCommunicator> pipeline_comm_, dp_comm_, dp_scalars_comm_, replica_comm_, tp_comm_,
      tp_exact_comm_, tied_comm_, dp_leaders_, outer_comm_, group_comm_;
  std::unique_ptr<CommunicatorTensorParallel> tp_adapter_;
  std::unique_ptr<comm::BucketMemory> bucket_memory_;
#ifdef GEOTRAIN_HAVE_CUDA
  std::unique_ptr<NcclTensorParallel> nccl_tp_;
  std::unique_ptr<comm::NcclCommunicator> nccl_dp_;
  std::unique_ptr<comm::NcclHierarchicalAllReduce> nccl_dp_hierarchical_;
#endif
};

// The communicator options of a stage's groups, all with the collective deadline and keyed by ranks.comm_job_id.
struct GroupOptions {
  comm::CommunicatorOptions coded;        // gradients: the spec's WAN and LAN codecs
  comm::CommunicatorOptions activations;  // the pipeline's and tensor parallelism's: comm::ActivationCodec of those
  comm::CommunicatorOptions exact;        // scalars, never lossy
};

absl::StatusOr<GroupOptions> MakeGroupOptions(const JobSpec& spec, const ActorRanks& ranks, absl::Duration timeout) {
  ASSIGN_OR_RETURN(comm::Codec wan, comm::ParseCodec(spec.comm().wan_codec()));
  ASSIGN_OR_RETURN(comm::Codec lan, comm::ParseCodec(spec.comm().lan_codec()));
  GroupOptions out;
  comm::CommunicatorOptions& options = out.coded;
  options.job_id = ranks.comm_job_id;
  options.lan_codec = lan;
  options.wan_codec = wan;
  options.timeout = timeout;
  // Activations never go through a gradients-only codec (top-k, int4, sparse): they use the codec's dense part.
  out.activations = options;
  out.activations.wan_codec = comm::ActivationCodec(wan);
  out.activations.lan_codec = comm::ActivationCodec(lan);
  // Scalars (gradient norm, loss) always travel exactly.
  out.exact = options;
  out.exact.lan_codec = comm::Codec{};
  out.exact.wan_codec = comm::Codec{};
  return out;
}

// The tensor streams' options: `credentials`, and with `links` each acknowledged send recorded against its peer
// worker and site, found from the address this actor dials it at.
comm::TensorStreamOptions LinkStreamOptions(const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                                            LinkMetrics* links, const ActorRanks& ranks,
                                            const std::vector<ActorPeer>& actors) {
  comm::TensorStreamOptions stream_options;
  stream_options.channel_credentials = credentials;
  if (links != nullptr) {
    std::map<std::string, std::string> worker_of_actor;
    for (const ActorPeer& a : actors) worker_of_actor[a.actor_id()] = a.worker_id();
    std::map<std::string, std::pair<std::string, std::string>> peer_at;  // address -> (worker id, site)
    for (const comm::PeerInfo& p : ranks.peers) peer_at[p.address] = {worker_of_actor[p.name], p.site};
    stream_options.on_acknowledged = [links, peer_at = std::move(peer_at)](const std::string& address, uint64_t bytes,
                                                                           absl::Duration took) {
      if (auto it = peer_at.find(address); it != peer_at.end()) {
        links->RecordSent(it->second.first, it->second.second, bytes, absl::ToDoubleSeconds(took));
      }
    };
  }
  return stream_options;
}

// Makes the gRPC communicators of a stage's groups over the worker's mailbox. Not owned: `ranks` and `mailbox`
// must outlive it.
class GroupMaker {
 public:
  GroupMaker(const ActorRanks& ranks, comm::TensorStreamServer* mailbox, const comm::CommunicatorOptions& coded)
      : ranks_(ranks), mailbox_(mailbox), coded_(coded) {}

  // The group of `members` (world ranks, one of them this actor), sending through `client`.
  std::unique_ptr<comm::GrpcCommunicator> Group(const std::vector<int>& members, comm::TensorStreamClient* client,
                                                const comm::CommunicatorOptions& options) const {
    std::vector<comm::PeerInfo> peers;
    int index = 0;
    for (size_t i = 0; i < members.size(); ++i) {
      peers.push_back(ranks_.peers[members[i]]);
      if (members[i] == ranks_.my_rank) index = static_cast<int>(i);
    }
    return std::make_unique<comm::GrpcCommunicator>(index, peers, mailbox_, client, options);
  }

  // A group of `members` with the spec's codecs that all-reduces as RouteOf says; *route is where its bytes cross
  // sites.
  std::unique_ptr<comm::GrpcCommunicator> Routed(const std::vector<int>& members, comm::TensorStreamClient* client,
                                                 AllReduceRoute* route) const {
    const GroupRoute r = RouteOf(members, ranks_);
    comm::CommunicatorOptions routed_options = coded_;
    routed_options.all_reduce = r.algorithm;
    *route = r.traffic;
    return Group(members, client, routed_options);
  }

 private:
  const ActorRanks& ranks_;
  comm::TensorStreamServer* const mailbox_;
  const comm::CommunicatorOptions coded_;
};

// The groups every actor has: the pipeline, the loss scalars across replicas, the replica's norm, and the
// tensor-parallel group on gRPC (StageCollectives::tp when tp > 1, until NCCL takes it).
void SetUpBaseGroups(const ActorRanks& ranks, comm::TensorStreamServer* mailbox, const GroupMaker& make,
                     const GroupOptions& options, GrpcStageCollectives& c) {
  c.pipeline_comm_ = std::make_unique<comm::GrpcCommunicator>(ranks.my_rank, ranks.peers, mailbox, &c.pipeline_client_,
                                                              options.activations);
  c.dp_scalars_comm_ = make.Group(ranks.DataParallelGroup(), &c.other_client_, options.exact);
  c.replica_comm_ = make.Group(ranks.ReplicaGroup(), &c.other_client_, options.exact);
  // Tensor parallelism sums activations (forward) and their gradients (backward): the activation codecs too.
  c.tp_comm_ = make.Group(ranks.TensorParallelGroup(), &c.other_client_, options.activations);
  c.tp_adapter_ = std::make_unique<CommunicatorTensorParallel>(c.tp_comm_.get());
  c.pipeline = c.pipeline_comm_.get();
  c.dp_scalars = c.dp_scalars_comm_.get();
  c.replica = c.replica_comm_.get();
  c.tp = ranks.tp > 1 ? c.tp_adapter_.get() : nullptr;
}

// The data-parallel group whose gradients this actor sums: this stage and tensor rank in every replica, or with
// DiLoCo in the replicas of its group.
struct InnerGroup {
  std::vector<int> members;   // world ranks
  std::vector<int> replicas;  // the replicas `members` holds this stage of
};

// DiLoCo (`diloco`: on, with dp > 1): the groups of replicas whose first stage shares a site (model/diloco.h
// DilocoGroups), the communicators inside this actor's group and between the groups' leaders, and c's DiLoCo fields.
// Then the data-parallel all-reduce on gRPC over the inner group. Errors: diloco.codec is unknown.
absl::StatusOr<InnerGroup> SetUpInnerGroup(const JobSpec& spec, const ActorRanks& ranks, bool diloco,
                                           const GroupMaker& make, const GroupOptions& options,
                                           GrpcStageCollectives& c) {
  const std::vector<int> dp_group = ranks.DataParallelGroup();
  // Every present replica (every replica, unless a live regroup left some out).
  c.inner_replicas = static_cast<int>(ranks.present.size());
  InnerGroup inner{.members = dp_group, .replicas = ranks.present};
  if (diloco) {  // never regrouped: every replica is present
    std::vector<std::string> replica_sites;
    for (int r = 0; r < ranks.dp; ++r) replica_sites.push_back(ranks.peers[ranks.WorldRank(r, 0, 0)].site);
    const std::vector<int> group_of = model::DilocoGroups(replica_sites);
    std::vector<int> leaders;  // world ranks of each group's lowest replica at this stage and tensor rank
    inner.members.clear();
    inner.replicas.clear();
    for (int r = 0; r < ranks.dp; ++r) {
      if (group_of[r] == group_of[ranks.replica]) {
        inner.members.push_back(dp_group[r]);
        inner.replicas.push_back(r);
      }
      if (group_of[r] == static_cast<int>(leaders.size())) leaders.push_back(dp_group[r]);
    }
    ASSIGN_OR_RETURN(comm::Codec outer_codec, comm::ParseCodec(EffectiveDiloco(spec).codec()));
    comm::CommunicatorOptions outer_options = options.exact;
    outer_options.wan_codec = outer_codec;
    c.inner_replicas = static_cast<int>(inner.members.size());
    c.diloco_group = group_of[ranks.replica];
    c.diloco_groups = static_cast<int>(leaders.size());
    c.diloco_leader = inner.members.front() == ranks.my_rank;
    c.outer_weight = static_cast<float>(c.inner_replicas) / static_cast<float>(ranks.dp);
    if (inner.members.size() > 1) {
      c.group_comm_ = make.Group(inner.members, &c.other_client_, options.exact);
      c.group = c.group_comm_.get();
    }
    const auto me = std::find(leaders.begin(), leaders.end(), ranks.my_rank);
    if (leaders.size() > 1 && me != leaders.end()) {
      c.outer_comm_ = make.Group(leaders, &c.outer_client_, outer_options);
      c.outer = c.outer_comm_.get();
      c.outer_route = {leaders[(me - leaders.begin() + 1) % leaders.size()], static_cast<int>(leaders.size())};
    }
  }
  if (inner.members.size() > 1) {
    c.dp_comm_ = make.Routed(inner.members, &c.dp_client_, &c.dp_route);
    c.dp_all_reduce = [comm = c.dp_comm_.get()](absl::Span<float> data, std::string_view tag) {
      return comm->AllReduceSum(data, tag);
    };
  }
  return inner;
}

// The tied embedding: with data parallelism on gRPC, one all-reduce over every copy of wte in the group's
// replicas (the first and last stage of each), routed as the data-parallel groups are, so that across sites
// each site's sum of them crosses once; the data-parallel buckets leave wte out. Summing each replica's pair
// and then each stage's replicas apart sent it across once per copy that crossed. With NCCL's data
// parallelism (at the first or the last stage: every copy's holder must build the same group) the pair of each
// replica's first and last stage, and wte goes with the buckets.
absl::Status SetUpTiedEmbedding(const std::vector<ActorPeer>& actors, const ActorRanks& ranks, bool diloco,
                                const std::vector<int>& inner_replicas, const GroupMaker& make,
                                GrpcStageCollectives& c) {
  bool tied_stages_on_nccl = false;
  if (!diloco && ranks.pp > 1 && (ranks.first_stage || ranks.last_stage)) {
    for (int stage : {0, ranks.pp - 1}) {
      ASSIGN_OR_RETURN(CollectivePlan stage_plan, PlanCollectives(actors, ranks.dp, ranks.pp, ranks.tp, ranks.replica,
                                                                  stage, ranks.tp_rank, kNcclBuiltWhereCudaRuns));
      tied_stages_on_nccl = tied_stages_on_nccl || stage_plan.dp.use;
    }
  }
  c.tied_over_replicas = !tied_stages_on_nccl && inner_replicas.size() > 1;
  if (const std::vector<int> tied =
          ranks.TiedEmbeddingGroup(c.tied_over_replicas ? inner_replicas : std::vector<int>{ranks.replica});
      !tied.empty()) {
    c.tied_comm_ = make.Routed(tied, &c.tied_client_, &c.tied_route);
    c.tied = c.tied_comm_.get();
  } else {
    c.tied_over_replicas = false;
  }
  return absl::OkStatus();
}

#ifdef GEOTRAIN_HAVE_CUDA
// The groups `plan` puts on NCCL, formed through the head's rendezvous (`head`, `token`; each collective with
// `timeout`): the data-parallel sum inside the site (hierarchical, with a gRPC ring among the site leaders, when the
// group spans sites) with its buckets on the device, and the tensor-parallel all-reduces.
absl::Status SetUpNcclGroups(const CollectivePlan& plan, const ActorRanks& ranks, model::Backend* backend,
                             int device_index, internal::HeadControl::StubInterface* head, const std::string& token,
                             absl::Duration timeout, const GroupMaker& make, const GroupOptions& options,
                             GrpcStageCollectives& c) {
  if ((plan.tp_nccl || plan.dp.use) && head == nullptr) {
    return absl::UnavailableError("a CUDA actor's NCCL groups need the head for their rendezvous");
  }
  const int r = ranks.replica, s = ranks.stage, t = ranks.tp_rank;
  if (plan.dp.use) {
    const DataParallelNccl& d = plan.dp;
    // With several sites, a non-leader's NCCL broadcast waits while its leader all-reduces over the WAN
    // (each with the collective deadline) and while remote sites finish their backward: twice the deadline.
    const absl::Duration site_timeout = d.leader_replicas.size() > 1 ? 2 * timeout + absl::Seconds(30) : timeout;
    ASSIGN_OR_RETURN(c.nccl_dp_,
                     comm::CreateNcclCommunicatorWithRendezvous(
                         head, token, ranks.job_id,
                         absl::StrCat("attempt", ranks.attempt, "/nccl/dp/stage", s, "/tp", t, "/site-", d.site),
                         d.site_rank, static_cast<int>(d.site_replicas.size()), device_index, site_timeout));
    if (d.leader_replicas.size() == 1) {  // one site: NCCL all-reduces the whole group
      c.dp_all_reduce = [nccl = c.nccl_dp_.get()](absl::Span<float> data, std::string_view tag) {
        return nccl->AllReduceSum(data, tag);
      };
    } else {
      if (d.leader_index >= 0) {
        std::vector<int> leader_ranks;
        for (int x : d.leader_replicas) leader_ranks.push_back(ranks.WorldRank(x, s, t));
        c.dp_leaders_ = make.Group(leader_ranks, &c.dp_client_, options.coded);
      }
      ASSIGN_OR_RETURN(c.nccl_dp_hierarchical_,
                       comm::NcclHierarchicalAllReduce::Create(c.nccl_dp_.get(), c.dp_leaders_.get()));
      c.dp_all_reduce = [h = c.nccl_dp_hierarchical_.get()](absl::Span<float> data, std::string_view tag) {
        return h->AllReduceSum(data, tag);
      };
      // The site leaders' ring carries the gRPC traffic; the others send nothing through dp_client.
      const int ring = static_cast<int>(d.leader_replicas.size());
      c.dp_route = {ranks.WorldRank(d.leader_replicas[(std::max(d.leader_index, 0) + 1) % ring], s, t), ring};
    }
    model::cuda::CudaContext* context = model::CudaContextOf(*backend);
    if (context == nullptr) return absl::InternalError("a CUDA stage without a CUDA context");
    c.bucket_memory_ = std::make_unique<comm::DeviceBucketMemory>(device_index, context->stream());
    c.dp_bucket_memory = c.bucket_memory_.get();
    c.dp_on_device = true;
  }
  if (plan.tp_nccl) {
    ASSIGN_OR_RETURN(
        std::unique_ptr<comm::NcclCommunicator> nccl,
        comm::CreateNcclCommunicatorWithRendezvous(
            head, token, ranks.job_id, absl::StrCat("attempt", ranks.attempt, "/nccl/tp/replica", r, "/stage", s), t,
            ranks.tp, device_index, timeout));
    c.nccl_tp_ = std::make_unique<NcclTensorParallel>(std::move(nccl), backend);
    c.tp = c.nccl_tp_.get();
    c.tp_nccl = true;
  }
  return absl::OkStatus();
}
#endif

}  // namespace

GrpcCollectivesFactory::GrpcCollectivesFactory(comm::TensorStreamServer* mailbox, std::string token,
                                               internal::HeadControl::StubInterface* head, absl::Duration timeout,
                                               std::shared_ptr<grpc::ChannelCredentials> credentials,
                                               LinkMetrics* links)
    : mailbox_(mailbox),
      token_(std::move(token)),
      head_(head),
      timeout_(timeout),
      credentials_(std::move(credentials)),
      links_(links) {}

absl::StatusOr<std::unique_ptr<StageCollectives>> GrpcCollectivesFactory::Create(const ActorRanks& ranks,
                                                                                 const JobSpec& spec,
                                                                                 const std::vector<ActorPeer>& actors,
                                                                                 model::Backend* backend,
                                                                                 int device_index) {
  ASSIGN_OR_RETURN(GroupOptions options, MakeGroupOptions(spec, ranks, timeout_));
  for (comm::CommunicatorOptions* o : {&options.coded, &options.activations, &options.exact}) {
    o->on_peer_unavailable = on_peer_unavailable_;
  }
  auto out = std::make_unique<GrpcStageCollectives>(token_, LinkStreamOptions(credentials_, links_, ranks, actors),
                                                    ranks, mailbox_, ranks.comm_job_id);
  GrpcStageCollectives& c = *out;
  const GroupMaker make(ranks, mailbox_, options.coded);
  SetUpBaseGroups(ranks, mailbox_, make, options, c);
  const bool diloco = DilocoOn(spec) && ranks.dp > 1;
  ASSIGN_OR_RETURN(const InnerGroup inner, SetUpInnerGroup(spec, ranks, diloco, make, options, c));

  // Which groups run on NCCL: decided alike by every member from the actor list (worker/collectives.h).
  ASSIGN_OR_RETURN(CollectivePlan plan, PlanCollectives(actors, ranks.dp, ranks.pp, ranks.tp, ranks.replica,
                                                        ranks.stage, ranks.tp_rank, kNcclBuilt));
  if (diloco) plan.dp.use = false;  // DiLoCo's groups run on the gRPC rings above
  c.notes = plan.notes;

  RETURN_IF_ERROR(SetUpTiedEmbedding(actors, ranks, diloco, inner.replicas, make, c));
  ASSIGN_OR_RETURN(c.split_replicated, SplitReplicatedTensors(actors, ranks, diloco));
  if (ranks.tp > 1) {
    c.tp_exact_comm_ = make.Group(ranks.TensorParallelGroup(), &c.other_client_, options.exact);
    c.tp_exact = c.tp_exact_comm_.get();
  }
  if (!backend->is_cuda() && (plan.tp_nccl || plan.dp.use)) {
    return absl::InternalError(absl::StrCat("actor ", ranks.peers[ranks.my_rank].name, " runs on ", backend->name(),
                                            " but the head lists it on a CUDA device"));
  }
#ifdef GEOTRAIN_HAVE_CUDA
  RETURN_IF_ERROR(SetUpNcclGroups(plan, ranks, backend, device_index, head_, token_, timeout_, make, options, c));
#else
  (void)device_index;
#endif
  return out;
}

}  // namespace geotrain::worker
