// Placement of a job's actors and the planning of `plan: auto` jobs (see placement.h).
#include "head/placement.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/codec_spec.h"
#include "common/spec.h"
#include "common/status.h"
#include "model/config.h"
#include "model/precision.h"
#include "scheduler/diloco_plan.h"
#include "scheduler/planner.h"
#include "scheduler/spec_planning.h"

namespace geotrain::head {

std::string ActorId(const std::string& job_id, int r, int s, int t) {
  return absl::StrCat(job_id, "-r", r, "s", s, "t", t);
}

namespace {

// Emulated devices (--emulate-device) carry a GPU's figures while the CPU computes: a plan's predicted step
// time is the GPU's and the measured one the CPU's. Says so, so that nobody reads the gap as a planner error.
std::string EmulatedDevicesNote(const std::vector<WorkerInfo>& workers, double predicted_step_seconds) {
  std::set<std::string> names, timed;
  for (const WorkerInfo& w : workers) {
    for (const Device& d : w.devices()) {
      if (d.kind() == DEVICE_KIND_EMULATED) (d.timed_compute() ? timed : names).insert(d.name());
    }
  }
  if (names.empty() && timed.empty()) return "";
  if (names.empty()) {
    // Timed compute: the workers wait those GPUs' time, so prediction and measurement are both in it.
    return absl::StrFormat(
        "note: the devices planned on are emulated with timed compute (%s): the measured step times are EMULATED "
        "(each op waits the device's time, nothing is computed, losses are not real); the predicted %.3f s per "
        "step and the measured ones are both in those GPUs' time",
        absl::StrJoin(timed, ", "), predicted_step_seconds);
  }
  names.insert(timed.begin(), timed.end());
  return absl::StrFormat(
      "note: the devices planned on are emulated (%s): the predicted %.3f s per step is for those GPUs, while this "
      "cluster computes on its CPUs, so measured steps will take far longer; compare plans with each other, not "
      "with the measured time",
      absl::StrJoin(names, ", "), predicted_step_seconds);
}

// The alive workers' devices and the measured site links in the planner's terms.
struct PlanningCluster {
  scheduler::Cluster cluster;
  int alive_workers = 0;
  std::map<std::pair<std::string, int>, int> device_of;  // (worker id, device index) -> Cluster::devices index
  // Some device is not CUDA: collectives run on gRPC (worker/collectives.h), data parallelism across sites by
  // gRPC's hierarchical all-reduce or a ring (worker/stage_collectives.cc).
  bool grpc_collectives = false;
};

// A device's dense peak TFLOP/s for the job's train.precision: the peak of that precision where the device reports
// it (fp32 runs on the CUDA cores, a fraction of the tensor cores' rate), else its planning figure (the tensor
// cores' fp16/bf16 peak for a GPU, measured for a CPU). auto becomes bf16 or fp16 on GPUs, whose peaks are that one.
double PeakTflops(const Device& d, const std::string& precision) {
  const double peak = precision == "fp32"   ? d.fp32_tflops()
                      : precision == "bf16" ? d.bf16_tflops()
                      : precision == "fp16" ? d.fp16_tflops()
                                            : 0;
  return peak > 0 ? peak : d.tflops();
}

absl::StatusOr<PlanningCluster> ClusterForPlanning(const std::vector<WorkerInfo>& workers,
                                                   const std::vector<SiteLink>& links, const std::string& precision) {
  PlanningCluster out;
  scheduler::Cluster& cluster = out.cluster;
  std::map<std::string, int> site_index;
  std::map<std::string, int> workers_in_site;
  std::vector<const WorkerInfo*> alive;
  for (const WorkerInfo& w : workers) {
    if (Placeable(w)) alive.push_back(&w);
  }
  std::sort(alive.begin(), alive.end(), [](const WorkerInfo* a, const WorkerInfo* b) {
    return std::tie(a->site(), a->worker_id()) < std::tie(b->site(), b->worker_id());
  });
  if (alive.empty()) return absl::UnavailableError("no alive workers to plan for");
  out.alive_workers = static_cast<int>(alive.size());
  for (const WorkerInfo* w : alive) {
    if (!site_index.count(w->site())) {
      site_index[w->site()] = static_cast<int>(cluster.site_names.size());
      cluster.site_names.push_back(w->site());
    }
    const int worker = workers_in_site[w->site()]++;
    for (int d = 0; d < w->devices_size(); ++d) {
      // A GPU that cannot run the job's precision (bf16 asked of a Turing GPU; any precision of a GPU older than
      // this build's oldest) is no device for this job: the plan leaves it out rather than fail on it.
      absl::StatusOr<model::Precision> asked = model::ParsePrecision(precision);
      const int cc = w->devices(d).compute_capability();
      if (cc > 0 && (cc < model::kMinComputeCapability || (asked.ok() && !model::PrecisionSupported(*asked, cc)))) {
        continue;
      }
      scheduler::Device device;
      device.site = site_index[w->site()];
      device.worker = worker;
      device.slot = d;
      device.name = w->devices(d).name();
      device.tflops = std::max(1e-3, PeakTflops(w->devices(d), precision));
      device.mem_bytes = static_cast<double>(w->devices(d).memory_bytes());
      device.compute_capability = w->devices(d).compute_capability();
      device.fp32_tflops = w->devices(d).fp32_tflops();
      out.grpc_collectives = out.grpc_collectives || w->devices(d).kind() != DEVICE_KIND_CUDA;
      out.device_of[{w->worker_id(), d}] = static_cast<int>(cluster.devices.size());
      cluster.devices.push_back(device);
    }
  }
  const int n = cluster.num_sites();
  const scheduler::ClusterOptions defaults;
  cluster.links.assign(n, std::vector<scheduler::LinkSpec>(n, scheduler::LinkSpec{1e-3, 1e9 / 8}));
  for (int a = 0; a < n; ++a) cluster.links[a][a] = defaults.intra_site;
  for (const SiteLink& l : links) {
    if (l.a() == l.b() || !site_index.count(l.a()) || !site_index.count(l.b()) || l.bandwidth_mbps() <= 0) continue;
    const scheduler::LinkSpec measured{std::max(1e-6, l.latency_ms() / 1e3), l.bandwidth_mbps() * 1e6 / 8};
    cluster.links[site_index[l.a()]][site_index[l.b()]] = measured;
    cluster.links[site_index[l.b()]][site_index[l.a()]] = measured;
  }
  return out;
}

}  // namespace

uint64_t EstimateActorMemory(const JobSpec& spec, int stage) {
  absl::StatusOr<double> bytes = scheduler::SpecStageMemoryBytes(spec, stage);
  return bytes.ok() ? static_cast<uint64_t>(std::ceil(*bytes)) : 0;
}

absl::StatusOr<PrecisionChoice> ChoosePrecision(const JobSpec& spec, const std::vector<ActorPlacement>& placement,
                                                const std::vector<WorkerInfo>& workers) {
  // The devices the actors hold, each once, with its site.
  struct Placed {
    const Device* device;
    std::string site;
  };
  std::map<std::pair<std::string, int>, Placed> placed;
  for (const ActorPlacement& p : placement) {
    for (const WorkerInfo& w : workers) {
      if (w.worker_id() != p.actor.worker_id()) continue;
      for (const Device& d : w.devices()) {
        if (d.index() == p.actor.device_index()) placed[{w.worker_id(), d.index()}] = {&d, p.site};
      }
    }
  }
  auto describe = [](const Placed& p) {
    return absl::StrCat("site ", p.site, "'s ", p.device->name(), " (",
                        model::ComputeCapabilityName(p.device->compute_capability()), ")");
  };
  // A GPU older than any this build runs has no precision at all.
  for (const auto& [key, p] : placed) {
    const int cc = p.device->compute_capability();
    if (cc > 0 && cc < model::kMinComputeCapability) {
      return absl::FailedPreconditionError(absl::StrCat(
          describe(p), " is older than the oldest GPU geotrain's CUDA build runs (compute capability ",
          model::ComputeCapabilityName(model::kMinComputeCapability), ", Turing); leave its worker out of the job"));
    }
  }
  // fp16's overflow steps send infinities through the gradient all-reduces, which int8 and the gradients-only codecs
  // cannot encode: fp16 needs a WAN and LAN codec that carries them (model::FiniteOnlyCodec).
  const std::string lossy = model::FiniteOnlyCodec(spec.comm());
  const std::string& asked = spec.train().precision();
  PrecisionChoice choice;
  if (asked.empty() || asked == "auto") {
    const Placed* oldest = nullptr;  // the GPU of the lowest compute capability
    for (const auto& [key, p] : placed) {
      if (p.device->compute_capability() == 0) continue;  // a CPU
      if (oldest == nullptr || p.device->compute_capability() < oldest->device->compute_capability()) oldest = &p;
    }
    if (oldest == nullptr) {
      choice.explanation = "precision fp32 (auto: the job runs on CPUs)";
    } else {
      choice.precision = model::AutoPrecision(oldest->device->compute_capability(), !lossy.empty());
      if (choice.precision == model::Precision::kBf16) {
        choice.explanation = absl::StrCat("precision bf16 (auto: every GPU of the job has compute capability ",
                                          model::ComputeCapabilityName(model::kBf16MinComputeCapability),
                                          " or more; the oldest is ", describe(*oldest), ")");
      } else if (choice.precision == model::Precision::kFp32) {
        choice.explanation = absl::StrCat("precision fp32 (auto: ", describe(*oldest),
                                          " has no bf16, and fp16's overflow steps cannot go through the ", lossy,
                                          " codec; with wan_codec bf16 or fp16 auto would choose fp16)");
      } else {
        choice.explanation = absl::StrCat("precision fp16 with dynamic loss scaling (auto: ", describe(*oldest),
                                          " has no bf16, which needs compute capability ",
                                          model::ComputeCapabilityName(model::kBf16MinComputeCapability), ")");
      }
    }
  } else {
    ASSIGN_OR_RETURN(choice.precision, model::ParsePrecision(asked));
    for (const auto& [key, p] : placed) {
      const int cc = p.device->compute_capability();
      if (model::PrecisionSupported(choice.precision, cc)) continue;
      std::vector<std::string> supported;
      for (model::Precision q : {model::Precision::kBf16, model::Precision::kFp16, model::Precision::kFp32}) {
        if (model::PrecisionSupported(q, cc)) supported.emplace_back(model::PrecisionName(q));
      }
      const int needs =
          choice.precision == model::Precision::kBf16 ? model::kBf16MinComputeCapability : model::kMinComputeCapability;
      return absl::FailedPreconditionError(absl::StrCat(
          asked, " needs compute capability ", model::ComputeCapabilityName(needs), "; ", describe(p), " supports ",
          absl::StrJoin(supported, " and "), ": set train.precision to one of those, or auto"));
    }
    if (choice.precision == model::Precision::kFp16 && !lossy.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("fp16 cannot train through the ", lossy,
                       " codec: an overflowing step's infinities must reach every "
                       "replica to be skipped, and ",
                       lossy,
                       " refuses them; set comm.wan_codec (and lan_codec) to bf16, fp16 or "
                       "none, or train.precision to fp32"));
    }
    choice.explanation = absl::StrCat("precision ", asked, " (as the spec asks)");
  }
  if (choice.precision == model::Precision::kFp16) {
    const model::LossScaleOptions scaling = model::LossScaleFromSpec(spec.train(), choice.precision);
    absl::StrAppend(&choice.explanation, absl::StrFormat("; loss scale from %g, doubled after %d clean steps",
                                                         scaling.initial, scaling.growth_interval));
  }
  return choice;
}

