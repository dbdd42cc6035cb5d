// LinkMetrics on a real registry, read back in the Prometheus text format: probe gauges and goodput counters per
// peer, removal of the gauges of peers that left, and the bound on distinct peers.
#include "worker/link_metrics.h"

#include <prometheus/text_serializer.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace geotrain::worker {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string Text(MetricsServer& metrics) {
  return prometheus::TextSerializer().Serialize(metrics.registry().Collect());
}

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(LinkMetrics, ProbesAndSendsArePerPeerAndLinkAndGoneWhenThePeerLeaves) {
  MetricsServer metrics;
  LinkMetrics links(&metrics, "site-a");
  links.RecordProbe("w1", "site-b", 0.0125, 1.5e8);
  links.RecordProbe("w2", "site-a", 0.0004, 9e8);
  links.RecordSent("w1", "site-b", 1000, 0.5);
  links.RecordSent("w1", "site-b", 3000, 1.5);
  std::string text = Text(metrics);
  EXPECT_THAT(text, HasSubstr(R"(geotrain_link_rtt_seconds{dst_site="site-b",peer="w1",src_site="site-a"} 0.0125)"));
  EXPECT_THAT(text, HasSubstr(R"(geotrain_link_rtt_seconds{dst_site="site-a",peer="w2",src_site="site-a"} 0.0004)"));
  EXPECT_THAT(text, HasSubstr(R"(geotrain_link_probe_bandwidth_bytes_per_second{dst_site="site-b",peer="w1",)"
                              R"(src_site="site-a"} 150000000)"));
  EXPECT_THAT(text, HasSubstr(R"(geotrain_link_sent_bytes_total{dst_site="site-b",peer="w1",src_site="site-a"} 4000)"));
  EXPECT_THAT(text, HasSubstr(R"(geotrain_link_send_seconds_total{dst_site="site-b",peer="w1",src_site="site-a"} 2)"));

  links.KeepProbedPeers({"w2"});  // w1 left the head's peer list
  text = Text(metrics);
  EXPECT_THAT(text, Not(HasSubstr(R"(geotrain_link_rtt_seconds{dst_site="site-b",peer="w1")")));
  EXPECT_THAT(text, Not(HasSubstr(R"(geotrain_link_probe_bandwidth_bytes_per_second{dst_site="site-b",peer="w1")")));
  EXPECT_THAT(text, HasSubstr(R"(geotrain_link_rtt_seconds{dst_site="site-a",peer="w2",src_site="site-a"})"));
  // Its counters stay: a counter that vanished would read as a reset.
  EXPECT_THAT(text, HasSubstr(R"(geotrain_link_sent_bytes_total{dst_site="site-b",peer="w1",src_site="site-a"} 4000)"));
  // A probe after it came back shows it again.
  links.RecordProbe("w1", "site-b", 0.013, 1e8);
  EXPECT_THAT(Text(metrics), HasSubstr(R"(geotrain_link_rtt_seconds{dst_site="site-b",peer="w1",src_site="site-a"})"));
}

TEST(LinkMetrics, DistinctPeersAreBounded) {
  MetricsServer metrics;
  LinkMetrics links(&metrics, "a");
  for (size_t i = 0; i < kMaxLinkPeers + 10; ++i) {
    links.RecordProbe(absl::StrCat("w", i), "b", 0.01, 1e6);
    links.RecordSent(absl::StrCat("w", i), "b", 10, 0.1);
  }
  const std::string text = Text(metrics);
  EXPECT_EQ(Count(text, "\ngeotrain_link_rtt_seconds{"), static_cast<int>(kMaxLinkPeers));
  EXPECT_EQ(Count(text, "\ngeotrain_link_sent_bytes_total{"), static_cast<int>(kMaxLinkPeers));
  EXPECT_THAT(text, Not(HasSubstr(absl::StrCat("peer=\"w", kMaxLinkPeers, "\""))));
  // Peers already recorded still are.
  links.RecordSent("w0", "b", 5, 0.1);
  EXPECT_THAT(Text(metrics), HasSubstr(R"(geotrain_link_sent_bytes_total{dst_site="b",peer="w0",src_site="a"} 15)"));
}

// Without a metrics server there are no series, but the sent totals the heartbeat carries to the head add up.
TEST(LinkMetrics, WithoutAMetricsServerOnlyTheSentTotalsAreKept) {
  LinkMetrics links(nullptr, "a");
  links.RecordProbe("w1", "b", 0.01, 1e6);
  links.RecordSent("w1", "b", 10, 0.1);
  links.RecordSent("w1", "b", 30, 0.3);
  links.RecordSent("w2", "a", 5, 0.5);
  links.KeepProbedPeers({});
  const auto totals = links.SentTotalsByPeer();
  ASSERT_EQ(totals.size(), 2u);
  EXPECT_EQ(totals.at("w1").bytes, 40u);
  EXPECT_DOUBLE_EQ(totals.at("w1").seconds, 0.4);
  EXPECT_EQ(totals.at("w2").bytes, 5u);
}

}  // namespace
}  // namespace geotrain::worker
