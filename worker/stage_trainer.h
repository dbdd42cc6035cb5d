// The training of one stage actor: its stage of the model (model::GPT2Stage) on its device, AdamW, its
// replica's data, and one optimizer step at a time in lock-step with the job's other actors.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<StageTrainer> trainer,
//                    StageTrainer::Create(spec, ranks, actors, &factory, "cpu", /*device_index=*/0));
//   for (int64_t step = 1; step <= steps; ++step) {
//     ASSIGN_OR_RETURN(StepFigures figures, trainer->Step(step, stop_flag));
//   }
//
// A step:
//   1. the pipeline: the schedule's forwards and backwards (common/pipeline_schedule.h). Activations come
//      from the previous stage and go to the next over the pipeline communicator; their gradients go back.
//      Sends run on background threads (worker/async_sender.h), so a stage computes while the previous
//      microbatch crosses a slow link; a pipeline deeper than pp keeps several sends in flight. A stage keeps the activations of one microbatch, so a backward whose
//      microbatch is not the latest forward first recomputes that forward from the input it kept
//      (activation recomputation: exact, at the cost of one extra forward);
//   2. data parallelism: during the last microbatch's backward each block's gradients go into all-reduce
//      buckets (comm::GradientBuckets) that start while backward goes on; the embeddings and final LayerNorm
//      go last, after the tied-embedding sum (on gRPC one all-reduce over every replica's first- and
//      last-stage copy of wte, which the buckets then leave out; with NCCL each replica's pair, and wte
//      goes with the buckets). With tensor parallelism and data parallelism across sites on gRPC each tp rank
//      sums only its slice of the replicated tensors, then gathers the other ranks' slices inside its site
//      (GatherReplicated: StageCollectives::split_replicated);
//   3. the global gradient norm over the replica's stages and ranks (exact), clipping and the AdamW step:
//      every replica takes the same step;
//   4. the job's loss: the mean over replicas of each replica's mean (loss carriers: last stage, tp rank 0);
//   5. DiLoCo (the spec's diloco block on): the all-reduce of step 2 stays inside this actor's group (the
//      replicas whose first stage shares its site), and at the schedule's sync points the groups' pseudo-
//      gradients are averaged across sites and the outer optimizer steps (model/diloco.h: the same
//      algorithm as `train --local`'s simulation). With fragments > 1 a fragment's exchange runs on a
//      background thread during the next step. Each replica's loss goes to the head, which averages;
//   6. validation, every train.eval_every steps and at the last: the replica's rows of eval_batches global
//      batches of data.val, a microbatch per forward pass through the pipeline; the carrier's mean goes to the
//      head, which averages over replicas. The tokens are the same for every plan and for `train --local`.
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
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "common/pipeline_schedule.h"
#include "model/backend.h"
#include "model/config.h"
#include "model/data.h"
#include "model/diloco.h"
#include "model/gpt2.h"
#include "model/optimizer.h"
#include "worker/actor_ranks.h"
#include "worker/async_sender.h"
#include "worker/stage_collectives.h"

namespace geotrain::worker {

// Where a stage's token shards come from, given the spec's data pattern (paths on the head's machine): the worker
// stages them from the head (worker/job_staging.h). Null, or `data: {local: true}`, reads the paths as they are.
using DataSourceFn = std::function<absl::StatusOr<model::ShardSource>(const std::string& pattern)>;

// The precision a stage trains in: the spec's (the head resolves auto by the job's devices); auto or unset, as an
// actor started without a head may get it, is bf16 on a CUDA device (or timed compute's emulated GPU) and fp32 on
// the CPU.
absl::StatusOr<model::Precision> StagePrecision(const JobSpec& spec, const std::string& device);

// `train --local`'s model::LocalTrainOptions::outer_codec for `spec`: the rounding that its cluster run's outer
// all-reduce (ExchangeOuter, through diloco.codec) gives each group's pseudo-gradient, with the error feedback of
// top-k, int4 and sparse kept per group and fragment (as the leaders' communicator keeps it per fragment's tag). Null when that exchange is exact (codec none, or no diloco block). Errors: an unknown
// codec, named as ParseCodec names it.
absl::StatusOr<std::function<absl::Status(int group, int fragment, absl::Span<float> operand)>> SimulatedOuterCodec(
    const JobSpec& spec);

class StageTrainer {
 public:
  // Makes the device backend (`device`: "cpu", "cuda:N" or "timed:..." for timed compute), the collectives (through `factory`, which must
  // outlive the trainer), the stage with freshly initialised weights (train.seed), AdamW, the data loader
  // (first and last stage, over `data`'s shards) and every buffer and bucket the steps need. Errors name what failed.
  static absl::StatusOr<std::unique_ptr<StageTrainer>> Create(const JobSpec& spec, const ActorRanks& ranks,
                                                              const std::vector<ActorPeer>& actors,
                                                              CollectivesFactory* factory, const std::string& device,
                                                              int device_index, const DataSourceFn& data = nullptr);
  ~StageTrainer();
  StageTrainer(const StageTrainer&) = delete;
  StageTrainer& operator=(const StageTrainer&) = delete;

