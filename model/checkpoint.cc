// Weights files and training checkpoints (see checkpoint.h).
#include "model/checkpoint.h"

#include <filesystem>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace geotrain::model {
namespace {

// The name the model uses for a file's tensor name, or "" to skip it.
std::string CanonicalName(const std::string& file_name) {
  std::string name = file_name;
  if (absl::StartsWith(name, "transformer.")) name = name.substr(strlen("transformer."));
  if (absl::EndsWith(name, ".attn.bias") || absl::EndsWith(name, ".attn.masked_bias") || name == "lm_head.weight") {
    return "";
  }
  return name;
}

absl::StatusOr<google::protobuf::Struct> ParseJson(const std::string& text, const std::string& source) {
  google::protobuf::Struct root;
  auto parsed = google::protobuf::util::JsonStringToMessage(text, &root);
  if (!parsed.ok()) return absl::DataLossError(absl::StrCat(source, ": not valid JSON: ", parsed.ToString()));
  return root;
}

}  // namespace

absl::StatusOr<std::vector<NamedTensor>> ExportStageTensors(GPT2Stage& stage, bool grads, const std::string& prefix) {
  std::vector<NamedTensor> out;
  for (const std::string& name : stage.TensorNames()) {
    NamedTensor t;
    t.name = prefix + name;
    absl::StatusOr<std::vector<int64_t>> shape = stage.TensorShape(name);
    if (!shape.ok()) return shape.status();
    t.shape = *shape;
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    t.data.resize(n);
    if (absl::Status s = stage.ExportTensor(name, grads, t.data.data()); !s.ok()) return s;
    out.push_back(std::move(t));
  }
  return out;
}

absl::Status LoadStageWeights(const SafetensorsFile& file, const std::string& source, GPT2Stage& stage) {
  std::set<std::string> needed;
  for (const std::string& name : stage.TensorNames()) needed.insert(name);
  for (const NamedTensor& t : file.tensors) {
    const std::string name = CanonicalName(t.name);
    if (name.empty() || !needed.count(name)) continue;  // buffers, or another stage's tensors
    absl::StatusOr<std::vector<int64_t>> shape = stage.TensorShape(name);
    if (!shape.ok()) return shape.status();
    if (t.shape != *shape) {
      std::string got, want;
      for (int64_t d : t.shape) absl::StrAppend(&got, got.empty() ? "" : ", ", d);
      for (int64_t d : *shape) absl::StrAppend(&want, want.empty() ? "" : ", ", d);
      return absl::InvalidArgumentError(absl::StrCat(source, ": tensor ", t.name, " has shape (", got,
                                                     ") but the model needs (", want,
                                                     "); the file is for another model shape"));
    }
    if (absl::Status s = stage.ImportTensor(name, t.data.data(), static_cast<int64_t>(t.data.size())); !s.ok()) {
      return s;
    }
    needed.erase(name);
  }
  if (!needed.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": missing tensor ", *needed.begin(), " (and ",
                                                   needed.size() - 1, " more); is this a GPT-2 weights file?"));
  }
  return absl::OkStatus();
}

absl::Status LoadStageWeights(const std::string& path, GPT2Stage& stage) {
  absl::StatusOr<SafetensorsFile> file = ReadSafetensors(path);
  if (!file.ok()) return file.status();
  return LoadStageWeights(*file, path, stage);
}

absl::Status SaveStageWeights(const std::string& path, GPT2Stage& stage) {
  absl::StatusOr<std::vector<NamedTensor>> tensors = ExportStageTensors(stage, false);
  if (!tensors.ok()) return tensors.status();
  return WriteSafetensorsAtomically(path, *tensors, {{"format", "pt"}});
}

