// Fuzzes the receiving side of a tensor stream (comm/tensor_chunks.h TensorChunkAssembler, what the worker's
// TensorStream reactor runs on every message a peer sends), without gRPC. The input is a stream: messages, each
// a 2-byte little-endian length then that many bytes (a serialized TensorChunk), each handed over in two
// pieces split where its first byte says (gRPC delivers a message as several slices). The stream stops at the
// first error, as the server finishes the call. Checked: nothing is allocated before the reservation, the
// reservations stay within the receiver's limit, and a tensor that completes has the size its header gave, a
// codec header that agrees with the stream header, and decodes (or fails cleanly) into its element count.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "comm/codec.h"
#include "comm/tensor_chunks.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  geotrain::comm::TensorStreamOptions options;
  options.max_tensor_bytes = 1 << 20;
  options.max_chunk_bytes = 64 << 10;
  uint64_t reserved = 0;
  geotrain::comm::TensorChunkAssembler assembler(options, [&](uint64_t bytes) {
    FUZZ_CHECK(bytes <= options.max_tensor_bytes, "reservations within max_tensor_bytes");
    reserved = bytes;
    return absl::OkStatus();
  });
  size_t at = 0;
  while (at + 2 <= size) {
    const size_t length = std::min<size_t>(data[at] | (size_t{data[at + 1]} << 8), size - at - 2);
    const uint8_t* message = data + at + 2;
    at += 2 + length;
    const size_t split = length == 0 ? 0 : message[0] % (length + 1);
    const absl::Span<const uint8_t> pieces[2] = {{message, split}, {message + split, length - split}};
    if (!assembler.AddChunk(pieces).ok()) return 0;
    if (!assembler.has_complete()) continue;
    geotrain::comm::ReceivedTensor tensor = assembler.TakeComplete();
    FUZZ_CHECK(tensor.encoded.size() == reserved, "a tensor is as large as its reservation");
    absl::StatusOr<geotrain::comm::EncodedInfo> info =
        geotrain::comm::InspectEncoded(tensor.encoded.span(), /*verify_checksum=*/true);
    FUZZ_CHECK(info.ok(), "a delivered tensor has a valid codec header and payload CRC");
    FUZZ_CHECK(static_cast<int64_t>(info->element_count) == tensor.num_elements(), "element count = shape product");
    if (info->element_count <= (1u << 20)) {
      std::vector<float> out(info->element_count);
      (void)tensor.DecodeInto(absl::MakeSpan(out));
    }
  }
  return 0;
}
