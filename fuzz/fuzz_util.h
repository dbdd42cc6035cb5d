// Helpers shared by the fuzz targets of fuzz/ (one LLVMFuzzerTestOneInput per *_fuzzer.cc).
//
//   extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
//     std::string_view text = geotrain::fuzz::AsText(data, size);
//     FUZZ_CHECK(Parse(text).ok() || !Required(text), "a required document failed to parse");
//     return 0;
//   }
//
// A property that fails is a finding like a crash: FUZZ_CHECK prints what broke and aborts, which libFuzzer
// reports and saves the input for.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace geotrain::fuzz {

inline std::string_view AsText(const uint8_t* data, size_t size) {
  return std::string_view(reinterpret_cast<const char*>(data), size);
}

// Splits the input at the first NUL byte: two documents in one input (e.g. a tokenizer's two files).
inline std::pair<std::string_view, std::string_view> SplitAtNul(std::string_view input) {
  const size_t at = input.find('\0');
  if (at == std::string_view::npos) return {input, std::string_view()};
  return {input.substr(0, at), input.substr(at + 1)};
}

}  // namespace geotrain::fuzz

#define FUZZ_CHECK(condition, what)                                                                    \
  do {                                                                                                 \
    if (!(condition)) {                                                                                \
      std::fprintf(stderr, "%s:%d: property failed: %s (%s)\n", __FILE__, __LINE__, #condition, what); \
      std::abort();                                                                                    \
    }                                                                                                  \
  } while (false)
