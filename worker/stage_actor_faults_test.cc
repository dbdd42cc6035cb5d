// Stage actors of one job in one process (worker/stage_actor_testing.h) when something stops or fails: a stop ends
// every actor without an error, a drain ends them after one common step with its checkpoint, a peer that fails ends
// the job with its error by the collective deadline, and a replica lost mid-job leaves the others training (a live
// regroup) as the one-process simulation without it.
#include <functional>
#include <memory>

#include "worker/stage_actor_testing.h"

namespace geotrain::worker {
namespace {

using actor_testing::kToken;
using actor_testing::RecordingHead;
using actor_testing::StageActorTest;
using ::testing::HasSubstr;

// A communicator whose sends fail from the n-th on: a peer whose link or process failed.
class FailingCommunicator : public comm::Communicator {
 public:
  FailingCommunicator(comm::Communicator* inner, int fail_from_send) : inner_(inner), fail_from_(fail_from_send) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status AllReduceSum(absl::Span<float> d, std::string_view tag) override { return inner_->AllReduceSum(d, tag); }
  absl::Status ReduceScatter(absl::Span<const float> in, absl::Span<float> out, std::string_view tag) override {
    return inner_->ReduceScatter(in, out, tag);
  }
  absl::Status AllGather(absl::Span<const float> in, absl::Span<float> out, std::string_view tag) override {
    return inner_->AllGather(in, out, tag);
  }
  absl::Status Broadcast(absl::Span<float> d, int root, std::string_view tag) override {
    return inner_->Broadcast(d, root, tag);
  }
  absl::Status Send(int peer, absl::Span<const float> d, std::string_view tag) override {
    if (++sends_ >= fail_from_) return absl::UnavailableError("injected: the link to the next stage is down");
    return inner_->Send(peer, d, tag);
  }
  absl::Status Recv(int peer, absl::Span<float> d, std::string_view tag) override { return inner_->Recv(peer, d, tag); }

 private:
  comm::Communicator* inner_;
  const int fail_from_;
  std::atomic<int> sends_{0};
};

// The gRPC collectives with a fault injected: `inject` edits the actor's copy of their pointers and flags, and returns
// what the edit needs kept alive (may be null).
class InjectingFactory : public CollectivesFactory {
 public:
  using Inject = std::function<std::shared_ptr<void>(StageCollectives& collectives)>;
  InjectingFactory(std::unique_ptr<CollectivesFactory> inner, Inject inject)
      : inner_(std::move(inner)), inject_(std::move(inject)) {}
  absl::StatusOr<std::unique_ptr<StageCollectives>> Create(const ActorRanks& ranks, const JobSpec& spec,
                                                           const std::vector<ActorPeer>& actors,
                                                           model::Backend* backend, int device_index) override {
    auto made = inner_->Create(ranks, spec, actors, backend, device_index);
    if (!made.ok()) return made.status();
    return std::unique_ptr<StageCollectives>(new Wrapped(std::move(*made), inject_));
  }

 private:
  class Wrapped : public StageCollectives {
   public:
    Wrapped(std::unique_ptr<StageCollectives> inner, const Inject& inject) : inner_(std::move(inner)) {
      static_cast<StageCollectives&>(*this) = *inner_;  // copy the pointers and flags
      kept_ = inject(*this);
    }
    uint64_t BytesSent(TrafficClass traffic) const override { return inner_->BytesSent(traffic); }
    void CancelReceives(bool stopped) override { inner_->CancelReceives(stopped); }

