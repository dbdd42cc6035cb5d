// The local trainer: loss goes down, validation runs, and a run interrupted and resumed from its
// checkpoint continues with exactly the numbers of an uninterrupted run.
#include "model/trainer.h"

#include <filesystem>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "model/data.h"

namespace geotrain::model {
namespace {

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / ("geotrain_trainer_test_" + std::to_string(::getpid()))).string();
    std::filesystem::create_directories(dir_);
    // A learnable sequence: a repeating pattern with a little noise.
    std::mt19937 rng(3);
    std::vector<uint16_t> tokens;
    for (int i = 0; i < 20000; ++i) tokens.push_back(rng() % 10 == 0 ? rng() % 64 : (i * 7) % 64);
    ASSERT_TRUE(WriteTokenShard(dir_ + "/train_000000.bin", tokens).ok());
    ASSERT_TRUE(
        WriteTokenShard(dir_ + "/val_000000.bin", std::vector<uint16_t>(tokens.begin(), tokens.begin() + 2000)).ok());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  JobSpec Spec(const std::string& ckpt) {
    JobSpec spec;
    spec.mutable_model()->set_n_layer(2);
    spec.mutable_model()->set_n_head(2);
    spec.mutable_model()->set_n_embd(32);
    spec.mutable_model()->set_block_size(32);
    spec.mutable_model()->set_vocab_size(64);
    spec.mutable_data()->set_train(dir_ + "/train_*.bin");
    spec.mutable_data()->set_val(dir_ + "/val_*.bin");
    TrainSpec* t = spec.mutable_train();
    t->set_global_batch(4);
    t->set_seq_len(32);
    t->set_steps(12);
    t->set_lr(3e-3);
    t->set_min_lr(3e-4);
    t->set_warmup_steps(2);
    t->set_weight_decay(0.1);
    t->set_grad_clip(1.0);
    t->set_seed(9);
    t->set_eval_every(6);
    t->set_eval_batches(2);
    t->set_beta1(0.9);
    t->set_beta2(0.95);
    spec.mutable_parallel()->set_microbatches(2);
    spec.mutable_checkpoint()->set_dir(ckpt);
    spec.mutable_checkpoint()->set_every_steps(5);
    return spec;
  }
  std::string dir_;
};

TEST_F(TrainerTest, LearnsAndResumesExactly) {
  FILE* sink = std::fopen("/dev/null", "w");
  LocalTrainer full;
  LocalTrainOptions options;
  options.out = sink;
  ASSERT_TRUE(full.Run(Spec(dir_ + "/ckpt_full"), options).ok());
  ASSERT_EQ(full.history().size(), 12u);
  EXPECT_LT(full.history().back().loss, full.history().front().loss - 0.5f);
  EXPECT_GE(full.history()[5].val_loss, 0.0f);
  EXPECT_LT(full.history()[6].val_loss, 0.0f);

  LocalTrainer first;
  options.stop_after_step = 7;  // checkpoint at step 5, then two steps that the resume repeats
  ASSERT_TRUE(first.Run(Spec(dir_ + "/ckpt_resumed"), options).ok());
  LocalTrainer second;
  options.stop_after_step = 0;
  options.resume = true;
  ASSERT_TRUE(second.Run(Spec(dir_ + "/ckpt_resumed"), options).ok());
  ASSERT_EQ(second.history().size(), 7u);  // steps 6..12
  for (size_t i = 0; i < second.history().size(); ++i) {
    EXPECT_EQ(second.history()[i].step, full.history()[5 + i].step);
    EXPECT_EQ(second.history()[i].loss, full.history()[5 + i].loss) << "step " << second.history()[i].step;
  }
  std::fclose(sink);
}

// The validation set is eval_batches global batches whatever the plan: the same job with other data-parallel
// replicas or microbatches reports the same validation loss (up to the order of float sums), so that two plans'
// quality can be compared.
TEST_F(TrainerTest, ValidationLossIsTheSameForEveryPlan) {
  FILE* sink = std::fopen("/dev/null", "w");
  LocalTrainOptions options;
  options.out = sink;
  std::vector<std::vector<float>> val_losses;
  for (const auto& [dp, micro] : std::vector<std::pair<int, int>>{{1, 1}, {1, 4}, {2, 2}, {4, 1}}) {
    JobSpec spec = Spec(dir_ + "/ckpt_dp" + std::to_string(dp) + "_mb" + std::to_string(micro));
    spec.mutable_parallel()->set_dp(dp);
    spec.mutable_parallel()->set_microbatches(micro);
    LocalTrainer trainer;
    ASSERT_TRUE(trainer.Run(spec, options).ok());
    std::vector<float> val;
    for (const StepRecord& r : trainer.history()) {
      if (r.val_loss >= 0) val.push_back(r.val_loss);
    }
    ASSERT_EQ(val.size(), 2u) << "dp " << dp << ", microbatches " << micro;  // steps 6 and 12
    val_losses.push_back(val);
  }
  for (size_t plan = 1; plan < val_losses.size(); ++plan) {
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_NEAR(val_losses[plan][i], val_losses[0][i], 1e-4 * val_losses[0][i]) << "plan " << plan << ", eval " << i;
    }
  }
  std::fclose(sink);
}

// A validation set smaller than one global batch is refused before training, with an error that names it.
TEST_F(TrainerTest, AValidationSetSmallerThanAGlobalBatchIsRefusedByName) {
  FILE* sink = std::fopen("/dev/null", "w");
  LocalTrainOptions options;
  options.out = sink;
  JobSpec spec = Spec(dir_ + "/ckpt_small_val");
  spec.mutable_train()->set_global_batch(64);  // 64 x 32 + 1 tokens: more than the 2000 of val_000000.bin
  LocalTrainer trainer;
  const absl::Status status = trainer.Run(spec, options);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("validation data (data.val"), std::string::npos) << status;
  EXPECT_NE(status.message().find("holds one step of 2049 tokens"), std::string::npos) << status;
  EXPECT_TRUE(trainer.history().empty());
  std::fclose(sink);
}

}  // namespace
}  // namespace geotrain::model
