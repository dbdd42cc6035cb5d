// The receiving side of a tensor stream without gRPC: parses each chunk message (a TensorChunk on the wire) and
// validates the sequence of chunks of one stream, assembling tensors. TensorStreamServer's reactor feeds it the
// messages gRPC delivers; fuzz/tensor_chunks_fuzzer.cc feeds it arbitrary bytes.
//
//   TensorChunkAssembler assembler(options, [&](uint64_t bytes) { return mailbox.Reserve(bytes); });
//   for each message of the stream:
//     RETURN_IF_ERROR(assembler.AddChunk(pieces));     // an error ends the stream with that status
//     if (assembler.has_complete()) Deliver(assembler.TakeComplete());
//
// What is checked (tensor_stream.h's contract): key field sizes, dtype, shape (rank, non-negative dims, product
// without overflow), codec name, total size against the codec's size for that element count and
// options.max_tensor_bytes, chunk size, contiguous offsets, the last flag, the trailer (only on the last chunk,
// only with a zero header checksum), the payload CRC-32C, and the codec header (its CRC, element count = shape
// product, kind and flags as the stream header says). Nothing is allocated before the header passed and
// `reserve` accepted the tensor's size. Errors: INVALID_ARGUMENT, DATA_LOSS for checksums, RESOURCE_EXHAUSTED
// for sizes over the limits, or whatever `reserve` returns.
// Threads: one assembler per stream, used by one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "comm/codec.h"
#include "comm/tensor_stream.h"

namespace geotrain {
class TensorHeader;  // proto/tensor.proto
class TensorKey;
}  // namespace geotrain

namespace geotrain::comm {

// The key as the wire carries it.
TensorKey KeyFromProto(const geotrain::TensorKey& key);

// The element count of `shape`: at most max_rank dimensions, none negative, product <= kMaxCodecElements.
absl::StatusOr<uint64_t> ShapeElements(absl::Span<const int64_t> shape, int max_rank);

class TensorChunkAssembler {
 public:
  // `reserve(bytes)` is called once per tensor, after its header is validated and before its buffer is
  // allocated; its error ends the stream. The caller owns the reservation (and releases it on error).
  TensorChunkAssembler(const TensorStreamOptions& options, std::function<absl::Status(uint64_t)> reserve);

  // One chunk message, given as the pieces it arrived in. OK: accepted, and has_complete() tells whether it
  // completed a tensor. An error means the stream is malformed: finish it with that status.
  absl::Status AddChunk(absl::Span<const absl::Span<const uint8_t>> message);

  // A tensor is being received (a header came, its last chunk has not).
  bool in_progress() const { return in_progress_; }
  // The key of the tensor in progress (for errors).
  const TensorKey& current_key() const { return tensor_.key; }
  // The last AddChunk completed a tensor; TakeComplete() hands it over (once).
  bool has_complete() const { return has_complete_; }
  ReceivedTensor TakeComplete();

 private:
  absl::Status BeginTensor(const TensorHeader& header, uint64_t offset);
  absl::Status FinishTensor(const uint64_t* trailer);

  const TensorStreamOptions options_;
  const std::function<absl::Status(uint64_t)> reserve_;
  bool in_progress_ = false;
  bool has_complete_ = false;
  ReceivedTensor tensor_;
  Codec codec_;
  uint64_t elements_ = 0;
  uint64_t chunk_bytes_ = 0;
  uint64_t received_ = 0;
  uint32_t expected_crc_ = 0;
  uint32_t crc_ = 0;
};

}  // namespace geotrain::comm
