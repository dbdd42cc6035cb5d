// Half-precision rounding on the CPU (the values a GPU's tensor cores take) and the CPU backend's emulated GEMMs.
#include "model/precision.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "model/backend.h"
#include "model/ops.h"

namespace geotrain::model {
namespace {

TEST(PrecisionTest, Fp16RoundsToNearestEvenAndOverflowsToInfinity) {
  EXPECT_EQ(RoundToFp16(1.0f), 1.0f);
  EXPECT_EQ(RoundToFp16(65504.0f), 65504.0f);      // the largest half
  EXPECT_EQ(RoundToFp16(65519.996f), 65504.0f);    // below the halfway point
  EXPECT_TRUE(std::isinf(RoundToFp16(65520.0f)));  // the tie goes to the even side: infinity
  EXPECT_TRUE(std::isinf(RoundToFp16(-1e6f)));
  EXPECT_LT(RoundToFp16(-1e6f), 0.0f);
  const float spacing = std::ldexp(1.0f, -10);                        // of halves in [1, 2)
  EXPECT_EQ(RoundToFp16(1.0f + spacing / 2), 1.0f);                   // tie, to the even significand
  EXPECT_EQ(RoundToFp16(1.0f + 1.5f * spacing), 1.0f + 2 * spacing);  // tie, to the even one above
  EXPECT_EQ(RoundToFp16(1.0f + 0.6f * spacing), 1.0f + spacing);
  EXPECT_EQ(RoundToFp16(std::ldexp(1.0f, -24)), std::ldexp(1.0f, -24));  // the smallest subnormal
  EXPECT_EQ(RoundToFp16(std::ldexp(1.0f, -25)), 0.0f);                   // tie with zero: zero
  EXPECT_EQ(RoundToFp16(std::ldexp(1.5f, -25)), std::ldexp(1.0f, -24));
  EXPECT_EQ(RoundToFp16(std::ldexp(3.0f, -24)), std::ldexp(3.0f, -24));
  EXPECT_EQ(RoundToFp16(std::ldexp(1023.5f, -24)), std::ldexp(1.0f, -14));  // rounds up into the normals
  EXPECT_TRUE(std::signbit(RoundToFp16(-0.0f)));
  EXPECT_TRUE(std::isnan(RoundToFp16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isinf(RoundToFp16(std::numeric_limits<float>::infinity())));
}

TEST(PrecisionTest, Bf16KeepsFloatsRangeAndRoundsToNearestEven) {
  const float spacing = std::ldexp(1.0f, -7);  // of bf16 values in [1, 2)
  EXPECT_EQ(RoundToBf16(1.0f + spacing / 2), 1.0f);
  EXPECT_EQ(RoundToBf16(1.0f + 1.5f * spacing), 1.0f + 2 * spacing);
  EXPECT_NEAR(RoundToBf16(1e30f), 1e30f, 1e30f / 256);  // far past fp16's range, finite in bf16
  EXPECT_TRUE(std::isfinite(RoundToBf16(65520.0f)));
  EXPECT_TRUE(std::isnan(RoundToBf16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isinf(RoundToBf16(std::numeric_limits<float>::max())));  // rounds up past the largest bf16
}

TEST(PrecisionTest, RoundedValuesAreFixedPointsAndWithinHalfAUnit) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = normal(rng);
    const float h = RoundToFp16(x), b = RoundToBf16(x);
    EXPECT_EQ(RoundToFp16(h), h);
    EXPECT_EQ(RoundToBf16(b), b);
    if (std::fabs(x) >= std::ldexp(1.0f, -14)) {
      EXPECT_LE(std::fabs(h - x), std::ldexp(std::fabs(x), -11) * 1.0001f) << x;
    }
    EXPECT_LE(std::fabs(b - x), std::ldexp(std::fabs(x), -8) * 1.0001f) << x;
  }
}

TEST(PrecisionTest, NamesAndSupportByComputeCapability) {
  for (Precision p : {Precision::kFp32, Precision::kBf16, Precision::kFp16}) {
    absl::StatusOr<Precision> parsed = ParsePrecision(PrecisionName(p));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, p);
  }
  EXPECT_EQ(ParsePrecision("tf32").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(PrecisionSupported(Precision::kBf16, 75));  // Turing: T4, RTX 6000
  EXPECT_TRUE(PrecisionSupported(Precision::kFp16, 75));
  EXPECT_TRUE(PrecisionSupported(Precision::kBf16, 80));   // A30, A100
  EXPECT_TRUE(PrecisionSupported(Precision::kBf16, 0));    // the CPU emulates every one
  EXPECT_FALSE(PrecisionSupported(Precision::kFp32, 70));  // a V100: older than this build's oldest GPU
  EXPECT_EQ(ComputeCapabilityName(86), "8.6");
}

// What auto resolves to (the head's choice and the planner's prediction): bf16 from Ampere, fp16 on Turing unless a
// codec refuses its overflow steps' infinities, fp32 then and on CPUs.
TEST(PrecisionTest, AutoFollowsTheOldestGpuAndTheCodecs) {
  EXPECT_EQ(AutoPrecision(80, false), Precision::kBf16);
  EXPECT_EQ(AutoPrecision(80, true), Precision::kBf16);
  EXPECT_EQ(AutoPrecision(75, false), Precision::kFp16);
  EXPECT_EQ(AutoPrecision(75, true), Precision::kFp32);
  EXPECT_EQ(AutoPrecision(0, false), Precision::kFp32);
  CommSpec comm;
  EXPECT_EQ(FiniteOnlyCodec(comm), "");
  comm.set_wan_codec("bf16");
  EXPECT_EQ(FiniteOnlyCodec(comm), "");
  comm.set_lan_codec("int8");
  EXPECT_EQ(FiniteOnlyCodec(comm), "int8");
  comm.set_wan_codec("sparse:0.02:2");
  EXPECT_EQ(FiniteOnlyCodec(comm), "sparse:0.02:2");  // the WAN codec first
}

// The CPU backend in bf16 / fp16 multiplies exactly the rounded operands: the same as rounding them by hand and
// multiplying in fp32. The bias gradient sums the unrounded dout.
TEST(PrecisionTest, CpuBackendGemmsTakeRoundedInputs) {
  const int64_t N = 6;
  const int C = 5, OC = 4;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  const std::vector<float> inp = random(N * C), weight = random(OC * C), bias = random(OC), dout = random(N * OC);
  for (Precision p : {Precision::kBf16, Precision::kFp16}) {
    absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackend("cpu", p);
    ASSERT_TRUE(backend.ok()) << backend.status();
    auto rounded = [&](const std::vector<float>& v) {
      std::vector<float> r(v.size());
      RoundToPrecision(p, v.data(), r.data(), static_cast<int64_t>(v.size()));
      return r;
    };
    std::vector<float> out(N * OC), expected(N * OC);
    (*backend)->matmul_forward(out.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
    matmul_forward(expected.data(), rounded(inp).data(), rounded(weight).data(), bias.data(), N, C, OC);
    EXPECT_EQ(out, expected) << PrecisionName(p);
    std::vector<float> unrounded(N * OC);
    matmul_forward(unrounded.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
    EXPECT_NE(out, unrounded) << PrecisionName(p);  // the rounding is there

    std::vector<float> dinp(N * C), dweight(OC * C), dbias(OC), e_dinp(N * C), e_dweight(OC * C), e_dbias(OC);
    (*backend)->matmul_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(), N, C,
                                OC, false);
    matmul_backward(e_dinp.data(), e_dweight.data(), nullptr, rounded(dout).data(), rounded(inp).data(),
                    rounded(weight).data(), N, C, OC, false);
    bias_backward(e_dbias.data(), dout.data(), N, OC);
    EXPECT_EQ(dinp, e_dinp);
    EXPECT_EQ(dweight, e_dweight);
    EXPECT_EQ(dbias, e_dbias);
  }
  // fp16's overflow reaches the output as infinity, as on a GPU: what loss scaling detects.
  absl::StatusOr<std::unique_ptr<Backend>> fp16 = MakeBackend("cpu", Precision::kFp16);
  ASSERT_TRUE(fp16.ok());
  std::vector<float> big = inp, out(N * OC);
  big[0] = 1e5f;
  (*fp16)->matmul_forward(out.data(), big.data(), weight.data(), nullptr, N, C, OC);
  EXPECT_TRUE(std::isinf(out[0]));
}

}  // namespace
}  // namespace geotrain::model