std::vector<WorkerInfo> FreeDevices(const std::vector<WorkerInfo>& workers, const HeldDevices& held) {
  std::vector<WorkerInfo> out;
  for (const WorkerInfo& w : workers) {
    if (!Placeable(w)) continue;
    WorkerInfo copy = w;
    copy.clear_devices();
    for (int d = 0; d < w.devices_size(); ++d) {
      if (!held.count({w.worker_id(), d})) *copy.add_devices() = w.devices(d);
    }
    if (copy.devices_size() > 0) out.push_back(std::move(copy));
  }
  return out;
}

namespace {

// A free device of an alive worker, and whether an actor took it.
struct Slot {
  const WorkerInfo* worker;
  int device;
  bool used = false;
};
using ActorKey = std::tuple<int, int, int>;  // (replica, stage, tp rank)
using ChosenSlots = std::map<ActorKey, Slot*>;

// Placement's first phase: the plan against the model (stages and tensor-parallel ranks it can be cut into).
absl::Status CheckPlanFitsModel(const JobSpec& spec) {
  const int pp = spec.parallel().pp(), tp = spec.parallel().tp();
  ASSIGN_OR_RETURN(const GPT2Config config, GPT2Config::FromSpec(spec.model()));
  if (pp > config.n_layer) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.pp (", pp, ") exceeds the model's ", config.n_layer, " layers"));
  }
  if (config.n_head % tp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("parallel.tp (", tp, ") must divide the model's n_head (", config.n_head, ")"));
  }
  return absl::OkStatus();
}

