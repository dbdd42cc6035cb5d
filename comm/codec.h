// Tensor codecs: how fp32 tensors are encoded on a link (inside a site, across sites).
//
//   ASSIGN_OR_RETURN(Codec codec, ParseCodec("bf16+zstd"));
//   Bytes wire;
//   RETURN_IF_ERROR(EncodeTensor(codec, grad, &wire));            // grad: absl::Span<const float>
//   RETURN_IF_ERROR(DecodeTensor(wire.span(), absl::MakeSpan(out)));  // validates everything first
//
// Codecs: "none" (fp32 as is), "fp16" and "bf16" (round to nearest even), "int8" (symmetric, one fp32
// scale per block of kInt8BlockSize elements), "topk:F" (the F*n largest magnitudes with their indices;
// gradients only, with error feedback: the caller keeps one residual vector per tensor), each optionally
// followed by "+zstd" or "+zstd:LEVEL" (zstd over the encoded payload).
//
// Error bounds (per element x, decoded y), tested in comm/codec_test.cc:
//   fp16: |y - x| <= 2^-11 |x| for normal fp16 range (|x| in [2^-14, 65504]);
//   bf16: |y - x| <= 2^-8 |x| for normal values;
//   int8: |y - x| <= scale/2 with scale = max|block| / 127, i.e. max|block| / 254;
//   topk: kept entries exact; the others are 0 and go into the residual, so that over steps
//         sum(decoded) + residual == sum(inputs) (error feedback conserves every element's sum).
//
// Wire format (little endian): a 40-byte header, then the payload.
//   u32 magic "GTDC" | u8 version (1) | u8 codec kind | u8 flags (bit 0: zstd) | u8 reserved (0)
//   u64 element count | u64 payload bytes (after the header, as sent) | u64 raw payload bytes (before zstd)
//   u32 CRC-32C of the payload | u32 CRC-32C of the 36 header bytes before it
// Raw payload per kind: none: count x f32; fp16/bf16: count x u16; int8: ceil(count/256) x f32 scales then
// count x i8; topk: u64 k, then k x u32 strictly increasing indices, then k x f32 values.
// Decoding checks the magic, version, kind, flags, header checksum, sizes against the element count, the
// payload checksum, zstd's frame size, int8 scales (finite, >= 0) and top-k indices (in range, increasing)
// before it writes anything; bad input is an absl error (DATA_LOSS or INVALID_ARGUMENT), never a crash.
//
// Thread safety: all functions are thread-safe; a residual vector must not be shared by concurrent calls.
// Speed: the element loops are compiled for AVX-512, AVX2 and plain x86-64 and chosen at run time.
// Files: codec.cc (wire header, encode and decode), codec_kernels.{h,cc} (the element loops per
// instruction set), crc32c.{h,cc} (checksums), buffer_pool.{h,cc} (Bytes and its pool of large buffers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "comm/buffer_pool.h"   // Bytes
#include "comm/crc32c.h"        // Crc32c
#include "common/codec_spec.h"  // Codec, CodecKind, ParseCodec

