// The GPT-2 ops on the CPU, in fp32, as plain functions in llm.c's style: outputs first, then inputs,
// then sizes. Every backward ACCUMULATES (+=) into its parameter gradients and, unless it says
// otherwise, into its input gradient, so that gradient accumulation over microbatches and the
// residual stream need no extra copies. Buffers never alias unless a comment says they may.
//
// Dimension names: B batch, T time, C channels, NH heads, OC output channels, V real vocabulary,
// Vp padded vocabulary (row stride of the logits). N = B*T when an op does not care about the split.
//
// Parallelism: GEMMs go to OpenBLAS (cblas_sgemm); the other ops are OpenMP loops written so that the
// compiler vectorises their inner loops. Results are deterministic for a fixed thread count.
#pragma once

#include <cstdint>

namespace geotrain::model {

// out(B,T,C) = wte[inp] + wpe[t]. inp holds token ids < Vp.
void encoder_forward(float* out, const int32_t* inp, const float* wte, const float* wpe, int B, int T, int C);
// dwte(Vp,C) += scatter of dout by token; dwpe(T,C) += sum over b of dout.
void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* inp, int B, int T, int C);

// Row-wise LayerNorm with eps 1e-5; mean and rstd (N) are kept for backward.
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int C);
// dinp(N,C) += ..., dweight(C) += ..., dbias(C) += ...
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int C);

// out(N,OC) = inp(N,C) @ weight(OC,C)^T (+ bias(OC) when bias is non-null). Overwrites out.
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int C, int OC);
// dinp(N,C) = or += dout @ weight (accumulate_dinp chooses; dinp may be null to skip it);
// dweight(OC,C) += dout^T @ inp; dbias(OC) += column sums of dout (dbias may be null).
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int C, int OC, bool accumulate_dinp);

// Adds bias(OC) to every row of out(N,OC).
void add_bias(float* out, const float* bias, int64_t N, int OC);
// dbias(OC) += column sums of dout(N,OC).
void bias_backward(float* dbias, const float* dout, int64_t N, int OC);

// Causal multi-head self-attention, fused: the (T x T) scores and probabilities are never stored.
// qkv (B,T,3*C) holds per token [q (C) | k (C) | v (C)], each split in NH heads of C/NH channels.
// out (B,T,C); lse (B,NH,T) keeps each query row's log-sum-exp of scaled scores for backward.
void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH);
// Recomputes the probabilities from qkv and lse; out is attention_forward's output.
// dqkv(B,T,3C) is OVERWRITTEN (not accumulated).
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse, int B,
                        int T, int C, int NH);

// GELU, tanh approximation (GPT-2's). out may not alias inp.
void gelu_forward(float* out, const float* inp, int64_t N);
// dinp(N) = dout * gelu'(inp) (OVERWRITES dinp; dinp may alias dout).
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t N);

// out(N,C) = a + b (out may alias a or b).
void residual_forward(float* out, const float* a, const float* b, int64_t N);

// Softmax cross-entropy over the first V columns of logits (N rows of stride Vp); the padded columns
// never take part. losses(N) = -log p[target]; lse(N) keeps log-sum-exp for backward.
void crossentropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N, int V,
                          int Vp);
// Turns logits IN PLACE into dlogits = dloss * (softmax - onehot(target)), padded columns set to 0.
void crossentropy_backward_inplace(float* logits, const float* lse, const int32_t* targets, float dloss, int64_t N,
                                   int V, int Vp);

// ---- Training arithmetic (the CPU twins of model/cuda/ops_cuda.h's). ----
// out(n) += in(n).
void accumulate(float* out, const float* in, int64_t n);
// x(n) *= factor.
void scale(float* x, int64_t n, float factor);
// One AdamW update of n parameters, torch.optim.AdamW to the operation (decoupled decay first):
//   g = grads*grad_scale; p = params*decay; m += (1-b1)(g-m); v = b2 v + (1-b2) g^2;
//   params = p - step_size * m / (sqrt(v) / bc2_sqrt + eps)
// decay = 1 - lr*weight_decay (1 without decay), step_size = lr / (1 - b1^t), bc2_sqrt = sqrt(1 - b2^t) for
// step t (1-based); AdamW::Step computes them.
void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float decay, float beta1,
                  float beta2, float eps, float grad_scale, float step_size, float bc2_sqrt);

}  // namespace geotrain::model
