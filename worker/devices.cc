// Device discovery: CPU GEMM probe, CUDA runtime query, emulated devices.
#include "worker/devices.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/log.h"
#include "common/spec.h"

#ifdef GEOTRAIN_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace geotrain::worker {

absl::StatusOr<Device> ParseEmulatedDevice(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  Device d;
  d.set_kind(DEVICE_KIND_EMULATED);
  const auto bad = [&text](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--emulate-device '", text, "': ", why, "; expected NAME:TFLOPS:MEM_GB, e.g. T4:65:16"));
  };
  if (parts.empty() || parts[0].empty() || parts.size() > 3) return bad("wrong number of fields");
  d.set_name(parts[0]);
  const KnownDevice* known = FindKnownDevice(parts[0]);
  double tflops = known ? known->tflops : 0, mem_gb = known ? known->mem_gb : 0;
  if (parts.size() >= 2 && !absl::SimpleAtod(parts[1], &tflops)) return bad("TFLOPS is not a number");
  if (parts.size() == 3 && !absl::SimpleAtod(parts[2], &mem_gb)) return bad("MEM_GB is not a number");
  if (tflops <= 0 || mem_gb <= 0) return bad("unknown device: give TFLOPS and MEM_GB, both positive");
  d.set_tflops(tflops);
  d.set_memory_bytes(static_cast<uint64_t>(mem_gb * 1e9));
  return d;
}

double MeasureCpuTflops() {
  constexpr int n = 512;
  std::vector<float> a(n * n, 1.0f), b(n * n, 0.5f), c(n * n, 0.0f);
  double best_seconds = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best_seconds = std::min(best_seconds, s);
  }
  return 2.0 * n * n * n / best_seconds / 1e12;
}

uint64_t PhysicalMemoryBytes() {
  return static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

std::vector<Device> DiscoverCudaDevices() {
  std::vector<Device> out;
#ifdef GEOTRAIN_HAVE_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    GT_LOG(INFO) << "no usable CUDA device (" << cudaGetErrorString(cudaGetLastError()) << "); using the CPU";
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    Device d;
    d.set_index(i);
    d.set_kind(DEVICE_KIND_CUDA);
    d.set_name(prop.name);
    d.set_memory_bytes(prop.totalGlobalMem);
    const KnownDevice* known = FindKnownDevice(prop.name);
    if (known == nullptr) {
      // Names such as "NVIDIA H200" or "NVIDIA A100-SXM4-80GB": try the words one by one.
      for (absl::string_view word : absl::StrSplit(prop.name, absl::ByAnyChar(" -"))) {
        if ((known = FindKnownDevice(std::string(word))) != nullptr) break;
      }
    }
    d.set_tflops(known ? known->tflops : 0);
    out.push_back(d);
  }
#endif
  return out;
}

std::vector<Device> DiscoverDevices(const std::vector<Device>& emulated) {
  std::vector<Device> out;
  if (!emulated.empty()) {
    out = emulated;
  } else {
    out = DiscoverCudaDevices();
  }
  if (out.empty()) {
    Device cpu;
    cpu.set_kind(DEVICE_KIND_CPU);
    cpu.set_name(absl::StrCat("cpu x", sysconf(_SC_NPROCESSORS_ONLN)));
    cpu.set_memory_bytes(PhysicalMemoryBytes());
    cpu.set_tflops(MeasureCpuTflops());
    out.push_back(cpu);
  }
  for (int i = 0; i < static_cast<int>(out.size()); ++i) out[i].set_index(i);
  return out;
}

}  // namespace geotrain::worker
