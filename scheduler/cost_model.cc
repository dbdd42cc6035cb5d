// The planner's cost model (see cost_model.h and docs/planner.md for the formulas): the model's layer costs,
// codecs, the pipeline's event-by-event simulation, the data-parallel all-reduce, memory and calibration. The
// step simulation that puts them together (Simulate) is in cost_model_simulate.cc.
#include "scheduler/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/pipeline_schedule.h"
#include "common/status.h"
#include "model/op_costs.h"
#include "scheduler/cost_model_internal.h"

namespace geotrain::scheduler {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// What `+zstd` does to a codec in the model: wire bytes x kZstdRatio, at most kZstdThroughput.
constexpr double kZstdRatio = 0.9;
constexpr double kZstdThroughput = 1e9;

}  // namespace

namespace internal {

LinkSpec CollectiveLink(const Cluster& cluster, int site, double collective_scale) {
  LinkSpec link = cluster.Link(site, site);
  link.bandwidth_bytes_per_s *= collective_scale;
  return link;
}

double WindowSeconds(const JobOptions& job, const LinkSpec& link, double wire) {
  if (job.wan_window_bytes <= 0 || wire <= job.wan_window_bytes) return 0;
  const double per_byte = 2 * link.latency_s / job.wan_window_bytes - 1 / link.bandwidth_bytes_per_s;
  return per_byte > 0 ? (wire - job.wan_window_bytes) * per_byte : 0;
}

bool TiedCopyApart(const ModelCosts& model, int begin, int end, int pp, bool tied_apart) {
  return tied_apart && pp > 1 && (begin == 0 || end == model.num_layers());
}

ParameterCount StageParameterCount(const ModelCosts& model, int begin, int end, int pp) {
  ParameterCount p;
  for (int l = begin; l < end; ++l) p += {model.layers[l].parameters, model.layers[l].replicated_parameters};
  if (pp > 1 && end == model.num_layers() && begin > 0) p += {model.tied_parameters, model.tied_parameters};
  return p;
}

double StageStateBytes(const ModelCosts& model, const JobOptions& job, int begin, int end, int pp, int tp, int dp) {
  return StageParameterCount(model, begin, end, pp).PerRank(tp, false) * StateBytesPerParameter(model, job, dp);
}

double StageFlops(const ModelCosts& model, int begin, int end) {
  double f = 0;
  for (int l = begin; l < end; ++l) f += model.layers[l].forward_flops;
  return f;
}

}  // namespace internal

using internal::ParameterCount;
using internal::StageFlops;
using internal::StageStateBytes;
using internal::TiedCopyApart;

ModelCosts ModelCosts::FromConfig(const GPT2Config& config, int seq_len) {
  ModelCosts m;
  m.seq_len = seq_len;
  m.n_embd = config.n_embd;
  m.n_head = config.n_head;
  const double C = config.n_embd, T = seq_len, Vp = config.padded_vocab_size;
  const double e = m.bytes_per_element;
  LayerCost embedding;
  embedding.name = "embedding";
  embedding.forward_flops = model::EncoderForwardCost(1, seq_len, config.n_embd).flops;  // wte + wpe rows
  embedding.parameters = static_cast<double>(config.EmbeddingParameters());
  embedding.replicated_parameters = embedding.parameters;
  embedding.activation_bytes = T * C * e;
  embedding.output_bytes = T * C * e;
  m.layers.push_back(embedding);
  for (int l = 0; l < config.n_layer; ++l) {
    LayerCost block;
    block.name = absl::StrCat("h.", l);
    block.forward_flops = config.BlockForwardFlops(seq_len);
    block.parameters = static_cast<double>(config.BlockParameters());
    block.replicated_parameters = 6 * C;  // two LayerNorms' weights and biases, the two projections' biases
    block.activation_bytes = static_cast<double>(config.BlockActivationFloatsPerToken(seq_len)) * T * e;
    block.output_bytes = T * C * e;
    block.tensor_parallel_comm = true;
    m.layers.push_back(block);
  }
  LayerCost head;
  head.name = "head";
  head.forward_flops = model::MatmulForwardCost(seq_len, config.n_embd, config.padded_vocab_size).flops;
  head.parameters = 2 * C;  // ln_f; the tied wte copy is counted by Simulate when pp > 1
  head.replicated_parameters = head.parameters;
  head.activation_bytes = (C + 2 + 2 * Vp) * T * e;  // ln_f output and stats, logits, probabilities
  head.output_bytes = 0;
  m.layers.push_back(head);
  m.tied_parameters = Vp * C;
  return m;
}

