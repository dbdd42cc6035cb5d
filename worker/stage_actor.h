// A stage actor: one (replica, stage, tensor rank) of a job's plan, hosted by a worker. It holds its
// layers (model::GPT2Stage), their gradients and AdamW state, and its replica's slice of the data, and
// trains in lock-step with the job's other actors:
//
//   - activations flow forward and their gradients backward between the stages of a replica over
//     tensor streams (comm::GrpcCommunicator Send/Recv), through the WAN codec when they cross sites;
//   - the schedule is GPipe (all forwards, then all backwards) or 1F1B (pp - stage - 1 warm-up
//     forwards, then one forward / one backward). A stage keeps the activations of one microbatch, so a
//     backward whose microbatch is not the latest forward first recomputes that forward from the input
//     it kept (activation recomputation: exact, at the cost of one extra forward);
//   - tensor-parallel ranks of a stage all-reduce inside their group (model::TensorParallelComm over a
//     GrpcCommunicator); the first and last stage sum their tied-embedding gradients; gradients are
//     all-reduced across replicas (ring, or hierarchical across sites); the global gradient norm is
//     summed over the replica's stages and ranks; every replica takes the same AdamW step.
//   - after each step it reports to the head (StepReport); the head's reply can stop it.
//
// Threads: Start() runs the whole job on one thread that owns the stage, the optimizer, the loaders and
// the communicators. Stop() and the accessors may be called from any thread (state_ and message_ are
// guarded by mu_; the stop flag is atomic and checked between schedule operations; blocked receives
// end at their deadline).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "comm/tensor_stream.h"
#include "common/rpc.h"
#include "control.grpc.pb.h"

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
};

class StageActor {
 public:
  // `server` is the hosting worker's tensor-stream mailbox; it must outlive the actor.
  StageActor(StageActorConfig config, comm::TensorStreamServer* server);
  ~StageActor();  // stops and joins
  StageActor(const StageActor&) = delete;
  StageActor& operator=(const StageActor&) = delete;

  void Start();
  void Stop(const std::string& reason);
  ActorRecord Record() const;

  // Tells whether the actor's thread has finished (after the last step, an error, or a stop).
  bool finished() const;

 private:
  absl::Status Run();
  void SetState(ActorState state, const std::string& message);
  void Report(const StepReport& report);

  const StageActorConfig config_;
  comm::TensorStreamServer* const server_;
  std::unique_ptr<Head::Stub> head_;
  std::atomic<bool> stop_{false};
  std::thread thread_;

  mutable absl::Mutex mu_;
  ActorState state_ ABSL_GUARDED_BY(mu_) = ACTOR_PENDING_CREATION;
  std::string message_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace geotrain::worker
