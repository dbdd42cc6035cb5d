// Stage actor: its thread, state, step loop, checkpoints and reports (see stage_actor.h).
#include "worker/stage_actor.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/status.h"
#include "model/checkpoint.h"
#include "worker/actor_ranks.h"
#include "worker/stage_trainer.h"

namespace geotrain::worker {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Errors in the job itself, which any worker would hit again: a spec it cannot run, data or a checkpoint that is
// not there or not readable. Transport errors (UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED...) are not.
// A step that failed on a peer (a stream or a collective: the peer's process gone, a link down, receives cancelled by
// a regroup), which a live regroup may recover from; other errors are this actor's own.
bool IsPeerFailure(const absl::Status& s) {
  if (comm::IsJobFailedOnReceiver(s)) return true;  // the peer's receives were cancelled: it failed, or it regroups
  switch (s.code()) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kAborted:
      return !comm::IsJobStoppedOnReceiver(s);  // a peer stopped because the job stops: stop too
    default:
      return false;
  }
}

// Whether a fault may leave this job training on with fewer replicas (the head decides alike, head/job_regroup.h):
// the spec allows it and no actor runs on a CUDA device (NCCL's groups are not rebuilt live).
bool RegroupsLive(const JobSpec& spec, const std::vector<ActorPeer>& peers) {
  std::string why;
  return RegroupAllowedBySpec(spec, &why) && std::none_of(peers.begin(), peers.end(), [](const ActorPeer& p) {
           return p.device_kind() == DEVICE_KIND_CUDA;
         });
}

bool IsConfigurationError(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return true;
    default:
      return false;
  }
}

}  // namespace

StageActor::StageActor(StageActorConfig config, ActorServices services)
    : config_(std::move(config)), services_(std::move(services)) {
  peers_ = config_.peers;
  if (!services_.head) {
    if (auto channel = MakeChannel(config_.head_address, config_.tls); channel.ok()) {
      services_.head = std::make_unique<GrpcHeadClient>(*channel, config_.token);
    }
  }
  if (!services_.collectives) {
    // The tensor streams to peers go under the same TLS configuration as every other connection.
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials = MakeChannelCredentials(config_.tls);
    if (!credentials.ok()) GT_LOG(ERROR) << "actor " << config_.actor.actor_id() << ": " << credentials.status();
    auto factory = std::make_unique<GrpcCollectivesFactory>(
        services_.mailbox, config_.token, services_.head ? services_.head->stub() : nullptr,
        absl::Milliseconds(config_.collective_timeout_ms), credentials.value_or(nullptr), services_.links);
    factory->set_on_peer_unavailable([this](const std::string& actor_id) { ReportUnreachable(actor_id); });
    services_.collectives = std::move(factory);
  }
  if (services_.checkpoints) {
    checkpoint_writer_ = std::make_unique<CheckpointWriter>([this](CheckpointShard* shard) {
      return services_.checkpoints->Publish(shard, model::StepDirectory(CheckpointDir(), shard->step()));
    });
  } else {
    checkpoint_writer_ = std::make_unique<CheckpointWriter>();
  }
  reporter_ = std::make_unique<StepReporter>(
      services_.head.get(), config_.actor.actor_id(), [this] { Stop("the head stopped the job"); },
      [this](const ReportStepReply& reply) { OnReply(reply); });
}

void StageActor::OnReply(const ReportStepReply& reply) {
  // Every reply says where the job's drain stands now (0: no drain).
  drain_at_step_ = reply.drain_at_step();
  drain_confirmed_step_ = reply.drain_confirmed() ? reply.drain_at_step() : 0;
  heal_at_step_ = reply.heal_at_step();
  heal_confirmed_step_ = reply.heal_confirmed() ? reply.heal_at_step() : 0;
  absl::MutexLock lock(&mu_);
  regroup_ = reply.regroup();
  if (!reply.drain_checkpoint_dir().empty()) drain_checkpoint_dir_ = reply.drain_checkpoint_dir();
}

