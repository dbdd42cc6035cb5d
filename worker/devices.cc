// Device discovery: CPU GEMM probe, CUDA runtime query, emulated devices.
#include "worker/devices.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/status.h"
#include "model/config.h"
#include "model/timed_backend.h"
#include "nlohmann/json.hpp"

#ifdef GEOTRAIN_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace geotrain::worker {

namespace {

// The known device of a name, trying it whole, then word by word ("NVIDIA A100-SXM4-80GB": A100).
const KnownDevice* FindKnownDeviceInName(const std::string& name) {
  if (const KnownDevice* known = FindKnownDevice(name)) return known;
  for (absl::string_view word : absl::StrSplit(name, absl::ByAnyChar(" -_"))) {
    if (const KnownDevice* known = FindKnownDevice(std::string(word))) return known;
  }
  return nullptr;
}

}  // namespace

model::Roofline DeviceProfile::roofline(model::Precision precision) const {
  const KnownDevice* known = precision == model::Precision::kFp32 ? FindKnownDeviceInName(name) : nullptr;
  const double peak = known != nullptr && known->fp32_tflops > 0 ? known->fp32_tflops : peak_tflops;
  return {.flops_per_s = peak * 1e12 * flops_efficiency,
          .bytes_per_s = bandwidth_gbs * 1e9 * bandwidth_efficiency,
          .launch_s = launch_us * 1e-6};
}

absl::StatusOr<DeviceProfile> ParseDeviceProfile(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  const auto bad = [&text](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--emulate-device '", text, "': ", why, "; expected NAME[:TFLOPS:MEM_GB[:BW_GBS]], e.g. T4 or T4:65:16:320"));
  };
  if (parts.empty() || parts[0].empty() || parts.size() > 4) return bad("wrong number of fields");
  DeviceProfile p;
  p.name = parts[0];
  if (const KnownDevice* known = FindKnownDevice(parts[0])) {
    p.peak_tflops = known->tflops;
    p.memory_gb = known->mem_gb;
    p.bandwidth_gbs = known->bandwidth_gbs;
  }
  if (parts.size() >= 2 && !absl::SimpleAtod(parts[1], &p.peak_tflops)) return bad("TFLOPS is not a number");
  if (parts.size() >= 3 && !absl::SimpleAtod(parts[2], &p.memory_gb)) return bad("MEM_GB is not a number");
  if (parts.size() == 4 && (!absl::SimpleAtod(parts[3], &p.bandwidth_gbs) || !(p.bandwidth_gbs > 0))) {
    return bad("BW_GBS is not a positive number");
  }
  if (!(p.peak_tflops > 0) || !(p.memory_gb > 0)) return bad("unknown device: give TFLOPS and MEM_GB, both positive");
  if (parts.size() > 1) p.source = "given peaks x default efficiencies";
  return p;
}

namespace {
// A known GPU's compute capability and per-precision peaks (left 0 for an unknown one).
void SetCapabilities(const KnownDevice* known, Device* d) {
  if (known == nullptr) return;
  d->set_compute_capability(known->compute_capability);
  d->set_fp32_tflops(known->fp32_tflops);
  d->set_fp16_tflops(known->fp16_tflops);
  d->set_bf16_tflops(known->bf16_tflops);
}
}  // namespace

absl::StatusOr<Device> EmulatedDevice(const DeviceProfile& profile) {
  Device d;
  d.set_kind(DEVICE_KIND_EMULATED);
  d.set_name(profile.name);
  d.set_tflops(profile.peak_tflops);
  // The emulated GPU's capabilities: an emulated T4 trains in fp16 as a real one must (the CPU emulates it). A
  // device given only by its figures has none: it trains as the CPU does (fp32 under precision auto).
  SetCapabilities(FindKnownDeviceInName(profile.name), &d);
  d.set_memory_bytes(static_cast<uint64_t>(profile.memory_gb * 1e9));
  return d;
}

absl::StatusOr<Device> ParseEmulatedDevice(const std::string& text) {
  ASSIGN_OR_RETURN(DeviceProfile profile, ParseDeviceProfile(text));
  return EmulatedDevice(profile);
}

absl::StatusOr<std::string> TimedDeviceName(const DeviceProfile& profile) {
  if (!(profile.bandwidth_gbs > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--timed-compute: device ", profile.name,
                                                   " has no memory bandwidth; give it as NAME:TFLOPS:MEM_GB:BW_GBS"));
  }
  const model::Roofline r = profile.roofline();
  std::string name = absl::StrFormat("timed:%s@%.6g:%.6g:%.6g", profile.name, r.flops_per_s / 1e12, r.bytes_per_s / 1e9,
                                     r.launch_s * 1e6);
  // A known GPU's fp32 peak, at the same achieved fraction: an fp32 job on it is timed at its CUDA cores' rate.
  if (const KnownDevice* known = FindKnownDeviceInName(profile.name); known != nullptr && known->fp32_tflops > 0) {
    absl::StrAppendFormat(&name, ":%.6g", profile.roofline(model::Precision::kFp32).flops_per_s / 1e12);
  }
  return name;
}

