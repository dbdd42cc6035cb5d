// Prometheus file-based discovery targets (see scrape_targets.h).
#include "head/scrape_targets.h"

#include <map>

#include "nlohmann/json.hpp"

namespace geotrain::head {

std::string ScrapeTargetsJson(const std::string& head_target, const std::vector<WorkerInfo>& workers) {
  using Json = nlohmann::ordered_json;
  std::map<std::string, std::vector<std::string>> by_site;
  for (const WorkerInfo& w : workers) {
    if (w.state() == WORKER_ALIVE && !w.metrics_address().empty()) by_site[w.site()].push_back(w.metrics_address());
  }
  Json groups = Json::array();
  if (!head_target.empty()) {
    groups.push_back({{"targets", Json::array({head_target})}, {"labels", {{"role", "head"}}}});
  }
  for (const auto& [site, targets] : by_site) {
    groups.push_back({{"targets", targets}, {"labels", {{"role", "worker"}, {"site", site}}}});
  }
  // A name that is not UTF-8 gets U+FFFD rather than an exception (Prometheus reads UTF-8).
  return groups.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

}  // namespace geotrain::head
