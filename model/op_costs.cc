// FLOPs and bytes per op (see op_costs.h).
#include "model/op_costs.h"

#include <algorithm>

namespace geotrain::model {
namespace {

constexpr double kFloat = 4;  // fp32 bytes

OpCost Cost(double flops, double floats_moved) { return {flops, floats_moved * kFloat}; }

}  // namespace

OpCost EncoderForwardCost(int64_t B, int64_t T, int64_t C) {
  const double N = static_cast<double>(B) * T;
  return Cost(N * C, 3 * N * C);  // wte row + wpe row -> out
}

OpCost EncoderBackwardCost(int64_t B, int64_t T, int64_t C) {
  const double N = static_cast<double>(B) * T;
  return Cost(2 * N * C, 5 * N * C);  // dout read, dwte and dwpe rows read and written
}

OpCost LayernormForwardCost(int64_t N, int64_t C) {
  const double n = static_cast<double>(N) * C;
  return Cost(8 * n, 2 * n + 2 * C + 2.0 * N);
}

OpCost LayernormBackwardCost(int64_t N, int64_t C) {
  const double n = static_cast<double>(N) * C;
  return Cost(12 * n, 4 * n + 4 * C + 2.0 * N);
}

OpCost MatmulForwardCost(int64_t N, int64_t C, int64_t OC) {
  const double n = N, c = C, oc = OC;
  return Cost(2 * n * c * oc, n * c + c * oc + n * oc + oc);
}

OpCost MatmulBackwardCost(int64_t N, int64_t C, int64_t OC) {
  const double n = N, c = C, oc = OC;
  // dinp = dout W and dW += dout^T inp; dbias += sum of dout rows.
  return Cost(4 * n * c * oc + n * oc, 2 * n * oc + 2 * n * c + 3 * c * oc + 2 * oc);
}

OpCost BiasCost(int64_t N, int64_t OC) {
  const double n = static_cast<double>(N) * OC;
  return Cost(n, 2 * n + OC);
}

OpCost AttentionForwardCost(int64_t B, int64_t T, int64_t C, int64_t NH) {
  const double b = B, t = T, c = C;
  // QK^T and AV over the causal half of the T x T scores: 2 GEMMs of 2 T T C each, halved.
  return Cost(2 * b * t * t * c, b * t * 3 * c + b * t * c + b * NH * t);
}

OpCost AttentionBackwardCost(int64_t B, int64_t T, int64_t C, int64_t NH) {
  const OpCost f = AttentionForwardCost(B, T, C, NH);
  const double b = B, t = T, c = C;
  return {2 * f.flops, (b * t * c * 2 + b * t * 3 * c * 2 + b * NH * t) * kFloat};
}

OpCost ElementwiseCost(int64_t n, int inputs, int outputs, double flops_per_element) {
  const double e = static_cast<double>(n);
  return Cost(flops_per_element * e, (inputs + outputs) * e);
}

OpCost CrossentropyCost(int64_t N, int64_t Vp) {
  const double n = static_cast<double>(N) * Vp;
  return Cost(3 * n, n + 3.0 * N);
}

OpCost AdamWCost(int64_t n) {
  const double e = static_cast<double>(n);
  return Cost(12 * e, 7 * e);  // params, grads, m, v read; params, m, v written
}

OpCost CopyCost(int64_t bytes) { return {0, 2.0 * static_cast<double>(bytes)}; }

double Roofline::Seconds(const OpCost& cost) const {
  const double compute = flops_per_s > 0 ? cost.flops / flops_per_s : 0;
  const double memory = bytes_per_s > 0 ? cost.bytes / bytes_per_s : 0;
  return std::max(compute, memory) + launch_s;
}

}  // namespace geotrain::model
