// Pipeline schedules (see pipeline_schedule.h).
#include "common/pipeline_schedule.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace geotrain {

std::vector<PipelineOp> MakePipelineSchedule(PipelineKind kind, int pp, int stage, int microbatches, int depth) {
  const int M = std::max(0, microbatches);
  // The last stage waits on no one downstream: extra depth would only cost it recomputation.
  const int deepest = stage == pp - 1 ? pp : std::max(pp, depth);
  const int warmup = kind == PipelineKind::k1F1B ? std::clamp(deepest - stage - 1, 0, M) : M;
  std::vector<PipelineOp> out;
  out.reserve(2 * static_cast<size_t>(M));
  int next_forward = 0, next_backward = 0;
  for (; next_forward < warmup; ++next_forward) out.push_back({true, next_forward});
  while (next_backward < M) {
    if (next_forward < M) out.push_back({true, next_forward++});
    out.push_back({false, next_backward++});
  }
  return out;
}

int PipelineDepthFor(int pp, int microbatches, double one_way_seconds, double microbatch_seconds) {
  if (pp <= 1 || one_way_seconds <= 0 || microbatch_seconds <= 0) return std::max(pp, 1);
  const double round_trip = 2 * one_way_seconds / microbatch_seconds;
  if (round_trip < 0.1) return pp;
  const double deepest = std::max(pp, microbatches);
  return static_cast<int>(std::min(deepest, pp + std::ceil(round_trip)));
}

std::string ScheduleToString(const std::vector<PipelineOp>& schedule) {
  std::string out;
  for (const PipelineOp& op : schedule)
    absl::StrAppend(&out, out.empty() ? "" : " ", op.forward ? "F" : "B", op.microbatch);
  return out;
}

}  // namespace geotrain
