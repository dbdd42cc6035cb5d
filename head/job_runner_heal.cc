// JobRunner's heals (head/job_heal.h): a degraded run's missing replicas placed on free devices, their actors created
// to join it, the step they join after, and the heal's record. The rest of the runner is in job_runner.cc.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "head/job_heal.h"
#include "head/job_runner.h"

namespace geotrain::head {
namespace {

std::string Replicas(const std::vector<int>& replicas) {
  return absl::StrCat(replicas.size() == 1 ? "replica " : "replicas ", absl::StrJoin(replicas, ", "));
}

std::string WorkersOf(const std::vector<ActorPlacement>& actors) {
  std::set<std::string> workers;
  for (const ActorPlacement& p : actors) workers.insert(p.actor.worker_id());
  return absl::StrJoin(workers, ", ");
}

// Why a heal that has not joined yet cannot finish ("" when it may).
std::string HealBlocked(const JobRun& run, const WorkersById& workers, int64_t now_ms) {
  const RunHeal& h = run.heal;
  if (!run.drain.workers.empty()) return "a drain began";
  for (const ActorPlacement& p : h.actors) {
    auto w = workers.find(p.actor.worker_id());
    if (w == workers.end() || w->second.state() != WORKER_ALIVE) {
      return absl::StrCat("worker ", p.actor.worker_id(), " of its new actor ", p.actor.actor_id(), " is not alive");
    }
  }
  if (h.target == 0 && now_ms - h.started_ms > kHealSetUpMs) {
    return absl::StrCat("its new actors did not all set up within ", kHealSetUpMs / 1000, " s (", h.ready.size(),
                        " of ", h.actors.size(), " did)");
  }
  return "";
}

}  // namespace

void JobRunner::CheckHeals() {
  const std::vector<WorkerInfo> workers = registry_->Workers();
  const WorkersById by_id = ById(workers);
  const int64_t now = clock_->NowMillis();
  struct Candidate {
    std::string job_id;
    int64_t attempt, epoch;
    std::vector<int> missing;
  };
  std::vector<Candidate> candidates;
  std::vector<std::tuple<std::string, int64_t, std::string>> give_ups;  // job, run, why
  {
    absl::MutexLock lock(&runs_.mu);
    for (auto& [job_id, run] : runs_.by_job) {
      if (run.phase != RunPhase::kRunning) continue;
      if (!run.heal.replicas.empty()) {
        if (run.heal.joined) continue;  // a failure now is the run's fault like any other
        if (std::string why = HealBlocked(run, by_id, now); !why.empty())
          give_ups.push_back({job_id, run.attempt, why});
        continue;
      }
      // Placing reads the job's record and the cluster: once a second is often enough for devices to come free; and
      // not before the wait after a heal given up.
      if (now - run.regroup.heal_looked_ms < kHealLookMs || now < run.regroup.heal_retry_ms) continue;
      std::vector<int> missing = MissingReplicas(run, by_id);
      if (missing.empty()) continue;
      run.regroup.heal_looked_ms = now;
      candidates.push_back({job_id, run.attempt, NextEpoch(run.regroup), std::move(missing)});
    }
  }
  for (const auto& [job_id, attempt, why] : give_ups) GiveUpHeal(job_id, attempt, why);
  for (const Candidate& c : candidates) {
    absl::StatusOr<JobInfo> job = jobs_->Get(c.job_id);
    if (!job.ok() || job->timed_compute()) continue;  // timed compute has no weights to stream
    HeldDevices held = HeldByOthers(c.job_id);
    for (const ActorRecord& a : Actors(c.job_id)) held[{a.worker_id(), a.device_index()}] = c.job_id;
    // Not every missing replica fits now: the job trains on degraded and tries again on the next look.
    absl::StatusOr<std::vector<ActorPlacement>> placed = PlaceHeal(*job, c.missing, workers, held, c.attempt, c.epoch);
    if (!placed.ok()) continue;
    Regroup join;
    std::vector<ActorPeer> peers;
    JobSpec spec;
    {
      absl::MutexLock lock(&runs_.mu);
      auto it = runs_.by_job.find(c.job_id);
      if (it == runs_.by_job.end() || it->second.attempt != c.attempt ||
          MissingReplicas(it->second, by_id) != c.missing || NextEpoch(it->second.regroup) != c.epoch) {
        continue;  // the run moved on meanwhile
      }
      JobRun& run = it->second;
      BeginHeal(run, c.missing, *placed, now);
      join = HealMembership(run);
      run.heal.peers = ActorLauncher::Peers(HealedActors(run), by_id);
      peers = run.heal.peers;
      spec = run.spec;
    }
    LogIfFailed(jobs_->Log(c.job_id, absl::StrCat("healing: ", Replicas(c.missing),
                                                  c.missing.size() == 1 ? " comes" : " come", " back on worker",
                                                  WorkersOf(*placed).find(',') == std::string::npos ? " " : "s ",
                                                  WorkersOf(*placed),
                                                  "; once set up, they join at a step boundary "
                                                  "with replica ",
                                                  join.donor(), "'s state streamed to them")),
                c.job_id, "logging");
    LaunchHeal(c.job_id, c.attempt, *placed, spec, join, peers);
  }
}

void JobRunner::LaunchHeal(const std::string& job_id, int64_t attempt, const std::vector<ActorPlacement>& actors,
                           const JobSpec& spec, const Regroup& join, const std::vector<ActorPeer>& peers) {
  const absl::Status created =
      launcher_.CreateActors(spec, actors, ById(registry_->Workers()), attempt, /*resume_from=*/"", &peers, &join);
  if (!created.ok()) GiveUpHeal(job_id, attempt, std::string(created.message()));
}

bool JobRunner::GiveUpHeal(const std::string& job_id, int64_t attempt, const std::string& why) {
  std::vector<ActorPlacement> stop;
  std::vector<int> replicas;
  std::string present;
  bool regroup = false;  // the others wait at the confirmed step: a membership of them alone lets them go on
  std::vector<ActorPlacement> staying;
  std::vector<int> kept;
  int64_t epoch = 0;
  int planned = 0;
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(job_id);
    // A fault being handled (not kRunning) ends the heal itself: its regroup stops the new actors, a restart's run
    // refuses their reports.
    if (it == runs_.by_job.end() || it->second.attempt != attempt || it->second.heal.replicas.empty() ||
        it->second.heal.joined || it->second.phase != RunPhase::kRunning) {
      return false;
    }
    JobRun& run = it->second;
    replicas = run.heal.replicas;
    planned = run.spec.parallel().dp();
    RunRegroup& g = run.regroup;
    g.heal_backoff_ms = g.heal_backoff_ms == 0 ? kHealRetryMs : std::min(2 * g.heal_backoff_ms, kHealRetryMaxMs);
    g.heal_retry_ms = clock_->NowMillis() + g.heal_backoff_ms;
    if (run.heal.confirmed) {
      kept = PresentReplicas(run);
      RegroupBegun begun = BeginRegroup(run, kept, absl::StrCat("a heal given up: ", why), clock_->NowMillis());
      QueueSteps(run, std::move(begun.completed));
      stop = std::move(begun.leaving);
      staying = run.actors;
      epoch = run.regroup.epoch;
      regroup = true;
    } else {
      stop = run.heal.actors;
      run.heal = RunHeal{};
    }
    present = absl::StrJoin(PresentReplicas(run), ", ");
  }
  launcher_.StopActors(stop, absl::StrCat("the heal was given up: ", why), /*wait=*/false, /*job_goes_on=*/true);
  if (regroup) {
    recovery_.RecordRegroup(job_id, staying, kept, planned, epoch, absl::StrCat("a heal given up: ", why));
    // The others stopped after the heal's step, or (if the word had not reached them) train on: either way they
    // rebuild for the membership without the new actors and resume after that step.
    launcher_.InterruptActors(staying, epoch);
  }
  RecordSteps(job_id);
  LogIfFailed(jobs_->Log(job_id, absl::StrCat("heal of ", Replicas(replicas), " given up: ", why,
                                              "; the job trains on with replicas ", present)),
              job_id, "logging");
  return true;
}

