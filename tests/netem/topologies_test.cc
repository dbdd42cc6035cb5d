// Every topology shipped in deploy/topologies/ loads and validates; the measured cloud pairs are
// carried as the handbook gives them.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>

#include "common/spec.h"

namespace geotrain {
namespace {

const std::string kDir = std::string(GEOTRAIN_SOURCE_DIR) + "/deploy/topologies";

TEST(TopologiesTest, EveryShippedTopologyLoads) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kDir)) {
    if (entry.path().extension() != ".yaml") continue;
    absl::StatusOr<Topology> t = LoadTopologyFile(entry.path().string());
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_GE(t->sites_size(), 2) << entry.path();
    EXPECT_GE(t->links_size(), 1) << entry.path();
    for (const TopologySite& s : t->sites()) {
      EXPECT_GE(s.workers_size(), 1) << entry.path() << " " << s.name();
      for (const TopologyWorker& w : s.workers()) EXPECT_GT(w.tflops(), 0);
    }
    ++count;
  }
  EXPECT_GE(count, 4);
}

TEST(TopologiesTest, ExamplesCarryTheirFigures) {
  absl::StatusOr<Topology> two = LoadTopologyFile(kDir + "/two-sites-30ms.yaml");
  ASSERT_TRUE(two.ok()) << two.status();
  ASSERT_EQ(two->sites_size(), 2);
  EXPECT_EQ(two->sites(0).workers_size(), 2);
  EXPECT_EQ(two->sites(1).workers_size(), 2);
  EXPECT_DOUBLE_EQ(two->links(0).latency_ms(), 30);

  absl::StatusOr<Topology> fabric = LoadTopologyFile(kDir + "/fabric-3site.yaml");
  ASSERT_TRUE(fabric.ok()) << fabric.status();
  std::set<std::string> devices;
  for (const TopologySite& s : fabric->sites()) {
    for (const TopologyWorker& w : s.workers()) devices.insert(w.device());
  }
  EXPECT_EQ(devices, (std::set<std::string>{"RTX6000", "A30", "T4"}));
  EXPECT_EQ(fabric->sites_size(), 3);

  absl::StatusOr<Topology> transatlantic = LoadTopologyFile(kDir + "/utah-amsterdam-103ms.yaml");
  ASSERT_TRUE(transatlantic.ok()) << transatlantic.status();
  EXPECT_DOUBLE_EQ(2 * transatlantic->links(0).latency_ms(), 103);

  absl::StatusOr<Topology> cloud = LoadTopologyFile(kDir + "/cloud-wide.yaml");
  ASSERT_TRUE(cloud.ok()) << cloud.status();
  std::map<std::string, std::pair<double, double>> links;
  for (const TopologyLink& l : cloud->links()) {
    links[l.a() + "-" + l.b()] = {l.latency_ms(), l.bandwidth_mbps()};
  }
  EXPECT_EQ(links["virginia-ohio"], std::make_pair(11.0, 1120.0));
  EXPECT_EQ(links["oregon-virginia"], std::make_pair(67.0, 790.0));
  EXPECT_EQ(links["tokyo-seoul"], std::make_pair(34.0, 1100.0));
  EXPECT_EQ(links["sydney-frankfurt"], std::make_pair(265.0, 328.0));
}

}  // namespace
}  // namespace geotrain
