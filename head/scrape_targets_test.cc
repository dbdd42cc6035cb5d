// Prometheus discovery targets: valid JSON whatever the site names, the head first, alive workers by site.
#include "head/scrape_targets.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "nlohmann/json.hpp"

namespace geotrain::head {
namespace {

WorkerInfo Worker(const std::string& site, const std::string& metrics, WorkerState state = WORKER_ALIVE) {
  WorkerInfo w;
  w.set_site(site);
  w.set_metrics_address(metrics);
  w.set_state(state);
  return w;
}

TEST(ScrapeTargetsTest, ASiteNameWithAQuoteGivesValidJson) {
  const std::string site = "ut\"ah\\ \n";
  const std::string text =
      ScrapeTargetsJson("10.0.0.1:9100", {Worker(site, "10.0.0.2:9101"), Worker(site, "10.0.0.3:9101"),
                                          Worker("b", "10.0.0.4:9101", WORKER_DEAD), Worker("b", "")});
  const nlohmann::json json = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(json.is_discarded()) << text;
  ASSERT_EQ(json.size(), 2u) << text;  // the head, and the site with alive workers that serve metrics
  EXPECT_EQ(json[0]["targets"], nlohmann::json::array({"10.0.0.1:9100"}));
  EXPECT_EQ(json[0]["labels"]["role"], "head");
  EXPECT_EQ(json[1]["labels"]["role"], "worker");
  EXPECT_EQ(json[1]["labels"]["site"], site);
  EXPECT_EQ(json[1]["targets"], nlohmann::json::array({"10.0.0.2:9101", "10.0.0.3:9101"}));
}

TEST(ScrapeTargetsTest, NoMetricsServerNoHeadTarget) { EXPECT_EQ(ScrapeTargetsJson("", {}), "[]\n"); }

}  // namespace
}  // namespace geotrain::head
