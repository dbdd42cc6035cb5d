// CRC-32C (Castagnoli), the checksum of the codec wire format (codec.h) and of tensor-stream chunks.
//
//   uint32_t crc = Crc32c(first.data(), first.size());
//   crc = Crc32c(second.data(), second.size(), crc);   // == Crc32c of first || second
//
// Hardware-accelerated where SSE4.2 is present (three interleaved streams of the crc32 instruction), a
// slicing-by-8 table elsewhere; both give the same value. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace geotrain::comm {

// CRC-32C of `size` bytes at `data`. `crc` chains calls: pass the previous result to continue it.
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

}  // namespace geotrain::comm