  // One optimizer step; `step` is 1-based (it sets the learning rate). CANCELLED when `stop` was set. Returns this
  // actor's figures of the step (control.proto's StepFigures, as the actor reports them): step, tokens, loss on the
  // loss carrier, validation loss of its slice on evaluated steps (else < 0), compute, communication-wait and bubble
  // times, WAN bytes by site pair and their compression ratio, fp16's loss scale and skip. The step, checkpoint and
  // timed-compute fields are the actor's to set.
  absl::StatusOr<StepFigures> Step(int64_t step, const std::atomic<bool>& stop);
  // Whether this actor's loss is one the head averages into the job's: the last stage's tensor rank 0 of the lowest
  // replica present (the present replicas' mean, all-reduced), or of every replica with DiLoCo (each replica's own).
  bool carries_loss() const;

  // Live regroups (head/job_regroup.h). The newest step whose optimizer update this stage applied (0: none; the
  // step resumed after, on a resume): a step that failed before its update changed no weight and no optimizer state.
  int64_t completed_step() const { return completed_step_; }
  // Whether the job's collectives can be rebuilt for fewer replicas while the stages keep their state: synchronous
  // (no DiLoCo), no tensor parallelism, and every group on gRPC (NCCL's communicators are not rebuilt).
  bool regroupable() const;
  // Ends the collectives of the membership it had (after a failed step: their receives cancelled, the sender and
  // the buckets' threads joined) and builds them for `ranks` (the same actor, another membership) through `factory`.
  // The data of a step that did not complete is read again by the next Step. Weights and optimizer state stay.
  absl::Status Regroup(const ActorRanks& ranks, const std::vector<ActorPeer>& actors, CollectivesFactory* factory,
                       int device_index);
  // Where a resume sets the step counter: `step` completed.
  void set_completed_step(int64_t step) { completed_step_ = step; }
  // Heals (head/job_heal.h), after Regroup to the membership the healed replicas join: the donor (the lowest replica
  // that stays) sends this stage's whole training state to the same stage of each joining replica, which receives
  // it: the weights, AdamW's moments and step, fp16's loss scale, the completed step and the data position. Over the
  // data-parallel group's exact communicator (StageCollectives::dp_scalars), lossless whatever the codecs, so that
  // the copies are bit-identical. Returns the bytes sent or received. A joiner's state is checked (its model's size,
  // the scale) before any of it is used.
  absl::StatusOr<uint64_t> SendState(const std::vector<int>& joining);
  absl::StatusOr<uint64_t> ReceiveState(int donor);
  // The figures of `step` as far as it went: for a step whose update applied before something after it (validation)
  // failed on a peer, so that it is reported all the same (without a validation loss).
  StepFigures FiguresSoFar(int64_t step) const { return Figures(step); }

  model::GPT2Stage& stage() { return *stage_; }
  model::AdamW& optimizer() { return *adam_; }
  model::DataLoader* loader() { return loader_.get(); }    // null on middle stages
  model::OuterOptimizer* outer() { return outer_.get(); }  // DiLoCo's outer state; null when synchronous
  const ActorRanks& ranks() const { return ranks_; }
  const StageCollectives& collectives() const { return *collectives_; }  // its DiLoCo group, among others
  // One line for the actor's log: parameters, layers, device, how gradients are all-reduced.
  std::string Describe() const;
  // Slows this CPU stage by `factor` (>= 1; the worker's --slowdown): after each compute op it waits (factor - 1)
  // times the op's time, and its figures say the times are emulated (StepFigures.slowdown). Before the first Step.
  void set_slowdown(double factor) { slowdown_ = factor > 1 ? factor : 1; }
  // Whether the stage runs on timed compute (device "timed:...", model/timed_backend.h): its times are an
  // emulated GPU's, its loss and gradient norm are not real, and it has no weights to checkpoint.
  bool timed() const { return timed_; }

