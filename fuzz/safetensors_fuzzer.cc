// Fuzzes the safetensors reader (model/safetensors.h ParseSafetensors): any bytes give an error or tensors
// whose data matches their shape, in offset order, never a crash or an allocation beyond what the bytes hold.
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_util.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<geotrain::model::SafetensorsFile> file =
      geotrain::model::ParseSafetensors(geotrain::fuzz::AsText(data, size), "fuzz.safetensors");
  if (!file.ok()) return 0;
  size_t floats = 0;
  for (const geotrain::model::NamedTensor& t : file->tensors) {
    uint64_t count = 1;
    for (int64_t d : t.shape) {
      FUZZ_CHECK(d >= 0, "non-negative dimensions");
      count *= static_cast<uint64_t>(d);
    }
    FUZZ_CHECK(count == t.data.size(), "data holds product(shape) floats");
    floats += t.data.size();
  }
  // Every element comes from at least two bytes of the file (F16/BF16) or four (F32).
  FUZZ_CHECK(floats * 2 <= size, "no more elements than the data bytes hold");
  return 0;
}
