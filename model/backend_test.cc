// The backend seam on the CPU: device names, memory, and a stage and an optimizer on an explicit CPU
// backend giving the default (null backend) numbers bit for bit. The CUDA backend is checked against
// the CPU in tests/gpu/gpu_model_test.cc.
#include "model/backend.h"

#include <random>

#include "gtest/gtest.h"
#include "model/gpt2.h"
#include "model/optimizer.h"

namespace geotrain::model {
namespace {

TEST(BackendTest, DeviceNames) {
  absl::StatusOr<std::unique_ptr<Backend>> cpu = MakeBackend("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ((*cpu)->name(), "cpu");
  EXPECT_FALSE((*cpu)->is_cuda());
  EXPECT_EQ(MakeBackend("tpu:0").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeBackend("cuda:x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeBackend("cuda:-1").status().code(), absl::StatusCode::kInvalidArgument);
  // Without the CUDA backend, or without a device 99, the error says what to do.
  absl::StatusOr<std::unique_ptr<Backend>> cuda = MakeBackend("cuda:99");
  ASSERT_FALSE(cuda.ok());
  EXPECT_EQ(cuda.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(cuda.status().message().find("cpu"), std::string_view::npos) << cuda.status();
}

TEST(BackendTest, BuffersAreZeroedMovedAndCopied) {
  Backend& cpu = *CpuBackendInstance();
  absl::StatusOr<DeviceBuffer> a = DeviceBuffer::Allocate(cpu, 64 * sizeof(float));
  ASSERT_TRUE(a.ok());
  for (int i = 0; i < 64; ++i) EXPECT_EQ(a->as<float>()[i], 0.0f);
  std::vector<float> host(64, 2.0f), back(64);
  ASSERT_TRUE(cpu.CopyToDevice(a->as<float>(), host.data(), 64 * sizeof(float)).ok());
  cpu.scale(a->as<float>(), 64, 1.5f);
  cpu.accumulate(a->as<float>(), host.data(), 64);
  DeviceBuffer b = std::move(*a);
  EXPECT_EQ(a->as<float>(), nullptr);
  ASSERT_TRUE(cpu.CopyToHost(back.data(), b.as<float>(), 64 * sizeof(float)).ok());
  EXPECT_EQ(back, std::vector<float>(64, 5.0f));
  EXPECT_EQ(*cpu.Sum(b.as<float>(), 64), 320.0);
  EXPECT_EQ(*cpu.SumSquares(b.as<float>(), 64), 1600.0);
  EXPECT_EQ(DeviceBuffer::Allocate(cpu, 0)->as<float>(), nullptr);
}

GPT2Config SmallConfig() {
  GPT2Config c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 16;
  c.block_size = 8;
  c.vocab_size = 40;
  EXPECT_TRUE(c.Validate().ok());
  return c;
}

// Three training steps of a two-stage pipeline; returns the losses and both stages' parameters.
std::vector<float> Train(Backend* first_backend, Backend* last_backend) {
  const GPT2Config c = SmallConfig();
  std::vector<std::unique_ptr<GPT2Stage>> stages;
  std::vector<std::unique_ptr<AdamW>> adams;
  Backend* backends[] = {first_backend, last_backend};
  for (int k = 0; k < 2; ++k) {
    StageOptions o = StageOptions::Split(c, k, 2);
    o.backend = backends[k];
    auto stage = GPT2Stage::Create(c, o);
    EXPECT_TRUE(stage.ok()) << stage.status();
    (*stage)->InitializeWeights(5);
    if (backends[k] == nullptr) {
      adams.push_back(std::make_unique<AdamW>((*stage)->num_params(), (*stage)->segments(),
                                              AdamWOptions{.weight_decay = 0.1f}));
    } else {
      adams.push_back(*AdamW::Create((*stage)->num_params(), (*stage)->segments(),
                                     {.weight_decay = 0.1f}, *backends[k]));
    }
    stages.push_back(std::move(*stage));
  }
  std::mt19937 rng(3);
  std::vector<float> out;
  for (int step = 0; step < 3; ++step) {
    std::vector<int32_t> x(2 * 8), y(2 * 8);
    for (size_t i = 0; i < x.size(); ++i) {
      x[i] = rng() % c.vocab_size;
      y[i] = rng() % c.vocab_size;
    }
    for (auto& s : stages) s->ZeroGrad();
    EXPECT_TRUE(stages[0]->Forward(2, 8, x.data(), nullptr, nullptr).ok());
    EXPECT_TRUE(stages[1]->Forward(2, 8, nullptr, stages[0]->output(), y.data()).ok());
    EXPECT_TRUE(stages[1]->Backward(nullptr, 1.0f).ok());
    EXPECT_TRUE(stages[0]->Backward(stages[1]->dinput(), 1.0f).ok());
    EXPECT_TRUE(SumTiedEmbeddingGradients(*stages[0], *stages[1]).ok());
    out.push_back(stages[1]->loss());
    double norm = 0.0;
    for (auto& s : stages) norm += s->GradSquaredNormShare();
    for (int k = 0; k < 2; ++k) {
      adams[k]->Step(stages[k]->params(), stages[k]->grads(), 1e-2f, ClipScale(std::sqrt(norm), 1.0));
    }
  }
  for (auto& s : stages) out.insert(out.end(), s->params(), s->params() + s->num_params());
  return out;
}

TEST(BackendTest, ExplicitCpuBackendsGiveTheDefaultNumbersExactly) {
  const std::vector<float> reference = Train(nullptr, nullptr);
  absl::StatusOr<std::unique_ptr<Backend>> a = MakeBackend("cpu"), b = MakeBackend("cpu");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(Train(a->get(), a->get()), reference);
  // Two backend objects (one memory, so the tied gradients are summed in place).
  EXPECT_EQ(Train(a->get(), b->get()), reference);
}

}  // namespace
}  // namespace geotrain::model
