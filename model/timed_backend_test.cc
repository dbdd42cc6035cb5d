// Timed compute's arithmetic and memory: the roofline, the op costs against the planner's layer FLOPs, a stage
// on the timed backend waiting the time its ops add up to, and a large model's stage costing no real memory.
#include "model/timed_backend.h"

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "model/gpt2.h"
#include "model/optimizer.h"

namespace geotrain::model {
namespace {

// Proportional set size of this process in bytes (shared pages divided among their mappings: the window
// mapped many times counts once).
int64_t PssBytes() {
  std::ifstream in("/proc/self/smaps_rollup");
  std::string key;
  int64_t kb = 0;
  while (in >> key) {
    if (key == "Pss:") {
      in >> kb;
      return kb * 1024;
    }
    std::string rest;
    std::getline(in, rest);
  }
  return -1;
}

TEST(RooflineTest, ComputeOrMemoryBoundPlusLaunch) {
  const Roofline r{.flops_per_s = 100e12, .bytes_per_s = 1e12, .launch_s = 5e-6};
  // 1e12 FLOPs at 100 TFLOP/s: 10 ms; 1 MB at 1 TB/s: 1 us. Compute-bound.
  EXPECT_DOUBLE_EQ(r.Seconds({.flops = 1e12, .bytes = 1e6}), 0.01 + 5e-6);
  // Memory-bound: 1 GB at 1 TB/s is 1 ms, the FLOPs 10 us.
  EXPECT_DOUBLE_EQ(r.Seconds({.flops = 1e9, .bytes = 1e9}), 1e-3 + 5e-6);
  EXPECT_DOUBLE_EQ(r.Seconds({}), 5e-6);
}

TEST(OpCostsTest, MatmulAndAttentionCountsAndThePlannersBlockFlopsAgree) {
  EXPECT_DOUBLE_EQ(MatmulForwardCost(8, 16, 32).flops, 2.0 * 8 * 16 * 32);
  EXPECT_DOUBLE_EQ(MatmulForwardCost(8, 16, 32).bytes, 4.0 * (8 * 16 + 16 * 32 + 8 * 32 + 32));
  EXPECT_DOUBLE_EQ(MatmulBackwardCost(8, 16, 32).flops, 2 * MatmulForwardCost(8, 16, 32).flops + 8 * 32);
  EXPECT_DOUBLE_EQ(AttentionForwardCost(2, 64, 32, 4).flops, 2.0 * 2 * 64 * 64 * 32);
  EXPECT_DOUBLE_EQ(AttentionBackwardCost(2, 64, 32, 4).flops, 2 * AttentionForwardCost(2, 64, 32, 4).flops);
  // The planner's block FLOPs (GPT2Config::BlockForwardFlops, scheduler/cost_model) are the same count: the
  // four matmuls and causal attention of one sequence (llm.c's 24 C^2 T + 2 C T^2).
  GPT2Config c = *GPT2Config::FromPreset("gpt2-medium");
  const double C = c.n_embd, T = 1024;
  EXPECT_DOUBLE_EQ(c.BlockForwardFlops(1024), 24 * C * C * T + 2 * C * T * T);
}

TEST(TimedBackendTest, DeviceNameParsing) {
  absl::StatusOr<std::unique_ptr<Backend>> b = MakeBackend("timed:H100@400:2680:5");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_FALSE((*b)->is_cuda());
  EXPECT_NE((*b)->name().find("EMULATED"), std::string::npos) << (*b)->name();
  EXPECT_NE((*b)->name().find("H100"), std::string::npos);
  for (const char* bad :
       {"timed:H100", "timed:@1:2:3", "timed:H100@1:2", "timed:H100@x:2:3", "timed:H100@0:2:3", "timed:H100@1:-2:3"}) {
    EXPECT_EQ(MakeBackend(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(TimedBackendTest, MemoryIsZeroAndCostsOnlyTheWindow) {
  auto backend = TimedBackend::Create({.device_name = "test", .roofline = {1e12, 1e11, 0}, .sleep = false});
  ASSERT_TRUE(backend.ok()) << backend.status();
  const int64_t before = PssBytes();
  ASSERT_GT(before, 0);
  // 4 GB of "device memory", written all over (as the runtime's all-reduces write zeros into gradients).
  constexpr size_t kBytes = size_t{4} << 30;
  absl::StatusOr<DeviceBuffer> buffer = DeviceBuffer::Allocate(**backend, kBytes);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  float* data = buffer->as<float>();
  for (size_t i = 0; i < kBytes / sizeof(float); i += 4096) data[i] = 0.0f;
  EXPECT_EQ(data[kBytes / sizeof(float) - 1], 0.0f);
#if defined(__SANITIZE_ADDRESS__)  // GCC's ASan
#define GEOTRAIN_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)  // clang's
#define GEOTRAIN_TEST_ASAN 1
#endif
#endif
#ifdef GEOTRAIN_TEST_ASAN
  // ASan clears the shadow of every window mapping it intercepts: 1 byte per 8 of the 4 GB, its memory, not ours.
  constexpr int64_t kShadowBytes = int64_t{kBytes / 8};
#else
  constexpr int64_t kShadowBytes = 0;
#endif
  EXPECT_LT(PssBytes() - before, (int64_t{64} << 20) + kShadowBytes)
      << "4 GB touched should cost about the 8 MB window";
  float host[4] = {1, 2, 3, 4};
  ASSERT_TRUE((*backend)->CopyToHost(host, data, sizeof(host)).ok());
  EXPECT_EQ(host[3], 0.0f);
  EXPECT_EQ(*(*backend)->SumSquares(data, 1024), 0.0);
}

TEST(TimedBackendTest, AStageStepWaitsTheTimeItsOpsAddUpTo) {
  GPT2Config config = *GPT2Config::FromPreset("gpt2-small-test");
  const int B = 2, T = 64;
  // Slow enough that a step takes about 0.2 s: the sleeps dominate the host's own work.
  const Roofline slow{.flops_per_s = 5e9, .bytes_per_s = 5e9, .launch_s = 20e-6};
  absl::StatusOr<double> predicted = PredictTrainingStepSeconds(config, B, T, 1, slow);
  ASSERT_TRUE(predicted.ok()) << predicted.status();
  ASSERT_GT(*predicted, 0.05);
  ASSERT_LT(*predicted, 2.0);

  auto backend = TimedBackend::Create({.device_name = "slow", .roofline = slow});
  ASSERT_TRUE(backend.ok()) << backend.status();
  StageOptions options;
  options.backend = backend->get();
  options.max_batch = B;
  options.max_seq_len = T;
  auto stage = GPT2Stage::Create(config, options);
  ASSERT_TRUE(stage.ok()) << stage.status();
  auto adam = AdamW::Create((*stage)->num_params(), (*stage)->segments(), {}, **backend);
  ASSERT_TRUE(adam.ok()) << adam.status();
  std::vector<int32_t> tokens(B * T, 7);
  const double charged_before = (*backend)->busy_seconds();
  const auto start = std::chrono::steady_clock::now();
  (*stage)->ZeroGrad();
  ASSERT_TRUE((*stage)->Forward(B, T, tokens.data(), nullptr, tokens.data()).ok());
  ASSERT_TRUE((*stage)->Backward(nullptr, 1.0f).ok());
  (*stage)->GradSquaredNormShare();
  (*adam)->Step((*stage)->params(), (*stage)->grads(), 1e-4f, 1.0f);
  ASSERT_TRUE((*backend)->Synchronize().ok());
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NEAR((*backend)->busy_seconds() - charged_before, *predicted, 1e-9);
  // It waited at least the predicted time; the host's own work and the sleeps' overshoot add a little.
  EXPECT_GE(elapsed, *predicted * 0.99);
  EXPECT_LT(elapsed, *predicted * 1.5 + 0.05);
  // No real loss: the timed stage computes nothing.
  EXPECT_EQ((*stage)->loss(), 0.0f);
}

}  // namespace
}  // namespace geotrain::model
