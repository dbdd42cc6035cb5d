// GPU utilisation and memory of a CUDA worker's devices, read through NVML (the driver's management library) and
// exported on the worker's /metrics:
//
//   geotrain_gpu_utilization_ratio{site,device,name}   share of the last sample period a kernel ran (0..1)
//   geotrain_gpu_memory_used_bytes{site,device,name}   device memory in use (every process, as nvidia-smi shows)
//   geotrain_gpu_memory_total_bytes{site,device,name}
//
// `device` is the worker's device index (the CUDA ordinal its actors use), matched to NVML's device by PCI bus id,
// so that CUDA_VISIBLE_DEVICES and NVML's own order cannot mix two GPUs up. NVML is opened with dlopen: a worker
// without a driver (CPU workers, emulated devices, this project's build machines) has no such series at all, never
// zeros, and logs once why.
//
//   GpuTelemetry gpus(metrics_server, "site-a", {{0, "0000:3B:00.0"}});
//   absl::Status s = gpus.Start(absl::Seconds(2));   // FAILED_PRECONDITION: no NVML (the series stay absent)
//
// Thread-safety: Start and the destructor from the owning thread; a sampling thread owned by the object sets the
// gauges (prometheus-cpp gauges are thread-safe) until the destructor stops and joins it.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/metrics.h"

namespace geotrain::worker {

struct GpuToWatch {
  int device_index = 0;    // the worker's device index (CUDA ordinal)
  std::string pci_bus_id;  // as cudaDeviceGetPCIBusId writes it ("0000:3B:00.0")
  std::string name;        // for the `name` label
};

// The PCI bus ids of the CUDA devices this process sees, by CUDA ordinal ({} without CUDA or a device).
std::vector<GpuToWatch> CudaDevicesToWatch();

class GpuTelemetry {
 public:
  // `metrics` may be null (nothing is exported; Start does nothing). `library` is the NVML shared library to open
  // (tests name a stand-in; the default is the driver's libnvidia-ml.so.1).
  GpuTelemetry(MetricsServer* metrics, std::string site, std::vector<GpuToWatch> gpus,
               std::string library = "libnvidia-ml.so.1");
  ~GpuTelemetry();
  GpuTelemetry(const GpuTelemetry&) = delete;
  GpuTelemetry& operator=(const GpuTelemetry&) = delete;

  // Opens NVML, matches every GPU to an NVML device, samples once, and starts sampling every `period`.
  // FAILED_PRECONDITION naming the cause when there is nothing to watch, no NVML, or no GPU matches; the
  // worker runs on without the series.
  absl::Status Start(absl::Duration period);

 private:
  // Samples every matched GPU once (Start does once, then its sampling thread every period).
  void SampleOnce();

  struct Nvml;  // the dlopen'ed library and its entry points
  struct Watched;

  MetricsServer* const metrics_;
  const std::string site_;
  const std::vector<GpuToWatch> gpus_;
  const std::string library_;
  std::unique_ptr<Nvml> nvml_;    // set by Start; read by the sampling thread after
  std::vector<Watched> watched_;  // made by Start; then SampleOnce, on the sampling thread alone, sets its gauges
  absl::Notification stop_;
  std::thread sampler_;
};

}  // namespace geotrain::worker
