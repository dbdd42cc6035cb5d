// The diloco block's defaults and its codec settings (diloco_spec.h) as a job spec gives them, and their validation
// (common/spec.h ValidateJobSpec: errors name the key).
#include "common/diloco_spec.h"

#include "common/codec_spec.h"
#include "common/spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace geotrain {
namespace {

using ::testing::HasSubstr;

// The spec `text` after defaults, and its validation.
JobSpec Loaded(const std::string& text, absl::Status* validation) {
  JobSpec spec;
  const absl::Status parsed = ParseYamlOrJson(text, "spec.yaml", &spec);
  EXPECT_TRUE(parsed.ok()) << text << ": " << parsed;
  ApplyJobDefaults(&spec);
  *validation = ValidateJobSpec(spec);
  return spec;
}

TEST(DilocoSpecTest, SparseTakesItsSettingsIntoItsName) {
  const struct {
    const char* text;
    const char* codec;
    double fraction;
    int bits;
  } cases[] = {
      {"diloco: {inner_steps: 8, codec: sparse}", "sparse:0.02:2", 0.02, 2},
      {"diloco: {inner_steps: 8, codec: sparse, sparse: {fraction: 0.05, bits: 4}}", "sparse:0.05:4", 0.05, 4},
      {"diloco: {inner_steps: 8, codec: sparse+zstd, sparse: {bits: 8}}", "sparse:0.02:8+zstd", 0.02, 8},
      {"diloco: {inner_steps: 8, codec: 'sparse:0.1:3'}", "sparse:0.1:3", 0.1, 3},
      {"diloco: {inner_steps: 8, codec: 'sparse:0.1:3', sparse: {bits: 3}}", "sparse:0.1:3", 0.1, 3},
  };
  for (const auto& c : cases) {
    absl::Status validation;
    const JobSpec spec = Loaded(c.text, &validation);
    EXPECT_TRUE(validation.ok()) << c.text << ": " << validation;
    EXPECT_EQ(spec.diloco().codec(), c.codec) << c.text;
    EXPECT_EQ(spec.diloco().sparse().fraction(), c.fraction) << c.text;
    EXPECT_EQ(spec.diloco().sparse().bits(), c.bits) << c.text;
    // Defaults twice change nothing, and every user of the codec parses the same settings from its name.
    EXPECT_EQ(EffectiveDiloco(spec).SerializeAsString(), spec.diloco().SerializeAsString()) << c.text;
    absl::StatusOr<CodecSpec> codec = ParseCodecSpec(EffectiveDiloco(spec).codec());
    ASSERT_TRUE(codec.ok()) << c.text;
    EXPECT_EQ(codec->sparse_fraction, c.fraction) << c.text;
    EXPECT_EQ(codec->sparse_bits, c.bits) << c.text;
  }
  // Other codecs: no sparse block appears, and int4 is a codec name like the others.
  for (const char* codec : {"int8", "int4", "topk:0.01"}) {
    absl::Status validation;
    const JobSpec spec = Loaded(std::string("diloco: {inner_steps: 8, codec: '") + codec + "'}", &validation);
    EXPECT_TRUE(validation.ok()) << codec << ": " << validation;
    EXPECT_FALSE(spec.diloco().has_sparse()) << codec;
    EXPECT_EQ(spec.diloco().codec(), codec);
  }
}

TEST(DilocoSpecTest, BadSparseSettingsNameTheKey) {
  const struct {
    const char* text;
    const char* error;
  } cases[] = {
      {"diloco: {inner_steps: 8, codec: sparse, sparse: {fraction: 0}}", "diloco.sparse.fraction must be in (0, 1]"},
      {"diloco: {inner_steps: 8, codec: sparse, sparse: {fraction: 1.5}}", "diloco.sparse.fraction"},
      {"diloco: {inner_steps: 8, codec: sparse, sparse: {bits: 1}}", "diloco.sparse.bits must be in [2, 8] (got 1)"},
      {"diloco: {inner_steps: 8, codec: sparse, sparse: {bits: 9}}", "diloco.sparse.bits"},
      {"diloco: {inner_steps: 8, codec: int8, sparse: {fraction: 0.1}}",
       "diloco.sparse applies to diloco.codec sparse"},
      {"diloco: {inner_steps: 8, sparse: {bits: 4}}", "diloco.sparse applies to diloco.codec sparse only"},
      {"diloco: {inner_steps: 8, codec: 'sparse:0.1:3', sparse: {fraction: 0.02}}", "disagrees with diloco.codec"},
      {"diloco: {inner_steps: 8, codec: 'sparse:0.1:9'}", "diloco.codec"},
      {"diloco: {inner_steps: 8, codec: int3}", "diloco.codec"},
  };
  for (const auto& c : cases) {
    absl::Status validation;
    Loaded(c.text, &validation);
    EXPECT_EQ(validation.code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(validation.message(), HasSubstr(c.error)) << c.text;
  }
}

}  // namespace
}  // namespace geotrain
