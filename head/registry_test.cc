// Worker registry and failure detector, driven by a fake clock.
#include "head/registry.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace geotrain::head {
namespace {

RegisterWorkerRequest Request(const std::string& id, const std::string& site) {
  RegisterWorkerRequest r;
  r.set_worker_id(id);
  r.set_site(site);
  r.set_address("127.0.0.1:1");
  Device* d = r.add_devices();
  d->set_kind(DEVICE_KIND_EMULATED);
  d->set_name("T4");
  d->set_tflops(65);
  return r;
}

TEST(RegistryTest, RegistersAndAssignsIds) {
  FakeClock clock;
  WorkerRegistry registry(&clock, {1000, 4000}, "h-1");
  RegisterWorkerReply a = registry.Register(Request("", "utah"), nullptr);
  EXPECT_FALSE(a.worker_id().empty());
  EXPECT_EQ(a.incarnation(), 1u);
  EXPECT_EQ(a.head_id(), "h-1");
  RegisterWorkerReply b = registry.Register(Request("w-fixed", "amsterdam"), nullptr);
  EXPECT_EQ(b.worker_id(), "w-fixed");
  ASSERT_EQ(registry.Workers().size(), 2u);
  // Registering again raises the incarnation.
  EXPECT_EQ(registry.Register(Request("w-fixed", "amsterdam"), nullptr).incarnation(), 2u);
}

TEST(RegistryTest, SilentWorkerIsDeclaredDeadAfterTimeoutWithItsActors) {
  FakeClock clock;
  WorkerRegistry registry(&clock, {1000, 4000}, "h-1");
  RegisterWorkerReply a = registry.Register(Request("w-a", "utah"), nullptr);
  registry.Register(Request("w-b", "utah"), nullptr);
  HeartbeatRequest beat;
  beat.set_worker_id("w-a");
  beat.set_incarnation(a.incarnation());
  ActorRecord* actor = beat.add_actors();
  actor->set_actor_id("a-1");
  actor->set_state(ACTOR_ALIVE);
  for (int i = 0; i < 3; ++i) {
    clock.AdvanceMillis(1000);
    EXPECT_FALSE(registry.Heartbeat(beat).reregister());
    // w-b is silent (3000 ms so far): dead only once more than 4000 ms have passed.
    std::vector<WorkerInfo> dead = registry.CheckLiveness();
    EXPECT_TRUE(dead.empty()) << "at step " << i;
  }
  clock.AdvanceMillis(1500);  // w-b silent for 4500 ms; w-a for 1500 ms
  std::vector<WorkerInfo> dead = registry.CheckLiveness();
  ASSERT_EQ(dead.size(), 1u);
  EXPECT_EQ(dead[0].worker_id(), "w-b");
  EXPECT_NE(dead[0].dead_reason().find("no heartbeat"), std::string::npos);
  // Now silence w-a: its actor dies with it.
  clock.AdvanceMillis(4001);
  dead = registry.CheckLiveness();
  ASSERT_EQ(dead.size(), 1u);
  ASSERT_EQ(registry.Actors().size(), 1u);
  EXPECT_EQ(registry.Actors()[0].state(), ACTOR_DEAD);
  EXPECT_NE(registry.Actors()[0].message().find("w-a"), std::string::npos);
  // A dead worker's heartbeat is told to register again; doing so revives it.
  EXPECT_TRUE(registry.Heartbeat(beat).reregister());
  RegisterWorkerReply again = registry.Register(Request("w-a", "utah"), nullptr);
  beat.set_incarnation(again.incarnation());
  EXPECT_FALSE(registry.Heartbeat(beat).reregister());
}

// A worker its job's peers lost (Suspect) is probed at once, silent or not: a refused port is a dead process, declared
// dead before its heartbeat timeout; one whose port answers stays alive, and is not probed again unless suspected.
TEST(RegistryTest, ASuspectWhosePortRefusesIsDeadBeforeItsHeartbeatTimeout) {
  FakeClock clock;
  WorkerRegistry registry(&clock, {1000, 4000}, "h-1");
  registry.Register(Request("w-a", "utah"), nullptr);
  registry.Register(Request("w-b", "utah"), nullptr);
  std::vector<std::string> probed;
  Reachability answer = Reachability::kListening;
  const WorkerRegistry::Probe probe = [&](const std::vector<std::string>& addresses) {
    probed.insert(probed.end(), addresses.begin(), addresses.end());
    return std::vector<Reachability>(addresses.size(), answer);
  };
  clock.AdvanceMillis(500);
  EXPECT_TRUE(registry.CheckLiveness(probe).empty());
  EXPECT_TRUE(probed.empty()) << "nobody silent, nobody suspected: no probe";
  registry.Suspect({"w-b"}, "its job's actors lost contact with it");
  EXPECT_TRUE(registry.CheckLiveness(probe).empty()) << "its port answers: alive";
  EXPECT_EQ(probed.size(), 1u);
  EXPECT_TRUE(registry.CheckLiveness(probe).empty());
  EXPECT_EQ(probed.size(), 1u) << "a suspect is probed once";
  registry.Suspect({"w-b"}, "its job's actors lost contact with it");
  answer = Reachability::kRefused;
  std::vector<WorkerInfo> dead = registry.CheckLiveness(probe);
  ASSERT_EQ(dead.size(), 1u);
  EXPECT_EQ(dead[0].worker_id(), "w-b");
  EXPECT_NE(dead[0].dead_reason().find("lost contact with it and its port refuses"), std::string::npos)
      << dead[0].dead_reason();
}

TEST(RegistryTest, UnknownOrStaleWorkerMustReregister) {
  FakeClock clock;
  WorkerRegistry registry(&clock, {1000, 4000}, "h-2");
  HeartbeatRequest beat;
  beat.set_worker_id("w-nobody");
  EXPECT_TRUE(registry.Heartbeat(beat).reregister());
  RegisterWorkerReply r = registry.Register(Request("w-x", "s"), nullptr);
  beat.set_worker_id("w-x");
  beat.set_incarnation(r.incarnation() + 5);
  EXPECT_TRUE(registry.Heartbeat(beat).reregister());
}

// Leaving on notice: a draining worker's heartbeats say so, the same process registering again (a head restart)
// stays draining, a new process under its id joins afresh; unknown and dead workers cannot drain.
TEST(RegistryTest, DrainingWorkerStaysDrainingUntilANewProcessRegisters) {
  FakeClock clock;
  WorkerRegistry registry(&clock, {1000, 4000}, "h-4");
  RegisterWorkerRequest request = Request("w-d", "utah");
  request.set_pid(100);
  RegisterWorkerReply r = registry.Register(request, nullptr);
  EXPECT_EQ(registry.SetDraining("w-nobody").status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<WorkerInfo> drained = registry.SetDraining("w-d");
  ASSERT_TRUE(drained.ok()) << drained.status();
  EXPECT_TRUE(drained->draining());
  EXPECT_TRUE(registry.SetDraining("w-d").ok());  // again: no error
  HeartbeatRequest beat;
  beat.set_worker_id("w-d");
  beat.set_incarnation(r.incarnation());
  EXPECT_TRUE(registry.Heartbeat(beat).draining());
  registry.Register(request, nullptr);  // the same process (pid 100)
  EXPECT_TRUE(registry.Workers()[0].draining());
  request.set_pid(101);  // a new process
  registry.Register(request, nullptr);
  EXPECT_FALSE(registry.Workers()[0].draining());
  clock.AdvanceMillis(5000);
  ASSERT_EQ(registry.CheckLiveness().size(), 1u);
  EXPECT_EQ(registry.SetDraining("w-d").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(RegistryTest, RestoredWorkersGetAGracePeriod) {
  FakeClock clock;
  WorkerRegistry registry(&clock, {1000, 4000}, "h-3");
  WorkerInfo w;
  w.set_worker_id("w-old");
  w.set_site("utah");
  w.set_state(WORKER_ALIVE);
  w.set_incarnation(3);
  registry.Restore({w});
  clock.AdvanceMillis(3000);
  EXPECT_TRUE(registry.CheckLiveness().empty());
  clock.AdvanceMillis(2000);
  EXPECT_EQ(registry.CheckLiveness().size(), 1u);
}

}  // namespace
}  // namespace geotrain::head

namespace geotrain::head {
namespace {

// Heartbeats carry each worker's sent totals; their growth between two heartbeats is a worker pair's goodput, and a
// site link shows the median of the pairs' recent ones, until they are a minute old.
TEST(RegistryTest, SentTotalsBecomeTheLinksGoodput) {
  FakeClock clock;
  WorkerRegistry registry(&clock, {1000, 60'000}, "h-1");
  const uint64_t incarnation = registry.Register(Request("w-a", "utah"), nullptr).incarnation();
  registry.Register(Request("w-b", "mass"), nullptr);
  HeartbeatRequest beat;
  beat.set_worker_id("w-a");
  beat.set_incarnation(incarnation);
  LinkMeasurement* probe = beat.add_links();
  probe->set_dst_worker("w-b");
  probe->set_rtt_ms(20);
  probe->set_bandwidth_mbps(100);
  LinkSent* sent = beat.add_sent();
  sent->set_dst_worker("w-b");
  sent->set_bytes(1'000'000);
  sent->set_seconds(1);
  registry.Heartbeat(beat);
  ASSERT_EQ(registry.SiteLinks().size(), 1u);
  EXPECT_DOUBLE_EQ(registry.SiteLinks()[0].goodput_mbps(), 8) << "the first totals: 1 MB in 1 s since it started";
  beat.clear_links();
  sent->set_bytes(6'000'000);  // 5 MB more in 0.5 s more: 80 Mbit/s
  sent->set_seconds(1.5);
  clock.AdvanceMillis(1000);
  registry.Heartbeat(beat);
  ASSERT_EQ(registry.SiteLinks().size(), 1u);
  EXPECT_DOUBLE_EQ(registry.SiteLinks()[0].goodput_mbps(), 80);
  clock.AdvanceMillis(61'000);
  EXPECT_EQ(registry.SiteLinks()[0].goodput_mbps(), 0) << "a minute old: not recent";
}

}  // namespace
}  // namespace geotrain::head
