// How every handler of every geotrain service (the head's and the workers') starts and fails: it times the call
// (geotrain_rpc_duration_seconds and geotrain_rpc_total{method,code}, when the process serves metrics), checks the
// cluster token (TokenAuth, common/rpc.h), and answers errors as gRPC statuses with their code recorded. It is the
// one preamble: every handler returns its errors through Fail, so that the code recorded is the code answered.
//
//   grpc::Status GetJob(grpc::ServerContext* context, const v1::GetJobRequest* request, v1::Job* reply) override {
//     RpcCall call(metrics_, auth_, context, "GetJob");
//     if (!call.authorized()) return call.status();
//     absl::StatusOr<JobInfo> job = jobs_->Get(request->job_id());
//     if (!job.ok()) return call.Fail(job.status());
//     ...
//     return grpc::Status::OK;  // recorded as OK
//
// Ownership: the call holds its timer, which records when the RpcCall goes out of scope (the handler's return), with
// the code of the last status it set: UNAUTHENTICATED, a Fail's, else OK.
// Errors: an unauthorized call is UNAUTHENTICATED (TokenAuth::Check logs the peer); Fail keeps the handler's code
// and message as they are (ToGrpc).
// Thread safety: one RpcCall per handler invocation, on the handler's thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "common/metrics.h"
#include "common/rpc.h"

namespace geotrain {

class RpcCall {
 public:
  // `metrics` may be null (no metrics); `auth` and `context` outlive the call. `method` is a string literal.
  RpcCall(MetricsServer* metrics, const TokenAuth& auth, grpc::ServerContext* context, const char* method)
      : timer_(metrics ? metrics->rpc() : nullptr, method), status_(auth.Check(context)) {
    timer_.set_code(status_.error_code());
  }
  RpcCall(const RpcCall&) = delete;
  RpcCall& operator=(const RpcCall&) = delete;

  // False when the token was missing or wrong: return status() (UNAUTHENTICATED).
  bool authorized() const { return status_.ok(); }
  const grpc::Status& status() const { return status_; }
  // The handler's error as the call's answer (the same code, the message as is), recorded on the timer.
  grpc::Status Fail(const absl::Status& status) {
    status_ = ToGrpc(status);
    timer_.set_code(status_.error_code());
    return status_;
  }

 private:
  RpcTimer timer_;
  grpc::Status status_;
};

}  // namespace geotrain
