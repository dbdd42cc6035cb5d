// One stage actor's training step: schedule, gradient synchronisation and optimizer (see stage_trainer.h).
#include "worker/stage_trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/codec.h"
#include "common/diloco_spec.h"
#include "common/log.h"
#include "common/status.h"
#include "model/trainer.h"

namespace geotrain::worker {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// The seconds a compute op that began at `start` took, `slowdown` times as many: with the worker's --slowdown (> 1)
// the op is followed by a wait of (slowdown - 1) times its time, as if the device were that much slower.
double ComputeSeconds(Clock::time_point start, double slowdown) {
  const double took = SecondsSince(start);
  if (slowdown > 1) std::this_thread::sleep_for(std::chrono::duration<double>(took * (slowdown - 1)));
  return took * slowdown;
}

// Timed compute's gradient buckets: the timed backend's memory (address space over one small window, zeros), and
// copies that move nothing, since both sides hold zeros (model/timed_backend.h). The all-reduces still send
// every bucket's real size through the real communicator.
class TimedBucketMemory : public comm::BucketMemory {
 public:
  explicit TimedBucketMemory(model::Backend* backend) : backend_(backend) {}
  absl::StatusOr<float*> Allocate(int64_t elements) override {
    ASSIGN_OR_RETURN(model::DeviceBuffer buffer,
                     model::DeviceBuffer::Allocate(*backend_, static_cast<size_t>(elements) * sizeof(float)));
    buffers_.push_back(std::move(buffer));
    return buffers_.back().as<float>();
  }
  void Copy(float*, const float*, int64_t) override {}
  comm::BucketFence Fence(int) override { return nullptr; }

 private:
  model::Backend* backend_;
  std::vector<model::DeviceBuffer> buffers_;
};

// Rank r's part of `span` split in order among `ranks` (as evenly as the size allows): what one tp rank sums of a
// replicated tensor's gradient with StageCollectives::split_replicated.
absl::Span<float> TensorRankSlice(absl::Span<float> span, int r, int ranks) {
  const size_t begin = span.size() * r / ranks, end = span.size() * (r + 1) / ranks;
  return span.subspan(begin, end - begin);
}

}  // namespace

absl::StatusOr<std::function<absl::Status(int group, int fragment, absl::Span<float> operand)>> SimulatedOuterCodec(
    const JobSpec& spec) {
  std::function<absl::Status(int, int, absl::Span<float>)> none;
  if (!DilocoOn(spec)) return none;
  ASSIGN_OR_RETURN(comm::Codec codec, comm::ParseCodec(EffectiveDiloco(spec).codec()));
  if (codec.lossless()) return none;
  auto round_trip = std::make_shared<comm::CodecRoundTrip>(codec);
  return [round_trip](int group, int fragment, absl::Span<float> operand) {
    return round_trip->Apply(absl::StrCat(group, "/", fragment), operand);
  };
}

absl::StatusOr<model::Precision> StagePrecision(const JobSpec& spec, const std::string& device) {
  const std::string& name = spec.train().precision();
  if (name.empty() || name == "auto") {
    // A GPU, or timed compute's emulated one: bf16, as before precision was a setting.
    return device.starts_with("cuda") || device.starts_with("timed:") ? model::Precision::kBf16
                                                                      : model::Precision::kFp32;
  }
  return model::SpecPrecision(spec);
}

StageTrainer::StageTrainer(const JobSpec& spec, ActorRanks ranks) : spec_(spec), ranks_(std::move(ranks)) {}

StageTrainer::~StageTrainer() {
  // The sender, the buckets' and the outer exchanges' threads use the collectives: they go first (an
  // exchange in flight ends at its deadline, or at once when the receives are cancelled).
  if (!outer_in_flight_.empty()) collectives_->CancelReceives();
  for (auto& x : outer_in_flight_) x->thread.join();
  sender_.reset();
  grad_buckets_.reset();
  timed_bucket_memory_.reset();  // after the buckets, before the backend that owns its memory
}

absl::StatusOr<std::unique_ptr<StageTrainer>> StageTrainer::Create(const JobSpec& spec, const ActorRanks& ranks,
                                                                   const std::vector<ActorPeer>& actors,
                                                                   CollectivesFactory* factory,
                                                                   const std::string& device, int device_index,
                                                                   const DataSourceFn& data) {
  std::unique_ptr<StageTrainer> trainer(new StageTrainer(spec, ranks));
  RETURN_IF_ERROR(trainer->Initialize(actors, factory, device, device_index, data));
  return trainer;
}

absl::Status StageTrainer::Initialize(const std::vector<ActorPeer>& actors, CollectivesFactory* factory,
                                      const std::string& device, int device_index, const DataSourceFn& data) {
  ASSIGN_OR_RETURN(config_, GPT2Config::FromSpec(spec_.model()));
  ASSIGN_OR_RETURN(const model::Precision precision, OpenDevice(device));
  ASSIGN_OR_RETURN(collectives_, factory->Create(ranks_, spec_, actors, backend_, device_index));
  RETURN_IF_ERROR(CreateStage(precision));
  RETURN_IF_ERROR(OpenData(data));
  RETURN_IF_ERROR(AllocateStepBuffers());
  bucket_bytes_ = (spec_.comm().grad_bucket_mb() > 0 ? spec_.comm().grad_bucket_mb() : 25.0) * (1 << 20);
  RETURN_IF_ERROR(CreateGradientBuckets(bucket_bytes_));
  if (collectives_->split_replicated) PrepareReplicatedGather(bucket_bytes_);
  if (DilocoOn(spec_)) RETURN_IF_ERROR(CreateOuterOptimizer());
  StartSender();
  return absl::OkStatus();
}

