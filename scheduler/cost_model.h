// The planner's cost model, which is also a step-time simulator: given a cluster (cluster.h), a
// model's layer costs, a job and a plan (DP x PP x TP degrees, stage slicing, placement of every
// (replica, stage, tp_rank) on a device, microbatch size and schedule, codec per cross-site link),
// it predicts the step time, its parts (pipeline, exposed gradient all-reduce, tied-embedding
// sync), the bubble, the memory of every device and the bytes each cross-site link carries per
// step. The formulas are in docs/planner.md.
//
//   ModelCosts model = ModelCosts::FromConfig(*GPT2Config::FromPreset("gpt2-medium"),
//   /*seq_len=*/1024); JobOptions job;  job.global_batch = 64;  job.seq_len = 1024; Prediction p =
//   Simulate(cluster, model, job, plan); if (!p.fits) std::cout << p.reject_reason;
//
// The pipeline is simulated event by event (each stage runs its schedule's list of forward and
// backward microbatch ops; a boundary transfer occupies its link for bytes / bandwidth and arrives
// one latency later), so unequal stages and slow links show up as they would in a run. Everything
// else is closed-form.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/codec_spec.h"
#include "model/config.h"
#include "scheduler/cluster.h"

namespace geotrain::scheduler {

// One slice unit of the model for stage slicing: the embedding, each transformer block, the head.
struct LayerCost {
  std::string name;
  double forward_flops = 0;           // per sequence of seq_len tokens; backward costs 2x
  double parameters = 0;              // parameters held (the head's tied wte copy is added by Simulate)
  double replicated_parameters = 0;   // of those, the ones whole on every tp rank (embeddings, LayerNorms, biases)
  double activation_bytes = 0;        // per sequence, kept from forward for backward
  double output_bytes = 0;            // per sequence, sent to the next stage if a boundary follows
  bool tensor_parallel_comm = false;  // a block: 2 all-reduces forward and 2 backward under TP
};

struct ModelCosts {
  std::vector<LayerCost> layers;  // [embedding, block 0 .. block L-1, head]
  int seq_len = 0;
  int n_embd = 0;
  int n_head = 0;                // tensor parallelism splits heads: tp must divide it
  double tied_parameters = 0;    // wte (Vp x C): held by the first and the last stage when pp > 1
  double bytes_per_element = 4;  // fp32 activations, gradients and master weights

