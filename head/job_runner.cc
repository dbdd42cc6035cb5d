// Job runner: actor creation, step aggregation and the end of jobs (placement and auto plans: placement.cc).
#include "head/job_runner.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/spec.h"
#include "model/config.h"
#include "scheduler/planner.h"

namespace geotrain::head {

JobRunner::JobRunner(JobManager* jobs, WorkerRegistry* registry, MetricsServer* metrics, std::string token,
                     std::string head_address, TlsFiles tls)
    : jobs_(jobs),
      registry_(registry),
      metrics_(metrics),
      token_(std::move(token)),
      head_address_(std::move(head_address)),
      tls_(std::move(tls)) {}

void JobRunner::StartPendingJobs() {
  for (const JobInfo& job : jobs_->List()) {
    if (job.state() != JOB_PENDING) continue;
    {
      absl::MutexLock lock(&mu_);
      if (launching_.count(job.job_id()) || runs_.count(job.job_id())) continue;
      launching_.insert(job.job_id());
    }
    JobInfo planned = job;
    if (job.spec().parallel().plan() == "auto") {
      auto plan = PlanAutoJob(job.spec(), registry_->Workers(), registry_->SiteLinks());
      if (!plan.ok()) {
        if (plan.status().code() != absl::StatusCode::kUnavailable) {
          (void)jobs_->Transition(job.job_id(), JOB_FAILED, absl::StrCat("planning failed: ", plan.status().message()));
        }
        absl::MutexLock lock(&mu_);
        launching_.erase(job.job_id());
        continue;
      }
      *planned.mutable_spec()->mutable_parallel() = plan->parallel;
      planned.set_predicted_step_seconds(plan->predicted_step_seconds);
      (void)jobs_->SetPlan(job.job_id(), plan->parallel, plan->predicted_step_seconds);
      const ParallelSpec& p = plan->parallel;
      (void)jobs_->Log(job.job_id(), absl::StrFormat("planned: dp %d x pp %d x tp %d, %d microbatches, %s; "
                                                     "predicted step %.3f s",
                                                     p.dp(), p.pp(), p.tp(), p.microbatches(), p.schedule(),
                                                     plan->predicted_step_seconds));
      for (const std::string& line : plan->explanation) (void)jobs_->Log(job.job_id(), "  " + line);
    }
    auto placement = PlaceActors(planned, registry_->Workers());
    absl::Status launched;
    if (!placement.ok()) {
      if (placement.status().code() == absl::StatusCode::kUnavailable) {
        // Not enough devices yet: the job waits for workers.
        const std::string why = absl::StrCat("waiting for workers: ", placement.status().message());
        if (job.message() != why) (void)jobs_->Log(job.job_id(), why);
      } else {
        (void)jobs_->Transition(job.job_id(), JOB_FAILED, std::string(placement.status().message()));
      }
    } else {
      launched = Launch(planned, std::move(*placement));
      if (!launched.ok()) EndJob(job.job_id(), JOB_FAILED, std::string(launched.message()));
    }
    absl::MutexLock lock(&mu_);
    launching_.erase(job.job_id());
  }
}

absl::Status JobRunner::Launch(const JobInfo& job, std::vector<ActorPlacement> placement) {
  std::map<std::string, WorkerInfo> workers;
  for (const WorkerInfo& w : registry_->Workers()) workers[w.worker_id()] = w;
  CreateActorRequest request;
  *request.mutable_spec() = job.spec();
  request.set_head_address(head_address_);
  for (const ActorPlacement& p : placement) {
    const WorkerInfo& w = workers[p.actor.worker_id()];
    ActorPeer* peer = request.add_peers();
    peer->set_actor_id(p.actor.actor_id());
    peer->set_replica(p.actor.replica());
    peer->set_stage(p.actor.stage());
    peer->set_tp_rank(p.actor.tp_rank());
    peer->set_worker_id(w.worker_id());
    peer->set_site(w.site());
    peer->set_address(w.address());
    *peer->mutable_address_for_site() = w.address_for_site();
    const int d = p.actor.device_index();
    peer->set_device_kind(d >= 0 && d < w.devices_size() ? w.devices(d).kind() : DEVICE_KIND_UNSPECIFIED);
  }
  {
    absl::MutexLock lock(&mu_);
    Run& run = runs_[job.job_id()];
    run.spec = job.spec();
    run.actors = placement;
  }
  std::vector<ActorRecord> records;
  for (const ActorPlacement& p : placement) records.push_back(p.actor);
  (void)jobs_->SetActors(job.job_id(), records);
  auto started =
      jobs_->Transition(job.job_id(), JOB_RUNNING, absl::StrCat("placed ", placement.size(), " actors; creating them"));
  if (!started.ok()) return started.status();
  for (const ActorPlacement& p : placement) {
    bool ended;
    {
      absl::MutexLock lock(&mu_);
      ended = runs_[job.job_id()].ended;
    }
    if (ended) {
      // Cancelled (or failed) while its actors were being created: stop the ones already made.
      std::vector<ActorPlacement> made(placement.begin(), placement.begin() + (&p - placement.data()));
      StopActors(made, "the job ended while its actors were being created");
      return absl::OkStatus();
    }
    const WorkerInfo& w = workers[p.actor.worker_id()];
    auto channel = MakeChannel(w.address(), tls_);
    if (!channel.ok()) return channel.status();
    auto stub = Worker::NewStub(*channel);
    grpc::ClientContext ctx;
    AttachToken(&ctx, token_);
    SetDeadlineMillis(&ctx, 10000);
    CreateActorRequest one = request;
    *one.mutable_actor() = p.actor;
    CreateActorReply reply;
    grpc::Status s = stub->CreateActor(&ctx, one, &reply);
    if (!s.ok()) {
      return absl::UnavailableError(absl::StrCat("creating actor ", p.actor.actor_id(), " on worker ", w.worker_id(),
                                                 " (", w.address(), "): ", s.error_message()));
    }
  }
  std::string where;
  for (const ActorPlacement& p : placement) {
    absl::StrAppend(&where, where.empty() ? "" : ", ", "r", p.actor.replica(), "s", p.actor.stage(),
                    p.actor.tp_rank() ? absl::StrCat("t", p.actor.tp_rank()) : "", "@", p.site);
  }
  (void)jobs_->Log(job.job_id(), absl::StrCat("actors created: ", where));
  return absl::OkStatus();
}

void JobRunner::StopActors(const std::vector<ActorPlacement>& actors, const std::string& reason) {
  std::map<std::string, WorkerInfo> workers;
  for (const WorkerInfo& w : registry_->Workers()) workers[w.worker_id()] = w;
  for (const ActorPlacement& p : actors) {
    auto it = workers.find(p.actor.worker_id());
    if (it == workers.end() || it->second.state() != WORKER_ALIVE) continue;
    auto channel = MakeChannel(it->second.address(), tls_);
    if (!channel.ok()) continue;
    auto stub = Worker::NewStub(*channel);
    grpc::ClientContext ctx;
    AttachToken(&ctx, token_);
    SetDeadlineMillis(&ctx, 3000);
    StopActorRequest request;
    request.set_actor_id(p.actor.actor_id());
    request.set_reason(reason);
    StopActorReply reply;
    (void)stub->StopActor(&ctx, request, &reply);
  }
}

void JobRunner::EndJob(const std::string& job_id, JobState state, const std::string& message) {
  std::vector<ActorPlacement> actors;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(job_id);
    if (it != runs_.end()) {
      if (it->second.ended) return;
      it->second.ended = true;
      actors = it->second.actors;
    }
  }
  (void)jobs_->Transition(job_id, state, message);
  if (state != JOB_SUCCEEDED) StopActors(actors, message);
}

