// Tests of PlanCollectives: which collective groups go on NCCL, consistently for every member.
#include "worker/collectives.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>

#include "absl/strings/str_cat.h"

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

}  // namespace
}  // namespace geotrain::worker