double ModelCosts::TotalForwardFlops() const {
  double total = 0;
  for (const LayerCost& l : layers) total += l.forward_flops;
  return total;
}

double Codec::SecondsPerByte(const LinkSpec& link) const {
  const double wire = ratio / link.bandwidth_bytes_per_s;
  if (throughput_bytes_per_s <= 0) return wire;
  // The sender encodes the next chunk while the last one is on the wire (comm/tensor_stream.h); the receiver
  // decodes once the whole tensor is in.
  return std::max(wire, 1.0 / throughput_bytes_per_s) + 1.0 / throughput_bytes_per_s;
}

absl::StatusOr<Codec> ParseCodec(const std::string& name) {
  ASSIGN_OR_RETURN(const CodecSpec spec, ParseCodecSpec(name));  // the runtime's parser: one meaning per name
  // Throughputs are the codec issue's goal figures for one core (4 GB/s for casts); calibrate with
  // runs.
  Codec codec;
  codec.name = spec.ToString();
  switch (spec.kind) {
    case CodecKind::kNone:
      codec = Codec{codec.name, 1.0, 0, true};
      break;
    case CodecKind::kFp16:
    case CodecKind::kBf16:
      codec = Codec{codec.name, 0.5, 4e9, true};
      break;
    case CodecKind::kInt8:
      codec = Codec{codec.name, 0.25 + 1.0 / 1024, 2e9, false};  // a scale per 256 values
      break;
    case CodecKind::kTopK:
      // A value and an index per kept element; the selection is slow.
      codec = Codec{codec.name, 2 * spec.topk_fraction, 0.5e9, false};
      break;
    case CodecKind::kInt4:
    case CodecKind::kSparse: {
      // The runtime's bytes (common/codec_spec.h) of a tensor far larger than a block. Throughputs: the encoders'
      // on one core of an AMD EPYC (comm/codec_lowbit_test.cc PrintsItsSpeed: int4 0.95 GB/s of fp32, sparse 0.44
      // with its per-block selection; their decoders run at 5-7 GB/s), taken for both ends.
      constexpr uint64_t kElements = uint64_t{1} << 24;
      const double ratio = static_cast<double>(CodecRawPayloadBytes(spec, kElements)) / (4.0 * kElements);
      codec = Codec{codec.name, ratio, spec.kind == CodecKind::kInt4 ? 0.95e9 : 0.44e9, false};
      break;
    }
  }
  codec.gradients_only = spec.gradients_only();
  codec.finite_only = spec.finite_only();
  if (spec.zstd) {
    // zstd over the payload (docs/results/2026-12-02-comm.md (b), level 1 on gradient-like data): it took 7-22% off
    // the cast codecs' bytes and ran at about 1 GB/s of fp32 input, encode and decode together.
    codec.ratio *= kZstdRatio;
    codec.throughput_bytes_per_s =
        codec.throughput_bytes_per_s > 0 ? std::min(codec.throughput_bytes_per_s, kZstdThroughput) : kZstdThroughput;
  }
  return codec;
}

const char* ScheduleName(Schedule schedule) { return schedule == Schedule::k1F1B ? "1f1b" : "gpipe"; }

double JobOptions::EfficiencyOf(const std::string& device) const {
  auto it = efficiency_by_device.find(device);
  return it != efficiency_by_device.end() ? it->second : efficiency;
}

int AllReduceRounds(int n, double bytes) {
  return n <= 1 ? 0 : n == 2 && bytes <= kPairAllReduceMaxBytes ? 1 : 2 * (n - 1);
}

double RingAllReduceSeconds(double bytes, int n, const LinkSpec& link) {
  if (n <= 1) return 0;
  return 2.0 * (n - 1) / n * bytes / link.bandwidth_bytes_per_s + AllReduceRounds(n, bytes) * link.latency_s;
}