void JobRunner::Reconcile(const std::vector<ActorRecord>& reported) {
  std::map<std::string, const ActorRecord*> by_id;
  for (const ActorRecord& a : reported) by_id[a.actor_id()] = &a;
  std::vector<std::pair<std::string, std::string>> failed;
  std::vector<std::string> succeeded;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [job_id, run] : runs_) {
      if (run.ended) continue;
      for (const ActorPlacement& p : run.actors) {
        auto it = by_id.find(p.actor.actor_id());
        if (it == by_id.end() || it->second->state() != ACTOR_DEAD || run.done.count(p.actor.actor_id())) continue;
        if (it->second->message() == "finished") {
          run.done.insert(p.actor.actor_id());
        } else {
          failed.push_back({job_id, absl::StrCat("actor ", p.actor.actor_id(), " died: ", it->second->message())});
          break;
        }
      }
      if (static_cast<int>(run.done.size()) == static_cast<int>(run.actors.size())) succeeded.push_back(job_id);
    }
  }
  for (const auto& [job_id, why] : failed) EndJob(job_id, JOB_FAILED, why);
  for (const std::string& job_id : succeeded) EndJob(job_id, JOB_SUCCEEDED, "every actor finished");
}

void JobRunner::StopJob(const std::string& job_id, const std::string& reason) {
  std::vector<ActorPlacement> actors;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(job_id);
    if (it == runs_.end()) return;
    it->second.ended = true;
    actors = it->second.actors;
  }
  StopActors(actors, reason);
}

