// Single-process training of a job spec: the reference every distributed run must match.
//
//   absl::StatusOr<JobSpec> spec = LoadJobSpecFile("job.yaml");
//   LocalTrainer trainer;
//   absl::Status s = trainer.Run(*spec, {.resume = true});
//
// One optimizer step takes train.global_batch sequences of train.seq_len tokens (parallel.microbatches
// microbatches, gradients accumulated), in the order DataLoader gives them with one replica; then global
// norm clipping (train.grad_clip; 0 disables), AdamW (train.lr with warm-up and cosine decay to
// train.min_lr, train.weight_decay, beta1/beta2) and, every train.eval_every steps, the mean validation
// loss over train.eval_batches global batches of data.val (the same tokens for every plan). Checkpoints go to checkpoint.dir every
// checkpoint.every_steps steps and at the end (the newest checkpoint.keep kept); a resume (--resume,
// checkpoint.resume: auto, or checkpoint.resume_from: a checkpoint of this or of a cluster run, any plan)
// continues from the newest complete one exactly, skipping corrupt or incomplete newer ones.
#pragma once

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "model/optimizer.h"
#include "model/precision.h"
#include "spec.pb.h"

namespace geotrain::model {

// The AdamW learning rate schedule of a job's (inner) steps: train's, times the inner scale with DiLoCo over
// `diloco_groups` groups (DilocoInnerLrScale). `train --local` and the cluster's stages take it from here.
LearningRateSchedule TrainSchedule(const JobSpec& spec, int diloco_groups);

// The precision a spec trains in: train.precision, with auto (or unset) as fp32. The head resolves auto by the
// job's devices before its actors start (head/precision.h) and hands them the resolved spec; `train --local` runs
// on the CPU, whose native precision is fp32 (ask for bf16 or fp16 to emulate a GPU's).
absl::StatusOr<Precision> SpecPrecision(const JobSpec& spec);
// AdamW's options from a spec (betas, weight decay, and in fp16 the loss scaling of train.loss_scale): one rule
// for `train --local`, the stages and the parity tools.
AdamWOptions TrainOptimizerOptions(const JobSpec& spec, Precision precision);

struct LocalTrainOptions {
  bool resume = false;
  bool progress_bar = false;  // redraw a progress bar (for a TTY)
  FILE* out = stdout;
  int stop_after_step = 0;  // > 0: return after this step (still counting train.steps for the schedule)
  // DiLoCo: turns group g's weighted pseudo-gradient of fragment f into what the cluster's outer all-reduce adds
  // for it (diloco.codec's rounding, comm::CodecRoundTrip), before the groups' sum: exactly the cluster's sum with
  // two groups, pp = tp = 1 and fragments up to 8 M elements (its leaders' pair exchange), an approximation
  // otherwise (docs/diloco.md). Null: the exchange is exact. model/ does not depend on comm/: the CLI (`train
  // --local`) and the tests pass it.
  std::function<absl::Status(int group, int fragment, absl::Span<float> operand)> outer_codec;
  // A synchronous job that went on without some replicas (a live regroup, head/job_regroup.h): from step
  // `replicas_from_step` (1-based; 0: never) on, only `replicas` train: each update is the mean over their rows of the
  // global batch, the loss is theirs, and validation evaluates their rows.
  int replicas_from_step = 0;
  std::vector<int> replicas;
  // And healed (head/job_heal.h): from step `healed_from_step` (after replicas_from_step; 0: never) on, every replica
  // trains again.
  int healed_from_step = 0;
};

struct StepRecord {
  int step = 0;
  float loss = 0.0f;
  float val_loss = -1.0f;  // < 0 when not evaluated at this step
  double lr = 0.0, grad_norm = 0.0, tokens_per_second = 0.0;
  // fp16: the loss scale the step's gradients carried, and whether the step was skipped (they overflowed; group 0's
  // with DiLoCo, each group deciding for itself).
  double loss_scale = 1;
  bool skipped = false;
};

class LocalTrainer {
 public:
  absl::Status Run(const JobSpec& spec, const LocalTrainOptions& options);
  const std::vector<StepRecord>& history() const { return history_; }

 private:
  std::vector<StepRecord> history_;
};

}  // namespace geotrain::model