PipelineTimeline SimulatePipeline(const std::vector<double>& forward_s, const std::vector<double>& backward_s,
                                  const std::vector<double>& transfer_s, const std::vector<double>& latency_s,
                                  int microbatches, Schedule schedule, const std::vector<double>& round_trips,
                                  int depth, const std::vector<int>& stage_sites, const std::vector<double>& stall_s) {
  // A message of r round trips (the runtime's sends wait for the peer's ack): it holds its link direction for its
  // serialisation, arrives (2 r - 1) latencies after it and is acknowledged 2 r latencies after it. Each stage
  // sends as the runtime's AsyncSender (worker/async_sender.h) does, in its ops' order: up to `in_flight` sends at
  // once when they all go to one site (a pipeline deeper than pp: depth - pp + 1 of them), one otherwise, and a
  // send to another site than those in flight waits for their acks. So a middle stage whose neighbours sit in
  // two sites overlaps runs of sends one way (a deep pipeline's warm-up forwards, its drain's backwards) and
  // waits a round trip where its sends alternate. Without round trips: a plain link (busy for the serialisation,
  // arriving one latency later).
  const int stages = static_cast<int>(forward_s.size());
  constexpr int kMaxSendsInFlight = 16;  // the runtime's cap (worker/stage_trainer.cc)
  const int in_flight = schedule == Schedule::k1F1B && depth > stages
                            ? std::clamp(std::min(depth, microbatches) - stages + 1, 1, kMaxSendsInFlight)
                            : 1;
  auto arrival_latencies = [&](int s) { return round_trips.empty() ? 1.0 : 2 * round_trips[s] - 1; };
  const int p = static_cast<int>(forward_s.size());
  const int m = microbatches;
  PipelineTimeline out;
  out.last_backward_start.assign(p, 0);
  out.last_backward_end.assign(p, 0);
  out.busy.assign(p, 0);
  if (p == 0 || m <= 0) return out;
  // Op lists, the runtime's schedules: +i+1 is the forward of microbatch i, -(i+1) its backward.
  std::vector<std::vector<int>> ops(p);
  for (int s = 0; s < p; ++s) {
    const PipelineKind kind = schedule == Schedule::kGPipe ? PipelineKind::kGPipe : PipelineKind::k1F1B;
    for (const PipelineOp& op : MakePipelineSchedule(kind, p, s, m, depth)) {
      ops[s].push_back(op.forward ? op.microbatch + 1 : -(op.microbatch + 1));
    }
  }
  std::vector<double> forward_arrival(static_cast<size_t>(p) * m, -1), backward_arrival(forward_arrival),
      forward_done(forward_arrival);
  std::vector<double> stage_free(p, 0), link_forward_free(p, 0), link_backward_free(p, 0);
  std::vector<size_t> next(p, 0);
  // Per stage: the acks of its sends in flight (the two directions' sends to one site may be acknowledged out of
  // order: a slot frees at the earliest) and the site they go to.
  std::vector<std::multiset<double>> acks(p);
  std::vector<int> in_flight_site(p, -1);
  // Stage s sends, once it is `ready`, over boundary `boundary` to stage `to`, on the link direction whose
  // serialisation is free at `wire_free`; returns the arrival. A stream's window stall (stall_s) delays the message
  // but leaves the link to the other streams.
  auto send = [&](int s, int boundary, int to, double ready, double& wire_free) {
    const double transfer = transfer_s[boundary], latency = latency_s[boundary];
    const double stall = stall_s.empty() ? 0.0 : stall_s[boundary];
    if (round_trips.empty()) {
      const double start = std::max(ready, wire_free);
      wire_free = start + transfer;
      return start + transfer + stall + latency;
    }
    const int site = stage_sites.empty() ? 0 : stage_sites[to];
    std::multiset<double>& pending = acks[s];
    double start = ready;
    pending.erase(pending.begin(), pending.upper_bound(start));  // acknowledged by now
    if (site != in_flight_site[s]) {
      if (!pending.empty()) start = std::max(start, *pending.rbegin());
      pending.clear();
      in_flight_site[s] = site;
    }
    while (static_cast<int>(pending.size()) >= in_flight) {
      start = std::max(start, *pending.begin());
      pending.erase(pending.begin());
    }
    start = std::max(start, wire_free);
    wire_free = start + transfer;
    pending.insert(start + transfer + stall + 2 * round_trips[boundary] * latency);
    return start + transfer + stall + arrival_latencies(boundary) * latency;
  };
  size_t remaining = static_cast<size_t>(2) * p * m;
  // Sweeps alternate direction: forwards flow down the stages, backwards up, so each sweep carries
  // a wave of either all the way and the number of sweeps grows with m, not m x p.
  for (int sweep = 0; remaining > 0; ++sweep) {
    bool progress = false;
    for (int k = 0; k < p; ++k) {
      const int s = sweep % 2 == 0 ? k : p - 1 - k;
      while (next[s] < ops[s].size()) {
        const int op = ops[s][next[s]];
        const bool forward = op > 0;
        const int i = (forward ? op : -op) - 1;
        const size_t at = static_cast<size_t>(s) * m + i;
        double ready;
        if (forward) {
          ready = s == 0 ? 0 : forward_arrival[at];
        } else {
          ready = s == p - 1 ? forward_done[at] : backward_arrival[at];
        }
        if (ready < 0) break;
        const double duration = forward ? forward_s[s] : backward_s[s];
        const double start = std::max(stage_free[s], ready);
        const double end = start + duration;
        stage_free[s] = end;
        out.busy[s] += duration;
        if (forward) {
          forward_done[at] = end;
          if (s + 1 < p) forward_arrival[at + m] = send(s, s, s + 1, end, link_forward_free[s]);
        } else {
          if (s > 0) backward_arrival[at - m] = send(s, s - 1, s - 1, end, link_backward_free[s - 1]);
          if (next[s] + 1 == ops[s].size()) {
            out.last_backward_start[s] = start;
            out.last_backward_end[s] = end;
          }
        }
        out.makespan = std::max(out.makespan, end);
        ++next[s];
        --remaining;
        progress = true;
      }
    }
    if (!progress) break;  // cannot happen for the two schedules above; guards against a hang
  }
  return out;
}

