// A stand-in for the driver's NVML, for gpu_telemetry_test only: this machine has no GPU and no driver, so the test
// loads this library in NVML's place to check the dlopen path, the PCI-bus-id matching and the gauges' values.
// One GPU exists, at PCI bus id 0000:3B:00.0: 42% busy, 4 GiB of 16 GiB used.
extern "C" {
static int fake_device;
int nvmlInit_v2() { return 0; }
int nvmlShutdown() { return 0; }
int nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, void** device) {
  const char* known = "0000:3B:00.0";
  for (int i = 0;; ++i) {
    if (bus_id[i] != known[i]) return 6;  // NVML_ERROR_NOT_FOUND
    if (known[i] == 0) break;
  }
  *device = &fake_device;
  return 0;
}
int nvmlDeviceGetUtilizationRates(void* device, unsigned int* rates) {
  if (device != &fake_device) return 2;  // NVML_ERROR_INVALID_ARGUMENT
  rates[0] = 42;
  rates[1] = 7;
  return 0;
}
int nvmlDeviceGetMemoryInfo(void* device, unsigned long long* memory) {
  if (device != &fake_device) return 2;
  memory[0] = 16ull << 30;  // total
  memory[1] = 12ull << 30;  // free
  memory[2] = 4ull << 30;   // used
  return 0;
}
const char* nvmlErrorString(int r) { return r == 6 ? "Not Found" : "Unknown Error"; }
}
