// Building and checking the planner's cluster description (see cluster.h).
#include "scheduler/cluster.h"

#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "spec.pb.h"

namespace geotrain::scheduler {
namespace {

bool PositiveFinite(double x) { return std::isfinite(x) && x > 0; }

}  // namespace

absl::Status Cluster::Validate() const {
  const int n = num_sites();
  if (n == 0) return absl::InvalidArgumentError("cluster: no sites");
  if (devices.empty()) return absl::InvalidArgumentError("cluster: no devices; join workers or list them");
  if (static_cast<int>(links.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster: link matrix has ", links.size(), " rows for ", n, " sites"));
  }
  for (int a = 0; a < n; ++a) {
    if (static_cast<int>(links[a].size()) != n) {
      return absl::InvalidArgumentError(absl::StrCat("cluster: link row of site '", site_names[a], "' has ",
                                                     links[a].size(), " entries for ", n, " sites"));
    }
    for (int b = 0; b < n; ++b) {
      const LinkSpec& l = links[a][b];
      if (!PositiveFinite(l.bandwidth_bytes_per_s) || !std::isfinite(l.latency_s) || l.latency_s < 0) {
        return absl::InvalidArgumentError(absl::StrCat("cluster: link ", site_names[a], "-", site_names[b],
                                                       " needs a positive bandwidth and a non-negative latency (got ",
                                                       l.bandwidth_bytes_per_s, " B/s, ", l.latency_s, " s)"));
      }
    }
  }
  for (const Device& d : devices) {
    if (d.site < 0 || d.site >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("cluster: device '", d.name, "' has site index ", d.site, " outside 0..", n - 1));
    }
    if (!PositiveFinite(d.tflops) || !PositiveFinite(d.mem_bytes)) {
      return absl::InvalidArgumentError(absl::StrCat("cluster: device '", d.name, "' at site '", site_names[d.site],
                                                     "' needs positive TFLOP/s and memory"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Cluster> ClusterFromTopology(const Topology& topology, const ClusterOptions& options) {
  Cluster cluster;
  std::map<std::string, int> index;
  for (const TopologySite& site : topology.sites()) {
    index[site.name()] = cluster.num_sites();
    cluster.site_names.push_back(site.name());
  }
  const int n = cluster.num_sites();
  for (int s = 0; s < n; ++s) {
    const TopologySite& site = topology.sites(s);
    for (int w = 0; w < site.workers_size(); ++w) {
      const TopologyWorker& worker = site.workers(w);
      const int count = worker.count() > 0 ? worker.count() : 1;
      for (int slot = 0; slot < count; ++slot) {
        Device d;
        d.site = s;
        d.worker = w;
        d.slot = slot;
        d.name = worker.device().empty() ? "custom" : worker.device();
        d.tflops = worker.tflops();
        d.mem_bytes = worker.mem_gb() * 1e9;
        d.compute_capability = worker.compute_capability();
        d.fp32_tflops = worker.fp32_tflops();
        cluster.devices.push_back(d);
      }
    }
  }
  cluster.links.assign(n, std::vector<LinkSpec>(n, LinkSpec{-1, -1}));
  for (int s = 0; s < n; ++s) cluster.links[s][s] = options.intra_site;
  for (const TopologyLink& link : topology.links()) {
    auto a = index.find(link.a()), b = index.find(link.b());
    if (a == index.end() || b == index.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("topology: link ", link.a(), "-", link.b(), " names an unknown site"));
    }
    if (link.bandwidth_mbps() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("topology: link ", link.a(), "-", link.b(),
                                                     " has no bandwidth; the planner needs bandwidth_mbps > 0"));
    }
    const LinkSpec spec{link.latency_ms() * 1e-3, link.bandwidth_mbps() * 1e6 / 8};
    cluster.links[a->second][b->second] = spec;
    cluster.links[b->second][a->second] = spec;
  }
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) {
      if (cluster.links[a][b].bandwidth_bytes_per_s < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("topology: no link between sites '", cluster.site_names[a], "' and '", cluster.site_names[b],
                         "'; the planner needs every pair: add {a: ", cluster.site_names[a],
                         ", b: ", cluster.site_names[b], ", latency_ms: ..., bandwidth_mbps: ...} under 'links'"));
      }
    }
  }
  RETURN_IF_ERROR(cluster.Validate());
  return cluster;
}

}  // namespace geotrain::scheduler