void JobRunner::OnWorkerDead(const WorkerInfo& worker) {
  std::vector<std::pair<std::string, std::string>> failed;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [job_id, run] : runs_) {
      if (run.ended) continue;
      for (const ActorPlacement& p : run.actors) {
        if (p.actor.worker_id() == worker.worker_id() && !run.done.count(p.actor.actor_id())) {
          failed.push_back({job_id, absl::StrCat("actor ", p.actor.actor_id(), " died with worker ", worker.worker_id(),
                                                 " (", worker.dead_reason(), ")")});
          break;
        }
      }
    }
  }
  for (const auto& [job_id, why] : failed) EndJob(job_id, JOB_FAILED, why);
}

std::vector<ActorRecord> JobRunner::Actors(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  std::vector<ActorRecord> out;
  auto it = runs_.find(job_id);
  if (it == runs_.end()) return out;
  for (const ActorPlacement& p : it->second.actors) out.push_back(p.actor);
  return out;
}

bool JobRunner::OnStepReport(const StepReport& report) {
  bool finished = false, failed = false;
  int actors = 0;
  StepAggregate complete;
  bool step_complete = false;
  int64_t manifest_step = 0;
  std::map<std::string, std::string> manifest_shards;
  JobSpec manifest_spec;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(report.job_id());
    if (it == runs_.end()) return true;  // unknown (e.g. a head restart lost the run): stop
    Run& run = it->second;
    if (run.ended) return true;
    actors = static_cast<int>(run.actors.size());
    if (!report.error().empty()) {
      failed = true;
    } else if (report.step() > 0) {
      StepAggregate& agg = run.steps[report.step()];
      ++agg.reports;
      agg.step_seconds = std::max(agg.step_seconds, report.step_seconds());
      agg.compute = std::max(agg.compute, report.compute_seconds());
      agg.wait = std::max(agg.wait, report.comm_wait_seconds());
      agg.bubble = std::max(agg.bubble, report.bubble_seconds());
      agg.tokens = report.tokens();
      if (report.carries_loss()) {
        agg.loss = report.loss();
        agg.have_loss = true;
      }
      for (const auto& [pair, bytes] : report.wan_bytes()) agg.wan_bytes[pair] += bytes;
      if (report.compression_ratio() > 0) agg.compression_ratio = report.compression_ratio();
      if (agg.reports == actors) {
        complete = agg;
        step_complete = true;
        run.steps.erase(report.step());
      }
      if (!report.checkpoint().empty()) {
        auto& shards = run.checkpoints[report.step()];
        shards[report.actor_id()] = report.checkpoint();
        const int writers = run.spec.parallel().pp() * run.spec.parallel().tp();
        if (static_cast<int>(shards.size()) == writers) {
          manifest_step = report.step();
          manifest_shards = shards;
          manifest_spec = run.spec;
          run.checkpoints.erase(report.step());
        }
      }
      if (report.done()) run.done.insert(report.actor_id());
      finished = static_cast<int>(run.done.size()) == actors;
    }
  }
  if (failed) {
    EndJob(report.job_id(), JOB_FAILED, absl::StrCat("actor ", report.actor_id(), " failed: ", report.error()));
    return true;
  }
  if (step_complete) RecordStep(report.job_id(), report.step(), complete, actors);
  if (manifest_step > 0) WriteManifest(report.job_id(), manifest_spec, manifest_step, manifest_shards);
  if (finished) {
    EndJob(report.job_id(), JOB_SUCCEEDED, absl::StrCat("finished ", report.step(), " steps"));
  }
  return false;
}

