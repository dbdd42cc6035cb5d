// `geotrain plan`: the plan the head would run for a `plan: auto` job on a topology file, whether the job is given
// as --job SPEC or as --model with --global-batch and --seq-len: the head's own planning (head::RankAutoPlans) on
// the workers and links `cluster up` would bring up, allow_diloco and parallel.sites included; the ranked plans
// and the explanation follow; --json prints the same as one JSON object. Flags that change the planner's model
// (--efficiency, --codecs, --no-subsets, ...) make it a what-if on the planner alone (scheduler/planner.h), said
// in the output. --predict simulates the --job spec's manual plan (as the runtime runs it) instead of searching.
//
//   geotrain plan --topology utah_amsterdam.yaml --model gpt2-medium --global-batch 48 --seq-len
//   1024
//   geotrain plan --topology two_sites.yaml --job job.yaml --predict --json
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/flags.h"
#include "cli/registry.h"
#include "cli/support.h"
#include "common/spec.h"
#include "common/status.h"
#include "head/placement.h"
#include "model/config.h"
#include "scheduler/cluster.h"
#include "scheduler/cost_model.h"
#include "scheduler/planner.h"
#include "scheduler/spec_planning.h"
#include "worker/devices.h"

namespace geotrain::cli {
namespace {

struct PlanFlags {
  // A flag that changes the planner's model of the cluster (efficiency, codecs, the search...): the result is a
  // what-if, not the plan the head runs for `plan: auto`.
  bool what_if = false;
  bool allow_diloco = false;
  bool emulated = false;  // --emulated: the topology as `cluster up` emulates it (CPU workers, gRPC collectives)
  std::string sites;      // --sites: all, or NAME,NAME
  std::string topology;
  std::string model;  // a preset, or --job
  int global_batch = 0;
  int seq_len = 0;
  bool json = false;
  int top = 5;
  std::string codecs = "fp16,bf16";
  double efficiency = 0.40;
  double memory_headroom = 0.10;
  double intra_site_gbps = 100;
  double intra_site_latency_ms = 0.05;
  double intra_site_activation_gbps = 0;  // 0: intra_site_gbps
  std::string tp_degrees = "1,2,4,8";
  bool no_subsets = false;
  std::string job_spec;  // --job: model, batch, seq_len and WAN codec from a job spec
  bool predict = false;  // --predict: simulate the spec's manual plan
  bool runtime_plans = false;
  std::string efficiency_by_device;  // NAME=E,...
  double layer_overhead_us = 30;
  double step_overhead_ms = 0;
  bool sequential_sync = false;
  double message_round_trips = 1;
  double message_window_kib = 0;
  std::string shared_host_scale;  // N=SCALE,...
  bool sites_share_one_host = false;
  bool grpc_collectives = false;
  double wan_window_mb = 0;
  bool codecs_given = false;
};

// Parses "NAME=E,NAME=E" into JobOptions::efficiency_by_device.
absl::Status ParseEfficiencies(const std::string& text, std::map<std::string, double>* out) {
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    double e = 0;
    if (kv.first.empty() || !absl::SimpleAtod(kv.second, &e) || !(e > 0 && e <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--efficiency-by-device '", item, "': give NAME=EFFICIENCY with 0 < EFFICIENCY <= 1"));
    }
    (*out)[kv.first] = e;
  }
  return absl::OkStatus();
}

// The manual plan of `spec` as the runtime runs it on `cluster`: the runtime's stage slicing, the
// same microbatch count on every replica, and each actor on the device its placement names (worker
// ids as `cluster up` gives them: SITE-INDEX), else on the first free device of its site, else on
// the first free device.
absl::StatusOr<scheduler::Plan> PlanOfSpec(const JobSpec& spec, const scheduler::Cluster& cluster,
                                           const scheduler::ModelCosts& model) {
  const ParallelSpec& parallel = spec.parallel();
  if (parallel.plan() != "manual") {
    return absl::InvalidArgumentError("--predict needs a job spec with parallel: {plan: manual, ...}");
  }
  ASSIGN_OR_RETURN(scheduler::Plan shape, scheduler::RuntimePlanShape(spec, model));
  scheduler::Plan plan = std::move(shape);
  std::map<std::string, int> site_of;
  for (int s = 0; s < cluster.num_sites(); ++s) site_of[cluster.site_names[s]] = s;
  std::vector<char> used(cluster.devices.size(), 0);
  auto take = [&](int site, int worker) -> int {
    for (int d = 0; d < static_cast<int>(cluster.devices.size()); ++d) {
      const scheduler::Device& device = cluster.devices[d];
      if (used[d] || (site >= 0 && device.site != site) || (worker >= 0 && device.worker != worker)) continue;
      used[d] = 1;
      return d;
    }
    return -1;
  };
  plan.devices.assign(plan.dp, std::vector<std::vector<int>>(plan.pp, std::vector<int>(plan.tp, -1)));
  for (const PlacementSpec& pin : parallel.placement()) {
    int site = -1, worker = -1;
    if (!pin.worker().empty()) {
      const size_t dash = pin.worker().rfind('-');
      if (dash == std::string::npos || !site_of.count(pin.worker().substr(0, dash)) ||
          !absl::SimpleAtoi(pin.worker().substr(dash + 1), &worker)) {
        return absl::InvalidArgumentError(
            absl::StrCat("placement worker '", pin.worker(), "': expected SITE-INDEX as `cluster up` names workers"));
      }
      site = site_of[pin.worker().substr(0, dash)];
    } else if (!pin.site().empty()) {
      if (!site_of.count(pin.site())) {
        return absl::InvalidArgumentError(absl::StrCat("placement site '", pin.site(), "' is not in the topology"));
      }
      site = site_of[pin.site()];
    }
    if (pin.replica() >= plan.dp || pin.stage() >= plan.pp || pin.tp_rank() >= plan.tp) continue;
    int& slot = plan.devices[pin.replica()][pin.stage()][pin.tp_rank()];
    if (slot >= 0) continue;
    slot = take(site, worker);
    if (slot < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("no free device for the placement of replica ", pin.replica(), " stage ", pin.stage()));
    }
  }
  for (auto& replica : plan.devices) {
    for (auto& stage : replica) {
      for (int& d : stage) {
        if (d < 0) d = take(-1, -1);
        if (d < 0) return absl::InvalidArgumentError("the plan needs more devices than the topology has");
      }
    }
  }
  return plan;
}

// The workers and site links the head would see for `topology`: a worker per topology worker (SITE-INDEX), alive,
// with its devices (their capabilities included) as CUDA GPUs (the testbed the topology describes: NCCL inside a
// site) or, `emulated`, as `cluster up` starts them on this machine (CPU workers standing in for the GPUs, every
// collective on gRPC); and the links as configured (the head plans with what it measures, which the WAN emulator
// makes the configured figures).
absl::StatusOr<std::pair<std::vector<WorkerInfo>, std::vector<SiteLink>>> ClusterOfTopology(const Topology& topology,
                                                                                            bool emulated) {
  std::vector<WorkerInfo> workers;
  for (const TopologySite& site : topology.sites()) {
    for (int i = 0; i < site.workers_size(); ++i) {
      WorkerInfo w;
      w.set_worker_id(absl::StrCat(site.name(), "-", i));
      w.set_site(site.name());
      w.set_state(WORKER_ALIVE);
      for (const std::string& text : TopologyWorkerDevices(site.workers(i))) {
        ASSIGN_OR_RETURN(Device d, worker::ParseEmulatedDevice(text));
        if (!emulated) d.set_kind(DEVICE_KIND_CUDA);
        d.set_index(w.devices_size());
        *w.add_devices() = std::move(d);
      }
      workers.push_back(std::move(w));
    }
  }
  std::vector<SiteLink> links;
  for (const TopologyLink& l : topology.links()) {
    SiteLink link;
    link.set_a(l.a());
    link.set_b(l.b());
    link.set_latency_ms(l.latency_ms());
    link.set_bandwidth_mbps(l.bandwidth_mbps());
    links.push_back(std::move(link));
  }
  return std::make_pair(std::move(workers), std::move(links));
}

// The job to plan: --job's spec, or --model with --global-batch and --seq-len (the defaults a submitted spec
// gets); planned as `plan: auto`, with --allow-diloco and --sites on top.
absl::StatusOr<JobSpec> SpecToPlan(const PlanFlags& flags) {
  JobSpec spec;
  if (!flags.job_spec.empty()) {
    ASSIGN_OR_RETURN(spec, LoadJobSpecFile(flags.job_spec));
  } else if (!flags.model.empty()) {
    spec.mutable_model()->set_preset(flags.model);
    ApplyJobDefaults(&spec);
  } else {
    return absl::InvalidArgumentError("give --model PRESET or --job SPEC.yaml");
  }
  if (flags.global_batch != 0) spec.mutable_train()->set_global_batch(flags.global_batch);
  if (flags.seq_len != 0) spec.mutable_train()->set_seq_len(flags.seq_len);
  ParallelSpec* p = spec.mutable_parallel();
  if (p->plan() != "auto") {  // planned as the head plans an auto job; --predict simulates the manual plan
    const bool diloco = p->allow_diloco();
    p->Clear();
    p->set_plan("auto");
    p->set_allow_diloco(diloco);
    ApplyJobDefaults(&spec);
  }
  if (flags.allow_diloco) p->set_allow_diloco(true);
  if (!flags.sites.empty()) {
    p->clear_sites();
    for (absl::string_view site : absl::StrSplit(flags.sites, ',', absl::SkipEmpty())) p->add_sites(std::string(site));
  }
  RETURN_IF_ERROR(ValidateJobSpec(spec));
  return spec;
}

// Prints "geotrain plan: <message>" for an error in what the user asked and returns the exit code 2.
int PlanUsageError(const absl::Status& status) {
  std::fprintf(stderr, "geotrain plan: %s\n", std::string(status.message()).c_str());
  return 2;
}

// What the head would run for `plan: auto`: head::RankAutoPlans on the topology's workers and links.
int RunHeadPlan(const PlanFlags& flags, const Topology& topology) {
  absl::StatusOr<JobSpec> spec = SpecToPlan(flags);
  if (!spec.ok()) return PlanUsageError(spec.status());
  absl::StatusOr<std::pair<std::vector<WorkerInfo>, std::vector<SiteLink>>> cluster =
      ClusterOfTopology(topology, flags.emulated);
  if (!cluster.ok()) return PlanUsageError(cluster.status());
  absl::StatusOr<head::RankedAutoPlans> ranked =
      head::RankAutoPlans(*spec, cluster->first, cluster->second, std::max(flags.top, 1));
  if (!ranked.ok()) {
    std::fprintf(stderr, "geotrain plan: %s\n", std::string(ranked.status().message()).c_str());
    return 1;
  }
  absl::StatusOr<scheduler::SpecPlanning> planning = scheduler::PlanningForSpec(*spec);
  if (!planning.ok()) return PlanUsageError(planning.status());
  // The ranked plans the head chooses from, best first (the first is what it runs, or its DiLoCo form).
  scheduler::PlanResult result;
  for (const head::RankedAutoPlan& p : ranked->plans) result.ranked.push_back(p.candidate);
  result.explanation = ranked->explanation;
  result.plans_simulated = ranked->plans_simulated;
  result.planning_seconds = ranked->planning_seconds;
  const head::RankedAutoPlan& chosen = ranked->plans.front();
  const ParallelSpec& p = chosen.parallel;
  if (flags.json) {
    // The planner's JSON, with the plan the head runs (in job spec form) first.
    Json json = {{"head_runs", Json::parse(ToJson(p))},
                 {"predicted_step_seconds", JsonFigure(chosen.predicted_step_seconds, 6)}};
    const Json planner =
        Json::parse(scheduler::PlanResultToJson(ranked->cluster, planning->model, planning->job, result, flags.top));
    for (const auto& item : planner.items()) json[item.key()] = item.value();
    std::cout << DumpJson(json) << "\n";
    return 0;
  }
  std::set<std::string> sites;
  for (const PlacementSpec& pin : p.placement()) sites.insert(pin.site());
  const std::string runs =
      absl::StrFormat("dp %d x pp %d x tp %d, %d microbatches, %s%s on %s, predicted step %.3f s", p.dp(), p.pp(),
                      p.tp(), p.microbatches(), p.schedule(), p.sync() == "diloco" ? ", DiLoCo" : "",
                      absl::StrJoin(sites, "+"), chosen.predicted_step_seconds);
  std::cout << "geotrain plan: " << (flags.job_spec.empty() ? flags.model : flags.job_spec) << " on " << flags.topology
            << ", as the head plans `plan: auto`\n";
  std::cout << "the head runs: " << runs << "\n\n";
  std::cout << scheduler::FormatPlanResult(ranked->cluster, planning->model, planning->job, result, flags.top);
  return 0;
}

// The job a what-if plans, and how the planner searches for it.
struct WhatIfJob {
  std::optional<JobSpec> spec;  // --job's spec
  GPT2Config config;
  scheduler::JobOptions job;
  scheduler::PlannerOptions options;
};

// The job from --job (planned as the head plans a `plan: auto` job, scheduler::PlanningForSpec: its codec, the
// runtime's step end and plans) or from --model, with --global-batch and --seq-len on top. Errors name the flag.
absl::StatusOr<WhatIfJob> WhatIfJobOfFlags(const PlanFlags& flags) {
  WhatIfJob what;
  int global_batch = flags.global_batch, seq_len = flags.seq_len;
  absl::StatusOr<GPT2Config> config = absl::InvalidArgumentError("give --model or --job");
  if (!flags.job_spec.empty()) {
    ASSIGN_OR_RETURN(JobSpec spec, LoadJobSpecFile(flags.job_spec));
    if (global_batch != 0) spec.mutable_train()->set_global_batch(global_batch);
    if (seq_len != 0) spec.mutable_train()->set_seq_len(seq_len);
    absl::StatusOr<scheduler::SpecPlanning> planning = scheduler::PlanningForSpec(spec);
    if (!planning.ok()) return WithContext(planning.status(), flags.job_spec);
    config = planning->config;
    what.job = planning->job;
    what.options = planning->options;
    global_batch = what.job.global_batch;
    seq_len = what.job.seq_len;
    what.spec = std::move(spec);
  } else if (!flags.model.empty()) {
    config = GPT2Config::FromPreset(flags.model);
  }
  if (!config.ok()) return config.status();
  if (flags.predict && !what.spec) {
    return absl::InvalidArgumentError("--predict needs --job SPEC.yaml with a manual plan");
  }
  if (seq_len < 1 || seq_len > config->block_size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--seq-len %d must be between 1 and the model's block size %d", seq_len, config->block_size));
  }
  if (global_batch < 1) return absl::InvalidArgumentError("--global-batch must be a positive number of sequences");
  what.config = *std::move(config);
  what.job.global_batch = global_batch;
  what.job.seq_len = seq_len;
  return what;
}

// The flags that change the planner's model of the devices and the network: efficiencies, overheads, the links
// inside a site, the step end, flow-control windows, shared hosts.
absl::Status ApplyCostFlags(const PlanFlags& flags, scheduler::JobOptions* job) {
  job->efficiency = flags.efficiency;
  job->memory_headroom = flags.memory_headroom;
  job->layer_overhead_s = flags.layer_overhead_us * 1e-6;
  job->step_overhead_s = flags.step_overhead_ms * 1e-3;
  job->sequential_sync = job->sequential_sync || flags.sequential_sync;
  job->message_round_trips = flags.message_round_trips;
  job->message_window_bytes = flags.message_window_kib * 1024;
  job->sites_share_one_host = flags.sites_share_one_host;
  if (flags.intra_site_activation_gbps < 0 || flags.intra_site_gbps <= 0) {
    return absl::InvalidArgumentError(
        "--intra-site-gbps must be positive and --intra-site-activation-gbps 0 (the same) or positive");
  }
  if (flags.intra_site_activation_gbps > 0) {
    job->activation_bandwidth_scale = flags.intra_site_activation_gbps / flags.intra_site_gbps;
  }
  job->grpc_collectives = job->grpc_collectives || flags.grpc_collectives;
  if (flags.wan_window_mb < 0) {
    return absl::InvalidArgumentError("--wan-window-mb must be 0 (no window) or a positive number of MB");
  }
  job->wan_window_bytes = flags.wan_window_mb * 1e6;
  for (absl::string_view item : absl::StrSplit(flags.shared_host_scale, ',', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    int n = 0;
    double scale = 0;
    if (!absl::SimpleAtoi(kv.first, &n) || !absl::SimpleAtod(kv.second, &scale) || n < 1 || !(scale > 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shared-host-scale '", item, "': give DEVICES=SCALE, e.g. 2=0.7"));
    }
    job->shared_host_scale[n] = scale;
  }
  return ParseEfficiencies(flags.efficiency_by_device, &job->efficiency_by_device);
}

// The flags that shape the search: the codecs (with --job, the spec's unless --codecs is given), the
// tensor-parallel degrees, subsets, runtime plans only, and how many ranked plans to keep.
absl::Status ApplySearchFlags(const PlanFlags& flags, bool from_spec, scheduler::JobOptions* job,
                              scheduler::PlannerOptions* options) {
  if (!from_spec || flags.codecs_given) {
    job->codecs.clear();
    job->codec_on_every_link = false;  // a what-if: the cheapest of them per link
    job->finite_only_codec = false;
    for (absl::string_view name : absl::StrSplit(flags.codecs, ',', absl::SkipEmpty())) {
      if (name == "none") continue;
      absl::StatusOr<scheduler::Codec> codec = scheduler::ParseCodec(std::string(name));
      if (!codec.ok()) return WithContext(codec.status(), "--codecs");
      job->codecs.push_back(*codec);
      job->finite_only_codec = job->finite_only_codec || codec->finite_only;
    }
  }
  options->search_subsets = !flags.no_subsets;
  options->runtime_plans = options->runtime_plans || flags.runtime_plans;
  options->max_ranked = std::max(flags.top, 1);
  options->tp_degrees.clear();
  for (absl::string_view degree : absl::StrSplit(flags.tp_degrees, ',', absl::SkipEmpty())) {
    int t = 0;
    if (!absl::SimpleAtoi(degree, &t) || t < 1) {
      return absl::InvalidArgumentError("--tp-degrees takes positive integers, e.g. 1,2,4,8");
    }
    options->tp_degrees.push_back(t);
  }
  return absl::OkStatus();
}

// --predict: the step time of the --job spec's manual plan, as placed, on `cluster`.
int PrintPrediction(const PlanFlags& flags, const scheduler::Cluster& cluster, const scheduler::ModelCosts& model,
                    const WhatIfJob& what) {
  absl::StatusOr<scheduler::Plan> plan = PlanOfSpec(*what.spec, cluster, model);
  absl::StatusOr<scheduler::Prediction> prediction = plan.ok() ? scheduler::Simulate(cluster, model, what.job, *plan)
                                                               : absl::StatusOr<scheduler::Prediction>(plan.status());
  if (!prediction.ok()) return PlanUsageError(WithContext(prediction.status(), flags.job_spec));
  const scheduler::PlanCandidate candidate{*plan, *prediction, "as placed", "spec", {}};
  if (flags.json) {
    std::cout << scheduler::PlanCandidateToJson(cluster, model, candidate) << "\n";
  } else {
    std::cout << absl::StrFormat(
        "%s on %s: predicted step %.3f s (pipeline %.3f s, exposed all-reduce %.3f s, tied "
        "exchange %.3f s, bubble %.0f%%)%s\n",
        flags.job_spec, flags.topology, prediction->step_time_s, prediction->pipeline_time_s, prediction->dp_exposed_s,
        prediction->tied_sync_s, 100 * prediction->bubble_fraction,
        prediction->fits ? "" : absl::StrCat("; does not fit: ", prediction->reject_reason));
  }
  return 0;
}

// A what-if (flags that change the planner's model were given) or --predict: the planner alone on the topology.
int RunWhatIfPlan(const PlanFlags& flags, const Topology& topology) {
  if (flags.allow_diloco || !flags.sites.empty() || flags.emulated) {
    return PlanUsageError(absl::InvalidArgumentError(
        "--allow-diloco, --sites and --emulated plan as the head does; leave out the flags that change the "
        "planner's model (--efficiency, --codecs, --no-subsets, ...)"));
  }
  scheduler::ClusterOptions cluster_options;
  cluster_options.intra_site = {flags.intra_site_latency_ms * 1e-3, flags.intra_site_gbps * 1e9 / 8};
  absl::StatusOr<scheduler::Cluster> cluster = scheduler::ClusterFromTopology(topology, cluster_options);
  if (!cluster.ok()) return PlanUsageError(WithContext(cluster.status(), flags.topology));
  absl::StatusOr<WhatIfJob> what = WhatIfJobOfFlags(flags);
  if (!what.ok()) return PlanUsageError(what.status());
  if (absl::Status s = ApplyCostFlags(flags, &what->job); !s.ok()) return PlanUsageError(s);
  if (absl::Status s = ApplySearchFlags(flags, what->spec.has_value(), &what->job, &what->options); !s.ok()) {
    return PlanUsageError(s);
  }
  const scheduler::ModelCosts model = scheduler::ModelCosts::FromConfig(what->config, what->job.seq_len);
  if (flags.predict) return PrintPrediction(flags, *cluster, model, *what);
  absl::StatusOr<scheduler::PlanResult> result = scheduler::PlanJob(*cluster, model, what->job, what->options);
  if (!result.ok()) {
    std::fprintf(stderr, "geotrain plan: %s\n", std::string(result.status().message()).c_str());
    return 1;
  }
  if (flags.json) {
    std::cout << scheduler::PlanResultToJson(*cluster, model, what->job, *result, flags.top);
  } else {
    std::cout << "geotrain plan: " << (what->spec ? flags.job_spec : flags.model) << " ("
              << absl::StrFormat("%.0fM", what->config.NumParameters() / 1e6) << " parameters) on " << flags.topology
              << " (what-if: flags that change the planner's model were given, so this is not necessarily what "
                 "the head runs for plan: auto)\n";
    std::cout << scheduler::FormatPlanResult(*cluster, model, what->job, *result, flags.top);
  }
  return 0;
}

int RunPlan(const PlanFlags& flags) {
  absl::StatusOr<Topology> topology = LoadTopologyFile(flags.topology);
  if (!topology.ok()) return PlanUsageError(topology.status());
  if (!flags.what_if && !flags.predict) return RunHeadPlan(flags, *topology);
  return RunWhatIfPlan(flags, *topology);
}

void AddPlanCommands(CLI::App& app, Context& context) {
  auto flags = std::make_shared<PlanFlags>();
  CLI::App* plan = app.add_subcommand("plan",
                                      "Rank parallelisation plans (DP x PP x TP, stages, "
                                      "placement, codecs) for a topology and explain "
                                      "the best");
  plan->add_option("--topology", flags->topology, "topology file (YAML or JSON): sites, workers, links")->required();
  CLI::Option* model =
      plan->add_option("--model", flags->model, "model preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, ...)");
  CLI::Option* job = plan->add_option("--job", flags->job_spec,
                                      "job spec (YAML/JSON) giving the model, global batch, seq len and WAN codec; "
                                      "planned as the head plans `plan: auto` (--runtime-plans and "
                                      "--sequential-sync on)");
  model->excludes(job);
  plan->add_option("--global-batch", flags->global_batch, "sequences per optimizer step");
  plan->add_option("--seq-len", flags->seq_len, "tokens per sequence");
  plan->add_flag("--predict", flags->predict,
                 "simulate the --job spec's manual plan (runtime slicing, its placement) instead of "
                 "searching");
  plan->add_flag("--runtime-plans", flags->runtime_plans,
                 "search only plans the runtime runs as planned (its stage slicing, equal "
                 "microbatch counts per replica)");
  plan->add_option("--efficiency-by-device", flags->efficiency_by_device,
                   "calibrated efficiency per device name, NAME=E,NAME=E (overrides --efficiency)");
  plan->add_option("--layer-overhead-us", flags->layer_overhead_us,
                   "fixed cost per layer and microbatch forward, in us (backward pays it twice; "
                   "default 30)");
  plan->add_flag("--sequential-sync", flags->sequential_sync,
                 "model geotrain's runtime step end: tied, gradient, norm and loss all-reduces one "
                 "after the other after the schedule, no overlap with backward");
  plan->add_option("--message-round-trips", flags->message_round_trips,
                   "with --sequential-sync: round trips one message costs (default 1)");
  plan->add_option("--message-window-kib", flags->message_window_kib,
                   "with --sequential-sync: one more round trip per this many KiB of a message "
                   "(flow-control window; default 0: none)");
  plan->add_option("--shared-host-scale", flags->shared_host_scale,
                   "devices sharing one host: N=SCALE,... multiplies every device's efficiency "
                   "when the plan uses N devices");
  plan->add_flag("--sites-share-one-host", flags->sites_share_one_host,
                 "every site's traffic inside the site goes through one host (a timed or emulated cluster on one "
                 "machine): the sites a plan uses share the bandwidth inside a site, a collective's ranks the "
                 "host's throughput");
  plan->add_flag("--grpc-collectives", flags->grpc_collectives,
                 "collectives run on gRPC (CPU or timed-compute workers, no NCCL): data parallelism across sites "
                 "is gRPC's hierarchical all-reduce where a site holds several replicas, else one ring");
  plan->add_option("--wan-window-mb", flags->wan_window_mb,
                   "flow-control window of one stream across sites, in MB: each message across sites sends its "
                   "first window at the link's rate and the rest at most at window / round trip (default 0: none)");
  plan->add_option("--step-overhead-ms", flags->step_overhead_ms,
                   "fixed cost per optimizer step (optimizer, step barrier), in ms (default 0)");
  AddJsonFlag(plan, &flags->json);
  plan->add_option("--top", flags->top, "how many ranked plans to print (default 5)");
  plan->add_option_function<std::string>(
      "--codecs",
      [flags](const std::string& v) {
        flags->codecs = v;
        flags->codecs_given = true;
      },
      "codecs allowed on cross-site links: none, fp16, bf16, int8, topk:F, each optionally +zstd (default "
      "fp16,bf16; with --job the spec's wan_codec)");
  plan->add_option("--efficiency", flags->efficiency, "assumed achieved/peak FLOP/s per device (default 0.4)");
  plan->add_option("--memory-headroom", flags->memory_headroom,
                   "fraction of each device's memory kept free (default 0.1)");
  plan->add_option("--intra-site-gbps", flags->intra_site_gbps, "bandwidth inside a site (default 100)");
  plan->add_option("--intra-site-activation-gbps", flags->intra_site_activation_gbps,
                   "bandwidth inside a site for activations (pipeline sends, tensor-parallel all-reduces; default: "
                   "--intra-site-gbps)");
  plan->add_option("--intra-site-latency-ms", flags->intra_site_latency_ms,
                   "one-way latency inside a site (default 0.05)");
  plan->add_option("--tp-degrees", flags->tp_degrees, "tensor-parallel degrees to try (default 1,2,4,8)");
  plan->add_flag("--no-subsets", flags->no_subsets, "do not try leaving out slow devices or whole sites");
  plan->add_flag("--allow-diloco", flags->allow_diloco,
                 "let the plan be DiLoCo when it predicts a shorter step (parallel.allow_diloco)");
  plan->add_flag("--emulated", flags->emulated,
                 "plan for the topology as `cluster up` emulates it on this machine (CPU workers standing in for the "
                 "GPUs, collectives on gRPC), as the head of such a cluster does; default: the GPUs themselves");
  plan->add_option("--sites", flags->sites,
                   "sites the plan must use: all, or NAME,NAME (parallel.sites); the explanation says what it costs");
  plan->callback([flags, plan, &context]() {
    // Without these the answer is the head's for `plan: auto` (head::RankAutoPlans); with any, a what-if.
    for (const char* option :
         {"--efficiency", "--memory-headroom", "--intra-site-gbps", "--intra-site-activation-gbps",
          "--intra-site-latency-ms", "--tp-degrees", "--no-subsets", "--codecs", "--efficiency-by-device",
          "--layer-overhead-us", "--step-overhead-ms", "--sequential-sync", "--message-round-trips",
          "--message-window-kib", "--shared-host-scale", "--sites-share-one-host", "--grpc-collectives",
          "--wan-window-mb", "--runtime-plans"}) {
      flags->what_if = flags->what_if || plan->count(option) > 0;
    }
    context.exit_code = RunPlan(*flags);
  });
}

bool registered = RegisterCommands("plan", &AddPlanCommands);

}  // namespace
}  // namespace geotrain::cli
