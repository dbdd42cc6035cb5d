// Device discovery for a worker: CUDA devices through the CUDA runtime in a CUDA build with a GPU
// present; otherwise the CPU as one device whose fp32 GFLOP/s is measured by a short GEMM probe.
// Emulated devices (--emulate-device NAME:TFLOPS:MEM_GB) stand in for heterogeneous GPUs on one machine.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "control.pb.h"

namespace geotrain::worker {

// Parses NAME:TFLOPS:MEM_GB (e.g. "T4:65:16"); TFLOPS and MEM_GB may be omitted for known devices
// ("A30"). Errors name the flag and the expected form.
absl::StatusOr<Device> ParseEmulatedDevice(const std::string& text);

// Measured fp32 throughput of this CPU in TFLOP/s: the best of a few single-precision GEMMs
// (n = 512) through BLAS, taking about 0.2 s.
double MeasureCpuTflops();

// CUDA devices (empty when there is no CUDA build or no GPU); errors are logged, not fatal.
std::vector<Device> DiscoverCudaDevices();

// Physical memory of this machine in bytes.
uint64_t PhysicalMemoryBytes();

// What a worker offers: emulated devices when given, else CUDA devices, else the CPU.
std::vector<Device> DiscoverDevices(const std::vector<Device>& emulated);

}  // namespace geotrain::worker
