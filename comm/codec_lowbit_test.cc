// int4 and sparse (comm/codec_lowbit.h through comm/codec.h): names, the stated error bounds, bytes on the wire,
// error feedback over several rounds, and refusal of malformed payloads (forged with valid checksums).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "comm/codec.h"
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

std::vector<float> Decode(const Bytes& wire, size_t n) {
  std::vector<float> out(n, -1.0f);
  const absl::Status s = DecodeTensor(wire.span(), absl::MakeSpan(out));
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// Rewrites both checksums of an edited buffer, so that decoding reaches the payload checks.
void Reseal(std::vector<uint8_t>* b) {
  const uint32_t payload_crc = Crc32c(b->data() + kCodecHeaderBytes, b->size() - kCodecHeaderBytes);
  std::memcpy(b->data() + 32, &payload_crc, 4);
  const uint32_t header_crc = Crc32c(b->data(), 36);
  std::memcpy(b->data() + 36, &header_crc, 4);
}

TEST(LowBitCodecParse, NamesAndTheirCanonicalForms) {
  for (const char* text : {"int4", "int4+zstd:3", "sparse:0.02:2", "sparse:0.1:8+zstd", "sparse:1:4"}) {
    auto codec = ParseCodec(text);
    ASSERT_TRUE(codec.ok()) << text << ": " << codec.status();
    EXPECT_EQ(codec->ToString(), text);
  }
  const Codec bare = MustParse("Sparse");
  EXPECT_EQ(bare.kind, CodecKind::kSparse);
  EXPECT_EQ(bare.sparse_fraction, 0.02);
  EXPECT_EQ(bare.sparse_bits, 2);
  EXPECT_EQ(bare.ToString(), "sparse:0.02:2");
  EXPECT_EQ(MustParse("sparse:0.05").ToString(), "sparse:0.05:2");
  // The name keeps the fraction exactly (the shortest text that reads back the same).
  EXPECT_EQ(MustParse(MustParse("sparse:0.0123456789:3").ToString()).sparse_fraction, 0.0123456789);
  EXPECT_TRUE(MustParse("int4").error_feedback());
  EXPECT_FALSE(MustParse("int8").error_feedback());
  for (const char* text : {"int4:2", "sparse:0", "sparse:1.5", "sparse:x", "sparse:0.1:1", "sparse:0.1:9",
                           "sparse:0.1:2:3", "sparse::2", "sparse:0.1:2.5"}) {
    auto codec = ParseCodec(text);
    EXPECT_FALSE(codec.ok()) << "accepted '" << text << "'";
    EXPECT_EQ(codec.status().code(), absl::StatusCode::kInvalidArgument);
  }
  // Existing names keep their meaning and bytes (kind bytes 0-4; the new ones 5 and 6).
  EXPECT_EQ(static_cast<int>(MustParse("topk:0.1").kind), 4);
  EXPECT_EQ(static_cast<int>(MustParse("int4").kind), 5);
  EXPECT_EQ(static_cast<int>(MustParse("sparse").kind), 6);
}

// Every codec with error feedback is for gradients only, and activations take its dense part instead (fp32): the
// pipeline's and tensor parallelism's communicators (worker/stage_collectives.cc) use ActivationCodec.
TEST(LowBitCodecParse, GradientsOnlyCodecsNeverCarryActivations) {
  for (const char* name : {"topk:0.01", "topk:0.5+zstd", "int4", "int4+zstd:3", "sparse", "sparse:0.1:8+zstd"}) {
    const Codec codec = MustParse(name);
    EXPECT_TRUE(codec.gradients_only()) << name;
    EXPECT_EQ(ActivationCodec(codec).ToString(), "none") << name;
    EXPECT_FALSE(ActivationCodec(codec).error_feedback()) << name;
  }
  for (const char* name : {"none", "fp16", "bf16+zstd", "int8", "int8+zstd:3"}) {
    EXPECT_FALSE(MustParse(name).gradients_only()) << name;
    EXPECT_EQ(ActivationCodec(MustParse(name)).ToString(), name);
  }
}

// Bytes on the wire: 40 + CodecRawPayloadBytes (what the planner costs), and the ratios docs/comm.md states.
TEST(LowBitCodec, BytesOnTheWireAreTheStatedOnes) {
  const size_t n = 4096 * 1000 + 77;  // a partial last block
  const std::vector<float> input = RandomTensor(n, 1);
  for (const char* name : {"int4", "sparse:0.02:2", "sparse:0.1:4", "sparse:1:8", "int8"}) {
    const Codec codec = MustParse(name);
    Bytes wire;
    std::vector<float> residual;
    ASSERT_TRUE(EncodeTensor(codec, input, &wire, &residual).ok()) << name;
    EXPECT_EQ(wire.size(), kCodecHeaderBytes + CodecRawPayloadBytes(codec, n)) << name;
    EXPECT_TRUE(CheckEncodedSize(codec, n, wire.size()).ok()) << name;
    EXPECT_FALSE(CheckEncodedSize(codec, n, wire.size() + 1).ok()) << name;
    std::printf("%s: %.4f of fp32 (%.1fx), %.4f of bf16 (%.1fx)\n", name, wire.size() / (4.0 * n),
                4.0 * n / wire.size(), wire.size() / (2.0 * n), 2.0 * n / wire.size());
  }
  Bytes wire;
  ASSERT_TRUE(EncodeTensor(MustParse("int4"), input, &wire).ok());
  EXPECT_GT(4.0 * n / wire.size(), 7.1);  // 4.5 bits per value
  std::vector<float> residual;
  ASSERT_TRUE(EncodeTensor(MustParse("sparse"), input, &wire, &residual).ok());
  EXPECT_GT(4.0 * n / wire.size(), 110.0);  // 82 of 4096 kept, 14 bits each, a 4-byte scale per block
  // The counts per block: ceil(F x block), at least one.
  EXPECT_EQ(SparseKeptPerBlock(0.02, 4096), 82u);
  EXPECT_EQ(SparseKeptPerBlock(0.02, 10), 1u);
  EXPECT_EQ(SparseKeptPerBlock(1e-9, 4096), 1u);
  EXPECT_EQ(SparseKeptPerBlock(1.0, 77), 77u);
  EXPECT_EQ(SparseKeptPerBlock(0.5, 0), 0u);
}

TEST(LowBitCodec, Int4WithinHalfAScalePerBlock) {
  for (size_t n : {size_t{1}, size_t{63}, size_t{64}, size_t{65}, size_t{1001}, size_t{40000}}) {
    std::vector<float> input = RandomTensor(n, 2, 3.0f);
    if (n > 10) input[7] = 0.0f;
    Bytes wire;
    ASSERT_TRUE(EncodeTensor(MustParse("int4"), input, &wire).ok());
    const std::vector<float> out = Decode(wire, n);
    for (size_t begin = 0; begin < n; begin += kInt4BlockSize) {
      const size_t end = std::min(n, begin + kInt4BlockSize);
      float max_abs = 0;
      for (size_t i = begin; i < end; ++i) max_abs = std::max(max_abs, std::fabs(input[i]));
      for (size_t i = begin; i < end; ++i) {
        ASSERT_LE(std::fabs(out[i] - input[i]), max_abs / 14 * (1 + 1e-5f)) << n << " element " << i;
      }
    }
    if (n > 10) EXPECT_EQ(out[7], 0.0f);  // int4 keeps a zero level
  }
}

TEST(LowBitCodec, SparseKeepsEachBlocksLargestWithinItsBound) {
  const size_t n = 4096 * 3 + 500;
  for (int bits : {2, 3, 8}) {
    const Codec codec = MustParse("sparse:0.05:" + std::to_string(bits));
    const std::vector<float> input = RandomTensor(n, 3);
    std::vector<float> residual;
    Bytes wire;
    ASSERT_TRUE(EncodeTensor(codec, input, &wire, &residual).ok());
    const std::vector<float> out = Decode(wire, n);
    for (size_t begin = 0; begin < n; begin += kSparseBlockSize) {
      const size_t end = std::min<size_t>(n, begin + kSparseBlockSize);
      float scale = 0, smallest_kept = INFINITY, largest_dropped = 0;
      size_t kept = 0;
      for (size_t i = begin; i < end; ++i) scale = std::max(scale, std::fabs(input[i]));
      for (size_t i = begin; i < end; ++i) {
        if (out[i] != 0.0f) {
          ++kept;
          smallest_kept = std::min(smallest_kept, std::fabs(input[i]));
          ASSERT_LE(std::fabs(out[i] - input[i]), scale / (1 << bits) * (1 + 1e-5f)) << bits << " bits, " << i;
          ASSERT_EQ(residual[i], input[i] - out[i]) << i;  // what the rounding left out, exactly
        } else {
          largest_dropped = std::max(largest_dropped, std::fabs(input[i]));
          ASSERT_EQ(residual[i], input[i]) << i;  // not sent: all of it stays behind
        }
      }
      EXPECT_EQ(kept, SparseKeptPerBlock(0.05, end - begin)) << bits << " bits, block at " << begin;
      EXPECT_GE(smallest_kept, largest_dropped);
    }
  }
}

// Error feedback over many rounds: what was delivered plus what is held equals everything that came in; and a
// tensor sent once, then nothing, is delivered (the residual drains) within a few rounds.
TEST(LowBitCodec, ErrorFeedbackDeliversWhatWasDropped) {
  const size_t n = 4096 * 2 + 100;
  for (const char* name : {"int4", "sparse:0.02:2", "sparse:0.25:4"}) {
    const Codec codec = MustParse(name);
    std::vector<float> residual;
    std::vector<double> delivered(n, 0.0), came_in(n, 0.0);
    for (int round = 0; round < 30; ++round) {
      const std::vector<float> grad = RandomTensor(n, 100 + round);
      Bytes wire;
      ASSERT_TRUE(EncodeTensor(codec, grad, &wire, &residual).ok());
      const std::vector<float> out = Decode(wire, n);
      for (size_t i = 0; i < n; ++i) {
        delivered[i] += out[i];
        came_in[i] += grad[i];
      }
    }
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(delivered[i] + residual[i], came_in[i], 1e-4 * (1.0 + std::fabs(came_in[i]))) << name << " " << i;
    }
  }
  for (const auto& [name, rounds] : {std::pair<const char*, int>{"int4", 8}, {"sparse:0.25:4", 24}}) {
    const Codec codec = MustParse(name);
    const std::vector<float> once = RandomTensor(n, 5);
    std::vector<float> residual, zeros(n, 0.0f);
    std::vector<double> delivered(n, 0.0);
    float largest = 0;
    for (float x : once) largest = std::max(largest, std::fabs(x));
    for (int round = 0; round < rounds; ++round) {
      Bytes wire;
      ASSERT_TRUE(EncodeTensor(codec, round == 0 ? once : zeros, &wire, &residual).ok());
      const std::vector<float> out = Decode(wire, n);
      for (size_t i = 0; i < n; ++i) delivered[i] += out[i];
    }
    double left = 0;
    for (size_t i = 0; i < n; ++i) {
      left = std::max(left, std::fabs(delivered[i] - once[i]));
      ASSERT_NEAR(delivered[i] + residual[i], once[i], 1e-5 * largest) << name << " " << i;
    }
    EXPECT_LT(left, 1e-3 * largest) << name << ": still held back after " << rounds << " rounds";
  }
}

