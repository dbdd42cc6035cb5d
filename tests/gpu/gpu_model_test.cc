// The whole GPT-2 on a CUDA device (model/backend.h's CUDA backend) against the CPU model:
//   - one forward and backward in fp32: logits, loss and every gradient within 1e-4 relative
//     (|cuda - cpu| <= 1e-4 * max(1, max |cpu|) per tensor, as tests/parity does against PyTorch);
//   - the gradient-ready hook on the device (order, and gradients final when it fires);
//   - two pipeline stages and TP = 2 (all-reduce staged through the host) on the device;
//   - 50 AdamW steps with clipping: losses within 1e-3 relative in fp32 GEMMs, 2e-2 in bf16 and fp16 GEMMs, both
//     from the fp32 CPU and from the CPU emulating the same precision (bf16 only where the device has it).
// Every test skips without a CUDA device.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "model/backend.h"
#include "model/cuda/ops_cuda.h"
#include "model/gpt2.h"
#include "model/optimizer.h"

namespace geotrain::model {
namespace {

class GpuModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device visible (cuda::DeviceCount() == 0); run on a GPU host "
                      "(tests/gpu/run.sh, ctest -L gpu)";
    }
  }
};

// Device 0's compute capability (major * 10 + minor).
int ComputeCapability() {
  cudaDeviceProp prop;
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess ? prop.major * 10 + prop.minor : 0;
}

std::unique_ptr<Backend> Cuda(Precision precision = Precision::kFp32) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackend("cuda:0", precision);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? std::move(*backend) : nullptr;
}

GPT2Config Preset(const std::string& name) {
  absl::StatusOr<GPT2Config> c = GPT2Config::FromPreset(name);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

struct Batch {
  int B, T;
  std::vector<int32_t> tokens, targets;
};

Batch MakeBatch(const GPT2Config& c, int B, int T, uint32_t seed) {
  Batch b{B, T, {}, {}};
  std::mt19937 rng(seed);
  for (int i = 0; i < B * T; ++i) {
    b.tokens.push_back(rng() % c.vocab_size);
    b.targets.push_back(rng() % c.vocab_size);
  }
  return b;
}

std::unique_ptr<GPT2Stage> MakeStage(const GPT2Config& c, StageOptions o, Backend* backend, int B, int T) {
  o.backend = backend;
  o.max_batch = B;
  o.max_seq_len = T;
  absl::StatusOr<std::unique_ptr<GPT2Stage>> stage = GPT2Stage::Create(c, o);
  EXPECT_TRUE(stage.ok()) << stage.status();
  (*stage)->InitializeWeights(1337);
  (*stage)->ZeroGrad();
  return std::move(*stage);
}

std::vector<float> Export(GPT2Stage& s, const std::string& name, bool grads) {
  const std::vector<int64_t> shape = *s.TensorShape(name);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> out(n);
  EXPECT_TRUE(s.ExportTensor(name, grads, out.data()).ok()) << name;
  return out;
}

// max |a - ref| / max(1, max |ref|).
double RelativeError(const std::vector<float>& a, const std::vector<float>& ref) {
  double diff = 0.0, scale = 1.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - ref[i]));
    scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
  }
  return diff / scale;
}

// The first V columns of the (B*T, Vp) logits, copied to the host.
std::vector<float> Logits(GPT2Stage& s, int B, int T) {
  const int V = s.config().vocab_size, Vp = s.config().padded_vocab_size;
  std::vector<float> padded(static_cast<size_t>(B) * T * Vp), out;
  EXPECT_TRUE(s.backend().CopyToHost(padded.data(), s.logits(), padded.size() * sizeof(float)).ok());
  for (int64_t n = 0; n < static_cast<int64_t>(B) * T; ++n) {
    out.insert(out.end(), padded.begin() + n * Vp, padded.begin() + n * Vp + V);
  }
  return out;
}

