// DiLoCo's outer loop, shared by the cluster runtime (worker/outer_sync.h) and the single-process
// simulation (`train --local` with a diloco block, model/trainer.cc), so that both run one algorithm.
//
// Groups of replicas train independently with their inner AdamW. Every inner_steps steps a fragment of the
// model is synchronised: each group's pseudo-gradient delta = theta_outer - theta (the parameters of the last
// outer step minus its own) is averaged over the groups (weighted by their share of the batch), and the outer
// optimizer takes an SGD step with momentum (optionally Nesterov) on theta_outer:
//   v <- mu v + delta;   u <- nesterov ? delta + mu v : v;   theta_outer <- theta_outer - lr u
// after which every group's parameters become theta_outer. With inner_steps 1, lr 1 and mu 0 the outer step
// sets every group to the weighted mean of the groups' parameters.
//
// Fragments (Streaming DiLoCo): the blocks are split into `fragments` contiguous parts (the embeddings go with
// the first, the final LayerNorm with the last); fragment f syncs after steps off_f, off_f + H, ... with
// off_f = (f + 1) H / F. With one fragment the sync is blocking, at the end of the step. With several, the
// exchange of a fragment due after step s starts at the beginning of step s + 1 (from the parameters at the
// end of step s) and is applied at the end of step s + 1, keeping the progress made meanwhile:
//   theta_f <- theta_outer_f + (theta_f - snapshot_f)
// The last step ends with a blocking sync of every fragment, so the final model is the outer model.
// Checkpoints are taken at step ends, where no exchange is in flight: a resumed run starts the exchanges
// due after the step it resumes from again from the same parameters, and so continues exactly.
//
//   DilocoSchedule schedule{.inner_steps = 32, .fragments = 4, .total_steps = 1000};
//   OuterOptimizer outer(FragmentRanges(stage, 4), stage.num_params(), {.lr = 0.7, .momentum = 0.9});
//   outer.Initialize(params);
//   for (int f : schedule.BlockingAfter(step)) { outer.PseudoGradient(f, params, &delta); ...average...;
//                                                outer.Step(f, delta); outer.Apply(f, params, nullptr); }
//
// Thread-safety: an OuterOptimizer is used by one thread at a time.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "model/gpt2.h"

namespace geotrain::model {

struct DilocoSchedule {
  int inner_steps = 1;
  int fragments = 1;
  int64_t total_steps = 0;

  bool overlapped() const { return fragments > 1; }
  // Step after which fragment f syncs first: (f + 1) * inner_steps / fragments.
  int64_t Offset(int fragment) const;
  // The fragments whose sync point follows step `step` (1-based), ascending.
  std::vector<int> DueAfter(int64_t step) const;
  // What step `step` does: exchanges it starts at its beginning (and applies at its end), and the blocking
  // syncs at its end (after those are applied).
  std::vector<int> StartAtBeginning(int64_t step) const;
  std::vector<int> BlockingAfter(int64_t step) const;
  // With one fragment, the outer period that holds `step`: its first step, and its length (inner_steps; the last
  // period ends at total_steps).
  int64_t PeriodStart(int64_t step) const { return (step - 1) / inner_steps * inner_steps + 1; }
  int PeriodLength(int64_t step) const;
};

// diloco.sync time (sites of unequal speed). Outer periods are counted in the job's steps (inner_steps each, as with
// count pacing); in a period of `period_steps` steps a group takes as many inner steps as fit in the time the
// slowest group takes for period_steps, from the groups' median inner-step seconds measured over the previous period:
// the slowest takes period_steps, a group k times as fast floor(k period_steps) (rounded down, so that it never
// makes the slowest wait), at most max_factor times period_steps. Every group takes period_steps when a time is
// unknown (<= 0 or not finite: the first period, or one resumed from a checkpoint).
std::vector<int> PlanPacedPeriod(const std::vector<double>& step_seconds, int period_steps, int max_factor = 8);
// The inner steps a group that takes `inner` over a period of `period_steps` steps takes in the period's step `j`
// (0-based): spread evenly, each at least one when inner >= period_steps; over the period they sum to `inner`.
int PacedInnerSteps(int inner, int period_steps, int j);

// The DiLoCo group of each replica, from the site each replica trains in (the site of its first stage): the
// replicas of one site form a group; groups are numbered in the order of their lowest replica.
std::vector<int> DilocoGroups(const std::vector<std::string>& replica_sites);

// Which fragment a block (global index) belongs to: block * fragments / n_layer.
int FragmentOfBlock(int block, int n_layer, int fragments);

// A piece of the parameter layout: `count` floats at `offset` of params().
struct ParamRange {
  int64_t offset = 0, count = 0;
};
// The parameter ranges of each of `fragments` fragments that `stage` holds (a fragment may be empty on a
// stage). Together they cover the stage's parameters exactly once.
std::vector<std::vector<ParamRange>> FragmentRanges(GPT2Stage& stage, int fragments);

// The elements of `from` at `ranges`, in order, into `out` (resized); and back, from `packed` to `to`.
void PackRanges(const std::vector<ParamRange>& ranges, const float* from, std::vector<float>* out);
void UnpackRanges(const std::vector<ParamRange>& ranges, const float* packed, float* to);

// Where in `ranges` packed (as PackRanges packs them) the elements of `stage`'s replicated tensors lie
// (ParameterSegment::replicated: whole and the same on every tp rank), and where the rest; each ascending.
struct ReplicatedSplit {
  std::vector<ParamRange> replicated, rest;
  int64_t replicated_count = 0;
};
ReplicatedSplit SplitReplicated(const GPT2Stage& stage, const std::vector<ParamRange>& ranges);

struct OuterOptions {
  double lr = 0.7;
  double momentum = 0.9;
  bool nesterov = true;
};

class OuterOptimizer {
 public:
  OuterOptimizer(std::vector<std::vector<ParamRange>> fragments, int64_t num_params, OuterOptions options);

  int num_fragments() const { return static_cast<int>(fragments_.size()); }
  // Floats in fragment f (the packed size of its ranges).
  int64_t FragmentSize(int f) const;
  // theta_outer <- params (host memory, the parameter layout), momentum <- 0.
  void Initialize(const float* params);
  // Packs theta_outer_f - params_f into `delta` (resized to FragmentSize(f)).
  void PseudoGradient(int f, const float* params, std::vector<float>* delta) const;
  // Packs params_f into `out` (resized).
  void Pack(int f, const float* params, std::vector<float>* out) const;
  // One outer step on fragment f from the averaged pseudo-gradient (packed).
  void Step(int f, const float* delta);
  // params_f <- theta_outer_f, plus (params_f - snapshot_f) when `snapshot` (packed, from Pack) is given.
  void Apply(int f, float* params, const float* snapshot) const;

  // The state, in the parameter layout (num_params floats each): for checkpoints.
  std::vector<float>& outer_params() { return outer_; }
  std::vector<float>& momentum() { return momentum_; }

 private:
  std::vector<std::vector<ParamRange>> fragments_;
  OuterOptions options_;
  std::vector<float> outer_, momentum_;
};

}  // namespace geotrain::model
