// The arithmetic precision a job trains in, and what each GPU generation can run.
//
//   ASSIGN_OR_RETURN(Precision p, ParsePrecision("fp16"));
//   RoundToPrecision(p, in, out, n);          // what a GPU GEMM would see of `in`
//   if (!PrecisionSupported(p, /*compute_capability=*/75)) ...   // bf16 on a T4: no
//
// Master weights, gradients, AdamW moments and activations stay fp32 in every precision (the GPU backend keeps
// them so); kBf16 and kFp16 multiply half-precision inputs (rounded to nearest, ties to even) with fp32
// accumulation, on tensor cores. bf16 needs compute capability 8.0 (Ampere); fp16 runs from 7.0 (Volta, Turing),
// where its narrow range needs loss scaling (model/loss_scaler.h). The CPU backend runs the same rounding
// (backend.h MakeBackend("cpu", precision)), so the half-precision paths are tested without a GPU.
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"
#include "model/loss_scale_state.h"
#include "spec.pb.h"

namespace geotrain::model {

enum class Precision { kFp32, kBf16, kFp16 };

// "fp32", "bf16", "fp16".
std::string_view PrecisionName(Precision precision);
// One of the names above; INVALID_ARGUMENT naming the choices otherwise ("auto" is resolved by the caller).
absl::StatusOr<Precision> ParsePrecision(std::string_view name);

// Compute capability as major * 10 + minor (75 for Turing, 80 for A100, 90 for H100); 0 for the CPU, which
// runs every precision (emulated by rounding).
inline constexpr int kBf16MinComputeCapability = 80;
// The oldest GPU geotrain's CUDA build runs (CUDA 13 compiles for Turing, 7.5, and newer): below it (a V100, 7.0)
// no precision is supported.
inline constexpr int kMinComputeCapability = 75;
bool PrecisionSupported(Precision precision, int compute_capability);
// "7.5" for 75.
std::string ComputeCapabilityName(int compute_capability);

// The first of a job's codecs (comm.wan_codec, then comm.lan_codec) that refuses non-finite values (int8, and the
// gradients-only top-k, int4 and sparse), which fp16's overflow steps send through the all-reduces; "" when none
// does (or a name does not parse: the spec's validation reports that).
std::string FiniteOnlyCodec(const CommSpec& comm);
// What train.precision auto resolves to for GPUs whose oldest has compute capability `oldest_compute_capability`
// (0: the job runs on CPUs only, in fp32): bf16 from Ampere on; before it fp16, unless a codec of the job refuses
// fp16's infinities (`finite_only_codec`, FiniteOnlyCodec), then fp32. The head resolves a job's precision by it
// (head/placement.h ChoosePrecision) and the planner predicts with it (scheduler/cost_model.h).
Precision AutoPrecision(int oldest_compute_capability, bool finite_only_codec);

// x rounded to bf16 / fp16 (IEEE binary16) and back to float, to nearest with ties to even. fp16: magnitudes
// that round past 65504 become infinity (as a GPU's conversion does), below 2^-14 they lose precision
// (subnormals) and below 2^-25 become zero. NaN stays NaN, infinities and signed zeros stay.
float RoundToBf16(float x);
float RoundToFp16(float x);
// out[i] = in[i] rounded to `precision` (a copy for kFp32); out may be in.
void RoundToPrecision(Precision precision, const float* in, float* out, int64_t n);

// The loss scaling a job trains with in `precision`: on in fp16 only, from train.loss_scale (its zeros: the
// defaults, 65536 and 2000 steps).
LossScaleOptions LossScaleFromSpec(const TrainSpec& train, Precision precision);

}  // namespace geotrain::model
