// Runs jobs on the cluster: places a job's actors on workers, creates them, follows their step reports,
// and ends the job. It is the head's only path into the data plane, and it stays at step granularity:
// tensors flow between actors directly, never through the head.
//
//   PENDING ──(enough alive devices; plan fits in memory)──▶ actors created ──▶ RUNNING
//   RUNNING ──(every actor reported its last step)──▶ SUCCEEDED
//   RUNNING ──(an actor failed, its worker died)──▶ FAILED, every other actor stopped
//   any ──(job cancel)──▶ CANCELLED, every actor stopped
//
// Placement and `plan: auto` planning are in head/placement.h.
//
// Thread-safety: all methods may be called from any thread (gRPC handlers, the detector thread); one
// mutex guards the runs; RPCs to workers are made without holding it.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "control.grpc.pb.h"
#include "head/job_manager.h"
#include "head/placement.h"  // PlaceActors, PlanAutoJob (moved there; callers keep including this header)
#include "head/registry.h"

namespace geotrain::head {

class JobRunner {
 public:
  JobRunner(JobManager* jobs, WorkerRegistry* registry, MetricsServer* metrics, std::string token,
            std::string head_address, TlsFiles tls);

  // Tries to start every PENDING job (call after a submit and on every detector tick).
  void StartPendingJobs();
  // Handles one actor's step report; returns true when the actor should stop.
  bool OnStepReport(const StepReport& report);
  // Fails jobs whose actors ran on `worker`.
  void OnWorkerDead(const WorkerInfo& worker);
  // Reconciles runs with the actor states workers report in heartbeats, for when a step report was
  // lost: an actor that finished counts as done; one that died fails its job with its message.
  void Reconcile(const std::vector<ActorRecord>& reported);
  // Stops every actor of the job (after a cancel).
  void StopJob(const std::string& job_id, const std::string& reason);
  // Actors of running jobs as the head placed them (for status when workers have not reported yet).
  std::vector<ActorRecord> Actors(const std::string& job_id) const;

 private:
  struct StepAggregate {
    int reports = 0;
    double step_seconds = 0, compute = 0, wait = 0, bubble = 0, loss = 0;
    bool have_loss = false;
    int64_t tokens = 0;
    std::map<std::string, int64_t> wan_bytes;
    double compression_ratio = 0;
  };
  struct Run {
    JobSpec spec;
    std::vector<ActorPlacement> actors;
    std::set<std::string> done;
    std::map<int64_t, StepAggregate> steps;
    std::map<int64_t, std::map<std::string, std::string>> checkpoints;  // step -> actor -> shard dir
    bool ended = false;
  };

  absl::Status Launch(const JobInfo& job, std::vector<ActorPlacement> placement);
  void EndJob(const std::string& job_id, JobState state, const std::string& message);
  void StopActors(const std::vector<ActorPlacement>& actors, const std::string& reason);
  void WriteManifest(const std::string& job_id, const JobSpec& spec, int64_t step,
                     const std::map<std::string, std::string>& shards);
  void RecordStep(const std::string& job_id, int64_t step, const StepAggregate& agg, int actors);

  JobManager* jobs_;
  WorkerRegistry* registry_;
  MetricsServer* metrics_;  // may be null
  const std::string token_;
  const std::string head_address_;
  const TlsFiles tls_;

  mutable absl::Mutex mu_;
  std::map<std::string, Run> runs_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> launching_ ABSL_GUARDED_BY(mu_);
};

}  // namespace geotrain::head
