// Stage actors of one job in one process (worker/stage_actor_testing.h): the job's losses and validation losses
// equal the single-process LocalTrainer's under every plan (pipelines, data and tensor parallelism, DiLoCo, fp16), and
// its gradients cross the sites once.
#include "worker/stage_actor_testing.h"

namespace geotrain::worker {
namespace {

using actor_testing::StageActorTest;

TEST_F(StageActorTest, PipelineGPipeEqualsLocal) { ExpectEqualToLocal(Spec(1, 2, 1, 4, "gpipe", 4)); }

TEST_F(StageActorTest, PipelineOneFOneBEqualsLocal) { ExpectEqualToLocal(Spec(1, 2, 1, 4, "1f1b", 4)); }

TEST_F(StageActorTest, DeeperOneFOneBEqualsLocal) {
  JobSpec spec = Spec(1, 2, 1, 4, "1f1b", 3);
  spec.mutable_parallel()->set_pipeline_depth(4);
  ExpectEqualToLocal(spec);
}

TEST_F(StageActorTest, DataParallelBucketsEqualLocal) { ExpectEqualToLocal(Spec(2, 1, 1, 2, "1f1b", 4)); }

TEST_F(StageActorTest, DataAndPipelineAcrossTwoSitesEqualLocal) { ExpectEqualToLocal(Spec(2, 2, 1, 2, "1f1b", 3)); }

// Four replicas in two sites (alternating, so that a flat ring over them would cross the sites at every hop): the
// gradient all-reduce is hierarchical, each site's sum crossing once each way per step (twice the model's fp32
// bytes over both directions, where the ring of four would send six times them), and training equals local.
TEST_F(StageActorTest, DataParallelAcrossTwoSitesSendsEachSitesSumAcrossOnce) {
  ExpectEveryGradientAcrossOnceAndEqualToLocal(Spec(4, 1, 1, 1, "1f1b", 3));
}

// Two pipelines of two stages, one per site: the tied embedding's four copies are summed by one all-reduce, each
// site's two copies crossing once each way, and the stages' buckets leave wte out (it used to cross once per
// stage: 1.5x the model's bytes each way for this model).
TEST_F(StageActorTest, TiedEmbeddingOfPipelinesInTwoSitesCrossesOnce) {
  ExpectEveryGradientAcrossOnceAndEqualToLocal(Spec(2, 2, 1, 2, "1f1b", 3));
}

// Two replicas of two tensor-parallel ranks, one replica per site: each tp rank's data-parallel pair sums only its
// half of the replicated tensors (the embeddings above all) and gathers the other half from its tp peer inside the
// site, so every gradient crosses once each way (each tp rank's pair used to send all of them: 1.4x the model's
// bytes each way for this model).
TEST_F(StageActorTest, TensorParallelReplicasInTwoSitesSendEachGradientAcrossOnce) {
  ExpectEveryGradientAcrossOnceAndEqualToLocal(Spec(2, 1, 2, 2, "1f1b", 3));
}

// The same with pipelines of two stages: the tied all-reduce of wte sums each tp rank's half of it too.
TEST_F(StageActorTest, TensorParallelPipelinesInTwoSitesSendEachGradientAcrossOnce) {
  ExpectEveryGradientAcrossOnceAndEqualToLocal(Spec(2, 2, 2, 2, "1f1b", 3));
}

TEST_F(StageActorTest, TensorParallelEqualsLocal) { ExpectEqualToLocal(Spec(1, 1, 2, 2, "1f1b", 3)); }

// Validation on the cluster: each replica's last stage evaluates its slice of data.val through the
// pipeline; the mean over replicas equals `train --local`'s validation loss.
TEST_F(StageActorTest, ValidationLossOfDataAndPipelineEqualsLocal) {
  ExpectEqualToLocal(WithValidation(Spec(2, 2, 1, 2, "1f1b", 4), 2, 3));
}

// The validation set does not depend on the plan: two pipelined replicas of two microbatches each report the
// validation loss that one process without microbatches computes (eval_batches global batches of data.val).
TEST_F(StageActorTest, ValidationLossEqualsLocalUnderAnotherPlan) {
  const JobSpec reference = WithValidation(Spec(1, 1, 1, 1, "1f1b", 4), 2, 3);
  ExpectEqualToLocal(WithValidation(Spec(2, 2, 1, 2, "1f1b", 4), 2, 3), 1e-4, &reference);
}

TEST_F(StageActorTest, ValidationLossWithTensorParallelEqualsLocal) {
  ExpectEqualToLocal(WithValidation(Spec(1, 1, 2, 2, "1f1b", 3), 3, 2));
}

// DiLoCo across the two sites equals the one-process simulation of the same algorithm (train --local with
// the same diloco block): one replica per site (exact up to summation order), with momentum and Nesterov.
TEST_F(StageActorTest, DilocoAcrossTwoSitesEqualsLocalSimulation) {
  ExpectEqualToLocal(WithValidation(WithDiloco(Spec(2, 1, 1, 2, "1f1b", 7), 3, 1, "none"), 2, 2));
}

// diloco.inner_lr_scale: the stages' inner AdamW takes the scaled (capped) schedule, as the simulation does, and the
// scale changes the training (so the equality above is not of two runs that ignore it).
TEST_F(StageActorTest, DilocoInnerLearningRateScaleEqualsLocalSimulation) {
  const JobSpec plain = WithDiloco(Spec(2, 1, 1, 2, "1f1b", 7), 3, 1, "none");
  JobSpec scaled = plain;
  scaled.mutable_diloco()->set_inner_lr_scale(1.5);
  ExpectEqualToLocal(scaled);
  const std::vector<float> with = LocalLosses(scaled), without = LocalLosses(plain);
  ASSERT_EQ(with.size(), without.size());
  EXPECT_EQ(with[0], without[0]);  // the first step's loss comes before any update
  EXPECT_GT(std::abs(with.back() - without.back()), 1e-4);
}

// Two replicas per site: synchronous inside each site, outer steps across; pipelines of two stages.
TEST_F(StageActorTest, DilocoGroupsOfTwoPipelinedEqualLocalSimulation) {
  ExpectEqualToLocal(WithDiloco(Spec(4, 2, 1, 1, "1f1b", 4), 2, 1, "none"), 1e-4);
}

// Streaming DiLoCo: two fragments synced in turn, each exchange overlapped with the next step.
TEST_F(StageActorTest, DilocoFragmentsOverlappedEqualLocalSimulation) {
  ExpectEqualToLocal(WithValidation(WithDiloco(Spec(2, 2, 1, 2, "1f1b", 8), 4, 2, "none"), 4, 1));
}

// Tensor parallelism inside the sites: each tp rank's leaders exchange their shard's pseudo-gradient, and tp rank
// 0's the replicated tensors' too, which it hands to the other rank inside the site; the job equals the simulation.
// With int8 the replicated part is rounded once, by tp rank 0: the outer bytes across are the model's once each
// way per outer step (in int8: 1 + 4/256 bytes a value), where every tp rank sent the replicated tensors before.
TEST_F(StageActorTest, DilocoWithTensorParallelismEqualsLocalSimulation) {
  ExpectEqualToLocal(WithDiloco(Spec(2, 1, 2, 2, "1f1b", 4), 2, 1, "none"), 1e-5);
}

TEST_F(StageActorTest, DilocoWithTensorParallelismSendsTheReplicatedTensorsOnce) {
  const JobSpec spec = WithDiloco(Spec(2, 1, 2, 2, "1f1b", 4), 2, 1, "int8");
  StartJob(spec, 30000);
  ASSERT_TRUE(WaitFinished(120));
  double outer_bytes = 0;
  for (const StepReport& r : head_.reports()) {
    EXPECT_TRUE(r.error().empty()) << r.error();
    for (const auto& [pair, bytes] : r.figures().wan_bytes_by_pair()) outer_bytes += static_cast<double>(bytes);
  }
  absl::StatusOr<GPT2Config> config = GPT2Config::FromPreset("gpt2-tiny-test");
  ASSERT_TRUE(config.ok());
  const double int8_model = static_cast<double>(config->NumParameters()) * (1 + 4.0 / 256);
  // Two outer steps in 4 steps (inner_steps 2), each sending the model once each way.
  EXPECT_GE(outer_bytes, 2 * 2 * int8_model);
  EXPECT_LT(outer_bytes, 2 * 2 * int8_model * 1.05);
  const std::vector<float> losses = ReportedLosses();
  const std::vector<float> rounded = LocalLosses(spec);
  ASSERT_EQ(losses.size(), rounded.size());
  EXPECT_NEAR(losses.back(), rounded.back(), 1e-3 * rounded.back());  // tp packs the fragments otherwise
}

// A lossy codec for the pseudo-gradients (int8): the job equals the simulation that rounds each site's
// pseudo-gradient as the cluster's pair exchange does, trains (loss falls), and stays near the exact run; the
// rounding is real (the simulation with it differs from the exact one).
TEST_F(StageActorTest, DilocoWithInt8PseudoGradientsEqualsTheRoundingSimulation) {
  const JobSpec spec = WithValidation(WithDiloco(Spec(2, 1, 1, 2, "1f1b", 6), 2, 1, "int8"), 3, 2);
  // To 5e-7: the rounding moves the losses by about 2e-6 of themselves from step 3 (the first after an outer step),
  // the cluster stays within 1e-7 of the simulation that rounds.
  ExpectEqualToLocal(spec, 5e-7);
  const std::vector<float> losses = ReportedLosses(), rounded = LocalLosses(spec),
                           exact = LocalLosses(WithDiloco(Spec(2, 1, 1, 2, "1f1b", 6), 2, 1, "none"));
  ASSERT_EQ(losses.size(), exact.size());
  EXPECT_LT(losses.back(), losses.front());
  EXPECT_NEAR(losses.back(), exact.back(), 0.02 * exact.back());
  EXPECT_NE(rounded.back(), exact.back());
  uint64_t outer_bytes = 0;
  for (const StepReport& r : head_.reports()) {
    for (const auto& [pair, bytes] : r.figures().wan_bytes_by_pair()) outer_bytes += bytes;
  }
  EXPECT_GT(outer_bytes, 0u);  // the outer exchanges cross the sites, and are counted
}

// int4 and sparse pseudo-gradients, with their error feedback (kept per fragment by the leaders' communicator, per
// group and fragment by the simulation): the job equals the simulation that rounds them alike (ExpectLowBitOuter).
TEST_F(StageActorTest, DilocoWithInt4PseudoGradientsEqualsTheRoundingSimulation) { ExpectLowBitOuter("int4"); }

TEST_F(StageActorTest, DilocoWithSparsePseudoGradientsEqualsTheRoundingSimulation) { ExpectLowBitOuter("sparse"); }

// diloco.sync time with site-b's CPU slowed 4x (the worker's --slowdown): the first two steps are count-paced (nothing
// measured yet), then the groups' times of those two plan the rest of the first period, and each outer step plans the
// next period: the group measured slower takes one inner step a step, and each step's tokens are every group's inner
// steps' tokens. The groups meet after step 2 (to plan) and at every outer step. Every actor ends
// cleanly.
TEST_F(StageActorTest, DilocoPacedByTimePlansFromMeasuredTimesAndCountsEveryGroupsTokens) {
  RunTimePacedWithSiteBSlowed(Spec(2, 1, 1, 2, "1f1b", 8), "none");
  std::map<int64_t, std::map<std::string, StepFigures>> by_step;  // step -> site -> figures
  for (const StepReport& r : head_.reports()) {
    ASSERT_TRUE(r.error().empty()) << r.actor_id() << ": " << r.error();
    if (r.step() > 0) by_step[r.step()][r.actor_id().find("r0") != std::string::npos ? "a" : "b"] = r.figures();
  }
  ASSERT_EQ(by_step.size(), 8u);
  const int64_t replica_tokens = 4 * 16;  // global batch 8 over two replicas, 16 tokens each
  int inner_a = 0, inner_b = 0;           // over steps 3-8, the planned ones
  for (const auto& [step, sites] : by_step) {
    ASSERT_EQ(sites.size(), 2u) << step;
    const StepFigures &a = sites.at("a"), &b = sites.at("b");
    // Whichever group the plan found slower (the times are measured, on a machine that may be busy) takes one.
    EXPECT_EQ(std::min(a.inner_steps(), b.inner_steps()), 1) << step;
    EXPECT_EQ(b.slowdown(), 4) << step;
    EXPECT_EQ(a.slowdown(), 0) << step;
    if (step <= 2) EXPECT_EQ(a.inner_steps(), 1) << step;
    if (step > 2) inner_a += a.inner_steps(), inner_b += b.inner_steps();
    EXPECT_GE(a.inner_steps(), 1) << step;
    EXPECT_EQ(a.replica_tokens(), a.inner_steps() * replica_tokens) << step;
    EXPECT_EQ(a.tokens(), (a.inner_steps() + b.inner_steps()) * replica_tokens) << step;
    EXPECT_EQ(b.tokens(), a.tokens()) << step;
    EXPECT_TRUE(std::isfinite(a.loss()) && std::isfinite(b.loss())) << step;
    EXPECT_EQ(a.outer_sync_seconds() > 0, step == 2 || step % 4 == 0) << step;
  }
  // Which site takes more depends on the times measured (this test runs beside others; runtime_unequal_sites checks
  // that a site 6x slower takes fewer, with real processes): here only the cap of 8x holds whatever they were.
  EXPECT_LE(inner_a + inner_b, 6 * 9);
}

// The same with two pipeline stages per replica and a short last period (10 steps, inner_steps 4): a replica's
// stages take the same inner steps in every step (they share one plan), or the pipeline would hang.
TEST_F(StageActorTest, DilocoPacedByTimeKeepsAReplicasStagesInStep) {
  RunTimePacedWithSiteBSlowed(Spec(2, 2, 1, 2, "1f1b", 10), "int8");
  std::map<std::pair<int64_t, char>, std::set<int>> inner;  // (step, replica) -> the inner steps its stages took
  for (const StepReport& r : head_.reports()) {
    ASSERT_TRUE(r.error().empty()) << r.actor_id() << ": " << r.error();
    if (r.step() > 0) inner[{r.step(), r.actor_id()[7]}].insert(r.figures().inner_steps());  // "job-1-r0s1t0"
  }
  ASSERT_EQ(inner.size(), 20u);
  std::map<int64_t, int> fewest;  // step -> the fewer inner steps of the two replicas
  for (const auto& [key, counts] : inner) {
    EXPECT_EQ(counts.size(), 1u) << "step " << key.first << " replica " << key.second;
    auto [it, first] = fewest.try_emplace(key.first, *counts.begin());
    if (!first) it->second = std::min(it->second, *counts.begin());
  }
  // Whichever group the plan found slower (measured times, on a machine that may be busy) takes one a step.
  for (const auto& [step, n] : fewest) EXPECT_EQ(n, 1) << step;
}

// Timed compute takes DiLoCo jobs for their timing: the steps are emulated (no loss), and the outer steps send the
// (zero) pseudo-gradients across the sites at their real size, every inner_steps steps only.
TEST_F(StageActorTest, DilocoOnTimedComputeExchangesAtTheOuterStepsOnly) {
  device_ = "timed:H100@400:2680:5";
  StartJob(WithDiloco(Spec(2, 1, 1, 2, "1f1b", 6), 3, 1, "int8"), 30000);
  ASSERT_TRUE(WaitFinished(120));
  for (auto& a : actors_) EXPECT_EQ(a->Record().message(), "finished");
  int reports = 0;
  for (const StepReport& r : head_.reports()) {
    ASSERT_TRUE(r.error().empty()) << r.actor_id() << ": " << r.error();
    if (r.step() == 0) continue;
    ++reports;
    EXPECT_TRUE(r.figures().timed_compute()) << r.step();
    EXPECT_EQ(r.figures().wan_bytes() > 0, r.step() % 3 == 0) << r.actor_id() << " step " << r.step();
  }
  EXPECT_EQ(reports, 12);
}

// fp16 with a scale far too large (2^40) on DP2 x PP2 across two "sites": the first steps overflow; every actor of
// the job skips exactly those steps and halves the scale each time (one decision, from the all-reduced gradient
// norm), then the job trains; its losses equal the single-process simulation's, which skips the same steps.
TEST_F(StageActorTest, Fp16OverflowSkipsTheSameStepsOnEveryActorAndEqualsLocal) {
  JobSpec spec = WithValidation(Spec(2, 2, 1, 2, "1f1b", 20), 10, 1);
  spec.mutable_train()->set_precision("fp16");
  spec.mutable_train()->mutable_loss_scale()->set_initial(std::ldexp(1.0, 40));
  ExpectEqualToLocal(spec, 1e-5);
  const std::vector<model::StepRecord> local = LocalHistory(spec);
  int skips = 0;
  for (const model::StepRecord& r : local) skips += r.skipped;
  ASSERT_GE(skips, 2);
  std::map<std::string, int> reports_of;
  for (const StepReport& r : head_.reports()) {
    if (r.step() == 0 || !r.error().empty()) continue;
    const model::StepRecord& want = local[r.step() - 1];
    EXPECT_EQ(r.figures().skipped(), want.skipped) << r.actor_id() << " step " << r.step();
    EXPECT_EQ(r.figures().loss_scale(), want.loss_scale) << r.actor_id() << " step " << r.step();
    ++reports_of[r.actor_id()];
  }
  EXPECT_EQ(reports_of.size(), 4u);
  for (const auto& [actor, n] : reports_of) EXPECT_EQ(n, 20) << actor;
  for (int i = 0; i < skips; ++i) EXPECT_EQ(local[i].loss_scale, std::ldexp(1.0, 40 - i));
  EXPECT_FALSE(local.back().skipped);
}

}  // namespace
}  // namespace geotrain::worker
