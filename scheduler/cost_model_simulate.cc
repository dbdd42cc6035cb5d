// Simulate (see cost_model.h and docs/planner.md for the formulas): checks a plan, adjusts the links for a shared
// host, and puts one optimizer step together in phases: the stages' compute and memory, the 1F1B depth, the
// pipelines, the tied-embedding and gradient all-reduces, the step's end, and the traffic on every cross-site link.
// The parts it uses (SimulatePipeline, DataParallelAllReduce, memory) are in cost_model.cc.
#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/pipeline_schedule.h"
#include "common/status.h"
#include "model/precision.h"
#include "scheduler/cost_model.h"
#include "scheduler/cost_model_internal.h"

namespace geotrain::scheduler {
namespace {

using internal::CodedSecondsPerByte;
using internal::CollectiveHost;
using internal::CollectiveLink;
using internal::DataParallelAllReduce;
using internal::DpRing;
using internal::ParameterCount;
using internal::StageFlops;
using internal::StageParameterCount;
using internal::StageStateBytes;
using internal::TiedCopyApart;
using internal::WindowSeconds;

constexpr double kInf = std::numeric_limits<double>::infinity();

double GB(double bytes) { return bytes / 1e9; }

// The ranks that communicate at once in the calibration a one-host cluster's bandwidth inside a site comes from
// (bench/geo/timed_lib.py: DP2 and TP2 inside a site).
constexpr int kOneHostCalibrationRanks = 2;

// The link from site a to site b as messages of activations see it (JobOptions::activation_bandwidth_scale).
LinkSpec ActivationLink(const Cluster& cluster, const JobOptions& job, int a, int b) {
  LinkSpec link = cluster.Link(a, b);
  if (a == b) link.bandwidth_bytes_per_s *= job.activation_bandwidth_scale;
  return link;
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

std::string CodecName(const JobOptions& job, int c) { return c < 0 ? "none" : job.codecs[c].name; }

// A shared host's arithmetic (JobOptions::sites_share_one_host): collectives inside a site get collective_scale of
// the bandwidth inside the site, and each send between stages at most p2p_bytes_per_s.
struct HostShare {
  double collective_scale = 1;
  double p2p_bytes_per_s = kInf;
  double host_bytes_per_s = 0;  // 0: not shared (internal::CollectiveHost)
  double codec_scale = 1;       // what every codec's throughput was multiplied by: all ranks code at once
};

// One step of a checked plan, on the links as the plan sees them (Simulate adjusts them for a shared host). Run
// goes through the phases in order; each phase reads what the earlier ones left in the fields below. It refers to
// its arguments, which must outlive it, and is used once, by one thread.
class StepSimulation {
 public:
  StepSimulation(const Cluster& cluster, const ModelCosts& model, const JobOptions& job, const Plan& plan,
                 const HostShare& host);
  StepSimulation(const StepSimulation&) = delete;
  StepSimulation& operator=(const StepSimulation&) = delete;

  // The prediction; an error when a replica has no microbatch. `used` marks the devices the plan uses.
  absl::StatusOr<Prediction> Run(const std::vector<char>& used);

 private:
  // Round trips of one message of `wire` bytes with sequential sync (the runtime's messages).
  double RoundTrips(double wire) const {
    return job_.message_round_trips + (job_.message_window_bytes > 0 ? wire / job_.message_window_bytes : 0);
  }
  int ActivationCodecOf(int a, int c) const {
    if (!plan_.activation_codec.empty()) return plan_.activation_codec[a][c];
    return ChooseCodec(job_, cluster_.Link(a, c), /*activations=*/true);
  }
  int SiteOf(int r, int s) const { return cluster_.devices[plan_.devices[r][s][0]].site; }

  // Tensor parallelism with gRPC data parallelism across sites (a data-parallel group of some stage and tp rank in
  // more than one site): each tp rank sums 1/tp of the replicated tensors and gathers the rest inside its site
  // (worker/stage_collectives.h, split_replicated).
  bool SplitsReplicated() const;
  // Phase 1, memory and the per-stage compute of replica r: its stages' forward and backward seconds per
  // microbatch, its boundaries' transfers, and its activations' cross-site traffic.
  void ComputeReplicaStages(int r);
  // The memory of stage s of replica r on each of its tp devices (a stage that does not fit sets the rejection);
  // returns the slowest device's effective FLOP/s.
  double StageMemoryAndSpeed(int r, int s);
  // Phase 2: the 1F1B depth, the plan's or the one that covers the slowest replica boundary's round trip.
  int PipelineDepth() const;
  // Phase 3: each replica's pipeline, the slowest one's figures, and when each tied wte copy is complete.
  void SimulatePipelines(int depth);
  // The seconds an all-reduce of each of `buckets` (fp32 bytes per tp rank) on `ring` (among `member_sites`) waits
  // beyond what DataParallelAllReduce counted: each round's message pays the window across sites and, with
  // sequential_sync, 2 r latencies (a message and its ack) where it counted one.
  double RoundsExtra(const std::vector<int>& member_sites, const DpRing& ring,
                     const std::vector<double>& buckets) const;
  // Phase 4: the tied all-reduce of every copy (tied_apart).
  void TiedGroupAllReduce();
  // Phase 5: when the gradient all-reduces may start: after the pipeline, and with sequential sync after the tied
  // all-reduces.
  double EpilogueStart();
  // Phase 6: the gradient all-reduce of every stage, and the WAN's bound on them.
  void GradientAllReduces();
  // With split_replicated: the seconds each replica's tp ranks take to gather the others' slices of stage s's
  // replicated tensors after its all-reduce (a ring inside the replica's site), the slowest replica's.
  double ReplicatedGatherSeconds(int s, int begin, int end) const;
  // How `groups` all-reduces at once see the host (internal::CollectiveHost): its share when sites share one.
  CollectiveHost Collective(int groups) const;
  // Phase 7 with sequential sync: the scalar rings and the step time.
  void SequentialStepEnd();
  // Phase 8: the tied wte exchange of each replica's pair (its traffic, and the step time without sequential sync).
  void TiedPairExchanges();
  // Phase 9: throughput, the compute bound, memory and the traffic on each cross-site link.
  void Summarize(const std::vector<char>& used);

  const Cluster& cluster_;
  const ModelCosts& model_;
  const JobOptions& job_;
  const Plan& plan_;
  const HostShare& host_;
  const int pp_, tp_, b_, n_sites_;
  const double host_scale_;
  const double tokens_per_microbatch_;
  const bool tied_apart_;        // the tied wte copies are summed by one all-reduce of their own (see below)
  const bool split_replicated_;  // SplitsReplicated()

  Prediction out_;
  int total_sequences_ = 0;
  double worst_memory_fraction_ = 0;
  std::string reject_;
  // Cross-site traffic per ordered site pair, and the codec each unordered pair used (-2: none crossed it).
  std::vector<std::vector<double>> traffic_gradient_, traffic_activation_, traffic_tied_;
  std::vector<std::vector<int>> gradient_codec_used_, activation_codec_used_;
  // Per replica: its stages' seconds per microbatch, its boundaries' transfers, latencies, round trips and window
  // stalls, and the sites of its stages.
  std::vector<std::vector<double>> forward_of_, backward_of_, transfer_of_, latency_of_, round_trips_of_, stall_of_;
  std::vector<std::vector<int>> sites_of_;
  // Per replica, its pipeline's timeline (into simulated_: replicas that look alike share one).
  std::vector<const PipelineTimeline*> timelines_;
  std::map<std::vector<double>, PipelineTimeline> simulated_;
  int slowest_ = 0;
  // The tied wte gradient. With gRPC collectives and several replicas (tied_apart_), one all-reduce over every copy
  // (the first and the last stage of each replica: tied_sites_), routed as a data-parallel group, and the stages'
  // buckets leave wte out (worker/stage_collectives.cc); once every copy is complete (tied_group_ready_); it ends at
  // tied_group_end_. Otherwise each replica's first and last stage exchange theirs: (first, last) stage site pairs
  // -> replicas (tied_pairs_), and when their wte gradients are complete (tied_ready_).
  std::vector<int> tied_sites_;
  double tied_group_ready_ = 0;
  double tied_group_end_ = 0;
  std::map<std::pair<int, int>, int> tied_pairs_;
  std::map<std::pair<int, int>, double> tied_ready_;
  // The step's end: when the gradient all-reduces may start, when the last ends, and the earliest start.
  double epilogue_start_ = 0, finish_ = 0, earliest_start_ = kInf;
};

StepSimulation::StepSimulation(const Cluster& cluster, const ModelCosts& model, const JobOptions& job, const Plan& plan,
                               const HostShare& host)
    : cluster_(cluster),
      model_(model),
      job_(job),
      plan_(plan),
      host_(host),
      pp_(plan.pp),
      tp_(plan.tp),
      b_(plan.microbatch_size),
      n_sites_(cluster.num_sites()),
      host_scale_([&] {
        const auto scale = job.shared_host_scale.find(plan.dp * plan.pp * plan.tp);
        return scale == job.shared_host_scale.end() ? 1.0 : scale->second;
      }()),
      tokens_per_microbatch_(static_cast<double>(plan.microbatch_size) * model.seq_len),
      tied_apart_(job.grpc_collectives && plan.pp > 1 && plan.dp > 1),
      split_replicated_(SplitsReplicated()),
      traffic_gradient_(n_sites_, std::vector<double>(n_sites_, 0)),
      traffic_activation_(traffic_gradient_),
      traffic_tied_(traffic_gradient_),
      gradient_codec_used_(n_sites_, std::vector<int>(n_sites_, -2)),
      activation_codec_used_(gradient_codec_used_),
      forward_of_(plan.dp),
      backward_of_(plan.dp),
      transfer_of_(plan.dp),
      latency_of_(plan.dp),
      round_trips_of_(plan.dp),
      stall_of_(plan.dp),
      sites_of_(plan.dp, std::vector<int>(plan.pp)),
      timelines_(plan.dp) {
  out_.device_memory_bytes.assign(cluster.devices.size(), 0);
}

bool StepSimulation::SplitsReplicated() const {
  bool split_replicated = false;
  if (job_.grpc_collectives && tp_ > 1 && plan_.dp > 1) {
    for (int s = 0; s < pp_; ++s) {
      for (int k = 0; k < tp_; ++k) {
        for (int r = 1; r < plan_.dp; ++r) {
          split_replicated = split_replicated || cluster_.devices[plan_.devices[r][s][k]].site !=
                                                     cluster_.devices[plan_.devices[0][s][k]].site;
        }
      }
    }
  }
  return split_replicated;
}

absl::StatusOr<Prediction> StepSimulation::Run(const std::vector<char>& used) {
  for (int m : plan_.microbatches) {
    if (m < 1) return absl::InvalidArgumentError("plan: every replica needs at least one microbatch");
    total_sequences_ += m * plan_.microbatch_size;
  }
  for (int r = 0; r < plan_.dp; ++r) ComputeReplicaStages(r);
  const int depth = PipelineDepth();
  out_.pipeline_depth = depth;
  SimulatePipelines(depth);
  TiedGroupAllReduce();
  epilogue_start_ = EpilogueStart();
  GradientAllReduces();
  out_.dp_exposed_s = finish_ - epilogue_start_;
  if (job_.sequential_sync) SequentialStepEnd();
  TiedPairExchanges();
  Summarize(used);
  return out_;
}

double StepSimulation::StageMemoryAndSpeed(int r, int s) {
  const int begin = plan_.stage_begin[s], end = plan_.stage_begin[s + 1];
  double slowest_flops = kInf;
  for (int k = 0; k < tp_; ++k) {
    const Device& d = cluster_.devices[plan_.devices[r][s][k]];
    slowest_flops = std::min(slowest_flops, d.tflops * 1e12 * job_.EfficiencyOf(d.name) * host_scale_);
    const double mem =
        StageMemoryBytes(model_, job_, begin, end, s, pp_, tp_, plan_.dp, b_, plan_.microbatches[r], plan_.schedule);
    out_.device_memory_bytes[plan_.devices[r][s][k]] = mem;
    const double usable = UsableMemoryBytes(job_, d.mem_bytes);
    const double fraction = mem / usable;
    if (fraction > worst_memory_fraction_) {
      worst_memory_fraction_ = fraction;
      if (fraction > 1) {
        const double state = StageStateBytes(model_, job_, begin, end, pp_, tp_, plan_.dp);
        reject_ = absl::StrFormat(
            "stage %d (layers %s..%s) on %s at site %s needs %.2f GB of %.2f GB usable "
            "(parameters+gradients+optimizer %.2f GB, activations and buffers %.2f GB, fixed "
            "%.2f GB)",
            s, model_.layers[begin].name, model_.layers[end - 1].name, d.name, cluster_.site_names[d.site], GB(mem),
            GB(usable), GB(state), GB(mem - state - job_.fixed_memory_bytes), GB(job_.fixed_memory_bytes));
      }
    }
  }
  return slowest_flops;
}

void StepSimulation::ComputeReplicaStages(int r) {
  std::vector<double> forward(pp_), backward(pp_), transfer(std::max(pp_ - 1, 0)), latency(transfer), stall(transfer),
      message_round_trips;
  for (int s = 0; s < pp_; ++s) {
    const int begin = plan_.stage_begin[s], end = plan_.stage_begin[s + 1];
    const double slowest_flops = StageMemoryAndSpeed(r, s);
    const double flops = StageFlops(model_, begin, end) * b_;
    const int site = SiteOf(r, s);
    sites_of_[r][s] = site;
    LinkSpec tp_link = ActivationLink(cluster_, job_, site, site);
    tp_link.bandwidth_bytes_per_s *= host_.collective_scale;
    const double tp_comm =
        tp_ > 1
            ? StageBlocks(model_, begin, end) * 2 *
                  RingAllReduceSeconds(tokens_per_microbatch_ * model_.n_embd * model_.bytes_per_element, tp_, tp_link)
            : 0;
    const double overhead = (end - begin) * job_.layer_overhead_s;
    forward[s] = flops / (tp_ * slowest_flops) + tp_comm + overhead;
    backward[s] = 2 * flops / (tp_ * slowest_flops) + tp_comm + 2 * overhead;
    if (s + 1 >= pp_) continue;
    // The boundary to the next stage: its transfer, and the activations' cross-site traffic.
    const int next_site = SiteOf(r, s + 1);
    LinkSpec link = ActivationLink(cluster_, job_, site, next_site);
    link.bandwidth_bytes_per_s = std::min(link.bandwidth_bytes_per_s, host_.p2p_bytes_per_s);
    // Every tp rank sends its own copy of the boundary's activations to its peer of the next stage, at once: across
    // sites the copies share the link.
    if (site != next_site) link.bandwidth_bytes_per_s /= tp_;
    const double bytes = model_.layers[end - 1].output_bytes * b_;
    int c = -1;
    if (site != next_site) c = ActivationCodecOf(site, next_site);
    transfer[s] = bytes * CodedSecondsPerByte(job_, c, link, 1);
    if (site != next_site) stall[s] = WindowSeconds(job_, link, bytes * (c < 0 ? 1.0 : job_.codecs[c].ratio));
    latency[s] = link.latency_s;
    if (job_.sequential_sync) {
      message_round_trips.push_back(RoundTrips(bytes * (c < 0 ? 1.0 : job_.codecs[c].ratio)));
    }
    if (site != next_site) {
      const double wire = bytes * (c < 0 ? 1.0 : job_.codecs[c].ratio) * plan_.microbatches[r] * tp_;
      traffic_activation_[site][next_site] += wire;  // activations forward
      traffic_activation_[next_site][site] += wire;  // their gradients backward
      activation_codec_used_[std::min(site, next_site)][std::max(site, next_site)] = c;
    }
  }
  forward_of_[r] = std::move(forward);
  backward_of_[r] = std::move(backward);
  transfer_of_[r] = std::move(transfer);
  latency_of_[r] = std::move(latency);
  stall_of_[r] = std::move(stall);
  round_trips_of_[r] = std::move(message_round_trips);
}

int StepSimulation::PipelineDepth() const {
  int depth = plan_.schedule == Schedule::kGPipe ? pp_ : std::max(pp_, plan_.pipeline_depth);
  if (plan_.schedule == Schedule::k1F1B && plan_.pipeline_depth <= 0) {
    for (int r = 0; r < plan_.dp; ++r) {
      double one_way = 0, microbatch = 0;
      for (int s = 0; s < pp_; ++s) {
        microbatch = std::max(microbatch, forward_of_[r][s] + backward_of_[r][s]);
        if (s + 1 >= pp_) continue;
        // Arrival, as SimulatePipeline counts it: serialisation plus one latency, or 2 r - 1 with round trips.
        const double latencies = round_trips_of_[r].empty() ? 1.0 : 2 * round_trips_of_[r][s] - 1;
        one_way = std::max(one_way, transfer_of_[r][s] + stall_of_[r][s] + latencies * latency_of_[r][s]);
      }
      depth = std::max(depth, PipelineDepthFor(pp_, plan_.microbatches[r], one_way, microbatch));
    }
  }
  return depth;
}

void StepSimulation::SimulatePipelines(int depth) {
  double slowest_makespan = -1;
  for (int r = 0; r < plan_.dp; ++r) {
    // Replicas on identical devices and links behave identically: simulate each kind once.
    std::vector<double> signature;
    signature.reserve(6 * pp_ + 1);
    for (const auto* part :
         {&forward_of_[r], &backward_of_[r], &transfer_of_[r], &latency_of_[r], &round_trips_of_[r], &stall_of_[r]}) {
      signature.insert(signature.end(), part->begin(), part->end());
    }
    signature.push_back(plan_.microbatches[r]);
    signature.insert(signature.end(), sites_of_[r].begin(), sites_of_[r].end());
    auto known = simulated_.find(signature);
    if (known == simulated_.end()) {
      known =
          simulated_
              .emplace(std::move(signature), SimulatePipeline(forward_of_[r], backward_of_[r], transfer_of_[r],
                                                              latency_of_[r], plan_.microbatches[r], plan_.schedule,
                                                              round_trips_of_[r], depth, sites_of_[r], stall_of_[r]))
              .first;
    }
    timelines_[r] = &known->second;
    if (timelines_[r]->makespan > slowest_makespan) {
      slowest_makespan = timelines_[r]->makespan;
      slowest_ = r;
    }
    if (pp_ > 1) {
      const int first = SiteOf(r, 0);
      const int last = SiteOf(r, pp_ - 1);
      const double ready_r = std::max(timelines_[r]->last_backward_end[0], timelines_[r]->last_backward_end[pp_ - 1]);
      if (tied_apart_) {
        tied_sites_.push_back(first);
        tied_sites_.push_back(last);
        tied_group_ready_ = std::max(tied_group_ready_, ready_r);
      } else {
        ++tied_pairs_[{first, last}];
        double& ready = tied_ready_[{first, last}];
        ready = std::max(ready, ready_r);
      }
    }
  }
  out_.pipeline_time_s = slowest_makespan;
  out_.stage_forward_s = forward_of_[slowest_];
  out_.stage_backward_s = backward_of_[slowest_];
  const PipelineTimeline& t = *timelines_[slowest_];
  double busy = 0;
  for (double x : t.busy) busy += x;
  out_.bubble_fraction = t.makespan > 0 ? 1 - busy / pp_ / t.makespan : 0;
}

double StepSimulation::RoundsExtra(const std::vector<int>& member_sites, const DpRing& ring,
                                   const std::vector<double>& buckets) const {
  double ratio = 1;  // the codec of the group's first cross-site pair
  for (int m : member_sites) {
    if (m == member_sites[0]) continue;
    const int c = plan_.gradient_codec.empty() ? ChooseCodec(job_, cluster_.Link(member_sites[0], m), false)
                                               : plan_.gradient_codec[member_sites[0]][m];
    ratio = c < 0 ? 1.0 : job_.codecs[c].ratio;
    break;
  }
  double waited = 0;
  for (double bucket : buckets) {
    const int rounds = AllReduceRounds(ring.members, bucket);
    const double chunk = bucket / (rounds == 1 ? 1 : ring.members) * ratio;
    const double window = ring.wan.bandwidth_bytes_per_s > 0 ? WindowSeconds(job_, ring.wan, chunk) : 0;
    waited += rounds * ((job_.sequential_sync ? 2 * RoundTrips(chunk) : 1) * ring.round_latency + window);
  }
  return waited - ring.counted_latency;
}

void StepSimulation::TiedGroupAllReduce() {
  // It ends at tied_group_end_. Every tp rank holds all of wte (it is replicated, not sharded), so each rank's group
  // all-reduces the whole of it, or 1/tp of it with split_replicated. Its bytes join the gradients' after the
  // stages' bound on the WAN (GradientAllReduces), as each replica's pair does.
  if (!tied_apart_) return;
  const double bytes = model_.tied_parameters * model_.bytes_per_element / (split_replicated_ ? tp_ : 1);
  DpRing ring;
  const CollectiveHost host = Collective(tp_);
  const double seconds = DataParallelAllReduce(cluster_, job_, plan_, tied_sites_, bytes, host, &traffic_tied_,
                                               &gradient_codec_used_, &ring);
  tied_group_end_ = tied_group_ready_ + seconds + (seconds > 0 ? RoundsExtra(tied_sites_, ring, {bytes}) : 0);
}

double StepSimulation::EpilogueStart() {
  // Sequential sync (the runtime's step epilogue): the tied wte all-reduce first (each replica's pair: a ring of
  // two, both directions at once: its bytes once plus two latencies, when both stages are done), then the buckets.
  double epilogue_start = std::max(out_.pipeline_time_s, job_.sequential_sync ? tied_group_end_ : 0.0);
  if (!job_.sequential_sync) return epilogue_start;
  for (const auto& [pair, replicas] : tied_pairs_) {
    const auto [first, last] = pair;
    const LinkSpec& link = cluster_.Link(first, last);
    const int c = first == last                  ? -1
                  : plan_.gradient_codec.empty() ? ChooseCodec(job_, link, false)
                                                 : plan_.gradient_codec[first][last];
    // Each pair's two stages code at once, every tp rank of every replica.
    const double spb = CodedSecondsPerByte(job_, c, link, Collective(1).CodecRescale(2 * tp_ * plan_.dp));
    // Each replica's tp ranks: every rank holds all of wte.
    const double bytes = model_.tied_parameters * model_.bytes_per_element * replicas * tp_;
    // Two members: one exchange of the whole tensor, or a ring of two's two half-size rounds above 32 MiB.
    const int rounds = AllReduceRounds(2, model_.tied_parameters * model_.bytes_per_element);
    const double wire = model_.tied_parameters * model_.bytes_per_element * (c < 0 ? 1.0 : job_.codecs[c].ratio) /
                        rounds;  // a round's message
    const double window = first == last ? 0 : rounds * WindowSeconds(job_, link, wire);
    epilogue_start = std::max(
        epilogue_start, tied_ready_[pair] + bytes * spb + window + rounds * 2 * RoundTrips(wire) * link.latency_s);
  }
  return epilogue_start;
}

CollectiveHost StepSimulation::Collective(int groups) const {
  CollectiveHost host{.collective_scale = host_.collective_scale,
                      .host_bytes_per_s = host_.host_bytes_per_s,
                      .concurrent_groups = groups};
  if (host_.host_bytes_per_s > 0) {
    host.cores = kOneHostCalibrationRanks;  // as many coders as run at full speed: the codecs' share (Simulate)
    host.codec_scale = host_.codec_scale;
  }
  return host;
}

double StepSimulation::ReplicatedGatherSeconds(int s, int begin, int end) const {
  double gather = 0;
  const double gathered = DataParallelParameters(model_, begin, end, pp_, false).replicated * model_.bytes_per_element;
  for (int r = 0; r < plan_.dp; ++r) {
    const LinkSpec link = CollectiveLink(cluster_, SiteOf(r, s), host_.collective_scale);
    gather = std::max(gather, (tp_ - 1.0) / tp_ * gathered / link.bandwidth_bytes_per_s + (tp_ - 1) * link.latency_s);
  }
  return gather;
}

void StepSimulation::GradientAllReduces() {
  // Gradient all-reduce per stage, overlapped with the last microbatch's backward (one bucket per
  // layer), or after the tied all-reduce with sequential sync.
  out_.stage_allreduce_s.assign(pp_, 0);
  finish_ = epilogue_start_;
  earliest_start_ = kInf;
  for (int s = 0; s < pp_; ++s) {
    const int begin = plan_.stage_begin[s], end = plan_.stage_begin[s + 1];
    double start_last = 0, end_last = 0;
    for (int r = 0; r < plan_.dp; ++r) {
      start_last = std::max(start_last, timelines_[r]->last_backward_start[s]);
      end_last = std::max(end_last, timelines_[r]->last_backward_end[s]);
    }
    std::vector<int> member_sites;
    for (int r = 0; r < plan_.dp; ++r) member_sites.push_back(SiteOf(r, s));
    const double bytes = DataParallelParameters(model_, begin, end, pp_, tied_apart_).PerRank(tp_, split_replicated_) *
                         model_.bytes_per_element;
    DpRing ring;
    const CollectiveHost host = Collective(pp_ * tp_);
    const double seconds = DataParallelAllReduce(cluster_, job_, plan_, member_sites, bytes, host, &traffic_gradient_,
                                                 &gradient_codec_used_, &ring);
    // With split_replicated each replica's tp ranks then gather the others' slices of the replicated tensors (a ring
    // inside the replica's site), after the all-reduce's last bucket.
    const double gather = split_replicated_ && seconds > 0 ? ReplicatedGatherSeconds(s, begin, end) : 0;
    out_.stage_allreduce_s[s] = seconds + gather;
    if (seconds <= 0) continue;
    if (job_.sequential_sync) {
      // Each bucket is an all-reduce of its own, after the last. A round's message is one stream's (one tp
      // rank's). `seconds` counted the stage's rounds once, at one latency each.
      const double extra = RoundsExtra(
          member_sites, ring,
          GradientBucketBytes(model_, begin, end, pp_, tp_, job_.grad_bucket_bytes, tied_apart_, split_replicated_));
      out_.stage_allreduce_s[s] = seconds + extra + gather;
      finish_ = std::max(finish_, epilogue_start_ + seconds + extra + gather);
      earliest_start_ = std::min(earliest_start_, epilogue_start_);
      continue;
    }
    const int buckets = std::max(1, end - begin);
    finish_ = std::max(finish_, std::max(end_last + seconds / buckets, start_last + seconds) + gather);
    earliest_start_ = std::min(earliest_start_, start_last);
  }
  // Stages' all-reduces share the WAN: no link can carry its gradient bytes faster than its
  // bandwidth.
  if (earliest_start_ < kInf) {
    for (int a = 0; a < n_sites_; ++a) {
      for (int c = 0; c < n_sites_; ++c) {
        if (a == c || traffic_gradient_[a][c] <= 0) continue;
        finish_ = std::max(finish_, earliest_start_ + cluster_.Link(a, c).latency_s +
                                        traffic_gradient_[a][c] / cluster_.Link(a, c).bandwidth_bytes_per_s);
      }
    }
  }
}

void StepSimulation::SequentialStepEnd() {
  // Then two scalar rings, latency only: the gradient norm among each replica's stages, the loss
  // among the replicas' last stages.
  auto ring_latency = [&](const std::vector<int>& sites) {
    double worst = 0;
    for (size_t i = 0; i < sites.size(); ++i) {
      worst = std::max(worst, cluster_.Link(sites[i], sites[(i + 1) % sites.size()]).latency_s);
    }
    return AllReduceRounds(static_cast<int>(sites.size()), sizeof(float)) * 2 * job_.message_round_trips * worst;
  };
  double norm = 0;
  std::vector<int> last_sites;
  for (int r = 0; r < plan_.dp; ++r) {
    std::vector<int> stage_sites;
    for (int s = 0; s < pp_; ++s) stage_sites.push_back(SiteOf(r, s));
    norm = std::max(norm, ring_latency(stage_sites));
    last_sites.push_back(stage_sites.back());
  }
  out_.scalar_sync_s = norm + ring_latency(last_sites);
  out_.tied_sync_s = epilogue_start_ - out_.pipeline_time_s;
  out_.step_time_s = finish_ + out_.scalar_sync_s + job_.step_overhead_s;
}

void StepSimulation::TiedPairExchanges() {
  for (int a = 0; a < n_sites_; ++a) {
    for (int c = 0; c < n_sites_; ++c) traffic_gradient_[a][c] += traffic_tied_[a][c];
  }
  // Tied wte gradients: the first and the last stage of each replica (each tp rank's pair: every rank holds all of
  // wte) send each other their partial gradient once both are complete (full duplex: both directions at once), then
  // both apply the sum.
  double tied_sync = 0;
  for (const auto& [pair, replicas] : tied_pairs_) {
    const auto [first, last] = pair;
    const LinkSpec& link = cluster_.Link(first, last);
    const double bytes = model_.tied_parameters * model_.bytes_per_element;  // one pair's
    const double copies = static_cast<double>(replicas) * tp_;
    int c = -1;
    if (first != last) {
      c = plan_.gradient_codec.empty() ? ChooseCodec(job_, link, false) : plan_.gradient_codec[first][last];
      traffic_gradient_[first][last] += bytes * copies * (c < 0 ? 1.0 : job_.codecs[c].ratio);
      traffic_gradient_[last][first] += bytes * copies * (c < 0 ? 1.0 : job_.codecs[c].ratio);
      gradient_codec_used_[std::min(first, last)][std::max(first, last)] = c;
    }
    const double spb = CodedSecondsPerByte(job_, c, link, Collective(1).CodecRescale(2 * tp_ * plan_.dp));
    const double window = first == last ? 0 : WindowSeconds(job_, link, bytes * (c < 0 ? 1.0 : job_.codecs[c].ratio));
    tied_sync = std::max(tied_sync, tied_ready_[pair] + bytes * copies * spb + window + link.latency_s);
  }
  if (!job_.sequential_sync) {
    tied_sync = std::max(tied_sync, tied_group_end_);
    out_.tied_sync_s = std::max(0.0, tied_sync - finish_);
    out_.step_time_s = std::max(finish_, tied_sync) + job_.step_overhead_s;
  }
}

void StepSimulation::Summarize(const std::vector<char>& used) {
  out_.tokens_per_s =
      out_.step_time_s > 0 ? total_sequences_ * static_cast<double>(model_.seq_len) / out_.step_time_s : 0;
  double used_flops = 0;
  for (int d = 0; d < static_cast<int>(used.size()); ++d) {
    if (!used[d]) continue;
    used_flops += cluster_.devices[d].tflops * 1e12 * job_.EfficiencyOf(cluster_.devices[d].name);
  }
  out_.compute_bound_s = 3 * model_.TotalForwardFlops() * total_sequences_ / used_flops;
  out_.max_memory_fraction = worst_memory_fraction_;
  out_.fits = reject_.empty();
  out_.reject_reason = reject_;
  for (int a = 0; a < n_sites_; ++a) {
    for (int c = a + 1; c < n_sites_; ++c) {
      const double g = traffic_gradient_[a][c] + traffic_gradient_[c][a];
      const double x = traffic_activation_[a][c] + traffic_activation_[c][a];
      if (g + x <= 0) continue;
      LinkTraffic t;
      t.site_a = a;
      t.site_b = c;
      t.gradient_bytes = g;
      t.activation_bytes = x;
      t.bytes = g + x;
      t.gradient_codec = gradient_codec_used_[a][c] == -2 ? "" : CodecName(job_, gradient_codec_used_[a][c]);
      t.activation_codec = activation_codec_used_[a][c] == -2 ? "" : CodecName(job_, activation_codec_used_[a][c]);
      out_.cross_site.push_back(t);
    }
  }
}

// Checks the plan's shapes against the model and the cluster; marks in *used the devices it uses.
absl::Status CheckPlan(const Cluster& cluster, const ModelCosts& model, const Plan& plan, std::vector<char>* used) {
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
  used->assign(cluster.devices.size(), 0);
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
        if ((*used)[d]++) {
          return absl::InvalidArgumentError(absl::StrCat("plan: device ", d, " holds two actors"));
        }
      }
    }
  }
  return absl::OkStatus();
}