constexpr double kFp32Tolerance = 1e-4;

TEST_F(GpuModelTest, ForwardAndBackwardMatchTheCpu) {
  for (const char* preset : {"gpt2-tiny-test", "gpt2-small-test"}) {
    const GPT2Config c = Preset(preset);
    const int B = 4, T = 64;
    const Batch b = MakeBatch(c, B, T, 7);
    std::unique_ptr<Backend> cuda = Cuda();
    ASSERT_NE(cuda, nullptr);
    auto cpu_model = MakeStage(c, {}, nullptr, B, T);
    auto gpu_model = MakeStage(c, {}, cuda.get(), B, T);
    for (const std::string& name : cpu_model->TensorNames()) {
      ASSERT_EQ(Export(*gpu_model, name, false), Export(*cpu_model, name, false)) << name << " after init";
    }
    ASSERT_TRUE(cpu_model->Forward(B, T, b.tokens.data(), nullptr, b.targets.data()).ok());
    absl::Status forward = gpu_model->Forward(B, T, b.tokens.data(), nullptr, b.targets.data());
    ASSERT_TRUE(forward.ok()) << forward;
    EXPECT_LE(RelativeError(Logits(*gpu_model, B, T), Logits(*cpu_model, B, T)), kFp32Tolerance) << preset;
    EXPECT_LE(std::abs(gpu_model->loss() - cpu_model->loss()) / std::max(1.0f, cpu_model->loss()), kFp32Tolerance)
        << preset << ": loss " << gpu_model->loss() << " vs " << cpu_model->loss();
    ASSERT_TRUE(cpu_model->Backward(nullptr, 1.0f).ok());
    absl::Status backward = gpu_model->Backward(nullptr, 1.0f);
    ASSERT_TRUE(backward.ok()) << backward;
    for (const std::string& name : cpu_model->TensorNames()) {
      EXPECT_LE(RelativeError(Export(*gpu_model, name, true), Export(*cpu_model, name, true)), kFp32Tolerance)
          << preset << " gradient " << name;
    }
    EXPECT_NEAR(gpu_model->GradSquaredNormShare(), cpu_model->GradSquaredNormShare(),
                kFp32Tolerance * cpu_model->GradSquaredNormShare());
  }
}

TEST_F(GpuModelTest, GradientHookFiresWhenLayerGradientsAreOnTheDevice) {
  const GPT2Config c = Preset("gpt2-tiny-test");
  const Batch b = MakeBatch(c, 2, 32, 9);
  std::unique_ptr<Backend> cuda = Cuda();
  ASSERT_NE(cuda, nullptr);
  auto model = MakeStage(c, {}, cuda.get(), 2, 32);
  ASSERT_TRUE(model->Forward(2, 32, b.tokens.data(), nullptr, b.targets.data()).ok());
  std::vector<int> order;
  std::vector<std::vector<float>> at_hook(model->num_layers());
  auto layer_to_host = [&](int l) {
    std::vector<float> host;
    for (absl::Span<float> span : model->LayerGradientSpans(l)) {
      std::vector<float> piece(span.size());
      EXPECT_TRUE(cuda->CopyToHost(piece.data(), span.data(), span.size() * sizeof(float)).ok());
      host.insert(host.end(), piece.begin(), piece.end());
    }
    return host;
  };
  model->set_layer_gradients_ready([&](int l) {
    order.push_back(l);
    if (l >= 0) at_hook[l] = layer_to_host(l);
  });
  ASSERT_TRUE(model->Backward(nullptr, 1.0f).ok());
  EXPECT_EQ(order, (std::vector<int>{1, 0, -1}));
  for (int l = 0; l < model->num_layers(); ++l) EXPECT_EQ(layer_to_host(l), at_hook[l]) << "layer " << l;
}

