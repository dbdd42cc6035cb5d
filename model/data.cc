// Token shards, the data loader and text preparation (see data.h).
#include "model/data.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "model/safetensors.h"
#include "model/tokenizer.h"

namespace geotrain::model {

absl::Status WriteTokenShard(const std::string& path, const std::vector<uint16_t>& tokens) {
  std::string bytes(kShardHeaderInts * 4 + tokens.size() * 2, '\0');
  int32_t header[kShardHeaderInts] = {};
  header[0] = kShardMagic;
  header[1] = kShardVersion;
  header[2] = static_cast<int32_t>(tokens.size());
  if (tokens.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", tokens.size(), " tokens exceed one shard"));
  }
  std::memcpy(bytes.data(), header, sizeof(header));
  std::memcpy(bytes.data() + sizeof(header), tokens.data(), tokens.size() * 2);
  return WriteFileAtomically(path, bytes);
}

absl::StatusOr<int64_t> ValidateTokenShard(const void* bytes, size_t size, int vocab_size, const std::string& path) {
  const size_t header_bytes = kShardHeaderInts * 4;
  if (size < header_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", size, " bytes is shorter than the ", header_bytes,
                                            "-byte shard header; the file is truncated or not a token shard"));
  }
  int32_t header[3];
  std::memcpy(header, bytes, sizeof(header));
  if (header[0] != kShardMagic) {
    return absl::DataLossError(absl::StrCat(path, ": bad magic ", header[0], " (expected ", kShardMagic,
                                            "); not an llm.c token shard; write shards with `geotrain data prepare`"));
  }
  if (header[1] != kShardVersion) {
    return absl::DataLossError(
        absl::StrCat(path, ": shard version ", header[1], " is not supported (expected ", kShardVersion, ")"));
  }
  const int64_t count = header[2];
  if (count < 0 || header_bytes + static_cast<size_t>(count) * 2 != size) {
    return absl::DataLossError(absl::StrCat(path, ": header says ", count, " tokens (", header_bytes + count * 2,
                                            " bytes) but the file has ", size, " bytes; it is truncated or corrupt"));
  }
  const char* tokens = static_cast<const char*>(bytes) + header_bytes;
  for (int64_t i = 0; i < count; ++i) {
    uint16_t token;
    std::memcpy(&token, tokens + 2 * i, 2);
    if (token >= vocab_size) {
      return absl::DataLossError(absl::StrCat(path, ": token ", token, " at index ", i,
                                              " is outside the model's vocabulary of ", vocab_size,
                                              "; the shard was made with another tokenizer or model"));
    }
  }
  return count;
}

absl::StatusOr<std::unique_ptr<TokenShard>> TokenShard::Open(const std::string& path, int vocab_size) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open token shard ", path, ": ", std::strerror(errno)));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("cannot stat ", path));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < kShardHeaderInts * 4) {
    ::close(fd);
    return ValidateTokenShard(nullptr, size, vocab_size, path).status();  // the "too short" error
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return absl::InternalError(absl::StrCat("cannot mmap ", path, ": ", std::strerror(errno)));
  std::unique_ptr<TokenShard> shard(new TokenShard());
  shard->path_ = path;
  shard->map_ = map;
  shard->map_size_ = size;
  ASSIGN_OR_RETURN(shard->count_, ValidateTokenShard(map, size, vocab_size, path));
  shard->tokens_ = reinterpret_cast<const uint16_t*>(static_cast<const char*>(map) + kShardHeaderInts * 4);
  return shard;
}

TokenShard::~TokenShard() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

int64_t ShardTokensForBytes(uint64_t bytes) {
  const uint64_t header_bytes = kShardHeaderInts * 4;
  if (bytes < header_bytes || (bytes - header_bytes) % 2 != 0) return -1;
  return static_cast<int64_t>((bytes - header_bytes) / 2);
}

absl::StatusOr<std::unique_ptr<DataLoader>> DataLoader::Create(const std::string& pattern, int B, int T, int replica,
                                                               int num_replicas, int vocab_size) {
  ShardSource source;
  glob_t g;
  std::memset(&g, 0, sizeof(g));
  if (::glob(pattern.c_str(), 0, nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) source.names.push_back(g.gl_pathv[i]);
  }
  ::globfree(&g);
  std::sort(source.names.begin(), source.names.end());
  if (source.names.empty()) {
    return absl::NotFoundError(absl::StrCat("no token shards match '", pattern,
                                            "'; write them with `geotrain data prepare INPUT... --out DIR`"));
  }
  // Local files: every shard is opened and validated now.
  std::vector<std::unique_ptr<TokenShard>> opened;
  for (const std::string& path : source.names) {
    ASSIGN_OR_RETURN(std::unique_ptr<TokenShard> shard, TokenShard::Open(path, vocab_size));
    source.token_counts.push_back(shard->size());
    opened.push_back(std::move(shard));
  }
  source.wait_for_shard = [names = source.names](int index) -> absl::StatusOr<std::string> { return names[index]; };
  return Make(std::move(source), std::move(opened), B, T, replica, num_replicas, vocab_size,
              absl::StrCat("matching '", pattern, "'"));
}