// The bytes each stage needs, as the planner counts them.
absl::StatusOr<std::vector<uint64_t>> StageMemory(const JobSpec& spec) {
  std::vector<uint64_t> stage_bytes(spec.parallel().pp());
  for (int s = 0; s < spec.parallel().pp(); ++s) {
    ASSIGN_OR_RETURN(const double bytes, scheduler::SpecStageMemoryBytes(spec, s));
    stage_bytes[s] = static_cast<uint64_t>(std::ceil(bytes));
  }
  return stage_bytes;
}

// The second: the free devices of the alive workers in site order, or UNAVAILABLE when there are fewer than the
// plan needs, naming the jobs that hold the others.
absl::StatusOr<std::vector<Slot>> FreeSlots(const ParallelSpec& parallel, const std::vector<WorkerInfo>& workers,
                                            const HeldDevices& held) {
  std::vector<const WorkerInfo*> alive;
  for (const WorkerInfo& w : workers) {
    if (Placeable(w)) alive.push_back(&w);
  }
  std::sort(alive.begin(), alive.end(), [](const WorkerInfo* a, const WorkerInfo* b) {
    return std::tie(a->site(), a->worker_id()) < std::tie(b->site(), b->worker_id());
  });
  std::vector<Slot> slots;
  int alive_devices = 0;
  std::set<std::string> holders;
  for (const WorkerInfo* w : alive) {
    for (int d = 0; d < w->devices_size(); ++d) {
      ++alive_devices;
      auto h = held.find({w->worker_id(), d});
      if (h == held.end()) {
        slots.push_back({w, d});
      } else {
        holders.insert(h->second);
      }
    }
  }
  const int dp = parallel.dp(), pp = parallel.pp(), tp = parallel.tp();
  const int needed = dp * pp * tp;
  if (static_cast<int>(slots.size()) < needed) {
    std::string by;
    for (const std::string& j : holders) absl::StrAppend(&by, by.empty() ? "" : ", ", j);
    return absl::UnavailableError(absl::StrCat(
        "needs ", needed, " devices (dp ", dp, " x pp ", pp, " x tp ", tp, "); ", alive_devices, " alive",
        holders.empty() ? ""
                        : absl::StrCat(", ", alive_devices - static_cast<int>(slots.size()), " of them held by ", by)));
  }
  return slots;
}

