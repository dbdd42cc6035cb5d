// Synchronous training or DiLoCo (see diloco_plan.h).
#include "scheduler/diloco_plan.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace geotrain::scheduler {
namespace {

double WanBytes(const Prediction& p) {
  double bytes = 0;
  for (const LinkTraffic& t : p.cross_site) bytes += t.bytes;
  return bytes;
}

// The sites of the plan's replicas, or empty when a replica spans sites.
std::set<int> ReplicaSites(const Cluster& cluster, const Plan& plan) {
  std::set<int> sites;
  for (const auto& replica : plan.devices) {
    std::set<int> own;
    for (const auto& stage : replica) {
      for (int d : stage) own.insert(cluster.devices[d].site);
    }
    if (own.size() != 1) return {};
    sites.insert(*own.begin());
  }
  return sites;
}

std::string Shape(const Plan& plan) { return absl::StrFormat("dp %d x pp %d x tp %d", plan.dp, plan.pp, plan.tp); }

// The site of each of the plan's replicas (each inside one site: ReplicaSites is not empty).
int SiteOfReplica(const Cluster& cluster, const Plan& plan, int replica) {
  return cluster.devices[plan.devices[replica].front().front()].site;
}

// Each site group's inner step alone, `sites` in order: its replicas of `plan` simulated on the free cluster;
// and each group's sequences per inner step.
absl::Status SimulateGroups(const Cluster& free, const ModelCosts& model, const JobOptions& job, const Plan& plan,
                            const std::set<int>& sites, std::vector<double>* step_s, std::vector<double>* sequences) {
  for (int site : sites) {
    Plan group = plan;
    group.devices.clear();
    group.microbatches.clear();
    for (int r = 0; r < plan.dp; ++r) {
      if (SiteOfReplica(free, plan, r) != site) continue;
      group.devices.push_back(plan.devices[r]);
      group.microbatches.push_back(plan.microbatches[r]);
    }
    group.dp = static_cast<int>(group.devices.size());
    JobOptions group_job = job;
    group_job.global_batch = 0;
    for (int m : group.microbatches) group_job.global_batch += m * plan.microbatch_size;
    ASSIGN_OR_RETURN(const Prediction p, Simulate(free, model, group_job, group));
    step_s->push_back(p.step_time_s);
    sequences->push_back(group_job.global_batch);
  }
  return absl::OkStatus();
}

// diloco.sync time over count pacing: the sequences a period trains when each group takes floor(k H) inner steps
// (k: how many times as fast as the slowest it is, at most 8), over H times every group's.
double TimePacedGain(const std::vector<double>& step_s, const std::vector<double>& sequences, int H) {
  const double slowest = *std::max_element(step_s.begin(), step_s.end());
  double paced = 0, counted = 0;
  for (size_t g = 0; g < step_s.size(); ++g) {
    if (!(step_s[g] > 0)) return 1;
    paced += std::clamp(std::floor(H * slowest / step_s[g]), 1.0 * H, 8.0 * H) * sequences[g];
    counted += H * sequences[g];
  }
  return counted > 0 ? paced / counted : 1;
}

// The other pseudo-gradient codecs, with the bytes and step time each would give (one line, for the explanation).
std::string CodecOffers(const Codec& chosen, double raw, int S, const LinkSpec& slowest, double inner_step_s, int H,
                        int F) {
  std::string out;
  for (const char* name : {"int8", "int4", "sparse:0.02:2"}) {
    absl::StatusOr<Codec> codec = ParseCodec(name);
    if (!codec.ok() || codec->name == chosen.name) continue;
    const double codec_s = codec->throughput_bytes_per_s > 0 ? 2 * raw / codec->throughput_bytes_per_s : 0;
    const double exchange_s = RingAllReduceSeconds(raw * codec->ratio, S, slowest) + codec_s;
    const double fragment_s = RingAllReduceSeconds(raw * codec->ratio / F, S, slowest) + codec_s / F;
    const double exposed = F == 1 ? exchange_s : F * std::max(0.0, fragment_s - inner_step_s);
    absl::StrAppend(&out, out.empty() ? "" : "; ",
                    absl::StrFormat("%s %.3f s per step, %.2f MB across sites per step", codec->name,
                                    inner_step_s + exposed / H, 2.0 * (S - 1) * raw * codec->ratio / H / 1e6));
  }
  return absl::StrCat(
      "other codecs for the pseudo-gradients (diloco.codec; their loss cost is measured in "
      "docs/diloco.md, not predicted): ",
      out);
}

}  // namespace

