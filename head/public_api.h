// The head's public API (proto/geotrain/v1, listed with its guarantees in docs/api.md): the Jobs, Cluster and
// Planner services, served on the head's port next to the internal HeadControl service. Each handler is a thin
// adapter: it checks the token, times the call, calls the head's components and answers with the public
// mirror of their records.
//
//   PublicApi api(components, token);
//   api.RegisterWith(&builder);  // before builder.BuildAndStart(); `api` outlives the server
//
// The public messages mirror the head's records (proto/control.proto) field for field, with the same numbers and
// types; ToPublic projects a record onto its mirror (fields the mirror lacks, the head's bookkeeping, are
// dropped). public_api_test.cc checks the mirrors, so a change to a record that would change the public API
// fails there: give the public message an explicit conversion then, never a new meaning for an old field.
//
// The same calls are methods of PublicApi without gRPC types (SubmitJob, GetJob, ...), for in-process callers that
// checked the token themselves: the head's dashboard (head/dashboard.h) answers with exactly what the RPCs answer.
//
// Threads: gRPC's sync server pool runs the handlers; the components lock their own state. WatchJob holds its
// handler thread while it follows a job (waking every 0.5 s to notice a cancelled call or a stopping head). The
// in-process methods are thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/metrics.h"
#include "common/rpc.h"
#include "geotrain/v1/cluster.pb.h"
#include "geotrain/v1/jobs.pb.h"
#include "geotrain/v1/planner.pb.h"
#include "google/protobuf/message.h"
#include "head/job_manager.h"
#include "head/job_runner.h"
#include "head/registry.h"

namespace geotrain::head {

class PublicApi {
 public:
  // What the services use; owned by the head, which outlives them.
  struct Components {
    WorkerRegistry* registry = nullptr;
    JobManager* jobs = nullptr;
    JobRunner* runner = nullptr;
    MetricsServer* metrics = nullptr;  // null: no metrics
    std::string head_id;
    int64_t started_unix_ms = 0;
    std::function<bool()> stopping;  // the head is shutting down (ends WatchJob streams with UNAVAILABLE)
    std::function<void()> changed;   // after a submit or a cancel (refreshes the head's metrics)
    // DrainWorker: marks the worker draining, persisted, and wakes the job runner (HeadServer::DrainWorker).
    std::function<absl::StatusOr<WorkerInfo>(const std::string& worker_id)> drain_worker;
    // GetClusterInfo's answer: where the head serves its dashboard and /metrics ("": not served), and the
    // topology it was started with.
    std::string dashboard_url;
    std::string metrics_url;
    std::string topology_file;
    std::vector<v1::ConfiguredLink> configured_links;
  };

  PublicApi(Components components, std::string token);
  ~PublicApi();
  PublicApi(const PublicApi&) = delete;
  PublicApi& operator=(const PublicApi&) = delete;

  void RegisterWith(grpc::ServerBuilder* builder);

  // The calls without gRPC (the caller checked the token): the answers and errors of the RPCs of the same names.
  absl::StatusOr<v1::Job> SubmitJob(const v1::SubmitJobRequest& request) const;
  absl::StatusOr<v1::Job> GetJob(const std::string& job_id) const;
  v1::ListJobsReply ListJobs() const;
  absl::StatusOr<v1::Job> CancelJob(const std::string& job_id) const;
  // WatchJob without follow: the job's events with seq > after_seq recorded so far, in seq order; at most `limit`
  // of them when > 0 (the first, or with `newest` the last).
  absl::StatusOr<std::vector<v1::JobEvent>> JobEvents(const std::string& job_id, int64_t after_seq, int64_t limit = 0,
                                                      bool newest = false) const;
  absl::StatusOr<v1::JobEfficiency> GetJobEfficiency(const std::string& job_id) const;
  v1::ClusterStatus GetClusterStatus() const;
  v1::ClusterInfo GetClusterInfo() const;
  absl::StatusOr<v1::Worker> DrainWorker(const std::string& worker_id) const;
  absl::StatusOr<v1::PlanJobReply> PlanJob(const v1::PlanJobRequest& request) const;

 private:
  class JobsService;
  class ClusterService;
  class PlannerService;
  const Components components_;
  const TokenAuth auth_;
  std::unique_ptr<JobsService> jobs_;
  std::unique_ptr<ClusterService> cluster_;
  std::unique_ptr<PlannerService> planner_;
};

// `record` projected onto its public mirror `Public`: the fields both have (same numbers, same types) are copied,
// the others dropped.
template <typename Public>
Public ToPublic(const google::protobuf::Message& record) {
  Public out;
  out.ParseFromString(record.SerializeAsString());
  out.DiscardUnknownFields();
  return out;
}

}  // namespace geotrain::head
