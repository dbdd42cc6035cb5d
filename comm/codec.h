// Tensor codecs: how fp32 tensors are encoded on a link (inside a site, across sites).
//
//   ASSIGN_OR_RETURN(Codec codec, ParseCodec("bf16+zstd"));
//   Bytes wire;
//   RETURN_IF_ERROR(EncodeTensor(codec, grad, &wire));            // grad: absl::Span<const float>
//   RETURN_IF_ERROR(DecodeTensor(wire.span(), absl::MakeSpan(out)));  // validates everything first
//
// Codecs: "none" (fp32 as is), "fp16" and "bf16" (round to nearest even), "int8" (symmetric, one fp32
// scale per block of kInt8BlockSize elements), "topk:F" (the F*n largest magnitudes with their indices;
// gradients only, with error feedback: the caller keeps one residual vector per tensor), "int4" (symmetric,
// -7..7, one fp32 scale per block of kInt4BlockSize elements; gradients only, error feedback when given a residual),
// "sparse:F:B" (per block of kSparseBlockSize elements the ceil(F x block) largest magnitudes, each as a 12-bit
// offset and a B-bit value, 2 <= B <= 8; gradients only, with error feedback), each optionally followed by "+zstd"
// or "+zstd:LEVEL" (zstd over the encoded payload).
//
// Error feedback (top-k, int4 with a residual, sparse): the encoder sends input + residual and leaves in the
// residual exactly what the receiver does not get, so that over calls sum(decoded) + residual == sum(inputs) (top-k
// exactly; int4 and sparse up to one float rounding per call). Communicators keep one residual per tensor key for
// every codec whose CodecSpec::error_feedback() is true.
//
// Error bounds (per element x, decoded y), tested in comm/codec_test.cc:
//   fp16: |y - x| <= 2^-11 |x| for normal fp16 range (|x| in [2^-14, 65504]);
//   bf16: |y - x| <= 2^-8 |x| for normal values;
//   int8: |y - x| <= scale/2 with scale = max|block| / 127, i.e. max|block| / 254;
//   topk: kept entries exact; the others are 0 and go into the residual, so that over steps
//         sum(decoded) + residual == sum(inputs) (error feedback conserves every element's sum);
//   int4: |y - x| <= scale/2 with scale = max|block| / 7, i.e. max|block| / 14 (x: input + residual);
//   sparse: kept entries |y - x| <= scale / 2^B with scale = max|block| (mid-rise levels (2c+1-2^B)/2^B x scale,
//         no level spent on zero: the kept values are the block's largest); the others are 0; both errors go into
//         the residual.
// Bytes on the wire (header included, large tensors; docs/diloco.md): int8 0.254 of fp32, int4 0.141 (7.1x),
// sparse:0.02:2 0.0090 (111x: 82 of every 4096 values, 14 bits each, and a scale).
//
// Wire format (little endian): a 40-byte header, then the payload.
//   u32 magic "GTDC" | u8 version (1) | u8 codec kind | u8 flags (bit 0: zstd) | u8 reserved (0)
//   u64 element count | u64 payload bytes (after the header, as sent) | u64 raw payload bytes (before zstd)
//   u32 CRC-32C of the payload | u32 CRC-32C of the 36 header bytes before it
// Raw payload per kind (kind byte: none 0, fp16 1, bf16 2, int8 3, topk 4, int4 5, sparse 6): none: count x f32;
// fp16/bf16: count x u16; int8: ceil(count/256) x f32 scales then count x i8; topk: u64 k, then k x u32 strictly
// increasing indices, then k x f32 values; int4: ceil(count/64) x f32 scales, then ceil(count/2) bytes of 4-bit
// two's complement codes in -7..7 (element 2j in the low nibble of byte j, 2j+1 in the high one; an odd count's
// last high nibble 0); sparse: a 12-byte preamble (u32 kept per full block, u32 kept in the last block, u8 bits B,
// 3 zero bytes), ceil(count/4096) x f32 scales, then every kept value's offset inside its block as a 12-bit field
// (blocks in order, offsets increasing inside each), then every kept value's code as a B-bit field in the same
// order (each stream little endian, bit b at bit b%8 of byte b/8, zero-padded to a byte).
// Decoding checks the magic, version, kind, flags, header checksum, sizes against the element count, the
// payload checksum, zstd's frame size, int8 and int4 scales (finite, >= 0), int4 codes (no -8, padding 0),
// top-k indices (in range, increasing), sparse's counts (within their blocks, the size they give), bits, scales,
// offsets (inside the block, increasing per block) and padding, before it writes anything; bad input is an absl
// error (DATA_LOSS or INVALID_ARGUMENT), never a crash.
//
// Thread safety: all functions are thread-safe; a residual vector must not be shared by concurrent calls.
// Speed: the element loops are compiled for AVX-512, AVX2 and plain x86-64 and chosen at run time.
// Files: codec.cc (wire header, encode and decode), codec_kernels.{h,cc} (the element loops per
// instruction set), codec_lowbit.{h,cc} (int4 and sparse), crc32c.{h,cc} (checksums), buffer_pool.{h,cc} (Bytes
// and its pool of large buffers). Sizes per codec: common/codec_spec.h CodecRawPayloadBytes.
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

