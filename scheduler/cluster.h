// The planner's view of a cluster: sites, the devices of each worker (TFLOP/s, memory) and the
// links between sites (one-way latency, bandwidth), plus the intra-site link that the planner
// assumes where nothing better is known. The struct knows nothing of gRPC: the head fills it from
// its registry (measured TFLOP/s and links), and tools fill it from a topology file.
//
//   absl::StatusOr<Topology> topology = LoadTopologyFile("two_sites.yaml");
//   absl::StatusOr<Cluster> cluster = ClusterFromTopology(*topology);
//   double seconds = cluster->Link(0, 1).Seconds(1 << 20);  // latency + bytes / bandwidth
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace geotrain {

class Topology;  // proto/spec.proto

namespace scheduler {

// A point-to-point path: one-way latency and bandwidth in bytes per second.
struct LinkSpec {
  double latency_s = 0;
  double bandwidth_bytes_per_s = 0;
  // Time to deliver `bytes` over this link: latency + bytes / bandwidth.
  double Seconds(double bytes) const { return latency_s + bytes / bandwidth_bytes_per_s; }
};

// One accelerator. `worker` is the index of its worker in the topology's site (or the registry's
// worker), `slot` its index among the devices of that worker.
struct Device {
  int site = 0;
  int worker = 0;
  int slot = 0;
  std::string name;      // device model, e.g. "RTX6000"
  double tflops = 0;     // dense bf16/fp16 peak (or measured) TFLOP/s
  double mem_bytes = 0;  // device memory
  // A GPU's compute capability (major * 10 + minor; 0: a CPU or unknown) and its fp32 peak TFLOP/s (0: unknown,
  // then tflops stands for every precision): a job that trains in fp32 runs at that peak (JobOptions::precision).
  int compute_capability = 0;
  double fp32_tflops = 0;
};

struct Cluster {
  std::vector<std::string> site_names;
  std::vector<Device> devices;
  // links[a][b] for a != b: the path between sites a and b (symmetric). links[a][a]: the intra-site
  // path of site a (defaults to intra_site below).
  std::vector<std::vector<LinkSpec>> links;

  int num_sites() const { return static_cast<int>(site_names.size()); }
  const LinkSpec& Link(int site_a, int site_b) const { return links[site_a][site_b]; }
  // Checks sizes and that every figure is positive and finite; errors name the site or device.
  absl::Status Validate() const;
};

struct ClusterOptions {
  // The intra-site path assumed for every site: 100 Gbit/s and 0.05 ms (FABRIC nodes have 100
  // Gbit/s NICs).
  LinkSpec intra_site{0.05e-3, 100e9 / 8};
};

// Builds the planner's cluster from a validated topology (ValidateTopology fills tflops and
// mem_gb). Every pair of sites must have a link with a positive bandwidth; errors name the pair and
// the fix.
absl::StatusOr<Cluster> ClusterFromTopology(const Topology& topology, const ClusterOptions& options = {});

}  // namespace scheduler
}  // namespace geotrain