int ChooseCodec(const JobOptions& job, const LinkSpec& link, bool activations) {
  if (job.codec_on_every_link && !job.codecs.empty()) return activations && job.codecs[0].gradients_only ? -1 : 0;
  int best = -1;
  double best_cost = 1.0 / link.bandwidth_bytes_per_s;
  for (int c = 0; c < static_cast<int>(job.codecs.size()); ++c) {
    const Codec& codec = job.codecs[c];
    if (activations && !codec.for_activations) continue;
    const double cost = codec.SecondsPerByte(link);
    if (cost < best_cost * 0.999) {
      best = c;
      best_cost = cost;
    }
  }
  return best;
}

std::vector<double> GradientBucketBytes(const ModelCosts& model, int begin, int end, int pp, int tp,
                                        double bucket_bytes, bool tied_apart, bool split_replicated) {
  constexpr double kBucketElementBytes = sizeof(float);
  std::vector<ParameterCount> groups;
  ParameterCount others;
  if (pp > 1 && end == model.num_layers() && begin > 0) others = {model.tied_parameters, model.tied_parameters};
  for (int l = end - 1; l >= begin; --l) {
    const ParameterCount layer{model.layers[l].parameters, model.layers[l].replicated_parameters};
    if (model.layers[l].tensor_parallel_comm) {
      groups.push_back(layer);
    } else {
      others += layer;
    }
  }
  if (TiedCopyApart(model, begin, end, pp, tied_apart)) others -= {model.tied_parameters, model.tied_parameters};
  groups.push_back(others);
  std::vector<double> buckets;
  for (const ParameterCount& parameters : groups) {
    const double bytes = parameters.PerRank(tp, split_replicated) * kBucketElementBytes;
    if (bytes <= 0) continue;
    if (buckets.empty() || buckets.back() >= bucket_bytes) buckets.push_back(0);
    buckets.back() += bytes;
  }
  return buckets;
}

double StateBytesPerParameter(const ModelCosts& model, const JobOptions& job, int dp) {
  const double e = model.bytes_per_element;
  return 2 * e + job.optimizer_bytes_per_parameter + (dp > 1 ? e : 0);
}

double UsableMemoryBytes(const JobOptions& job, double device_bytes) {
  return device_bytes * (1 - job.memory_headroom);
}

