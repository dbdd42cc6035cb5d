// Tests of PlanCollectives: which collective groups go on NCCL, consistently for every member; and of the codecs
// GrpcCollectivesFactory (worker/stage_collectives.h) gives the groups that carry activations.
#include "worker/collectives.h"

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <array>
#include <functional>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "comm/codec.h"
#include "comm/communicator.h"
#include "comm/tensor_stream.h"
#include "model/backend.h"
#include "worker/stage_collectives.h"

namespace geotrain::worker {
namespace {

using testing::ElementsAre;

// Actors of a dp x pp x tp plan; site_of(r, s, t) and kind_of(r, s, t) give each one's site and device.
std::vector<ActorPeer> Actors(int dp, int pp, int tp, const std::function<std::string(int, int, int)>& site_of,
                              const std::function<DeviceKind(int, int, int)>& kind_of) {
  std::vector<ActorPeer> peers;
  for (int r = 0; r < dp; ++r)
    for (int s = 0; s < pp; ++s)
      for (int t = 0; t < tp; ++t) {
        ActorPeer p;
        p.set_actor_id(absl::StrCat("r", r, "s", s, "t", t));
        p.set_replica(r);
        p.set_stage(s);
        p.set_tp_rank(t);
        p.set_site(site_of(r, s, t));
        p.set_device_kind(kind_of(r, s, t));
        peers.push_back(p);
      }
  return peers;
}

DeviceKind AllCuda(int, int, int) { return DEVICE_KIND_CUDA; }

TEST(Collectives, AllCudaInOneSiteUsesNcclForTensorAndDataParallelism) {
  auto peers = Actors(
      2, 1, 2, [](int, int, int) { return "a"; }, AllCuda);
  absl::StatusOr<CollectivePlan> plan = PlanCollectives(peers, 2, 1, 2, 1, 0, 1, /*nccl_built=*/true);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->tp_nccl);
  EXPECT_TRUE(plan->dp.use);
  EXPECT_THAT(plan->dp.site_replicas, ElementsAre(0, 1));
  EXPECT_EQ(plan->dp.site_rank, 1);
  EXPECT_THAT(plan->dp.leader_replicas, ElementsAre(0));
  EXPECT_EQ(plan->dp.leader_index, -1);
  EXPECT_TRUE(plan->notes.empty());
}

TEST(Collectives, DataParallelAcrossSitesHasOneLeaderPerSite) {
  // Replicas 0 and 2 in site b, 1 and 3 in site a.
  auto peers = Actors(
      4, 2, 1, [](int r, int, int) { return r % 2 ? "a" : "b"; }, AllCuda);
  for (int r = 0; r < 4; ++r) {
    absl::StatusOr<CollectivePlan> plan = PlanCollectives(peers, 4, 2, 1, r, 1, 0, true);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_TRUE(plan->dp.use);
    EXPECT_EQ(plan->dp.site, r % 2 ? "a" : "b");
    EXPECT_THAT(plan->dp.site_replicas, r % 2 ? ElementsAre(1, 3) : ElementsAre(0, 2));
    EXPECT_EQ(plan->dp.site_rank, r / 2);
    EXPECT_THAT(plan->dp.leader_replicas, ElementsAre(0, 1));
    EXPECT_EQ(plan->dp.leader_index, r < 2 ? r : -1);
  }
}

TEST(Collectives, AMixedGroupStaysOnGrpcForEveryMember) {
  // Replica 1's stage 0 runs on a CPU: stage 0's DP group goes on gRPC for both replicas, stage 1's on
  // NCCL; the TP group of replica 1, stage 0 mixes CUDA and CPU and goes on gRPC for both ranks.
  auto peers = Actors(
      2, 2, 2, [](int, int, int) { return "a"; },
      [](int r, int s, int t) { return r == 1 && s == 0 && t == 0 ? DEVICE_KIND_CPU : DEVICE_KIND_CUDA; });
  for (int r = 0; r < 2; ++r) {
    for (int t = 0; t < 2; ++t) {
      absl::StatusOr<CollectivePlan> stage0 = PlanCollectives(peers, 2, 2, 2, r, 0, t, true);
      ASSERT_TRUE(stage0.ok()) << stage0.status();
      EXPECT_EQ(stage0->dp.use, t == 1) << "replica " << r << " tp rank " << t;
      EXPECT_EQ(stage0->tp_nccl, r == 0);
      absl::StatusOr<CollectivePlan> stage1 = PlanCollectives(peers, 2, 2, 2, r, 1, t, true);
      ASSERT_TRUE(stage1.ok()) << stage1.status();
      EXPECT_TRUE(stage1->dp.use);
      EXPECT_TRUE(stage1->tp_nccl);
    }
  }
  // The CUDA members of a mixed group say why they stay on gRPC.
  absl::StatusOr<CollectivePlan> tp_partner = PlanCollectives(peers, 2, 2, 2, 1, 0, 1, true);
  EXPECT_THAT(tp_partner->notes,
              ElementsAre(testing::HasSubstr("tensor-parallel group on gRPC: some of its actors do not run on CUDA")));
  absl::StatusOr<CollectivePlan> dp_partner = PlanCollectives(peers, 2, 2, 2, 0, 0, 0, true);
  EXPECT_THAT(dp_partner->notes, ElementsAre(testing::HasSubstr("data-parallel all-reduce on gRPC")));
  absl::StatusOr<CollectivePlan> cpu_member = PlanCollectives(peers, 2, 2, 2, 1, 0, 0, true);
  EXPECT_TRUE(cpu_member->notes.empty());
}

TEST(Collectives, TensorParallelAcrossSitesOrWithoutNcclStaysOnGrpc) {
  auto split = Actors(
      1, 1, 2, [](int, int, int t) { return t ? "b" : "a"; }, AllCuda);
  absl::StatusOr<CollectivePlan> plan = PlanCollectives(split, 1, 1, 2, 0, 0, 0, true);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->tp_nccl);
  EXPECT_THAT(plan->notes, ElementsAre(testing::HasSubstr("several sites")));
  auto together = Actors(
      2, 1, 2, [](int, int, int) { return "a"; }, AllCuda);
  plan = PlanCollectives(together, 2, 1, 2, 0, 0, 0, /*nccl_built=*/false);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->tp_nccl);
  EXPECT_FALSE(plan->dp.use);
  EXPECT_THAT(plan->notes, ElementsAre(testing::HasSubstr("no NCCL"), testing::HasSubstr("no NCCL")));
}

