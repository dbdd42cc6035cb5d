// Stage actor: its thread, state, step loop, checkpoints and reports (see stage_actor.h).
#include "worker/stage_actor.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "model/checkpoint.h"
#include "worker/actor_ranks.h"
#include "worker/stage_trainer.h"

namespace geotrain::worker {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

}  // namespace

StageActor::StageActor(StageActorConfig config, ActorServices services)
    : config_(std::move(config)), services_(std::move(services)) {
  if (!services_.head) {
    if (auto channel = MakeChannel(config_.head_address, config_.tls); channel.ok()) {
      services_.head = std::make_unique<GrpcHeadClient>(*channel, config_.token);
    }
  }
  if (!services_.collectives) {
    services_.collectives = std::make_unique<GrpcCollectivesFactory>(services_.mailbox, config_.token,
                                                                     services_.head ? services_.head->stub() : nullptr,
                                                                     absl::Milliseconds(config_.collective_timeout_ms));
  }
}

StageActor::~StageActor() {
  Stop("the worker is shutting down");
  if (thread_.joinable()) thread_.join();
}

void StageActor::Start() {
  thread_ = std::thread([this] {
    absl::Status s = Run();
    if (!s.ok()) {
      const std::string why = stop_ ? absl::StrCat("stopped: ", s.message()) : std::string(s.message());
      GT_LOG(WARNING) << "actor " << config_.actor.actor_id() << " ended: " << why;
      SetState(ACTOR_DEAD, why);
      if (!stop_) {
        StepReport report;
        report.set_job_id(config_.actor.job_id());
        report.set_actor_id(config_.actor.actor_id());
        report.set_error(why);
        Report(report);
      }
    }
    absl::MutexLock lock(&mu_);
    finished_ = true;
  });
}

void StageActor::Stop(const std::string& reason) {
  if (!stop_.exchange(true)) {
    {
      absl::MutexLock lock(&mu_);
      if (state_ != ACTOR_DEAD) message_ = reason;
    }
    // Receives blocked on peers end now rather than at their deadline.
    if (services_.mailbox != nullptr) services_.mailbox->CancelJob(CommJobId(config_.actor.job_id(), config_.attempt));
  }
}

bool StageActor::finished() const {
  absl::MutexLock lock(&mu_);
  return finished_;
}

ActorRecord StageActor::Record() const {
  ActorRecord r = config_.actor;
  absl::MutexLock lock(&mu_);
  r.set_state(state_);
  r.set_message(message_);
  return r;
}

void StageActor::SetState(ActorState state, const std::string& message) {
  absl::MutexLock lock(&mu_);
  state_ = state;
  message_ = message;
}

void StageActor::Report(const StepReport& report) {
  if (!services_.head) return;
  // The last report and an error decide the job's end: they are retried (about a minute in all);
  // an ordinary step report is tried once.
  const bool decisive = report.done() || !report.error().empty();
  absl::StatusOr<ReportStepReply> reply;
  for (int attempt = 0, backoff_ms = 500; attempt < (decisive ? 8 : 1); ++attempt, backoff_ms *= 2) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(std::min(backoff_ms, 8000)));
    reply = services_.head->ReportStep(report, absl::Seconds(5));
    if (reply.ok()) break;
  }
  if (!reply.ok()) {
    GT_LOG(WARNING) << "actor " << config_.actor.actor_id() << ": cannot report step " << report.step()
                    << " to the head: " << reply.status().message();
  } else if (reply->stop()) {
    Stop("the head stopped the job");
  }
}

absl::Status StageActor::Run() {
  const JobSpec& spec = config_.spec;
  const ActorRecord& me = config_.actor;
  ASSIGN_OR_RETURN(ActorRanks ranks, ActorRanks::Create(spec, me, config_.peers, config_.site, config_.attempt));
  ASSIGN_OR_RETURN(std::unique_ptr<StageTrainer> trainer,
                   StageTrainer::Create(spec, ranks, config_.peers, services_.collectives.get(), config_.device,
                                        config_.device_index));
  SetState(ACTOR_ALIVE, "training");
  GT_LOG(INFO) << "actor " << me.actor_id() << " (replica " << ranks.replica << ", stage " << ranks.stage << " of "
               << ranks.pp << ", tp rank " << ranks.tp_rank << ") " << trainer->Describe();

  for (int step = 1; step <= spec.train().steps(); ++step) {
    const auto step_start = Clock::now();
    ASSIGN_OR_RETURN(StepStats stats, trainer->Step(step, stop_));
    StepReport report;
    report.set_job_id(me.job_id());
    report.set_actor_id(me.actor_id());
    report.set_step(step);
    report.set_loss(stats.loss);
    report.set_carries_loss(stats.carries_loss && ranks.replica == 0);
    report.set_step_seconds(SecondsSince(step_start));
    report.set_compute_seconds(stats.compute_seconds);
    report.set_comm_wait_seconds(stats.wait_seconds);
    report.set_bubble_seconds(stats.bubble_seconds);
    report.set_tokens(static_cast<int64_t>(spec.train().global_batch()) * ranks.seq_len);
    report.set_val_loss(-1);
    for (const auto& [pair, bytes] : stats.traffic.wan_bytes) (*report.mutable_wan_bytes())[pair] = bytes;
    if (stats.traffic.encoded_wan_bytes > 0) {
      report.set_compression_ratio(stats.traffic.raw_wan_bytes / stats.traffic.encoded_wan_bytes);
    }
    report.set_done(step == spec.train().steps());
    // Checkpoints: replica 0 writes each stage's shard (weights, AdamW moments, data position); the head
    // writes the job's manifest once every shard of the step is in, so a checkpoint is complete or absent.
    const int every = spec.checkpoint().every_steps();
    if (!spec.checkpoint().dir().empty() && ranks.replica == 0 && ((every > 0 && step % every == 0) || report.done())) {
      const std::string dir = absl::StrCat(spec.checkpoint().dir(), "/stage_", ranks.stage,
                                           ranks.tp > 1 ? absl::StrCat("_tp", ranks.tp_rank) : "");
      model::DataPosition position = trainer->loader() ? trainer->loader()->position() : model::DataPosition{};
      RETURN_IF_ERROR(model::SaveCheckpoint(dir, step, trainer->stage(), trainer->optimizer(), position));
      char step_dir[32];
      std::snprintf(step_dir, sizeof(step_dir), "/step_%08d", step);
      report.set_checkpoint(dir + step_dir);
    }
    Report(report);
    if (stop_) return absl::CancelledError("stop requested");
  }
  SetState(ACTOR_DEAD, "finished");
  return absl::OkStatus();
}

}  // namespace geotrain::worker