// The third: a slot for every actor, the pinned ones first (pins to a worker before pins to a site, so that a site
// pin never takes the device a worker pin needs), then the rest in order, replica by replica, stage by stage.
absl::StatusOr<ChosenSlots> AssignSlots(const ParallelSpec& parallel, std::vector<Slot>& slots) {
  const int dp = parallel.dp(), pp = parallel.pp(), tp = parallel.tp();
  std::map<ActorKey, const PlacementSpec*> pinned;
  for (const PlacementSpec& p : parallel.placement()) {
    if (p.replica() < 0 || p.replica() >= dp || p.stage() < 0 || p.stage() >= pp || p.tp_rank() < 0 ||
        p.tp_rank() >= tp) {
      return absl::InvalidArgumentError(absl::StrCat("parallel.placement names replica ", p.replica(), ", stage ",
                                                     p.stage(), ", tp rank ", p.tp_rank(), " outside the plan"));
    }
    pinned[{p.replica(), p.stage(), p.tp_rank()}] = &p;
  }
  auto take = [&](const PlacementSpec* pin) -> Slot* {
    for (Slot& slot : slots) {
      if (slot.used) continue;
      if (pin != nullptr && !pin->worker().empty() && slot.worker->worker_id() != pin->worker()) continue;
      if (pin != nullptr && !pin->site().empty() && slot.worker->site() != pin->site()) continue;
      slot.used = true;
      return &slot;
    }
    return nullptr;
  };
  ChosenSlots chosen;
  std::vector<std::pair<ActorKey, const PlacementSpec*>> ordered(pinned.begin(), pinned.end());
  std::stable_sort(ordered.begin(), ordered.end(), [](const auto& a, const auto& b) {
    return !a.second->worker().empty() && b.second->worker().empty();
  });
  for (const auto& [key, pin] : ordered) {
    Slot* slot = take(pin);
    if (slot == nullptr) {
      return absl::UnavailableError(absl::StrCat("no free device on ", pin->worker().empty() ? "site " : "worker ",
                                                 pin->worker().empty() ? pin->site() : pin->worker(), " for replica ",
                                                 std::get<0>(key), ", stage ", std::get<1>(key)));
    }
    chosen[key] = slot;
  }
  for (int r = 0; r < dp; ++r) {
    for (int s = 0; s < pp; ++s) {
      for (int t = 0; t < tp; ++t) {
        if (chosen.count({r, s, t})) continue;
        chosen[{r, s, t}] = take(nullptr);
      }
    }
  }
  return chosen;
}