absl::StatusOr<model::Precision> StageTrainer::OpenDevice(const std::string& device) {
  // The device: on a CUDA worker the stage's parameters, gradients, optimizer state and activations live
  // on its GPU (GEMMs in the job's precision, fp32 master weights). On the CPU, bf16 and fp16 round the GEMMs'
  // inputs as a GPU would (an emulated Turing worker trains in fp16 for real).
  ASSIGN_OR_RETURN(const model::Precision precision, StagePrecision(spec_, device));
  backend_ = model::CpuBackendInstance();
  if (device != "cpu" || precision != model::Precision::kFp32) {
    ASSIGN_OR_RETURN(device_backend_, model::MakeBackend(device, precision));
    backend_ = device_backend_.get();
  }
  on_device_ = backend_->is_cuda();
  // Timed compute (model/timed_backend.h): every op waits the emulated device's time; the stage has no real
  // weights, so nothing that needs them can run. DiLoCo runs for its timing: its weights and so its pseudo-gradients
  // are zeros, exchanged at their real size through the real codec, and its outer state takes host memory as usual.
  timed_ = device.starts_with("timed:");
  return precision;
}

absl::Status StageTrainer::CreateStage(model::Precision precision) {
  model::StageOptions stage_options = model::StageOptions::Split(config_, ranks_.stage, ranks_.pp);
  stage_options.tp_comm = collectives_->tp;
  stage_options.backend = backend_;
  stage_options.max_batch = ranks_.microbatch_size;
  stage_options.max_seq_len = ranks_.seq_len;
  ASSIGN_OR_RETURN(stage_, model::GPT2Stage::Create(config_, stage_options));
  if (!timed_) stage_->InitializeWeights(spec_.train().seed());
  // Timed compute has no real gradients to scale: its loss scaling stays off.
  model::AdamWOptions adam_options = model::TrainOptimizerOptions(spec_, precision);
  if (timed_) adam_options.loss_scale.enabled = false;
  ASSIGN_OR_RETURN(adam_, model::AdamW::Create(stage_->num_params(), stage_->segments(), adam_options, *backend_));
  schedule_ = model::TrainSchedule(spec_, collectives_->diloco_groups);
  return absl::OkStatus();
}

absl::Status StageTrainer::OpenData(const DataSourceFn& data) {
  const int T = ranks_.seq_len;
  const bool first = ranks_.first_stage, last = ranks_.last_stage;
  if ((first || last) && (data == nullptr || spec_.data().local())) {
    ASSIGN_OR_RETURN(loader_, model::DataLoader::Create(spec_.data().train(), ranks_.replica_batch, T, ranks_.replica,
                                                        ranks_.dp, config_.vocab_size));
  } else if (first || last) {
    // Staged shards: training starts once the first one is local; the later ones stream in behind it.
    ASSIGN_OR_RETURN(model::ShardSource source, data(spec_.data().train()));
    ASSIGN_OR_RETURN(loader_, model::DataLoader::Create(std::move(source), ranks_.replica_batch, T, ranks_.replica,
                                                        ranks_.dp, config_.vocab_size));
  }
  // Validation: train.eval_batches global batches of data.val, whatever the plan; replica r takes its rows of
  // each, as in training, and evaluates them in microbatches (staged like the training shards when the data is
  // not local).
  if ((first || last) && !spec_.data().val().empty() && spec_.train().eval_every() > 0) {
    absl::StatusOr<std::unique_ptr<model::DataLoader>> val;
    if (data == nullptr || spec_.data().local()) {
      val = model::DataLoader::Create(spec_.data().val(), ranks_.replica_batch, T, ranks_.replica, ranks_.dp,
                                      config_.vocab_size);
    } else {
      ASSIGN_OR_RETURN(model::ShardSource val_source, data(spec_.data().val()));
      val = model::DataLoader::Create(std::move(val_source), ranks_.replica_batch, T, ranks_.replica, ranks_.dp,
                                      config_.vocab_size);
    }
    if (!val.ok()) return WithContext(val.status(), model::kValidationDataContext);
    val_loader_ = std::move(*val);
    val_inputs_.resize(static_cast<size_t>(ranks_.replica_batch) * T);
    val_targets_.resize(val_inputs_.size());
  }
  return absl::OkStatus();
}

absl::Status StageTrainer::AllocateStepBuffers() {
  const int M = ranks_.microbatches, T = ranks_.seq_len, Bm = ranks_.microbatch_size;
  const bool first = ranks_.first_stage, last = ranks_.last_stage;
  inputs_.resize(static_cast<size_t>(ranks_.replica_batch) * T);
  targets_.resize(inputs_.size());
  activation_floats_ = static_cast<size_t>(Bm) * T * config_.n_embd;
  stage_inputs_.assign(first ? 0 : M, std::vector<float>(activation_floats_));
  doutput_.resize(last ? 0 : activation_floats_);
  loss_scale_ = 1.0f / static_cast<float>(M * collectives_->inner_replicas);
  pipeline_ = MakePipelineSchedule(ranks_.one_f_one_b ? PipelineKind::k1F1B : PipelineKind::kGPipe, ranks_.pp,
                                   ranks_.stage, M, spec_.parallel().pipeline_depth());
  if (!on_device_) return absl::OkStatus();
  const size_t act_bytes = activation_floats_ * sizeof(float);
  if (!first) {
    ASSIGN_OR_RETURN(device_input_, model::DeviceBuffer::Allocate(*backend_, act_bytes));
    host_dinput_.resize(activation_floats_);
  }
  if (!last) {
    ASSIGN_OR_RETURN(device_doutput_, model::DeviceBuffer::Allocate(*backend_, act_bytes));
    host_output_.resize(activation_floats_);
  }
  if ((collectives_->dp_all_reduce && !collectives_->dp_on_device) || collectives_->tied != nullptr ||
      DilocoOn(spec_)) {
    host_grads_.resize(static_cast<size_t>(stage_->num_params()));
  }
  return absl::OkStatus();
}

