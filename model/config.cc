// GPT-2 presets and the derived counts (parameters, FLOPs, activations).
#include "model/config.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "model/op_costs.h"
#include "spec.pb.h"

namespace geotrain {
namespace {

struct Preset {
  const char* name;
  int n_layer, n_head, n_embd, block_size, vocab_size;
};

constexpr Preset kPresets[] = {
    {"gpt2", 12, 12, 768, 1024, 50257},
    {"gpt2-medium", 24, 16, 1024, 1024, 50257},
    {"gpt2-large", 36, 20, 1280, 1024, 50257},
    {"gpt2-xl", 48, 25, 1600, 1024, 50257},
    // Small shapes with the real GPT-2 vocabulary, for the demo and short runs.
    {"gpt2-demo", 4, 4, 128, 128, 50257},
    {"gpt2-small-test", 2, 4, 64, 128, 50257},
    // A tiny shape with a small vocabulary, for unit and equivalence tests.
    {"gpt2-tiny-test", 2, 2, 32, 32, 512},
};

}  // namespace

absl::StatusOr<GPT2Config> GPT2Config::FromPreset(const std::string& name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) {
      GPT2Config c;
      c.n_layer = p.n_layer;
      c.n_head = p.n_head;
      c.n_embd = p.n_embd;
      c.block_size = p.block_size;
      c.vocab_size = p.vocab_size;
      RETURN_IF_ERROR(c.Validate());
      return c;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown model preset '", name, "'; known presets: ", absl::StrJoin(PresetNames(), ", ")));
}

std::vector<std::string> GPT2Config::PresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.push_back(p.name);
  return names;
}

absl::StatusOr<GPT2Config> GPT2Config::FromSpec(const ModelSpec& spec) {
  GPT2Config c;
  if (!spec.preset().empty()) {
    ASSIGN_OR_RETURN(GPT2Config preset, FromPreset(spec.preset()));
    c = preset;
  }
  if (spec.n_layer() != 0) c.n_layer = spec.n_layer();
  if (spec.n_head() != 0) c.n_head = spec.n_head();
  if (spec.n_embd() != 0) c.n_embd = spec.n_embd();
  if (spec.block_size() != 0) c.block_size = spec.block_size();
  if (spec.vocab_size() != 0) c.vocab_size = spec.vocab_size();
  RETURN_IF_ERROR(c.Validate());
  return c;
}

absl::Status GPT2Config::Validate() {
  if (n_layer <= 0 || n_head <= 0 || n_embd <= 0 || block_size <= 0 || vocab_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: n_layer, n_head, n_embd, block_size and vocab_size must all be positive (got ", n_layer, ", ", n_head,
        ", ", n_embd, ", ", block_size, ", ", vocab_size, "); give a preset or all five sizes"));
  }
  if (n_embd % n_head != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: n_embd (", n_embd, ") must be a multiple of n_head (", n_head, ")"));
  }
  if (vocab_size > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: vocab_size ", vocab_size, " exceeds 65536, the limit of uint16 token shards"));
  }
  padded_vocab_size = (vocab_size + 127) / 128 * 128;
  return absl::OkStatus();
}

int64_t GPT2Config::BlockParameters() const {
  const int64_t C = n_embd;
  // ln_1 (2C) + qkv (3C*C + 3C) + proj (C*C + C) + ln_2 (2C) + fc (4C*C + 4C) + fcproj (4C*C + C)
  return 2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + 4 * C * C + 4 * C + 4 * C * C + C;
}

int64_t GPT2Config::EmbeddingParameters() const {
  return static_cast<int64_t>(padded_vocab_size) * n_embd + static_cast<int64_t>(block_size) * n_embd;
}

int64_t GPT2Config::NumParameters() const {
  return EmbeddingParameters() + n_layer * BlockParameters() + 2 * static_cast<int64_t>(n_embd);
}

double GPT2Config::TrainingFlopsPerToken(int seq_len) const {
  return 6.0 * static_cast<double>(NumParameters()) + 6.0 * n_layer * static_cast<double>(n_embd) * seq_len;
}

double GPT2Config::BlockForwardFlops(int seq_len) const {
  // The forward ops' FLOPs as the timed-compute backend counts them (model/op_costs.h), for one sequence:
  // the four matmuls (qkv, attention projection, MLP up and down) and causal attention.
  const int64_t C = n_embd, T = seq_len;
  return model::MatmulForwardCost(T, C, 3 * C).flops + model::MatmulForwardCost(T, C, C).flops +
         model::MatmulForwardCost(T, C, 4 * C).flops + model::MatmulForwardCost(T, 4 * C, C).flops +
         model::AttentionForwardCost(1, T, C, n_head).flops;
}

int64_t GPT2Config::BlockActivationFloatsPerToken(int seq_len) const {
  const int64_t C = n_embd;
  // ln1, ln1 stats, qkv, atty, attproj, residual2, ln2, ln2 stats, fch, fch_gelu, fcproj, residual3
  // plus the attention probabilities (NH x T per token) llm.c keeps.
  return C + 2 + 3 * C + C + C + C + C + 2 + 4 * C + 4 * C + C + C + static_cast<int64_t>(n_head) * seq_len;
}

StageBlocks SplitStageBlocks(int n_layer, int stage, int num_stages) {
  const int base = n_layer / num_stages, extra = n_layer % num_stages;
  StageBlocks blocks;
  blocks.first = stage * base + std::min(stage, extra);
  blocks.last = blocks.first + base + (stage < extra ? 1 : 0);
  return blocks;
}

}  // namespace geotrain
