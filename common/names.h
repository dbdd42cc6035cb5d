// Short display names of the control plane's enums ("ALIVE", "PENDING_CREATION", "cuda"), shared by
// the head's metrics labels and the CLI's tables, and the Ping echo that every service offers.
#pragma once

#include <grpcpp/support/sync_stream.h>

#include <string>

#include "control.grpc.pb.h"

namespace geotrain {

std::string WorkerStateName(WorkerState state);  // "ALIVE", "DEAD"
std::string ActorStateName(ActorState state);    // "PENDING_CREATION", "ALIVE", "DEAD"
std::string DeviceKindName(DeviceKind kind);     // "cpu", "cuda", "emulated"
const char* JobStateName(JobState state);        // "PENDING", "RUNNING", ...
// Whether a job in `state` has ended for good (SUCCEEDED, FAILED, CANCELLED).
bool IsTerminal(JobState state);

// The body of every service's Ping and PingStream (after the token check): echo the payload unless
// the request asks for no echo (one-way bandwidth probes).
void EchoPing(const PingRequest& request, PingReply* reply);
void EchoPingStream(grpc::ServerReaderWriter<PingReply, PingRequest>* stream);

}  // namespace geotrain
