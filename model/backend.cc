// The CPU backend (model/ops.h on host memory), the backend factory and DeviceBuffer (see
// backend.h).
#include "model/backend.h"

#include <cstring>
#include <new>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "model/cuda_backend.h"
#include "model/ops.h"
#include "model/precision.h"
#include "model/timed_backend.h"

namespace geotrain::model {
namespace {

// Every op runs to completion on the calling thread's OpenMP team before it returns. In fp32 it is stateless; in
// bf16 or fp16 its GEMMs take their inputs rounded as a GPU's tensor cores would (model/precision.h), through
// scratch buffers the backend owns (one driving thread at a time, as for every backend).
class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(Precision precision = Precision::kFp32) : precision_(precision) {}

  std::string name() const override {
    return precision_ == Precision::kFp32
               ? "cpu"
               : absl::StrCat("cpu (", std::string(PrecisionName(precision_)), " GEMM inputs, emulated)");
  }
  bool is_cuda() const override { return false; }

  // operator new like the std::vector buffers this replaced, so alignment (and with it the
  // vectorised reductions' order) is what it was.
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* ptr = ::operator new(bytes, std::nothrow);
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
    }
    std::memset(ptr, 0, bytes);
    return ptr;
  }
  void Free(void* ptr) override { ::operator delete(ptr); }
  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) override {
    if (bytes > 0) std::memmove(dst, host_src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memmove(host_dst, src, bytes);
    return absl::OkStatus();
  }
  void CopyOnDevice(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memmove(dst, src, bytes);
  }
  void Zero(void* ptr, size_t bytes) override {
    if (bytes > 0) std::memset(ptr, 0, bytes);
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T,
                       int C) override {
    model::encoder_forward(out, inp, wte, wpe, B, T, C);
  }
  void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T, int C) override {
    model::encoder_backward(dwte, dwpe, dout, inp, B, T, C);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                         int64_t N, int C) override {
    model::layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int64_t N, int C) override {
    model::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C,
                      int OC) override {
    if (precision_ != Precision::kFp32) {
      inp = Rounded(0, inp, N * C);
      weight = Rounded(1, weight, static_cast<int64_t>(OC) * C);
    }
    model::matmul_forward(out, inp, weight, bias, N, C, OC);
  }
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int64_t N, int C, int OC, bool accumulate_dinp) override {
    if (precision_ != Precision::kFp32) {
      // The bias gradient sums the fp32 dout, as the GPU's bias kernel does; the GEMMs see it rounded.
      if (dbias != nullptr) model::bias_backward(dbias, dout, N, OC);
      dbias = nullptr;
      dout = Rounded(0, dout, N * OC);
      inp = Rounded(1, inp, N * C);
      if (dinp != nullptr) weight = Rounded(2, weight, static_cast<int64_t>(OC) * C);
    }
    model::matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC, accumulate_dinp);
  }
  void add_bias(float* out, const float* bias, int64_t N, int OC) override { model::add_bias(out, bias, N, OC); }
  void bias_backward(float* dbias, const float* dout, int64_t N, int OC) override {
    model::bias_backward(dbias, dout, N, OC);
  }
  void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH) override {
    model::attention_forward(out, lse, qkv, B, T, C, NH);
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                          int T, int C, int NH) override {
    model::attention_backward(dqkv, dout, qkv, out, lse, B, T, C, NH);
  }
  void gelu_forward(float* out, const float* inp, int64_t N) override { model::gelu_forward(out, inp, N); }
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t N) override {
    model::gelu_backward(dinp, inp, dout, N);
  }
  void residual_forward(float* out, const float* a, const float* b, int64_t N) override {
    model::residual_forward(out, a, b, N);
  }
  void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N, int V,
                            int Vp) override {
    model::crossentropy_forward(losses, lse, logits, targets, N, V, Vp);
  }
  void crossentropy_backward_inplace(float* logits, const float* lse, const int32_t* targets, float dloss, int64_t N,
                                     int V, int Vp) override {
    model::crossentropy_backward_inplace(logits, lse, targets, dloss, N, V, Vp);
  }

  void accumulate(float* out, const float* in, int64_t n) override { model::accumulate(out, in, n); }
  void scale(float* x, int64_t n, float factor) override { model::scale(x, n, factor); }
  absl::StatusOr<double> Sum(const float* x, int64_t n) override {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += x[i];
    return sum;
  }
  absl::StatusOr<double> SumSquares(const float* x, int64_t n) override {
    double sum = 0.0;
#pragma omp parallel for simd reduction(+ : sum) schedule(static)
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
    return sum;
  }
  void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float decay, float beta1,
                    float beta2, float eps, float grad_scale, float step_size, float bc2_sqrt) override {
    model::adamw_update(params, grads, m, v, n, decay, beta1, beta2, eps, grad_scale, step_size, bc2_sqrt);
  }

 private:
  // The `slot`th operand of a GEMM, rounded to precision_ into a scratch buffer that lives until the next GEMM.
  const float* Rounded(int slot, const float* in, int64_t n) {
    std::vector<float>& buffer = scratch_[slot];
    if (buffer.size() < static_cast<size_t>(n)) buffer.resize(static_cast<size_t>(n));
    RoundToPrecision(precision_, in, buffer.data(), n);
    return buffer.data();
  }

  const Precision precision_;
  std::vector<float> scratch_[3];  // the GEMM operands (inp, weight; dout, inp, weight) in half precision
};

}  // namespace

Backend* CpuBackendInstance() {
  static CpuBackend* const instance = new CpuBackend();
  return instance;
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(std::string_view device_view, Precision precision) {
  const std::string device(device_view);  // this Abseil's string_view is not std::string_view
  if (device == "cpu") return std::unique_ptr<Backend>(new CpuBackend(precision));
  if (device.starts_with("timed:")) {
    ASSIGN_OR_RETURN(std::unique_ptr<TimedBackend> timed, MakeTimedBackend(device, precision));
    return std::unique_ptr<Backend>(std::move(timed));
  }
  int index = 0;
  if (device != "cuda" && (!device.starts_with("cuda:") || !absl::SimpleAtoi(device.substr(5), &index) || index < 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("device '", device,
                     "' is not 'cpu', 'cuda', 'cuda:N' (N the device index) or 'timed:...' (docs/timed-compute.md)"));
  }
  return MakeCudaBackend(index, precision);
}

#ifndef GEOTRAIN_HAVE_CUDA
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device, Precision) {
  return absl::FailedPreconditionError(
      absl::StrCat("device cuda:", device,
                   " requested but this geotrain was built without the CUDA backend; install the CUDA "
                   "toolkit (nvcc, cuBLAS) and NCCL and rebuild with -DGEOTRAIN_CUDA=ON, or use device 'cpu'"));
}

cuda::CudaContext* CudaContextOf(Backend&) { return nullptr; }
#endif

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(Backend& backend, size_t bytes) {
  ASSIGN_OR_RETURN(void* ptr, backend.Allocate(bytes));
  return DeviceBuffer(&backend, ptr, bytes);
}

DeviceBuffer::~DeviceBuffer() { Release(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : backend_(other.backend_), ptr_(other.ptr_), bytes_(other.bytes_) {
  other.backend_ = nullptr;
  other.ptr_ = nullptr;
  other.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    backend_ = other.backend_;
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
    other.backend_ = nullptr;
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::Release() {
  if (backend_ != nullptr && ptr_ != nullptr) backend_->Free(ptr_);
  backend_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

}  // namespace geotrain::model
