// cuBLAS, opened when the first CUDA context needs it rather than when the process starts.
//
// Linked as a shared library, libcublas brings libcublasLt (hundreds of MB of code), whose relocations and static
// initialisers cost every geotrain process about 0.45 s of CPU at start, on machines without a GPU too: 0.6 s in
// all for `geotrain --version` on the 2-core development machine (2026-12-05), three quarters of it in
// libcublasLt. The CLI, the head and the workers start often (a test suite, a study's harness), and only a CUDA
// stage's GEMMs (matmul.cu) use cuBLAS, through the few entry points below. So the binary does not link it; the
// first CudaContext opens it with dlopen and keeps it open for the life of the process.
#pragma once

#include <cublas_v2.h>

#include "absl/status/statusor.h"

namespace geotrain::model::cuda {

// The cuBLAS entry points geotrain calls, with cuBLAS's own signatures (cublas_api.h).
struct CublasApi {
  cublasStatus_t (*create)(cublasHandle_t* handle);
  cublasStatus_t (*destroy)(cublasHandle_t handle);
  cublasStatus_t (*set_stream)(cublasHandle_t handle, cudaStream_t stream);
  cublasStatus_t (*gemm_ex)(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* a, cudaDataType a_type, int lda, const void* b,
                            cudaDataType b_type, int ldb, const void* beta, void* c, cudaDataType c_type, int ldc,
                            cublasComputeType_t compute_type, cublasGemmAlgo_t algo);
  const char* (*status_string)(cublasStatus_t status);
};

// The loaded entry points: libcublas.so.<the major version built against> from the library path, else from the
// CUDA toolkit's directory the build found. Loaded once per process (thread-safe); later calls return the same
// table or the same error. FAILED_PRECONDITION naming the library, the loader's message and the fix when it
// cannot be opened or lacks an entry point.
absl::StatusOr<const CublasApi*> LoadCublas();

}  // namespace geotrain::model::cuda
