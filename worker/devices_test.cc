// Emulated device parsing and the CPU probe.
#include "worker/devices.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

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
  EXPECT_THAT(ParseEmulatedDevice("Z9:x:1").status().message(), ::testing::HasSubstr("NAME:TFLOPS:MEM_GB"));
  EXPECT_FALSE(ParseEmulatedDevice("Z9").ok());
  EXPECT_FALSE(ParseEmulatedDevice("T4:-1:16").ok());
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

}  // namespace
}  // namespace geotrain::worker