absl::StatusOr<bool> CalibrateDeviceProfile(const std::string& path, DeviceProfile* profile) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("--device-profiles: cannot read '", path, "'; check the path"));
  }
  const KnownDevice* mine = FindKnownDeviceInName(profile->name);
  const std::string my_name = mine != nullptr ? mine->name : profile->name;
  bool matched = false;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    const auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device-profiles ", path, " line ", number, ": ", why,
                       "; each line is a JSON object with \"device\" and achieved figures, or a bench_gpu_step line"));
    };
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("device") || !j["device"].is_string()) return bad("not an object with a device");
    const std::string device = j["device"].get<std::string>();
    const KnownDevice* theirs = FindKnownDeviceInName(device);
    if ((theirs != nullptr ? std::string(theirs->name) : device) != my_name) continue;
    const auto number_of = [&j](const char* key, double* out) {
      if (!j.contains(key) || !j[key].is_number()) return false;
      *out = j[key].get<double>();
      return *out > 0;
    };
    DeviceProfile p = *profile;
    double value = 0;
    if (number_of("peak_tflops", &value)) p.peak_tflops = value;
    if (number_of("bandwidth_gbs", &value)) p.bandwidth_gbs = value;
    if (number_of("achieved_tflops", &value) && !j.contains("median_step_s"))
      p.flops_efficiency = value / p.peak_tflops;
    if (number_of("achieved_bandwidth_gbs", &value)) {
      if (!(p.bandwidth_gbs > 0)) return bad("achieved_bandwidth_gbs for a device without a known bandwidth");
      p.bandwidth_efficiency = value / p.bandwidth_gbs;
    }
    if (j.contains("launch_us") && j["launch_us"].is_number() && j["launch_us"].get<double>() >= 0) {
      p.launch_us = j["launch_us"].get<double>();
    }
    double step_s = 0, batch = 0, seq_len = 0;
    if (number_of("median_step_s", &step_s)) {
      // A measured training step: fit the GEMM efficiency so that the timed model of it takes step_s.
      if (!number_of("batch", &batch) || !number_of("seq_len", &seq_len) || !j.contains("model") ||
          !j["model"].is_string()) {
        return bad("a bench_gpu_step line needs model, batch and seq_len");
      }
      absl::StatusOr<GPT2Config> config = GPT2Config::FromPreset(j["model"].get<std::string>());
      if (!config.ok()) return bad(std::string(config.status().message()));
      const auto predict = [&](double efficiency) -> absl::StatusOr<double> {
        DeviceProfile q = p;
        q.flops_efficiency = efficiency;
        return model::PredictTrainingStepSeconds(*config, static_cast<int>(batch), static_cast<int>(seq_len), 1,
                                                 q.roofline());
      };
      double lo = 0.01, hi = 1.0;
      ASSIGN_OR_RETURN(double fastest, predict(hi));
      if (fastest > step_s) {
        return bad(
            absl::StrFormat("the measured step (%.4f s) is faster than the model allows at 100%% of the peak "
                            "(%.4f s): check peak_tflops and the bandwidth",
                            step_s, fastest));
      }
      for (int i = 0; i < 30; ++i) {
        const double mid = std::sqrt(lo * hi);
        ASSIGN_OR_RETURN(double predicted, predict(mid));
        (predicted > step_s ? lo : hi) = mid;
      }
      p.flops_efficiency = hi;
    }
    if (!(p.flops_efficiency > 0 && p.flops_efficiency <= 1) ||
        !(p.bandwidth_efficiency > 0 && p.bandwidth_efficiency <= 1)) {
      return bad(absl::StrFormat("achieved figures beyond the peaks (FLOP/s %.2f, bandwidth %.2f of peak)",
                                 p.flops_efficiency, p.bandwidth_efficiency));
    }
    p.source = absl::StrCat("calibrated from ", path, " line ", number);
    *profile = p;
    matched = true;
  }
  return matched;
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
    const KnownDevice* known = FindKnownDeviceInName(prop.name);
    d.set_tflops(known ? known->tflops : 0);
    SetCapabilities(known, &d);
    d.set_compute_capability(prop.major * 10 + prop.minor);  // the runtime's word, known model or not
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

absl::Status ValidateSlowdown(double factor, bool timed_compute) {
  if (!std::isfinite(factor) || factor < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--slowdown %g: the factor must be a finite number >= 1 (2: twice as slow; 1: not slowed)", factor));
  }
  if (factor > 1 && timed_compute) {
    return absl::InvalidArgumentError(
        "--slowdown slows real CPU compute, and --timed-compute computes nothing (it waits an emulated GPU's time); "
        "use one or the other");
  }
  return absl::OkStatus();
}

absl::Status SlowDevices(double factor, std::vector<Device>* devices) {
  const bool timed = std::any_of(devices->begin(), devices->end(), [](const Device& d) { return d.timed_compute(); });
  RETURN_IF_ERROR(ValidateSlowdown(factor, timed));
  if (factor == 1) return absl::OkStatus();
  for (const Device& d : *devices) {
    if (d.kind() == DEVICE_KIND_CUDA) {
      return absl::InvalidArgumentError(
          absl::StrCat("--slowdown slows a device that computes on the CPU, and device ", d.index(), " is a CUDA GPU (",
                       d.name(), "); drop --slowdown, or run on the CPU with --emulate-device NAME"));
    }
  }
  for (Device& d : *devices) {
    d.set_slowdown(factor);
    d.set_tflops(d.tflops() / factor);
    d.set_fp32_tflops(d.fp32_tflops() / factor);
    d.set_fp16_tflops(d.fp16_tflops() / factor);
    d.set_bf16_tflops(d.bf16_tflops() / factor);
    d.set_name(absl::StrFormat("%s (EMULATED: slowed %gx)", d.name(), factor));
  }
  return absl::OkStatus();
}

}  // namespace geotrain::worker
