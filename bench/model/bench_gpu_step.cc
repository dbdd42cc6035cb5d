// One GPT-2 training step (forward, backward, gradient norm and clipping, AdamW) on one CUDA GPU through
// the CUDA backend, bf16 GEMMs by default: tokens/s, model FLOPs per token and MFU against the device's
// dense bf16 peak. Warm-up steps, then the median of --steps (>= 20) steps timed with CUDA events on the
// backend's stream.
//
//   bench_gpu_step                              # GPT-2 124M, T = 1024, B chosen to fill the GPU
//   bench_gpu_step --batch 16 --out gpu.jsonl   # appends one JSON line
//
// Model FLOPs per token = 6 N + 6 L C T (GPT2Config::TrainingFlopsPerToken, llm.c's count: N parameters
// with the padded vocabulary, the attention term for causal attention). MFU = tokens/s x FLOPs per token
// / peak. Peaks (dense bf16, TFLOP/s) come from a table of known devices (H100 SXM and H200 989, H100
// PCIe 756, A100 312, L40S 362); --peak-tflops gives or overrides it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_util.h"
#include "model/backend.h"
#include "model/config.h"
#include "model/cuda/ops_cuda.h"
#include "model/cuda_backend.h"
#include "model/gpt2.h"
#include "model/optimizer.h"

