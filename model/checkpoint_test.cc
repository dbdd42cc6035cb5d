// Weights and checkpoints: HF names and layout, round trip, HF prefixes, corruption detection.
#include "model/checkpoint.h"

#include <filesystem>

#include "common/files.h"
#include "common/json.h"
#include "gtest/gtest.h"
#include "model/checkpoint_files.h"

namespace geotrain::model {
namespace {

GPT2Config Tiny() {
  GPT2Config c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 8;
  c.block_size = 8;
  c.vocab_size = 30;
  EXPECT_TRUE(c.Validate().ok());
  return c;
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / ("geotrain_ckpt_test_" + std::to_string(::getpid()) + "_" +
                                                      ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

std::unique_ptr<GPT2Stage> Model(uint64_t seed) {
  auto m = GPT2Stage::Create(Tiny(), {});
  EXPECT_TRUE(m.ok());
  (*m)->InitializeWeights(seed);
  return std::move(*m);
}

TEST_F(CheckpointTest, WeightsUseHfNamesAndConv1dLayout) {
  auto m = Model(1);
  ASSERT_TRUE(SaveStageWeights(dir_ + "/w.safetensors", *m).ok());
  auto f = ReadSafetensors(dir_ + "/w.safetensors");
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->Find("wte.weight")->shape, (std::vector<int64_t>{30, 8}));  // V rows, not Vp
  EXPECT_EQ(f->Find("h.1.attn.c_attn.weight")->shape, (std::vector<int64_t>{8, 24}));
  EXPECT_EQ(f->Find("h.0.mlp.c_proj.weight")->shape, (std::vector<int64_t>{32, 8}));
  EXPECT_NE(f->Find("ln_f.bias"), nullptr);
  // Conv1D (in, out): element [i][o] of c_fc is the model's fcw[o][i].
  const NamedTensor* fc = f->Find("h.0.mlp.c_fc.weight");
  EXPECT_EQ(fc->data[3 * 32 + 5], m->param_tensors().fcw[5 * 8 + 3]);
  // Loading with the transformer. prefix and attn.bias buffers (GPT2LMHeadModel files).
  std::vector<NamedTensor> hf;
  for (NamedTensor t : f->tensors) {
    t.name = "transformer." + t.name;
    hf.push_back(t);
  }
  hf.push_back({"transformer.h.0.attn.bias", {1, 1, 8, 8}, std::vector<float>(64, 1.0f)});
  hf.push_back({"lm_head.weight", {30, 8}, std::vector<float>(240, 0.0f)});
  ASSERT_TRUE(WriteSafetensorsAtomically(dir_ + "/hf.safetensors", hf, {}).ok());
  auto other = Model(2);
  ASSERT_TRUE(LoadStageWeights(dir_ + "/hf.safetensors", *other).ok());
  EXPECT_TRUE(std::equal(m->params(), m->params() + m->num_params(), other->params()));
  // A file for another shape is a clear error.
  GPT2Config bigger = Tiny();
  bigger.n_embd = 16;
  auto wrong = GPT2Stage::Create(bigger, {});
  auto s = LoadStageWeights(dir_ + "/w.safetensors", **wrong);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("another model shape"), std::string::npos) << s;
}

TEST_F(CheckpointTest, RoundTripAndCorruption) {
  auto m = Model(3);
  AdamW adam(m->num_params(), m->segments(), {});
  std::fill(m->grads(), m->grads() + m->num_params(), 0.01f);
  // Padded vocabulary rows never get a gradient in training (and are not saved).
  std::fill(m->grad_tensors().wte + 30 * 8, m->grad_tensors().wte + 128 * 8, 0.0f);
  adam.Step(m->params(), m->grads(), 1e-3f, 1.0f);
  ASSERT_TRUE(SaveCheckpoint(dir_, 1, *m, adam, DataPosition{.shard = 2, .offset = 99, .epoch = 1}).ok());
  auto restored = Model(4);
  AdamW adam2(restored->num_params(), restored->segments(), {});
  auto info = LoadCheckpoint(dir_, *restored, adam2);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->step, 1);
  EXPECT_EQ(info->data_position.offset, 99);
  EXPECT_EQ(info->data_position.shard, 2);
  EXPECT_EQ(adam2.step(), 1);
  EXPECT_TRUE(std::equal(m->params(), m->params() + m->num_params(), restored->params()));
  std::vector<float> m1, v1, m2, v2;
  ASSERT_TRUE(adam.CopyMomentsToHost(&m1, &v1).ok());
  ASSERT_TRUE(adam2.CopyMomentsToHost(&m2, &v2).ok());
  EXPECT_EQ(m1, m2);
  EXPECT_EQ(v1, v2);
  // Flip one byte of the weights: the CRC check refuses it.
  const std::string path = dir_ + "/step_00000001/model.safetensors";
  std::string bytes = *ReadFileToString(path);
  bytes[bytes.size() - 5] ^= 0x40;
  ASSERT_TRUE(WriteFileAtomically(path, bytes).ok());
  auto bad = LoadCheckpoint(dir_, *restored, adam2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("corrupt"), std::string::npos) << bad.status();
  EXPECT_EQ(LoadCheckpoint(dir_ + "/nothing", *restored, adam2).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace geotrain::model

namespace geotrain::model {
namespace {

// A checkpoint whose weights span several files gets HF's sharded index, so that from_pretrained(step_dir) finds
// every tensor: {"metadata": {}, "weight_map": {tensor: file}}, names escaped as JSON requires.
TEST_F(CheckpointTest, SeveralModelFilesGetTheHfIndex) {
  CheckpointManifest manifest;
  manifest.set_step(3);
  (*manifest.mutable_tensors())["h.0.attn.c_attn.weight"] = "model-s0.safetensors";
  (*manifest.mutable_tensors())["h.1.mlp.c_fc.weight"] = "model-s1.safetensors";
  (*manifest.mutable_tensors())["odd \"name\""] = "model-s1.safetensors";
  std::filesystem::create_directories(StepDirectory(dir_, 3));
  ASSERT_TRUE(CommitCheckpoint(dir_, manifest).ok());
  absl::StatusOr<std::string> text = ReadFileToString(StepDirectory(dir_, 3) + "/model.safetensors.index.json");
  ASSERT_TRUE(text.ok()) << text.status();
  const Json index = Json::parse(*text);
  EXPECT_TRUE(index["metadata"].is_object());
  EXPECT_EQ(index["weight_map"].size(), 3u);
  EXPECT_EQ(index["weight_map"]["h.0.attn.c_attn.weight"], "model-s0.safetensors");
  EXPECT_EQ(index["weight_map"]["odd \"name\""], "model-s1.safetensors");
}

}  // namespace
}  // namespace geotrain::model