std::string StageActor::CheckpointDir() const {
  if (!config_.spec.checkpoint().dir().empty()) return config_.spec.checkpoint().dir();
  absl::MutexLock lock(&mu_);
  return drain_checkpoint_dir_;  // a job without checkpoint.dir gets one from the head for its drain
}

StageActor::~StageActor() {
  // A finished actor (the worker forgets it) leaves its job's mailbox alone: other actors of the job may still
  // receive there.
  if (!finished()) Stop("the worker is shutting down", /*job_stopping=*/false);
  if (thread_.joinable()) thread_.join();
}

void StageActor::Start() {
  thread_ = std::thread([this] {
    absl::Status s = Run();
    // A peer that refused a tensor because the job was stopped there: the stop reached that worker first and is
    // on its way here. This actor stops too (and with it its job's receives on this worker), without an error.
    if (!s.ok() && comm::IsJobStoppedOnReceiver(s)) Stop("a peer stopped the job");
    if (!s.ok()) {
      const std::string why = stop_ ? absl::StrCat("stopped: ", s.message()) : std::string(s.message());
      GT_LOG(WARNING) << "actor " << config_.actor.actor_id() << " ended: " << why;
      SetState(ACTOR_DEAD, why);
      if (!stop_) {
        StepReport report;
        report.set_job_id(config_.actor.job_id());
        report.set_actor_id(config_.actor.actor_id());
        report.set_attempt(config_.attempt);
        report.set_error(why);
        report.set_permanent(!set_up_ && IsConfigurationError(s));
        reporter_->Enqueue(report);
      }
    }
    // The run is over: every report is queued and no checkpoint will be written. The worker keeps a finished
    // actor for its record; it holds no thread: the writer ends now (after a write in flight), the reporter once
    // the head has the last report.
    checkpoint_writer_.reset();
    reporter_->Close();
    absl::MutexLock lock(&mu_);
    finished_ = true;
  });
}

void StageActor::Stop(const std::string& reason, bool job_stopping) {
  if (!stop_.exchange(true)) {
    {
      absl::MutexLock lock(&mu_);
      if (state_ != ACTOR_DEAD) message_ = reason;
    }
    // Receives blocked on peers end now rather than at their deadline.
    if (services_.mailbox != nullptr) services_.mailbox->CancelJob(comm_job_id(), job_stopping);
  }
}

void StageActor::ReportUnreachable(const std::string& peer_actor_id) {
  {
    absl::MutexLock lock(&mu_);
    if (!reported_unreachable_.insert(peer_actor_id).second) return;  // once per peer
  }
  StepReport report;
  report.set_job_id(config_.actor.job_id());
  report.set_actor_id(config_.actor.actor_id());
  report.set_attempt(config_.attempt);
  report.set_unreachable_peer(peer_actor_id);
  reporter_->Enqueue(report);
}

