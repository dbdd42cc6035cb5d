// The step-time simulator behind the planner (see cost_model.h and docs/planner.md for the
// formulas).
#include "scheduler/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/pipeline_schedule.h"
#include "common/status.h"
#include "model/op_costs.h"

namespace geotrain::scheduler {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double GB(double bytes) { return bytes / 1e9; }

// What `+zstd` does to a codec in the model: wire bytes x kZstdRatio, at most kZstdThroughput.
constexpr double kZstdRatio = 0.9;
constexpr double kZstdThroughput = 1e9;

// The ranks that communicate at once in the calibration a one-host cluster's bandwidth inside a site comes from
// (bench/geo/timed_lib.py: DP2 and TP2 inside a site).
constexpr int kOneHostCalibrationRanks = 2;

// The link inside site `site` as a collective sees it: collective_scale of its bandwidth.
LinkSpec CollectiveLink(const Cluster& cluster, int site, double collective_scale) {
  LinkSpec link = cluster.Link(site, site);
  link.bandwidth_bytes_per_s *= collective_scale;
  return link;
}

// Seconds one message of `wire` bytes from one site to another takes beyond its serialisation, because of its
// stream's flow-control window (JobOptions::wan_window_bytes): the first window goes at the link's rate, the rest
// at window / round trip when that is the slower.
double WindowSeconds(const JobOptions& job, const LinkSpec& link, double wire) {
  if (job.wan_window_bytes <= 0 || wire <= job.wan_window_bytes) return 0;
  const double per_byte = 2 * link.latency_s / job.wan_window_bytes - 1 / link.bandwidth_bytes_per_s;
  return per_byte > 0 ? (wire - job.wan_window_bytes) * per_byte : 0;
}

// The link from site a to site b as messages of activations see it (JobOptions::activation_bandwidth_scale).
LinkSpec ActivationLink(const Cluster& cluster, const JobOptions& job, int a, int b) {
  LinkSpec link = cluster.Link(a, b);
  if (a == b) link.bandwidth_bytes_per_s *= job.activation_bandwidth_scale;
  return link;
}

// Whether the stage [begin, end) holds a wte copy that the tied all-reduce sums apart from its data-parallel
// all-reduce (tied_apart: gRPC collectives with several replicas): the first and the last stage when pp > 1.
bool TiedCopyApart(const ModelCosts& model, int begin, int end, int pp, bool tied_apart) {
  return tied_apart && pp > 1 && (begin == 0 || end == model.num_layers());
}

// A count of parameters, and of them those whole on every tp rank (LayerCost::replicated_parameters).
struct ParameterCount {
  double all = 0, replicated = 0;
  ParameterCount& operator+=(const ParameterCount& o) {
    all += o.all;
    replicated += o.replicated;
    return *this;
  }
  ParameterCount& operator-=(const ParameterCount& o) {
    all -= o.all;
    replicated -= o.replicated;
    return *this;
  }
  // What one of tp ranks all-reduces: its 1/tp of the sharded parameters, and the replicated ones whole, or 1/tp of
  // them with split_replicated (worker/stage_collectives.h).
  double PerRank(int tp, bool split_replicated) const {
    return (all - replicated) / tp + replicated / (split_replicated ? tp : 1);
  }
};

// The parameters of the stage [begin, end), with the last stage's tied wte copy when pp > 1.
ParameterCount StageParameterCount(const ModelCosts& model, int begin, int end, int pp) {
  ParameterCount p;
  for (int l = begin; l < end; ++l) p += {model.layers[l].parameters, model.layers[l].replicated_parameters};
  if (pp > 1 && end == model.num_layers() && begin > 0) p += {model.tied_parameters, model.tied_parameters};
  return p;
}

// Parameters, gradients and optimizer state of one tp rank of the stage: its shard of the sharded parameters, and
// the replicated ones whole.
double StageStateBytes(const ModelCosts& model, const JobOptions& job, int begin, int end, int pp, int tp, int dp) {
  return StageParameterCount(model, begin, end, pp).PerRank(tp, false) * StateBytesPerParameter(model, job, dp);
}

}  // namespace

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
  }
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

