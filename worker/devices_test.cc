// Emulated device parsing and the CPU probe.
#include "worker/devices.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>

#include "absl/strings/str_format.h"
#include "model/config.h"
#include "model/timed_backend.h"

namespace geotrain::worker {
namespace {

TEST(DevicesTest, ParsesEmulatedDevices) {
  auto d = ParseEmulatedDevice("T4:65:16");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->name(), "T4");
  EXPECT_DOUBLE_EQ(d->tflops(), 65);
  EXPECT_EQ(d->memory_bytes(), 16000000000ull);
  EXPECT_EQ(d->kind(), DEVICE_KIND_EMULATED);
  auto known = ParseEmulatedDevice("A30");
  ASSERT_TRUE(known.ok());
  EXPECT_DOUBLE_EQ(known->tflops(), 165);
  EXPECT_THAT(ParseEmulatedDevice("Z9:x:1").status().message(), ::testing::HasSubstr("NAME[:TFLOPS:MEM_GB"));
  EXPECT_FALSE(ParseEmulatedDevice("Z9").ok());
  EXPECT_FALSE(ParseEmulatedDevice("T4:-1:16").ok());
}

TEST(DeviceProfileTest, KnownProfilesOverridesAndTheirRoofline) {
  // The published figures of the GPUs the FABRIC study and this project's machines use.
  for (const auto& [name, tflops, mem, bw] :
       std::vector<std::tuple<std::string, double, double, double>>{{"T4", 65, 16, 320},
                                                                    {"RTX6000", 130.5, 24, 672},
                                                                    {"A30", 165, 24, 933},
                                                                    {"A40", 149.7, 48, 696},
                                                                    {"A100", 312, 80, 2039},
                                                                    {"H100", 989, 80, 3350},
                                                                    {"H200", 989, 141, 4800}}) {
    auto p = ParseDeviceProfile(name);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_DOUBLE_EQ(p->peak_tflops, tflops) << name;
    EXPECT_DOUBLE_EQ(p->memory_gb, mem) << name;
    EXPECT_DOUBLE_EQ(p->bandwidth_gbs, bw) << name;
  }
  auto h100 = ParseDeviceProfile("h100");
  ASSERT_TRUE(h100.ok());
  const model::Roofline r = h100->roofline();
  EXPECT_DOUBLE_EQ(r.flops_per_s, 989e12 * 0.6);
  EXPECT_DOUBLE_EQ(r.bytes_per_s, 3350e9 * 0.8);
  EXPECT_DOUBLE_EQ(r.launch_s, 5e-6);
  // Achieved tensor TFLOP/s, GB/s, launch us, and the achieved fp32 TFLOP/s (67 x 0.6) for fp32 jobs.
  EXPECT_EQ(*TimedDeviceName(*h100), "timed:h100@593.4:2680:5:40.2");
  // Overrides: TFLOPS and memory, and the bandwidth; an unknown device needs all three for timed compute.
  auto slow = ParseDeviceProfile("T4:10:8:100");
  ASSERT_TRUE(slow.ok());
  EXPECT_DOUBLE_EQ(slow->peak_tflops, 10);
  EXPECT_DOUBLE_EQ(slow->bandwidth_gbs, 100);
  auto keeps_bw = ParseDeviceProfile("T4:10:8");
  ASSERT_TRUE(keeps_bw.ok());
  EXPECT_DOUBLE_EQ(keeps_bw->bandwidth_gbs, 320);
  auto unknown = ParseDeviceProfile("X1:50:16");
  ASSERT_TRUE(unknown.ok());
  EXPECT_THAT(TimedDeviceName(*unknown).status().message(), ::testing::HasSubstr("BW_GBS"));
  EXPECT_TRUE(TimedDeviceName(*ParseDeviceProfile("X1:50:16:900")).ok());
  EXPECT_FALSE(ParseDeviceProfile("T4:1:2:3:4").ok());
  EXPECT_FALSE(ParseDeviceProfile("T4:1:2:-3").ok());
  // The backend name round-trips into a timed backend.
  auto backend = model::MakeTimedBackend(*TimedDeviceName(*h100));
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_NEAR((*backend)->roofline().flops_per_s, r.flops_per_s, 1e6);
  // In fp32 the GEMMs run on the CUDA cores: the H100's 67 TFLOP/s at the same achieved fraction, not 989.
  auto fp32 = model::MakeTimedBackend(*TimedDeviceName(*h100), model::Precision::kFp32);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  EXPECT_NEAR((*fp32)->roofline().flops_per_s, 67e12 * h100->flops_efficiency, 1e6);
  // The profile's own roofline in fp32 (what `geotrain model timed-step --precision fp32` times) is that backend's.
  EXPECT_NEAR(h100->roofline(model::Precision::kFp32).flops_per_s, (*fp32)->roofline().flops_per_s, 1e6);
  // A device without a known fp32 peak keeps its one figure.
  auto custom = model::MakeTimedBackend(*TimedDeviceName(*ParseDeviceProfile("X1:50:16:900")), model::Precision::kFp32);
  ASSERT_TRUE(custom.ok()) << custom.status();
  EXPECT_NEAR((*custom)->roofline().flops_per_s, 50e12 * 0.6, 1e6);
}

// A file of `text` in /tmp, removed when the object goes (a failed assertion included).
class TempFile {
 public:
  explicit TempFile(const std::string& text) {
    char path[] = "/tmp/geotrain_profiles_XXXXXX";
    const int fd = mkstemp(path);
    close(fd);
    std::ofstream(path) << text;
    path_ = path;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(DeviceProfileTest, CalibratesFromMeasuredFigures) {
  const TempFile file(
      "{\"device\": \"A30\", \"achieved_tflops\": 99}\n"
      "\n"
      "{\"device\": \"NVIDIA H100 80GB HBM3\", \"achieved_tflops\": 494.5, \"achieved_bandwidth_gbs\": 3015, "
      "\"launch_us\": 3}\n");
  auto p = ParseDeviceProfile("H100");
  ASSERT_TRUE(p.ok());
  absl::StatusOr<bool> matched = CalibrateDeviceProfile(file.path(), &*p);
  ASSERT_TRUE(matched.ok()) << matched.status();
  EXPECT_TRUE(*matched);
  EXPECT_DOUBLE_EQ(p->flops_efficiency, 0.5);
  EXPECT_DOUBLE_EQ(p->bandwidth_efficiency, 0.9);
  EXPECT_DOUBLE_EQ(p->launch_us, 3);
  EXPECT_THAT(p->source, ::testing::HasSubstr("line 3"));
  auto t4 = ParseDeviceProfile("T4");
  EXPECT_FALSE(*CalibrateDeviceProfile(file.path(), &*t4));  // no line for it: unchanged
  EXPECT_DOUBLE_EQ(t4->flops_efficiency, 0.6);

  // A bench_gpu_step line: the GEMM efficiency is fitted so that the timed model of that step takes its time.
  auto predicted = [](double efficiency) {
    DeviceProfile h = *ParseDeviceProfile("H200");
    h.flops_efficiency = efficiency;
    return *model::PredictTrainingStepSeconds(*GPT2Config::FromPreset("gpt2"), 8, 1024, 1, h.roofline());
  };
  const double measured = predicted(0.35);
  const TempFile bench(
      absl::StrFormat("{\"bench\": \"gpu_step\", \"device\": \"NVIDIA H200\", \"precision\": \"bf16\", \"model\": "
                      "\"gpt2\", \"batch\": 8, \"seq_len\": 1024, \"steps\": 20, \"median_step_s\": %.9f, "
                      "\"achieved_tflops\": 300}\n",
                      measured));
  auto h200 = ParseDeviceProfile("H200");
  ASSERT_TRUE(*CalibrateDeviceProfile(bench.path(), &*h200));
  EXPECT_NEAR(h200->flops_efficiency, 0.35, 0.35 * 1e-3);

  EXPECT_THAT(CalibrateDeviceProfile(TempFile("not json\n").path(), &*h200).status().message(),
              ::testing::HasSubstr("line 1"));
  EXPECT_FALSE(
      CalibrateDeviceProfile(TempFile("{\"device\": \"H200\", \"achieved_tflops\": 2000}\n").path(), &*h200).ok());
  EXPECT_EQ(CalibrateDeviceProfile("/nonexistent/profiles", &*h200).status().code(), absl::StatusCode::kNotFound);
}

TEST(DevicesTest, CpuIsMeasuredWhenNothingElse) {
  std::vector<Device> devices = DiscoverDevices({});
  ASSERT_FALSE(devices.empty());
  if (devices[0].kind() == DEVICE_KIND_CPU) {
    EXPECT_GT(devices[0].tflops(), 0.001);  // any CPU of this decade does more than 1 GFLOP/s
    EXPECT_GT(devices[0].memory_bytes(), 1ull << 28);
  }
  auto emulated = DiscoverDevices({*ParseEmulatedDevice("T4"), *ParseEmulatedDevice("A30")});
  ASSERT_EQ(emulated.size(), 2u);
  EXPECT_EQ(emulated[1].index(), 1);
}

TEST(DevicesTest, SlowedDevicesCarryTheFactorAndDividedFigures) {
  Device cpu;
  cpu.set_kind(DEVICE_KIND_CPU);
  cpu.set_name("cpu x2");
  cpu.set_tflops(0.2);
  cpu.set_memory_bytes(8000000000ull);
  std::vector<Device> devices = {cpu, *ParseEmulatedDevice("A30")};
  const Device a30 = devices[1];
  ASSERT_GT(a30.fp32_tflops(), 0);  // a known GPU's per-precision peaks: divided too
  ASSERT_TRUE(SlowDevices(2.5, &devices).ok());
  EXPECT_DOUBLE_EQ(devices[0].slowdown(), 2.5);
  EXPECT_DOUBLE_EQ(devices[0].tflops(), 0.2 / 2.5);
  EXPECT_EQ(devices[0].memory_bytes(), 8000000000ull);  // slower, not smaller
  EXPECT_EQ(devices[0].name(), "cpu x2 (EMULATED: slowed 2.5x)");
  EXPECT_DOUBLE_EQ(devices[1].slowdown(), 2.5);
  EXPECT_DOUBLE_EQ(devices[1].tflops(), a30.tflops() / 2.5);
  EXPECT_DOUBLE_EQ(devices[1].fp32_tflops(), a30.fp32_tflops() / 2.5);
  EXPECT_DOUBLE_EQ(devices[1].fp16_tflops(), a30.fp16_tflops() / 2.5);
  EXPECT_DOUBLE_EQ(devices[1].bf16_tflops(), a30.bf16_tflops() / 2.5);
  EXPECT_EQ(devices[1].name(), "A30 (EMULATED: slowed 2.5x)");
  EXPECT_EQ(devices[1].compute_capability(), a30.compute_capability());

  // A factor of 1 is the default: nothing changes, and the devices do not say they are slowed.
  std::vector<Device> unslowed = {cpu};
  ASSERT_TRUE(SlowDevices(1, &unslowed).ok());
  EXPECT_EQ(unslowed[0].slowdown(), 0);
  EXPECT_DOUBLE_EQ(unslowed[0].tflops(), 0.2);
  EXPECT_EQ(unslowed[0].name(), "cpu x2");
}

TEST(DevicesTest, SlowdownRefusesBadFactorsTimedComputeAndCuda) {
  for (const double bad : {0.5, 0.0, -2.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    const absl::Status s = ValidateSlowdown(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), ::testing::HasSubstr("--slowdown")) << bad;
    EXPECT_THAT(s.message(), ::testing::HasSubstr("finite number >= 1")) << bad;
  }
  EXPECT_TRUE(ValidateSlowdown(1).ok());
  EXPECT_TRUE(ValidateSlowdown(1.5).ok());
  EXPECT_TRUE(ValidateSlowdown(1, /*timed_compute=*/true).ok());  // the default goes with anything
  EXPECT_THAT(ValidateSlowdown(2, /*timed_compute=*/true).message(), ::testing::HasSubstr("--timed-compute"));

  Device gpu;
  gpu.set_kind(DEVICE_KIND_CUDA);
  gpu.set_name("NVIDIA H100 80GB HBM3");
  gpu.set_tflops(989);
  std::vector<Device> cuda = {gpu};
  const absl::Status on_cuda = SlowDevices(2, &cuda);
  EXPECT_EQ(on_cuda.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(on_cuda.message(), ::testing::HasSubstr("CUDA GPU"));
  EXPECT_THAT(on_cuda.message(), ::testing::HasSubstr("--emulate-device"));  // the fix
  EXPECT_DOUBLE_EQ(cuda[0].tflops(), 989);                                   // refused: left as it was
  EXPECT_EQ(cuda[0].slowdown(), 0);

  std::vector<Device> timed = {*ParseEmulatedDevice("H100")};
  timed[0].set_timed_compute(true);
  EXPECT_THAT(SlowDevices(2, &timed).message(), ::testing::HasSubstr("--timed-compute"));
  EXPECT_EQ(timed[0].slowdown(), 0);
  Device cpu;
  cpu.set_kind(DEVICE_KIND_CPU);
  cpu.set_tflops(0.2);
  std::vector<Device> below_one = {cpu};
  EXPECT_THAT(SlowDevices(0.9, &below_one).message(), ::testing::HasSubstr("finite number >= 1"));
  EXPECT_DOUBLE_EQ(below_one[0].tflops(), 0.2);
}

}  // namespace
}  // namespace geotrain::worker
