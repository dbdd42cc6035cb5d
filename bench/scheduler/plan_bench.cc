// Planning time of the planner (scheduler/planner.h) on generated topologies: 64 devices in 4 sites
// (goal <= 1 s) and 1,024 devices in 16 sites (goal <= 10 s). Prints one line per run and a summary
// with medians. The in-run reference (alternating A B A B) is the same search restricted to all
// devices (no subsets of sites or device types): the ratio is what the subset search costs, and its
// winner's step time what it buys.
//
//   build/bench/scheduler/plan_bench [--runs 5] [--model gpt2-xl] [--max-devices N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "scheduler/cluster.h"
#include "scheduler/cost_model.h"
#include "scheduler/planner.h"

namespace geotrain::scheduler {
namespace {

struct Kind {
  const char* name;
  double tflops;
  double mem_gb;
};
constexpr Kind kKinds[] = {{"A100", 312, 80}, {"A30", 165, 24}, {"RTX6000", 130.5, 24}, {"T4", 65, 16}};

// `sites` sites of `per_site` devices (workers of 8; device kinds rotate by site so the cluster is
// mixed); site-to-site latency and bandwidth drawn uniformly from the given ranges by a fixed
// pseudo-random sequence.
Cluster Generate(int sites, int per_site, double min_ms, double max_ms, double min_gbps, double max_gbps) {
  Cluster c;
  uint64_t x = 88172645463325252ull;
  auto next = [&x]() {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return static_cast<double>(x % 1000000) / 1e6;
  };
  for (int s = 0; s < sites; ++s) {
    c.site_names.push_back("site" + std::to_string(s));
    for (int d = 0; d < per_site; ++d) {
      const Kind& k = kKinds[(s + d / (per_site / 2 > 0 ? per_site / 2 : 1)) % 4];
      c.devices.push_back(Device{s, d / 8, d % 8, k.name, k.tflops, k.mem_gb * 1e9});
    }
  }
  c.links.assign(sites, std::vector<LinkSpec>(sites));
  for (int a = 0; a < sites; ++a) {
    c.links[a][a] = ClusterOptions{}.intra_site;
    for (int b = a + 1; b < sites; ++b) {
      const LinkSpec l{(min_ms + (max_ms - min_ms) * next()) * 1e-3,
                       (min_gbps + (max_gbps - min_gbps) * next()) * 1e9 / 8};
      c.links[a][b] = c.links[b][a] = l;
    }
  }
  return c;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

int Main(int argc, char** argv) {
  int runs = 5;
  std::string preset = "gpt2-xl";
  int max_devices = 1 << 30;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--runs")) runs = std::max(1, std::atoi(argv[i + 1]));
    if (!std::strcmp(argv[i], "--model")) preset = argv[i + 1];
    if (!std::strcmp(argv[i], "--max-devices")) max_devices = std::atoi(argv[i + 1]);
  }
  absl::StatusOr<GPT2Config> config = GPT2Config::FromPreset(preset);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  struct Case {
    const char* name;
    int sites, per_site, global_batch;
    double min_ms, max_ms, min_gbps, max_gbps;
    double goal_s;
  };
  const Case cases[] = {{"64 devices / 4 sites, WAN 5-100 ms 1-10 Gbit/s", 4, 16, 512, 5, 100, 1, 10, 1.0},
                        {"64 devices / 4 sites, metro 1-5 ms 25-100 Gbit/s", 4, 16, 512, 1, 5, 25, 100, 1.0},
                        {"1024 devices / 16 sites, WAN 5-100 ms 1-10 Gbit/s", 16, 64, 2048, 5, 100, 1, 10, 10.0},
                        {"1024 devices / 16 sites, metro 1-5 ms 25-100 Gbit/s", 16, 64, 2048, 1, 5, 25, 100, 10.0}};
  const int seq_len = 1024;
  const ModelCosts model = ModelCosts::FromConfig(*config, seq_len);
  std::printf("model %s, seq_len %d, %d runs per case\n", preset.c_str(), seq_len, runs);
  std::vector<std::string> summary;
  for (const Case& k : cases) {
    if (k.sites * k.per_site > max_devices) continue;
    const Cluster cluster = Generate(k.sites, k.per_site, k.min_ms, k.max_ms, k.min_gbps, k.max_gbps);
    JobOptions job;
    job.global_batch = k.global_batch;
    job.seq_len = seq_len;
    for (const char* codec : {"fp16", "bf16", "int8"}) job.codecs.push_back(*ParseCodec(codec));
    std::vector<double> seconds, reference_seconds;
    double reference_step = 0;
    PlannerOptions no_subsets;
    no_subsets.search_subsets = false;
    int64_t simulated = 0;
    std::string winner;
    for (int run = 0; run < runs; ++run) {
      const auto t0 = std::chrono::steady_clock::now();
      absl::StatusOr<PlanResult> r = PlanJob(cluster, model, job);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!r.ok()) {
        std::fprintf(stderr, "%s: %s\n", k.name, std::string(r.status().message()).c_str());
        return 1;
      }
      seconds.push_back(s);
      simulated = r->plans_simulated;
      const PlanCandidate& best = r->ranked.front();
      winner = absl::StrFormat("dp=%d pp=%d tp=%d mb=%d %s, %zu devices left out (%s), %.3f s/step", best.plan.dp,
                               best.plan.pp, best.plan.tp, best.plan.microbatch_size, ScheduleName(best.plan.schedule),
                               best.left_out.size(), best.subset, best.prediction.step_time_s);
      // Reference in the same run (A B A B): the same search on all devices only, no subsets.
      const auto r0 = std::chrono::steady_clock::now();
      absl::StatusOr<PlanResult> reference = PlanJob(cluster, model, job, no_subsets);
      reference_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - r0).count());
      if (reference.ok()) reference_step = reference->ranked.front().prediction.step_time_s;
      std::printf("%s run %d: planning %.3f s, %lld plans simulated; winner %s\n", k.name, run + 1, s,
                  static_cast<long long>(simulated), winner.c_str());
    }
    const double median = Median(seconds);
    summary.push_back(absl::StrFormat("| %s | %d | %.3f | %.3f | %.3f | %lld | %.3f (%.2fx) | %.3f s/step | %s | %s |",
                                      k.name, k.global_batch, median, *std::min_element(seconds.begin(), seconds.end()),
                                      *std::max_element(seconds.begin(), seconds.end()),
                                      static_cast<long long>(simulated), Median(reference_seconds),
                                      median / Median(reference_seconds), reference_step,
                                      median <= k.goal_s ? absl::StrFormat("met (<= %.0f s)", k.goal_s)
                                                         : absl::StrFormat("MISSED (<= %.0f s)", k.goal_s),
                                      winner));
  }
  std::printf(
      "\n| case | global batch | median s | min s | max s | plans simulated | reference: all "
      "devices only, "
      "median s (ratio) | reference winner | goal | winner "
      "|\n|---|---|---|---|---|---|---|---|---|---|\n");
  for (const std::string& line : summary) std::printf("%s\n", line.c_str());
  return 0;
}

}  // namespace
}  // namespace geotrain::scheduler

int main(int argc, char** argv) { return geotrain::scheduler::Main(argc, argv); }
