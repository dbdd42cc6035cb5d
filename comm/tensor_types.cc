// The shared tensor-stream types' functions (see tensor_types.h).
#include "comm/tensor_types.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace geotrain::comm {

std::string TensorKey::ToString() const {
  return absl::StrCat("{job=", job_id, " step=", step, " mb=", microbatch, " tensor=", tensor_id, " src=", src, "}");
}

// --- ReceivedTensor --------------------------------------------------------------------------------------

int64_t ReceivedTensor::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status ReceivedTensor::DecodeInto(absl::Span<float> out) const {
  DecodeOptions options;
  options.verify_checksum = false;  // verified on arrival
  return DecodeTensor(encoded.span(), out, options);
}

absl::Status ReceivedTensor::DecodeAddInto(absl::Span<float> accumulator) const {
  DecodeOptions options;
  options.verify_checksum = false;
  return DecodeTensorAdd(encoded.span(), accumulator, options);
}

absl::StatusOr<std::vector<float>> ReceivedTensor::Decode() const {
  std::vector<float> out(static_cast<size_t>(num_elements()));
  RETURN_IF_ERROR(DecodeInto(absl::MakeSpan(out)));
  return out;
}

}  // namespace geotrain::comm
