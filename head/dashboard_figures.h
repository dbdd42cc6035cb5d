// Figures the head derives from what it already holds, for the public API (GetJobEfficiency, GetClusterInfo) and
// the dashboard that shows them (head/dashboard.h): a job's model FLOPs utilization, and the links a topology file
// configures.
//
//   v1::JobEfficiency e = JobEfficiencyOf(job, registry.Workers());   // e.mfu(): achieved / peak FLOP/s
//   absl::StatusOr<std::vector<v1::ConfiguredLink>> links = ConfiguredLinksOf("deploy/topologies/x.yaml");
//
// Pure functions of their arguments (the topology: of the file), so thread-safe.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "control.pb.h"
#include "geotrain/v1/cluster.pb.h"
#include "geotrain/v1/jobs.pb.h"

namespace geotrain::head {

// The job's MFU: its newest tokens/s times its model's training FLOPs per token, over the dense peak (in the job's
// precision; a device's declared TFLOP/s where it gives none for that precision) of the devices its actors hold,
// found in `workers`. Unknowns (no step yet, a model the head cannot size, devices no worker lists) leave the
// figures that need them at 0.
v1::JobEfficiency JobEfficiencyOf(const JobInfo& job, const std::vector<WorkerInfo>& workers);

// The links of the topology file at `path` (YAML or JSON, validated as `cluster up` validates it). Errors name the
// file and what is wrong with it.
absl::StatusOr<std::vector<v1::ConfiguredLink>> ConfiguredLinksOf(const std::string& path);

}  // namespace geotrain::head