absl::Status StageTrainer::CreateGradientBuckets(double bucket_bytes) {
  // Data parallelism: the replicas' gradients are summed in buckets, each all-reduced as soon as the last
  // microbatch's backward has finished its layers, overlapped with the backward of earlier layers (each
  // replica scaled its loss by 1 / (M dp)). With NCCL the buckets live on the device and take the gradients
  // where backward leaves them; otherwise they take them from the host mirror, which the device copies
  // them to as each layer finishes.
  const bool dp_on_device = collectives_->dp_on_device;
  num_layers_ = stage_->last_layer() - stage_->first_layer();
  overlap_dp_ = !(dp_on_device && collectives_->tp_nccl);
  if (!collectives_->dp_all_reduce) return absl::OkStatus();
  auto dp_view = [&](absl::Span<float> g) { return dp_on_device ? g : HostView(g); };
  // With split_replicated (host memory: never with NCCL) a replicated tensor's span is this rank's slice of it;
  // the whole goes on the list that GatherReplicated completes.
  auto bucket_span = [&](absl::Span<float> g) {
    const int64_t offset = g.data() - stage_->grads();
    const bool replicated = std::any_of(stage_->segments().begin(), stage_->segments().end(), [&](const auto& seg) {
      return seg.replicated && offset >= seg.offset && offset < seg.offset + seg.count;
    });
    if (!collectives_->split_replicated || !replicated) return dp_view(g);
    tp_gathered_.push_back(HostView(g));
    return TensorRankSlice(HostView(g), ranks_.tp_rank, ranks_.tp);
  };
  std::vector<std::vector<absl::Span<float>>> groups;
  for (int l = num_layers_ - 1; l >= 0; --l) {
    groups.emplace_back();
    for (absl::Span<float> g : stage_->LayerGradientSpans(l)) groups.back().push_back(bucket_span(g));
  }
  groups.emplace_back();
  // The embeddings and final LayerNorm, less wte when the tied all-reduce sums every replica's copy.
  dp_non_layer_spans_ = stage_->NonLayerGradientSpans();
  if (collectives_->tied_over_replicas) {
    const float* wte = stage_->grad_tensors().wte;
    std::erase_if(dp_non_layer_spans_, [&](absl::Span<float> g) { return g.data() == wte; });
  }
  for (absl::Span<float> g : dp_non_layer_spans_) groups.back().push_back(bucket_span(g));
  comm::BucketMemory* bucket_memory = collectives_->dp_bucket_memory;
  if (timed_) {
    timed_bucket_memory_ = std::make_unique<TimedBucketMemory>(backend_);
    bucket_memory = timed_bucket_memory_.get();
  }
  grad_buckets_ = std::make_unique<comm::GradientBuckets>(collectives_->dp_all_reduce, bucket_memory, std::move(groups),
                                                          static_cast<int64_t>(bucket_bytes));
  return grad_buckets_->status();
}

void StageTrainer::PrepareReplicatedGather(double bucket_bytes) {
  if (collectives_->tied != nullptr) {  // the tied all-reduce sums this rank's slice of wte
    tp_gathered_.push_back(HostView(WteGradient()));
  }
  // Each rank's slices packed in order; the gather moves them a gradient bucket's size at a time (comm.grad_bucket_mb),
  // so that its buffers stay small (the replicated tensors are mostly the embeddings: hundreds of MB on large models).
  const size_t chunk_elements = std::max<size_t>(1, static_cast<size_t>(bucket_bytes / sizeof(float)));
  tp_gather_packed_ = 0;
  for (int r = 0; r < ranks_.tp; ++r) {
    size_t n = 0;
    for (absl::Span<float> s : tp_gathered_) n += TensorRankSlice(s, r, ranks_.tp).size();
    tp_gather_packed_ = std::max(tp_gather_packed_, n);
  }
  const size_t chunk = std::min(tp_gather_packed_, chunk_elements);
  tp_gather_send_.assign(chunk, 0.0f);
  tp_gather_recv_.assign(chunk * ranks_.tp, 0.0f);
}

absl::Status StageTrainer::CreateOuterOptimizer() {
  const DilocoSpec d = EffectiveDiloco(spec_);
  if (d.fragments() > config_.n_layer) {
    return absl::InvalidArgumentError(absl::StrCat("diloco.fragments ", d.fragments(), " exceeds the model's ",
                                                   config_.n_layer, " blocks; use at most one fragment per block"));
  }
  outer_schedule_ = {.inner_steps = d.inner_steps(), .fragments = d.fragments(), .total_steps = spec_.train().steps()};
  std::vector<std::vector<model::ParamRange>> fragments = model::FragmentRanges(*stage_, d.fragments());
  if (ranks_.tp > 1) {
    // Each fragment's packed pseudo-gradient in two: the replicated tensors' elements (the same on every tp rank),
    // which tp rank 0 alone exchanges across sites, and the rest.
    for (const std::vector<model::ParamRange>& ranges : fragments) {
      outer_split_.push_back(model::SplitReplicated(*stage_, ranges));
    }
  }
  outer_ = std::make_unique<model::OuterOptimizer>(
      std::move(fragments), stage_->num_params(),
      model::OuterOptions{.lr = d.outer_lr(), .momentum = d.outer_momentum(), .nesterov = d.nesterov()});
  ASSIGN_OR_RETURN(float* params, HostParams());
  outer_->Initialize(params);
  outer_weight_ = collectives_->outer_weight;
  if (DilocoTimePaced(spec_)) pacing_ = std::make_unique<Pacing>();
  return absl::OkStatus();
}

