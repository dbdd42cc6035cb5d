// Stage actor: the training loop of one (replica, stage, tensor rank), its schedules and collectives.
#include "worker/stage_actor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>

#include "absl/strings/str_cat.h"
#include "comm/codec.h"
#include "comm/communicator.h"
#include "common/log.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/data.h"
#include "model/gpt2.h"
#include "model/optimizer.h"
#include "worker/collectives.h"

#ifdef GEOTRAIN_HAVE_CUDA
#include "comm/nccl_communicator.h"
#include "model/cuda/ops_cuda.h"
#include "model/cuda_backend.h"
#endif

namespace geotrain::worker {
namespace {

using Clock = std::chrono::steady_clock;

#ifdef GEOTRAIN_HAVE_CUDA
constexpr bool kNcclBuilt = true;
#else
constexpr bool kNcclBuilt = false;
#endif

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// model::TensorParallelComm over a GrpcCommunicator of the stage's tensor-parallel group.
class GrpcTensorParallelComm : public model::TensorParallelComm {
 public:
  explicit GrpcTensorParallelComm(comm::Communicator* comm) : comm_(comm) {}
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
class NcclTensorParallelComm : public model::TensorParallelComm {
 public:
  NcclTensorParallelComm(std::unique_ptr<comm::NcclCommunicator> comm, model::Backend* backend)
      : comm_(std::move(comm)), backend_(backend) {}
  absl::Status AllReduceSum(float* data, int64_t n) override {
    if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
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

// Bytes a client sent, attributed to site pairs (for WAN accounting per step).
struct Traffic {
  std::map<std::string, int64_t> wan_bytes;
  double raw_wan_bytes = 0;
  double encoded_wan_bytes = 0;
  void Add(const std::string& src, const std::string& dst, uint64_t encoded, double raw) {
    if (src == dst || encoded == 0) return;
    wan_bytes[absl::StrCat(src, ">", dst)] += static_cast<int64_t>(encoded);
    raw_wan_bytes += raw;
    encoded_wan_bytes += static_cast<double>(encoded);
  }
};

// Sends activations and their gradients on a background thread, in order, so that a stage computes
// its next microbatch while the previous one crosses a slow link (a send returns only once the peer
// holds the tensor: a round trip). Send() copies the data; Flush() waits for everything queued and
// returns the first error. The thread owns the client's counters while it runs.
class AsyncSender {
 public:
  AsyncSender(comm::Communicator* comm, comm::TensorStreamClient* client, std::string my_site)
      : comm_(comm), client_(client), my_site_(std::move(my_site)), thread_([this] { Loop(); }) {}
  // Drops whatever is still queued (the step is being abandoned) and joins; a send in flight ends at
  // its deadline.
  ~AsyncSender() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      queue_.clear();
    }
    thread_.join();
  }

  void Send(int peer, const std::string& peer_site, const float* data, size_t n, const char* tag) {
    absl::MutexLock lock(&mu_);
    queue_.push_back({peer, peer_site, std::vector<float>(data, data + n), tag});
  }

  // Waits until every queued tensor was delivered; moves this step's traffic into `traffic`.
  absl::Status Flush(Traffic* traffic) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](AsyncSender* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
          return (self->queue_.empty() && !self->busy_) || !self->error_.ok();
        },
        this));
    for (const auto& [pair, bytes] : traffic_.wan_bytes) traffic->wan_bytes[pair] += bytes;
    traffic->raw_wan_bytes += traffic_.raw_wan_bytes;
    traffic->encoded_wan_bytes += traffic_.encoded_wan_bytes;
    traffic_ = Traffic{};
    return error_;
  }

 private:
  struct Item {
    int peer;
    std::string site;
    std::vector<float> data;
    const char* tag;
  };
  void Loop() {
    while (true) {
      Item item;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](AsyncSender* self)
                 ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) { return self->stop_ || !self->queue_.empty(); },
            this));
        if (queue_.empty()) return;  // stopping
        item = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      const auto before = client_->stats().bytes_sent;
      absl::Status st = comm_->Send(item.peer, absl::MakeConstSpan(item.data), item.tag);
      const auto sent = client_->stats().bytes_sent - before;
      absl::MutexLock lock(&mu_);
      traffic_.Add(my_site_, item.site, sent, 4.0 * item.data.size());
      if (!st.ok() && error_.ok()) error_ = st;
      if (!error_.ok()) queue_.clear();  // later sends of the step are moot
      busy_ = false;
    }
  }

  comm::Communicator* const comm_;
  comm::TensorStreamClient* const client_;
  const std::string my_site_;
  absl::Mutex mu_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  Traffic traffic_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace

StageActor::StageActor(StageActorConfig config, comm::TensorStreamServer* server)
    : config_(std::move(config)), server_(server) {
  auto channel = MakeChannel(config_.head_address, config_.tls);
  if (channel.ok()) head_ = Head::NewStub(*channel);
}

StageActor::~StageActor() {
  Stop("the worker is shutting down");
  if (thread_.joinable()) thread_.join();
}

void StageActor::Start() {
  thread_ = std::thread([this] {
    absl::Status s = Run();
    if (!s.ok()) {
      const std::string why = stop_ ? absl::StrCat("stopped: ", s.message()) : std::string(s.message());
      GT_LOG(WARNING) << "actor " << config_.actor.actor_id() << " ended: " << why;
      SetState(ACTOR_DEAD, why);
      if (!stop_) {
        StepReport report;
        report.set_job_id(config_.actor.job_id());
        report.set_actor_id(config_.actor.actor_id());
        report.set_error(why);
        Report(report);
      }
    }
    absl::MutexLock lock(&mu_);
    finished_ = true;
  });
}

void StageActor::Stop(const std::string& reason) {
  if (!stop_.exchange(true)) {
    absl::MutexLock lock(&mu_);
    if (state_ != ACTOR_DEAD) message_ = reason;
  }
}

bool StageActor::finished() const {
  absl::MutexLock lock(&mu_);
  return finished_;
}

ActorRecord StageActor::Record() const {
  ActorRecord r = config_.actor;
  absl::MutexLock lock(&mu_);
  r.set_state(state_);
  r.set_message(message_);
  return r;
}

void StageActor::SetState(ActorState state, const std::string& message) {
  absl::MutexLock lock(&mu_);
  state_ = state;
  message_ = message;
}

void StageActor::Report(const StepReport& report) {
  if (!head_) return;
  // The last report and an error decide the job's end: they are retried (about a minute in all);
  // an ordinary step report is tried once.
  const bool decisive = report.done() || !report.error().empty();
  grpc::Status s;
  ReportStepReply reply;
  for (int attempt = 0, backoff_ms = 500; attempt < (decisive ? 8 : 1); ++attempt, backoff_ms *= 2) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(std::min(backoff_ms, 8000)));
    grpc::ClientContext ctx;
    AttachToken(&ctx, config_.token);
    SetDeadlineMillis(&ctx, 5000);
    s = head_->ReportStep(&ctx, report, &reply);
    if (s.ok()) break;
  }
  if (!s.ok()) {
    GT_LOG(WARNING) << "actor " << config_.actor.actor_id() << ": cannot report step " << report.step()
                    << " to the head: " << s.error_message();
  } else if (reply.stop()) {
    Stop("the head stopped the job");
  }
}

