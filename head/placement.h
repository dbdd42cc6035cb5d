// Where a job's actors run: the placement of a manual plan on the alive workers, and the planning of a
// `parallel: {plan: auto}` job into a manual plan. Pure functions of the job and the registry's view of the
// workers (no RPC, no locks), so they are tested without processes; JobRunner (job_runner.h) calls them.
//
//   ASSIGN_OR_RETURN(AutoPlan plan, PlanAutoJob(job.spec(), registry.Workers(), registry.SiteLinks()));
//   *job.mutable_spec()->mutable_parallel() = plan.parallel;
//   ASSIGN_OR_RETURN(std::vector<ActorPlacement> actors, PlaceActors(job, registry.Workers()));
//
// Placement (manual plans): an explicit `parallel.placement` entry pins (replica, stage, tp rank) to a
// worker or a site; the others take the free devices in site order, replica by replica, stage by stage.
// Tensor-parallel groups must sit inside one site. An actor whose stage does not fit its device's memory
// is refused before anything starts, with the numbers. Memory is counted as the planner counts it
// (scheduler::SpecStageMemoryBytes), so the head refuses exactly the plans the planner calls too large.
// Thread safety: pure functions; any thread.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "control.pb.h"
#include "model/precision.h"
#include "scheduler/cluster.h"
#include "scheduler/planner.h"

namespace geotrain::head {

// One actor's placement and its estimated memory.
struct ActorPlacement {
  ActorRecord actor;
  std::string site;
  uint64_t memory_bytes = 0;         // estimated need
  uint64_t device_memory_bytes = 0;  // what its device has
};

// The id of the actor (replica r, stage s, tensor rank t) of a job's plan: "<job>-r<r>s<s>t<t>".
std::string ActorId(const std::string& job_id, int r, int s, int t);

// The devices other jobs' actors hold: (worker id, device index) -> the job. A device runs one actor at a
// time, so a held device is neither planned on nor placed on until its job ends or restarts elsewhere.
using HeldDevices = std::map<std::pair<std::string, int>, std::string>;

// Places the actors of a manual plan on the free devices of `workers` (placeable ones, less `held`). Errors: not
// enough free devices (UNAVAILABLE, naming the jobs that hold the others: the job waits), a TP group across
// sites or a plan that does not fit in memory (FAILED_PRECONDITION / INVALID_ARGUMENT: the job is refused).
absl::StatusOr<std::vector<ActorPlacement>> PlaceActors(const JobInfo& job, const std::vector<WorkerInfo>& workers,
                                                        const HeldDevices& held = {});

// The precision a placed job trains in (train.precision) and one line saying why. auto: fp32 when no actor is on a
// GPU (a CPU worker's native precision), else bf16 when every GPU of the job has compute capability 8.0 or more
// and fp16 when one has less (Turing: T4, RTX 6000); emulated GPUs count as the GPU they stand for, and CPU
// workers in such a job emulate its precision. An explicit precision that a placed device cannot run is
// FAILED_PRECONDITION naming the device, its site and what it supports, before any actor starts.
struct PrecisionChoice {
  model::Precision precision = model::Precision::kFp32;
  std::string explanation;
};
absl::StatusOr<PrecisionChoice> ChoosePrecision(const JobSpec& spec, const std::vector<ActorPlacement>& placement,
                                                const std::vector<WorkerInfo>& workers);

// Whether jobs may be planned and placed on the worker: it is alive and not draining (leaving on notice).
inline bool Placeable(const WorkerInfo& w) { return w.state() == WORKER_ALIVE && !w.draining(); }

// The workers as the planner should see them for a new job: each placeable one's devices less those `held`.
std::vector<WorkerInfo> FreeDevices(const std::vector<WorkerInfo>& workers, const HeldDevices& held);

// Estimated bytes an actor of stage `stage` of the spec's manual plan needs, as the planner's simulator counts
// them (scheduler::SpecStageMemoryBytes): parameters, gradients and AdamW state (16 bytes per parameter, 20
// with data parallelism for the gradient buckets' copy), the activations of the microbatches its schedule
// holds (the logits included on the last stage), boundary buffers, and 1 GB fixed (runtime, workspace). 0 when
// the spec cannot be planned (a bad model or codec).
uint64_t EstimateActorMemory(const JobSpec& spec, int stage);

// The 1F1B depth of a placed job (parallel.pipeline_depth; common/pipeline_schedule.h): the spec's when it sets
// one, pp for GPipe or one stage, else the simulator's choice (scheduler::Simulate, Plan::pipeline_depth 0)
// for these devices and the measured site links: enough microbatches in flight to cover the slowest
// boundary's round trip. `explanation` (for the job's log) says why when the depth is above pp. Errors: a
// spec the planner cannot read, or a placement outside the plan (INTERNAL).
struct PipelineDepthChoice {
  int depth = 1;
  std::string explanation;
};
absl::StatusOr<PipelineDepthChoice> ChoosePipelineDepth(const JobSpec& spec,
                                                        const std::vector<ActorPlacement>& placement,
                                                        const std::vector<WorkerInfo>& workers,
                                                        const std::vector<SiteLink>& links);

// Chooses a plan for a `plan: auto` job with the planner (scheduler/) on the alive workers, their
// devices and the site links the workers measured (1 Gbit/s and 1 ms where nothing was measured yet),
// with the planner's inputs for the spec (scheduler::PlanningForSpec: its WAN codec, +zstd included).
// Returns the job with its parallel section filled (manual form, placement by site) and the predicted
// step time, plus the planner's explanation lines. The runtime splits layers evenly across stages and
// the batch evenly across replicas, so only plans with equal replica shares are taken.
struct AutoPlan {
  ParallelSpec parallel;
  double predicted_step_seconds = 0;
  std::vector<std::string> explanation;
};
absl::StatusOr<AutoPlan> PlanAutoJob(const JobSpec& spec, const std::vector<WorkerInfo>& workers,
                                     const std::vector<SiteLink>& links);

// The plans PlanAutoJob chooses from, best first: up to `max_plans` of the planner's ranked plans that the runtime
// runs as planned (equal replica shares, a valid spec), each in manual form with the planner's candidate (its
// prediction), the cluster as the planner saw it (site names by index), the explanation of the first and the
// search's figures. PlanAutoJob takes the first. Errors: as PlanAutoJob.
struct RankedAutoPlan {
  ParallelSpec parallel;
  scheduler::PlanCandidate candidate;
  double predicted_step_seconds = 0;  // the candidate's, or DiLoCo's when the first plan was switched to it
};
struct RankedAutoPlans {
  std::vector<RankedAutoPlan> plans;
  std::vector<std::string> explanation;
  scheduler::Cluster cluster;
  int alive_workers = 0;
  int64_t plans_simulated = 0;
  double planning_seconds = 0;
};
absl::StatusOr<RankedAutoPlans> RankAutoPlans(const JobSpec& spec, const std::vector<WorkerInfo>& workers,
                                              const std::vector<SiteLink>& links, int max_plans);

}  // namespace geotrain::head
