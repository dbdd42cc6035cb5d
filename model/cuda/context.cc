// CudaContext (device, stream, cuBLAS handle, workspace, error memory), device queries, and the launch
// bookkeeping every op shares (cuda_check.h).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "model/cuda/cublas_loader.h"
#include "model/cuda/cuda_check.h"
#include "model/cuda/ops_cuda.h"

namespace geotrain::model::cuda {
namespace {

std::string CudaErrorText(cudaError_t error) {
  return absl::StrCat(cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
}

// GEOTRAIN_CUDA_SYNC=1: synchronize after every op (see cuda_check.h).
bool SyncEveryOp() {
  static const bool sync = [] {
    const char* value = std::getenv("GEOTRAIN_CUDA_SYNC");
    return value != nullptr && value[0] == '1';
  }();
  return sync;
}

}  // namespace

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: clear the error so that it does not leak into later calls
    return 0;
  }
  return count;
}

absl::StatusOr<std::string> DeviceDescription(int device) {
  cudaDeviceProp prop;
  const cudaError_t error = cudaGetDeviceProperties(&prop, device);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, ": ", CudaErrorText(error)));
  }
  const double gib = static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0);
  return absl::StrCat(prop.name, ", sm_", prop.major, prop.minor, ", ", static_cast<int>(gib + 0.5), " GiB");
}

absl::StatusOr<std::unique_ptr<CudaContext>> CudaContext::Create(int device, GemmPrecision precision) {
  const int count = DeviceCount();
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device ", device, " (this machine has ", count,
                                                      "); check nvidia-smi and CUDA_VISIBLE_DEVICES"));
  }
  absl::StatusOr<const CublasApi*> cublas = LoadCublas();
  if (!cublas.ok()) return cublas.status();
  std::unique_ptr<CudaContext> ctx(new CudaContext(device, precision));
  ctx->cublas_api_ = *cublas;
  cudaError_t error = cudaSetDevice(device);
  if (error == cudaSuccess) error = cudaStreamCreateWithFlags(&ctx->stream_, cudaStreamNonBlocking);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("CUDA device ", device, ": ", CudaErrorText(error)));
  }
  cublasStatus_t status = (*cublas)->create(&ctx->cublas_);
  if (status == CUBLAS_STATUS_SUCCESS) status = (*cublas)->set_stream(ctx->cublas_, ctx->stream_);
  if (status != CUBLAS_STATUS_SUCCESS) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuBLAS on CUDA device ", device, ": ", (*cublas)->status_string(status)));
  }
  return ctx;
}

CudaContext::~CudaContext() {
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (cublas_ != nullptr) cublas_api_->destroy(cublas_);
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  cudaGetLastError();
}

void CudaContext::RecordError(absl::Status status) {
  if (first_error_.ok() && !status.ok()) first_error_ = std::move(status);
}

absl::StatusOr<void*> CudaContext::Workspace(size_t bytes) {
  if (bytes <= workspace_bytes_ && workspace_ != nullptr) return workspace_;
  internal::UseDevice(*this);
  // Queued work may still read the old workspace: wait for it before freeing.
  cudaError_t error = cudaStreamSynchronize(stream_);
  if (error != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("CUDA error in queued work before growing the workspace: ", CudaErrorText(error)));
  }
  if (workspace_ != nullptr) cudaFree(workspace_);
  workspace_ = nullptr;
  workspace_bytes_ = 0;
  // Round up to 2 MiB so that slowly growing shapes do not reallocate every call.
  constexpr size_t kGranule = size_t{2} << 20;
  const size_t rounded = (std::max<size_t>(bytes, 1) + kGranule - 1) / kGranule * kGranule;
  error = cudaMalloc(&workspace_, rounded);
  if (error != cudaSuccess) {
    cudaGetLastError();
    workspace_ = nullptr;
    return absl::ResourceExhaustedError(
        absl::StrCat("CUDA workspace of ", rounded, " bytes on device ", device_, ": ", CudaErrorText(error)));
  }
  workspace_bytes_ = rounded;
  return workspace_;
}

absl::Status CudaContext::Synchronize() {
  internal::UseDevice(*this);
  const cudaError_t error = cudaStreamSynchronize(stream_);
  if (error != cudaSuccess) {
    RecordError(
        absl::InternalError(absl::StrCat("CUDA error in queued work on device ", device_, ": ", CudaErrorText(error),
                                         "; run with GEOTRAIN_CUDA_SYNC=1 to name the op")));
  }
  absl::Status result = std::move(first_error_);
  first_error_ = absl::OkStatus();
  return result;
}

