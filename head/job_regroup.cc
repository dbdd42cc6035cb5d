// Live regroups of a run: the replicas untouched by a fault train on (see job_regroup.h).
#include "head/job_regroup.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/spec.h"
#include "head/job_drain.h"
#include "head/job_heal.h"
#include "head/step_aggregator.h"

namespace geotrain::head {

std::vector<int> PresentReplicas(const JobRun& run) {
  if (!run.regroup.replicas.empty()) return run.regroup.replicas;
  std::vector<int> all(static_cast<size_t>(std::max(1, run.spec.parallel().dp())));
  std::iota(all.begin(), all.end(), 0);
  return all;
}

namespace {

// Some actor of the run is on a CUDA device of `workers`: its groups may be NCCL's, which are not rebuilt live.
bool OnCudaDevices(const JobRun& run, const WorkersById& workers) {
  return std::any_of(run.actors.begin(), run.actors.end(), [&](const ActorPlacement& p) {
    auto w = workers.find(p.actor.worker_id());
    const int d = p.actor.device_index();
    return w != workers.end() && d >= 0 && d < w->second.devices_size() &&
           w->second.devices(d).kind() == DEVICE_KIND_CUDA;
  });
}

}  // namespace

bool RegroupEligible(const JobRun& run, const WorkersById& workers, std::string* why) {
  if (!RegroupAllowedBySpec(run.spec, why)) return false;
  if (!run.drain.workers.empty()) {
    *why = "a drain is under way";
    return false;
  }
  if (OnCudaDevices(run, workers)) {
    *why = "its actors on CUDA devices use NCCL groups, which are not rebuilt live";
    return false;
  }
  return true;
}

std::vector<int> DrainKeeps(const JobRun& run, const WorkersById& workers) {
  std::string why;
  if (!RegroupAllowedBySpec(run.spec, &why) || OnCudaDevices(run, workers)) return {};
  std::set<int> leaving;
  for (const ActorPlacement& p : run.actors) {
    if (run.drain.workers.count(p.actor.worker_id())) leaving.insert(p.actor.replica());
  }
  std::vector<int> kept;
  for (int r : PresentReplicas(run)) {
    if (!leaving.count(r)) kept.push_back(r);
  }
  if (leaving.empty() || kept.empty()) return {};
  return kept;
}

std::vector<int> RegroupKept(const JobRun& run, const WorkersById& workers, const std::set<std::string>& lost) {
  std::set<int> broken;
  for (const ActorPlacement& p : run.actors) {
    auto w = workers.find(p.actor.worker_id());
    const bool alive = w != workers.end() && w->second.state() == WORKER_ALIVE;
    if (!alive || lost.count(p.actor.actor_id())) broken.insert(p.actor.replica());
  }
  std::vector<int> kept;
  for (int r : PresentReplicas(run)) {
    if (!broken.count(r)) kept.push_back(r);
  }
  return kept;
}

bool RegroupMakesProgress(const JobRun& run, const std::vector<int>& kept) {
  if (kept.size() < PresentReplicas(run).size()) return true;
  // The same replicas again: only once a step completed since the last regroup (the step it resumed at).
  return run.regroup.epoch == 0 || (run.regroup.confirmed && run.last_step >= run.regroup.resume_step);
}

RegroupBegun BeginRegroup(JobRun& run, const std::vector<int>& kept, const std::string& cause, int64_t detected_ms) {
  std::vector<ActorPlacement> leaving, staying;
  for (const ActorPlacement& p : run.actors) {
    (std::binary_search(kept.begin(), kept.end(), p.actor.replica()) ? staying : leaving).push_back(p);
  }
  run.actors = std::move(staying);
  run.phase = RunPhase::kRunning;
  // The steps in flight complete when the actors that stay have reported them (CompleteAfterLeave, below).
  for (auto& [step, agg] : run.steps) {
    for (const ActorPlacement& p : leaving) agg.reported.erase(p.actor.actor_id());
  }
  RunRegroup& g = run.regroup;
  // The healthy replicas' pause runs from their last complete step before the first fault of a series.
  const int64_t last_complete_ms = run.progress.last_complete_ms;
  if (g.paused_from_ms == 0) g.paused_from_ms = last_complete_ms > 0 ? last_complete_ms : detected_ms;
  g.epoch = NextEpoch(g);
  g.replicas = kept;
  g.confirmed = false;
  g.resume_step = 0;
  g.ready.clear();
  g.cause = cause;
  g.detected_ms = detected_ms;
  g.waiting_since_ms = 0;
  g.waiting_cause.clear();
  g.lost_actors.clear();
  g.joining.clear();  // the actors' list (peers) stays: it has the healed replicas' addresses
  run.actor_errors.clear();
  for (const ActorPlacement& p : leaving) run.done.erase(p.actor.actor_id());
  // A heal under way is given up: its new actors (not in the run until its membership) leave with the others.
  if (!run.heal.joined) leaving.insert(leaving.end(), run.heal.actors.begin(), run.heal.actors.end());
  run.heal = RunHeal{};
  return {std::move(leaving), StepAggregator::CompleteAfterLeave(run)};
}

void NoteCompleteStep(RunProgress& progress, int64_t now_ms) {
  if (progress.last_complete_ms > 0) {
    progress.intervals_ms.push_back(now_ms - progress.last_complete_ms);
    if (progress.intervals_ms.size() > kStallIntervals) progress.intervals_ms.pop_front();
  }
  progress.last_complete_ms = now_ms;
}

bool StallProbeDue(RunProgress& progress, int64_t now_ms) {
  if (progress.last_complete_ms == 0) return false;
  std::vector<int64_t> sorted(progress.intervals_ms.begin(), progress.intervals_ms.end());
  std::sort(sorted.begin(), sorted.end());
  const int64_t median = sorted.empty() ? 0 : sorted[(sorted.size() - 1) / 2];  // the lower one of two
  const int64_t after = std::max(kStallProbeMinMs, median * 3 / 2);
  if (now_ms - progress.last_complete_ms < after || now_ms - progress.probed_ms < kStallProbeMinMs) return false;
  progress.probed_ms = now_ms;
  return true;
}

RegroupNews ApplyRegroupReport(JobRun& run, const StepReport& report, int64_t now_ms) {
  RegroupNews news;
  RunRegroup& g = run.regroup;
  if (g.confirmed || report.epoch() != g.epoch) {
    // No regroup forms (or the actor has not rebuilt for it yet): a step failed on a peer; the fault may be unknown.
    // A probe an actor sent before it saw the confirmation (it completed no step since) is no new failure.
    // Nor is an actor that waits at a heal's confirmed step for the membership with the joining replicas.
    const RunHeal& h = run.heal;
    const bool at_heal = h.confirmed && !h.joined && report.completed_step() == h.target;
    if (g.confirmed && report.epoch() == g.epoch && g.waiting_since_ms == 0 && !at_heal &&
        report.completed_step() >= g.resume_step) {
      g.waiting_since_ms = now_ms;
      g.waiting_cause = absl::StrCat("actor ", report.actor_id(), ": ", report.regroup_cause());
      news.first_wait = true;
    }
    return news;
  }
  g.ready[report.actor_id()] = report.completed_step();
  for (const ActorPlacement& p : run.actors) {
    if (!g.ready.count(p.actor.actor_id())) return news;  // not every actor yet
  }
  std::set<int64_t> steps;
  for (const auto& [actor, step] : g.ready) steps.insert(step);
  if (steps.size() == 1) {
    g.confirmed = true;
    g.resume_step = *steps.begin() + 1;
    news.confirmed = true;
    news.step = *steps.begin();
    return news;
  }
  news.diverged = true;
  for (const auto& [actor, step] : g.ready)
    absl::StrAppend(&news.steps, news.steps.empty() ? "" : ", ", actor, " at ", step);
  return news;
}

void FillRegroupReply(const JobRun& run, ReportStepReply* reply) {
  const RunRegroup& g = run.regroup;
  if (g.epoch == 0) return;
  Regroup* r = reply->mutable_regroup();
  r->Clear();  // filled anew when a report changes the membership
  r->set_epoch(g.epoch);
  for (int x : g.replicas) r->add_replicas(x);
  r->set_confirmed(g.confirmed);
  r->set_resume_step(g.resume_step);
  for (int x : g.joining) r->add_joining(x);
  r->set_donor(g.donor);
  // The actors' list while a membership forms (its actors keep the latest they were told).
  if (!g.confirmed) {
    for (const ActorPeer& p : g.peers) *r->add_peers() = p;
  }
}

void FillRunReply(const JobRun& run, ReportStepReply* reply) {
  FillRegroupReply(run, reply);
  FillDrainReply(run, reply);
  FillHealReply(run, reply);
}

bool InRun(const JobRun& run, const std::string& actor_id) {
  return std::any_of(run.actors.begin(), run.actors.end(),
                     [&](const ActorPlacement& p) { return p.actor.actor_id() == actor_id; });
}

}  // namespace geotrain::head
