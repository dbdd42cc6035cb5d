// The gRPC head client of stage actors (see head_client.h).
#include "worker/head_client.h"

#include "absl/time/clock.h"
#include "common/rpc.h"

namespace geotrain::worker {

GrpcHeadClient::GrpcHeadClient(const std::shared_ptr<grpc::ChannelInterface>& channel, std::string token)
    : stub_(internal::HeadControl::NewStub(channel)), token_(std::move(token)) {}

absl::StatusOr<ReportStepReply> GrpcHeadClient::ReportStep(const StepReport& report, absl::Duration timeout) {
  grpc::ClientContext context;
  AttachToken(&context, token_);
  SetDeadlineMillis(&context, absl::ToInt64Milliseconds(timeout));
  ReportStepReply reply;
  grpc::Status status = stub_->ReportStep(&context, report, &reply);
  if (!status.ok()) return FromGrpc(status);
  return reply;
}

}  // namespace geotrain::worker
