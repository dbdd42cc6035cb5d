// Every CUDA op of model/cuda/ops_cuda.h against its CPU twin (model/ops.h, model/optimizer.h and
// comm/codec.h's encoder), on fresh random inputs, including odd shapes (T not a multiple of 32, V != Vp,
// N = 1, head sizes that are not powers of two, grids larger than one sweep).
//
// What "close" means: per output tensor, relative error = max_i |gpu_i - cpu_i| / max(1e-6, max_i |cpu_i|).
// fp32 ops must stay under 1e-5; GEMMs in bf16 (inputs rounded to bf16, fp32 accumulation) under 1e-2.
// Codec packs must equal the CPU encoder's raw payload byte for byte.
// "Every element written": outputs an op overwrites are pre-filled with NaN on the device, and any NaN left
// fails the test. Outputs an op accumulates into are pre-filled with random values (the same on both sides),
// so a kernel that overwrote instead of adding would fail.
//
// Seeds: each run draws a fresh seed and prints it; GEOTRAIN_GPU_TEST_SEED=N reproduces a run. Without a
// CUDA device every test skips (run them on a GPU host with tests/gpu/run.sh).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/types/span.h"
#include "comm/codec.h"
#include "gtest/gtest.h"
#include "model/cuda/ops_cuda.h"
#include "model/gpt2.h"
#include "model/ops.h"
#include "model/optimizer.h"

namespace geotrain::model {
namespace {

constexpr double kFp32Tolerance = 1e-5;
constexpr double kBf16Tolerance = 1e-2;
constexpr double kRelativeFloor = 1e-6;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t RunSeed() {
  static const uint32_t seed = [] {
    const char* env = std::getenv("GEOTRAIN_GPU_TEST_SEED");
    const uint32_t s = env != nullptr ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10)) : std::random_device{}();
    std::printf("gpu_ops_test seed %u (GEOTRAIN_GPU_TEST_SEED=%u reproduces this run)\n", s, s);
    return s;
  }();
  return seed;
}

// Checks got (GPU) against want (CPU) as the file's header says.
void ExpectClose(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                 double tolerance) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double max_want = 0.0, max_error = 0.0;
  size_t worst = 0, unwritten = 0, first_unwritten = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) && !std::isnan(want[i])) {
      if (unwritten++ == 0) first_unwritten = i;
      continue;
    }
    max_want = std::max(max_want, std::fabs(static_cast<double>(want[i])));
    const double error = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (error > max_error) {
      max_error = error;
      worst = i;
    }
  }
  EXPECT_EQ(unwritten, 0u) << what << ": " << unwritten << " of " << got.size()
                           << " elements NaN on the GPU only (not written?), the first at " << first_unwritten;
  const double relative = max_error / std::max(kRelativeFloor, max_want);
  EXPECT_LT(relative, tolerance) << what << ": relative error " << relative << " at element " << worst << " (gpu "
                                 << got[worst] << ", cpu " << want[worst] << ", max |cpu| " << max_want << ")";
}

template <typename T>
void ExpectSameBytes(const std::string& what, const T* got, const uint8_t* want, size_t count) {
  const uint8_t* g = reinterpret_cast<const uint8_t*>(got);
  for (size_t i = 0; i < count * sizeof(T); ++i) {
    if (g[i] != want[i]) {
      T got_value, want_value;
      std::memcpy(&got_value, g + i / sizeof(T) * sizeof(T), sizeof(T));
      std::memcpy(&want_value, want + i / sizeof(T) * sizeof(T), sizeof(T));
      ADD_FAILURE() << what << ": element " << i / sizeof(T) << " of " << count << " differs: gpu " << +got_value
                    << ", cpu " << +want_value;
      return;
    }
  }
}

class GpuOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda::DeviceCount() == 0) {
      GTEST_SKIP() << "no CUDA device on this machine: GPU tests run on a GPU host via tests/gpu/run.sh";
    }
    auto ctx = cuda::CudaContext::Create(0, cuda::GemmPrecision::kFp32);
    ASSERT_TRUE(ctx.ok()) << ctx.status();
    ctx_ = std::move(*ctx);
    // Each test draws from its own stream (the run's seed and its name), so a test's inputs do not depend
    // on which tests ran before it.
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    rng_.seed(RunSeed() ^ static_cast<uint32_t>(std::hash<std::string>{}(name)));
  }

  void TearDown() override {
    if (ctx_ == nullptr) return;
    EXPECT_TRUE(ctx_->Synchronize().ok());
    for (void* ptr : allocations_) ctx_->Free(ptr);
  }

  std::vector<float> Random(size_t n, float scale = 1.0f, float mean = 0.0f) {
    std::normal_distribution<float> dist(mean, scale);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }

  std::vector<int32_t> Tokens(size_t n, int bound) {
    std::uniform_int_distribution<int32_t> dist(0, bound - 1);
    std::vector<int32_t> v(n);
    for (int32_t& x : v) x = dist(rng_);
    return v;
  }

  // A device copy of `host`, freed at the end of the test.
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    T* device = Scratch<T>(host.size());
    if (device != nullptr) EXPECT_TRUE(ctx_->CopyToDevice(device, host.data(), host.size() * sizeof(T)).ok());
    return device;
  }

  // An uninitialised device buffer of n elements, freed at the end of the test.
  template <typename T>
  T* Scratch(size_t n) {
    auto ptr = ctx_->Allocate(std::max<size_t>(1, n) * sizeof(T));
    EXPECT_TRUE(ptr.ok()) << ptr.status();
    if (!ptr.ok()) return nullptr;
    allocations_.push_back(*ptr);
    return static_cast<T*>(*ptr);
  }

  // A device buffer of n NaNs: for outputs the op must overwrite completely.
  float* NaNs(size_t n) { return Upload(std::vector<float>(n, kNaN)); }

  // Waits for the queued ops (failing the test on any CUDA error) and copies n elements back.
  template <typename T>
  std::vector<T> Download(const T* device, size_t n) {
    std::vector<T> host(n);
    const absl::Status status = ctx_->Synchronize();
    EXPECT_TRUE(status.ok()) << status;
    EXPECT_TRUE(ctx_->CopyToHost(host.data(), device, n * sizeof(T)).ok());
    return host;
  }

  std::unique_ptr<cuda::CudaContext> ctx_;
  std::mt19937 rng_;
  std::vector<void*> allocations_;
};

TEST_F(GpuOpsTest, DeviceDescription) {
  auto description = cuda::DeviceDescription(0);
  ASSERT_TRUE(description.ok()) << description.status();
  std::printf("device 0: %s\n", description->c_str());
  EXPECT_FALSE(cuda::DeviceDescription(cuda::DeviceCount()).ok());
  EXPECT_FALSE(cuda::CudaContext::Create(cuda::DeviceCount(), cuda::GemmPrecision::kFp32).ok());
}

TEST_F(GpuOpsTest, Encoder) {
  struct Shape {
    int B, T, C, Vp;
  };
  for (const Shape& s : {Shape{2, 37, 48, 11}, Shape{1, 1, 7, 3}, Shape{4, 64, 128, 50}}) {
    const std::string at = "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C);
    const size_t N = static_cast<size_t>(s.B) * s.T;
    const auto tokens = Tokens(N, s.Vp);  // a small vocabulary: tokens repeat, so dwte rows collide
    const auto wte = Random(static_cast<size_t>(s.Vp) * s.C), wpe = Random(static_cast<size_t>(s.T) * s.C);
    std::vector<float> out(N * s.C);
    encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), s.B, s.T, s.C);
    float* d_out = NaNs(out.size());
    const int32_t* d_tokens = Upload(tokens);
    cuda::encoder_forward(*ctx_, d_out, d_tokens, Upload(wte), Upload(wpe), s.B, s.T, s.C);
    ExpectClose("encoder_forward out " + at, Download(d_out, out.size()), out, kFp32Tolerance);

    const auto dout = Random(N * s.C);
    auto dwte = Random(wte.size()), dwpe = Random(wpe.size());  // accumulated into
    float* d_dwte = Upload(dwte);
    float* d_dwpe = Upload(dwpe);
    encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), s.B, s.T, s.C);
    cuda::encoder_backward(*ctx_, d_dwte, d_dwpe, Upload(dout), d_tokens, s.B, s.T, s.C);
    ExpectClose("encoder_backward dwte " + at, Download(d_dwte, dwte.size()), dwte, kFp32Tolerance);
    ExpectClose("encoder_backward dwpe " + at, Download(d_dwpe, dwpe.size()), dwpe, kFp32Tolerance);
  }
}

