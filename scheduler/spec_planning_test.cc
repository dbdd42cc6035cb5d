// Job specs in the planner's terms: the WAN codec as the runtime parses it (+zstd included), the runtime's
// plan shape, and the memory of an actor as the simulator counts it.
#include "scheduler/spec_planning.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/spec.h"
#include "spec.pb.h"

namespace geotrain::scheduler {
namespace {

JobSpec Spec(const std::string& wan_codec, int dp, int pp, int microbatches, const std::string& schedule) {
  JobSpec spec;
  spec.mutable_model()->set_preset("gpt2-small-test");
  spec.mutable_train()->set_global_batch(16);
  spec.mutable_train()->set_seq_len(64);
  spec.mutable_comm()->set_wan_codec(wan_codec);
  ParallelSpec* parallel = spec.mutable_parallel();
  parallel->set_plan("manual");
  parallel->set_dp(dp);
  parallel->set_pp(pp);
  parallel->set_tp(1);
  parallel->set_microbatches(microbatches);
  parallel->set_schedule(schedule);
  ApplyJobDefaults(&spec);
  return spec;
}

TEST(SpecPlanningTest, TheWanCodecIsPlannedAsTheRuntimeParsesIt) {
  absl::StatusOr<SpecPlanning> zstd = PlanningForSpec(Spec("bf16+zstd", 1, 1, 1, "1f1b"));
  ASSERT_TRUE(zstd.ok()) << zstd.status();
  ASSERT_EQ(zstd->job.codecs.size(), 1u);
  EXPECT_EQ(zstd->job.codecs[0].name, "bf16+zstd");
  EXPECT_LT(zstd->job.codecs[0].ratio, ParseCodec("bf16")->ratio);  // compressed, and a little more than bf16
  EXPECT_TRUE(zstd->job.sequential_sync);
  EXPECT_TRUE(zstd->options.runtime_plans);
  EXPECT_EQ(zstd->job.global_batch, 16);
  EXPECT_EQ(zstd->model.seq_len, 64);

  // As the runtime sends it: on every link, and its precision resolved as the head resolves it.
  EXPECT_TRUE(zstd->job.codec_on_every_link);
  EXPECT_FALSE(zstd->job.finite_only_codec);
  JobSpec int8_fp32 = Spec("int8", 1, 1, 1, "1f1b");
  int8_fp32.mutable_train()->set_precision("fp32");
  absl::StatusOr<SpecPlanning> int8 = PlanningForSpec(int8_fp32);
  ASSERT_TRUE(int8.ok()) << int8.status();
  EXPECT_TRUE(int8->job.finite_only_codec);
  EXPECT_EQ(int8->job.precision, "fp32");

  absl::StatusOr<SpecPlanning> none = PlanningForSpec(Spec("none", 1, 1, 1, "1f1b"));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->job.codecs.empty());

  absl::StatusOr<SpecPlanning> bad = PlanningForSpec(Spec("zip", 1, 1, 1, "1f1b"));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), testing::HasSubstr("comm.wan_codec"));
}

TEST(SpecPlanningTest, TheRuntimePlanShapeSplitsTheBatchEvenly) {
  const JobSpec spec = Spec("bf16", 2, 2, 4, "gpipe");
  absl::StatusOr<SpecPlanning> planning = PlanningForSpec(spec);
  ASSERT_TRUE(planning.ok()) << planning.status();
  absl::StatusOr<Plan> plan = RuntimePlanShape(spec, planning->model);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->microbatch_size, 2);  // 16 sequences / (2 replicas x 4 microbatches)
  EXPECT_THAT(plan->microbatches, testing::ElementsAre(4, 4));
  EXPECT_EQ(plan->schedule, Schedule::kGPipe);
  EXPECT_EQ(plan->stage_begin, RuntimeStageBegin(planning->model, 2));
  EXPECT_FALSE(RuntimePlanShape(Spec("bf16", 1, 3, 1, "1f1b"), planning->model).ok());  // 2 blocks
  EXPECT_EQ(plan->pipeline_depth, 0);  // none given: the simulator chooses, as the head does
  JobSpec deep = Spec("bf16", 1, 2, 8, "1f1b");
  deep.mutable_parallel()->set_pipeline_depth(5);  // the runtime runs the spec's depth: so is it predicted
  absl::StatusOr<Plan> given = RuntimePlanShape(deep, planning->model);
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(given->pipeline_depth, 5);
}

TEST(SpecPlanningTest, StageMemoryIsTheSimulatorsCount) {
  // The simulator's memory of every device of the spec's plan, placed on a cluster, is what the head's
  // placement checks for that stage.
  for (const char* schedule : {"1f1b", "gpipe"}) {
    const JobSpec spec = Spec("bf16", 2, 2, 4, schedule);
    absl::StatusOr<SpecPlanning> planning = PlanningForSpec(spec);
    ASSERT_TRUE(planning.ok()) << planning.status();
    absl::StatusOr<Plan> plan = RuntimePlanShape(spec, planning->model);
    ASSERT_TRUE(plan.ok()) << plan.status();
    Cluster cluster;
    cluster.site_names = {"a"};
    cluster.links = {{LinkSpec{1e-4, 1e9}}};
    plan->devices.assign(2, std::vector<std::vector<int>>(2, std::vector<int>(1)));
    for (int r = 0; r < 2; ++r) {
      for (int s = 0; s < 2; ++s) {
        plan->devices[r][s][0] = static_cast<int>(cluster.devices.size());
        cluster.devices.push_back(Device{0, r * 2 + s, 0, "T4", 65, 16e9});
      }
    }
    absl::StatusOr<Prediction> prediction = Simulate(cluster, planning->model, planning->job, *plan);
    ASSERT_TRUE(prediction.ok()) << prediction.status();
    for (int s = 0; s < 2; ++s) {
      absl::StatusOr<double> bytes = SpecStageMemoryBytes(spec, s);
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      EXPECT_DOUBLE_EQ(*bytes, prediction->device_memory_bytes[plan->devices[0][s][0]]) << schedule << " stage " << s;
    }
    EXPECT_FALSE(SpecStageMemoryBytes(spec, 2).ok());
  }
}

}  // namespace
}  // namespace geotrain::scheduler
