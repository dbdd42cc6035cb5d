// GPT-2 ops on the CPU (see ops.h for the contracts).
#include "model/ops.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#include "model/adamw_element.h"

namespace geotrain::model {
namespace {

// exp(x) for softmax and cross-entropy, written so that loops over it vectorise (libm's expf does not
// without -ffast-math): x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial
// (relative error < 4e-7), 2^n built in the exponent bits. Inputs are <= 0 here; below -87 it returns
// about 1e-38 instead of a denormal, which no softmax can tell from 0.
inline float FastExp(float x) {
  x = std::max(x, -87.0f);
  x = std::min(x, 88.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

}  // namespace

void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T, int C) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int b = 0; b < B; ++b) {
    for (int t = 0; t < T; ++t) {
      float* o = out + (static_cast<int64_t>(b) * T + t) * C;
      const float* we = wte + static_cast<int64_t>(inp[b * T + t]) * C;
      const float* pe = wpe + static_cast<int64_t>(t) * C;
      for (int i = 0; i < C; ++i) o[i] = we[i] + pe[i];
    }
  }
}

void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T, int C) {
  // A token's row of dwte receives the sum of its positions' gradients, summed first (in position
  // order) and added once: rows never collide between threads, and the result does not depend on what
  // dwte held before (so the tied head's part can be added before or after, bit for bit the same).
  const int64_t N = static_cast<int64_t>(B) * T;
  // Scratch reused across calls; plain references so that the OpenMP threads share the caller's copy.
  static thread_local std::vector<std::pair<int32_t, int32_t>> order_storage;  // (token, position)
  static thread_local std::vector<int64_t> starts_storage;
  std::vector<std::pair<int32_t, int32_t>>& order = order_storage;
  std::vector<int64_t>& starts = starts_storage;
  order.resize(N);
  for (int64_t n = 0; n < N; ++n) order[n] = {inp[n], static_cast<int32_t>(n)};
  std::sort(order.begin(), order.end());
  starts.clear();
  for (int64_t n = 0; n < N; ++n) {
    if (n == 0 || order[n].first != order[n - 1].first) starts.push_back(n);
  }
  starts.push_back(N);
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
#pragma omp parallel
  {
    std::vector<float> sum(C);
#pragma omp for schedule(dynamic, 16)
    for (int64_t g = 0; g < groups; ++g) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t k = starts[g]; k < starts[g + 1]; ++k) {
        const float* d = dout + static_cast<int64_t>(order[k].second) * C;
        for (int i = 0; i < C; ++i) sum[i] += d[i];
      }
      float* dw = dwte + static_cast<int64_t>(order[starts[g]].first) * C;
      for (int i = 0; i < C; ++i) dw[i] += sum[i];
    }
#pragma omp for schedule(static)
    for (int t = 0; t < T; ++t) {
      float* dp = dwpe + static_cast<int64_t>(t) * C;
      for (int b = 0; b < B; ++b) {
        const float* d = dout + (static_cast<int64_t>(b) * T + t) * C;
        for (int i = 0; i < C; ++i) dp[i] += d[i];
      }
    }
  }
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int C) {
  const float eps = 1e-5f;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float m = 0.0f;
#pragma omp simd reduction(+ : m)
    for (int i = 0; i < C; ++i) m += x[i];
    m /= C;
    float v = 0.0f;
#pragma omp simd reduction(+ : v)
    for (int i = 0; i < C; ++i) {
      const float d = x[i] - m;
      v += d * d;
    }
    v /= C;
    const float s = 1.0f / std::sqrt(v + eps);
    float* o = out + n * C;
    for (int i = 0; i < C; ++i) o[i] = (x[i] - m) * s * weight[i] + bias[i];
    mean[n] = m;
    rstd[n] = s;
  }
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int C) {
  const int max_threads = omp_get_max_threads();
  // Per-thread partial sums of dweight and dbias, reduced in thread order (deterministic).
  std::vector<float> partial(static_cast<size_t>(max_threads) * 2 * C, 0.0f);
  int used_threads = 1;
#pragma omp parallel
  {
    const int tid = omp_get_thread_num();
#pragma omp single
    used_threads = omp_get_num_threads();
    float* pw = partial.data() + static_cast<size_t>(tid) * 2 * C;
    float* pb = pw + C;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* d = dout + n * C;
      const float* x = inp + n * C;
      const float m = mean[n], s = rstd[n];
      float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
      for (int i = 0; i < C; ++i) {
        const float norm = (x[i] - m) * s;
        const float dnorm = weight[i] * d[i];
        dnorm_mean += dnorm;
        dnorm_norm_mean += dnorm * norm;
      }
      dnorm_mean /= C;
      dnorm_norm_mean /= C;
      float* di = dinp + n * C;
      for (int i = 0; i < C; ++i) {
        const float norm = (x[i] - m) * s;
        const float dnorm = weight[i] * d[i];
        pb[i] += d[i];
        pw[i] += norm * d[i];
        di[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
      }
    }
  }
  for (int t = 0; t < used_threads; ++t) {
    const float* pw = partial.data() + static_cast<size_t>(t) * 2 * C;
    const float* pb = pw + C;
    for (int i = 0; i < C; ++i) {
      dweight[i] += pw[i];
      dbias[i] += pb[i];
    }
  }
}