TEST_F(GpuOpsTest, LayerNorm) {
  struct Shape {
    int64_t N;
    int C;
  };
  // C = 6500 needs more than 48 KiB of shared memory in backward; N = 40000 rows with C = 8 is more rows
  // than one sweep of the grid (32 blocks of 8 rows per SM).
  for (const Shape& s : {Shape{1, 48}, Shape{77, 130}, Shape{64, 768}, Shape{5, 6500}, Shape{40000, 8}}) {
    const std::string at = "N=" + std::to_string(s.N) + " C=" + std::to_string(s.C);
    const size_t NC = static_cast<size_t>(s.N) * s.C;
    const auto inp = Random(NC, 2.0f, 3.0f);  // a mean far from 0, as residual streams have
    const auto weight = Random(s.C, 0.5f, 1.0f), bias = Random(s.C, 0.5f);
    std::vector<float> out(NC), mean(s.N), rstd(s.N);
    layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), s.N, s.C);
    float *d_out = NaNs(NC), *d_mean = NaNs(s.N), *d_rstd = NaNs(s.N);
    const float *d_inp = Upload(inp), *d_weight = Upload(weight);
    cuda::layernorm_forward(*ctx_, d_out, d_mean, d_rstd, d_inp, d_weight, Upload(bias), s.N, s.C);
    ExpectClose("layernorm_forward out " + at, Download(d_out, NC), out, kFp32Tolerance);
    ExpectClose("layernorm_forward mean " + at, Download(d_mean, s.N), mean, kFp32Tolerance);
    ExpectClose("layernorm_forward rstd " + at, Download(d_rstd, s.N), rstd, kFp32Tolerance);

    const auto dout = Random(NC);
    auto dinp = Random(NC), dweight = Random(s.C), dbias = Random(s.C);  // all three accumulate
    float *d_dinp = Upload(dinp), *d_dweight = Upload(dweight), *d_dbias = Upload(dbias);
    // Both sides use the CPU's mean and rstd, so that backward is checked on its own.
    layernorm_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(), mean.data(),
                       rstd.data(), s.N, s.C);
    cuda::layernorm_backward(*ctx_, d_dinp, d_dweight, d_dbias, Upload(dout), d_inp, d_weight, Upload(mean),
                             Upload(rstd), s.N, s.C);
    ExpectClose("layernorm_backward dinp " + at, Download(d_dinp, NC), dinp, kFp32Tolerance);
    ExpectClose("layernorm_backward dweight " + at, Download(d_dweight, s.C), dweight, kFp32Tolerance);
    ExpectClose("layernorm_backward dbias " + at, Download(d_dbias, s.C), dbias, kFp32Tolerance);
  }
}

struct GemmShape {
  int64_t N;
  int C, OC;
};
const GemmShape kGemmShapes[] = {{1, 5, 3}, {67, 96, 130}, {256, 768, 2304}, {33, 768, 50}};

std::string GemmName(const char* op, const GemmShape& s, cuda::GemmPrecision precision) {
  return std::string(op) + " N=" + std::to_string(s.N) + " C=" + std::to_string(s.C) + " OC=" + std::to_string(s.OC) +
         (precision == cuda::GemmPrecision::kBf16   ? " bf16"
          : precision == cuda::GemmPrecision::kFp16 ? " fp16"
                                                    : " fp32");
}

// The GEMM precisions device 0 runs: bf16 from compute capability 8.0 (Ampere) on, fp16 and fp32 everywhere.
std::vector<cuda::GemmPrecision> GemmPrecisions() {
  cudaDeviceProp prop;
  const bool bf16 = cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major >= 8;
  std::vector<cuda::GemmPrecision> out = {cuda::GemmPrecision::kFp32, cuda::GemmPrecision::kFp16};
  if (bf16) out.push_back(cuda::GemmPrecision::kBf16);
  return out;
}

TEST_F(GpuOpsTest, MatmulForward) {
  for (const auto precision : GemmPrecisions()) {
    ctx_->set_precision(precision);
    // fp16 keeps 3 more bits than bf16: the half-precision tolerance holds for both.
    const double tolerance = precision == cuda::GemmPrecision::kFp32 ? kFp32Tolerance : kBf16Tolerance;
    for (const GemmShape& s : kGemmShapes) {
      for (const bool with_bias : {true, false}) {
        const auto inp = Random(s.N * s.C), weight = Random(static_cast<size_t>(s.OC) * s.C, 0.05f);
        const auto bias = Random(s.OC);
        std::vector<float> out(s.N * s.OC);
        matmul_forward(out.data(), inp.data(), weight.data(), with_bias ? bias.data() : nullptr, s.N, s.C, s.OC);
        float* d_out = NaNs(out.size());
        cuda::matmul_forward(*ctx_, d_out, Upload(inp), Upload(weight), with_bias ? Upload(bias) : nullptr, s.N, s.C,
                             s.OC);
        ExpectClose(GemmName(with_bias ? "matmul_forward+bias" : "matmul_forward", s, precision),
                    Download(d_out, out.size()), out, tolerance);
      }
    }
  }
}

