// Codec names (see codec_spec.h).
#include "common/codec_spec.h"

#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace geotrain {

std::string CodecSpec::ToString() const {
  std::string base;
  switch (kind) {
    case CodecKind::kNone:
      base = "none";
      break;
    case CodecKind::kFp16:
      base = "fp16";
      break;
    case CodecKind::kBf16:
      base = "bf16";
      break;
    case CodecKind::kInt8:
      base = "int8";
      break;
    case CodecKind::kTopK:
      base = absl::StrCat("topk:", topk_fraction);
      break;
  }
  if (zstd) absl::StrAppend(&base, zstd_level == 1 ? "+zstd" : absl::StrCat("+zstd:", zstd_level));
  return base;
}

absl::StatusOr<CodecSpec> ParseCodecSpec(std::string_view text_view) {
  // Debian's Abseil has its own string_view type: work on std::string here.
  const std::string text(text_view);
  std::string lowered = absl::AsciiStrToLower(text);
  absl::StripAsciiWhitespace(&lowered);
  const std::string accepted = "accepted: none | fp16 | bf16 | int8 | topk:F (0<F<=1), optionally +zstd or +zstd:L";
  std::vector<std::string> parts = absl::StrSplit(lowered, '+');
  if (parts.empty() || parts.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat("bad codec '", text, "'; ", accepted));
  }
  CodecSpec codec;
  const std::string& base = parts[0];
  if (base == "none" || base == "fp32") {
    codec.kind = CodecKind::kNone;
  } else if (base == "fp16") {
    codec.kind = CodecKind::kFp16;
  } else if (base == "bf16") {
    codec.kind = CodecKind::kBf16;
  } else if (base == "int8") {
    codec.kind = CodecKind::kInt8;
  } else if (base.rfind("topk:", 0) == 0) {
    codec.kind = CodecKind::kTopK;
    double fraction = 0;
    if (!absl::SimpleAtod(base.substr(5), &fraction) || !(fraction > 0.0) || fraction > 1.0) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad top-k fraction in codec '", text, "': give a number in (0, 1], e.g. topk:0.01"));
    }
    codec.topk_fraction = fraction;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown codec '", base, "' in '", text, "'; ", accepted));
  }
  if (parts.size() == 2) {
    const std::string& extra = parts[1];
    if (extra == "zstd") {
      codec.zstd = true;
    } else if (extra.rfind("zstd:", 0) == 0) {
      int level = 0;
      if (!absl::SimpleAtoi(extra.substr(5), &level) || level < 1 || level > 19) {
        return absl::InvalidArgumentError(absl::StrCat("bad zstd level in codec '", text, "': use 1..19"));
      }
      codec.zstd = true;
      codec.zstd_level = level;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown codec suffix '+", extra, "' in '", text, "'; ", accepted));
    }
  }
  return codec;
}

}  // namespace geotrain