absl::StatusOr<void*> CudaContext::Allocate(size_t bytes) {
  internal::UseDevice(*this);
  void* ptr = nullptr;
  const cudaError_t error = cudaMalloc(&ptr, std::max<size_t>(bytes, 1));
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaMalloc of ", bytes, " bytes on device ", device_, ": ", CudaErrorText(error)));
  }
  return ptr;
}

void CudaContext::Free(void* ptr) {
  if (ptr == nullptr) return;
  internal::UseDevice(*this);
  internal::CheckCuda(*this, cudaFree(ptr), "Free");
}

namespace {

// A copy between host and device memory on the context's stream; `direction` ("to", "from") names it in
// errors.
absl::Status CopyWithHost(CudaContext& ctx, void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                          const char* direction) {
  if (bytes == 0) return absl::OkStatus();
  internal::UseDevice(ctx);
  const cudaError_t error = cudaMemcpyAsync(dst, src, bytes, kind, ctx.stream());
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(
        absl::StrCat("copy of ", bytes, " bytes ", direction, " device ", ctx.device(), ": ", CudaErrorText(error)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaContext::CopyToDevice(void* dst, const void* src, size_t bytes) {
  return CopyWithHost(*this, dst, src, bytes, cudaMemcpyHostToDevice, "to");
}

absl::Status CudaContext::CopyToHost(void* dst, const void* src, size_t bytes) {
  return CopyWithHost(*this, dst, src, bytes, cudaMemcpyDeviceToHost, "from");
}

void CudaContext::CopyOnDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  internal::UseDevice(*this);
  internal::CheckCuda(*this, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "CopyOnDevice");
}

void CudaContext::Zero(void* ptr, size_t bytes) {
  if (bytes == 0) return;
  internal::UseDevice(*this);
  internal::CheckCuda(*this, cudaMemsetAsync(ptr, 0, bytes, stream_), "Zero");
}

namespace internal {

void UseDevice(CudaContext& ctx) {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != ctx.device()) {
    CheckCuda(ctx, cudaSetDevice(ctx.device()), "cudaSetDevice");
  }
}

void CheckCuda(CudaContext& ctx, cudaError_t error, const char* op) {
  if (error == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so that it is reported once, under this op
  ctx.RecordError(absl::InternalError(absl::StrCat(op, " on CUDA device ", ctx.device(), ": ", CudaErrorText(error))));
}

void CheckLaunch(CudaContext& ctx, const char* op) {
  CheckCuda(ctx, cudaGetLastError(), op);
  if (SyncEveryOp()) CheckCuda(ctx, cudaStreamSynchronize(ctx.stream()), op);
}

void CheckCublas(CudaContext& ctx, int status, const char* op) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  ctx.RecordError(
      absl::InternalError(absl::StrCat(op, " on CUDA device ", ctx.device(), ": cuBLAS ",
                                       ctx.cublas_api().status_string(static_cast<cublasStatus_t>(status)))));
}

int SmCount(CudaContext& ctx) {
  static std::mutex mu;
  static int cached[64] = {};
  const int device = ctx.device();
  std::lock_guard<std::mutex> lock(mu);
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0) {
    cudaGetLastError();
    count = 108;  // an A100's count: only sizes grids, never correctness
  }
  if (device >= 0 && device < 64) cached[device] = count;
  return count;
}

unsigned GridFor(CudaContext& ctx, int64_t items, int per_block) {
  // 32 blocks per SM keeps every SM busy (and the tail short) for any block size used here; the loops
  // inside the kernels cover the rest.
  const int64_t wanted = (items + per_block - 1) / per_block;
  const int64_t cap = int64_t{32} * SmCount(ctx);
  return static_cast<unsigned>(std::clamp<int64_t>(wanted, 1, cap));
}

int WorkspaceLayout::Add(size_t bytes) {
  if (count_ >= kMaxPieces) std::abort();  // a broken invariant of this file's callers, not a user error
  offsets_[count_] = total_;
  total_ += (bytes + 255) & ~size_t{255};
  return count_++;
}

bool WorkspaceLayout::Acquire(CudaContext& ctx, const char* op) {
  absl::StatusOr<void*> base = ctx.Workspace(total_);
  if (!base.ok()) {
    ctx.RecordError(absl::Status(base.status().code(), absl::StrCat(op, ": ", base.status().message())));
    return false;
  }
  base_ = *base;
  return true;
}

}  // namespace internal
}  // namespace geotrain::model::cuda
