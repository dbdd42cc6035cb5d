// A stage actor: one (replica, stage, tensor rank) of a job's plan, hosted by a worker. It trains its
// stage in lock-step with the job's other actors and reports every step to the head.
//
//   StageActor actor(config, {.mailbox = &tensor_streams});  // the head client and collectives made from config
//   actor.Start();                                         // trains on its own thread
//   ...
//   actor.Stop("job cancelled");                           // ends at the next schedule operation
//
// The parts (each in its own file):
//   worker/actor_ranks.h          where the actor sits in the plan: ranks, peers, groups;
//   worker/stage_collectives.h    the set-up of its collectives (tensor streams, NCCL): injectable;
//   worker/stage_trainer.h        the stage, optimizer and data, and one step: forward, backward, the
//                                 schedule as data (common/pipeline_schedule.h), gradient sync, AdamW;
//   worker/head_client.h          step reports to the head: injectable.
//   worker/step_reporter.h        reports delivered in the background, retried while the head is away;
//   worker/checkpoint_writer.h    checkpoint shards written in the background from a host snapshot.
// This file is the actor's life: its thread, its state, the step loop, resume, checkpoints and reports, and a drain
// (head/job_drain.h): when the head's replies name a step the job's actors leave after, the actor writes its
// checkpoint shard of that step, waits there until the head confirms that every actor stops there (or names a later
// step), and ends with a last report (drained) that carries its shard. And a live regroup (head/job_regroup.h): when a
// step fails on a peer, the actor waits for the head to name the replicas the job goes on with, rebuilds its
// collectives for them (its stage, optimizer and data kept) and trains the failed step again, or leaves when its
// replica is not among them.
//
// Threads: Start() runs the whole job on one thread that owns the trainer. Stop() and the accessors may be
// called from any thread (state_ and message_ are guarded by mu_; the stop flag is atomic and checked
// between schedule operations; a receive blocked on a peer ends at its deadline, or at once when the
// worker cancels the job's receives).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "comm/tensor_stream.h"
#include "common/rpc.h"
#include "internal.grpc.pb.h"
#include "worker/actor_ranks.h"
#include "worker/checkpoint_store.h"
#include "worker/checkpoint_writer.h"
#include "worker/head_client.h"
#include "worker/stage_collectives.h"
#include "worker/stage_trainer.h"
#include "worker/step_reporter.h"

namespace geotrain::worker {

struct StageActorConfig {
  ActorRecord actor;
  JobSpec spec;
  std::vector<ActorPeer> peers;  // every actor of the job
  std::string site;              // the hosting worker's site
  std::string token;
  std::string head_address;
  TlsFiles tls;
  int64_t collective_timeout_ms = 60000;  // deadline of each receive and collective
  // Where the stage runs: "cpu", or "cuda:N" on a worker whose device N is a CUDA GPU.
  std::string device = "cpu";
  int device_index = 0;
  // > 1: the device is a CPU slowed by this factor (the worker's --slowdown): each op is followed by a wait of
  // (slowdown - 1) times its time, and the step figures say the times are emulated. 1: not slowed.
  double slowdown = 1;
  int64_t attempt = 0;      // which run of the job this actor belongs to (0 first; raised by each restart)
  std::string resume_from;  // a checkpoint step directory to start from; empty: fresh weights, step 1
  // A heal (head/job_heal.h): the actor joins a running job in membership join.epoch (> 0) of join.replicas; its
  // state comes from replica join.donor once that membership forms (no resume_from). Epoch 0: a run's actor.
  Regroup join;
};

// What an actor uses from its host. Null members are made from the config: a GrpcHeadClient to
// config.head_address, and a GrpcCollectivesFactory over `mailbox`.
struct ActorServices {
  comm::TensorStreamServer* mailbox = nullptr;  // the hosting worker's tensor-stream mailbox; outlives the actor
  LinkMetrics* links = nullptr;  // the hosting worker's per-link metrics (may be null); outlives the actor
  std::unique_ptr<HeadClient> head;
  std::unique_ptr<CollectivesFactory> collectives;
  // Token shards staged from the head (worker/job_staging.h); null: the spec's data paths are local.
  DataSourceFn data;
  // Checkpoints written on this node and copied to the head (worker/checkpoint_store.h); null: checkpoint.dir is
  // shared with the head (tests in one process) and the actor writes there, and resumes from there.
  std::unique_ptr<CheckpointStore> checkpoints;
};

class StageActor {
 public:
  StageActor(StageActorConfig config, ActorServices services);
  ~StageActor();  // stops and joins
  StageActor(const StageActor&) = delete;
  StageActor& operator=(const StageActor&) = delete;

