// Healing a degraded job from a live peer (see job_heal.h).
#include "head/job_heal.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "head/job_regroup.h"

namespace geotrain::head {

std::vector<int> MissingReplicas(const JobRun& run, const WorkersById& workers) {
  const RunRegroup& g = run.regroup;
  std::string why;
  if (run.phase != RunPhase::kRunning || g.epoch == 0 || !g.confirmed || run.last_step < g.resume_step ||
      !run.drain.workers.empty() || !run.heal.replicas.empty() || !RegroupEligible(run, workers, &why) ||
      (run.spec.fault_tolerance().has_heal() && !run.spec.fault_tolerance().heal())) {
    return {};
  }
  const std::vector<int> present = PresentReplicas(run);
  std::vector<int> missing;
  for (int r = 0; r < run.spec.parallel().dp(); ++r) {
    if (!std::binary_search(present.begin(), present.end(), r)) missing.push_back(r);
  }
  return missing;
}

absl::StatusOr<std::vector<ActorPlacement>> PlaceHeal(const JobInfo& job, const std::vector<int>& replicas,
                                                      const std::vector<WorkerInfo>& workers, const HeldDevices& held,
                                                      int64_t attempt, int64_t epoch) {
  // The missing replicas as a job of their own: the same stages, one replica each, on the devices free now; the
  // plan's pins of them kept where they name a site or an alive worker (a pinned worker may be the one that died: its
  // actor goes wherever a device is free).
  JobInfo part = job;
  ParallelSpec* parallel = part.mutable_spec()->mutable_parallel();
  parallel->set_dp(static_cast<int>(replicas.size()));
  // Each replica's share of the batch as in the plan (the memory each stage needs depends on it).
  const int dp = std::max(1, job.spec().parallel().dp());
  part.mutable_spec()->mutable_train()->set_global_batch(job.spec().train().global_batch() / dp *
                                                         static_cast<int>(replicas.size()));
  std::vector<PlacementSpec> pins;
  for (const PlacementSpec& pin : job.spec().parallel().placement()) {
    auto r = std::find(replicas.begin(), replicas.end(), pin.replica());
    const bool alive = std::any_of(workers.begin(), workers.end(), [&](const WorkerInfo& w) {
      return w.worker_id() == pin.worker() && w.state() == WORKER_ALIVE;
    });
    if (r == replicas.end() || (!pin.worker().empty() && !alive && pin.site().empty())) continue;
    PlacementSpec& kept = pins.emplace_back(pin);
    kept.set_replica(static_cast<int>(r - replicas.begin()));
    if (!alive) kept.clear_worker();  // its site stays
  }
  parallel->clear_placement();
  for (const PlacementSpec& pin : pins) *parallel->add_placement() = pin;
  // Not on a CUDA device: its groups would be NCCL's, which a live membership change does not rebuild.
  HeldDevices unusable = held;
  for (const WorkerInfo& w : workers) {
    for (int d = 0; d < w.devices_size(); ++d) {
      if (w.devices(d).kind() == DEVICE_KIND_CUDA) unusable.emplace(std::make_pair(w.worker_id(), d), "NCCL");
    }
  }
  ASSIGN_OR_RETURN(std::vector<ActorPlacement> placed, PlaceActors(part, workers, unusable));
  for (ActorPlacement& p : placed) {
    const int r = replicas[static_cast<size_t>(p.actor.replica())];
    p.actor.set_replica(r);
    p.actor.set_actor_id(absl::StrCat(ActorId(job.job_id(), r, p.actor.stage(), p.actor.tp_rank()),
                                      attempt > 0 ? absl::StrCat("-a", attempt) : "", "-h", epoch));
  }
  return placed;
}

void BeginHeal(JobRun& run, std::vector<int> replicas, std::vector<ActorPlacement> actors, int64_t now_ms) {
  RunHeal& h = run.heal;
  h = RunHeal{};
  h.replicas = std::move(replicas);
  h.actors = std::move(actors);
  h.epoch = NextEpoch(run.regroup);
  run.regroup.reserved_epoch = h.epoch;
  h.donor = PresentReplicas(run).front();
  h.started_ms = now_ms;
  h.fault_detected_ms = run.regroup.detected_ms;
}

Regroup HealMembership(const JobRun& run) {
  const RunHeal& h = run.heal;
  std::vector<int> all = PresentReplicas(run);
  all.insert(all.end(), h.replicas.begin(), h.replicas.end());
  std::sort(all.begin(), all.end());
  Regroup m;
  m.set_epoch(h.epoch);
  for (int r : all) m.add_replicas(r);
  for (int r : h.replicas) m.add_joining(r);
  m.set_donor(h.donor);
  return m;
}

std::vector<ActorPlacement> HealedActors(const JobRun& run) {
  std::vector<ActorPlacement> all = run.actors;
  all.insert(all.end(), run.heal.actors.begin(), run.heal.actors.end());
  return all;
}

HealNews ApplyHealReady(JobRun& run, const std::string& actor_id) {
  HealNews news;
  RunHeal& h = run.heal;
  if (h.joined || !InHeal(run, actor_id)) return news;
  h.ready.insert(actor_id);
  if (h.target == 0 && !h.ends_first && h.ready.size() == h.actors.size()) {
    PickBoundary(run, h);
    news.picked = true;
  }
  return news;
}

HealNews ApplyHealStep(JobRun& run, const StepReport& report, int64_t now_ms) {
  HealNews news;
  RunHeal& h = run.heal;
  if (h.replicas.empty() || h.joined || h.target <= 0 || report.step() <= 0) return news;
  news.boundary = ApplyBoundaryStep(run, h, report.actor_id(), report.step(), report.heal_at_step());
  if (!news.boundary.broken) news.joined = JoinHeal(run, now_ms);
  return news;
}

bool JoinHeal(JobRun& run, int64_t now_ms) {
  RunHeal& h = run.heal;
  if (h.joined || !h.confirmed || run.last_step < h.target) return false;
  const Regroup m = HealMembership(run);
  run.actors = HealedActors(run);
  // Created a moment ago: not "gone from its worker" before a heartbeat could list them (JobRunner::Reconcile).
  for (const ActorPlacement& p : h.actors) run.actor_seen_ms[p.actor.actor_id()] = now_ms;
  h.joined = true;
  h.first_step = h.target + 1;
  RunRegroup& g = run.regroup;
  g.epoch = m.epoch();
  g.replicas.assign(m.replicas().begin(), m.replicas().end());
  g.confirmed = false;
  g.resume_step = 0;
  g.ready.clear();
  g.cause = absl::StrCat("a heal of replicas ", absl::StrJoin(h.replicas, ", "));
  g.detected_ms = now_ms;  // the membership's forming is bounded from here (kRegroupFormMs)
  // The replicas that trained on pause from their last complete step until their first in the new membership.
  if (g.paused_from_ms == 0)
    g.paused_from_ms = run.progress.last_complete_ms > 0 ? run.progress.last_complete_ms : now_ms;
  g.waiting_since_ms = 0;
  g.waiting_cause.clear();
  g.joining = h.replicas;
  g.donor = h.donor;
  g.peers = h.peers;
  g.heal_backoff_ms = 0;
  return true;
}

void FillHealReply(const JobRun& run, ReportStepReply* reply) {
  const RunHeal& h = run.heal;
  if (h.replicas.empty() || h.target <= 0) return;
  reply->set_heal_at_step(h.target);
  reply->set_heal_confirmed(h.confirmed);
}

bool InHeal(const JobRun& run, const std::string& actor_id) {
  return std::any_of(run.heal.actors.begin(), run.heal.actors.end(),
                     [&](const ActorPlacement& p) { return p.actor.actor_id() == actor_id; });
}

}  // namespace geotrain::head
