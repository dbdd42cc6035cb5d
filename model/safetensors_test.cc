// safetensors round trip, HF-compatible header, and corruption errors.
#include "model/safetensors.h"

#include <cstring>
#include <filesystem>

#include "gtest/gtest.h"

namespace geotrain::model {
namespace {

std::string TempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("geotrain_st_" + std::to_string(::getpid()) + "_" + name)).string();
}

TEST(SafetensorsTest, RoundTrip) {
  const std::string path = TempPath("rt.safetensors");
  std::vector<NamedTensor> tensors = {{"b", {2, 3}, {1, 2, 3, 4, 5, 6}}, {"a.weight", {4}, {-1, 0.5f, 1e-30f, 3}}};
  ASSERT_TRUE(WriteSafetensorsAtomically(path, tensors, {{"step", "7"}}).ok());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  auto f = ReadSafetensors(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors.size(), 2u);
  EXPECT_EQ(f->tensors[0].name, "b");  // offset order
  EXPECT_EQ(f->Find("b")->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f->Find("a.weight")->data, tensors[1].data);
  EXPECT_EQ(f->metadata.at("step"), "7");
  // The header length is a multiple of 8 and the JSON names dtype F32 (what HF expects).
  auto bytes = ReadFileToString(path);
  EXPECT_EQ(static_cast<unsigned char>((*bytes)[0]) % 8, 0);
  EXPECT_NE(bytes->find("\"dtype\":\"F32\""), std::string::npos);
  std::filesystem::remove(path);
}

TEST(SafetensorsTest, CorruptFilesAreClearErrors) {
  const std::string path = TempPath("bad.safetensors");
  ASSERT_TRUE(WriteSafetensorsAtomically(path, {{"x", {1000}, std::vector<float>(1000, 1.0f)}}, {}).ok());
  const std::string good = *ReadFileToString(path);
  // Truncated data.
  ASSERT_TRUE(WriteFileAtomically(path, good.substr(0, good.size() - 100)).ok());
  auto r1 = ReadSafetensors(path);
  ASSERT_FALSE(r1.ok());
  EXPECT_NE(r1.status().message().find("truncated"), std::string::npos) << r1.status();
  // Truncated inside the header.
  ASSERT_TRUE(WriteFileAtomically(path, good.substr(0, 20)).ok());
  EXPECT_FALSE(ReadSafetensors(path).ok());
  // Too short for the length field.
  ASSERT_TRUE(WriteFileAtomically(path, "abc").ok());
  EXPECT_FALSE(ReadSafetensors(path).ok());
  // Garbage header.
  std::string garbage = good;
  garbage[8] = '#';  // the opening brace
  ASSERT_TRUE(WriteFileAtomically(path, garbage).ok());
  EXPECT_FALSE(ReadSafetensors(path).ok());
  // Shape that disagrees with the byte range.
  ASSERT_TRUE(WriteSafetensorsAtomically(path, {{"x", {4}, {1, 2, 3, 4}}}, {}).ok());
  std::string s = *ReadFileToString(path);
  const size_t at = s.find("[4]");
  s.replace(at, 3, "[5]");
  ASSERT_TRUE(WriteFileAtomically(path, s).ok());
  auto r2 = ReadSafetensors(path);
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.status().message().find("bytes"), std::string::npos);
  // Mismatched data and shape on write.
  EXPECT_FALSE(WriteSafetensorsAtomically(path, {{"x", {3}, {1, 2}}}, {}).ok());
  std::filesystem::remove(path);
}

TEST(SafetensorsTest, Crc32MatchesZlib) {
  const std::string s = "123456789";
  EXPECT_EQ(Crc32(s.data(), s.size()), 0xCBF43926u);
}

// A safetensors file from its JSON header and data bytes.
std::string Safetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t size = header.size();
  std::memcpy(out.data(), &size, 8);
  return out + header + data;
}

// Found by fuzz/safetensors_fuzzer.cc: an empty tensor (a zero dimension) copied from a null pointer.
TEST(SafetensorsTest, EmptyTensorsParse) {
  const std::string one("\0\0\x80\x3f", 4);
  auto f = ParseSafetensors(Safetensors(R"({"e": {"dtype": "F32", "shape": [0, 5], "data_offsets": [0, 0]},
                                             "s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}})",
                                        one),
                            "empty.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->Find("e")->data.empty());
  EXPECT_EQ(f->Find("e")->shape, (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(f->Find("s")->data, std::vector<float>{1.0f});
}

// Found by fuzzing: a shape whose element count (2^62 + 1) wraps to 4 bytes when multiplied by the dtype's
// size matched a 4-byte range, and the reader then tried to allocate 2^62 floats. Dimensions that are not
// integers in data_offsets are refused too.
TEST(SafetensorsTest, ShapesTooLargeForTheDataAreErrors) {
  auto f = ParseSafetensors(
      Safetensors(R"({"x": {"dtype": "F32", "shape": [27905, 429509837, 384773], "data_offsets": [0, 4]}})",
                  std::string(4, '\0')),
      "wrap.safetensors");
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("more elements than the 4 data bytes"), std::string::npos) << f.status();
  // A zero dimension makes any other dimensions empty, however large.
  f = ParseSafetensors(
      Safetensors(R"({"x": {"dtype": "F16", "shape": [1000000000000, 0, 1000000000000], "data_offsets": [0, 0]}})", ""),
      "zero.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  f = ParseSafetensors(
      Safetensors(R"({"x": {"dtype": "F16", "shape": [1], "data_offsets": [0.5, 2.5]}})", std::string(3, '\0')),
      "fraction.safetensors");
  EXPECT_FALSE(f.ok());
}

}  // namespace
}  // namespace geotrain::model