 private:
  StageTrainer(const JobSpec& spec, ActorRanks ranks);
  absl::Status Initialize(const std::vector<ActorPeer>& actors, CollectivesFactory* factory, const std::string& device,
                          int device_index, const DataSourceFn& data);
  // Initialize's phases, in order. The backend for `device` (timed_, on_device_); returns the stage's precision.
  absl::StatusOr<model::Precision> OpenDevice(const std::string& device);
  // The stage (fresh weights from train.seed, not on timed compute), AdamW and the learning rate schedule.
  absl::Status CreateStage(model::Precision precision);
  // The loaders of data.train and data.val (first and last stage), through `data` unless the data is local.
  absl::Status OpenData(const DataSourceFn& data);
  // The step's batch, activation and gradient buffers (on a device, their host mirrors) and the pipeline schedule.
  absl::Status AllocateStepBuffers();
  // The data-parallel gradient buckets of `bucket_bytes` each (when there is a data-parallel all-reduce).
  absl::Status CreateGradientBuckets(double bucket_bytes);
  // split_replicated: the gathered spans' packed length and the gather's buffers, a bucket's size at a time.
  void PrepareReplicatedGather(double bucket_bytes);
  // DiLoCo: the outer optimizer over the stage's fragments, from the initial weights.
  absl::Status CreateOuterOptimizer();
  // The pipeline's background sender.
  void StartSender();
  absl::Status Forward(int m, bool recompute);
  absl::Status Backward(int m);
  absl::Status SynchronizeGradients(SiteTraffic* traffic, uint64_t dp_bytes_before);
  // One inner step of `step`: the batch, the pipeline, the gradients' sum and the optimizer step. Returns the
  // replica's mean loss on the loss carrier (0 elsewhere).
  absl::StatusOr<double> InnerStep(int64_t step, const std::atomic<bool>& stop);
  // diloco.sync time (null pacing_: count-paced, one inner step a step). PacedInnerSteps: the inner steps this actor's
  // group takes in `step`, starting an unplanned period when `step` opens one; InnerStepsOf: any group's; PaceStep: the
  // job's tokens in `step` (every group's inner steps; before the period's outer step plans the next) and the period's
  // counts; GatherPace: the groups' median inner-step times and replica counts from every actor (their arrival: the
  // step's outer_sync_seconds); PlanPacing: the plan from step `from` to the period's end; PaceWarmUp: after the
  // second step of an unplanned period, a plan for the rest of it; PaceOuterStep: at a period's end, before its outer
  // exchange, this period's outer weight by tokens and the next period's plan.
  int PacedInnerSteps(int64_t step);
  int InnerStepsOf(int group, int64_t step) const;
  int64_t PaceStep(int64_t step);
  absl::StatusOr<std::vector<double>> GatherPace();
  void PlanPacing(int64_t from, int64_t step, const std::vector<double>& seconds);
  absl::Status PaceWarmUp(int64_t step);
  absl::Status PaceOuterStep(int64_t step);
  // Validation of this replica's slice of data.val: stats_.val_loss on the carrier.
  absl::Status Evaluate(const std::atomic<bool>& stop);
  // The step's figures from stats_.
  StepFigures Figures(int64_t step) const;
  // DiLoCo: the outer exchanges the schedule starts at the beginning of `step` (on a background thread),
  // and at its end those finished and applied, then the blocking ones.
  absl::Status StartOuterExchanges(int64_t step);
  absl::Status FinishOuterExchanges(int64_t step);
  // The averaged pseudo-gradient of fragment f (in place): a sum over the group leaders, handed to the group (with
  // tp > 1 the replicated tensors' part from tp rank 0). *exchanged: the floats this actor put through it.
  absl::Status ExchangeOuter(int f, std::vector<float>* delta, size_t* exchanged);
  // The stage's parameters in host memory (itself on the CPU, a copy on a device), and back after a change.
  absl::StatusOr<float*> HostParams();
  absl::Status ParamsToDevice();
  // The host span standing for a span of the stage's gradients: itself on the CPU, its place in the host
  // mirror on a device.
  absl::Span<float> HostView(absl::Span<float> grads);
  // The gradient of the stage's wte copy (first or last stage; backend memory).
  absl::Span<float> WteGradient();
  // Counts `encoded` bytes an all-reduce of a `tensor_bytes` fp32 tensor sent on `route` (across sites or not).
  void AddAllReduceTraffic(SiteTraffic* traffic, const AllReduceRoute& route, uint64_t encoded,
                           double tensor_bytes) const;
  absl::Status CopyOut(const std::vector<absl::Span<float>>& spans);
  // StageCollectives::split_replicated: after the data-parallel and tied sums of this rank's slices, the other tp
  // ranks' slices of every replicated tensor, so that each rank holds the whole sums.
  absl::Status GatherReplicated();