absl::StatusOr<std::unique_ptr<DataLoader>> DataLoader::Create(ShardSource source, int B, int T, int replica,
                                                               int num_replicas, int vocab_size) {
  if (source.names.empty() || source.names.size() != source.token_counts.size() || !source.wait_for_shard) {
    return absl::InvalidArgumentError("data loader: no shards (or a shard without its token count) to load");
  }
  std::vector<std::unique_ptr<TokenShard>> opened(source.names.size());
  const std::string what = absl::StrCat("of the ", source.names.size(), " staged");
  return Make(std::move(source), std::move(opened), B, T, replica, num_replicas, vocab_size, what);
}

absl::StatusOr<std::unique_ptr<DataLoader>> DataLoader::Make(ShardSource source,
                                                             std::vector<std::unique_ptr<TokenShard>> opened, int B,
                                                             int T, int replica, int num_replicas, int vocab_size,
                                                             const std::string& what) {
  if (B <= 0 || T <= 0 || num_replicas <= 0 || replica < 0 || replica >= num_replicas) {
    return absl::InvalidArgumentError(
        absl::StrCat("data loader: bad B ", B, ", T ", T, ", replica ", replica, " of ", num_replicas));
  }
  const int64_t step_tokens = static_cast<int64_t>(num_replicas) * B * T + 1;
  if (std::none_of(source.token_counts.begin(), source.token_counts.end(),
                   [&](int64_t n) { return n >= step_tokens; })) {
    return absl::InvalidArgumentError(absl::StrCat("no shard ", what, " holds one step of ", step_tokens, " tokens (",
                                                   num_replicas, " replicas x B ", B, " x T ", T,
                                                   " + 1); use more data or a smaller batch"));
  }
  std::unique_ptr<DataLoader> loader(new DataLoader());
  loader->source_ = std::move(source);
  loader->shards_ = std::move(opened);
  loader->B_ = B;
  loader->T_ = T;
  loader->replica_ = replica;
  loader->num_replicas_ = num_replicas;
  loader->vocab_size_ = vocab_size;
  loader->SkipShortShards();
  return loader;
}

void DataLoader::SkipShortShards() {
  const int64_t step_tokens = static_cast<int64_t>(num_replicas_) * B_ * T_ + 1;
  while (position_.offset + step_tokens > source_.token_counts[position_.shard]) {
    position_.offset = 0;
    if (++position_.shard == static_cast<int64_t>(shards_.size())) {
      position_.shard = 0;
      ++position_.epoch;
    }
  }
}

absl::Status DataLoader::EnsureOpen(int64_t index) {
  if (shards_[index] != nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::string path, source_.wait_for_shard(static_cast<int>(index)));
  ASSIGN_OR_RETURN(std::unique_ptr<TokenShard> shard, TokenShard::Open(path, vocab_size_));
  if (shard->size() != source_.token_counts[index]) {
    return absl::DataLossError(absl::StrCat("token shard ", source_.names[index], " (local copy ", path, ") holds ",
                                            shard->size(), " tokens, expected ", source_.token_counts[index],
                                            "; the shard changed while the job ran"));
  }
  shards_[index] = std::move(shard);
  return absl::OkStatus();
}

absl::Status DataLoader::Next(int32_t* inputs, int32_t* targets) {
  RETURN_IF_ERROR(EnsureOpen(position_.shard));
  const uint16_t* tokens = shards_[position_.shard]->tokens() + position_.offset;
  for (int b = 0; b < B_; ++b) {
    const uint16_t* row = tokens + (static_cast<int64_t>(replica_) * B_ + b) * T_;
    for (int t = 0; t < T_; ++t) {
      inputs[b * T_ + t] = row[t];
      targets[b * T_ + t] = row[t + 1];
    }
  }
  position_.offset += static_cast<int64_t>(num_replicas_) * B_ * T_;
  SkipShortShards();
  return absl::OkStatus();
}

absl::Status DataLoader::Restore(const DataPosition& position) {
  if (position.shard < 0 || position.shard >= static_cast<int64_t>(shards_.size()) || position.offset < 0 ||
      position.offset > source_.token_counts[position.shard] || position.epoch < 0) {
    return absl::InvalidArgumentError(absl::StrCat("data position (shard ", position.shard, ", offset ",
                                                   position.offset, ") does not fit the ", shards_.size(),
                                                   " shards found; were the shards rewritten?"));
  }
  position_ = position;
  SkipShortShards();
  return absl::OkStatus();
}

