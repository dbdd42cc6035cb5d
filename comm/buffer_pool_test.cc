// BufferPool: reuse by size class, and which buffers go when a cap is reached (the least recently given back,
// so that one job's sizes do not hold the pool against the next job's).
#include "comm/buffer_pool.h"

#include <vector>

#include "gtest/gtest.h"

namespace geotrain::comm {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(BufferPoolTest, AGivenBackBufferServesTheNextTakeOfItsClass) {
  BufferPool pool(64 * kMiB, 8);
  uint8_t* a = pool.Take(2 * kMiB);
  pool.Give(a, 2 * kMiB);
  uint8_t* other = pool.Take(3 * kMiB);  // another class: not the cached one
  EXPECT_NE(other, a);
  EXPECT_EQ(pool.Take(2 * kMiB), a);
  const BufferPool::Stats s = pool.stats();
  EXPECT_EQ(s.hits, 1);
  EXPECT_EQ(s.misses, 2);
  EXPECT_EQ(s.cached_bytes, 0u);
  pool.Give(a, 2 * kMiB);
  pool.Give(other, 3 * kMiB);
  EXPECT_EQ(pool.stats().cached_bytes, 5 * kMiB);
}

// One job fills the pool with its sizes; the next job's buffers are cached all the same, and the old job's
// oldest buffers go to make room (before, the new sizes were freed and every one of them was fresh memory).
TEST(BufferPoolTest, ANewSizeDisplacesTheLeastRecentlyGivenBack) {
  BufferPool pool(4 * kMiB, 8);
  std::vector<uint8_t*> old_job;
  for (int i = 0; i < 4; ++i) old_job.push_back(pool.Take(kMiB));
  for (uint8_t* p : old_job) pool.Give(p, kMiB);  // old_job[0] given back first: the oldest
  EXPECT_EQ(pool.stats().cached_bytes, 4 * kMiB);

  uint8_t* next_job = pool.Take(2 * kMiB);
  pool.Give(next_job, 2 * kMiB);
  BufferPool::Stats s = pool.stats();
  EXPECT_EQ(s.evicted, 2);  // old_job[0] and [1]
  EXPECT_EQ(s.cached_bytes, 4 * kMiB);
  EXPECT_EQ(pool.Take(2 * kMiB), next_job);
  // The newest of the old job's class is taken first.
  EXPECT_EQ(pool.Take(kMiB), old_job[3]);
  EXPECT_EQ(pool.Take(kMiB), old_job[2]);
  s = pool.stats();
  EXPECT_EQ(s.hits, 3);
  EXPECT_EQ(s.cached_buffers, 0u);
  pool.Give(next_job, 2 * kMiB);
  pool.Give(old_job[2], kMiB);
  pool.Give(old_job[3], kMiB);
}

TEST(BufferPoolTest, AClassKeepsAtMostItsCapAndTheNewestStay) {
  BufferPool pool(64 * kMiB, 2);
  std::vector<uint8_t*> taken;
  for (int i = 0; i < 3; ++i) taken.push_back(pool.Take(kMiB));
  for (uint8_t* p : taken) pool.Give(p, kMiB);
  const BufferPool::Stats s = pool.stats();
  EXPECT_EQ(s.evicted, 1);
  EXPECT_EQ(s.cached_buffers, 2u);
  EXPECT_EQ(pool.Take(kMiB), taken[2]);
  EXPECT_EQ(pool.Take(kMiB), taken[1]);
  pool.Give(taken[1], kMiB);
  pool.Give(taken[2], kMiB);
}

TEST(BufferPoolTest, ABufferLargerThanThePoolIsFreedNotCached) {
  BufferPool pool(2 * kMiB, 8);
  pool.Give(pool.Take(4 * kMiB), 4 * kMiB);
  EXPECT_EQ(pool.stats().cached_bytes, 0u);
  EXPECT_EQ(pool.stats().evicted, 0);
}

TEST(BufferPoolTest, BytesOfAMegabyteAndMoreComeFromTheGlobalPool) {
  const uint8_t* first = nullptr;
  {
    Bytes b(3 * kMiB + 5);
    first = b.data();
    EXPECT_EQ(b.size(), 3 * kMiB + 5);
  }
  const int64_t hits = BufferPool::Global().stats().hits;  // after b: other tests in this process may have hit too
  Bytes again(3 * kMiB + 100);                             // the same class (64 KiB granularity)
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(BufferPool::Global().stats().hits, hits + 1);
}

}  // namespace
}  // namespace geotrain::comm
