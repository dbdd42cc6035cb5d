// The low-bit codecs' payloads: int4 (block-scaled 4-bit) and sparse (top-k per block, kept values of B bits), with
// their error feedback. Internal to comm/ (codec.cc is the only caller; the wire layout is documented in codec.h).
//
//   std::vector<float> residual;                        // one per tensor, kept across calls
//   RETURN_IF_ERROR(internal::EncodeSparse(codec, grad, &residual, raw));   // raw: CodecRawPayloadBytes bytes
//   RETURN_IF_ERROR(internal::CheckSparse(raw, raw_bytes, count));          // a received payload, before use
//   internal::DecodeSparse(raw, count, out, /*accumulate=*/false);
//
// Error feedback: with a residual the encoder sends input + residual and leaves in the residual exactly what the
// receiver does not get (accumulated - decoded, the decoded value computed as the decoder computes it), so that over
// calls sum(decoded) + residual == sum(inputs) up to one float rounding per call. The residual is written only when
// encoding succeeds: a NaN or infinity in input + residual is refused before anything is written (AccumulatedFinite,
// which top-k in codec.cc checks too), so one bad element never spreads into the residual of the others.
// Thread safety: pure functions of their arguments; a residual must not be shared by concurrent calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/codec_spec.h"

namespace geotrain::comm::internal {

// Unaligned little-endian-host reads and writes of the wire formats' fields (codec.cc and codec_lowbit.cc).
template <typename T>
void Put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Whether input[i] + residual[i] (input[i] alone without a residual) is finite for every i: what the encoders with
// error feedback (top-k, int4, sparse) check before they write the residual. `residual`, if given, has input.size()
// elements.
bool AccumulatedFinite(absl::Span<const float> input, const std::vector<float>* residual);

// int4: writes CodecRawPayloadBytes(int4, input.size()) bytes to `raw` (zeroed by the caller is not needed).
// `residual` may be null (no error feedback); otherwise it is resized to input.size() (zeroed) if it differs.
// INVALID_ARGUMENT on NaN or infinity (in input + residual).
absl::Status EncodeInt4(absl::Span<const float> input, std::vector<float>* residual, uint8_t* raw);
// Validates an int4 payload of `count` elements (its size checked by the caller): scales finite and >= 0, no code
// -8 (the encoder writes -7..7), the padding nibble of an odd count zero. DATA_LOSS naming the block or element.
absl::Status CheckInt4(const uint8_t* raw, uint64_t count);
// Decodes elements [begin, begin + n) of a validated int4 payload; `begin` is a multiple of kCodecInt4BlockSize.
void DecodeInt4Range(const uint8_t* raw, uint64_t count, size_t begin, size_t n, float* out);

// sparse: writes CodecRawPayloadBytes(codec, input.size()) bytes to `raw`. `residual` is required (error feedback of
// everything not sent); INVALID_ARGUMENT without one, or on NaN or infinity.
absl::Status EncodeSparse(const CodecSpec& codec, absl::Span<const float> input, std::vector<float>* residual,
                          uint8_t* raw);
// Validates a sparse payload of `raw_bytes` bytes for `count` elements: the preamble (kept counts within their
// blocks, bits 2..8, reserved bytes zero), the size the counts give, scales finite and >= 0, indices inside their
// block and strictly increasing, the padding bits zero. DATA_LOSS naming what is wrong.
absl::Status CheckSparse(const uint8_t* raw, uint64_t raw_bytes, uint64_t count);
// Writes (or with `accumulate` adds) a validated sparse payload into out[0, count): the values not kept are 0.
void DecodeSparse(const uint8_t* raw, uint64_t count, float* out, bool accumulate);

}  // namespace geotrain::comm::internal
