// The receiving side of a tensor stream without gRPC: parses each chunk message (a TensorChunk on the wire),
// validates the sequence of chunks of one stream, and assembles each tensor either into a mailbox buffer or,
// when a RecvInto is already waiting for it, decoded chunk by chunk straight into that receiver's buffer.
// TensorStreamServer's reactor runs one assembler per stream and feeds it every message gRPC delivers;
// fuzz/tensor_chunks_fuzzer.cc feeds it arbitrary bytes with a fake sink. The sink is where tensors go: the
// server's mailbox and its waiting RecvInto buffers.
//
//   TensorChunkAssembler assembler(options, &sink);
//   for each message of the stream:
//     absl::StatusOr<bool> delivered = assembler.AddChunk(pieces);
//     if (!delivered.ok()) { assembler.Abandon(); finish the stream with delivered.status(); }
//     else if (*delivered) ack(assembler.delivered_key(), assembler.delivered_bytes());
//   at the stream's end: assembler.Abandon() (a tensor still in progress gives back its reservation or claim)
//
// What is checked (tensor_stream_server.h's contract): key field sizes, dtype, shape (rank, non-negative dims, product
// without overflow), codec name, total size against the codec's size for that element count and
// options.max_tensor_bytes, chunk size, contiguous offsets, the last flag, the trailer (only on the last chunk,
// only with a zero header checksum), the payload CRC-32C, and the codec header (its CRC, element count = shape
// product, kind and flags as the stream header says; on the decode-on-arrival path byte for byte against the
// header a whole-tensor encode of the payload would have). Nothing is allocated before the header passed and
// the sink's Reserve accepted the tensor's size; nothing is written into a claimed buffer outside the sink's
// BeginWrite/EndWrite brackets. Errors: INVALID_ARGUMENT, DATA_LOSS for checksums, RESOURCE_EXHAUSTED for sizes
// over the limits, or whatever the sink returns.
// Threads: one assembler per stream, used by one thread at a time; the sink is called from that thread.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "comm/codec.h"
#include "comm/tensor_types.h"

namespace geotrain {
class TensorHeader;  // proto/tensor.proto
class TensorKey;
}  // namespace geotrain

namespace geotrain::comm {

// The key as the wire carries it, both ways (the sender's header and the receiver's ack).
TensorKey KeyFromProto(const geotrain::TensorKey& key);
void KeyToProto(const TensorKey& key, geotrain::TensorKey* out);

// The element count of `shape`: at most max_rank dimensions, none negative, product <= kMaxCodecElements.
absl::StatusOr<uint64_t> ShapeElements(absl::Span<const int64_t> shape, int max_rank);

// Encode + CRC and copy + CRC work in blocks of this size so that the second pass reads from L1/L2.
inline constexpr size_t kStreamCacheBlockBytes = 64 * 1024;

class ChunkReader;  // tensor_chunks.cc: reads a message spread over several pieces

class TensorChunkAssembler {
 public:
  // `sink` must outlive the assembler.
  TensorChunkAssembler(const TensorStreamOptions& options, TensorSink* sink);
  ~TensorChunkAssembler();  // Abandon()
  TensorChunkAssembler(const TensorChunkAssembler&) = delete;
  TensorChunkAssembler& operator=(const TensorChunkAssembler&) = delete;

  // One chunk message, given as the pieces it arrived in. true: it completed a tensor, which is now delivered
  // (delivered_key() and delivered_bytes() say which, for the ack); false: accepted, the tensor goes on. An error
  // means the stream is malformed or the sink refused the tensor: call Abandon() and end the stream with it.
  absl::StatusOr<bool> AddChunk(absl::Span<const absl::Span<const uint8_t>> message);

  // Gives back what the tensor in progress holds (its mailbox reservation, or its claim on a receiver's buffer)
  // and forgets it. Harmless when nothing is in progress.
  void Abandon();

  // A tensor is being received (a header came, its last chunk has not).
  bool in_progress() const { return in_progress_; }
  // The key of the tensor in progress (for errors).
  const TensorKey& current_key() const { return tensor_.key; }
  // The tensor the last AddChunk delivered.
  const TensorKey& delivered_key() const { return delivered_key_; }
  uint64_t delivered_bytes() const { return delivered_bytes_; }

 private:
  absl::Status BeginTensor(const TensorHeader& header, uint64_t offset);
  void CopyChunk(ChunkReader* payload, uint64_t len);
  absl::Status DecodeChunk(ChunkReader* payload, uint64_t len);
  absl::Status FinishTensor(const uint64_t* trailer);

  const TensorStreamOptions options_;
  TensorSink* const sink_;
  bool in_progress_ = false;
  ReceivedTensor tensor_;  // key, shape and codec name; `encoded` holds the bytes on the mailbox path
  std::shared_ptr<TensorDestination> destination_;  // or: the receiver's buffer the chunks are decoded into
  uint8_t codec_header_[kCodecHeaderBytes] = {};    // the codec header as received (decode-on-arrival path)
  std::vector<uint8_t> staging_;                    // fp16/bf16 blocks being decoded (decode-on-arrival path)
  uint64_t carry_ = 0;                              // bytes of a partial element at the start of staging_'s block
  uint64_t decoded_ = 0;                            // elements written into destination_->out
  Codec codec_;
  size_t element_bytes_ = 0;  // of the element-wise codecs; 0 for the others
  uint64_t elements_ = 0;
  uint64_t total_ = 0;
  uint64_t chunk_bytes_ = 0;
  uint64_t received_ = 0;
  uint64_t reserved_ = 0;
  uint32_t expected_crc_ = 0;
  uint32_t crc_ = 0;
  TensorKey delivered_key_;
  uint64_t delivered_bytes_ = 0;
};

}  // namespace geotrain::comm
