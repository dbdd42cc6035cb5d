// Spec and topology loading: the mapping, defaults, and errors that name the key and the file.
#include "common/spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace geotrain {
namespace {

using ::testing::HasSubstr;

TEST(SpecTest, ParsesTheArchitectureExample) {
  JobSpec spec;
  ASSERT_TRUE(ParseYamlOrJson(R"(
name: fortunes-small
model: {preset: gpt2-small-test}
data: {train: data/fortunes/train_*.bin, val: data/fortunes/val_*.bin}
train: {global_batch: 32, seq_len: 128, steps: 300, lr: 6.0e-4, warmup_steps: 20, weight_decay: 0.1, grad_clip: 1.0, seed: 1}
parallel: {plan: manual, dp: 2, pp: 2, tp: 1, microbatches: 8, schedule: 1f1b}
comm: {wan_codec: bf16}
checkpoint: {dir: ckpt/fortunes, every_steps: 100}
)",
                              "job.yaml", &spec)
                  .ok());
  EXPECT_EQ(spec.name(), "fortunes-small");
  EXPECT_EQ(spec.train().global_batch(), 32);
  EXPECT_DOUBLE_EQ(spec.train().lr(), 6.0e-4);
  EXPECT_EQ(spec.train().seed(), 1u);
  EXPECT_EQ(spec.parallel().dp(), 2);
  EXPECT_EQ(spec.parallel().schedule(), "1f1b");
  EXPECT_EQ(spec.checkpoint().every_steps(), 100);
  ApplyJobDefaults(&spec);
  EXPECT_TRUE(ValidateJobSpec(spec).ok());
}

TEST(SpecTest, JsonWorksToo) {
  JobSpec spec;
  ASSERT_TRUE(ParseYamlOrJson(R"({"name": "j", "train": {"steps": 5, "seq_len": 16}})", "job.json", &spec).ok());
  EXPECT_EQ(spec.train().steps(), 5);
}

TEST(SpecTest, UnknownKeyIsNamedWithItsPathAndFile) {
  JobSpec spec;
  absl::Status s = ParseYamlOrJson("train: {stepz: 3}\n", "bad.yaml", &spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("bad.yaml"));
  EXPECT_THAT(s.message(), HasSubstr("'train.stepz'"));
  EXPECT_THAT(s.message(), HasSubstr("global_batch"));
}

TEST(SpecTest, WrongTypeIsNamed) {
  JobSpec spec;
  absl::Status s = ParseYamlOrJson("train: {steps: many}\n", "bad.yaml", &spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("train.steps"));
  EXPECT_THAT(s.message(), HasSubstr("'many'"));
  s = ParseYamlOrJson("model: 3\n", "bad.yaml", &spec);
  EXPECT_THAT(s.message(), HasSubstr("'model'"));
  s = ParseYamlOrJson("train: {steps: 9999999999}\n", "bad.yaml", &spec);
  EXPECT_THAT(s.message(), HasSubstr("32 bits"));
}

TEST(SpecTest, BrokenYamlGivesLine) {
  JobSpec spec;
  absl::Status s = ParseYamlOrJson("train: {steps: 3\nname: [", "broken.yaml", &spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("broken.yaml"));
  EXPECT_THAT(s.message(), HasSubstr("line"));
}

TEST(SpecTest, ValidationNamesTheKey) {
  JobSpec spec;
  ApplyJobDefaults(&spec);
  spec.mutable_parallel()->set_plan("manual");
  spec.mutable_parallel()->set_dp(3);
  spec.mutable_parallel()->set_microbatches(1);
  spec.mutable_train()->set_global_batch(8);
  absl::Status s = ValidateJobSpec(spec);
  EXPECT_THAT(s.message(), HasSubstr("train.global_batch"));
  spec.mutable_parallel()->set_schedule("zigzag");
  spec.mutable_train()->set_global_batch(9);
  EXPECT_THAT(ValidateJobSpec(spec).message(), HasSubstr("parallel.schedule"));
}

TEST(SpecTest, TopologyFillsKnownDevicesAndRejectsBadLinks) {
  Topology t;
  ASSERT_TRUE(ParseYamlOrJson(R"(
sites:
  - {name: utah, workers: [{device: RTX6000}, {device: rtx-6000}]}
  - {name: amsterdam, workers: [{device: T4}]}
links:
  - {a: utah, b: amsterdam, latency_ms: 51.5, bandwidth_mbps: 1000, jitter_ms: 1}
)",
                              "topo.yaml", &t)
                  .ok());
  ASSERT_TRUE(ValidateTopology(&t).ok());
  EXPECT_DOUBLE_EQ(t.sites(0).workers(1).mem_gb(), 24.0);
  EXPECT_DOUBLE_EQ(t.sites(1).workers(0).tflops(), 65.0);
  EXPECT_EQ(t.sites(1).workers(0).count(), 1);

  Topology bad = t;
  bad.mutable_links(0)->set_b("tokyo");
  EXPECT_THAT(ValidateTopology(&bad).message(), HasSubstr("unknown site 'tokyo'"));
  bad = t;
  bad.mutable_sites(1)->mutable_workers(0)->set_device("Z9000");
  bad.mutable_sites(1)->mutable_workers(0)->set_tflops(0);
  EXPECT_THAT(ValidateTopology(&bad).message(), HasSubstr("unknown device 'Z9000'"));
  bad = t;
  bad.mutable_sites(1)->set_name("utah");
  EXPECT_THAT(ValidateTopology(&bad).message(), HasSubstr("appears twice"));
}

}  // namespace
}  // namespace geotrain
