// The GEMMs of model/ops.h on cuBLAS: matmul_forward and matmul_backward (the bias parts use
// ops_kernels.cu's add_bias and bias_backward).
//
// Layout. The model's matrices are row-major; cuBLAS is column-major. A row-major (R, K) matrix with row
// stride K is, read column-major with leading dimension K, its transpose (K, R). So each row-major product
// is computed as the column-major product of transposes:
//   out(N,OC) = inp(N,C) @ W(OC,C)^T   <=>  out^T(OC,N) = W^T'(OC,C) @ inp^T(C,N):
//       gemm(T, N, m=OC, n=N, k=C, A=W lda=C, B=inp ldb=C, C=out ldc=OC)
//   dinp(N,C) = dout(N,OC) @ W(OC,C)   <=>  dinp^T(C,N) = W^T(C,OC) @ dout^T(OC,N):
//       gemm(N, N, m=C, n=N, k=OC, A=W lda=C, B=dout ldb=OC, C=dinp ldc=C)
//   dW(OC,C) += dout^T(OC,N) @ inp(N,C) <=> dW^T(C,OC) = inp^T(C,N) @ dout(N,OC):
//       gemm(N, T, m=C, n=OC, k=N, A=inp lda=C, B=dout ldb=OC, C=dW ldc=C, beta=1)
//
// Precision. kFp32: fp32 in and out with CUBLAS_COMPUTE_32F_PEDANTIC (no TF32, no reduced-precision
// reductions), the parity mode. kBf16 / kFp16: the inputs are rounded to bf16 / fp16 (nearest even; fp16
// overflows to infinity past 65504, which loss scaling catches) into the context's workspace, then multiplied on
// the tensor cores with fp32 accumulation and fp32 output. model/precision.h rounds the same way on the CPU.
// bf16 GEMMs need compute capability 8.0; fp16 runs on Turing (7.5) too.
//
// cuBLAS takes int dimensions: N above 2^30 rows is processed in slices of rows (forward, dinp) or of the
// reduction (dweight, with beta = 1 after the first slice), which changes nothing numerically but order.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "model/cuda/cublas_loader.h"
#include "model/cuda/cuda_check.h"
#include "model/cuda/device_util.cuh"
#include "model/cuda/ops_cuda.h"

namespace geotrain::model::cuda {
namespace {

using namespace internal;  // NOLINT: this file is the internal namespace's user

constexpr int64_t kMaxGemmRows = int64_t{1} << 30;

__global__ void ToBf16Kernel(__nv_bfloat16* out, const float* in, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) out[i] = __float2bfloat16_rn(in[i]);
}

__global__ void ToFp16Kernel(__half* out, const float* in, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) out[i] = __float2half_rn(in[i]);
}

// Both half formats take two bytes an element in the workspace.
using HalfBits = uint16_t;
static_assert(sizeof(__nv_bfloat16) == sizeof(HalfBits) && sizeof(__half) == sizeof(HalfBits));

// Where a GEMM operand lives and in which type: the fp32 original or its half-precision copy in the workspace.
struct Operand {
  const void* data;
  cudaDataType_t type;
  size_t element_bytes;
  const void* At(int64_t element) const { return static_cast<const char*>(data) + element * element_bytes; }
};

// Rounds `n` floats to bf16 or fp16 into `scratch` (kBf16, kFp16) or passes them through (kFp32).
Operand Prepare(CudaContext& ctx, const float* in, int64_t n, HalfBits* scratch) {
  if (ctx.precision() == GemmPrecision::kFp32) return {in, CUDA_R_32F, sizeof(float)};
  if (ctx.precision() == GemmPrecision::kFp16) {
    ToFp16Kernel<<<GridFor(ctx, n, kBlock), kBlock, 0, ctx.stream()>>>(reinterpret_cast<__half*>(scratch), in, n);
    return {scratch, CUDA_R_16F, sizeof(HalfBits)};
  }
  ToBf16Kernel<<<GridFor(ctx, n, kBlock), kBlock, 0, ctx.stream()>>>(reinterpret_cast<__nv_bfloat16*>(scratch), in, n);
  return {scratch, CUDA_R_16BF, sizeof(HalfBits)};
}

cublasComputeType_t ComputeType(const CudaContext& ctx) {
  return ctx.precision() == GemmPrecision::kFp32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
}

// One column-major GEMM with fp32 C (see the mapping above); returns the cuBLAS status.
// a_ptr and b_ptr point into operands a and b (which give the element type).
cublasStatus_t Gemm(CudaContext& ctx, cublasOperation_t transa, cublasOperation_t transb, int64_t m, int64_t n,
                    int64_t k, const Operand& a, const void* a_ptr, int64_t lda, const Operand& b, const void* b_ptr,
                    int64_t ldb, float beta, float* c, int64_t ldc) {
  const float alpha = 1.0f;
  return ctx.cublas_api().gemm_ex(ctx.cublas(), transa, transb, static_cast<int>(m), static_cast<int>(n),
                                  static_cast<int>(k), &alpha, a_ptr, a.type, static_cast<int>(lda), b_ptr, b.type,
                                  static_cast<int>(ldb), &beta, c, CUDA_R_32F, static_cast<int>(ldc), ComputeType(ctx),
                                  CUBLAS_GEMM_DEFAULT);
}

}  // namespace

