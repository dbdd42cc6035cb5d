// The stats text: FormatStatsText and ParseStatsText agree, and malformed lines are rejected.
#include "netem/control_client.h"

#include <gtest/gtest.h>

#include "netem/emulator.h"

namespace geotrain::netem {
namespace {

TEST(StatsTextTest, RoundTrip) {
  LinkDirectionStats s;
  s.src = "utah";
  s.dst = "amsterdam";
  s.params = {51.5, 1000, 1};
  s.up = false;
  s.stalled_ms_left = 120;
  s.bytes_in = int64_t{1} << 40;
  s.bytes_out = (int64_t{1} << 40) - 7;
  s.queued_bytes = 7;
  s.connections_total = 12;
  s.connections_active = 3;
  s.connections_reset = 2;
  s.measured_mbps = 812.5;
  s.measured_delay_ms = 52.25;
  LinkDirectionStats t = s;
  t.src = "amsterdam";
  t.dst = "utah";
  t.up = true;
  const std::string text = FormatStatsText({s, t});
  absl::StatusOr<std::vector<LinkDirectionStats>> parsed = ParseStatsText(text);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->size(), 2u);
  const LinkDirectionStats& p = (*parsed)[0];
  EXPECT_EQ(p.src, "utah");
  EXPECT_EQ(p.dst, "amsterdam");
  EXPECT_FALSE(p.up);
  EXPECT_TRUE((*parsed)[1].up);
  EXPECT_DOUBLE_EQ(p.params.latency_ms, 51.5);
  EXPECT_DOUBLE_EQ(p.params.bandwidth_mbps, 1000);
  EXPECT_DOUBLE_EQ(p.params.jitter_ms, 1);
  EXPECT_EQ(p.bytes_in, s.bytes_in);
  EXPECT_EQ(p.bytes_out, s.bytes_out);
  EXPECT_EQ(p.queued_bytes, 7);
  EXPECT_EQ(p.connections_total, 12);
  EXPECT_EQ(p.connections_active, 3);
  EXPECT_EQ(p.connections_reset, 2);
  EXPECT_DOUBLE_EQ(p.stalled_ms_left, 120);
  EXPECT_DOUBLE_EQ(p.measured_mbps, 812.5);
  EXPECT_DOUBLE_EQ(p.measured_delay_ms, 52.25);
  EXPECT_NE(FormatStatsJson({s}).find("\"src\":\"utah\",\"dst\":\"amsterdam\",\"up\":false"), std::string::npos);
}

TEST(StatsTextTest, RejectsMalformedLines) {
  for (const char* bad : {"nonsense", "link a>b sideways", "link ab up", "link a>b up bytes_in=x", "link >b up",
                          "link a>b up active=1.5"}) {
    EXPECT_FALSE(ParseStatsText(bad).ok()) << bad;
  }
  // Unknown keys are skipped (a newer emulator may add some).
  EXPECT_TRUE(ParseStatsText("link a>b up future_key=1 bytes_in=5\n").ok());
}

}  // namespace
}  // namespace geotrain::netem