std::optional<ReportStepReply> JobRunner::OnHealReport(const StepReport& report) {
  ReportStepReply reply;
  HealNews news;
  int64_t attempt = 0;
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(report.job_id());
    const bool found = it != runs_.by_job.end();
    const bool in_heal = found && InHeal(it->second, report.actor_id()) && !it->second.heal.joined;
    if (!report.heal_ready() && !in_heal) return std::nullopt;  // an error of another actor, or of one that joined
    // A ready report may arrive after the membership moved (sent before its actor saw it): the actor is the run's.
    const bool joined = found && !in_heal && InRun(it->second, report.actor_id());
    if ((!in_heal && !joined) || it->second.phase == RunPhase::kEnded || report.attempt() != it->second.attempt) {
      reply.set_stop(true);  // an ended job, an earlier run, or a heal given up
      return reply;
    }
    JobRun& run = it->second;
    attempt = run.attempt;
    if (run.phase == RunPhase::kRunning && in_heal && report.heal_ready())
      news = ApplyHealReady(run, report.actor_id());
    FillRunReply(run, &reply);
  }
  if (!report.error().empty()) {
    // Joined meanwhile (or a fault is being handled): the error is the run's, as any actor's.
    if (!GiveUpHeal(report.job_id(), attempt,
                    absl::StrCat("its new actor ", report.actor_id(), " failed: ", report.error()))) {
      return std::nullopt;
    }
    reply.set_stop(true);
    return reply;
  }
  AfterHealNews(report.job_id(), news);
  return reply;
}

