// Device discovery for a worker: CUDA devices through the CUDA runtime in a CUDA build with a GPU
// present; otherwise the CPU as one device whose fp32 GFLOP/s is measured by a short GEMM probe.
// Emulated devices (--emulate-device NAME:TFLOPS:MEM_GB) stand in for heterogeneous GPUs on one machine.
#pragma once

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "control.pb.h"
#include "model/op_costs.h"
#include "model/precision.h"

namespace geotrain::worker {

// A GPU to emulate: its published peak figures and the fraction of them it achieves. Timed compute
// (model/timed_backend.h) waits, per op, the roofline of the achieved figures.
struct DeviceProfile {
  std::string name;
  double peak_tflops = 0;  // dense fp16/bf16 tensor-core TFLOP/s
  double memory_gb = 0;
  double bandwidth_gbs = 0;  // memory bandwidth
  // Achieved fractions of the peaks. Defaults: GEMMs at 60% of the tensor peak (cuBLAS on large bf16 GEMMs
  // reaches 60-75%; llm.c's whole GPT-2 step 50-60% MFU on an A100) and 80% of the memory bandwidth
  // (streaming kernels); a calibration replaces them with a measured run's.
  double flops_efficiency = 0.6;
  double bandwidth_efficiency = 0.8;
  double launch_us = 5;                                           // per op: kernel launch and the framework's dispatch
  std::string source = "published peaks x default efficiencies";  // where the achieved figures come from
  // The achieved figures of a job in `precision`: in fp32 a known GPU computes on its CUDA cores, at its fp32 peak
  // (the same achieved fraction); the other precisions (and devices without a known fp32 peak) at peak_tflops.
  model::Roofline roofline(model::Precision precision = model::Precision::kBf16) const;
};

// Parses NAME[:TFLOPS[:MEM_GB[:BW_GBS]]] (e.g. "T4", "T4:65:16", "X:100:32:900"). Figures left out come from
// the known-device table (common/spec.h), so an unknown NAME needs TFLOPS and MEM_GB, and a bandwidth (BW_GBS) for
// timed compute. Errors name the flag and the expected form.
absl::StatusOr<DeviceProfile> ParseDeviceProfile(const std::string& text);
// ParseDeviceProfile as the Device a worker offers (kind EMULATED).
absl::StatusOr<Device> ParseEmulatedDevice(const std::string& text);
absl::StatusOr<Device> EmulatedDevice(const DeviceProfile& profile);
// The backend device name of timed compute on `profile` (model::MakeTimedBackend's form); INVALID_ARGUMENT
// when the profile has no bandwidth.
absl::StatusOr<std::string> TimedDeviceName(const DeviceProfile& profile);

// Calibration: applies a file of measured figures (JSON lines) to `profile` when one of its lines is for that
// device (names compared as FindKnownDevice does, a word at a time: "NVIDIA H200" matches H200). Two kinds of
// line (docs/timed-compute.md):
//   {"device": "H100", "achieved_tflops": 420, "achieved_bandwidth_gbs": 2700, "launch_us": 4}  (any subset)
//   a line of bench_gpu_step --out (tests/gpu/run.sh's bench_gpu_step.json): the GEMM efficiency is fitted
//   so that the timed model of that step (its model, batch and sequence length) takes its median step time.
// The last matching line wins. Returns whether a line matched; errors name the file, the line and the fix.
absl::StatusOr<bool> CalibrateDeviceProfile(const std::string& path, DeviceProfile* profile);

// Measured fp32 throughput of this CPU in TFLOP/s: the best of a few single-precision GEMMs
// (n = 512) through BLAS, taking about 0.2 s.
double MeasureCpuTflops();

// CUDA devices (empty when there is no CUDA build or no GPU); errors are logged, not fatal.
std::vector<Device> DiscoverCudaDevices();

// Physical memory of this machine in bytes.
uint64_t PhysicalMemoryBytes();

// What a worker offers: emulated devices when given, else CUDA devices, else the CPU.
std::vector<Device> DiscoverDevices(const std::vector<Device>& emulated);

// A worker's --slowdown factor: OK for a finite number >= 1 (1: not slowed); INVALID_ARGUMENT naming the flag for
// another, or for a factor above 1 with timed compute (which computes nothing to slow).
absl::Status ValidateSlowdown(double factor, bool timed_compute = false);

// Slows a worker's devices by `factor` (worker start --slowdown, docs/timed-compute.md), so that sites of unequal
// speed can be tried with real numerics: each device then carries slowdown = factor, its TFLOP/s (and its
// per-precision peaks) divided by it, so the planner sees it slower, and its name says so
// ("cpu x16 (EMULATED: slowed 2x)"). The stage actors on it wait (factor - 1) times each op's time
// (StageTrainer::set_slowdown). Only devices that compute on the CPU can be slowed: the CPU, and emulated devices
// without timed compute. INVALID_ARGUMENT for a bad factor, a CUDA device or a timed-compute one, with the fix. A
// factor of 1 changes nothing.
absl::Status SlowDevices(double factor, std::vector<Device>* devices);

}  // namespace geotrain::worker