TEST_F(GpuOpsTest, MatmulBackward) {
  for (const auto precision : GemmPrecisions()) {
    ctx_->set_precision(precision);
    // fp16 keeps 3 more bits than bf16: the half-precision tolerance holds for both.
    const double tolerance = precision == cuda::GemmPrecision::kFp32 ? kFp32Tolerance : kBf16Tolerance;
    for (const GemmShape& s : kGemmShapes) {
      // (accumulate dinp, compute dinp, compute dbias)
      for (const auto [accumulate, with_dinp, with_dbias] :
           {std::tuple{false, true, true}, std::tuple{true, true, false}, std::tuple{false, false, true}}) {
        const std::string name = GemmName("matmul_backward", s, precision) +
                                 (accumulate ? " accumulate" : " overwrite") + (with_dinp ? "" : " no-dinp") +
                                 (with_dbias ? "" : " no-dbias");
        const auto dout = Random(s.N * s.OC), inp = Random(s.N * s.C);
        const auto weight = Random(static_cast<size_t>(s.OC) * s.C, 0.05f);
        auto dinp = accumulate ? Random(s.N * s.C) : std::vector<float>(s.N * s.C, 0.0f);
        auto dweight = Random(weight.size()), dbias = Random(s.OC);
        float* d_dinp = with_dinp ? (accumulate ? Upload(dinp) : NaNs(dinp.size())) : nullptr;
        float* d_dweight = Upload(dweight);
        float* d_dbias = with_dbias ? Upload(dbias) : nullptr;
        matmul_backward(with_dinp ? dinp.data() : nullptr, dweight.data(), with_dbias ? dbias.data() : nullptr,
                        dout.data(), inp.data(), weight.data(), s.N, s.C, s.OC, accumulate);
        cuda::matmul_backward(*ctx_, d_dinp, d_dweight, d_dbias, Upload(dout), Upload(inp), Upload(weight), s.N, s.C,
                              s.OC, accumulate);
        if (with_dinp) ExpectClose(name + " dinp", Download(d_dinp, dinp.size()), dinp, tolerance);
        ExpectClose(name + " dweight", Download(d_dweight, dweight.size()), dweight, tolerance);
        // The bias gradient is a plain fp32 column sum in either precision.
        if (with_dbias) ExpectClose(name + " dbias", Download(d_dbias, dbias.size()), dbias, kFp32Tolerance);
      }
    }
  }
}

TEST_F(GpuOpsTest, Bias) {
  struct Shape {
    int64_t N;
    int OC;
  };
  // N = 10000: bias_backward splits the rows over several blocks (atomics); OC = 33: a partial column tile.
  for (const Shape& s : {Shape{1, 7}, Shape{300, 70}, Shape{10000, 33}}) {
    const std::string at = "N=" + std::to_string(s.N) + " OC=" + std::to_string(s.OC);
    auto out = Random(s.N * s.OC);
    const auto bias = Random(s.OC);
    float* d_out = Upload(out);
    add_bias(out.data(), bias.data(), s.N, s.OC);
    cuda::add_bias(*ctx_, d_out, Upload(bias), s.N, s.OC);
    ExpectClose("add_bias " + at, Download(d_out, out.size()), out, kFp32Tolerance);

    const auto dout = Random(s.N * s.OC);
    auto dbias = Random(s.OC);
    float* d_dbias = Upload(dbias);
    bias_backward(dbias.data(), dout.data(), s.N, s.OC);
    cuda::bias_backward(*ctx_, d_dbias, Upload(dout), s.N, s.OC);
    ExpectClose("bias_backward " + at, Download(d_dbias, dbias.size()), dbias, kFp32Tolerance);
  }
}

TEST_F(GpuOpsTest, Attention) {
  struct Shape {
    int B, T, C, NH;
  };
  // Head sizes 12, 64, 96 and 128 (padded to 32, 64, 128, 128); T = 1, not multiples of 32, and long.
  for (const Shape& s : {Shape{2, 37, 48, 4}, Shape{1, 1, 64, 1}, Shape{2, 130, 128, 2}, Shape{1, 33, 96, 1},
                         Shape{1, 64, 256, 2}, Shape{1, 1024, 128, 2}, Shape{3, 200, 768, 12}}) {
    const std::string at = "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
                           " NH=" + std::to_string(s.NH);
    const size_t BT = static_cast<size_t>(s.B) * s.T;
    const size_t lse_size = static_cast<size_t>(s.B) * s.NH * s.T;
    const auto qkv = Random(BT * 3 * s.C);
    std::vector<float> out(BT * s.C), lse(lse_size);
    attention_forward(out.data(), lse.data(), qkv.data(), s.B, s.T, s.C, s.NH);
    float *d_out = NaNs(out.size()), *d_lse = NaNs(lse.size());
    const float* d_qkv = Upload(qkv);
    cuda::attention_forward(*ctx_, d_out, d_lse, d_qkv, s.B, s.T, s.C, s.NH);
    ExpectClose("attention_forward out " + at, Download(d_out, out.size()), out, kFp32Tolerance);
    ExpectClose("attention_forward lse " + at, Download(d_lse, lse.size()), lse, kFp32Tolerance);

    // Backward from the CPU's out and lse, into a NaN-filled dqkv (it must be overwritten everywhere).
    const auto dout = Random(out.size());
    std::vector<float> dqkv(qkv.size());
    attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T, s.C, s.NH);
    float* d_dqkv = NaNs(dqkv.size());
    cuda::attention_backward(*ctx_, d_dqkv, Upload(dout), d_qkv, Upload(out), Upload(lse), s.B, s.T, s.C, s.NH);
    ExpectClose("attention_backward dqkv " + at, Download(d_dqkv, dqkv.size()), dqkv, kFp32Tolerance);
  }
}

