// GPT-2 model shapes: the presets (gpt2 ... gpt2-xl and small ones for tests and the demo) and the counts
// that the planner and the benchmarks need (parameters, FLOPs per token, activation sizes).
//
//   absl::StatusOr<GPT2Config> config = GPT2Config::FromPreset("gpt2");
//   int64_t n = config->NumParameters();
//
// Dimension names follow llm.c: L layers, NH heads, C channels, T block size, V vocabulary
// (Vp: V padded up to a multiple of 128 for the embedding and head matrices).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace geotrain {

class ModelSpec;  // proto/spec.proto

struct GPT2Config {
  int n_layer = 0;            // L
  int n_head = 0;             // NH
  int n_embd = 0;             // C
  int block_size = 0;         // maximum T
  int vocab_size = 0;         // V
  int padded_vocab_size = 0;  // Vp, a multiple of 128 (>= V)

  // A preset by name: gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-small-test, gpt2-tiny-test, gpt2-demo.
  static absl::StatusOr<GPT2Config> FromPreset(const std::string& name);
  // Preset named in spec.preset (if any) with explicit fields of the spec overriding it; validated.
  static absl::StatusOr<GPT2Config> FromSpec(const ModelSpec& spec);
  static std::vector<std::string> PresetNames();

  // Checks that sizes are positive and n_embd divides by n_head; fills padded_vocab_size.
  absl::Status Validate();

  int64_t BlockParameters() const;      // parameters of one transformer block
  int64_t EmbeddingParameters() const;  // wte (Vp x C) + wpe (T x C)
  int64_t NumParameters() const;        // everything, padded vocabulary included, head tied to wte
  // Training FLOPs per token as llm.c counts them: 6 N + 6 L C T.
  double TrainingFlopsPerToken(int seq_len) const;
  // Forward FLOPs of one block for one sequence of length T (matmuls and attention).
  double BlockForwardFlops(int seq_len) const;
  // Floats of activation kept for backward by one block per token (llm.c's layout).
  int64_t BlockActivationFloatsPerToken(int seq_len) const;
};

// The runtime's pipeline split, the one rule for every place that needs it (model::StageOptions::Split, the
// head's memory check through scheduler::RuntimeStageBegin, the planner's runtime plans): stage `stage` of
// `num_stages` holds blocks [first, last), the blocks split as evenly as possible with the earlier stages
// taking the extra ones; the embedding goes with stage 0 and the head with the last stage. Requires
// 1 <= num_stages and 0 <= stage < num_stages; a stage gets no block when num_stages > n_layer.
struct StageBlocks {
  int first = 0;
  int last = 0;  // exclusive
};
StageBlocks SplitStageBlocks(int n_layer, int stage, int num_stages);

}  // namespace geotrain
