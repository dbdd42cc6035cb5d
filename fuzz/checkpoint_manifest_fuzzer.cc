// Fuzzes checkpoint manifests (proto CheckpointManifest in protobuf's JSON mapping) through the public loader
// (model/checkpoint.h LoadCheckpoint, which runs VerifyCheckpoint from model/checkpoint_files.h, as the head's
// FindNewestCheckpoint does): a real checkpoint of a tiny model (zero weights, so its files and their CRCs are
// the same on every build) is saved once in a temporary directory; each input replaces its manifest.json and is
// loaded. Any manifest gives an error or a checkpoint, never a crash or undefined behaviour.
// The seed corpus holds the manifest SaveCheckpoint writes; GEOTRAIN_FUZZ_DUMP_MANIFEST=PATH copies it there.
#include <stdlib.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "fuzz/fuzz_util.h"
#include "model/checkpoint.h"

namespace {

struct Fixture {
  std::string root;  // the temporary directory, removed at exit
  std::string dir;   // the checkpoint in it
  std::unique_ptr<geotrain::model::GPT2Stage> stage;
  std::unique_ptr<geotrain::model::AdamW> adam;
};
Fixture* fixture = nullptr;

void Fail(const absl::Status& s) {
  std::fprintf(stderr, "checkpoint_manifest fuzzer: %s\n", std::string(s.message()).c_str());
  std::exit(1);
}

void RemoveDir() {
  if (fixture != nullptr) {
    std::error_code ec;
    std::filesystem::remove_all(fixture->root, ec);  // not dir: that left root behind
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fixture = new Fixture();
  char pattern[] = "/tmp/geotrain_fuzz_ckpt_XXXXXX";
  if (::mkdtemp(pattern) == nullptr) Fail(absl::InternalError("mkdtemp failed"));
  fixture->root = pattern;
  fixture->dir = pattern;
  std::atexit(RemoveDir);
  geotrain::GPT2Config config;
  config.n_layer = 1;
  config.n_head = 1;
  config.n_embd = 4;
  config.block_size = 4;
  config.vocab_size = 8;
  absl::StatusOr<std::unique_ptr<geotrain::model::GPT2Stage>> stage = geotrain::model::GPT2Stage::Create(config, {});
  if (!stage.ok()) Fail(stage.status());
  fixture->stage = std::move(*stage);
  std::fill(fixture->stage->params(), fixture->stage->params() + fixture->stage->num_params(), 0.0f);
  fixture->adam = std::make_unique<geotrain::model::AdamW>(fixture->stage->num_params(), fixture->stage->segments(),
                                                           geotrain::model::AdamWOptions{});
  const absl::Status saved = geotrain::model::SaveCheckpoint(fixture->dir, 5, *fixture->stage, *fixture->adam,
                                                             geotrain::model::DataPosition{1, 2, 3});
  if (!saved.ok()) Fail(saved);
  fixture->dir += "/step_00000005";
  if (const char* dump = std::getenv("GEOTRAIN_FUZZ_DUMP_MANIFEST"); dump != nullptr) {
    std::filesystem::copy_file(fixture->dir + "/manifest.json", dump,
                               std::filesystem::copy_options::overwrite_existing);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream out(fixture->dir + "/manifest.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  (void)geotrain::model::LoadCheckpoint(fixture->dir, *fixture->stage, *fixture->adam);
  return 0;
}
