// The training of one stage actor: its stage of the model (model::GPT2Stage) on its device, AdamW, its
// replica's data, and one optimizer step at a time in lock-step with the job's other actors.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<StageTrainer> trainer,
//                    StageTrainer::Create(spec, ranks, actors, &factory, "cpu", /*device_index=*/0));
//   for (int64_t step = 1; step <= steps; ++step) {
//     ASSIGN_OR_RETURN(StepStats stats, trainer->Step(step, stop_flag));
//   }
//
// A step:
//   1. the pipeline: the schedule's forwards and backwards (worker/pipeline_schedule.h). Activations come
//      from the previous stage and go to the next over the pipeline communicator; their gradients go back.
//      Sends run on a background thread (worker/async_sender.h), so a stage computes while the previous
//      microbatch crosses a slow link. A stage keeps the activations of one microbatch, so a backward whose
//      microbatch is not the latest forward first recomputes that forward from the input it kept
//      (activation recomputation: exact, at the cost of one extra forward);
//   2. data parallelism: during the last microbatch's backward each block's gradients go into all-reduce
//      buckets (comm::GradientBuckets) that start while backward goes on; the embeddings and final LayerNorm
//      go last, after the tied-embedding sum of the first and last stage;
//   3. the global gradient norm over the replica's stages and ranks (exact), clipping and the AdamW step:
//      every replica takes the same step;
//   4. the job's loss: the mean over replicas of each replica's mean (loss carriers: last stage, tp rank 0).
// On a CUDA worker the stage lives on the GPU; activations and gradients bound for other actors cross
// through host buffers.
//
// Thread-safety: one thread drives a trainer (Create, Step, the accessors); Step's `stop` may be set from
// any thread and is polled between schedule operations.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "model/backend.h"
#include "model/config.h"
#include "model/data.h"
#include "model/gpt2.h"
#include "model/optimizer.h"
#include "worker/actor_ranks.h"
#include "worker/async_sender.h"
#include "worker/pipeline_schedule.h"
#include "worker/stage_collectives.h"

namespace geotrain::worker {

// Where a stage's token shards come from, given the spec's data pattern (paths on the head's machine): the worker
// stages them from the head (worker/job_staging.h). Null, or `data: {local: true}`, reads the paths as they are.
using DataSourceFn = std::function<absl::StatusOr<model::ShardSource>(const std::string& pattern)>;

// What one step measured.
struct StepStats {
  double loss = 0;  // the job's loss, on the loss carrier (last stage, tp rank 0)
  bool carries_loss = false;
  double compute_seconds = 0;  // forward, backward, optimizer
  double wait_seconds = 0;     // blocked on peers: activations, gradients, all-reduces
  double bubble_seconds = 0;   // waiting for the pipeline to fill
  SiteTraffic traffic;         // bytes this actor sent across sites in the step
};

class StageTrainer {
 public:
  // Makes the device backend (`device`: "cpu" or "cuda:N"), the collectives (through `factory`, which must
  // outlive the trainer), the stage with freshly initialised weights (train.seed), AdamW, the data loader
  // (first and last stage, over `data`'s shards) and every buffer and bucket the steps need. Errors name what failed.
  static absl::StatusOr<std::unique_ptr<StageTrainer>> Create(const JobSpec& spec, const ActorRanks& ranks,
                                                              const std::vector<ActorPeer>& actors,
                                                              CollectivesFactory* factory, const std::string& device,
                                                              int device_index, const DataSourceFn& data = nullptr);
  ~StageTrainer();
  StageTrainer(const StageTrainer&) = delete;
  StageTrainer& operator=(const StageTrainer&) = delete;

  // One optimizer step; `step` is 1-based (it sets the learning rate). CANCELLED when `stop` was set.
  absl::StatusOr<StepStats> Step(int64_t step, const std::atomic<bool>& stop);

  model::GPT2Stage& stage() { return *stage_; }
  model::AdamW& optimizer() { return *adam_; }
  model::DataLoader* loader() { return loader_.get(); }  // null on middle stages
  const ActorRanks& ranks() const { return ranks_; }
  // One line for the actor's log: parameters, layers, device, how gradients are all-reduced.
  std::string Describe() const;

 private:
  StageTrainer(const JobSpec& spec, ActorRanks ranks);
  absl::Status Initialize(const std::vector<ActorPeer>& actors, CollectivesFactory* factory, const std::string& device,
                          int device_index, const DataSourceFn& data);
  absl::Status Forward(int m, bool recompute);
  absl::Status Backward(int m);
  absl::Status SynchronizeGradients(SiteTraffic* traffic, uint64_t dp_bytes_before);
  // The host span standing for a span of the stage's gradients: itself on the CPU, its place in the host
  // mirror on a device.
  absl::Span<float> HostView(absl::Span<float> grads);
  absl::Status CopyOut(const std::vector<absl::Span<float>>& spans);

  const JobSpec spec_;
  const ActorRanks ranks_;
  GPT2Config config_;
  std::unique_ptr<model::Backend> device_backend_;
  model::Backend* backend_ = nullptr;
  bool on_device_ = false;
  std::unique_ptr<StageCollectives> collectives_;
  std::unique_ptr<model::GPT2Stage> stage_;
  std::unique_ptr<model::AdamW> adam_;
  model::LearningRateSchedule schedule_;
  std::unique_ptr<model::DataLoader> loader_;
  std::vector<PipelineOp> pipeline_;
  int num_layers_ = 0;
  size_t activation_floats_ = 0;  // one microbatch's activations at a stage boundary
  float loss_scale_ = 1;
  // The step's batch (first and last stage), the inputs kept per microbatch (not first stage), the
  // gradient of the output (not last stage).
  std::vector<int32_t> inputs_, targets_;
  std::vector<std::vector<float>> stage_inputs_;
  std::vector<float> doutput_;
  // On a device: activations in and out cross through these host buffers, and so do the gradients of the
  // tied-embedding sum and of a data-parallel all-reduce on gRPC.
  model::DeviceBuffer device_input_, device_doutput_;
  std::vector<float> host_output_, host_dinput_, host_grads_;
  // Whether the data-parallel buckets start during backward (not with NCCL tensor parallelism: two NCCL
  // communicators of one device running at once can deadlock when ranks issue them in different orders).
  bool overlap_dp_ = true;
  std::unique_ptr<comm::GradientBuckets> grad_buckets_;
  std::unique_ptr<AsyncSender> sender_;
  // Per step.
  StepStats stats_;
  double loss_sum_ = 0;
  int latest_forward_ = -1;
  bool first_op_ = true;
};

}  // namespace geotrain::worker
