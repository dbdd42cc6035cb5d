// A heal's state transfer between two stage trainers of one job in this process, on real tensor streams
// (StageTrainer::SendState / ReceiveState; head/job_heal.h).
#include <cstring>

#include "worker/stage_actor_testing.h"
#include "worker/stage_trainer.h"

namespace geotrain::worker {
namespace {

using actor_testing::kToken;
using ::testing::HasSubstr;

// Two replicas of a one-stage job, each with its own mailbox and collectives, driven step by step.
class HealTransferTest : public actor_testing::StageActorTest {
 protected:
  void MakeReplicas(const JobSpec& spec) {
    for (int r = 0; r < 2; ++r) {
      const int port = StartMailbox();
      ASSERT_NE(port, 0);
      factories_.push_back(
          std::make_unique<GrpcCollectivesFactory>(mailboxes_.back().get(), kToken, nullptr, absl::Seconds(30)));
      ActorPeer p;
      p.set_actor_id(absl::StrCat("job-1-r", r, "s0t0"));
      p.set_replica(r);
      p.set_worker_id(p.actor_id());
      p.set_site(r == 0 ? "site-a" : "site-b");
      p.set_address(absl::StrCat("127.0.0.1:", port));
      p.set_device_kind(DEVICE_KIND_CPU);
      peers_.push_back(p);
    }
    for (int r = 0; r < 2; ++r) {
      ActorRecord me;
      me.set_actor_id(peers_[r].actor_id());
      me.set_job_id("job-1");
      me.set_replica(r);
      absl::StatusOr<ActorRanks> ranks = ActorRanks::Create(spec, me, peers_, peers_[r].site());
      ASSERT_TRUE(ranks.ok()) << ranks.status();
      ranks_.push_back(*ranks);
    }
  }
  // Replica r's trainer in membership `epoch` of `replicas`.
  std::unique_ptr<StageTrainer> Trainer(const JobSpec& spec, int r, int64_t epoch, std::vector<int> replicas) {
    absl::StatusOr<std::unique_ptr<StageTrainer>> t = StageTrainer::Create(
        spec, ranks_[r].Regrouped(epoch, std::move(replicas)), peers_, factories_[r].get(), "cpu", 0);
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? *std::move(t) : nullptr;
  }
  // Both trainers' `step` at once (their all-reduces meet).
  void StepBoth(StageTrainer& a, StageTrainer& b, int64_t step) {
    std::atomic<bool> stop{false};
    absl::Status sa;
    std::thread other([&] { sa = a.Step(step, stop).status(); });
    absl::Status sb = b.Step(step, stop).status();
    other.join();
    ASSERT_TRUE(sa.ok()) << sa;
    ASSERT_TRUE(sb.ok()) << sb;
  }
  // Weights, AdamW moments and step, loss scale, completed step and data position are equal bit for bit.
  void ExpectBitIdentical(StageTrainer& a, StageTrainer& b, const std::string& when) {
    const int64_t n = a.stage().num_params();
    ASSERT_EQ(n, b.stage().num_params());
    EXPECT_EQ(std::memcmp(a.stage().params(), b.stage().params(), static_cast<size_t>(n) * sizeof(float)), 0) << when;
    std::vector<float> am, av, bm, bv;
    ASSERT_TRUE(a.optimizer().CopyMomentsToHost(&am, &av).ok());
    ASSERT_TRUE(b.optimizer().CopyMomentsToHost(&bm, &bv).ok());
    EXPECT_EQ(std::memcmp(am.data(), bm.data(), am.size() * sizeof(float)), 0) << when;
    EXPECT_EQ(std::memcmp(av.data(), bv.data(), av.size() * sizeof(float)), 0) << when;
    EXPECT_EQ(a.optimizer().step(), b.optimizer().step()) << when;
    const model::LossScaleState& sa = a.optimizer().loss_scaler().state();
    const model::LossScaleState& sb = b.optimizer().loss_scaler().state();
    EXPECT_EQ(std::memcmp(&sa.scale, &sb.scale, sizeof(sa.scale)), 0) << when;
    EXPECT_EQ(sa.clean_steps, sb.clean_steps) << when;
    EXPECT_EQ(sa.skipped, sb.skipped) << when;
    EXPECT_EQ(a.completed_step(), b.completed_step()) << when;
    ASSERT_NE(a.loader(), nullptr);
    ASSERT_NE(b.loader(), nullptr);
    EXPECT_EQ(a.loader()->position().shard, b.loader()->position().shard) << when;
    EXPECT_EQ(a.loader()->position().offset, b.loader()->position().offset) << when;
    EXPECT_EQ(a.loader()->position().epoch, b.loader()->position().epoch) << when;
  }

