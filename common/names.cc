// Enum display names derived from the generated protobuf names, and the Ping echo.
#include "common/names.h"

#include "absl/strings/ascii.h"

namespace geotrain {
namespace {
// "WORKER_ALIVE" -> "ALIVE"; "ACTOR_PENDING_CREATION" -> "PENDING_CREATION".
std::string StripPrefix(const std::string& name, const std::string& prefix) {
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}
}  // namespace

std::string WorkerStateName(WorkerState state) { return StripPrefix(WorkerState_Name(state), "WORKER_"); }
std::string ActorStateName(ActorState state) { return StripPrefix(ActorState_Name(state), "ACTOR_"); }
std::string DeviceKindName(DeviceKind kind) {
  return absl::AsciiStrToLower(StripPrefix(DeviceKind_Name(kind), "DEVICE_KIND_"));
}

bool IsTerminal(JobState state) { return state == JOB_SUCCEEDED || state == JOB_FAILED || state == JOB_CANCELLED; }

const char* JobStateName(JobState state) {
  switch (state) {
    case JOB_PENDING:
      return "PENDING";
    case JOB_RUNNING:
      return "RUNNING";
    case JOB_SUCCEEDED:
      return "SUCCEEDED";
    case JOB_FAILED:
      return "FAILED";
    case JOB_RESTARTING:
      return "RESTARTING";
    case JOB_CANCELLED:
      return "CANCELLED";
    default:
      return "UNKNOWN";
  }
}

void EchoPing(const PingRequest& request, PingReply* reply) {
  if (!request.no_echo()) reply->set_payload(request.payload());
}

void EchoPingStream(grpc::ServerReaderWriter<PingReply, PingRequest>* stream) {
  PingRequest request;
  PingReply reply;
  while (stream->Read(&request)) {
    EchoPing(request, &reply);
    if (!stream->Write(reply)) break;
  }
}

}  // namespace geotrain
