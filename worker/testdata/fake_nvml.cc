// A stand-in for the driver's NVML, for gpu_telemetry_test only: this machine has no GPU and no driver, so the test
// loads this library in NVML's place to check the dlopen path, the PCI-bus-id matching and the gauges' values.
// One GPU exists, at PCI bus id 0000:3B:00.0: 42% busy, 4 GiB of 16 GiB used.
#include <cstring>

#include "worker/nvml_abi.h"

extern "C" {
struct nvmlDevice_st {
  int unused;
};
static nvmlDevice_st fake_device;
nvmlReturn_t nvmlInit_v2() { return 0; }
nvmlReturn_t nvmlShutdown() { return 0; }
nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, nvmlDevice_t* device) {
  if (std::strcmp(bus_id, "0000:3B:00.0") != 0) return 6;  // NVML_ERROR_NOT_FOUND
  *device = &fake_device;
  return 0;
}
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_st* rates) {
  if (device != &fake_device) return 2;  // NVML_ERROR_INVALID_ARGUMENT
  rates->gpu = 42;
  rates->memory = 7;
  return 0;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_st* memory) {
  if (device != &fake_device) return 2;
  memory->total = 16ull << 30;
  memory->free = 12ull << 30;
  memory->used = 4ull << 30;
  return 0;
}
const char* nvmlErrorString(nvmlReturn_t r) { return r == 6 ? "Not Found" : "Unknown Error"; }
}