TEST_F(GpuOpsTest, AttentionRejectsHeadSizeAbove128) {
  const int B = 1, T = 4, C = 256, NH = 1;
  float* d_qkv = Upload(Random(static_cast<size_t>(B) * T * 3 * C));
  cuda::attention_forward(*ctx_, NaNs(B * T * C), NaNs(B * NH * T), d_qkv, B, T, C, NH);
  const absl::Status status = ctx_->Synchronize();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("attention_forward"), std::string::npos) << status;
  EXPECT_TRUE(ctx_->Synchronize().ok()) << "the error is reported once";
}

TEST_F(GpuOpsTest, GeluAndResidual) {
  // 5M elements: more than one sweep of the grid.
  for (const int64_t N : {int64_t{1}, int64_t{1000}, int64_t{5'000'000}}) {
    const std::string at = "N=" + std::to_string(N);
    const auto inp = Random(N, 3.0f);
    std::vector<float> out(N);
    gelu_forward(out.data(), inp.data(), N);
    float* d_out = NaNs(N);
    const float* d_inp = Upload(inp);
    cuda::gelu_forward(*ctx_, d_out, d_inp, N);
    ExpectClose("gelu_forward " + at, Download(d_out, N), out, kFp32Tolerance);

    // gelu_backward overwrites dinp, and dinp may alias dout: test it in place.
    auto grad = Random(N);
    float* d_grad = Upload(grad);
    gelu_backward(grad.data(), inp.data(), grad.data(), N);
    cuda::gelu_backward(*ctx_, d_grad, d_inp, d_grad, N);
    ExpectClose("gelu_backward (in place) " + at, Download(d_grad, N), grad, kFp32Tolerance);
    float* d_dinp = NaNs(N);
    const auto dout = Random(N);
    std::vector<float> dinp(N);
    gelu_backward(dinp.data(), inp.data(), dout.data(), N);
    cuda::gelu_backward(*ctx_, d_dinp, d_inp, Upload(dout), N);
    ExpectClose("gelu_backward " + at, Download(d_dinp, N), dinp, kFp32Tolerance);

    // residual_forward into a fresh buffer and in place (out aliases a).
    auto a = Random(N);
    const auto b = Random(N);
    float* d_a = Upload(a);
    const float* d_b = Upload(b);
    float* d_sum = NaNs(N);
    std::vector<float> sum(N);
    residual_forward(sum.data(), a.data(), b.data(), N);
    cuda::residual_forward(*ctx_, d_sum, d_a, d_b, N);
    ExpectClose("residual_forward " + at, Download(d_sum, N), sum, kFp32Tolerance);
    residual_forward(a.data(), a.data(), b.data(), N);
    cuda::residual_forward(*ctx_, d_a, d_a, d_b, N);
    ExpectClose("residual_forward (in place) " + at, Download(d_a, N), a, kFp32Tolerance);
  }
}