namespace geotrain::model {
namespace {

// Dense bf16 tensor-core peak of known devices by (a piece of) their CUDA name; 0 when unknown.
double KnownPeakTflops(const std::string& device_name) {
  auto has = [&](const char* piece) { return device_name.find(piece) != std::string::npos; };
  if (has("H200")) return 989;
  if (has("H100") && has("PCIe")) return 756;
  if (has("H100") && !has("NVL")) return 989;  // SXM ("NVIDIA H100 80GB HBM3")
  if (has("A100")) return 312;
  if (has("L40S")) return 362;
  return 0;
}

// Device bytes one sequence of T tokens needs: the stage's activations and backward scratch (as
// GPT2Stage lays them out) and the bf16 GEMM workspace, which at most holds the (T, Vp) logits gradient
// and the GEMM's other operand.
double BytesPerSequence(const GPT2Config& c, int T) {
  const double C = c.n_embd, L = c.n_layer, NH = c.n_head, Vp = c.padded_vocab_size;
  const double per_layer = C + 2 + 3 * C + C + NH + C + C + 2 + 4 * C + 4 * C + C;
  const double activations = C + L * per_layer + C + 2 + Vp + 2;
  const double scratch = 3 * C + 3 * C + C + 4 * C;
  const double workspace = 2.0 * (Vp + 4 * C);
  return T * (4.0 * (activations + scratch) + workspace);
}

struct StepResult {
  absl::Status status;
  float loss = 0.0f;
  double seconds = 0.0;
};

// One timed step; the events bracket every op of the step on the backend's stream.
StepResult TimedStep(GPT2Stage& model, AdamW& adam, cuda::CudaContext& ctx, cudaEvent_t start, cudaEvent_t stop,
                     const std::vector<int32_t>& x, const std::vector<int32_t>& y, int B, int T) {
  StepResult r;
  cudaEventRecord(start, ctx.stream());
  model.ZeroGrad();
  r.status = model.Forward(B, T, x.data(), nullptr, y.data());
  if (r.status.ok()) r.status = model.Backward(nullptr, 1.0f);
  if (!r.status.ok()) return r;
  const double norm = std::sqrt(model.GradSquaredNormShare());
  adam.Step(model.params(), model.grads(), 1e-4f, ClipScale(norm, 1.0));
  cudaEventRecord(stop, ctx.stream());
  r.status = model.backend().Synchronize();
  if (!r.status.ok()) return r;
  if (!std::isfinite(norm)) {
    r.status = absl::InternalError("the gradient norm is not finite");
    return r;
  }
  float ms = 0.0f;
  cudaEventSynchronize(stop);
  cudaEventElapsedTime(&ms, start, stop);
  r.loss = model.loss();
  r.seconds = ms / 1000.0;
  return r;
}

int Run(int argc, char** argv) {
  CLI::App app{"GPT-2 training step on one CUDA GPU (bf16 GEMMs): tokens/s and MFU"};
  std::string preset = "gpt2", precision_name = "bf16", out;
  int B = 0, T = 1024, steps = 20, warmup = 3, device = 0;
  double peak_tflops = 0.0;
  app.add_option("--preset", preset, "model preset (gpt2 is the 124M model)");
  app.add_option("--batch", B, "sequences per step; 0 chooses the largest that fits the GPU's free memory");
  app.add_option("--seq", T, "tokens per sequence");
  app.add_option("--steps", steps, "timed steps (the median is reported)")->check(CLI::Range(20, 100000));
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--precision", precision_name, "GEMM precision")->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_option("--device", device, "CUDA device index");
  app.add_option("--peak-tflops", peak_tflops, "dense peak TFLOP/s for MFU (default: known-device table)");
  app.add_option("--out", out, "append one JSON line with the results to this file");
  CLI11_PARSE(app, argc, argv);

  if (cuda::DeviceCount() == 0) {
    std::fprintf(stderr,
                 "bench_gpu_step: no CUDA device visible (no driver or no GPU; check nvidia-smi and "
                 "CUDA_VISIBLE_DEVICES); this benchmark needs a GPU, bench/model/train_step_bench measures the CPU\n");
    return 2;
  }
  absl::StatusOr<GPT2Config> preset_config = GPT2Config::FromPreset(preset);
  if (!preset_config.ok()) {
    std::fprintf(stderr, "bench_gpu_step: %s\n", std::string(preset_config.status().message()).c_str());
    return 1;
  }
  GPT2Config c = *preset_config;
  if (T > c.block_size) {
    std::fprintf(stderr, "bench_gpu_step: --seq %d exceeds %s's block size %d\n", T, preset.c_str(), c.block_size);
    return 1;
  }
  const Precision precision = precision_name == "bf16" ? Precision::kBf16 : Precision::kFp32;
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackend(absl::StrCat("cuda:", device), precision);
  if (!backend.ok()) {
    std::fprintf(stderr, "bench_gpu_step: %s\n", std::string(backend.status().message()).c_str());
    return 1;
  }
  cuda::CudaContext& ctx = *CudaContextOf(**backend);
  absl::StatusOr<std::string> description = cuda::DeviceDescription(device);
  const std::string device_name = description.ok() ? description->substr(0, description->find(',')) : "unknown";
  if (peak_tflops <= 0.0) peak_tflops = KnownPeakTflops(device_name);

  // Batch: parameters, gradients and AdamW moments (16 bytes per parameter) first, then as many
  // sequences as fit in 85% of the rest.
  size_t free_bytes = 0, total_bytes = 0;
  cudaSetDevice(device);
  cudaMemGetInfo(&free_bytes, &total_bytes);
  const bool auto_batch = B <= 0;
  if (auto_batch) {
    const double fixed = 16.0 * c.NumParameters() + 2.0 * c.NumParameters();  // + bf16 weight copies
    B = std::max(1, static_cast<int>(0.85 * (free_bytes - fixed) / BytesPerSequence(c, T)));
  }

  std::unique_ptr<GPT2Stage> model;
  std::unique_ptr<AdamW> adam;
  std::vector<int32_t> x, y;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> seconds;
  float last_loss = 0.0f;
  // With an automatic batch, an out-of-memory first step halves B and starts again.
  for (;;) {
    StageOptions o;
    o.backend = backend->get();
    o.max_batch = B;
    o.max_seq_len = T;
    adam.reset();
    model.reset();
    absl::StatusOr<std::unique_ptr<GPT2Stage>> created = GPT2Stage::Create(c, o);
    absl::Status status = created.status();
    if (status.ok()) {
      model = std::move(*created);
      model->InitializeWeights(1);
      absl::StatusOr<std::unique_ptr<AdamW>> a =
          AdamW::Create(model->num_params(), model->segments(), {.weight_decay = 0.1f}, **backend);
      status = a.status();
      if (a.ok()) adam = std::move(*a);
    }
    if (status.ok()) {
      std::mt19937 rng(1);
      x.resize(static_cast<size_t>(B) * T);
      y.resize(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        x[i] = rng() % c.vocab_size;
        y[i] = rng() % c.vocab_size;
      }
      status = TimedStep(*model, *adam, ctx, start, stop, x, y, B, T).status;
    }
    if (status.ok()) break;
    if (auto_batch && status.code() == absl::StatusCode::kResourceExhausted && B > 1) {
      std::printf("batch %d does not fit (%s); trying %d\n", B, std::string(status.message()).c_str(), B / 2);
      B /= 2;
      continue;
    }
    std::fprintf(stderr, "bench_gpu_step: %s\n", std::string(status.message()).c_str());
    return 1;
  }

  const double flops_per_token = c.TrainingFlopsPerToken(T);
  std::printf("device %s (%s), %s GEMMs, model %s (%lld parameters), B=%d T=%d (%s), %.1f GiB free of %.1f\n",
              device_name.c_str(), (*backend)->name().c_str(), precision_name.c_str(), preset.c_str(),
              static_cast<long long>(c.NumParameters()), B, T, auto_batch ? "chosen by memory" : "--batch",
              free_bytes / 1073741824.0, total_bytes / 1073741824.0);
  for (int step = 0; step < warmup + steps; ++step) {
    StepResult r = TimedStep(*model, *adam, ctx, start, stop, x, y, B, T);
    if (!r.status.ok()) {
      std::fprintf(stderr, "bench_gpu_step: step %d: %s\n", step, std::string(r.status.message()).c_str());
      return 1;
    }
    last_loss = r.loss;
    std::printf("step %d loss %.4f time %.4f s tokens/s %.0f%s\n", step, r.loss, r.seconds, B * T / r.seconds,
                step < warmup ? " (warm-up)" : "");
    if (step >= warmup) seconds.push_back(r.seconds);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);

  const double median_s = bench::Median(seconds);
  const double tokens_per_s = B * T / median_s;
  const double achieved_tflops = tokens_per_s * flops_per_token / 1e12;
  const double mfu = peak_tflops > 0.0 ? achieved_tflops / peak_tflops : NAN;
  std::printf("median step %.4f s over %d steps: %.0f tokens/s\n", median_s, steps, tokens_per_s);
  std::printf("model FLOPs per token %.4g (6N + 6LCT: N=%lld, L=%d, C=%d, T=%d): %.1f TFLOP/s\n", flops_per_token,
              static_cast<long long>(c.NumParameters()), c.n_layer, c.n_embd, T, achieved_tflops);
  if (peak_tflops > 0.0) {
    std::printf("MFU %.1f%% of %.0f TFLOP/s dense %s peak\n", 100.0 * mfu, peak_tflops, "bf16");
  } else {
    std::printf("MFU unknown: '%s' is not in the peak table; pass --peak-tflops\n", device_name.c_str());
  }
  if (!out.empty()) {
    std::FILE* f = std::fopen(out.c_str(), "a");
    if (f == nullptr) {
      std::fprintf(stderr, "bench_gpu_step: cannot open %s for appending\n", out.c_str());
      return 1;
    }
    std::fprintf(f,
                 "{\"bench\": \"gpu_step\", \"device\": \"%s\", \"precision\": \"%s\", \"model\": \"%s\", "
                 "\"params\": %lld, \"batch\": %d, \"seq_len\": %d, \"steps\": %d, \"median_step_s\": %.6f, "
                 "\"tokens_per_s\": %.1f, \"flops_per_token\": %.6g, \"achieved_tflops\": %.3f, "
                 "\"peak_tflops\": %.1f, \"mfu\": %s, \"last_loss\": %.4f, \"load_average\": \"%s\"}\n",
                 device_name.c_str(), precision_name.c_str(), preset.c_str(), static_cast<long long>(c.NumParameters()),
                 B, T, steps, median_s, tokens_per_s, flops_per_token, achieved_tflops, peak_tflops,
                 peak_tflops > 0.0 ? absl::StrFormat("%.4f", mfu).c_str() : "null", last_loss,
                 bench::LoadAverage().c_str());
    std::fclose(f);
  }
  return 0;
}

}  // namespace
}  // namespace geotrain::model

int main(int argc, char** argv) { return geotrain::model::Run(argc, argv); }
