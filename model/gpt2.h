// GPT-2 in fp32 on the CPU or a CUDA device, cut into pipeline stages and tensor-parallel shards.
//
// A GPT2Stage owns a contiguous range of blocks [first_layer, last_layer); the first stage also owns
// the token and position embeddings, the last one the final LayerNorm, the head (tied to wte) and the
// loss. The whole model is the stage with every block (StageOptions defaults). With tp_comm set, the
// stage holds rank r's shard (Megatron): heads [r*NH/tp, (r+1)*NH/tp) of each block and MLP hidden
// columns [r*4C/tp, (r+1)*4C/tp); everything else is replicated.
//
//   auto model = GPT2Stage::Create(config, {});         // the full model, tp = 1, on the CPU
//   (*model)->InitializeWeights(/*seed=*/1337);
//   (*model)->ZeroGrad();
//   (*model)->Forward(B, T, tokens, nullptr, targets);  // then loss()
//   (*model)->Backward(nullptr, 1.0f);                  // grads accumulate in grads()
//
// Stages run in sequence compose to the full model's numbers exactly: stage k's output() feeds stage
// k+1's Forward(input), and stage k+1's dinput() feeds stage k's Backward(doutput). The last stage
// keeps its own copy of wte when it is not also the first: call SumTiedEmbeddingGradients before the
// optimizer step so both copies get the same (summed) gradient and stay equal.
//
// Device: StageOptions::backend chooses where parameters, gradients and activations live and where the
// ops run (model/backend.h; null is the CPU). Every float* the stage returns or takes as activations
// (params(), grads(), param_tensors(), grad_tensors(), the gradient spans, output(), dinput(), logits(),
// Forward's input, Backward's doutput) is backend memory: DEVICE pointers on a CUDA backend, moved with
// the backend's CopyToHost / CopyToDevice. Tokens and targets are host arrays (checked, then copied to the
// device); the tensor import and export functions take and give host arrays.
//
// Memory: parameters, gradients and activations are each one allocation, made at construction (the
// activations for up to max_batch x max_seq_len); Forward and Backward do not allocate for tensors.
// A stage is not thread-safe; one thread drives it (TP ranks each drive their own stage).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/backend.h"
#include "model/config.h"
#include "model/tp_comm.h"

namespace geotrain::model {

// Pointers into one contiguous buffer (parameters or gradients: same layout). Ls = layers of the stage,
// Cr = C / tp and Hr = 4C / tp on a tensor-parallel rank. Weights are (out, in) as in llm.c; checkpoints
// use HF's Conv1D (in, out) layout (see ExportTensor). Absent tensors are null.
struct ParameterTensors {
  float* wte;       // (Vp, C)      first stage, and last stage (tied head); rows >= V stay zero
  float* wpe;       // (maxT, C)    first stage
  float* ln1w;      // (Ls, C)
  float* ln1b;      // (Ls, C)
  float* qkvw;      // (Ls, 3*Cr, C) rows: this rank's q channels, then k, then v
  float* qkvb;      // (Ls, 3*Cr)
  float* attprojw;  // (Ls, C, Cr)
  float* attprojb;  // (Ls, C)       replicated; added after the all-reduce
  float* ln2w;      // (Ls, C)
  float* ln2b;      // (Ls, C)
  float* fcw;       // (Ls, Hr, C)
  float* fcb;       // (Ls, Hr)
  float* fcprojw;   // (Ls, C, Hr)
  float* fcprojb;   // (Ls, C)       replicated; added after the all-reduce
  float* lnfw;      // (C)          last stage
  float* lnfb;      // (C)          last stage
};
inline constexpr int kNumParameterTensors = 16;

struct StageOptions {
  int first_layer = 0;
  int last_layer = -1;                    // exclusive; -1 means n_layer
  bool has_embedding = true;              // normally first_layer == 0
  bool has_head = true;                   // normally last_layer == n_layer
  TensorParallelComm* tp_comm = nullptr;  // null: tp = 1
  Backend* backend = nullptr;             // null: the CPU; not owned, must outlive the stage
  int max_batch = 4;
  int max_seq_len = 0;  // 0: block_size
  // Convenience: the options of stage `stage` of `num_stages` with the runtime's split (SplitStageBlocks in
  // model/config.h: blocks split as evenly as possible, earlier stages get the extra blocks).
  static StageOptions Split(const GPT2Config& config, int stage, int num_stages);
};

// A piece of the parameter buffer with one optimizer policy.
struct ParameterSegment {
  int64_t offset = 0;
  int64_t count = 0;
  bool weight_decay = false;  // true for matmul weights and embeddings, false for biases and LayerNorms
  // True when another stage or TP rank holds an identical copy whose gradient is the same (replicated
  // tensors on TP rank > 0; the last stage's tied wte). Counted once by the global gradient norm.
  bool duplicate = false;
  // True when tp > 1 and the tensor is whole on every TP rank (not sharded): its values and gradients are the
  // same on each. The runtime's data parallelism across sites sums 1/tp of it per rank (worker/stage_trainer.h).
  bool replicated = false;
};

class GPT2Stage {
 public:
  // Checks the options (layer range, n_head % tp, sizes) and allocates everything through the backend.
  static absl::StatusOr<std::unique_ptr<GPT2Stage>> Create(const GPT2Config& config, const StageOptions& options);
  GPT2Stage(const GPT2Stage&) = delete;
  GPT2Stage& operator=(const GPT2Stage&) = delete;