void StageTrainer::StartSender() {
  // A failed send ends the receives this actor waits in, so that it reports the failure at once. A pipeline
  // deeper than pp keeps its extra microbatches' sends in flight together, so that none waits for another's
  // acknowledgement across a slow link.
  // At most the microbatches there are, and kAsyncSendsInFlight: a spec's depth (up to max_microbatches) must not
  // start a thread per microbatch.
  constexpr int kAsyncSendsInFlight = 16;
  const int depth = std::min(spec_.parallel().pipeline_depth(), ranks_.microbatches);
  const int in_flight = std::clamp(depth - ranks_.pp + 1, 1, kAsyncSendsInFlight);
  sender_ = std::make_unique<AsyncSender>(
      collectives_->pipeline, [c = collectives_.get()] { return c->BytesSent(TrafficClass::kPipeline); }, ranks_.site,
      [c = collectives_.get()](const absl::Status& s) { c->CancelReceives(comm::IsJobStoppedOnReceiver(s)); },
      in_flight);
}

bool StageTrainer::regroupable() const {
  // The stage holds its tensor-parallel communicator (model::GPT2Stage): with tp > 1 it would outlive a regroup.
  return outer_ == nullptr && ranks_.tp == 1 && !collectives_->dp_on_device && !collectives_->tp_nccl;
}

absl::Status StageTrainer::Regroup(const ActorRanks& ranks, const std::vector<ActorPeer>& actors,
                                   CollectivesFactory* factory, int device_index) {
  if (!regroupable()) {
    return absl::FailedPreconditionError("this stage's collectives cannot be rebuilt (DiLoCo, or NCCL groups)");
  }
  // The old membership's threads end first: its receives are cancelled, so a send or an all-reduce in flight fails
  // at once (its retries see the cancelled key), and nothing uses the old collectives once they are joined.
  collectives_->CancelReceives();
  sender_.reset();
  grad_buckets_.reset();
  timed_bucket_memory_.reset();
  tp_gathered_.clear();
  ranks_ = ranks;
  ASSIGN_OR_RETURN(collectives_, factory->Create(ranks_, spec_, actors, backend_, device_index));
  if (!regroupable()) {
    return absl::FailedPreconditionError("the regrouped collectives use NCCL, which a live regroup does not rebuild");
  }
  loss_scale_ = 1.0f / static_cast<float>(ranks_.microbatches * collectives_->inner_replicas);
  if (on_device_ && (collectives_->dp_all_reduce || collectives_->tied != nullptr) && host_grads_.empty()) {
    host_grads_.resize(static_cast<size_t>(stage_->num_params()));
  }
  RETURN_IF_ERROR(CreateGradientBuckets(bucket_bytes_));
  if (collectives_->split_replicated) PrepareReplicatedGather(bucket_bytes_);
  StartSender();
  // The step that failed is trained again from its first microbatch: its batch is read again.
  if (loader_ && loaded_step_ > completed_step_) {
    RETURN_IF_ERROR(loader_->Restore(step_start_position_));
    loaded_step_ = completed_step_;
  }
  return absl::OkStatus();
}

std::string StageTrainer::Describe() const {
  return absl::StrCat("training ", stage_->num_params(), " parameters, layers [", stage_->first_layer(), ", ",
                      stage_->last_layer(), ") on ", backend_->name(),
                      grad_buckets_
                          ? absl::StrCat("; gradient all-reduce in ", grad_buckets_->num_buckets(), " buckets ",
                                         overlap_dp_ ? "overlapped with backward" : "after backward",
                                         collectives_->dp_on_device ? ", on NCCL inside the site" : "",
                                         collectives_->split_replicated
                                             ? absl::StrCat(", replicated tensors summed 1/", ranks_.tp, " per tp rank")
                                             : "")
                          : std::string(),
                      collectives_->tp_nccl ? "; tensor-parallel all-reduces on NCCL" : "");
}

void StageTrainer::AddAllReduceTraffic(SiteTraffic* traffic, const AllReduceRoute& route, uint64_t encoded,
                                       double tensor_bytes) const {
  const double ring = route.ring_size;
  traffic->Add(ranks_.site, ranks_.peers[route.successor_rank].site, encoded, 2.0 * (ring - 1) / ring * tensor_bytes);
}

absl::Span<float> StageTrainer::WteGradient() {
  return absl::MakeSpan(stage_->grad_tensors().wte, static_cast<size_t>(config_.padded_vocab_size) * config_.n_embd);
}

absl::Span<float> StageTrainer::HostView(absl::Span<float> grads) {
  if (!on_device_) return grads;
  return absl::MakeSpan(host_grads_.data() + (grads.data() - stage_->grads()), grads.size());
}

absl::Status StageTrainer::CopyOut(const std::vector<absl::Span<float>>& spans) {
  if (!on_device_) return absl::OkStatus();
  for (const absl::Span<float>& g : spans) {
    RETURN_IF_ERROR(backend_->CopyToHost(HostView(g).data(), g.data(), g.size() * sizeof(float)));
  }
  return absl::OkStatus();
}

namespace {

// Each microbatch's tensors under their own tag, so that sends of different microbatches may be in flight
// together (comm::Communicator numbers a tag's calls; AsyncSender overlaps only different tags).
std::string MicrobatchTag(const char* kind, int m) { return absl::StrCat(kind, "/", m); }

}  // namespace

