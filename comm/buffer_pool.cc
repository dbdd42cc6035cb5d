// Bytes and its pool of large buffers (see buffer_pool.h).
#include "comm/buffer_pool.h"

#include <algorithm>
#include <iterator>
#include <vector>

namespace geotrain::comm {

BufferPool::~BufferPool() {
  absl::MutexLock lock(&mu_);
  for (const Cached& c : lru_) delete[] c.p;
}

BufferPool& BufferPool::Global() {
  static BufferPool* pool = new BufferPool(size_t{1} << 30, 8);
  return *pool;
}

uint8_t* BufferPool::Take(size_t capacity) {
  {
    absl::MutexLock lock(&mu_);
    auto it = classes_.find(capacity);
    if (it != classes_.end() && !it->second.empty()) {
      const Lru::iterator newest = it->second.back();  // the warmest in cache
      uint8_t* p = newest->p;
      it->second.pop_back();
      if (it->second.empty()) classes_.erase(it);
      lru_.erase(newest);
      stats_.cached_bytes -= capacity;
      --stats_.cached_buffers;
      ++stats_.hits;
      return p;
    }
    ++stats_.misses;
  }
  return new uint8_t[capacity];
}

uint8_t* BufferPool::EvictLocked(Lru::iterator it) {
  auto cls = classes_.find(it->capacity);
  std::deque<Lru::iterator>& entries = cls->second;  // at most max_per_class_ entries
  entries.erase(std::find(entries.begin(), entries.end(), it));
  if (entries.empty()) classes_.erase(cls);
  stats_.cached_bytes -= it->capacity;
  --stats_.cached_buffers;
  ++stats_.evicted;
  uint8_t* p = it->p;
  lru_.erase(it);
  return p;
}

void BufferPool::Give(uint8_t* p, size_t capacity) {
  if (capacity > max_cached_bytes_ || max_per_class_ == 0) {
    delete[] p;
    return;
  }
  std::vector<uint8_t*> evicted;  // freed after the lock: freeing a large buffer unmaps it, which takes a while
  {
    absl::MutexLock lock(&mu_);
    auto cls = classes_.find(capacity);
    if (cls != classes_.end() && cls->second.size() >= max_per_class_) {
      evicted.push_back(EvictLocked(cls->second.front()));
    }
    while (capacity > max_cached_bytes_ - stats_.cached_bytes) evicted.push_back(EvictLocked(std::prev(lru_.end())));
    lru_.push_front(Cached{p, capacity});
    classes_[capacity].push_back(lru_.begin());
    stats_.cached_bytes += capacity;
    ++stats_.cached_buffers;
  }
  for (uint8_t* e : evicted) delete[] e;
}

BufferPool::Stats BufferPool::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

Bytes::Bytes(size_t size) : size_(size), capacity_(size) {
  if (size == 0) return;
  if (size < BufferPool::kMinPooled) {
    data_ = std::shared_ptr<uint8_t[]>(new uint8_t[size]);
    return;
  }
  capacity_ = BufferPool::ClassOf(size);
  const size_t capacity = capacity_;
  data_ = std::shared_ptr<uint8_t[]>(BufferPool::Global().Take(capacity),
                                     [capacity](uint8_t* p) { BufferPool::Global().Give(p, capacity); });
}

void Bytes::Shrink(size_t size) { size_ = std::min(size, capacity_); }

}  // namespace geotrain::comm
