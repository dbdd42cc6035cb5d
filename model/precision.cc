// Precision names, support by compute capability, and half-precision rounding on the CPU (see precision.h).
#include "model/precision.h"

#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/codec_spec.h"

namespace geotrain::model {
namespace {

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

}  // namespace

std::string_view PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kFp32:
      return "fp32";
    case Precision::kBf16:
      return "bf16";
    case Precision::kFp16:
      return "fp16";
  }
  return "fp32";
}

absl::StatusOr<Precision> ParsePrecision(std::string_view name) {
  for (Precision p : {Precision::kFp32, Precision::kBf16, Precision::kFp16}) {
    if (name == PrecisionName(p)) return p;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("precision '", std::string(name), "' is not one of auto, bf16, fp16, fp32"));
}

bool PrecisionSupported(Precision precision, int compute_capability) {
  if (compute_capability == 0) return true;  // the CPU: every precision, by rounding
  if (compute_capability < kMinComputeCapability) return false;
  switch (precision) {
    case Precision::kFp32:
    case Precision::kFp16:
      return true;
    case Precision::kBf16:
      return compute_capability >= kBf16MinComputeCapability;
  }
  return false;
}

std::string FiniteOnlyCodec(const CommSpec& comm) {
  for (const std::string* codec : {&comm.wan_codec(), &comm.lan_codec()}) {
    absl::StatusOr<CodecSpec> parsed = ParseCodecSpec(*codec);
    if (parsed.ok() && parsed->finite_only()) return *codec;
  }
  return "";
}

Precision AutoPrecision(int oldest_compute_capability, bool finite_only_codec) {
  if (oldest_compute_capability == 0) return Precision::kFp32;
  if (PrecisionSupported(Precision::kBf16, oldest_compute_capability)) return Precision::kBf16;
  return finite_only_codec ? Precision::kFp32 : Precision::kFp16;
}

std::string ComputeCapabilityName(int compute_capability) {
  return absl::StrCat(compute_capability / 10, ".", compute_capability % 10);
}

float RoundToBf16(float x) {
  uint32_t b = Bits(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return FromBits((b | 0x00400000u) & 0xffff0000u);  // NaN stays (quiet)
  b += 0x7fffu + ((b >> 16) & 1u);  // to nearest, ties to the even upper half; overflow carries into infinity
  return FromBits(b & 0xffff0000u);
}

float RoundToFp16(float x) {
  const uint32_t b = Bits(x);
  const uint32_t sign = b & 0x80000000u;
  const uint32_t magnitude = b & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) return x;  // infinity or NaN
  // 65520 is halfway between 65504 (the largest half, odd significand) and 65536 (past the range): ties to even
  // go up, to infinity.
  if (magnitude >= 0x477ff000u) return FromBits(sign | 0x7f800000u);
  if (magnitude < 0x38800000u) {
    // Below 2^-14: half's subnormals, multiples of 2^-24. Scaling by 2^24 is exact; nearbyint rounds to nearest
    // even in the default rounding mode.
    const float units = std::nearbyint(FromBits(magnitude) * 16777216.0f);
    return FromBits(sign | Bits(units / 16777216.0f));
  }
  // Normal: keep 10 of the 23 significand bits, to nearest even (a carry may step into the next exponent).
  const uint32_t dropped = magnitude & 0x1fffu;
  uint32_t kept = magnitude & ~0x1fffu;
  if (dropped > 0x1000u || (dropped == 0x1000u && (kept & 0x2000u))) kept += 0x2000u;
  return FromBits(sign | kept);
}

LossScaleOptions LossScaleFromSpec(const TrainSpec& train, Precision precision) {
  LossScaleOptions options;
  options.enabled = precision == Precision::kFp16;
  if (train.loss_scale().initial() > 0) options.initial = train.loss_scale().initial();
  if (train.loss_scale().growth_interval() > 0) options.growth_interval = train.loss_scale().growth_interval();
  return options;
}

void RoundToPrecision(Precision precision, const float* in, float* out, int64_t n) {
  switch (precision) {
    case Precision::kFp32:
      if (out != in) std::memmove(out, in, static_cast<size_t>(n) * sizeof(float));
      return;
    case Precision::kBf16:
      for (int64_t i = 0; i < n; ++i) out[i] = RoundToBf16(in[i]);
      return;
    case Precision::kFp16:
      for (int64_t i = 0; i < n; ++i) out[i] = RoundToFp16(in[i]);
      return;
  }
}

}  // namespace geotrain::model
