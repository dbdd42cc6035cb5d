// Delay line with an injected time: fixed latency, jitter bounds and spread, and no reordering.
#include "netem/delay_line.h"

#include <gtest/gtest.h>

#include <set>

namespace geotrain::netem {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

TEST(DelayLineTest, WithoutJitterEveryChunkWaitsTheLatency) {
  DelayLine line(1);
  const TimePoint t0 = TimePoint{} + milliseconds(100);
  for (int i = 0; i < 10; ++i) {
    const TimePoint sent = t0 + milliseconds(i);
    EXPECT_EQ(line.Release(sent, milliseconds(30), Duration::zero()), sent + milliseconds(30));
  }
}

TEST(DelayLineTest, JitterStaysWithinBoundsAndVaries) {
  DelayLine line(7);
  const TimePoint t0 = TimePoint{} + milliseconds(100);
  std::set<int64_t> delays_us;
  double sum_us = 0;
  const int n = 2000;
  for (int i = 0; i < n; ++i) {
    // Chunks 100 ms apart: far enough that ordering never binds.
    const TimePoint sent = t0 + milliseconds(100) * i;
    const TimePoint release = line.Release(sent, milliseconds(20), milliseconds(5));
    const int64_t us = std::chrono::duration_cast<microseconds>(release - sent).count();
    ASSERT_GE(us, 15000);
    ASSERT_LE(us, 25000);
    delays_us.insert(us / 1000);
    sum_us += us;
  }
  EXPECT_GE(delays_us.size(), 9u);      // spread over the whole +-5 ms range
  EXPECT_NEAR(sum_us / n, 20000, 300);  // uniform around the latency
}

TEST(DelayLineTest, JitterNeverReordersCloseChunks) {
  DelayLine line(3);
  const TimePoint t0 = TimePoint{} + milliseconds(100);
  TimePoint previous{};
  for (int i = 0; i < 5000; ++i) {
    const TimePoint sent = t0 + microseconds(50) * i;  // far closer than the jitter
    const TimePoint release = line.Release(sent, milliseconds(10), milliseconds(4));
    ASSERT_GE(release, previous) << "chunk " << i;
    ASSERT_GE(release, sent + milliseconds(6));
    previous = release;
  }
}

TEST(DelayLineTest, JitterLargerThanLatencyNeverDeliversEarly) {
  DelayLine line(11);
  const TimePoint t0 = TimePoint{} + milliseconds(100);
  for (int i = 0; i < 1000; ++i) {
    const TimePoint sent = t0 + milliseconds(50) * i;
    ASSERT_GE(line.Release(sent, milliseconds(1), milliseconds(10)), sent);
  }
}

TEST(DelayLineTest, SameSeedSameDelays) {
  DelayLine a(42), b(42);
  const TimePoint t0 = TimePoint{} + milliseconds(100);
  for (int i = 0; i < 100; ++i) {
    const TimePoint sent = t0 + milliseconds(10) * i;
    EXPECT_EQ(a.Release(sent, milliseconds(5), milliseconds(2)), b.Release(sent, milliseconds(5), milliseconds(2)));
  }
}

}  // namespace
}  // namespace geotrain::netem
