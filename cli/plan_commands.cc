// `geotrain plan`: ranks parallelisation plans for a model on a topology file with the planner
// (scheduler/planner.h) and explains the winner; --json prints the same as one JSON object.
//
//   geotrain plan --topology utah_amsterdam.yaml --model gpt2-medium --global-batch 48 --seq-len
//   1024
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "cli/registry.h"
#include "common/spec.h"
#include "model/config.h"
#include "scheduler/cluster.h"
#include "scheduler/cost_model.h"
#include "scheduler/planner.h"

namespace geotrain::cli {
namespace {

struct PlanFlags {
  std::string topology;
  std::string model = "gpt2";
  int global_batch = 0;
  int seq_len = 0;
  bool json = false;
  int top = 5;
  std::string codecs = "fp16,bf16";
  double efficiency = 0.40;
  double memory_headroom = 0.10;
  double intra_site_gbps = 100;
  double intra_site_latency_ms = 0.05;
  std::string tp_degrees = "1,2,4,8";
  bool no_subsets = false;
};

int RunPlan(const PlanFlags& flags) {
  absl::StatusOr<Topology> topology = LoadTopologyFile(flags.topology);
  if (!topology.ok()) {
    std::fprintf(stderr, "geotrain plan: %s\n", std::string(topology.status().message()).c_str());
    return 2;
  }
  scheduler::ClusterOptions cluster_options;
  cluster_options.intra_site = {flags.intra_site_latency_ms * 1e-3,
                                flags.intra_site_gbps * 1e9 / 8};
  absl::StatusOr<scheduler::Cluster> cluster =
      scheduler::ClusterFromTopology(*topology, cluster_options);
  if (!cluster.ok()) {
    std::fprintf(stderr, "geotrain plan: %s: %s\n", flags.topology.c_str(),
                 std::string(cluster.status().message()).c_str());
    return 2;
  }
  absl::StatusOr<GPT2Config> config = GPT2Config::FromPreset(flags.model);
  if (!config.ok()) {
    std::fprintf(stderr, "geotrain plan: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  if (flags.seq_len < 1 || flags.seq_len > config->block_size) {
    std::fprintf(stderr,
                 "geotrain plan: --seq-len %d must be between 1 and the model's block size %d\n",
                 flags.seq_len, config->block_size);
    return 2;
  }
  if (flags.global_batch < 1) {
    std::fprintf(stderr, "geotrain plan: --global-batch must be a positive number of sequences\n");
    return 2;
  }
  scheduler::JobOptions job;
  job.global_batch = flags.global_batch;
  job.seq_len = flags.seq_len;
  job.efficiency = flags.efficiency;
  job.memory_headroom = flags.memory_headroom;
  for (absl::string_view name : absl::StrSplit(flags.codecs, ',', absl::SkipEmpty())) {
    if (name == "none") continue;
    absl::StatusOr<scheduler::Codec> codec = scheduler::ParseCodec(std::string(name));
    if (!codec.ok()) {
      std::fprintf(stderr, "geotrain plan: --codecs: %s\n",
                   std::string(codec.status().message()).c_str());
      return 2;
    }
    job.codecs.push_back(*codec);
  }
  scheduler::PlannerOptions options;
  options.search_subsets = !flags.no_subsets;
  options.max_ranked = std::max(flags.top, 1);
  options.tp_degrees.clear();
  for (absl::string_view degree : absl::StrSplit(flags.tp_degrees, ',', absl::SkipEmpty())) {
    int t = 0;
    if (!absl::SimpleAtoi(degree, &t) || t < 1) {
      std::fprintf(stderr, "geotrain plan: --tp-degrees takes positive integers, e.g. 1,2,4,8\n");
      return 2;
    }
    options.tp_degrees.push_back(t);
  }
  const scheduler::ModelCosts model = scheduler::ModelCosts::FromConfig(*config, flags.seq_len);
  absl::StatusOr<scheduler::PlanResult> result = scheduler::PlanJob(*cluster, model, job, options);
  if (!result.ok()) {
    std::fprintf(stderr, "geotrain plan: %s\n", std::string(result.status().message()).c_str());
    return 1;
  }
  if (flags.json) {
    std::cout << scheduler::PlanResultToJson(*cluster, model, job, *result, flags.top);
  } else {
    std::cout << "geotrain plan: " << flags.model << " ("
              << absl::StrFormat("%.0fM", config->NumParameters() / 1e6) << " parameters) on "
              << flags.topology << "\n";
    std::cout << scheduler::FormatPlanResult(*cluster, model, job, *result, flags.top);
  }
  return 0;
}

void AddPlanCommands(CLI::App& app, Context& context) {
  auto flags = std::make_shared<PlanFlags>();
  CLI::App* plan = app.add_subcommand("plan",
                                      "Rank parallelisation plans (DP x PP x TP, stages, "
                                      "placement, codecs) for a topology and explain "
                                      "the best");
  plan->add_option("--topology", flags->topology,
                   "topology file (YAML or JSON): sites, workers, links")
      ->required();
  plan->add_option("--model", flags->model,
                   "model preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, ...)")
      ->required();
  plan->add_option("--global-batch", flags->global_batch, "sequences per optimizer step")
      ->required();
  plan->add_option("--seq-len", flags->seq_len, "tokens per sequence")->required();
  plan->add_flag("--json", flags->json, "print the result as JSON");
  plan->add_option("--top", flags->top, "how many ranked plans to print (default 5)");
  plan->add_option(
      "--codecs", flags->codecs,
      "codecs allowed on cross-site links: none, fp16, bf16, int8, topk:F (default fp16,bf16)");
  plan->add_option("--efficiency", flags->efficiency,
                   "assumed achieved/peak FLOP/s per device (default 0.4)");
  plan->add_option("--memory-headroom", flags->memory_headroom,
                   "fraction of each device's memory kept free (default 0.1)");
  plan->add_option("--intra-site-gbps", flags->intra_site_gbps,
                   "bandwidth inside a site (default 100)");
  plan->add_option("--intra-site-latency-ms", flags->intra_site_latency_ms,
                   "one-way latency inside a site (default 0.05)");
  plan->add_option("--tp-degrees", flags->tp_degrees,
                   "tensor-parallel degrees to try (default 1,2,4,8)");
  plan->add_flag("--no-subsets", flags->no_subsets,
                 "do not try leaving out slow devices or whole sites");
  plan->callback([flags, &context]() { context.exit_code = RunPlan(*flags); });
}

bool registered = RegisterCommands("plan", &AddPlanCommands);

}  // namespace
}  // namespace geotrain::cli
