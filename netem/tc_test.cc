// tc netem command generation: the commands for a topology, limits and input checks.
#include "netem/tc.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace geotrain::netem {
namespace {

using ::testing::HasSubstr;

Topology TwoSites() {
  Topology t;
  t.add_sites()->set_name("a");
  t.add_sites()->set_name("b");
  t.add_sites()->set_name("c");
  TopologyLink* l = t.add_links();
  l->set_a("a");
  l->set_b("b");
  l->set_latency_ms(51.5);
  l->set_bandwidth_mbps(1000);
  l->set_jitter_ms(1);
  TopologyLink* m = t.add_links();
  m->set_a("b");
  m->set_b("c");
  m->set_latency_ms(265);
  m->set_bandwidth_mbps(328);
  return t;
}

TEST(TcTest, OneReplaceCommandPerDevice) {
  std::vector<TcDevice> devices = {*ParseTcDevice("a>b=nsA:veth-ab"), *ParseTcDevice("b>a=veth-ba"),
                                   *ParseTcDevice("c>b=eth1")};
  absl::StatusOr<std::vector<std::string>> commands = TcCommands(TwoSites(), devices, false);
  ASSERT_TRUE(commands.ok()) << commands.status();
  ASSERT_EQ(commands->size(), 3u);
  // 1 Gbit/s x 52.5 ms = 6.5625 MB = 4375 packets; twice that.
  EXPECT_EQ((*commands)[0],
            "ip netns exec nsA tc qdisc replace dev veth-ab root netem delay 51.5ms 1ms rate "
            "1000000kbit limit 8750");
  EXPECT_EQ((*commands)[1], "tc qdisc replace dev veth-ba root netem delay 51.5ms 1ms rate 1000000kbit limit 8750");
  EXPECT_EQ((*commands)[2], "tc qdisc replace dev eth1 root netem delay 265ms rate 328000kbit limit 14487");
  absl::StatusOr<std::vector<std::string>> clear = TcCommands(TwoSites(), devices, true);
  ASSERT_TRUE(clear.ok());
  EXPECT_EQ((*clear)[0], "ip netns exec nsA tc qdisc del dev veth-ab root");
}

TEST(TcTest, LimitIsAtLeastNetemsDefault) {
  EXPECT_EQ(NetemLimitPackets(10, 1, 0), 1000);
  EXPECT_EQ(NetemLimitPackets(1000, 30, 0), 5000);  // 3.75 MB = 2500 packets, doubled
}

TEST(TcTest, RejectsUnknownLinksAndUnsafeNames) {
  absl::StatusOr<std::vector<std::string>> r = TcCommands(TwoSites(), {*ParseTcDevice("a>c=eth0")}, false);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("no link between 'a' and 'c'"));
  EXPECT_FALSE(TcCommands(TwoSites(), {}, false).ok());
  for (const char* bad : {"a>b=eth0;reboot", "a>b=$(x)", "a>b=", "ab=eth0", "a>b=ns:", "a>b=averyveryverylongname0",
                          "a>b=-eth0", "a>b=ns x:eth0"}) {
    EXPECT_FALSE(ParseTcDevice(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace geotrain::netem
