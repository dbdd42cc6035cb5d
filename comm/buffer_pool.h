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
#include <memory>

#include "absl/types/span.h"

namespace geotrain::comm {

// An owned byte buffer that is left uninitialised on allocation (no memset of large tensors). Copies
// share the same memory (so that gRPC slices can reference it without copying); treat the contents as
// immutable once they are shared. Buffers of 1 MiB and more are recycled through a process-wide pool
// (at most 1 GiB kept), because first-touch page faults on fresh large allocations cost more than encoding.
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
