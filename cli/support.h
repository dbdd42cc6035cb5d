// What every `geotrain` verb shares: how it reports an error, how it reaches the head, and how it writes
// figures into JSON. A verb's callback that calls the head:
//
//   std::optional<HeadClient> client = ConnectOrFail(*flags, context);  // flags: a HeadFlags (flags.h)
//   if (!client) return;
//   grpc::ClientContext ctx;
//   v1::ListJobsReply reply;
//   if (!RpcSucceeded(client->jobs->ListJobs(client->Prepare(&ctx), v1::ListJobsRequest(), &reply), *client,
//                     context)) {
//     return;
//   }
//
// The CLI talks to the head through the public API only (proto/geotrain/v1, docs/api.md).
// Thread safety: Fail writes to stderr; a HeadClient is used by one thread at a time (its stubs are
// thread-safe, as gRPC stubs are).
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cli/flags.h"
#include "cli/registry.h"
#include "common/json.h"  // JsonFigure, DumpJson: the --json output
#include "common/rpc.h"
#include "geotrain/v1/cluster.grpc.pb.h"
#include "geotrain/v1/jobs.grpc.pb.h"
#include "geotrain/v1/planner.grpc.pb.h"
#include "spec.pb.h"

namespace geotrain::cli {

// Prints "geotrain: <message>" to stderr and returns the verb's exit code for it: 3 when the head refused
// the token (UNAUTHENTICATED), 1 otherwise.
int Fail(const absl::Status& status);

// Stubs of the public services on one channel to the head, and the endpoint (address, token) it was resolved to.
struct HeadClient {
  std::unique_ptr<v1::Jobs::Stub> jobs;
  std::unique_ptr<v1::Cluster::Stub> cluster;
  std::unique_ptr<v1::Planner::Stub> planner;
  HeadEndpoint endpoint;
  // Attaches the token and, when deadline_ms > 0, a deadline; returns ctx.
  grpc::ClientContext* Prepare(grpc::ClientContext* ctx, int64_t deadline_ms = 10000) const;
};

// Resolves the head from `head` and `token` (flags; empty: GEOTRAIN_HEAD and GEOTRAIN_TOKEN, then the
// record a head on this machine leaves, see common/rpc.h ResolveHead) and opens a channel to it (TLS when
// `tls` names a CA). Errors say which flag or variable to set.
absl::StatusOr<HeadClient> ConnectToHead(const std::string& head, const std::string& token, const TlsFiles& tls = {});

// An RPC failure in terms of what the user can do: an unreachable head (start it, or pass --head), a
// refused token, else the status as is.
absl::Status ExplainRpcFailure(const grpc::Status& status, const std::string& address);

// A verb's connection to the head named by `flags`: the token from --token/--token-file or the environment,
// the head and the TLS files as ConnectToHead and common/rpc.h resolve them. On failure it prints the error
// (Fail), sets context.exit_code and returns nullopt.
std::optional<HeadClient> ConnectOrFail(const HeadFlags& flags, Context& context);

// True when `status`, the answer of an RPC `client` made, is OK; else it prints the failure as
// ExplainRpcFailure says it (Fail), sets context.exit_code and returns false.
bool RpcSucceeded(const grpc::Status& status, const HeadClient& client, Context& context);

// The --emulate-device arguments of a topology worker's devices, NAME:TFLOPS:MEM_GB each (count of them): what
// `cluster up` starts the worker with and what `plan` registers for it, so that both see the same devices.
std::vector<std::string> TopologyWorkerDevices(const TopologyWorker& worker);

}  // namespace geotrain::cli
