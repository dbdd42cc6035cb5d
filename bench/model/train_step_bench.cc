// Training-step throughput of the CPU GPT-2: forward, backward, clipping and AdamW on random tokens.
// Prints one line per measured step and a final `tokens_per_s <median>` line that
// bench/model/compare_pytorch.py reads. Threads come from OMP_NUM_THREADS.
//
//   train_step_bench --preset gpt2 --batch 4 --seq 256 --steps 3 --warmup 1
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>

#include "CLI/CLI.hpp"
#include "model/config.h"
#include "model/gpt2.h"
#include "model/optimizer.h"

int main(int argc, char** argv) {
  CLI::App app{"GPT-2 CPU training-step benchmark"};
  std::string preset = "gpt2";
  int n_layer = 0, n_head = 0, n_embd = 0, vocab = 0, B = 4, T = 256, steps = 3, warmup = 1;
  app.add_option("--preset", preset);
  app.add_option("--n_layer", n_layer);
  app.add_option("--n_head", n_head);
  app.add_option("--n_embd", n_embd);
  app.add_option("--vocab", vocab);
  app.add_option("--batch", B);
  app.add_option("--seq", T);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  CLI11_PARSE(app, argc, argv);

  auto preset_config = geotrain::GPT2Config::FromPreset(preset);
  if (!preset_config.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(preset_config.status().message()).c_str());
    return 1;
  }
  geotrain::GPT2Config c = *preset_config;
  if (n_layer) c.n_layer = n_layer;
  if (n_head) c.n_head = n_head;
  if (n_embd) c.n_embd = n_embd;
  if (vocab) c.vocab_size = vocab;
  c.block_size = std::max(c.block_size, T);
  if (!c.Validate().ok()) return 1;
  geotrain::model::StageOptions o;
  o.max_batch = B;
  o.max_seq_len = T;
  auto model_or = geotrain::model::GPT2Stage::Create(c, o);
  if (!model_or.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(model_or.status().message()).c_str());
    return 1;
  }
  auto& model = **model_or;
  model.InitializeWeights(1);
  geotrain::model::AdamW adam(model.num_params(), model.segments(), {.weight_decay = 0.1f});
  std::mt19937 rng(1);
  std::vector<int32_t> x(B * T), y(B * T);
  for (int i = 0; i < B * T; ++i) {
    x[i] = rng() % c.vocab_size;
    y[i] = rng() % c.vocab_size;
  }
  std::printf("model L=%d NH=%d C=%d V=%d params=%lld B=%d T=%d threads=%d flops/token=%.4g\n", c.n_layer, c.n_head,
              c.n_embd, c.vocab_size, static_cast<long long>(c.NumParameters()), B, T, omp_get_max_threads(),
              c.TrainingFlopsPerToken(T));
  std::vector<double> rates;
  for (int step = 0; step < warmup + steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    model.ZeroGrad();
    if (!model.Forward(B, T, x.data(), nullptr, y.data()).ok()) return 1;
    if (!model.Backward(nullptr, 1.0f).ok()) return 1;
    const double norm = std::sqrt(model.GradSquaredNormShare());
    adam.Step(model.params(), model.grads(), 1e-4f, geotrain::model::ClipScale(norm, 1.0));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("step %d loss %.4f time %.3f s tokens/s %.1f%s\n", step, model.loss(), s, B * T / s,
                step < warmup ? " (warm-up)" : "");
    std::fflush(stdout);
    if (step >= warmup) rates.push_back(B * T / s);
  }
  std::sort(rates.begin(), rates.end());
  std::printf("tokens_per_s %.2f\n", rates[rates.size() / 2]);
  return 0;
}