void matmul_forward(CudaContext& ctx, float* out, const float* inp, const float* weight, const float* bias, int64_t N,
                    int C, int OC) {
  if (N == 0 || OC == 0) return;
  UseDevice(ctx);
  if (C == 0) {  // an empty sum: out = bias or 0 (cuBLAS would refuse k = 0 with lda = 0)
    ctx.Zero(out, static_cast<size_t>(N) * OC * sizeof(float));
    if (bias != nullptr) add_bias(ctx, out, bias, N, OC);
    return;
  }
  const bool half = ctx.precision() != GemmPrecision::kFp32;
  WorkspaceLayout layout;
  const int inp_piece = layout.Add(half ? N * C * sizeof(HalfBits) : 0);
  const int weight_piece = layout.Add(half ? static_cast<size_t>(OC) * C * sizeof(HalfBits) : 0);
  if (half && !layout.Acquire(ctx, "matmul_forward")) return;
  const Operand a = Prepare(ctx, inp, N * C, half ? layout.Get<HalfBits>(inp_piece) : nullptr);
  const Operand w =
      Prepare(ctx, weight, static_cast<int64_t>(OC) * C, half ? layout.Get<HalfBits>(weight_piece) : nullptr);
  CheckLaunch(ctx, "matmul_forward (half-precision conversion)");
  for (int64_t n0 = 0; n0 < N; n0 += kMaxGemmRows) {
    const int64_t rows = std::min(kMaxGemmRows, N - n0);
    CheckCublas(
        ctx,
        Gemm(ctx, CUBLAS_OP_T, CUBLAS_OP_N, OC, rows, C, w, w.data, C, a, a.At(n0 * C), C, 0.0f, out + n0 * OC, OC),
        "matmul_forward");
  }
  if (bias != nullptr) add_bias(ctx, out, bias, N, OC);
}

void matmul_backward(CudaContext& ctx, float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int C, int OC, bool accumulate_dinp) {
  if (N == 0) return;  // no rows: every gradient receives an empty sum (dinp has no elements)
  UseDevice(ctx);
  if (dbias != nullptr) bias_backward(ctx, dbias, dout, N, OC);
  if (C == 0 || OC == 0) {
    // dweight and dinp have no elements, or (OC == 0) dinp = empty sum.
    if (OC == 0 && C > 0 && dinp != nullptr && !accumulate_dinp) {
      ctx.Zero(dinp, static_cast<size_t>(N) * C * sizeof(float));
    }
    return;
  }
  const bool half = ctx.precision() != GemmPrecision::kFp32;
  WorkspaceLayout layout;
  const int dout_piece = layout.Add(half ? N * OC * sizeof(HalfBits) : 0);
  const int inp_piece = layout.Add(half ? N * C * sizeof(HalfBits) : 0);
  const int weight_piece = layout.Add(half && dinp != nullptr ? static_cast<size_t>(OC) * C * sizeof(HalfBits) : 0);
  if (half && !layout.Acquire(ctx, "matmul_backward")) return;
  const Operand d = Prepare(ctx, dout, N * OC, half ? layout.Get<HalfBits>(dout_piece) : nullptr);
  const Operand a = Prepare(ctx, inp, N * C, half ? layout.Get<HalfBits>(inp_piece) : nullptr);
  CheckLaunch(ctx, "matmul_backward (half-precision conversion)");
  if (dinp != nullptr) {
    const Operand w =
        Prepare(ctx, weight, static_cast<int64_t>(OC) * C, half ? layout.Get<HalfBits>(weight_piece) : nullptr);
    CheckLaunch(ctx, "matmul_backward (half-precision conversion)");
    for (int64_t n0 = 0; n0 < N; n0 += kMaxGemmRows) {
      const int64_t rows = std::min(kMaxGemmRows, N - n0);
      CheckCublas(ctx,
                  Gemm(ctx, CUBLAS_OP_N, CUBLAS_OP_N, C, rows, OC, w, w.data, C, d, d.At(n0 * OC), OC,
                       accumulate_dinp ? 1.0f : 0.0f, dinp + n0 * C, C),
                  "matmul_backward (dinp)");
    }
  }
  // dweight always accumulates: beta = 1 for every slice of the reduction over N.
  for (int64_t n0 = 0; n0 < N; n0 += kMaxGemmRows) {
    const int64_t rows = std::min(kMaxGemmRows, N - n0);
    CheckCublas(
        ctx,
        Gemm(ctx, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, rows, a, a.At(n0 * C), C, d, d.At(n0 * OC), OC, 1.0f, dweight, C),
        "matmul_backward (dweight)");
  }
}

}  // namespace geotrain::model::cuda
