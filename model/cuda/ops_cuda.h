// The GPT-2 ops on a CUDA device: the same functions, semantics and argument order as model/ops.h (read
// it first), on device pointers, queued on the context's stream. Every op is checked element by element
// against its CPU twin in tests/gpu/ (fp32 relative error under 1e-5, bf16 GEMMs under 1e-2).
//
//   ASSIGN_OR_RETURN(auto ctx, cuda::CudaContext::Create(/*device=*/0, cuda::GemmPrecision::kBf16));
//   cuda::matmul_forward(*ctx, out, inp, weight, bias, N, C, OC);   // queued, returns at once
//   RETURN_IF_ERROR(ctx->Synchronize());                             // waits and reports any CUDA error
//
// Precision: parameters, gradients, optimizer moments and activations are fp32 in device memory (the fp32
// master weights). In GemmPrecision::kBf16 the GEMMs convert their inputs to bf16 in the context's
// workspace and multiply on the tensor cores with fp32 accumulation and fp32 output; in kFp32 they run in
// pedantic fp32 (CUBLAS_COMPUTE_32F, no TF32), which the parity tests use.
//
// Memory: the ops never allocate except the context's workspace, which grows on first use of a larger
// shape and is then reused (so steady-state steps allocate nothing).
// Errors: launch errors surface at the next Synchronize() (or a function returning a Status/StatusOr);
// functions returning void only queue work.
// Thread safety: a context (and its stream) is driven by one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Opaque CUDA handles, so that this header compiles without the CUDA headers.
typedef struct CUstream_st* cudaStream_t;
typedef struct cublasContext* cublasHandle_t;

namespace geotrain::model::cuda {

struct CublasApi;  // cublas_loader.h

enum class GemmPrecision { kFp32, kBf16, kFp16 };

// Number of CUDA devices visible (0 when there is no driver or no device; never an error).
int DeviceCount();
// "NAME, sm_XY, N GiB" of device `device`, or the CUDA error.
absl::StatusOr<std::string> DeviceDescription(int device);

// One device, one stream, one cuBLAS handle and a growable workspace.
class CudaContext {
 public:
  // Selects `device`, creates a non-blocking stream and a cuBLAS handle bound to it (opening cuBLAS on the first
  // call: cublas_loader.h). FAILED_PRECONDITION with the CUDA error when there is no such device, or with the
  // loader's when cuBLAS cannot be opened.
  static absl::StatusOr<std::unique_ptr<CudaContext>> Create(int device, GemmPrecision precision);
  ~CudaContext();
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t cublas() const { return cublas_; }
  // The cuBLAS entry points to call with cublas() (never null once Create succeeded).
  const CublasApi& cublas_api() const { return *cublas_api_; }
  GemmPrecision precision() const { return precision_; }
  void set_precision(GemmPrecision precision) { precision_ = precision; }

  // At least `bytes` of device scratch, valid until the next call (grows, never shrinks). Synchronizes
  // the stream before it reallocates.
  absl::StatusOr<void*> Workspace(size_t bytes);
  // Waits for the stream; returns the first CUDA or cuBLAS error since the last call, with context.
  absl::Status Synchronize();

  // Device memory (cudaMalloc / cudaFree) and copies on this context's stream. Copies from or to
  // pageable host memory are synchronous with respect to the host.
  absl::StatusOr<void*> Allocate(size_t bytes);
  void Free(void* ptr);
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes);
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes);
  void CopyOnDevice(void* dst, const void* src, size_t bytes);
  void Zero(void* ptr, size_t bytes);

  // Remembers the first error of queued work (a failed launch, a cuBLAS status, a workspace that could
  // not grow) for the next Synchronize() to return; later errors are dropped until then. The ops call
  // it; callers only need it for errors of their own launches on stream().
  void RecordError(absl::Status status);

 private:
  CudaContext(int device, GemmPrecision precision) : device_(device), precision_(precision) {}
  int device_;
  GemmPrecision precision_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  const CublasApi* cublas_api_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  absl::Status first_error_;
};

