// Fuzzes token shard validation (model/data.h ValidateTokenShard, what TokenShard::Open runs on the mapped
// file): any bytes give an error or a count that matches the size and tokens inside the vocabulary.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "fuzz/fuzz_util.h"
#include "model/data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr int kVocab = 50257;
  absl::StatusOr<int64_t> count = geotrain::model::ValidateTokenShard(data, size, kVocab, "fuzz.bin");
  if (!count.ok()) return 0;
  const size_t header = geotrain::model::kShardHeaderInts * 4;
  FUZZ_CHECK(*count >= 0 && header + static_cast<size_t>(*count) * 2 == size, "count matches the size");
  for (int64_t i = 0; i < *count; ++i) {
    uint16_t token;
    std::memcpy(&token, data + header + 2 * i, 2);
    FUZZ_CHECK(token < kVocab, "tokens inside the vocabulary");
  }
  return 0;
}
