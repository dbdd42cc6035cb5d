// Bytes: the owned byte buffer that encoded tensors live in, with a process-wide pool for large ones.
//
//   Bytes wire(kCodecHeaderBytes + payload);   // uninitialised; 1 MiB and more comes from the pool
//   std::memcpy(wire.data(), ..., wire.size());
//   grpc::Slice slice(wire.data(), wire.size(), ...);  // share wire.shared() instead of copying
//
// Thread safety: the pool is thread-safe; one Bytes object is not (copies are independent handles to the same
// memory, which must be treated as immutable once shared).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace geotrain::comm {

// Recycles large byte buffers by size class (64 KiB granularity): a fresh multi-megabyte allocation is faulted
// in and zeroed by the kernel page by page on first touch, which costs more than encoding it (and 3-10 s per GB
// on a VM whose host backs memory lazily). Tensors of the same sizes recur every step, so a given-back buffer
// is kept for the next Take of its class, up to max_cached_bytes in all and max_per_class per class.
//
// When a buffer would exceed a cap, the least recently given-back buffers go first (over the whole pool, or in
// its class for max_per_class), never the one being given back. A worker runs one job after another, and the
// sizes change with the plan: the buffers of a job that ended must not hold the cap against the next job's
// (they did, and every buffer of the next job was fresh memory: GPT-2 medium dp x pp 3.8 s per step on a fresh
// timed cluster, 5.0-6.1 s after a dp job; docs/results/2026-12-05-timed-worker-after-dp.md).
//
// Thread safety: every method may be called from any thread.
class BufferPool {
 public:
  static constexpr size_t kMinPooled = size_t{1} << 20;  // smaller buffers are not pooled (Bytes)
  static constexpr size_t kGranularity = size_t{64} << 10;

  struct Stats {
    int64_t hits = 0;     // Takes served from the pool
    int64_t misses = 0;   // Takes that allocated
    int64_t evicted = 0;  // cached buffers freed to make room
    size_t cached_bytes = 0;
    size_t cached_buffers = 0;
  };

  BufferPool(size_t max_cached_bytes, size_t max_per_class)
      : max_cached_bytes_(max_cached_bytes), max_per_class_(max_per_class) {}
  ~BufferPool();  // frees what it caches
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // The process-wide pool Bytes uses: 1 GiB, 8 buffers per class.
  static BufferPool& Global();
  // `size` rounded up to its class.
  static size_t ClassOf(size_t size) { return (size + kGranularity - 1) / kGranularity * kGranularity; }

  // A buffer of `capacity` bytes (a class size), uninitialised: a cached one of that class, or a new one.
  uint8_t* Take(size_t capacity);
  // Gives back a buffer Take returned for `capacity`; it is cached (evicting older ones if needed) or freed.
  void Give(uint8_t* p, size_t capacity);
  Stats stats() const;

 private:
  struct Cached {
    uint8_t* p;
    size_t capacity;
  };
  using Lru = std::list<Cached>;  // front: the most recently given back
  // Forgets a cached buffer and returns it, for the caller to free once the lock is released.
  uint8_t* EvictLocked(Lru::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_cached_bytes_;
  const size_t max_per_class_;
  mutable absl::Mutex mu_;
  Lru lru_ ABSL_GUARDED_BY(mu_);
  // Per class, its entries of lru_ from the oldest to the newest.
  std::map<size_t, std::deque<Lru::iterator>> classes_ ABSL_GUARDED_BY(mu_);
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

// An owned byte buffer that is left uninitialised on allocation (no memset of large tensors). Copies
// share the same memory (so that gRPC slices can reference it without copying); treat the contents as
// immutable once they are shared. Buffers of 1 MiB and more are recycled through BufferPool::Global().
class Bytes {
 public:
  Bytes() = default;
  explicit Bytes(size_t size);
  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  size_t size() const { return size_; }
  // Sets the size to `size` <= the allocated size (used after compressing into a worst-case buffer).
  void Shrink(size_t size);
  absl::Span<const uint8_t> span() const { return {data_.get(), size_}; }
  // Shared ownership of the memory, for zero-copy hand-off.
  const std::shared_ptr<uint8_t[]>& shared() const { return data_; }

 private:
  std::shared_ptr<uint8_t[]> data_;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

}  // namespace geotrain::comm