void add_bias(float* out, const float* bias, int64_t N, int OC) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* o = out + n * OC;
    for (int i = 0; i < OC; ++i) o[i] += bias[i];
  }
}

void bias_backward(float* dbias, const float* dout, int64_t N, int OC) {
  // Split the columns among threads; each thread walks all rows of its column range.
#pragma omp parallel
  {
    const int nthreads = omp_get_num_threads();
    const int tid = omp_get_thread_num();
    const int chunk = ((OC + nthreads - 1) / nthreads + 15) / 16 * 16;
    const int c0 = std::min(OC, tid * chunk), c1 = std::min(OC, c0 + chunk);
    for (int64_t n = 0; n < N; ++n) {
      const float* d = dout + n * OC;
      for (int i = c0; i < c1; ++i) dbias[i] += d[i];
    }
  }
}

namespace {

// OpenBLAS runs single-threaded inside our OpenMP threads: its own pthread pool and OpenMP's would
// otherwise spin against each other on the same cores (measured 8x slower on two busy cores).
const bool kBlasSingleThreaded = [] {
  openblas_set_num_threads(1);
  return true;
}();

// Splits [0, n) into per-thread chunks that are multiples of `align` (but the last).
inline void ThreadRange(int64_t n, int64_t align, int64_t* begin, int64_t* end) {
  const int nthreads = omp_get_num_threads(), tid = omp_get_thread_num();
  int64_t chunk = (n + nthreads - 1) / nthreads;
  chunk = (chunk + align - 1) / align * align;
  *begin = std::min(n, tid * chunk);
  *end = std::min(n, *begin + chunk);
}

}  // namespace

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C, int OC) {
  (void)kBlasSingleThreaded;
  // Rows of out split among threads; each runs one single-threaded GEMM and adds the bias while the
  // block is still in cache.
#pragma omp parallel
  {
    int64_t n0, n1;
    ThreadRange(N, 8, &n0, &n1);
    if (n1 > n0) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(n1 - n0), OC, C, 1.0f, inp + n0 * C, C,
                  weight, C, 0.0f, out + n0 * OC, OC);
      if (bias != nullptr) {
        for (int64_t n = n0; n < n1; ++n) {
          float* o = out + n * OC;
          for (int i = 0; i < OC; ++i) o[i] += bias[i];
        }
      }
    }
  }
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int C, int OC, bool accumulate_dinp) {
#pragma omp parallel
  {
    if (dinp != nullptr) {
      int64_t n0, n1;
      ThreadRange(N, 8, &n0, &n1);
      if (n1 > n0) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(n1 - n0), C, OC, 1.0f, dout + n0 * OC,
                    OC, weight, C, accumulate_dinp ? 1.0f : 0.0f, dinp + n0 * C, C);
      }
    }
    // dweight rows (output channels) split among threads; each also owns those entries of dbias.
    int64_t o0, o1;
    ThreadRange(OC, 16, &o0, &o1);
    if (o1 > o0) {
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(o1 - o0), C, static_cast<int>(N), 1.0f,
                  dout + o0, OC, inp, C, 1.0f, dweight + o0 * C, C);
      if (dbias != nullptr) {
        for (int64_t n = 0; n < N; ++n) {
          const float* d = dout + n * OC;
          for (int64_t i = o0; i < o1; ++i) dbias[i] += d[i];
        }
      }
    }
  }
}