absl::Status StageActor::Run() {
  const JobSpec& spec = config_.spec;
  const ActorRecord& me = config_.actor;
  auto config = GPT2Config::FromSpec(spec.model());
  if (!config.ok()) return config.status();
  const int dp = spec.parallel().dp(), pp = spec.parallel().pp(), tp = spec.parallel().tp();
  const int M = spec.parallel().microbatches();
  const int T = spec.train().seq_len();
  const int B_replica = spec.train().global_batch() / dp;
  const int Bm = B_replica / M;
  if (Bm <= 0 || B_replica % M != 0) {
    return absl::InvalidArgumentError("global_batch must be a multiple of dp x microbatches");
  }
  const int r = me.replica(), s = me.stage(), t = me.tp_rank();
  const bool first = s == 0, last = s == pp - 1;
  const bool one_f_one_b = spec.parallel().schedule() == "1f1b";

  // Ranks: world rank of (replica, stage, tp rank) = (replica * pp + stage) * tp + tp rank.
  auto world_rank = [pp, tp](int replica, int stage, int rank) { return (replica * pp + stage) * tp + rank; };
  const int world = dp * pp * tp;
  std::vector<comm::PeerInfo> peers(world);
  std::vector<bool> seen(world, false);
  for (const ActorPeer& p : config_.peers) {
    const int w = world_rank(p.replica(), p.stage(), p.tp_rank());
    if (w < 0 || w >= world || seen[w]) {
      return absl::InvalidArgumentError(
          absl::StrCat("actor list of job ", me.job_id(), " is inconsistent at ", p.actor_id()));
    }
    seen[w] = true;
    auto via = p.address_for_site().find(config_.site);
    peers[w] = {p.actor_id(), via != p.address_for_site().end() ? via->second : p.address(), p.site()};
  }
  if (std::count(seen.begin(), seen.end(), false) > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("job ", me.job_id(), " lists ", config_.peers.size(), " actors; its plan needs ", world));
  }
  const int my_rank = world_rank(r, s, t);

  auto wan = comm::ParseCodec(spec.comm().wan_codec());
  if (!wan.ok()) return wan.status();
  auto lan = comm::ParseCodec(spec.comm().lan_codec());
  if (!lan.ok()) return lan.status();
  comm::CommunicatorOptions options;
  options.job_id = me.job_id();
  options.lan_codec = *lan;
  options.wan_codec = *wan;
  options.timeout = absl::Milliseconds(config_.collective_timeout_ms);
  // Activations never go through top-k (it is for gradients): they use the codec's dense part.
  comm::CommunicatorOptions p2p_options = options;
  if (p2p_options.wan_codec.kind == comm::CodecKind::kTopK) p2p_options.wan_codec = comm::Codec{};
  if (p2p_options.lan_codec.kind == comm::CodecKind::kTopK) p2p_options.lan_codec = comm::Codec{};

  // One client per traffic class, so that each step's bytes can be attributed.
  comm::TensorStreamClient p2p_client(config_.token), dp_client(config_.token), misc_client(config_.token);
  comm::GrpcCommunicator p2p(my_rank, peers, server_, &p2p_client, p2p_options);
  // Scalars (gradient norm, loss) always travel exactly.
  comm::CommunicatorOptions exact_options = options;
  exact_options.lan_codec = comm::Codec{};
  exact_options.wan_codec = comm::Codec{};
  auto group = [&](const std::vector<int>& ranks, comm::TensorStreamClient* client,
                   const comm::CommunicatorOptions& group_options) {
    std::vector<comm::PeerInfo> members;
    int index = 0;
    for (size_t i = 0; i < ranks.size(); ++i) {
      members.push_back(peers[ranks[i]]);
      if (ranks[i] == my_rank) index = static_cast<int>(i);
    }
    return std::make_unique<comm::GrpcCommunicator>(index, members, server_, client, group_options);
  };
  std::vector<int> dp_ranks, replica_ranks, tp_ranks;
  for (int x = 0; x < dp; ++x) dp_ranks.push_back(world_rank(x, s, t));
  for (int x = 0; x < pp; ++x)
    for (int y = 0; y < tp; ++y) replica_ranks.push_back(world_rank(r, x, y));
  for (int y = 0; y < tp; ++y) tp_ranks.push_back(world_rank(r, s, y));
  auto dp_comm = group(dp_ranks, &dp_client, options);
  auto dp_scalars = group(dp_ranks, &misc_client, exact_options);
  auto replica_comm = group(replica_ranks, &misc_client, exact_options);
  auto tp_comm = group(tp_ranks, &misc_client, options);
  std::unique_ptr<comm::GrpcCommunicator> tied_comm;
  if (pp > 1 && (first || last)) {
    tied_comm = group({world_rank(r, 0, t), world_rank(r, pp - 1, t)}, &misc_client, options);
  }
  GrpcTensorParallelComm tp_adapter(tp_comm.get());

  // The device: on a CUDA worker the stage's parameters, gradients, optimizer state and activations live
  // on its GPU (bf16 GEMMs, fp32 master weights); activations bound for other actors cross through host
  // buffers; the collective groups whose members are all CUDA stages (worker/collectives.h) run on NCCL
  // on device memory: tensor-parallel all-reduces, and the data-parallel gradient buckets.
  std::unique_ptr<model::Backend> device_backend;
  model::Backend* backend = model::CpuBackendInstance();
  if (config_.device != "cpu") {
    auto made = model::MakeBackend(config_.device, model::Precision::kBf16);
    if (!made.ok()) return made.status();
    device_backend = std::move(*made);
    backend = device_backend.get();
  }
  const bool on_device = backend->is_cuda();
  // Which groups run on NCCL: decided alike by every member from the actor list (worker/collectives.h).
  absl::StatusOr<CollectivePlan> collectives = PlanCollectives(config_.peers, dp, pp, tp, r, s, t, kNcclBuilt);
  if (!collectives.ok()) return collectives.status();
  if (!on_device && (collectives->tp_nccl || collectives->dp.use)) {
    return absl::InternalError(
        absl::StrCat("actor ", me.actor_id(), " runs on ", backend->name(), " but the head lists it on a CUDA device"));
  }
  for (const std::string& note : collectives->notes) GT_LOG(INFO) << "actor " << me.actor_id() << ": " << note;
  model::TensorParallelComm* stage_tp = tp > 1 ? &tp_adapter : nullptr;
  // The data-parallel all-reduce of a bucket: gRPC on host memory, or NCCL on device memory.
  comm::AllReduceFn dp_all_reduce = [c = dp_comm.get()](absl::Span<float> data, std::string_view tag) {
    return c->AllReduceSum(data, tag);
  };
  std::unique_ptr<comm::BucketMemory> dp_bucket_memory;  // null: host memory
  std::unique_ptr<comm::GrpcCommunicator> dp_leaders;    // NCCL data parallelism: the site leaders' ring
