// Emulator metrics: counters follow bytes_out by increments, gauges carry the latest figures.
#include "netem/metrics.h"

#include <gtest/gtest.h>

namespace geotrain::netem {
namespace {

double Value(prometheus::Registry& registry, const std::string& name, const std::string& src) {
  for (const prometheus::MetricFamily& family : registry.Collect()) {
    if (family.name != name) continue;
    for (const prometheus::ClientMetric& m : family.metric) {
      for (const prometheus::ClientMetric::Label& l : m.label) {
        if (l.name == "src_site" && l.value == src) {
          return family.type == prometheus::MetricType::Counter ? m.counter.value : m.gauge.value;
        }
      }
    }
  }
  return -1;
}

TEST(EmulatorMetricsTest, FollowsTheStats) {
  prometheus::Registry registry;
  EmulatorMetrics metrics(registry);
  LinkDirectionStats s;
  s.src = "a";
  s.dst = "b";
  s.params = {30, 1000, 0.5};
  s.bytes_out = 1000;
  s.queued_bytes = 10;
  s.connections_active = 2;
  s.measured_delay_ms = 31;
  s.measured_mbps = 12.5;
  metrics.Update({s});
  EXPECT_DOUBLE_EQ(Value(registry, "geotrain_netem_bytes_total", "a"), 1000);
  s.bytes_out = 4000;
  s.up = false;
  metrics.Update({s});
  metrics.Update({s});  // no new bytes: the counter stays
  EXPECT_DOUBLE_EQ(Value(registry, "geotrain_netem_bytes_total", "a"), 4000);
  EXPECT_DOUBLE_EQ(Value(registry, "geotrain_netem_queued_bytes", "a"), 10);
  EXPECT_DOUBLE_EQ(Value(registry, "geotrain_netem_connections", "a"), 2);
  EXPECT_DOUBLE_EQ(Value(registry, "geotrain_netem_link_up", "a"), 0);
  EXPECT_DOUBLE_EQ(Value(registry, "geotrain_netem_latency_seconds", "a"), 0.030);
  EXPECT_DOUBLE_EQ(Value(registry, "geotrain_netem_bandwidth_bits_per_second", "a"), 1e9);
  EXPECT_DOUBLE_EQ(Value(registry, "geotrain_netem_measured_delay_seconds", "a"), 0.031);
  EXPECT_DOUBLE_EQ(Value(registry, "geotrain_netem_measured_bits_per_second", "a"), 12.5e6);
}

}  // namespace
}  // namespace geotrain::netem