absl::Status SaveCheckpoint(const std::string& dir, int64_t step, GPT2Stage& stage, AdamW& adam,
                            const DataPosition& data_position) {
  namespace fs = std::filesystem;
  const std::string step_name = absl::StrFormat("step_%08d", step);
  const std::string step_dir = absl::StrCat(dir, "/", step_name);
  std::error_code ec;
  fs::create_directories(step_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create checkpoint directory ", step_dir, ": ", ec.message()));

  if (absl::Status s = SaveStageWeights(step_dir + "/model.safetensors", stage); !s.ok()) return s;
  std::vector<float> host_m, host_v;
  if (absl::Status s = adam.CopyMomentsToHost(&host_m, &host_v); !s.ok()) return s;
  std::vector<NamedTensor> moments;
  for (const char* which : {"m.", "v."}) {
    const float* buffer = which[0] == 'm' ? host_m.data() : host_v.data();
    for (const std::string& name : stage.TensorNames()) {
      NamedTensor t;
      t.name = which + name;
      t.shape = *stage.TensorShape(name);
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      t.data.resize(n);
      if (absl::Status s = stage.ExportTensorFromBuffer(name, buffer, t.data.data()); !s.ok()) return s;
      moments.push_back(std::move(t));
    }
  }
  if (absl::Status s = WriteSafetensorsAtomically(step_dir + "/optimizer.safetensors", moments,
                                                  {{"step", absl::StrCat(adam.step())}});
      !s.ok()) {
    return s;
  }
  const GPT2Config& c = stage.config();
  std::string manifest = absl::StrCat(
      "{\n  \"format\": \"geotrain-checkpoint-1\",\n  \"step\": ", step, ",\n  \"model\": {\"n_layer\": ", c.n_layer,
      ", \"n_head\": ", c.n_head, ", \"n_embd\": ", c.n_embd, ", \"block_size\": ", c.block_size,
      ", \"vocab_size\": ", c.vocab_size, "},\n  \"data_position\": {\"shard\": ", data_position.shard,
      ", \"offset\": ", data_position.offset, ", \"epoch\": ", data_position.epoch, "},\n  \"files\": {");
  bool first = true;
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    absl::StatusOr<std::string> bytes = ReadFileToString(absl::StrCat(step_dir, "/", file));
    if (!bytes.ok()) return bytes.status();
    absl::StrAppend(&manifest, first ? "" : ",", "\n    \"", file, "\": {\"bytes\": ", bytes->size(), ", \"crc32\": \"",
                    absl::StrFormat("%08x", Crc32(bytes->data(), bytes->size())), "\"}");
    first = false;
  }
  manifest += "\n  }\n}\n";
  if (absl::Status s = WriteFileAtomically(step_dir + "/manifest.json", manifest); !s.ok()) return s;
  return WriteFileAtomically(dir + "/latest", step_name + "\n");
}

