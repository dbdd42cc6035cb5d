// The backend seam on the CPU: device names, memory, and a stage and an optimizer on an explicit CPU
// backend giving the default (null backend) numbers bit for bit. A CPU backend that claims to be a
// device runs the stage's device paths (host staging of imports, exports, the TP all-reduce and the tied
// embedding gradient) without a GPU. The CUDA backend is checked against the CPU in
// tests/gpu/gpu_model_test.cc.
#include "model/backend.h"

#include <random>
#include <thread>

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

// The CPU's numbers behind a backend that says it is a device, so that GPT2Stage stages through host
// copies as it does on a GPU.
class PretendDeviceBackend final : public Backend {
 public:
  std::string name() const override { return "pretend-device"; }
  bool is_cuda() const override { return true; }
  absl::StatusOr<void*> Allocate(size_t bytes) override { return cpu_.Allocate(bytes); }
  void Free(void* ptr) override { cpu_.Free(ptr); }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    ++copies_;
    return cpu_.CopyToDevice(dst, src, bytes);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    ++copies_;
    return cpu_.CopyToHost(dst, src, bytes);
  }
  void CopyOnDevice(void* dst, const void* src, size_t bytes) override { cpu_.CopyOnDevice(dst, src, bytes); }
  void Zero(void* ptr, size_t bytes) override { cpu_.Zero(ptr, bytes); }
  absl::Status Synchronize() override { return cpu_.Synchronize(); }
  void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T,
                       int C) override {
    cpu_.encoder_forward(out, inp, wte, wpe, B, T, C);
  }
  void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T, int C) override {
    cpu_.encoder_backward(dwte, dwpe, dout, inp, B, T, C);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                         int64_t N, int C) override {
    cpu_.layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* mean, const float* rstd, int64_t N, int C) override {
    cpu_.layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  }
  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C,
                      int OC) override {
    cpu_.matmul_forward(out, inp, weight, bias, N, C, OC);
  }
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int64_t N, int C, int OC, bool accumulate_dinp) override {
    cpu_.matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC, accumulate_dinp);
  }
  void add_bias(float* out, const float* bias, int64_t N, int OC) override { cpu_.add_bias(out, bias, N, OC); }
  void bias_backward(float* dbias, const float* dout, int64_t N, int OC) override {
    cpu_.bias_backward(dbias, dout, N, OC);
  }
  void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH) override {
    cpu_.attention_forward(out, lse, qkv, B, T, C, NH);
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                          int T, int C, int NH) override {
    cpu_.attention_backward(dqkv, dout, qkv, out, lse, B, T, C, NH);
  }
  void gelu_forward(float* out, const float* inp, int64_t N) override { cpu_.gelu_forward(out, inp, N); }
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t N) override {
    cpu_.gelu_backward(dinp, inp, dout, N);
  }
  void residual_forward(float* out, const float* a, const float* b, int64_t N) override {
    cpu_.residual_forward(out, a, b, N);
  }
  void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N, int V,
                            int Vp) override {
    cpu_.crossentropy_forward(losses, lse, logits, targets, N, V, Vp);
  }
  void crossentropy_backward_inplace(float* logits, const float* lse, const int32_t* targets, float dloss, int64_t N,
                                     int V, int Vp) override {
    cpu_.crossentropy_backward_inplace(logits, lse, targets, dloss, N, V, Vp);
  }
  void accumulate(float* out, const float* in, int64_t n) override { cpu_.accumulate(out, in, n); }
  void scale(float* x, int64_t n, float factor) override { cpu_.scale(x, n, factor); }
  absl::StatusOr<double> Sum(const float* x, int64_t n) override { return cpu_.Sum(x, n); }
  absl::StatusOr<double> SumSquares(const float* x, int64_t n) override { return cpu_.SumSquares(x, n); }
  void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float decay, float beta1,
                    float beta2, float eps, float grad_scale, float step_size, float bc2_sqrt) override {
    cpu_.adamw_update(params, grads, m, v, n, decay, beta1, beta2, eps, grad_scale, step_size, bc2_sqrt);
  }

  int copies() const { return copies_; }

 private:
  Backend& cpu_ = *CpuBackendInstance();
  int copies_ = 0;
};

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
      adams.push_back(
          std::make_unique<AdamW>((*stage)->num_params(), (*stage)->segments(), AdamWOptions{.weight_decay = 0.1f}));
    } else {
      adams.push_back(
          *AdamW::Create((*stage)->num_params(), (*stage)->segments(), {.weight_decay = 0.1f}, *backends[k]));
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

TEST(BackendTest, DevicePathsThroughHostStagingGiveTheCpuNumbers) {
  const std::vector<float> reference = Train(nullptr, nullptr);
  // Two "devices": imports, exports and the tied wte gradient go through host copies.
  PretendDeviceBackend first, last;
  EXPECT_EQ(Train(&first, &last), reference);
  EXPECT_GT(first.copies(), 0);
  EXPECT_GT(last.copies(), 0);
}

TEST(BackendTest, TensorParallelAllReduceStagedThroughTheHost) {
  const GPT2Config c = SmallConfig();
  std::mt19937 rng(4);
  std::vector<int32_t> x(2 * 8), y(2 * 8);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = rng() % c.vocab_size;
    y[i] = rng() % c.vocab_size;
  }
  // The same TP = 2 run on the CPU and on two pretend devices: the same numbers bit for bit.
  auto run = [&](Backend* r0, Backend* r1) {
    InProcessTensorParallelGroup group(2);
    Backend* backends[] = {r0, r1};
    std::vector<std::vector<float>> out(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r]() {
        StageOptions o;
        o.tp_comm = group.comm(r);
        o.backend = backends[r];
        auto s = GPT2Stage::Create(c, o);
        ASSERT_TRUE(s.ok()) << s.status();
        (*s)->InitializeWeights(8);
        (*s)->ZeroGrad();
        EXPECT_TRUE((*s)->Forward(2, 8, x.data(), nullptr, y.data()).ok());
        out[r].push_back((*s)->loss());
        EXPECT_TRUE((*s)->Backward(nullptr, 1.0f).ok());
        for (const std::string& name : (*s)->TensorNames()) {
          const std::vector<int64_t> shape = *(*s)->TensorShape(name);
          int64_t n = 1;
          for (int64_t d : shape) n *= d;
          std::vector<float> full(n);
          EXPECT_TRUE((*s)->ExportTensor(name, true, full.data()).ok());  // collective
          out[r].insert(out[r].end(), full.begin(), full.end());
        }
      });
    }
    for (auto& t : threads) t.join();
    return out;
  };
  PretendDeviceBackend d0, d1;
  EXPECT_EQ(run(&d0, &d1), run(nullptr, nullptr));
  EXPECT_GT(d0.copies(), 0);
}

}  // namespace
}  // namespace geotrain::model