absl::Status StageTrainer::Forward(int m, bool recompute) {
  const int T = ranks_.seq_len, Bm = ranks_.microbatch_size;
  const bool first = ranks_.first_stage, last = ranks_.last_stage;
  const int32_t* tokens = first ? inputs_.data() + static_cast<size_t>(m) * Bm * T : nullptr;
  const int32_t* targets = last ? targets_.data() + static_cast<size_t>(m) * Bm * T : nullptr;
  const float* in = nullptr;
  if (!first) {
    if (!recompute) {
      const auto t0 = Clock::now();
      RETURN_IF_ERROR(
          collectives_->pipeline->Recv(ranks_.prev_rank, absl::MakeSpan(stage_inputs_[m]), MicrobatchTag("act", m)));
      const double waited = SecondsSince(t0);
      stats_.wait_seconds += waited;
      if (first_op_) stats_.bubble_seconds += waited;  // pipeline fill
    }
    in = stage_inputs_[m].data();
    if (on_device_) {
      RETURN_IF_ERROR(backend_->CopyToDevice(device_input_.as<float>(), in, activation_floats_ * sizeof(float)));
      in = device_input_.as<float>();
    }
  }
  first_op_ = false;
  const auto t0 = Clock::now();
  RETURN_IF_ERROR(stage_->Forward(Bm, T, tokens, in, targets));
  stats_.compute_seconds += ComputeSeconds(t0, slowdown_);
  latest_forward_ = m;
  if (recompute) return absl::OkStatus();
  if (last) {
    loss_sum_ += stage_->loss();
    return absl::OkStatus();
  }
  const float* out = stage_->output();
  if (on_device_) {
    RETURN_IF_ERROR(backend_->CopyToHost(host_output_.data(), out, activation_floats_ * sizeof(float)));
    out = host_output_.data();
  }
  sender_->Send(ranks_.next_rank, ranks_.peers[ranks_.next_rank].site, out, activation_floats_,
                MicrobatchTag("act", m));
  return absl::OkStatus();
}

absl::Status StageTrainer::Backward(int m) {
  const bool first = ranks_.first_stage, last = ranks_.last_stage;
  if (latest_forward_ != m) RETURN_IF_ERROR(Forward(m, /*recompute=*/true));
  if (!last) {
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(collectives_->pipeline->Recv(ranks_.next_rank, absl::MakeSpan(doutput_), MicrobatchTag("grad", m)));
    stats_.wait_seconds += SecondsSince(t0);
  }
  const auto t0 = Clock::now();
  const float* dout = last ? nullptr : doutput_.data();
  if (on_device_ && !last) {
    RETURN_IF_ERROR(backend_->CopyToDevice(device_doutput_.as<float>(), dout, activation_floats_ * sizeof(float)));
    dout = device_doutput_.as<float>();
  }
  absl::Status hook_status;
  bool dp_on_device = false;  // outlives the hook below, which runs inside stage_->Backward
  if (grad_buckets_ && overlap_dp_ && m == ranks_.microbatches - 1) {
    // The step's gradients become final layer by layer.
    dp_on_device = collectives_->dp_on_device;
    stage_->set_layer_gradients_ready([&](int l) {
      if (l < 0 || !hook_status.ok()) return;
      if (!dp_on_device) hook_status = CopyOut(stage_->LayerGradientSpans(l));
      if (hook_status.ok()) grad_buckets_->GroupReady(num_layers_ - 1 - l);
    });
  }
  absl::Status backward_status = stage_->Backward(dout, loss_scale_ * adam_->loss_scaler().scale());
  stage_->set_layer_gradients_ready(nullptr);
  RETURN_IF_ERROR(backward_status);
  RETURN_IF_ERROR(hook_status);
  stats_.compute_seconds += ComputeSeconds(t0, slowdown_);
  latest_forward_ = -1;  // Backward consumed the activations
  if (first) return absl::OkStatus();
  const float* din = stage_->dinput();
  if (on_device_) {
    RETURN_IF_ERROR(backend_->CopyToHost(host_dinput_.data(), din, activation_floats_ * sizeof(float)));
    din = host_dinput_.data();
  }
  sender_->Send(ranks_.prev_rank, ranks_.peers[ranks_.prev_rank].site, din, activation_floats_,
                MicrobatchTag("grad", m));
  return absl::OkStatus();
}

absl::Status StageTrainer::SynchronizeGradients(SiteTraffic* traffic, uint64_t dp_bytes_before) {
  if (grad_buckets_ && !overlap_dp_) {
    for (int g = 0; g < num_layers_; ++g) grad_buckets_->GroupReady(g);
  }
  RETURN_IF_ERROR(sender_->Flush(traffic));
  // Tied embedding: the first and last stage hold copies of wte; each needs the sum of every copy's gradient
  // (its replica's pair, or every replica's with tied_over_replicas).
  if (collectives_->tied != nullptr) {
    const uint64_t before = collectives_->BytesSent(TrafficClass::kTied);
    const absl::Span<float> wte = WteGradient();
    RETURN_IF_ERROR(CopyOut({wte}));
    // With split_replicated this rank's slice; GatherReplicated then completes it (and the mirror goes to the device).
    const absl::Span<float> summed =
        collectives_->split_replicated ? TensorRankSlice(HostView(wte), ranks_.tp_rank, ranks_.tp) : HostView(wte);
    RETURN_IF_ERROR(collectives_->tied->AllReduceSum(summed, "tied"));
    if (on_device_ && !collectives_->split_replicated) {
      RETURN_IF_ERROR(backend_->CopyToDevice(wte.data(), HostView(wte).data(), wte.size() * sizeof(float)));
    }
    AddAllReduceTraffic(traffic, collectives_->tied_route, collectives_->BytesSent(TrafficClass::kTied) - before,
                        4.0 * static_cast<double>(summed.size()));
  }
  if (grad_buckets_) {
    const bool dp_on_device = collectives_->dp_on_device;
    if (!dp_on_device) RETURN_IF_ERROR(CopyOut(dp_non_layer_spans_));
    grad_buckets_->GroupReady(num_layers_);  // the embeddings and final LayerNorm
    RETURN_IF_ERROR(grad_buckets_->Finish());
    RETURN_IF_ERROR(GatherReplicated());
    if (on_device_ && !dp_on_device) {  // the groups and the tied sum cover the gradients once: the mirror is the sums
      RETURN_IF_ERROR(backend_->CopyToDevice(stage_->grads(), host_grads_.data(), host_grads_.size() * sizeof(float)));
    }
    AddAllReduceTraffic(traffic, collectives_->dp_route,
                        collectives_->BytesSent(TrafficClass::kDataParallel) - dp_bytes_before,
                        4.0 * static_cast<double>(grad_buckets_->elements()));
  }
  return absl::OkStatus();
}

