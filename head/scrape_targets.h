// Prometheus file-based service discovery for a geotrain cluster: the JSON the head writes to
// <state-dir>/prometheus_targets.json (deploy/prometheus/prometheus.yml reads it): the head's metrics
// endpoint and every alive worker's, the workers grouped by site.
//
//   std::string json = ScrapeTargetsJson("10.0.0.1:9100", registry.Workers());
//   // [{"targets":["10.0.0.1:9100"],"labels":{"role":"head"}},
//   //  {"targets":["10.0.0.2:9101"],"labels":{"role":"worker","site":"utah"}}]
//
// Names are escaped by the JSON library, so any site name gives valid JSON. Pure; any thread.
#pragma once

#include <string>
#include <vector>

#include "control.pb.h"

namespace geotrain::head {

// The target groups as one JSON array and a newline. `head_target` ("host:port") is left out when empty
// (no metrics server); workers that are not alive or have no metrics address are left out.
std::string ScrapeTargetsJson(const std::string& head_target, const std::vector<WorkerInfo>& workers);

}  // namespace geotrain::head