void StageActor::Interrupt(int64_t epoch) {
  const int64_t current = epoch_;  // read once: the actor thread may move it on meanwhile
  if (epoch <= current || services_.mailbox == nullptr) return;
  GT_LOG(INFO) << "actor " << config_.actor.actor_id() << ": the job regroups (membership " << epoch
               << "): the step in flight ends";
  services_.mailbox->CancelJob(CommJobId(config_.actor.job_id(), config_.attempt, current), /*stopped=*/false);
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

absl::StatusOr<StageActor::SetUp> StageActor::SetUpStage() {
  const JobSpec& spec = config_.spec;
  const ActorRecord& me = config_.actor;
  ASSIGN_OR_RETURN(ActorRanks ranks, ActorRanks::Create(spec, me, config_.peers, config_.site, config_.attempt));
  const bool joining = config_.join.epoch() > 0;
  if (joining) {  // a heal: its collectives are those of the membership it joins
    ranks = ranks.Regrouped(config_.join.epoch(),
                            std::vector<int>(config_.join.replicas().begin(), config_.join.replicas().end()));
    epoch_ = ranks.epoch;
  }
  ASSIGN_OR_RETURN(std::unique_ptr<StageTrainer> trainer,
                   StageTrainer::Create(spec, ranks, config_.peers, services_.collectives.get(), config_.device,
                                        config_.device_index, services_.data));
  trainer->set_slowdown(config_.slowdown);
  const bool timed = trainer->timed();
  if (joining && (timed || !trainer->regroupable())) {
    return absl::FailedPreconditionError(
        "a joining actor needs a stage whose state can be streamed to it: real "
        "weights (not timed compute) and collectives on gRPC");
  }
  ASSIGN_OR_RETURN(const int64_t first_step, joining ? Join(*trainer, ranks) : Resume(*trainer));
  SetState(ACTOR_ALIVE, "training");
  set_up_ = true;
  GT_LOG(INFO) << "actor " << me.actor_id() << " (replica " << ranks.replica << ", stage " << ranks.stage << " of "
               << ranks.pp << ", tp rank " << ranks.tp_rank << ", run " << config_.attempt << ") "
               << trainer->Describe();
  if (timed) {
    GT_LOG(INFO) << "actor " << me.actor_id()
                 << ": timed compute: every op waits the emulated device's time and computes nothing; step times are "
                    "EMULATED, losses are not real (not reported), no checkpoint is written (no real weights)";
  }
  if (config_.slowdown > 1) {
    GT_LOG(INFO) << "actor " << me.actor_id() << ": slowed " << config_.slowdown
                 << "x (--slowdown): each op is followed by a wait of (factor - 1) times its time; step times are "
                    "EMULATED, losses real";
  }

  return SetUp{std::move(ranks), std::move(trainer), first_step};
}

absl::Status StageActor::Run() {
  const JobSpec& spec = config_.spec;
  const ActorRecord& me = config_.actor;
  ASSIGN_OR_RETURN(SetUp set_up, SetUpStage());
  ActorRanks& ranks = set_up.ranks;
  std::unique_ptr<StageTrainer>& trainer = set_up.trainer;
  const int64_t first_step = set_up.first_step;
  const bool timed = trainer->timed();
  const int64_t steps = spec.train().steps();
  const bool regroups = RegroupsLive(spec, config_.peers) && trainer->regroupable();
  for (int64_t step = first_step; step <= steps; ++step) {
    const auto step_start = Clock::now();
    absl::StatusOr<StepFigures> stepped = trainer->Step(step, stop_);
    absl::Status peer_failure;  // a step whose update applied, then something after it failed on a peer
    if (!stepped.ok()) {
      // A peer failed (a stream, a collective): the job may go on without its replica, without a restart.
      if (stop_ || !regroups || !IsPeerFailure(stepped.status())) return stepped.status();
      peer_failure = stepped.status();
      if (trainer->completed_step() == step) {
        stepped = trainer->FiguresSoFar(step);  // reported as trained (its validation failed), then the regroup
      } else {
        ASSIGN_OR_RETURN(const int64_t resume,
                         AwaitRegroup(*trainer, ranks, peer_failure,
                                      absl::StrCat("step ", step, " failed (", peer_failure.message(), ")")));
        if (resume == 0) return LeftForRegroup();
        step = resume - 1;
        continue;
      }
    }
    StepFigures figures = *std::move(stepped);
    // Its checkpoint shards: DiLoCo's group leaders, else the lowest replica present.
    const bool writer =
        trainer->outer() != nullptr ? trainer->collectives().diloco_leader : ranks.replica == ranks.lead_replica();
    if (timed) {  // an emulated step: no real loss to report
      figures.set_timed_compute(true);
      figures.set_loss(0);
      figures.set_val_loss(-1);
    }
    StepReport report;
    report.set_job_id(me.job_id());
    report.set_actor_id(me.actor_id());
    report.set_attempt(config_.attempt);
    report.set_step(step);
    report.set_carries_loss(trainer->carries_loss());
    *report.mutable_figures() = std::move(figures);
    report.set_done(step == steps);
    // A drain (head/job_drain.h): the step the job's actors leave after, as this actor knows it now.
    const int64_t drain_at = drain_at_step_;
    report.set_drain_at_step(drain_at);
    const bool leaving = drain_at == step && !report.done();
    // A heal (head/job_heal.h): the step every actor pauses after for the healed replicas to join.
    const int64_t heal_at = heal_at_step_;
    report.set_heal_at_step(heal_at);
    const bool healing = heal_at == step && !report.done() && regroups;
    const int every = spec.checkpoint().every_steps();
    const std::string dir = CheckpointDir();
    if (!timed && !dir.empty() && writer && ((every > 0 && step % every == 0) || report.done() || leaving)) {
      ASSIGN_OR_RETURN(const double seconds, WriteCheckpoint(*trainer, ranks, step, dir));
      report.mutable_figures()->set_checkpoint_seconds(seconds);
    }
    if (report.done()) checkpoint_writer_->WaitIdle();  // the last checkpoint goes with the last report
    for (CheckpointShard& shard : checkpoint_writer_->TakeFinished()) *report.add_checkpoints() = std::move(shard);
    report.mutable_figures()->set_step_seconds(SecondsSince(step_start));
    reporter_->Enqueue(report);
    if (stop_) return absl::CancelledError("stop requested");
    if (!peer_failure.ok() && !report.done()) {
      ASSIGN_OR_RETURN(
          const int64_t resume,
          AwaitRegroup(*trainer, ranks, peer_failure, absl::StrCat("after step ", step, ": ", peer_failure.message())));
      if (resume == 0) return LeftForRegroup();
      step = resume - 1;
      continue;
    }
    // A leave by regroup: the head names the replicas that train on with the confirmation, and may have finished it
    // (the drain cleared) before a leaving actor's next probe: the newer membership tells it all the same.
    if (healing && !leaving && AwaitBoundary(step, HealBoundary())) {
      // Every actor stops after `step`: the membership with the joining replicas forms, this stage's state goes to
      // theirs from the donor, and all train step + 1 next.
      ASSIGN_OR_RETURN(const int64_t resume,
                       AwaitRegroup(*trainer, ranks,
                                    absl::AbortedError(absl::StrCat("replicas join after step ", step,
                                                                    " for a heal; no membership with them came")),
                                    absl::StrCat("replicas join after step ", step, " (a heal)")));
      if (resume == 0) return LeftForRegroup();
      step = resume - 1;
      continue;
    }
    const bool drained = leaving && AwaitBoundary(step, DrainBoundary());
    const Membership membership = leaving && regroups ? NewerMembership(ranks) : Membership::kSame;
    if (drained || membership != Membership::kSame) {
      // This actor's replica among them: it rebuilds its groups and trains on after `step`; otherwise it leaves.
      if (membership == Membership::kStays) {
        ASSIGN_OR_RETURN(const int64_t resume,
                         AwaitRegroup(*trainer, ranks,
                                      absl::AbortedError(absl::StrCat("replicas leave after step ", step,
                                                                      " for a drain; no membership without them came")),
                                      absl::StrCat("the replicas on a draining worker leave after step ", step)));
        if (resume > 0) {
          step = resume - 1;
          continue;
        }
      }
      ReportLeft(step);
      SetState(ACTOR_DEAD, absl::StrCat("stopped after step ", step,
                                        " for a drain: the job restarts without the draining worker from there"));
      GT_LOG(INFO) << "actor " << me.actor_id() << " left after step " << step << " for a drain";
      return absl::OkStatus();
    }
    if (stop_) return absl::CancelledError("stop requested");
  }
  SetState(ACTOR_DEAD, "finished");
  return absl::OkStatus();
}

absl::StatusOr<int64_t> StageActor::Resume(StageTrainer& trainer) {
  if (config_.resume_from.empty()) return 1;
  if (trainer.timed()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "timed compute cannot resume from ", config_.resume_from,
        ": its stages have no real weights to load; submit the job again (a timed job starts from step 1)"));
  }
  // Any plan's checkpoint: the stage reads the tensors it holds (its layers, its tensor-parallel part), from a local
  // copy of the files it needs when the checkpoint is on the head's machine. DiLoCo: its group's weights and moments
  // (group 0's when the checkpoint holds fewer groups) and the outer state (the checkpoint's, or the loaded weights').
  const int group = trainer.collectives().diloco_group;
  std::string resume_from = config_.resume_from;
  if (services_.checkpoints) {
    ASSIGN_OR_RETURN(resume_from,
                     services_.checkpoints->FetchForResume(config_.resume_from, trainer.stage().TensorNames(), group));
  }
  ASSIGN_OR_RETURN(model::CheckpointInfo info, model::LoadCheckpoint(resume_from, trainer.stage(), trainer.optimizer(),
                                                                     {.group = group, .outer = trainer.outer()}));
  if (trainer.loader() != nullptr) RETURN_IF_ERROR(trainer.loader()->Restore(info.data_position));
  trainer.set_completed_step(info.step);
  GT_LOG(INFO) << "actor " << config_.actor.actor_id() << " resumed from " << info.directory << " at step "
               << info.step;
  return info.step + 1;
}

