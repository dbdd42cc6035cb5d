// Timed compute: a Backend whose ops compute nothing and take the time an emulated GPU would take instead.
// A worker started with --emulate-device NAME --timed-compute runs its stages on it, so that a cluster of
// CPU processes behaves, in time, like one of GPUs, while every tensor that crosses actors keeps its real
// size and goes through the real runtime (docs/timed-compute.md).
//
//   ASSIGN_OR_RETURN(std::unique_ptr<Backend> b, MakeBackend("timed:H100@400:2680:5"));
//   auto stage = GPT2Stage::Create(config, {.backend = b.get(), .max_batch = 8});  // allocates no real memory
//   stage->Forward(...);  // returns after the emulated device's time for these shapes
//
// Time: each op costs Roofline::Seconds(op's FLOPs and bytes, model/op_costs.h). Like a GPU stream, ops are
// queued: the backend keeps the time its emulated device is busy until, and the calls that wait for the
// device (Synchronize, CopyToHost, Sum, SumSquares) sleep until then. The time charged is also counted
// (busy_seconds), and with Options::sleep false nothing sleeps at all: the backend then only counts, which
// predicts a step's compute time (PredictTrainingStepSeconds).
//
// Memory: Allocate hands out address space of the requested size backed by one small shared window of
// physical memory (every allocation maps the same pages over and over), so that a GPT-2 large stage, its
// gradients and its optimizer take a few MB. The contents are zeros, and stay zeros because no op writes:
// the only writers are the runtime's communication (receives, all-reduces), which sums and moves zeros, and
// DiLoCo's outer step (model/diloco.h OuterOptimizer::Apply), which writes back the zeros it started from.
// Anything that would write real values into backend memory (loading weights, InitializeWeights) must not
// be used with this backend (a timed stage has no real weights; checkpoints of a timed job are refused).
// CopyToDevice and CopyOnDevice copy nothing (time only); CopyToHost writes zeros. Sum and SumSquares return 0:
// a timed stage's loss and gradient norm are not real numbers and must never be reported as such.
//
// Threads: like every backend, one thread drives it.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "model/backend.h"
#include "model/config.h"
#include "model/op_costs.h"

namespace geotrain::model {

class TimedBackend : public Backend {
 public:
  struct Options {
    std::string device_name;  // the emulated device, for name()
    Roofline roofline;
    bool sleep = true;                      // false: count the time only
    size_t window_bytes = size_t{8} << 20;  // physical memory behind every allocation
  };
  // INVALID_ARGUMENT when the roofline's speeds are not positive; INTERNAL when the window cannot be made.
  static absl::StatusOr<std::unique_ptr<TimedBackend>> Create(Options options);
  ~TimedBackend() override;

  std::string name() const override;
  bool is_cuda() const override { return false; }  // its memory is host memory (zeros) the runtime may read
  const Roofline& roofline() const { return options_.roofline; }
  // Emulated device seconds charged so far, and the FLOPs and bytes behind them.
  double busy_seconds() const { return busy_seconds_; }
  const OpCost& total_cost() const { return total_; }

  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Free(void* ptr) override;
  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) override;
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override;
  void CopyOnDevice(void* dst, const void* src, size_t bytes) override;
  void Zero(void* ptr, size_t bytes) override;
  absl::Status Synchronize() override;

  void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T,
                       int C) override;
  void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T, int C) override;
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                         int64_t N, int C) override;
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int64_t N, int C) override;
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C,
                      int OC) override;
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int64_t N, int C, int OC, bool accumulate_dinp) override;
  void add_bias(float* out, const float* bias, int64_t N, int OC) override;
  void bias_backward(float* dbias, const float* dout, int64_t N, int OC) override;
  void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH) override;
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                          int T, int C, int NH) override;
  void gelu_forward(float* out, const float* inp, int64_t N) override;
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t N) override;
  void residual_forward(float* out, const float* a, const float* b, int64_t N) override;
  void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N, int V,
                            int Vp) override;
  void crossentropy_backward_inplace(float* logits, const float* lse, const int32_t* targets, float dloss, int64_t N,
                                     int V, int Vp) override;
  void accumulate(float* out, const float* in, int64_t n) override;
  void scale(float* x, int64_t n, float factor) override;
  absl::StatusOr<double> Sum(const float* x, int64_t n) override;
  absl::StatusOr<double> SumSquares(const float* x, int64_t n) override;
  void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float decay, float beta1,
                    float beta2, float eps, float grad_scale, float step_size, float bc2_sqrt) override;

 private:
  using Clock = std::chrono::steady_clock;
  TimedBackend(Options options, int window_fd);
  // Queues an op of this cost on the emulated device.
  void Charge(const OpCost& cost);
  // Waits until the emulated device has finished what was queued.
  void Wait();

  const Options options_;
  const int window_fd_;
  Clock::time_point busy_until_;
  double busy_seconds_ = 0;
  OpCost total_;
  absl::Mutex mu_;  // Free may come from another thread than the driving one (a buffer's owner)
  std::map<void*, size_t> mappings_ ABSL_GUARDED_BY(mu_);
};

// The backend for a device name "timed:NAME@TFLOPS:GBPS:LAUNCH_US[:FP32_TFLOPS]" (achieved FLOP/s in TFLOP/s on
// the tensor cores, bf16 and fp16, achieved memory bandwidth in GB/s, per-op launch overhead in microseconds, and
// the achieved fp32 FLOP/s where the device's fp32 peak is known), as worker/devices.h's TimedDeviceName writes it.
// In fp32 the GEMMs run at FP32_TFLOPS when given (a GPU's CUDA cores, several times slower than its tensor cores).
// INVALID_ARGUMENT naming the form otherwise.
absl::StatusOr<std::unique_ptr<TimedBackend>> MakeTimedBackend(std::string_view device,
                                                               Precision precision = Precision::kBf16);

// Emulated device seconds of one training step of a whole `config` model (forward and backward of
// `microbatches` microbatches of B x T tokens, then AdamW), under `roofline`: the waits a timed stage adds up,
// counted without sleeping. For calibration and for tests' expectations.
absl::StatusOr<double> PredictTrainingStepSeconds(const GPT2Config& config, int B, int T, int microbatches,
                                                  const Roofline& roofline);

}  // namespace geotrain::model
