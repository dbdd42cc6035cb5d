// Codec tests: round trips, the stated error bounds, top-k error feedback, and rejection of corrupted,
// truncated and forged buffers (including a small fuzz loop), on both the vector and scalar loops.
#include "comm/codec.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace geotrain::comm {
namespace {

std::vector<float> RandomTensor(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

Codec MustParse(std::string_view text) {
  auto codec = ParseCodec(text);
  EXPECT_TRUE(codec.ok()) << codec.status();
  return codec.value_or(Codec{});
}

std::vector<float> RoundTrip(const Codec& codec, const std::vector<float>& input,
                             std::vector<float>* residual = nullptr) {
  Bytes wire;
  absl::Status s = EncodeTensor(codec, input, &wire, residual);
  EXPECT_TRUE(s.ok()) << s;
  std::vector<float> out(input.size(), -1.0f);
  s = DecodeTensor(wire.span(), absl::MakeSpan(out));
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// Runs each test on the run-time chosen loops and on the scalar ones.
class CodecTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { ForceScalarCodecs(GetParam()); }
  void TearDown() override { ForceScalarCodecs(false); }
};

TEST(CodecParse, AcceptsEveryFormAndPrintsItBack) {
  for (const char* text :
       {"none", "fp16", "bf16", "int8", "topk:0.01", "bf16+zstd", "int8+zstd:3", "none+zstd", "topk:0.5+zstd"}) {
    auto codec = ParseCodec(text);
    ASSERT_TRUE(codec.ok()) << text << ": " << codec.status();
    EXPECT_EQ(codec->ToString(), text);
  }
  EXPECT_EQ(MustParse("BF16+ZSTD").kind, CodecKind::kBf16);
  EXPECT_TRUE(MustParse("none").lossless());
  EXPECT_TRUE(MustParse("none+zstd").lossless());
  EXPECT_FALSE(MustParse("bf16").lossless());
}

TEST(CodecParse, RejectsBadForms) {
  for (const char* text : {"", "fp8", "topk", "topk:0", "topk:1.5", "topk:abc", "bf16+lz4", "bf16+zstd:0",
                           "bf16+zstd:99", "bf16+zstd+zstd"}) {
    auto codec = ParseCodec(text);
    EXPECT_FALSE(codec.ok()) << "accepted '" << text << "'";
    EXPECT_EQ(codec.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST_P(CodecTest, NoneIsBitExactWithAndWithoutZstd) {
  std::vector<float> input = RandomTensor(10007, 1);
  input[3] = -0.0f;
  input[5] = std::numeric_limits<float>::denorm_min();
  for (const char* name : {"none", "none+zstd"}) {
    std::vector<float> out = RoundTrip(MustParse(name), input);
    ASSERT_EQ(std::memcmp(out.data(), input.data(), input.size() * 4), 0) << name;
  }
}

TEST_P(CodecTest, EmptyTensorRoundTrips) {
  for (const char* name : {"none", "fp16", "bf16", "int8", "bf16+zstd"}) {
    std::vector<float> out = RoundTrip(MustParse(name), {});
    EXPECT_TRUE(out.empty());
  }
}

TEST_P(CodecTest, Fp16WithinRelativeBound) {
  std::vector<float> input = RandomTensor(4099, 2, 10.0f);
  input.push_back(65504.0f);
  input.push_back(-6.103515625e-05f);  // smallest normal fp16
  input.push_back(1.0f + 0x1p-11f);    // a tie: rounds to even (1.0)
  for (const char* name : {"fp16", "fp16+zstd"}) {
    std::vector<float> out = RoundTrip(MustParse(name), input);
    for (size_t i = 0; i < input.size(); ++i) {
      if (std::fabs(input[i]) < 6.103515625e-05f) {
        EXPECT_LE(std::fabs(out[i] - input[i]), 0x1p-25f) << i;  // subnormal: half the step 2^-24
      } else {
        EXPECT_LE(std::fabs(out[i] - input[i]), std::ldexp(std::fabs(input[i]), -11)) << i << " " << input[i];
      }
    }
    EXPECT_EQ(out[input.size() - 1], 1.0f);
    EXPECT_EQ(out[input.size() - 3], 65504.0f);
  }
}

TEST_P(CodecTest, Fp16SpecialValues) {
  const std::vector<float> input = {INFINITY, -INFINITY, 1e6f, -1e6f, 0.0f, -0.0f, 1e-9f, 3e-6f, NAN};
  std::vector<float> out = RoundTrip(MustParse("fp16"), input);
  EXPECT_EQ(out[0], INFINITY);
  EXPECT_EQ(out[1], -INFINITY);
  EXPECT_EQ(out[2], INFINITY);  // overflow
  EXPECT_EQ(out[3], -INFINITY);
  EXPECT_EQ(out[4], 0.0f);
  EXPECT_TRUE(std::signbit(out[5]));
  EXPECT_EQ(out[6], 0.0f);  // underflow
  EXPECT_NEAR(out[7], 3e-6f, 0x1p-25f);
  EXPECT_TRUE(std::isnan(out[8]));
}

TEST_P(CodecTest, Bf16WithinRelativeBoundAndRoundsToEven) {
  std::vector<float> input = RandomTensor(5003, 3, 1000.0f);
  const float tie_down = std::bit_cast<float>(0x3F808000u);  // halfway, lower neighbour even -> down
  const float tie_up = std::bit_cast<float>(0x3F818000u);    // halfway, lower neighbour odd -> up
  input.push_back(tie_down);
  input.push_back(tie_up);
  input.push_back(NAN);
  for (const char* name : {"bf16", "bf16+zstd"}) {
    std::vector<float> out = RoundTrip(MustParse(name), input);
    for (size_t i = 0; i + 3 < input.size(); ++i) {
      EXPECT_LE(std::fabs(out[i] - input[i]), std::ldexp(std::fabs(input[i]), -8)) << i;
      EXPECT_EQ(std::bit_cast<uint32_t>(out[i]) & 0xFFFFu, 0u);
    }
    EXPECT_EQ(std::bit_cast<uint32_t>(out[input.size() - 3]), 0x3F800000u);
    EXPECT_EQ(std::bit_cast<uint32_t>(out[input.size() - 2]), 0x3F820000u);
    EXPECT_TRUE(std::isnan(out[input.size() - 1]));
  }
}

TEST_P(CodecTest, Int8WithinHalfScalePerBlock) {
  // Blocks of very different magnitudes, a zero block, and a partial last block.
  std::vector<float> input = RandomTensor(kInt8BlockSize * 5 + 77, 4);
  for (size_t i = 0; i < kInt8BlockSize; ++i) input[kInt8BlockSize + i] *= 1000.0f;
  for (size_t i = 0; i < kInt8BlockSize; ++i) input[2 * kInt8BlockSize + i] = 0.0f;
  for (size_t i = 0; i < kInt8BlockSize; ++i) input[3 * kInt8BlockSize + i] *= 1e-6f;
  for (const char* name : {"int8", "int8+zstd"}) {
    std::vector<float> out = RoundTrip(MustParse(name), input);
    for (size_t begin = 0; begin < input.size(); begin += kInt8BlockSize) {
      const size_t end = std::min(input.size(), begin + kInt8BlockSize);
      float max_abs = 0;
      for (size_t i = begin; i < end; ++i) max_abs = std::max(max_abs, std::fabs(input[i]));
      const float bound = max_abs / 254.0f * (1.0f + 1e-5f);
      for (size_t i = begin; i < end; ++i) {
        ASSERT_LE(std::fabs(out[i] - input[i]), bound) << name << " element " << i;
      }
      if (max_abs == 0.0f) {
        for (size_t i = begin; i < end; ++i) ASSERT_EQ(out[i], 0.0f);
      }
    }
  }
}

TEST_P(CodecTest, Int8RefusesNonFiniteInput) {
  std::vector<float> input = RandomTensor(1000, 5);
  input[700] = NAN;
  Bytes wire;
  EXPECT_EQ(EncodeTensor(MustParse("int8"), input, &wire).code(), absl::StatusCode::kInvalidArgument);
  input[700] = INFINITY;
  EXPECT_EQ(EncodeTensor(MustParse("int8"), input, &wire).code(), absl::StatusCode::kInvalidArgument);
}

// Found by fuzz/codec_fuzzer.cc (UBSan): decoding an empty tensor into an empty span (whose data() is null)
// passed the null pointer to memcpy.
TEST_P(CodecTest, EmptyTensorsRoundTrip) {
  for (const char* name : {"none", "fp16", "bf16", "int8", "topk:0.5", "bf16+zstd", "none+zstd"}) {
    const std::vector<float> input;
    Bytes wire;
    std::vector<float> residual;
    ASSERT_TRUE(EncodeTensor(MustParse(name), input, &wire, &residual).ok()) << name;
    std::vector<float> out;
    EXPECT_TRUE(DecodeTensor(wire.span(), absl::MakeSpan(out)).ok()) << name;
    EXPECT_TRUE(DecodeTensorAdd(wire.span(), absl::MakeSpan(out)).ok()) << name;
  }
}

// Found by fuzz/codec_fuzzer.cc (UBSan): a block whose largest magnitude is tiny (below ~3.7e-37) made the int8
// inverse scale infinite, and a zero in it became 0 x inf = NaN before the conversion to an integer (undefined
// behaviour). Such blocks now quantize with the largest finite inverse: zeros stay zero, values stay finite and
// within their own magnitude.
TEST_P(CodecTest, Int8BlocksOfTinyValuesStayFinite) {
  std::vector<float> input(600, 0.0f);
  input[1] = 1.4e-44f;   // a denormal: 127 / it overflows
  input[2] = -3.0e-39f;  // a denormal too
  input[300] = 2.0f;     // another block, normal
  Bytes wire;
  ASSERT_TRUE(EncodeTensor(MustParse("int8"), input, &wire).ok());
  std::vector<float> out(input.size(), 1.0f);
  ASSERT_TRUE(DecodeTensor(wire.span(), absl::MakeSpan(out)).ok());
  for (size_t i = 0; i < 256; ++i) {
    ASSERT_TRUE(std::isfinite(out[i])) << i;
    EXPECT_LE(std::fabs(out[i] - input[i]), std::fabs(input[i])) << i;
  }
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_NEAR(out[300], 2.0f, 2.0f / 254);
}

TEST_P(CodecTest, TopKKeepsLargestExactlyAndConservesTheSum) {
  const size_t n = 10000;
  const Codec codec = MustParse("topk:0.01");
  std::vector<float> residual;
  std::vector<double> sent_sum(n, 0.0), input_sum(n, 0.0);
  for (int step = 0; step < 20; ++step) {
    std::vector<float> grad = RandomTensor(n, 100 + step);
    std::vector<float> accumulated(n);
    for (size_t i = 0; i < n; ++i) {
      accumulated[i] = (residual.empty() ? 0.0f : residual[i]) + grad[i];
      input_sum[i] += grad[i];
    }
    std::vector<float> out = RoundTrip(codec, grad, &residual);
    // Exactly k = 1% non-zero entries, each equal to the accumulated value, and the largest ones.
    size_t kept = 0;
    float smallest_kept = INFINITY, largest_dropped = 0;
    for (size_t i = 0; i < n; ++i) {
      if (out[i] != 0.0f) {
        ++kept;
        ASSERT_EQ(out[i], accumulated[i]);
        ASSERT_EQ(residual[i], 0.0f);
        smallest_kept = std::min(smallest_kept, std::fabs(out[i]));
      } else {
        ASSERT_EQ(residual[i], accumulated[i]);
        largest_dropped = std::max(largest_dropped, std::fabs(accumulated[i]));
      }
      sent_sum[i] += out[i];
    }
    EXPECT_EQ(kept, 100u);
    EXPECT_GE(smallest_kept, largest_dropped);
  }
  // Error feedback: what was sent plus what is still held equals everything that came in.
  for (size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(sent_sum[i] + residual[i], input_sum[i], 1e-4 * (1.0 + std::fabs(input_sum[i]))) << i;
  }
}

TEST_P(CodecTest, TopKNeedsResidualAndRejectsNan) {
  Bytes wire;
  std::vector<float> input = RandomTensor(100, 6);
  EXPECT_EQ(EncodeTensor(MustParse("topk:0.1"), input, &wire).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> residual;
  input[3] = NAN;
  EXPECT_FALSE(EncodeTensor(MustParse("topk:0.1"), input, &wire, &residual).ok());
}

TEST_P(CodecTest, DecodeAddAccumulates) {
  for (const char* name : {"none", "bf16", "fp16", "int8", "int8+zstd"}) {
    std::vector<float> input = RandomTensor(40000, 7);
    std::vector<float> acc = RandomTensor(40000, 8);
    std::vector<float> decoded(input.size());
    Bytes wire;
    ASSERT_TRUE(EncodeTensor(MustParse(name), input, &wire).ok());
    ASSERT_TRUE(DecodeTensor(wire.span(), absl::MakeSpan(decoded)).ok());
    std::vector<float> expected = acc;
    for (size_t i = 0; i < acc.size(); ++i) expected[i] += decoded[i];
    ASSERT_TRUE(DecodeTensorAdd(wire.span(), absl::MakeSpan(acc)).ok());
    EXPECT_EQ(acc, expected) << name;
  }
  std::vector<float> residual;
  std::vector<float> acc(1000, 1.0f);
  std::vector<float> input(1000, 0.0f);
  input[10] = 5.0f;
  Bytes wire;
  ASSERT_TRUE(EncodeTensor(MustParse("topk:0.001"), input, &wire, &residual).ok());
  ASSERT_TRUE(DecodeTensorAdd(wire.span(), absl::MakeSpan(acc)).ok());
  EXPECT_EQ(acc[10], 6.0f);
  EXPECT_EQ(acc[11], 1.0f);
}

// CodecRoundTrip: a tensor becomes what a receiver decodes; top-k's error feedback is kept per stream, so that two
// streams of the same values round alike and one stream's second tensor sends what the first held back.
TEST_P(CodecTest, RoundTripIsWhatAReceiverDecodes) {
  for (const char* name : {"none", "bf16", "int8", "int8+zstd"}) {
    const std::vector<float> input = RandomTensor(5000, 9);
    std::vector<float> applied = input, expected = RoundTrip(MustParse(name), input);
    CodecRoundTrip round_trip(MustParse(name));
    ASSERT_TRUE(round_trip.Apply("a", absl::MakeSpan(applied)).ok());
    EXPECT_EQ(applied, expected) << name;
  }
  CodecRoundTrip top_k(MustParse("topk:0.001"));
  std::vector<float> first(1000, 0.0f), second(1000, 0.0f), other(1000, 0.0f);
  first[3] = 5.0f;
  first[7] = 2.0f;  // held back: one of 1000 kept
  other = first;
  ASSERT_TRUE(top_k.Apply("a", absl::MakeSpan(first)).ok());
  ASSERT_TRUE(top_k.Apply("b", absl::MakeSpan(other)).ok());
  EXPECT_EQ(first[3], 5.0f);
  EXPECT_EQ(first[7], 0.0f);
  EXPECT_EQ(other, first);
  ASSERT_TRUE(top_k.Apply("a", absl::MakeSpan(second)).ok());
  EXPECT_EQ(second[7], 2.0f);
  std::vector<float> bad(10, NAN);
  EXPECT_FALSE(top_k.Apply("c", absl::MakeSpan(bad)).ok());
}

TEST(CodecCorruption, RejectsWrongMagicTruncationSizeMismatchAndFlips) {
  std::vector<float> input = RandomTensor(3000, 9);
  std::vector<float> out(input.size());
  for (const char* name : {"none", "fp16", "bf16", "int8", "topk:0.05", "bf16+zstd", "int8+zstd"}) {
    Bytes wire;
    std::vector<float> residual;
    ASSERT_TRUE(EncodeTensor(MustParse(name), input, &wire, &residual).ok());
    std::vector<uint8_t> good(wire.data(), wire.data() + wire.size());
    ASSERT_TRUE(DecodeTensor(good, absl::MakeSpan(out)).ok()) << name;
    // Wrong destination size.
    std::vector<float> small(input.size() - 1);
    EXPECT_EQ(DecodeTensor(good, absl::MakeSpan(small)).code(), absl::StatusCode::kInvalidArgument) << name;
    // Wrong magic.
    std::vector<uint8_t> bad = good;
    bad[0] ^= 0xFF;
    EXPECT_EQ(DecodeTensor(bad, absl::MakeSpan(out)).code(), absl::StatusCode::kDataLoss) << name;
    // Every truncation length of the header, and a few of the payload.
    for (size_t len : {size_t{0}, size_t{1}, size_t{39}, size_t{40}, size_t{41}, good.size() / 2, good.size() - 1}) {
      std::vector<uint8_t> cut(good.begin(), good.begin() + static_cast<ptrdiff_t>(len));
      EXPECT_FALSE(DecodeTensor(cut, absl::MakeSpan(out)).ok()) << name << " truncated to " << len;
    }
    // Extra bytes.
    bad = good;
    bad.push_back(0);
    EXPECT_FALSE(DecodeTensor(bad, absl::MakeSpan(out)).ok()) << name;
    // A flipped bit anywhere is caught by a checksum or a size check.
    std::mt19937 rng(42);
    for (int trial = 0; trial < 200; ++trial) {
      bad = good;
      const size_t at = rng() % bad.size();
      bad[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
      EXPECT_FALSE(DecodeTensor(bad, absl::MakeSpan(out)).ok()) << name << " flip at " << at;
    }
  }
}

TEST(CodecCorruption, ForgedHeadersWithValidChecksumsAreRejected) {
  // An attacker (or a bug) that writes consistent checksums still cannot make decode overread.
  std::vector<float> input = RandomTensor(1000, 10);
  std::vector<float> out(input.size());
  Bytes wire;
  std::vector<float> residual;
  ASSERT_TRUE(EncodeTensor(MustParse("topk:0.1"), input, &wire, &residual).ok());
  std::vector<uint8_t> forged(wire.data(), wire.data() + wire.size());
  auto reseal = [](std::vector<uint8_t>& b) {
    const uint32_t payload_crc = Crc32c(b.data() + 40, b.size() - 40);
    std::memcpy(b.data() + 32, &payload_crc, 4);
    const uint32_t header_crc = Crc32c(b.data(), 36);
    std::memcpy(b.data() + 36, &header_crc, 4);
  };
  // An index out of range.
  std::vector<uint8_t> bad = forged;
  const uint32_t huge = 5000;
  std::memcpy(bad.data() + 40 + 8, &huge, 4);
  reseal(bad);
  EXPECT_EQ(DecodeTensor(bad, absl::MakeSpan(out)).code(), absl::StatusCode::kDataLoss);
  // Indices not increasing (duplicate).
  bad = forged;
  std::memcpy(bad.data() + 40 + 12, bad.data() + 40 + 8, 4);
  reseal(bad);
  EXPECT_EQ(DecodeTensor(bad, absl::MakeSpan(out)).code(), absl::StatusCode::kDataLoss);
  // A k larger than the payload holds.
  bad = forged;
  const uint64_t k = 1u << 30;
  std::memcpy(bad.data() + 40, &k, 8);
  reseal(bad);
  EXPECT_EQ(DecodeTensor(bad, absl::MakeSpan(out)).code(), absl::StatusCode::kDataLoss);
  // A k whose 8 * k wraps to the payload's size (the fuzzer's find: the check compared 8 * k + 8, and decode
  // then read indices past the payload; ASan reports the overread).
  bad = forged;
  uint64_t kept = 0;
  std::memcpy(&kept, bad.data() + 40, 8);
  const uint64_t wrapped = kept + (uint64_t{1} << 61);
  std::memcpy(bad.data() + 40, &wrapped, 8);
  reseal(bad);
  const absl::Status wraps = DecodeTensor(bad, absl::MakeSpan(out));
  EXPECT_EQ(wraps.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(wraps.message()), ::testing::HasSubstr("does not match its payload"));
  // An element count far beyond the payload.
  Bytes int8_wire;
  ASSERT_TRUE(EncodeTensor(MustParse("int8"), input, &int8_wire).ok());
  bad.assign(int8_wire.data(), int8_wire.data() + int8_wire.size());
  const uint64_t count = uint64_t{1} << 39;
  std::memcpy(bad.data() + 8, &count, 8);
  reseal(bad);
  std::vector<float> out_big(1);
  EXPECT_FALSE(DecodeTensor(bad, absl::MakeSpan(out_big)).ok());
  // An int8 NaN scale.
  bad.assign(int8_wire.data(), int8_wire.data() + int8_wire.size());
  const float nan = NAN;
  std::memcpy(bad.data() + 40, &nan, 4);
  reseal(bad);
  EXPECT_EQ(DecodeTensor(bad, absl::MakeSpan(out)).code(), absl::StatusCode::kDataLoss);
}

TEST(CodecCorruption, FuzzedBuffersNeverCrash) {
  // Random buffers, random headers with valid checksums, random payload edits: decode must return
  // (any status) without crashing or reading out of bounds (run under ASan to check the latter).
  std::mt19937 rng(7);
  std::vector<float> input = RandomTensor(700, 11);
  std::vector<std::vector<uint8_t>> seeds;
  for (const char* name : {"none", "fp16", "bf16", "int8", "topk:0.1", "bf16+zstd", "topk:0.2+zstd", "int4",
                           "int4+zstd", "sparse:0.1:3", "sparse:0.05:8+zstd"}) {
    Bytes wire;
    std::vector<float> residual;
    ASSERT_TRUE(EncodeTensor(MustParse(name), input, &wire, &residual).ok());
    seeds.emplace_back(wire.data(), wire.data() + wire.size());
  }
  int accepted = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<uint8_t> b = seeds[rng() % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      switch (rng() % 3) {
        case 0:
          b[rng() % b.size()] = static_cast<uint8_t>(rng());
          break;
        case 1:
          b.resize(rng() % (b.size() + 1));
          break;
        case 2:
          b.push_back(static_cast<uint8_t>(rng()));
          break;
      }
      if (b.empty()) b.push_back(0);
    }
    if (b.size() >= 40 && (rng() % 2) == 0) {  // make the checksums agree so deeper checks run
      const uint64_t payload = b.size() - 40;
      std::memcpy(b.data() + 16, &payload, 8);
      const uint32_t payload_crc = Crc32c(b.data() + 40, payload);
      std::memcpy(b.data() + 32, &payload_crc, 4);
      const uint32_t header_crc = Crc32c(b.data(), 36);
      std::memcpy(b.data() + 36, &header_crc, 4);
    }
    std::vector<float> out(input.size());
    if (DecodeTensor(b, absl::MakeSpan(out)).ok()) ++accepted;
  }
  // Some resealed edits only change values (still valid buffers); most must be refused.
  EXPECT_LT(accepted, 3000 / 2);
}

TEST(Crc32c, MatchesTheStandardCheckValue) {
  const char* text = "123456789";
  EXPECT_EQ(Crc32c(text, 9), 0xE3069283u);
  EXPECT_EQ(Crc32c(text + 4, 5, Crc32c(text, 4)), 0xE3069283u);  // chaining
  // Large buffers take the interleaved path; chaining small pieces takes the simple one: they must agree.
  std::mt19937 rng(3);
  std::vector<uint8_t> big(100000 + 13);
  for (uint8_t& b : big) b = static_cast<uint8_t>(rng());
  for (size_t length : {size_t{12287}, size_t{12288}, size_t{12289}, size_t{50000}, big.size()}) {
    uint32_t chained = 0;
    for (size_t at = 0; at < length; at += 1000)
      chained = Crc32c(big.data() + at, std::min<size_t>(1000, length - at), chained);
    EXPECT_EQ(Crc32c(big.data(), length), chained) << length;
  }
}

INSTANTIATE_TEST_SUITE_P(Loops, CodecTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("Scalar") : std::string("Vector"); });

}  // namespace
}  // namespace geotrain::comm