void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH) {
  const int C3 = 3 * C;
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  // One query row at a time: its scores live in a per-thread row of T floats; only the row's
  // log-sum-exp is kept for backward, which recomputes the probabilities.
#pragma omp parallel
  {
    std::vector<float> row(T);
#pragma omp for collapse(3) schedule(dynamic, 8)
    for (int b = 0; b < B; ++b) {
      for (int h = 0; h < NH; ++h) {
        for (int t = 0; t < T; ++t) {
          const float* q = qkv + (static_cast<int64_t>(b) * T + t) * C3 + h * hs;
          float maxval = -INFINITY;
          for (int t2 = 0; t2 <= t; ++t2) {
            const float* k = qkv + (static_cast<int64_t>(b) * T + t2) * C3 + C + h * hs;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int i = 0; i < hs; ++i) dot += q[i] * k[i];
            dot *= scale;
            row[t2] = dot;
            maxval = std::max(maxval, dot);
          }
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int t2 = 0; t2 <= t; ++t2) {
            const float e = FastExp(row[t2] - maxval);
            row[t2] = e;
            sum += e;
          }
          const float inv = 1.0f / sum;
          float* o = out + (static_cast<int64_t>(b) * T + t) * C + h * hs;
          for (int i = 0; i < hs; ++i) o[i] = 0.0f;
          for (int t2 = 0; t2 <= t; ++t2) {
            const float* v = qkv + (static_cast<int64_t>(b) * T + t2) * C3 + 2 * C + h * hs;
            const float w = row[t2] * inv;
            for (int i = 0; i < hs; ++i) o[i] += w * v[i];
          }
          lse[(static_cast<int64_t>(b) * NH + h) * T + t] = maxval + std::log(sum);
        }
      }
    }
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                        int T, int C, int NH) {
  const int C3 = 3 * C;
  const int hs = C / NH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  // dk and dv of a key collect from every later query, so a (b, h) pair is one task. The softmax
  // backward needs sum_j p_j datt_j = dout . out per query, so no probability row is stored.
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      for (int t = 0; t < T; ++t) {
        float* base = dqkv + (static_cast<int64_t>(b) * T + t) * C3 + h * hs;
        for (int i = 0; i < hs; ++i) base[i] = base[C + i] = base[2 * C + i] = 0.0f;
      }
      for (int t = 0; t < T; ++t) {
        const float* d = dout + (static_cast<int64_t>(b) * T + t) * C + h * hs;
        const float* o = out + (static_cast<int64_t>(b) * T + t) * C + h * hs;
        const float* q = qkv + (static_cast<int64_t>(b) * T + t) * C3 + h * hs;
        float* dq = dqkv + (static_cast<int64_t>(b) * T + t) * C3 + h * hs;
        const float row_lse = lse[(static_cast<int64_t>(b) * NH + h) * T + t];
        float dot_do = 0.0f;
#pragma omp simd reduction(+ : dot_do)
        for (int i = 0; i < hs; ++i) dot_do += d[i] * o[i];
        for (int t2 = 0; t2 <= t; ++t2) {
          const int64_t row = (static_cast<int64_t>(b) * T + t2) * C3;
          const float* k = qkv + row + C + h * hs;
          const float* v = qkv + row + 2 * C + h * hs;
          float* dk = dqkv + row + C + h * hs;
          float* dv = dqkv + row + 2 * C + h * hs;
          float score = 0.0f, datt = 0.0f;
#pragma omp simd reduction(+ : score, datt)
          for (int i = 0; i < hs; ++i) {
            score += q[i] * k[i];
            datt += v[i] * d[i];
          }
          const float p = FastExp(score * scale - row_lse);
          const float dpre = p * (datt - dot_do) * scale;
          for (int i = 0; i < hs; ++i) {
            dv[i] += p * d[i];
            dq[i] += dpre * k[i];
            dk[i] += dpre * q[i];
          }
        }
      }
    }
  }
}

namespace {
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
}

void gelu_forward(float* out, const float* inp, int64_t N) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float x = inp[i];
    const float cube = 0.044715f * x * x * x;
    out[i] = 0.5f * x * (1.0f + std::tanh(kGeluScale * (x + cube)));
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t N) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float x = inp[i];
    const float cube = 0.044715f * x * x * x;
    const float tanh_arg = kGeluScale * (x + cube);
    const float tanh_out = std::tanh(tanh_arg);
    const float sech2 = 1.0f - tanh_out * tanh_out;
    const float local_grad =
        0.5f * (1.0f + tanh_out) + x * 0.5f * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = local_grad * dout[i];
  }
}

void residual_forward(float* out, const float* a, const float* b, int64_t N) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) out[i] = a[i] + b[i];
}

void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N, int V,
                          int Vp) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* l = logits + n * Vp;
    float maxval = -INFINITY;
#pragma omp simd reduction(max : maxval)
    for (int i = 0; i < V; ++i) maxval = std::max(maxval, l[i]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < V; ++i) sum += FastExp(l[i] - maxval);
    const float log_sum_exp = maxval + std::log(sum);
    lse[n] = log_sum_exp;
    losses[n] = log_sum_exp - l[targets[n]];
  }
}

void crossentropy_backward_inplace(float* logits, const float* lse, const int32_t* targets, float dloss, int64_t N,
                                   int V, int Vp) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* l = logits + n * Vp;
    const float m = lse[n];
#pragma omp simd
    for (int i = 0; i < V; ++i) l[i] = FastExp(l[i] - m) * dloss;
    l[targets[n]] -= dloss;
    for (int i = V; i < Vp; ++i) l[i] = 0.0f;
  }
}

void accumulate(float* out, const float* in, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] += in[i];
}

void scale(float* x, int64_t n, float factor) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] *= factor;
}

void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float decay, float beta1,
                  float beta2, float eps, float grad_scale, float step_size, float bc2_sqrt) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    AdamWElement(params, grads, m, v, i, decay, beta1, beta2, eps, grad_scale, step_size, bc2_sqrt);
  }
}

}  // namespace geotrain::model
