// Spec and topology loading: the mapping, defaults, and errors that name the key and the file.
#include "common/spec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>

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

TEST(SpecTest, ValuesAreBoundedAndTheErrorNamesTheLimit) {
  // Each spec parses and has the right types; a value past its bound is refused naming the key, the range and
  // the value, whether it came from YAML or JSON.
  const struct {
    const char* text;
    const char* key;
  } cases[] = {
      {"train: {steps: 2000000000}", "train.steps must be in [1, 1000000000] (got 2000000000)"},
      {"train: {global_batch: 100000000}", "train.global_batch must be in [1, 1048576]"},
      {"train: {seq_len: 1000000}", "train.seq_len"},
      {"train: {lr: 100}", "train.lr must be in [0, 10] (got 100)"},
      {"train: {beta2: 1.5}", "train.beta2"},
      {"model: {n_layer: 100000, n_head: 1, n_embd: 8, block_size: 8, vocab_size: 8}", "model.n_layer"},
      {"model: {n_layer: 1, n_head: 1, n_embd: 8, block_size: 8, vocab_size: 2000000000}", "model.vocab_size"},
      {"parallel: {dp: 100000}", "parallel.dp must be in [1, 4096]"},
      {"parallel: {dp: 4096, pp: 4096}", "parallel.dp x pp x tp"},
      {"parallel: {microbatches: 1000000}", "parallel.microbatches"},
      {"comm: {chunk_bytes: 1000000000000}", "comm.chunk_bytes"},
      {"checkpoint: {every_steps: 2000000000}", "checkpoint.every_steps"},
      {"fault_tolerance: {max_restarts: 2000000000}", "fault_tolerance.max_restarts"},
      {"diloco: {inner_steps: 8, inner_lr_scale: 11}", "diloco.inner_lr_scale must be in (0, 10]"},
      {"diloco: {inner_steps: 8, inner_lr_scale: -1}", "diloco.inner_lr_scale must be in (0, 10]"},
      {"diloco: {inner_steps: 8, sync: wall}", "diloco.sync must be steps or time"},
      {"diloco: {inner_steps: 8, sync: time, fragments: 2}", "it needs diloco.fragments 1"},
      {"{\"name\": \"x\", \"train\": {\"steps\": 2000000000}}", "train.steps"},
  };
  for (const auto& c : cases) {
    JobSpec spec;
    ASSERT_TRUE(ParseYamlOrJson(c.text, "spec.yaml", &spec).ok()) << c.text;
    ApplyJobDefaults(&spec);
    const absl::Status s = ValidateJobSpec(spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(s.message(), HasSubstr(c.key)) << c.text;
  }
  // The scale's bound is inclusive at 10, and only a job that trains with DiLoCo is held to it.
  for (const char* text : {"diloco: {inner_steps: 8, inner_lr_scale: 10}", "diloco: {inner_steps: 8, sync: time}",
                           "parallel: {sync: sync}\ndiloco: {inner_steps: 8, inner_lr_scale: 11}"}) {
    JobSpec spec;
    ASSERT_TRUE(ParseYamlOrJson(text, "spec.yaml", &spec).ok()) << text;
    ApplyJobDefaults(&spec);
    EXPECT_TRUE(ValidateJobSpec(spec).ok()) << text << ": " << ValidateJobSpec(spec);
  }
  JobSpec long_name;
  long_name.set_name(std::string(kSpecLimits.max_name_bytes + 1, 'j'));
  ApplyJobDefaults(&long_name);
  EXPECT_THAT(ValidateJobSpec(long_name).message(), HasSubstr("name (bytes) must be in [0, 256]"));
  // The bounds themselves are accepted.
  JobSpec edge;
  edge.mutable_train()->set_steps(kSpecLimits.max_steps);
  edge.mutable_parallel()->set_dp(kSpecLimits.max_parallel);
  ApplyJobDefaults(&edge);
  edge.mutable_train()->set_global_batch(kSpecLimits.max_parallel * 2);
  EXPECT_TRUE(ValidateJobSpec(edge).ok()) << ValidateJobSpec(edge);

  Topology t;
  ASSERT_TRUE(ParseYamlOrJson("sites: [{name: a, workers: [{device: T4, count: 100000}]}]", "t.yaml", &t).ok());
  EXPECT_THAT(ValidateTopology(&t).message(), HasSubstr("worker count must be in [1, 1024]"));
  ASSERT_TRUE(ParseYamlOrJson("sites: [{name: a}, {name: b}]\nlinks: [{a: a, b: b}]", "t.yaml", &t).ok());
  t.mutable_links(0)->set_bandwidth_mbps(std::numeric_limits<double>::infinity());  // JSON's "Infinity"
  EXPECT_THAT(ValidateTopology(&t).message(), HasSubstr("bandwidth_mbps"));
  JobSpec nan_lr;
  ApplyJobDefaults(&nan_lr);
  nan_lr.mutable_train()->set_lr(std::numeric_limits<double>::quiet_NaN());
  EXPECT_THAT(ValidateJobSpec(nan_lr).message(), HasSubstr("train.lr"));
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
  // A known GPU brings its compute capability and fp32 peak, which plans that train in fp32 use.
  EXPECT_EQ(t.sites(1).workers(0).compute_capability(), 75);
  EXPECT_DOUBLE_EQ(t.sites(1).workers(0).fp32_tflops(), FindKnownDevice("T4")->fp32_tflops);

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
  bad = t;
  bad.mutable_sites(1)->mutable_workers(0)->set_fp32_tflops(-1);
  EXPECT_THAT(ValidateTopology(&bad).message(), HasSubstr("fp32_tflops"));
}

}  // namespace
}  // namespace geotrain
