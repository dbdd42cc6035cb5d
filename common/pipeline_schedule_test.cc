// The pipeline schedules (pipeline_schedule.h): orders, depth, and the depth that covers a slow boundary.
#include "common/pipeline_schedule.h"

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"

namespace geotrain {
namespace {

TEST(PipelineScheduleTest, GPipeAndOneFOneBOrders) {
  EXPECT_EQ(ScheduleToString(MakePipelineSchedule(PipelineKind::kGPipe, 2, 0, 3)), "F0 F1 F2 B0 B1 B2");
  EXPECT_EQ(ScheduleToString(MakePipelineSchedule(PipelineKind::k1F1B, 4, 0, 6)),
            "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
  EXPECT_EQ(ScheduleToString(MakePipelineSchedule(PipelineKind::k1F1B, 4, 3, 3)), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(ScheduleToString(MakePipelineSchedule(PipelineKind::k1F1B, 8, 0, 2)), "F0 F1 B0 B1");
}

// A deeper pipeline (parallel.pipeline_depth) runs more warm-up forwards before the first backward, so that a
// stage keeps computing while a microbatch crosses a slow link and its gradient comes back.
TEST(PipelineScheduleTest, DepthAbovePipelineStagesAddsWarmUpForwards) {
  EXPECT_EQ(ScheduleToString(MakePipelineSchedule(PipelineKind::k1F1B, 2, 0, 6, 4)),
            "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
  EXPECT_EQ(ScheduleToString(MakePipelineSchedule(PipelineKind::k1F1B, 3, 1, 6, 4)),
            "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5");
  // The last stage has no one downstream to wait for: no extra warm-up.
  EXPECT_EQ(ScheduleToString(MakePipelineSchedule(PipelineKind::k1F1B, 2, 1, 3, 4)), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(ScheduleToString(MakePipelineSchedule(PipelineKind::k1F1B, 2, 0, 6, 1)),
            ScheduleToString(MakePipelineSchedule(PipelineKind::k1F1B, 2, 0, 6)));  // never below pp
  EXPECT_EQ(ScheduleToString(MakePipelineSchedule(PipelineKind::k1F1B, 2, 0, 3, 8)), "F0 F1 F2 B0 B1 B2");
}

TEST(PipelineScheduleTest, EveryMicrobatchOnceForwardThenBackward) {
  for (PipelineKind kind : {PipelineKind::kGPipe, PipelineKind::k1F1B}) {
    for (int pp = 1; pp <= 5; ++pp) {
      for (int stage = 0; stage < pp; ++stage) {
        for (int M = 1; M <= 9; ++M) {
          std::vector<int> forward_at(M, -1), backward_at(M, -1);
          const std::vector<PipelineOp> ops = MakePipelineSchedule(kind, pp, stage, M);
          ASSERT_EQ(ops.size(), 2u * M);
          int in_flight = 0, max_in_flight = 0;
          for (size_t i = 0; i < ops.size(); ++i) {
            int& at = ops[i].forward ? forward_at[ops[i].microbatch] : backward_at[ops[i].microbatch];
            ASSERT_EQ(at, -1) << ScheduleToString(ops);
            at = static_cast<int>(i);
            in_flight += ops[i].forward ? 1 : -1;
            max_in_flight = std::max(max_in_flight, in_flight);
          }
          for (int m = 0; m < M; ++m) {
            EXPECT_LT(forward_at[m], backward_at[m]);
            if (m > 0) EXPECT_LT(backward_at[m - 1], backward_at[m]);
          }
          // 1F1B bounds the microbatches in flight by the stages after this one.
          if (kind == PipelineKind::k1F1B) EXPECT_LE(max_in_flight, std::max(1, std::min(M, pp - stage)));
        }
      }
    }
  }
}

// The depth covers the round trip: pp plus ceil(2 x one way / microbatch time), capped at the microbatches.
TEST(PipelineScheduleTest, DepthForCoversTheRoundTrip) {
  EXPECT_EQ(PipelineDepthFor(2, 16, 0.050, 0.030), 2 + 4);  // 100 ms round trip / 30 ms: 3.33 -> 4 more
  EXPECT_EQ(PipelineDepthFor(2, 16, 0.050, 0.100), 2 + 1);  // one microbatch covers it
  EXPECT_EQ(PipelineDepthFor(2, 16, 0.001, 0.100), 2);      // a round trip under a tenth of a microbatch
  EXPECT_EQ(PipelineDepthFor(2, 8, 0.050, 0.001), 8);       // at most the microbatches
  EXPECT_EQ(PipelineDepthFor(4, 2, 0.050, 0.001), 4);       // never below pp
  EXPECT_EQ(PipelineDepthFor(1, 16, 0.050, 0.030), 1);      // one stage: nothing to cover
  EXPECT_EQ(PipelineDepthFor(3, 16, 0.050, 0.0), 3);        // no time known
}

}  // namespace
}  // namespace geotrain
