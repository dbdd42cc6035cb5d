// NVML through dlopen: worker/nvml_abi.h declares the few entry points of NVML's stable C ABI this file uses.
#include "worker/gpu_telemetry.h"

#include <dlfcn.h>

#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "worker/nvml_abi.h"

#ifdef GEOTRAIN_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace geotrain::worker {
std::vector<GpuToWatch> CudaDevicesToWatch() {
  std::vector<GpuToWatch> out;
#ifdef GEOTRAIN_HAVE_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return out;
  for (int i = 0; i < count; ++i) {
    char bus_id[32] = {};
    cudaDeviceProp prop;
    if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), i) != cudaSuccess) continue;
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    out.push_back({i, bus_id, prop.name});
  }
#endif
  return out;
}

struct GpuTelemetry::Nvml {
  void* handle = nullptr;
  NvmlInitFn* init = nullptr;
  NvmlInitFn* shutdown = nullptr;
  NvmlByPciBusIdFn* by_pci_bus_id = nullptr;
  NvmlUtilizationFn* utilization = nullptr;
  NvmlMemoryFn* memory = nullptr;
  NvmlErrorStringFn* error_string = nullptr;
  bool initialised = false;

  std::string Error(nvmlReturn_t r) const {
    return error_string ? absl::StrCat(error_string(r), " (", r, ")") : absl::StrCat("error ", r);
  }
  ~Nvml() {
    if (initialised) shutdown();
    if (handle) dlclose(handle);
  }
};

// A matched GPU. Its gauges are made at its first successful read of each figure (null until then), so that a
// figure NVML cannot read on it (a MIG instance's utilisation, say) has no series rather than a zero.
struct GpuTelemetry::Watched {
  nvmlDevice_t device;
  std::map<std::string, std::string> labels;
  prometheus::Gauge* utilization = nullptr;
  prometheus::Gauge* used = nullptr;
  prometheus::Gauge* total = nullptr;
};

GpuTelemetry::GpuTelemetry(MetricsServer* metrics, std::string site, std::vector<GpuToWatch> gpus, std::string library)
    : metrics_(metrics), site_(std::move(site)), gpus_(std::move(gpus)), library_(std::move(library)) {}

GpuTelemetry::~GpuTelemetry() {
  stop_.Notify();
  if (sampler_.joinable()) sampler_.join();
}

namespace {
template <typename F>
bool Resolve(void* handle, const char* symbol, F* out) {
  *out = reinterpret_cast<F>(dlsym(handle, symbol));
  return *out != nullptr;
}
}  // namespace

absl::Status GpuTelemetry::Start(absl::Duration period) {
  if (metrics_ == nullptr) return absl::OkStatus();
  if (gpus_.empty()) return absl::FailedPreconditionError("no CUDA device to watch: GPU gauges are not exported");
  auto nvml = std::make_unique<Nvml>();
  nvml->handle = dlopen(library_.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (nvml->handle == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("cannot open NVML (", library_, ": ", dlerror(),
                                                      "); GPU utilisation and memory are not exported. Install "
                                                      "the NVIDIA driver's NVML library to see them"));
  }
  if (!Resolve(nvml->handle, "nvmlInit_v2", &nvml->init) || !Resolve(nvml->handle, "nvmlShutdown", &nvml->shutdown) ||
      !Resolve(nvml->handle, "nvmlDeviceGetHandleByPciBusId_v2", &nvml->by_pci_bus_id) ||
      !Resolve(nvml->handle, "nvmlDeviceGetUtilizationRates", &nvml->utilization) ||
      !Resolve(nvml->handle, "nvmlDeviceGetMemoryInfo", &nvml->memory)) {
    return absl::FailedPreconditionError(
        absl::StrCat(library_, " lacks an NVML entry point this worker needs (driver too old?): ", dlerror()));
  }
  Resolve(nvml->handle, "nvmlErrorString", &nvml->error_string);  // optional: errors show their code without it
  if (nvmlReturn_t r = nvml->init(); r != 0) {
    return absl::FailedPreconditionError(absl::StrCat("NVML does not start: ", nvml->Error(r)));
  }
  nvml->initialised = true;

  for (const GpuToWatch& gpu : gpus_) {
    nvmlDevice_t device = nullptr;
    if (nvmlReturn_t r = nvml->by_pci_bus_id(gpu.pci_bus_id.c_str(), &device); r != 0) {
      GT_LOG(WARNING) << "GPU " << gpu.device_index << " (PCI " << gpu.pci_bus_id
                      << ") has no NVML device: " << nvml->Error(r) << "; its gauges are not exported";
      continue;
    }
    const std::map<std::string, std::string> labels = {
        {"site", site_}, {"device", absl::StrCat(gpu.device_index)}, {"name", gpu.name}};
    watched_.push_back({.device = device, .labels = labels});
  }
  if (watched_.empty()) return absl::FailedPreconditionError("NVML knows none of this worker's GPUs");
  nvml_ = std::move(nvml);
  SampleOnce();
  sampler_ = std::thread([this, period] {
    while (!stop_.WaitForNotificationWithTimeout(period)) SampleOnce();
  });
  return absl::OkStatus();
}

void GpuTelemetry::SampleOnce() {
  if (!nvml_) return;
  auto& utilization = metrics_->Gauges("geotrain_gpu_utilization_ratio",
                                       "Share of the last sample period a kernel ran on the GPU (NVML), 0..1");
  auto& used = metrics_->Gauges("geotrain_gpu_memory_used_bytes", "GPU memory in use, every process (NVML)");
  auto& total = metrics_->Gauges("geotrain_gpu_memory_total_bytes", "GPU memory (NVML)");
  for (Watched& w : watched_) {
    nvmlUtilization_st u{};
    // A failed read leaves the last value: a gauge that drops to zero on a driver hiccup would read as an idle GPU.
    if (nvml_->utilization(w.device, &u) == 0) {
      if (w.utilization == nullptr) w.utilization = &utilization.Add(w.labels);
      w.utilization->Set(u.gpu / 100.0);
    }
    nvmlMemory_st m{};
    if (nvml_->memory(w.device, &m) == 0) {
      if (w.used == nullptr) w.used = &used.Add(w.labels), w.total = &total.Add(w.labels);
      w.used->Set(static_cast<double>(m.used));
      w.total->Set(static_cast<double>(m.total));
    }
  }
}

}  // namespace geotrain::worker