  const JobSpec spec_;
  ActorRanks ranks_;            // its membership changes with Regroup (same thread)
  double bucket_bytes_ = 0;     // comm.grad_bucket_mb in bytes
  int64_t completed_step_ = 0;  // completed_step()
  // The train loader's position before the batch of step loaded_step_: a regroup reads that batch again when the
  // step did not complete.
  model::DataPosition step_start_position_;
  int64_t loaded_step_ = 0;
  GPT2Config config_;
  std::unique_ptr<model::Backend> device_backend_;
  model::Backend* backend_ = nullptr;
  bool on_device_ = false;
  bool timed_ = false;
  double slowdown_ = 1;                                      // set_slowdown
  std::unique_ptr<comm::BucketMemory> timed_bucket_memory_;  // timed compute: the buckets' memory
  std::unique_ptr<StageCollectives> collectives_;
  std::unique_ptr<model::GPT2Stage> stage_;
  std::unique_ptr<model::AdamW> adam_;
  model::LearningRateSchedule schedule_;
  std::unique_ptr<model::DataLoader> loader_;
  std::vector<PipelineOp> pipeline_;
  int num_layers_ = 0;
  size_t activation_floats_ = 0;  // one microbatch's activations at a stage boundary
  float loss_scale_ = 1;          // of the loss gradient over the microbatches and replicas (fp16's scale comes on top)
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
  // The gradients outside the blocks that the buckets sum (device spans): the stage's embeddings and final
  // LayerNorm, less wte when the tied all-reduce sums every replica's copy (StageCollectives::tied_over_replicas).
  std::vector<absl::Span<float>> dp_non_layer_spans_;
  // split_replicated: the replicated tensors' spans (host view) this rank summed a slice of, in the same order on
  // every tp rank; the length of the longest rank's slices packed in that order, and the gather's buffers for one
  // chunk of them (this rank's, and every rank's).
  std::vector<absl::Span<float>> tp_gathered_;
  size_t tp_gather_packed_ = 0;
  std::vector<float> tp_gather_send_, tp_gather_recv_;
  std::unique_ptr<AsyncSender> sender_;
  // Validation (first and last stage): the replica's slice of data.val, a microbatch at a time.
  std::unique_ptr<model::DataLoader> val_loader_;
  std::vector<int32_t> val_inputs_, val_targets_;
  // DiLoCo.
  std::unique_ptr<model::OuterOptimizer> outer_;
  model::DilocoSchedule outer_schedule_;
  std::vector<float> host_params_;  // on a device: the parameters' host copy for the outer step
  // tp > 1: per fragment, the packed positions of its replicated tensors' elements and of the rest.
  std::vector<model::ReplicatedSplit> outer_split_;
  struct OuterExchange {
    int fragment = 0;
    std::vector<float> delta, snapshot;  // packed; snapshot: the parameters when the exchange started
    size_t exchanged = 0;
    absl::Status status;
    std::thread thread;
  };
  std::vector<std::unique_ptr<OuterExchange>> outer_in_flight_;
  // This group's weight in the outer average: its share of the batch (StageCollectives::outer_weight), or
  // time-paced, its share of the tokens the period trained.
  float outer_weight_ = 1;
  // diloco.sync time (model::PlanPacedPeriod). The period the fields are of (0: none yet) and the first step this run
  // trained in it; the plan (0: none, one inner step a step): its first step, its length (to the period's end) and each
  // group's inner steps over it; each group's inner steps over the period so far, and its replicas (from the first
  // gathering on); the seconds of this actor's inner steps since the last gathering, one each.
  struct Pacing {
    int64_t period_start = 0, first_step = 0;
    int64_t plan_from = 0;
    int plan_length = 0;
    std::vector<int> planned;
    std::vector<int> counts;
    std::vector<float> group_replicas;
    std::vector<double> seconds;
  };
  std::unique_ptr<Pacing> pacing_;
  uint64_t outer_bytes_counted_ = 0;  // the outer client's bytes already in a step's traffic
  // Per step.
  // What the step measures as it runs (Step turns it into the step's StepFigures).
  struct StepStats {
    double loss = 0;             // the job's loss, on the loss carrier (last stage, tp rank 0)
    double val_loss = -1;        // validation loss of this replica's slice (carrier, evaluated steps); else < 0
    double compute_seconds = 0;  // forward, backward, optimizer
    double wait_seconds = 0;     // blocked on peers: activations, gradients, all-reduces
    double bubble_seconds = 0;   // waiting for the pipeline to fill
    SiteTraffic traffic;         // bytes this actor sent across sites in the step
    // fp16: the loss scale this step's gradients carried, and whether it was skipped (they overflowed somewhere in
    // the job, or in its DiLoCo group: every actor decides the same from the all-reduced gradient norm).
    double loss_scale = 1;
    bool skipped = false;
    int inner_steps = 1;            // the inner steps the step took (diloco.sync time: more than one when fast)
    int64_t tokens = 0;             // the job's tokens in the step, every group's
    double outer_sync_seconds = 0;  // blocked at the outer sync (time-paced: waiting for the other groups)
  };
  StepStats stats_;
  double loss_sum_ = 0;
  int latest_forward_ = -1;
  bool first_op_ = true;
};

}  // namespace geotrain::worker