TEST(Collectives, CpuJobsAndUnknownDevicesUseGrpcSilently) {
  auto cpu = Actors(
      2, 1, 2, [](int, int, int) { return "a"; }, [](int, int, int) { return DEVICE_KIND_CPU; });
  absl::StatusOr<CollectivePlan> plan = PlanCollectives(cpu, 2, 1, 2, 0, 0, 0, true);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->tp_nccl);
  EXPECT_FALSE(plan->dp.use);
  EXPECT_TRUE(plan->notes.empty());
  // A head that does not send device kinds (UNSPECIFIED): never NCCL.
  auto unknown = Actors(
      2, 1, 1, [](int, int, int) { return "a"; }, [](int, int, int) { return DEVICE_KIND_UNSPECIFIED; });
  plan = PlanCollectives(unknown, 2, 1, 1, 0, 0, 0, true);
  ASSERT_TRUE(plan.ok());
  EXPECT_FALSE(plan->dp.use);
}

TEST(Collectives, AMissingActorIsAnError) {
  auto peers = Actors(
      2, 1, 1, [](int, int, int) { return "a"; }, AllCuda);
  peers.pop_back();
  absl::StatusOr<CollectivePlan> plan = PlanCollectives(peers, 2, 1, 1, 0, 0, 0, true);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), testing::HasSubstr("no actor for replica 1, stage 0, tp rank 0"));
}

// The collectives GrpcCollectivesFactory makes for the four CPU actors of a dp 1 x pp 2 x tp 2 job, stage 0 in site
// a and stage 1 in site b, each actor with a mailbox on a gRPC server of its own.
class StageCollectivesCodecTest : public testing::Test {
 protected:
  static constexpr char kToken[] = "collectives-test-token";

  void SetUp() override {
    for (int s = 0; s < 2; ++s) {
      for (int t = 0; t < 2; ++t) {
        auto mailbox = std::make_unique<comm::TensorStreamServer>(kToken);
        grpc::ServerBuilder builder;
        int port = 0;
        builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
        mailbox->Register(&builder);
        servers_.push_back(builder.BuildAndStart());
        ASSERT_NE(port, 0);
        mailboxes_.push_back(std::move(mailbox));
        ActorPeer p;
        p.set_actor_id(absl::StrCat("job-1-r0s", s, "t", t));
        p.set_stage(s);
        p.set_tp_rank(t);
        p.set_worker_id(p.actor_id());
        p.set_site(s == 0 ? "a" : "b");
        p.set_address(absl::StrCat("127.0.0.1:", port));
        p.set_device_kind(DEVICE_KIND_CPU);
        actors_.push_back(p);
      }
    }
  }

  void TearDown() override {
    made_.clear();
    for (auto& m : mailboxes_) m->Shutdown();
    for (auto& s : servers_) s->Shutdown();
  }

