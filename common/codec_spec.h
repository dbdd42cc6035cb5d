// What a codec name says ("bf16+zstd", "topk:0.01", "int8+zstd:3", "sparse:0.02:2"): the one parser of codec names,
// shared by the codecs that encode tensors (comm/codec.h) and by the planner's cost model of them (scheduler/
// cost_model.h), so that a name means the same thing to the runtime and to the planner. No gRPC: the
// planner links it without the rest of common/.
//
//   ASSIGN_OR_RETURN(CodecSpec codec, ParseCodecSpec(spec.comm().wan_codec()));
//   if (codec.zstd) ...;          // codec.ToString() gives the canonical name back
//   uint64_t wire = kCodecHeaderBytes + CodecRawPayloadBytes(codec, n);  // a tensor's bytes (not top-k, no zstd)
//
// Names: "none" (or "fp32": fp32 as is), "fp16", "bf16", "int8", "topk:F" (0 < F <= 1), "int4", "sparse",
// "sparse:F" or "sparse:F:B" (0 < F <= 1, B in 2..8; absent: F 0.02, B 2), each optionally followed by "+zstd" or
// "+zstd:L" (L in 1..19). Case and surrounding spaces do not matter.
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace geotrain {

// The element encoding; the values are the codec wire format's kind byte (comm/codec.h).
enum class CodecKind : uint8_t { kNone = 0, kFp16 = 1, kBf16 = 2, kInt8 = 3, kTopK = 4, kInt4 = 5, kSparse = 6 };

// The block-scaled codecs' blocks (comm/codec.h has the wire layout): int8 and int4 keep one fp32 scale per block;
// sparse keeps the largest F of each block of kSparseBlockSize values, each addressed by a kSparseIndexBits-bit
// offset inside its block.
inline constexpr uint64_t kCodecInt8BlockSize = 256;
inline constexpr uint64_t kCodecInt4BlockSize = 64;
inline constexpr uint64_t kSparseBlockSize = 4096;
inline constexpr int kSparseIndexBits = 12;  // 2^12 = kSparseBlockSize
// sparse's fixed fields before its scales: u32 kept per full block, u32 kept in the last block, u8 bits, 3 zeros.
inline constexpr uint64_t kSparsePreambleBytes = 12;
inline constexpr double kSparseDefaultFraction = 0.02;
inline constexpr int kSparseDefaultBits = 2;

struct CodecSpec {
  CodecKind kind = CodecKind::kNone;
  double topk_fraction = 0.0;    // (0, 1], kTopK only
  double sparse_fraction = 0.0;  // (0, 1], kSparse only: the share of each block kept
  int sparse_bits = 0;           // 2..8, kSparse only: the bits of each kept value
  bool zstd = false;
  int zstd_level = 1;

  // Lossless codecs reproduce every bit: none, optionally with zstd.
  bool lossless() const { return kind == CodecKind::kNone; }
  // Whether an encoder keeps error feedback (a residual per tensor, comm/codec.h EncodeTensor): top-k and sparse
  // need it, int4 takes it when given one. Communicators keep one residual per tensor key for these.
  bool error_feedback() const {
    return kind == CodecKind::kTopK || kind == CodecKind::kInt4 || kind == CodecKind::kSparse;
  }
  // Whether the codec is for gradients only, never for activations: every codec with error feedback (top-k, int4,
  // sparse). What they hold back in the residual reaches the receiver only with a later tensor, which a gradient's
  // sum over steps absorbs and an activation, used once, does not.
  bool gradients_only() const { return error_feedback(); }
  // Whether the encoder refuses non-finite input (infinities, NaN): int8 (its scale would be infinite) and every
  // gradients-only codec. fp16's overflow steps need a codec that carries them (none, fp16, bf16).
  bool finite_only() const { return kind == CodecKind::kInt8 || gradients_only(); }
  // The canonical name, which ParseCodecSpec accepts and parses back to the same codec: "bf16+zstd", "topk:0.01",
  // "int8+zstd:3", "sparse:0.02:2".
  std::string ToString() const;
};

// Parses a codec name (see above). Errors (INVALID_ARGUMENT) name the bad part and list the accepted forms.
absl::StatusOr<CodecSpec> ParseCodecSpec(std::string_view text);

// sparse: how many of a block's `block_length` values are kept, ceil(fraction x block_length), at least one (none
// of an empty block) and at most all.
uint64_t SparseKeptPerBlock(double fraction, uint64_t block_length);
// sparse: the raw payload bytes of `blocks` blocks keeping `kept` values in all, each of `bits` bits: the preamble,
// a scale per block, then the indices and the values, each packed to whole bytes.
uint64_t SparsePayloadBytes(uint64_t blocks, uint64_t kept, int bits);

// The raw payload bytes (after the 40-byte header, before zstd) of `count` elements: exact for every kind but
// top-k, whose payload depends on how many it keeps (8 + 8k: the bound with k = count is given). The codecs
// (comm/codec.cc) and the planner's ratios (scheduler/cost_model.cc) both take their sizes from here.
uint64_t CodecRawPayloadBytes(const CodecSpec& codec, uint64_t count);

}  // namespace geotrain
