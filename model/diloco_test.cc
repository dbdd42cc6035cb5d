// DiLoCo's outer loop (model/diloco.h) and its simulation in the local trainer: the schedule, the fragments'
// cover of the parameters, the outer step's arithmetic, the degenerate cases that must equal synchronous
// training, an interrupted simulation that resumes from its checkpoint exactly, and a warm start from a
// synchronous run's checkpoint.
#include "model/diloco.h"

#include <cmath>
#include <filesystem>
#include <random>

#include "gtest/gtest.h"
#include "model/checkpoint_files.h"
#include "model/config.h"
#include "model/data.h"
#include "model/safetensors.h"
#include "model/trainer.h"

namespace geotrain::model {
namespace {

TEST(DilocoScheduleTest, OneFragmentSyncsBlockingEveryInnerStepsAndAtTheEnd) {
  const DilocoSchedule s{.inner_steps = 4, .fragments = 1, .total_steps = 10};
  std::vector<int64_t> sync_steps;
  for (int64_t step = 1; step <= 10; ++step) {
    EXPECT_TRUE(s.StartAtBeginning(step).empty());
    if (!s.BlockingAfter(step).empty()) sync_steps.push_back(step);
  }
  EXPECT_EQ(sync_steps, (std::vector<int64_t>{4, 8, 10}));
}

TEST(DilocoScheduleTest, PeriodsOfOneFragmentEndAtTheSyncs) {
  const DilocoSchedule s{.inner_steps = 4, .fragments = 1, .total_steps = 10};
  for (int64_t step = 1; step <= 10; ++step) {
    const int64_t start = s.PeriodStart(step);
    const int64_t end = start + s.PeriodLength(step) - 1;
    EXPECT_LE(start, step);
    EXPECT_GE(end, step);
    EXPECT_FALSE(s.BlockingAfter(end).empty()) << step;  // the period ends where the outer step is
    for (int64_t inside = start; inside < end; ++inside) EXPECT_TRUE(s.BlockingAfter(inside).empty()) << inside;
  }
  EXPECT_EQ(s.PeriodLength(9), 2);  // the last period is cut at total_steps
}

TEST(DilocoPacingTest, AGroupTwiceAsFastTakesTwiceTheInnerStepsSpreadOverThePeriod) {
  EXPECT_EQ(PlanPacedPeriod({0.2, 0.1}, 8), (std::vector<int>{8, 16}));
  // Rounded down: a group 1.9x as fast takes 15, not 16, so that the slowest never waits for it.
  EXPECT_EQ(PlanPacedPeriod({0.19, 0.1}, 8), (std::vector<int>{8, 15}));
  EXPECT_EQ(PlanPacedPeriod({1.0, 0.01}, 4), (std::vector<int>{4, 32}));  // at most 8x
  EXPECT_EQ(PlanPacedPeriod({0.2, 0.0}, 8), (std::vector<int>{8, 8}));    // a time unknown: count pacing
  EXPECT_EQ(PlanPacedPeriod({0.2, NAN}, 8), (std::vector<int>{8, 8}));
  for (int inner : {8, 11, 15, 16, 64}) {
    int sum = 0;
    for (int j = 0; j < 8; ++j) {
      const int k = PacedInnerSteps(inner, 8, j);
      EXPECT_GE(k, inner / 8);
      EXPECT_LE(k, inner / 8 + 1);
      sum += k;
    }
    EXPECT_EQ(sum, inner);
  }
}

TEST(DilocoScheduleTest, FragmentsTakeTurnsAndOverlapTheNextStep) {
  const DilocoSchedule s{.inner_steps = 4, .fragments = 2, .total_steps = 12};
  EXPECT_EQ(s.Offset(0), 2);
  EXPECT_EQ(s.Offset(1), 4);
  EXPECT_EQ(s.DueAfter(2), std::vector<int>{0});
  EXPECT_EQ(s.DueAfter(4), std::vector<int>{1});
  EXPECT_EQ(s.DueAfter(6), std::vector<int>{0});
  EXPECT_TRUE(s.DueAfter(5).empty());
  EXPECT_EQ(s.StartAtBeginning(3), std::vector<int>{0});  // due after step 2: runs during step 3
  EXPECT_EQ(s.StartAtBeginning(5), std::vector<int>{1});
  EXPECT_TRUE(s.BlockingAfter(4).empty());
  EXPECT_EQ(s.BlockingAfter(12), (std::vector<int>{0, 1}));  // the last step ends on the outer model
}

// diloco.inner_lr_scale scales the inner schedule only while DiLoCo is on: parallel.sync "sync" with a diloco
// block, and a job without one, train at train.lr's schedule.
TEST(TrainScheduleTest, TheInnerLearningRateScaleAppliesOnlyWithDiloco) {
  JobSpec spec;
  TrainSpec* t = spec.mutable_train();
  t->set_lr(1e-3);
  t->set_min_lr(1e-4);
  t->set_warmup_steps(2);
  t->set_steps(20);
  EXPECT_EQ(TrainSchedule(spec, 2).scale, 1.0);
  spec.mutable_diloco()->set_inner_steps(4);
  EXPECT_EQ(TrainSchedule(spec, 2).scale, std::sqrt(2.0));  // absent: sqrt of the groups
  EXPECT_EQ(TrainSchedule(spec, 4).scale, 2.0);
  EXPECT_EQ(TrainSchedule(spec, 1).scale, 1.0);
  spec.mutable_diloco()->set_inner_lr_scale(1.5);
  const LearningRateSchedule on = TrainSchedule(spec, 2);
  EXPECT_EQ(on.scale, 1.5);
  EXPECT_EQ(on.max_lr, 1e-3);
  EXPECT_EQ(on.min_lr, 1e-4);
  EXPECT_EQ(on.warmup_steps, 2);
  EXPECT_EQ(on.total_steps, 20);
  spec.mutable_parallel()->set_sync("sync");
  EXPECT_EQ(TrainSchedule(spec, 2).scale, 1.0);
  spec.mutable_parallel()->set_sync("diloco");
  EXPECT_EQ(TrainSchedule(spec, 2).scale, 1.5);
}

TEST(DilocoGroupsTest, ReplicasOfOneSiteShareAGroupNumberedByFirstReplica) {
  EXPECT_EQ(DilocoGroups({"b", "a", "b", "a"}), (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(DilocoGroups({"x"}), std::vector<int>{0});
}

class FragmentsTest : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

// Every parameter of a stage lies in exactly one fragment, for any split into stages.
TEST_P(FragmentsTest, CoverTheStageExactlyOnce) {
  const auto [fragments, stage_index, stages] = GetParam();
  GPT2Config config = *GPT2Config::FromPreset("gpt2-tiny-test");
  config.n_layer = 4;
  StageOptions options = StageOptions::Split(config, stage_index, stages);
  options.max_batch = 1;
  options.max_seq_len = 8;
  auto stage = GPT2Stage::Create(config, options);
  ASSERT_TRUE(stage.ok()) << stage.status();
  const auto ranges = FragmentRanges(**stage, fragments);
  ASSERT_EQ(static_cast<int>(ranges.size()), fragments);
  std::vector<int> covered((*stage)->num_params());
  for (const auto& fragment : ranges) {
    for (const ParamRange& r : fragment) {
      for (int64_t i = r.offset; i < r.offset + r.count; ++i) ++covered[i];
    }
  }
  for (int64_t i = 0; i < (*stage)->num_params(); ++i) ASSERT_EQ(covered[i], 1) << "parameter " << i;
}

INSTANTIATE_TEST_SUITE_P(Splits, FragmentsTest,
                         ::testing::Values(std::make_tuple(1, 0, 1), std::make_tuple(2, 0, 1), std::make_tuple(4, 0, 1),
                                           std::make_tuple(3, 0, 2), std::make_tuple(3, 1, 2),
                                           std::make_tuple(2, 1, 2)));

TEST(OuterOptimizerTest, NesterovMomentumStepByHand) {
  OuterOptimizer outer({{{0, 2}}}, 2, {.lr = 0.5, .momentum = 0.9, .nesterov = true});
  const float start[2] = {1.0f, -2.0f};
  outer.Initialize(start);
  float params[2] = {0.8f, -1.6f};  // the inner steps moved by (-0.2, +0.4)
  std::vector<float> delta;
  outer.PseudoGradient(0, params, &delta);
  EXPECT_FLOAT_EQ(delta[0], 0.2f);
  EXPECT_FLOAT_EQ(delta[1], -0.4f);
  outer.Step(0, delta.data());
  // v = d; u = d + 0.9 v = 1.9 d; theta = theta - 0.5 u.
  EXPECT_FLOAT_EQ(outer.outer_params()[0], 1.0f - 0.5f * 1.9f * 0.2f);
  EXPECT_FLOAT_EQ(outer.outer_params()[1], -2.0f + 0.5f * 1.9f * 0.4f);
  outer.Apply(0, params, nullptr);
  EXPECT_FLOAT_EQ(params[0], outer.outer_params()[0]);
  // A second step with the same pseudo-gradient: v = 0.9 d + d.
  params[0] = outer.outer_params()[0] - 0.2f;
  params[1] = outer.outer_params()[1] + 0.4f;
  const float before = outer.outer_params()[0];
  outer.PseudoGradient(0, params, &delta);
  outer.Step(0, delta.data());
  EXPECT_NEAR(outer.outer_params()[0], before - 0.5f * (0.2f + 0.9f * 1.9f * 0.2f), 1e-6);
}

TEST(OuterOptimizerTest, LearningRateOneWithoutMomentumTakesTheAveragedParameters) {
  OuterOptimizer outer({{{0, 3}}}, 3, {.lr = 1.0, .momentum = 0.0, .nesterov = true});
  const float start[3] = {1, 2, 3};
  outer.Initialize(start);
  const float a[3] = {1.5f, 1.0f, 3.0f}, b[3] = {0.5f, 2.0f, 4.0f};
  std::vector<float> da, db;
  outer.PseudoGradient(0, a, &da);
  outer.PseudoGradient(0, b, &db);
  std::vector<float> mean(3);
  for (int i = 0; i < 3; ++i) mean[i] = 0.5f * da[i] + 0.5f * db[i];
  outer.Step(0, mean.data());
  for (int i = 0; i < 3; ++i) EXPECT_FLOAT_EQ(outer.outer_params()[i], 0.5f * (a[i] + b[i]));
}

TEST(OuterOptimizerTest, ApplyWithASnapshotKeepsTheProgressMadeMeanwhile) {
  OuterOptimizer outer({{{1, 1}}}, 2, {.lr = 1.0, .momentum = 0.0, .nesterov = false});
  const float start[2] = {10, 20};
  outer.Initialize(start);
  float params[2] = {11, 21};
  std::vector<float> delta, snapshot;
  outer.PseudoGradient(0, params, &delta);
  outer.Pack(0, params, &snapshot);
  ASSERT_EQ(snapshot.size(), 1u);
  outer.Step(0, delta.data());  // theta_outer[1] = 21
  params[1] = 21.5f;            // the next step moved on by 0.5
  outer.Apply(0, params, snapshot.data());
  EXPECT_FLOAT_EQ(params[1], 21.5f);
  EXPECT_FLOAT_EQ(params[0], 11.0f);  // not in the fragment
}

class DilocoSimulationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / ("geotrain_diloco_test_" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(dir_);
    std::mt19937 rng(3);
    std::vector<uint16_t> tokens;
    for (int i = 0; i < 20000; ++i) tokens.push_back(rng() % 10 == 0 ? rng() % 64 : (i * 7) % 64);
    ASSERT_TRUE(WriteTokenShard(dir_ + "/train_000000.bin", tokens).ok());
    ASSERT_TRUE(
        WriteTokenShard(dir_ + "/val_000000.bin", std::vector<uint16_t>(tokens.begin(), tokens.begin() + 2000)).ok());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  JobSpec Spec(int dp, int steps) {
    JobSpec spec;
    spec.mutable_model()->set_n_layer(2);
    spec.mutable_model()->set_n_head(2);
    spec.mutable_model()->set_n_embd(32);
    spec.mutable_model()->set_block_size(32);
    spec.mutable_model()->set_vocab_size(64);
    spec.mutable_data()->set_train(dir_ + "/train_*.bin");
    spec.mutable_data()->set_val(dir_ + "/val_*.bin");
    TrainSpec* t = spec.mutable_train();
    t->set_global_batch(8);
    t->set_seq_len(16);
    t->set_steps(steps);
    t->set_lr(3e-3);
    t->set_min_lr(3e-4);
    t->set_warmup_steps(2);
    t->set_weight_decay(0.1);
    t->set_grad_clip(1.0);
    t->set_seed(9);
    t->set_eval_every(3);
    t->set_eval_batches(2);
    t->set_beta1(0.9);
    t->set_beta2(0.95);
    spec.mutable_parallel()->set_dp(dp);
    spec.mutable_parallel()->set_microbatches(2);
    return spec;
  }
  JobSpec Diloco(JobSpec spec, int inner_steps, double lr, double momentum, int fragments, bool two_sites) {
    DilocoSpec* d = spec.mutable_diloco();
    d->set_inner_steps(inner_steps);
    d->set_outer_lr(lr);
    d->set_outer_momentum(momentum);
    d->set_fragments(fragments);
    for (int r = 0; two_sites && r < spec.parallel().dp(); ++r) {
      PlacementSpec* p = spec.mutable_parallel()->add_placement();
      p->set_replica(r);
      p->set_site(r % 2 == 0 ? "a" : "b");
    }
    return spec;
  }
  std::vector<StepRecord> Run(const JobSpec& spec, LocalTrainOptions options = {}) {
    FILE* sink = std::fopen("/dev/null", "w");
    options.out = sink;
    LocalTrainer trainer;
    absl::Status s = trainer.Run(spec, options);
    std::fclose(sink);
    EXPECT_TRUE(s.ok()) << s;
    return trainer.history();
  }
  std::string dir_;
};

// One group (every replica in one site) with outer lr 1 and no momentum: the outer step sets the
// parameters to themselves (theta - (theta - p): p up to one rounding), so DiLoCo is synchronous data
// parallelism.
TEST_F(DilocoSimulationTest, OneGroupWithLearningRateOneAndNoMomentumIsSynchronousDataParallelism) {
  JobSpec diloco = Diloco(Spec(2, 6), 1, 1.0, 0.0, 1, false);
  for (int r = 0; r < 2; ++r) {
    PlacementSpec* p = diloco.mutable_parallel()->add_placement();
    p->set_replica(r);
    p->set_site("same");
  }
  const std::vector<StepRecord> sync = Run(Spec(2, 6)), outer = Run(diloco);
  ASSERT_EQ(sync.size(), outer.size());
  for (size_t i = 0; i < sync.size(); ++i) {
    EXPECT_NEAR(sync[i].loss, outer[i].loss, 1e-5 * sync[i].loss) << "step " << i + 1;
    EXPECT_NEAR(sync[i].val_loss, outer[i].val_loss, 1e-5 * std::abs(sync[i].val_loss)) << "step " << i + 1;
  }
}

// Two sites, inner_steps 1, outer lr 1, no momentum: every step ends on the mean of the sites' parameters
// (each site took its own AdamW step on its half of the batch). Close to synchronous DP, not equal: the mean
// of two AdamW updates is not the AdamW update of the mean gradient.
TEST_F(DilocoSimulationTest, TwoSitesWithInnerStepsOneStayCloseToSynchronous) {
  const std::vector<StepRecord> sync = Run(Spec(2, 8)), outer = Run(Diloco(Spec(2, 8), 1, 1.0, 0.0, 1, true));
  ASSERT_EQ(sync.size(), outer.size());
  EXPECT_NE(sync.back().loss, outer.back().loss);
  EXPECT_NEAR(sync.back().val_loss, outer.back().val_loss, 0.05 * sync.back().val_loss);
  EXPECT_LT(outer.back().loss, outer.front().loss);
}

// A DiLoCo simulation interrupted between outer steps (groups apart, a fragment's exchange due) resumes
// from its checkpoint (every group's weights and moments, the outer state) with exactly the same numbers.
TEST_F(DilocoSimulationTest, InterruptedSimulationResumesExactly) {
  auto spec = [&](const std::string& ckpt) {
    JobSpec s = Diloco(Spec(2, 10), 4, 0.7, 0.9, 2, true);
    s.mutable_checkpoint()->set_dir(ckpt);
    s.mutable_checkpoint()->set_every_steps(3);
    return s;
  };
  const std::vector<StepRecord> full = Run(spec(dir_ + "/full"));
  ASSERT_EQ(full.size(), 10u);
  LocalTrainOptions options;
  options.stop_after_step = 7;  // checkpoint at step 6: after fragment 0's sync point, before fragment 1's
  Run(spec(dir_ + "/resumed"), options);
  options.stop_after_step = 0;
  options.resume = true;
  const std::vector<StepRecord> resumed = Run(spec(dir_ + "/resumed"), options);
  ASSERT_EQ(resumed.size(), 4u);  // steps 7..10
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_EQ(resumed[i].loss, full[6 + i].loss) << "step " << resumed[i].step;
    EXPECT_EQ(resumed[i].val_loss, full[6 + i].val_loss) << "step " << resumed[i].step;
  }
}

// A warm start (docs/diloco.md): DiLoCo resumed from a synchronous run's checkpoint. Every group starts from
// its weights, moments and data position, so the loss of the first step after the resume is the synchronous
// run's; the outer state starts from its weights (not the initial ones) with zero momentum; then the sites go
// apart.
TEST_F(DilocoSimulationTest, WarmStartFromASynchronousCheckpoint) {
  JobSpec sync = Spec(2, 10);
  sync.mutable_checkpoint()->set_dir(dir_ + "/sync");
  sync.mutable_checkpoint()->set_every_steps(4);
  sync.mutable_checkpoint()->set_keep(-1);
  const std::vector<StepRecord> synchronous = Run(sync);
  ASSERT_EQ(synchronous.size(), 10u);

  JobSpec warm = Diloco(Spec(2, 10), 3, 0.7, 0.9, 1, true);  // outer steps after steps 6, 9 and 10
  warm.mutable_checkpoint()->set_resume_from(StepDirectory(dir_ + "/sync", 4));
  warm.mutable_checkpoint()->set_dir(dir_ + "/warm");
  warm.mutable_checkpoint()->set_every_steps(1);
  warm.mutable_checkpoint()->set_keep(-1);
  const std::vector<StepRecord> resumed = Run(warm);
  ASSERT_EQ(resumed.size(), 6u);
  EXPECT_EQ(resumed.front().step, 5);
  EXPECT_NEAR(resumed.front().loss, synchronous[4].loss, 1e-5 * synchronous[4].loss);

  // Before the first outer step (the checkpoint after step 5): theta_outer = the synchronous weights at step 4.
  absl::StatusOr<SafetensorsFile> weights = ReadSafetensors(StepDirectory(dir_ + "/sync", 4) + "/model.safetensors");
  absl::StatusOr<SafetensorsFile> outer = ReadSafetensors(StepDirectory(dir_ + "/warm", 5) + "/diloco.safetensors");
  ASSERT_TRUE(weights.ok()) << weights.status();
  ASSERT_TRUE(outer.ok()) << outer.status();
  ASSERT_FALSE(weights->tensors.empty());
  for (const NamedTensor& w : weights->tensors) {
    const NamedTensor* theta = outer->Find("outer." + w.name);
    const NamedTensor* momentum = outer->Find("outer_m." + w.name);
    ASSERT_NE(theta, nullptr) << w.name;
    ASSERT_NE(momentum, nullptr) << w.name;
    EXPECT_EQ(theta->data, w.data) << w.name;
    EXPECT_EQ(momentum->data, std::vector<float>(w.data.size(), 0.0f)) << w.name;
  }
  EXPECT_NE(resumed.back().loss, synchronous.back().loss);
  EXPECT_NEAR(resumed.back().val_loss, synchronous.back().val_loss, 0.05 * synchronous.back().val_loss);

  // One site (one group), outer lr 1, no momentum: DiLoCo is synchronous DP, so a warm start from step 4 must
  // go on as the synchronous run did: its AdamW moments, step count and schedule came from the checkpoint.
  JobSpec one_site = Diloco(Spec(2, 10), 1, 1.0, 0.0, 1, false);
  for (int r = 0; r < 2; ++r) {
    PlacementSpec* p = one_site.mutable_parallel()->add_placement();
    p->set_replica(r);
    p->set_site("same");
  }
  one_site.mutable_checkpoint()->set_resume_from(StepDirectory(dir_ + "/sync", 4));
  const std::vector<StepRecord> same = Run(one_site);
  ASSERT_EQ(same.size(), 6u);
  for (size_t i = 0; i < same.size(); ++i) {
    EXPECT_NEAR(same[i].loss, synchronous[4 + i].loss, 1e-5 * synchronous[4 + i].loss) << "step " << same[i].step;
    EXPECT_NEAR(same[i].val_loss, synchronous[4 + i].val_loss, 1e-5 * std::abs(synchronous[4 + i].val_loss))
        << "step " << same[i].step;
  }
}

// A DiLoCo checkpoint verifies only with every group's weights and moments: one whose manifest lacks group 1's
// optimizer file is refused, naming it, instead of resuming group 1 from another group's state.
TEST_F(DilocoSimulationTest, CheckpointWithoutAGroupsFilesDoesNotVerify) {
  JobSpec s = Diloco(Spec(2, 3), 2, 0.7, 0.9, 1, true);
  s.mutable_checkpoint()->set_dir(dir_ + "/ckpt");
  s.mutable_checkpoint()->set_every_steps(3);
  ASSERT_EQ(Run(s).size(), 3u);
  const std::string step_dir = StepDirectory(dir_ + "/ckpt", 3);
  absl::StatusOr<CheckpointManifest> manifest = VerifyCheckpoint(step_dir);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->diloco_groups(), 2);
  ASSERT_TRUE(manifest->files().contains("optimizer-g1.safetensors"));
  manifest->mutable_files()->erase("optimizer-g1.safetensors");
  ASSERT_TRUE(WriteManifest(step_dir, *manifest).ok());
  const absl::Status refused = VerifyCheckpoint(step_dir).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kDataLoss) << refused;
  EXPECT_NE(refused.message().find("model-g1.safetensors"), std::string::npos) << refused;
}

}  // namespace
}  // namespace geotrain::model
