// Loading job specs and topologies from YAML or JSON files into their protobuf messages
// (proto/spec.proto), with errors that name the file and the key.
//
//   absl::StatusOr<JobSpec> spec = LoadJobSpecFile("job.yaml");
//   // "job.yaml: unknown key 'train.stepz'; known keys of train: global_batch, seq_len, ..."
//
// YAML is walked against the message's descriptor: every key must name a field (its proto name or its
// JSON name), every scalar must parse as the field's type. The checked document is then re-emitted as
// JSON and parsed with protobuf's JSON mapping, so files and the wire agree on one mapping.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/message.h"
#include "spec.pb.h"

namespace geotrain {

// Parses YAML or JSON text into `message`. `source` names the file in errors.
absl::Status ParseYamlOrJson(std::string_view text, std::string_view source, google::protobuf::Message* message);
absl::Status LoadMessageFile(const std::string& path, google::protobuf::Message* message);

// Loads, fills defaults and validates.
absl::StatusOr<JobSpec> LoadJobSpecFile(const std::string& path);
absl::StatusOr<Topology> LoadTopologyFile(const std::string& path);

// Makes the spec's relative paths (data.train, data.val, checkpoint.dir, checkpoint.resume_from) absolute
// against `base_dir`, an absolute directory (the submitting client's working directory): workers may run
// elsewhere, in another directory, so paths travel absolute. Empty paths stay empty.
void MakeSpecPathsAbsolute(JobSpec* spec, const std::string& base_dir);

// Fills fields the user left out with geotrain's defaults (lr 6e-4, plan auto, codec bf16, ...).
void ApplyJobDefaults(JobSpec* spec);
// Checks the values of a (defaulted) job spec; errors name the key and the fix.
absl::Status ValidateJobSpec(const JobSpec& spec);
// Checks a topology: unique site names, links between known sites, non-negative figures; fills
// tflops and mem_gb of workers from their device names.
absl::Status ValidateTopology(Topology* topology);

// A known accelerator: dense bf16/fp16 tensor TFLOP/s and memory. Used for --emulate-device,
// topologies and the planner. Names are matched case-insensitively, without spaces or dashes.
struct KnownDevice {
  const char* name;
  double tflops;
  double mem_gb;
};
const KnownDevice* FindKnownDevice(std::string_view name);

// Proto to one-line JSON (field names as in the files) and to indented JSON.
std::string ToJson(const google::protobuf::Message& message, bool pretty = false);

}  // namespace geotrain
