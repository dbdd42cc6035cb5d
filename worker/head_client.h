// How a stage actor talks to the head: step reports (and, through the stub, the NCCL rendezvous).
//
//   GrpcHeadClient head(channel, token);
//   absl::StatusOr<ReportStepReply> reply = head.ReportStep(report, absl::Seconds(5));
//   if (reply.ok() && reply->stop()) ...   // the head stopped the job
//
// An interface so that tests run stage actors in one process against a head of their own making.
// Thread-safety: implementations are thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "internal.grpc.pb.h"

namespace geotrain::worker {

class HeadClient {
 public:
  virtual ~HeadClient() = default;
  // Delivers one report; UNAVAILABLE or DEADLINE_EXCEEDED when the head cannot be reached in `timeout`.
  virtual absl::StatusOr<ReportStepReply> ReportStep(const StepReport& report, absl::Duration timeout) = 0;
  // The head's stub for the NCCL rendezvous; null when there is no gRPC head (tests).
  virtual internal::HeadControl::StubInterface* stub() = 0;
};

class GrpcHeadClient : public HeadClient {
 public:
  GrpcHeadClient(const std::shared_ptr<grpc::ChannelInterface>& channel, std::string token);
  absl::StatusOr<ReportStepReply> ReportStep(const StepReport& report, absl::Duration timeout) override;
  internal::HeadControl::StubInterface* stub() override { return stub_.get(); }

 private:
  std::unique_ptr<internal::HeadControl::Stub> stub_;
  const std::string token_;
};

}  // namespace geotrain::worker