TEST_F(GpuOpsTest, CrossEntropy) {
  struct Shape {
    int64_t N;
    int V, Vp;
  };
  for (const Shape& s : {Shape{1, 5, 8}, Shape{70, 1000, 1024}, Shape{3, 50257, 50304}, Shape{9, 64, 64}}) {
    const std::string at = "N=" + std::to_string(s.N) + " V=" + std::to_string(s.V) + " Vp=" + std::to_string(s.Vp);
    auto logits = Random(s.N * s.Vp, 3.0f);
    // The padded columns never take part: NaN there must not reach the loss, and backward zeroes them.
    for (int64_t n = 0; n < s.N; ++n) {
      for (int i = s.V; i < s.Vp; ++i) logits[n * s.Vp + i] = kNaN;
    }
    const auto targets = Tokens(s.N, s.V);
    std::vector<float> losses(s.N), lse(s.N);
    crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), s.N, s.V, s.Vp);
    float *d_losses = NaNs(s.N), *d_lse = NaNs(s.N), *d_logits = Upload(logits);
    const int32_t* d_targets = Upload(targets);
    cuda::crossentropy_forward(*ctx_, d_losses, d_lse, d_logits, d_targets, s.N, s.V, s.Vp);
    ExpectClose("crossentropy_forward losses " + at, Download(d_losses, s.N), losses, kFp32Tolerance);
    ExpectClose("crossentropy_forward lse " + at, Download(d_lse, s.N), lse, kFp32Tolerance);

    const float dloss = 1.0f / static_cast<float>(s.N);
    crossentropy_backward_inplace(logits.data(), lse.data(), targets.data(), dloss, s.N, s.V, s.Vp);
    cuda::crossentropy_backward_inplace(*ctx_, d_logits, Upload(lse), d_targets, dloss, s.N, s.V, s.Vp);
    ExpectClose("crossentropy_backward_inplace " + at, Download(d_logits, logits.size()), logits, kFp32Tolerance);
  }
}

TEST_F(GpuOpsTest, AccumulateScaleAndSums) {
  for (const int64_t n : {int64_t{1}, int64_t{1000}, int64_t{3'000'001}}) {
    const std::string at = "n=" + std::to_string(n);
    auto out = Random(n);
    const auto in = Random(n);
    float* d_out = Upload(out);
    cuda::accumulate(*ctx_, d_out, Upload(in), n);
    for (int64_t i = 0; i < n; ++i) out[i] += in[i];
    ExpectClose("accumulate " + at, Download(d_out, n), out, kFp32Tolerance);
    cuda::scale(*ctx_, d_out, n, 0.37f);
    for (float& x : out) x *= 0.37f;
    ExpectClose("scale " + at, Download(d_out, n), out, kFp32Tolerance);

    double sum = 0.0, squares = 0.0, magnitude = 0.0;
    for (const float x : out) {
      sum += x;
      squares += static_cast<double>(x) * x;
      magnitude += std::fabs(x);
    }
    auto gpu_sum = cuda::Sum(*ctx_, d_out, n);
    auto gpu_squares = cuda::SumSquares(*ctx_, d_out, n);
    ASSERT_TRUE(gpu_sum.ok()) << gpu_sum.status();
    ASSERT_TRUE(gpu_squares.ok()) << gpu_squares.status();
    // Both sides add doubles, in different orders: relative to the sum of magnitudes, far below 1e-12.
    EXPECT_NEAR(*gpu_sum, sum, 1e-12 * magnitude) << "Sum " << at;
    EXPECT_NEAR(*gpu_squares, squares, 1e-12 * squares) << "SumSquares " << at;
  }
}