// The last: one actor on its slot, refused when its stage does not fit the device's usable memory.
absl::StatusOr<ActorPlacement> PlaceOn(const std::string& job_id, const ActorKey& key, const Slot& slot,
                                       uint64_t stage_bytes, const scheduler::SpecPlanning& planning) {
  const auto [r, s, t] = key;
  ActorPlacement p;
  p.actor.set_actor_id(ActorId(job_id, r, s, t));
  p.actor.set_job_id(job_id);
  p.actor.set_worker_id(slot.worker->worker_id());
  p.actor.set_replica(r);
  p.actor.set_stage(s);
  p.actor.set_tp_rank(t);
  p.actor.set_device_index(slot.device);
  p.actor.set_state(ACTOR_PENDING_CREATION);
  p.site = slot.worker->site();
  p.memory_bytes = stage_bytes;
  p.device_memory_bytes = slot.worker->devices(slot.device).memory_bytes();
  const double usable = scheduler::UsableMemoryBytes(planning.job, static_cast<double>(p.device_memory_bytes));
  if (p.device_memory_bytes > 0 && static_cast<double>(p.memory_bytes) > usable) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the plan does not fit: stage %d needs about %.2f GB (parameters, gradients and AdamW at 16 bytes per "
        "parameter, 20 with data parallelism, the activations its schedule holds, boundary buffers and "
        "%.2f GB fixed, as the planner counts them) but device %d of worker %s has %.2f GB usable (%.2f GB "
        "less %.0f%% headroom); use more pipeline stages, more tensor parallelism, or smaller microbatches",
        s, p.memory_bytes / 1e9, planning.job.fixed_memory_bytes / 1e9, slot.device, slot.worker->worker_id(),
        usable / 1e9, p.device_memory_bytes / 1e9, 100 * planning.job.memory_headroom));
  }
  return p;
}

}  // namespace

absl::StatusOr<std::vector<ActorPlacement>> PlaceActors(const JobInfo& job, const std::vector<WorkerInfo>& workers,
                                                        const HeldDevices& held) {
  const JobSpec& spec = job.spec();
  const int dp = spec.parallel().dp(), pp = spec.parallel().pp(), tp = spec.parallel().tp();
  RETURN_IF_ERROR(CheckPlanFitsModel(spec));
  // What each stage needs and what a device may give, as the planner counts them.
  ASSIGN_OR_RETURN(const scheduler::SpecPlanning planning, scheduler::PlanningForSpec(spec));
  ASSIGN_OR_RETURN(const std::vector<uint64_t> stage_bytes, StageMemory(spec));
  ASSIGN_OR_RETURN(std::vector<Slot> slots, FreeSlots(spec.parallel(), workers, held));
  ASSIGN_OR_RETURN(ChosenSlots chosen, AssignSlots(spec.parallel(), slots));
  std::vector<ActorPlacement> out;
  for (int r = 0; r < dp; ++r) {
    for (int s = 0; s < pp; ++s) {
      for (int t = 0; t < tp; ++t) {
        const Slot* slot = chosen[{r, s, t}];
        const Slot* leader = chosen[{r, s, 0}];
        if (t > 0 && slot->worker->site() != leader->worker->site()) {
          return absl::FailedPreconditionError(
              absl::StrCat("the tensor-parallel group of replica ", r, ", stage ", s, " would span sites ",
                           leader->worker->site(), " and ", slot->worker->site(),
                           "; tensor parallelism stays inside a site: pin the group with parallel.placement"));
        }
        ASSIGN_OR_RETURN(ActorPlacement p, PlaceOn(job.job_id(), {r, s, t}, *slot, stage_bytes[s], planning));
        out.push_back(std::move(p));
      }
    }
  }
  return out;
}