   private:
    std::unique_ptr<StageCollectives> inner_;
    std::shared_ptr<void> kept_;
  };
  std::unique_ptr<CollectivesFactory> inner_;
  const Inject inject_;
};

// The gRPC collectives, with the pipeline's sends failing from the n-th on.
std::unique_ptr<CollectivesFactory> FailingFactory(std::unique_ptr<CollectivesFactory> inner, int fail_from_send) {
  return std::make_unique<InjectingFactory>(std::move(inner), [fail_from_send](StageCollectives& c) {
    auto failing = std::make_shared<FailingCommunicator>(c.pipeline, fail_from_send);
    c.pipeline = failing.get();
    return std::shared_ptr<void>(failing);
  });
}

// The gRPC collectives of a replica whose worker dies once `dead` is set: from then on its data-parallel all-reduces
// fail before they send anything, so that its peers wait for it in theirs, as for a killed process.
std::unique_ptr<CollectivesFactory> DyingFactory(std::unique_ptr<CollectivesFactory> inner,
                                                 std::shared_ptr<std::atomic<bool>> dead) {
  return std::make_unique<InjectingFactory>(std::move(inner), [dead](StageCollectives& c) {
    c.dp_all_reduce = [reduce = c.dp_all_reduce, dead](absl::Span<float> data, std::string_view tag) {
      if (*dead) return absl::UnavailableError("injected: this replica's worker died");
      return reduce(data, tag);
    };
    return std::shared_ptr<void>();
  });
}

TEST_F(StageActorTest, AStopInTheMiddleEndsEveryActorWithoutAnError) {
  head_.StopFromStep(2);  // the head answers step 2's reports with stop
  StartJob(Spec(1, 2, 1, 2, "1f1b", 50), 5000);
  ASSERT_TRUE(WaitFinished(30));
  int64_t last_step = 0;
  for (const StepReport& r : head_.reports()) {
    EXPECT_TRUE(r.error().empty()) << r.error();  // a stopped actor reports no error
    last_step = std::max(last_step, r.step());
  }
  EXPECT_LT(last_step, 50);
  for (auto& a : actors_) {
    EXPECT_EQ(a->Record().state(), ACTOR_DEAD);
    EXPECT_THAT(a->Record().message(), HasSubstr("stop"));
  }
}

// A drain: every actor stops after the same step T, the last report of each says so (drained), replica 0's carry
// their stage's checkpoint shard of T, written into the directory the head named (the job has none of its own), and
// no actor trains past T. With the target moved once (an actor passed it unaware), the actors waiting at the first
// target train on to the second.
void ExpectDrainedAtOneStep(const RecordingHead& head, int64_t target, const std::string& dir) {
  std::map<std::string, const StepReport*> last;
  std::map<std::string, int64_t> newest_step;
  for (const StepReport& r : head.reports()) {
    EXPECT_TRUE(r.error().empty()) << r.actor_id() << ": " << r.error();
    newest_step[r.actor_id()] = std::max(newest_step[r.actor_id()], r.step());
  }
  const std::vector<StepReport> reports = head.reports();
  for (const StepReport& r : reports) last[r.actor_id()] = &r;
  ASSERT_EQ(last.size(), 4u);
  for (const auto& [actor, report] : last) {
    EXPECT_EQ(newest_step[actor], target) << actor << " trained past the drain's step";
    EXPECT_TRUE(report->drained()) << actor;
    EXPECT_EQ(report->drain_at_step(), target) << actor;
    for (const CheckpointShard& shard : report->checkpoints()) EXPECT_EQ(shard.step(), target);
  }
  // T's shards: with the last report, or with the report of T when the background write finished before it.
  std::set<std::string> writers;
  for (const StepReport& r : reports) {
    for (const CheckpointShard& shard : r.checkpoints()) {
      if (shard.step() != target) continue;
      EXPECT_TRUE(shard.error().empty()) << shard.error();
      EXPECT_EQ(shard.dir(), model::StepDirectory(dir, target));
      EXPECT_TRUE(writers.insert(r.actor_id()).second) << r.actor_id() << " reported its shard of T twice";
    }
  }
  EXPECT_EQ(writers.size(), 2u) << "replica 0's two stages";
  EXPECT_TRUE(std::filesystem::exists(model::StepDirectory(dir, target) + "/model-s0.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(model::StepDirectory(dir, target) + "/model-s1.safetensors"));
}

TEST_F(StageActorTest, ADrainEndsEveryActorAfterOneStepWithItsCheckpoint) {
  const std::string dir = dir_ + "/drain-ckpt";
  head_.DrainFromStep(3, 4, /*move_once=*/false, dir);
  StartJob(Spec(2, 2, 1, 2, "1f1b", 40), 20000);
  ASSERT_TRUE(WaitFinished(60));
  const int64_t target = head_.drain_target();
  ASSERT_GE(target, 5);
  ExpectDrainedAtOneStep(head_, target, dir);
  for (auto& a : actors_) {
    EXPECT_EQ(a->Record().state(), ACTOR_DEAD);
    EXPECT_THAT(a->Record().message(), HasSubstr(absl::StrCat("stopped after step ", target, " for a drain")));
  }
}

TEST_F(StageActorTest, ADrainWhoseStepMovesOnTrainsOnToTheNextOne) {
  const std::string dir = dir_ + "/drain-ckpt";
  head_.DrainFromStep(3, 4, /*move_once=*/true, dir);
  StartJob(Spec(2, 2, 1, 2, "1f1b", 40), 20000);
  ASSERT_TRUE(WaitFinished(60));
  const int64_t target = head_.drain_target();
  ASSERT_GE(target, 7);
  ExpectDrainedAtOneStep(head_, target, dir);
}

TEST_F(StageActorTest, APeerThatFailsEndsTheJobWithItsErrorByTheDeadline) {
  const auto start = std::chrono::steady_clock::now();
  // Stage 0 can send 3 tensors (1.5 steps of 2 microbatches), then its link fails.
  StartJob(Spec(1, 2, 1, 2, "1f1b", 20), 2000, [](int rank, comm::TensorStreamServer* mailbox) {
    std::unique_ptr<CollectivesFactory> grpc =
        std::make_unique<GrpcCollectivesFactory>(mailbox, kToken, nullptr, absl::Milliseconds(2000));
    if (rank != 0) return grpc;
    return FailingFactory(std::move(grpc), 4);
  });
  ASSERT_TRUE(WaitFinished(30));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::map<std::string, std::string> errors;
  for (const StepReport& r : head_.reports()) {
    if (!r.error().empty()) errors[r.actor_id()] = r.error();
  }
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_THAT(errors["job-1-r0s0t0"], HasSubstr("injected"));
  EXPECT_THAT(errors["job-1-r0s1t0"], HasSubstr("job-1"));  // waited for stage 0's activations: a deadline
  EXPECT_LT(seconds, 20.0);
  for (auto& a : actors_) EXPECT_EQ(a->Record().state(), ACTOR_DEAD);
}

// Replicas as failure domains: replica 2's worker dies in the middle of the job (its all-reduces fail; its peers wait
// for it), the head names replicas 0 and 1, the survivors rebuild their groups and train the failed step again, and
// replica 2's actors leave. From that step on the job equals the one-process simulation that trains only replicas
// 0 and 1's rows of each global batch (losses and validation), and before it the whole job.
TEST_F(StageActorTest, AReplicaLostMidJobLeavesTheOthersTrainingAsTheSimulationWithoutIt) {
  JobSpec spec = WithValidation(Spec(3, 2, 1, 2, "1f1b", 6), 2, 1);
  spec.mutable_train()->set_global_batch(12);
  auto dead = std::make_shared<std::atomic<bool>>(false);
  head_.RegroupTo({0, 1}, /*actors=*/4);
  StartJob(spec, 30000, [dead](int rank, comm::TensorStreamServer* mailbox) {
    std::unique_ptr<CollectivesFactory> grpc =
        std::make_unique<GrpcCollectivesFactory>(mailbox, kToken, nullptr, absl::Seconds(30));
    if (rank / 2 != 2) return grpc;  // world rank (r * pp + s) * tp + t: replica 2's are 4 and 5
    return DyingFactory(std::move(grpc), dead);
  });
  // Once every actor finished step 2, replica 2's worker dies; the head interrupts the survivors' step in flight.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  auto reported = [&](int64_t step) {
    std::set<std::string> actors;
    for (const StepReport& r : head_.reports()) {
      if (r.step() == step && r.error().empty()) actors.insert(r.actor_id());
    }
    return actors.size();
  };
  while (reported(2) < 6 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_EQ(reported(2), 6u);
  dead->store(true);
  while (head_.regroup_epoch() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(head_.regroup_epoch(), 1);
  for (size_t i = 0; i < 4; ++i) actors_[i]->Interrupt(1);
  ASSERT_TRUE(WaitFinished(120));
  for (const StepReport& r : head_.reports()) EXPECT_TRUE(r.error().empty()) << r.actor_id() << ": " << r.error();
  for (size_t i = 0; i < actors_.size(); ++i) {
    EXPECT_EQ(actors_[i]->Record().message(), i < 4 ? "finished" : "stopped: the job went on without this replica")
        << i;
  }
  const int64_t resume = head_.resume_step();
  ASSERT_GE(resume, 3);
  ASSERT_LE(resume, 6);
  model::LocalTrainOptions without;
  without.replicas_from_step = static_cast<int>(resume);
  without.replicas = {0, 1};
  const std::vector<model::StepRecord> reference = LocalHistory(spec, without), whole = LocalHistory(spec);
  const std::vector<float> losses = ReportedLosses(), val = ReportedLosses(/*validation=*/true);
  ASSERT_EQ(losses.size(), reference.size());
  for (size_t i = 0; i < losses.size(); ++i) {
    EXPECT_NEAR(losses[i], reference[i].loss, 1e-5 * std::abs(reference[i].loss)) << "step " << i + 1;
    if (reference[i].val_loss >= 0) {
      EXPECT_NEAR(val[i], reference[i].val_loss, 1e-5 * std::abs(reference[i].val_loss)) << "step " << i + 1;
    }
  }
  // The simulation without replica 2 is not the whole job's: the regroup changed what was trained.
  EXPECT_NE(reference.back().loss, whole.back().loss);
  EXPECT_EQ(reference[static_cast<size_t>(resume) - 2].loss, whole[static_cast<size_t>(resume) - 2].loss);
}

}  // namespace
}  // namespace geotrain::worker