absl::Status StageTrainer::GatherReplicated() {
  if (tp_gathered_.empty()) return absl::OkStatus();
  const int tp = ranks_.tp;
  // Calls fn(piece, at) for each piece of the spans that holds positions [begin, end) of rank r's packed slices, `at`
  // being the piece's position in that range.
  auto for_each_piece = [&](int r, size_t begin, size_t end, const auto& fn) {
    size_t offset = 0;
    for (absl::Span<float> s : tp_gathered_) {
      if (offset >= end) break;
      const absl::Span<float> slice = TensorRankSlice(s, r, tp);
      const size_t lo = std::max(begin, offset), hi = std::min(end, offset + slice.size());
      if (lo < hi) fn(slice.subspan(lo - offset, hi - lo), lo - begin);
      offset += slice.size();
    }
  };
  const size_t chunk = tp_gather_send_.size();
  for (size_t begin = 0; begin < tp_gather_packed_; begin += chunk) {
    const size_t n = std::min(chunk, tp_gather_packed_ - begin);  // a shorter rank's tail is padding nobody reads
    for_each_piece(ranks_.tp_rank, begin, begin + n, [&](absl::Span<float> piece, size_t at) {
      std::copy(piece.begin(), piece.end(), tp_gather_send_.begin() + static_cast<std::ptrdiff_t>(at));
    });
    RETURN_IF_ERROR(collectives_->tp_exact->AllGather(absl::MakeConstSpan(tp_gather_send_.data(), n),
                                                      absl::MakeSpan(tp_gather_recv_.data(), n * tp), "replicated"));
    for (int r = 0; r < tp; ++r) {
      if (r == ranks_.tp_rank) continue;
      const float* theirs = tp_gather_recv_.data() + static_cast<size_t>(r) * n;
      for_each_piece(r, begin, begin + n, [&](absl::Span<float> piece, size_t at) {
        std::copy(theirs + at, theirs + at + piece.size(), piece.begin());
      });
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<StepFigures> StageTrainer::Step(int64_t step, const std::atomic<bool>& stop) {
  stats_ = StepStats{};
  RETURN_IF_ERROR(StartOuterExchanges(step));
  const int inner = PacedInnerSteps(step);
  double loss = 0;
  for (int i = 0; i < inner; ++i) {
    const auto t0 = Clock::now();
    ASSIGN_OR_RETURN(const double inner_loss, InnerStep(step, stop));
    loss += inner_loss / inner;
    if (pacing_) pacing_->seconds.push_back(SecondsSince(t0));
  }
  stats_.inner_steps = inner;
  stats_.tokens = PaceStep(step);  // before the period's outer step plans the next period
  RETURN_IF_ERROR(PaceWarmUp(step));
  RETURN_IF_ERROR(FinishOuterExchanges(step));

  // The job's loss: synchronous, the mean over the present replicas (InnerStep); with DiLoCo the head averages the
  // replicas' losses: no collective across sites every step.
  stats_.loss = loss;
  const int every = spec_.train().eval_every();
  if (!spec_.data().val().empty() && every > 0 && (step % every == 0 || step == spec_.train().steps())) {
    RETURN_IF_ERROR(Evaluate(stop));
  }
  return Figures(step);
}

absl::StatusOr<double> StageTrainer::InnerStep(int64_t step, const std::atomic<bool>& stop) {
  loss_sum_ = 0;
  latest_forward_ = -1;
  first_op_ = true;
  const uint64_t dp_bytes_before = collectives_->BytesSent(TrafficClass::kDataParallel);
  if (loader_) {
    step_start_position_ = loader_->position();
    loaded_step_ = step;
    RETURN_IF_ERROR(loader_->Next(inputs_.data(), targets_.data()));
  }
  stage_->ZeroGrad();

  for (const PipelineOp& op : pipeline_) {
    if (stop) return absl::CancelledError("stop requested");
    absl::Status status = op.forward ? Forward(op.microbatch, /*recompute=*/false) : Backward(op.microbatch);
    if (!status.ok()) {
      // A receive cancelled because a send failed: the send's error is the cause.
      if (absl::Status send_error = sender_->error(); !send_error.ok()) return send_error;
      return status;
    }
  }

  const auto sync_start = Clock::now();
  RETURN_IF_ERROR(SynchronizeGradients(&stats_.traffic, dp_bytes_before));
  // Synchronous: the job's loss, the mean over the present replicas of each one's mean (their last stages), before
  // the replica's norm. So nothing crosses replicas after the update (an actor that applied it reports its step),
  // and a carrier whose exchange fails holds its whole replica before the update (a live regroup finds every stage
  // of a replica at the same step).
  const bool carrier = ranks_.last_stage && ranks_.tp_rank == 0;
  float loss = carrier ? static_cast<float>(loss_sum_ / ranks_.microbatches) : 0.0f;
  const int present = static_cast<int>(ranks_.present.size());
  if (carrier && present > 1 && outer_ == nullptr) {
    RETURN_IF_ERROR(collectives_->dp_scalars->AllReduceSum(absl::MakeSpan(&loss, 1), "loss"));
    loss /= static_cast<float>(present);
  }
  // Global gradient norm: every stage and TP rank of the replica adds its share.
  float norm_share[2] = {static_cast<float>(stage_->GradSquaredNormShare()), loss};
  if (collectives_->replica->size() > 1) {
    RETURN_IF_ERROR(collectives_->replica->AllReduceSum(absl::MakeSpan(norm_share, 2), "norm"));
  }
  stats_.wait_seconds += SecondsSince(sync_start);
  // fp16: the norm is of the scaled gradients. It is not finite when any gradient of the replica is not (the
  // all-reduce carries infinities and NaNs), and the replicas' gradients are summed before it (DiLoCo: its group's),
  // so every actor takes the same decision, without a collective of its own.
  model::LossScaler& scaler = adam_->loss_scaler();
  const bool apply = scaler.Update(!scaler.enabled() || std::isfinite(norm_share[0]));
  stats_.loss_scale = scaler.scale_applied();
  stats_.skipped = stats_.skipped || !apply;
  const double norm = std::sqrt(static_cast<double>(norm_share[0])) / scaler.scale_applied();
  const auto t0 = Clock::now();
  if (apply) {
    adam_->Step(stage_->params(), stage_->grads(), static_cast<float>(schedule_.At(static_cast<int>(step) - 1)),
                model::ClipScale(norm, spec_.train().grad_clip()) / scaler.scale_applied());
  }
  if (outer_ == nullptr) completed_step_ = step;  // the scaler moved too: a skipped step is complete as well
  stats_.compute_seconds += ComputeSeconds(t0, slowdown_);
  return norm_share[1];
}

bool StageTrainer::carries_loss() const {
  return ranks_.last_stage && ranks_.tp_rank == 0 && (ranks_.replica == ranks_.lead_replica() || outer_ != nullptr);
}

StepFigures StageTrainer::Figures(int64_t step) const {
  StepFigures figures;
  figures.set_step(step);
  figures.set_tokens(stats_.tokens);
  figures.set_replica_tokens(static_cast<int64_t>(stats_.inner_steps) * ranks_.replica_batch * ranks_.seq_len);
  figures.set_inner_steps(stats_.inner_steps);
  figures.set_outer_sync_seconds(stats_.outer_sync_seconds);
  if (slowdown_ > 1) figures.set_slowdown(slowdown_);
  figures.set_loss(stats_.loss);
  figures.set_val_loss(stats_.val_loss);
  figures.set_compute_seconds(stats_.compute_seconds);
  figures.set_comm_wait_seconds(stats_.wait_seconds);
  figures.set_bubble_seconds(stats_.bubble_seconds);
  figures.set_loss_scale(stats_.loss_scale);
  figures.set_skipped(stats_.skipped);
  int64_t wan_total = 0;
  for (const auto& [pair, bytes] : stats_.traffic.wan_bytes) {
    (*figures.mutable_wan_bytes_by_pair())[pair] = bytes;
    wan_total += bytes;
  }
  figures.set_wan_bytes(wan_total);
  if (stats_.traffic.encoded_wan_bytes > 0) {
    figures.set_compression_ratio(stats_.traffic.raw_wan_bytes / stats_.traffic.encoded_wan_bytes);
  }
  return figures;
}

absl::Status StageTrainer::Evaluate(const std::atomic<bool>& stop) {
  const int T = ranks_.seq_len, Bm = ranks_.microbatch_size, M = ranks_.microbatches;
  const bool first = ranks_.first_stage, last = ranks_.last_stage;
  if (val_loader_) val_loader_->Reset();
  // Every microbatch of this replica's rows of each batch, one after the other through the pipeline. Piece k
  // travels under the tag of microbatch k mod M, as in training, so that up to M sends are in flight at once
  // (one tag waits for its acknowledgement before its next send: a round trip per piece across a slow link).
  const int64_t pieces = static_cast<int64_t>(std::max(1, spec_.train().eval_batches())) * M;
  double sum = 0;
  for (int64_t k = 0; k < pieces; ++k) {
    if (stop) return absl::CancelledError("stop requested");
    const int m = static_cast<int>(k % M);
    if (val_loader_ && m == 0) RETURN_IF_ERROR(val_loader_->Next(val_inputs_.data(), val_targets_.data()));
    const size_t offset = static_cast<size_t>(m) * Bm * T;  // of the microbatch in this batch
    const float* in = nullptr;
    if (!first) {
      const auto t0 = Clock::now();
      RETURN_IF_ERROR(
          collectives_->pipeline->Recv(ranks_.prev_rank, absl::MakeSpan(stage_inputs_[0]), MicrobatchTag("val", m)));
      stats_.wait_seconds += SecondsSince(t0);
      in = stage_inputs_[0].data();
      if (on_device_) {
        RETURN_IF_ERROR(backend_->CopyToDevice(device_input_.as<float>(), in, activation_floats_ * sizeof(float)));
        in = device_input_.as<float>();
      }
    }
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(stage_->Forward(Bm, T, first ? val_inputs_.data() + offset : nullptr, in,
                                    last ? val_targets_.data() + offset : nullptr));
    stats_.compute_seconds += ComputeSeconds(t0, slowdown_);
    if (last) {
      sum += stage_->loss();
      continue;
    }
    const float* out = stage_->output();
    if (on_device_) {
      RETURN_IF_ERROR(backend_->CopyToHost(host_output_.data(), out, activation_floats_ * sizeof(float)));
      out = host_output_.data();
    }
    sender_->Send(ranks_.next_rank, ranks_.peers[ranks_.next_rank].site, out, activation_floats_,
                  MicrobatchTag("val", m));
  }
  latest_forward_ = -1;
  RETURN_IF_ERROR(sender_->Flush(&stats_.traffic));
  if (last && ranks_.tp_rank == 0) stats_.val_loss = sum / pieces;
  return absl::OkStatus();
}

absl::StatusOr<float*> StageTrainer::HostParams() {
  if (!on_device_) return stage_->params();
  host_params_.resize(static_cast<size_t>(stage_->num_params()));
  RETURN_IF_ERROR(backend_->CopyToHost(host_params_.data(), stage_->params(), host_params_.size() * sizeof(float)));
  return host_params_.data();
}

absl::Status StageTrainer::ParamsToDevice() {
  if (!on_device_) return absl::OkStatus();
  return backend_->CopyToDevice(stage_->params(), host_params_.data(), host_params_.size() * sizeof(float));
}

absl::Status StageTrainer::ExchangeOuter(int f, std::vector<float>* delta, size_t* exchanged) {
  // With tensor parallelism the replicated tensors' part crosses from tp rank 0 alone, which then hands it to the
  // other ranks exactly: once across the WAN rather than once per rank, and rounded alike for every rank (a lossy
  // codec's rounding depends on the neighbouring shard elements, int8's scales and top-k's choice).
  const model::ReplicatedSplit* split = outer_split_.empty() ? nullptr : &outer_split_[f];
  std::vector<float> rest;
  if (split != nullptr && ranks_.tp_rank != 0) model::PackRanges(split->rest, delta->data(), &rest);
  const absl::Span<float> data = absl::MakeSpan(split != nullptr && ranks_.tp_rank != 0 ? rest : *delta);
  *exchanged = data.size();
  if (collectives_->outer != nullptr) {
    // The group's share of the batch: sum_g (n_g / dp) delta_g over the group leaders.
    for (float& x : data) x *= outer_weight_;
    RETURN_IF_ERROR(collectives_->outer->AllReduceSum(data, absl::StrCat("outer", f)));
  }
  if (collectives_->group != nullptr) {
    RETURN_IF_ERROR(collectives_->group->Broadcast(data, 0, absl::StrCat("outer-group", f)));
  }
  if (split == nullptr) return absl::OkStatus();
  if (ranks_.tp_rank != 0) model::UnpackRanges(split->rest, rest.data(), delta->data());
  std::vector<float> replicated;
  if (ranks_.tp_rank == 0) {
    model::PackRanges(split->replicated, delta->data(), &replicated);
  } else {
    replicated.resize(static_cast<size_t>(split->replicated_count));
  }
  RETURN_IF_ERROR(
      collectives_->tp_exact->Broadcast(absl::MakeSpan(replicated), 0, absl::StrCat("outer-replicated", f)));
  if (ranks_.tp_rank != 0) model::UnpackRanges(split->replicated, replicated.data(), delta->data());
  return absl::OkStatus();
}

absl::Status StageTrainer::StartOuterExchanges(int64_t step) {
  if (outer_ == nullptr) return absl::OkStatus();
  const std::vector<int> due = outer_schedule_.StartAtBeginning(step);
  if (due.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(float* params, HostParams());
  for (int f : due) {
    auto x = std::make_unique<OuterExchange>();
    x->fragment = f;
    outer_->PseudoGradient(f, params, &x->delta);
    outer_->Pack(f, params, &x->snapshot);
    outer_in_flight_.push_back(std::move(x));
  }
  // One thread runs this step's exchanges in turn (every rank starts them in the same order).
  auto* exchanges = &outer_in_flight_;
  const size_t from = outer_in_flight_.size() - due.size();
  outer_in_flight_[from]->thread = std::thread([this, exchanges, from] {
    for (size_t i = from; i < exchanges->size(); ++i) {
      OuterExchange& x = *(*exchanges)[i];
      x.status = ExchangeOuter(x.fragment, &x.delta, &x.exchanged);
      if (!x.status.ok()) break;
    }
  });
  return absl::OkStatus();
}

absl::Status StageTrainer::FinishOuterExchanges(int64_t step) {
  if (outer_ == nullptr) return absl::OkStatus();
  const std::vector<int> blocking = outer_schedule_.BlockingAfter(step);
  if (outer_in_flight_.empty() && blocking.empty()) return absl::OkStatus();
  const auto t0 = Clock::now();
  if (pacing_ && !blocking.empty()) RETURN_IF_ERROR(PaceOuterStep(step));
  for (auto& x : outer_in_flight_) {
    if (x->thread.joinable()) x->thread.join();
  }
  std::vector<std::unique_ptr<OuterExchange>> finished = std::move(outer_in_flight_);
  outer_in_flight_.clear();
  ASSIGN_OR_RETURN(float* params, HostParams());
  double raw = 0;
  for (auto& x : finished) {
    RETURN_IF_ERROR(x->status);
    outer_->Step(x->fragment, x->delta.data());
    outer_->Apply(x->fragment, params, x->snapshot.data());
    raw += 4.0 * static_cast<double>(x->exchanged);
  }
  std::vector<float> delta;
  for (int f : blocking) {
    outer_->PseudoGradient(f, params, &delta);
    size_t exchanged = 0;
    RETURN_IF_ERROR(ExchangeOuter(f, &delta, &exchanged));
    outer_->Step(f, delta.data());
    outer_->Apply(f, params, nullptr);
    raw += 4.0 * static_cast<double>(exchanged);
  }
  RETURN_IF_ERROR(ParamsToDevice());
  stats_.wait_seconds += SecondsSince(t0);
  if (!pacing_) stats_.outer_sync_seconds = SecondsSince(t0);
  if (collectives_->outer != nullptr) {
    const uint64_t sent = collectives_->BytesSent(TrafficClass::kOuter);
    AddAllReduceTraffic(&stats_.traffic, collectives_->outer_route, sent - outer_bytes_counted_, raw);
    outer_bytes_counted_ = sent;
  }
  return absl::OkStatus();
}

}  // namespace geotrain::worker