absl::StatusOr<double> StageActor::WriteCheckpoint(StageTrainer& trainer, const ActorRanks& ranks, int64_t step,
                                                   const std::string& dir) {
  // Replica 0's actors snapshot their stage (weights, AdamW moments: full tensors, gathered across the
  // tensor-parallel group) into host memory; tensor rank 0 writes it in the background. The head commits the
  // checkpoint once every stage's shard of the step is in. DiLoCo: each group's leader writes its group's weights
  // and moments (model-g<G>[-sK]), group 0's the outer state as well.
  const StageCollectives& collectives = trainer.collectives();
  const bool diloco = trainer.outer() != nullptr;
  const auto snapshot_start = Clock::now();
  ASSIGN_OR_RETURN(model::CheckpointSnapshot snapshot,
                   model::SnapshotStage(trainer.stage(), trainer.optimizer(), /*keep=*/ranks.tp_rank == 0,
                                        collectives.diloco_group == 0 ? trainer.outer() : nullptr));
  double seconds = SecondsSince(snapshot_start);
  if (ranks.tp_rank != 0) return seconds;
  CheckpointShard shard;
  shard.set_step(step);
  shard.set_actor_id(config_.actor.actor_id());
  shard.set_stage(ranks.stage);
  shard.set_group(collectives.diloco_group);
  if (diloco) shard.set_writers(collectives.diloco_groups * ranks.pp);
  shard.set_optimizer_step(snapshot.optimizer_step);
  shard.set_snapshot_seconds(seconds);
  if (const model::DataLoader* loader = trainer.loader(); loader != nullptr) {
    shard.mutable_data_position()->set_shard(loader->position().shard);
    shard.mutable_data_position()->set_offset(loader->position().offset);
    shard.mutable_data_position()->set_epoch(loader->position().epoch);
  }
  const std::string suffix = model::ShardSuffix(collectives.diloco_group, ranks.pp, ranks.stage);
  const std::string step_dir =
      services_.checkpoints ? services_.checkpoints->LocalStepDir(step) : model::StepDirectory(dir, step);
  return seconds +
         absl::ToDoubleSeconds(checkpoint_writer_->Write(std::move(shard), step_dir, suffix, std::move(snapshot)));
}

