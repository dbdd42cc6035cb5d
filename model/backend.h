// Where the model's numbers live and run: the CPU (model/ops.h) or a CUDA device
// (model/cuda/ops_cuda.h). GPT2Stage and AdamW are written once against Backend; a backend owns the
// memory it hands out and runs every op of model/ops.h (same names, same argument order, same
// contracts) on that memory, plus the training arithmetic (accumulate, scale, sums, the AdamW
// update).
//
//   ASSIGN_OR_RETURN(std::unique_ptr<Backend> cuda, MakeBackend("cuda:0", Precision::kBf16));
//   auto stage = GPT2Stage::Create(config, {.backend = cuda.get(), .max_batch = 8});
//   auto adam = AdamW::Create(stage->num_params(), stage->segments(), {}, *cuda);
//
// Pointers: every float* / int32_t* an op takes is backend memory (from Allocate; on the CPU
// backend any host memory is backend memory). Host data crosses with CopyToDevice / CopyToHost
// only. Ordering: ops are queued in call order on one stream and may return before they finish (on
// the CPU they finish before returning). Copies to or from the host, Sum and SumSquares wait for
// what was queued before them. Synchronize waits for everything and returns the first error since
// its last call: a void op that failed reports there. Threads: a backend is driven by one thread at
// a time (a CUDA backend is one device and one stream); CpuBackendInstance() is stateless and may
// be shared by any number of threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "model/precision.h"

namespace geotrain::model {

// Precision (model/precision.h): the GEMMs' input precision. Parameters, gradients, moments and activations stay
// fp32 (the master copy) in every precision; kBf16 / kFp16 multiply inputs rounded to bf16 / fp16 with fp32
// accumulation, on a GPU's tensor cores or, on the CPU, by rounding before fp32 GEMMs (the same values).

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;  // "cpu", "cuda:0 (NVIDIA H100 ..., fp32 GEMMs)"
  virtual bool is_cuda() const = 0;

  // ---- Memory. ----
  // `bytes` of zeroed backend memory (null for 0 bytes); RESOURCE_EXHAUSTED or the device error on
  // failure.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  virtual absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void CopyOnDevice(void* dst, const void* src, size_t bytes) = 0;
  virtual void Zero(void* ptr, size_t bytes) = 0;
  virtual absl::Status Synchronize() = 0;

  // ---- The ops of model/ops.h (read the contracts there). ----
  virtual void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T,
                               int C) = 0;
  virtual void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T,
                                int C) = 0;
  virtual void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                                 const float* bias, int64_t N, int C) = 0;
  virtual void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                                  const float* weight, const float* mean, const float* rstd, int64_t N, int C) = 0;
  virtual void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C,
                              int OC) = 0;
  virtual void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* weight, int64_t N, int C, int OC, bool accumulate_dinp) = 0;
  virtual void add_bias(float* out, const float* bias, int64_t N, int OC) = 0;
  virtual void bias_backward(float* dbias, const float* dout, int64_t N, int OC) = 0;
  virtual void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH) = 0;
  virtual void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                                  int B, int T, int C, int NH) = 0;
  virtual void gelu_forward(float* out, const float* inp, int64_t N) = 0;
  virtual void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t N) = 0;
  virtual void residual_forward(float* out, const float* a, const float* b, int64_t N) = 0;
  virtual void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                                    int V, int Vp) = 0;
  virtual void crossentropy_backward_inplace(float* logits, const float* lse, const int32_t* targets, float dloss,
                                             int64_t N, int V, int Vp) = 0;

  // ---- Training arithmetic. ----
  // out(n) += in(n).
  virtual void accumulate(float* out, const float* in, int64_t n) = 0;
  // x(n) *= factor.
  virtual void scale(float* x, int64_t n, float factor) = 0;
  // Sum of x(n) and sum of squares, accumulated in double; wait for the queued work. On the CPU,
  // Sum adds in index order and SumSquares is an OpenMP reduction (deterministic for a fixed thread
  // count).
  virtual absl::StatusOr<double> Sum(const float* x, int64_t n) = 0;
  virtual absl::StatusOr<double> SumSquares(const float* x, int64_t n) = 0;
  // One AdamW update of n parameters (see model/ops.h adamw_update for the arithmetic and
  // arguments).
  virtual void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float decay, float beta1,
                            float beta2, float eps, float grad_scale, float step_size, float bc2_sqrt) = 0;
};

// The backend for a device name: "cpu", "cuda:N" ("cuda" is "cuda:0"), or "timed:..." (timed compute,
// model/timed_backend.h), running its GEMMs in `precision` (a timed backend computes nothing and ignores it). FAILED_PRECONDITION
// naming the fix when this build has no CUDA or there is no such device; INVALID_ARGUMENT for any
// other name.
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(std::string_view device, Precision precision = Precision::kFp32);

// The process-wide CPU backend (what a null Backend* means everywhere). Never destroyed.
Backend* CpuBackendInstance();

// Backend memory owned by value: freed by its backend on destruction. Move-only. The backend must
// outlive the buffer.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // `bytes` of zeroed memory from `backend`.
  static absl::StatusOr<DeviceBuffer> Allocate(Backend& backend, size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  DeviceBuffer(Backend* backend, void* ptr, size_t bytes) : backend_(backend), ptr_(ptr), bytes_(bytes) {}
  void Release();

  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace geotrain::model