// parallel.sites as site indices of the planning cluster (the free devices of alive workers): "all" is every site
// that has one; a name with none is UNAVAILABLE (the job waits for a device there, as for any device it needs),
// naming the sites that have free devices.
absl::StatusOr<std::vector<int>> RequiredSites(const ParallelSpec& parallel, const scheduler::Cluster& cluster) {
  std::set<int> required;
  for (const std::string& name : parallel.sites()) {
    if (name == "all") {
      for (int s = 0; s < cluster.num_sites(); ++s) required.insert(s);
      continue;
    }
    auto it = std::find(cluster.site_names.begin(), cluster.site_names.end(), name);
    if (it == cluster.site_names.end()) {
      return absl::UnavailableError(absl::StrCat("parallel.sites needs site '", name,
                                                 "', which has no free device on an alive worker now (sites with "
                                                 "free devices: ",
                                                 absl::StrJoin(cluster.site_names, ", "), ")"));
    }
    required.insert(static_cast<int>(it - cluster.site_names.begin()));
  }
  return std::vector<int>(required.begin(), required.end());
}

// A plan that leaves out devices of a site it uses that differ from the ones it uses (a slower type, a GPU without
// bf16 for a job that would train in fp32 on it) names the workers of its actors, not only their sites: PlaceActors
// takes a site's free devices in the order of its workers, and could take the ones left out.
void PinWorkersWhereTheChoiceMatters(const scheduler::Cluster& cluster,
                                     const std::map<std::pair<std::string, int>, int>& device_of,
                                     const scheduler::Plan& plan, ParallelSpec* parallel) {
  std::map<int, std::string> worker_of;  // Cluster::devices index -> worker id
  for (const auto& [key, index] : device_of) worker_of[index] = key.first;
  std::set<int> used;
  for (const auto& replica : plan.devices)
    for (const auto& stage : replica) used.insert(stage.begin(), stage.end());
  auto kind = [&](int d) { return std::make_pair(cluster.devices[d].name, cluster.devices[d].compute_capability); };
  std::set<int> sites_to_pin;
  for (int d = 0; d < static_cast<int>(cluster.devices.size()); ++d) {
    if (used.count(d)) continue;
    for (int u : used) {
      if (cluster.devices[u].site == cluster.devices[d].site && kind(u) != kind(d)) {
        sites_to_pin.insert(cluster.devices[d].site);
      }
    }
  }
  for (PlacementSpec& p : *parallel->mutable_placement()) {
    if (p.replica() >= plan.dp || p.stage() >= plan.pp || p.tp_rank() >= plan.tp) continue;
    const int d = plan.devices[p.replica()][p.stage()][p.tp_rank()];
    if (!sites_to_pin.count(cluster.devices[d].site) || !worker_of.count(d)) continue;
    p.set_worker(worker_of[d]);  // the site stays: the plan's sites read the same
  }
}