double StageMemoryBytes(const ModelCosts& model, const JobOptions& job, int begin, int end, int stage, int pp, int tp,
                        int dp, int microbatch_size, int microbatches, Schedule schedule) {
  double activations = 0;
  for (int l = begin; l < end; ++l) activations += model.layers[l].activation_bytes;
  const int held = schedule == Schedule::kGPipe ? microbatches : std::min(pp - stage, microbatches);
  const double e = model.bytes_per_element;
  const double state = StageStateBytes(model, job, begin, end, pp, tp, dp);
  const double boundary = (stage > 0 ? 1 : 0) + (stage + 1 < pp ? 1 : 0);
  const double buffers = boundary * 2.0 * microbatch_size * model.seq_len * model.n_embd * e;
  return state + activations * microbatch_size / tp * held + buffers + job.fixed_memory_bytes;
}

namespace internal {

double CollectiveHost::CodecRescale(int coders) const {
  return cores > 0 ? std::min(1.0, cores / coders) / codec_scale : 1;
}

double CodedSecondsPerByte(const JobOptions& job, int c, const LinkSpec& link, double rescale) {
  if (c < 0) return 1.0 / link.bandwidth_bytes_per_s;
  Codec codec = job.codecs[c];
  codec.throughput_bytes_per_s *= rescale;
  return codec.SecondsPerByte(link);
}

double DataParallelAllReduce(const Cluster& cluster, const JobOptions& job, const Plan& plan,
                             const std::vector<int>& member_sites, double bytes_per_rank, const CollectiveHost& host,
                             std::vector<std::vector<double>>* traffic, std::vector<std::vector<int>>* used_codec,
                             DpRing* ring) {
  const int n = static_cast<int>(member_sites.size());
  *ring = DpRing{};
  if (n <= 1 || bytes_per_rank <= 0) return 0;
  std::vector<int> count(cluster.num_sites(), 0);
  for (int s : member_sites) ++count[s];
  std::vector<int> sites;
  for (int s = 0; s < cluster.num_sites(); ++s) {
    if (count[s] > 0) sites.push_back(s);
  }
  const int tp = plan.tp;
  if (sites.size() == 1) {
    const LinkSpec link = CollectiveLink(cluster, sites[0], host.collective_scale);
    *ring = DpRing{n, link.latency_s, AllReduceRounds(n, bytes_per_rank) * link.latency_s, LinkSpec{}};
    return RingAllReduceSeconds(bytes_per_rank, n, link);
  }
  auto codec_of = [&](int a, int b) {
    if (!plan.gradient_codec.empty()) return plan.gradient_codec[a][b];
    return ChooseCodec(job, cluster.Link(a, b), /*activations=*/false);
  };
  // The sites' cyclic ring order is their index order; the slowest hop paces the ring.
  const int S = static_cast<int>(sites.size());
  // On a shared host the hierarchical all-reduce's leaders code at their own share of its cores: only they code
  // while their ring runs (CollectiveHost::cores).
  const double leader_codec_rescale = host.CodecRescale(host.concurrent_groups * S);
  double worst_seconds_per_byte = 0, worst_leader_seconds_per_byte = 0, worst_wan_latency = 0;
  LinkSpec worst_wan;
  for (int i = 0; i < S; ++i) {
    const int a = sites[i], b = sites[(i + 1) % S];
    const LinkSpec& link = cluster.Link(a, b);
    const int c = codec_of(a, b);
    const double spb = CodedSecondsPerByte(job, c, link, 1);
    worst_seconds_per_byte = std::max(worst_seconds_per_byte, spb);
    worst_leader_seconds_per_byte =
        std::max(worst_leader_seconds_per_byte, CodedSecondsPerByte(job, c, link, leader_codec_rescale));
    if (link.latency_s >= worst_wan_latency) worst_wan = link;
    worst_wan_latency = std::max(worst_wan_latency, link.latency_s);
  }
  double intra_latency = 0, intra_seconds_per_byte = 0;
  for (int s : sites) {
    const LinkSpec link = CollectiveLink(cluster, s, host.collective_scale);
    intra_latency = std::max(intra_latency, link.latency_s);
    if (count[s] > 1) intra_seconds_per_byte = std::max(intra_seconds_per_byte, 1.0 / link.bandwidth_bytes_per_s);
  }
  // Flat ring over all n members: every step is paced by its slowest hop, a WAN hop (shared by the tp rings) or
  // a hop inside a site.
  const double flat =
      2.0 * (n - 1) / n * bytes_per_rank * std::max(tp * worst_seconds_per_byte, intra_seconds_per_byte) +
      AllReduceRounds(n, bytes_per_rank) * std::max(worst_wan_latency, intra_latency);
  // Hierarchical: reduce to a leader per site, all-reduce among the S leaders over the WAN, broadcast back.
  // NCCL's (comm::NcclHierarchicalAllReduce) reduces and broadcasts by rings inside the site; gRPC's
  // (comm::GrpcCommunicator::HierarchicalAllReduce) gathers the site's k - 1 other tensors to the leader and sends
  // it k - 1 copies back. Both leaders' groups are gRPC all-reduces: two leaders exchange in one round.
  double intra = 0;
  bool shared_site = false;
  int gathered = 0;  // the transfers of one gather (or copy back): every site's members but its leader
  for (int s : sites) {
    const int k = count[s];
    if (k <= 1) continue;
    shared_site = true;
    gathered += k - 1;
    const LinkSpec l = CollectiveLink(cluster, s, host.collective_scale);
    intra = std::max(intra, job.grpc_collectives
                                ? (k - 1.0) * bytes_per_rank / l.bandwidth_bytes_per_s + l.latency_s
                                : (k - 1.0) / k * bytes_per_rank / l.bandwidth_bytes_per_s + (k - 1) * l.latency_s);
  }
  if (job.grpc_collectives && host.host_bytes_per_s > 0 && shared_site) {
    // One host carries every site's gather at once (CollectiveHost).
    intra =
        bytes_per_rank * std::max(2.0, static_cast<double>(host.concurrent_groups) * gathered) / host.host_bytes_per_s +
        intra_latency;
  }
  const double leader_rounds = AllReduceRounds(S, bytes_per_rank);
  const double hierarchical = 2 * intra + 2.0 * (S - 1) / S * bytes_per_rank * tp * worst_leader_seconds_per_byte +
                              leader_rounds * worst_wan_latency;
  // What the runtime runs (worker/stage_collectives.cc): its gRPC groups the hierarchical all-reduce whenever a site
  // holds several of their replicas, else the ring; NCCL groups across sites always the hierarchical one.
  const bool use_flat = job.grpc_collectives && !shared_site;
  if (use_flat) {
    const double latency = std::max(worst_wan_latency, intra_latency);
    *ring = DpRing{n, latency, AllReduceRounds(n, bytes_per_rank) * latency, worst_wan};
  } else {
    *ring = DpRing{S, worst_wan_latency, leader_rounds * worst_wan_latency, worst_wan};
  }
  const double per_hop = use_flat ? 2.0 * (n - 1) / n : 2.0 * (S - 1) / S;
  for (int i = 0; i < S; ++i) {
    const int a = sites[i], b = sites[(i + 1) % S];
    const int c = codec_of(a, b);
    (*traffic)[a][b] += per_hop * bytes_per_rank * tp * (c < 0 ? 1.0 : job.codecs[c].ratio);
    (*used_codec)[std::min(a, b)][std::max(a, b)] = c;
  }
  return use_flat ? flat : hierarchical;
}

}  // namespace internal