TEST_F(GpuOpsTest, AdamW) {
  // Two segments, with and without weight decay, of odd sizes; several steps with fresh gradients.
  const std::vector<ParameterSegment> segments = {{0, 1000, true, false}, {1000, 333, false, false}};
  const int64_t n = 1333;
  const AdamWOptions options{.beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  AdamW cpu(n, segments, options);
  auto params = Random(n);
  float* d_params = Upload(params);
  float* d_m = Upload(std::vector<float>(n, 0.0f));
  float* d_v = Upload(std::vector<float>(n, 0.0f));
  for (int step = 1; step <= 5; ++step) {
    const auto grads = Random(n, 0.1f);
    const float lr = 6e-4f * static_cast<float>(step), grad_scale = step == 3 ? 0.5f : 1.0f;
    const float* d_grads = Upload(grads);
    cpu.Step(params.data(), grads.data(), lr, grad_scale);
    // The step constants as model::AdamW computes them.
    const double bias_correction1 = 1.0 - std::pow(static_cast<double>(options.beta1), step);
    const double bias_correction2 = 1.0 - std::pow(static_cast<double>(options.beta2), step);
    const float step_size = static_cast<float>(lr / bias_correction1);
    const float bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
    for (const ParameterSegment& seg : segments) {
      const float decay = seg.weight_decay ? 1.0f - lr * options.weight_decay : 1.0f;
      cuda::adamw_update(*ctx_, d_params + seg.offset, d_grads + seg.offset, d_m + seg.offset, d_v + seg.offset,
                         seg.count, decay, options.beta1, options.beta2, options.eps, grad_scale, step_size, bc2_sqrt);
    }
    const std::string at = " after step " + std::to_string(step);
    ExpectClose("adamw params" + at, Download(d_params, n), params, kFp32Tolerance);
    std::vector<float> cpu_m, cpu_v;
    ASSERT_TRUE(cpu.CopyMomentsToHost(&cpu_m, &cpu_v).ok());
    ExpectClose("adamw m" + at, Download(d_m, n), cpu_m, kFp32Tolerance);
    ExpectClose("adamw v" + at, Download(d_v, n), cpu_v, kFp32Tolerance);
  }
}

// ---- Codecs. ----

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Random values with the cases rounding gets wrong: signed zeros, infinities, NaNs whose payload every
// encoder (scalar, F16C, AVX-512) maps alike, fp32 subnormals, fp16 subnormals and overflow, bf16 and fp16
// ties (halfway bit patterns).
std::vector<float> CodecInputs(std::mt19937& rng, size_t n, bool finite_only) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<uint32_t> bits(0, 0xFFFFu);
  std::vector<float> special = {0.0f,
                                -0.0f,
                                1e-40f,
                                -1e-40f,
                                6e-8f,
                                3e-8f,
                                1e-6f,
                                -3.0e-5f,
                                6.1e-5f,
                                65504.0f,
                                65519.0f,
                                65520.0f,
                                -70000.0f,
                                1e30f,
                                1.0f,
                                -2.5f,
                                FromBits(0x3F808000u),
                                FromBits(0x3F818000u),
                                FromBits(0xBF808000u),  // bf16 ties
                                FromBits(0x3F801000u),
                                FromBits(0x3F803000u)};  // fp16 ties
  if (!finite_only) {
    for (const uint32_t b : {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0x7FC00001u}) {
      special.push_back(FromBits(b));
    }
  }
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    const int kind = static_cast<int>(rng() % 4);
    if (kind == 0) {
      v[i] = special[rng() % special.size()];
    } else if (kind == 1) {  // a float whose low 16 bits are random: all the bf16 rounding cases
      v[i] = FromBits((std::bit_cast<uint32_t>(normal(rng)) & 0xFFFF0000u) | bits(rng));
    } else {
      v[i] = normal(rng) * (kind == 2 ? 1.0f : 1e-3f);
    }
  }
  return v;
}

// The raw payload the CPU encoder writes for `input`.
std::vector<uint8_t> CpuPayload(comm::CodecKind kind, const std::vector<float>& input) {
  comm::Codec codec;
  codec.kind = kind;
  comm::Bytes encoded;
  const absl::Status status = comm::EncodeTensor(codec, input, &encoded);
  EXPECT_TRUE(status.ok()) << status;
  if (!status.ok()) return {};
  return std::vector<uint8_t>(encoded.data() + comm::kCodecHeaderBytes, encoded.data() + encoded.size());
}

// The CPU decoder's output for an encoded payload of `kind` (header rebuilt by EncodeTensor on `input`).
std::vector<float> CpuDecode(comm::CodecKind kind, const std::vector<float>& input) {
  comm::Codec codec;
  codec.kind = kind;
  comm::Bytes encoded;
  EXPECT_TRUE(comm::EncodeTensor(codec, input, &encoded).ok());
  std::vector<float> out(input.size());
  const absl::Status status = comm::DecodeTensor(encoded.span(), absl::MakeSpan(out));
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

// Decoded values must match bit for bit, except that a NaN only has to stay a NaN.
void ExpectSameDecoded(const std::string& what, const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool same =
        std::isnan(want[i]) ? std::isnan(got[i]) : std::bit_cast<uint32_t>(got[i]) == std::bit_cast<uint32_t>(want[i]);
    if (!same) {
      ADD_FAILURE() << what << ": element " << i << " decodes to " << got[i] << " on the GPU, " << want[i]
                    << " on the CPU";
      return;
    }
  }
}

class GpuCodecTest : public GpuOpsTest {
 protected:
  void TearDown() override {
    comm::ForceScalarCodecs(false);
    GpuOpsTest::TearDown();
  }

  // Packs on the GPU and compares with the CPU's payload; then unpacks the CPU payload on the GPU and
  // compares with the CPU decoder.
  void CheckHalfCodec(comm::CodecKind kind, size_t n, bool finite_only) {
    const bool bf16 = kind == comm::CodecKind::kBf16;
    const std::string what = std::string(bf16 ? "bf16" : "fp16") + " n=" + std::to_string(n) + " (" +
                             std::string(comm::CodecIsa()) + " CPU loops)";
    const auto input = CodecInputs(rng_, n, finite_only);
    const auto payload = CpuPayload(kind, input);
    ASSERT_EQ(payload.size(), n * 2) << what;
    auto* d_packed = Scratch<uint16_t>(n);
    const float* d_input = Upload(input);
    if (bf16) {
      cuda::pack_bf16(*ctx_, d_packed, d_input, static_cast<int64_t>(n));
    } else {
      cuda::pack_fp16(*ctx_, d_packed, d_input, static_cast<int64_t>(n));
    }
    const auto packed = Download(d_packed, n);
    ExpectSameBytes("pack " + what, packed.data(), payload.data(), n);

    std::vector<uint16_t> cpu_packed(n);
    std::memcpy(cpu_packed.data(), payload.data(), n * 2);
    float* d_unpacked = NaNs(n);
    if (bf16) {
      cuda::unpack_bf16(*ctx_, d_unpacked, Upload(cpu_packed), static_cast<int64_t>(n));
    } else {
      cuda::unpack_fp16(*ctx_, d_unpacked, Upload(cpu_packed), static_cast<int64_t>(n));
    }
    ExpectSameDecoded("unpack " + what, Download(d_unpacked, n), CpuDecode(kind, input));
  }
};