  // World rank `rank`'s collectives (rank = stage * 2 + tp rank) for a job whose comm section names `wan` and `lan`;
  // this fixture keeps them.
  StageCollectives* Make(int rank, const std::string& wan, const std::string& lan) {
    JobSpec spec;
    spec.mutable_parallel()->set_dp(1);
    spec.mutable_parallel()->set_pp(2);
    spec.mutable_parallel()->set_tp(2);
    spec.mutable_parallel()->set_microbatches(1);
    spec.mutable_parallel()->set_schedule("1f1b");
    spec.mutable_train()->set_global_batch(1);
    spec.mutable_train()->set_seq_len(8);
    spec.mutable_comm()->set_wan_codec(wan);
    spec.mutable_comm()->set_lan_codec(lan);
    const ActorPeer& me = actors_[rank];
    ActorRecord record;
    record.set_job_id("job-1");
    record.set_actor_id(me.actor_id());
    record.set_stage(me.stage());
    record.set_tp_rank(me.tp_rank());
    absl::StatusOr<ActorRanks> ranks = ActorRanks::Create(spec, record, actors_, me.site());
    EXPECT_TRUE(ranks.ok()) << ranks.status();
    if (!ranks.ok()) return nullptr;
    ranks_.push_back(std::make_unique<ActorRanks>(*ranks));
    factories_.push_back(
        std::make_unique<GrpcCollectivesFactory>(mailboxes_[rank].get(), kToken, nullptr, absl::Seconds(20)));
    absl::StatusOr<std::unique_ptr<StageCollectives>> made =
        factories_.back()->Create(*ranks_.back(), spec, actors_, model::CpuBackendInstance(), 0);
    EXPECT_TRUE(made.ok()) << made.status();
    if (!made.ok()) return nullptr;
    made_.push_back(std::move(*made));
    return made_.back().get();
  }

  std::vector<std::unique_ptr<grpc::Server>> servers_;
  std::vector<std::unique_ptr<comm::TensorStreamServer>> mailboxes_;
  std::vector<ActorPeer> actors_;
  std::vector<std::unique_ptr<ActorRanks>> ranks_;
  std::vector<std::unique_ptr<GrpcCollectivesFactory>> factories_;
  std::vector<std::unique_ptr<StageCollectives>> made_;
};

// A gradients-only codec (top-k, int4, sparse) named for a link gives way to fp32 for the activations the pipeline
// sends over it; the other codecs are used as named.
TEST_F(StageCollectivesCodecTest, PipelineActivationsNeverUseAGradientsOnlyCodec) {
  const std::vector<std::array<const char*, 4>> cases = {
      // wan, lan, the pipeline's codec across sites, inside a site
      {"int4", "sparse", "none", "none"},
      {"sparse:0.1:4+zstd", "int4+zstd", "none", "none"},
      {"topk:0.1", "topk:0.5+zstd", "none", "none"},
      {"bf16", "int8", "bf16", "int8"},
      {"fp16+zstd", "none", "fp16+zstd", "none"},
  };
  for (const auto& [wan, lan, across, inside] : cases) {
    StageCollectives* c = Make(0, wan, lan);
    ASSERT_NE(c, nullptr) << wan << " " << lan;
    const auto* pipeline = dynamic_cast<const comm::GrpcCommunicator*>(c->pipeline);
    ASSERT_NE(pipeline, nullptr);
    EXPECT_EQ(pipeline->LinkCodec(0, 2).ToString(), across) << "wan_codec " << wan;  // stage 0 to stage 1
    EXPECT_EQ(pipeline->LinkCodec(0, 1).ToString(), inside) << "lan_codec " << lan;  // the other tp rank, site a
  }
}

// Tensor parallelism sums activations: with a sparse lan_codec its all-reduce is still exact, not 2% of the values.
TEST_F(StageCollectivesCodecTest, TensorParallelSumsAreExactWithAGradientsOnlyLanCodec) {
  StageCollectives* rank0 = Make(0, "int4", "sparse:0.02:2");
  StageCollectives* rank1 = Make(1, "int4", "sparse:0.02:2");
  ASSERT_TRUE(rank0 != nullptr && rank1 != nullptr && rank0->tp != nullptr && rank1->tp != nullptr);
  const size_t n = 5000;
  std::vector<float> a(n), b(n), expected(n);
  for (size_t i = 0; i < n; ++i) {
    a[i] = 0.001f * static_cast<float>(i) - 1.7f;
    b[i] = 1.0f / static_cast<float>(i + 3);
    expected[i] = a[i] + b[i];
  }
  absl::Status status1;
  std::thread other([&] { status1 = rank1->tp->AllReduceSum(b.data(), static_cast<int64_t>(n)); });
  const absl::Status status0 = rank0->tp->AllReduceSum(a.data(), static_cast<int64_t>(n));
  other.join();
  ASSERT_TRUE(status0.ok()) << status0;
  ASSERT_TRUE(status1.ok()) << status1;
  EXPECT_EQ(a, expected);
  EXPECT_EQ(b, expected);
}

}  // namespace
}  // namespace geotrain::worker