int64_t DataLoader::total_tokens() const {
  int64_t n = 0;
  for (int64_t count : source_.token_counts) n += count;
  return n;
}

namespace {

// Collects input files in a deterministic order.
absl::Status CollectFiles(const std::string& input, std::vector<std::string>* files) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(input, ec)) {
    std::vector<std::string> found;
    for (auto it = fs::recursive_directory_iterator(input, ec); !ec && it != fs::recursive_directory_iterator();
         it.increment(ec)) {
      if (it->is_regular_file(ec)) found.push_back(it->path().string());
    }
    std::sort(found.begin(), found.end());
    for (const std::string& f : found) {
      if (f.ends_with(".dat") || f.ends_with(".u8")) continue;
      files->push_back(f);
    }
    return absl::OkStatus();
  }
  if (fs::is_regular_file(input, ec)) {
    files->push_back(input);
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("data prepare: input '", input, "' is neither a file nor a directory"));
}

uint64_t Mix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

absl::StatusOr<PrepareStats> PrepareTextData(const std::vector<std::string>& inputs, const std::string& out_dir,
                                             double val_fraction, Tokenizer& tokenizer, int64_t shard_tokens) {
  if (val_fraction < 0.0 || val_fraction >= 1.0) {
    return absl::InvalidArgumentError(absl::StrCat("--val-fraction ", val_fraction, " must be in [0, 1)"));
  }
  if (tokenizer.eot_token() < 0 || tokenizer.vocab_size() > 65536) {
    return absl::InvalidArgumentError("data prepare needs a GPT-2 tokenizer (<|endoftext|> and <= 65536 tokens)");
  }
  std::vector<std::string> files;
  for (const std::string& input : inputs) {
    RETURN_IF_ERROR(CollectFiles(input, &files));
  }
  std::vector<std::string> documents;
  for (const std::string& file : files) {
    ASSIGN_OR_RETURN(std::string text, ReadFileToString(file));
    if (text.find('\0') != std::string::npos) continue;  // binary
    std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
    const bool fortune = std::count(lines.begin(), lines.end(), absl::string_view("%")) > 0;
    if (!fortune) {
      if (!text.empty()) documents.push_back(text);
      continue;
    }
    std::string doc;
    for (absl::string_view line : lines) {
      if (line == "%") {
        if (!doc.empty()) documents.push_back(doc);
        doc.clear();
      } else {
        absl::StrAppend(&doc, line, "\n");
      }
    }
    if (doc.find_first_not_of(" \t\n") != std::string::npos) documents.push_back(doc);
  }
  if (documents.empty()) return absl::InvalidArgumentError("data prepare: the inputs hold no text");
  // Fisher-Yates with a fixed seed: the split is the same on every run.
  uint64_t state = 20240520;
  for (size_t i = documents.size(); i > 1; --i) std::swap(documents[i - 1], documents[Mix(state) % i]);
  const size_t num_val =
      val_fraction > 0.0 ? std::max<size_t>(1, static_cast<size_t>(std::ceil(val_fraction * documents.size()))) : 0;
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", out_dir, ": ", ec.message()));
  PrepareStats stats;
  stats.documents = static_cast<int64_t>(documents.size());
  std::vector<uint16_t> buffer;
  int shard_index = 0;
  auto flush = [&](const std::string& name) -> absl::Status {
    const std::string path = absl::StrCat(out_dir, "/", name);
    RETURN_IF_ERROR(WriteTokenShard(path, buffer));
    stats.files_written.push_back(path);
    buffer.clear();
    return absl::OkStatus();
  };
  for (size_t d = 0; d < documents.size(); ++d) {
    const bool val = d < num_val;
    buffer.push_back(static_cast<uint16_t>(tokenizer.eot_token()));
    for (int32_t id : tokenizer.Encode(documents[d])) buffer.push_back(static_cast<uint16_t>(id));
    if (val) {
      if (d + 1 == num_val) {
        stats.val_tokens = static_cast<int64_t>(buffer.size());
        RETURN_IF_ERROR(flush("val_000000.bin"));
      }
      continue;
    }
    if (static_cast<int64_t>(buffer.size()) >= shard_tokens || d + 1 == documents.size()) {
      stats.train_tokens += static_cast<int64_t>(buffer.size());
      RETURN_IF_ERROR(flush(absl::StrFormat("train_%06d.bin", shard_index++)));
    }
  }
  return stats;
}

}  // namespace geotrain::model
