#include "worker/gpu_telemetry.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace geotrain::worker {
namespace {

// The value of `family`'s series whose labels include `labels`, or -1 when there is none.
double GaugeValue(MetricsServer& metrics, const std::string& family, const std::map<std::string, std::string>& labels) {
  for (const prometheus::MetricFamily& f : metrics.registry().Collect()) {
    if (f.name != family) continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      int matched = 0;
      for (const prometheus::ClientMetric::Label& l : m.label) {
        auto it = labels.find(l.name);
        if (it != labels.end() && it->second == l.value) ++matched;
      }
      if (matched == static_cast<int>(labels.size())) return m.gauge.value;
    }
  }
  return -1;
}

bool HasFamily(MetricsServer& metrics, const std::string& family) {
  for (const prometheus::MetricFamily& f : metrics.registry().Collect()) {
    if (f.name == family && !f.metric.empty()) return true;
  }
  return false;
}

TEST(GpuTelemetryTest, WithoutNvmlTheSeriesAreAbsentNotZero) {
  MetricsServer metrics;
  GpuTelemetry gpus(&metrics, "site-a", {{0, "0000:3B:00.0", "Tesla T4"}}, "libgeotrain-no-such-nvml.so");
  absl::Status s = gpus.Start(absl::Seconds(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("cannot open NVML"), std::string::npos) << s;
  EXPECT_FALSE(HasFamily(metrics, "geotrain_gpu_utilization_ratio"));
  EXPECT_FALSE(HasFamily(metrics, "geotrain_gpu_memory_used_bytes"));
}

TEST(GpuTelemetryTest, NothingToWatchIsSaid) {
  MetricsServer metrics;
  GpuTelemetry gpus(&metrics, "site-a", {}, GEOTRAIN_FAKE_NVML);
  EXPECT_EQ(gpus.Start(absl::Seconds(1)).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(HasFamily(metrics, "geotrain_gpu_utilization_ratio"));
}

TEST(GpuTelemetryTest, GpusMatchedByPciBusIdReportUtilisationAndMemory) {
  MetricsServer metrics;
  // Device 1's bus id is unknown to NVML: it gets no series, device 0 gets all three.
  GpuTelemetry gpus(&metrics, "site-a", {{0, "0000:3B:00.0", "Tesla T4"}, {1, "0000:AF:00.0", "Tesla T4"}},
                    GEOTRAIN_FAKE_NVML);
  ASSERT_TRUE(gpus.Start(absl::Seconds(60)).ok());
  const std::map<std::string, std::string> gpu0 = {{"site", "site-a"}, {"device", "0"}, {"name", "Tesla T4"}};
  EXPECT_DOUBLE_EQ(GaugeValue(metrics, "geotrain_gpu_utilization_ratio", gpu0), 0.42);
  EXPECT_DOUBLE_EQ(GaugeValue(metrics, "geotrain_gpu_memory_used_bytes", gpu0), 4.0 * (1ull << 30));
  EXPECT_DOUBLE_EQ(GaugeValue(metrics, "geotrain_gpu_memory_total_bytes", gpu0), 16.0 * (1ull << 30));
  EXPECT_EQ(GaugeValue(metrics, "geotrain_gpu_utilization_ratio", {{"device", "1"}}), -1);
}

TEST(GpuTelemetryTest, NoMetricsServerIsANoOp) {
  GpuTelemetry gpus(nullptr, "site-a", {{0, "0000:3B:00.0", "Tesla T4"}}, GEOTRAIN_FAKE_NVML);
  EXPECT_TRUE(gpus.Start(absl::Seconds(1)).ok());
}

}  // namespace
}  // namespace geotrain::worker
