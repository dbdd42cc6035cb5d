// Token bucket with an injected time: burst, steady rate, FIFO debt and rate changes.
#include "netem/token_bucket.h"

#include <gtest/gtest.h>

namespace geotrain::netem {
namespace {

using std::chrono::milliseconds;

TEST(TokenBucketTest, UnlimitedNeverDelays) {
  const TimePoint t0{};
  TokenBucket bucket(0, 1, t0);
  EXPECT_TRUE(bucket.unlimited());
  EXPECT_EQ(bucket.Reserve(t0, int64_t{1} << 40), t0);
  EXPECT_EQ(bucket.Reserve(t0 + milliseconds(1), 5), t0 + milliseconds(1));
}

TEST(TokenBucketTest, BurstGoesAtOnceThenTheRateHolds) {
  const TimePoint t0 = TimePoint{} + milliseconds(1000);
  TokenBucket bucket(/*bytes_per_second=*/1e6, /*burst_bytes=*/10000, t0);
  EXPECT_EQ(bucket.Reserve(t0, 10000), t0);  // the full bucket
  // 1,000 more bytes at 1 MB/s: 1 ms later.
  EXPECT_EQ(bucket.Reserve(t0, 1000), t0 + milliseconds(1));
  // FIFO: the next reservation waits behind the debt of the previous one.
  EXPECT_EQ(bucket.Reserve(t0, 2000), t0 + milliseconds(3));
  EXPECT_NEAR(bucket.TokensAt(t0), -3000, 1e-6);
  EXPECT_NEAR(bucket.TokensAt(t0 + milliseconds(3)), 0, 1e-6);
}

TEST(TokenBucketTest, LongRunRateEqualsTheCap) {
  TimePoint now{};
  TokenBucket bucket(1.25e6, 16384, now);  // 10 Mbit/s
  TimePoint done = now;
  int64_t bytes = 0;
  // A sender that reserves 4 KiB whenever the previous chunk has been sent.
  for (int i = 0; i < 1000; ++i) {
    done = bucket.Reserve(now, 4096);
    bytes += 4096;
    now = std::max(now, done);
  }
  const double seconds = std::chrono::duration<double>(done - TimePoint{}).count();
  EXPECT_NEAR((bytes - 16384) / seconds, 1.25e6, 1.25e6 * 0.001);
}

TEST(TokenBucketTest, IdleTimeRefillsOnlyUpToTheBurst) {
  const TimePoint t0{};
  TokenBucket bucket(1e6, 5000, t0);
  bucket.Reserve(t0, 5000);
  EXPECT_NEAR(bucket.TokensAt(t0 + milliseconds(2)), 2000, 1e-6);
  EXPECT_NEAR(bucket.TokensAt(t0 + milliseconds(100)), 5000, 1e-6);
  // After a long idle time a reservation larger than the burst pays only the excess.
  EXPECT_EQ(bucket.Reserve(t0 + milliseconds(100), 6000), t0 + milliseconds(101));
}

TEST(TokenBucketTest, SharedBetweenTwoSendersEachGetsHalf) {
  TimePoint now{};
  TokenBucket bucket(1e6, 1000, now);
  TimePoint next_a = now, next_b = now;
  int64_t a = 0, b = 0;
  const TimePoint end = now + milliseconds(1000);
  // Two senders reserve 1,000 bytes each time their previous chunk has gone; time advances to the
  // earliest of them.
  while (true) {
    now = std::min(next_a, next_b);
    if (now >= end) break;
    if (next_a <= next_b) {
      next_a = bucket.Reserve(now, 1000);
      a += 1000;
    } else {
      next_b = bucket.Reserve(now, 1000);
      b += 1000;
    }
  }
  EXPECT_NEAR(a + b, 1e6, 3000);
  EXPECT_NEAR(static_cast<double>(a) / (a + b), 0.5, 0.01);
}

TEST(TokenBucketTest, SetRateAppliesFromNow) {
  const TimePoint t0{};
  TokenBucket bucket(1e6, 1000, t0);
  bucket.Reserve(t0, 1000);
  bucket.SetRate(2e6, 1000, t0);
  EXPECT_EQ(bucket.Reserve(t0, 2000), t0 + milliseconds(1));
  bucket.SetRate(0, 1000, t0);
  EXPECT_TRUE(bucket.unlimited());
  EXPECT_EQ(bucket.Reserve(t0 + milliseconds(5), 1 << 20), t0 + milliseconds(5));
  // From unlimited to a cap: a full bucket, then the rate.
  bucket.SetRate(1e6, 1000, t0 + milliseconds(5));
  EXPECT_EQ(bucket.Reserve(t0 + milliseconds(5), 1000), t0 + milliseconds(5));
  EXPECT_EQ(bucket.Reserve(t0 + milliseconds(5), 1000), t0 + milliseconds(6));
}

TEST(TokenBucketTest, TimeGoingBackwardsIsClamped) {
  const TimePoint t0 = TimePoint{} + milliseconds(10);
  TokenBucket bucket(1e6, 1000, t0);
  bucket.Reserve(t0, 1000);
  // An earlier `now` is treated as t0: 1,000 bytes of debt take 1 ms from t0.
  EXPECT_EQ(bucket.Reserve(t0 - milliseconds(5), 1000), t0 + milliseconds(1));
}

}  // namespace
}  // namespace geotrain::netem