absl::StatusOr<double> CalibrateEfficiency(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                           const Plan& plan, const std::vector<double>& measured_stage_compute_s) {
  if (static_cast<int>(measured_stage_compute_s.size()) != plan.pp || plan.devices.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration: need ", plan.pp, " measured stage times (one per stage of replica 0)"));
  }
  double cc = 0, cm = 0;
  for (int s = 0; s < plan.pp; ++s) {
    double slowest = kInf;
    for (int d : plan.devices[0][s]) slowest = std::min(slowest, cluster.devices[d].tflops * 1e12);
    const double c = 3 * StageFlops(model, plan.stage_begin[s], plan.stage_begin[s + 1]) * plan.microbatch_size /
                     (plan.tp * slowest);  // seconds at 100% efficiency
    // The per-layer overhead is not compute: take it off the measurement before fitting.
    const double m =
        measured_stage_compute_s[s] - 3 * (plan.stage_begin[s + 1] - plan.stage_begin[s]) * job.layer_overhead_s;
    if (!(m > 0) || !std::isfinite(m)) {
      return absl::InvalidArgumentError(absl::StrCat("calibration: stage ", s, " time must be positive"));
    }
    cc += c * c;
    cm += c * m;
  }
  return cc / cm;
}

}  // namespace geotrain::scheduler
