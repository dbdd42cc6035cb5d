// Pipeline stages (2 and 3) and tensor-parallel shards (TP = 2, 3) against the unsplit model, on the
// awkward shape of the PyTorch parity test (n_head 3, n_embd 48, T 17, vocab 97) and an even one:
// loss, every gradient, and the parameters after 3 AdamW steps with clipping.
#include <cmath>
#include <map>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "model/gpt2.h"
#include "model/optimizer.h"

namespace geotrain::model {
namespace {

struct Shape {
  const char* name;
  int L, NH, C, V, T, B;
  std::vector<int> tp_degrees;
};

const Shape kShapes[] = {
    {"awkward", 3, 3, 48, 97, 17, 2, {3}},
    {"even", 4, 4, 32, 200, 16, 2, {2, 4}},
};

GPT2Config ConfigOf(const Shape& s) {
  GPT2Config c;
  c.n_layer = s.L;
  c.n_head = s.NH;
  c.n_embd = s.C;
  c.vocab_size = s.V;
  c.block_size = s.T;
  EXPECT_TRUE(c.Validate().ok());
  return c;
}

std::vector<int32_t> Tokens(const Shape& s, int step) {
  std::mt19937 rng(100 + step);
  std::vector<int32_t> t(s.B * (s.T + 1));
  for (int32_t& x : t) x = rng() % s.V;
  return t;
}

void Split(const std::vector<int32_t>& window, const Shape& s, std::vector<int32_t>* x, std::vector<int32_t>* y) {
  x->clear();
  y->clear();
  for (int b = 0; b < s.B; ++b) {
    for (int t = 0; t < s.T; ++t) {
      x->push_back(window[b * (s.T + 1) + t]);
      y->push_back(window[b * (s.T + 1) + t + 1]);
    }
  }
}

// Trains `steps` steps on a pipeline of stages (one thread) and returns every full tensor per name
// plus the losses.
struct Result {
  std::vector<float> losses;
  std::map<std::string, std::vector<float>> grads_step0, params;
};

std::vector<float> Export(GPT2Stage& s, const std::string& name, bool grads) {
  int64_t n = 1;
  const std::vector<int64_t> shape = *s.TensorShape(name);
  for (int64_t d : shape) n *= d;
  std::vector<float> out(n);
  EXPECT_TRUE(s.ExportTensor(name, grads, out.data()).ok());
  return out;
}

Result RunPipeline(const Shape& shape, int num_stages, int steps) {
  GPT2Config c = ConfigOf(shape);
  std::vector<std::unique_ptr<GPT2Stage>> stages;
  std::vector<std::unique_ptr<AdamW>> adams;
  for (int k = 0; k < num_stages; ++k) {
    auto s = GPT2Stage::Create(c, StageOptions::Split(c, k, num_stages));
    EXPECT_TRUE(s.ok());
    (*s)->InitializeWeights(5);
    adams.push_back(std::make_unique<AdamW>((*s)->num_params(), (*s)->segments(), AdamWOptions{.weight_decay = 0.1f}));
    stages.push_back(std::move(*s));
  }
  Result r;
  std::vector<int32_t> x, y;
  for (int step = 0; step < steps; ++step) {
    Split(Tokens(shape, step), shape, &x, &y);
    for (int k = 0; k < num_stages; ++k) {
      stages[k]->ZeroGrad();
      EXPECT_TRUE(stages[k]->Forward(shape.B, shape.T, x.data(), k ? stages[k - 1]->output() : nullptr, y.data()).ok());
    }
    r.losses.push_back(stages.back()->loss());
    for (int k = num_stages - 1; k >= 0; --k) {
      EXPECT_TRUE(stages[k]->Backward(k + 1 < num_stages ? stages[k + 1]->dinput() : nullptr, 1.0f).ok());
    }
    EXPECT_TRUE(SumTiedEmbeddingGradients(*stages.front(), *stages.back()).ok());
    double sq = 0.0;
    for (auto& s : stages) sq += s->GradSquaredNormShare();
    const float scale = ClipScale(std::sqrt(sq), 0.5);
    for (int k = 0; k < num_stages; ++k) {
      if (step == 0) {
        for (const std::string& n : stages[k]->TensorNames()) r.grads_step0[n] = Export(*stages[k], n, true);
      }
      adams[k]->Step(stages[k]->params(), stages[k]->grads(), 1e-3f, scale);
    }
  }
  for (auto& s : stages) {
    for (const std::string& n : s->TensorNames()) r.params[n] = Export(*s, n, false);
  }
  return r;
}

Result RunTensorParallel(const Shape& shape, int tp, int steps) {
  GPT2Config c = ConfigOf(shape);
  InProcessTensorParallelGroup group(tp);
  std::vector<Result> results(tp);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < tp; ++rank) {
    threads.emplace_back([&, rank]() {
      StageOptions o;
      o.tp_comm = group.comm(rank);
      auto s = std::move(*GPT2Stage::Create(c, o));
      s->InitializeWeights(5);
      AdamW adam(s->num_params(), s->segments(), AdamWOptions{.weight_decay = 0.1f});
      std::vector<int32_t> x, y;
      std::vector<double> shares(tp);
      for (int step = 0; step < steps; ++step) {
        Split(Tokens(shape, step), shape, &x, &y);
        s->ZeroGrad();
        EXPECT_TRUE(s->Forward(shape.B, shape.T, x.data(), nullptr, y.data()).ok());
        results[rank].losses.push_back(s->loss());
        EXPECT_TRUE(s->Backward(nullptr, 1.0f).ok());
        // The global norm: sum of every rank's share (through the group's all-reduce).
        float share = static_cast<float>(s->GradSquaredNormShare());
        EXPECT_TRUE(group.comm(rank)->AllReduceSum(&share, 1).ok());
        if (step == 0) {
          for (const std::string& n : s->TensorNames()) results[rank].grads_step0[n] = Export(*s, n, true);
        }
        adam.Step(s->params(), s->grads(), 1e-3f, ClipScale(std::sqrt(share), 0.5));
      }
      for (const std::string& n : s->TensorNames()) results[rank].params[n] = Export(*s, n, false);
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 1; rank < tp; ++rank) EXPECT_EQ(results[rank].params, results[0].params) << "ranks disagree";
  return results[0];
}

void ExpectClose(const Result& a, const Result& ref, const std::string& what, bool exact) {
  ASSERT_EQ(a.losses.size(), ref.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    if (exact)
      EXPECT_EQ(a.losses[i], ref.losses[i]) << what << " step " << i;
    else
      EXPECT_NEAR(a.losses[i], ref.losses[i], 1e-4 * std::max(1.0f, std::abs(ref.losses[i]))) << what;
  }
  for (auto maps : {&Result::grads_step0, &Result::params}) {
    const auto& mine = a.*maps;
    const auto& theirs = ref.*maps;
    ASSERT_EQ(mine.size(), theirs.size()) << what;
    for (const auto& [name, values] : theirs) {
      const std::vector<float>& got = mine.at(name);
      float max_ref = 1.0f, max_diff = 0.0f;
      for (size_t i = 0; i < values.size(); ++i) {
        max_ref = std::max(max_ref, std::abs(values[i]));
        max_diff = std::max(max_diff, std::abs(values[i] - got[i]));
      }
      if (exact)
        EXPECT_EQ(max_diff, 0.0f) << what << " " << name;
      else
        EXPECT_LE(max_diff, 1e-4f * max_ref) << what << " " << name;
    }
  }
}

TEST(SplitParityTest, StagesAndTensorParallelMatchTheUnsplitModel) {
  for (const Shape& shape : kShapes) {
    const Result full = RunPipeline(shape, 1, 3);
    // One microbatch per step: stages give exactly the full model's numbers.
    for (int stages : {2, 3})
      ExpectClose(RunPipeline(shape, stages, 3), full, std::string(shape.name) + " stages " + std::to_string(stages),
                  true);
    for (int tp : shape.tp_degrees)
      ExpectClose(RunTensorParallel(shape, tp, 3), full, std::string(shape.name) + " tp " + std::to_string(tp), false);
  }
}

}  // namespace
}  // namespace geotrain::model
