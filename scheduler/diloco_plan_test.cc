// Synchronous training or DiLoCo: across a slow link the planner takes DiLoCo (with the numbers that made it
// choose), inside one fast site it keeps synchronous training, and the predicted WAN bytes follow the
// inner_steps, codec and sites.
#include "scheduler/diloco_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "common/spec.h"
#include "spec.pb.h"

namespace geotrain::scheduler {
namespace {

using ::testing::HasSubstr;

// Two sites of `per_site` A30s; site b's declared `b_tflops` (0: the A30's).
Cluster TwoSites(double latency_ms, double mbps, int per_site = 2, double b_tflops = 0) {
  Topology t;
  for (const char* name : {"a", "b"}) {
    TopologySite* site = t.add_sites();
    site->set_name(name);
    TopologyWorker* w = site->add_workers();
    w->set_device("A30");
    w->set_count(per_site);
    if (std::string(name) == "b" && b_tflops > 0) w->set_tflops(b_tflops);
  }
  TopologyLink* link = t.add_links();
  link->set_a("a");
  link->set_b("b");
  link->set_latency_ms(latency_ms);
  link->set_bandwidth_mbps(mbps);
  EXPECT_TRUE(ValidateTopology(&t).ok());
  absl::StatusOr<Cluster> c = ClusterFromTopology(t);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

DilocoSpec Block(int inner_steps, const std::string& codec, int fragments = 1) {
  JobSpec spec;
  spec.mutable_diloco()->set_inner_steps(inner_steps);
  spec.mutable_diloco()->set_codec(codec);
  spec.mutable_diloco()->set_fragments(fragments);
  return EffectiveDiloco(spec);
}

struct Planned {
  PlanResult sync;
  DilocoChoice choice;
};

Planned Plan(const Cluster& cluster, const DilocoSpec& block, int global_batch = 32) {
  const ModelCosts model = ModelCosts::FromConfig(*GPT2Config::FromPreset("gpt2"), 1024);
  JobOptions job;
  job.global_batch = global_batch;
  job.seq_len = 1024;
  job.codecs.push_back(*ParseCodec("bf16"));
  PlannerOptions options;
  options.runtime_plans = true;
  Planned out;
  absl::StatusOr<PlanResult> sync = PlanJob(cluster, model, job, options);
  EXPECT_TRUE(sync.ok()) << sync.status();
  out.sync = *sync;
  absl::StatusOr<DilocoChoice> choice = ChooseSyncOrDiloco(cluster, model, job, options, *sync, block);
  EXPECT_TRUE(choice.ok()) << choice.status();
  out.choice = *choice;
  return out;
}

TEST(DilocoPlanTest, SlowLinkBetweenSitesChoosesDilocoAndSaysWhy) {
  const Planned p = Plan(TwoSites(100, 1000), Block(32, "int8"));
  const DilocoChoice& c = p.choice;
  ASSERT_TRUE(c.diloco_possible) << c.why_not;
  EXPECT_TRUE(c.diloco_chosen);
  EXPECT_EQ(c.diloco_sites, 2);
  EXPECT_LT(c.diloco_step_s, c.sync_step_s);
  EXPECT_GT(c.diloco_step_s, c.inner_step_s);  // the exchange costs something
  // Its plan uses both sites (more devices than the synchronous plan that stays in one).
  EXPECT_GE(c.diloco.plan.dp, 2);
  EXPECT_EQ(c.sync_step_s, p.sync.ranked.front().prediction.step_time_s);
  ASSERT_EQ(c.explanation.size(), 4u);  // equal sites: no word on time pacing
  EXPECT_THAT(c.explanation[0], HasSubstr("synchronous"));
  EXPECT_THAT(c.explanation[1], HasSubstr("inner_steps 32, codec int8"));
  EXPECT_THAT(c.explanation[2], HasSubstr("other codecs for the pseudo-gradients"));
  EXPECT_THAT(c.explanation[2], HasSubstr("int4"));
  EXPECT_THAT(c.explanation[2], HasSubstr("sparse:0.02:2"));
  EXPECT_THAT(c.explanation[3], HasSubstr("chose DiLoCo"));
  ASSERT_EQ(c.group_step_s.size(), 2u);
  EXPECT_NEAR(c.group_step_s[0], c.group_step_s[1], 1e-9);
  EXPECT_DOUBLE_EQ(c.time_paced_gain, 1);
}

// Site b's GPUs half as fast (the same device with half the TFLOP/s): count pacing waits for b at every outer step;
// time pacing lets a take about twice the inner steps, and the planner says so, and with sync time predicts the
// shorter time per global batch.
TEST(DilocoPlanTest, SitesOfUnequalSpeedAreOfferedTimePacing) {
  const Cluster cluster = TwoSites(100, 1000, 2, /*b_tflops=*/20);  // well under an A30's
  const DilocoChoice counted = Plan(cluster, Block(32, "int8")).choice;
  ASSERT_TRUE(counted.diloco_possible) << counted.why_not;
  ASSERT_EQ(counted.group_step_s.size(), 2u);
  EXPECT_LT(counted.group_step_s[0], counted.group_step_s[1]);
  // Equal groups: a takes floor(32 k) inner steps per outer step where b takes 32 (k: how much faster a is).
  const double k = counted.group_step_s[1] / counted.group_step_s[0];
  EXPECT_GT(k, 1.5);
  EXPECT_NEAR(counted.time_paced_gain, (std::min(std::floor(32 * k), 256.0) + 32) / 64, 1e-9);
  EXPECT_THAT(counted.explanation[2], HasSubstr("diloco.sync time would let the faster"));
  DilocoSpec block = Block(32, "int8");
  block.set_sync("time");
  const DilocoChoice paced = Plan(cluster, block).choice;
  EXPECT_TRUE(paced.time_paced);
  EXPECT_DOUBLE_EQ(paced.diloco_step_s, counted.diloco_step_s);  // a job step: the measured step's prediction
  EXPECT_NEAR(paced.diloco_batch_s, counted.diloco_step_s / counted.time_paced_gain, 1e-9);
  EXPECT_DOUBLE_EQ(counted.diloco_batch_s, counted.diloco_step_s);
  EXPECT_THAT(paced.explanation[2], HasSubstr("paced by time"));
}

TEST(DilocoPlanTest, FastLinkKeepsSynchronousTraining) {
  const DilocoChoice c = Plan(TwoSites(0.05, 100000), Block(32, "int8")).choice;
  ASSERT_TRUE(c.diloco_possible);
  EXPECT_FALSE(c.diloco_chosen);
  EXPECT_THAT(c.explanation.back(), HasSubstr("chose synchronous"));
}

TEST(DilocoPlanTest, WanBytesFollowInnerStepsAndCodec) {
  const Cluster cluster = TwoSites(100, 100);
  const DilocoChoice h8 = Plan(cluster, Block(8, "none")).choice, h32 = Plan(cluster, Block(32, "none")).choice,
                     h32_int8 = Plan(cluster, Block(32, "int8")).choice;
  ASSERT_GT(h32.diloco_wan_bytes_per_step, 0);
  EXPECT_NEAR(h8.diloco_wan_bytes_per_step / h32.diloco_wan_bytes_per_step, 4.0, 1e-9);
  EXPECT_LT(h32_int8.diloco_wan_bytes_per_step, 0.3 * h32.diloco_wan_bytes_per_step);
  // Two sites: each leader sends (S - 1) / S x 2 of the parameters per exchange: 2 (S-1) P 4 / H in all.
  const ModelCosts model = ModelCosts::FromConfig(*GPT2Config::FromPreset("gpt2"), 1024);
  double parameters = 0;
  for (const LayerCost& l : model.layers) parameters += l.parameters;
  EXPECT_NEAR(h32.diloco_wan_bytes_per_step, 2.0 * parameters * 4 / 32, 1.0);
}

TEST(DilocoPlanTest, OverlappedFragmentsHideTheExchangeBehindTheNextStep) {
  // Inner steps long enough (a large batch) to cover a quarter of the exchange, not all of it.
  const Cluster cluster = TwoSites(100, 1000);
  const DilocoChoice one = Plan(cluster, Block(32, "int8", 1), 256).choice,
                     four = Plan(cluster, Block(32, "int8", 4), 256).choice;
  EXPECT_GT(one.outer_exchange_s, one.inner_step_s / 4);
  EXPECT_GT(one.diloco_step_s, one.inner_step_s);
  EXPECT_EQ(four.diloco_step_s, four.inner_step_s);  // hidden
  EXPECT_NEAR(four.diloco_wan_bytes_per_step, one.diloco_wan_bytes_per_step, 1e-6);
}

TEST(DilocoPlanTest, OneSiteCannotRunDiloco) {
  Topology t;
  TopologySite* site = t.add_sites();
  site->set_name("only");
  TopologyWorker* w = site->add_workers();
  w->set_device("A30");
  w->set_count(4);
  ASSERT_TRUE(ValidateTopology(&t).ok());
  const DilocoChoice c = Plan(*ClusterFromTopology(t), Block(32, "int8")).choice;
  EXPECT_FALSE(c.diloco_possible);
  EXPECT_FALSE(c.diloco_chosen);
  EXPECT_THAT(c.explanation.back(), HasSubstr("not possible"));
}

}  // namespace
}  // namespace geotrain::scheduler