inline constexpr size_t kInt8BlockSize = kCodecInt8BlockSize;
inline constexpr size_t kInt4BlockSize = kCodecInt4BlockSize;
inline constexpr size_t kCodecHeaderBytes = 40;
inline constexpr uint32_t kCodecMagic = 0x43445447;  // "GTDC" in little endian
// Element counts above this are refused (keeps every size computation far from overflow).
inline constexpr uint64_t kMaxCodecElements = uint64_t{1} << 40;

// Parses "none" | "fp16" | "bf16" | "int8" | "topk:F" (0 < F <= 1) | "int4" | "sparse[:F[:B]]", each optionally
// "+zstd" or "+zstd:L" (L in 1..19): ParseCodecSpec under comm's name. Errors name the bad part and list the accepted forms.
inline absl::StatusOr<Codec> ParseCodec(std::string_view text) { return ParseCodecSpec(text); }

// The codec activations (and their gradients between pipeline stages) travel with on a link whose spec names `codec`:
// a gradients-only codec (CodecSpec::gradients_only: top-k, int4, sparse, every codec with error feedback) gives way
// to its dense part, fp32 as is ("none", without zstd); every other codec is used as named.
inline Codec ActivationCodec(const Codec& codec) { return codec.gradients_only() ? Codec{} : codec; }

// What the header of an encoded tensor says, once validated.
struct EncodedInfo {
  Codec codec;  // kind and zstd flag (the top-k and sparse fractions, sparse's bits and the zstd level are not read)
  uint64_t element_count = 0;
  uint64_t payload_bytes = 0;
  uint64_t raw_payload_bytes = 0;
  uint32_t payload_crc = 0;
};

// Encodes `input` into `*out` (replaced). For kTopK and kSparse `residual` is required, for kInt4 optional (without
// one, no error feedback), for the others unused: it holds the error feedback of this tensor (resized to
// input.size() and zeroed if its size differs) and is updated only on success. int8, top-k, int4 and sparse refuse
// NaN and infinity (in input + residual for the last three) with INVALID_ARGUMENT, before writing anything: a diverged
// gradient is reported, not quantised, and never spreads into the residual of the other elements.
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
// the fixed-size codecs and sparse, whose name gives its size; an upper bound for top-k and zstd). Receivers check
// this before allocating.
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
// a communicator's all-reduce replaces each rank's own operand (top-k, int4 and sparse with their error feedback kept
// per `stream`, as a communicator keeps it per tensor key). Lets a one-process simulation send nothing and round alike (`train
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