  const GPT2Config& config() const { return config_; }
  bool has_embedding() const { return has_embedding_; }
  bool has_head() const { return has_head_; }
  int first_layer() const { return first_layer_; }
  int last_layer() const { return last_layer_; }
  int tp_rank() const { return tp_rank_; }
  int tp_size() const { return tp_size_; }
  Backend& backend() const { return *backend_; }

  // GPT-2 initialisation: N(0, 0.02) for weights and embeddings, residual projections (attn.c_proj,
  // mlp.c_proj) N(0, 0.02/sqrt(2L)), biases 0, LayerNorm weights 1. Each full HF tensor draws from its
  // own stream seeded by (seed, name), so every stage split and TP degree gets the same model.
  void InitializeWeights(uint64_t seed);

  // Forward on B sequences of T tokens (B <= max_batch, T <= max_seq_len). First stage: tokens (B,T),
  // host memory, input ignored; otherwise input (B,T,C), backend memory, is the previous stage's output
  // (copied). Last stage: targets (B,T), host memory, give the loss; they may be null to compute logits
  // only. Returns once the work is done on the device too (device errors are reported here).
  absl::Status Forward(int B, int T, const int32_t* tokens, const float* input, const int32_t* targets);
  // Backward of the last Forward; ACCUMULATES parameter gradients. Last stage: doutput is ignored and
  // the loss gradient is loss_scale * d(mean loss) (use 1/microbatches when accumulating). Otherwise
  // doutput (B,T,C), backend memory, is the next stage's dinput(). Destroys logits(). Returns once the
  // work is done on the device too.
  absl::Status Backward(const float* doutput, float loss_scale);
  void ZeroGrad();

  // Hook for overlapping the gradient all-reduce with backward. When set, Backward calls fn(l) for each
  // local block l in descending order (num_layers()-1 .. 0) as soon as block l's parameter gradients are
  // final for this Backward call (right after its ln1 backward): this call does not touch
  // LayerGradientSpans(l) again. It then calls fn(-1) at the very end, once the gradients of
  // NonLayerGradientSpans() (wte, wpe, ln_f) are final too. fn runs on the thread that called Backward,
  // synchronously: Backward continues when fn returns, so fn should only hand the spans to another thread
  // (or queue work) and must not call back into this stage. On a CUDA backend Backward waits for the
  // device before each call, so the gradients are in device memory when fn runs. On an error Backward
  // returns early and the remaining calls are not made. Pass an empty function to remove the hook.
  void set_layer_gradients_ready(std::function<void(int local_layer)> fn) { layer_gradients_ready_ = std::move(fn); }
  int num_layers() const { return num_layers_; }
  // The 12 gradient pieces of local block l (0 <= l < num_layers()), in buffer order: ln1w, ln1b, qkvw,
  // qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb (this rank's shards on a TP rank).
  std::vector<absl::Span<float>> LayerGradientSpans(int local_layer);
  // The gradients that belong to no block: wte, wpe, lnfw, lnfb, those this stage holds. Together with
  // LayerGradientSpans(0 .. num_layers()-1) they cover grads() exactly once.
  std::vector<absl::Span<float>> NonLayerGradientSpans();

