// The whole model: deterministic init, gradients against finite differences, pipeline stages and
// tensor-parallel shards against the unsplit model, gradient accumulation, AdamW and the schedule.
#include "model/gpt2.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "model/optimizer.h"

namespace geotrain::model {
namespace {

GPT2Config TinyConfig() {
  GPT2Config c;
  c.n_layer = 3;
  c.n_head = 4;
  c.n_embd = 16;
  c.block_size = 8;
  c.vocab_size = 50;
  EXPECT_TRUE(c.Validate().ok());
  return c;
}

struct Batch {
  int B = 2, T = 7;
  std::vector<int32_t> tokens, targets;
};

Batch MakeBatch(const GPT2Config& c, uint32_t seed, int B = 2, int T = 7) {
  Batch b;
  b.B = B;
  b.T = T;
  std::mt19937 rng(seed);
  for (int i = 0; i < B * T; ++i) {
    b.tokens.push_back(rng() % c.vocab_size);
    b.targets.push_back(rng() % c.vocab_size);
  }
  return b;
}

std::unique_ptr<GPT2Stage> Make(const GPT2Config& c, StageOptions o = {}, uint64_t seed = 7) {
  auto stage = GPT2Stage::Create(c, o);
  EXPECT_TRUE(stage.ok()) << stage.status();
  (*stage)->InitializeWeights(seed);
  (*stage)->ZeroGrad();
  return std::move(*stage);
}

std::vector<float> Export(GPT2Stage& s, const std::string& name, bool grads) {
  auto shape = s.TensorShape(name);
  EXPECT_TRUE(shape.ok());
  int64_t n = 1;
  for (int64_t d : *shape) n *= d;
  std::vector<float> out(n);
  EXPECT_TRUE(s.ExportTensor(name, grads, out.data()).ok());
  return out;
}

float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0.0f;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

TEST(GPT2Test, InitIsDeterministicAndFollowsGpt2) {
  GPT2Config c = TinyConfig();
  auto a = Make(c, {}, 1), b = Make(c, {}, 1), d = Make(c, {}, 2);
  ASSERT_EQ(a->num_params(), c.NumParameters());
  EXPECT_TRUE(std::equal(a->params(), a->params() + a->num_params(), b->params()));
  EXPECT_FALSE(std::equal(a->params(), a->params() + a->num_params(), d->params()));
  // LayerNorm weights 1, biases 0, padded wte rows 0, residual projections have the smaller scale.
  EXPECT_EQ(a->param_tensors().ln1w[0], 1.0f);
  EXPECT_EQ(a->param_tensors().qkvb[0], 0.0f);
  EXPECT_EQ(a->param_tensors().wte[static_cast<int64_t>(c.vocab_size) * c.n_embd], 0.0f);
  auto stddev = [](const float* p, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(p[i]) * p[i];
    return std::sqrt(s / n);
  };
  const int C = c.n_embd;
  EXPECT_NEAR(stddev(a->param_tensors().fcw, 4 * C * C * c.n_layer), 0.02, 0.002);
  EXPECT_NEAR(stddev(a->param_tensors().fcprojw, 4 * C * C * c.n_layer), 0.02 / std::sqrt(2.0 * c.n_layer), 0.002);
}

TEST(GPT2Test, LossGradientMatchesFiniteDifferences) {
  GPT2Config c = TinyConfig();
  auto m = Make(c);
  Batch b = MakeBatch(c, 3);
  ASSERT_TRUE(m->Forward(b.B, b.T, b.tokens.data(), nullptr, b.targets.data()).ok());
  EXPECT_NEAR(m->loss(), std::log(static_cast<double>(c.vocab_size)), 0.2);
  ASSERT_TRUE(m->Backward(nullptr, 1.0f).ok());
  std::vector<float> grads(m->grads(), m->grads() + m->num_params());
  std::mt19937 rng(5);
  const float eps = 1e-2f;
  int checked = 0;
  for (int k = 0; k < 60; ++k) {
    const int64_t i = rng() % m->num_params();
    float& p = m->params()[i];
    const float saved = p;
    p = saved + eps;
    ASSERT_TRUE(m->Forward(b.B, b.T, b.tokens.data(), nullptr, b.targets.data()).ok());
    const double plus = m->loss();
    p = saved - eps;
    ASSERT_TRUE(m->Forward(b.B, b.T, b.tokens.data(), nullptr, b.targets.data()).ok());
    const double minus = m->loss();
    p = saved;
    const double numeric = (plus - minus) / (2 * eps);
    EXPECT_NEAR(grads[i], numeric, 2e-3 + 0.05 * std::abs(numeric)) << "parameter " << i;
    ++checked;
  }
  EXPECT_EQ(checked, 60);
}

// Runs the pipeline of `num_stages` on a batch; returns the stages after forward and backward.
std::vector<std::unique_ptr<GPT2Stage>> RunPipeline(const GPT2Config& c, int num_stages, const Batch& b, float* loss) {
  std::vector<std::unique_ptr<GPT2Stage>> stages;
  for (int s = 0; s < num_stages; ++s) stages.push_back(Make(c, StageOptions::Split(c, s, num_stages)));
  for (int s = 0; s < num_stages; ++s) {
    const float* input = s == 0 ? nullptr : stages[s - 1]->output();
    EXPECT_TRUE(stages[s]->Forward(b.B, b.T, b.tokens.data(), input, b.targets.data()).ok());
  }
  *loss = stages.back()->loss();
  for (int s = num_stages - 1; s >= 0; --s) {
    const float* dout = s == num_stages - 1 ? nullptr : stages[s + 1]->dinput();
    EXPECT_TRUE(stages[s]->Backward(dout, 1.0f).ok());
  }
  EXPECT_TRUE(SumTiedEmbeddingGradients(*stages.front(), *stages.back()).ok());
  return stages;
}

TEST(GPT2Test, StagesComposeToTheFullModelExactly) {
  GPT2Config c = TinyConfig();
  Batch b = MakeBatch(c, 11);
  float full_loss = 0.0f;
  auto full = RunPipeline(c, 1, b, &full_loss);
  for (int num_stages : {2, 3}) {
    float loss = 0.0f;
    auto stages = RunPipeline(c, num_stages, b, &loss);
    EXPECT_EQ(loss, full_loss) << num_stages << " stages";
    double norm_share = 0.0;
    for (auto& s : stages) {
      norm_share += s->GradSquaredNormShare();
      for (const std::string& name : s->TensorNames()) {
        EXPECT_EQ(Export(*s, name, true), Export(*full[0], name, true)) << name << " in " << num_stages;
        EXPECT_EQ(Export(*s, name, false), Export(*full[0], name, false)) << name;
      }
    }
    EXPECT_NEAR(norm_share, full[0]->GradSquaredNormShare(), 1e-6 * norm_share);
  }
}

TEST(GPT2Test, TensorParallelShardsMatchTheFullModel) {
  GPT2Config c = TinyConfig();
  Batch b = MakeBatch(c, 13);
  float full_loss = 0.0f;
  auto full = RunPipeline(c, 1, b, &full_loss);
  for (int tp : {2, 4}) {
    InProcessTensorParallelGroup group(tp);
    std::vector<float> losses(tp);
    std::vector<double> norm_shares(tp);
    std::vector<std::vector<std::vector<float>>> grads(tp);
    std::vector<std::thread> threads;
    const std::vector<std::string> names = full[0]->TensorNames();
    for (int r = 0; r < tp; ++r) {
      threads.emplace_back([&, r]() {
        StageOptions o;
        o.tp_comm = group.comm(r);
        auto s = Make(c, o);
        EXPECT_TRUE(s->Forward(b.B, b.T, b.tokens.data(), nullptr, b.targets.data()).ok());
        losses[r] = s->loss();
        EXPECT_TRUE(s->Backward(nullptr, 1.0f).ok());
        norm_shares[r] = s->GradSquaredNormShare();
        for (const std::string& name : names) grads[r].push_back(Export(*s, name, true));
      });
    }
    for (auto& t : threads) t.join();
    double norm_total = 0.0;
    for (int r = 0; r < tp; ++r) {
      norm_total += norm_shares[r];
      EXPECT_NEAR(losses[r], full_loss, 1e-5) << "tp " << tp;
      EXPECT_EQ(losses[r], losses[0]);
      for (size_t i = 0; i < names.size(); ++i) {
        const std::vector<float> ref = Export(*full[0], names[i], true);
        EXPECT_LE(MaxAbsDiff(grads[r][i], ref), 1e-5) << names[i] << " tp " << tp << " rank " << r;
      }
    }
    EXPECT_NEAR(norm_total, full[0]->GradSquaredNormShare(), 1e-5 * norm_total);
  }
}

TEST(GPT2Test, GradientAccumulationEqualsTheLargerBatch) {
  GPT2Config c = TinyConfig();
  Batch big = MakeBatch(c, 17, 2, 7);
  auto whole = Make(c);
  ASSERT_TRUE(whole->Forward(2, 7, big.tokens.data(), nullptr, big.targets.data()).ok());
  ASSERT_TRUE(whole->Backward(nullptr, 1.0f).ok());
  auto accumulated = Make(c);
  for (int micro = 0; micro < 2; ++micro) {
    ASSERT_TRUE(
        accumulated->Forward(1, 7, big.tokens.data() + micro * 7, nullptr, big.targets.data() + micro * 7).ok());
    ASSERT_TRUE(accumulated->Backward(nullptr, 0.5f).ok());
  }
  for (int64_t i = 0; i < whole->num_params(); ++i) {
    ASSERT_NEAR(whole->grads()[i], accumulated->grads()[i], 1e-6) << i;
  }
}

// The hook for overlapping the gradient all-reduce: the spans cover grads() exactly once, the hook
// fires L-1 .. 0 then -1, and a layer's gradients do not change after its call.
TEST(GPT2Test, LayerGradientHookAndSpansCoverTheGradients) {
  GPT2Config c = TinyConfig();
  Batch b = MakeBatch(c, 23);
  for (int num_stages : {1, 2}) {
    std::vector<std::unique_ptr<GPT2Stage>> stages;
    for (int k = 0; k < num_stages; ++k) stages.push_back(Make(c, StageOptions::Split(c, k, num_stages)));
    for (auto& s : stages) {
      std::vector<int> covered(s->num_params(), 0);
      auto mark = [&](const std::vector<absl::Span<float>>& spans) {
        for (absl::Span<float> span : spans) {
          for (size_t i = 0; i < span.size(); ++i) ++covered[span.data() + i - s->grads()];
        }
      };
      for (int l = 0; l < s->num_layers(); ++l) {
        EXPECT_EQ(s->LayerGradientSpans(l).size(), 12u);
        mark(s->LayerGradientSpans(l));
      }
      mark(s->NonLayerGradientSpans());
      EXPECT_EQ(std::count(covered.begin(), covered.end(), 1), s->num_params()) << num_stages << " stages";
    }
    // Forward through the stages, then backward with the hook recording order and snapshots.
    for (int k = 0; k < num_stages; ++k) {
      const float* input = k == 0 ? nullptr : stages[k - 1]->output();
      ASSERT_TRUE(stages[k]->Forward(b.B, b.T, b.tokens.data(), input, b.targets.data()).ok());
    }
    for (int k = num_stages - 1; k >= 0; --k) {
      GPT2Stage& s = *stages[k];
      std::vector<int> order;
      std::vector<std::vector<float>> snapshots(s.num_layers());
      s.set_layer_gradients_ready([&](int l) {
        order.push_back(l);
        if (l < 0) return;
        for (absl::Span<float> span : s.LayerGradientSpans(l)) {
          snapshots[l].insert(snapshots[l].end(), span.begin(), span.end());
        }
      });
      const float* doutput = k == num_stages - 1 ? nullptr : stages[k + 1]->dinput();
      ASSERT_TRUE(s.Backward(doutput, 1.0f).ok());
      std::vector<int> expected;
      for (int l = s.num_layers() - 1; l >= -1; --l) expected.push_back(l);
      EXPECT_EQ(order, expected);
      for (int l = 0; l < s.num_layers(); ++l) {
        std::vector<float> now;
        for (absl::Span<float> span : s.LayerGradientSpans(l)) now.insert(now.end(), span.begin(), span.end());
        EXPECT_EQ(now, snapshots[l]) << "layer " << l << " changed after its hook";
      }
      s.set_layer_gradients_ready(nullptr);
    }
  }
}

TEST(GPT2Test, BadInputsAreErrors) {
  GPT2Config c = TinyConfig();
  auto m = Make(c);
  std::vector<int32_t> tokens(8, 0);
  tokens[3] = c.vocab_size;
  EXPECT_FALSE(m->Forward(1, 8, tokens.data(), nullptr, nullptr).ok());
  EXPECT_FALSE(m->Forward(1, 9, tokens.data(), nullptr, nullptr).ok());  // T > block_size
  StageOptions o;
  o.first_layer = 2;
  o.last_layer = 1;
  EXPECT_FALSE(GPT2Stage::Create(c, o).ok());
  InProcessTensorParallelGroup group(3);
  StageOptions t;
  t.tp_comm = group.comm(0);
  EXPECT_FALSE(GPT2Stage::Create(c, t).ok());  // 4 heads do not split in 3
}

TEST(GPT2Test, TrainingReducesLossAndScheduleHasItsShape) {
  GPT2Config c = TinyConfig();
  auto m = Make(c);
  Batch b = MakeBatch(c, 19);
  AdamWOptions opts;
  opts.weight_decay = 0.1f;
  AdamW adam(m->num_params(), m->segments(), opts);
  float first = 0.0f, last = 0.0f;
  for (int step = 0; step < 30; ++step) {
    m->ZeroGrad();
    ASSERT_TRUE(m->Forward(b.B, b.T, b.tokens.data(), nullptr, b.targets.data()).ok());
    if (step == 0) first = m->loss();
    last = m->loss();
    ASSERT_TRUE(m->Backward(nullptr, 1.0f).ok());
    adam.Step(m->params(), m->grads(), 1e-2f, ClipScale(std::sqrt(m->GradSquaredNormShare()), 1.0));
  }
  EXPECT_LT(last, first - 1.0f);
  // Padded vocabulary rows stay zero through training.
  EXPECT_EQ(m->param_tensors().wte[static_cast<int64_t>(c.vocab_size) * c.n_embd + 1], 0.0f);

  LearningRateSchedule s{.max_lr = 1.0, .min_lr = 0.1, .warmup_steps = 10, .total_steps = 110};
  EXPECT_DOUBLE_EQ(s.At(0), 0.1);
  EXPECT_DOUBLE_EQ(s.At(9), 1.0);
  EXPECT_DOUBLE_EQ(s.At(10), 1.0);
  EXPECT_NEAR(s.At(60), 0.55, 1e-12);
  EXPECT_NEAR(s.At(110), 0.1, 1e-12);
  // DiLoCo's inner_lr_scale: the rate times the scale, never above max_lr.
  LearningRateSchedule scaled = s;
  scaled.scale = 1.5;
  EXPECT_DOUBLE_EQ(scaled.At(0), 0.15);
  EXPECT_DOUBLE_EQ(scaled.At(9), 1.0);
  EXPECT_DOUBLE_EQ(scaled.At(10), 1.0);
  EXPECT_NEAR(scaled.At(60), 0.825, 1e-12);
  EXPECT_NEAR(scaled.At(110), 0.15, 1e-12);
  scaled.scale = 0.5;  // below 1 nothing reaches the cap
  EXPECT_DOUBLE_EQ(scaled.At(9), 0.5);
  EXPECT_NEAR(scaled.At(60), 0.275, 1e-12);
  EXPECT_FLOAT_EQ(ClipScale(4.0, 1.0), 1.0f / (4.0f + 1e-6f));
  EXPECT_EQ(ClipScale(0.5, 1.0), 1.0f);
}

}  // namespace
}  // namespace geotrain::model
