// Gradient checks of every op against central finite differences (computed in double from the float
// forward), on small random inputs.
#include "model/ops.h"

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace geotrain::model {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Checks analytic[i] against d f / d x[i] for a sample of indices; f reads x.
void CheckGradient(const char* what, std::vector<float>& x, const std::vector<float>& analytic,
                   const std::function<double()>& f, float eps = 1e-2f, double tol = 2e-2) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  const size_t step = std::max<size_t>(1, x.size() / 40);
  for (size_t i = 0; i < x.size(); i += step) {
    const float saved = x[i];
    x[i] = saved + eps;
    const double plus = f();
    x[i] = saved - eps;
    const double minus = f();
    x[i] = saved;
    const double numeric = (plus - minus) / (2.0 * eps);
    EXPECT_NEAR(analytic[i], numeric, tol * std::max(1.0, std::abs(numeric))) << what << " index " << i;
  }
}

double Dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

TEST(OpsTest, LayerNormGradients) {
  const int N = 6, C = 16;
  auto inp = Random(N * C, 1), weight = Random(C, 2), bias = Random(C, 3), probe = Random(N * C, 4);
  std::vector<float> out(N * C), mean(N), rstd(N);
  auto f = [&]() {
    layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N, C);
    return Dot(out, probe);
  };
  f();
  std::vector<float> dinp(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
  layernorm_backward(dinp.data(), dw.data(), db.data(), probe.data(), inp.data(), weight.data(), mean.data(),
                     rstd.data(), N, C);
  CheckGradient("dinp", inp, dinp, f);
  CheckGradient("dweight", weight, dw, f);
  CheckGradient("dbias", bias, db, f);
}

TEST(OpsTest, MatmulGradients) {
  const int N = 5, C = 12, OC = 7;
  auto inp = Random(N * C, 1), weight = Random(OC * C, 2), bias = Random(OC, 3), probe = Random(N * OC, 4);
  std::vector<float> out(N * OC);
  auto f = [&]() {
    matmul_forward(out.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
    return Dot(out, probe);
  };
  f();
  // The forward is exact arithmetic: check it against a naive loop too.
  for (int n = 0; n < N; ++n) {
    for (int o = 0; o < OC; ++o) {
      double s = bias[o];
      for (int i = 0; i < C; ++i) s += static_cast<double>(inp[n * C + i]) * weight[o * C + i];
      EXPECT_NEAR(out[n * OC + o], s, 1e-4);
    }
  }
  std::vector<float> dinp(N * C, 1.0f), dw(OC * C, 0.0f), db(OC, 0.0f);
  matmul_backward(dinp.data(), dw.data(), db.data(), probe.data(), inp.data(), weight.data(), N, C, OC, false);
  CheckGradient("dinp", inp, dinp, f);
  CheckGradient("dweight", weight, dw, f);
  CheckGradient("dbias", bias, db, f);
  // accumulate_dinp adds instead of overwriting.
  std::vector<float> dinp2(N * C, 1.0f);
  std::vector<float> dw2(OC * C, 0.0f);
  matmul_backward(dinp2.data(), dw2.data(), nullptr, probe.data(), inp.data(), weight.data(), N, C, OC, true);
  for (int i = 0; i < N * C; ++i) EXPECT_NEAR(dinp2[i], dinp[i] + 1.0f, 1e-5);
}

TEST(OpsTest, AttentionGradientsAndCausality) {
  const int B = 2, T = 5, C = 8, NH = 2;
  auto qkv = Random(B * T * 3 * C, 1), probe = Random(B * T * C, 2);
  std::vector<float> out(B * T * C), lse(B * NH * T);
  auto f = [&]() {
    attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
    return Dot(out, probe);
  };
  f();
  std::vector<float> dqkv(B * T * 3 * C, 123.0f);  // overwritten, not accumulated
  attention_backward(dqkv.data(), probe.data(), qkv.data(), out.data(), lse.data(), B, T, C, NH);
  CheckGradient("dqkv", qkv, dqkv, f);
  // Changing the last token's k and v leaves earlier outputs alone.
  const std::vector<float> before = out;
  for (int i = 0; i < 3 * C; ++i) qkv[((0 * T) + T - 1) * 3 * C + i] += 1.0f;
  f();
  for (int t = 0; t < T - 1; ++t) {
    for (int i = 0; i < C; ++i) EXPECT_EQ(out[t * C + i], before[t * C + i]);
  }
}

TEST(OpsTest, GeluGradient) {
  const int N = 50;
  auto inp = Random(N, 1, 2.0f), probe = Random(N, 2);
  std::vector<float> out(N);
  auto f = [&]() {
    gelu_forward(out.data(), inp.data(), N);
    return Dot(out, probe);
  };
  f();
  EXPECT_NEAR(out[0], 0.5 * inp[0] * (1 + std::tanh(std::sqrt(2 / M_PI) * (inp[0] + 0.044715 * std::pow(inp[0], 3)))),
              1e-6);
  std::vector<float> dinp(N);
  gelu_backward(dinp.data(), inp.data(), probe.data(), N);
  CheckGradient("dinp", inp, dinp, f, 1e-3f);
}

TEST(OpsTest, CrossEntropyGradientIgnoresPadding) {
  const int N = 4, V = 10, Vp = 16;
  auto logits = Random(N * Vp, 1);
  for (int n = 0; n < N; ++n) {
    for (int i = V; i < Vp; ++i) logits[n * Vp + i] = 1000.0f;  // would dominate if it took part
  }
  std::vector<int32_t> targets = {0, 3, 9, 5};
  std::vector<float> losses(N), lse(N);
  auto f = [&]() {
    crossentropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V, Vp);
    double s = 0.0;
    for (float l : losses) s += l;
    return s / N;
  };
  const double loss = f();
  EXPECT_LT(loss, 20.0);
  std::vector<float> dlogits = logits;
  crossentropy_backward_inplace(dlogits.data(), lse.data(), targets.data(), 1.0f / N, N, V, Vp);
  for (int n = 0; n < N; ++n) {
    for (int i = V; i < Vp; ++i) EXPECT_EQ(dlogits[n * Vp + i], 0.0f);
  }
  CheckGradient("dlogits", logits, dlogits, f, 1e-2f);
}

TEST(OpsTest, EncoderForwardBackward) {
  const int B = 2, T = 3, C = 4, Vp = 5;
  auto wte = Random(Vp * C, 1), wpe = Random(T * C, 2);
  std::vector<int32_t> inp = {1, 4, 1, 0, 1, 2};
  std::vector<float> out(B * T * C);
  encoder_forward(out.data(), inp.data(), wte.data(), wpe.data(), B, T, C);
  EXPECT_EQ(out[(1 * T + 2) * C + 3], wte[2 * C + 3] + wpe[2 * C + 3]);
  std::vector<float> dout(B * T * C, 1.0f), dwte(Vp * C, 0.0f), dwpe(T * C, 0.0f);
  encoder_backward(dwte.data(), dwpe.data(), dout.data(), inp.data(), B, T, C);
  EXPECT_EQ(dwte[1 * C], 3.0f);  // token 1 appears three times
  EXPECT_EQ(dwte[3 * C], 0.0f);
  EXPECT_EQ(dwpe[0], 2.0f);
}

}  // namespace
}  // namespace geotrain::model
