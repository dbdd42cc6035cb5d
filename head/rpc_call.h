// How every handler of the head's services starts and fails: it times the call (geotrain_rpc_duration_seconds
// and geotrain_rpc_total, when the head serves metrics), checks the cluster token, and answers errors as gRPC
// statuses with the code recorded.
//
//   grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request, v1::Job* reply) override {
//     RpcCall call(metrics_, auth_, context, "GetJob");
//     if (!call.authorized()) return call.status();
//     absl::StatusOr<JobInfo> job = jobs_->Get(request->job_id());
//     if (!job.ok()) return call.Fail(job.status());
//
// Thread safety: one RpcCall per handler invocation, on the handler's thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "common/metrics.h"
#include "common/rpc.h"

namespace geotrain::head {

class RpcCall {
 public:
  // `metrics` may be null (no metrics); `auth` and `context` outlive the call. `method` is a string literal.
  RpcCall(MetricsServer* metrics, const TokenAuth& auth, grpc::ServerContext* context, const char* method)
      : timer_(metrics ? metrics->rpc() : nullptr, method), status_(auth.Check(context)) {
    timer_.set_code(status_.error_code());
  }
  // False when the token was missing or wrong: return status() (UNAUTHENTICATED).
  bool authorized() const { return status_.ok(); }
  const grpc::Status& status() const { return status_; }
  // The handler's error as the call's answer (the same code, the message as is).
  grpc::Status Fail(const absl::Status& status) {
    status_ = ToGrpc(status);
    timer_.set_code(status_.error_code());
    return status_;
  }

 private:
  RpcTimer timer_;
  grpc::Status status_;
};

}  // namespace geotrain::head
