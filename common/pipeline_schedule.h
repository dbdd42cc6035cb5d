// The pipeline schedule as data: the order in which one stage runs the forwards and backwards of a step's
// microbatches.
//
//   for (const PipelineOp& op : MakePipelineSchedule(PipelineKind::k1F1B, /*pp=*/4, /*stage=*/1, /*M=*/8)) {
//     op.forward ? Forward(op.microbatch) : Backward(op.microbatch);
//   }
//
// GPipe: every forward, then every backward, in microbatch order. 1F1B: min(D - stage - 1, M) warm-up
// forwards, then one forward and one backward in turn while forwards remain, then the remaining backwards;
// D, the pipeline's depth, is max(pp, depth) (pp on the last stage): the microbatches in flight at the
// first stage. A depth above pp keeps a stage busy while a microbatch crosses a slow link and its gradient
// comes back (parallel.pipeline_depth, chosen by PipelineDepthFor unless the spec sets it); the runtime keeps
// no activations for the extra microbatches in flight, the stage recomputes their forward before their
// backward (worker/stage_trainer.h): only their boundary tensors (inputs kept, sends queued) take memory. The planner simulates the same schedules (scheduler/cost_model.h).
// Every microbatch appears once as a forward and once as a backward, each backward after its forward, and
// backwards in microbatch order (so the last stage's backwards can start as soon as their forward is done).
#pragma once

#include <string>
#include <vector>

namespace geotrain {

enum class PipelineKind { kGPipe, k1F1B };

struct PipelineOp {
  bool forward = true;  // false: backward
  int microbatch = 0;
  bool operator==(const PipelineOp&) const = default;
};

std::vector<PipelineOp> MakePipelineSchedule(PipelineKind kind, int pp, int stage, int microbatches, int depth = 0);

// The 1F1B depth that covers a slow boundary: pp plus the microbatches a stage computes while one crosses the
// boundary and its gradient comes back, pp + ceil(2 x round_trip_share), where round_trip_share is
// one_way_seconds / microbatch_seconds (one way: the boundary's latency and the activation's transfer;
// microbatch: the forward and backward of the slowest stage). A round trip under a tenth of a microbatch
// needs no extra depth; the result is at most max(pp, microbatches). Non-positive times give pp.
int PipelineDepthFor(int pp, int microbatches, double one_way_seconds, double microbatch_seconds);

// "F0 F1 B0 F2 B1 B2", for logs and test messages.
std::string ScheduleToString(const std::vector<PipelineOp>& schedule);

}  // namespace geotrain