  static ModelCosts FromConfig(const GPT2Config& config, int seq_len);
  int num_layers() const { return static_cast<int>(layers.size()); }
  double TotalForwardFlops() const;
};

// A gradient/activation codec on cross-site links: wire bytes = ratio x raw bytes; encoding and
// decoding cost raw bytes / throughput each, the encoding overlapped with the wire. Lossy codecs (int8,
// top-k) are used for gradients only.
struct Codec {
  std::string name;
  double ratio = 1;
  double throughput_bytes_per_s = 0;  // 0: free (no codec)
  bool for_activations = true;        // whether ChooseCodec may pick it for activations (the lossy ones: no)
  // The runtime never sends activations in it (CodecSpec::gradients_only: top-k, int4, sparse); int8 it does.
  bool gradients_only = false;
  // It refuses fp16's infinities (CodecSpec::finite_only: int8 and the gradients-only ones).
  bool finite_only = false;
  // Seconds per raw byte sent over `link`: max(ratio / bandwidth, 1 / throughput) + 1 / throughput (the sender
  // encodes chunk k + 1 while chunk k is on the wire; the receiver decodes the whole tensor).
  double SecondsPerByte(const LinkSpec& link) const;
};
// The cost of a codec name as the runtime parses it (ParseCodecSpec, common/codec_spec.h): none (ratio 1),
// fp16 and bf16 (0.5), int8 (0.25 and a scale per 256 values), topk:F (2F: a value and an index per kept
// element), int4 and sparse:F:B (the runtime's own byte count, CodecRawPayloadBytes: int4 0.1406, sparse:0.02:2
// 0.0090); "+zstd" multiplies the ratio by 0.9 and caps the throughput at 1 GB/s. Errors: the parser's.
absl::StatusOr<Codec> ParseCodec(const std::string& name);

inline constexpr std::string_view kFp32EfficiencySuffix = "@fp32";

enum class Schedule { k1F1B, kGPipe };
const char* ScheduleName(Schedule schedule);

struct JobOptions {
  int global_batch = 0;  // sequences per optimizer step
  int seq_len = 0;
  std::vector<Codec> codecs;          // allowed on cross-site links; empty: none only
  double memory_headroom = 0.10;      // fraction of each device's memory kept free
  double fixed_memory_bytes = 1.0e9;  // runtime context, workspace, allocator slack per device
  double efficiency = 0.40;           // achieved / peak FLOP/s (MFU) for devices not in efficiency_by_device
  // Device name -> MFU, calibrated from runs. NAME@fp32 (kFp32EfficiencySuffix): NAME's when the plan trains in fp32
  // (on the CUDA cores, where less of the step is bound by memory than on the tensor cores); absent, NAME's.
  std::map<std::string, double> efficiency_by_device;
  double optimizer_bytes_per_parameter = 8;  // Adam: two fp32 moments
  // Fixed cost per layer and microbatch (kernel launches, framework): forward pays it once,
  // backward twice. It is what makes many tiny microbatches slower than fewer larger ones;
  // calibrate it with the efficiency.
  double layer_overhead_s = 30e-6;
  // Fixed cost per optimizer step on top of the schedule (optimizer, data loading, step reports,
  // the step barrier): 0 unless calibrated from a profiling run.
  double step_overhead_s = 0;
  // How the step ends. false (the default): gradient all-reduces overlap the last microbatch's
  // backward (bucketed), the tied wte exchange runs beside them. true: the step end as geotrain's
  // runtime (worker/stage_actor.cc) was validated with: after the schedule, one after the other, the
  // tied wte all-reduce (each replica's first and last stage, or with gRPC every copy), the gradient all-reduce, the
  // gradient-norm all-reduce among the replica's stages and the loss all-reduce among replicas. The
  // runtime now starts its gradient buckets during the last microbatch's backward; on the validation's
  // 2 cores that gained nothing (docs/benchmarks.md), so the sequential model still fits it there. It
  // does not model NCCL inside a site.
  bool sequential_sync = false;
  // Round trips one message costs with sequential_sync (the runtime's send returns once the peer
  // holds the tensor): a point-to-point send keeps its sender busy for bytes / bandwidth + 2 r
  // latency and arrives after bytes / bandwidth + (2 r - 1) latency; each ring step of an
  // all-reduce takes its chunk's time + 2 r latency. 1 by design; HTTP/2 flow control on large
  // messages makes it more (calibrate it from a profiling run).
  double message_round_trips = 1;
  // ... plus one round trip per message_window_bytes of the message's wire bytes (a flow-control
  // window: at most that many bytes in flight per round trip). 0: no window.
  double message_window_bytes = 0;
  // With sequential_sync: the runtime's gradient buckets (comm.grad_bucket_mb, comm::GradientBuckets). Each
  // bucket is its own all-reduce, one after another on one thread, so each pays its ring's round trips: across
  // a link of 103 ms round trip, GPT-2 medium's 25 buckets over a ring of 4 wait 25 x 6 round trips, 15 s per
  // step. Bytes (fp32), 25 MiB by default as in the runtime.
  double grad_bucket_bytes = 25.0 * (1 << 20);
  // Devices that share one host (the CPU workers of an emulated cluster on one machine) slow each
  // other down: with n devices in use, every device's efficiency is multiplied by
  // shared_host_scale[n] (absent: 1). Calibrated by running devices alone and together.
  std::map<int, double> shared_host_scale;
  // Every site's traffic inside the site goes through one host (a cluster emulated on one machine, as timed
  // compute runs it: collectives inside a site are gRPC on loopback, all sites sharing the host's cores). The
  // bandwidth inside a site is then what each of two ranks gets when they communicate at once (the calibration:
  // DP2 and TP2 inside a site), so the host moves at most twice that. The sites a plan uses divide it for sends
  // between stages (each site's sends run at the same time as the others'), and a collective, whose members all
  // send at once, gets at most the host's throughput over every rank of the plan: 2 / (dp pp tp) of it. Sends
  // between stages share it too: each gets at most 2 / (dp tp (pp - 1)) of it (one send per boundary at a time).
  // And with more than two ranks, codecs run at 2 / (dp pp tp) of their throughput (the same cores). gRPC's
  // hierarchical all-reduce, its leaders' ring and the tied embedding's pair exchanges share the host by phase
  // instead, among the ranks that take part (internal::CollectiveHost). Off for real clusters, where each site has
  // its own hosts.
  bool sites_share_one_host = false;
  // The bandwidth inside a site for messages of one microbatch's activations (the pipeline's sends between
  // stages, tensor parallelism's all-reduces), over the bandwidth inside a site that gradients and the tied
  // embedding get (hundreds of MB per message). 1 on real links; on one host's loopback a message of a few MB
  // moves at another rate per byte than one of hundreds (docs/results/2026-12-04-pair-exchange.md), so the timed studies
  // calibrate the two apart (bench/geo/timed_lib.py).
  double activation_bandwidth_scale = 1;
  // Collectives run on gRPC (workers that compute on CPU or by timed compute, or a build without NCCL): data
  // parallelism across sites is then gRPC's hierarchical all-reduce when a site holds several of the group's
  // replicas (a gather to the site's leader, the leaders' exchange, copies back), else one ring over the sites'
  // replicas, as the runtime chooses (worker/stage_collectives.cc), and with tensor parallelism each tp rank sums
  // 1/tp of the replicated tensors (split_replicated). false: NCCL's hierarchical all-reduce across sites
  // (worker/collectives.h), each tp rank's group summing all of its replicated tensors.
  bool grpc_collectives = false;
  // The flow-control window of one stream across sites (gRPC's HTTP/2 window as its BDP probing grows it). The
  // runtime sends each tensor on a stream of its own and waits for its ack, so a message starts with the whole
  // window open: its first window goes at the link's rate, the rest at most at window / round trip (twice the
  // link's latency). Applied to each message across sites: the pipeline's sends, the tied exchange's rounds and,
  // with sequential_sync, each gradient bucket's ring messages. 0: no window. Calibrated from a run across a long
  // link (bench/geo/timed_lib.py); inside a site the latency is a per-message cost, not a round trip.
  double wan_window_bytes = 0;
  // The job's train.precision ("", auto, bf16, fp16, fp32) and whether a codec of the job refuses fp16's
  // infinities (model::FiniteOnlyCodec). Simulate resolves auto as the head does (model::AutoPrecision over the
  // plan's oldest GPU), and a plan that trains in fp32 computes at each device's fp32_tflops where it is known: a
  // Turing GPU (no bf16) with an int8 codec trains in fp32, 8x slower than on its tensor cores.
  std::string precision;
  bool finite_only_codec = false;
  // The runtime's rule (PlanningForSpec sets it): every message across sites goes in codecs[0] (comm.wan_codec),
  // whatever the link, activations too unless it is gradients-only (comm::ActivationCodec). false: ChooseCodec picks
  // the cheapest of `codecs` (or none) for each link and kind, as a what-if over codecs.
  bool codec_on_every_link = false;
  double EfficiencyOf(const std::string& device) const;
};

// A plan in the simulator's terms. devices[r][s][k] is the index into Cluster::devices of the
// device holding stage s of replica r, tensor-parallel rank k. Replica r runs microbatches[r]
// microbatches of microbatch_size sequences (replicas may differ in speed and so in share of the
// global batch).
struct Plan {
  int dp = 1, pp = 1, tp = 1;
  int microbatch_size = 1;
  Schedule schedule = Schedule::k1F1B;
  std::vector<int> stage_begin;  // pp + 1 layer indices into ModelCosts::layers: stage s =
                                 // [begin[s], begin[s+1])
  std::vector<std::vector<std::vector<int>>> devices;
  std::vector<int> microbatches;  // per replica
  // 1F1B only: the microbatches in flight at the first stage (common/pipeline_schedule.h). 0: chosen by
  // Simulate with PipelineDepthFor from each replica's slowest boundary (latency and transfer) and slowest
  // stage (forward and backward of a microbatch), the largest over replicas; the runtime chooses the same
  // way on the measured links (head/placement.h). Below pp: pp.
  int pipeline_depth = 0;
  // Codec per ordered site pair for gradients and activations (index into JobOptions::codecs, -1:
  // none). Empty: chosen by ChooseCodec for each link.
  std::vector<std::vector<int>> gradient_codec, activation_codec;
};

struct LinkTraffic {
  int site_a = 0, site_b = 0;  // site_a < site_b
  double bytes = 0;            // per step, both directions, after compression
  double gradient_bytes = 0;
  double activation_bytes = 0;
  std::string gradient_codec, activation_codec;
};

struct Prediction {
  bool fits = true;
  std::string precision;      // what the plan trains in: bf16, fp16 or fp32 (JobOptions::precision resolved)
  std::string reject_reason;  // which device does not fit, with the numbers
  double step_time_s = 0;
  double tokens_per_s = 0;
  double pipeline_time_s = 0;  // forward/backward of all microbatches, slowest replica
  double dp_exposed_s = 0;     // gradient all-reduce not hidden under backward
  double tied_sync_s = 0;      // wte gradient exchange (pp > 1) not hidden under the all-reduce
  double scalar_sync_s = 0;    // gradient-norm and loss all-reduces (sequential_sync only)
  double bubble_fraction = 0;  // idle share of the pipeline time, averaged over stages of the slowest replica
  int pipeline_depth = 1;      // the 1F1B depth simulated (Plan::pipeline_depth, or the one chosen); GPipe: pp
  double compute_bound_s = 0;  // step time if nothing but compute mattered (all devices busy)
  std::vector<double> stage_forward_s, stage_backward_s;  // per microbatch, slowest replica
  std::vector<double> stage_allreduce_s;                  // gradient all-reduce per stage
  std::vector<double> device_memory_bytes;                // per Cluster::devices index; 0: unused
  double max_memory_fraction = 0;                         // max over used devices of memory / usable memory
  std::vector<LinkTraffic> cross_site;
};

// Rounds of messages an all-reduce of `bytes` (fp32, per member) among n members takes: a ring's 2(n-1), or 1
// for two members and at most kPairAllReduceMaxBytes, who exchange their whole tensors at once
// (GrpcCommunicator::PairAllReduce and its kPairMaxElements).
inline constexpr double kPairAllReduceMaxBytes = 32.0 * 1024 * 1024;
int AllReduceRounds(int n, double bytes);

// Seconds of an all-reduce of `bytes` among n members whose slowest hop is `link`:
// 2(n-1)/n bytes / bandwidth + AllReduceRounds(n, bytes) latency.
double RingAllReduceSeconds(double bytes, int n, const LinkSpec& link);

// Event-by-event simulation of one pipeline: per-stage forward/backward seconds per microbatch and
// per boundary (s -> s+1) transfer serialisation seconds and latency. Returns, per stage, when its
// last backward starts and ends, and its busy time; makespan is the end of the last op of any
// stage.
struct PipelineTimeline {
  double makespan = 0;
  std::vector<double> last_backward_start, last_backward_end, busy;
};
// With round_trips (one per boundary, JobOptions::message_round_trips), a send over boundary s holds its link
// direction for its serialisation, arrives (2 r_s - 1) latencies after it and is acknowledged 2 r_s latencies
// after it; each stage sends as the runtime's AsyncSender: one send at a time, or with a 1F1B depth above pp
// up to min(depth, microbatches) - pp + 1 at once while they go to one site; a send to another site waits for
// the acks of those in flight. Empty round_trips: a plain link (busy for the serialisation, arriving one
// latency later). stage_sites (site of each stage; empty: all in one site) says where sends go. stall_s (per
// boundary; empty: none): a message's flow-control stall (JobOptions::wan_window_bytes), which delays its arrival
// and ack but does not hold the link.
PipelineTimeline SimulatePipeline(const std::vector<double>& forward_s, const std::vector<double>& backward_s,
                                  const std::vector<double>& transfer_s, const std::vector<double>& latency_s,
                                  int microbatches, Schedule schedule, const std::vector<double>& round_trips = {},
                                  int depth = 0, const std::vector<int>& stage_sites = {},
                                  const std::vector<double>& stall_s = {});

// The codec (index into job.codecs, -1 for none) that minimises seconds per raw byte on `link`;
// activations only consider codecs with for_activations.
int ChooseCodec(const JobOptions& job, const LinkSpec& link, bool activations);

// The runtime's gradient buckets of layers [begin, end) at a stage of pp, per tp rank, in bytes (fp32), as
// comm::GradientBuckets packs them: the blocks in the order backward finishes them, then the stage's other
// parameters (embeddings, final LayerNorm, the last stage's tied wte copy) as one group; a bucket is closed once
// it holds bucket_bytes, and a group is never split. tied_apart: the first and last stage's wte copies go through
// an all-reduce of their own (gRPC collectives with several replicas), so their buckets leave wte out. A tp rank
// holds 1/tp of the sharded parameters and all of the replicated ones, of which it sums 1/tp with
// split_replicated (gRPC data parallelism across sites: worker/stage_collectives.h) and all of them otherwise.
std::vector<double> GradientBucketBytes(const ModelCosts& model, int begin, int end, int pp, int tp,
                                        double bucket_bytes, bool tied_apart = false, bool split_replicated = false);

// Bytes per parameter of a stage's state: parameters, gradients and optimizer state, plus, with
// data parallelism (dp > 1), the gradient buckets' copy of the gradients (comm::GradientBuckets).
double StateBytesPerParameter(const ModelCosts& model, const JobOptions& job, int dp);

// Memory of one device holding layers [begin, end) at stage `stage` of `pp` with tp ranks in a plan
// of dp replicas, microbatch size b and `microbatches` microbatches: the state
// (StateBytesPerParameter / tp per parameter), activations of the microbatches the schedule holds
// (GPipe: all; 1F1B: min(pp - stage, microbatches)), the boundary buffers, and fixed_memory_bytes.
double StageMemoryBytes(const ModelCosts& model, const JobOptions& job, int begin, int end, int stage, int pp, int tp,
                        int dp, int microbatch_size, int microbatches, Schedule schedule);

// The bytes of a device of `device_bytes` that a stage may use: all but the job's memory_headroom. A stage
// fits when its StageMemoryBytes is at most this (Simulate, and the head's placement).
double UsableMemoryBytes(const JobOptions& job, double device_bytes);

// Simulates `plan`. Checks shapes (an error names what is inconsistent); a plan that does not fit
// in memory comes back with fits = false and the reason, and its times still filled in.
absl::StatusOr<Prediction> Simulate(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                    const Plan& plan);

// Calibration hook for measured runs: given the plan that ran and the measured forward+backward
// compute seconds per microbatch of each stage (replica 0, no communication), returns the
// efficiency (MFU) that makes the model's compute times fit them in the least-squares sense. Feed
// it into JobOptions::efficiency_by_device for the devices of that plan.
absl::StatusOr<double> CalibrateEfficiency(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                           const Plan& plan, const std::vector<double>& measured_stage_compute_s);

}  // namespace geotrain::scheduler
