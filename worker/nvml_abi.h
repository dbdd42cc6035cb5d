// The part of NVML's stable C ABI that gpu_telemetry.cc calls through dlopen (nvml.h is not part of the CUDA toolkit
// here, and a worker must start where the driver is absent). The layouts and names follow nvml.h. The test's stand-in
// library (testdata/fake_nvml.cc) defines its functions with these same types, so that a call through a pointer of
// these types is a call of a function of that type (UBSan's -fsanitize=function checks it).
#pragma once

extern "C" {
using nvmlReturn_t = int;  // 0 is NVML_SUCCESS, 2 NVML_ERROR_INVALID_ARGUMENT, 6 NVML_ERROR_NOT_FOUND
struct nvmlDevice_st;
using nvmlDevice_t = nvmlDevice_st*;
struct nvmlUtilization_st {
  unsigned int gpu;     // percent of the sample period a kernel ran
  unsigned int memory;  // percent of it memory was read or written
};
struct nvmlMemory_st {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};

using NvmlInitFn = nvmlReturn_t();
using NvmlByPciBusIdFn = nvmlReturn_t(const char* pci_bus_id, nvmlDevice_t* device);
using NvmlUtilizationFn = nvmlReturn_t(nvmlDevice_t device, nvmlUtilization_st* utilization);
using NvmlMemoryFn = nvmlReturn_t(nvmlDevice_t device, nvmlMemory_st* memory);
using NvmlErrorStringFn = const char*(nvmlReturn_t result);
}
