// What a codec name says ("bf16+zstd", "topk:0.01", "int8+zstd:3"): the one parser of codec names, shared by
// the codecs that encode tensors (comm/codec.h) and by the planner's cost model of them (scheduler/
// cost_model.h), so that a name means the same thing to the runtime and to the planner. No gRPC: the
// planner links it without the rest of common/.
//
//   ASSIGN_OR_RETURN(CodecSpec codec, ParseCodecSpec(spec.comm().wan_codec()));
//   if (codec.zstd) ...;          // codec.ToString() gives the canonical name back
//
// Names: "none" (or "fp32": fp32 as is), "fp16", "bf16", "int8", "topk:F" (0 < F <= 1), each optionally
// followed by "+zstd" or "+zstd:L" (L in 1..19). Case and surrounding spaces do not matter.
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace geotrain {

// The element encoding; the values are the codec wire format's kind byte (comm/codec.h).
enum class CodecKind : uint8_t { kNone = 0, kFp16 = 1, kBf16 = 2, kInt8 = 3, kTopK = 4 };

struct CodecSpec {
  CodecKind kind = CodecKind::kNone;
  double topk_fraction = 0.0;  // (0, 1], kTopK only
  bool zstd = false;
  int zstd_level = 1;

  // Lossless codecs reproduce every bit: none, optionally with zstd.
  bool lossless() const { return kind == CodecKind::kNone; }
  // The canonical name, which ParseCodecSpec accepts: "bf16+zstd", "topk:0.01", "int8+zstd:3".
  std::string ToString() const;
};

// Parses a codec name (see above). Errors (INVALID_ARGUMENT) name the bad part and list the accepted forms.
absl::StatusOr<CodecSpec> ParseCodecSpec(std::string_view text);

}  // namespace geotrain