void JobRunner::WriteManifest(const std::string& job_id, const JobSpec& spec, int64_t step,
                              const std::map<std::string, std::string>& shards) {
  // The manifest names every shard of the step; it is written last, atomically, so a reader that finds
  // it finds a complete checkpoint.
  std::string json = absl::StrCat("{\"job\": \"", job_id, "\", \"step\": ", step, ", \"shards\": [");
  bool first = true;
  for (const auto& [actor, dir] : shards) {
    absl::StrAppend(&json, first ? "" : ", ", "{\"actor\": \"", actor, "\", \"dir\": \"", dir, "\"}");
    first = false;
  }
  absl::StrAppend(&json, "]}\n");
  const std::string path = absl::StrCat(spec.checkpoint().dir(), "/manifest.json");
  if (absl::Status s = WriteFileAtomically(path, json, 0644); !s.ok()) {
    (void)jobs_->Log(job_id, absl::StrCat("checkpoint of step ", step, " not recorded: ", s.message()));
    return;
  }
  (void)jobs_->Log(job_id, absl::StrCat("checkpoint of step ", step, " complete: ", path));
}

void JobRunner::RecordStep(const std::string& job_id, int64_t step, const StepAggregate& agg, int actors) {
  const double tokens_per_second = agg.step_seconds > 0 ? agg.tokens / agg.step_seconds : 0;
  std::string wan;
  int64_t wan_total = 0;
  for (const auto& [pair, bytes] : agg.wan_bytes) {
    absl::StrAppend(&wan, " ", pair, " ", bytes);
    wan_total += bytes;
  }
  const std::string line = absl::StrFormat(
      "step %d loss %.6f %.0f tokens/s step %.3f s (compute %.3f, comm wait %.3f, bubble %.3f) wan bytes %d%s", step,
      agg.loss, tokens_per_second, agg.step_seconds, agg.compute, agg.wait, agg.bubble, wan_total,
      wan.empty() ? "" : absl::StrCat(" (", wan.substr(1), ")"));
  (void)jobs_->UpdateProgress(job_id, step, agg.loss, tokens_per_second, agg.step_seconds, line);
  if (metrics_ == nullptr) return;
  if (auto job = jobs_->Get(job_id); job.ok() && job->predicted_step_seconds() > 0) {
    metrics_->Gauges("geotrain_predicted_step_seconds", "The planner's predicted step time, by job")
        .Add({{"job", job_id}})
        .Set(job->predicted_step_seconds());
  }
  metrics_->Gauges("geotrain_measured_step_seconds", "The latest measured step time, by job")
      .Add({{"job", job_id}})
      .Set(agg.step_seconds);
  static const prometheus::Histogram::BucketBoundaries kBuckets = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                                   2.5,  5,     10,   30,  60,   120};
  prometheus::BuildHistogram()
      .Name("geotrain_step_duration_seconds")
      .Help("Optimizer step time, by job")
      .Register(metrics_->registry())
      .Add({{"job", job_id}}, kBuckets)
      .Observe(agg.step_seconds);
  metrics_->Gauges("geotrain_tokens_per_second", "Training throughput, by job")
      .Add({{"job", job_id}})
      .Set(tokens_per_second);
  if (agg.have_loss)
    metrics_->Gauges("geotrain_train_loss", "Training loss, by job").Add({{"job", job_id}}).Set(agg.loss);
  metrics_->Gauges("geotrain_pipeline_bubble_ratio", "Pipeline bubble share of step time, by job")
      .Add({{"job", job_id}})
      .Set(agg.step_seconds > 0 ? agg.bubble / agg.step_seconds : 0);
  auto& wan_family = metrics_->Counters("geotrain_wan_bytes_total", "Bytes sent between sites");
  for (const auto& [pair, bytes] : agg.wan_bytes) {
    const size_t gt = pair.find('>');
    wan_family.Add({{"src_site", pair.substr(0, gt)}, {"dst_site", pair.substr(gt + 1)}, {"direction", "sent"}})
        .Increment(static_cast<double>(bytes));
  }
  if (agg.compression_ratio > 0) {
    std::string codec;
    {
      absl::MutexLock lock(&mu_);
      auto it = runs_.find(job_id);
      if (it != runs_.end()) codec = it->second.spec.comm().wan_codec();
    }
    metrics_->Gauges("geotrain_codec_compression_ratio", "Raw over encoded bytes across sites, by codec")
        .Add({{"codec", codec}})
        .Set(agg.compression_ratio);
  }
  (void)actors;
}

}  // namespace geotrain::head