absl::StatusOr<CheckpointInfo> LoadCheckpoint(const std::string& dir, GPT2Stage& stage, AdamW& adam) {
  namespace fs = std::filesystem;
  std::string step_dir = dir;
  if (!fs::exists(dir + "/manifest.json")) {
    absl::StatusOr<std::string> latest = ReadFileToString(dir + "/latest");
    if (!latest.ok()) return absl::NotFoundError(absl::StrCat("no checkpoint in ", dir, " (no 'latest' file)"));
    step_dir = absl::StrCat(dir, "/", absl::StripAsciiWhitespace(*latest));
  }
  const std::string manifest_path = step_dir + "/manifest.json";
  absl::StatusOr<std::string> manifest_text = ReadFileToString(manifest_path);
  if (!manifest_text.ok()) return manifest_text.status();
  absl::StatusOr<google::protobuf::Struct> manifest = ParseJson(*manifest_text, manifest_path);
  if (!manifest.ok()) return manifest.status();
  const auto& fields = manifest->fields();
  auto number = [&](const google::protobuf::Struct& s, const std::string& key) -> double {
    auto it = s.fields().find(key);
    return it == s.fields().end() ? -1.0 : it->second.number_value();
  };
  if (!fields.count("format") || fields.at("format").string_value() != "geotrain-checkpoint-1") {
    return absl::DataLossError(absl::StrCat(manifest_path, ": not a geotrain checkpoint manifest"));
  }
  for (const char* key : {"model", "files", "data_position", "step"}) {
    if (!fields.count(key)) return absl::DataLossError(absl::StrCat(manifest_path, ": missing '", key, "'"));
  }
  const google::protobuf::Struct& model = fields.at("model").struct_value();
  const GPT2Config& c = stage.config();
  if (number(model, "n_layer") != c.n_layer || number(model, "n_head") != c.n_head ||
      number(model, "n_embd") != c.n_embd || number(model, "block_size") != c.block_size ||
      number(model, "vocab_size") != c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(manifest_path, ": checkpoint is for another model shape (",
                                                   number(model, "n_layer"), " layers, ", number(model, "n_embd"),
                                                   " channels); resume with the spec it was trained with"));
  }
  // Verify every file before loading anything.
  std::map<std::string, SafetensorsFile> files;
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string path = absl::StrCat(step_dir, "/", file);
    auto entry = fields.at("files").struct_value().fields().find(file);
    if (entry == fields.at("files").struct_value().fields().end()) {
      return absl::DataLossError(absl::StrCat(manifest_path, ": no entry for ", file));
    }
    absl::StatusOr<std::string> bytes = ReadFileToString(path);
    if (!bytes.ok()) return bytes.status();
    const double want_bytes = number(entry->second.struct_value(), "bytes");
    const auto& entry_fields = entry->second.struct_value().fields();
    const std::string want_crc = entry_fields.count("crc32") ? entry_fields.at("crc32").string_value() : "";
    const std::string crc = absl::StrFormat("%08x", Crc32(bytes->data(), bytes->size()));
    if (want_bytes != static_cast<double>(bytes->size()) || crc != want_crc) {
      return absl::DataLossError(absl::StrCat(path, ": ", bytes->size(), " bytes with CRC-32 ", crc,
                                              " but the manifest records ", want_bytes, " bytes with ", want_crc,
                                              "; the file is truncated or corrupt: resume from an older step"));
    }
    absl::StatusOr<SafetensorsFile> parsed = ReadSafetensors(path);
    if (!parsed.ok()) return parsed.status();
    files[file] = std::move(*parsed);
  }
  if (absl::Status s = LoadStageWeights(files["model.safetensors"], step_dir + "/model.safetensors", stage); !s.ok()) {
    return s;
  }
  const SafetensorsFile& opt = files["optimizer.safetensors"];
  // Every element the files hold is set; the rest (wte's padded rows) keeps its current value.
  std::vector<float> host_m, host_v;
  if (absl::Status s = adam.CopyMomentsToHost(&host_m, &host_v); !s.ok()) return s;
  for (const char* which : {"m.", "v."}) {
    float* buffer = which[0] == 'm' ? host_m.data() : host_v.data();
    for (const std::string& name : stage.TensorNames()) {
      const NamedTensor* t = opt.Find(which + name);
      if (t == nullptr)
        return absl::DataLossError(absl::StrCat(step_dir, "/optimizer.safetensors: missing ", which, name));
      if (absl::Status s =
              stage.ImportTensorToBuffer(name, t->data.data(), static_cast<int64_t>(t->data.size()), buffer);
          !s.ok()) {
        return s;
      }
    }
  }
  if (absl::Status s = adam.CopyMomentsFromHost(host_m, host_v); !s.ok()) return s;
  int64_t adam_step = 0;
  if (auto it = opt.metadata.find("step"); it != opt.metadata.end()) adam_step = std::stoll(it->second);
  adam.set_step(adam_step);
  CheckpointInfo info;
  info.directory = step_dir;
  info.step = static_cast<int64_t>(number(*manifest, "step"));
  const google::protobuf::Struct& pos = fields.at("data_position").struct_value();
  info.data_position.shard = static_cast<int64_t>(number(pos, "shard"));
  info.data_position.offset = static_cast<int64_t>(number(pos, "offset"));
  info.data_position.epoch = static_cast<int64_t>(number(pos, "epoch"));
  return info;
}

}  // namespace geotrain::model