  const float* output() const;          // (B,T,C) after Forward, not on the last stage
  const float* dinput() const;          // (B,T,C) after Backward, not on the first stage
  float loss() const { return loss_; }  // mean over B*T, last stage with targets
  const float* logits() const;          // (B,T,Vp) after Forward on the last stage
  int batch() const { return B_; }
  int seq_len() const { return T_; }

  // Backend memory (device pointers on a CUDA backend), num_params() floats each.
  float* params() { return params_; }
  float* grads() { return grads_; }
  int64_t num_params() const { return num_params_; }
  const ParameterTensors& param_tensors() const { return p_; }
  const ParameterTensors& grad_tensors() const { return g_; }
  const std::vector<ParameterSegment>& segments() const { return segments_; }

  // Sum of squared gradients over this stage's share (duplicates counted by exactly one holder): add
  // the figures of every stage and TP rank, then take the square root for the global norm. NaN when the
  // device failed (the backend's next Synchronize, e.g. in the next Forward, reports the error).
  double GradSquaredNormShare() const;

  // HF GPT-2 names of the full tensors this stage holds (a shard of some on a TP rank), e.g.
  // "wte.weight", "h.3.attn.c_attn.weight", "ln_f.bias".
  std::vector<std::string> TensorNames() const;
  // Full HF shape of a tensor (wte.weight is (V, C), Conv1D weights (in, out)).
  absl::StatusOr<std::vector<int64_t>> TensorShape(const std::string& name) const;
  // Sets this stage's part of the tensor `name` from the full HF tensor `data` (host memory, shape
  // TensorShape); on a device backend through a host staging copy.
  absl::Status ImportTensor(const std::string& name, const float* data, int64_t count);
  // Writes the full HF tensor `name` from parameters (or gradients when from_grads) into out
  // (host memory, TensorShape elements). On a TP rank > 1 this is collective: every rank must call it in
  // the same order, and each gets the whole tensor (shards are gathered through the all-reduce).
  absl::Status ExportTensor(const std::string& name, bool from_grads, float* out);
  // The same two mappings for any HOST buffer with the parameter layout (num_params floats), e.g. the
  // optimizer's moments copied to the host (AdamW::CopyMomentsToHost), to save them under HF names too.
  absl::Status ImportTensorToBuffer(const std::string& name, const float* data, int64_t count, float* buffer);
  absl::Status ExportTensorFromBuffer(const std::string& name, const float* buffer, float* out);

 private:
  // This stage's piece of one HF tensor: `count` floats at `offset` of the parameter layout.
  struct Piece {
    int kind = 0;
    int64_t offset = 0, count = 0;
    int64_t full_count = 0;  // elements of the full HF tensor
  };