  void Start();
  // Ends the actor at its next step boundary or receive. `job_stopping`: the job is stopping (the head said so, or a
  // peer refused a tensor because it stopped), so peers that send here are told it stopped and stop too; false (the
  // worker shuts down): they are told this side failed, and report it, so the head learns at once.
  void Stop(const std::string& reason, bool job_stopping = true);
  ActorRecord Record() const;

  // Tells whether the actor's thread has finished (after the last step, an error, or a stop).
  bool finished() const;
  // Whether no report waits for the head (all delivered, or dropped as undeliverable).
  bool ReportsDelivered() const { return reporter_->queued() == 0; }
  // The key of this run of the job, in its current membership, in the tensor-stream mailbox (worker/actor_ranks.h
  // CommJobId).
  std::string comm_job_id() const { return CommJobId(config_.actor.job_id(), config_.attempt, epoch_); }
  // A live regroup (head/job_regroup.h) to membership `epoch`: ends the step in flight of an actor still in an older
  // one (its receives cancelled, as failed, not stopped), so that it asks the head for the new membership. Any thread.
  void Interrupt(int64_t epoch);
  // Waits until the head has taken every report queued so far, or `timeout`; true when none is left.
  bool DrainReports(absl::Duration timeout) { return reporter_->Drain(timeout); }