namespace {

double StageFlops(const ModelCosts& model, int begin, int end) {
  double f = 0;
  for (int l = begin; l < end; ++l) f += model.layers[l].forward_flops;
  return f;
}

int StageBlocks(const ModelCosts& model, int begin, int end) {
  int n = 0;
  for (int l = begin; l < end; ++l) n += model.layers[l].tensor_parallel_comm ? 1 : 0;
  return n;
}

// The parameters a stage's data-parallel all-reduce sums: its own, less its wte copy when the tied all-reduce sums
// every replica's copies apart (tied_apart, as GradientBucketBytes).
ParameterCount DataParallelParameters(const ModelCosts& model, int begin, int end, int pp, bool tied_apart) {
  ParameterCount p = StageParameterCount(model, begin, end, pp);
  if (TiedCopyApart(model, begin, end, pp, tied_apart)) p -= {model.tied_parameters, model.tied_parameters};
  return p;
}

// The ring a stage's DP all-reduce runs its rounds on, as DataParallelAllReduce chose it: what each gradient
// bucket pays again with sequential_sync.
struct DpRing {
  int members = 1;             // the flat ring's ranks, or the hierarchical all-reduce's site leaders
  double round_latency = 0;    // latency of one of its rounds
  double counted_latency = 0;  // latency seconds the returned time already holds for those rounds
  LinkSpec wan;                // its slowest hop across sites (a message's window); bandwidth 0 when none
};

// Gradient all-reduce of one stage's DP group (one per tp rank; the tp rings share the WAN).
// Returns the seconds, describes its ring in *ring and adds the wire bytes of every cross-site hop to
// traffic[a][b] (ordered by direction).
double DataParallelAllReduce(const Cluster& cluster, const JobOptions& job, const Plan& plan,
                             const std::vector<int>& member_sites, double bytes_per_rank, double collective_scale,
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
    const LinkSpec link = CollectiveLink(cluster, sites[0], collective_scale);
    *ring = DpRing{n, link.latency_s, AllReduceRounds(n, bytes_per_rank) * link.latency_s, LinkSpec{}};
    return RingAllReduceSeconds(bytes_per_rank, n, link);
  }
  auto codec_of = [&](int a, int b) {
    if (!plan.gradient_codec.empty()) return plan.gradient_codec[a][b];
    return ChooseCodec(job, cluster.Link(a, b), /*activations=*/false);
  };
  // The sites' cyclic ring order is their index order; the slowest hop paces the ring.
  const int S = static_cast<int>(sites.size());
  double worst_seconds_per_byte = 0, worst_wan_latency = 0;
  LinkSpec worst_wan;
  for (int i = 0; i < S; ++i) {
    const int a = sites[i], b = sites[(i + 1) % S];
    const LinkSpec& link = cluster.Link(a, b);
    const int c = codec_of(a, b);
    const double spb = c < 0 ? 1.0 / link.bandwidth_bytes_per_s : job.codecs[c].SecondsPerByte(link);
    worst_seconds_per_byte = std::max(worst_seconds_per_byte, spb);
    if (link.latency_s >= worst_wan_latency) worst_wan = link;
    worst_wan_latency = std::max(worst_wan_latency, link.latency_s);
  }
  double intra_latency = 0, intra_seconds_per_byte = 0;
  for (int s : sites) {
    const LinkSpec link = CollectiveLink(cluster, s, collective_scale);
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
  for (int s : sites) {
    const int k = count[s];
    if (k <= 1) continue;
    shared_site = true;
    const LinkSpec l = CollectiveLink(cluster, s, collective_scale);
    intra = std::max(intra, job.grpc_collectives
                                ? (k - 1.0) * bytes_per_rank / l.bandwidth_bytes_per_s + l.latency_s
                                : (k - 1.0) / k * bytes_per_rank / l.bandwidth_bytes_per_s + (k - 1) * l.latency_s);
  }
  const double leader_rounds = AllReduceRounds(S, bytes_per_rank);
  const double hierarchical =
      2 * intra + 2.0 * (S - 1) / S * bytes_per_rank * tp * worst_seconds_per_byte + leader_rounds * worst_wan_latency;
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

std::string CodecName(const JobOptions& job, int c) { return c < 0 ? "none" : job.codecs[c].name; }

// A shared host's arithmetic (JobOptions::sites_share_one_host): collectives inside a site get collective_scale of
// the bandwidth inside the site, and each send between stages at most p2p_bytes_per_s.
struct HostShare {
  double collective_scale = 1;
  double p2p_bytes_per_s = kInf;
};

// Simulate after its checks, on the links as the plan sees them.
absl::StatusOr<Prediction> SimulateChecked(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                           const Plan& plan, const HostShare& host, const std::vector<char>& used);

}  // namespace

absl::StatusOr<Prediction> Simulate(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                    const Plan& plan) {
  const int L = model.num_layers();
  if (plan.dp < 1 || plan.pp < 1 || plan.tp < 1 || plan.microbatch_size < 1) {
    return absl::InvalidArgumentError("plan: dp, pp, tp and microbatch_size must be at least 1");
  }
  if (static_cast<int>(plan.stage_begin.size()) != plan.pp + 1 || plan.stage_begin.front() != 0 ||
      plan.stage_begin.back() != L) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan: stage_begin needs pp + 1 = ", plan.pp + 1, " boundaries from 0 to ", L));
  }
  for (int s = 0; s < plan.pp; ++s) {
    if (plan.stage_begin[s] >= plan.stage_begin[s + 1]) {
      return absl::InvalidArgumentError(absl::StrCat("plan: stage ", s, " holds no layer"));
    }
  }
  if (static_cast<int>(plan.devices.size()) != plan.dp || static_cast<int>(plan.microbatches.size()) != plan.dp) {
    return absl::InvalidArgumentError("plan: devices and microbatches need one entry per replica");
  }
  std::vector<char> used(cluster.devices.size(), 0);
  for (const auto& replica : plan.devices) {
    if (static_cast<int>(replica.size()) != plan.pp) {
      return absl::InvalidArgumentError("plan: every replica needs pp stages");
    }
    for (const auto& stage : replica) {
      if (static_cast<int>(stage.size()) != plan.tp) {
        return absl::InvalidArgumentError("plan: every stage needs tp devices");
      }
      for (int d : stage) {
        if (d < 0 || d >= static_cast<int>(cluster.devices.size())) {
          return absl::InvalidArgumentError(absl::StrCat("plan: device index ", d, " outside the cluster"));
        }
        if (used[d]++) {
          return absl::InvalidArgumentError(absl::StrCat("plan: device ", d, " holds two actors"));
        }
      }
    }
  }
  // The links as this plan sees them (see JobOptions): a shared host's arithmetic.
  std::optional<Cluster> adjusted;
  std::optional<JobOptions> shared_job;
  HostShare host;
  if (job.sites_share_one_host) {
    std::set<int> sites_used;
    for (const auto& replica : plan.devices)
      for (const auto& stage : replica)
        for (int d : stage) sites_used.insert(cluster.devices[d].site);
    const int k = static_cast<int>(sites_used.size());
    // The sends between stages run on the host at the same time: one at a time per boundary of each replica (and
    // per tp rank's copy). GPipe's forward and backward phases go one way at a time; in 1F1B a stage's next
    // forward waits for its backward, and a send (4 MB for GPT-2 medium) outlasts a stage's compute of a
    // microbatch on an emulated GPU, so the two directions take turns.
    if (plan.pp > 1) {
      double inside = 0;
      for (int a : sites_used) inside = std::max(inside, ActivationLink(cluster, job, a, a).bandwidth_bytes_per_s);
      const int streams = plan.dp * plan.tp * (plan.pp - 1);
      host.p2p_bytes_per_s = kOneHostCalibrationRanks * inside / streams;
    }
    if (k > 1) {
      adjusted = cluster;
      for (int a = 0; a < adjusted->num_sites(); ++a) adjusted->links[a][a].bandwidth_bytes_per_s /= k;
    }
    const int ranks = plan.dp * plan.pp * plan.tp;
    host.collective_scale = std::min(1.0, static_cast<double>(kOneHostCalibrationRanks) * k / ranks);
    // The codecs' encoding and decoding run on the same cores: when more ranks than the host runs at full speed
    // code at once (a collective's members all do), each gets its share of their throughput.
    const double codec_scale = std::min(1.0, static_cast<double>(kOneHostCalibrationRanks) / ranks);
    if (codec_scale < 1) {
      shared_job = job;
      for (Codec& codec : shared_job->codecs) codec.throughput_bytes_per_s *= codec_scale;
    }
  }
  return SimulateChecked(adjusted ? *adjusted : cluster, model, shared_job ? *shared_job : job, plan, host, used);
}

