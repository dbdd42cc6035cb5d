// The CUDA backend: Backend over one cuda::CudaContext (a device, a stream, a cuBLAS handle), every
// op a call of its twin in model/cuda/ops_cuda.h. Compiled only when geotrain_model_cuda is built.
#include "model/cuda_backend.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "model/cuda/ops_cuda.h"

namespace geotrain::model {
namespace {

cuda::GemmPrecision ToGemmPrecision(Precision precision) {
  switch (precision) {
    case Precision::kBf16:
      return cuda::GemmPrecision::kBf16;
    case Precision::kFp16:
      return cuda::GemmPrecision::kFp16;
    case Precision::kFp32:
      break;
  }
  return cuda::GemmPrecision::kFp32;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(std::unique_ptr<cuda::CudaContext> ctx, std::string name)
      : ctx_(std::move(ctx)), name_(std::move(name)) {}

  std::string name() const override { return name_; }
  bool is_cuda() const override { return true; }
  cuda::CudaContext& context() { return *ctx_; }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    absl::StatusOr<void*> ptr = ctx_->Allocate(bytes);
    if (ptr.ok()) ctx_->Zero(*ptr, bytes);
    return ptr;
  }
  void Free(void* ptr) override { ctx_->Free(ptr); }
  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) override {
    return Keep(ctx_->CopyToDevice(dst, host_src, bytes));
  }
  // The context queues the copy; a pageable destination makes cudaMemcpyAsync wait for it, but a
  // pinned one would not, so wait explicitly: callers read host_dst right after.
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    RETURN_IF_ERROR(Keep(ctx_->CopyToHost(host_dst, src, bytes)));
    return Synchronize();
  }
  void CopyOnDevice(void* dst, const void* src, size_t bytes) override { ctx_->CopyOnDevice(dst, src, bytes); }
  void Zero(void* ptr, size_t bytes) override { ctx_->Zero(ptr, bytes); }
  absl::Status Synchronize() override {
    absl::Status status = ctx_->Synchronize();
    if (!kept_error_.ok()) {
      status = std::move(kept_error_);
      kept_error_ = absl::OkStatus();
    }
    return status;
  }

  void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T,
                       int C) override {
    cuda::encoder_forward(*ctx_, out, inp, wte, wpe, B, T, C);
  }
  void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T, int C) override {
    cuda::encoder_backward(*ctx_, dwte, dwpe, dout, inp, B, T, C);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                         int64_t N, int C) override {
    cuda::layernorm_forward(*ctx_, out, mean, rstd, inp, weight, bias, N, C);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int64_t N, int C) override {
    cuda::layernorm_backward(*ctx_, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C,
                      int OC) override {
    cuda::matmul_forward(*ctx_, out, inp, weight, bias, N, C, OC);
  }
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int64_t N, int C, int OC, bool accumulate_dinp) override {
    cuda::matmul_backward(*ctx_, dinp, dweight, dbias, dout, inp, weight, N, C, OC, accumulate_dinp);
  }
  void add_bias(float* out, const float* bias, int64_t N, int OC) override { cuda::add_bias(*ctx_, out, bias, N, OC); }
  void bias_backward(float* dbias, const float* dout, int64_t N, int OC) override {
    cuda::bias_backward(*ctx_, dbias, dout, N, OC);
  }
  void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH) override {
    cuda::attention_forward(*ctx_, out, lse, qkv, B, T, C, NH);
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                          int T, int C, int NH) override {
    cuda::attention_backward(*ctx_, dqkv, dout, qkv, out, lse, B, T, C, NH);
  }
  void gelu_forward(float* out, const float* inp, int64_t N) override { cuda::gelu_forward(*ctx_, out, inp, N); }
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t N) override {
    cuda::gelu_backward(*ctx_, dinp, inp, dout, N);
  }
  void residual_forward(float* out, const float* a, const float* b, int64_t N) override {
    cuda::residual_forward(*ctx_, out, a, b, N);
  }
  void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N, int V,
                            int Vp) override {
    cuda::crossentropy_forward(*ctx_, losses, lse, logits, targets, N, V, Vp);
  }
  void crossentropy_backward_inplace(float* logits, const float* lse, const int32_t* targets, float dloss, int64_t N,
                                     int V, int Vp) override {
    cuda::crossentropy_backward_inplace(*ctx_, logits, lse, targets, dloss, N, V, Vp);
  }

  void accumulate(float* out, const float* in, int64_t n) override { cuda::accumulate(*ctx_, out, in, n); }
  void scale(float* x, int64_t n, float factor) override { cuda::scale(*ctx_, x, n, factor); }
  absl::StatusOr<double> Sum(const float* x, int64_t n) override { return Keep(cuda::Sum(*ctx_, x, n)); }
  absl::StatusOr<double> SumSquares(const float* x, int64_t n) override { return Keep(cuda::SumSquares(*ctx_, x, n)); }
  void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float decay, float beta1,
                    float beta2, float eps, float grad_scale, float step_size, float bc2_sqrt) override {
    cuda::adamw_update(*ctx_, params, grads, m, v, n, decay, beta1, beta2, eps, grad_scale, step_size, bc2_sqrt);
  }

 private:
  // Errors returned directly are also kept for the next Synchronize(), so that callers that cannot
  // return a Status (GPT2Stage::GradSquaredNormShare, InitializeWeights) still have them reported.
  absl::Status Keep(absl::Status status) {
    if (!status.ok() && kept_error_.ok()) kept_error_ = status;
    return status;
  }
  absl::StatusOr<double> Keep(absl::StatusOr<double> value) {
    if (!value.ok()) (void)Keep(value.status());
    return value;
  }

  std::unique_ptr<cuda::CudaContext> ctx_;
  std::string name_;
  absl::Status kept_error_;
};

}  // namespace

cuda::CudaContext* CudaContextOf(Backend& backend) {
  auto* cuda_backend = dynamic_cast<CudaBackend*>(&backend);
  return cuda_backend != nullptr ? &cuda_backend->context() : nullptr;
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device, Precision precision) {
  const int count = cuda::DeviceCount();
  if (device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("no CUDA device ", device, ": this machine has ", count,
                     count == 0 ? " (no driver or no GPU visible; check nvidia-smi and CUDA_VISIBLE_DEVICES, or use "
                                  "device 'cpu')"
                                : "; use cuda:0 .. cuda:" + std::to_string(count - 1)));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<cuda::CudaContext> ctx,
                   cuda::CudaContext::Create(device, ToGemmPrecision(precision)));
  absl::StatusOr<std::string> description = cuda::DeviceDescription(device);
  std::string name = absl::StrCat("cuda:", device, " (", description.ok() ? *description : "unknown device", ", ",
                                  std::string(PrecisionName(precision)), " GEMMs)");
  return std::unique_ptr<Backend>(new CudaBackend(std::move(ctx), std::move(name)));
}

}  // namespace geotrain::model
