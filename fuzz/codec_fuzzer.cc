// Fuzzes the tensor codecs (comm/codec.h): codec names (ParseCodec), encoded tensors as a peer sends them
// (InspectEncoded, DecodeTensor, DecodeTensorAdd), and encode -> decode of fuzzed floats.
// Input: one control byte, then the bytes. Control bits 0-2 repair the header's payload size, payload CRC and
// header CRC before decoding (so the fuzzer reaches the payload checks behind the checksums); bit 3 switches
// to the round trip: the bytes are "CODEC NAME\0float data", encoded then decoded, with the codec's error bound
// checked for the lossless codec, and for the codecs with error feedback (top-k, int4, sparse) that what was decoded
// plus what the residual kept is the input. Every kind is reached: none, fp16, bf16, int8, topk, int4 and sparse
// (corpus: fuzz/corpus/codec/, int4* and sparse* for the last two).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "comm/codec.h"
#include "fuzz/fuzz_util.h"

namespace {

using geotrain::comm::Bytes;
using geotrain::comm::Codec;
using geotrain::comm::kCodecHeaderBytes;

constexpr uint64_t kMaxDecodedElements = uint64_t{1} << 22;

void Decode(std::vector<uint8_t> buffer, uint8_t control) {
  if (buffer.size() >= kCodecHeaderBytes) {
    uint8_t* p = buffer.data();
    const uint64_t payload = buffer.size() - kCodecHeaderBytes;
    if (control & 1) std::memcpy(p + 16, &payload, 8);
    if (control & 2) {
      const uint32_t crc = geotrain::comm::Crc32c(p + kCodecHeaderBytes, payload);
      std::memcpy(p + 32, &crc, 4);
    }
    if (control & 4) {
      const uint32_t crc = geotrain::comm::Crc32c(p, 36);
      std::memcpy(p + 36, &crc, 4);
    }
  }
  const absl::Span<const uint8_t> encoded(buffer.data(), buffer.size());
  absl::StatusOr<geotrain::comm::EncodedInfo> info = geotrain::comm::InspectEncoded(encoded);
  if (!info.ok()) {
    std::vector<float> out(4);
    FUZZ_CHECK(!geotrain::comm::DecodeTensor(encoded, absl::MakeSpan(out)).ok(), "decode fails where inspect fails");
    return;
  }
  FUZZ_CHECK(info->payload_bytes + kCodecHeaderBytes == buffer.size(), "payload size is the buffer's");
  if (info->element_count > kMaxDecodedElements) return;
  std::vector<float> out(info->element_count + 1);
  // A wrong output size is refused before anything is written.
  FUZZ_CHECK(!geotrain::comm::DecodeTensor(encoded, absl::MakeSpan(out)).ok(), "output size checked");
  out.pop_back();
  if (!geotrain::comm::DecodeTensor(encoded, absl::MakeSpan(out)).ok()) return;
  std::vector<float> sum(out.size(), 0.0f);
  FUZZ_CHECK(geotrain::comm::DecodeTensorAdd(encoded, absl::MakeSpan(sum)).ok(), "add decodes what decode does");
  for (size_t i = 0; i < out.size(); ++i) {
    FUZZ_CHECK(std::memcmp(&out[i], &sum[i], 4) == 0 || (std::isnan(out[i]) && std::isnan(sum[i])) ||
                   (out[i] == 0 && sum[i] == 0),
               "0 + decoded == decoded");
  }
}

void RoundTrip(std::string_view input) {
  const size_t nul = input.find('\0');
  if (nul == std::string_view::npos) return;
  absl::StatusOr<Codec> codec = geotrain::comm::ParseCodec(input.substr(0, nul));
  if (!codec.ok()) return;
  absl::StatusOr<Codec> again = geotrain::comm::ParseCodec(codec->ToString());
  FUZZ_CHECK(again.ok() && again->kind == codec->kind && again->zstd == codec->zstd &&
                 again->sparse_fraction == codec->sparse_fraction && again->sparse_bits == codec->sparse_bits,
             codec->ToString().c_str());
  const std::string_view raw = input.substr(nul + 1);
  std::vector<float> values(raw.size() / 4);
  if (!values.empty()) std::memcpy(values.data(), raw.data(), values.size() * 4);
  Bytes wire;
  std::vector<float> residual;
  if (!geotrain::comm::EncodeTensor(*codec, values, &wire, &residual).ok()) return;
  FUZZ_CHECK(geotrain::comm::CheckEncodedSize(*codec, values.size(), wire.size()).ok(), "encoded size allowed");
  std::vector<float> decoded(values.size());
  FUZZ_CHECK(geotrain::comm::DecodeTensor(wire.span(), absl::MakeSpan(decoded)).ok(), "decodes what it encodes");
  if (codec->lossless() && !values.empty()) {
    FUZZ_CHECK(std::memcmp(values.data(), decoded.data(), values.size() * 4) == 0, "lossless is bit exact");
  }
  if (codec->error_feedback()) {
    // The residual started empty: it holds exactly what the decoded tensor lacks (one float rounding at most).
    FUZZ_CHECK(residual.size() == values.size(), "error feedback keeps a residual per element");
    for (size_t i = 0; i < values.size(); ++i) {
      const double v = values[i], y = decoded[i], r = residual[i];
      FUZZ_CHECK(std::isfinite(y) && std::isfinite(r), "error feedback values stay finite");
      FUZZ_CHECK(std::fabs(y + r - v) <= 1e-6 * (std::fabs(v) + std::fabs(y)) + 1e-37, "decoded + residual == input");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t control = data[0];
  if (control & 8) {
    RoundTrip(geotrain::fuzz::AsText(data + 1, size - 1));
  } else {
    Decode(std::vector<uint8_t>(data + 1, data + size), control);
  }
  return 0;
}