TEST_F(GpuModelTest, StagesAndTensorParallelOnTheDevice) {
  const GPT2Config c = Preset("gpt2-tiny-test");
  const int B = 2, T = 32;
  const Batch b = MakeBatch(c, B, T, 11);
  auto cpu_model = MakeStage(c, {}, nullptr, B, T);
  ASSERT_TRUE(cpu_model->Forward(B, T, b.tokens.data(), nullptr, b.targets.data()).ok());
  ASSERT_TRUE(cpu_model->Backward(nullptr, 1.0f).ok());

  // Two stages on one device: activations pass as device pointers, the tied wte gradient is summed there.
  std::unique_ptr<Backend> cuda = Cuda();
  ASSERT_NE(cuda, nullptr);
  std::vector<std::unique_ptr<GPT2Stage>> stages;
  for (int k = 0; k < 2; ++k) stages.push_back(MakeStage(c, StageOptions::Split(c, k, 2), cuda.get(), B, T));
  ASSERT_TRUE(stages[0]->Forward(B, T, b.tokens.data(), nullptr, nullptr).ok());
  ASSERT_TRUE(stages[1]->Forward(B, T, nullptr, stages[0]->output(), b.targets.data()).ok());
  ASSERT_TRUE(stages[1]->Backward(nullptr, 1.0f).ok());
  ASSERT_TRUE(stages[0]->Backward(stages[1]->dinput(), 1.0f).ok());
  ASSERT_TRUE(SumTiedEmbeddingGradients(*stages[0], *stages[1]).ok());
  EXPECT_NEAR(stages[1]->loss(), cpu_model->loss(), kFp32Tolerance * cpu_model->loss());
  for (auto& s : stages) {
    for (const std::string& name : s->TensorNames()) {
      EXPECT_LE(RelativeError(Export(*s, name, true), Export(*cpu_model, name, true)), kFp32Tolerance)
          << "2 stages, gradient " << name;
    }
  }

  // TP = 2: one backend (context and stream) per rank, on the same device, one thread each.
  InProcessTensorParallelGroup group(2);
  std::vector<std::vector<std::vector<float>>> grads(2);
  std::vector<float> losses(2);
  std::vector<std::unique_ptr<Backend>> backends;
  for (int r = 0; r < 2; ++r) backends.push_back(Cuda());
  ASSERT_NE(backends[1], nullptr);
  const std::vector<std::string> names = cpu_model->TensorNames();
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r]() {
      StageOptions o;
      o.tp_comm = group.comm(r);
      auto s = MakeStage(c, o, backends[r].get(), B, T);
      EXPECT_TRUE(s->Forward(B, T, b.tokens.data(), nullptr, b.targets.data()).ok());
      losses[r] = s->loss();
      EXPECT_TRUE(s->Backward(nullptr, 1.0f).ok());
      for (const std::string& name : names) grads[r].push_back(Export(*s, name, true));  // collective
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NEAR(losses[r], cpu_model->loss(), kFp32Tolerance * cpu_model->loss()) << "tp rank " << r;
    for (size_t i = 0; i < names.size(); ++i) {
      EXPECT_LE(RelativeError(grads[r][i], Export(*cpu_model, names[i], true)), kFp32Tolerance)
          << "tp rank " << r << " gradient " << names[i];
    }
  }
}