 private:
  absl::Status Run();
  // Run's first phase: the actor's ranks, its trainer (the stage, its data and collectives), and the first step to
  // train: after a resume from config_.resume_from, or once a joining actor has its state (Join); logged.
  struct SetUp {
    ActorRanks ranks;
    std::unique_ptr<StageTrainer> trainer;
    int64_t first_step = 1;
  };
  absl::StatusOr<SetUp> SetUpStage();
  // Loads config_.resume_from into the trainer (nothing when empty); returns the first step to train.
  absl::StatusOr<int64_t> Resume(StageTrainer& trainer);
  void SetState(ActorState state, const std::string& message);
  // The head's reply to a report (the reporter's thread): where the job's drain stands.
  void OnReply(const ReportStepReply& reply);
  // The job's checkpoint.dir, else the one the head gave for its drain ("": none).
  std::string CheckpointDir() const;
  // Snapshots the stage for the checkpoint of `step` into host memory and queues its write (tensor rank 0) under
  // `dir`; returns the training thread's seconds.
  absl::StatusOr<double> WriteCheckpoint(StageTrainer& trainer, const ActorRanks& ranks, int64_t step,
                                         const std::string& dir);
  // At a drain's (or heal's) step: true once the head confirms that every actor stops after it; false when it names another
  // step (or none), the actor is stopped, or no answer came within the collective deadline (training goes on).
  // A step boundary's fields as a reply tells them: a drain's, or a heal's.
  struct Boundary {
    const std::atomic<int64_t>& at;
    const std::atomic<int64_t>& confirmed;
    bool heal;  // a heal's (its probes say heal_waiting), else a drain's (drain_waiting)
  };
  Boundary DrainBoundary() const { return {drain_at_step_, drain_confirmed_step_, false}; }
  Boundary HealBoundary() const { return {heal_at_step_, heal_confirmed_step_, true}; }
  bool AwaitBoundary(int64_t step, const Boundary& boundary);
  // The last report of an actor that leaves after `step` for a drain, with its checkpoint shard of it.
  void ReportLeft(int64_t step);
  // After a step failed on a peer (`failure`), or at a drain's step when the job goes on without the draining
  // workers' replicas (`why` says which, for the log): waits, probing the head, for the membership the job goes on
  // in, and rebuilds the trainer's collectives (and `ranks`) for it. Returns the step to train next once the head
  // confirms that every actor of it stands at the same completed step; 0 when this actor's replica is not in it (it
  // leaves); `failure` when the head stops the actor (a restart, a cancel) or gives no word within the deadline.
  // In a heal's membership the donor replica's actor sends its stage's state to the joining replicas' before it says
  // it is ready.
  absl::StatusOr<int64_t> AwaitRegroup(StageTrainer& trainer, ActorRanks& ranks, const absl::Status& failure,
                                       const std::string& why);
  // The actor's place in membership `g`: its ranks from the job's actors' list as it knows it (peers_) and g's
  // replicas.
  absl::StatusOr<ActorRanks> MembershipRanks(const Regroup& g) const;
  // A joining actor (config_.join): says it is set up, waits for its membership to form, receives its state from the
  // donor and says it is ready; returns the step to train next once the head confirms the membership. An error
  // when the head stops it (the heal was given up), the membership moves on without it, or no word comes in time.
  absl::StatusOr<int64_t> Join(StageTrainer& trainer, const ActorRanks& ranks);
  // A probe of an actor that waits at a boundary or for a membership: the job, the actor and the run filled in.
  StepReport Probe() const;
  // What the latest reply says of the job's membership (a drain's leave by regroup): none newer than this actor's, or
  // a newer one with its replica in it, or without.
  enum class Membership { kSame, kStays, kLeaves };
  Membership NewerMembership(const ActorRanks& ranks) const;
  // The end of an actor whose replica is not in the job's new membership: it leaves, no error.
  absl::Status LeftForRegroup();
  // A send could not reach the peer `peer_actor_id` and is retried (a sending thread): tells the head once, so that it
  // checks that peer's worker now rather than after its heartbeat timeout.
  void ReportUnreachable(const std::string& peer_actor_id);

  const StageActorConfig config_;
  ActorServices services_;
  std::unique_ptr<StepReporter> reporter_;  // uses services_.head
  // Publishes through services_.checkpoints; used and, when the run ends, reset by thread_ only.
  std::unique_ptr<CheckpointWriter> checkpoint_writer_;
  std::atomic<bool> stop_{false};
  // A drain, as the latest reply tells (OnReply on the reporter's thread; the step loop reads them): the step the
  // job's actors leave after (0: none), and that step once the head confirmed it.
  std::atomic<int64_t> drain_at_step_{0};
  std::atomic<int64_t> drain_confirmed_step_{0};
  // A heal, likewise: the step the job's actors pause after for the healed replicas to join, and once confirmed.
  std::atomic<int64_t> heal_at_step_{0};
  std::atomic<int64_t> heal_confirmed_step_{0};
  std::atomic<int64_t> epoch_{0};  // the membership the actor's collectives are built for (thread_ writes it)
  // Every actor of the job as this actor knows it: config_.peers, then each heal's list (thread_ only).
  std::vector<ActorPeer> peers_;
  bool set_up_ = false;  // written and read by thread_ only: true once the actor has set up and trains
  std::thread thread_;   // joined by the destructor before the members it uses go

  mutable absl::Mutex mu_;
  ActorState state_ ABSL_GUARDED_BY(mu_) = ACTOR_PENDING_CREATION;
  std::string message_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::string drain_checkpoint_dir_ ABSL_GUARDED_BY(mu_);            // from the head, for a job without checkpoint.dir
  Regroup regroup_ ABSL_GUARDED_BY(mu_);                             // the job's membership, as the latest reply tells
  std::set<std::string> reported_unreachable_ ABSL_GUARDED_BY(mu_);  // peers ReportUnreachable told the head of
};

}  // namespace geotrain::worker