  std::vector<std::unique_ptr<GrpcCollectivesFactory>> factories_;
  std::vector<ActorPeer> peers_;
  std::vector<ActorRanks> ranks_;
};

// Replica 0 trains three steps alone (the membership a fault left); a fresh replica 1 joins: replica 0 sends its
// state, and replica 1 holds exactly the same weights, optimizer state, loss scale, step and data position; after two
// steps together, the two are still bit-identical. fp16 (emulated here) so that the loss scale is real state.
TEST_F(HealTransferTest, TheJoiningReplicaIsBitIdenticalToItsDonorAndStaysSo) {
  JobSpec spec = Spec(2, 1, 1, 2, "1f1b", 8);
  spec.mutable_train()->set_precision("fp16");
  MakeReplicas(spec);
  std::unique_ptr<StageTrainer> donor = Trainer(spec, 0, 1, {0});
  ASSERT_NE(donor, nullptr);
  std::atomic<bool> stop{false};
  for (int64_t step = 1; step <= 3; ++step) ASSERT_TRUE(donor->Step(step, stop).ok());
  std::unique_ptr<StageTrainer> joiner = Trainer(spec, 1, 2, {0, 1});
  ASSERT_NE(joiner, nullptr);
  ASSERT_TRUE(donor->Regroup(ranks_[0].Regrouped(2, {0, 1}), peers_, factories_[0].get(), 0).ok());
  absl::StatusOr<uint64_t> sent;
  std::thread sender([&] { sent = donor->SendState({1}); });
  absl::StatusOr<uint64_t> received = joiner->ReceiveState(0);
  sender.join();
  ASSERT_TRUE(sent.ok()) << sent.status();
  ASSERT_TRUE(received.ok()) << received.status();
  EXPECT_EQ(joiner->completed_step(), 3);
  EXPECT_EQ(joiner->optimizer().step(), 3);
  ExpectBitIdentical(*donor, *joiner, "after the transfer");
  StepBoth(*donor, *joiner, 4);
  StepBoth(*donor, *joiner, 5);
  ExpectBitIdentical(*donor, *joiner, "after two steps together");
}

// A joining stage of another model size refuses the state before it uses any of it: its weights stay its own.
TEST_F(HealTransferTest, AStateOfAnotherStageIsRefused) {
  JobSpec spec = Spec(2, 1, 1, 2, "1f1b", 8);
  MakeReplicas(spec);
  std::unique_ptr<StageTrainer> donor = Trainer(spec, 0, 2, {0, 1});
  ASSERT_NE(donor, nullptr);
  // The joiner's stage: the same plan with one more layer (another parameter count).
  absl::StatusOr<GPT2Config> config = GPT2Config::FromSpec(spec.model());
  ASSERT_TRUE(config.ok()) << config.status();
  JobSpec bigger = spec;
  bigger.mutable_model()->set_n_layer(config->n_layer + 1);
  std::unique_ptr<StageTrainer> joiner = Trainer(bigger, 1, 2, {0, 1});
  ASSERT_NE(joiner, nullptr);
  std::vector<float> before(joiner->stage().params(), joiner->stage().params() + joiner->stage().num_params());
  std::thread sender([&] { (void)donor->SendState({1}); });
  absl::StatusOr<uint64_t> received = joiner->ReceiveState(0);
  sender.join();
  ASSERT_FALSE(received.ok());
  EXPECT_EQ(received.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(received.status().message(), HasSubstr("the replicas' plans differ"));
  EXPECT_EQ(std::memcmp(before.data(), joiner->stage().params(), before.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace geotrain::worker
