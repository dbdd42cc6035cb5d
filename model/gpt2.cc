// GPT-2 stages: parameter layout, initialisation, forward and backward, HF tensor import and export.
#include "model/gpt2.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "model/ops.h"

namespace geotrain::model {
namespace {

enum Kind {
  kWte,
  kWpe,
  kLn1w,
  kLn1b,
  kQkvw,
  kQkvb,
  kAttprojw,
  kAttprojb,
  kLn2w,
  kLn2b,
  kFcw,
  kFcb,
  kFcprojw,
  kFcprojb,
  kLnfw,
  kLnfb,
};

// HF suffixes of the per-block tensors, by kind.
struct BlockName {
  Kind kind;
  const char* suffix;
};
constexpr BlockName kBlockNames[] = {
    {kLn1w, "ln_1.weight"},
    {kLn1b, "ln_1.bias"},
    {kQkvw, "attn.c_attn.weight"},
    {kQkvb, "attn.c_attn.bias"},
    {kAttprojw, "attn.c_proj.weight"},
    {kAttprojb, "attn.c_proj.bias"},
    {kLn2w, "ln_2.weight"},
    {kLn2b, "ln_2.bias"},
    {kFcw, "mlp.c_fc.weight"},
    {kFcb, "mlp.c_fc.bias"},
    {kFcprojw, "mlp.c_proj.weight"},
    {kFcprojb, "mlp.c_proj.bias"},
};

bool IsSharded(int kind) {
  return kind == kQkvw || kind == kQkvb || kind == kAttprojw || kind == kFcw || kind == kFcb || kind == kFcprojw;
}
bool HasDecay(int kind) {
  return kind == kWte || kind == kWpe || kind == kQkvw || kind == kAttprojw || kind == kFcw || kind == kFcprojw;
}

std::array<float**, kNumParameterTensors> Slots(ParameterTensors& t) {
  return {&t.wte,  &t.wpe,  &t.ln1w, &t.ln1b, &t.qkvw,    &t.qkvb,    &t.attprojw, &t.attprojb,
          &t.ln2w, &t.ln2b, &t.fcw,  &t.fcb,  &t.fcprojw, &t.fcprojb, &t.lnfw,     &t.lnfb};
}

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Deterministic N(0, std) stream for one tensor (Box-Muller on splitmix64; no libstdc++ dependence).
class NormalStream {
 public:
  NormalStream(uint64_t seed, const std::string& name) {
    uint64_t h = 1469598103934665603ull;  // FNV-1a of the name
    for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
    state_ = seed ^ (h * 0x9E3779B97F4A7C15ull);
  }
  float Next(float stddev) {
    if (have_spare_) {
      have_spare_ = false;
      return static_cast<float>(spare_ * stddev);
    }
    const double u1 = (static_cast<double>(SplitMix64(state_) >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(SplitMix64(state_) >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * M_PI * u2);
    have_spare_ = true;
    return static_cast<float>(r * std::cos(2.0 * M_PI * u2) * stddev);
  }

 private:
  uint64_t state_;
  double spare_ = 0.0;
  bool have_spare_ = false;
};

}  // namespace

StageOptions StageOptions::Split(const GPT2Config& config, int stage, int num_stages) {
  StageOptions o;
  const StageBlocks blocks = SplitStageBlocks(config.n_layer, stage, num_stages);
  o.first_layer = blocks.first;
  o.last_layer = blocks.last;
  o.has_embedding = stage == 0;
  o.has_head = stage == num_stages - 1;
  return o;
}

absl::StatusOr<std::unique_ptr<GPT2Stage>> GPT2Stage::Create(const GPT2Config& config, const StageOptions& options) {
  GPT2Config c = config;
  RETURN_IF_ERROR(c.Validate());
  const int last = options.last_layer < 0 ? c.n_layer : options.last_layer;
  if (options.first_layer < 0 || options.first_layer > last || last > c.n_layer) {
    return absl::InvalidArgumentError(absl::StrCat("stage layers [", options.first_layer, ", ", last,
                                                   ") are not a range inside [0, ", c.n_layer, ")"));
  }
  const int tp = options.tp_comm == nullptr ? 1 : options.tp_comm->size();
  if (tp < 1 || c.n_head % tp != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor parallelism ", tp, " must divide n_head ", c.n_head));
  }
  const int max_T = options.max_seq_len == 0 ? c.block_size : options.max_seq_len;
  if (options.max_batch <= 0 || max_T <= 0 || max_T > c.block_size) {
    return absl::InvalidArgumentError(absl::StrCat("stage max_batch ", options.max_batch, " and max_seq_len ", max_T,
                                                   " must be positive, max_seq_len <= block_size ", c.block_size));
  }
  StageOptions o = options;
  o.last_layer = last;
  o.max_seq_len = max_T;
  std::unique_ptr<GPT2Stage> stage(new GPT2Stage(c, o));
  if (absl::Status s = stage->BuildLayout(); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("allocating a GPT-2 stage on ", stage->backend_->name(), ": ",
                                               s.message(), "; lower max_batch or max_seq_len"));
  }
  return stage;
}

GPT2Stage::GPT2Stage(const GPT2Config& config, const StageOptions& options)
    : config_(config),
      first_layer_(options.first_layer),
      last_layer_(options.last_layer),
      num_layers_(options.last_layer - options.first_layer),
      has_embedding_(options.has_embedding),
      has_head_(options.has_head),
      tp_comm_(options.tp_comm),
      backend_(options.backend != nullptr ? options.backend : CpuBackendInstance()),
      max_batch_(options.max_batch),
      max_seq_len_(options.max_seq_len) {
  if (tp_comm_ != nullptr) {
    tp_rank_ = tp_comm_->rank();
    tp_size_ = tp_comm_->size();
  }
}

absl::Status GPT2Stage::BuildLayout() {
  const int64_t C = config_.n_embd, Vp = config_.padded_vocab_size, maxT = config_.block_size;
  const int64_t Ls = num_layers_, Cr = C / tp_size_, Hr = 4 * C / tp_size_;
  sizes_[kWte] = (has_embedding_ || has_head_) ? Vp * C : 0;
  sizes_[kWpe] = has_embedding_ ? maxT * C : 0;
  sizes_[kLn1w] = sizes_[kLn1b] = sizes_[kLn2w] = sizes_[kLn2b] = Ls * C;
  sizes_[kQkvw] = Ls * 3 * Cr * C;
  sizes_[kQkvb] = Ls * 3 * Cr;
  sizes_[kAttprojw] = Ls * C * Cr;
  sizes_[kAttprojb] = Ls * C;
  sizes_[kFcw] = Ls * Hr * C;
  sizes_[kFcb] = Ls * Hr;
  sizes_[kFcprojw] = Ls * C * Hr;
  sizes_[kFcprojb] = Ls * C;
  sizes_[kLnfw] = sizes_[kLnfb] = has_head_ ? C : 0;
  int64_t total = 0;
  for (int k = 0; k < kNumParameterTensors; ++k) {
    if (sizes_[k] == 0) continue;
    ParameterSegment seg;
    seg.offset = total;
    seg.count = sizes_[k];
    seg.weight_decay = HasDecay(k);
    seg.duplicate = (tp_rank_ > 0 && !IsSharded(k)) || (k == kWte && !has_embedding_);
    seg.replicated = tp_size_ > 1 && !IsSharded(k);
    segments_.push_back(seg);
    total += sizes_[k];
  }
  num_params_ = total;
  auto allocate = [&](DeviceBuffer& buffer, size_t bytes) -> absl::Status {
    ASSIGN_OR_RETURN(DeviceBuffer b, DeviceBuffer::Allocate(*backend_, bytes));
    buffer = std::move(b);
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(allocate(params_memory_, sizeof(float) * total));
  RETURN_IF_ERROR(allocate(grads_memory_, sizeof(float) * total));
  params_ = params_memory_.as<float>();
  grads_ = grads_memory_.as<float>();
  auto ps = Slots(p_);
  auto gs = Slots(g_);
  int64_t offset = 0;
  for (int k = 0; k < kNumParameterTensors; ++k) {
    *ps[k] = sizes_[k] ? params_ + offset : nullptr;
    *gs[k] = sizes_[k] ? grads_ + offset : nullptr;
    offset += sizes_[k];
  }

  // Activations.
  const int64_t BT = static_cast<int64_t>(max_batch_) * max_seq_len_;
  const int64_t NHr = config_.n_head / tp_size_;
  const int64_t att_size = static_cast<int64_t>(max_batch_) * NHr * max_seq_len_;  // attention row lse
  const int64_t act_sizes[] = {
      BT * C,  // input
      Ls * BT * C,
      Ls * BT,
      Ls * BT,           // ln1, mean, rstd
      Ls * BT * 3 * Cr,  // qkv
      Ls * BT * Cr,      // atty
      Ls * att_size,     // att_lse
      Ls * BT * C,       // residual2
      Ls * BT * C,
      Ls * BT,
      Ls * BT,  // ln2, mean, rstd
      Ls * BT * Hr,
      Ls * BT * Hr,  // fch, fch_gelu
      Ls * BT * C,   // residual3
      has_head_ ? BT * C : 0,
      has_head_ ? BT : 0,
      has_head_ ? BT : 0,  // lnf, mean, rstd
      has_head_ ? BT * Vp : 0,
      has_head_ ? BT : 0,
      has_head_ ? BT : 0,  // logits, losses, lse
  };
  float** act_slots[] = {&input_,     &ln1_,      &ln1_mean_, &ln1_rstd_, &qkv_,    &atty_,     &att_lse_,
                         &residual2_, &ln2_,      &ln2_mean_, &ln2_rstd_, &fch_,    &fch_gelu_, &residual3_,
                         &lnf_,       &lnf_mean_, &lnf_rstd_, &logits_,   &losses_, &lse_};
  int64_t act_total = 0;
  for (int64_t s : act_sizes) act_total += s;
  RETURN_IF_ERROR(allocate(acts_memory_, sizeof(float) * act_total));
  offset = 0;
  for (size_t i = 0; i < std::size(act_sizes); ++i) {
    *act_slots[i] = act_sizes[i] ? acts_memory_.as<float>() + offset : nullptr;
    offset += act_sizes[i];
  }
  const int64_t scratch_sizes[] = {BT * C, BT * C, BT * C, BT * 3 * Cr, BT * Cr, BT * Hr};
  float** scratch_slots[] = {&dresidual_, &dln_, &proj_, &dqkv_, &datty_, &dfch_};
  int64_t scratch_total = 0;
  for (int64_t s : scratch_sizes) scratch_total += s;
  RETURN_IF_ERROR(allocate(scratch_memory_, sizeof(float) * scratch_total));
  offset = 0;
  for (size_t i = 0; i < std::size(scratch_sizes); ++i) {
    *scratch_slots[i] = scratch_memory_.as<float>() + offset;
    offset += scratch_sizes[i];
  }
  RETURN_IF_ERROR(allocate(tokens_memory_, sizeof(int32_t) * BT));
  RETURN_IF_ERROR(allocate(targets_memory_, sizeof(int32_t) * BT));
  tokens_ = tokens_memory_.as<int32_t>();
  targets_ = targets_memory_.as<int32_t>();
  if (tp_size_ > 1 && backend_->is_cuda() && !tp_comm_->accepts_device_memory()) tp_staging_.resize(BT * C);
  return absl::OkStatus();
}

absl::Status GPT2Stage::AllReduceHost(float* data, int64_t n) {
  if (tp_size_ == 1) return absl::OkStatus();
  return tp_comm_->AllReduceSum(data, n);
}

// The TensorParallelComm implementations sum host memory; a device stage therefore copies the
// activation gradient out and back (n <= max_batch x max_seq_len x C, the staging buffer's size).
absl::Status GPT2Stage::AllReduce(float* data, int64_t n) {
  if (tp_size_ == 1) return absl::OkStatus();
  if (tp_staging_.empty()) {
    // Host memory: the ops that wrote `data` must have finished (on the CPU they have; timed compute's are
    // queued on its emulated stream). A device comm (NCCL) orders itself on the stream instead.
    if (!backend_->is_cuda()) RETURN_IF_ERROR(backend_->Synchronize());
    return tp_comm_->AllReduceSum(data, n);
  }
  const size_t bytes = sizeof(float) * n;
  RETURN_IF_ERROR(backend_->CopyToHost(tp_staging_.data(), data, bytes));
  RETURN_IF_ERROR(tp_comm_->AllReduceSum(tp_staging_.data(), n));
  return backend_->CopyToDevice(data, tp_staging_.data(), bytes);
}

void GPT2Stage::ZeroGrad() { backend_->Zero(grads_, sizeof(float) * num_params_); }

const float* GPT2Stage::output() const {
  if (num_layers_ == 0) return input_;
  return residual3_ + static_cast<int64_t>(num_layers_ - 1) * max_batch_ * max_seq_len_ * config_.n_embd;
}
const float* GPT2Stage::dinput() const { return dresidual_; }
const float* GPT2Stage::logits() const { return logits_; }

absl::Status GPT2Stage::Forward(int B, int T, const int32_t* tokens, const float* input, const int32_t* targets) {
  if (B <= 0 || T <= 0 || B > max_batch_ || T > max_seq_len_) {
    return absl::InvalidArgumentError(
        absl::StrCat("forward: batch ", B, " x ", T, " exceeds the stage's ", max_batch_, " x ", max_seq_len_));
  }
  B_ = B;
  T_ = T;
  const int C = config_.n_embd, Cr = C / tp_size_, Hr = 4 * C / tp_size_, NHr = config_.n_head / tp_size_;
  const int64_t N = static_cast<int64_t>(B) * T;
  const int64_t act_stride = static_cast<int64_t>(max_batch_) * max_seq_len_;  // rows per layer slot
  const int64_t att_stride = static_cast<int64_t>(max_batch_) * NHr * max_seq_len_;
  if (has_embedding_) {
    if (tokens == nullptr) return absl::InvalidArgumentError("forward: the first stage needs tokens");
    for (int64_t i = 0; i < N; ++i) {
      if (tokens[i] < 0 || tokens[i] >= config_.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("forward: token ", tokens[i], " at ", i,
                                                       " is outside the vocabulary of ", config_.vocab_size));
      }
    }
    RETURN_IF_ERROR(backend_->CopyToDevice(tokens_, tokens, sizeof(int32_t) * N));
    backend_->encoder_forward(input_, tokens_, p_.wte, p_.wpe, B, T, C);
  } else {
    if (input == nullptr) return absl::InvalidArgumentError("forward: a later stage needs input activations");
    backend_->CopyOnDevice(input_, input, sizeof(float) * N * C);
  }
  for (int l = 0; l < num_layers_; ++l) {
    const float* residual = l == 0 ? input_ : residual3_ + (l - 1) * act_stride * C;
    float* ln1 = ln1_ + l * act_stride * C;
    float* ln1_mean = ln1_mean_ + l * act_stride;
    float* ln1_rstd = ln1_rstd_ + l * act_stride;
    float* qkv = qkv_ + l * act_stride * 3 * Cr;
    float* atty = atty_ + l * act_stride * Cr;
    float* att_lse = att_lse_ + l * att_stride;
    float* residual2 = residual2_ + l * act_stride * C;
    float* ln2 = ln2_ + l * act_stride * C;
    float* ln2_mean = ln2_mean_ + l * act_stride;
    float* ln2_rstd = ln2_rstd_ + l * act_stride;
    float* fch = fch_ + l * act_stride * Hr;
    float* fch_gelu = fch_gelu_ + l * act_stride * Hr;
    float* residual3 = residual3_ + l * act_stride * C;

    backend_->layernorm_forward(ln1, ln1_mean, ln1_rstd, residual, p_.ln1w + l * C, p_.ln1b + l * C, N, C);
    backend_->matmul_forward(qkv, ln1, p_.qkvw + static_cast<int64_t>(l) * 3 * Cr * C, p_.qkvb + l * 3 * Cr, N, C,
                             3 * Cr);
    backend_->attention_forward(atty, att_lse, qkv, B, T, Cr, NHr);
    backend_->matmul_forward(proj_, atty, p_.attprojw + static_cast<int64_t>(l) * C * Cr, nullptr, N, Cr, C);
    RETURN_IF_ERROR(AllReduce(proj_, N * C));
    backend_->add_bias(proj_, p_.attprojb + l * C, N, C);
    backend_->residual_forward(residual2, residual, proj_, N * C);
    backend_->layernorm_forward(ln2, ln2_mean, ln2_rstd, residual2, p_.ln2w + l * C, p_.ln2b + l * C, N, C);
    backend_->matmul_forward(fch, ln2, p_.fcw + static_cast<int64_t>(l) * Hr * C, p_.fcb + l * Hr, N, C, Hr);
    backend_->gelu_forward(fch_gelu, fch, N * Hr);
    backend_->matmul_forward(proj_, fch_gelu, p_.fcprojw + static_cast<int64_t>(l) * C * Hr, nullptr, N, Hr, C);
    RETURN_IF_ERROR(AllReduce(proj_, N * C));
    backend_->add_bias(proj_, p_.fcprojb + l * C, N, C);
    backend_->residual_forward(residual3, residual2, proj_, N * C);
  }
  have_targets_ = false;
  if (has_head_) {
    const int V = config_.vocab_size, Vp = config_.padded_vocab_size;
    backend_->layernorm_forward(lnf_, lnf_mean_, lnf_rstd_, output(), p_.lnfw, p_.lnfb, N, C);
    backend_->matmul_forward(logits_, lnf_, p_.wte, nullptr, N, C, Vp);
    if (targets != nullptr) {
      for (int64_t i = 0; i < N; ++i) {
        if (targets[i] < 0 || targets[i] >= V) {
          return absl::InvalidArgumentError(
              absl::StrCat("forward: target ", targets[i], " at ", i, " is outside the vocabulary of ", V));
        }
      }
      RETURN_IF_ERROR(backend_->CopyToDevice(targets_, targets, sizeof(int32_t) * N));
      backend_->crossentropy_forward(losses_, lse_, logits_, targets_, N, V, Vp);
      ASSIGN_OR_RETURN(double sum, backend_->Sum(losses_, N));
      loss_ = static_cast<float>(sum / N);
      have_targets_ = true;
    }
  }
  return backend_->Synchronize();
}

absl::Status GPT2Stage::Backward(const float* doutput, float loss_scale) {
  if (B_ == 0) return absl::FailedPreconditionError("backward before forward");
  const int B = B_, T = T_;
  const int C = config_.n_embd, Cr = C / tp_size_, Hr = 4 * C / tp_size_, NHr = config_.n_head / tp_size_;
  const int64_t N = static_cast<int64_t>(B) * T;
  const int64_t act_stride = static_cast<int64_t>(max_batch_) * max_seq_len_;
  const int64_t att_stride = static_cast<int64_t>(max_batch_) * NHr * max_seq_len_;
  float* dres = dresidual_;
  if (has_head_) {
    if (!have_targets_) return absl::FailedPreconditionError("backward on the last stage needs targets in forward");
    have_targets_ = false;  // logits are about to be overwritten by their gradient
    const int V = config_.vocab_size, Vp = config_.padded_vocab_size;
    backend_->crossentropy_backward_inplace(logits_, lse_, targets_, loss_scale / static_cast<float>(N), N, V, Vp);
    backend_->matmul_backward(dln_, g_.wte, nullptr, logits_, lnf_, p_.wte, N, C, Vp, false);
    backend_->Zero(dres, sizeof(float) * N * C);
    backend_->layernorm_backward(dres, g_.lnfw, g_.lnfb, dln_, output(), p_.lnfw, lnf_mean_, lnf_rstd_, N, C);
  } else {
    if (doutput == nullptr) return absl::InvalidArgumentError("backward: a non-last stage needs doutput");
    backend_->CopyOnDevice(dres, doutput, sizeof(float) * N * C);
  }
  for (int l = num_layers_ - 1; l >= 0; --l) {
    const float* residual = l == 0 ? input_ : residual3_ + (l - 1) * act_stride * C;
    const float* ln1 = ln1_ + l * act_stride * C;
    const float* qkv = qkv_ + l * act_stride * 3 * Cr;
    const float* atty = atty_ + l * act_stride * Cr;
    const float* att_lse = att_lse_ + l * att_stride;
    const float* residual2 = residual2_ + l * act_stride * C;
    const float* ln2 = ln2_ + l * act_stride * C;
    const float* fch = fch_ + l * act_stride * Hr;
    const float* fch_gelu = fch_gelu_ + l * act_stride * Hr;

    // MLP: dres is d(residual3) and also d(fcproj output).
    backend_->matmul_backward(dfch_, g_.fcprojw + static_cast<int64_t>(l) * C * Hr, g_.fcprojb + l * C, dres, fch_gelu,
                              p_.fcprojw + static_cast<int64_t>(l) * C * Hr, N, Hr, C, false);
    backend_->gelu_backward(dfch_, fch, dfch_, N * Hr);
    backend_->matmul_backward(dln_, g_.fcw + static_cast<int64_t>(l) * Hr * C, g_.fcb + l * Hr, dfch_, ln2,
                              p_.fcw + static_cast<int64_t>(l) * Hr * C, N, C, Hr, false);
    RETURN_IF_ERROR(AllReduce(dln_, N * C));
    backend_->layernorm_backward(dres, g_.ln2w + l * C, g_.ln2b + l * C, dln_, residual2, p_.ln2w + l * C,
                                 ln2_mean_ + l * act_stride, ln2_rstd_ + l * act_stride, N, C);
    // Attention: dres is now d(residual2) and d(attproj output).
    backend_->matmul_backward(datty_, g_.attprojw + static_cast<int64_t>(l) * C * Cr, g_.attprojb + l * C, dres, atty,
                              p_.attprojw + static_cast<int64_t>(l) * C * Cr, N, Cr, C, false);
    backend_->attention_backward(dqkv_, datty_, qkv, atty, att_lse, B, T, Cr, NHr);
    backend_->matmul_backward(dln_, g_.qkvw + static_cast<int64_t>(l) * 3 * Cr * C, g_.qkvb + l * 3 * Cr, dqkv_, ln1,
                              p_.qkvw + static_cast<int64_t>(l) * 3 * Cr * C, N, C, 3 * Cr, false);
    RETURN_IF_ERROR(AllReduce(dln_, N * C));
    backend_->layernorm_backward(dres, g_.ln1w + l * C, g_.ln1b + l * C, dln_, residual, p_.ln1w + l * C,
                                 ln1_mean_ + l * act_stride, ln1_rstd_ + l * act_stride, N, C);
    if (layer_gradients_ready_) {
      RETURN_IF_ERROR(backend_->Synchronize());
      layer_gradients_ready_(l);
    }
  }
  if (has_embedding_) backend_->encoder_backward(g_.wte, g_.wpe, dres, tokens_, B, T, C);
  RETURN_IF_ERROR(backend_->Synchronize());
  if (layer_gradients_ready_) layer_gradients_ready_(-1);
  return absl::OkStatus();
}

std::vector<absl::Span<float>> GPT2Stage::LayerGradientSpans(int local_layer) {
  std::vector<absl::Span<float>> spans;
  if (local_layer < 0 || local_layer >= num_layers_) return spans;
  auto gs = Slots(g_);
  for (const BlockName& b : kBlockNames) {
    const int64_t per_layer = sizes_[b.kind] / num_layers_;
    spans.emplace_back(*gs[b.kind] + local_layer * per_layer, per_layer);
  }
  return spans;
}

std::vector<absl::Span<float>> GPT2Stage::NonLayerGradientSpans() {
  std::vector<absl::Span<float>> spans;
  auto gs = Slots(g_);
  for (Kind kind : {kWte, kWpe, kLnfw, kLnfb}) {
    if (sizes_[kind] > 0) spans.emplace_back(*gs[kind], sizes_[kind]);
  }
  return spans;
}

double GPT2Stage::GradSquaredNormShare() const {
  double total = 0.0;
  for (const ParameterSegment& seg : segments_) {
    if (seg.duplicate) continue;
    absl::StatusOr<double> s = backend_->SumSquares(grads_ + seg.offset, seg.count);
    if (!s.ok()) return std::nan("");
    total += *s;
  }
  return total;
}

std::vector<std::string> GPT2Stage::TensorNames() const {
  std::vector<std::string> names;
  if (has_embedding_ || has_head_) names.push_back("wte.weight");
  if (has_embedding_) names.push_back("wpe.weight");
  for (int l = first_layer_; l < last_layer_; ++l) {
    for (const BlockName& b : kBlockNames) names.push_back(absl::StrCat("h.", l, ".", b.suffix));
  }
  if (has_head_) {
    names.push_back("ln_f.weight");
    names.push_back("ln_f.bias");
  }
  return names;
}

absl::StatusOr<std::pair<int, int>> GPT2Stage::ParseName(const std::string& name) const {
  auto missing = [&]() {
    return absl::NotFoundError(
        absl::StrCat("tensor '", name, "' is not held by this stage (layers [", first_layer_, ", ", last_layer_, "))"));
  };
  auto whole = [&](int kind) -> absl::StatusOr<std::pair<int, int>> {
    if (sizes_[kind] == 0) return missing();
    return std::make_pair(kind, 0);
  };
  if (name == "wte.weight") return whole(kWte);
  if (name == "wpe.weight") return whole(kWpe);
  if (name == "ln_f.weight") return whole(kLnfw);
  if (name == "ln_f.bias") return whole(kLnfb);
  std::vector<std::string> parts = absl::StrSplit(name, absl::MaxSplits('.', 2));
  int layer = 0;
  if (parts.size() == 3 && parts[0] == "h" && absl::SimpleAtoi(parts[1], &layer)) {
    for (const BlockName& b : kBlockNames) {
      if (parts[2] == b.suffix) {
        if (layer < first_layer_ || layer >= last_layer_) return missing();
        return std::make_pair(int{b.kind}, layer - first_layer_);
      }
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("'", name, "' is not a GPT-2 tensor name"));
}

absl::StatusOr<std::vector<int64_t>> GPT2Stage::TensorShape(const std::string& name) const {
  ASSIGN_OR_RETURN(const auto parsed, ParseName(name));
  const int64_t C = config_.n_embd;
  switch (parsed.first) {
    case kWte:
      return std::vector<int64_t>{config_.vocab_size, C};
    case kWpe:
      return std::vector<int64_t>{config_.block_size, C};
    case kQkvw:
      return std::vector<int64_t>{C, 3 * C};
    case kQkvb:
      return std::vector<int64_t>{3 * C};
    case kAttprojw:
      return std::vector<int64_t>{C, C};
    case kFcw:
      return std::vector<int64_t>{C, 4 * C};
    case kFcb:
      return std::vector<int64_t>{4 * C};
    case kFcprojw:
      return std::vector<int64_t>{4 * C, C};
    default:
      return std::vector<int64_t>{C};
  }
}

// Walks every element of this rank's part of a tensor as (local offset, full HF offset).
template <typename Fn>
static void ForEachElement(int kind, int64_t C, int64_t Cr, int64_t Hr, int rank, int64_t rows, Fn fn) {
  switch (kind) {
    case kQkvw:  // local (3Cr, C); full (C, 3C)
      for (int64_t p = 0; p < 3; ++p)
        for (int64_t j = 0; j < Cr; ++j)
          for (int64_t i = 0; i < C; ++i) fn(((p * Cr + j) * C) + i, i * 3 * C + p * C + rank * Cr + j);
      break;
    case kQkvb:
      for (int64_t p = 0; p < 3; ++p)
        for (int64_t j = 0; j < Cr; ++j) fn(p * Cr + j, p * C + rank * Cr + j);
      break;
    case kAttprojw:  // local (C, Cr); full (C in, C out)
      for (int64_t o = 0; o < C; ++o)
        for (int64_t j = 0; j < Cr; ++j) fn(o * Cr + j, (rank * Cr + j) * C + o);
      break;
    case kFcw:  // local (Hr, C); full (C, 4C)
      for (int64_t j = 0; j < Hr; ++j)
        for (int64_t i = 0; i < C; ++i) fn(j * C + i, i * 4 * C + rank * Hr + j);
      break;
    case kFcb:
      for (int64_t j = 0; j < Hr; ++j) fn(j, rank * Hr + j);
      break;
    case kFcprojw:  // local (C, Hr); full (4C, C)
      for (int64_t o = 0; o < C; ++o)
        for (int64_t j = 0; j < Hr; ++j) fn(o * Hr + j, (rank * Hr + j) * C + o);
      break;
    default:  // replicated, same layout; `rows` x C elements (or C for vectors)
      for (int64_t i = 0; i < rows; ++i) fn(i, i);
      break;
  }
}

absl::StatusOr<GPT2Stage::Piece> GPT2Stage::Locate(const std::string& name) const {
  ASSIGN_OR_RETURN(const auto parsed, ParseName(name));
  const auto [kind, layer] = parsed;
  const bool per_block = !(kind == kWte || kind == kWpe || kind == kLnfw || kind == kLnfb);
  Piece piece;
  piece.kind = kind;
  piece.count = sizes_[kind] / (per_block ? num_layers_ : 1);
  for (int k = 0; k < kind; ++k) piece.offset += sizes_[k];
  piece.offset += layer * piece.count;
  const std::vector<int64_t> shape = *TensorShape(name);
  piece.full_count = 1;
  for (int64_t d : shape) piece.full_count *= d;
  return piece;
}

absl::Status GPT2Stage::CopyPiece(const Piece& piece, float* local, const float* full, float* full_out) {
  const int64_t C = config_.n_embd, Cr = C / tp_size_, Hr = 4 * C / tp_size_;
  const int64_t count = piece.full_count;
  if (full != nullptr) {
    ForEachElement(piece.kind, C, Cr, Hr, tp_rank_, count, [&](int64_t li, int64_t fi) { local[li] = full[fi]; });
  } else {
    if (IsSharded(piece.kind)) std::fill(full_out, full_out + count, 0.0f);
    ForEachElement(piece.kind, C, Cr, Hr, tp_rank_, count, [&](int64_t li, int64_t fi) { full_out[fi] = local[li]; });
    if (IsSharded(piece.kind)) return AllReduceHost(full_out, count);
  }
  return absl::OkStatus();
}

// On a device the piece is copied to the host, changed there (an import does not write every element:
// wte's padded rows) and copied back.
absl::Status GPT2Stage::CopyBackendPiece(const std::string& name, float* base, const float* full, float* full_out) {
  ASSIGN_OR_RETURN(Piece piece, Locate(name));
  if (!backend_->is_cuda()) return CopyPiece(piece, base + piece.offset, full, full_out);
  std::vector<float> host(piece.count);
  float* local = base + piece.offset;
  const size_t bytes = sizeof(float) * piece.count;
  RETURN_IF_ERROR(backend_->CopyToHost(host.data(), local, bytes));
  RETURN_IF_ERROR(CopyPiece(piece, host.data(), full, full_out));
  return full != nullptr ? backend_->CopyToDevice(local, host.data(), bytes) : absl::OkStatus();
}

absl::Status GPT2Stage::ImportTensor(const std::string& name, const float* data, int64_t count) {
  RETURN_IF_ERROR(CheckTensorCount(name, count));
  return CopyBackendPiece(name, params_, data, nullptr);
}

absl::Status GPT2Stage::ExportTensorFromBuffer(const std::string& name, const float* buffer, float* out) {
  ASSIGN_OR_RETURN(Piece piece, Locate(name));
  return CopyPiece(piece, const_cast<float*>(buffer) + piece.offset, nullptr, out);
}

absl::Status GPT2Stage::ImportTensorToBuffer(const std::string& name, const float* data, int64_t count, float* buffer) {
  RETURN_IF_ERROR(CheckTensorCount(name, count));
  ASSIGN_OR_RETURN(Piece piece, Locate(name));
  return CopyPiece(piece, buffer + piece.offset, data, nullptr);
}

absl::Status GPT2Stage::CheckTensorCount(const std::string& name, int64_t count) const {
  ASSIGN_OR_RETURN(std::vector<int64_t> shape, TensorShape(name));
  int64_t expected = 1;
  for (int64_t d : shape) expected *= d;
  if (count != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "' has ", count, " elements; the model expects ", expected));
  }
  return absl::OkStatus();
}

absl::Status GPT2Stage::ExportTensor(const std::string& name, bool from_grads, float* out) {
  return CopyBackendPiece(name, from_grads ? grads_ : params_, nullptr, out);
}

void GPT2Stage::InitializeWeights(uint64_t seed) {
  backend_->Zero(params_, sizeof(float) * num_params_);
  const float residual_std = 0.02f / std::sqrt(2.0f * config_.n_layer);
  std::vector<float> full;
  for (const std::string& name : TensorNames()) {
    const int kind = ParseName(name)->first;
    std::vector<int64_t> shape = *TensorShape(name);
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    full.assign(count, 0.0f);
    if (kind == kLn1w || kind == kLn2w || kind == kLnfw) {
      std::fill(full.begin(), full.end(), 1.0f);
    } else if (HasDecay(kind)) {
      const float stddev = (kind == kAttprojw || kind == kFcprojw) ? residual_std : 0.02f;
      NormalStream stream(seed, name);
      for (float& x : full) x = stream.Next(stddev);
    }
    // A device copy error is kept by the backend and reported by its next Synchronize (Forward's).
    (void)CopyBackendPiece(name, params_, full.data(), nullptr);
  }
}

absl::Status SumTiedEmbeddingGradients(GPT2Stage& first, GPT2Stage& last) {
  if (&first == &last) return absl::OkStatus();
  float* a = first.grad_tensors().wte;
  float* b = last.grad_tensors().wte;
  if (a == nullptr || b == nullptr || !first.has_embedding() || !last.has_head()) {
    return absl::InvalidArgumentError("SumTiedEmbeddingGradients needs the first stage and the last stage");
  }
  const int64_t n = static_cast<int64_t>(first.config().padded_vocab_size) * first.config().n_embd;
  const size_t bytes = sizeof(float) * n;
  Backend& backend = first.backend();
  if (&backend == &last.backend() || (!backend.is_cuda() && !last.backend().is_cuda())) {
    // One memory: a += b, then b = a (both hold a + b, bit for bit).
    backend.accumulate(a, b, n);
    backend.CopyOnDevice(b, a, bytes);
    return backend.Synchronize();
  }
  std::vector<float> host_a(n), host_b(n);
  RETURN_IF_ERROR(backend.CopyToHost(host_a.data(), a, bytes));
  RETURN_IF_ERROR(last.backend().CopyToHost(host_b.data(), b, bytes));
  CpuBackendInstance()->accumulate(host_a.data(), host_b.data(), n);
  RETURN_IF_ERROR(backend.CopyToDevice(a, host_a.data(), bytes));
  RETURN_IF_ERROR(last.backend().CopyToDevice(b, host_a.data(), bytes));
  RETURN_IF_ERROR(backend.Synchronize());
  return last.backend().Synchronize();
}

}  // namespace geotrain::model