TEST_F(GpuCodecTest, Bf16AndFp16MatchTheCpuEncoder) {
  for (const bool scalar : {false, true}) {
    comm::ForceScalarCodecs(scalar);
    for (const size_t n : {size_t{1}, size_t{17}, size_t{4096}, size_t{1'000'003}}) {
      CheckHalfCodec(comm::CodecKind::kBf16, n, /*finite_only=*/false);
      CheckHalfCodec(comm::CodecKind::kFp16, n, /*finite_only=*/false);
    }
  }
}

TEST_F(GpuCodecTest, Fp16NaNPayloadsMatchTheScalarEncoder) {
  // The scalar encoder maps every NaN to 0x7E00 (with its sign), as the GPU does; the F16C instruction keeps
  // the top of the payload instead, so this case is compared with the scalar loops only.
  comm::ForceScalarCodecs(true);
  const std::vector<float> input = {FromBits(0x7FFFFFFFu), FromBits(0xFFFFE000u), FromBits(0x7FA00000u),
                                    FromBits(0x7F802000u)};
  const auto payload = CpuPayload(comm::CodecKind::kFp16, input);
  auto* d_packed = Scratch<uint16_t>(input.size());
  cuda::pack_fp16(*ctx_, d_packed, Upload(input), static_cast<int64_t>(input.size()));
  ExpectSameBytes("pack fp16 NaN payloads", Download(d_packed, input.size()).data(), payload.data(), input.size());
}

TEST_F(GpuCodecTest, Int8MatchesTheCpuEncoder) {
  for (const bool scalar : {false, true}) {
    comm::ForceScalarCodecs(scalar);
    // Partial last blocks, a single element, an all-zero block, and exact rounding ties (a block whose
    // max is 127 has inverse scale 1, so x.5 values are ties).
    for (const size_t n : {size_t{1}, size_t{255}, size_t{256}, size_t{257}, size_t{1000}, size_t{70001}}) {
      const std::string what = "int8 n=" + std::to_string(n) + " (" + std::string(comm::CodecIsa()) + " CPU loops)";
      auto input = CodecInputs(rng_, n, /*finite_only=*/true);
      if (n >= 512) {
        for (size_t i = 0; i < 256; ++i) input[i] = 0.0f;
        const float ties[] = {127.0f, 2.5f, -3.5f, 0.5f, -0.5f, 126.5f, 1.5f};
        for (size_t i = 0; i < 256; ++i) input[256 + i] = ties[i % 7];
      }
      const size_t blocks = (n + comm::kInt8BlockSize - 1) / comm::kInt8BlockSize;
      const auto payload = CpuPayload(comm::CodecKind::kInt8, input);
      ASSERT_EQ(payload.size(), blocks * 4 + n) << what;
      auto* d_scales = Scratch<float>(blocks);
      auto* d_q = Scratch<int8_t>(n);
      cuda::pack_int8(*ctx_, d_scales, d_q, Upload(input), static_cast<int64_t>(n));
      ExpectSameBytes("pack scales " + what, Download(d_scales, blocks).data(), payload.data(), blocks);
      ExpectSameBytes("pack q " + what, Download(d_q, n).data(), payload.data() + blocks * 4, n);

      std::vector<float> cpu_scales(blocks);
      std::vector<int8_t> cpu_q(n);
      std::memcpy(cpu_scales.data(), payload.data(), blocks * 4);
      std::memcpy(cpu_q.data(), payload.data() + blocks * 4, n);
      float* d_out = NaNs(n);
      cuda::unpack_int8(*ctx_, d_out, Upload(cpu_scales), Upload(cpu_q), static_cast<int64_t>(n));
      ExpectSameDecoded("unpack " + what, Download(d_out, n), CpuDecode(comm::CodecKind::kInt8, input));
    }
  }
}

}  // namespace
}  // namespace geotrain::model
