// Checkpoint files: shards, manifests, verification, pruning (see checkpoint_files.h).
#include "model/checkpoint_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/json.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"

namespace geotrain::model {
namespace {

namespace fs = std::filesystem;

std::string Crc32Hex(const std::string& bytes) { return absl::StrFormat("%08x", Crc32(bytes.data(), bytes.size())); }

absl::StatusOr<WrittenShard::File> WriteTensorsFile(const std::string& dir, const std::string& name,
                                                    const std::vector<NamedTensor>& tensors,
                                                    const std::map<std::string, std::string>& metadata) {
  const std::string path = absl::StrCat(dir, "/", name);
  RETURN_IF_ERROR(WithContext(WriteSafetensorsAtomically(path, tensors, metadata), "writing checkpoint file"));
  // The CRC is of the bytes on disk, read back: what a later reader will verify.
  ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
  return WrittenShard::File{name, bytes.size(), Crc32Hex(bytes)};
}

std::string ManifestToJson(const CheckpointManifest& manifest) {
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  std::string json;
  (void)google::protobuf::util::MessageToJsonString(manifest, &json, options);
  return json;
}

// Step directories under `dir`, newest first.
std::vector<std::pair<int64_t, std::string>> StepDirectories(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    int64_t step = 0;
    if (!e.is_directory(ec) || !absl::StartsWith(name, "step_") || !absl::SimpleAtoi(name.substr(5), &step)) continue;
    out.push_back({step, e.path().string()});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

}  // namespace

std::string OptimizerFileFor(const std::string& model_file) {
  return absl::StrCat("optimizer", absl::StripPrefix(model_file, "model"));
}

std::string GroupFileFor(const std::string& model_file, int group) {
  if (group == 0) return model_file;
  return absl::StrCat("model-g", group, absl::StripPrefix(model_file, "model"));
}

std::string ShardSuffix(int group, int pp, int stage) {
  return absl::StrCat(group > 0 ? absl::StrCat("-g", group) : "", pp > 1 ? absl::StrCat("-s", stage) : "");
}

std::string DilocoFileFor(const std::string& model_file) {
  return absl::StrCat("diloco", absl::StripPrefix(model_file, "model"));
}

std::string StepDirectory(const std::string& dir, int64_t step) { return absl::StrFormat("%s/step_%08d", dir, step); }

absl::StatusOr<WrittenShard> WriteCheckpointShard(const std::string& step_dir, const std::string& suffix,
                                                  const CheckpointSnapshot& snapshot) {
  std::error_code ec;
  fs::create_directories(step_dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create checkpoint directory ", step_dir, ": ", ec.message()));
  }
  WrittenShard shard;
  shard.model_file = absl::StrCat("model", suffix, ".safetensors");
  ASSIGN_OR_RETURN(WrittenShard::File model,
                   WriteTensorsFile(step_dir, shard.model_file, snapshot.weights, {{"format", "pt"}}));
  std::map<std::string, std::string> optimizer_metadata = {{"step", absl::StrCat(snapshot.optimizer_step)}};
  if (snapshot.loss_scale.has_value()) {
    optimizer_metadata[kLossScaleKey] = absl::StrFormat("%.17g", snapshot.loss_scale->scale);  // exact
    optimizer_metadata[kLossScaleCleanStepsKey] = absl::StrCat(snapshot.loss_scale->clean_steps);
    optimizer_metadata[kLossScaleSkippedKey] = absl::StrCat(snapshot.loss_scale->skipped);
  }
  ASSIGN_OR_RETURN(WrittenShard::File optimizer, WriteTensorsFile(step_dir, OptimizerFileFor(shard.model_file),
                                                                  snapshot.moments, optimizer_metadata));
  shard.files = {model, optimizer};
  if (!snapshot.outer.empty()) {
    ASSIGN_OR_RETURN(WrittenShard::File outer,
                     WriteTensorsFile(step_dir, DilocoFileFor(shard.model_file), snapshot.outer, {}));
    shard.files.push_back(outer);
  }
  for (const NamedTensor& t : snapshot.weights) shard.tensors.push_back(t.name);
  return shard;
}

absl::Status CommitCheckpoint(const std::string& dir, const CheckpointManifest& manifest) {
  const std::string step_dir = StepDirectory(dir, manifest.step());
  std::set<std::string> model_files;
  for (const auto& [name, file] : manifest.tensors()) model_files.insert(file);
  if (model_files.size() > 1) {
    // HF transformers' sharded-checkpoint index: from_pretrained(step_dir) then finds every tensor.
    Json weight_map = Json::object();
    std::map<std::string, std::string> sorted(manifest.tensors().begin(), manifest.tensors().end());
    for (const auto& [name, file] : sorted) weight_map[name] = file;
    const Json index = {{"metadata", Json::object()}, {"weight_map", std::move(weight_map)}};
    RETURN_IF_ERROR(WriteFileAtomically(step_dir + "/model.safetensors.index.json",
                                        index.dump(2, ' ', false, Json::error_handler_t::replace) + "\n"));
  }
  RETURN_IF_ERROR(WriteFileAtomically(step_dir + "/manifest.json", ManifestToJson(manifest)));
  return WriteFileAtomically(dir + "/latest", fs::path(step_dir).filename().string() + "\n");
}

absl::StatusOr<CheckpointManifest> VerifyCheckpoint(const std::string& step_dir) {
  const std::string manifest_path = step_dir + "/manifest.json";
  std::error_code ec;
  if (!fs::exists(manifest_path, ec)) {
    return absl::NotFoundError(absl::StrCat(step_dir, " has no manifest.json: the checkpoint is incomplete"));
  }
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(manifest_path));
  CheckpointManifest manifest;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;  // later versions may add fields
  if (auto parsed = google::protobuf::util::JsonStringToMessage(text, &manifest, options); !parsed.ok()) {
    return absl::DataLossError(absl::StrCat(manifest_path, ": not a valid checkpoint manifest: ", parsed.ToString()));
  }
  if (manifest.format() != kCheckpointFormat && manifest.format() != "geotrain-checkpoint-1") {
    return absl::DataLossError(
        absl::StrCat(manifest_path, ": unknown format '", manifest.format(), "' (expected ", kCheckpointFormat, ")"));
  }
  if (manifest.files().empty()) return absl::DataLossError(absl::StrCat(manifest_path, ": lists no files"));
  for (const auto& [name, entry] : manifest.files()) {
    if (name.empty() || name.find('/') != std::string::npos || name == "..") {
      return absl::DataLossError(absl::StrCat(manifest_path, ": bad file name '", name, "'"));
    }
    const std::string path = absl::StrCat(step_dir, "/", name);
    absl::StatusOr<std::string> bytes = ReadFileToString(path);
    if (!bytes.ok())
      return absl::DataLossError(absl::StrCat(path, ": listed in the manifest but ", bytes.status().message()));
    const std::string crc = Crc32Hex(*bytes);
    if (entry.bytes() != bytes->size() || crc != entry.crc32()) {
      return absl::DataLossError(absl::StrCat(path, ": ", bytes->size(), " bytes with CRC-32 ", crc,
                                              " but the manifest records ", entry.bytes(), " bytes with ",
                                              entry.crc32(), "; the file is truncated or corrupt"));
    }
  }
  // Every tensor's file with its optimizer file, in each DiLoCo group.
  for (const auto& [tensor, group_0_file] : manifest.tensors()) {
    for (int group = 0; group < std::max(1, manifest.diloco_groups()); ++group) {
      const std::string file = GroupFileFor(group_0_file, group);
      if (manifest.files().contains(file) && manifest.files().contains(OptimizerFileFor(file))) continue;
      return absl::DataLossError(absl::StrCat(manifest_path, ": tensor ", tensor, " is in ", file,
                                              ", which the manifest does not list with its optimizer file"));
    }
  }
  return manifest;
}

absl::StatusOr<std::string> FindNewestCheckpoint(const std::string& dir, std::vector<std::string>* skipped) {
  std::vector<std::string> reasons;
  for (const auto& [step, step_dir] : StepDirectories(dir)) {
    absl::StatusOr<CheckpointManifest> manifest = VerifyCheckpoint(step_dir);
    if (manifest.ok()) {
      if (skipped != nullptr) skipped->insert(skipped->end(), reasons.begin(), reasons.end());
      return step_dir;
    }
    reasons.push_back(std::string(manifest.status().message()));
  }
  if (skipped != nullptr) skipped->insert(skipped->end(), reasons.begin(), reasons.end());
  if (!reasons.empty()) {
    return absl::NotFoundError(
        absl::StrCat("no complete checkpoint in ", dir, ": ", reasons.front(),
                     reasons.size() > 1 ? absl::StrCat(" (and ", reasons.size() - 1, " more step directories)") : ""));
  }
  return absl::NotFoundError(absl::StrCat("no checkpoint in ", dir, " (no step_NNNNNNNN directory)"));
}

absl::Status PruneCheckpoints(const std::string& dir, int keep) {
  int complete = 0;
  bool seen_complete = false;
  for (const auto& [step, step_dir] : StepDirectories(dir)) {
    std::error_code ec;
    const bool has_manifest = fs::exists(step_dir + "/manifest.json", ec);
    bool remove = false;
    if (has_manifest) {
      seen_complete = true;
      remove = keep >= 0 && ++complete > keep;
    } else {
      remove = seen_complete;  // an abandoned write older than a complete checkpoint
    }
    if (!remove) continue;
    fs::remove_all(step_dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot delete old checkpoint ", step_dir, ": ", ec.message()));
  }
  return absl::OkStatus();
}

int CheckpointsKept(const CheckpointSpec& spec) { return spec.keep() == 0 ? 3 : spec.keep(); }

absl::StatusOr<CheckpointManifest> ParseManifest(const std::string& json, const std::string& source) {
  CheckpointManifest manifest;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  if (!google::protobuf::util::JsonStringToMessage(json, &manifest, options).ok()) {
    return absl::DataLossError(absl::StrCat(source, " does not parse as a checkpoint manifest"));
  }
  return manifest;
}

absl::StatusOr<CheckpointManifest> ReadManifest(const std::string& step_dir) {
  const std::string path = absl::StrCat(step_dir, "/manifest.json");
  ASSIGN_OR_RETURN(std::string json, ReadFileToString(path));
  return ParseManifest(json, path);
}

absl::Status WriteManifest(const std::string& step_dir, const CheckpointManifest& manifest) {
  return WriteFileAtomically(absl::StrCat(step_dir, "/manifest.json"), ManifestToJson(manifest));
}

bool IsCheckpointFileName(const std::string& name) {
  if (name.empty() || name.size() > 255 || name == "." || name == ".." || absl::StartsWith(name, ".")) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

absl::StatusOr<std::string> FileCrc32Hex(const std::string& path) {
  ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
  return Crc32Hex(bytes);
}

IncomingCheckpointFile::IncomingCheckpointFile(std::string path, uint64_t bytes, std::string crc32, int fd)
    : path_(std::move(path)), part_(path_ + ".part"), crc32_(std::move(crc32)), bytes_(bytes), fd_(fd) {}

absl::StatusOr<std::unique_ptr<IncomingCheckpointFile>> IncomingCheckpointFile::Create(std::string path, uint64_t bytes,
                                                                                       std::string crc32) {
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", fs::path(path).parent_path().string(), ": ", ec.message()));
  }
  const std::string part = path + ".part";
  const int fd = ::open(part.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::PermissionDeniedError(absl::StrCat("cannot create ", part, ": ", std::strerror(errno)));
  return std::unique_ptr<IncomingCheckpointFile>(
      new IncomingCheckpointFile(std::move(path), bytes, std::move(crc32), fd));
}

IncomingCheckpointFile::~IncomingCheckpointFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) ::unlink(part_.c_str());
}

absl::Status IncomingCheckpointFile::Append(std::string_view data) {
  if (received_ + data.size() > bytes_) {
    return absl::DataLossError(absl::StrCat(path_, ": more than the ", bytes_, " bytes announced arrived"));
  }
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return errno == ENOSPC ? absl::ResourceExhaustedError(absl::StrCat("the disk holding ", path_, " is full"))
                             : absl::InternalError(absl::StrCat("writing ", part_, ": ", std::strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
  crc_ = Crc32(data.data(), data.size(), crc_);
  received_ += data.size();
  return absl::OkStatus();
}

absl::Status IncomingCheckpointFile::Finish() {
  if (received_ != bytes_) {
    return absl::DataLossError(
        absl::StrCat(path_, ": ", received_, " bytes arrived, ", bytes_, " were announced; the copy broke off"));
  }
  const std::string crc = absl::StrFormat("%08x", crc_);
  if (crc != crc32_) {
    return absl::DataLossError(absl::StrCat(path_, ": the copy has CRC-32 ", crc, ", the sender's file ", crc32_,
                                            "; it was corrupted on the way"));
  }
  if (::fsync(fd_) != 0 || ::close(fd_) != 0) {
    fd_ = -1;
    return absl::InternalError(absl::StrCat("flushing ", part_, ": ", std::strerror(errno)));
  }
  fd_ = -1;
  if (::rename(part_.c_str(), path_.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("renaming ", part_, ": ", std::strerror(errno)));
  }
  finished_ = true;
  return absl::OkStatus();
}

}  // namespace geotrain::model