absl::StatusOr<RankedAutoPlans> RankAutoPlans(const JobSpec& spec, const std::vector<WorkerInfo>& workers,
                                              const std::vector<SiteLink>& links, int max_plans) {
  ASSIGN_OR_RETURN(scheduler::SpecPlanning planning, scheduler::PlanningForSpec(spec));
  planning.options.max_ranked = std::max(planning.options.max_ranked, max_plans);
  RankedAutoPlans out;
  ASSIGN_OR_RETURN(PlanningCluster planning_cluster, ClusterForPlanning(workers, links, spec.train().precision()));
  planning.job.grpc_collectives = planning_cluster.grpc_collectives;
  out.cluster = std::move(planning_cluster.cluster);
  const scheduler::Cluster& cluster = out.cluster;
  out.alive_workers = planning_cluster.alive_workers;
  const scheduler::ModelCosts& model = planning.model;
  ASSIGN_OR_RETURN(planning.options.required_sites, RequiredSites(spec.parallel(), cluster));
  ASSIGN_OR_RETURN(const scheduler::PlanResult result,
                   scheduler::PlanJob(cluster, model, planning.job, planning.options));
  out.explanation = result.explanation;
  if (!planning.options.required_sites.empty()) {
    // What the requirement costs: the best plan the planner finds without it.
    scheduler::PlannerOptions free = planning.options;
    free.required_sites.clear();
    free.max_ranked = 1;
    absl::StatusOr<scheduler::PlanResult> unrequired = scheduler::PlanJob(cluster, model, planning.job, free);
    const scheduler::PlanCandidate& best = result.ranked.front();
    std::string cost = "no plan without the requirement fits";
    if (unrequired.ok()) {
      const scheduler::PlanCandidate& other = unrequired->ranked.front();
      const double ratio = best.prediction.step_time_s / other.prediction.step_time_s;
      cost = ratio > 1 + 1e-9
                 ? absl::StrFormat(
                       "the best plan without it, dp %d pp %d tp %d (%s), takes %.3f s: the requirement "
                       "costs %.0f%% of step time",
                       other.plan.dp, other.plan.pp, other.plan.tp, scheduler::DevicesUsedName(cluster, other),
                       other.prediction.step_time_s, 100 * (ratio - 1))
                 : absl::StrFormat("the best plan found without it takes %.3f s: the requirement costs nothing",
                                   other.prediction.step_time_s);
    }
    out.explanation.insert(
        out.explanation.begin(),
        absl::StrFormat("sites required (%s): the best plan on them takes %.3f s; %s",
                        absl::StrJoin(spec.parallel().sites(), ", "), best.prediction.step_time_s, cost));
  }
  out.plans_simulated = result.plans_simulated;
  out.planning_seconds = result.planning_seconds;
  for (const scheduler::PlanCandidate& candidate : result.ranked) {
    if (static_cast<int>(out.plans.size()) >= std::max(1, max_plans)) break;
    const scheduler::ManualPlan manual = scheduler::ToManualPlan(cluster, model, candidate.plan);
    if (std::adjacent_find(manual.microbatches.begin(), manual.microbatches.end(), std::not_equal_to<>()) !=
        manual.microbatches.end()) {
      continue;  // unequal replica shares: not what the runtime does
    }
    RankedAutoPlan plan;
    scheduler::FillParallelSpec(manual, &plan.parallel);
    PinWorkersWhereTheChoiceMatters(cluster, planning_cluster.device_of, candidate.plan, &plan.parallel);
    JobSpec check = spec;
    *check.mutable_parallel() = plan.parallel;
    if (!ValidateJobSpec(check).ok()) continue;
    if (out.plans.empty()) {  // the plan a `plan: auto` job gets
      if (const std::string note = EmulatedDevicesNote(workers, candidate.prediction.step_time_s); !note.empty()) {
        out.explanation.push_back(note);
      }
    }
    if (out.plans.empty() && &candidate != &result.ranked.front()) {
      out.explanation.push_back(
          "(the top plan splits the batch unevenly across replicas; geotrain's runtime "
          "splits it evenly, so the best even plan was taken)");
    }
    plan.candidate = candidate;
    plan.predicted_step_seconds = candidate.prediction.step_time_s;
    if (out.plans.empty() && spec.parallel().allow_diloco()) {
      // Synchronous or DiLoCo: the faster predicted step (scheduler/diloco_plan.h).
      ASSIGN_OR_RETURN(
          const scheduler::DilocoChoice choice,
          scheduler::ChooseSyncOrDiloco(cluster, model, planning.job, planning.options, result, EffectiveDiloco(spec)));
      out.explanation.insert(out.explanation.end(), choice.explanation.begin(), choice.explanation.end());
      plan.parallel.set_sync("sync");
      if (choice.diloco_chosen) {
        ParallelSpec diloco;
        scheduler::FillParallelSpec(scheduler::ToManualPlan(cluster, model, choice.diloco.plan), &diloco);
        PinWorkersWhereTheChoiceMatters(cluster, planning_cluster.device_of, choice.diloco.plan, &diloco);
        diloco.set_sync("diloco");
        *check.mutable_parallel() = diloco;
        if (ValidateJobSpec(check).ok()) {
          plan.parallel = diloco;
          plan.predicted_step_seconds = choice.diloco_step_s;
        }
      }
    }
    out.plans.push_back(std::move(plan));
  }
  if (out.plans.empty()) {
    return absl::FailedPreconditionError(
        "the planner found no plan that splits the global batch evenly across replicas; give a manual plan");
  }
  return out;
}

