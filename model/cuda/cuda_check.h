// Internal to model/cuda/: what every op does around its launches. Each op makes its context's device
// current (a context may be driven by different threads over its life, one at a time), queues its kernels
// on the context's stream, and reports a failed launch or API call through CudaContext::RecordError, so that
// the next Synchronize() returns it with the op's name. Launch grids are sized here so that no op ever
// exceeds the grid limits, whatever N: kernels use grid-stride loops.
//
// Debugging: GEOTRAIN_CUDA_SYNC=1 makes every op synchronize after its launches, so that a fault inside a
// kernel (an illegal address, say) is reported under the op that caused it instead of at the next
// Synchronize().
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "model/cuda/ops_cuda.h"

namespace geotrain::model::cuda::internal {

// Makes ctx's device current on the calling thread.
void UseDevice(CudaContext& ctx);
// Records the error, if any, of the launches just queued by `op` (cudaGetLastError).
void CheckLaunch(CudaContext& ctx, const char* op);
// Records `error` (a CUDA runtime call made by `op`) unless it is cudaSuccess.
void CheckCuda(CudaContext& ctx, cudaError_t error, const char* op);
// Records a failed cuBLAS call (its cublasStatus_t, as int so that this header needs no cuBLAS).
void CheckCublas(CudaContext& ctx, int status, const char* op);

// Streaming multiprocessors of ctx's device (cached per device).
int SmCount(CudaContext& ctx);

// Blocks for a grid-stride loop over `items` work items of `per_block` items each: enough to fill the
// device several times over, at most what a 1-D grid allows, at least 1.
unsigned GridFor(CudaContext& ctx, int64_t items, int per_block);

// Carves one workspace into 256-byte aligned pieces: add every piece, then Acquire once (a second
// Workspace() call would invalidate the first), then take the pieces' addresses.
class WorkspaceLayout {
 public:
  // Returns the piece's index.
  int Add(size_t bytes);
  // Grows ctx's workspace to fit; false (with the error recorded under `op`) when it cannot.
  bool Acquire(CudaContext& ctx, const char* op);
  template <typename T>
  T* Get(int piece) const {
    return reinterpret_cast<T*>(static_cast<char*>(base_) + offsets_[piece]);
  }

 private:
  static constexpr int kMaxPieces = 4;
  size_t offsets_[kMaxPieces] = {};
  int count_ = 0;
  size_t total_ = 0;
  void* base_ = nullptr;
};

}  // namespace geotrain::model::cuda::internal
