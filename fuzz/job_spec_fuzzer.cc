// Fuzzes job spec loading (common/spec.h): YAML or JSON text -> JobSpec, defaults, validation, and the JSON
// the CLI and head print, which must load back to the same spec.
#include <cstddef>
#include <cstdint>

#include "common/spec.h"
#include "fuzz/fuzz_util.h"
#include "google/protobuf/util/message_differencer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  geotrain::JobSpec spec;
  if (!geotrain::ParseYamlOrJson(geotrain::fuzz::AsText(data, size), "fuzz.yaml", &spec).ok()) return 0;
  geotrain::ApplyJobDefaults(&spec);
  if (!geotrain::ValidateJobSpec(spec).ok()) return 0;
  const std::string json = geotrain::ToJson(spec);
  geotrain::JobSpec again;
  const absl::Status reloaded = geotrain::ParseYamlOrJson(json, "printed.json", &again);
  FUZZ_CHECK(reloaded.ok(), json.c_str());
  FUZZ_CHECK(google::protobuf::util::MessageDifferencer::Equals(spec, again), json.c_str());
  return 0;
}