// The precision the plan trains in (JobOptions::precision): the job's, or auto resolved as the head resolves it for
// the GPUs the plan uses (the oldest of them).
absl::StatusOr<model::Precision> PlanPrecision(const Cluster& cluster, const JobOptions& job,
                                               const std::vector<char>& used) {
  if (!job.precision.empty() && job.precision != "auto") return model::ParsePrecision(job.precision);
  int oldest = 0;
  for (size_t d = 0; d < used.size(); ++d) {
    const int cc = cluster.devices[d].compute_capability;
    if (used[d] && cc > 0 && (oldest == 0 || cc < oldest)) oldest = cc;
  }
  return model::AutoPrecision(oldest, job.finite_only_codec);
}

}  // namespace

absl::StatusOr<Prediction> Simulate(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                    const Plan& plan) {
  std::vector<char> used;
  RETURN_IF_ERROR(CheckPlan(cluster, model, plan, &used));
  std::optional<Cluster> adjusted;  // the devices and links as this plan sees them
  auto adjust = [&]() -> Cluster& {
    if (!adjusted) adjusted = cluster;
    return *adjusted;
  };
  std::optional<JobOptions> adjusted_job;  // the job's figures as this plan sees them
  auto adjust_job = [&]() -> JobOptions& {
    if (!adjusted_job) adjusted_job = job;
    return *adjusted_job;
  };
  // In fp32 the GPUs compute on their CUDA cores, at their fp32 peak where it is known, and at the efficiency
  // calibrated for fp32 where there is one (JobOptions::efficiency_by_device).
  ASSIGN_OR_RETURN(const model::Precision precision, PlanPrecision(cluster, job, used));
  if (precision == model::Precision::kFp32) {
    for (size_t d = 0; d < cluster.devices.size(); ++d) {
      if (cluster.devices[d].fp32_tflops > 0) adjust().devices[d].tflops = cluster.devices[d].fp32_tflops;
    }
    for (const auto& [name, efficiency] : job.efficiency_by_device) {
      if (name.ends_with(kFp32EfficiencySuffix)) {
        adjust_job().efficiency_by_device[name.substr(0, name.size() - kFp32EfficiencySuffix.size())] = efficiency;
      }
    }
  }
  // A shared host's arithmetic (see JobOptions).
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
      for (int a = 0; a < cluster.num_sites(); ++a) adjust().links[a][a].bandwidth_bytes_per_s /= k;
    }
    for (int a : sites_used) {
      host.host_bytes_per_s =
          std::max(host.host_bytes_per_s, kOneHostCalibrationRanks * cluster.Link(a, a).bandwidth_bytes_per_s);
    }
    const int ranks = plan.dp * plan.pp * plan.tp;
    host.collective_scale = std::min(1.0, static_cast<double>(kOneHostCalibrationRanks) * k / ranks);
    // The codecs' encoding and decoding run on the same cores: when more ranks than the host runs at full speed
    // code at once (a collective's members all do), each gets its share of their throughput.
    const double codec_scale = std::min(1.0, static_cast<double>(kOneHostCalibrationRanks) / ranks);
    host.codec_scale = codec_scale;
    if (codec_scale < 1) {
      for (Codec& codec : adjust_job().codecs) codec.throughput_bytes_per_s *= codec_scale;
    }
  }
  StepSimulation step(adjusted ? *adjusted : cluster, model, adjusted_job ? *adjusted_job : job, plan, host);
  ASSIGN_OR_RETURN(Prediction prediction, step.Run(used));
  prediction.precision = std::string(model::PrecisionName(precision));
  return prediction;
}

}  // namespace geotrain::scheduler
