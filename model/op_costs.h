// The work of each op of model/backend.h: floating-point operations and bytes of memory traffic, counted once
// here for everything that needs them: the timed-compute backend (model/timed_backend.h), which waits for
// the time an emulated GPU would take per op, and the planner's layer costs (GPT2Config::BlockForwardFlops,
// scheduler/cost_model.cc), which add up the same FLOPs per layer.
//
//   OpCost c = MatmulForwardCost(B * T, C, 3 * C);        // 2 N C OC FLOPs; inputs, weight and output bytes
//   double s = Roofline{.flops_per_s = 400e12, .bytes_per_s = 3e12}.Seconds(c);
//
// Conventions: a FLOP is a multiply or an add (a fused multiply-add is 2); bytes are what the op must read
// and write at least once in fp32 (geotrain keeps activations, gradients and master weights in fp32 on every
// device), with no cache reuse across ops. Causal attention counts the half of the T x T scores it computes.
// Backward ops count what llm.c's kernels do: a matmul backward is the two GEMMs for dinp and dweight
// (twice the forward FLOPs), attention backward twice its forward.
#pragma once

#include <cstdint>

namespace geotrain::model {

struct OpCost {
  double flops = 0;
  double bytes = 0;
  OpCost& operator+=(const OpCost& o) {
    flops += o.flops;
    bytes += o.bytes;
    return *this;
  }
};

// Sizes follow model/ops.h: N rows (B*T), C channels in, OC out, V vocabulary, Vp padded vocabulary.
OpCost EncoderForwardCost(int64_t B, int64_t T, int64_t C);
OpCost EncoderBackwardCost(int64_t B, int64_t T, int64_t C);
OpCost LayernormForwardCost(int64_t N, int64_t C);
OpCost LayernormBackwardCost(int64_t N, int64_t C);
OpCost MatmulForwardCost(int64_t N, int64_t C, int64_t OC);
OpCost MatmulBackwardCost(int64_t N, int64_t C, int64_t OC);
OpCost BiasCost(int64_t N, int64_t OC);  // add_bias and bias_backward
// C is the channels of this rank's heads (C / tp under tensor parallelism).
OpCost AttentionForwardCost(int64_t B, int64_t T, int64_t C, int64_t NH);
OpCost AttentionBackwardCost(int64_t B, int64_t T, int64_t C, int64_t NH);
OpCost ElementwiseCost(int64_t n, int inputs, int outputs, double flops_per_element);
OpCost CrossentropyCost(int64_t N, int64_t Vp);
OpCost AdamWCost(int64_t n);
OpCost CopyCost(int64_t bytes);

// A device's achieved speed: time of an op = max(flops / flops_per_s, bytes / bytes_per_s) + launch_s
// (compute-bound or memory-bound, whichever is slower, plus the kernel launch).
struct Roofline {
  double flops_per_s = 0;
  double bytes_per_s = 0;
  double launch_s = 0;
  double Seconds(const OpCost& cost) const;
};

}  // namespace geotrain::model
