// Derived figures for the public API and the dashboard (see dashboard_figures.h).
#include "head/dashboard_figures.h"

#include <map>
#include <set>
#include <utility>

#include "common/spec.h"
#include "model/config.h"

namespace geotrain::head {

v1::JobEfficiency JobEfficiencyOf(const JobInfo& job, const std::vector<WorkerInfo>& workers) {
  v1::JobEfficiency out;
  out.set_job_id(job.job_id());
  const std::string precision = job.precision().empty() ? "fp32" : job.precision();
  out.set_precision(precision);
  out.set_timed_compute(job.timed_compute());
  if (absl::StatusOr<GPT2Config> config = GPT2Config::FromSpec(job.spec().model()); config.ok()) {
    out.set_flops_per_token(config->TrainingFlopsPerToken(job.spec().train().seq_len()));
  }
  std::map<std::string, const WorkerInfo*> by_id;
  for (const WorkerInfo& w : workers) by_id[w.worker_id()] = &w;
  // A device runs one actor of one job, but tensor-parallel ranks and stages of a replica may share a worker: count
  // each (worker, device) once.
  std::set<std::pair<std::string, int>> held;
  for (const ActorRecord& a : job.actors()) held.insert({a.worker_id(), a.device_index()});
  double peak_tflops = 0;
  int devices = 0;
  for (const auto& [worker_id, index] : held) {
    auto worker = by_id.find(worker_id);
    if (worker == by_id.end()) continue;
    for (const Device& d : worker->second->devices()) {
      if (d.index() != index) continue;
      double tflops = precision == "bf16" ? d.bf16_tflops() : precision == "fp16" ? d.fp16_tflops() : d.fp32_tflops();
      if (tflops <= 0) tflops = d.tflops();
      peak_tflops += tflops;
      ++devices;
      if (d.kind() == DEVICE_KIND_EMULATED) out.set_emulated_devices(true);
    }
  }
  out.set_devices(devices);
  out.set_peak_flops(peak_tflops * 1e12);
  out.set_achieved_flops(job.tokens_per_second() * out.flops_per_token());
  if (out.peak_flops() > 0) out.set_mfu(out.achieved_flops() / out.peak_flops());
  return out;
}

absl::StatusOr<std::vector<v1::ConfiguredLink>> ConfiguredLinksOf(const std::string& path) {
  absl::StatusOr<Topology> topology = LoadTopologyFile(path);
  if (!topology.ok()) return topology.status();
  std::vector<v1::ConfiguredLink> links;
  for (const TopologyLink& l : topology->links()) {
    v1::ConfiguredLink& link = links.emplace_back();
    link.set_a(l.a());
    link.set_b(l.b());
    link.set_latency_ms(l.latency_ms());
    link.set_bandwidth_mbps(l.bandwidth_mbps());
    link.set_jitter_ms(l.jitter_ms());
  }
  return links;
}

}  // namespace geotrain::head