// `steps` AdamW steps (warm-up, cosine, clipping at 1) on a fixed stream of batches; the losses.
std::vector<float> TrainLosses(const GPT2Config& c, Backend* backend, int steps) {
  const int B = 4, T = 64;
  auto model = MakeStage(c, {}, backend, B, T);
  std::unique_ptr<AdamW> adam;
  if (backend == nullptr) {
    adam = std::make_unique<AdamW>(model->num_params(), model->segments(), AdamWOptions{.weight_decay = 0.1f});
  } else {
    absl::StatusOr<std::unique_ptr<AdamW>> created =
        AdamW::Create(model->num_params(), model->segments(), {.weight_decay = 0.1f}, *backend);
    EXPECT_TRUE(created.ok()) << created.status();
    adam = std::move(*created);
  }
  const LearningRateSchedule schedule{.max_lr = 3e-3, .min_lr = 3e-4, .warmup_steps = 5, .total_steps = steps};
  // Eight batches cycled, so that the loss falls well below its initial value within 50 steps.
  std::vector<Batch> batches;
  for (int i = 0; i < 8; ++i) batches.push_back(MakeBatch(c, B, T, 100 + i));
  std::vector<float> losses;
  for (int step = 0; step < steps; ++step) {
    const Batch& b = batches[step % batches.size()];
    model->ZeroGrad();
    absl::Status s = model->Forward(B, T, b.tokens.data(), nullptr, b.targets.data());
    EXPECT_TRUE(s.ok()) << s;
    losses.push_back(model->loss());
    s = model->Backward(nullptr, 1.0f);
    EXPECT_TRUE(s.ok()) << s;
    const double norm = std::sqrt(model->GradSquaredNormShare());
    adam->Step(model->params(), model->grads(), static_cast<float>(schedule.At(step)), ClipScale(norm, 1.0));
  }
  EXPECT_TRUE(model->backend().Synchronize().ok());
  return losses;
}

TEST_F(GpuModelTest, FiftyTrainingStepsFollowTheCpu) {
  const GPT2Config c = Preset("gpt2-tiny-test");
  constexpr int kSteps = 50;
  const std::vector<float> cpu = TrainLosses(c, nullptr, kSteps);
  ASSERT_LT(cpu.back(), cpu.front() - 0.5f) << "the CPU run should learn";
  for (Precision precision : {Precision::kFp32, Precision::kBf16, Precision::kFp16}) {
    const int cc = ComputeCapability();
    if (!PrecisionSupported(precision, cc)) {
      std::printf("%s: not run, device of compute capability %s\n", std::string(PrecisionName(precision)).c_str(),
                  ComputeCapabilityName(cc).c_str());
      continue;
    }
    const double tolerance = precision == Precision::kFp32 ? 1e-3 : 2e-2;
    std::unique_ptr<Backend> cuda = Cuda(precision);
    ASSERT_NE(cuda, nullptr);
    const std::vector<float> gpu = TrainLosses(c, cuda.get(), kSteps);
    ASSERT_EQ(gpu.size(), cpu.size());
    // The CPU's emulation of the same precision (GEMM inputs rounded the same way, fp32 accumulation): what the
    // CPU-only test suite trains half precision with, so it must follow the GPU's.
    absl::StatusOr<std::unique_ptr<Backend>> emulated = MakeBackend("cpu", precision);
    ASSERT_TRUE(emulated.ok()) << emulated.status();
    const std::vector<float> cpu_same = TrainLosses(c, emulated->get(), kSteps);
    double worst = 0.0, worst_emulated = 0.0;
    for (int i = 0; i < kSteps; ++i) {
      const double relative = std::abs(gpu[i] - cpu[i]) / std::abs(cpu[i]);
      const double relative_emulated = std::abs(gpu[i] - cpu_same[i]) / std::abs(cpu_same[i]);
      worst = std::max(worst, relative);
      worst_emulated = std::max(worst_emulated, relative_emulated);
      EXPECT_LE(relative, tolerance) << cuda->name() << " step " << i << ": " << gpu[i] << " vs CPU " << cpu[i];
      EXPECT_LE(relative_emulated, tolerance)
          << cuda->name() << " step " << i << ": " << gpu[i] << " vs the CPU's emulation " << cpu_same[i];
    }
    std::printf(
        "%s: worst relative loss difference over %d steps %.3g from the fp32 CPU, %.3g from the CPU "
        "emulating %s (tolerance %.0e)\n",
        cuda->name().c_str(), kSteps, worst, worst_emulated, std::string(PrecisionName(precision)).c_str(), tolerance);
  }
}

}  // namespace
}  // namespace geotrain::model