// ---- The model ops (see model/ops.h for each one's contract; pointers are device pointers). ----
// Differences from the CPU: attention supports head sizes C/NH up to 128 (larger ones are an
// INVALID_ARGUMENT at the next Synchronize()); encoder_backward's dwte, layernorm_backward's dweight and dbias
// and bias_backward's (so matmul_backward's) dbias are summed with float atomics: their last bits vary from run
// to run.
void encoder_forward(CudaContext& ctx, float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T,
                     int C);
void encoder_backward(CudaContext& ctx, float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T,
                      int C);
void layernorm_forward(CudaContext& ctx, float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int C);
void layernorm_backward(CudaContext& ctx, float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd, int64_t N, int C);
void matmul_forward(CudaContext& ctx, float* out, const float* inp, const float* weight, const float* bias, int64_t N,
                    int C, int OC);
void matmul_backward(CudaContext& ctx, float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int C, int OC, bool accumulate_dinp);
void add_bias(CudaContext& ctx, float* out, const float* bias, int64_t N, int OC);
void bias_backward(CudaContext& ctx, float* dbias, const float* dout, int64_t N, int OC);
void attention_forward(CudaContext& ctx, float* out, float* lse, const float* qkv, int B, int T, int C, int NH);
void attention_backward(CudaContext& ctx, float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int B, int T, int C, int NH);
void gelu_forward(CudaContext& ctx, float* out, const float* inp, int64_t N);
void gelu_backward(CudaContext& ctx, float* dinp, const float* inp, const float* dout, int64_t N);
void residual_forward(CudaContext& ctx, float* out, const float* a, const float* b, int64_t N);
void crossentropy_forward(CudaContext& ctx, float* losses, float* lse, const float* logits, const int32_t* targets,
                          int64_t N, int V, int Vp);
void crossentropy_backward_inplace(CudaContext& ctx, float* logits, const float* lse, const int32_t* targets,
                                   float dloss, int64_t N, int V, int Vp);

// ---- Training arithmetic. ----
// out(n) += in(n).
void accumulate(CudaContext& ctx, float* out, const float* in, int64_t n);
// x(n) *= factor.
void scale(CudaContext& ctx, float* x, int64_t n, float factor);
// Sum of x(n), and sum of squares, accumulated in double; synchronizes and returns the value.
absl::StatusOr<double> Sum(CudaContext& ctx, const float* x, int64_t n);
absl::StatusOr<double> SumSquares(CudaContext& ctx, const float* x, int64_t n);
// One AdamW update of n parameters with the CPU's arithmetic (model/optimizer.cc, torch.optim.AdamW):
//   g = grads*grad_scale; p = params*decay; m += (1-b1)(g-m); v = b2 v + (1-b2) g^2;
//   params = p - step_size * m / (sqrt(v) / bc2_sqrt + eps)
// where decay = 1 - lr*weight_decay (1 for segments without decay), step_size = lr / (1 - b1^t) and
// bc2_sqrt = sqrt(1 - b2^t) for step t (1-based), computed by the caller as the CPU does.
void adamw_update(CudaContext& ctx, float* params, const float* grads, float* m, float* v, int64_t n, float decay,
                  float beta1, float beta2, float eps, float grad_scale, float step_size, float bc2_sqrt);

// ---- Codec pack and unpack (comm/codec.h's raw payloads, bit for bit the CPU encoder's output). ----
void pack_bf16(CudaContext& ctx, uint16_t* out, const float* in, int64_t n);  // round to nearest even
void unpack_bf16(CudaContext& ctx, float* out, const uint16_t* in, int64_t n);
void pack_fp16(CudaContext& ctx, uint16_t* out, const float* in, int64_t n);  // round to nearest even
void unpack_fp16(CudaContext& ctx, float* out, const uint16_t* in, int64_t n);
// int8 with one fp32 scale per block of comm::kInt8BlockSize (256) elements: scales(ceil(n/256)), q(n).
void pack_int8(CudaContext& ctx, float* scales, int8_t* q, const float* in, int64_t n);
void unpack_int8(CudaContext& ctx, float* out, const float* scales, const int8_t* q, int64_t n);

}  // namespace geotrain::model::cuda