  GPT2Stage(const GPT2Config& config, const StageOptions& options);
  absl::Status BuildLayout();
  // Sum all-reduce over the TP group of backend memory (staged through host memory on a device unless
  // the comm accepts device pointers), and of host memory.
  absl::Status AllReduce(float* data, int64_t n);
  absl::Status AllReduceHost(float* data, int64_t n);
  // Maps a name to (kind, local layer); kind indexes ParameterTensors in declaration order.
  absl::StatusOr<std::pair<int, int>> ParseName(const std::string& name) const;
  absl::StatusOr<Piece> Locate(const std::string& name) const;
  absl::Status CheckTensorCount(const std::string& name, int64_t count) const;
  // Copies between a piece in host memory (`local`) and the full HF tensor: from `full` when it is set,
  // else into `full_out` (collective on a TP rank for sharded tensors).
  absl::Status CopyPiece(const Piece& piece, float* local, const float* full, float* full_out);
  // The same for a piece of a backend buffer (params_ or grads_), through host staging on a device.
  absl::Status CopyBackendPiece(const std::string& name, float* base, const float* full, float* full_out);

  GPT2Config config_;
  int first_layer_, last_layer_, num_layers_;
  bool has_embedding_, has_head_;
  TensorParallelComm* tp_comm_;
  Backend* backend_;
  int tp_rank_ = 0, tp_size_ = 1;
  int max_batch_, max_seq_len_;
  int B_ = 0, T_ = 0;
  float loss_ = 0.0f;
  bool have_targets_ = false;
  std::function<void(int)> layer_gradients_ready_;

  int64_t sizes_[kNumParameterTensors] = {};
  int64_t num_params_ = 0;
  DeviceBuffer params_memory_, grads_memory_;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  ParameterTensors p_{}, g_{};
  std::vector<ParameterSegment> segments_;

  // Activations (one buffer) and backward scratch (another), tokens and targets (B,T), in backend memory.
  DeviceBuffer acts_memory_, scratch_memory_, tokens_memory_, targets_memory_;
  int32_t* tokens_ = nullptr;
  int32_t* targets_ = nullptr;
  // Host copy of activations for the TP all-reduce on a device (max_batch x max_seq_len x C), else empty.
  std::vector<float> tp_staging_;
  float* input_ = nullptr;      // (B,T,C): encoded tokens or the copied stage input
  float* ln1_ = nullptr;        // (Ls,B,T,C)
  float* ln1_mean_ = nullptr;   // (Ls,B,T)
  float* ln1_rstd_ = nullptr;   // (Ls,B,T)
  float* qkv_ = nullptr;        // (Ls,B,T,3Cr)
  float* atty_ = nullptr;       // (Ls,B,T,Cr)
  float* att_lse_ = nullptr;    // (Ls,B,NHr,T): attention rows' log-sum-exp (fused attention)
  float* residual2_ = nullptr;  // (Ls,B,T,C)
  float* ln2_ = nullptr;        // (Ls,B,T,C)
  float* ln2_mean_ = nullptr;   // (Ls,B,T)
  float* ln2_rstd_ = nullptr;   // (Ls,B,T)
  float* fch_ = nullptr;        // (Ls,B,T,Hr)
  float* fch_gelu_ = nullptr;   // (Ls,B,T,Hr)
  float* residual3_ = nullptr;  // (Ls,B,T,C)
  float* lnf_ = nullptr;        // (B,T,C)
  float* lnf_mean_ = nullptr;   // (B,T)
  float* lnf_rstd_ = nullptr;   // (B,T)
  float* logits_ = nullptr;     // (B,T,Vp)
  float* losses_ = nullptr;     // (B,T)
  float* lse_ = nullptr;        // (B,T)
  // Scratch: dresidual (B,T,C), dln (B,T,C), proj (B,T,C), dqkv (B,T,3Cr), datty (B,T,Cr), dfch (B,T,Hr).
  float* dresidual_ = nullptr;
  float* dln_ = nullptr;
  float* proj_ = nullptr;
  float* dqkv_ = nullptr;
  float* datty_ = nullptr;
  float* dfch_ = nullptr;
};

// Adds the two wte gradient parts of a first and a last stage (different stages, tp-equal shapes) so
// both hold the sum; call before the optimizer step. A no-op error-free call when first == last. The
// stages may be on different backends (the sum then goes through host memory).
absl::Status SumTiedEmbeddingGradients(GPT2Stage& first, GPT2Stage& last);

}  // namespace geotrain::model