#ifdef GEOTRAIN_HAVE_CUDA
  std::unique_ptr<NcclTensorParallelComm> nccl_tp;
  std::unique_ptr<comm::NcclCommunicator> nccl_dp;
  std::unique_ptr<comm::NcclHierarchicalAllReduce> nccl_dp_hierarchical;
  if ((collectives->tp_nccl || collectives->dp.use) && !head_) {
    return absl::UnavailableError("a CUDA actor's NCCL groups need the head for their rendezvous");
  }
  if (collectives->dp.use) {
    const DataParallelNccl& d = collectives->dp;
    // With several sites, a non-leader's NCCL broadcast waits while its leader all-reduces over the WAN
    // (each with the collective deadline) and while remote sites finish their backward: twice the deadline.
    const int64_t site_timeout_ms =
        d.leader_replicas.size() > 1 ? 2 * config_.collective_timeout_ms + 30000 : config_.collective_timeout_ms;
    auto nccl = comm::CreateNcclCommunicatorWithRendezvous(head_.get(), config_.token, me.job_id(),
                                                           absl::StrCat("nccl/dp/stage", s, "/tp", t, "/site-", d.site),
                                                           d.site_rank, static_cast<int>(d.site_replicas.size()),
                                                           config_.device_index, absl::Milliseconds(site_timeout_ms));
    if (!nccl.ok()) return nccl.status();
    nccl_dp = std::move(*nccl);
    if (d.leader_replicas.size() == 1) {  // one site: NCCL all-reduces the whole group
      dp_all_reduce = [c = nccl_dp.get()](absl::Span<float> data, std::string_view tag) {
        return c->AllReduceSum(data, tag);
      };
    } else {
      if (d.leader_index >= 0) {
        std::vector<int> leader_ranks;
        for (int x : d.leader_replicas) leader_ranks.push_back(world_rank(x, s, t));
        dp_leaders = group(leader_ranks, &dp_client, options);
      }
      auto h = comm::NcclHierarchicalAllReduce::Create(nccl_dp.get(), dp_leaders.get());
      if (!h.ok()) return h.status();
      nccl_dp_hierarchical = std::move(*h);
      dp_all_reduce = [h = nccl_dp_hierarchical.get()](absl::Span<float> data, std::string_view tag) {
        return h->AllReduceSum(data, tag);
      };
    }
    model::cuda::CudaContext* context = model::CudaContextOf(*backend);
    if (context == nullptr) return absl::InternalError("a CUDA stage without a CUDA context");
    dp_bucket_memory = std::make_unique<comm::DeviceBucketMemory>(config_.device_index, context->stream());
  }
  if (collectives->tp_nccl) {
    auto nccl = comm::CreateNcclCommunicatorWithRendezvous(
        head_.get(), config_.token, me.job_id(), absl::StrCat("nccl/tp/replica", r, "/stage", s), t, tp,
        config_.device_index, absl::Milliseconds(config_.collective_timeout_ms));
    if (!nccl.ok()) return nccl.status();
    nccl_tp = std::make_unique<NcclTensorParallelComm>(std::move(*nccl), backend);
    stage_tp = nccl_tp.get();
  }