// A NaN or infinity (in the input, or made by input + residual overflowing) is refused before the residual is
// touched, by every codec with error feedback: the other elements' residuals stay as they were, and the next finite
// tensor encodes as if the refused one had never come.
TEST(LowBitCodec, NeedsAResidualRefusesNanAndKeepsTheResidualThen) {
  std::vector<float> input = RandomTensor(5000, 6);
  Bytes wire;
  EXPECT_EQ(EncodeTensor(MustParse("sparse"), input, &wire).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(EncodeTensor(MustParse("int4"), input, &wire).ok());  // int4 without error feedback
  for (const char* name : {"topk:0.1", "int4", "sparse"}) {
    std::vector<float> residual;
    ASSERT_TRUE(EncodeTensor(MustParse(name), input, &wire, &residual).ok());
    const std::vector<float> before = residual;
    std::vector<float> bad = input;
    bad[4321] = NAN;
    EXPECT_EQ(EncodeTensor(MustParse(name), bad, &wire, &residual).code(), absl::StatusCode::kInvalidArgument);
    bad[4321] = INFINITY;
    EXPECT_EQ(EncodeTensor(MustParse(name), bad, &wire, &residual).code(), absl::StatusCode::kInvalidArgument);
    ASSERT_EQ(residual.size(), before.size()) << name;
    for (size_t i = 0; i < residual.size(); ++i) {
      ASSERT_EQ(std::memcmp(&residual[i], &before[i], sizeof(float)), 0) << name << ": residual " << i << " changed";
    }
    // Finite input and residual whose sum overflows.
    std::vector<float> overflowing = before, huge = input;
    overflowing[17] = huge[17] = std::numeric_limits<float>::max();
    const std::vector<float> overflowing_before = overflowing;
    EXPECT_EQ(EncodeTensor(MustParse(name), huge, &wire, &overflowing).code(), absl::StatusCode::kInvalidArgument)
        << name;
    EXPECT_EQ(overflowing, overflowing_before) << name;
    // The next finite tensor: the same bytes as from an encoder that never saw the refused ones.
    std::vector<float> fresh = before;
    Bytes expected;
    ASSERT_TRUE(EncodeTensor(MustParse(name), input, &expected, &fresh).ok());
    ASSERT_TRUE(EncodeTensor(MustParse(name), input, &wire, &residual).ok()) << name;
    EXPECT_EQ(std::vector<uint8_t>(wire.data(), wire.data() + wire.size()),
              std::vector<uint8_t>(expected.data(), expected.data() + expected.size()))
        << name;
    EXPECT_EQ(residual, fresh) << name;
  }
}

TEST(LowBitCodec, DecodeAddZstdEmptyAndTinyBlocks) {
  for (const char* name : {"int4", "int4+zstd", "sparse:0.1:3", "sparse:0.1:3+zstd"}) {
    const std::vector<float> input = RandomTensor(9001, 7);
    std::vector<float> acc = RandomTensor(9001, 8), residual;
    Bytes wire;
    ASSERT_TRUE(EncodeTensor(MustParse(name), input, &wire, &residual).ok()) << name;
    const std::vector<float> decoded = Decode(wire, input.size());
    std::vector<float> expected = acc;
    for (size_t i = 0; i < acc.size(); ++i) expected[i] += decoded[i];
    ASSERT_TRUE(DecodeTensorAdd(wire.span(), absl::MakeSpan(acc)).ok()) << name;
    EXPECT_EQ(acc, expected) << name;
    std::vector<float> empty, empty_residual;
    ASSERT_TRUE(EncodeTensor(MustParse(name), empty, &wire, &empty_residual).ok()) << name;
    EXPECT_TRUE(DecodeTensor(wire.span(), absl::MakeSpan(empty)).ok()) << name;
  }
  // Blocks of denormals and zeros stay finite.
  std::vector<float> tiny(300, 1e-42f), residual;
  tiny[0] = 0.0f;
  for (const char* name : {"int4", "sparse:0.5:8"}) {
    Bytes wire;
    ASSERT_TRUE(EncodeTensor(MustParse(name), tiny, &wire, &residual).ok());
    for (float x : Decode(wire, tiny.size())) ASSERT_TRUE(std::isfinite(x)) << name;
  }
}

// CodecRoundTrip (train --local's simulation of the outer exchange) keeps int4's and sparse's error feedback per
// stream, as a communicator keeps it per tensor key.
TEST(LowBitCodec, RoundTripKeepsTheErrorFeedbackPerStream) {
  for (const char* name : {"int4", "sparse:0.02:2"}) {
    const std::vector<float> first = RandomTensor(10000, 9), second = RandomTensor(10000, 10);
    CodecRoundTrip round_trip(MustParse(name));
    std::vector<float> a1 = first, b1 = first, a2 = second;
    ASSERT_TRUE(round_trip.Apply("a", absl::MakeSpan(a1)).ok());
    ASSERT_TRUE(round_trip.Apply("b", absl::MakeSpan(b1)).ok());
    EXPECT_EQ(a1, b1) << name;  // two streams of the same values round alike
    ASSERT_TRUE(round_trip.Apply("a", absl::MakeSpan(a2)).ok());
    // The same as an encoder that kept its residual across the two tensors.
    std::vector<float> residual;
    Bytes wire;
    ASSERT_TRUE(EncodeTensor(MustParse(name), first, &wire, &residual).ok());
    EXPECT_EQ(Decode(wire, first.size()), a1) << name;
    ASSERT_TRUE(EncodeTensor(MustParse(name), second, &wire, &residual).ok());
    EXPECT_EQ(Decode(wire, second.size()), a2) << name;
  }
}

// A header for `payload` as a peer would send it (kind byte, element count, sizes, both checksums).
std::vector<uint8_t> Sealed(CodecKind kind, uint64_t count, const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> b(kCodecHeaderBytes + payload.size(), 0);
  std::copy(payload.begin(), payload.end(), b.begin() + kCodecHeaderBytes);
  std::memcpy(b.data(), &kCodecMagic, 4);
  b[4] = 1;
  b[5] = static_cast<uint8_t>(kind);
  const uint64_t bytes = payload.size();
  std::memcpy(b.data() + 8, &count, 8);
  std::memcpy(b.data() + 16, &bytes, 8);
  std::memcpy(b.data() + 24, &bytes, 8);
  Reseal(&b);
  return b;
}

// The wire layouts codec.h documents, written by hand as fuzz/make_seeds.py writes its int4 and sparse seeds
// (fuzz/corpus/codec/int4, sparse, sparse_two_blocks): they decode to the values their fields stand for.
TEST(LowBitCodec, HandWrittenPayloadsDecodeAsDocumented) {
  // int4: scale 0.5, codes 7, -7, 3 (element 2j in the low nibble of byte j), the padding nibble 0.
  std::vector<uint8_t> int4 = {0, 0, 0, 0x3f, 0x97, 0x03};
  std::vector<float> out(3);
  ASSERT_TRUE(DecodeTensor(Sealed(CodecKind::kInt4, 3, int4), absl::MakeSpan(out)).ok());
  EXPECT_THAT(out, testing::ElementsAre(3.5f, -3.5f, 1.5f));
  // sparse, one block of 10: kept 82 per full block (none here) and 2 in the last, B = 2, scale 0.75; offsets 1 and
  // 7 (12 bits each: 0x001, 0x007), codes 3 and 0 (2 bits each): values (2c + 1 - 4) / 4 x 0.75.
  std::vector<uint8_t> sparse = {82, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0x40, 0x3f, 0x01, 0x70, 0x00, 0x03};
  out.assign(10, -1.0f);
  ASSERT_TRUE(DecodeTensor(Sealed(CodecKind::kSparse, 10, sparse), absl::MakeSpan(out)).ok());
  EXPECT_THAT(out, testing::ElementsAre(0, 0.5625f, 0, 0, 0, 0, 0, -0.5625f, 0, 0));
  // sparse, blocks of 4096 and 4: 3 kept in the first (offsets 0, 100, 4095), 1 in the last (offset 3), B = 5, scales
  // 2 and 0.5, codes 31, 0, 17, 9: values (2c + 1 - 32) / 32 x scale.
  sparse = {3,    0,    0,    0,    1,    0,    0, 0, 5, 0, 0, 0, 0, 0, 0, 0x40, 0, 0, 0, 0x3f,  // preamble, scales
            0x00, 0x40, 0x06, 0xff, 0x3f, 0x00,  // offsets 0, 100, 4095, 3
            0x1f, 0xc4, 0x04};                   // codes 31, 0, 17, 9
  out.assign(4100, -1.0f);
  ASSERT_TRUE(DecodeTensor(Sealed(CodecKind::kSparse, 4100, sparse), absl::MakeSpan(out)).ok());
  std::vector<float> expected(4100, 0.0f);
  expected[0] = 31.0f / 32 * 2;
  expected[100] = -31.0f / 32 * 2;
  expected[4095] = 3.0f / 32 * 2;
  expected[4096 + 3] = -13.0f / 32 * 0.5f;
  EXPECT_EQ(out, expected);
}

TEST(LowBitCodecCorruption, ForgedInt4PayloadsAreRefused) {
  const size_t n = 201;  // odd: a padding nibble
  const std::vector<float> input = RandomTensor(n, 11);
  Bytes wire;
  ASSERT_TRUE(EncodeTensor(MustParse("int4"), input, &wire).ok());
  const std::vector<uint8_t> good(wire.data(), wire.data() + wire.size());
  std::vector<float> out(n);
  const size_t scales = kCodecHeaderBytes, codes = kCodecHeaderBytes + 4 * ((n + 63) / 64);
  auto refused = [&](std::vector<uint8_t> bad, const char* what) {
    Reseal(&bad);
    const absl::Status s = DecodeTensor(bad, absl::MakeSpan(out));
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << what << ": " << s;
  };
  std::vector<uint8_t> bad = good;
  const float nan = NAN, negative = -1.0f;
  std::memcpy(bad.data() + scales + 4, &nan, 4);
  refused(bad, "a NaN scale");
  bad = good;
  std::memcpy(bad.data() + scales, &negative, 4);
  refused(bad, "a negative scale");
  bad = good;
  bad[codes + 3] = 0x80;  // -8 in the high nibble
  refused(bad, "code -8");
  bad = good;
  bad.back() |= 0x10;  // the odd count's padding nibble
  refused(bad, "padding nibble");
  bad = good;
  bad.pop_back();
  const uint64_t shorter = bad.size() - kCodecHeaderBytes;
  std::memcpy(bad.data() + 16, &shorter, 8);
  std::memcpy(bad.data() + 24, &shorter, 8);
  Reseal(&bad);
  EXPECT_FALSE(DecodeTensor(bad, absl::MakeSpan(out)).ok()) << "a payload one byte short";
}

TEST(LowBitCodecCorruption, ForgedSparsePayloadsAreRefused) {
  const size_t n = 4096 + 1000;  // two blocks
  const std::vector<float> input = RandomTensor(n, 12);
  std::vector<float> residual;
  Bytes wire;
  ASSERT_TRUE(EncodeTensor(MustParse("sparse:0.01:3"), input, &wire, &residual).ok());
  const std::vector<uint8_t> good(wire.data(), wire.data() + wire.size());
  std::vector<float> out(n);
  ASSERT_TRUE(DecodeTensor(good, absl::MakeSpan(out)).ok());
  const size_t preamble = kCodecHeaderBytes, indices = preamble + kSparsePreambleBytes + 4 * 2;
  auto refused = [&](std::vector<uint8_t> bad, const char* what) {
    Reseal(&bad);
    const absl::Status s = DecodeTensor(bad, absl::MakeSpan(out));
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << what << ": " << s;
    std::vector<float> acc(n, 1.0f);
    EXPECT_FALSE(DecodeTensorAdd(bad, absl::MakeSpan(acc)).ok()) << what;
    EXPECT_EQ(acc, std::vector<float>(n, 1.0f)) << what << ": touched before its checks";
  };
  auto put_u32 = [](std::vector<uint8_t>* b, size_t at, uint32_t v) { std::memcpy(b->data() + at, &v, 4); };
  std::vector<uint8_t> bad = good;
  put_u32(&bad, preamble, 5000);
  refused(bad, "more kept than a block holds");
  bad = good;
  put_u32(&bad, preamble + 4, 1001);
  refused(bad, "more kept than the last block holds");
  bad = good;
  put_u32(&bad, preamble, 40);  // 40 + 10 kept, but the payload holds 41 + 10
  refused(bad, "counts that do not match the size");
  bad = good;
  bad[preamble + 8] = 9;
  refused(bad, "9 bits");
  bad = good;
  bad[preamble + 8] = 1;
  refused(bad, "1 bit");
  bad = good;
  bad[preamble + 10] = 1;
  refused(bad, "a reserved byte");
  bad = good;
  const float inf = INFINITY;
  std::memcpy(bad.data() + preamble + kSparsePreambleBytes + 4, &inf, 4);
  refused(bad, "an infinite scale");
  // The first index (12 bits at bit 0) set to the second's: not increasing.
  bad = good;
  const uint32_t second = (bad[indices + 1] >> 4) | (uint32_t{bad[indices + 2]} << 4);
  bad[indices] = static_cast<uint8_t>(second);
  bad[indices + 1] = static_cast<uint8_t>((bad[indices + 1] & 0xF0) | (second >> 8));
  refused(bad, "indices not increasing");
  // The last block's last index (the stream's last 12 bits) out of the block: 4095 >= 1000.
  bad = good;
  const uint64_t kept = 41 + 10, last_bit = (kept - 1) * 12;
  for (int b = 0; b < 12; ++b) {
    const uint64_t bit = last_bit + b;
    bad[indices + bit / 8] |= static_cast<uint8_t>(1u << (bit % 8));
  }
  refused(bad, "an index out of its block");
  // The values' padding bits (51 x 3 = 153 bits: 7 padding bits in the last byte).
  bad = good;
  bad.back() |= 0x80;
  refused(bad, "padding bits");
}

// Encode and decode speed on this machine (one core), the figures the planner's cost model takes.
TEST(LowBitCodec, PrintsItsSpeed) {
  const std::vector<float> input = RandomTensor(size_t{1} << 22, 13);
  std::vector<float> out(input.size());
  for (const char* name : {"int8", "int4", "sparse:0.02:2", "topk:0.02"}) {
    std::vector<float> residual;
    Bytes wire;
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(EncodeTensor(MustParse(name), input, &wire, &residual).ok());
    const auto t1 = std::chrono::steady_clock::now();
    ASSERT_TRUE(DecodeTensor(wire.span(), absl::MakeSpan(out)).ok());
    const auto t2 = std::chrono::steady_clock::now();
    const double encode = std::chrono::duration<double>(t1 - t0).count();
    const double decode = std::chrono::duration<double>(t2 - t1).count();
    std::printf("%s: encode %.2f GB/s, decode %.2f GB/s of fp32 (ISA %s)\n", name, 4.0 * input.size() / encode / 1e9,
                4.0 * input.size() / decode / 1e9, std::string(CodecIsa()).c_str());
  }
}

}  // namespace
}  // namespace geotrain::comm
