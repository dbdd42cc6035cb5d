// Internal to the simulator's files (cost_model.cc, cost_model_simulate.cc): the pieces of the cost model that
// the step simulation (Simulate, in cost_model_simulate.cc) shares with the rest of the model (memory, gradient
// buckets, calibration, the data-parallel all-reduce, in cost_model.cc). Callers use cost_model.h.
//
// cost_model.cc holds the model's costs, codecs, the pipeline's event-by-event simulation (SimulatePipeline), the
// data-parallel all-reduce (DataParallelAllReduce, below), memory and calibration. cost_model_simulate.cc checks a
// plan and puts a step together from those parts: stage compute, the pipeline, the tied-embedding and gradient
// all-reduces, and the traffic on every cross-site link.
// Thread safety: everything here is a pure function of its arguments (DataParallelAllReduce writes only through
// the pointers it is given), so calls may run at once on different threads.
#pragma once

#include <string>
#include <vector>

#include "scheduler/cluster.h"
#include "scheduler/cost_model.h"

namespace geotrain::scheduler::internal {

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

// Whether the stage [begin, end) holds a wte copy that the tied all-reduce sums apart from its data-parallel
// all-reduce (tied_apart: gRPC collectives with several replicas): the first and the last stage when pp > 1.
bool TiedCopyApart(const ModelCosts& model, int begin, int end, int pp, bool tied_apart);

// The parameters of the stage [begin, end), with the last stage's tied wte copy when pp > 1.
ParameterCount StageParameterCount(const ModelCosts& model, int begin, int end, int pp);

// Parameters, gradients and optimizer state of one tp rank of the stage: its shard of the sharded parameters, and
// the replicated ones whole.
double StageStateBytes(const ModelCosts& model, const JobOptions& job, int begin, int end, int pp, int tp, int dp);

// Forward FLOPs of layers [begin, end) per sequence.
double StageFlops(const ModelCosts& model, int begin, int end);

// The link inside site `site` as a collective sees it: collective_scale of its bandwidth.
LinkSpec CollectiveLink(const Cluster& cluster, int site, double collective_scale);

// Seconds one message of `wire` bytes from one site to another takes beyond its serialisation, because of its
// stream's flow-control window (JobOptions::wan_window_bytes): the first window goes at the link's rate, the rest
// at window / round trip when that is the slower.
double WindowSeconds(const JobOptions& job, const LinkSpec& link, double wire);

// The ring a stage's DP all-reduce runs its rounds on, as DataParallelAllReduce chose it: what each gradient
// bucket pays again with sequential_sync.
struct DpRing {
  int members = 1;             // the flat ring's ranks, or the hierarchical all-reduce's site leaders
  double round_latency = 0;    // latency of one of its rounds
  double counted_latency = 0;  // latency seconds the returned time already holds for those rounds
  LinkSpec wan;                // its slowest hop across sites (a message's window); bandwidth 0 when none
};

// How a data-parallel all-reduce's transfers inside sites see the machine (JobOptions::sites_share_one_host).
struct CollectiveHost {
  double collective_scale = 1;  // of the bandwidth inside a site: a ring inside one site, a flat ring across sites
  // > 0: every site's traffic goes through one host, which moves this many bytes per second in all (twice the
  // bandwidth inside a site, whose calibration has two ranks sending at once). gRPC's hierarchical all-reduce then
  // shares it among the transfers that run at once: in each of concurrent_groups groups (the stages' and tp
  // ranks' groups, which all-reduce together), every site's members but its leader send it their tensor, and
  // then it sends each of them the sum. One transfer alone goes at most at half of it.
  double host_bytes_per_s = 0;
  int concurrent_groups = 1;
  // > 0: the host's cores, which the leaders of the concurrent groups share for their codecs while the leaders' ring
  // runs, instead of the share of every rank of the plan at once that job.codecs' throughputs carry (codec_scale).
  double cores = 0;
  double codec_scale = 1;
  // The factor on job.codecs' throughputs while `coders` ranks code at once: their share of the cores over the share
  // of every rank that the throughputs carry; 1 when the host is not shared.
  double CodecRescale(int coders) const;
};

// Seconds per raw byte of job.codecs[c] (-1: none) on `link`, the codec's throughput multiplied by `rescale`
// (CollectiveHost::CodecRescale).
double CodedSecondsPerByte(const JobOptions& job, int c, const LinkSpec& link, double rescale);

// Gradient all-reduce of one stage's DP group (one per tp rank; the tp rings share the WAN), whose members sit in
// member_sites. Returns the seconds, describes its ring in *ring and adds the wire bytes of every cross-site hop to
// traffic[a][b] (ordered by direction) and the codec of each pair it crosses to used_codec[min][max]. The pointers
// are the caller's and must not be null.
double DataParallelAllReduce(const Cluster& cluster, const JobOptions& job, const Plan& plan,
                             const std::vector<int>& member_sites, double bytes_per_rank, const CollectiveHost& host,
                             std::vector<std::vector<double>>* traffic, std::vector<std::vector<int>>* used_codec,
                             DpRing* ring);

}  // namespace geotrain::scheduler::internal