bool StageActor::AwaitBoundary(int64_t step, const Boundary& boundary) {
  // Every actor stops after `step` only once each knows it (the head confirms): until then this one waits here,
  // which holds its peers at the next step at the latest, and asks again every 0.1 s. A later step (an actor passed
  // this one before it knew) or none (the head restarted) means training goes on.
  const auto deadline = Clock::now() + std::chrono::milliseconds(config_.collective_timeout_ms);
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    reporter_->Drain(absl::Milliseconds(std::max<int64_t>(0, left.count())));  // the replies so far are in
    if (boundary.confirmed == step) return true;
    if (boundary.at != step || stop_) return false;
    if (Clock::now() >= deadline) {
      GT_LOG(WARNING) << "actor " << config_.actor.actor_id() << ": the head did not confirm the "
                      << (boundary.heal ? "heal" : "drain") << " after step " << step << " within "
                      << config_.collective_timeout_ms << " ms; training goes on";
      return false;
    }
    absl::SleepFor(absl::Milliseconds(100));
    StepReport probe = Probe();
    if (boundary.heal) {
      probe.set_heal_at_step(step);
      probe.set_heal_waiting(true);
    } else {
      probe.set_drain_at_step(step);
      probe.set_drain_waiting(true);
    }
    reporter_->Enqueue(probe);
  }
}

