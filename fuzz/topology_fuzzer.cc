// Fuzzes topology loading (common/spec.h): YAML or JSON text -> Topology and its validation (which fills
// known devices), and the printed JSON, which must load back to the same topology.
#include <cstddef>
#include <cstdint>

#include "common/spec.h"
#include "fuzz/fuzz_util.h"
#include "google/protobuf/util/message_differencer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  geotrain::Topology topology;
  if (!geotrain::ParseYamlOrJson(geotrain::fuzz::AsText(data, size), "fuzz.yaml", &topology).ok()) return 0;
  if (!geotrain::ValidateTopology(&topology).ok()) return 0;
  const std::string json = geotrain::ToJson(topology);
  geotrain::Topology again;
  const absl::Status reloaded = geotrain::ParseYamlOrJson(json, "printed.json", &again);
  FUZZ_CHECK(reloaded.ok(), json.c_str());
  FUZZ_CHECK(geotrain::ValidateTopology(&again).ok(), json.c_str());
  FUZZ_CHECK(google::protobuf::util::MessageDifferencer::Equals(topology, again), json.c_str());
  return 0;
}