absl::StatusOr<DilocoChoice> ChooseSyncOrDiloco(const Cluster& cluster, const ModelCosts& model, const JobOptions& job,
                                                const PlannerOptions& options, const PlanResult& sync,
                                                const DilocoSpec& diloco) {
  DilocoChoice choice;
  if (sync.ranked.empty()) return absl::InvalidArgumentError("ChooseSyncOrDiloco: no synchronous plan to compare");
  absl::StatusOr<Codec> parsed = ParseCodec(diloco.codec().empty() ? "none" : diloco.codec());
  if (!parsed.ok()) return WithContext(parsed.status(), "diloco.codec");
  const Codec codec = *parsed;
  choice.sync = sync.ranked.front();
  choice.sync_step_s = choice.sync.prediction.step_time_s;
  choice.sync_wan_bytes_per_step = WanBytes(choice.sync.prediction);

  // The inner steps: the cluster with free links between sites, only plans whose replicas each sit in one
  // site and that use two sites or more.
  Cluster free = cluster;
  for (int a = 0; a < cluster.num_sites(); ++a) {
    for (int b = 0; b < cluster.num_sites(); ++b) {
      if (a != b) free.links[a][b] = LinkSpec{0, 1e15};
    }
  }
  PlannerOptions inner_options = options;
  inner_options.max_ranked = 1000;
  ASSIGN_OR_RETURN(const PlanResult inner, PlanJob(free, model, job, inner_options));
  const PlanCandidate* best = nullptr;
  std::set<int> best_sites;
  for (const PlanCandidate& c : inner.ranked) {
    const std::set<int> sites = ReplicaSites(cluster, c.plan);
    if (sites.size() < 2) continue;
    best = &c;
    best_sites = sites;
    break;  // ranked fastest first
  }
  const int H = std::max(1, diloco.inner_steps()), F = std::max(1, diloco.fragments());
  std::string codec_offers;
  if (best == nullptr) {
    choice.why_not = "no plan keeps each replica inside one site with replicas in two sites or more";
  } else {
    choice.diloco_possible = true;
    choice.diloco = *best;
    choice.diloco_sites = static_cast<int>(best_sites.size());
    choice.inner_step_s = best->prediction.step_time_s;
    LinkSpec slowest{0, 1e300};
    for (int a : best_sites) {
      for (int b : best_sites) {
        if (a == b) continue;
        slowest.latency_s = std::max(slowest.latency_s, cluster.Link(a, b).latency_s);
        slowest.bandwidth_bytes_per_s =
            std::min(slowest.bandwidth_bytes_per_s, cluster.Link(a, b).bandwidth_bytes_per_s);
      }
    }
    double parameters = 0;
    for (const LayerCost& l : model.layers) parameters += l.parameters;
    const double raw = parameters * model.bytes_per_element;
    const int S = choice.diloco_sites;
    // Encoding and decoding the pseudo-gradients on top of the wire time.
    const double codec_s = codec.throughput_bytes_per_s > 0 ? 2 * raw / codec.throughput_bytes_per_s : 0;
    choice.outer_exchange_s = RingAllReduceSeconds(raw * codec.ratio, S, slowest) + codec_s;
    const double fragment_s = RingAllReduceSeconds(raw * codec.ratio / F, S, slowest) + codec_s / F;
    const double exposed_per_sync =
        F == 1 ? choice.outer_exchange_s : F * std::max(0.0, fragment_s - choice.inner_step_s);
    choice.diloco_step_s = choice.inner_step_s + exposed_per_sync / H;
    choice.diloco_wan_bytes_per_step = 2.0 * (S - 1) * raw * codec.ratio / H;
    std::vector<double> sequences;
    RETURN_IF_ERROR(SimulateGroups(free, model, job, best->plan, best_sites, &choice.group_step_s, &sequences));
    choice.time_paced_gain = TimePacedGain(choice.group_step_s, sequences, H);
    choice.time_paced = diloco.sync() == "time";
    choice.diloco_batch_s = choice.time_paced ? choice.diloco_step_s / choice.time_paced_gain : choice.diloco_step_s;
    choice.diloco_chosen = choice.diloco_batch_s < choice.sync_step_s;
    codec_offers = CodecOffers(codec, raw, S, slowest, choice.inner_step_s, H, F);
  }

  const Prediction& s = choice.sync.prediction;
  choice.explanation.push_back(absl::StrFormat(
      "synchronous: %s (%s) predicts %.3f s per step, %.2f MB across sites per step", Shape(choice.sync.plan),
      choice.sync.subset, s.step_time_s, choice.sync_wan_bytes_per_step / 1e6));
  if (!choice.diloco_possible) {
    choice.explanation.push_back(absl::StrCat("DiLoCo: not possible here: ", choice.why_not));
  } else {
    choice.explanation.push_back(absl::StrFormat(
        "DiLoCo (inner_steps %d, codec %s, %d fragment%s): %s, replicas in %d sites, inner step %.3f s, outer "
        "exchange %.3f s every %d steps%s: %.3f s per step, %.2f MB across sites per step",
        H, codec.name, F, F == 1 ? "" : "s", Shape(choice.diloco.plan), choice.diloco_sites, choice.inner_step_s,
        choice.outer_exchange_s, H, F == 1 ? "" : " (overlapped with the next step)", choice.diloco_step_s,
        choice.diloco_wan_bytes_per_step / 1e6));
    std::string groups;
    for (double t : choice.group_step_s)
      absl::StrAppend(&groups, groups.empty() ? "" : ", ", absl::StrFormat("%.3f", t));
    if (choice.time_paced) {
      choice.explanation.push_back(absl::StrFormat(
          "paced by time (diloco.sync time): the sites' inner steps take %s s alone; the faster take more of them per "
          "outer step: %.2fx the tokens per second of count pacing, %.3f s per global batch of tokens",
          groups, choice.time_paced_gain, choice.diloco_batch_s));
    } else if (choice.time_paced_gain >= 1.05 && F == 1) {  // time pacing takes one fragment
      choice.explanation.push_back(absl::StrFormat(
          "the sites differ in speed (inner steps of %s s alone): diloco.sync time would let the faster take more "
          "inner steps per outer step, %.2fx the tokens per second",
          groups, choice.time_paced_gain));
    }
    choice.explanation.push_back(codec_offers);
    choice.explanation.push_back(
        choice.diloco_chosen
            ? absl::StrFormat("chose DiLoCo: %.2fx shorter steps%s, %.0fx fewer bytes across sites",
                              choice.sync_step_s / choice.diloco_batch_s,
                              choice.time_paced ? " (per global batch of tokens)" : "",
                              choice.sync_wan_bytes_per_step / std::max(1.0, choice.diloco_wan_bytes_per_step))
            : absl::StrFormat("chose synchronous training: DiLoCo's steps would be %.2fx as long",
                              choice.diloco_batch_s / choice.sync_step_s));
  }
  return choice;
}

}  // namespace geotrain::scheduler
