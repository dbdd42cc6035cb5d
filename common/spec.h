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

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/diloco_spec.h"  // DilocoOn, EffectiveDiloco
#include "google/protobuf/message.h"
#include "spec.pb.h"

namespace geotrain {

// Parses YAML or JSON text into `message`. `source` names the file in errors.
absl::Status ParseYamlOrJson(std::string_view text, std::string_view source, google::protobuf::Message* message);
absl::Status LoadMessageFile(const std::string& path, google::protobuf::Message* message);

// Loads, fills defaults and validates.
absl::StatusOr<JobSpec> LoadJobSpecFile(const std::string& path);
absl::StatusOr<Topology> LoadTopologyFile(const std::string& path);

// Upper bounds on spec values, so that a spec the head accepts cannot make an actor fail to allocate or loop
// for ever (docs/architecture.md, "Limits"). ValidateJobSpec and ValidateTopology refuse values outside them
// with INVALID_ARGUMENT naming the key, the range and the value.
struct SpecLimits {
  int64_t max_name_bytes = 256;        // job and site names
  int64_t max_path_bytes = 4096;       // data globs, checkpoint directories
  int32_t max_layers = 1024;           // model.n_layer
  int32_t max_heads = 1024;            // model.n_head
  int32_t max_embd = 65536;            // model.n_embd
  int32_t max_vocab = 1 << 22;         // model.vocab_size
  int32_t max_seq_len = 1 << 17;       // train.seq_len, model.block_size
  int32_t max_global_batch = 1 << 20;  // train.global_batch
  int32_t max_steps = 1000000000;      // train.steps, warmup_steps, eval_every, checkpoint.every_steps
  int32_t max_eval_batches = 1 << 20;
  double max_lr = 10.0;         // train.lr, train.min_lr
  int32_t max_parallel = 4096;  // each of dp, pp, tp
  int32_t max_microbatches = 1 << 16;
  int64_t max_actors = 1 << 16;        // dp x pp x tp, and placement entries
  int64_t max_chunk_bytes = 64 << 20;  // comm.chunk_bytes
  int32_t max_checkpoints_kept = 1 << 20;
  int32_t max_restarts = 1 << 20;  // fault_tolerance.max_restarts
  int32_t max_sites = 1024;        // topology
  int32_t max_workers_per_site = 1 << 16;
  int32_t max_devices_per_worker = 1024;
  double max_link_latency_ms = 1e5;      // a link's latency_ms and jitter_ms (100 s)
  double max_link_bandwidth_mbps = 1e9;  // a link's bandwidth_mbps (1 Pbit/s; 0 = no cap)
};
inline constexpr SpecLimits kSpecLimits;

// Checks one link's figures against kSpecLimits: each finite, not negative, latency and jitter at most
// max_link_latency_ms, bandwidth at most max_link_bandwidth_mbps. `what` names the link in the error
// ("topology: link a-b"). Used for topology files and for the WAN emulator's `set` command, so both accept
// the same figures.
absl::Status ValidateLinkFigures(std::string_view what, double latency_ms, double bandwidth_mbps, double jitter_ms);

// Makes the spec's relative paths (data.train, data.val, checkpoint.dir, checkpoint.resume_from) absolute
// against `base_dir`, an absolute directory (the submitting client's working directory): workers may run
// elsewhere, in another directory, so paths travel absolute. Empty paths stay empty.
void MakeSpecPathsAbsolute(JobSpec* spec, const std::string& base_dir);

// Fills fields the user left out with geotrain's defaults (lr 6e-4, plan auto, codec bf16, ...).
void ApplyJobDefaults(JobSpec* spec);
// Checks the values of a (defaulted) job spec; errors name the key and the fix.
absl::Status ValidateJobSpec(const JobSpec& spec);

// Whether a fault may leave the job training on with fewer data-parallel replicas (a live regroup, head/job_regroup.h)
// as far as its spec tells: dp > 1, tp 1, synchronous (no DiLoCo), fault_tolerance.regroup not false. Else false, with
// why.
bool RegroupAllowedBySpec(const JobSpec& spec, std::string* why);
// Checks a topology: unique site names, links between known sites, non-negative figures; fills
// tflops and mem_gb of workers from their device names.
absl::Status ValidateTopology(Topology* topology);

// A known accelerator: dense bf16/fp16 tensor TFLOP/s, memory and memory bandwidth, from the vendors' data
// sheets. Used for --emulate-device (and its timed compute, worker/devices.h), topologies and the planner. Names
// are matched case-insensitively, without spaces or dashes.
struct KnownDevice {
  const char* name;
  double tflops;
  double mem_gb;
  double bandwidth_gbs;  // HBM / GDDR, GB/s
  // Compute capability (major * 10 + minor) and the dense peak TFLOP/s in each precision: fp32 on the CUDA cores,
  // fp16 and bf16 on the tensor cores with fp32 accumulation (0: not supported, as bf16 before Ampere).
  int compute_capability;
  double fp32_tflops;
  double fp16_tflops;
  double bf16_tflops;
};
const KnownDevice* FindKnownDevice(std::string_view name);

// Proto to one-line JSON (field names as in the files) and to indented JSON.
std::string ToJson(const google::protobuf::Message& message, bool pretty = false);

}  // namespace geotrain
