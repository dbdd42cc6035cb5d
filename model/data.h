// Token shards and the training data loader.
//
// A shard is llm.c's / nanoGPT's .bin layout: a header of 256 little-endian int32 (magic 20240520,
// version 1, token count, the rest 0), then `count` uint16 tokens. PrepareTextData writes them from text
// (documents separated by <|endoftext|>); DataLoader memory-maps them and yields batches.
//
//   auto loader = DataLoader::Create("data/train_*.bin", B, T, /*replica=*/r, /*num_replicas=*/R, vocab);
//   (*loader)->Next(inputs, targets);        // (B,T) each: one (B, T+1) window split in two
//   DataPosition pos = (*loader)->position(); // save beside a checkpoint; Restore(pos) to resume exactly
//
// Deterministic split among data-parallel replicas: the loader walks the shards in name order in steps
// of R*B*T tokens; replica r takes the r-th B*T piece of each step (row b of its batch is the T+1 tokens
// at step_start + (r*B + b)*T). All replicas hold the same position, so one saved position resumes all.
// A shard too short for a step is skipped; after the last shard the walk restarts (epoch + 1).
//
// Shards that arrive while training goes on (staged from the head, worker/shard_cache.h): a ShardSource gives
// every shard's token count up front and a call that waits until a shard is on local disk; the loader opens each
// shard when its walk reaches it, so training starts with the first shard and the later ones stream in behind.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace geotrain::model {

inline constexpr int32_t kShardMagic = 20240520;
inline constexpr int32_t kShardVersion = 1;
inline constexpr int kShardHeaderInts = 256;

absl::Status WriteTokenShard(const std::string& path, const std::vector<uint16_t>& tokens);

// Checks the bytes of a whole shard (what TokenShard::Open maps): magic, version, size == header +
// 2*count, every token < vocab_size. Returns the token count; `path` names the shard in errors. Pure and safe
// on any bytes (fuzzed: fuzz/token_shard_fuzzer.cc).
absl::StatusOr<int64_t> ValidateTokenShard(const void* bytes, size_t size, int vocab_size, const std::string& path);

// A read-only memory-mapped shard, validated on open: magic, version, size == header + 2*count, and
// every token < vocab_size.
class TokenShard {
 public:
  static absl::StatusOr<std::unique_ptr<TokenShard>> Open(const std::string& path, int vocab_size);
  ~TokenShard();
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const uint16_t* tokens() const { return tokens_; }
  int64_t size() const { return count_; }
  const std::string& path() const { return path_; }

 private:
  TokenShard() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  const uint16_t* tokens_ = nullptr;
  int64_t count_ = 0;
};

struct DataPosition {
  int64_t shard = 0;   // index into the sorted shard list
  int64_t offset = 0;  // token offset of the next step inside that shard
  int64_t epoch = 0;
};

// The token count a shard file of `bytes` bytes holds (header excluded); -1 when it cannot be a shard.
int64_t ShardTokensForBytes(uint64_t bytes);

// Shards in walk order whose files may not be local yet.
struct ShardSource {
  std::vector<std::string> names;     // for messages (e.g. the shard's path on the head)
  std::vector<int64_t> token_counts;  // known before the file is local (from its size)
  // Blocks until shard `index` is on local disk and returns its path, or why it cannot be (the step then fails
  // with that error). Called from the thread that drives the loader, once per shard, in walk order.
  std::function<absl::StatusOr<std::string>(int index)> wait_for_shard;
};

// What a validation loader's errors are prefixed with (train --local and the stage actors alike).
inline constexpr char kValidationDataContext[] =
    "validation data (data.val: each evaluation reads train.eval_batches global batches)";

class DataLoader {
 public:
  // pattern: a glob (or one path) of shards; sorted by name. Fails when nothing matches, a shard is
  // invalid, or no shard holds one step (num_replicas * B * T + 1 tokens).
  static absl::StatusOr<std::unique_ptr<DataLoader>> Create(const std::string& pattern, int B, int T, int replica,
                                                            int num_replicas, int vocab_size);
  // Shards that become local later: each is opened (and validated) when the walk first reaches it. Fails at once
  // when no shard holds one step.
  static absl::StatusOr<std::unique_ptr<DataLoader>> Create(ShardSource source, int B, int T, int replica,
                                                            int num_replicas, int vocab_size);

  // Fills inputs and targets (B*T each) with this replica's next window and advances. Waits for a shard that is
  // not local yet; fails when it cannot be had or does not validate (the error names the shard).
  [[nodiscard]] absl::Status Next(int32_t* inputs, int32_t* targets);
  DataPosition position() const { return position_; }
  absl::Status Restore(const DataPosition& position);
  void Reset() {
    position_ = DataPosition{};
    SkipShortShards();
  }
  int64_t total_tokens() const;
  const std::vector<std::string>& paths() const { return source_.names; }

 private:
  DataLoader() = default;
  static absl::StatusOr<std::unique_ptr<DataLoader>> Make(ShardSource source,
                                                          std::vector<std::unique_ptr<TokenShard>> opened, int B, int T,
                                                          int replica, int num_replicas, int vocab_size,
                                                          const std::string& what);
  void SkipShortShards();
  absl::Status EnsureOpen(int64_t index);

  ShardSource source_;
  std::vector<std::unique_ptr<TokenShard>> shards_;  // null until the walk reaches a shard
  int B_ = 0, T_ = 0, replica_ = 0, num_replicas_ = 1, vocab_size_ = 0;
  DataPosition position_;
};

// Text to shards. Inputs are files or directories (walked recursively, sorted; *.dat and *.u8 skipped,
// as are files with NUL bytes). A file whose lines include lone "%" separators (fortune files) splits
// into one document per entry; any other file is one document. Documents are shuffled with a fixed
// seed; the first ceil(val_fraction * n) go to val_000000.bin, the rest to train_000000.bin,
// train_000001.bin, ... (at most shard_tokens each). Each document is preceded by <|endoftext|>.
class Tokenizer;
struct PrepareStats {
  int64_t documents = 0, train_tokens = 0, val_tokens = 0;
  std::vector<std::string> files_written;
};
absl::StatusOr<PrepareStats> PrepareTextData(const std::vector<std::string>& inputs, const std::string& out_dir,
                                             double val_fraction, Tokenizer& tokenizer,
                                             int64_t shard_tokens = 100'000'000);

}  // namespace geotrain::model
