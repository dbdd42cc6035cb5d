// Weights files and training checkpoints (see checkpoint.h).
#include "model/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"

namespace geotrain::model {
namespace {

namespace fs = std::filesystem;

// The name the model uses for a file's tensor name, or "" to skip it.
std::string CanonicalName(const std::string& file_name) {
  std::string name = file_name;
  if (absl::StartsWith(name, "transformer.")) name = name.substr(strlen("transformer."));
  if (absl::EndsWith(name, ".attn.bias") || absl::EndsWith(name, ".attn.masked_bias") || name == "lm_head.weight") {
    return "";
  }
  return name;
}

// DiLoCo's outer state: from the diloco files beside group 0's model files (a simulation's checkpoint, or a
// cluster job's, whose replica 0 writes them), or else the stage's (loaded) weights with zero momentum. `by_file` lists the stage's tensors by the model file that holds them.
absl::Status LoadOuterState(const std::string& step_dir, const CheckpointManifest& manifest, GPT2Stage& stage,
                            const std::map<std::string, std::vector<std::string>>& by_file, OuterOptimizer& outer,
                            CheckpointInfo* info) {
  std::vector<float> params(static_cast<size_t>(stage.num_params()));
  RETURN_IF_ERROR(stage.backend().CopyToHost(params.data(), stage.params(), params.size() * sizeof(float)));
  outer.Initialize(params.data());  // padded rows and anything the files do not hold
  for (const auto& [group_file, names] : by_file) {
    // The group's file name back to group 0's ("model-g1-s0" -> "model-s0"), then its diloco twin.
    std::string model_file = group_file;
    if (absl::StartsWith(group_file, "model-g")) {
      const size_t dash = group_file.find_first_of("-.", strlen("model-g"));
      model_file = absl::StrCat("model", group_file.substr(dash));
    }
    const std::string file = DilocoFileFor(model_file);
    if (!manifest.files().contains(file)) {
      // A synchronous job's checkpoint: the outer state starts from its weights.
      if (manifest.diloco_groups() == 0) return absl::OkStatus();
      return absl::DataLossError(absl::StrCat(step_dir, ": a DiLoCo checkpoint without ", file));
    }
    ASSIGN_OR_RETURN(SafetensorsFile tensors, ReadSafetensors(absl::StrCat(step_dir, "/", file)));
    for (const std::string& name : names) {
      for (const auto& [prefix, buffer] : {std::pair<const char*, float*>{"outer.", outer.outer_params().data()},
                                           {"outer_m.", outer.momentum().data()}}) {
        const NamedTensor* t = tensors.Find(prefix + name);
        ASSIGN_OR_RETURN(std::vector<int64_t> shape, stage.TensorShape(name));
        if (t == nullptr || t->shape != shape) {
          return absl::DataLossError(absl::StrCat(step_dir, "/", file, ": missing or mis-shaped ", prefix, name));
        }
        RETURN_IF_ERROR(stage.ImportTensorToBuffer(name, t->data.data(), static_cast<int64_t>(t->data.size()), buffer));
      }
    }
  }
  info->outer_loaded = true;
  return absl::OkStatus();
}

// The stage's tensors, full size, under HF names with `prefix`, each filled by export_one(name, data).
absl::StatusOr<std::vector<NamedTensor>> ExportTensors(
    GPT2Stage& stage, const std::string& prefix,
    const std::function<absl::Status(const std::string& name, float* data)>& export_one) {
  std::vector<NamedTensor> out;
  for (const std::string& name : stage.TensorNames()) {
    NamedTensor t;
    t.name = prefix + name;
    ASSIGN_OR_RETURN(t.shape, stage.TensorShape(name));
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    t.data.resize(n);
    RETURN_IF_ERROR(export_one(name, t.data.data()));
    out.push_back(std::move(t));
  }
  return out;
}

// fp16's loss scale from an optimizer file's metadata into adam's scaler. A checkpoint written without one (an
// fp32 or bf16 run) leaves the scaler at its initial scale; one whose values do not parse is DATA_LOSS.
absl::Status RestoreLossScale(const SafetensorsFile& optimizer_file, const std::string& step_dir, AdamW& adam) {
  const auto& metadata = optimizer_file.metadata;
  auto scale = metadata.find(kLossScaleKey);
  if (scale == metadata.end()) return absl::OkStatus();
  LossScaleState state;
  auto clean = metadata.find(kLossScaleCleanStepsKey);
  auto skipped = metadata.find(kLossScaleSkippedKey);
  if (!absl::SimpleAtod(scale->second, &state.scale) || clean == metadata.end() ||
      !absl::SimpleAtoi(clean->second, &state.clean_steps) || skipped == metadata.end() ||
      !absl::SimpleAtoi(skipped->second, &state.skipped)) {
    return absl::DataLossError(absl::StrCat(step_dir, ": the optimizer file's loss scale metadata does not parse"));
  }
  if (absl::Status s = adam.loss_scaler().Restore(state); !s.ok()) {
    return absl::DataLossError(absl::StrCat(step_dir, ": ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<NamedTensor>> ExportStageTensors(GPT2Stage& stage, bool grads, const std::string& prefix) {
  return ExportTensors(stage, prefix,
                       [&](const std::string& name, float* data) { return stage.ExportTensor(name, grads, data); });
}

absl::Status LoadStageWeights(const SafetensorsFile& file, const std::string& source, GPT2Stage& stage) {
  std::set<std::string> needed;
  for (const std::string& name : stage.TensorNames()) needed.insert(name);
  for (const NamedTensor& t : file.tensors) {
    const std::string name = CanonicalName(t.name);
    if (name.empty() || !needed.count(name)) continue;  // buffers, or another stage's tensors
    ASSIGN_OR_RETURN(std::vector<int64_t> shape, stage.TensorShape(name));
    if (t.shape != shape) {
      std::string got, want;
      for (int64_t d : t.shape) absl::StrAppend(&got, got.empty() ? "" : ", ", d);
      for (int64_t d : shape) absl::StrAppend(&want, want.empty() ? "" : ", ", d);
      return absl::InvalidArgumentError(absl::StrCat(source, ": tensor ", t.name, " has shape (", got,
                                                     ") but the model needs (", want,
                                                     "); the file is for another model shape"));
    }
    RETURN_IF_ERROR(stage.ImportTensor(name, t.data.data(), static_cast<int64_t>(t.data.size())));
    needed.erase(name);
  }
  if (!needed.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": missing tensor ", *needed.begin(), " (and ",
                                                   needed.size() - 1, " more); is this a GPT-2 weights file?"));
  }
  return absl::OkStatus();
}

absl::Status LoadStageWeights(const std::string& path, GPT2Stage& stage) {
  ASSIGN_OR_RETURN(SafetensorsFile file, ReadSafetensors(path));
  return LoadStageWeights(file, path, stage);
}

absl::Status SaveStageWeights(const std::string& path, GPT2Stage& stage) {
  ASSIGN_OR_RETURN(std::vector<NamedTensor> tensors, ExportStageTensors(stage, false));
  return WriteSafetensorsAtomically(path, tensors, {{"format", "pt"}});
}

absl::StatusOr<std::vector<NamedTensor>> ExportBufferTensors(GPT2Stage& stage, const float* buffer,
                                                             const std::string& prefix) {
  return ExportTensors(stage, prefix, [&](const std::string& name, float* data) {
    return stage.ExportTensorFromBuffer(name, buffer, data);
  });
}

absl::StatusOr<CheckpointSnapshot> SnapshotStage(GPT2Stage& stage, AdamW& adam, bool keep, OuterOptimizer* outer) {
  CheckpointSnapshot snapshot;
  ASSIGN_OR_RETURN(snapshot.weights, ExportStageTensors(stage, false));
  std::vector<float> host_m, host_v;
  RETURN_IF_ERROR(adam.CopyMomentsToHost(&host_m, &host_v));
  for (const auto& [prefix, buffer] :
       {std::pair<const char*, const float*>{"m.", host_m.data()}, {"v.", host_v.data()}}) {
    ASSIGN_OR_RETURN(std::vector<NamedTensor> moments, ExportBufferTensors(stage, buffer, prefix));
    for (NamedTensor& t : moments) snapshot.moments.push_back(std::move(t));
  }
  if (outer != nullptr) {
    for (const auto& [prefix, buffer] : {std::pair<const char*, const float*>{"outer.", outer->outer_params().data()},
                                         {"outer_m.", outer->momentum().data()}}) {
      ASSIGN_OR_RETURN(std::vector<NamedTensor> tensors, ExportBufferTensors(stage, buffer, prefix));
      for (NamedTensor& t : tensors) snapshot.outer.push_back(std::move(t));
    }
  }
  snapshot.optimizer_step = adam.step();
  if (adam.loss_scaler().enabled()) snapshot.loss_scale = adam.loss_scaler().state();
  if (!keep) return CheckpointSnapshot{};
  return snapshot;
}

absl::Status SaveCheckpoint(const std::string& dir, int64_t step, GPT2Stage& stage, AdamW& adam,
                            const DataPosition& data_position) {
  return SaveCheckpoint(dir, step, {{&stage, &adam}}, nullptr, data_position);
}

absl::Status SaveCheckpoint(const std::string& dir, int64_t step,
                            const std::vector<std::pair<GPT2Stage*, AdamW*>>& groups, OuterOptimizer* outer,
                            const DataPosition& data_position) {
  CheckpointManifest manifest;
  for (size_t g = 0; g < groups.size(); ++g) {
    ASSIGN_OR_RETURN(CheckpointSnapshot snapshot,
                     SnapshotStage(*groups[g].first, *groups[g].second, /*keep=*/true, g == 0 ? outer : nullptr));
    ASSIGN_OR_RETURN(WrittenShard shard, WriteCheckpointShard(StepDirectory(dir, step),
                                                              ShardSuffix(static_cast<int>(g), /*pp=*/1, 0), snapshot));
    for (const WrittenShard::File& f : shard.files) {
      CheckpointFileEntry& entry = (*manifest.mutable_files())[f.name];
      entry.set_bytes(f.bytes);
      entry.set_crc32(f.crc32);
    }
    if (g == 0) {
      for (const std::string& t : shard.tensors) (*manifest.mutable_tensors())[t] = shard.model_file;
      manifest.set_optimizer_step(snapshot.optimizer_step);
    }
  }
  manifest.set_format(kCheckpointFormat);
  manifest.set_step(step);
  const GPT2Config& c = groups.front().first->config();
  manifest.mutable_model()->set_n_layer(c.n_layer);
  manifest.mutable_model()->set_n_head(c.n_head);
  manifest.mutable_model()->set_n_embd(c.n_embd);
  manifest.mutable_model()->set_block_size(c.block_size);
  manifest.mutable_model()->set_vocab_size(c.vocab_size);
  manifest.mutable_data_position()->set_shard(data_position.shard);
  manifest.mutable_data_position()->set_offset(data_position.offset);
  manifest.mutable_data_position()->set_epoch(data_position.epoch);
  manifest.set_job("local");
  manifest.set_plan("dp 1 x pp 1 x tp 1");
  manifest.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
  if (outer != nullptr) manifest.set_diloco_groups(static_cast<int>(groups.size()));
  return CommitCheckpoint(dir, manifest);
}

absl::StatusOr<CheckpointInfo> LoadCheckpoint(const std::string& path, GPT2Stage& stage, AdamW& adam) {
  return LoadCheckpoint(path, stage, adam, CheckpointLoadOptions{});
}

absl::StatusOr<CheckpointInfo> LoadCheckpoint(const std::string& path, GPT2Stage& stage, AdamW& adam,
                                              const CheckpointLoadOptions& options) {
  CheckpointInfo info;
  std::error_code ec;
  if (fs::exists(path + "/manifest.json", ec)) {
    info.directory = path;
  } else {
    if (!fs::is_directory(path, ec)) return absl::NotFoundError(absl::StrCat("no checkpoint at ", path));
    ASSIGN_OR_RETURN(info.directory, FindNewestCheckpoint(path, &info.skipped));
  }
  const std::string& step_dir = info.directory;
  ASSIGN_OR_RETURN(CheckpointManifest manifest, VerifyCheckpoint(step_dir));
  const ModelSpec& m = manifest.model();
  const GPT2Config& c = stage.config();
  if (m.n_layer() != c.n_layer || m.n_head() != c.n_head || m.n_embd() != c.n_embd || m.block_size() != c.block_size ||
      m.vocab_size() != c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(step_dir, ": checkpoint is for another model shape (", m.n_layer(),
                                                   " layers, ", m.n_embd(),
                                                   " channels); resume with the spec it "
                                                   "was trained with"));
  }
  // Which model files hold the tensors this stage needs (format 1: model.safetensors holds all); a DiLoCo
  // group's own files when the checkpoint holds that group.
  info.diloco_groups = manifest.diloco_groups();
  const int group = options.group < manifest.diloco_groups() ? options.group : 0;
  std::map<std::string, std::vector<std::string>> by_file;
  for (const std::string& name : stage.TensorNames()) {
    std::string file = "model.safetensors";
    if (!manifest.tensors().empty()) {
      auto it = manifest.tensors().find(name);
      if (it == manifest.tensors().end()) {
        return absl::DataLossError(absl::StrCat(step_dir, ": the checkpoint has no tensor ", name));
      }
      file = it->second;
    }
    by_file[GroupFileFor(file, group)].push_back(name);
  }
  // Read and check every file needed before changing the stage or the optimizer.
  std::map<std::string, SafetensorsFile> weights, moments;
  for (const auto& [file, names] : by_file) {
    ASSIGN_OR_RETURN(weights[file], ReadSafetensors(absl::StrCat(step_dir, "/", file)));
    ASSIGN_OR_RETURN(moments[file], ReadSafetensors(absl::StrCat(step_dir, "/", OptimizerFileFor(file))));
    for (const std::string& name : names) {
      const NamedTensor* w = weights[file].Find(name);
      const NamedTensor* mt = moments[file].Find("m." + name);
      const NamedTensor* vt = moments[file].Find("v." + name);
      if (w == nullptr || mt == nullptr || vt == nullptr) {
        return absl::DataLossError(absl::StrCat(step_dir, "/", file, ": missing ", name, " or its moments"));
      }
      ASSIGN_OR_RETURN(std::vector<int64_t> shape, stage.TensorShape(name));
      if (w->shape != shape || mt->shape != shape || vt->shape != shape) {
        return absl::InvalidArgumentError(
            absl::StrCat(step_dir, "/", file, ": tensor ", name, " has another shape than the model's"));
      }
    }
  }
  std::vector<float> host_m, host_v;
  RETURN_IF_ERROR(adam.CopyMomentsToHost(&host_m, &host_v));
  for (const auto& [file, names] : by_file) {
    for (const std::string& name : names) {
      const NamedTensor* w = weights[file].Find(name);
      RETURN_IF_ERROR(stage.ImportTensor(name, w->data.data(), static_cast<int64_t>(w->data.size())));
      // Every element the files hold is set; the rest (wte's padded rows) keeps its current value.
      for (const char* which : {"m.", "v."}) {
        float* buffer = which[0] == 'm' ? host_m.data() : host_v.data();
        const NamedTensor* t = moments[file].Find(which + name);
        RETURN_IF_ERROR(stage.ImportTensorToBuffer(name, t->data.data(), static_cast<int64_t>(t->data.size()), buffer));
      }
    }
  }
  RETURN_IF_ERROR(adam.CopyMomentsFromHost(host_m, host_v));
  if (options.outer != nullptr)
    RETURN_IF_ERROR(LoadOuterState(step_dir, manifest, stage, by_file, *options.outer, &info));
  int64_t optimizer_step = manifest.optimizer_step();
  if (manifest.format() == "geotrain-checkpoint-1") {  // format 1 kept it in the optimizer file's metadata
    const SafetensorsFile& opt = moments.begin()->second;
    auto it = opt.metadata.find("step");
    if (it == opt.metadata.end() || !absl::SimpleAtoi(it->second, &optimizer_step) || optimizer_step < 0) {
      return absl::DataLossError(absl::StrCat(step_dir, "/optimizer.safetensors: no valid 'step' in its metadata"));
    }
  }
  // A DiLoCo group of its own (time-paced groups differ): its position and step, else group 0's.
  const DataPositionRecord* position = &manifest.data_position();
  if (auto it = manifest.group_optimizer_step().find(options.group); it != manifest.group_optimizer_step().end()) {
    optimizer_step = it->second;
  }
  if (auto it = manifest.group_data_position().find(options.group); it != manifest.group_data_position().end()) {
    position = &it->second;
  }
  if (optimizer_step < 0 || position->shard() < 0 || position->offset() < 0 || position->epoch() < 0) {
    return absl::DataLossError(
        absl::StrCat(step_dir, "/manifest.json: group ", options.group,
                     "'s optimizer step or data position is negative; the checkpoint is damaged"));
  }
  adam.set_step(optimizer_step);
  if (adam.loss_scaler().enabled()) RETURN_IF_ERROR(RestoreLossScale(moments.begin()->second, step_dir, adam));
  info.step = manifest.step();
  info.data_position.shard = position->shard();
  info.data_position.offset = position->offset();
  info.data_position.epoch = position->epoch();
  return info;
}

}  // namespace geotrain::model