absl::StatusOr<AutoPlan> PlanAutoJob(const JobSpec& spec, const std::vector<WorkerInfo>& workers,
                                     const std::vector<SiteLink>& links) {
  ASSIGN_OR_RETURN(RankedAutoPlans ranked, RankAutoPlans(spec, workers, links, 1));
  AutoPlan out;
  out.parallel = ranked.plans.front().parallel;
  out.predicted_step_seconds = ranked.plans.front().predicted_step_seconds;
  out.explanation = std::move(ranked.explanation);
  return out;
}

absl::StatusOr<PipelineDepthChoice> ChoosePipelineDepth(const JobSpec& spec,
                                                        const std::vector<ActorPlacement>& placement,
                                                        const std::vector<WorkerInfo>& workers,
                                                        const std::vector<SiteLink>& links) {
  const ParallelSpec& parallel = spec.parallel();
  PipelineDepthChoice out;
  out.depth = std::max(1, parallel.pp());
  if (parallel.pp() <= 1 || parallel.schedule() == "gpipe") return out;
  if (parallel.pipeline_depth() > 0) {
    out.depth = std::max(parallel.pp(), parallel.pipeline_depth());
    return out;
  }
  ASSIGN_OR_RETURN(scheduler::SpecPlanning planning, scheduler::PlanningForSpec(spec));
  ASSIGN_OR_RETURN(scheduler::Plan plan, scheduler::RuntimePlanShape(spec, planning.model));
  ASSIGN_OR_RETURN(const PlanningCluster planning_cluster,
                   ClusterForPlanning(workers, links, spec.train().precision()));
  planning.job.grpc_collectives = planning_cluster.grpc_collectives;
  plan.devices.assign(plan.dp, std::vector<std::vector<int>>(plan.pp, std::vector<int>(plan.tp, -1)));
  std::set<int> sites;
  for (const ActorPlacement& p : placement) {
    const ActorRecord& a = p.actor;
    auto device = planning_cluster.device_of.find({a.worker_id(), a.device_index()});
    if (device == planning_cluster.device_of.end() || a.replica() < 0 || a.replica() >= plan.dp || a.stage() < 0 ||
        a.stage() >= plan.pp || a.tp_rank() < 0 || a.tp_rank() >= plan.tp) {
      return absl::InternalError(absl::StrCat("actor ", a.actor_id(), " is placed outside its plan or its worker"));
    }
    plan.devices[a.replica()][a.stage()][a.tp_rank()] = device->second;
    sites.insert(planning_cluster.cluster.devices[device->second].site);
  }
  ASSIGN_OR_RETURN(const scheduler::Prediction prediction,
                   scheduler::Simulate(planning_cluster.cluster, planning.model, planning.job, plan));
  out.depth = prediction.pipeline_depth;
  if (out.depth <= plan.pp) return out;
  double microbatch = 0, one_way = 0;
  for (size_t s = 0; s < prediction.stage_forward_s.size(); ++s) {
    microbatch = std::max(microbatch, prediction.stage_forward_s[s] + prediction.stage_backward_s[s]);
  }
  for (int a : sites) {
    for (int b : sites) one_way = std::max(one_way, planning_cluster.cluster.Link(a, b).latency_s);
  }
  out.explanation = absl::StrFormat(
      "1F1B pipeline depth %d (pp %d): %d microbatches in flight cover a round trip over links measured at up to "
      "%.1f ms one way, with %.1f ms of predicted compute per microbatch (forward and backward, slowest stage); "
      "the extra microbatches are recomputed, not kept",
      out.depth, plan.pp, out.depth, one_way * 1e3, microbatch * 1e3);
  return out;
}

}  // namespace geotrain::head