namespace {

absl::StatusOr<Prediction> SimulateChecked(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                           const Plan& plan, const HostShare& host, const std::vector<char>& used) {
  const double collective_scale = host.collective_scale;
  int total_sequences = 0;
  for (int m : plan.microbatches) {
    if (m < 1) return absl::InvalidArgumentError("plan: every replica needs at least one microbatch");
    total_sequences += m * plan.microbatch_size;
  }

  const int pp = plan.pp, tp = plan.tp, b = plan.microbatch_size;
  // Round trips of one message of `wire` bytes with sequential sync (the runtime's messages).
  auto round_trips = [&](double wire) {
    return job.message_round_trips + (job.message_window_bytes > 0 ? wire / job.message_window_bytes : 0);
  };
  const auto scale = job.shared_host_scale.find(plan.dp * plan.pp * plan.tp);
  const double host_scale = scale == job.shared_host_scale.end() ? 1.0 : scale->second;
  const int n_sites = cluster.num_sites();
  Prediction out;
  out.device_memory_bytes.assign(cluster.devices.size(), 0);
  std::vector<std::vector<double>> traffic_gradient(n_sites, std::vector<double>(n_sites, 0));
  std::vector<std::vector<double>> traffic_activation = traffic_gradient;
  std::vector<std::vector<int>> gradient_codec_used(n_sites, std::vector<int>(n_sites, -2));
  std::vector<std::vector<int>> activation_codec_used = gradient_codec_used;
  auto activation_codec_of = [&](int a, int c) {
    if (!plan.activation_codec.empty()) return plan.activation_codec[a][c];
    return ChooseCodec(job, cluster.Link(a, c), /*activations=*/true);
  };

  // Memory, and the per-stage compute of each replica.
  double worst_memory_fraction = 0;
  std::string reject;
  const double tokens_per_microbatch = static_cast<double>(b) * model.seq_len;
  double tied_sync = 0;
  std::vector<const PipelineTimeline*> timelines(plan.dp);
  std::map<std::vector<double>, PipelineTimeline> simulated;
  double slowest_makespan = -1;
  int slowest = 0;
  std::vector<std::vector<double>> forward_of(plan.dp), backward_of(plan.dp), transfer_of(plan.dp), latency_of(plan.dp),
      round_trips_of(plan.dp), stall_of(plan.dp);
  std::vector<std::vector<int>> sites_of(plan.dp, std::vector<int>(pp));
  // The tied wte gradient. With gRPC collectives and several replicas, one all-reduce over every copy (the first
  // and the last stage of each replica: tied_sites), routed as a data-parallel group, and the stages' buckets leave
  // wte out (worker/stage_collectives.cc); once every copy is complete (tied_group_ready). Otherwise each replica's
  // first and last stage exchange theirs: (first, last) stage site pairs -> replicas, and when their wte gradients
  // are complete.
  const bool tied_apart = job.grpc_collectives && pp > 1 && plan.dp > 1;
  // Tensor parallelism with gRPC data parallelism across sites (a data-parallel group of some stage and tp rank in
  // more than one site): each tp rank sums 1/tp of the replicated tensors and gathers the rest inside its site
  // (worker/stage_collectives.h, split_replicated).
  bool split_replicated = false;
  if (job.grpc_collectives && tp > 1 && plan.dp > 1) {
    for (int s = 0; s < pp; ++s) {
      for (int k = 0; k < tp; ++k) {
        for (int r = 1; r < plan.dp; ++r) {
          split_replicated = split_replicated ||
                             cluster.devices[plan.devices[r][s][k]].site != cluster.devices[plan.devices[0][s][k]].site;
        }
      }
    }
  }
  std::vector<int> tied_sites;
  double tied_group_ready = 0;
  std::map<std::pair<int, int>, int> tied_pairs;
  std::map<std::pair<int, int>, double> tied_ready;
  for (int r = 0; r < plan.dp; ++r) {
    std::vector<double> forward(pp), backward(pp), transfer(std::max(pp - 1, 0)), latency(transfer), stall(transfer),
        message_round_trips;
    for (int s = 0; s < pp; ++s) {
      const int begin = plan.stage_begin[s], end = plan.stage_begin[s + 1];
      double slowest_flops = kInf;
      for (int k = 0; k < tp; ++k) {
        const Device& d = cluster.devices[plan.devices[r][s][k]];
        slowest_flops = std::min(slowest_flops, d.tflops * 1e12 * job.EfficiencyOf(d.name) * host_scale);
        const double mem =
            StageMemoryBytes(model, job, begin, end, s, pp, tp, plan.dp, b, plan.microbatches[r], plan.schedule);
        out.device_memory_bytes[plan.devices[r][s][k]] = mem;
        const double usable = UsableMemoryBytes(job, d.mem_bytes);
        const double fraction = mem / usable;
        if (fraction > worst_memory_fraction) {
          worst_memory_fraction = fraction;
          if (fraction > 1) {
            const double state = StageStateBytes(model, job, begin, end, pp, tp, plan.dp);
            reject = absl::StrFormat(
                "stage %d (layers %s..%s) on %s at site %s needs %.2f GB of %.2f GB usable "
                "(parameters+gradients+optimizer %.2f GB, activations and buffers %.2f GB, fixed "
                "%.2f GB)",
                s, model.layers[begin].name, model.layers[end - 1].name, d.name, cluster.site_names[d.site], GB(mem),
                GB(usable), GB(state), GB(mem - state - job.fixed_memory_bytes), GB(job.fixed_memory_bytes));
          }
        }
      }
      const double flops = StageFlops(model, begin, end) * b;
      const int site = cluster.devices[plan.devices[r][s][0]].site;
      sites_of[r][s] = site;
      LinkSpec tp_link = ActivationLink(cluster, job, site, site);
      tp_link.bandwidth_bytes_per_s *= collective_scale;
      const double tp_comm =
          tp > 1 ? StageBlocks(model, begin, end) * 2 *
                       RingAllReduceSeconds(tokens_per_microbatch * model.n_embd * model.bytes_per_element, tp, tp_link)
                 : 0;
      const double overhead = (end - begin) * job.layer_overhead_s;
      forward[s] = flops / (tp * slowest_flops) + tp_comm + overhead;
      backward[s] = 2 * flops / (tp * slowest_flops) + tp_comm + 2 * overhead;
      if (s + 1 < pp) {
        const int next_site = cluster.devices[plan.devices[r][s + 1][0]].site;
        LinkSpec link = ActivationLink(cluster, job, site, next_site);
        link.bandwidth_bytes_per_s = std::min(link.bandwidth_bytes_per_s, host.p2p_bytes_per_s);
        const double bytes = model.layers[end - 1].output_bytes * b;
        int c = -1;
        if (site != next_site) c = activation_codec_of(site, next_site);
        transfer[s] = bytes * (c < 0 ? 1.0 / link.bandwidth_bytes_per_s : job.codecs[c].SecondsPerByte(link));
        if (site != next_site) stall[s] = WindowSeconds(job, link, bytes * (c < 0 ? 1.0 : job.codecs[c].ratio));
        latency[s] = link.latency_s;
        if (job.sequential_sync) {
          message_round_trips.push_back(round_trips(bytes * (c < 0 ? 1.0 : job.codecs[c].ratio)));
        }
        if (site != next_site) {
          const double wire = bytes * (c < 0 ? 1.0 : job.codecs[c].ratio) * plan.microbatches[r];
          traffic_activation[site][next_site] += wire;  // activations forward
          traffic_activation[next_site][site] += wire;  // their gradients backward
          activation_codec_used[std::min(site, next_site)][std::max(site, next_site)] = c;
        }
      }
    }
    forward_of[r] = std::move(forward);
    backward_of[r] = std::move(backward);
    transfer_of[r] = std::move(transfer);
    latency_of[r] = std::move(latency);
    stall_of[r] = std::move(stall);
    round_trips_of[r] = std::move(message_round_trips);
  }
  // The 1F1B depth: the plan's, or the one that covers the slowest replica boundary's round trip.
  int depth = plan.schedule == Schedule::kGPipe ? pp : std::max(pp, plan.pipeline_depth);
  if (plan.schedule == Schedule::k1F1B && plan.pipeline_depth <= 0) {
    for (int r = 0; r < plan.dp; ++r) {
      double one_way = 0, microbatch = 0;
      for (int s = 0; s < pp; ++s) {
        microbatch = std::max(microbatch, forward_of[r][s] + backward_of[r][s]);
        if (s + 1 >= pp) continue;
        // Arrival, as SimulatePipeline counts it: serialisation plus one latency, or 2 r - 1 with round trips.
        const double latencies = round_trips_of[r].empty() ? 1.0 : 2 * round_trips_of[r][s] - 1;
        one_way = std::max(one_way, transfer_of[r][s] + stall_of[r][s] + latencies * latency_of[r][s]);
      }
      depth = std::max(depth, PipelineDepthFor(pp, plan.microbatches[r], one_way, microbatch));
    }
  }
  out.pipeline_depth = depth;
  for (int r = 0; r < plan.dp; ++r) {
    // Replicas on identical devices and links behave identically: simulate each kind once.
    std::vector<double> signature;
    signature.reserve(6 * pp + 1);
    for (const auto* part :
         {&forward_of[r], &backward_of[r], &transfer_of[r], &latency_of[r], &round_trips_of[r], &stall_of[r]}) {
      signature.insert(signature.end(), part->begin(), part->end());
    }
    signature.push_back(plan.microbatches[r]);
    signature.insert(signature.end(), sites_of[r].begin(), sites_of[r].end());
    auto known = simulated.find(signature);
    if (known == simulated.end()) {
      known = simulated
                  .emplace(std::move(signature), SimulatePipeline(forward_of[r], backward_of[r], transfer_of[r],
                                                                  latency_of[r], plan.microbatches[r], plan.schedule,
                                                                  round_trips_of[r], depth, sites_of[r], stall_of[r]))
                  .first;
    }
    timelines[r] = &known->second;
    if (timelines[r]->makespan > slowest_makespan) {
      slowest_makespan = timelines[r]->makespan;
      slowest = r;
    }
    if (pp > 1) {
      const int first = cluster.devices[plan.devices[r][0][0]].site;
      const int last = cluster.devices[plan.devices[r][pp - 1][0]].site;
      const double ready_r = std::max(timelines[r]->last_backward_end[0], timelines[r]->last_backward_end[pp - 1]);
      if (tied_apart) {
        tied_sites.push_back(first);
        tied_sites.push_back(last);
        tied_group_ready = std::max(tied_group_ready, ready_r);
      } else {
        ++tied_pairs[{first, last}];
        double& ready = tied_ready[{first, last}];
        ready = std::max(ready, ready_r);
      }
    }
  }
  out.pipeline_time_s = slowest_makespan;
  out.stage_forward_s = forward_of[slowest];
  out.stage_backward_s = backward_of[slowest];
  {
    const PipelineTimeline& t = *timelines[slowest];
    double busy = 0;
    for (double x : t.busy) busy += x;
    out.bubble_fraction = t.makespan > 0 ? 1 - busy / pp / t.makespan : 0;
  }

  // The seconds an all-reduce of each of `buckets` (fp32 bytes per tp rank) on `ring` (among `member_sites`) waits
  // beyond what DataParallelAllReduce counted: each round's message pays the window across sites and, with
  // sequential_sync, 2 r latencies (a message and its ack) where it counted one.
  auto rounds_extra = [&](const std::vector<int>& member_sites, const DpRing& ring,
                          const std::vector<double>& buckets) {
    double ratio = 1;  // the codec of the group's first cross-site pair
    for (int m : member_sites) {
      if (m == member_sites[0]) continue;
      const int c = plan.gradient_codec.empty() ? ChooseCodec(job, cluster.Link(member_sites[0], m), false)
                                                : plan.gradient_codec[member_sites[0]][m];
      ratio = c < 0 ? 1.0 : job.codecs[c].ratio;
      break;
    }
    double waited = 0;
    for (double bucket : buckets) {
      const int rounds = AllReduceRounds(ring.members, bucket);
      const double chunk = bucket / (rounds == 1 ? 1 : ring.members) * ratio;
      const double window = ring.wan.bandwidth_bytes_per_s > 0 ? WindowSeconds(job, ring.wan, chunk) : 0;
      waited += rounds * ((job.sequential_sync ? 2 * round_trips(chunk) : 1) * ring.round_latency + window);
    }
    return waited - ring.counted_latency;
  };
  // The tied all-reduce of every copy (tied_apart): it ends at tied_group_end. Every tp rank holds all of wte
  // (it is replicated, not sharded), so each rank's group all-reduces the whole of it, or 1/tp of it with
  // split_replicated. Its bytes join the gradients' after the stages' bound on the WAN below, as each replica's
  // pair does.
  double tied_group_end = 0;
  std::vector<std::vector<double>> traffic_tied(n_sites, std::vector<double>(n_sites, 0));
  if (tied_apart) {
    const double bytes = model.tied_parameters * model.bytes_per_element / (split_replicated ? tp : 1);
    DpRing ring;
    const double seconds = DataParallelAllReduce(cluster, job, plan, tied_sites, bytes, collective_scale, &traffic_tied,
                                                 &gradient_codec_used, &ring);
    tied_group_end = tied_group_ready + seconds + (seconds > 0 ? rounds_extra(tied_sites, ring, {bytes}) : 0);
  }

  // Sequential sync (the runtime's step epilogue): the tied wte all-reduce first (each replica's pair: a ring of
  // two, both directions at once: its bytes once plus two latencies, when both stages are done), then the buckets.
  double epilogue_start = std::max(out.pipeline_time_s, job.sequential_sync ? tied_group_end : 0.0);
  if (job.sequential_sync) {
    for (const auto& [pair, replicas] : tied_pairs) {
      const auto [first, last] = pair;
      const LinkSpec& link = cluster.Link(first, last);
      const int c = first == last                 ? -1
                    : plan.gradient_codec.empty() ? ChooseCodec(job, link, false)
                                                  : plan.gradient_codec[first][last];
      const double spb = c < 0 ? 1.0 / link.bandwidth_bytes_per_s : job.codecs[c].SecondsPerByte(link);
      // Each replica's tp ranks: every rank holds all of wte.
      const double bytes = model.tied_parameters * model.bytes_per_element * replicas * tp;
      // Two members: one exchange of the whole tensor, or a ring of two's two half-size rounds above 32 MiB.
      const int rounds = AllReduceRounds(2, model.tied_parameters * model.bytes_per_element);
      const double wire = model.tied_parameters * model.bytes_per_element * (c < 0 ? 1.0 : job.codecs[c].ratio) /
                          rounds;  // a round's message
      const double window = first == last ? 0 : rounds * WindowSeconds(job, link, wire);
      epilogue_start = std::max(
          epilogue_start, tied_ready[pair] + bytes * spb + window + rounds * 2 * round_trips(wire) * link.latency_s);
    }
  }
  // Gradient all-reduce per stage, overlapped with the last microbatch's backward (one bucket per
  // layer), or after the tied all-reduce with sequential sync.
  out.stage_allreduce_s.assign(pp, 0);
  double finish = epilogue_start, earliest_start = kInf;
  for (int s = 0; s < pp; ++s) {
    const int begin = plan.stage_begin[s], end = plan.stage_begin[s + 1];
    double start_last = 0, end_last = 0;
    for (int r = 0; r < plan.dp; ++r) {
      start_last = std::max(start_last, timelines[r]->last_backward_start[s]);
      end_last = std::max(end_last, timelines[r]->last_backward_end[s]);
    }
    std::vector<int> member_sites;
    for (int r = 0; r < plan.dp; ++r) member_sites.push_back(cluster.devices[plan.devices[r][s][0]].site);
    const double bytes = DataParallelParameters(model, begin, end, pp, tied_apart).PerRank(tp, split_replicated) *
                         model.bytes_per_element;
    DpRing ring;
    const double seconds = DataParallelAllReduce(cluster, job, plan, member_sites, bytes, collective_scale,
                                                 &traffic_gradient, &gradient_codec_used, &ring);
    // With split_replicated each replica's tp ranks then gather the others' slices of the replicated tensors (a ring
    // inside the replica's site), after the all-reduce's last bucket.
    double gather = 0;
    if (split_replicated && seconds > 0) {
      const double gathered = DataParallelParameters(model, begin, end, pp, false).replicated * model.bytes_per_element;
      for (int r = 0; r < plan.dp; ++r) {
        const LinkSpec link = CollectiveLink(cluster, cluster.devices[plan.devices[r][s][0]].site, collective_scale);
        gather = std::max(gather, (tp - 1.0) / tp * gathered / link.bandwidth_bytes_per_s + (tp - 1) * link.latency_s);
      }
    }
    out.stage_allreduce_s[s] = seconds + gather;
    if (seconds <= 0) continue;
    if (job.sequential_sync) {
      // Each bucket is an all-reduce of its own, after the last. A round's message is one stream's (one tp
      // rank's). `seconds` counted the stage's rounds once, at one latency each.
      const double extra = rounds_extra(
          member_sites, ring,
          GradientBucketBytes(model, begin, end, pp, tp, job.grad_bucket_bytes, tied_apart, split_replicated));
      out.stage_allreduce_s[s] = seconds + extra + gather;
      finish = std::max(finish, epilogue_start + seconds + extra + gather);
      earliest_start = std::min(earliest_start, epilogue_start);
      continue;
    }
    const int buckets = std::max(1, end - begin);
    finish = std::max(finish, std::max(end_last + seconds / buckets, start_last + seconds) + gather);
    earliest_start = std::min(earliest_start, start_last);
  }
  // Stages' all-reduces share the WAN: no link can carry its gradient bytes faster than its
  // bandwidth.
  if (earliest_start < kInf) {
    for (int a = 0; a < n_sites; ++a) {
      for (int c = 0; c < n_sites; ++c) {
        if (a == c || traffic_gradient[a][c] <= 0) continue;
        finish = std::max(finish, earliest_start + cluster.Link(a, c).latency_s +
                                      traffic_gradient[a][c] / cluster.Link(a, c).bandwidth_bytes_per_s);
      }
    }
  }
  out.dp_exposed_s = finish - epilogue_start;
  if (job.sequential_sync) {
    // Then two scalar rings, latency only: the gradient norm among each replica's stages, the loss
    // among the replicas' last stages.
    auto ring_latency = [&](const std::vector<int>& sites) {
      double worst = 0;
      for (size_t i = 0; i < sites.size(); ++i) {
        worst = std::max(worst, cluster.Link(sites[i], sites[(i + 1) % sites.size()]).latency_s);
      }
      return AllReduceRounds(static_cast<int>(sites.size()), sizeof(float)) * 2 * job.message_round_trips * worst;
    };
    double norm = 0;
    std::vector<int> last_sites;
    for (int r = 0; r < plan.dp; ++r) {
      std::vector<int> stage_sites;
      for (int s = 0; s < pp; ++s) stage_sites.push_back(cluster.devices[plan.devices[r][s][0]].site);
      norm = std::max(norm, ring_latency(stage_sites));
      last_sites.push_back(stage_sites.back());
    }
    out.scalar_sync_s = norm + ring_latency(last_sites);
    out.tied_sync_s = epilogue_start - out.pipeline_time_s;
    out.step_time_s = finish + out.scalar_sync_s + job.step_overhead_s;
  }

  for (int a = 0; a < n_sites; ++a) {
    for (int c = 0; c < n_sites; ++c) traffic_gradient[a][c] += traffic_tied[a][c];
  }
  // Tied wte gradients: the first and the last stage of each replica (each tp rank's pair: every rank holds all of
  // wte) send each other their partial gradient once both are complete (full duplex: both directions at once), then
  // both apply the sum.
  for (const auto& [pair, replicas] : tied_pairs) {
    const auto [first, last] = pair;
    const LinkSpec& link = cluster.Link(first, last);
    const double bytes = model.tied_parameters * model.bytes_per_element;  // one pair's
    const double copies = static_cast<double>(replicas) * tp;
    int c = -1;
    if (first != last) {
      c = plan.gradient_codec.empty() ? ChooseCodec(job, link, false) : plan.gradient_codec[first][last];
      traffic_gradient[first][last] += bytes * copies * (c < 0 ? 1.0 : job.codecs[c].ratio);
      traffic_gradient[last][first] += bytes * copies * (c < 0 ? 1.0 : job.codecs[c].ratio);
      gradient_codec_used[std::min(first, last)][std::max(first, last)] = c;
    }
    const double spb = c < 0 ? 1.0 / link.bandwidth_bytes_per_s : job.codecs[c].SecondsPerByte(link);
    const double window = first == last ? 0 : WindowSeconds(job, link, bytes * (c < 0 ? 1.0 : job.codecs[c].ratio));
    tied_sync = std::max(tied_sync, tied_ready[pair] + bytes * copies * spb + window + link.latency_s);
  }
  if (!job.sequential_sync) {
    tied_sync = std::max(tied_sync, tied_group_end);
    out.tied_sync_s = std::max(0.0, tied_sync - finish);
    out.step_time_s = std::max(finish, tied_sync) + job.step_overhead_s;
  }
  out.tokens_per_s = out.step_time_s > 0 ? total_sequences * static_cast<double>(model.seq_len) / out.step_time_s : 0;

  double used_flops = 0;
  for (int d = 0; d < static_cast<int>(used.size()); ++d) {
    if (!used[d]) continue;
    used_flops += cluster.devices[d].tflops * 1e12 * job.EfficiencyOf(cluster.devices[d].name);
  }
  out.compute_bound_s = 3 * model.TotalForwardFlops() * total_sequences / used_flops;
  out.max_memory_fraction = worst_memory_fraction;
  out.fits = reject.empty();
  out.reject_reason = reject;
  for (int a = 0; a < n_sites; ++a) {
    for (int c = a + 1; c < n_sites; ++c) {
      const double g = traffic_gradient[a][c] + traffic_gradient[c][a];
      const double x = traffic_activation[a][c] + traffic_activation[c][a];
      if (g + x <= 0) continue;
      LinkTraffic t;
      t.site_a = a;
      t.site_b = c;
      t.gradient_bytes = g;
      t.activation_bytes = x;
      t.bytes = g + x;
      t.gradient_codec = gradient_codec_used[a][c] == -2 ? "" : CodecName(job, gradient_codec_used[a][c]);
      t.activation_codec = activation_codec_used[a][c] == -2 ? "" : CodecName(job, activation_codec_used[a][c]);
      out.cross_site.push_back(t);
    }
  }
  return out;
}

}  // namespace

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
