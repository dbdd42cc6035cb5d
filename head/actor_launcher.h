// The job runner's launcher: turns a placement (placement.h) into actors created on their workers, and stops
// actors. It is the runner's only caller of the Worker service (CreateActor, StopActor, InterruptActor); it decides nothing about
// the job (JobRunner records the run and moves its state, JobRecovery decides what a failure means).
//
//   ActorLauncher::NameForRun(&placement, attempt);
//   absl::Status created = launcher.CreateActors(spec, placement, ById(registry.Workers()), attempt, resume_from);
//   if (!created.ok()) launcher.StopActors(placement, "another actor of the job could not be created", false);
//
// Owns the executor (head/executor.h) whose threads ("head-rpc") make the RPCs: every actor of a run is created
// at once, so a slow worker costs one deadline rather than one per actor; stops are sent at once.
// Errors: CreateActors returns the first actor that could not be created (UNAVAILABLE naming the actor, the worker
// and its address, or the channel's error); stops never fail (a worker that does not answer is logged, an actor a
// restarted worker no longer has counts as stopped).
// Thread safety: CreateActors and StopActors from any thread (the control thread, gRPC handlers); no state is
// shared between calls but the executor. Shutdown once, after the last call (the runner's Shutdown).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/rpc.h"
#include "head/executor.h"
#include "head/job_run.h"
#include "head/placement.h"
#include "head/registry.h"
#include "internal.grpc.pb.h"

namespace geotrain::head {

struct ActorLauncherOptions {
  std::string token;
  std::string head_address;  // where actors report (empty: the worker's own head address)
  TlsFiles tls;
  int rpc_threads = 8;                 // the executor's threads
  int64_t stop_deadline_ms = 3000;     // StopActor's deadline
  int64_t create_deadline_ms = 10000;  // CreateActor's deadline
};

class ActorLauncher {
 public:
  // `registry` outlives the launcher (StopActors reads which workers are alive).
  ActorLauncher(WorkerRegistry* registry, ActorLauncherOptions options);
  ActorLauncher(const ActorLauncher&) = delete;
  ActorLauncher& operator=(const ActorLauncher&) = delete;

  // A restart's actors are new actors (their ids carry the run: "-aN"), so that a worker still finishing an
  // earlier run's actor takes the new one at once. Attempt 0 keeps the placement's ids.
  static void NameForRun(std::vector<ActorPlacement>* placement, int64_t attempt);

  // Creates every actor of `placement` (run `attempt` of a job with `spec`, resuming from `resume_from` when not
  // empty) on its worker, all at once, and waits for the answers. `workers` is the registry's view when the run
  // was placed; it tells each actor where its peers are. A heal's new actors (head/job_heal.h) join membership
  // `join`, their peers every actor of the job (`peers`; by default the placement's).
  absl::Status CreateActors(const JobSpec& spec, const std::vector<ActorPlacement>& placement,
                            const WorkersById& workers, int64_t attempt, const std::string& resume_from,
                            const std::vector<ActorPeer>* peers = nullptr, const Regroup* join = nullptr);
  // Every actor's place and the address its worker is reached at (per site), as actors are told of their peers.
  static std::vector<ActorPeer> Peers(const std::vector<ActorPlacement>& actors, const WorkersById& workers);

  // Sends StopActor to every actor whose worker is alive, at once; waits for the answers when `wait`. `job_goes_on`:
  // the actors leave a job that goes on without them (a live regroup): their peers are told they failed.
  void StopActors(const std::vector<ActorPlacement>& actors, const std::string& reason, bool wait,
                  bool job_goes_on = false);
  // A live regroup to membership `epoch` (head/job_regroup.h): InterruptActor to every actor whose worker is alive, at
  // once, without waiting: each one's step in flight ends, and it asks for the new membership.
  void InterruptActors(const std::vector<ActorPlacement>& actors, int64_t epoch);

  // Finishes the RPCs queued (the stops sent without waiting) and ends the executor's threads.
  void Shutdown();

 private:
  // One RPC per actor whose worker is alive, on the executor (`what` names it in a failure's log line).
  using ActorCall =
      std::function<grpc::Status(internal::Worker::Stub& stub, grpc::ClientContext& ctx, const std::string& actor_id)>;
  void OnAliveWorkers(const std::vector<ActorPlacement>& actors, bool wait, const std::string& what, ActorCall call);

  WorkerRegistry* registry_;
  const ActorLauncherOptions options_;
  std::unique_ptr<Executor> executor_;
};

}  // namespace geotrain::head