#endif

  model::StageOptions stage_options = model::StageOptions::Split(*config, s, pp);
  stage_options.tp_comm = stage_tp;
  stage_options.backend = backend;
  stage_options.max_batch = Bm;
  stage_options.max_seq_len = T;
  auto created = model::GPT2Stage::Create(*config, stage_options);
  if (!created.ok()) return created.status();
  model::GPT2Stage& stage = **created;
  stage.InitializeWeights(spec.train().seed());
  model::AdamWOptions adam_options;
  adam_options.beta1 = static_cast<float>(spec.train().beta1());
  adam_options.beta2 = static_cast<float>(spec.train().beta2());
  adam_options.weight_decay = static_cast<float>(spec.train().weight_decay());
  auto adam_created = model::AdamW::Create(stage.num_params(), stage.segments(), adam_options, *backend);
  if (!adam_created.ok()) return adam_created.status();
  model::AdamW& adam = **adam_created;
  model::LearningRateSchedule schedule;
  schedule.max_lr = spec.train().lr();
  schedule.min_lr = spec.train().min_lr();
  schedule.warmup_steps = spec.train().warmup_steps();
  schedule.total_steps = spec.train().steps();

  std::unique_ptr<model::DataLoader> loader;
  if (first || last) {
    auto l = model::DataLoader::Create(spec.data().train(), B_replica, T, r, dp, config->vocab_size);
    if (!l.ok()) return l.status();
    loader = std::move(*l);
  }
  std::vector<int32_t> inputs(static_cast<size_t>(B_replica) * T), targets(inputs.size());
  const size_t act = static_cast<size_t>(Bm) * T * config->n_embd;
  std::vector<std::vector<float>> stage_inputs(first ? 0 : M, std::vector<float>(act));
  std::vector<float> doutput(last ? 0 : act);
  const float loss_scale = 1.0f / static_cast<float>(M * dp);
  const int next_rank = last ? -1 : world_rank(r, s + 1, t);
  const int prev_rank = first ? -1 : world_rank(r, s - 1, t);
  const std::string& my_site = config_.site;

  // Data parallelism: the replicas' gradients are summed in buckets, each all-reduced as soon as the last
  // microbatch's backward has finished its layers, overlapped with the backward of earlier layers (each
  // replica scaled its loss by 1 / (M dp)). The embeddings and final LayerNorm go last, after the
  // tied-embedding sum.
  // On a device, the activations in and out cross through these host buffers, and so do the gradients of
  // the tied-embedding sum and of a data-parallel all-reduce on gRPC.
  model::DeviceBuffer device_input, device_doutput;
  std::vector<float> host_output, host_dinput, host_grads;
  if (on_device) {
    const size_t act_bytes = act * sizeof(float);
    if (!first) {
      auto b = model::DeviceBuffer::Allocate(*backend, act_bytes);
      if (!b.ok()) return b.status();
      device_input = std::move(*b);
      host_dinput.resize(act);
    }
    if (!last) {
      auto b = model::DeviceBuffer::Allocate(*backend, act_bytes);
      if (!b.ok()) return b.status();
      device_doutput = std::move(*b);
      host_output.resize(act);
    }
    if ((dp > 1 && !dp_bucket_memory) || tied_comm) host_grads.resize(static_cast<size_t>(stage.num_params()));
  }
  // The host span standing for a span of the stage's gradients: itself on the CPU, its place in the
  // host mirror on a device.
  auto host_view = [&](absl::Span<float> grads) {
    if (!on_device) return grads;
    return absl::MakeSpan(host_grads.data() + (grads.data() - stage.grads()), grads.size());
  };
  auto copy_out = [&](const std::vector<absl::Span<float>>& spans) -> absl::Status {
    if (!on_device) return absl::OkStatus();
    for (const absl::Span<float>& g : spans) {
      if (absl::Status st = backend->CopyToHost(host_view(g).data(), g.data(), g.size() * sizeof(float)); !st.ok()) {
        return st;
      }
    }
    return absl::OkStatus();
  };

  const int num_layers = stage.last_layer() - stage.first_layer();
  // With NCCL the buckets live on the device and take the gradients where backward leaves them; otherwise
  // they take them from the host mirror, which the device copies them to as each layer finishes.
  const bool dp_on_device = dp_bucket_memory != nullptr;
  auto dp_view = [&](absl::Span<float> g) { return dp_on_device ? g : host_view(g); };
  // Two NCCL communicators of one device running at once can deadlock when ranks issue them in different
  // orders (NCCL's documentation), so with NCCL tensor parallelism the device buckets start after backward.
  const bool overlap_dp = !(dp_on_device && collectives->tp_nccl);
  std::unique_ptr<comm::GradientBuckets> grad_buckets;
  if (dp > 1) {
    std::vector<std::vector<absl::Span<float>>> groups;
    for (int l = num_layers - 1; l >= 0; --l) {
      groups.emplace_back();
      for (absl::Span<float> g : stage.LayerGradientSpans(l)) groups.back().push_back(dp_view(g));
    }
    groups.emplace_back();
    for (absl::Span<float> g : stage.NonLayerGradientSpans()) groups.back().push_back(dp_view(g));
    const double bucket_mb = spec.comm().grad_bucket_mb() > 0 ? spec.comm().grad_bucket_mb() : 25.0;
    grad_buckets = std::make_unique<comm::GradientBuckets>(dp_all_reduce, dp_bucket_memory.get(), std::move(groups),
                                                           static_cast<int64_t>(bucket_mb * (1 << 20)));
    if (!grad_buckets->status().ok()) return grad_buckets->status();
  }

  AsyncSender sender(&p2p, &p2p_client, config_.site);
  SetState(ACTOR_ALIVE, "training");
  GT_LOG(INFO) << "actor " << me.actor_id() << " (replica " << r << ", stage " << s << " of " << pp << ", tp rank " << t
               << ") training " << stage.num_params() << " parameters, layers [" << stage.first_layer() << ", "
               << stage.last_layer() << ") on " << backend->name()
               << (grad_buckets ? absl::StrCat("; gradient all-reduce in ", grad_buckets->num_buckets(), " buckets ",
                                               overlap_dp ? "overlapped with backward" : "after backward",
                                               dp_on_device ? ", on NCCL inside the site" : "")
                                : std::string())
               << (collectives->tp_nccl ? "; tensor-parallel all-reduces on NCCL" : "");

  for (int step = 1; step <= spec.train().steps(); ++step) {
    const auto step_start = Clock::now();
    double compute = 0, wait = 0, bubble = 0;
    Traffic traffic;
    const uint64_t dp_bytes_before = dp_client.stats().bytes_sent;
    if (loader) loader->Next(inputs.data(), targets.data());
    stage.ZeroGrad();
    double loss_sum = 0;
    int latest_forward = -1;
    bool first_op = true;

    // Sends through `client` to `peer`, attributing the bytes to the site pair.
    auto timed_send = [&](int peer, const float* data, size_t n, const char* tag) -> absl::Status {
      sender.Send(peer, peers[peer].site, data, n, tag);
      return absl::OkStatus();
    };

    auto forward = [&](int m, bool recompute) -> absl::Status {
      const int32_t* tok = first ? inputs.data() + static_cast<size_t>(m) * Bm * T : nullptr;
      const int32_t* tgt = last ? targets.data() + static_cast<size_t>(m) * Bm * T : nullptr;
      const float* in = nullptr;
      if (!first) {
        if (!recompute) {
          const auto t0 = Clock::now();
          if (absl::Status st = p2p.Recv(prev_rank, absl::MakeSpan(stage_inputs[m]), "act"); !st.ok()) return st;
          const double waited = SecondsSince(t0);
          wait += waited;
          if (first_op) bubble += waited;  // pipeline fill
        }
        in = stage_inputs[m].data();
        if (on_device) {
          if (absl::Status st = backend->CopyToDevice(device_input.as<float>(), in, act * sizeof(float)); !st.ok()) {
            return st;
          }
          in = device_input.as<float>();
        }
      }
      first_op = false;
      const auto t0 = Clock::now();
      if (absl::Status st = stage.Forward(Bm, T, tok, in, tgt); !st.ok()) return st;
      compute += SecondsSince(t0);
      latest_forward = m;
      if (recompute) return absl::OkStatus();
      if (last) {
        loss_sum += stage.loss();
        return absl::OkStatus();
      }
      const float* out = stage.output();
      if (on_device) {
        if (absl::Status st = backend->CopyToHost(host_output.data(), out, act * sizeof(float)); !st.ok()) return st;
        out = host_output.data();
      }
      return timed_send(next_rank, out, act, "act");
    };
    auto backward = [&](int m) -> absl::Status {
      if (latest_forward != m) {
        if (absl::Status st = forward(m, /*recompute=*/true); !st.ok()) return st;
      }
      if (!last) {
        const auto t0 = Clock::now();
        if (absl::Status st = p2p.Recv(next_rank, absl::MakeSpan(doutput), "grad"); !st.ok()) return st;
        wait += SecondsSince(t0);
      }
      const auto t0 = Clock::now();
      const float* dout = last ? nullptr : doutput.data();
      if (on_device && !last) {
        if (absl::Status st = backend->CopyToDevice(device_doutput.as<float>(), dout, act * sizeof(float)); !st.ok()) {
          return st;
        }
        dout = device_doutput.as<float>();
      }
      absl::Status hook_status;
      if (grad_buckets && overlap_dp && m == M - 1) {  // the step's gradients become final layer by layer
        stage.set_layer_gradients_ready([&](int l) {
          if (l < 0 || !hook_status.ok()) return;
          if (!dp_on_device) hook_status = copy_out(stage.LayerGradientSpans(l));
          if (hook_status.ok()) grad_buckets->GroupReady(num_layers - 1 - l);
        });
      }
      absl::Status backward_status = stage.Backward(dout, loss_scale);
      stage.set_layer_gradients_ready(nullptr);
      if (!backward_status.ok()) return backward_status;
      if (!hook_status.ok()) return hook_status;
      compute += SecondsSince(t0);
      latest_forward = -1;  // Backward consumed the activations
      if (first) return absl::OkStatus();
      const float* din = stage.dinput();
      if (on_device) {
        if (absl::Status st = backend->CopyToHost(host_dinput.data(), din, act * sizeof(float)); !st.ok()) return st;
        din = host_dinput.data();
      }
      return timed_send(prev_rank, din, act, "grad");
    };

    // The schedule.
    const int warmup = one_f_one_b ? std::min(pp - s - 1, M) : M;
    int next_forward = 0, next_backward = 0;
    for (; next_forward < warmup; ++next_forward) {
      if (stop_) return absl::CancelledError("stop requested");
      if (absl::Status st = forward(next_forward, false); !st.ok()) return st;
    }
    while (next_backward < M) {
      if (stop_) return absl::CancelledError("stop requested");
      if (next_forward < M) {
        if (absl::Status st = forward(next_forward++, false); !st.ok()) return st;
      }
      if (absl::Status st = backward(next_backward++); !st.ok()) return st;
    }

    const auto sync_start = Clock::now();
    if (grad_buckets && !overlap_dp) {
      for (int g = 0; g < num_layers; ++g) grad_buckets->GroupReady(g);
    }
    if (absl::Status st = sender.Flush(&traffic); !st.ok()) return st;
    // Tied embedding: the first and last stage hold copies of wte; each needs the sum of both grads.
    if (tied_comm) {
      const model::ParameterTensors& g = stage.grad_tensors();
      const size_t n = static_cast<size_t>(config->padded_vocab_size) * config->n_embd;
      const auto before = misc_client.stats().bytes_sent;
      const absl::Span<float> wte = absl::MakeSpan(g.wte, n);
      if (absl::Status st = copy_out({wte}); !st.ok()) return st;
      if (absl::Status st = tied_comm->AllReduceSum(host_view(wte), "tied"); !st.ok()) return st;
      if (on_device) {
        if (absl::Status st = backend->CopyToDevice(g.wte, host_view(wte).data(), n * sizeof(float)); !st.ok()) {
          return st;
        }
      }
      const int partner = first ? world_rank(r, pp - 1, t) : world_rank(r, 0, t);
      traffic.Add(my_site, peers[partner].site, misc_client.stats().bytes_sent - before, 4.0 * n);
    }
    if (grad_buckets) {
      if (!dp_on_device) {
        if (absl::Status st = copy_out(stage.NonLayerGradientSpans()); !st.ok()) return st;
      }
      grad_buckets->GroupReady(num_layers);  // the embeddings and final LayerNorm
      if (absl::Status st = grad_buckets->Finish(); !st.ok()) return st;
      if (on_device && !dp_on_device) {  // the groups cover the gradients exactly once: the mirror is the sums
        if (absl::Status st =
                backend->CopyToDevice(stage.grads(), host_grads.data(), host_grads.size() * sizeof(float));
            !st.ok()) {
          return st;
        }
      }
      // The ring's successor: among all replicas, or among the site leaders with NCCL (the others send
      // nothing through dp_client).
      const std::vector<int>& leaders = collectives->dp.leader_replicas;
      const int ring = dp_leaders ? static_cast<int>(leaders.size()) : dp;
      const int successor =
          dp_leaders ? world_rank(leaders[(collectives->dp.leader_index + 1) % ring], s, t) : dp_ranks[(r + 1) % dp];
      traffic.Add(my_site, peers[successor].site, dp_client.stats().bytes_sent - dp_bytes_before,
                  2.0 * (ring - 1) / ring * 4.0 * static_cast<double>(grad_buckets->elements()));
    }
    // Global gradient norm: every stage and TP rank of the replica adds its share.
    float norm_share[2] = {static_cast<float>(stage.GradSquaredNormShare()),
                           last && t == 0 ? static_cast<float>(loss_sum / M) : 0.0f};
    if (replica_comm->size() > 1) {
      if (absl::Status st = replica_comm->AllReduceSum(absl::MakeSpan(norm_share, 2), "norm"); !st.ok()) return st;
    }
    wait += SecondsSince(sync_start);
    const double norm = std::sqrt(static_cast<double>(norm_share[0]));
    const auto t0 = Clock::now();
    adam.Step(stage.params(), stage.grads(), static_cast<float>(schedule.At(step - 1)),
              model::ClipScale(norm, spec.train().grad_clip()));
    compute += SecondsSince(t0);

    // The job's loss: the mean over replicas of each replica's mean (all replicas' last stages).
    double loss = norm_share[1];
    const bool carrier = last && t == 0;
    if (carrier && dp > 1) {
      float l = static_cast<float>(loss);
      if (absl::Status st = dp_scalars->AllReduceSum(absl::MakeSpan(&l, 1), "loss"); !st.ok()) return st;
      loss = l / dp;
    }

    StepReport report;
    report.set_job_id(me.job_id());
    report.set_actor_id(me.actor_id());
    report.set_step(step);
    report.set_loss(loss);
    report.set_carries_loss(carrier && r == 0);
    report.set_step_seconds(SecondsSince(step_start));
    report.set_compute_seconds(compute);
    report.set_comm_wait_seconds(wait);
    report.set_bubble_seconds(bubble);
    report.set_tokens(static_cast<int64_t>(spec.train().global_batch()) * T);
    report.set_val_loss(-1);
    for (const auto& [pair, bytes] : traffic.wan_bytes) (*report.mutable_wan_bytes())[pair] = bytes;
    if (traffic.encoded_wan_bytes > 0) report.set_compression_ratio(traffic.raw_wan_bytes / traffic.encoded_wan_bytes);
    report.set_done(step == spec.train().steps());
    // Checkpoints: replica 0 writes each stage's shard (weights, AdamW moments, data position); the head
    // writes the job's manifest once every shard of the step is in, so a checkpoint is complete or absent.
    const int every = spec.checkpoint().every_steps();
    if (!spec.checkpoint().dir().empty() && r == 0 && ((every > 0 && step % every == 0) || report.done())) {
      const std::string dir = absl::StrCat(spec.checkpoint().dir(), "/stage_", s, tp > 1 ? absl::StrCat("_tp", t) : "");
      model::DataPosition position = loader ? loader->position() : model::DataPosition{};
      if (absl::Status st = model::SaveCheckpoint(dir, step, stage, adam, position); !st.ok()) return st;
      char step_dir[32];
      std::snprintf(step_dir, sizeof(step_dir), "/step_%08d", step);
      report.set_checkpoint(dir + step_dir);
    }
    Report(report);
    if (stop_) return absl::CancelledError("stop requested");
  }
  SetState(ACTOR_DEAD, "finished");
  return absl::OkStatus();
}

}  // namespace geotrain::worker
