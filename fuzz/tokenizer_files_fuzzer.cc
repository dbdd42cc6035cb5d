// Fuzzes building a tokenizer from its two files (model/tokenizer.h Tokenizer::FromFileContents): the input is
// encoder.json, a NUL byte, then vocab.bpe. A tokenizer that loads must encode and decode any text without
// crashing, and only give ids it knows.
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_util.h"
#include "model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto [encoder, merges] = geotrain::fuzz::SplitAtNul(geotrain::fuzz::AsText(data, size));
  absl::StatusOr<std::unique_ptr<geotrain::model::Tokenizer>> tokenizer =
      geotrain::model::Tokenizer::FromFileContents(encoder, merges, "encoder.json", "vocab.bpe");
  if (!tokenizer.ok()) return 0;
  for (std::string_view text : {std::string_view("Hello world, it's 2024!\n\t\xe2\x82\xac \xff"), merges}) {
    const std::vector<int32_t> ids = (*tokenizer)->Encode(text);
    for (int32_t id : ids) FUZZ_CHECK(id >= 0 && id < (*tokenizer)->vocab_size(), "ids inside the vocabulary");
    (void)(*tokenizer)->Decode(ids);
  }
  return 0;
}