void JobRunner::AfterHealNews(const std::string& job_id, const HealNews& news) {
  if (!news.picked && !news.joined && !news.boundary.repicked && !news.boundary.broken) return;
  int64_t target = 0, attempt = 0, epoch = 0;
  std::vector<int> replicas, present;
  int donor = 0;
  bool joined = false;  // the heal's membership is still the run's (no regroup replaced it meanwhile)
  std::vector<ActorRecord> actors;
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(job_id);
    if (it == runs_.by_job.end()) return;
    const JobRun& run = it->second;
    const RunRegroup& g = run.regroup;
    target = run.heal.target;
    attempt = run.attempt;
    replicas = run.heal.replicas;
    donor = run.heal.donor;
    joined = news.joined && run.heal.joined && g.epoch == run.heal.epoch;
    epoch = g.epoch;
    present = g.replicas;
    for (const ActorPlacement& p : run.actors) actors.push_back(p.actor);
  }
  if (news.boundary.broken) {
    recovery_.Fault(job_id, attempt,
                    "an actor trained past the step a heal was confirmed at (a protocol break): restarting",
                    /*permanent=*/false, /*lost_actor=*/"", /*no_regroup=*/true);
    return;
  }
  if (news.picked) {
    LogIfFailed(
        jobs_->Log(job_id, absl::StrCat("healing: the new actors of ", Replicas(replicas),
                                        " are set up; every actor pauses after step ", target, " for them to join")),
        job_id, "logging");
  }
  if (news.boundary.repicked) {
    LogIfFailed(
        jobs_->Log(job_id, absl::StrCat("healing: actor ", news.boundary.passed_actor, " finished step ",
                                        news.boundary.passed_step, " before it knew of step ", news.boundary.old_target,
                                        "; the replicas join after step ", target, " instead")),
        job_id, "logging");
  }
  if (joined) {
    // A restarted head takes the forming membership over with its new actors (they report ready again).
    LogIfFailed(jobs_->SetActors(job_id, actors), job_id, "recording the healed run's actors");
    LogIfFailed(jobs_
                    ->Update(job_id,
                             [&](JobInfo& j) {
                               j.set_epoch(epoch);
                               j.set_regroup_resume_step(0);  // forming
                               j.clear_present_replicas();
                               for (int r : present) j.add_present_replicas(r);
                             })
                    .status(),
                job_id, "recording the heal's membership");
    LogIfFailed(jobs_->Log(job_id, absl::StrCat("healing: every actor stopped after step ", target, "; replica ", donor,
                                                "'s actors stream their state to ", Replicas(replicas))),
                job_id, "logging");
  }
}

void JobRunner::RecordHealed(const std::string& job_id, int64_t step) {
  std::vector<int> replicas, present;
  int donor = 0, planned = 0;
  {
    absl::MutexLock lock(&runs_.mu);
    auto it = runs_.by_job.find(job_id);
    if (it == runs_.by_job.end()) return;
    const JobRun& run = it->second;
    replicas = run.regroup.joining;
    donor = run.regroup.donor;
    present = PresentReplicas(run);
    planned = run.spec.parallel().dp();
  }
  aggregator_.CountHeal(job_id, static_cast<int>(present.size()));
  LogIfFailed(jobs_
                  ->Update(job_id,
                           [&](JobInfo& j) {
                             j.set_heals(j.heals() + 1);
                             j.set_heal_seconds(0);  // until the healed replicas' first step
                             j.mutable_replicas()->set_present(static_cast<int>(present.size()));
                             j.mutable_replicas()->set_planned(planned);
                             j.clear_present_replicas();
                             for (int r : present) j.add_present_replicas(r);
                             j.set_message(static_cast<int>(present.size()) == planned
                                               ? "RUNNING"
                                               : absl::StrCat("RUNNING, degraded: ", present.size(), " of ", planned,
                                                              " replicas train on"));
                           })
                  .status(),
              job_id, "recording the heal");
  LogIfFailed(
      jobs_->Log(job_id, absl::StrCat("healed: ", Replicas(replicas), " joined at step ", step, " with replica ", donor,
                                      "'s weights and optimizer state (no checkpoint "
                                      "read, no step lost); replicas ",
                                      absl::StrJoin(present, ", "), " train step ", step + 1, " next")),
      job_id, "logging");
}

void JobRunner::RecordHealSeconds(const std::string& job_id, int64_t step, double seconds) {
  aggregator_.SetHealSeconds(job_id, seconds);
  LogIfFailed(jobs_->Update(job_id, [&](JobInfo& j) { j.set_heal_seconds(seconds); }).status(), job_id,
              "recording the heal's cost");
  LogIfFailed(jobs_->Log(job_id, absl::StrFormat("healed replicas trained their first step (%d): %.1f s after the "
                                                 "fault they left for was detected",
                                                 step, seconds)),
              job_id, "logging");
}

}  // namespace geotrain::head