StepReport StageActor::Probe() const {
  StepReport probe;
  probe.set_job_id(config_.actor.job_id());
  probe.set_actor_id(config_.actor.actor_id());
  probe.set_attempt(config_.attempt);
  return probe;
}

absl::Status StageActor::LeftForRegroup() {
  SetState(ACTOR_DEAD, "stopped: the job went on without this replica");
  return absl::OkStatus();
}

StageActor::Membership StageActor::NewerMembership(const ActorRanks& ranks) const {
  absl::MutexLock lock(&mu_);
  if (regroup_.epoch() <= ranks.epoch) return Membership::kSame;
  const bool in =
      std::find(regroup_.replicas().begin(), regroup_.replicas().end(), ranks.replica) != regroup_.replicas().end();
  return in ? Membership::kStays : Membership::kLeaves;
}

absl::StatusOr<int64_t> StageActor::AwaitRegroup(StageTrainer& trainer, ActorRanks& ranks, const absl::Status& failure,
                                                 const std::string& why) {
  // The head decides once it knows what failed (a worker's death is detected within ~5 s): it names the replicas
  // whose actors are all alive, each actor rebuilds its groups for them and says which step it completed, and the
  // head confirms once they all stand at the same one (else it restarts the job from its checkpoint, stopping them).
  const int64_t failed_in = ranks.epoch;
  const std::string& id = config_.actor.actor_id();
  GT_LOG(WARNING) << "actor " << id << ": " << why << "; waiting for the head to regroup the job";
  // Twice the collective deadline: the head's detection (up to 30 s for an unreachable worker), its grace and the
  // membership's forming all come before the word; the head restarts the job itself when it forms no membership.
  const auto deadline = Clock::now() + 2 * std::chrono::milliseconds(config_.collective_timeout_ms);
  while (!stop_) {
    Regroup regroup;
    {
      absl::MutexLock lock(&mu_);
      regroup = regroup_;
    }
    if (regroup.epoch() > ranks.epoch) {
      std::vector<int> replicas(regroup.replicas().begin(), regroup.replicas().end());
      const bool valid = !replicas.empty() && std::is_sorted(replicas.begin(), replicas.end()) &&
                         std::adjacent_find(replicas.begin(), replicas.end()) == replicas.end() &&
                         replicas.front() >= 0 && replicas.back() < ranks.dp;
      if (!valid) {
        return absl::InternalError(absl::StrCat("the head named replicas [", absl::StrJoin(replicas, ", "),
                                                "] for a job of ", ranks.dp, " replicas"));
      }
      if (!std::binary_search(replicas.begin(), replicas.end(), ranks.replica)) {
        GT_LOG(INFO) << "actor " << id << ": the job goes on without replica " << ranks.replica << ": it leaves";
        return 0;
      }
      const std::string old_key = ranks.comm_job_id;
      // A heal's membership names every actor with the joining ones' addresses: the list from now on.
      if (!regroup.peers().empty()) peers_.assign(regroup.peers().begin(), regroup.peers().end());
      ASSIGN_OR_RETURN(ActorRanks next, MembershipRanks(regroup));
      RETURN_IF_ERROR(trainer.Regroup(next, peers_, services_.collectives.get(), config_.device_index));
      ranks = std::move(next);
      epoch_ = ranks.epoch;
      if (services_.mailbox != nullptr) services_.mailbox->DiscardJob(old_key);
      {
        absl::MutexLock lock(&mu_);
        reported_unreachable_.clear();  // a peer that fails in the new membership is news again
      }
      GT_LOG(INFO) << "actor " << id << ": regrouped with replicas [" << absl::StrJoin(ranks.present, ", ")
                   << "] (membership " << ranks.epoch << "), at step " << trainer.completed_step();
      if (!regroup.joining().empty() && regroup.donor() == ranks.replica) {
        // A heal: this stage's state goes to the joining replicas' actors before this one says it is ready.
        const auto start = Clock::now();
        const absl::StatusOr<uint64_t> sent =
            trainer.SendState(std::vector<int>(regroup.joining().begin(), regroup.joining().end()));
        if (!sent.ok() && !IsPeerFailure(sent.status())) return sent.status();
        // A joining actor that failed or whose worker died: the head goes on without its replica (a fault).
        if (!sent.ok()) {
          GT_LOG(WARNING) << "actor " << id << ": could not send its stage's state to replicas ["
                          << absl::StrJoin(regroup.joining(), ", ") << "]: " << sent.status()
                          << "; waiting for the head to go on without them";
        } else {
          GT_LOG(INFO) << "actor " << id << ": sent its stage's state (" << *sent << " bytes) to replicas ["
                       << absl::StrJoin(regroup.joining(), ", ") << "] in " << SecondsSince(start) << " s";
        }
      }
    }
    if (ranks.epoch > failed_in && regroup.epoch() == ranks.epoch && regroup.confirmed()) {
      if (regroup.resume_step() != trainer.completed_step() + 1) {
        return absl::InternalError(absl::StrCat("the head resumes the job at step ", regroup.resume_step(),
                                                " but this actor completed step ", trainer.completed_step()));
      }
      return regroup.resume_step();
    }
    if (Clock::now() >= deadline) {
      GT_LOG(WARNING) << "actor " << id << ": no regroup within " << 2 * config_.collective_timeout_ms
                      << " ms; the step's failure stands";
      return failure;
    }
    StepReport probe = Probe();
    probe.set_regroup_waiting(true);
    probe.set_epoch(ranks.epoch);
    probe.set_completed_step(trainer.completed_step());
    probe.set_regroup_cause(std::string(failure.message()));
    reporter_->Enqueue(probe);
    reporter_->Drain(absl::Milliseconds(config_.collective_timeout_ms));
    absl::SleepFor(absl::Milliseconds(100));
  }
  return failure;
}

void StageActor::ReportLeft(int64_t step) {
  checkpoint_writer_->WaitIdle();  // its shard of `step` goes with its last report
  StepReport report;
  report.set_job_id(config_.actor.job_id());
  report.set_actor_id(config_.actor.actor_id());
  report.set_attempt(config_.attempt);
  report.set_drain_at_step(step);
  report.set_drained(true);
  for (CheckpointShard& shard : checkpoint_writer_->TakeFinished()) *report.add_checkpoints() = std::move(shard);
  reporter_->Enqueue(report);
}

}  // namespace geotrain::worker
