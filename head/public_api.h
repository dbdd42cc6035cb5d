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
// Threads: gRPC's sync server pool runs the handlers; the components lock their own state. WatchJob holds its
// handler thread while it follows a job (waking every 0.5 s to notice a cancelled call or a stopping head).
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/metrics.h"
#include "common/rpc.h"
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
  };

  PublicApi(Components components, std::string token);
  ~PublicApi();
  PublicApi(const PublicApi&) = delete;
  PublicApi& operator=(const PublicApi&) = delete;

  void RegisterWith(grpc::ServerBuilder* builder);

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
