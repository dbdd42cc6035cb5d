// Bytes and its pool of large buffers (see buffer_pool.h).
#include "comm/buffer_pool.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <vector>

namespace geotrain::comm {

namespace {

// Recycles large buffers: a fresh multi-megabyte allocation is mmap'ed and every page is faulted in and
// zeroed by the kernel on first touch, which costs more than encoding it. Tensors of the same size recur
// every step, so buffers are kept per size class (64 KiB granularity) up to a total cap.
class BufferPool {
 public:
  static constexpr size_t kMinPooled = size_t{1} << 20;
  static constexpr size_t kGranularity = size_t{64} << 10;
  static constexpr size_t kMaxCachedBytes = size_t{1} << 30;
  static constexpr size_t kMaxPerClass = 8;

  static BufferPool& Get() {
    static BufferPool* pool = new BufferPool();
    return *pool;
  }
  static size_t ClassOf(size_t size) { return (size + kGranularity - 1) / kGranularity * kGranularity; }

  uint8_t* Take(size_t capacity) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(capacity);
      if (it != free_.end() && !it->second.empty()) {
        uint8_t* p = it->second.back();
        it->second.pop_back();
        cached_ -= capacity;
        return p;
      }
    }
    return new uint8_t[capacity];
  }
  void Give(uint8_t* p, size_t capacity) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<uint8_t*>& list = free_[capacity];
      if (cached_ + capacity <= kMaxCachedBytes && list.size() < kMaxPerClass) {
        list.push_back(p);
        cached_ += capacity;
        return;
      }
    }
    delete[] p;
  }

 private:
  std::mutex mu_;
  std::map<size_t, std::vector<uint8_t*>> free_;
  size_t cached_ = 0;
};

}  // namespace

Bytes::Bytes(size_t size) : size_(size), capacity_(size) {
  if (size == 0) return;
  if (size < BufferPool::kMinPooled) {
    data_ = std::shared_ptr<uint8_t[]>(new uint8_t[size]);
    return;
  }
  capacity_ = BufferPool::ClassOf(size);
  const size_t capacity = capacity_;
  data_ = std::shared_ptr<uint8_t[]>(BufferPool::Get().Take(capacity),
                                     [capacity](uint8_t* p) { BufferPool::Get().Give(p, capacity); });
}

void Bytes::Shrink(size_t size) { size_ = std::min(size, capacity_); }

}  // namespace geotrain::comm