namespace geotrain::comm {

// A codec is what its name says (common/codec_spec.h holds the one parser, which the planner shares).
using Codec = ::geotrain::CodecSpec;
using CodecKind = ::geotrain::CodecKind;

inline constexpr size_t kInt8BlockSize = 256;
inline constexpr size_t kCodecHeaderBytes = 40;
inline constexpr uint32_t kCodecMagic = 0x43445447;  // "GTDC" in little endian
// Element counts above this are refused (keeps every size computation far from overflow).
inline constexpr uint64_t kMaxCodecElements = uint64_t{1} << 40;

// Parses "none" | "fp16" | "bf16" | "int8" | "topk:F" (0 < F <= 1), each optionally "+zstd" or "+zstd:L"
// (L in 1..19): ParseCodecSpec under comm's name. Errors name the bad part and list the accepted forms.
inline absl::StatusOr<Codec> ParseCodec(std::string_view text) { return ParseCodecSpec(text); }

// What the header of an encoded tensor says, once validated.
struct EncodedInfo {
  Codec codec;  // kind and zstd flag (the top-k fraction and zstd level are not on the wire)
  uint64_t element_count = 0;
  uint64_t payload_bytes = 0;
  uint64_t raw_payload_bytes = 0;
  uint32_t payload_crc = 0;
};

// Encodes `input` into `*out` (replaced). For kTopK, `residual` is required: it holds the error
// feedback of this tensor (resized to input.size() and zeroed if its size differs) and is updated.
absl::Status EncodeTensor(const Codec& codec, absl::Span<const float> input, Bytes* out,
                          std::vector<float>* residual = nullptr);

// Encoding by ranges, for the element-wise codecs ("none", "fp16", "bf16", without zstd): the same bytes as
// EncodeTensor, produced a range of elements at a time so that a sender can send one chunk while it encodes the
// next. EncodedElementBytes is 4 or 2 for those codecs and 0 for the others (int8's scales precede all values;
// top-k and zstd need the whole tensor). EncodeElements writes input.size() encoded elements to `out`;
// WriteCodecHeader writes the 40-byte header for `element_count` elements whose payload has CRC-32C `payload_crc`.
// Which of the two ways a tensor is sent is decided in one place: OutgoingTensor (comm/tensor_stream_client.h).
size_t EncodedElementBytes(const Codec& codec);
void EncodeElements(const Codec& codec, absl::Span<const float> input, uint8_t* out);
void WriteCodecHeader(const Codec& codec, uint64_t element_count, uint32_t payload_crc, uint8_t* out);

// Whether an encoded tensor of `codec` with `element_count` elements may be `encoded_bytes` long (exact for
// the fixed-size codecs, an upper bound for top-k and zstd). Receivers check this before allocating.
absl::Status CheckEncodedSize(const Codec& codec, uint64_t element_count, uint64_t encoded_bytes);

// Validates the header of an encoded tensor (and, if `verify_checksum`, the payload checksum).
absl::StatusOr<EncodedInfo> InspectEncoded(absl::Span<const uint8_t> encoded, bool verify_checksum = true);

struct DecodeOptions {
  // Skip the payload CRC when the caller has already verified it (tensor streams check it on arrival).
  bool verify_checksum = true;
};

// Decodes into `output`, whose size must equal the encoded element count. On error `output` may have
// been partly written only if the error is found after validation (never: all checks come first).
absl::Status DecodeTensor(absl::Span<const uint8_t> encoded, absl::Span<float> output,
                          const DecodeOptions& options = {});

// Decodes and adds into `accumulator` (accumulator += decoded), saving a pass in reductions.
absl::Status DecodeTensorAdd(absl::Span<const uint8_t> encoded, absl::Span<float> accumulator,
                             const DecodeOptions& options = {});

// A lossy exchange's effect on its operands: Apply replaces a tensor by what a receiver decodes after `codec`, as
// a communicator's all-reduce replaces each rank's own operand (top-k with its error feedback kept per `stream`, as
// a communicator keeps it per tensor key). Lets a one-process simulation send nothing and round alike (`train
// --local`'s DiLoCo). Not thread-safe.
class CodecRoundTrip {
 public:
  explicit CodecRoundTrip(Codec codec) : codec_(codec) {}
  absl::Status Apply(const std::string& stream, absl::Span<float> data);

 private:
  const Codec codec_;
  Bytes encoded_;
  std::map<std::string, std::vector<float>> residuals_;
};

// The instruction set the element loops use on this machine: "avx512", "avx2" or "scalar".
std::string_view CodecIsa();
// For tests and benchmarks: force the scalar loops (true) or return to run-time detection (false).
void ForceScalarCodecs(bool force);

}  // namespace geotrain::comm
