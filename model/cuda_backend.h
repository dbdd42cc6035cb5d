// The CUDA backend's factory (model/cuda_backend.cc, compiled when the CUDA ops library
// geotrain_model_cuda is built). Use MakeBackend("cuda:N") (model/backend.h) rather than this.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "model/backend.h"

namespace geotrain::model {
namespace cuda {
class CudaContext;  // model/cuda/ops_cuda.h
}  // namespace cuda

// A backend on CUDA device `device` with its own stream and cuBLAS handle (cuda::CudaContext).
// Without the CUDA backend in this build, FAILED_PRECONDITION saying how to get it.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device, Precision precision);

// The context (device, stream, cuBLAS handle) under a CUDA backend, for what the Backend interface
// does not cover: timing with CUDA events, sharing the stream with NCCL. Null for any other backend.
cuda::CudaContext* CudaContextOf(Backend& backend);

}  // namespace geotrain::model
